"""The codec registry: which KV chunk codecs exist, and the facts every room must agree on.

A bottom floor like `kvjax/_typing.py` (standard library only; no JAX, numpy or storage), so the
kernels room (the math: `kvjax.kernels.kv_codec`), the storage room (the byte format:
`kvjax.storage.format.codecs`), the engine (which stored encoding to load) and the server (which codec
to store with) all read one table instead of four:

    codec     version  levels  lossless  derived from C                  paper, section
    raw       1        0       yes       -                               -
    int8      1        0       no        -                               LLM.int8() 2.1
    int4      1        0       no        G = int4_group_tokens(C)        KIVI 3, LLM.int8() 2.1
    cachegen  1        0..3    no        T = cachegen_anchor_stride(C)   CacheGen 5.2 (5.3)
    kvtc      5        0..4    no        -                               KVTC; PCA; DPCM over layers

(arXiv ids and details in each `Codec.reference`.)

An encoding is one (codec, level) pair, `EncodingId`; "cachegen/2" is only its display form.
Accuracy ranks order the encodings by their relative L2 error measured on real SmolLM2-135M KV
(1024 tokens, chunks of 256, f32; `scripts/codec_error.py`, max over chunks; kvtc:
`scripts/kvtc_design.py --rel_l2`, same passage and chunks, the model's calibrated transform,
`benchmarks/results/archive/kvtc_v5/kvtc_rel_l2.json`):

    raw/0 0%  <  int8/0 0.54%  <  cachegen/0 1.6%  <  cachegen/1 3.2%  <  int4/0 5.1%
              <  kvtc/0 6.2%  <  cachegen/2 6.3%  <  cachegen/3 12.6%  <  kvtc/1 13.5%
              <  kvtc/2 17.5%  <  kvtc/3 20.1%  <  kvtc/4 25.0%

(kvtc puts its error where the model's output is least sensitive, version 5 by its Fisher metric,
so its L2 error overstates its loss: on the 20 x 4K-token protocol kvtc/1 at 13.5% L2 costs KL
0.0038 per token and cachegen/1 at 3.2% costs 0.0079 (`benchmarks/results/archive/kvtc_v5/
bench_codec.json`). The ranks only order the encodings one chunk is stored in; a store holds one
codec's default level unless told otherwise.)

The chunk-size rule. A chunk holds C tokens. int4 keeps one scale and zero per group of G tokens
(per channel) and CacheGen one anchor per group of T tokens; both must divide C. The one rule:

    G = the largest divisor of C that is <= INT4_GROUP_TOKENS (64)
    T = the largest divisor of C that is <= CACHEGEN_ANCHOR_STRIDE (16)

    C    1  7  16  48  64  96  100  256  384   (a prime C > 64 gives G = 1, one group per token)
    G    1  7  16  48  64  48   50   64   64
    T    1  7  16  16  16  16   10   16   16

It takes every C >= 1 and gives the byte format the kernels wrote before this registry existed
(G = min(64, C) and T = min(16, C), which had to divide C) for every C they accepted (int4: C <= 64
or a multiple of 64; cachegen: C <= 16 or a multiple of 16; e.g. C = 256: G = 64, T = 16), and the
largest groups (the fewest side bytes) otherwise. Readers
never re-derive G or T: both are read from the stored shapes, so chunks stored under another rule
stay readable. Small G costs bytes, not correctness: int4 stores 0.5 + 4 / G bytes per value
(float16 scale and zero), more than int8 once G < 8. `check_chunk_size` is what the `LLM` calls
before it loads weights.

Compiled Pallas on a GPU (Triton) wants power-of-two block dims (C, C // G, C // T); chunk sizes
that are not powers of two are tested in interpret mode and with the jnp reference only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

__all__ = ["ACCURACY_RANK", "CACHEGEN", "CACHEGEN_ANCHOR_STRIDE", "CODECS", "CODEC_LEVELS",
           "CODEC_VERSIONS", "DEFAULT_LEVELS", "ENCODINGS", "INT4", "INT4_GROUP_TOKENS", "INT8",
           "KVTC", "RAW", "Codec",
           "EncodingId", "cachegen_anchor_stride", "check_chunk_size", "check_codec",
           "int4_group_tokens", "is_decodable"]

#: Codec ids.
RAW = "raw"
INT8 = "int8"
INT4 = "int4"
CACHEGEN = "cachegen"
KVTC = "kvtc"

#: Most tokens per int4 scale/zero group, G (the rule takes the largest divisor of C up to it).
INT4_GROUP_TOKENS = 64
#: Most tokens per CacheGen anchor group, T (the rule takes the largest divisor of C up to it).
CACHEGEN_ANCHOR_STRIDE = 16


@dataclasses.dataclass(frozen=True, order=True)
class EncodingId:
  """One encoding of a stored chunk: a codec at one of its levels.

  Hashable and ordered (by codec name, then level); `str()` gives the display form
  "codec/level" and `EncodingId.parse` reads it back. Only the types are checked here; whether
  the codec and level exist is `check_codec`'s job (a record may name a codec this reader does
  not know).

  Attributes:
    codec: codec id, e.g. "cachegen".
    level: level, >= 0 (0 is the finest).

  Raises:
    ValueError: `codec` is not a non-empty string without "/", or `level` is not an int >= 0.
  """

  codec: str
  level: int = 0

  def __post_init__(self):
    if not isinstance(self.codec, str) or not self.codec or "/" in self.codec:
      raise ValueError(f"EncodingId codec={self.codec!r} must be a non-empty string without '/'")
    if isinstance(self.level, bool) or not isinstance(self.level, int) or self.level < 0:
      raise ValueError(f"EncodingId level={self.level!r} must be an int >= 0")

  def __str__(self) -> str:
    return f"{self.codec}/{self.level}"

  @classmethod
  def parse(cls, text: str) -> EncodingId:
    """Reads the display form: "cachegen/2" -> EncodingId("cachegen", 2).

    Raises:
      ValueError: not of the form "<codec>/<decimal level>".
    """
    if not isinstance(text, str) or text.count("/") != 1:
      raise ValueError(f"encoding {text!r} is not of the form 'codec/level'")
    codec, level = text.split("/")
    if not level.isdigit() or not level.isascii():
      raise ValueError(f"encoding {text!r}: level {level!r} is not a decimal int")
    return cls(codec, int(level))


@dataclasses.dataclass(frozen=True)
class Codec:
  """One registered codec.

  Attributes:
    name: codec id.
    version: the byte format version encoders write (recorded in each stored `Encoding`).
    levels: its levels, finest first (0 is the finest).
    lossless: decoding gives back the stored KV bit for bit.
    rel_l2_error: per level, the measured relative L2 error of a chunk (max over chunks; module
      docstring), the source of the accuracy ranks.
    chunk_parameter: the per-chunk group size its format derives from C ("group_tokens",
      "anchor_stride"), or None.
    reference: the paper and section the algorithm follows.
    default_level: the one level `LLM(kv_codec=...)` stores when `kv_codec_levels` is not given.
  """

  name: str
  version: int
  levels: tuple[int, ...]
  lossless: bool
  rel_l2_error: tuple[float, ...]
  chunk_parameter: str | None
  reference: str
  default_level: int = 0

  @property
  def encodings(self) -> tuple[EncodingId, ...]:
    """Its encodings, finest first."""
    return tuple(EncodingId(self.name, level) for level in self.levels)


#: Codec id -> its registry entry.
CODECS: Mapping[str, Codec] = {c.name: c for c in (
    Codec(RAW, 1, (0,), True, (0.0,), None,
          "the KV dtype's bytes, K before RoPE (no algorithm)"),
    Codec(INT8, 1, (0,), False, (0.0054,), None,
          "symmetric absmax quantization per channel over the C tokens (LLM.int8(), arXiv "
          "2208.07339, section 2.1)"),
    Codec(INT4, 1, (0,), False, (0.051,), "group_tokens",
          "asymmetric (zero-point) quantization per channel per group of G tokens, as KIVI "
          "quantizes keys (arXiv 2402.02750, section 3; zero-point: LLM.int8() section 2.1), "
          "with a clipping search"),
    Codec(CACHEGEN, 1, (0, 1, 2, 3), False, (0.016, 0.032, 0.063, 0.126), "anchor_stride",
          "CacheGen (arXiv 2310.07240, section 5.2): anchors per group of T tokens, deltas "
          "against the dequantized anchor, layer-wise bins growing with the level, entropy "
          "coding per layer (levels: section 5.3)", default_level=1),
    Codec(KVTC, 5, (0, 1, 2, 3, 4), False, (0.062, 0.135, 0.175, 0.201, 0.250), None,
          "KV transform coding (KVTC): each layer predicted from the reconstruction of the two "
          "layers before (closed-loop DPCM over layers, Jayant & Noll 1984, ch. 6), then the "
          "remainder whitened by the model's Fisher metric of each layer's K or V (calibrated "
          "once per model from gradients of sampled targets; Amari 1998) and transformed by its "
          "PCA over the channels of all KV heads (Pearson 1901, Hotelling 1933; transform coding "
          "under a weighted error, Gersho & Gray 1992, ch. 8), uniform deadzone quantization "
          "with one step for every component (reverse water-filling; Sullivan & Wiegand, IEEE "
          "SPM 1998, for the deadzone), the first token of a sequence (the attention sink, "
          "StreamingLLM arXiv 2309.17453) at 1/64 of the step, and entropy coding per band of "
          "components (`kvjax.kernels.kvtc`)", default_level=1),
)}
#: Codec id -> levels (0 is the finest).
CODEC_LEVELS: Mapping[str, tuple[int, ...]] = {c.name: c.levels for c in CODECS.values()}
#: Codec id -> the one level stored by default (`LLM(kv_codec_levels=None)`).
DEFAULT_LEVELS: Mapping[str, int] = {c.name: c.default_level for c in CODECS.values()}
#: Codec id -> the byte format version encoders write.
CODEC_VERSIONS: Mapping[str, int] = {c.name: c.version for c in CODECS.values()}
#: Every encoding, most accurate first (ties: codec name, level).
ENCODINGS: tuple[EncodingId, ...] = tuple(sorted(
    (e for c in CODECS.values() for e in c.encodings),
    key=lambda e: (CODECS[e.codec].rel_l2_error[CODECS[e.codec].levels.index(e.level)], e)))
#: Encoding -> accuracy rank (0 = exact; larger is coarser), its index in `ENCODINGS`. The level
#: policy loads the most accurate encoding that lands in time (CacheGen section 5.3).
ACCURACY_RANK: Mapping[EncodingId, int] = {e: rank for rank, e in enumerate(ENCODINGS)}


def check_codec(codec: str, levels: Iterable[int] | None = None) -> Codec:
  """The registry entry of `codec`, with `levels` (if given) checked against it.

  Raises:
    ValueError: unknown codec, or `levels` empty, not ints, or not all levels of the codec.
  """
  if not isinstance(codec, str) or codec not in CODECS:
    raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODECS)}")
  info = CODECS[codec]
  if levels is not None:
    got = list(levels) if isinstance(levels, (list, tuple)) else None
    if not got or any(isinstance(v, bool) or not isinstance(v, int) or v not in info.levels
                      for v in got):
      raise ValueError(f"codec {codec!r} has levels {list(info.levels)}, got {levels!r}")
  return info


def is_decodable(codec: str, version: int, level: int) -> bool:
  """Whether `codec` at `version` and `level` is a registered encoding (False, never raises)."""
  info = CODECS.get(codec) if isinstance(codec, str) else None
  return info is not None and version == info.version and level in info.levels


def _check_chunk_tokens(chunk_size: int) -> int:
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
    raise ValueError(f"chunk size {chunk_size!r} must be an int >= 1 (tokens per chunk)")
  return chunk_size


def _largest_divisor_at_most(n: int, cap: int) -> int:
  return next(d for d in range(min(n, cap), 0, -1) if n % d == 0)


def int4_group_tokens(chunk_size: int) -> int:
  """int4's G for chunks of `chunk_size` tokens: the largest divisor of C <= INT4_GROUP_TOKENS.

  Raises:
    ValueError: `chunk_size` is not an int >= 1.
  """
  return _largest_divisor_at_most(_check_chunk_tokens(chunk_size), INT4_GROUP_TOKENS)


def cachegen_anchor_stride(chunk_size: int) -> int:
  """CacheGen's T for chunks of `chunk_size` tokens: the largest divisor of C <=
  CACHEGEN_ANCHOR_STRIDE (a chunk has C // T anchors; arXiv 2310.07240, section 5.2).

  Raises:
    ValueError: `chunk_size` is not an int >= 1.
  """
  return _largest_divisor_at_most(_check_chunk_tokens(chunk_size), CACHEGEN_ANCHOR_STRIDE)


def check_chunk_size(codec: str, levels: Iterable[int] | None, chunk_size: int) -> None:
  """Checks that `codec` at `levels` can store chunks of `chunk_size` tokens.

  The rule of the module docstring takes every C >= 1, so this fails only on a bad codec, bad
  levels or a chunk size that is not a positive int; call it where options are read (the `LLM`
  does, before it loads weights), so nothing fails later in a saver thread.

  Args:
    codec: codec id.
    levels: the levels to store (None: all of the codec's).
    chunk_size: tokens per stored chunk, C.

  Raises:
    ValueError: with the reason.
  """
  check_codec(codec, levels)
  _check_chunk_tokens(chunk_size)
