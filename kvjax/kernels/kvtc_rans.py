"""kvtc codes from their rANS bands, on the device: the entropy-decoding step of a kvtc load.

A kvtc chunk stored with the "rans-bands" coding (`kvjax/storage/format/entropy.py`,
`encode_components_rans`, whose docstring is the layout's spec) reaches the device as one rANS
encoding per band of components: the storage reader parses and verifies the bytes and hands back
plain arrays (`entropy.RansCodes`), and this module decodes every band (`rans_decode`: Pallas on
GPU/TPU, the jit'd jnp reference on CPU) and reassembles the int16 codes in one jit'd call:

    band b (components lo..hi):  symbols [M = L * 2, T, S]  --+ offset[m], stream-major -->
                                 codes [L, 2, hi - lo, C]   --concatenate bands--> [L, 2, D, C]
    q = swap -> int16[L, 2, C, D]   (then `kvjax.kernels.kvtc.kvtc_decode`: dequantize, inverse
                                     transform, RoPE, cache write)

Kernels do not import storage: `pack_bands` takes the per-band arrays by the names of
`kvjax.storage.format.rans.RansArrays` (the engine passes a reader's `RansCodes` through) and packs them
into shapes that depend only on the chunk's shape (the words of all blocks in one flat array of
a bucketed size, frequency tables padded to a power of two), so one compiled decoder serves
every chunk of a shape; `decode_codes` runs it.

Axis letters as in `kvjax/kernels/rans_decode.py` (M models, T steps, S streams); L layers, C
tokens, D = K * H components.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvjax.kernels import rans_decode as rd


class BandInput(NamedTuple):
  """One band of rANS-coded kvtc codes, packed for the device (`pack_bands`).

  The arrays' shapes depend only on the chunk's shape, never on its contents (so one compiled
  decoder serves every chunk of a shape): the band's words live in the shared flat word array
  (`PackedCodes.words`) from `block_start`, and `freqs` is padded with zeros to a power of two.

  Attributes:
    lo, hi: the band's components [lo, hi).
    offset: int32[M] code = symbol + offset per model (M = L * 2, (layer, K/V) order).
    block_start: int32[M, J] where each block's words start in the flat word array.
    states, lengths, num_words: the band's `RansArrays` arrays ([M, J, B], [M, J, B], [M, J]).
    freqs: int32[M, A'] its frequencies, A' = A rounded up to a power of two (>= 256).
    scale_bits, num_streams, num_steps, segments: its static sizes (segments: lanes per
      stream, `RansArrays.segments`).
  """
  lo: int
  hi: int
  offset: jax.Array
  block_start: jax.Array
  states: jax.Array
  lengths: jax.Array
  num_words: jax.Array
  freqs: jax.Array
  scale_bits: int
  num_streams: int
  num_steps: int
  segments: int = 1


class PackedCodes(NamedTuple):
  """rANS-coded kvtc codes, ready for `decode_codes`.

  Attributes:
    shape: (L, 2, C, D) of the codes.
    words: uint16[F] every block's words, band after band, zero-padded to F, a size bucket
      (2**(k/4) words, at least 4096: at most 19% padding, few distinct shapes).
    bands: one `BandInput` per band, tiling components 0..D in order.
  """
  shape: tuple[int, int, int, int]
  words: jax.Array
  bands: tuple[BandInput, ...]


_STATIC = ("lo", "hi", "scale_bits", "num_streams", "num_steps", "segments")
_ARRAYS = ("offset", "block_start", "states", "lengths", "num_words", "freqs")
_MIN_WORDS = 4096


def _bucket(n: int) -> int:
  """The smallest 2**(k/4) (rounded up to an int) >= max(n, 4096)."""
  n = max(int(n), _MIN_WORDS)
  k = math.ceil(4 * math.log2(n))
  while math.ceil(2 ** (k / 4)) < n:
    k += 1
  return math.ceil(2 ** (k / 4))


def pack_bands(shape: Sequence[int], bands: Sequence[tuple[int, int]], offsets: Sequence,
               arrays: Sequence) -> PackedCodes:
  """Packs a reader's per-band rANS arrays (host numpy) into `PackedCodes` (host numpy).

  Args:
    shape: (L, 2, C, D) of the codes.
    bands: ((lo, hi), ...) per band.
    offsets: int32[M] per band.
    arrays: per band a NamedTuple with the fields of `kvjax.storage.format.rans.RansArrays` (words
      uint16[M, J, W] zero-padded past num_words, states, lengths, num_words, freqs, scale_bits,
      num_streams, num_steps, segments).

  Raises:
    ValueError: sequences of different lengths.
  """
  if not len(bands) == len(offsets) == len(arrays):
    raise ValueError(f"{len(bands)} bands, {len(offsets)} offsets, {len(arrays)} rANS arrays")
  flat, out, start = [], [], 0
  for (lo, hi), off, a in zip(bands, offsets, arrays):
    counts = np.asarray(a.num_words, np.int64)
    w = a.words.shape[-1]
    flat.append(np.asarray(a.words)[np.arange(w)[None, None, :] < counts[..., None]])
    block_start = start + np.cumsum(counts.reshape(-1)) - counts.reshape(-1)
    start += int(counts.sum())
    a_ = a.freqs.shape[1]
    freqs = np.zeros((a.freqs.shape[0], max(256, 1 << max(a_ - 1, 0).bit_length())), np.int32)
    freqs[:, :a_] = a.freqs
    out.append(BandInput(int(lo), int(hi), np.asarray(off, np.int32),
                         block_start.reshape(counts.shape).astype(np.int32),
                         np.asarray(a.states, np.uint32), np.asarray(a.lengths, np.int32),
                         counts.astype(np.int32), freqs, int(a.scale_bits),
                         int(a.num_streams), int(a.num_steps), int(a.segments)))
  capacity = word_capacity(out)
  words = np.zeros(min(_bucket(start), max(capacity, start)), np.uint16)
  if start:
    words[:start] = np.concatenate(flat)
  return PackedCodes(tuple(int(x) for x in shape), words, tuple(out))


def _lane_steps(b: BandInput) -> int:
  """U: the steps each lane of a band decodes (at most one word per lane step)."""
  return rd.steps_per_lane(b.num_steps, b.segments)


def word_capacity(bands: Sequence[BandInput]) -> int:
  """The most words a chunk of these bands' shapes can hold: one per lane step (what
  `decode_codes` pads the flat words to, so one compiled decoder serves the shape)."""
  return sum(int(np.prod(np.shape(b.states))) * _lane_steps(b) for b in bands)


def _check(shape, bands: Sequence[BandInput]) -> None:
  if len(shape) != 4 or shape[1] != 2 or min(shape) < 1:
    raise ValueError(f"kvtc codes shape must be (L, 2, C, D), got {shape}")
  l_, _, c, d = shape
  lo_want = 0
  for b in bands:
    if b.lo != lo_want or b.hi <= b.lo:
      raise ValueError(f"bands must tile 0..{d} in order, got {[(x.lo, x.hi) for x in bands]}")
    lo_want = b.hi
    if (b.states.shape[0] != l_ * 2 or tuple(b.offset.shape) != (l_ * 2,) or
        b.num_streams * b.num_steps != (b.hi - b.lo) * c or
        tuple(b.block_start.shape) != tuple(b.num_words.shape)):
      raise ValueError(f"band {b.lo}..{b.hi}: {b.states.shape[0]} models x {b.num_streams} "
                       f"streams x {b.num_steps} steps do not cover [L * 2 = {l_ * 2}, "
                       f"{b.hi - b.lo} x C = {c}]")
  if lo_want != d:
    raise ValueError(f"bands end at component {lo_want}, D = {d}")


def decode_codes(packed: PackedCodes, *, use_pallas: bool = False, interpret: bool = False,
                 platform: str | None = None) -> tuple[jax.Array, jax.Array]:
  """Decodes rANS-coded kvtc codes on the device, in one jit'd call.

  Each band's blocks are sliced from the flat words into [M, J, U * B] (U = ceil(T / K) steps
  per lane: U * B bounds a block, at most one word per symbol), then decoded by `rans_decode`.

  Args:
    packed: `pack_bands`'s result (host or device arrays: they are transferred once).
    use_pallas: decode with the Pallas kernel (`rans_decode.rans_decode`); False: the jnp
      reference (`rans_decode_reference`, the CPU path). Bit-identical results.
    interpret: Pallas interpret mode (CPU tests).
    platform: the Pallas kernel's target ("cpu" | "tpu" | "cuda"); None: the platform being
      compiled for.

  Returns:
    (q int16[L, 2, C, D], ok bool[]): ok is False when some stream did not end where its encoder
    began, some block did not consume exactly its words, or a code left int16 (damaged or
    forged bytes past the format's checksum); q is then garbage and the chunk must be
    recomputed.

  Raises:
    ValueError: bands that do not fit the shape, or (from `rans_decode`) Pallas without
      interpret on a CPU backend.
  """
  shape = tuple(int(x) for x in packed.shape)
  bands = tuple(packed.bands)
  _check(shape, bands)
  static = tuple(tuple(int(getattr(b, n)) for n in _STATIC) for b in bands)
  arrays = tuple(tuple(getattr(b, n) for n in _ARRAYS) for b in bands)
  # The words travel in their size bucket; on the device they are padded to the most words a
  # chunk of this shape can have (one word per symbol per lane), so the decoder compiles once
  # per shape (the pad is a small program per bucket).
  capacity = word_capacity(bands)
  words = packed.words
  if words.shape[0] > capacity:
    raise ValueError(f"{words.shape[0]} words for a chunk of at most {capacity}")
  return _decode_jit(_pad_words(words, capacity=int(capacity)), arrays, shape=shape,
                     static=static, use_pallas=bool(use_pallas), interpret=bool(interpret),
                     platform=platform)


@functools.partial(jax.jit, static_argnames=("capacity",))
def _pad_words(words, *, capacity):
  return jnp.zeros((capacity,), jnp.uint16).at[:words.shape[0]].set(words.astype(jnp.uint16))


@functools.partial(jax.jit, static_argnames=("shape", "static", "use_pallas", "interpret",
                                             "platform"))
def _decode_jit(flat_words, arrays, *, shape, static, use_pallas, interpret, platform):
  l_, _, c, d = shape
  flat = flat_words.astype(jnp.int32)
  # Room for one block's words past the end: a slice that starts at the last word is never
  # clamped back (what `lax.dynamic_slice` does to a slice that would leave its array).
  most = max(max(1, rd.steps_per_lane(st[4], st[5]) * band[2].shape[2])
             for st, band in zip(static, arrays))
  padded = jnp.pad(flat, (0, most))
  parts, ok = [], jnp.bool_(True)
  for (lo, hi, scale_bits, num_streams, num_steps, segments), band in zip(static, arrays):
    offset, block_start, states, lengths, num_words, freqs = band
    w_ = max(1, rd.steps_per_lane(num_steps, segments) * states.shape[2])  # a block's words
    words = jax.vmap(lambda start, size=w_: lax.dynamic_slice(padded, (start,), (size,)))(
        jnp.clip(block_start.reshape(-1), 0, flat.shape[0])).reshape(*block_start.shape, w_)
    kw = dict(scale_bits=scale_bits, num_streams=num_streams, num_steps=num_steps,
              segments=segments)
    if use_pallas:
      sym_MTS, ok_b = rd.rans_decode(words, states, lengths, num_words, freqs,
                                     interpret=interpret, platform=platform, **kw)
    else:
      sym_MTS, ok_b = rd.rans_decode_reference(words, states, lengths, num_words, freqs, **kw)
    codes = jnp.swapaxes(sym_MTS, 1, 2).reshape(l_ * 2, (hi - lo) * c) + offset[:, None]
    ok = ok & ok_b & jnp.all((codes >= -32768) & (codes <= 32767))
    parts.append(codes.reshape(l_, 2, hi - lo, c))
  comp = jnp.concatenate(parts, axis=2)                                    # [L, 2, D, C]
  return jnp.swapaxes(comp, 2, 3).astype(jnp.int16), ok
