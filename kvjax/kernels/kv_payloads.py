"""KV codec payloads: one NamedTuple of arrays per codec, and the checks of the codec arguments.

A payload is what a codec turns a stored chunk `kv_L2CKH: [L, 2, C, K, H]` into (the contract's
table in `kvjax/storage/format/codecs.py`; codec ids, levels and the chunk-size rule in the registry,
`kvjax.codecs`). The codec math is `kvjax/kernels/kv_codec.py` (spec, Pallas kernels and their
wrappers) and `kvjax/kernels/kv_codec_ref.py` (the pure-jnp references); both build and read
the records here, and validate their arguments with the checks here, so the contract is written
once.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import codecs as registry
from kvjax.codecs import (CACHEGEN as CODEC_CACHEGEN, CODEC_LEVELS, INT4 as CODEC_INT4,
                          INT8 as CODEC_INT8, RAW as CODEC_RAW)

# ---------------------------------------------------------------------------------------------
# Payloads: the contract's arrays, one NamedTuple per codec (same field names as the dict).


class RawPayload(NamedTuple):
  """values: float[L, 2, C, K, H] (K before RoPE, and V) in the stored dtype."""
  values: jax.Array


class Int8Payload(NamedTuple):
  """Symmetric per-channel int8.

  Attributes:
    q: int8[L, 2, C, K, H] codes in [-127, 127].
    scale: f32[L, 2, K, H] absmax over the C tokens / 127 (0 for an all-zero channel).
  """
  q: jax.Array
  scale: jax.Array


class Int4Payload(NamedTuple):
  """Asymmetric int4 per channel per group of G tokens (G = C // scale.shape[2]).

  Attributes:
    q: uint8[L, 2, C, K, H // 2] two codes per byte along H: low nibble = even h, high = odd h.
    scale: f16[L, 2, C // G, K, H] step per (group, channel).
    zero: f16[L, 2, C // G, K, H] value of code 0 per (group, channel).
  """
  q: jax.Array
  scale: jax.Array
  zero: jax.Array


class CacheGenPayload(NamedTuple):
  """CacheGen anchors and deltas (arXiv 2310.07240, section 5.2), before entropy coding.

  Attributes:
    anchor_q: int8[L, 2, A, K, H] one anchor per group of T = C // A tokens.
    anchor_scale: f32[L, 2, K, H] absmax over the A anchors / 127.
    delta_q: int8[L, 2, C, K, H] every token's delta against its dequantized anchor, in steps.
    delta_step: f32[L, 2, K, H] per-channel step; grows with the layer group and the level.
  """
  anchor_q: jax.Array
  anchor_scale: jax.Array
  delta_q: jax.Array
  delta_step: jax.Array


Payload = Union[RawPayload, Int8Payload, Int4Payload, CacheGenPayload]
#: Codec id -> payload type.
PAYLOAD_TYPES = {CODEC_RAW: RawPayload, CODEC_INT8: Int8Payload, CODEC_INT4: Int4Payload,
                 CODEC_CACHEGEN: CacheGenPayload}


def codec_of(payload: Payload) -> str:
  """The codec id of a payload.

  Raises:
    ValueError: if `payload` is not one of the payload types.
  """
  for codec, cls in PAYLOAD_TYPES.items():
    if type(payload) is cls:  # pylint: disable=unidiomatic-typecheck
      return codec
  raise ValueError(f"not a KV codec payload: {type(payload).__name__}; want one of "
                   f"{[c.__name__ for c in PAYLOAD_TYPES.values()]}")


# ---------------------------------------------------------------------------------------------
# Validation.

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _shape_dtype(x, name):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  return tuple(x.shape), jnp.dtype(x.dtype)


def _expect(x, name, shape, dtype):
  got_shape, got_dtype = _shape_dtype(x, name)
  if got_shape != tuple(shape) or got_dtype != jnp.dtype(dtype):
    raise ValueError(f"{name}: want {jnp.dtype(dtype).name}{list(shape)}, "
                     f"got {got_dtype.name}{list(got_shape)}")


def validate_payload(payload: Payload) -> tuple[int, int, int, int]:
  """Checks a payload against the contract table; returns its (L, C, K, H).

  Raises:
    ValueError: on a wrong type, rank, shape or dtype, or a group/anchor count not dividing C.
  """
  codec = codec_of(payload)
  # The array holding every token gives L, C, K and H (H / 2 for int4's packed nibbles).
  main = {CODEC_RAW: "values", CODEC_INT8: "q", CODEC_INT4: "q", CODEC_CACHEGEN: "delta_q"}[codec]
  shape, dtype = _shape_dtype(getattr(payload, main), f"{codec}.{main}")
  if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
    raise ValueError(f"{codec}.{main} must be [L, 2, C, K, H] (H // 2 for int4), got {shape}")
  l_, _, c, k, h = shape
  if codec == CODEC_INT4:
    h *= 2

  def per_group(name):  # [L, 2, n, K, H] with n dividing C; returns n.
    got = _shape_dtype(getattr(payload, name), f"{codec}.{name}")[0]
    n = got[2] if len(got) == 5 else 0
    if n < 1 or c % n:
      raise ValueError(f"{codec}.{name} must be [L, 2, n, K, H] with n dividing C={c}, got "
                       f"{list(got)}")
    return n

  if codec == CODEC_RAW:
    if dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
      raise ValueError(f"raw.values must be float32/bfloat16/float16, got {dtype.name}")
  elif codec == CODEC_INT8:
    _expect(payload.q, "int8.q", (l_, 2, c, k, h), jnp.int8)
    _expect(payload.scale, "int8.scale", (l_, 2, k, h), jnp.float32)
  elif codec == CODEC_INT4:
    _expect(payload.q, "int4.q", (l_, 2, c, k, h // 2), jnp.uint8)
    n = per_group("scale")
    _expect(payload.scale, "int4.scale", (l_, 2, n, k, h), jnp.float16)
    _expect(payload.zero, "int4.zero", (l_, 2, n, k, h), jnp.float16)
  else:
    _expect(payload.delta_q, "cachegen.delta_q", (l_, 2, c, k, h), jnp.int8)
    a = per_group("anchor_q")
    _expect(payload.anchor_q, "cachegen.anchor_q", (l_, 2, a, k, h), jnp.int8)
    _expect(payload.anchor_scale, "cachegen.anchor_scale", (l_, 2, k, h), jnp.float32)
    _expect(payload.delta_step, "cachegen.delta_step", (l_, 2, k, h), jnp.float32)
  if h % 2:
    raise ValueError(f"head dim H={h} must be even (RoPE rotate_half, int4 nibble pairs)")
  return l_, c, k, h


def check_encode(kv_L2CKH, codec, level, group_tokens, anchor_stride) -> tuple[int, int]:
  """Validates `kv_encode` arguments; returns the int4 group G and the CacheGen stride T."""
  if not isinstance(codec, str) or codec not in CODEC_LEVELS:
    raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODEC_LEVELS)}")
  if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or (
      level not in CODEC_LEVELS[codec]):
    raise ValueError(f"codec {codec!r} has levels {list(CODEC_LEVELS[codec])}, got {level!r}")
  shape, dtype = _shape_dtype(kv_L2CKH, "kv_L2CKH")
  if len(shape) != 5 or shape[1] != 2 or min(shape) < 1:
    raise ValueError(f"kv_L2CKH must be [L, 2, C, K, H] with L, C, K, H >= 1, got {list(shape)}")
  if dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise ValueError(f"kv_L2CKH must be float32/bfloat16/float16, got {dtype.name}")
  c, h = shape[2], shape[4]
  if h % 2:
    raise ValueError(f"head dim H={h} must be even (RoPE rotate_half, int4 nibble pairs)")

  def tokens(value, rule, name):
    value = rule(c) if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 or (
        c % value):
      raise ValueError(f"{name}={value!r} must be a positive int dividing the chunk's C={c}")
    return int(value)

  # Only the codec's own parameter is checked; the other is 0 (one compile per real variant).
  return (tokens(group_tokens, registry.int4_group_tokens, "group_tokens")
          if codec == CODEC_INT4 else 0,
          tokens(anchor_stride, registry.cachegen_anchor_stride, "anchor_stride")
          if codec == CODEC_CACHEGEN else 0)


def _concrete_int(x):
  """The value of a concrete integer scalar, or None for a tracer."""
  if isinstance(x, jax.core.Tracer):
    return None
  return int(x)


def check_decode(payload, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH) -> None:
  """Validates `kv_decode` arguments (slot/start bounds only when they are concrete)."""
  l_, c, k, h = validate_payload(payload)
  shape, dtype = _shape_dtype(k_LBSKH, "k_LBSKH")
  if (shape, dtype) != _shape_dtype(v_LBSKH, "v_LBSKH"):
    raise ValueError(f"K and V caches differ: {dtype.name}{list(shape)} vs "
                     f"{jnp.dtype(v_LBSKH.dtype).name}{list(v_LBSKH.shape)}")
  if dtype not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
    raise ValueError(f"cache dtype must be float32/bfloat16/float16, got {dtype.name}")
  if len(shape) != 5 or (shape[0], shape[3], shape[4]) != (l_, k, h) or shape[2] < c:
    raise ValueError(f"cache {list(shape)} does not hold a chunk of L={l_}, C={c}, K={k}, H={h} "
                     "(want [L, slots, S_max >= C, K, H])")
  for name, x in (("cos_CH", cos_CH), ("sin_CH", sin_CH)):
    got, got_dtype = _shape_dtype(x, name)
    if got != (c, h) or not jnp.issubdtype(got_dtype, jnp.floating):
      raise ValueError(f"{name} must be float[C={c}, H={h}], got {got_dtype.name}{list(got)}")
  limits = {"slot": shape[1] - 1, "start": shape[2] - c}
  for name, x in (("slot", slot), ("start", start)):
    x_shape, x_dtype = _shape_dtype(jnp.asarray(x) if isinstance(x, (int, np.integer)) else x,
                                    name)
    if x_shape != () or not jnp.issubdtype(x_dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer scalar, got {x_dtype.name}{list(x_shape)}")
    value = _concrete_int(x)
    if value is not None and not 0 <= value <= limits[name]:
      raise ValueError(f"{name}={value} outside [0, {limits[name]}] (cache {list(shape)}, "
                       f"chunk of C={c})")
