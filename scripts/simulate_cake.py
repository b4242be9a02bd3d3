"""Replays measured cost curves through the Cake planner on the deterministic simulator.

Shaped like Cake's Tables 3 and 4 (arXiv 2410.03065, section 6): TTFT of kvjax (the Cake merge)
against compute-only and load-only, and against the ideal bound `min over m of max(C(m),
L(N - m))`, over sequence length x bandwidth ratio B/B* x compute share. B* is the bandwidth at
which loading a sequence's whole stored prefix takes as long as computing it with the full
budget; a compute share of s% gives the Cake request s% of each step's token budget, the rest
going to competing work (priced as short prompts at position 0).

    .venv/bin/python scripts/simulate_cake.py
    .venv/bin/python scripts/simulate_cake.py \\
        --costs benchmarks/results/archive/bench_prefill.json --out benchmarks/results

Cost curves (`--costs`, JSON), either
  {"chunk_tokens": 256, "compute_s_by_chunk": [...], "chunk_nbytes": 11796480,
   "decode_s_per_chunk": 0.0}
or a `bench_prefill.json` (its kvjax seconds per 256-token chunk). Without `--costs`: SmolLM2-135M
f32 on 2 CPU cores, 0.69 s per 256-token chunk at position 0 growing linearly to 3.40 s at 7936;
a raw f32 chunk is 30 * 2 * 256 * 3 * 64 * 4 = 11.8 MB.

The planner's cost model is warmed as an engine's is after one request (it has seen each
compiled size and one load), unless `--cold`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from absl import app, flags

import benchlib  # scripts/benchlib.py
from kvjax.scheduler import MergeMode, SchedulerConfig
from kvjax.testing.cake_sim import (ChunkCosts, LinkScript, PiecewiseConstant, SimRequest,
                                    ideal_bound, simulate, warm_cost_model)

_COSTS = flags.DEFINE_string("costs", None, "JSON of cost curves (see the module docstring).")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["2048", "4096", "6144", "8192"], "Prompt lengths.")
_RATIOS = flags.DEFINE_list("ratios", ["1/8", "1/4", "1/2", "1", "2", "4", "8"],
                            "Bandwidth ratios B/B*.")
_SHARES = flags.DEFINE_list("shares", ["12.5", "50", "87.5", "100"],
                            "Compute shares of the token budget, percent.")
_BUDGET = flags.DEFINE_integer("budget", 512, "Token budget per step.")
_SIZES = flags.DEFINE_list("chunk_sizes", ["16", "32", "64", "128", "256", "512"],
                           "Compiled prefill chunk sizes.")
_IN_FLIGHT = flags.DEFINE_integer("max_in_flight", 2, "Loads in flight per request.")
_COLD = flags.DEFINE_bool("cold", False, "Start every run with an unobserved cost model.")
_OUT = flags.DEFINE_string("out", None, "Folder for simulate_cake.json and simulate_cake.png.")

CPU_CURVE = [0.69 + (3.40 - 0.69) * j / 31 for j in range(32)]
RAW_CHUNK_BYTES = 30 * 2 * 256 * 3 * 64 * 4


def load_costs(path: str | None) -> tuple[int, list[float], int, float, str]:
  """(chunk tokens, seconds per chunk by index, stored bytes per chunk, decode s, source)."""
  if path is None:
    return 256, CPU_CURVE, RAW_CHUNK_BYTES, 0.0, "built-in SmolLM2-135M f32 2-core CPU line"
  d = json.loads(pathlib.Path(path).read_text())
  if "results" in d:  # bench_prefill.json
    return 256, list(d["results"]["256"]["kvjax_s"]), RAW_CHUNK_BYTES, 0.0, path
  try:
    return (int(d["chunk_tokens"]), [float(x) for x in d["compute_s_by_chunk"]],
            int(d["chunk_nbytes"]), float(d.get("decode_s_per_chunk", 0.0)), path)
  except (KeyError, TypeError, ValueError) as e:
    raise app.UsageError(f"{path}: not a cost-curve JSON ({e!r})") from e


def fraction(text: str) -> float:
  num, _, den = text.partition("/")
  return float(num) / float(den or 1)


def run_cell(seq_len, ratio, share_pct, chunk, costs, nbytes, b_star, sizes, budget):
  cfg = SchedulerConfig(num_slots=2, token_budget=budget, chunk_sizes=sizes)
  n_chunks = (seq_len - 1) // chunk
  link = LinkScript.constant(ratio * b_star, max_in_flight=_IN_FLIGHT.value)
  tokens = int(budget * share_pct / 100)
  script = None if tokens >= budget else PiecewiseConstant.constant(tokens)
  spec = SimRequest("r", seq_len, [True] * n_chunks, chunk_nbytes=nbytes)
  cell = {"seq_len": seq_len, "ratio": ratio, "share_pct": share_pct,
          "bandwidth_bytes_per_s": ratio * b_star, "cake_tokens_per_step": tokens}
  for mode in MergeMode:
    model = None if _COLD.value else warm_cost_model(
        costs, chunk_sizes=sizes, max_position=seq_len, bandwidth_bytes_per_s=ratio * b_star,
        nbytes=nbytes)
    sim = simulate([dataclasses.replace(spec, mode=mode)], costs=costs, link=link,
                   scheduler_config=cfg, chunk_size=chunk, cost_model=model, budget=script)
    res = sim.results["r"]
    cell[mode.value] = {"ttft_s": res.ttft_s, "meeting_index": res.meeting_index,
                        "chunks_wasted": len(res.trace.chunks_wasted),
                        "writers": res.chunk_writers, "max_step_s": sim.max_step_s}
  ideal = ideal_bound(spec, costs=costs, link=link, scheduler_config=cfg, chunk_size=chunk,
                      budget=script)
  cake = cell["cake"]["ttft_s"]
  best = min(cell["compute_only"]["ttft_s"], cell["load_only"]["ttft_s"])
  cell.update(ideal_ttft_s=ideal.ttft_s, ideal_m=ideal.best_m, speedup=best / cake,
              vs_ideal=cake / ideal.ttft_s,
              within_one_step=cake <= ideal.ttft_s + cell["cake"]["max_step_s"] + 1e-9)
  return cell


def table(cells, seq_lens, ratios, key, fmt) -> str:
  head = "seq \\ B/B*  " + " ".join(f"{r:>7}" for r in ratios)
  rows = [head]
  for n in seq_lens:
    vals = [next(c for c in cells if c["seq_len"] == n and c["ratio_text"] == r) for r in ratios]
    rows.append(f"{n:>10}  " + " ".join(f"{fmt(key(c)):>7}" for c in vals))
  return "\n".join(rows)


def main(argv):
  del argv
  prov = benchlib.provenance()
  t0 = time.perf_counter()
  chunk, curve, nbytes, decode_s, source = load_costs(_COSTS.value)
  costs = ChunkCosts.from_chunk_curve(chunk, curve, decode_chunk_s=decode_s)
  sizes = tuple(int(s) for s in _SIZES.value)
  seq_lens = [int(s) for s in _SEQ_LENS.value]
  shares = [float(s) for s in _SHARES.value]
  cells = []
  for share in shares:
    for n in seq_lens:
      n_chunks = (n - 1) // chunk
      # B*: the bandwidth at which loading the stored prefix takes its full-budget compute time.
      b_star = n_chunks * nbytes / sum(costs.compute_s(j * chunk, chunk) for j in range(n_chunks))
      for r in _RATIOS.value:
        cell = run_cell(n, fraction(r), share, chunk, costs, nbytes, b_star, sizes, _BUDGET.value)
        cell.update(ratio_text=r, b_star_bytes_per_s=b_star)
        cells.append(cell)
  wall = time.perf_counter() - t0
  print(f"Cake planner on the simulator: {source}; chunk {chunk} tokens, {nbytes / 1e6:.1f} MB; "
        f"budget {_BUDGET.value} tokens/step; {'cold' if _COLD.value else 'warm'} cost model")
  for share in shares:
    mine = [c for c in cells if c["share_pct"] == share]
    print(f"\n== compute share {share:g}% ({int(_BUDGET.value * share / 100)} of "
          f"{_BUDGET.value} tokens/step) ==")
    print("kvjax TTFT, seconds")
    print(table(mine, seq_lens, _RATIOS.value, lambda c: c["cake"]["ttft_s"], "{:.2f}".format))
    print("speedup of kvjax over the better of compute-only and load-only")
    print(table(mine, seq_lens, _RATIOS.value, lambda c: c["speedup"], "{:.2f}x".format))
    print("kvjax / ideal")
    print(table(mine, seq_lens, _RATIOS.value, lambda c: c["vs_ideal"], "{:.3f}".format))
  speedups = [c["speedup"] for c in cells]
  vs_ideal = [c["vs_ideal"] for c in cells]
  print(f"\n{len(cells)} cells: speedup min {min(speedups):.2f}x, max {max(speedups):.2f}x; "
        f"kvjax/ideal max {max(vs_ideal):.3f}; within one step of ideal: "
        f"{sum(c['within_one_step'] for c in cells)}/{len(cells)}; simulated in {wall:.1f} s")
  # No timing noise here: a cell more than 0.1% under its ideal bound means the bound is not a
  # true lower bound there (smaller differences: the bound's split of a chunk's cost).
  under = [f"{c['seq_len']}/x{c['ratio_text']}/{c['share_pct']:g}%: {c['vs_ideal']:.3f}"
           for c in cells if c["vs_ideal"] < 0.999]
  print(f"cells more than 0.1% under their ideal bound: {len(under)}"
        + (f" ({', '.join(under)})" if under else ""))
  if _OUT.value:
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    record = {**prov, "benchmark": "simulate_cake", "under_bound_cells": under,
              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "inputs": {"costs": source, "chunk_tokens": chunk, "compute_s_by_chunk": curve,
                         "chunk_nbytes": nbytes, "decode_s_per_chunk": decode_s,
                         "budget": _BUDGET.value, "chunk_sizes": sizes,
                         "max_in_flight": _IN_FLIGHT.value, "cold": _COLD.value},
              "wall_s": wall, "cells": cells}
    benchlib.write_json(out / "simulate_cake.json", record)
    wrote = plot(cells, seq_lens, _RATIOS.value, shares, out / "simulate_cake.png")
    print(f"wrote {out / 'simulate_cake.json'}" + (" and simulate_cake.png" if wrote else ""))


def plot(cells, seq_lens, ratios, shares, path) -> bool:
  """The speedup and kvjax/ideal heatmaps; False (nothing written) without matplotlib."""
  plt = benchlib.pyplot()
  if plt is None:
    return False

  fig, axes = plt.subplots(2, len(shares), figsize=(3.6 * len(shares), 6.4), squeeze=False)
  for col, share in enumerate(shares):
    for row, (key, title, cmap, lim) in enumerate((
        ("speedup", "speedup vs better baseline", "viridis", None),
        ("vs_ideal", "kvjax / ideal", "magma_r", (1.0, 1.3)))):
      grid = [[next(c[key] for c in cells if c["seq_len"] == n and c["ratio_text"] == r
                    and c["share_pct"] == share) for r in ratios] for n in seq_lens]
      ax = axes[row][col]
      im = ax.imshow(grid, cmap=cmap, aspect="auto", origin="lower",
                     vmin=lim[0] if lim else None, vmax=lim[1] if lim else None)
      for i, line in enumerate(grid):
        for j, v in enumerate(line):
          ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                  color="w" if row == 0 else "k")
      ax.set_xticks(range(len(ratios)), ratios)
      ax.set_yticks(range(len(seq_lens)), seq_lens)
      ax.set_xlabel("B / B*")
      ax.set_ylabel("sequence length")
      ax.set_title(f"{title}\ncompute share {share:g}%", fontsize=9)
      fig.colorbar(im, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


if __name__ == "__main__":
  app.run(main)
