"""KV codecs' byte formats: payload specs and payload <-> bytes (numpy, zstandard and pcodec; no
JAX). This docstring is the byte format's spec.

A *payload* is a codec's quantized form of one chunk `[L, 2, C, K, H]`: a dict of named arrays,
the table below. Codec ids, versions, levels and the rule deriving G and T from C are the
registry's (`kvjax.codecs`, shared with the kernels room); the kernels room computes payloads
from KV and KV from payloads (`kvjax.kernels.kv_codec`; its payload NamedTuples, in
`kvjax.kernels.kv_payloads`, have these array names); this module validates them and turns them into one stored bytes object and back.

    codec     version  levels  arrays (name: dtype[shape])
    raw       1        0       values: layout.dtype[L, 2, C, K, H]
    int8      1        0       q: int8[L, 2, C, K, H]; scale: float32[L, 2, K, H]
    int4      1        0       q: uint8[L, 2, C, K, H//2]; scale, zero: float16[L, 2, C//G, K, H]
    cachegen  1        0..3    anchor_q: int8[L, 2, A, K, H]; anchor_scale: float32[L, 2, K, H];
                               delta_q: int8[L, 2, C, K, H]; delta_step: float32[L, 2, K, H]
    kvtc      3        0..3    q: int16[L, 2, C, K*H]; step: float32[L, 2];
                               transform_id: uint8[16]

G (int4 tokens per group) and T = C // A (cachegen anchor stride) are read from the shapes; they
must divide C. Encoders use the registry's `int4_group_tokens(C)` and `cachegen_anchor_stride(C)`
(re-exported here).

Stored bytes (all integers little endian):

    "KVJC"  u8 container version (1)
    str codec  u16 codec version  u8 level  u8 number of arrays
    per array, in the codec's order:
      str name  str dtype  u8 ndim  u32 shape[ndim]  str coding  u64 stored bytes
      u32 CRC-32 of the decoded array's C-order bytes
    u32 CRC-32 of the header so far
    the arrays' stored bytes, back to back, nothing after
  (str = u8 length + ASCII)

Codings: "plain" (the C-order bytes), "zstd" (one zstandard frame, level 1), "pco" (int8 only:
`entropy.encode_groups`, one pcodec model per (layer, K/V) group). The encoder picks per array:
cachegen's `delta_q` and `anchor_q` are entropy-coded ("pco"); other arrays try "zstd"; either
falls back to "plain" when it does not save at least `MIN_SAVING`. kvtc's `q` is "rans-bands"
(`KVTC_Q_CODING`; `entropy.encode_components_rans`: one static rANS model per (layer, K/V, band
of PCA components), each band one interleaved-rANS encoding of `kvjax.storage.format.rans` (format
version 2: streams of 512 symbols in lanes of 256; version 1 bands still decode), decodable on
the device) or, for chunks stored before it (and if a model had more than 2**15 distinct
codes), "pco-bands" (`entropy.encode_components`: pcodec with the same models). On real SmolLM2
KV "rans-bands" stores 2.2-4.3% more bytes per token than "pco-bands" at the kvtc levels
(`scripts/bench_rans.py`, kvtc phase; its decode on a loaded 2-core CPU: 3.5 MB/s with the
jit'd jnp reference against pcodec's 13 MB/s on the host).
`decode_payload(defer_entropy=True)` (what `ChunkStore` reads with) returns a "rans-bands" array parsed and verified but not decoded,
as `entropy.RansCodes` (plain numpy), for the kernels' device decoder (`kvjax.kernels.kvtc_rans`,
run by the engine's store client); without it the array is decoded on the host (numpy rANS) and
CRC-checked like any other. A deferred array's CRC-32 is not checked (the rANS checksum of each
band and the device decoder's `ok` flag stand for it); the host tier keeps it in that form, and
`encode_payload` re-codes it from its decoded values.
kvtc's `transform_id` names the transform the codes are in; storage stores it like any array and
the store client rejects (as a miss) a chunk whose id is not its transform's. kvtc versions 1 (the
same arrays, coded without inter-layer prediction), 2 (another level ladder and rounding), 3 and
4 (other level ladders; version 4's transform steps each layer and K/V apart, version 5's is
whitened by the model's Fisher metric with one step) are no longer read: their chunks are
`UnknownCodec`, a miss that is recomputed. Decoders accept any
coding for any array ("pco" for int8 arrays only, "pco-bands" and "rans-bands" for int16 ones).

Entropy coder choice (CacheGen, arXiv 2310.07240, section 5.2). Measured with
`scripts/measure_entropy_coders.py` on real SmolLM2-135M KV (two 256-token chunks of book text,
K before RoPE, quantized by `kvjax.testing.codec_payloads`), 2-core CPU VM shared with other
jobs (rates +-30%), one thread, best of 3; bits per value include models and framing; decode
rate in compressed MB/s (1e6 bytes/s):

    delta_q            level 0         level 1         level 2         level 3
    coder              bits   MB/s     bits   MB/s     bits   MB/s     bits   MB/s
    plain              8.000           8.000           8.000           8.000
    zstd-1             5.202   628     4.199   601     3.181   214     2.593   147
    zstd-19            5.203   737     4.381   307     3.090   394     2.201   249
    ans per (L, K/V)   5.192    21     4.178    18     3.036    16     2.125    13
    ans, 2 per step    5.192    21     4.178    19     3.035    16     2.125    14
    ans per channel    5.771    12     4.576    11     3.272     7     2.270     6
    laplace/channel    5.333     4     4.334     3     3.199     2     2.287     1
    pco per (L, K/V)   5.191   168     4.189   156     3.049    99     2.137    72

  ans = constriction 0.5 AnsCoder with categorical models from the chunk's histogram (16-bit
  counts stored); "2 per step": pairs of symbols coded with the product model (2-4 per step
  gave at most 14.4 MB/s at level 3); "per channel": one categorical per (layer, K/V, head,
  channel); laplace: constriction QuantizedLaplace with a float16 location and scale per channel
  (per-symbol parameters). anchor_q (1/16 of the values: int8 of group means, absmax per
  channel) is near incompressible: plain 8, zstd-1 7.98, zstd-19 7.89, pco 7.93, ans 9.06.

  pco (pcodec 1.1: tANS with per-chunk bins, i.e. one categorical model per group) is chosen: its
  size is within 0.6% of constriction's ANS with the same per-layer models, and it decodes 5-8x
  faster. constriction's Python API decodes categoricals by binary search (about 20-45 ns per
  symbol, growing with the bits per symbol), which stays under 20 MB/s at the coarse levels
  even with several symbols per step; its table-lookup decoders are Rust-only. zstd decodes
  fastest, but its Huffman literals lose up to 21% at the coarse levels (zstd-19 recovers most
  of it, at encode times of seconds). Per-channel models cost more in stored tables than they
  save, because `delta_step` already normalises every channel.

  Whole cachegen payloads through `encode_payload`/`decode_payload` (same chunks): level 0..3
  8517 / 7074 / 5432 / 4119 bytes per token (raw float32 46080, bfloat16 23040; int8 11017,
  int4 5999), decode 180 / 95 / 89 / 78 MB/s including CRCs and checks, encode about 0.1 s.

  int8/int4 `q`: zstd-1 saves 6-7% (int8 1.063x, int4 1.069x, decode > 700 MB/s), the float
  side arrays 11-21%; pco saves less on them (1.05-1.06x). So they are zstd-coded.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Mapping, Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
import zstandard

from kvjax import codecs as registry
from kvjax.codecs import cachegen_anchor_stride, int4_group_tokens
from kvjax.storage.format import checksum
from kvjax.storage.format import entropy
from kvjax.storage.format.types import EncodedPayload, Encoding, KVLayout

MAGIC = b"KVJC"
CONTAINER_VERSION = 1
#: zstd level of "zstd"-coded arrays.
ZSTD_LEVEL = 1
#: A coding other than "plain" is kept only if it saves at least this fraction of the bytes.
MIN_SAVING = 0.02
CODINGS = ("plain", "zstd", "pco", "pco-bands", "rans-bands")
#: The coding `encode_payload` gives kvtc's `q` ("rans-bands": decodable on the device;
#: "pco-bands" chunks stored before it keep decoding on the host).
KVTC_Q_CODING = "rans-bands"
#: Codings whose arrays `decode_payload(defer_entropy=True)` returns parsed, not decoded (the
#: kernels room decodes them on the device).
DEVICE_CODINGS = ("rans-bands",)


class UnknownCodec(ValueError):
  """A codec id, version or level this reader does not know."""


class CorruptPayload(ValueError):
  """Stored payload bytes that are malformed, truncated or do not match what was asked for."""


class CodecVersionMismatch(CorruptPayload):
  """Payload bytes whose header names the asked codec and level at another byte-format version
  than their index record (written by another version of the codec): never decoded."""


@dataclasses.dataclass(frozen=True)
class CodecInfo:
  """One registered codec version.

  Attributes:
    name: codec id ("raw", "int8", "int4", "cachegen").
    version: byte format version.
    levels: the levels it has (0 is the finest).
    arrays: payload array names, in stored order.
  """

  name: str
  version: int
  levels: tuple[int, ...]
  arrays: tuple[str, ...]


#: Payload array names per codec, in stored order (the byte format's part of the contract).
_ARRAYS = {registry.RAW: ("values",), registry.INT8: ("q", "scale"),
           registry.INT4: ("q", "scale", "zero"),
           registry.CACHEGEN: ("anchor_q", "anchor_scale", "delta_q", "delta_step"),
           registry.KVTC: ("q", "step", "transform_id")}
#: (codec, version) -> entry, for every codec of the registry.
CODECS: dict[tuple[str, int], CodecInfo] = {
    (c.name, c.version): CodecInfo(c.name, c.version, c.levels, _ARRAYS[c.name])
    for c in registry.CODECS.values()}
#: The version `encode_payload` writes, per codec (the registry's).
CURRENT_VERSION = registry.CODEC_VERSIONS
#: Arrays that are entropy-coded ("pco"), with one model per (layer, K/V).
_ENTROPY_CODED = {("cachegen", "anchor_q"), ("cachegen", "delta_q")}


def codec_info(codec: str, version: int, level: int | None = None) -> CodecInfo:
  """The registry entry of `codec`/`version` (and a check of `level` if given).

  Raises:
    UnknownCodec: not registered, or `level` is not one of its levels.
  """
  info = CODECS.get((codec, version))
  if info is None:
    raise UnknownCodec(f"unknown codec {codec}/{version}")
  if level is not None and level not in info.levels:
    raise UnknownCodec(f"codec {codec}/{version} has no level {level} (levels {info.levels})")
  return info


def is_decodable(codec: str, version: int, level: int) -> bool:
  """Whether this reader can decode that encoding (`kvjax.codecs.is_decodable`)."""
  return registry.is_decodable(codec, version, level)


def other_versions(encodings: Sequence[Encoding]) -> str:
  """The encodings of a codec this reader knows at another byte-format version than the one it
  reads ("int8/v2/0,...", codec/version/level), or "" if none (the stored-chunk guard's
  CODEC_VERSION_MISMATCH)."""
  return ",".join(f"{e.codec}/v{e.codec_version}/{e.level}" for e in encodings
                  if e.codec in CURRENT_VERSION and e.codec_version != CURRENT_VERSION[e.codec])


Spec = dict[str, tuple[np.dtype, tuple[int, ...]]]


def payload_spec(codec: str, version: int, level: int, layout: KVLayout, *,
                 group_tokens: int | None = None, anchor_stride: int | None = None) -> Spec:
  """The arrays a payload must have: {name: (dtype, shape)}, in stored order.

  Args:
    codec, version, level: the encoding.
    layout: the raw layout the payload decodes to.
    group_tokens: int4's G (default `int4_group_tokens(C)`).
    anchor_stride: cachegen's T (default `cachegen_anchor_stride(C)`).

  Raises:
    UnknownCodec: unknown codec, version or level.
    ValueError: G or T does not divide C, or int4 with an odd head dim.
  """
  codec_info(codec, version, level)
  n_layers, c, n_kv_heads, head_dim = (layout.num_layers, layout.chunk_size,
                                       layout.num_kv_heads, layout.head_dim)
  full = (n_layers, 2, c, n_kv_heads, head_dim)
  per_channel = (n_layers, 2, n_kv_heads, head_dim)
  dt = np.dtype
  if codec == "raw":
    return {"values": (dt(layout.dtype), full)}
  if codec == "int8":
    return {"q": (dt(np.int8), full), "scale": (dt(np.float32), per_channel)}
  if codec == "kvtc":
    return {"q": (dt(np.int16), (n_layers, 2, c, n_kv_heads * head_dim)),
            "step": (dt(np.float32), (n_layers, 2)), "transform_id": (dt(np.uint8), (16,))}
  if codec == "int4":
    g = group_tokens or int4_group_tokens(c)
    if g < 1 or c % g:
      raise ValueError(f"int4 group of {g} tokens does not divide C={c}")
    if head_dim % 2:
      raise ValueError(f"int4 packs two codes per byte along H; H={head_dim} is odd")
    grouped = (n_layers, 2, c // g, n_kv_heads, head_dim)
    return {"q": (dt(np.uint8), (n_layers, 2, c, n_kv_heads, head_dim // 2)),
            "scale": (dt(np.float16), grouped), "zero": (dt(np.float16), grouped)}
  t = anchor_stride or cachegen_anchor_stride(c)
  if t < 1 or c % t:
    raise ValueError(f"cachegen anchor stride {t} does not divide C={c}")
  return {"anchor_q": (dt(np.int8), (n_layers, 2, c // t, n_kv_heads, head_dim)),
          "anchor_scale": (dt(np.float32), per_channel),
          "delta_q": (dt(np.int8), full), "delta_step": (dt(np.float32), per_channel)}


def _spec_for_shapes(codec: str, version: int, level: int, layout: KVLayout,
                     shapes: Mapping[str, tuple[int, ...]]) -> Spec:
  """`payload_spec` with G / T read from the given shapes (int4 scale, cachegen anchor_q)."""
  g = t = None
  if codec == "int4" and len(shapes.get("scale", ())) == 5:
    n_groups = shapes["scale"][2]
    if n_groups < 1 or layout.chunk_size % n_groups:
      raise ValueError(f"int4 scale has {n_groups} token groups; must divide C="
                       f"{layout.chunk_size}")
    g = layout.chunk_size // n_groups
  if codec == "cachegen" and len(shapes.get("anchor_q", ())) == 5:
    n_anchors = shapes["anchor_q"][2]
    if n_anchors < 1 or layout.chunk_size % n_anchors:
      raise ValueError(f"cachegen has {n_anchors} anchors; must divide C={layout.chunk_size}")
    t = layout.chunk_size // n_anchors
  return payload_spec(codec, version, level, layout, group_tokens=g, anchor_stride=t)


def _check_values(codec: str, name: str, a: np.ndarray) -> str | None:
  """What is wrong with an array's values (None if fine): NaN/inf side arrays, q of -128."""
  if codec == "raw":
    return None
  if a.dtype.kind == "f" and not np.isfinite(a).all():
    return f"{name} holds NaN or inf"
  if a.dtype == np.int8 and a.size and int(a.min()) < -127:
    return f"{name} holds -128 (codes are clipped to [-127, 127])"
  return None


def validate_payload(codec: str, version: int, level: int, arrays: Mapping[str, np.ndarray],
                     layout: KVLayout) -> dict[str, np.ndarray]:
  """Checks a payload against the contract.

  Returns:
    The arrays as C-contiguous numpy arrays, in stored order.

  Raises:
    UnknownCodec: unknown codec, version or level.
    ValueError: missing or extra arrays, a wrong dtype or shape, G or T not dividing C, NaN/inf
      in a float side array, or -128 in an int8 code array.
  """
  codec_info(codec, version, level)
  arrays = {k: v if isinstance(v, entropy.RansCodes) else np.asarray(v)
            for k, v in arrays.items()}
  spec = _spec_for_shapes(codec, version, level, layout,
                          {k: tuple(v.shape) for k, v in arrays.items()})
  if set(arrays) != set(spec):
    raise ValueError(f"{codec} payload needs arrays {sorted(spec)}, got {sorted(arrays)}")
  out = {}
  for name, (dtype, shape) in spec.items():
    a = arrays[name]
    if isinstance(a, entropy.RansCodes):  # codes a reader left coded (`decode_payload`)
      if dtype != np.int16 or tuple(a.shape) != shape:
        raise ValueError(f"{codec}.{name} must be {dtype}{list(shape)}, got rANS codes of "
                         f"{list(a.shape)}")
      out[name] = a
      continue
    if a.dtype != dtype or tuple(a.shape) != shape:
      raise ValueError(f"{codec}.{name} must be {dtype}{list(shape)}, got "
                       f"{a.dtype}{list(a.shape)}")
    bad = _check_values(codec, name, a)
    if bad:
      raise ValueError(f"{codec} payload: {bad}")
    out[name] = np.ascontiguousarray(a)
  return out


def _leaves(arrays: Mapping[str, np.ndarray | entropy.RansCodes]) -> list[np.ndarray]:
  out = []
  for a in arrays.values():
    out += a.leaves() if isinstance(a, entropy.RansCodes) else [np.asarray(a)]
  return out


def payload_nbytes(arrays: Mapping[str, np.ndarray | entropy.RansCodes]) -> int:
  """Bytes of a payload's arrays in memory (`RansCodes`: its parsed arrays)."""
  return sum(int(a.nbytes) for a in _leaves(arrays))


def payload_checksum(arrays: Mapping[str, np.ndarray | entropy.RansCodes],
                     algo: str = checksum.CURRENT) -> str:
  """Hex checksum (`storage.format.checksum`, xxh3-128 by default) over the arrays' C-order bytes in the
  given order (raw: the values' checksum; `RansCodes`: its parsed arrays)."""
  return checksum.digest_arrays(_leaves(arrays), algo)


def check_encodings(token_ids: tuple[int, ...], kv: np.ndarray | None, layout: KVLayout | None,
                    payloads: Sequence[EncodedPayload]) -> tuple[KVLayout, list[EncodedPayload]]:
  """Validates what a tier's `put` was given: raw KV and/or payloads of one chunk.

  Args:
    token_ids: the chunk's C token ids.
    kv: raw `[L, 2, C, K, H]` values, or None.
    layout: the raw layout the payloads decode to (default: `kv`'s; must agree with it).
    payloads: encodings to store; a "raw" one stands for `kv`.

  Returns:
    (layout, payloads): raw first (`{"values": C-contiguous kv}`, if any), then the others in
    the given order, each validated (`validate_payload`, arrays C-contiguous).

  Raises:
    ValueError: nothing to store, `kv` not `[L, 2, C, K, H]` with C == len(token_ids), raw given
      twice, no layout, a layout that disagrees, an invalid payload, or two payloads of one
      (codec, level).
    UnknownCodec: an unknown codec or level.
  """
  payloads = list(payloads)
  for p in payloads:
    if not isinstance(p, EncodedPayload):
      raise ValueError(f"payloads must be EncodedPayload records, got {type(p).__name__}")
  raw = [p for p in payloads if p.codec == "raw"]
  if raw:
    if kv is not None or len(raw) > 1:
      raise ValueError("raw KV given twice (kv and a raw payload, or two raw payloads)")
    if set(raw[0].arrays) != {"values"} or raw[0].level != 0:
      raise ValueError(f"a raw payload is level 0 with one array 'values', got level "
                       f"{raw[0].level} {sorted(raw[0].arrays)}")
    kv = raw[0].arrays["values"]
  if kv is None and not payloads:
    raise ValueError("nothing to store: no kv and no payloads")
  out = []
  if kv is not None:
    values = np.ascontiguousarray(kv)
    if values.ndim != 5 or values.shape[1] != 2 or values.shape[2] != len(token_ids):
      raise ValueError(f"kv must be [L, 2, C={len(token_ids)}, K, H], got {values.shape}")
    n_layers, _, c, n_kv_heads, head_dim = values.shape
    kv_layout = KVLayout(n_layers, c, n_kv_heads, head_dim, values.dtype.name)
    if layout is not None and layout != kv_layout:
      raise ValueError(f"layout {layout} does not match kv {kv_layout}")
    layout = kv_layout
    out.append(EncodedPayload("raw", 0, {"values": values}))
  if layout is None:
    raise ValueError("payloads without kv need the layout they decode to")
  if layout.chunk_size != len(token_ids):
    raise ValueError(f"layout has C={layout.chunk_size} tokens, token_ids {len(token_ids)}")
  seen = set()
  for p in payloads:
    if p.codec == "raw":
      continue
    if (p.codec, p.level) in seen:
      raise ValueError(f"two payloads of {p.codec} level {p.level}")
    seen.add((p.codec, p.level))
    if p.codec not in CURRENT_VERSION:
      raise UnknownCodec(f"unknown codec {p.codec!r}")
    out.append(EncodedPayload(p.codec, p.level, validate_payload(
        p.codec, CURRENT_VERSION[p.codec], p.level, p.arrays, layout)))
  return layout, out


# ---------------------------------------------------------------------------------------------
# Bytes.


def _str(s: str) -> bytes:
  b = s.encode("ascii")
  if len(b) > 255:
    raise ValueError(f"name too long: {s!r}")
  return struct.pack("<B", len(b)) + b


def _bytes_of(a: np.ndarray) -> memoryview:
  return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _code(codec: str, name: str, a: np.ndarray) -> tuple[str, bytes]:
  """(coding, stored bytes) of one array: entropy-coded or zstd if that saves, else plain."""
  plain = _bytes_of(a)
  if (codec, name) == ("kvtc", "q"):
    coded, coding = None, KVTC_Q_CODING
    if coding == "rans-bands":
      try:
        coded = entropy.encode_components_rans(a)
      except ValueError:  # a model with more distinct codes than one rANS table holds
        coding = "pco-bands"
    if coded is None:
      coded, coding = entropy.encode_components(a), "pco-bands"
  elif (codec, name) in _ENTROPY_CODED:
    coded, coding = entropy.encode_groups(a, a.shape[0] * 2), "pco"
  elif codec != "raw" and a.size:
    coded, coding = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(plain), "zstd"
  else:
    return "plain", bytes(plain)
  if len(coded) <= (1 - MIN_SAVING) * len(plain):
    return coding, coded
  return "plain", bytes(plain)


def encode_payload(codec: str, level: int, arrays: Mapping[str, np.ndarray],
                   layout: KVLayout) -> bytes:
  """A payload as one stored bytes object, in the codec's current version.

  Args:
    codec: codec id.
    level: its level.
    arrays: the payload (see `payload_spec`).
    layout: the raw layout the payload decodes to.

  Returns:
    The bytes (format in the module docstring).

  Raises:
    UnknownCodec: unknown codec or level.
    ValueError: the payload does not match the contract (see `validate_payload`).
  """
  if codec not in CURRENT_VERSION:
    raise UnknownCodec(f"unknown codec {codec!r}")
  version = CURRENT_VERSION[codec]
  checked = validate_payload(codec, version, level, arrays, layout)
  checked = {name: entropy.decode_rans_codes(a) if isinstance(a, entropy.RansCodes) else a
             for name, a in checked.items()}  # codes a reader left coded: re-coded from values
  head = [MAGIC, struct.pack("<B", CONTAINER_VERSION), _str(codec),
          struct.pack("<HBB", version, level, len(checked))]
  blobs = []
  for name, a in checked.items():
    coding, blob = _code(codec, name, a)
    head += [_str(name), _str(a.dtype.name), struct.pack(f"<B{a.ndim}I", a.ndim, *a.shape),
             _str(coding), struct.pack("<QI", len(blob), zlib.crc32(_bytes_of(a)))]
    blobs.append(blob)
  header = b"".join(head)
  return header + struct.pack("<I", zlib.crc32(header)) + b"".join(blobs)


class _Reader:
  """Bounds-checked reads from the front of a buffer; any overrun is CorruptPayload."""

  def __init__(self, data: memoryview):
    self.data = data
    self.pos = 0

  def take(self, n: int) -> memoryview:
    if n < 0 or self.pos + n > len(self.data):
      raise CorruptPayload(f"truncated payload: need {n} bytes at offset {self.pos}, "
                           f"have {len(self.data)}")
    out = self.data[self.pos:self.pos + n]
    self.pos += n
    return out

  def unpack(self, fmt: str) -> tuple:
    s = struct.Struct("<" + fmt)
    return s.unpack(self.take(s.size))

  def str(self) -> str:
    (n,) = self.unpack("B")
    try:
      return bytes(self.take(n)).decode("ascii")
    except UnicodeDecodeError as e:
      raise CorruptPayload(f"non-ASCII name in payload header: {e}") from e


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
  """One array's header entry: name, dtype name, shape, coding, stored bytes, CRC-32."""

  name: str
  dtype: str
  shape: tuple[int, ...]
  coding: str
  nbytes: int
  crc32: int


@dataclasses.dataclass(frozen=True)
class PayloadHeader:
  """The parsed header of stored payload bytes; `data_offset` is where the arrays start."""

  codec: str
  version: int
  level: int
  arrays: tuple[ArrayEntry, ...]
  data_offset: int


def read_header(data: bytes | memoryview) -> PayloadHeader:
  """Parses the header of stored payload bytes (no array is decoded).

  Raises:
    CorruptPayload: bad magic or container version, truncated or damaged header, or array
      lengths that do not add up to the bytes given.
  """
  view = memoryview(data).cast("B")
  r = _Reader(view)
  if bytes(r.take(4)) != MAGIC:
    raise CorruptPayload("not a kvjax payload (bad magic)")
  (container,) = r.unpack("B")
  if container != CONTAINER_VERSION:
    raise CorruptPayload(f"payload container version {container}, want {CONTAINER_VERSION}")
  codec = r.str()
  version, level, n_arrays = r.unpack("HBB")
  entries = []
  for _ in range(n_arrays):
    name, dtype = r.str(), r.str()
    (ndim,) = r.unpack("B")
    shape = r.unpack(f"{ndim}I")
    coding = r.str()
    nbytes, crc = r.unpack("QI")
    entries.append(ArrayEntry(name, dtype, tuple(shape), coding, nbytes, crc))
  header_end = r.pos
  (crc,) = r.unpack("I")
  if crc != zlib.crc32(view[:header_end]):
    raise CorruptPayload("payload header CRC mismatch")
  total = r.pos + sum(e.nbytes for e in entries)
  if total != len(view):
    raise CorruptPayload(f"payload of {len(view)} bytes, header says {total}")
  return PayloadHeader(codec, version, level, tuple(entries), r.pos)


def _decode_array(entry: ArrayEntry, blob: memoryview, dtype: np.dtype, defer: bool = False
                  ) -> np.ndarray | entropy.RansCodes:
  size = math.prod(entry.shape) * dtype.itemsize
  if entry.coding == "plain":
    if len(blob) != size:
      raise CorruptPayload(f"{entry.name}: {len(blob)} plain bytes, want {size}")
    return np.frombuffer(bytes(blob), dtype).reshape(entry.shape)
  if entry.coding == "zstd":
    try:
      raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
      raise CorruptPayload(f"{entry.name}: zstd: {e}") from e
    if len(raw) != size:
      raise CorruptPayload(f"{entry.name}: zstd gave {len(raw)} bytes, want {size}")
    return np.frombuffer(raw, dtype).reshape(entry.shape)
  if entry.coding == "pco":
    if dtype != np.int8:
      raise CorruptPayload(f"{entry.name}: pco coding of {dtype}")
    try:
      return entropy.decode_groups(blob, entry.shape)
    except entropy.EntropyError as e:
      raise CorruptPayload(f"{entry.name}: {e}") from e
  if entry.coding in ("pco-bands", "rans-bands"):
    if dtype != np.int16:
      raise CorruptPayload(f"{entry.name}: {entry.coding} coding of {dtype}")
    try:
      if entry.coding == "pco-bands":
        return entropy.decode_components(blob, entry.shape)
      codes = entropy.parse_components_rans(blob, entry.shape)
      return codes if defer else entropy.decode_rans_codes(codes)
    except entropy.EntropyError as e:
      raise CorruptPayload(f"{entry.name}: {e}") from e
  raise CorruptPayload(f"{entry.name}: unknown coding {entry.coding!r}")


def decode_payload(codec: str, version: int, level: int, data: bytes | memoryview,
                   layout: KVLayout, *, defer_entropy: bool = False
                   ) -> dict[str, np.ndarray | entropy.RansCodes]:
  """Stored payload bytes back to the payload's arrays (bit-exact).

  Args:
    codec, version, level: the encoding the index record says these bytes are.
    data: the stored bytes.
    layout: the raw layout the payload decodes to.
    defer_entropy: arrays of a device coding (`DEVICE_CODINGS`: kvtc's "rans-bands" `q`) come
      back parsed and verified but not decoded, as `entropy.RansCodes` (plain numpy), for the
      device decoder (`kvjax.kernels.kvtc_rans`); their CRC-32 of decoded values is not checked
      (the rANS checksum and the decoder's `ok` flag stand for it). False: decoded on the host
      (numpy rANS), CRC-checked like every array.

  Returns:
    {name: array} in stored order (fresh, writable arrays; `RansCodes` where deferred).

  Raises:
    UnknownCodec: `codec`/`version`/`level` is not one this reader knows.
    CodecVersionMismatch: the header names `codec` and `level` at another version (a
      `CorruptPayload`).
    CorruptPayload: anything malformed, truncated, damaged (CRC) or not matching the requested
      encoding and layout.
  """
  codec_info(codec, version, level)
  header = read_header(data)
  if (header.codec, header.level) == (codec, level) and header.version != version:
    raise CodecVersionMismatch(f"payload is {codec} version {header.version}, its record says "
                               f"version {version}")
  if (header.codec, header.version, header.level) != (codec, version, level):
    raise CorruptPayload(f"payload is {header.codec}/{header.version} level {header.level}, "
                         f"want {codec}/{version} level {level}")
  shapes = {e.name: e.shape for e in header.arrays}
  if len(shapes) != len(header.arrays):
    raise CorruptPayload("payload lists an array twice")
  try:
    spec = _spec_for_shapes(codec, version, level, layout, shapes)
  except ValueError as e:
    raise CorruptPayload(str(e)) from e
  if [e.name for e in header.arrays] != list(spec):
    raise CorruptPayload(f"payload arrays {list(shapes)}, want {list(spec)}")
  view = memoryview(data).cast("B")
  pos = header.data_offset
  out = {}
  for entry in header.arrays:
    dtype, shape = spec[entry.name]
    if entry.dtype != dtype.name or entry.shape != shape:
      raise CorruptPayload(f"{entry.name} is {entry.dtype}{list(entry.shape)}, want "
                           f"{dtype.name}{list(shape)}")
    a = _decode_array(entry, view[pos:pos + entry.nbytes], dtype, defer_entropy)
    pos += entry.nbytes
    if isinstance(a, entropy.RansCodes):
      out[entry.name] = a
      continue
    if zlib.crc32(_bytes_of(a)) != entry.crc32:
      raise CorruptPayload(f"{entry.name}: CRC mismatch after decoding")
    bad = _check_values(codec, entry.name, a)
    if bad:
      raise CorruptPayload(bad)
    if not a.flags.writeable:
      a = a.copy()
    out[entry.name] = a
  return out
