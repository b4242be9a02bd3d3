"""Prefill time per chunk versus chunk index, real SmolLM2-135M-Instruct, kvjax vs transformers.

Chunked prefill of one long real prompt (a public-domain book from ../shared/data) up to 8K tokens
at chunk sizes 256 and 512. Each chunk is timed with `block_until_ready` after a warm-up that
compiles every chunk size. When `transformers` (and torch) are importable, the same token ids go
through the same GGUF in transformers with a `DynamicCache`, chunk by chunk, with the same thread
count, and the script prints the per-chunk ratio measured side by side in this one run.

    .venv/bin/python scripts/bench_prefill.py                # kvjax only
    /tmp/refvenv/bin/python scripts/bench_prefill.py         # with transformers (see README)

Writes <out_dir>/bench_prefill.json (machine, versions, threads, git SHA, inputs, per-chunk
seconds) and <out_dir>/bench_prefill.png.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time

from absl import app, flags, logging

from benchlib import git_sha, machine  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent

_BOOK = flags.DEFINE_string(
    "book", str(REPO.parent / "shared/data/books/pg41_legend_of_sleepy_hollow_irving.txt"),
    "Text file the prompt is taken from.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 8192, "Prompt length, tokens.")
_CHUNK_SIZES = flags.DEFINE_list("chunk_sizes", ["256", "512"], "Prefill chunk sizes.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")
_TRANSFORMERS = flags.DEFINE_enum("transformers", "auto", ["auto", "on", "off"],
                                  "Time transformers too (auto: when importable).")


def time_kvjax(ids: list[int], chunk: int) -> list[float]:
  import jax  # noqa: PLC0415
  from kvjax.models.llama import Llama  # noqa: PLC0415
  from kvjax.models.registry import load_model  # noqa: PLC0415
  from kvjax.models.runner import ModelRunner, RunnerConfig  # noqa: PLC0415

  loaded = load_model("SmolLM2-135M-Instruct", cache_dir=None)
  runner = ModelRunner(Llama.from_params(loaded.config, loaded.params),
                       RunnerConfig(num_slots=1, max_seq_len=len(ids), chunk_sizes=(chunk,)))
  runner.warmup()
  times = []
  for start in range(0, len(ids), chunk):
    t0 = time.perf_counter()
    out = runner.prefill_chunk(ids[start:start + chunk], 0, start)
    jax.block_until_ready(out.logits)
    times.append(time.perf_counter() - t0)
  return times


def time_transformers(ids: list[int], chunk: int, threads: int) -> list[float]:
  import torch  # noqa: PLC0415
  from transformers import AutoModelForCausalLM, DynamicCache  # noqa: PLC0415
  from kvjax.models.gguf_loader import find_smollm2_gguf  # noqa: PLC0415

  torch.set_num_threads(threads)
  path = find_smollm2_gguf()
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                               gguf_file=os.path.basename(path),
                                               dtype=torch.float32).eval()
  with torch.no_grad():  # warm-up
    model(input_ids=torch.tensor([ids[:chunk]]), use_cache=True, logits_to_keep=1)
  cache = DynamicCache()
  times = []
  with torch.no_grad():
    for start in range(0, len(ids), chunk):
      x = torch.tensor([ids[start:start + chunk]])
      t0 = time.perf_counter()
      model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
      times.append(time.perf_counter() - t0)
  return times


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax  # noqa: PLC0415
  import kvjax  # noqa: PLC0415
  from kvjax.models.gguf_loader import find_smollm2_gguf  # noqa: PLC0415
  from kvjax.models.tokenizer import Tokenizer  # noqa: PLC0415

  tok = Tokenizer.from_gguf(find_smollm2_gguf())
  with open(_BOOK.value, encoding="utf-8") as f:
    ids = tok.encode(f.read(), add_special_tokens=False)[:_MAX_TOKENS.value]
  if len(ids) < _MAX_TOKENS.value:
    raise SystemExit(f"{_BOOK.value} has only {len(ids)} tokens; need {_MAX_TOKENS.value}")
  want_hf = _TRANSFORMERS.value == "on" or (
      _TRANSFORMERS.value == "auto" and importlib.util.find_spec("transformers") is not None)
  threads = os.cpu_count() or 1
  versions = {"kvjax": kvjax.__version__, "jax": jax.__version__,
              "backend": jax.default_backend()}
  results = {}
  for chunk in (int(c) for c in _CHUNK_SIZES.value):
    row = {"kvjax_s": time_kvjax(ids, chunk)}
    if want_hf:
      import torch  # noqa: PLC0415
      import transformers  # noqa: PLC0415
      versions.update(torch=torch.__version__, transformers=transformers.__version__)
      row["transformers_s"] = time_transformers(ids, chunk, threads)
    results[str(chunk)] = row

  print(f"SmolLM2-135M f32, {len(ids)}-token prompt from {os.path.basename(_BOOK.value)}, "
        f"{threads} threads, {machine()['cpu']}")
  for chunk, row in results.items():
    kv = row["kvjax_s"]
    hf = row.get("transformers_s")
    print(f"\nchunk size {chunk}: chunk index, start token, kvjax s"
          + (", transformers s, transformers/kvjax" if hf else ""))
    for i, t in enumerate(kv):
      line = f"  {i:3d} {i * int(chunk):6d} {t:8.3f}"
      if hf:
        line += f" {hf[i]:8.3f} {hf[i] / t:6.2f}x"
      print(line)
    total = f"  total kvjax {sum(kv):.1f} s"
    if hf:
      total += f", transformers {sum(hf):.1f} s, ratio {sum(hf) / sum(kv):.2f}x"
    print(total)

  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  record = {"benchmark": "bench_prefill", "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> f32)",
            "dtype": "float32", "prompt_source": os.path.basename(_BOOK.value),
            "prompt_tokens": len(ids), "machine": machine(), "threads": threads,
            "versions": versions, "git_sha": git_sha(), "seeds": None,
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "results": results}
  (out_dir / "bench_prefill.json").write_text(json.dumps(record, indent=1))
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
    return
  fig, ax = plt.subplots(figsize=(7, 4))
  for chunk, row in results.items():
    starts = [i * int(chunk) for i in range(len(row["kvjax_s"]))]
    ax.plot(starts, row["kvjax_s"], "o-", label=f"kvjax, chunk {chunk}")
    if "transformers_s" in row:
      ax.plot(starts, row["transformers_s"], "x--", label=f"transformers, chunk {chunk}")
  ax.set_xlabel("chunk start position (tokens)")
  ax.set_ylabel("prefill time per chunk (s)")
  ax.set_title(f"SmolLM2-135M f32 chunked prefill, {threads} CPU threads")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_dir / "bench_prefill.png", dpi=120)
  print(f"wrote {out_dir / 'bench_prefill.json'} and bench_prefill.png")


if __name__ == "__main__":
  app.run(main)
