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

`--restoring 1,4` also runs N prompts of the cell's length with stored prefixes arriving
together, sharing the link and each step's budget: kvjax planning them jointly (the default,
`kvjax/scheduler/cake_joint.py`) and each alone (`LoadConfig.joint_planning=False`), against
compute-only and load-only (jointly planned too), by mean TTFT over the N (per-request TTFTs
beside). The ideal bound there is the mean of each request's bound alone, a true but loose
lower bound (sharing can only slow a request).

`--layer_split auto` also runs kvjax with the layer axis of Cake (CacheFlow, arXiv 2604.25080;
`kvjax/scheduler/layer_split.py`: the meeting chunk computes layers [0, k) and loads [k, L))
beside token-only Cake in every cell (`cake_split`), and prints its speedup and its ratio to
token-only (`split_vs_token`, token-only TTFT over the split's). `--num_layers` is L (30, the
SmolLM2-135M of the built-in curve); `--layer_split_groups` G > 0 allows k only at the
boundaries of G layer groups (the real runner's layer-wise step), 0 at any layer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from absl import app, flags

import benchlib  # scripts/benchlib.py
from kvjax.models.runner.runner_api import layer_groups
from kvjax.scheduler import MergeMode, SchedulerConfig
from kvjax.testing.cake_sim import (SMOLLM2_CPU_CHUNK_S, SMOLLM2_RAW_CHUNK_BYTES, ChunkCosts,
                                    LinkScript, PiecewiseConstant, SimRequest, ideal_bound,
                                    simulate, warm_cost_model)

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
_OUT = flags.DEFINE_string("out", None, "Folder for simulate_cake.json and simulate_cake.png "
                           "(simulate_cake_layer_split.* with --layer_split auto).")
_RESTORING = flags.DEFINE_list("restoring", ["1"],
                               "Prompts restoring at once (N per cell; 1: today's grid).")
_LAYER_SPLIT = flags.DEFINE_enum("layer_split", "off", ["off", "auto"],
                                 "auto: also run kvjax with the layer axis (cake_split).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 30, "L, the model's layers (layer axis).")
_SPLIT_GROUPS = flags.DEFINE_integer("layer_split_groups", 0,
                                     "k only at the boundaries of this many layer groups; "
                                     "0: at any layer.")

CPU_CURVE = list(SMOLLM2_CPU_CHUNK_S)
RAW_CHUNK_BYTES = SMOLLM2_RAW_CHUNK_BYTES


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


def run_cell(seq_len, ratio, share_pct, chunk, costs, nbytes, b_star, sizes, budget,
             n_req=1, split_points=()):
  """One cell: kvjax and both baselines for `n_req` prompts of `seq_len` tokens arriving
  together (mean TTFT over them), and kvjax planning them each alone when `n_req` > 1."""
  cfg = SchedulerConfig(num_slots=max(2, n_req), token_budget=budget, chunk_sizes=sizes)
  n_chunks = (seq_len - 1) // chunk
  link = LinkScript.constant(ratio * b_star, max_in_flight=_IN_FLIGHT.value)
  tokens = int(budget * share_pct / 100)
  script = None if tokens >= budget else PiecewiseConstant.constant(tokens)
  ids = ["r"] if n_req == 1 else [f"r{i}" for i in range(n_req)]
  spec = SimRequest("r", seq_len, [True] * n_chunks, chunk_nbytes=nbytes)
  cell = {"seq_len": seq_len, "ratio": ratio, "share_pct": share_pct, "restoring": n_req,
          "bandwidth_bytes_per_s": ratio * b_star, "cake_tokens_per_step": tokens}
  runs = [(mode.value, mode, True, ()) for mode in MergeMode]
  if n_req > 1:
    runs.append(("cake_alone", MergeMode.CAKE, False, ()))
  if split_points:
    runs.append(("cake_split", MergeMode.CAKE, True, split_points))
  for name, mode, joint, points in runs:
    model = None if _COLD.value else warm_cost_model(
        costs, chunk_sizes=sizes, max_position=seq_len, bandwidth_bytes_per_s=ratio * b_star,
        nbytes=nbytes)
    sim = simulate([dataclasses.replace(spec, request_id=rid, mode=mode) for rid in ids],
                   costs=costs, link=link, scheduler_config=cfg, chunk_size=chunk,
                   cost_model=model, budget=script, joint_planning=joint,
                   num_layers=_NUM_LAYERS.value, layer_split_points=points)
    res = [sim.results[rid] for rid in ids]
    cell[name] = {"ttft_s": sum(r.ttft_s for r in res) / n_req,
                  "meeting_index": res[0].meeting_index,
                  "chunks_wasted": sum(len(r.trace.chunks_wasted) for r in res),
                  "writers": res[0].chunk_writers, "max_step_s": sim.max_step_s,
                  "layer_splits": {str(j): k for j, k in res[0].trace.layer_splits.items()}}
    if n_req > 1:
      cell[name].update(ttft_per_request_s=[r.ttft_s for r in res],
                        meeting_per_request=[r.meeting_index for r in res],
                        writers_per_request=[r.chunk_writers for r in res])
  ideal = ideal_bound(spec, costs=costs, link=link, scheduler_config=cfg, chunk_size=chunk,
                      budget=script)
  cake = cell["cake"]["ttft_s"]
  best = min(cell["compute_only"]["ttft_s"], cell["load_only"]["ttft_s"])
  cell.update(ideal_ttft_s=ideal.ttft_s, ideal_m=ideal.best_m, speedup=best / cake,
              vs_ideal=cake / ideal.ttft_s,
              within_one_step=cake <= ideal.ttft_s + cell["cake"]["max_step_s"] + 1e-9)
  if n_req > 1:
    cell.update(joint_vs_alone=cell["cake_alone"]["ttft_s"] / cake,
                alone_speedup=best / cell["cake_alone"]["ttft_s"])
  if split_points:
    split = cell["cake_split"]["ttft_s"]
    cell.update(split_speedup=best / split, split_vs_token=cake / split,
                split_vs_ideal=split / ideal.ttft_s)
  return cell


def split_points() -> tuple[int, ...]:
  """The k the layer axis may take (`--layer_split`, `--layer_split_groups`)."""
  if _LAYER_SPLIT.value == "off":
    return ()
  n = _NUM_LAYERS.value
  if _SPLIT_GROUPS.value:
    return tuple(l0 for l0, _ in layer_groups(n, _SPLIT_GROUPS.value)[1:])
  return tuple(range(1, n))


def table(cells, seq_lens, ratios, key, fmt, restoring=1) -> str:
  head = "seq \\ B/B*  " + " ".join(f"{r:>7}" for r in ratios)
  rows = [head]
  for n in seq_lens:
    vals = [next(c for c in cells if c["seq_len"] == n and c["ratio_text"] == r
                 and c["restoring"] == restoring) for r in ratios]
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
  restoring = [int(x) for x in _RESTORING.value]
  if any(x < 1 for x in restoring):
    raise app.UsageError(f"--restoring={_RESTORING.value}: each N must be >= 1")
  points = split_points()
  cells = []
  for n_req in restoring:
    for share in shares:
      for n in seq_lens:
        n_chunks = (n - 1) // chunk
        # B*: the bandwidth at which loading the stored prefix takes its full-budget compute
        # time (one prompt's; N prompts share it).
        b_star = n_chunks * nbytes / sum(costs.compute_s(j * chunk, chunk)
                                         for j in range(n_chunks))
        for r in _RATIOS.value:
          cell = run_cell(n, fraction(r), share, chunk, costs, nbytes, b_star, sizes,
                          _BUDGET.value, n_req, points)
          cell.update(ratio_text=r, b_star_bytes_per_s=b_star)
          cells.append(cell)
  wall = time.perf_counter() - t0
  print(f"Cake planner on the simulator: {source}; chunk {chunk} tokens, {nbytes / 1e6:.1f} MB; "
        f"budget {_BUDGET.value} tokens/step; {'cold' if _COLD.value else 'warm'} cost model")
  for n_req in restoring:
    for share in shares:
      mine = [c for c in cells if c["share_pct"] == share and c["restoring"] == n_req]
      print(f"\n== {n_req} restoring, compute share {share:g}% ({int(_BUDGET.value * share / 100)}"
            f" of {_BUDGET.value} tokens/step) ==")
      print("kvjax TTFT" + (" (mean over the N)" if n_req > 1 else "") + ", seconds")
      print(table(mine, seq_lens, _RATIOS.value, lambda c: c["cake"]["ttft_s"],
                  "{:.2f}".format, n_req))
      print("speedup of kvjax over the better of compute-only and load-only")
      print(table(mine, seq_lens, _RATIOS.value, lambda c: c["speedup"], "{:.2f}x".format,
                  n_req))
      if n_req > 1:
        print("each planned alone: speedup over the better baseline")
        print(table(mine, seq_lens, _RATIOS.value, lambda c: c["alone_speedup"],
                    "{:.2f}x".format, n_req))
      print("kvjax / ideal" + (" (the mean of each one's bound alone)" if n_req > 1 else ""))
      print(table(mine, seq_lens, _RATIOS.value, lambda c: c["vs_ideal"], "{:.3f}".format,
                  n_req))
      if points:
        print("layer split: speedup over the better baseline")
        print(table(mine, seq_lens, _RATIOS.value, lambda c: c["split_speedup"],
                    "{:.2f}x".format, n_req))
        print("layer split vs token-only (token-only TTFT / split TTFT)")
        print(table(mine, seq_lens, _RATIOS.value, lambda c: c["split_vs_token"],
                    "{:.3f}".format, n_req))
  speedups = [c["speedup"] for c in cells]
  vs_ideal = [c["vs_ideal"] for c in cells]
  print(f"\n{len(cells)} cells: speedup min {min(speedups):.2f}x, max {max(speedups):.2f}x; "
        f"kvjax/ideal max {max(vs_ideal):.3f}; within one step of ideal: "
        f"{sum(c['within_one_step'] for c in cells)}/{len(cells)}; simulated in {wall:.1f} s")
  # No timing noise here: a cell more than 0.1% under its ideal bound means the bound is not a
  # true lower bound there (smaller differences: the bound's split of a chunk's cost).
  for n_req in restoring:
    mine = [c["speedup"] for c in cells if c["restoring"] == n_req]
    line = f"N={n_req}: worst cell {min(mine):.2f}x the better baseline"
    if n_req > 1:
      alone = [c["alone_speedup"] for c in cells if c["restoring"] == n_req]
      gain = [c["joint_vs_alone"] for c in cells if c["restoring"] == n_req]
      line += (f" (planned alone: {min(alone):.2f}x); joint / alone mean TTFT gain "
               f"{min(gain):.2f}x-{max(gain):.2f}x")
    if points:
      mine_cells = [c for c in cells if c["restoring"] == n_req]
      ratio = [c["split_vs_token"] for c in mine_cells]
      at_b = [c["split_vs_token"] for c in mine_cells if c["ratio"] == 1.0]
      line += (f"; layer split vs token-only {min(ratio):.3f}-{max(ratio):.3f}"
               + (f" (at B*: {min(at_b):.3f}-{max(at_b):.3f})" if at_b else ""))
    print(line)
  under = [f"{c['seq_len']}/x{c['ratio_text']}/{c['share_pct']:g}%/N{c['restoring']}: "
           f"{c['vs_ideal']:.3f}" for c in cells if c["vs_ideal"] < 0.999]
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
                         "max_in_flight": _IN_FLIGHT.value, "cold": _COLD.value,
                         "restoring": restoring, "layer_split": _LAYER_SPLIT.value,
                         "num_layers": _NUM_LAYERS.value, "layer_split_points": points},
              "wall_s": wall, "cells": cells}
    stem = "simulate_cake_layer_split" if points else "simulate_cake"
    benchlib.write_json(out / f"{stem}.json", record)
    pngs = []
    for n_req in restoring:
      name = f"{stem}.png" if n_req == 1 else f"{stem}_n{n_req}.png"
      if plot([c for c in cells if c["restoring"] == n_req], seq_lens, _RATIOS.value, shares,
              out / name):
        pngs.append(name)
    print(f"wrote {out / (stem + '.json')}" + (f" and {', '.join(pngs)}" if pngs else ""))


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
