"""Identical requests, identical answers: one request sent alone, many times, with a lossy codec.

    python scripts/check_consistency.py [--repeats 200] [--codec int8] [--tokens 1500]

Issue 13's check. A book prompt's chunks are stored once (a cold compute-only run with the codec),
then the same request is sent `--repeats` times, one after another, to one `LLM` in Cake mode
(every repeat reads the store: a plain file store has no host tier), first with
`kv_codec_consistent=True`, then `--inconsistent_repeats` times with it off. Each repeat's Cake
meeting point depends on timing; the script counts distinct outputs (greedy token ids) and the
meeting points seen, side by side in one run.

Writes `<out>.json` (`benchlib.provenance()`, settings, every repeat's meeting index and
whether it equals the first output) and prints a table. SmolLM2-135M-Instruct, f32 on CPU.
"""

from __future__ import annotations

import collections
import os
import pathlib
import sys
import tempfile

from absl import app
from absl import flags

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

_BOOK = flags.DEFINE_string(
    "book", "../shared/data/books/pg1952_the_yellow_wallpaper_gilman.txt",
    "Book text; a relative path is taken from the repository root.")
_TOKENS = flags.DEFINE_integer("tokens", 1500, "Prompt tokens (the book's first ones).")
_REPEATS = flags.DEFINE_integer("repeats", 200, "Repeats with kv_codec_consistent=True.")
_INCONSISTENT = flags.DEFINE_integer("inconsistent_repeats", 60,
                                     "Repeats with kv_codec_consistent=False (the baseline).")
_CODEC = flags.DEFINE_string("codec", "int8", "Lossy codec of the stored chunks.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Greedy output tokens per request.")
_LINK_MB_S = flags.DEFINE_float("link_mb_s", None,
                                 "Emulated store link, MB/s (1e6 bytes/s): near the balance of "
                                 "compute and load the meeting point moves from run to run.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/consistency",
                           "Output path without extension (relative: from the repo root).")


def _run(llm, ids, params, repeats):
  outs, meetings = [], []
  for _ in range(repeats):
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    outs.append(tuple(out.token_ids))
    meetings.append(out.metrics.merge.meeting_index if out.metrics.merge else None)
  return outs, meetings


def main(argv):
  del argv
  import jax  # noqa: PLC0415
  from kvjax import LLM, SamplingParams  # noqa: PLC0415
  import benchlib  # noqa: PLC0415  (scripts/benchlib.py)
  prov = benchlib.provenance()

  book = pathlib.Path(_BOOK.value)
  if not book.is_absolute():
    book = REPO / book
  params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0)
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    for consistent, repeats in ((True, _REPEATS.value), (False, _INCONSISTENT.value)):
      store = os.path.join(tmp, f"store-{consistent}")
      writer = LLM(kv_store=store, kv_codec=_CODEC.value, kv_merge_mode="compute_only",
                   kv_codec_consistent=consistent)
      text = book.read_text(encoding="utf-8")
      ids = writer.get_tokenizer().encode(text)[:_TOKENS.value]
      cold = tuple(writer.generate({"prompt_token_ids": ids}, params)[0].token_ids)
      writer.flush()
      writer.close()
      llm = LLM(kv_store=store, kv_codec=_CODEC.value, kv_codec_consistent=consistent,
                kv_link_bytes_per_s=_LINK_MB_S.value * 1e6 if _LINK_MB_S.value else None)
      outs, meetings = _run(llm, ids, params, repeats)
      llm.close()
      counts = collections.Counter(outs)
      rows[consistent] = {
          "repeats": repeats, "distinct_outputs": len(counts),
          "equal_to_first": sum(o == outs[0] for o in outs),
          "equal_to_cold": sum(o == cold for o in outs),
          "meeting_points": dict(collections.Counter(meetings)),
          "meeting_index_per_repeat": meetings,
          "equal_to_first_per_repeat": [o == outs[0] for o in outs]}
      print(f"consistent={consistent}: {repeats} repeats, {len(counts)} distinct outputs, "
            f"{rows[consistent]['equal_to_cold']} equal to the cold run, meeting points "
            f"{dict(sorted(collections.Counter(meetings).items(), key=str))}", flush=True)
  result = {**prov, "settings": {"codec": _CODEC.value, "tokens": _TOKENS.value,
                         "max_tokens": _MAX_TOKENS.value, "book": _BOOK.value,
                         "link_mb_s": _LINK_MB_S.value},
            "backend": jax.default_backend(), "threads": os.cpu_count(),
            "seed": 0, "consistent": rows[True], "inconsistent": rows[False]}
  out = pathlib.Path(_OUT.value)
  if not out.is_absolute():
    out = REPO / out
  benchlib.write_json(out.with_suffix(".json"), result)
  _plot(rows, out.with_suffix(".png"))
  print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _plot(rows, path):
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  for ax, consistent in zip(axes, (True, False)):
    r = rows[consistent]
    same = r["equal_to_first_per_repeat"]
    ax.scatter(range(len(same)), r["meeting_index_per_repeat"], s=8,
               c=["tab:green" if x else "tab:red" for x in same])
    ax.set_title(f"kv_codec_consistent={consistent}: {r['distinct_outputs']} distinct output(s)")
    ax.set_xlabel("repeat (red: output differs from the first)")
    ax.set_ylabel("Cake meeting index")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  app.run(main)
