"""kvtc codes from their rANS bands, on the device: the entropy-decoding step of a kvtc load.

A kvtc chunk stored with the "rans-bands" coding (`kvjax/storage/entropy.py`,
`encode_components_rans`, whose docstring is the layout's spec) reaches the device as one rANS
encoding per band of components: the storage reader parses and verifies the bytes and hands back
plain arrays (`entropy.RansCodes`), and this module decodes every band (`rans_decode`: Pallas on
GPU/TPU, the jit'd jnp reference on CPU) and reassembles the int16 codes in one jit'd call:

    band b (components lo..hi):  symbols [M = L * 2, T, S]  --+ offset[m], stream-major -->
                                 codes [L, 2, hi - lo, C]   --concatenate bands--> [L, 2, D, C]
    q = swap -> int16[L, 2, C, D]   (then `kvjax.kernels.kvtc.kvtc_decode`: dequantize, inverse
                                     transform, RoPE, cache write)

Kernels do not import storage: `decode_codes` takes the per-band arrays by the names of
`kvjax.storage.rans.RansArrays` (the engine passes them through, `band_inputs`).

Axis letters as in `kvjax/kernels/rans_decode.py` (M models, T steps, S streams); L layers, C
tokens, D = K * H components.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kvjax.kernels import rans_decode as rd


class BandInput(NamedTuple):
  """One band of rANS-coded kvtc codes (arrays as `kvjax.storage.rans.RansArrays` names them).

  Attributes:
    lo, hi: the band's components [lo, hi).
    offset: int32[M] code = symbol + offset per model (M = L * 2, (layer, K/V) order).
    words, states, lengths, num_words, freqs: the band's `RansArrays` arrays.
    scale_bits, num_streams, num_steps: its static sizes.
  """
  lo: int
  hi: int
  offset: jax.Array
  words: jax.Array
  states: jax.Array
  lengths: jax.Array
  num_words: jax.Array
  freqs: jax.Array
  scale_bits: int
  num_streams: int
  num_steps: int


_STATIC = ("lo", "hi", "scale_bits", "num_streams", "num_steps")
_ARRAYS = ("offset", "words", "states", "lengths", "num_words", "freqs")


def band_inputs(bands: Sequence[tuple[int, int]], offsets: Sequence, arrays: Sequence
                ) -> tuple[BandInput, ...]:
  """`BandInput`s from a reader's (bands, offsets, per-band rANS arrays as NamedTuples).

  Raises:
    ValueError: sequences of different lengths.
  """
  if not len(bands) == len(offsets) == len(arrays):
    raise ValueError(f"{len(bands)} bands, {len(offsets)} offsets, {len(arrays)} rANS arrays")
  return tuple(BandInput(int(lo), int(hi), off, a.words, a.states, a.lengths, a.num_words,
                         a.freqs, int(a.scale_bits), int(a.num_streams), int(a.num_steps))
               for (lo, hi), off, a in zip(bands, offsets, arrays))


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
        b.num_streams * b.num_steps != (b.hi - b.lo) * c):
      raise ValueError(f"band {b.lo}..{b.hi}: {b.states.shape[0]} models x {b.num_streams} "
                       f"streams x {b.num_steps} steps do not cover [L * 2 = {l_ * 2}, "
                       f"{b.hi - b.lo} x C = {c}]")
  if lo_want != d:
    raise ValueError(f"bands end at component {lo_want}, D = {d}")


def decode_codes(shape: tuple[int, int, int, int], bands: Sequence[BandInput], *,
                 use_pallas: bool = False, interpret: bool = False
                 ) -> tuple[jax.Array, jax.Array]:
  """Decodes rANS-coded kvtc codes on the device, in one jit'd call.

  Args:
    shape: (L, 2, C, D) of the codes.
    bands: one `BandInput` per band, tiling components 0..D in order (host or device arrays:
      they are transferred once).
    use_pallas: decode with the Pallas kernel (`rans_decode.rans_decode`); False: the jnp
      reference (`rans_decode_reference`, the CPU path). Bit-identical results.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    (q int16[L, 2, C, D], ok bool[]): ok is False when some stream did not end where its encoder
    began or some block did not consume exactly its words (damaged or forged bytes past the
    format's checksum); q is then garbage and the chunk must be recomputed.

  Raises:
    ValueError: bands that do not fit `shape`, or (from `rans_decode`) Pallas without interpret
      on a CPU backend.
  """
  shape = tuple(int(x) for x in shape)
  bands = tuple(bands)
  _check(shape, bands)
  static = tuple(tuple(int(getattr(b, n)) for n in _STATIC) for b in bands)
  arrays = tuple(tuple(getattr(b, n) for n in _ARRAYS) for b in bands)
  return _decode_jit(arrays, shape=shape, static=static, use_pallas=bool(use_pallas),
                     interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("shape", "static", "use_pallas", "interpret"))
def _decode_jit(arrays, *, shape, static, use_pallas, interpret):
  l_, _, c, d = shape
  parts, ok = [], jnp.bool_(True)
  for (lo, hi, scale_bits, num_streams, num_steps), (offset, *rans_arrays) in zip(static, arrays):
    kw = dict(scale_bits=scale_bits, num_streams=num_streams, num_steps=num_steps)
    words, states, lengths, num_words, freqs = rans_arrays
    if use_pallas:
      sym_MTS, ok_b = rd.rans_decode(words, states, lengths, num_words, freqs,
                                     interpret=interpret, **kw)
    else:
      sym_MTS, ok_b = rd.rans_decode_reference(words, states, lengths, num_words, freqs, **kw)
    codes = jnp.swapaxes(sym_MTS, 1, 2).reshape(l_ * 2, (hi - lo) * c) + offset[:, None]
    ok = ok & ok_b & jnp.all((codes >= -32768) & (codes <= 32767))
    parts.append(codes.reshape(l_, 2, hi - lo, c))
  comp = jnp.concatenate(parts, axis=2)                                    # [L, 2, D, C]
  return jnp.swapaxes(comp, 2, 3).astype(jnp.int16), ok
