"""Short first-token steps (`SchedulerConfig.short_first_token_steps`) on real
SmolLM2-135M-Instruct, f32, offline: a store hit's TTFT when it arrives during another request's
cold chunked prefill, with the option on and off, side by side in one process.

Per trial (a different book passage each):
  1. turn 1: an N-token history is prefilled and its KV saved to a host tier over a disk tier
     (the device prefix cache is off, so turn 2 is served by the store: a Cake merge whose
     loads come from the host tier);
  2. a cold prompt of N other tokens is added; after `--lead_steps` engine steps (its first
     512-token chunks), turn 2 (turn 1's prompt and reply plus M new tokens) is added;
  3. both run to the end, greedy. Recorded: each one's TTFT and prefill seconds, the steps and
     the tokens of each step while turn 2 prefilled, and the generated tokens.

Both settings run every trial in turn (on, then off, alternating which goes first), each with
its own engine and store. The texts must be equal across settings (a different answer to an
identical request would be a bug); the script exits non-zero when they are not.

    .venv/bin/python scripts/bench_first_token_steps.py
    .venv/bin/python scripts/bench_first_token_steps.py --trials=5 --history_tokens=1780

Writes <out_dir>/bench_first_token_steps.json (machine and load average before and after,
versions, threads, git SHA, settings, per-trial records, medians and ratios) and
bench_first_token_steps.png. Timings on a shared 2-core VM are noisy: medians over trials.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile

from absl import app, flags

from benchlib import git_sha, machine, pyplot, versions  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model.")
_BOOK = flags.DEFINE_string(
    "book", str(REPO.parent / "shared/data/books/pg11_alice_in_wonderland_carroll.txt"),
    "Text the histories, cold prompts and new tokens are cut from.")
_N = flags.DEFINE_integer("history_tokens", 1780, "N: history and cold-prompt tokens.")
_M = flags.DEFINE_integer("new_tokens", 26, "M: turn 2's new tokens.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Generated tokens per request.")
_CHUNK = flags.DEFINE_integer("kv_chunk_size", 64, "Store chunk size.")
_LEAD = flags.DEFINE_integer("lead_steps", 2, "Steps of the cold prompt before turn 2 arrives.")
_TRIALS = flags.DEFINE_integer("trials", 3, "Trials (book passages) per setting.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")


def make_llm(short: bool, store_dir: str):
  from kvjax import LLM  # noqa: PLC0415
  from kvjax.storage import StoreConfig, TierConfig  # noqa: PLC0415
  store = StoreConfig((TierConfig("host", capacity_bytes=2 << 30),
                       TierConfig("disk", url=f"file://{store_dir}")))
  return LLM(_MODEL.value, dtype="float32", max_num_seqs=8, kv_store=store,
             kv_chunk_size=_CHUNK.value, enable_prefix_caching=False,
             short_first_token_steps=short)


def passages(tok, trials: int, n: int, m: int) -> list[tuple[list[int], list[int], list[int]]]:
  """Per trial: (history, cold prompt, new tokens), cut from consecutive parts of the book."""
  ids = tok.encode(pathlib.Path(_BOOK.value).read_text(encoding="utf-8"),
                   add_special_tokens=False)
  per = 2 * n + m
  if len(ids) < trials * per:
    raise ValueError(f"{_BOOK.value} has {len(ids)} tokens; {trials} trials need {trials * per}")
  out = []
  for t in range(trials):
    part = ids[t * per:(t + 1) * per]
    out.append((part[:n], part[n:2 * n], part[2 * n:]))
  return out


def trial(llm, steps: list, history: list[int], cold_ids: list[int], new: list[int]) -> dict:
  """One trial on `llm`, whose step observer appends every `StepRecord` to `steps`."""
  from kvjax import SamplingParams  # noqa: PLC0415
  greedy = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0)
  turn1 = llm.generate([{"prompt_token_ids": history}], greedy)[0]
  llm.flush()  # turn 1's chunks are in the store
  eng = llm.engine
  steps.clear()
  cold = eng.add_request(cold_ids, greedy)
  for _ in range(_LEAD.value):
    eng.step()
  hit = eng.add_request(history + list(turn1.token_ids) + new, greedy)
  done = {}
  while eng.has_unfinished_requests():
    for o in eng.step():
      if o.finished:
        done[o.request_id] = o
  h, c = done[hit], done[cold]
  hit_steps = [rec for rec in steps if any(x.request_id == hit for x in rec.plan.prefills)]
  return {
      "hit_ttft_s": h.metrics.ttft_s, "hit_prefill_s": h.metrics.prefill_s,
      "hit_cached_tokens": h.num_cached_tokens, "hit_prompt_tokens": len(h.prompt_token_ids),
      "cold_ttft_s": c.metrics.ttft_s, "cold_prefill_s": c.metrics.prefill_s,
      "cold_done_s": c.metrics.finished_s - c.metrics.arrival_s,
      "steps": [{"seconds": rec.ended_s - rec.started_s, "loads": len(rec.plan.loads),
                 "inserts": len(rec.plan.inserts),
                 "prefill_tokens": [(x.request_id == hit, x.num_tokens) for x in rec.plan.prefills],
                 "decodes": len(rec.plan.decodes)} for rec in steps[:12]],
      "hit_prefill_steps": len(hit_steps),
      "tokens": {"turn1": list(turn1.token_ids), "hit": list(h.token_ids),
                 "cold": list(c.token_ids)},
  }


def main(argv):
  del argv
  from kvjax.models.registry import load_model  # noqa: PLC0415
  sha, before = git_sha(), machine()
  tok = load_model(_MODEL.value).tokenizer
  parts = passages(tok, _TRIALS.value, _N.value, _M.value)
  settings = {"short": True, "full": False}
  with tempfile.TemporaryDirectory() as work:
    llms = {name: make_llm(on, os.path.join(work, name)) for name, on in settings.items()}
    sinks = {name: [] for name in settings}
    for name, llm in llms.items():
      llm.engine.add_step_observer(sinks[name].append)
    runs = {name: [] for name in settings}
    for t, (history, cold_ids, new) in enumerate(parts):
      order = list(settings) if t % 2 == 0 else list(reversed(settings))
      for name in order:
        runs[name].append(trial(llms[name], sinks[name], history, cold_ids, new))
        r = runs[name][-1]
        print(f"trial {t} {name:5s}: hit TTFT {r['hit_ttft_s']:.2f} s "
              f"({r['hit_cached_tokens']}/{r['hit_prompt_tokens']} cached), cold TTFT "
              f"{r['cold_ttft_s']:.2f} s, cold done {r['cold_done_s']:.2f} s", flush=True)
    for llm in llms.values():
      llm.close()
  same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["short"], runs["full"]))
  med = {name: {k: statistics.median(r[k] for r in rs)
                for k in ("hit_ttft_s", "hit_prefill_s", "cold_ttft_s", "cold_done_s")}
         for name, rs in runs.items()}
  ratios = {k: med["short"][k] / med["full"][k] for k in med["short"]}
  print(f"\n{'median of ' + str(_TRIALS.value):14s} {'hit TTFT':>9s} {'hit prefill':>12s} "
        f"{'cold TTFT':>10s} {'cold done':>10s}")
  for name in settings:
    m = med[name]
    print(f"{name:14s} {m['hit_ttft_s']:8.2f}s {m['hit_prefill_s']:11.2f}s "
          f"{m['cold_ttft_s']:9.2f}s {m['cold_done_s']:9.2f}s")
  print(f"{'short / full':14s} {ratios['hit_ttft_s']:8.2f}x {ratios['hit_prefill_s']:11.2f}x "
        f"{ratios['cold_ttft_s']:9.2f}x {ratios['cold_done_s']:9.2f}x")
  print(f"texts equal across settings: {same}")
  record = {"benchmark": "bench_first_token_steps", "machine": before,
            "machine_at_end": machine(),
            "threads": {"cpu_count": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", "")},
            "versions": versions("kvjax", "jax", "tokenizers", "matplotlib", "absl-py"),
            "git_sha": sha, "seeds": {"sampling": "greedy"},
            "settings": {"model": _MODEL.value, "book": pathlib.Path(_BOOK.value).name,
                         "history_tokens": _N.value, "new_tokens": _M.value,
                         "max_tokens": _MAX_TOKENS.value, "kv_chunk_size": _CHUNK.value,
                         "lead_steps": _LEAD.value, "trials": _TRIALS.value,
                         "max_num_batched_tokens": 512},
            "medians": med, "ratios_short_over_full": ratios, "texts_equal": same, "runs": runs}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench_first_token_steps.json").write_text(json.dumps(record, indent=1))
  plt = pyplot()
  if plt is not None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    keys = ("hit_ttft_s", "cold_ttft_s", "cold_done_s")
    labels = ("hit TTFT", "cold TTFT", "cold done")
    for i, name in enumerate(settings):
      ax.bar([k + 0.38 * i for k in range(len(keys))], [med[name][k] for k in keys], 0.38,
             label=f"short_first_token_steps={settings[name]}")
    ax.set_xticks([k + 0.19 for k in range(len(keys))], labels)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"store hit beside a cold {_N.value}-token prefill ({_TRIALS.value} trials)",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "bench_first_token_steps.png", dpi=120)
  print(f"wrote {out / 'bench_first_token_steps.json'}")
  if not same:
    sys.exit("texts differ across settings")


if __name__ == "__main__":
  app.run(main)
