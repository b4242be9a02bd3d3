"""Planner time per step with N requests restoring at once (the Cake planner, jointly and alone).

The simulator (`kvjax/testing/cake_sim.py`) drives the real `Scheduler` through the engine's
step loop; the loop times each step's `schedule` + `update` (`EngineCore`'s `planner_s`, wall
seconds of this process), which is all the planner costs an engine step (without the writer
map tests keep, as an engine runs it). N prompts of `--seq_len` tokens with fully stored
prefixes arrive together over a link at `--ratio` times the balance bandwidth B*, on the
built-in SmolLM2-135M 2-core cost line of
`scripts/simulate_cake.py` (`cake_sim.SMOLLM2_CPU_CHUNK_S`); the simulated clock is exact, the
planner seconds are this machine's (say which, and its load: `loadavg_before`/`loadavg_after`).

    .venv/bin/python scripts/bench_cake_planner.py --restoring 1,4,16 \\
        --out benchmarks/results/cake_planner.json
"""

from __future__ import annotations

import dataclasses
import pathlib

from absl import app, flags

import benchlib  # scripts/benchlib.py
from kvjax.scheduler import SchedulerConfig
from kvjax.testing.cake_sim import (SMOLLM2_CPU_CHUNK_S, SMOLLM2_RAW_CHUNK_BYTES, ChunkCosts,
                                    LinkScript, SimRequest, simulate, warm_cost_model)

_RESTORING = flags.DEFINE_list("restoring", ["1", "4", "16"], "Requests restoring at once.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Prompt length, tokens.")
_RATIO = flags.DEFINE_float("ratio", 1.0, "Link bandwidth over B*.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every setting.")
_OUT = flags.DEFINE_string("out", None, "Results JSON path.")

CHUNK = 256
SIZES = (16, 32, 64, 128, 256, 512)


def run(n_req: int, joint: bool) -> dict:
  """One simulated run: per-step planner seconds and the requests' TTFTs (simulated)."""
  costs = ChunkCosts.from_chunk_curve(CHUNK, SMOLLM2_CPU_CHUNK_S)
  nbytes = SMOLLM2_RAW_CHUNK_BYTES
  n_chunks = (_SEQ_LEN.value - 1) // CHUNK
  b_star = n_chunks * nbytes / sum(costs.compute_s(j * CHUNK, CHUNK) for j in range(n_chunks))
  bw = _RATIO.value * b_star
  spec = SimRequest("r", _SEQ_LEN.value, [True] * n_chunks, chunk_nbytes=nbytes)
  planner_s: list[float] = []
  sim = simulate([dataclasses.replace(spec, request_id=f"r{i}") for i in range(n_req)],
                 costs=costs, link=LinkScript.constant(bw),
                 scheduler_config=SchedulerConfig(num_slots=max(2, n_req), token_budget=512,
                                                  chunk_sizes=SIZES),
                 chunk_size=CHUNK, joint_planning=joint, check_writes=False,
                 cost_model=warm_cost_model(costs, chunk_sizes=SIZES,
                                            max_position=_SEQ_LEN.value,
                                            bandwidth_bytes_per_s=bw, nbytes=nbytes),
                 observe=lambda rec: planner_s.append(rec.planner_s))
  ttft = [sim.results[f"r{i}"].ttft_s for i in range(n_req)]
  return {"steps": len(planner_s), "planner_s": benchlib.summarize(planner_s),
          "planner_max_s": max(planner_s), "mean_ttft_sim_s": sum(ttft) / n_req}


def main(argv):
  del argv
  record = {**benchlib.provenance(), "benchmark": "bench_cake_planner",
            "inputs": {"seq_len": _SEQ_LEN.value, "ratio": _RATIO.value,
                       "rounds": _ROUNDS.value, "chunk_tokens": CHUNK, "chunk_sizes": SIZES,
                       "cost_line": "kvjax/testing/cake_sim.py SMOLLM2_CPU_CHUNK_S"}}
  settings = [f"{n}/{'joint' if j else 'alone'}" for n in (int(x) for x in _RESTORING.value)
              for j in (True, False) if n > 1 or j]
  runs: dict[str, list[dict]] = {s: [] for s in settings}
  for order in benchlib.interleaved_rounds(settings, _ROUNDS.value):
    for setting in order:
      n, mode = setting.split("/")
      runs[setting].append(run(int(n), mode == "joint"))
  results = {}
  print(f"planner seconds per step (schedule + update), {_SEQ_LEN.value} tokens at "
        f"{_RATIO.value:g} B*, median over the steps of each run, {_ROUNDS.value} rounds")
  for s in settings:
    medians = [r["planner_s"]["median"] for r in runs[s]]
    results[s] = {"per_step_median_s": benchlib.summarize(medians),
                  "per_step_max_s": max(r["planner_max_s"] for r in runs[s]),
                  "steps": runs[s][0]["steps"], "mean_ttft_sim_s": runs[s][0]["mean_ttft_sim_s"],
                  "runs": runs[s]}
    print(f"  {s:>10}: median {results[s]['per_step_median_s']['median'] * 1e3:.3f} ms/step "
          f"(max {results[s]['per_step_max_s'] * 1e3:.2f} ms; {results[s]['steps']} steps; "
          f"simulated mean TTFT {results[s]['mean_ttft_sim_s']:.2f} s)")
  record["results"] = results
  if _OUT.value:
    benchlib.write_json(pathlib.Path(_OUT.value), record)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
