"""Interleaved rANS over many independent lanes: a byte format decoded one lane per state.

rANS is Duda's range variant of asymmetric numeral systems (arXiv 1311.2540, section 4); the
lanes share one word array per block the way Giesen interleaves SIMD coders ("Interleaved
entropy coders", arXiv 1402.3392, section 3) and DietGPU lays out a warp (32 lanes, 16-bit
words, short segments of a long input each with its own state). Encoding and the reference
decoder are numpy here (storage imports no JAX); the device decoders
(`kvjax.kernels.rans_decode`: a jit'd jnp reference and Pallas kernels) take what `parse`
returns.

Axis letters of this module (local to the entropy format, not `kvjax._typing`'s key):
M models (frequency tables, one per stream group), T steps (symbols per stream, at most),
S streams per model, K segments per stream, U = ceil(T / K) steps per lane, L = S * K lanes per
model, J blocks per model (J = ceil(L / B)), B lanes per block, W words per block (padded),
A alphabet size, Z = 2**scale_bits slots.

    symbols_MTS[m, t, s]: symbol t of stream s of model m (KV [L, 2, C, K, H] as
    [L * 2, C, K * H] is one stream per (layer, K/V, head, channel) over the C tokens).

    stream s of model m:  symbols 0 .. U-1 | U .. 2U-1 | ... | (K-1)U .. T-1   (segments k)
    lane l = s * K + k decodes segment k of stream s with a state of its own (version 2;
    version 1 is K = 1: a lane per stream)
    model m:   lanes 0 .. B-1 | B .. 2B-1 | ... | (J-1)B .. L-1, pad        (blocks j = 0 .. J-1)
    block (m, j): B lanes, one 32-bit state each, one shared word array:
      step 0: lanes that renormalise read the next words in lane order (0, 3, 7 below)
      step 1: ...
                  words: [w(t0,l0) w(t0,l3) w(t0,l7) w(t1,l2) ...]   <- pos advances by the
                                                                        number of readers

Coder (per lane, state x in [2**16, 2**32), 16-bit words, one table of frequencies f summing
to Z = 2**n, cumulative c):
    encode s (symbols in reverse): if x >= f[s] << (32 - n): emit x & 0xFFFF, x >>= 16;
                                   x = (x // f[s]) << n | (x % f[s]) + c[s]
    decode:  slot = x & (Z - 1); s = sym[slot]; x = f[s] * (x >> n) + slot - c[s];
             if x < 2**16: x = x << 16 | next word        (at most one word per symbol)
The encoder starts every lane at 2**16, so a decoder that ends a lane elsewhere, or a block
anywhere but at its last word, has read damaged bytes.

Byte format, version 2 (what `encode` writes; little endian):

    "KVRA" u8 version (2) u8 scale_bits n (8..15) u8 flags u8 0
           (flags bit 0: explicit lengths; bit 1: the side data is one zstd frame)
    u32 M  u32 S  u32 T  u32 B  u32 A (1..65536)  u32 K (1..max(T, 1))  u64 total bytes
    16 B   xxh3-128 of every byte of the encoding except these 16 (`checksum.XXH3_128`)
    u32 nbytes, then nbytes of side data: with flag bit 1 a zstd frame holding the section
      below (the encoder compresses when that is shorter), else the section itself:
      per model: u32 lo  u32 count  u8 freq[count]  u16 big[number of 255s in freq]
                   (frequencies of symbols lo .. lo+count-1, the others 0; a byte 255 means
                   "the next u16 of big", so small tail frequencies cost one byte; count 0: no
                   stream of m has a symbol)
      u32 lengths[M * S]                    (only with flag bit 0; else all T) of the streams
      u8 state bytes [4][N]: the N = lanes with length > 0 (in (m, l) order) as four byte
                   planes, least significant first (lane l's length: its stream's symbols in
                   k * U .. k * U + U - 1)
      u32 words[M * J]                      (16-bit words per block)
    u16 word arrays of the blocks, (m, j) order, back to back, nothing after

Version 1 (still read; `encode(version=1)` writes it for tests): no K field (K = 1, a 36-byte
header before the checksum), no nbytes, the side data never compressed and the states u32
values (`u32 state[N]`) in place of the planes; flags bit 1 unused.

Costs: 4 bytes per non-empty lane (its final state; it holds about a byte of its symbols, so a
lane costs about 3 bytes over one long stream, less after zstd: the states' high bytes are
mostly small) on top of the words, 8 + count + 2 * (frequencies >= 255) bytes per model before
zstd (frequency tables are smooth: zstd -19 took two thirds off those of a synthetic kvtc
chunk), 60 bytes of header and length; measured against the empirical entropy and pcodec/zstd in
`tests/unit/storage/rans_test.py` and `scripts/bench_rans.py`.
"""

from __future__ import annotations

import heapq
import math
import struct
from typing import NamedTuple

import numpy as np
import zstandard

from kvjax.storage.format import checksum

MAGIC = b"KVRA"
#: The version `encode` writes; `parse` reads every one of VERSIONS.
VERSION = 2
VERSIONS = (1, 2)
#: Smallest and largest quantization precision (Z = 2**scale_bits); 2**16 would not fit u16.
MIN_SCALE_BITS, MAX_SCALE_BITS = 8, 15
DEFAULT_SCALE_BITS = 12
#: Lanes per block: a GPU warp (a TPU vreg row is 128; any B >= 1 decodes).
DEFAULT_LANES = 32
MAX_ALPHABET = 1 << 16
#: The state's lower bound L = 2**16 (also the encoder's initial state) and word size b = 2**16.
STATE_LOWER = 1 << 16
WORD_BITS = 16
#: Guards against headers that ask for absurd allocations (checked before allocating).
MAX_SYMBOLS = 1 << 32

_FLAG_LENGTHS = 1
_FLAG_ZSTD_META = 2
#: Frequencies below this take one byte in a table; the others the byte 255 and a u16.
_ESCAPE = 255
#: Version 1's header (without the checksum) and version 2's (one more u32: K).
_HEAD = struct.Struct("<4sBBBBIIIIIQ")
_HEAD_BYTES = _HEAD.size + 16
_HEAD2 = struct.Struct("<4sBBBBIIIIIIQ")
_HEAD2_BYTES = _HEAD2.size + 16
_TABLE = struct.Struct("<II")
_U32 = struct.Struct("<I")
#: zstd level of version 2's side data (small next to the words: level 19 costs milliseconds).
_ZSTD_LEVEL = 19


class RansError(ValueError):
  """Bytes that are not a valid rANS encoding: truncated, damaged (checksum), or inconsistent.

  `kvjax.storage.format.codecs` turns it into `CorruptPayload` the way it does `entropy.EntropyError`
  (this module does not import codecs, so codecs may import it).
  """


class RansArrays(NamedTuple):
  """Fixed-shape arrays a decoder needs (numpy; what `parse` returns).

  Field names are the keyword arguments of `kvjax.kernels.rans_decode.rans_decode` and
  `rans_decode_reference`: `rans_decode(**parse(data)._asdict())`. The arrays are per lane
  (L = S * K lanes per model, each decoding U = ceil(T / K) steps: `steps_per_lane`); decoders
  return symbols per stream.

  Attributes:
    words: uint16[M, J, W] each block's word array, zero-padded to W (`parse`'s bucket).
    states: uint32[M, J, B] initial decoder state per lane (2**16 on empty and padding lanes).
    lengths: int32[M, J, B] symbols per lane, 0..U (0 on padding lanes).
    num_words: int32[M, J] words each block holds (the rest of its row is padding).
    freqs: int32[M, A] quantized frequencies; each row sums to 2**scale_bits (or is all 0).
    scale_bits: n, the precision (Z = 2**n).
    num_streams: S, streams per model (lanes past S * K are padding).
    num_steps: T, the longest stream.
    segments: K, lanes per stream (1 in version 1).
  """
  words: np.ndarray
  states: np.ndarray
  lengths: np.ndarray
  num_words: np.ndarray
  freqs: np.ndarray
  scale_bits: int
  num_streams: int
  num_steps: int
  segments: int = 1


def steps_per_lane(num_steps: int, segments: int) -> int:
  """U = ceil(T / K): the steps every lane of an encoding decodes (0 when T = 0)."""
  return -(-int(num_steps) // max(1, int(segments)))


def segments_for(num_steps: int, lane_steps_max: int | None) -> int:
  """K: the fewest segments per stream so that no lane decodes more than `lane_steps_max`
  steps (None: 1, a lane per stream).

  Raises:
    ValueError: lane_steps_max below 1.
  """
  if lane_steps_max is None:
    return 1
  if not isinstance(lane_steps_max, (int, np.integer)) or lane_steps_max < 1:
    raise ValueError(f"lane_steps must be a positive int, got {lane_steps_max!r}")
  return max(1, -(-int(num_steps) // int(lane_steps_max)))


def stream_lengths(arrays: RansArrays) -> np.ndarray:
  """int32[M, S] symbols per stream: the lane lengths of `arrays` summed over segments."""
  m_, j_, b_ = arrays.lengths.shape
  k_, s_ = max(1, arrays.segments), arrays.num_streams
  lanes = arrays.lengths.reshape(m_, j_ * b_)[:, :s_ * k_]
  return lanes.reshape(m_, s_, k_).sum(axis=2).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Models


def quantize_frequencies(counts: np.ndarray, scale_bits: int = DEFAULT_SCALE_BITS) -> np.ndarray:
  """Symbol counts -> frequencies summing to 2**scale_bits, every present symbol at least 1.

  Starts from the rounded proportional share and moves single units where they cost the fewest
  bits (`counts[i] * log2(f[i] / f'[i])`), so the coded size stays near the empirical entropy.

  Args:
    counts: int[A] occurrences of each symbol (not all 0).
    scale_bits: n in MIN_SCALE_BITS..MAX_SCALE_BITS.

  Returns:
    int64[A] frequencies (0 exactly where counts is 0) summing to 2**n.

  Raises:
    ValueError: no symbol, more distinct symbols than 2**n, or a bad scale_bits.
  """
  _check_scale_bits(scale_bits)
  counts = np.asarray(counts, np.int64)
  total, z = int(counts.sum()), 1 << scale_bits
  present = counts > 0
  if total == 0:
    raise ValueError("no symbols to model")
  if int(present.sum()) > z:
    raise ValueError(f"{int(present.sum())} distinct symbols do not fit 2**{scale_bits} slots; "
                     f"raise scale_bits")
  freqs = np.where(present, np.maximum(1, np.rint(counts * (z / total))), 0).astype(np.int64)
  diff = z - int(freqs.sum())
  idx = np.flatnonzero(present)
  if diff > 0:  # add where one more unit saves the most bits
    heap = [(-counts[i] * math.log2((freqs[i] + 1) / freqs[i]), i) for i in idx]
    heapq.heapify(heap)
    for _ in range(diff):
      _, i = heapq.heappop(heap)
      freqs[i] += 1
      heapq.heappush(heap, (-counts[i] * math.log2((freqs[i] + 1) / freqs[i]), i))
  elif diff < 0:  # take where one unit less costs the fewest bits
    heap = [(counts[i] * math.log2(freqs[i] / (freqs[i] - 1)), i) for i in idx if freqs[i] > 1]
    heapq.heapify(heap)
    for _ in range(-diff):
      _, i = heapq.heappop(heap)
      freqs[i] -= 1
      if freqs[i] > 1:
        heapq.heappush(heap, (counts[i] * math.log2(freqs[i] / (freqs[i] - 1)), i))
  return freqs


def empirical_entropy_bits(symbols_MTS: np.ndarray, lengths_MS: np.ndarray | None = None) -> float:
  """Order-0 entropy in bits of all symbols, one model per m: the bound this format approaches.

  Args:
    symbols_MTS: int[M, T, S] symbols (as for `encode`).
    lengths_MS: int[M, S] symbols per stream (default T each).
  """
  symbols_MTS, lengths_MS = _check_symbols(symbols_MTS, lengths_MS)
  mask = np.arange(symbols_MTS.shape[1])[None, :, None] < lengths_MS[:, None, :]
  bits = 0.0
  for m in range(symbols_MTS.shape[0]):
    counts = np.bincount(symbols_MTS[m][mask[m]].astype(np.int64))
    counts = counts[counts > 0]
    if counts.size:
      n = counts.sum()
      bits += float(-(counts * np.log2(counts / n)).sum())
  return bits


# ---------------------------------------------------------------------------------------------
# Encoder


def encode(symbols_MTS: np.ndarray, lengths_MS: np.ndarray | None = None, *,
           scale_bits: int = DEFAULT_SCALE_BITS, lanes: int = DEFAULT_LANES,
           alphabet: int | None = None, lane_steps: int | None = None,
           version: int = VERSION) -> bytes:
  """Encodes M x S streams, one static frequency table per model m (built from its symbols).

  Vectorized across all lanes: one numpy pass per step, U steps in reverse.

  Args:
    symbols_MTS: uint8/uint16 (any integer dtype)[M, T, S]; symbol t of stream s of model m,
      in [0, alphabet). Values past a stream's length are ignored.
    lengths_MS: int[M, S] symbols in each stream, 0..T (default: T each).
    scale_bits: n, frequencies sum to 2**n (8..15; 12 keeps the decode table at 4096 slots).
    lanes: B, lanes per block (the decoder's SIMD width; a block shares one word array).
    alphabet: A, 1..65536 (default 256 when every symbol is below 256, else 65536). Stored in
      the header; `parse` gives freqs of A columns.
    lane_steps: the most steps a lane decodes: each stream is cut into K = ceil(T / lane_steps)
      segments of U = ceil(T / K) symbols, each a lane with its own state (about 3 bytes per
      lane more); None: K = 1, a lane per stream. Version 2 only.
    version: 2 (the default, the module docstring's format) or 1 (the previous format, for
      tests of readers of old bytes: K = 1, tables uncompressed).

  Returns:
    The encoding (format in the module docstring).

  Raises:
    ValueError: bad shapes, dtypes or lengths, symbols outside the alphabet, a bad scale_bits,
      lanes, lane_steps or version, or a model with more distinct symbols than 2**n.
  """
  _check_scale_bits(scale_bits)
  symbols_MTS, lengths_MS = _check_symbols(symbols_MTS, lengths_MS)
  m_, t_, s_ = symbols_MTS.shape
  if not isinstance(lanes, (int, np.integer)) or lanes < 1:
    raise ValueError(f"lanes must be a positive int, got {lanes!r}")
  if version not in VERSIONS:
    raise ValueError(f"version must be one of {VERSIONS}, got {version!r}")
  k_ = segments_for(t_, lane_steps)
  if version == 1 and k_ != 1:
    raise ValueError("version 1 has one lane per stream: lane_steps needs version 2")
  mask_MTS = np.arange(t_)[None, :, None] < lengths_MS[:, None, :]
  top = int(symbols_MTS[mask_MTS].max(initial=0))
  if alphabet is None:
    alphabet = 256 if top < 256 else MAX_ALPHABET
  if not 1 <= alphabet <= MAX_ALPHABET:
    raise ValueError(f"alphabet must be 1..{MAX_ALPHABET}, got {alphabet}")
  if mask_MTS.any() and (top >= alphabet or int(symbols_MTS[mask_MTS].min()) < 0):
    raise ValueError(f"symbols must lie in [0, {alphabet})")

  freqs_MA = np.zeros((m_, alphabet), np.int64)
  for m in range(m_):
    counts = np.bincount(symbols_MTS[m][mask_MTS[m]].astype(np.int64), minlength=alphabet)
    if counts.any():
      freqs_MA[m] = quantize_frequencies(counts, scale_bits)

  # Lanes: segment k of stream s is lane s * K + k, its symbols k * U .. k * U + U - 1.
  u_ = steps_per_lane(t_, k_)
  sym = np.pad(symbols_MTS, ((0, 0), (0, k_ * u_ - t_), (0, 0)))
  sym_MUL = sym.reshape(m_, k_, u_, s_).transpose(0, 2, 3, 1).reshape(m_, u_, s_ * k_)
  len_ML = np.clip(lengths_MS[:, :, None] - np.arange(k_) * u_, 0, u_).reshape(m_, s_ * k_)
  states, num_words, words = _encode_lanes(sym_MUL, len_ML, freqs_MA, scale_bits, int(lanes))

  explicit = bool((lengths_MS != t_).any())
  tables = []
  for m in range(m_):
    nz = np.flatnonzero(freqs_MA[m])
    lo, count = (int(nz[0]), int(nz[-1] - nz[0] + 1)) if nz.size else (0, 0)
    f = freqs_MA[m, lo:lo + count]
    tables += [_TABLE.pack(lo, count), np.minimum(f, _ESCAPE).astype(np.uint8).tobytes(),
               f[f >= _ESCAPE].astype("<u2").tobytes()]
  flags = _FLAG_LENGTHS if explicit else 0
  lengths_bytes = lengths_MS.astype("<u4").tobytes() if explicit else b""
  if version == 1:
    parts = tables + [lengths_bytes, states.astype("<u4").tobytes(),
                      num_words.astype("<u4").tobytes()]
  else:
    # The side data, states as byte planes (their high bytes are mostly small), one zstd
    # frame when that is shorter.
    planes = states.astype("<u4").view(np.uint8).reshape(-1, 4).T.tobytes()
    meta = b"".join(tables + [lengths_bytes, planes, num_words.astype("<u4").tobytes()])
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(meta)
    if len(packed) < len(meta):
      meta, flags = packed, flags | _FLAG_ZSTD_META
    parts = [_U32.pack(len(meta)), meta]
  parts.append(words.astype("<u2").tobytes())
  body = b"".join(parts)
  if version == 1:
    head = _HEAD.pack(MAGIC, 1, scale_bits, flags, 0, m_, s_, t_, int(lanes), alphabet,
                      _HEAD_BYTES + len(body))
  else:
    head = _HEAD2.pack(MAGIC, 2, scale_bits, flags, 0, m_, s_, t_, int(lanes), alphabet, k_,
                       _HEAD2_BYTES + len(body))
  return b"".join([head, _digest(head, body), body])


def _encode_lanes(sym_MUL: np.ndarray, len_ML: np.ndarray, freqs_MA: np.ndarray,
                  scale_bits: int, lanes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The coder over every lane at once: (states uint32[non-empty lanes] in (m, l) order,
  num_words int64[M * J], words uint16[sum num_words] in (m, j, step, lane) order)."""
  m_, u_, l_ = sym_MUL.shape
  alphabet = freqs_MA.shape[1]
  cum_MA = np.cumsum(freqs_MA, axis=1) - freqs_MA
  b_, j_ = lanes, -(-l_ // lanes)
  pad = j_ * b_ - l_
  sym = np.pad(sym_MUL, ((0, 0), (0, 0), (0, pad))).astype(np.int64)         # [M, U, JB]
  length = np.pad(len_ML, ((0, 0), (0, pad))).reshape(-1)                     # [MJB]
  base = (np.arange(m_, dtype=np.int64) * alphabet)[:, None]                  # [M, 1]
  f_flat, c_flat = freqs_MA.reshape(-1), cum_MA.reshape(-1)
  x = np.full(m_ * j_ * b_, STATE_LOWER, np.uint64)
  need_U = np.zeros((u_, m_ * j_ * b_), bool)
  word_U = np.zeros((u_, m_ * j_ * b_), np.uint16)
  shift = np.uint64(32 - scale_bits)
  for t in range(u_ - 1, -1, -1):
    active = t < length
    k = (base + sym[:, t]).reshape(-1)
    f = f_flat[k].astype(np.uint64)
    c = c_flat[k].astype(np.uint64)
    need = active & (x >= (f << shift))
    need_U[t] = need
    word_U[t] = (x & np.uint64(0xFFFF)).astype(np.uint16)
    x = np.where(need, x >> np.uint64(WORD_BITS), x)
    fa = np.where(active, f, np.uint64(1))
    x = np.where(active, ((x // fa) << np.uint64(scale_bits)) + (x % fa) + c, x)
  # Block (m, j) reads step by step, lanes ascending: C order of [MJ, U, B].
  need_KUB = need_U.reshape(u_, m_ * j_, b_).transpose(1, 0, 2)
  words = word_U.reshape(u_, m_ * j_, b_).transpose(1, 0, 2)[need_KUB]
  num_words = need_KUB.sum(axis=(1, 2))
  states = x.reshape(m_, j_ * b_)[:, :l_][len_ML > 0].astype(np.uint32)
  return states, num_words, words


# ---------------------------------------------------------------------------------------------
# Parsing (every check happens here, before any decoder runs)


def parse(data: bytes | memoryview, *, words_per_block: int | None = None) -> RansArrays:
  """Validates an encoding (version 1 or 2) and unpacks it into the fixed-shape arrays the
  decoders take.

  Args:
    data: the bytes of `encode`.
    words_per_block: W, the padded width of `words` (>= the longest block). Default: the
      longest block rounded up to a power of two (at least 64), so jit'd decoders see few
      distinct shapes; pass a per-model bound to get one shape.

  Returns:
    `RansArrays` (shapes and dtypes in its docstring).

  Raises:
    RansError: bad magic or version, truncated or trailing bytes, checksum mismatch, a table
      section that does not decompress or fill its models exactly, a table that does not sum
      to 2**n or leaves the alphabet, lengths past T, a non-empty stream of a model without a
      table, states outside [2**16, 2**32), word counts that do not add up.
    ValueError: words_per_block below the longest block.
  """
  view = memoryview(data).cast("B")
  if len(view) < _HEAD_BYTES:
    raise RansError(f"truncated rANS header: {len(view)} bytes, need {_HEAD_BYTES}")
  if bytes(view[:4]) != MAGIC:
    raise RansError("not a kvjax rANS encoding (bad magic)")
  version = view[4]
  if version not in VERSIONS:
    raise RansError(f"rANS format version {version}, this reader knows {VERSIONS}")
  if version == 1:
    head, head_bytes = _HEAD, _HEAD_BYTES
  else:
    head, head_bytes = _HEAD2, _HEAD2_BYTES
    if len(view) < head_bytes:
      raise RansError(f"truncated rANS header: {len(view)} bytes, need {head_bytes}")
  fields = head.unpack_from(view, 0)
  _, _, n, flags, reserved, m_, s_, t_, b_, a_ = fields[:10]
  k_, total = (1, fields[10]) if version == 1 else fields[10:12]
  if total != len(view):
    raise RansError(f"rANS encoding of {len(view)} bytes, header says {total} (truncated or "
                    f"trailing bytes)")
  if bytes(view[head.size:head_bytes]) != _digest(view[:head.size], view[head_bytes:]):
    raise RansError("rANS checksum mismatch (damaged bytes)")
  known = _FLAG_LENGTHS | (_FLAG_ZSTD_META if version == 2 else 0)
  if not MIN_SCALE_BITS <= n <= MAX_SCALE_BITS or flags & ~known or reserved:
    raise RansError(f"bad rANS header: scale_bits {n}, flags {flags}, reserved {reserved}")
  if not 1 <= a_ <= MAX_ALPHABET or b_ < 1 or m_ * s_ * max(t_, 1) > MAX_SYMBOLS:
    raise RansError(f"bad rANS header: M={m_} S={s_} T={t_} B={b_} A={a_}")
  if not 1 <= k_ <= max(t_, 1):
    raise RansError(f"bad rANS header: K={k_} segments for T={t_} steps")
  u_, l_ = steps_per_lane(t_, k_), s_ * k_
  j_ = -(-l_ // b_)
  if m_ * j_ * b_ > MAX_SYMBOLS or m_ * a_ > MAX_SYMBOLS:
    raise RansError(f"bad rANS header: M={m_} S={s_} K={k_} B={b_} A={a_}")
  r = _Reader(view, head_bytes)

  len_bound = m_ * (_TABLE.size + 3 * a_) + 4 * m_ * (s_ + l_ + j_)
  if version == 2:
    (meta_bytes,) = r.unpack(_U32)
    meta = r.take(meta_bytes)
    if flags & _FLAG_ZSTD_META:
      try:
        meta = memoryview(zstandard.ZstdDecompressor().decompress(
            bytes(meta), max_output_size=len_bound))
      except zstandard.ZstdError as e:
        raise RansError(f"rANS side data does not decompress: {e}") from e
    side = _Reader(meta, 0)
  else:
    side = r
  freqs = _read_tables(side, m_, a_, n)
  if flags & _FLAG_LENGTHS:
    lengths_MS = side.array("<u4", m_ * s_).reshape(m_, s_).astype(np.int64)
    if (lengths_MS > t_).any():
      raise RansError(f"stream lengths exceed T={t_}")
  else:
    lengths_MS = np.full((m_, s_), t_, np.int64)
  empty_models = ~freqs.any(axis=1)
  if ((lengths_MS > 0) & empty_models[:, None]).any():
    raise RansError("a non-empty stream belongs to a model without a table")
  len_ML = np.clip(lengths_MS[:, :, None] - np.arange(k_) * u_, 0, u_).reshape(m_, l_)
  live = len_ML > 0
  if version == 1:
    stored = side.array("<u4", int(live.sum()))
  else:  # four byte planes
    planes = side.array("u1", 4 * int(live.sum())).reshape(4, -1).astype(np.uint32)
    stored = planes[0] | planes[1] << 8 | planes[2] << 16 | planes[3] << 24
  if (stored < STATE_LOWER).any():
    raise RansError("rANS state below 2**16")
  counts = side.array("<u4", m_ * j_).astype(np.int64)
  if (counts > u_ * b_).any():
    raise RansError("a block holds more words than steps x lanes")
  if side is not r and side.pos != len(side.view):
    raise RansError(f"rANS side data ends at byte {side.pos} of {len(side.view)}")
  words_flat = r.array("<u2", int(counts.sum()))
  if r.pos != len(view):
    raise RansError(f"rANS sections end at byte {r.pos} of {len(view)}")

  longest = int(counts.max(initial=0))
  if words_per_block is None:
    w_ = max(64, 1 << max(longest - 1, 0).bit_length())
  elif words_per_block < longest:
    raise ValueError(f"words_per_block={words_per_block} < the longest block ({longest})")
  else:
    w_ = max(1, int(words_per_block))  # decoders want W >= 1
  words = np.zeros((m_ * j_, w_), np.uint16)
  cols = np.arange(w_)[None, :]
  words[cols < counts[:, None]] = words_flat
  states_ML = np.full((m_, l_), STATE_LOWER, np.uint32)
  states_ML[live] = stored
  pad = ((0, 0), (0, j_ * b_ - l_))
  states = np.pad(states_ML, pad, constant_values=STATE_LOWER).reshape(m_, j_, b_)
  lengths = np.pad(len_ML, pad).astype(np.int32).reshape(m_, j_, b_)
  return RansArrays(words.reshape(m_, j_, w_), states, lengths,
                    counts.astype(np.int32).reshape(m_, j_), freqs, int(n), int(s_), int(t_),
                    int(k_))


def _read_tables(r: "_Reader", m_: int, a_: int, n: int) -> np.ndarray:
  """int32[M, A] frequencies from the table section at r (the module docstring)."""
  z = 1 << n
  freqs = np.zeros((m_, a_), np.int32)
  for m in range(m_):
    lo, count = r.unpack(_TABLE)
    if lo + count > a_:
      raise RansError(f"model {m}: symbols {lo}..{lo + count - 1} leave the alphabet of {a_}")
    f = r.array("u1", count).astype(np.int64)
    escaped = f == _ESCAPE
    f[escaped] = r.array("<u2", int(escaped.sum()))
    if (f[escaped] < _ESCAPE).any():
      raise RansError(f"model {m}: escaped frequency below {_ESCAPE}")
    if count and int(f.sum()) != z:
      raise RansError(f"model {m}: frequencies sum to {int(f.sum())}, want {z}")
    freqs[m, lo:lo + count] = f
  return freqs


# ---------------------------------------------------------------------------------------------
# Reference decoder (numpy, vectorized across every lane of every block)


def decode_tables(freqs: np.ndarray, scale_bits: int) -> tuple[np.ndarray, np.ndarray,
                                                               np.ndarray]:
  """Slot -> (symbol, frequency, slot - cumulative) tables of each model.

  Args:
    freqs: int[M, A] rows summing to 2**scale_bits (all-0 rows give garbage, unused).

  Returns:
    (sym, freq, bias), each int64[M, 2**scale_bits].
  """
  freqs = np.asarray(freqs, np.int64)
  z = 1 << scale_bits
  incl = np.cumsum(freqs, axis=1)
  slots = np.arange(z)
  sym = np.stack([np.searchsorted(row, slots, side="right") for row in incl]) if len(incl) else \
      np.zeros((0, z), np.int64)
  sym = np.minimum(sym, freqs.shape[1] - 1)
  f = np.take_along_axis(freqs, sym, axis=1)
  bias = slots[None] - np.take_along_axis(incl - freqs, sym, axis=1)
  return sym, f, bias


def decode_arrays(arrays: RansArrays) -> np.ndarray:
  """Decodes parsed arrays with numpy: the oracle of the device decoders.

  Args:
    arrays: `parse`'s result.

  Returns:
    uint8 (A <= 256) or uint16 [M, T, S] symbols; 0 past each stream's length.

  Raises:
    RansError: a block reads past its words, ends before its last word, or a lane ends in
      another state than the encoder's initial 2**16 (bytes inconsistent with their checksum:
      an encoder bug or forged input).
  """
  words, states, lengths, num_words, freqs, n, s_, t_, k_ = arrays
  m_, j_, b_ = states.shape
  u_ = steps_per_lane(t_, k_)
  a_ = freqs.shape[1]
  sym_t, f_t, bias_t = decode_tables(freqs, n)
  z = 1 << n
  flat_words = words.reshape(-1).astype(np.uint64)
  w_ = words.shape[2]
  row = (np.arange(m_ * j_, dtype=np.int64) * w_)[:, None]                    # [MJ, 1]
  lut_base = (np.repeat(np.arange(m_, dtype=np.int64), j_) * z)[:, None]      # [MJ, 1]
  x = states.reshape(m_ * j_, b_).astype(np.uint64)
  length = lengths.reshape(m_ * j_, b_)
  limit = num_words.reshape(m_ * j_, 1).astype(np.int64)
  pos = np.zeros((m_ * j_, 1), np.int64)
  out = np.zeros((u_, m_ * j_, b_), np.uint8 if a_ <= 256 else np.uint16)
  sym_f, f_f, bias_f = (a.reshape(-1) for a in (sym_t, f_t, bias_t))
  mask = np.uint64(z - 1)
  for t in range(u_):
    active = t < length
    k = lut_base + (x & mask).astype(np.int64)
    out[t] = np.where(active, sym_f[k], 0)
    x = np.where(active, f_f[k].astype(np.uint64) * (x >> np.uint64(n)) +
                 bias_f[k].astype(np.uint64), x)
    need = active & (x < np.uint64(STATE_LOWER))
    idx = pos + np.cumsum(need, axis=1) - need
    if (need & (idx >= limit)).any():
      raise RansError(f"step {t}: a block reads past its {int(limit.max())} words")
    w = flat_words[row + np.minimum(idx, w_ - 1)]
    x = np.where(need, (x << np.uint64(WORD_BITS)) | w, x)
    pos += need.sum(axis=1, keepdims=True)
  if (pos != limit).any() or (x != STATE_LOWER).any():
    raise RansError("rANS streams do not end where they began (damaged or forged bytes)")
  # [U, M * J, B] lanes -> [M, U, S, K] -> streams [M, K * U, S], cut to T.
  lanes = out.reshape(u_, m_, j_ * b_)[:, :, :s_ * k_].reshape(u_, m_, s_, k_)
  return np.ascontiguousarray(lanes.transpose(1, 3, 0, 2).reshape(m_, k_ * u_, s_)[:, :t_])


def decode(data: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
  """`parse` then `decode_arrays`: bytes back to (symbols_MTS, lengths_MS int32[M, S]).

  Raises:
    RansError: as `parse` and `decode_arrays`.
  """
  arrays = parse(data)
  return decode_arrays(arrays), stream_lengths(arrays)


# ---------------------------------------------------------------------------------------------
# Helpers


def _check_scale_bits(scale_bits) -> None:
  if not isinstance(scale_bits, (int, np.integer)) or not (
      MIN_SCALE_BITS <= scale_bits <= MAX_SCALE_BITS):
    raise ValueError(f"scale_bits must be an int in {MIN_SCALE_BITS}..{MAX_SCALE_BITS}, "
                     f"got {scale_bits!r}")


def _check_symbols(symbols_MTS, lengths_MS) -> tuple[np.ndarray, np.ndarray]:
  symbols_MTS = np.asarray(symbols_MTS)
  if symbols_MTS.ndim != 3 or not np.issubdtype(symbols_MTS.dtype, np.integer):
    raise ValueError(f"symbols must be an integer array [M, T, S], got "
                     f"{symbols_MTS.dtype}{list(symbols_MTS.shape)}")
  m_, t_, s_ = symbols_MTS.shape
  if max(m_, t_, s_) >= 1 << 32 or m_ * s_ * max(t_, 1) > MAX_SYMBOLS:
    raise ValueError(f"too many symbols: {list(symbols_MTS.shape)}")
  if lengths_MS is None:
    return symbols_MTS, np.full((m_, s_), t_, np.int64)
  lengths_MS = np.asarray(lengths_MS)
  if lengths_MS.shape != (m_, s_) or not np.issubdtype(lengths_MS.dtype, np.integer):
    raise ValueError(f"lengths must be int[{m_}, {s_}], got "
                     f"{lengths_MS.dtype}{list(lengths_MS.shape)}")
  if ((lengths_MS < 0) | (lengths_MS > t_)).any():
    raise ValueError(f"lengths must lie in 0..{t_}")
  return symbols_MTS, lengths_MS.astype(np.int64)


def _digest(head, body) -> bytes:
  """xxh3-128 of the header before the checksum field, then everything after it."""
  return bytes.fromhex(checksum.digest_arrays(
      [np.frombuffer(head, np.uint8), np.frombuffer(body, np.uint8)], checksum.XXH3_128))


class _Reader:
  """Bounds-checked little-endian reads; any overrun is a RansError."""

  def __init__(self, view: memoryview, pos: int):
    self.view, self.pos = view, pos

  def _take(self, n: int) -> memoryview:
    if self.pos + n > len(self.view):
      raise RansError(f"truncated rANS encoding: need {n} bytes at offset {self.pos}, have "
                      f"{len(self.view) - self.pos}")
    out = self.view[self.pos:self.pos + n]
    self.pos += n
    return out

  def take(self, n: int) -> memoryview:
    return self._take(n)

  def unpack(self, st: struct.Struct) -> tuple:
    return st.unpack(self._take(st.size))

  def array(self, dtype: str, count: int) -> np.ndarray:
    dt = np.dtype(dtype)
    return np.frombuffer(self._take(count * dt.itemsize), dt).astype(dt.newbyteorder("="))
