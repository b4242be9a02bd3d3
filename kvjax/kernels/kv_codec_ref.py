"""KV chunk codecs in pure jnp: the constants of the math and the references (the kernels' oracle).

Contract layout `[L, 2, C, K, H]` (axis 1: 0 = K before RoPE, 1 = V); the codecs' spec is the
docstring of `kvjax/kernels/kv_codec.py`, whose Pallas kernels (and the Triton ones of
`kvjax/kernels/kv_codec_gpu.py`) must equal these references: `encode_reference`,
`dequantize_reference` and `kv_decode_reference`. The CPU engine runs them (`use_pallas=False`).
The RoPE and cache-write helpers (`rope_CH`, `write_chunk`) are shared with the kernels'
wrappers and `kvjax/kernels/kvtc.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codecs import INT4 as CODEC_INT4, INT8 as CODEC_INT8, RAW as CODEC_RAW
from kvjax.kernels import exact_quant
from kvjax.kernels.kv_payloads import (CacheGenPayload, Int4Payload, Int8Payload, Payload,
                                       RawPayload, check_encode, codec_of, validate_payload)

# ---------------------------------------------------------------------------------------------
# Constants (the math; ids, levels and G / T from the chunk size are `kvjax.codecs`').

#: CacheGen layer groups (section 5.2): layer l of L is in group `(3 * l) // L`.
CACHEGEN_LAYER_GROUPS = 3
#: CacheGen bins per level and layer group (section C.2 uses 0.5/1/1.5; that is level 1). The
#: delta step of a channel is `bin * rms(deltas of that channel) / CACHEGEN_STEPS_PER_RMS`.
CACHEGEN_LEVEL_BINS = ((0.25, 0.5, 0.75), (0.5, 1.0, 1.5), (1.0, 2.0, 3.0), (2.0, 4.0, 6.0))
#: Quantization steps per RMS of a channel's deltas at bin 1 (tuned on real SmolLM2 KV so that
#: level 0 stays under 2% and level 1 under 4% relative L2 error; scripts/codec_error.py).
CACHEGEN_STEPS_PER_RMS = 6.0
#: int4 clipping candidates (the fit, bit-identical on every backend, is
#: kvjax/kernels/exact_quant.py).
INT4_CLIP_RATIOS = exact_quant.INT4_CLIP_RATIOS

#: int8 codes (int8 payloads, CacheGen anchors and deltas) lie in [-Q8_MAX, Q8_MAX].
Q8_MAX = 127

# ---------------------------------------------------------------------------------------------
# Pure-jnp references (contract layout [L, 2, C, K, H]; the oracle for the kernels).


def _layer_step_factors(num_layers: int, level: int) -> np.ndarray:
  """f32[L]: CacheGen `bin(layer group, level) / CACHEGEN_STEPS_PER_RMS` per layer."""
  bins = np.asarray(CACHEGEN_LEVEL_BINS[level], np.float64) / CACHEGEN_STEPS_PER_RMS
  groups = (CACHEGEN_LAYER_GROUPS * np.arange(num_layers)) // num_layers
  return bins[groups].astype(np.float32)


def unpack_int4(q_u8: jax.Array) -> jax.Array:
  """uint8[..., H // 2] -> int32[..., H] codes (low nibble = even h, high nibble = odd h)."""
  q = q_u8.astype(jnp.int32)
  lo_hi = jnp.stack([q & 0xF, q >> 4], axis=-1)
  return lo_hi.reshape(*q.shape[:-1], 2 * q.shape[-1])


def pack_int4(codes: jax.Array) -> jax.Array:
  """int32[..., H] codes in 0..15 -> uint8[..., H // 2]."""
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)


def dequantize_reference(payload: Payload) -> jax.Array:
  """Dequantizes a payload: f32[L, 2, C, K, H] (K before RoPE, and V).

  Raises:
    ValueError: if the payload breaks the contract's shapes or dtypes.
  """
  codec = codec_of(payload)
  _, c, _, _ = validate_payload(payload)
  if codec == CODEC_RAW:
    return jnp.asarray(payload.values).astype(jnp.float32)
  if codec == CODEC_INT8:
    return payload.q.astype(jnp.float32) * payload.scale.astype(jnp.float32)[:, :, None]
  if codec == CODEC_INT4:
    g = c // payload.scale.shape[2]
    codes = unpack_int4(payload.q).astype(jnp.float32)
    scale = jnp.repeat(payload.scale.astype(jnp.float32), g, axis=2)
    zero = jnp.repeat(payload.zero.astype(jnp.float32), g, axis=2)
    return codes * scale + zero
  t = c // payload.anchor_q.shape[2]
  anchor = payload.anchor_q.astype(jnp.float32) * payload.anchor_scale[:, :, None]
  delta = payload.delta_q.astype(jnp.float32) * payload.delta_step[:, :, None]
  return jnp.repeat(anchor, t, axis=2) + delta


def _int8_encode_ref(x):
  q, scale = exact_quant.int8_quantize(x, axis=2)                       # scale [L, 2, 1, K, H]
  return Int8Payload(q.astype(jnp.int8), scale[:, :, 0])


def _int4_encode_ref(x, group):
  l_, _, c, k, h = x.shape
  xg = x.reshape(l_, 2, c // group, group, k, h)
  codes, scale, zero = exact_quant.int4_fit(xg, axis=3)
  return Int4Payload(pack_int4(codes.astype(jnp.int32).reshape(x.shape)),
                     scale[:, :, :, 0].astype(jnp.float16), zero[:, :, :, 0].astype(jnp.float16))


def _cachegen_encode_ref(x, level, stride):
  l_, _, c, k, h = x.shape
  xg = x.reshape(l_, 2, c // stride, stride, k, h)
  anchor = jnp.mean(xg, axis=3)                                          # [L, 2, A, K, H]
  anchor_scale = jnp.max(jnp.abs(anchor), axis=2) / Q8_MAX             # [L, 2, K, H]
  s = anchor_scale[:, :, None]
  anchor_q = jnp.where(s > 0, jnp.clip(jnp.round(anchor / jnp.where(s > 0, s, 1)),
                                       -Q8_MAX, Q8_MAX), 0)
  anchor_hat = anchor_q * s
  delta = (xg - anchor_hat[:, :, :, None]).reshape(x.shape)             # [L, 2, C, K, H]
  rms = jnp.sqrt(jnp.mean(jnp.square(delta), axis=2))                   # [L, 2, K, H]
  factor = jnp.asarray(_layer_step_factors(l_, level))[:, None, None, None]
  step = jnp.maximum(rms * factor, jnp.max(jnp.abs(delta), axis=2) / Q8_MAX)
  st = step[:, :, None]
  delta_q = jnp.where(st > 0, jnp.clip(jnp.round(delta / jnp.where(st > 0, st, 1)),
                                       -Q8_MAX, Q8_MAX), 0)
  return CacheGenPayload(anchor_q.astype(jnp.int8), anchor_scale, delta_q.astype(jnp.int8), step)


def encode_reference(kv_L2CKH: jax.Array, codec: str, level: int = 0, *,
                     group_tokens: int | None = None,
                     anchor_stride: int | None = None) -> Payload:
  """Encodes a chunk with pure jnp; the oracle for `kv_encode` (same arguments and errors).

  Args:
    kv_L2CKH: float[L, 2, C, K, H] K before RoPE, and V.
    codec: a codec of `kvjax.codecs.CODECS`.
    level: a level of `CODEC_LEVELS[codec]`.
    group_tokens: int4 group G (default `kvjax.codecs.int4_group_tokens(C)`); must divide C.
    anchor_stride: CacheGen T (default `kvjax.codecs.cachegen_anchor_stride(C)`); must divide
      C.

  Returns:
    The codec's payload (device arrays, contract shapes and dtypes).
  """
  group, stride = check_encode(kv_L2CKH, codec, level, group_tokens, anchor_stride)
  return encode_reference_jit(kv_L2CKH, codec=codec, level=int(level), group=group,
                              stride=stride)


@functools.partial(jax.jit, static_argnames=("codec", "level", "group", "stride"))
def encode_reference_jit(kv_L2CKH, *, codec, level, group, stride):
  if codec == CODEC_RAW:
    return RawPayload(kv_L2CKH)
  x = kv_L2CKH.astype(jnp.float32)
  if codec == CODEC_INT8:
    return _int8_encode_ref(x)
  if codec == CODEC_INT4:
    return _int4_encode_ref(x, group)
  return _cachegen_encode_ref(x, level, stride)


def rope_CH(x_CH, cos_CH, sin_CH):
  """HF `rotate_half` RoPE in f32: x * cos + rotate_half(x) * sin, over the last axis."""
  half = x_CH.shape[-1] // 2
  rotated = jnp.concatenate([-x_CH[..., half:], x_CH[..., :half]], axis=-1)
  return x_CH * cos_CH + rotated * sin_CH


def write_chunk(k_LBSKH, v_LBSKH, k_LCKH, v_LCKH, slot, start):
  """Writes a chunk's K `[L, C, K, H]` (after RoPE) and V into caches `[L, slots, S_max, K, H]`
  at `[slot, start:start + C]`, cast to the cache dtype (`dynamic_update_slice`: in place when
  the caller donates the caches). Returns the updated (k, v) caches."""
  zero = jnp.int32(0)
  idx = (zero, jnp.asarray(slot, jnp.int32), jnp.asarray(start, jnp.int32), zero, zero)
  k = jax.lax.dynamic_update_slice(k_LBSKH, k_LCKH.astype(k_LBSKH.dtype)[:, None], idx)
  v = jax.lax.dynamic_update_slice(v_LBSKH, v_LCKH.astype(v_LBSKH.dtype)[:, None], idx)
  return k, v


def kv_decode_reference(payload: Payload, k_LBSKH: jax.Array, v_LBSKH: jax.Array,
                        slot: jax.Array, start: jax.Array, cos_CH: jax.Array,
                        sin_CH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Pure-jnp `kv_decode`: dequantize, rotate K, cast, write at `[slot, start:start + C]`.

  Same arguments as `kv_decode` (no donation, no validation of slot/start).
  """
  kv = dequantize_reference(payload)
  k_LCKH = rope_CH(kv[:, 0], cos_CH.astype(jnp.float32)[:, None],
                   sin_CH.astype(jnp.float32)[:, None])
  return write_chunk(k_LBSKH, v_LBSKH, k_LCKH, kv[:, 1], slot, start)
