"""The paged KV layout (issue 11) on real SmolLM2-135M-Instruct, offline: batched decode and the
device prefix cache.

  decode   N sequences decoding together (paged, one ragged jit step per engine step): output
           tokens/s over steps where all N are decoding (after every prefill is done), for each
           N in --decode_seqs, in --rounds interleaved rounds (median, spread, CPU share per
           run); the ratio to N=1 is the batching gain.
  prefix   one ~--prefix_tokens prompt from a real book, sent twice with no store at all
           (`kv_store=None`): the second request's blocks are on the device (prefix cache), so
           its TTFT is one small prefill step; the text must be identical. A third run after
           `LLM.reset_prefix_cache()` is cold again (the cache, not a warm-up, is the cause).

    .venv/bin/python scripts/bench_paged.py
    .venv/bin/python scripts/bench_paged.py --parts=decode --decode_seqs=1,8,32

Writes <out_dir>/bench_paged.json (`benchlib.provenance()`, machine after, settings, per-N
step seconds, TTFTs, texts) and bench_paged.png.
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
from absl import app, flags, logging

import benchlib  # scripts/benchlib.py
from benchlib import machine

REPO = pathlib.Path(__file__).resolve().parent.parent

_PARTS = flags.DEFINE_list("parts", ["decode", "prefix"], "Parts to run.")
_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model.")
_SEQS = flags.DEFINE_list("decode_seqs", ["1", "32"], "Running sequence counts to decode with.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 24, "Timed decode steps per count.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Decode part: rounds; each runs every sequence count "
                               "once, in an order rotated per round (benchlib.interleaved_rounds); "
                               "a figure is the median over rounds.")
_DECODE_PROMPT = flags.DEFINE_integer("decode_prompt_tokens", 64, "Prompt tokens per sequence.")
_BOOK = flags.DEFINE_string(
    "book", str(REPO.parent / "shared/data/books/pg41_legend_of_sleepy_hollow_irving.txt"),
    "Text the prompts are cut from.")
_PREFIX_TOKENS = flags.DEFINE_integer("prefix_tokens", 4096, "Prefix part: prompt tokens.")
_PREFIX_OUT = flags.DEFINE_integer("prefix_max_tokens", 16, "Prefix part: output tokens.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")


def book_ids(tok, n: int, offset_chars: int = 0) -> list[int]:
  text = pathlib.Path(_BOOK.value).read_text(encoding="utf-8")[offset_chars:]
  ids = tok.encode(text[:12 * n])
  if len(ids) < n:
    raise ValueError(f"{_BOOK.value} has fewer than {n} tokens after {offset_chars} chars")
  return ids[:n]


def bench_decode(seq_counts: list[int]) -> dict:
  """Output tokens/s of steps where every one of N sequences decodes, per N."""
  from kvjax import LLM, SamplingParams  # noqa: PLC0415
  top = max(seq_counts)
  steps = _DECODE_STEPS.value
  p = _DECODE_PROMPT.value
  max_len = p + steps + 64
  t0 = time.perf_counter()
  llm = LLM(_MODEL.value, max_num_seqs=top, max_model_len=max_len,
            enable_prefix_caching=False, chunk_sizes=(16, 32, 64, 128, 256, 512))
  build_s = time.perf_counter() - t0
  tok = llm.get_tokenizer()
  eng = llm.engine
  out = {"build_and_compile_s": build_s, "max_model_len": max_len,
         "num_blocks": eng.stats().kv_cache.num_blocks, "rows": []}
  params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
  runs = {n: [] for n in seq_counts}
  for r_i, order in enumerate(benchlib.interleaved_rounds(seq_counts, _ROUNDS.value)):
    for n in order:
      runs[n].append(decode_once(eng, tok, params, n, p, steps))
      row = runs[n][-1]
      print(f"round {r_i} decode: {n:3d} sequences: {row['output_tokens_per_s']:8.1f} tokens/s "
            f"(median step {1e3 * row['median_step_s']:.1f} ms, CPU share "
            f"{row['cpu_share']:.2f})", flush=True)
  for n in seq_counts:
    tps = benchlib.summarize([r["output_tokens_per_s"] for r in runs[n]])
    out["rows"].append({"num_seqs": n, "steps": steps, "rounds": runs[n],
                        "output_tokens_per_s": tps["median"], "output_tokens_per_s_summary": tps,
                        "median_step_s": float(np.median([r["median_step_s"] for r in runs[n]]))})
  base = out["rows"][0]["output_tokens_per_s"]
  for row in out["rows"]:
    row["speedup_vs_first"] = row["output_tokens_per_s"] / base
  llm.close()
  return out


def decode_once(eng, tok, params, n: int, p: int, steps: int) -> dict:
  """One timed run: N sequences of a p-token prompt prefill, then `steps` steps where all N
  decode; their step seconds, output tokens/s and this process's CPU share over them."""
  prompts = [book_ids(tok, p, offset_chars=2000 * i) for i in range(n)]
  rids = [eng.add_request(ids, params) for ids in prompts]
  produced = {r: 0 for r in rids}
  while min(produced.values()) < 1:  # every prefill done, every sequence has a token
    for o in eng.step():
      produced[o.request_id] = len(o.token_ids)
  step_s, before = [], sum(produced.values())
  cpu0, wall0 = time.process_time(), time.perf_counter()
  for _ in range(steps):
    t = time.perf_counter()
    outs = eng.step()
    step_s.append(time.perf_counter() - t)
    for o in outs:
      produced[o.request_id] = len(o.token_ids)
  cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
  tokens = sum(produced.values()) - before
  if tokens != n * steps:
    raise RuntimeError(f"{tokens} tokens in {steps} steps of {n} sequences")
  for r in rids:
    eng.abort_request(r)
  total = sum(step_s)
  return {"step_s": step_s, "total_s": total, "median_step_s": float(np.median(step_s)),
          "output_tokens_per_s": tokens / total, "cpu_share": cpu_share}


def bench_prefix() -> dict:
  """Cold, repeated (device prefix hit) and reset-cold TTFT of one long prompt, no store."""
  from kvjax import LLM, SamplingParams  # noqa: PLC0415
  n = _PREFIX_TOKENS.value
  t0 = time.perf_counter()
  llm = LLM(_MODEL.value, max_num_seqs=1,
            max_model_len=n + _PREFIX_OUT.value + 64, kv_store=None)
  build_s = time.perf_counter() - t0
  ids = book_ids(llm.get_tokenizer(), n)
  params = SamplingParams(max_tokens=_PREFIX_OUT.value, temperature=0.0)
  runs = []
  for name in ("cold", "repeat", "after_reset"):
    if name == "after_reset":
      llm.reset_prefix_cache()
    o = llm.generate({"prompt_token_ids": ids}, params)[0]
    m = o.metrics
    runs.append({"run": name, "ttft_s": m.ttft_s, "e2e_s": m.finished_s - m.arrival_s,
                 "num_computed_tokens": m.num_computed_tokens,
                 "num_device_cached_tokens": m.num_device_cached_tokens,
                 "loaded_from_tiers": list(m.loaded_from_tiers), "text": o.text,
                 "token_ids": o.token_ids})
    print(f"prefix: {name:11s} TTFT {m.ttft_s:7.3f} s, computed {m.num_computed_tokens}, "
          f"device hits {m.num_device_cached_tokens}", flush=True)
  llm.close()
  cold, rep, reset = runs
  return {"prompt_tokens": n, "build_and_compile_s": build_s, "runs": runs,
          "repeat_over_cold_ttft": rep["ttft_s"] / cold["ttft_s"],
          "identical_text": cold["text"] == rep["text"] == reset["text"],
          "identical_tokens": cold["token_ids"] == rep["token_ids"] == reset["token_ids"]}


def plot(record: dict, path: pathlib.Path) -> bool:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  parts = [p for p in ("decode", "prefix") if p in record]
  fig, axes = plt.subplots(1, len(parts), figsize=(5 * len(parts), 3.8), squeeze=False)
  for ax, part in zip(axes[0], parts):
    if part == "decode":
      rows = record["decode"]["rows"]
      ax.bar([str(r["num_seqs"]) for r in rows], [r["output_tokens_per_s"] for r in rows])
      for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup_vs_first']:.1f}x", (i, r["output_tokens_per_s"]),
                    ha="center", va="bottom")
      ax.set_xlabel("running sequences")
      ax.set_ylabel("output tokens/s (decode steps)")
      ax.set_title("paged batched decode", fontsize=9)
    else:
      runs = record["prefix"]["runs"]
      ax.bar([r["run"] for r in runs], [r["ttft_s"] for r in runs])
      ax.set_yscale("log")
      ax.set_ylabel("TTFT, seconds (log)")
      ax.set_title(f"{record['prefix']['prompt_tokens']}-token prompt, no store: "
                   f"repeat/cold = {record['prefix']['repeat_over_cold_ttft']:.4f}", fontsize=9)
  load = record["machine"]["loadavg_1_5_15"][0]
  fig.suptitle(f"bench_paged: {_MODEL.value}, {os.cpu_count()} CPU cores, load {load:.1f}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax  # noqa: PLC0415
  record = {**benchlib.provenance(), "benchmark": "bench_paged",
            "backend": jax.default_backend(),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "settings": {"model": _MODEL.value, "parts": _PARTS.value,
                         "decode_seqs": [int(s) for s in _SEQS.value],
                         "decode_steps": _DECODE_STEPS.value, "rounds": _ROUNDS.value,
                         "decode_prompt_tokens": _DECODE_PROMPT.value,
                         "prefix_tokens": _PREFIX_TOKENS.value,
                         "prefix_max_tokens": _PREFIX_OUT.value, "book": pathlib.Path(
                             _BOOK.value).name, "dtype": "auto (float32 on CPU)",
                         "temperature": 0}}
  if "decode" in _PARTS.value:
    record["decode"] = bench_decode(sorted(int(s) for s in _SEQS.value))
  if "prefix" in _PARTS.value:
    record["prefix"] = bench_prefix()
  record["machine_at_end"] = machine()
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  benchlib.write_json(out_dir / "bench_paged.json", record)
  wrote = plot(record, out_dir / "bench_paged.png")
  print(f"wrote {out_dir / 'bench_paged.json'}" + (" and bench_paged.png" if wrote else ""))


if __name__ == "__main__":
  app.run(main)
