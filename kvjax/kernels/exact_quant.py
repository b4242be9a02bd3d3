"""Quantization arithmetic every backend computes bit for bit: the int8 and int4 codecs' encoders.

One definition shared by the jnp references (`kv_codec_ref.encode_reference`), the TPU Pallas
kernels (`kv_codec._int8_encode_kernel`, `_int4_encode_kernel`) and the Triton kernels
(`kv_codec_gpu`), so a chunk encoded on a GPU, a TPU or a CPU gets the same bytes (the payloads
of `kv_payloads.Int8Payload` and `Int4Payload`).

Backends differ in three ways that move codes (measured on an H200, scripts/device_check_codec.py:
f32 `/` was not correctly rounded in 28% of 65,536 quotients, in Triton kernels and in XLA's own
GPU code alike; before this module the Triton int4 encoder's payload differed from the
reference's, and GPU int8 codes differed from CPU ones in 1 of 2,800):

  * division: PTX `div.full.f32` (Triton; XLA:GPU measured the same) is up to 2 ulp off, TPUs
    use a reciprocal estimate; XLA on CPU divides exactly. A quotient on a rounding boundary
    (x - zero = (k + 1/2) * scale, frequent with bf16 KV) then rounds to k on one backend and
    k + 1 on another. Here the division only *estimates* the code; it is then corrected by exact
    comparisons against (k -+ 1/2) * scale, so the code is the round-half-even of the exact
    quotient. The comparisons are exact because every scale has few significant bits: int4's
    are float16 values (11 bits; (2k -+ 1) <= 33 needs 6), int8's are rounded to 16 bits
    (`round_mantissa`; (2k -+ 1) <= 255 needs 8): products of at most 24 bits.
  * fused multiply-add: LLVM (Triton, XLA:GPU) and XLA:CPU may contract `a * b + c` into one
    rounding. Every product here that feeds an addition is exact (`code * scale`,
    `7.5 * scale`), so contracted and separate arithmetic agree.
  * reduction order: int4's clipping search compares squared errors summed over the G tokens,
    and each backend sums in its own tree order. Here each token's squared error is first
    rounded down to an integer number of units (2**-k of the group's half range squared, k from
    G) and capped, so every partial sum is an integer below 2**24: exact in f32 in any order.
    (Min and max, the other reductions, are exact.)

What stays backend-dependent: NaN/inf chunks (rejected by `kv_encode`'s finite flag anyway)
and float32 subnormals flushed to zero by some backends (KV values below 2**-126). CacheGen's
encoder is not here: its anchor means and delta RMS are float sums in each backend's order.

int8 (per channel over the C tokens of a chunk, symmetric):

    scale = round_mantissa(max|x| * f32(1/127), 16 bits);  code = clip(round(x / scale), +-127)

int4 (per group of G tokens and channel, over `axis`):

    lo, hi = min, max;  mid = (lo + hi) / 2;  half = (hi - lo) / 2
    for ratio in INT4_CLIP_RATIOS:                     (shrink the range about its middle)
      scale = f16(half * 2 * ratio / 15);  zero = f16(mid - 7.5 * scale)
      code  = clip(round_half_even((x - zero) / scale), 0, 15)   (0 where scale == 0)
      err   = sum over G of floor(min(((code * scale + zero - x) / 2**E)**2, 1) * 2**k)
    keep the first ratio with the least err   (2**E <= half < 2**(E + 1); k = 24 - ceil(log2 G))

Every function here is plain jnp on float32/int32 (no float16 values, no `round`: Mosaic TPU
cannot hold float16 vectors, Triton has no round) and runs inside Pallas kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

#: int4 clipping candidates: each (group, channel) keeps the min-max range shrunk about its
#: middle by the ratio with the least squared error (the first on a tie).
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
Q4_MAX = 15
Q8_MAX = 127
#: Significant bits of an int8 scale (with the implicit one): (2k -+ 1) * scale stays exact.
INT8_SCALE_BITS = 16


def round_half_even(x: jax.Array) -> jax.Array:
  """`jnp.round` (half to even) of finite f32, from `floor` (Triton has no round)."""
  r = jnp.floor(x)
  d = x - r
  odd = jnp.floor(r * 0.5) != r * 0.5
  return jnp.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


def round_f16(x: jax.Array) -> jax.Array:
  """`x.astype(float16).astype(float32)` of a float32 array, bit for bit, without a float16
  value: round to nearest even at float16's precision with int32 and float32 ops only. Normal
  range: drop 13 mantissa bits with RNE; below 2**-14 (float16 subnormals): multiples of
  2**-24; from 65520 up: inf; NaN stays NaN; signs (and -0.0) kept."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  mag = bits & 0x7FFFFFFF
  rounded = (mag + 0xFFF + ((mag >> 13) & 1)) & ~0x1FFF
  ax = jax.lax.bitcast_convert_type(mag, jnp.float32)
  out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  out = jnp.where(ax < 2.0 ** -14, round_half_even(ax * 2.0 ** 24) * 2.0 ** -24, out)
  out = jnp.where(ax >= 65520.0, jnp.inf, out)
  out = jnp.where(bits < 0, -out, out)
  return jnp.where(x != x, x, out)


def round_mantissa(x: jax.Array, bits: int) -> jax.Array:
  """Finite f32 rounded to `bits` significant bits (the implicit one included), to nearest
  even, with int32 ops (so every backend rounds alike); magnitudes past f32's range: inf."""
  drop = 24 - bits
  b = jax.lax.bitcast_convert_type(x, jnp.int32)
  mag = b & 0x7FFFFFFF
  mag = (mag + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)) & ~((1 << drop) - 1)
  out = jax.lax.bitcast_convert_type(mag, jnp.float32)
  return jnp.where(b < 0, -out, out)


def correct_codes(d: jax.Array, scale: jax.Array, estimate: jax.Array, lo: int = 0,
                  hi: int = Q4_MAX) -> jax.Array:
  """Codes `clip(round_half_even(d / scale), lo, hi)` of the *exact* quotient, given an
  estimate within one step of it (any division will do).

  Args:
    d: f32 `x - zero` (int4) or `x` (int8).
    scale: f32 >= 0 with few significant bits (int4: float16 values; int8: `round_mantissa`
      to INT8_SCALE_BITS), so that `(2k -+ 1) / 2 * scale` is exact for k in [lo, hi]; 0: the
      code is 0.
    estimate: f32 integer-valued estimate of the rounded quotient (off by at most 1 where it
      matters; far out-of-range values only need the right side of [lo, hi]).
    lo, hi: the code range.

  Returns:
    f32 integer-valued codes in [lo, hi].
  """
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(estimate, float(lo), float(hi))
  # (q -+ 1/2) * scale: an odd integer of <= 8 bits / 2 times a scale of <= 16 bits: exact.
  lower = (q - 0.5) * safe
  upper = (q + 0.5) * safe
  odd = jnp.floor(q * 0.5) * 2.0 != q
  q = jnp.where((d < lower) | ((d == lower) & odd), q - 1.0,
                jnp.where((d > upper) | ((d == upper) & odd), q + 1.0, q))
  return jnp.where(scale > 0, jnp.clip(q, float(lo), float(hi)), 0.0)


def int4_codes(d: jax.Array, scale: jax.Array) -> jax.Array:
  """`correct_codes` in [0, 15] with the backend's own division as the estimate."""
  safe = jnp.where(scale > 0, scale, 1.0)
  return correct_codes(d, scale, jnp.floor(d / safe + 0.5))


def int8_quantize(x: jax.Array, axis: int):
  """Symmetric int8 over `axis` (the C tokens of a chunk), bit-identical on every backend.

  Args:
    x: f32 values.
    axis: the reduction axis.

  Returns:
    (codes f32 integer-valued in [-127, 127], scale f32 keeping `axis` with size 1): scale is
    max|x| / 127 rounded to INT8_SCALE_BITS significant bits (0 for an all-zero channel).
  """
  absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = round_mantissa(absmax * float(np.float32(1.0 / Q8_MAX)), INT8_SCALE_BITS)
  safe = jnp.where(scale > 0, scale, 1.0)
  codes = correct_codes(x, scale, jnp.floor(x / safe + 0.5), -Q8_MAX, Q8_MAX)
  return codes, scale


def err_units_exponent(group_tokens: int) -> int:
  """k: each token's squared error counts in units of 2**-k of the group's unit squared, so a
  sum of G capped terms (each <= 2**k) stays <= 2**24 (exact in f32)."""
  return 24 - math.ceil(math.log2(max(int(group_tokens), 1)))


def _inv_unit(half: jax.Array) -> jax.Array:
  """2**-E with 2**E <= half < 2**(E + 1) (E clamped to float32's normal exponents)."""
  e = (jax.lax.bitcast_convert_type(half, jnp.int32) >> 23) & 0xFF
  e = jnp.clip(e, 1, 253)
  return jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32)


def int4_fit(x: jax.Array, axis: int, ratios=INT4_CLIP_RATIOS, *, loop: bool = False):
  """Min-max int4 fit over `axis` (the G tokens of a group) with the clipping search.

  Args:
    x: f32 values; `axis` holds the G tokens of each group.
    axis: the group's token axis.
    ratios: the clipping candidates (INT4_CLIP_RATIOS).
    loop: candidates after the first in a `lax.fori_loop` (one copy of the candidate's code:
      the Triton kernel compiles faster) instead of unrolled (XLA fuses them). Same results.

  Returns:
    (codes f32 integer-valued in [0, 15], scale f32, zero f32): scale and zero hold float16
    values (their `.astype(float16)` is exact) and keep `axis` with size 1.
  """
  g = x.shape[axis]
  units = float(2 ** err_units_exponent(g))
  lo = jnp.min(x, axis=axis, keepdims=True)
  hi = jnp.max(x, axis=axis, keepdims=True)
  mid = (lo + hi) * 0.5
  half = (hi - lo) * 0.5
  inv_unit = _inv_unit(half)
  # f32(2 * ratio / 15) per candidate: the step of the shrunk range per half range.
  factors = [float(np.float32(2.0 * ratio / Q4_MAX)) for ratio in ratios]

  def candidate(factor):
    scale = round_f16(half * factor)
    zero = round_f16(mid - 7.5 * scale)
    codes = int4_codes(x - zero, scale)
    r = (codes * scale + zero - x) * inv_unit
    err = jnp.sum(jnp.floor(jnp.minimum(r * r, 1.0) * units), axis=axis, keepdims=True)
    return err, codes, scale, zero

  def keep_better(best, new):
    better = new[0] < best[0]  # strictly: the first of equal candidates stays
    return tuple(jnp.where(better, n, o) for n, o in zip(new, best))

  best = candidate(factors[0])
  if loop and len(factors) > 1:
    def body(i, best):
      factor = jnp.float32(factors[-1])
      for j in reversed(range(1, len(factors) - 1)):
        factor = jnp.where(i == j, jnp.float32(factors[j]), factor)
      return keep_better(best, candidate(factor))
    best = jax.lax.fori_loop(1, len(factors), body, best)
  else:
    for factor in factors[1:]:
      best = keep_better(best, candidate(factor))
  return best[1], best[2], best[3]
