"""Compares lossless coders for cachegen's int8 symbols (delta_q, anchor_q) on real KV.

Usage:
  python scripts/measure_entropy_coders.py --kv_glob '/tmp/cs_kv/*.npy' [--json out.json]

The KV files are real SmolLM2 chunks `[30, 2, 256, 3, 64]` float32 (K before RoPE), e.g. read
back from a store filled by `LLM(kv_store=...)`. Each chunk is quantized with the reference
encoder (`kvjax.testing.codec_payloads`) at cachegen levels 0..3, and every candidate coder
compresses the same symbols. Reported: bits per value (model and framing included), compressed
bytes per token, and single-thread decode throughput in compressed MB/s (best of 3; 1 MB =
1e6 bytes). Candidates:

  plain            the int8 bytes
  zstd-N           zstandard level N on the C-order bytes (one frame)
  ans-layer        constriction ANS, one categorical model per (layer, K/V), built from this
                   chunk's histogram (counts stored, 16 bits each)
  ans-layer-pairs  the same models, two symbols coded as one (product model): half the symbols
  ans-chan-cat     one categorical per (layer, K/V, head, channel) from its own histogram
  ans-chan-lap     constriction QuantizedLaplace per (layer, K/V, head, channel), location and
                   scale stored as float16, per-symbol parameters
  pco-layer        pcodec (tANS with per-chunk bins), one chunk per (layer, K/V): what
                   `kvjax.storage.format.entropy` does
  (and `codecs` itself: the coder kvjax.storage.format.codecs uses)
"""

from __future__ import annotations

import glob
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from absl import app
from absl import flags
import constriction
import numpy as np
import zstandard

import benchlib  # scripts/benchlib.py
from kvjax.storage.format import codecs
from kvjax.storage.format import entropy
from kvjax.storage.format.types import KVLayout
from kvjax.testing import codec_payloads

_KV_GLOB = flags.DEFINE_string("kv_glob", "/tmp/cs_kv/*.npy", "Real KV chunks (.npy).")
_JSON = flags.DEFINE_string("json", None, "Write the table here as JSON ({provenance..., "
                            "\"kv_files\": [...], \"rows\": [...]}).")
_MAX_CHUNKS = flags.DEFINE_integer("max_chunks", 4, "Chunks to use.")
_CODECS = flags.DEFINE_bool("codecs", True, "Also time kvjax.storage.format.codecs on whole payloads.")

_m = constriction.stream.model


def _counts_model(sym: np.ndarray) -> tuple[int, np.ndarray]:
  """(lowest symbol, uint16 counts over [lo, hi]) with every present symbol at least 1."""
  lo, hi = int(sym.min()), int(sym.max())
  counts = np.bincount(sym.astype(np.int64) - lo, minlength=hi - lo + 1).astype(np.float64)
  scale = min(1.0, 65535 / counts.max())
  q = np.where(counts > 0, np.maximum(1, np.rint(counts * scale)), 0).astype(np.uint16)
  return lo, q


class Plain:
  name = "plain"

  def encode(self, q):
    return q.tobytes()

  def decode(self, b, shape):
    return np.frombuffer(b, np.int8).reshape(shape)


class Zstd:

  def __init__(self, level):
    self.level = level
    self.name = f"zstd-{level}"

  def encode(self, q):
    return zstandard.ZstdCompressor(level=self.level).compress(q.tobytes())

  def decode(self, b, shape):
    return np.frombuffer(zstandard.ZstdDecompressor().decompress(b), np.int8).reshape(shape)


class AnsLayer:
  """One categorical per (layer, K/V) slice; optional pair symbols with a product model."""

  def __init__(self, pairs=False):
    self.pairs = pairs
    self.name = "ans-layer-pairs" if pairs else "ans-layer"

  def _model(self, lo_counts):
    lo, counts = lo_counts
    p = counts.astype(np.float64)
    if self.pairs:
      p = np.outer(p, p).reshape(-1)
    return _m.Categorical(p, perfect=False)

  def encode(self, q):
    slices = q.reshape(q.shape[0] * 2, -1)
    models = [_counts_model(s) for s in slices]
    coder = constriction.stream.stack.AnsCoder()
    for s, (lo, counts) in reversed(list(zip(slices, models))):
      sym = s.astype(np.int32) - lo
      if self.pairs:
        sym = sym[0::2] * len(counts) + sym[1::2]
      coder.encode_reverse(sym, self._model((lo, counts)))
    head = b"".join(np.int8(lo).tobytes() + np.uint16(len(c)).tobytes() + c.tobytes()
                    for lo, c in models)
    return head + coder.get_compressed().tobytes()

  def decode(self, b, shape):
    n_slices = shape[0] * 2
    per = int(np.prod(shape)) // n_slices
    pos, models = 0, []
    for _ in range(n_slices):
      lo = int(np.frombuffer(b, np.int8, 1, pos)[0])
      n = int(np.frombuffer(b, np.uint16, 1, pos + 1)[0])
      models.append((lo, np.frombuffer(b, np.uint16, n, pos + 3)))
      pos += 3 + 2 * n
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(b[pos:], np.uint32))
    out = np.empty((n_slices, per), np.int8)
    for i, (lo, counts) in enumerate(models):
      if self.pairs:
        pair = coder.decode(self._model((lo, counts)), per // 2)
        out[i, 0::2] = pair // len(counts) + lo
        out[i, 1::2] = pair % len(counts) + lo
      else:
        out[i] = coder.decode(self._model((lo, counts)), per) + lo
    return out.reshape(shape)


class AnsChannelCategorical:
  """One categorical per channel (layer, K/V, head, channel), counts zstd-compressed."""

  name = "ans-chan-cat"

  def encode(self, q):
    chan = np.moveaxis(q, 2, -1).reshape(-1, q.shape[2])  # [L*2*K*H, C]
    models = [_counts_model(s) for s in chan]
    coder = constriction.stream.stack.AnsCoder()
    for s, (lo, c) in reversed(list(zip(chan, models))):
      coder.encode_reverse(s.astype(np.int32) - lo, _m.Categorical(c.astype(np.float64),
                                                                    perfect=False))
    table = b"".join(np.int8(lo).tobytes() + np.uint8(len(c) - 1).tobytes()
                     + np.minimum(c, 255).astype(np.uint8).tobytes() for lo, c in models)
    table = zstandard.ZstdCompressor(level=19).compress(table)
    return len(table).to_bytes(4, "little") + table + coder.get_compressed().tobytes()

  def decode(self, b, shape):
    n = int.from_bytes(b[:4], "little")
    table = zstandard.ZstdDecompressor().decompress(b[4:4 + n])
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(b[4 + n:], np.uint32))
    n_chan = int(np.prod(shape)) // shape[2]
    out = np.empty((n_chan, shape[2]), np.int8)
    pos = 0
    for i in range(n_chan):
      lo = int(np.frombuffer(table, np.int8, 1, pos)[0])
      k = table[pos + 1] + 1
      c = np.frombuffer(table, np.uint8, k, pos + 2).astype(np.float64)
      pos += 2 + k
      out[i] = coder.decode(_m.Categorical(c, perfect=False), shape[2]) + lo
    L, two, C, K, H = shape
    return np.moveaxis(out.reshape(L, two, K, H, C), -1, 2)


class AnsChannelLaplace:
  """QuantizedLaplace per channel: location = channel mean, scale = mean |q - mean| (float16)."""

  name = "ans-chan-lap"

  def _params(self, loc, scale, shape):
    c = shape[2]
    loc_all = np.repeat(loc.astype(np.float64)[:, :, None], c, axis=2).reshape(-1)
    scale_all = np.repeat(scale.astype(np.float64)[:, :, None], c, axis=2).reshape(-1)
    return loc_all, scale_all

  def encode(self, q):
    x = q.astype(np.float64)
    loc = np.rint(x.mean(axis=2)).astype(np.float16)
    scale = np.maximum(np.abs(x - loc.astype(np.float64)[:, :, None]).mean(axis=2),
                       0.05).astype(np.float16)
    fam = _m.QuantizedLaplace(-128, 127)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(q.reshape(-1).astype(np.int32), fam, *self._params(loc, scale, q.shape))
    return loc.tobytes() + scale.tobytes() + coder.get_compressed().tobytes()

  def decode(self, b, shape):
    n = int(np.prod(shape)) // shape[2]
    L, two, C, K, H = shape
    loc = np.frombuffer(b, np.float16, n, 0).reshape(L, two, K, H)
    scale = np.frombuffer(b, np.float16, n, 2 * n).reshape(L, two, K, H)
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(b[4 * n:], np.uint32))
    fam = _m.QuantizedLaplace(-128, 127)
    return coder.decode(fam, *self._params(loc, scale, shape)).astype(np.int8).reshape(shape)


class PcoLayer:
  name = "pco-layer"

  def encode(self, q):
    return entropy.encode_groups(q, q.shape[0] * 2)

  def decode(self, b, shape):
    return entropy.decode_groups(b, shape)


def _time(fn, repeat=3):
  best = float("inf")
  for _ in range(repeat):
    t = time.perf_counter()
    out = fn()
    best = min(best, time.perf_counter() - t)
  return best, out


def main(argv):
  del argv
  prov = benchlib.provenance(("kvjax", "numpy", "constriction", "zstandard"))
  files = sorted(glob.glob(_KV_GLOB.value))[:_MAX_CHUNKS.value]
  if not files:
    sys.exit(f"no KV files match {_KV_GLOB.value!r}")
  kvs = [np.load(f) for f in files]
  coders = [Plain(), Zstd(1), Zstd(3), Zstd(9), Zstd(19), AnsLayer(), AnsLayer(pairs=True),
            AnsChannelCategorical(), AnsChannelLaplace(), PcoLayer()]
  rows = []
  for level in range(4):
    payloads = [codec_payloads.encode_cachegen(kv, level) for kv in kvs]
    for name in ("delta_q", "anchor_q"):
      for coder in coders:
        if name == "anchor_q" and coder.name in ("ans-layer-pairs",):
          continue
        nbytes = secs = 0
        for p in payloads:
          q = p[name]
          blob = coder.encode(q)
          dt, back = _time(lambda: coder.decode(blob, q.shape))
          assert np.array_equal(back, q), (coder.name, name, level)
          nbytes += len(blob)
          secs += dt
        n_values = sum(p[name].size for p in payloads)
        tokens = sum(p["delta_q"].shape[2] for p in payloads)
        rows.append({"level": level, "array": name, "coder": coder.name,
                     "bits_per_value": 8 * nbytes / n_values, "bytes_per_token": nbytes / tokens,
                     "decode_MB_per_s": nbytes / secs / 1e6})
    if not _CODECS.value:
      continue
    # The whole payload through kvjax.storage.format.codecs (what the store writes).
    kv = kvs[0]
    layout = KVLayout(kv.shape[0], kv.shape[2], kv.shape[3], kv.shape[4], "float32")
    nbytes = secs = 0
    for p in payloads:
      blob = codecs.encode_payload("cachegen", level, p, layout)
      dt, back = _time(lambda: codecs.decode_payload("cachegen", 1, level, blob, layout))
      assert all(np.array_equal(back[k], p[k]) for k in p)
      nbytes += len(blob)
      secs += dt
    tokens = sum(p["delta_q"].shape[2] for p in payloads)
    rows.append({"level": level, "array": "payload", "coder": "codecs",
                 "bits_per_value": 8 * nbytes / (tokens * layout.nbytes / 4 / layout.chunk_size),
                 "bytes_per_token": nbytes / tokens, "decode_MB_per_s": nbytes / secs / 1e6})
  print(f"{len(kvs)} chunks {kvs[0].shape}; single-thread decode, compressed MB/s")
  print(f"{'level':>5} {'array':<9} {'coder':<16} {'bits/value':>10} {'bytes/token':>11} "
        f"{'MB/s':>8}")
  for r in rows:
    print(f"{r['level']:>5} {r['array']:<9} {r['coder']:<16} {r['bits_per_value']:>10.3f} "
          f"{r['bytes_per_token']:>11.1f} {r['decode_MB_per_s']:>8.1f}")
  if _JSON.value:
    benchlib.write_json(_JSON.value, {**prov, "kv_files": [os.path.basename(f) for f in files],
                                      "rows": rows})


if __name__ == "__main__":
  app.run(main)
