"""Lossless entropy coding of int8 symbol arrays, one probability model per group (`pcodec`).

CacheGen (arXiv 2310.07240, section 5.2) arithmetic-codes its quantized deltas with a probability
model per layer and channel. Here the caller splits the array into groups (cachegen: one group
per (layer, K/V) slice of `[L, 2, C, K, H]`) and each group is one pcodec chunk: pcodec picks
bins over the group's symbols (for these small integer alphabets, one bin per symbol with its
weight: a categorical model of the group, stored in the chunk header) and codes them with tANS.
Channels of a group share its model because the codec's per-channel step already scales every
channel to one spread; measured on real SmolLM2 KV, separate per-channel models would save at
most 2-4% before paying for their tables and cost 3-11% more once their parameters or tables are
stored (table in `kvjax/storage/format/codecs.py`).

pcodec is used as a plain order-0 coder: no delta encoding, classic mode (`_CONFIG`).

Byte format of one coded array (little endian):

    u32 G                 groups (the array's C-order values are G equal groups)
    u32 nbytes[G]         length of each group's pcodec standalone file
    G pcodec standalone files, back to back, to the end

kvtc components (`encode_components`): int16 codes `q[L, 2, C, D]` (D components by descending
variance) are coded with one pcodec model per (layer, K/V, band of components), bands
`COMPONENT_BANDS` (clipped to D): the spread of a component falls by orders of magnitude from the
first to the last, so one model per (layer, K/V) would waste bits on the quiet ones. Format:

    u32 B                 bands actually used (after clipping to D)
    u32 nbytes[L * 2 * B] length of each group's pcodec standalone file, (l, kv, band) order
    the files, back to back (each codes the band's codes component-major: [width, C])

kvtc components with interleaved rANS (`encode_components_rans`, the "rans-bands" coding, what
new kvtc chunks store): the same models, each band one `kvjax.storage.format.rans` encoding, decoded on
the device (`parse_components_rans` -> `RansCodes` -> `kvjax.kernels.kvtc_rans`) or here
(`decode_rans_codes`); format in `encode_components_rans`.

A damaged file can decode to wrong symbols without an error from pcodec, so callers check a CRC
of the decoded values (`codecs` does).
"""

from __future__ import annotations

import struct

from typing import NamedTuple

import numpy as np
import pcodec
from pcodec import standalone

from kvjax.storage.format import rans

_CONFIG = pcodec.ChunkConfig(enable_8_bit=True, delta_spec=pcodec.DeltaSpec.no_op(),
                             mode_spec=pcodec.ModeSpec.classic())


_CONFIG_16 = pcodec.ChunkConfig(delta_spec=pcodec.DeltaSpec.no_op(),
                                mode_spec=pcodec.ModeSpec.classic())
#: Band edges over kvtc components (clipped to D; the last band runs to D).
COMPONENT_BANDS = (0, 2, 6, 16, 40, 96)


class EntropyError(ValueError):
  """Coded bytes that cannot be decoded (truncated, malformed, inconsistent)."""


def encode_groups(q: np.ndarray, num_groups: int) -> bytes:
  """Entropy-codes an int8 array with one model per group.

  Args:
    q: int8 array of any shape; its C-order values are split into `num_groups` equal groups.
    num_groups: G >= 1, dividing `q.size`.

  Returns:
    The coded bytes (format in the module docstring).

  Raises:
    ValueError: `q` is not int8 or `num_groups` does not divide its size.
  """
  if q.dtype != np.int8:
    raise ValueError(f"entropy coding wants int8, got {q.dtype}")
  if num_groups < 1 or q.size % num_groups:
    raise ValueError(f"{num_groups} groups do not divide {q.size} values")
  groups = np.ascontiguousarray(q).reshape(num_groups, -1)
  files = [standalone.simple_compress(np.ascontiguousarray(g), _CONFIG) for g in groups]
  head = struct.pack(f"<I{num_groups}I", num_groups, *(len(f) for f in files))
  return head + b"".join(files)


def decode_groups(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes `encode_groups` output to an int8 array of `shape`.

  Raises:
    EntropyError: truncated or malformed bytes, a group count that does not divide the size,
      group lengths that do not add up, or a group with too few or too many values.
  """
  data = memoryview(data).cast("B")
  size = int(np.prod(shape, dtype=np.int64))
  if len(data) < 4:
    raise EntropyError("truncated entropy header")
  (num_groups,) = struct.unpack_from("<I", data, 0)
  if num_groups < 1 or size % num_groups or 4 + 4 * num_groups > len(data):
    raise EntropyError(f"{num_groups} groups for {size} values in {len(data)} bytes")
  lengths = struct.unpack_from(f"<{num_groups}I", data, 4)
  pos = 4 + 4 * num_groups
  if pos + sum(lengths) != len(data):
    raise EntropyError(f"group lengths add up to {pos + sum(lengths)} bytes, have {len(data)}")
  out = np.empty((num_groups, size // num_groups), np.int8)
  for g, n in enumerate(lengths):
    try:
      progress = standalone.simple_decompress_into(bytes(data[pos:pos + n]), out[g])
    except (RuntimeError, TypeError, ValueError) as e:
      raise EntropyError(f"group {g}: {e}") from e
    if not progress.finished or progress.n_processed != out.shape[1]:
      raise EntropyError(f"group {g}: {progress.n_processed} values, want {out.shape[1]}")
    pos += n
  return out.reshape(shape)


def _bands(d: int) -> list[tuple[int, int]]:
  edges = [e for e in COMPONENT_BANDS if e < d] + [d]
  return list(zip(edges[:-1], edges[1:]))


def encode_components(q_L2CD: np.ndarray) -> bytes:
  """Entropy-codes kvtc codes with one model per (layer, K/V, band of components).

  Args:
    q_L2CD: int16[L, 2, C, D].

  Returns:
    The coded bytes (format in the module docstring).

  Raises:
    ValueError: not int16[L, 2, C, D].
  """
  if q_L2CD.dtype != np.int16 or q_L2CD.ndim != 4 or q_L2CD.shape[1] != 2:
    raise ValueError(f"kvtc codes must be int16[L, 2, C, D], got {q_L2CD.dtype}{q_L2CD.shape}")
  bands = _bands(q_L2CD.shape[3])
  comp = np.ascontiguousarray(np.swapaxes(q_L2CD, 2, 3))           # [L, 2, D, C]
  files = [standalone.simple_compress(np.ascontiguousarray(comp[l, a, lo:hi]).reshape(-1),
                                      _CONFIG_16)
           for l in range(comp.shape[0]) for a in range(2) for lo, hi in bands]
  head = struct.pack(f"<I{len(files)}I", len(bands), *(len(f) for f in files))
  return head + b"".join(files)


def decode_components(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes `encode_components` output to int16 `shape` = [L, 2, C, D].

  Raises:
    EntropyError: truncated or malformed bytes, or a group with too few or too many values.
  """
  data = memoryview(data).cast("B")
  if len(shape) != 4 or shape[1] != 2:
    raise EntropyError(f"kvtc codes shape {shape} is not [L, 2, C, D]")
  l_, _, c, d = shape
  bands = _bands(d)
  n = l_ * 2 * len(bands)
  if len(data) < 4 + 4 * n:
    raise EntropyError("truncated kvtc entropy header")
  (num_bands,) = struct.unpack_from("<I", data, 0)
  if num_bands != len(bands):
    raise EntropyError(f"{num_bands} bands, want {len(bands)} for D={d}")
  lengths = struct.unpack_from(f"<{n}I", data, 4)
  pos = 4 + 4 * n
  if pos + sum(lengths) != len(data):
    raise EntropyError(f"group lengths add up to {pos + sum(lengths)} bytes, have {len(data)}")
  comp = np.empty((l_, 2, d, c), np.int16)
  i = 0
  for l in range(l_):
    for a in range(2):
      for lo, hi in bands:
        out = np.empty(((hi - lo) * c,), np.int16)
        try:
          progress = standalone.simple_decompress_into(bytes(data[pos:pos + lengths[i]]), out)
        except (RuntimeError, TypeError, ValueError) as e:
          raise EntropyError(f"group {i}: {e}") from e
        if not progress.finished or progress.n_processed != out.size:
          raise EntropyError(f"group {i}: {progress.n_processed} values, want {out.size}")
        comp[l, a, lo:hi] = out.reshape(hi - lo, c)
        pos += lengths[i]
        i += 1
  return np.ascontiguousarray(np.swapaxes(comp, 2, 3))


# ---------------------------------------------------------------------------------------------
# kvtc components with interleaved rANS ("rans-bands"): decodable on the device.

#: Symbols per rANS stream the encoder aims for (a stream's 4-byte final state is its framing:
#: longer streams cost fewer bytes, shorter ones give a decoder more lanes; measured in
#: `scripts/bench_rans.py`'s kvtc phase).
RANS_STEPS = 512
#: The most symbols one rANS lane decodes: format version 2 cuts each stream into segments of
#: at most this many, each a lane with its own state (512-symbol streams: 2 lanes of 256). A
#: lane costs about 2 bytes net, so the lane count is what the stored bytes allow (+2% over
#: version 1 at most, per kvtc level): on 8 chunks of real SmolLM2 KV, 2 lanes per stream store
#: 0.5-0.9% fewer bytes of `q` than version 1 at kvtc levels 1-4, 3 lanes 2.5-2.9% more of the
#: whole payload at levels 2-4 (`scripts/bench_rans.py`, kvtc phase).
RANS_LANE_STEPS = 256


class RansCodes(NamedTuple):
  """kvtc codes `q: int16[L, 2, C, D]` still rANS-coded: what the storage reader hands back for a
  "rans-bands" array, so the entropy decoding runs on the device (`kvjax.kernels.kvtc_rans`).

  Plain numpy, every check done (`parse_components_rans`): each band's rANS encoding passed its
  xxh3-128 checksum and structure checks; the decoder's `ok` flag covers the rest.

  Attributes:
    shape: (L, 2, C, D) of the decoded codes.
    bands: ((lo, hi), ...) component ranges, one per band (`COMPONENT_BANDS` clipped to D).
    offsets: per band int32[L * 2]: code = symbol + offset (the model's smallest code).
    arrays: per band a `rans.RansArrays` with M = L * 2 models ((layer, K/V) order), S streams,
      T steps, S * T = (hi - lo) * C; symbol t of stream s of model m is the band's code number
      s * T + t in component-major order ([hi - lo, C]).
  """
  shape: tuple[int, int, int, int]
  bands: tuple[tuple[int, int], ...]
  offsets: tuple[np.ndarray, ...]
  arrays: tuple[rans.RansArrays, ...]

  def leaves(self) -> list[np.ndarray]:
    """Every numpy array it holds, in a fixed order (for byte counts and checksums)."""
    out = []
    for off, a in zip(self.offsets, self.arrays):
      out += [off, a.words, a.states, a.lengths, a.num_words, a.freqs]
    return out

  @property
  def nbytes(self) -> int:
    """Bytes of its arrays in memory (about the coded size: the words dominate)."""
    return sum(int(x.nbytes) for x in self.leaves())

  def frozen_copy(self) -> "RansCodes":
    """A copy whose arrays are read-only (what the host tier keeps)."""
    def frozen(x):
      c = np.array(x, copy=True, order="C")
      c.setflags(write=False)
      return c
    return RansCodes(self.shape, self.bands, tuple(frozen(o) for o in self.offsets),
                     tuple(a._replace(**{f: frozen(getattr(a, f)) for f in
                                         ("words", "states", "lengths", "num_words", "freqs")})
                           for a in self.arrays))


def _streams(n: int, steps: int) -> int:
  """Streams of one model of n symbols: the divisor of n nearest n / steps (at least 1)."""
  want = max(1, round(n / steps))
  divisors = [s for s in range(1, n + 1) if n % s == 0] if n else [1]
  return min(divisors, key=lambda s: (abs(s - want), s))


def _lanes(streams: int) -> int:
  """Lanes per block: the streams rounded up to a power of two, at most a warp (32): a GPU
  kernel's block shapes stay powers of two (with T a power of two, so is a block's T * B)."""
  return min(rans.DEFAULT_LANES, 1 << max(streams - 1, 0).bit_length())


def encode_components_rans(q_L2CD: np.ndarray, *, steps: int = RANS_STEPS,
                           lane_steps: int | None = RANS_LANE_STEPS,
                           version: int = rans.VERSION) -> bytes:
  """Entropy-codes kvtc codes with interleaved rANS, one model per (layer, K/V, band).

  The models are `encode_components`' (bands `COMPONENT_BANDS`); each band is one rANS
  encoding (`kvjax.storage.format.rans`, format `version`) of L * 2 models whose values are split into
  S streams of T = (hi - lo) * C / S symbols, S chosen so that T is near `steps`, each stream
  cut into K = ceil(T / lane_steps) lanes (version 2), in blocks of B = min(32, S * K rounded
  up to a power of two) lanes. Format:

      u32 B                                      bands actually used (after clipping to D)
      per band: u32 S  u32 nbytes                streams per model, bytes of its rANS encoding
      per band: i32 offset[L * 2]                code = symbol + offset, (l, kv) order
      the B rANS encodings, back to back, nothing after

  Args:
    q_L2CD: int16[L, 2, C, D].
    steps: the stream length to aim for (>= 1).
    lane_steps: the most symbols per lane (version 2; None: a lane per stream).
    version: the rANS format version to write (1: what readers before version 2 read).

  Returns:
    The coded bytes.

  Raises:
    ValueError: not int16[L, 2, C, D], or a model with more than 2**15 distinct codes (the
      caller falls back to "pco-bands").
  """
  if q_L2CD.dtype != np.int16 or q_L2CD.ndim != 4 or q_L2CD.shape[1] != 2:
    raise ValueError(f"kvtc codes must be int16[L, 2, C, D], got {q_L2CD.dtype}{q_L2CD.shape}")
  l_, _, c, d = q_L2CD.shape
  comp = np.swapaxes(q_L2CD, 2, 3).reshape(l_ * 2, d, c)            # [M, D, C]
  head, offsets, blobs = [], [], []
  for lo, hi in _bands(d):
    flat = comp[:, lo:hi].reshape(l_ * 2, -1).astype(np.int32)      # [M, n]
    n = flat.shape[1]
    s_ = _streams(n, steps)
    off = flat.min(axis=1) if n else np.zeros(l_ * 2, np.int32)
    sym = flat - off[:, None]
    alphabet = int(sym.max(initial=0)) + 1
    distinct = max((np.unique(row).size for row in sym), default=1)
    scale_bits = max(rans.DEFAULT_SCALE_BITS, (distinct - 1).bit_length())
    if scale_bits > rans.MAX_SCALE_BITS or alphabet > rans.MAX_ALPHABET:
      raise ValueError(f"band {lo}..{hi}: {distinct} distinct codes over {alphabet} values do "
                       f"not fit one rANS model")
    sym_MTS = sym.reshape(l_ * 2, s_, n // s_).transpose(0, 2, 1)
    k_ = rans.segments_for(n // s_, lane_steps) if version >= 2 else 1
    blob = rans.encode(sym_MTS.astype(np.uint16), scale_bits=scale_bits,
                       lanes=_lanes(s_ * k_), alphabet=alphabet,
                       lane_steps=lane_steps if version >= 2 else None, version=version)
    head.append((s_, len(blob)))
    offsets.append(off.astype("<i4"))
    blobs.append(blob)
  out = [struct.pack("<I", len(head))]
  out += [struct.pack("<II", s_, nb) for s_, nb in head]
  out += [o.tobytes() for o in offsets] + blobs
  return b"".join(out)


def parse_components_rans(data: bytes | memoryview, shape: tuple[int, ...]) -> RansCodes:
  """Checks `encode_components_rans` output and unpacks it for a decoder (nothing decoded).

  Args:
    data: the coded bytes.
    shape: (L, 2, C, D) of the codes.

  Returns:
    `RansCodes` (numpy arrays).

  Raises:
    EntropyError: truncated or malformed bytes, a damaged rANS encoding (its checksum), or one
      whose models, streams or steps do not fit `shape`.
  """
  data = memoryview(data).cast("B")
  if len(shape) != 4 or shape[1] != 2:
    raise EntropyError(f"kvtc codes shape {shape} is not [L, 2, C, D]")
  l_, _, c, d = (int(x) for x in shape)
  bands = _bands(d)
  m_ = l_ * 2
  head_bytes = 4 + 8 * len(bands) + 4 * m_ * len(bands)
  if len(data) < head_bytes:
    raise EntropyError(f"truncated kvtc rANS header: {len(data)} bytes, need {head_bytes}")
  (num_bands,) = struct.unpack_from("<I", data, 0)
  if num_bands != len(bands):
    raise EntropyError(f"{num_bands} bands, want {len(bands)} for D={d}")
  sizes = [struct.unpack_from("<II", data, 4 + 8 * b) for b in range(len(bands))]
  pos = 4 + 8 * len(bands)
  offsets = []
  for _ in bands:
    offsets.append(np.frombuffer(data[pos:pos + 4 * m_], "<i4").astype(np.int32))
    pos += 4 * m_
  if pos + sum(nb for _, nb in sizes) != len(data):
    raise EntropyError(f"band lengths add up to {pos + sum(nb for _, nb in sizes)} bytes, "
                       f"have {len(data)}")
  arrays = []
  for (lo, hi), (s_, nb) in zip(bands, sizes):
    try:
      a = rans.parse(data[pos:pos + nb])
    except rans.RansError as e:
      raise EntropyError(f"band {lo}..{hi}: {e}") from e
    n = (hi - lo) * c
    if (a.states.shape[0], a.num_streams, a.num_streams * a.num_steps) != (m_, s_, n) or (
        rans.stream_lengths(a) != a.num_steps).any():
      raise EntropyError(f"band {lo}..{hi}: rANS encoding of {a.states.shape[0]} models x "
                         f"{a.num_streams} streams x {a.num_steps} steps, want {m_} x {s_} "
                         f"covering {n} codes each")
    arrays.append(a)
    pos += nb
  return RansCodes((l_, 2, c, d), tuple(bands), tuple(offsets), tuple(arrays))


def decode_rans_codes(codes: RansCodes) -> np.ndarray:
  """Decodes `RansCodes` on the host (numpy, `rans.decode_arrays`): int16[L, 2, C, D].

  Raises:
    EntropyError: a rANS stream that does not end where it began (damaged or forged bytes),
      or codes outside int16.
  """
  l_, _, c, d = codes.shape
  comp = np.empty((l_ * 2, d, c), np.int16)
  for (lo, hi), off, a in zip(codes.bands, codes.offsets, codes.arrays):
    try:
      sym_MTS = rans.decode_arrays(a)
    except rans.RansError as e:
      raise EntropyError(f"band {lo}..{hi}: {e}") from e
    vals = sym_MTS.astype(np.int32).transpose(0, 2, 1).reshape(l_ * 2, -1) + off[:, None]
    if vals.size and (vals.min() < -32768 or vals.max() > 32767):
      raise EntropyError(f"band {lo}..{hi}: decoded codes leave int16")
    comp[:, lo:hi] = vals.reshape(l_ * 2, hi - lo, c)
  return np.ascontiguousarray(np.swapaxes(comp.reshape(l_, 2, d, c), 2, 3))


def decode_components_rans(data: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
  """`parse_components_rans` then `decode_rans_codes`: int16 `shape` = [L, 2, C, D].

  Raises:
    EntropyError: as those two.
  """
  return decode_rans_codes(parse_components_rans(data, shape))
