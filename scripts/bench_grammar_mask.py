"""The per-step cost of constrained decoding (`kvjax/engine/grammar.py`, llguidance) on
SmolLM2-135M-Instruct's 49,152-token vocabulary, side by side with free sampling.

Two parts, each in interleaved rounds (`benchlib.interleaved_rounds`):

1. host: one decode step's host work per sampled token, driven by random f32[V] logits through a
   JSON schema (a constraint restarts when its JSON is complete): "free" is `sample_token`;
   "masked" is `Constraint.allowed()` (the bool[V] mask), `sample_token` with it, and
   `Constraint.accept`. Their difference is what a constrained token adds to the host's share
   of a step; in the engine the mask is computed while the device runs the step
   (`Engine._execute_ragged`), so it costs a step only when it takes longer than the device.
2. engine (`--engine`, default on): the real model, greedy, one request at a time: seconds per
   output token after the first, free vs. `response_format`-style json_schema, and the outputs
   checked (the masked ones must parse and validate; the script exits non-zero otherwise).

    .venv/bin/python scripts/bench_grammar_mask.py
    .venv/bin/python scripts/bench_grammar_mask.py --steps=2000 --rounds=5 --noengine

Writes <out_dir>/bench_grammar_mask.json (`benchlib.provenance()`, per-setting `summarize` of
seconds per step with each round's `CpuClock` share). Seconds from a loaded shared machine are
noisy; the medians over rounds are what to read.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model (its tokenizer).")
_STEPS = flags.DEFINE_integer("steps", 1000, "Host part: sampled tokens per round and setting.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
_ENGINE = flags.DEFINE_bool("engine", True, "Also time the real engine's decode steps.")
_ENGINE_TOKENS = flags.DEFINE_integer("engine_tokens", 48, "Engine part: output tokens.")
_OUT = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def host_round(setting: str, grammars, spec, vocab: int, steps: int, seed: int) -> dict:
  """Seconds per sampled token of one setting over `steps` tokens."""
  from kvjax import SamplingParams  # noqa: PLC0415
  from kvjax.engine import sampling  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(64, vocab)).astype(np.float32)  # reused rows: no RNG in the span
  params = SamplingParams(temperature=1.0)
  constraint = grammars.constraint(spec) if setting == "masked" else None
  clock = benchlib.CpuClock()
  t0 = time.perf_counter()
  for i in range(steps):
    allowed = constraint.allowed() if constraint is not None else None
    token = sampling.sample_token(logits[i % 64], params, rng, allowed)
    if constraint is not None:
      constraint.accept(token)
      if constraint.done:
        constraint = grammars.constraint(spec)
  return {"s_per_step": (time.perf_counter() - t0) / steps, **clock.read()}


def engine_round(setting: str, llm, spec, tokens: int) -> dict:
  """Seconds per output token after the first, and the output, of one greedy request."""
  from kvjax import SamplingParams  # noqa: PLC0415
  params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=setting == "free",
                          structured=spec if setting == "masked" else None)
  msgs = [{"role": "user", "content": "Describe a person as JSON with name, age and tags."}]
  clock = benchlib.CpuClock()
  out = llm.chat(msgs, params)[0]
  m = out.metrics
  n = len(out.token_ids)
  return {"s_per_token": (m.finished_s - m.first_token_s) / max(1, n - 1), "tokens": n,
          "text": out.text, "finish_reason": out.finish_reason, **clock.read()}


def main(argv):
  del argv
  record = {**benchlib.provenance(("jax", "numpy", "llguidance")),
            "machine_note": "a shared, loaded 2-core CPU machine unless the machine says "
                            "otherwise: seconds are noisy", "schema": SCHEMA}
  from kvjax.engine import grammar  # noqa: PLC0415
  from kvjax.models.loading import registry  # noqa: PLC0415
  from kvjax.scheduler.request import StructuredOutput  # noqa: PLC0415
  spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
  tokenizer = registry.load_model(_MODEL.value).tokenizer
  vocab = tokenizer.vocab_size
  grammars = grammar.Grammars(tokenizer, vocab)
  t0 = time.perf_counter()
  grammars.constraint(spec)  # builds the token table once
  record["token_table_build_s"] = time.perf_counter() - t0
  settings = ["free", "masked"]
  host = {s: [] for s in settings}
  for r, order in enumerate(benchlib.interleaved_rounds(settings, _ROUNDS.value)):
    for s in order:
      host[s].append(host_round(s, grammars, spec, vocab, _STEPS.value, seed=r))
  record["host"] = {s: {"s_per_step": benchlib.summarize([x["s_per_step"] for x in v]),
                        "cpu_share": [x["cpu_share"] for x in v]} for s, v in host.items()}
  free = record["host"]["free"]["s_per_step"]["median"]
  masked = record["host"]["masked"]["s_per_step"]["median"]
  record["host"]["mask_s_per_step"] = masked - free
  print(f"host, per sampled token (V={vocab}): free {free * 1e6:.1f} us, masked "
        f"{masked * 1e6:.1f} us, the mask adds {(masked - free) * 1e6:.1f} us")
  failed = []
  if _ENGINE.value:
    from kvjax import LLM  # noqa: PLC0415
    import jsonschema  # noqa: PLC0415
    llm = LLM(_MODEL.value, startup_progress=None)
    engine = {s: [] for s in settings}
    for order in benchlib.interleaved_rounds(settings, _ROUNDS.value):
      for s in order:
        engine[s].append(engine_round(s, llm, spec, _ENGINE_TOKENS.value))
    llm.close()
    for x in engine["masked"]:
      try:
        jsonschema.validate(json.loads(x["text"]), SCHEMA)
      except (ValueError, jsonschema.ValidationError) as e:
        failed.append(f"masked output not valid: {x['text']!r}: {e}")
    record["engine"] = {s: {"s_per_token": benchlib.summarize([x["s_per_token"] for x in v]),
                            "runs": v} for s, v in engine.items()}
    ef = record["engine"]["free"]["s_per_token"]["median"]
    em = record["engine"]["masked"]["s_per_token"]["median"]
    record["engine"]["masked_over_free"] = em / ef
    print(f"engine, per output token: free {ef * 1e3:.2f} ms, masked {em * 1e3:.2f} ms "
          f"({em / ef:.3f}x)")
  record["failed"] = failed
  benchlib.write_json(pathlib.Path(_OUT.value) / "bench_grammar_mask.json", record)
  for f in failed:
    print("FAILED:", f, file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  app.run(main)
