"""The reduced bench_codec protocol: `scripts/bench_codec.py`'s size + quality phases (and
optionally its LongChat phase) without the compute sweep and throughput phases, with a kvtc
transform given as a file, and optional "protected first tokens" variants.

    PYTHONPATH=.:scripts nice -n 19 .venv/bin/python scripts/bench_codec_reduced.py \
        --codecs raw,int8,kvtc-1,kvtc-2,kvtc-3 --passages 5 --prefix_tokens 2048 \
        --held_tokens 256 --kvtc_transform T.npz --out benchmarks/results/kvtc_v3_reduced

`--phases quality,longchat` picks the phases (LongChat needs `--longchat_samples`).
`--kvtc_transform` is an .npz with mean, basis, variance, predictor and sensitivity (what
`kv_calibration.load_or_calibrate` caches); without it the model's calibrated transform is used
(calibrated now if not cached). `--protect_first N` adds, for every kvtc label X, a label X+pN:
the same stored bytes, then the first N tokens of chunk 0 replaced by the exact (computed) KV in
the cache: an upper bound of what protecting the first tokens of a sequence can gain (the bytes
of the protected tokens are not counted). Writes <out>/bench_codec.json and bench_codec.png like
bench_codec.py and prints its tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

from absl import app, flags

import bench_codec as bc  # scripts/
from bench_codec_lib import MODEL, Bench  # scripts/
import benchlib  # scripts/benchlib.py
from benchlib import machine

_TRANSFORM = flags.DEFINE_string("kvtc_transform", None, "kvtc transform .npz (mean, basis, "
                                 "variance, predictor, sensitivity).")
_PROTECT = flags.DEFINE_integer("protect_first", 0, "Also measure each kvtc level with the "
                                "first N tokens of chunk 0 exact (upper bound of protection).")
_PHASES = flags.DEFINE_list("phases", ["quality"], "Phases to run: quality, longchat (longchat "
                            "also needs --longchat_samples).")
_NOTE = flags.DEFINE_string("note", "", "A note written into the JSON (e.g. the transform).")


class ProtectBench(Bench):
  """A Bench whose decode_into, for the labels of `protected` (in the order quality() calls
  it: once per label of s.codecs), overwrites the first N tokens of slot `slot` with slot 0's
  exact KV."""

  def __init__(self, *args, labels=(), protect=0, **kwargs):
    super().__init__(*args, **kwargs)
    self.labels, self.protect, self.calls = list(labels), protect, 0

  def store_check(self, kv_L2CKH, token_ids, blobs):
    # The +pN labels store the same bytes as their level: checked once, under the level's label.
    return super().store_check(kv_L2CKH, token_ids,
                               {k: v for k, v in blobs.items() if "+p" not in k[0]})

  def decode_into(self, blobs, codec, level, slot):
    super().decode_into(blobs, codec, level, slot)
    label = self.labels[self.calls % len(self.labels)]
    self.calls += 1
    if self.protect and label.endswith(f"+p{self.protect}"):
      n = self.protect
      cache = self.runner.cache
      k = cache.k_LBSKH.at[:, slot, :n].set(cache.k_LBSKH[:, 0, :n])
      v = cache.v_LBSKH.at[:, slot, :n].set(cache.v_LBSKH[:, 0, :n])
      self.runner.cache = dataclasses.replace(cache, k_LBSKH=k, v_LBSKH=v)


def main(argv):
  del argv
  from kvjax.models.loading import kv_calibration  # noqa: PLC0415
  if _TRANSFORM.value:
    path = _TRANSFORM.value

    def given(runner, *_, **__):
      cfg = runner.model_config
      return kv_calibration.load_transform(path, cfg.n_kv_heads, cfg.head_dim)
    kv_calibration.load_or_calibrate = given
  s = bc.Settings.from_flags()
  codecs = list(s.codecs)
  if _PROTECT.value:
    codecs += [(f"{label}+p{_PROTECT.value}", codec, level) for label, codec, level in s.codecs
               if codec == "kvtc"]
  s = dataclasses.replace(s, codecs=tuple(codecs))
  from tqdm import tqdm  # noqa: PLC0415
  t0 = time.perf_counter()
  prov = benchlib.provenance(bc.VERSION_PACKAGES)
  data = bc.data_dir()
  max_seq_len = max(s.prefix_tokens + s.held_tokens + 1, 8192 if s.longchat_samples else 0)
  bench = ProtectBench(max_seq_len, tuple(sorted({s.held_tokens, s.chunk})), s.chunk,
                       labels=[c[0] for c in s.codecs], protect=_PROTECT.value)
  books = {}
  for name in bc.BOOKS:
    with open(data / "books" / name, encoding="utf-8") as f:
      books[name] = bench.tokenizer.encode(f.read(), add_special_tokens=False)
  total = (s.passages * len(s.codecs) * ("quality" in _PHASES.value)
           + s.longchat_samples * (1 + len(s.codecs)) * ("longchat" in _PHASES.value))
  with tqdm(total=total, desc="bench_codec_reduced", unit="step", dynamic_ncols=True) as pr:
    sizes = qual = passages = lc = None
    if "quality" in _PHASES.value:
      sizes, qual, passages = bc.quality(bench, books, s, pr)
    if s.longchat_samples and "longchat" in _PHASES.value:
      lc = bc.longchat(bench, data / "longchat" / "topics_10.jsonl", s, pr)
  t = bench.kvtc_transform
  record = {
      **prov,
      "benchmark": "bench_codec (reduced: scripts/bench_codec_reduced.py; phases "
                   + "+".join(_PHASES.value) + " of scripts/bench_codec.py)",
      "model": f"{MODEL} (GGUF Q4_1 -> f32)", "dtype": "float32",
      "settings": dataclasses.asdict(s), "machine_end": machine(),
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "seeds": {"bootstrap": s.seed, "note": "passages at fixed offsets; greedy decoding"},
      "kvtc_transform": {"file": os.path.basename(_TRANSFORM.value) if _TRANSFORM.value
                         else "the model's calibrated transform",
                         "transform_id": t.transform_id.hex()},
      "protect_first": _PROTECT.value, "note": _NOTE.value,
      "sizes": sizes, "quality": qual, "passages": passages, "longchat": lc,
      "elapsed_s": time.perf_counter() - t0}
  out = pathlib.Path(bc._OUT.value)  # noqa: SLF001
  out.mkdir(parents=True, exist_ok=True)
  benchlib.write_json(out / "bench_codec.json", record)
  for label, _, _ in s.codecs if qual else ():
    q = qual[label]
    print(f"{label:12s} {sizes[label]['bytes_per_token']:9.1f} B/token  ppl x"
          f"{bc._ci(q['ppl_ratio'], '.4f')}  KL {q['kl_per_token']['mean']:.5f}  "  # noqa: SLF001
          f"top1 {q['top1_agreement']['mean']:.3f}")
  if lc:
    print(json.dumps(lc["accuracy"], indent=1))
  if qual:
    bc.plot(out / "bench_codec.png", s, sizes, qual)
  print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  app.run(main)
