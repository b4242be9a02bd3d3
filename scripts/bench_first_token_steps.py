"""Short first-token steps (`SchedulerConfig.short_first_token_steps`) on real
SmolLM2-135M-Instruct, f32, offline: a store hit's TTFT when it arrives during another request's
cold chunked prefill, with the option on and off, side by side in one process.

Per trial (a different book passage each; a first one per setting is a warm-up, not recorded):
  1. turn 1: an N-token history is prefilled and its KV saved to a host tier over a disk tier
     (the device prefix cache is off, so turn 2 is served by the store: a Cake merge whose
     loads come from the host tier);
  2. a cold prompt of N other tokens is added; after `--lead_steps` engine steps (its first
     512-token chunks), turn 2 (turn 1's prompt and reply plus M new tokens) is added;
  3. both run to the end, greedy. Recorded: each one's TTFT and prefill seconds, the steps and
     the tokens of each step while turn 2 prefilled, and the generated tokens.

With `--scenario=decodes` (rule c, a step waiting for a hit's loads), step 2 differs:
`--decoders` short cold prompts are added and decode; once each has its first tokens, turn 2 is
added. Recorded besides: the decoders' longest gap between two tokens while turn 2 prefilled
(what the waiting step costs them) and their mean time per output token.

Both settings run every trial in turn (on, then off, alternating which goes first: interleaved
rounds of two settings, `benchlib.interleaved_rounds`), each with its own engine and store; a
figure is the median over trials, with its spread and each run's CPU share in `summary`. The texts must be equal across settings (a different answer to an
identical request would be a bug); the script exits non-zero when they are not.

    .venv/bin/python scripts/bench_first_token_steps.py
    .venv/bin/python scripts/bench_first_token_steps.py --trials=5 --history_tokens=1780
    .venv/bin/python scripts/bench_first_token_steps.py --scenario=decodes

Writes <out_dir>/bench_first_token_steps.json (`..._decodes.json` for that scenario;
`benchlib.provenance()`, machine after, threads, settings, per-trial records, medians and
ratios) and a plot of the same name. Timings on a shared 2-core VM are noisy: medians over trials.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from absl import app, flags

import benchlib  # scripts/benchlib.py
from benchlib import machine, pyplot

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
_SCENARIO = flags.DEFINE_enum("scenario", "cold_prefill", ["cold_prefill", "decodes"],
                              "What turn 2 arrives beside: another request's cold chunked "
                              "prefill, or --decoders requests decoding.")
_DECODERS = flags.DEFINE_integer("decoders", 3, "decodes: requests decoding when turn 2 comes.")
_DECODER_PROMPT = flags.DEFINE_integer("decoder_prompt_tokens", 64,
                                       "decodes: prompt tokens of each decoder.")
_DECODER_TOKENS = flags.DEFINE_integer("decoder_max_tokens", 48,
                                       "decodes: tokens each decoder generates.")
_REPLOT = flags.DEFINE_string("replot", None, "Only redraw the plot of this results JSON "
                              "(e.g. after installing matplotlib), next to it.")
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
  return finish(llm, steps, turn1, history + list(turn1.token_ids) + new, {"cold": cold})


def trial_decodes(llm, steps: list, history: list[int], cold_ids: list[int],
                  new: list[int]) -> dict:
  """The `decodes` scenario: turn 2 arrives while `--decoders` requests (prompts cut from
  `cold_ids`) decode."""
  from kvjax import SamplingParams  # noqa: PLC0415
  greedy = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0)
  turn1 = llm.generate([{"prompt_token_ids": history}], greedy)[0]
  llm.flush()
  eng = llm.engine
  steps.clear()
  k = _DECODER_PROMPT.value
  longer = SamplingParams(max_tokens=_DECODER_TOKENS.value, temperature=0.0)
  decoders = {f"decoder{i}": eng.add_request(cold_ids[i * k:(i + 1) * k], longer)
              for i in range(_DECODERS.value)}
  tokens = dict.fromkeys(decoders.values(), 0)
  while min(tokens.values()) < 2:  # every decoder has sampled its first tokens
    for o in eng.step():
      tokens[o.request_id] = len(o.token_ids)
  return finish(llm, steps, turn1, history + list(turn1.token_ids) + new, decoders)


def finish(llm, steps: list, turn1, hit_ids: list[int], others: dict) -> dict:
  """Adds turn 2, runs every request to the end; the trial's record."""
  from kvjax import SamplingParams  # noqa: PLC0415
  eng = llm.engine
  greedy = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0)
  hit = eng.add_request(hit_ids, greedy)
  done = {}
  while eng.has_unfinished_requests():
    for o in eng.step():
      if o.finished:
        done[o.request_id] = o
  h = done[hit]
  hit_steps = [rec for rec in steps if any(x.request_id == hit for x in rec.plan.prefills)]
  out = {
      "hit_ttft_s": h.metrics.ttft_s, "hit_prefill_s": h.metrics.prefill_s,
      "hit_cached_tokens": h.num_cached_tokens, "hit_prompt_tokens": len(h.prompt_token_ids),
      "steps": [{"seconds": rec.ended_s - rec.started_s, "loads": len(rec.plan.loads),
                 "inserts": len(rec.plan.inserts),
                 "prefill_tokens": [(x.request_id == hit, x.num_tokens) for x in rec.plan.prefills],
                 "decodes": len(rec.plan.decodes)}
                for rec in steps if rec.ended_s >= h.metrics.arrival_s][:12],
      "hit_prefill_steps": len(hit_steps),
      "tokens": {"turn1": list(turn1.token_ids), "hit": list(h.token_ids),
                 **{name: list(done[rid].token_ids) for name, rid in others.items()}},
  }
  if "cold" in others:
    c = done[others["cold"]]
    out.update(cold_ttft_s=c.metrics.ttft_s, cold_prefill_s=c.metrics.prefill_s,
               cold_done_s=c.metrics.finished_s - c.metrics.arrival_s)
  else:
    # A decoder's token comes at the end of each step that decodes it: its longest gap while
    # turn 2 prefilled (arrival to first token), and the decoders' mean seconds per token.
    ends = [rec.ended_s for rec in steps if rec.plan.decodes]
    window = [e for e in ends if h.metrics.arrival_s <= e <= h.metrics.first_token_s]
    before = [e for e in ends if e < h.metrics.arrival_s][-1:]
    gaps = [b - a for a, b in zip(before + window, window + [
        next((e for e in ends if e > h.metrics.first_token_s), h.metrics.first_token_s)])]
    outs = [done[rid] for rid in others.values()]
    out.update(decode_gap_max_s=max(gaps),
               decode_s_per_token=statistics.mean(
                   (o.metrics.finished_s - o.metrics.first_token_s) / (len(o.token_ids) - 1)
                   for o in outs))
  return out


def plot(record: dict, path: pathlib.Path) -> None:
  """A run's medians as bars, the option on and off side by side (nothing without matplotlib)."""
  plt = pyplot()
  if plt is None:
    return
  st, med = record["settings"], record["medians"]
  keys = list(med["short"])
  shown = [keys[0]] + keys[2:]
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for i, (name, on) in enumerate((("short", True), ("full", False))):
    ax.bar([k + 0.38 * i for k in range(len(shown))], [med[name][k] for k in shown], 0.38,
           label=f"short_first_token_steps={on}")
  ax.set_xticks([k + 0.19 for k in range(len(shown))],
                [k.removesuffix("_s").replace("_", " ") for k in shown])
  ax.set_ylabel("seconds (median)")
  beside = (f"a cold {st['history_tokens']}-token prefill"
            if st.get("scenario", "cold_prefill") == "cold_prefill"
            else f"{st['decoders']} decoding requests")
  ax.set_title(f"store hit beside {beside} ({st['trials']} trials)", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  if _REPLOT.value:  # only redraw a results file's plot
    path = pathlib.Path(_REPLOT.value)
    plot(json.loads(path.read_text(encoding="utf-8")), path.with_suffix(".png"))
    return
  from kvjax.models.loading.registry import load_model  # noqa: PLC0415
  prov = benchlib.provenance(("kvjax", "jax", "jaxlib", "numpy", "tokenizers", "matplotlib",
                               "absl-py"))
  tok = load_model(_MODEL.value).tokenizer
  # One more passage for a warm-up trial per setting, not recorded: the engines compile, and
  # their cost models learn the host tier's link from a first hit, as a running server's have
  # (before any load the prior is 1 GB/s, which a host tier on this VM beats several times).
  warmup, *parts = passages(tok, _TRIALS.value + 1, _N.value, _M.value)
  run = trial if _SCENARIO.value == "cold_prefill" else trial_decodes
  settings = {"short": True, "full": False}
  keys = ("hit_ttft_s", "hit_prefill_s") + (
      ("cold_ttft_s", "cold_done_s") if _SCENARIO.value == "cold_prefill"
      else ("decode_gap_max_s", "decode_s_per_token"))
  with tempfile.TemporaryDirectory() as work:
    llms = {name: make_llm(on, os.path.join(work, name)) for name, on in settings.items()}
    sinks = {name: [] for name in settings}
    for name, llm in llms.items():
      llm.engine.add_step_observer(sinks[name].append)
    for name, llm in llms.items():
      run(llm, sinks[name], *warmup)
    runs = {name: [] for name in settings}
    orders = benchlib.interleaved_rounds(list(settings), len(parts))
    for t, (history, cold_ids, new) in enumerate(parts):
      order = orders[t]
      for name in order:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        runs[name].append(run(llms[name], sinks[name], history, cold_ids, new))
        r = runs[name][-1]
        r["cpu_share"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        print(f"trial {t} {name:5s}: hit TTFT {r['hit_ttft_s']:.2f} s "
              f"({r['hit_cached_tokens']}/{r['hit_prompt_tokens']} cached), "
              + ", ".join(f"{k} {r[k]:.3f} s" for k in keys[2:]), flush=True)
    for llm in llms.values():
      llm.close()
  same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["short"], runs["full"]))
  med = {name: {k: statistics.median(r[k] for r in rs) for k in keys}
         for name, rs in runs.items()}
  summary = {name: {k: benchlib.summarize([r[k] for r in rs]) for k in keys + ("cpu_share",)}
             for name, rs in runs.items()}
  ratios = {k: med["short"][k] / med["full"][k] for k in keys}
  print(f"\n{'median of ' + str(_TRIALS.value):14s} " + " ".join(f"{k:>18s}" for k in keys))
  for name in settings:
    print(f"{name:14s} " + " ".join(f"{med[name][k]:17.3f}s" for k in keys))
  print(f"{'short / full':14s} " + " ".join(f"{ratios[k]:17.2f}x" for k in keys))
  print(f"texts equal across settings: {same}")
  record = {**prov, "benchmark": "bench_first_token_steps", "machine_at_end": machine(),
            "threads": {"cpu_count": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", "")},
            "seeds": {"sampling": "greedy"},
            "settings": {"model": _MODEL.value, "book": pathlib.Path(_BOOK.value).name,
                         "history_tokens": _N.value, "new_tokens": _M.value,
                         "max_tokens": _MAX_TOKENS.value, "kv_chunk_size": _CHUNK.value,
                         "lead_steps": _LEAD.value, "trials": _TRIALS.value,
                         "warmup_trials": 1,
                         "scenario": _SCENARIO.value, "decoders": _DECODERS.value,
                         "decoder_prompt_tokens": _DECODER_PROMPT.value,
                         "decoder_max_tokens": _DECODER_TOKENS.value,
                         "max_num_batched_tokens": 512},
            "medians": med, "summary": summary, "ratios_short_over_full": ratios, "texts_equal": same, "runs": runs}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  stem = "bench_first_token_steps" + ("" if _SCENARIO.value == "cold_prefill" else "_decodes")
  benchlib.write_json(out / f"{stem}.json", record)
  plot(record, out / f"{stem}.png")
  print(f"wrote {out / (stem + '.json')}")
  if not same:
    sys.exit("texts differ across settings")


if __name__ == "__main__":
  app.run(main)
