"""The int4 codec's group fit, in arithmetic every backend computes bit for bit.

One definition shared by the jnp reference (`kv_codec.encode_reference`), the TPU Pallas kernel
(`kv_codec._int4_encode_kernel`) and the Triton kernel (`kv_codec_gpu._int4_encode_kernel`), so
a chunk encoded on a GPU, a TPU or a CPU gets the same bytes (the int4 payload of
`kv_codec.Int4Payload`: codes, float16 scale and zero per (group of G tokens, channel)).

Backends differ in three ways that used to move int4 codes (the H200 device check found the
Triton encoder's payload differing from the reference's):

  * division: Triton lowers f32 `/` to PTX `div.full.f32` (up to 2 ulp off), TPUs to a
    reciprocal estimate; XLA on CPU/GPU divides exactly. A quotient on a rounding boundary
    (x - zero = (k + 1/2) * scale, frequent with bf16 KV and float16 scales) then rounds to k on
    one backend and k + 1 on another. Here the division only *estimates* the code; it is then
    corrected by exact comparisons against (k -+ 1/2) * scale (products of a 6-bit integer and a
    float16 value: exact in f32), so the code is the round-half-even of the exact quotient.
  * fused multiply-add: LLVM (Triton, XLA:GPU) may contract `a * b + c` into one rounding.
    Every product here that feeds an addition is exact (`code * scale`, `7.5 * scale`), so
    contracted and separate arithmetic agree.
  * reduction order: the clipping search compares squared errors summed over the G tokens, and
    each backend sums in its own tree order. Here each token's squared error is first rounded
    down to an integer number of units (2**-k of the group's half range squared, k from G) and
    capped, so every partial sum is an integer below 2**24: exact in f32 in any order.

What stays backend-dependent: NaN/inf chunks (rejected by `kv_encode`'s finite flag anyway)
and float32 subnormals flushed to zero by some backends (KV values below 2**-126).

The fit (per group of G tokens and channel, over `axis`):

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

#: int4 clipping candidates: each (group, channel) keeps the min-max range shrunk about its
#: middle by the ratio with the least squared error (the first on a tie).
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
Q4_MAX = 15


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


def correct_codes(d: jax.Array, scale: jax.Array, estimate: jax.Array) -> jax.Array:
  """int4 codes `clip(round_half_even(d / scale), 0, 15)` of the *exact* quotient, given an
  estimate within one step of it (any division will do).

  Args:
    d: f32 `x - zero`.
    scale: f32 holding float16 values, >= 0 (0: the code is 0).
    estimate: f32 integer-valued estimate of the rounded quotient (off by at most 1 where it
      matters; far out-of-range values only need the right side of [0, 15]).

  Returns:
    f32 integer-valued codes in [0, 15].
  """
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(estimate, -1.0, Q4_MAX + 1.0)
  # (q -+ 1/2) * scale: a 6-bit odd integer / 2 times a float16 value: exact in f32.
  lower = (q - 0.5) * safe
  upper = (q + 0.5) * safe
  odd = jnp.floor(q * 0.5) * 2.0 != q
  q = jnp.where((d < lower) | ((d == lower) & odd), q - 1.0,
                jnp.where((d > upper) | ((d == upper) & odd), q + 1.0, q))
  return jnp.where(scale > 0, jnp.clip(q, 0.0, float(Q4_MAX)), 0.0)


def int4_codes(d: jax.Array, scale: jax.Array) -> jax.Array:
  """`correct_codes` with the backend's own division as the estimate."""
  safe = jnp.where(scale > 0, scale, 1.0)
  return correct_codes(d, scale, jnp.floor(d / safe + 0.5))


def err_units_exponent(group_tokens: int) -> int:
  """k: each token's squared error counts in units of 2**-k of the group's unit squared, so a
  sum of G capped terms (each <= 2**k) stays <= 2**24 (exact in f32)."""
  return 24 - math.ceil(math.log2(max(int(group_tokens), 1)))


def _inv_unit(half: jax.Array) -> jax.Array:
  """2**-E with 2**E <= half < 2**(E + 1) (E clamped to float32's normal exponents)."""
  e = (jax.lax.bitcast_convert_type(half, jnp.int32) >> 23) & 0xFF
  e = jnp.clip(e, 1, 253)
  return jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32)


def int4_fit(x: jax.Array, axis: int, ratios=INT4_CLIP_RATIOS):
  """Min-max int4 fit over `axis` (the G tokens of a group) with the clipping search.

  Args:
    x: f32 values; `axis` holds the G tokens of each group.
    axis: the group's token axis.
    ratios: the clipping candidates (INT4_CLIP_RATIOS).

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
  best = None
  for ratio in ratios:
    scale = round_f16(half * (2.0 * ratio / Q4_MAX))
    zero = round_f16(mid - 7.5 * scale)
    codes = int4_codes(x - zero, scale)
    r = (codes * scale + zero - x) * inv_unit
    err = jnp.sum(jnp.floor(jnp.minimum(r * r, 1.0) * units), axis=axis, keepdims=True)
    if best is None:
      best = (err, codes, scale, zero)
    else:
      better = err < best[0]
      best = tuple(jnp.where(better, new, old) for new, old in zip((err, codes, scale, zero),
                                                                   best))
  return best[1], best[2], best[3]
