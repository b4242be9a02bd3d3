"""KV chunk codecs: Pallas encode and decode kernels with pure-jnp references.

A stored chunk is the KV of C tokens of every layer, `kv_L2CKH: [L, 2, C, K, H]` (axis 1: 0 = K
before RoPE, 1 = V). A codec turns it into a *payload* (a NamedTuple of arrays: the contract's
table in `kvjax/storage/codecs.py`; codec ids, versions, levels and the chunk-size rule in the
registry, `kvjax.codecs`) and back:

    device (engine, after prefill)            host (storage)               device (engine, load)
    kv_L2CKH --kv_encode--> payload --> bytes (entropy coding) --> payload --kv_decode--> KV cache
                 Pallas                 numpy, not JAX                        Pallas + DUS

Entropy coding of CacheGen's `delta_q`/`anchor_q` runs on the host in the storage room; it is the
one step of decoding that is not a Pallas kernel. `kv_decode` dequantizes, undoes the anchor
deltas, rotates K to its target positions (RoPE, HF `rotate_half` layout) and writes the chunk
into the cache slot; `kv_encode` quantizes a chunk the model just computed (K before RoPE).

Codecs (x̂ is the dequantized value, per layer l, K/V, token t, head k, channel h):

    raw       x̂ = values                                             (bit-exact)
    int8      x̂ = q * scale[l,kv,k,h]        symmetric, absmax over the C tokens / 127 (scale
                                             rounded to 16 significant bits; codes
                                             bit-identical on every backend)
    int4      x̂ = code * scale + zero        asymmetric per channel per group of G tokens; the
                                             fit is bit-identical on every backend
                                             (int8 and int4: kvjax/kernels/exact_quant.py)
    cachegen  x̂ = anchor_q[t // T] * anchor_scale + delta_q[t] * delta_step

CacheGen (arXiv 2310.07240) section 5.2: token-wise locality (each group of T tokens shares an
anchor; every token stores its delta against the *dequantized* anchor, so errors never compound)
and layer-wise quantization (bins grow with layer depth: three layer groups, bins 0.5/1/1.5 at
level 1 as in section C.2). Entropy coding per layer and channel (section 5.2) is storage's job.

Kernel layout. The contract layout puts kv heads next to the head dim (`[..., K, H]`). The kernels
run on a grid over (layer, kv head) and need blocks whose last two dims are whole array dims (the
TPU Mosaic rule; Triton also wants power-of-two block dims, and SmolLM2 has K = 3), so the jitted
wrappers transpose chunk-sized arrays to head-major `[L, 2, K, C, H]` (and per-channel arrays to
`[L, 2, K, 1, H]`) around the `pallas_call`. Blocks are then `(2, C, H)`, `(2, 1, H)`,
`(2, C // G, H)`, `(2, A, H)`: whole trailing dims, powers of two whenever C, H, A, C // G are.
The transposes touch only the chunk, never the cache.

The cache write is a `lax.dynamic_update_slice` in the same jit with the cache donated, not an
aliased Pallas output block: `start` is any token offset (not a multiple of a block), a block
index map cannot express that on every backend, and an aliased `[.., K, H]`-layout block would
break the whole-trailing-dims rule once the grid splits K. XLA performs the donated update in
place, so the only traffic is the chunk itself. Nothing here has been compiled for a GPU or TPU;
it is tested with `interpret=True` on CPU (`interpret=False` raises on CPU).

Measured on real SmolLM2-135M KV (1024 tokens, chunks of 256, f32; scripts/codec_error.py),
relative L2 error of the chunk, max over chunks: int8 0.54%, int4 5.1% (V alone 8.6%), cachegen
levels 0..3: 1.6%, 3.2%, 6.3%, 12.6%.

File order (STYLE.md "Kernels"): constants (no tunable block sizes: a grid step is one whole
(layer, kv head) slice of the chunk), payloads, references, validation, kernel bodies, jitted
wrappers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import codecs as registry
from kvjax.kernels import exact_quant, kv_codec_gpu
from kvjax.kernels.platform import resolve_platform
# Codec ids, levels and the chunk-size rule come from the registry (one table for every room).
from kvjax.codecs import (CACHEGEN as CODEC_CACHEGEN, CODEC_LEVELS, INT4 as CODEC_INT4,
                          INT8 as CODEC_INT8, RAW as CODEC_RAW)

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

_Q8_MAX = 127

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


def payload_from_arrays(codec: str, arrays: dict) -> Payload:
  """Builds the codec's payload from a `{name: array}` dict (what storage hands the engine).

  Raises:
    ValueError: unknown codec, missing or unexpected names, or shapes/dtypes that break the
      contract.
  """
  if codec not in PAYLOAD_TYPES:
    raise ValueError(f"unknown codec {codec!r}; known: {sorted(PAYLOAD_TYPES)}")
  cls = PAYLOAD_TYPES[codec]
  if not isinstance(arrays, dict) or set(arrays) != set(cls._fields):
    got = sorted(arrays) if isinstance(arrays, dict) else type(arrays).__name__
    raise ValueError(f"{codec} payload needs arrays {list(cls._fields)}, got {got}")
  payload = cls(**{name: arrays[name] for name in cls._fields})
  validate_payload(payload)
  return payload


def payload_arrays(payload: Payload) -> dict[str, np.ndarray]:
  """The payload as a `{name: np.ndarray}` dict on the host (copies device arrays)."""
  codec_of(payload)
  return {name: np.asarray(value) for name, value in payload._asdict().items()}


# ---------------------------------------------------------------------------------------------
# Pure-jnp references (contract layout [L, 2, C, K, H]; the oracle for the kernels).


def _layer_step_factors(num_layers: int, level: int) -> np.ndarray:
  """f32[L]: CacheGen `bin(layer group, level) / CACHEGEN_STEPS_PER_RMS` per layer."""
  bins = np.asarray(CACHEGEN_LEVEL_BINS[level], np.float64) / CACHEGEN_STEPS_PER_RMS
  groups = (CACHEGEN_LAYER_GROUPS * np.arange(num_layers)) // num_layers
  return bins[groups].astype(np.float32)


def _unpack_int4(q_u8: jax.Array) -> jax.Array:
  """uint8[..., H // 2] -> int32[..., H] codes (low nibble = even h, high nibble = odd h)."""
  q = q_u8.astype(jnp.int32)
  lo_hi = jnp.stack([q & 0xF, q >> 4], axis=-1)
  return lo_hi.reshape(*q.shape[:-1], 2 * q.shape[-1])


def _pack_int4(codes: jax.Array) -> jax.Array:
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
    codes = _unpack_int4(payload.q).astype(jnp.float32)
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
  return Int4Payload(_pack_int4(codes.astype(jnp.int32).reshape(x.shape)),
                     scale[:, :, :, 0].astype(jnp.float16), zero[:, :, :, 0].astype(jnp.float16))


def _cachegen_encode_ref(x, level, stride):
  l_, _, c, k, h = x.shape
  xg = x.reshape(l_, 2, c // stride, stride, k, h)
  anchor = jnp.mean(xg, axis=3)                                          # [L, 2, A, K, H]
  anchor_scale = jnp.max(jnp.abs(anchor), axis=2) / _Q8_MAX             # [L, 2, K, H]
  s = anchor_scale[:, :, None]
  anchor_q = jnp.where(s > 0, jnp.clip(jnp.round(anchor / jnp.where(s > 0, s, 1)),
                                       -_Q8_MAX, _Q8_MAX), 0)
  anchor_hat = anchor_q * s
  delta = (xg - anchor_hat[:, :, :, None]).reshape(x.shape)             # [L, 2, C, K, H]
  rms = jnp.sqrt(jnp.mean(jnp.square(delta), axis=2))                   # [L, 2, K, H]
  factor = jnp.asarray(_layer_step_factors(l_, level))[:, None, None, None]
  step = jnp.maximum(rms * factor, jnp.max(jnp.abs(delta), axis=2) / _Q8_MAX)
  st = step[:, :, None]
  delta_q = jnp.where(st > 0, jnp.clip(jnp.round(delta / jnp.where(st > 0, st, 1)),
                                       -_Q8_MAX, _Q8_MAX), 0)
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
  group, stride = _check_encode(kv_L2CKH, codec, level, group_tokens, anchor_stride)
  return _encode_reference_jit(kv_L2CKH, codec=codec, level=int(level), group=group,
                               stride=stride)


@functools.partial(jax.jit, static_argnames=("codec", "level", "group", "stride"))
def _encode_reference_jit(kv_L2CKH, *, codec, level, group, stride):
  if codec == CODEC_RAW:
    return RawPayload(kv_L2CKH)
  x = kv_L2CKH.astype(jnp.float32)
  if codec == CODEC_INT8:
    return _int8_encode_ref(x)
  if codec == CODEC_INT4:
    return _int4_encode_ref(x, group)
  return _cachegen_encode_ref(x, level, stride)


def _rope_CH(x_CH, cos_CH, sin_CH):
  """HF `rotate_half` RoPE in f32: x * cos + rotate_half(x) * sin, over the last axis."""
  half = x_CH.shape[-1] // 2
  rotated = jnp.concatenate([-x_CH[..., half:], x_CH[..., :half]], axis=-1)
  return x_CH * cos_CH + rotated * sin_CH


def _write_chunk(k_LBSKH, v_LBSKH, k_LCKH, v_LCKH, slot, start):
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
  k_LCKH = _rope_CH(kv[:, 0], cos_CH.astype(jnp.float32)[:, None],
                    sin_CH.astype(jnp.float32)[:, None])
  return _write_chunk(k_LBSKH, v_LBSKH, k_LCKH, kv[:, 1], slot, start)


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


def _check_encode(kv_L2CKH, codec, level, group_tokens, anchor_stride) -> tuple[int, int]:
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


def _check_backend(interpret, use_pallas, platform) -> str:
  """The target platform (`resolve_platform`); raises for compiled Pallas aimed at a CPU."""
  platform = resolve_platform(platform)
  if use_pallas and not interpret and platform == "cpu":
    raise ValueError("compiled Pallas kernels need a GPU or TPU; on CPU pass use_pallas=False "
                     "(the jnp reference) or interpret=True")
  return platform


def _check_decode(payload, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH) -> None:
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


# ---------------------------------------------------------------------------------------------
# Kernel bodies. Grid (layer l, kv head k); every block is one (l, k) slice, head-major.


def _dequant_raw_block(values_ref):
  # values_ref: [2, C, H] stored dtype
  return values_ref[...].astype(jnp.float32)


def _dequant_int8_block(q_ref, scale_ref):
  # q_ref: int8[2, C, H]; scale_ref: f32[2, 1, H]
  return q_ref[...].astype(jnp.float32) * scale_ref[...]


def _dequant_int4_block(q_ref, scale_ref, zero_ref):
  # q_ref: uint8[2, C, H // 2]; scale_ref, zero_ref: f32[2, C // G, H] (the payload's f16
  # values, widened by the wrapper: Mosaic TPU cannot load float16)
  codes_2CH = _unpack_int4(q_ref[...]).astype(jnp.float32)
  _, c, h = codes_2CH.shape
  n = scale_ref.shape[1]
  scale_2N1H = scale_ref[...].astype(jnp.float32)[:, :, None]
  zero_2N1H = zero_ref[...].astype(jnp.float32)[:, :, None]
  x_2NGH = codes_2CH.reshape(2, n, c // n, h) * scale_2N1H + zero_2N1H
  return x_2NGH.reshape(2, c, h)


def _dequant_cachegen_block(anchor_q_ref, anchor_scale_ref, delta_q_ref, delta_step_ref):
  # anchor_q_ref: int8[2, A, H]; anchor_scale_ref: f32[2, 1, H]
  # delta_q_ref: int8[2, C, H]; delta_step_ref: f32[2, 1, H]
  anchor_2AH = anchor_q_ref[...].astype(jnp.float32) * anchor_scale_ref[...]
  delta_2CH = delta_q_ref[...].astype(jnp.float32) * delta_step_ref[...]
  _, a, h = anchor_2AH.shape
  c = delta_2CH.shape[1]
  return (anchor_2AH[:, :, None] + delta_2CH.reshape(2, a, c // a, h)).reshape(2, c, h)


_DEQUANT_BLOCK = {CODEC_RAW: _dequant_raw_block, CODEC_INT8: _dequant_int8_block,
                  CODEC_INT4: _dequant_int4_block, CODEC_CACHEGEN: _dequant_cachegen_block}


def _decode_kernel(dequant, *refs):
  """Dequantize one (layer, kv head) block, rotate K, cast to the cache dtype."""
  *payload_refs, cos_ref, sin_ref, k_ref, v_ref = refs
  # cos_ref, sin_ref: f32[C, H]; k_ref, v_ref: cache dtype[C, H]
  x_2CH = dequant(*payload_refs)
  k_ref[...] = _rope_CH(x_2CH[0], cos_ref[...], sin_ref[...]).astype(k_ref.dtype)
  v_ref[...] = x_2CH[1].astype(v_ref.dtype)


def _int8_encode_kernel(x_ref, q_ref, scale_ref):
  # x_ref: [2, C, H] KV dtype; q_ref: int8[2, C, H]; scale_ref: f32[2, 1, H]
  q, scale = exact_quant.int8_quantize(x_ref[...].astype(jnp.float32), axis=1)
  q_ref[...] = q.astype(jnp.int8)
  scale_ref[...] = scale


def _int4_encode_kernel(x_ref, q_ref, scale_ref, zero_ref):
  # x_ref: [2, C, H] KV dtype; q_ref: uint8[2, C, H // 2]; scale_ref, zero_ref: f32[2, C // G, H]
  # holding float16 values (no float16 inside the kernel; the wrapper casts, exactly)
  x = x_ref[...].astype(jnp.float32)
  _, c, h = x.shape
  n = scale_ref.shape[1]
  codes_2NGH, scale_2N1H, zero_2N1H = exact_quant.int4_fit(x.reshape(2, n, c // n, h), axis=2)
  q_ref[...] = _pack_int4(codes_2NGH.astype(jnp.int32).reshape(2, c, h))
  scale_ref[...] = scale_2N1H[:, :, 0]
  zero_ref[...] = zero_2N1H[:, :, 0]


def _cachegen_encode_kernel(factors, x_ref, anchor_q_ref, anchor_scale_ref, delta_q_ref,
                            delta_step_ref):
  # x_ref: [2, C, H] KV dtype; anchor_q_ref: int8[2, A, H]; anchor_scale_ref: f32[2, 1, H]
  # delta_q_ref: int8[2, C, H]; delta_step_ref: f32[2, 1, H]
  # factors: static per-layer-group `bin / CACHEGEN_STEPS_PER_RMS` (section 5.2, layer groups).
  x = x_ref[...].astype(jnp.float32)
  _, c, h = x.shape
  a = anchor_q_ref.shape[1]
  anchor_2AH = jnp.mean(x.reshape(2, a, c // a, h), axis=2)
  anchor_scale = jnp.max(jnp.abs(anchor_2AH), axis=1, keepdims=True) / _Q8_MAX
  anchor_q = jnp.where(anchor_scale > 0, jnp.clip(jnp.round(
      anchor_2AH / jnp.where(anchor_scale > 0, anchor_scale, 1)), -_Q8_MAX, _Q8_MAX), 0)
  anchor_hat_2A1H = (anchor_q * anchor_scale)[:, :, None]
  delta_2CH = (x.reshape(2, a, c // a, h) - anchor_hat_2A1H).reshape(2, c, h)
  rms = jnp.sqrt(jnp.mean(jnp.square(delta_2CH), axis=1, keepdims=True))
  group = (CACHEGEN_LAYER_GROUPS * pl.program_id(0)) // pl.num_programs(0)
  factor = factors[-1]
  for g in reversed(range(len(factors) - 1)):
    factor = jnp.where(group == g, factors[g], factor)
  step = jnp.maximum(rms * factor, jnp.max(jnp.abs(delta_2CH), axis=1, keepdims=True) / _Q8_MAX)
  delta_q = jnp.where(step > 0, jnp.clip(jnp.round(delta_2CH / jnp.where(step > 0, step, 1)),
                                         -_Q8_MAX, _Q8_MAX), 0)
  anchor_q_ref[...] = anchor_q.astype(jnp.int8)
  anchor_scale_ref[...] = anchor_scale
  delta_q_ref[...] = delta_q.astype(jnp.int8)
  delta_step_ref[...] = step


# ---------------------------------------------------------------------------------------------
# Jitted wrappers.


def _heads(x_L2nKH):
  """[L, 2, n, K, H] <-> [L, 2, K, n, H] (contract layout <-> kernel layout)."""
  return jnp.transpose(x_L2nKH, (0, 1, 3, 2, 4))


def _head_spec(n, h):
  """Block (2, n, H) of a [L, 2, K, n, H] array at grid point (layer l, kv head k)."""
  return pl.BlockSpec((None, 2, None, n, h), lambda l, k: (l, 0, k, 0, 0))


def _kernel_inputs(payload):
  """Payload arrays in kernel layout with their block specs."""
  arrays, specs = [], []
  for x in payload:
    if x.dtype == jnp.float16:  # int4 scale/zero (raw f16 values): exact, and no float16
      x = x.astype(jnp.float32)  # vectors inside a TPU kernel
    if x.ndim == 4:  # per channel [L, 2, K, H] -> [L, 2, K, 1, H]
      x = x[:, :, :, None, :]
    else:
      x = _heads(x)
    arrays.append(x)
    specs.append(_head_spec(x.shape[3], x.shape[4]))
  return arrays, specs


#: Scoped VMEM of the TPU codec kernels, bytes: int4's clipping search keeps a few [2, C, H]
#: float32 temporaries per candidate (16.2 MiB at C = 256, H = 64) and its decode's unpacking
#: exceeds the 16 MiB default on a v5e at H = 128 (LLaMA-3.1-8B); v5e, v6e and v5p have
#: 128 / 128 / 95 MiB of VMEM per core.
_TPU_CODEC_VMEM_BYTES = 48 << 20


def _tpu_vmem_params(platform, interpret) -> dict:
  """`pallas_call` keywords raising the scoped VMEM limit when compiling for TPU."""
  if platform != "tpu" or interpret:
    return {}
  return {"compiler_params": pltpu.CompilerParams(vmem_limit_bytes=_TPU_CODEC_VMEM_BYTES)}


def _dequant_rope_pallas(payload, cos_CH, sin_CH, dtype, interpret, platform=None):
  """Pallas dequantize + RoPE: (k_LCKH, v_LCKH) in `dtype`, K rotated."""
  codec = codec_of(payload)
  l_, c, k_, h = validate_payload(payload)
  arrays, specs = _kernel_inputs(payload)
  cs_spec = pl.BlockSpec((c, h), lambda l, k: (0, 0))
  out_spec = pl.BlockSpec((None, None, c, h), lambda l, k: (l, k, 0, 0))
  out_shape = jax.ShapeDtypeStruct((l_, k_, c, h), dtype)
  k_LKCH, v_LKCH = pl.pallas_call(
      functools.partial(_decode_kernel, _DEQUANT_BLOCK[codec]),
      out_shape=(out_shape, out_shape),
      grid=(l_, k_),
      in_specs=specs + [cs_spec, cs_spec],
      out_specs=(out_spec, out_spec),
      interpret=interpret,
      name=f"kv_decode_{codec}",
      **_tpu_vmem_params(platform, interpret),
  )(*arrays, cos_CH, sin_CH)
  return jnp.transpose(k_LKCH, (0, 2, 1, 3)), jnp.transpose(v_LKCH, (0, 2, 1, 3))


@functools.partial(jax.jit, static_argnames=("interpret", "use_pallas", "platform"),
                   donate_argnums=(1, 2))
def _kv_decode_jit(payload, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH, *, interpret,
                   use_pallas, platform):
  # One Pallas kernel for "tpu" and "cuda" (the dispatch point per platform).
  cos_CH = cos_CH.astype(jnp.float32)
  sin_CH = sin_CH.astype(jnp.float32)
  if not use_pallas:
    return kv_decode_reference(payload, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH)
  if platform == "cuda":  # Triton bodies (kvjax/kernels/kv_codec_gpu.py)
    k_LCKH, v_LCKH = kv_codec_gpu.dequant_rope(codec_of(payload), payload, cos_CH, sin_CH,
                                               k_LBSKH.dtype, interpret=interpret)
  else:
    k_LCKH, v_LCKH = _dequant_rope_pallas(payload, cos_CH, sin_CH, k_LBSKH.dtype, interpret,
                                          platform)
  return _write_chunk(k_LBSKH, v_LBSKH, k_LCKH, v_LCKH, slot, start)


def kv_decode(payload: Payload, k_LBSKH: jax.Array, v_LBSKH: jax.Array, slot, start,
              cos_CH: jax.Array, sin_CH: jax.Array, *, interpret: bool = False,
              use_pallas: bool = True, platform: str | None = None
              ) -> tuple[jax.Array, jax.Array]:
  """Decodes a stored chunk into a cache slot: dequantize, undo deltas, RoPE K, cast, write.

  The dequantize + RoPE step is the Pallas kernel `kv_decode_<codec>` over a (layer, kv head)
  grid; the write is a donated `dynamic_update_slice` in the same jit. Compiles once per codec,
  chunk size (and group/anchor count) and cache shape; `slot` and `start` are traced. Entropy
  decoding (CacheGen, arXiv 2310.07240 section 5.2) happened before, on the host, in storage.

      cache [L, slots, S_max, K, H]:  slot `slot`, positions [start, start + C) <- the chunk
                                      every other position and slot is left untouched

  Args:
    payload: a RawPayload/Int8Payload/Int4Payload/CacheGenPayload of a chunk [L, 2, C, K, H]
      (K before RoPE), host or device arrays.
    k_LBSKH: [L, slots, S_max, K, H] key cache (after RoPE), float32/bfloat16/float16. Donated.
    v_LBSKH: [L, slots, S_max, K, H] value cache, same shape and dtype. Donated.
    slot: int32 scalar decode slot, in [0, slots).
    start: int32 scalar position of the chunk's first token, in [0, S_max - C].
    cos_CH: float[C, H] RoPE cosines at positions start..start + C - 1 (HF `rotate_half` layout:
      the H // 2 frequencies twice), computed by the caller (kvjax.models.layers).
    sin_CH: float[C, H] RoPE sines, same layout.
    interpret: run the Pallas kernel in interpret mode (CPU tests); False compiles it for the
      backend (Triton/Mosaic GPU, Mosaic TPU), which raises on CPU.
    use_pallas: False runs the pure-jnp reference instead (the CPU engine's path).
    platform: the target ("cpu" | "tpu" | "cuda"); None: the platform being compiled for
      (`kvjax.kernels.platform.resolve_platform`; TPU topology devices count, not the host).
      "cuda" uses the Triton kernel `kv_decode_<codec>_gpu` (kvjax/kernels/kv_codec_gpu.py; C,
      H powers of two), which also runs with interpret=True on CPU and lowers for CUDA on a CPU
      host.

  Returns:
    (k_LBSKH, v_LBSKH): the updated caches (same shapes and dtype). The chunk is computed in f32
    and cast to the cache dtype.

  Raises:
    ValueError: a payload that breaks the contract, caches or cos/sin of the wrong shape or
      dtype, a concrete slot/start out of range, or compiled Pallas (use_pallas=True,
      interpret=False) for a CPU target.
  """
  _check_decode(payload, k_LBSKH, v_LBSKH, slot, start, cos_CH, sin_CH)
  platform = _check_backend(interpret, use_pallas, platform)
  return _kv_decode_jit(payload, k_LBSKH, v_LBSKH, jnp.asarray(slot, jnp.int32),
                        jnp.asarray(start, jnp.int32), cos_CH, sin_CH,
                        interpret=bool(interpret), use_pallas=bool(use_pallas), platform=platform)


def _encode_pallas(x_L2CKH, codec, level, group, stride, interpret, platform):
  l_, _, c, k_, h = x_L2CKH.shape
  x_spec = _head_spec(c, h)
  params = _tpu_vmem_params(platform, interpret)

  def call(kernel, outs):
    out_shape = [jax.ShapeDtypeStruct((l_, 2, k_, n, hh), dt) for n, hh, dt in outs]
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(l_, k_), in_specs=[x_spec],
        out_specs=[_head_spec(n, hh) for n, hh, _ in outs], interpret=interpret,
        name=f"kv_encode_{codec}", **params)(_heads(x_L2CKH))

  if codec == CODEC_INT8:
    q, scale = call(_int8_encode_kernel, [(c, h, jnp.int8), (1, h, jnp.float32)])
    return Int8Payload(_heads(q), scale[:, :, :, 0])
  if codec == CODEC_INT4:
    q, scale, zero = call(_int4_encode_kernel, [(c, h // 2, jnp.uint8),
                                                (c // group, h, jnp.float32),
                                                (c // group, h, jnp.float32)])
    return Int4Payload(_heads(q), _heads(scale).astype(jnp.float16),
                       _heads(zero).astype(jnp.float16))
  factors = tuple(float(np.float32(b / CACHEGEN_STEPS_PER_RMS))
                  for b in CACHEGEN_LEVEL_BINS[level])
  anchor_q, anchor_scale, delta_q, delta_step = call(
      functools.partial(_cachegen_encode_kernel, factors),
      [(c // stride, h, jnp.int8), (1, h, jnp.float32), (c, h, jnp.int8), (1, h, jnp.float32)])
  return CacheGenPayload(_heads(anchor_q), anchor_scale[:, :, :, 0], _heads(delta_q),
                         delta_step[:, :, :, 0])


@functools.partial(jax.jit, static_argnames=("codec", "level", "group", "stride", "interpret",
                                             "use_pallas", "platform"))
def _kv_encode_jit(kv_L2CKH, *, codec, level, group, stride, interpret, use_pallas, platform):
  # One Pallas kernel for "tpu" and "cuda" (the dispatch point per platform).
  finite = jnp.all(jnp.isfinite(kv_L2CKH))
  if codec == CODEC_RAW:
    return RawPayload(kv_L2CKH), finite
  if not use_pallas:
    payload = _encode_reference_jit(kv_L2CKH, codec=codec, level=level, group=group, stride=stride)
  elif platform == "cuda":  # Triton bodies (kvjax/kernels/kv_codec_gpu.py)
    factors = tuple(float(np.float32(b / CACHEGEN_STEPS_PER_RMS))
                    for b in CACHEGEN_LEVEL_BINS[level])
    payload = PAYLOAD_TYPES[codec](*kv_codec_gpu.encode(
        kv_L2CKH, codec, group=group, stride=stride, factors=factors,
        interpret=interpret))
  else:
    payload = _encode_pallas(kv_L2CKH, codec, level, group, stride, interpret, platform)
  for value in payload:  # scales and zeros must be finite too (int4's float16 range).
    if jnp.issubdtype(value.dtype, jnp.floating):
      finite &= jnp.all(jnp.isfinite(value))
  return payload, finite


def kv_encode(kv_L2CKH: jax.Array, codec: str, level: int = 0, *, interpret: bool = False,
              use_pallas: bool = True, group_tokens: int | None = None,
              anchor_stride: int | None = None, platform: str | None = None
              ) -> tuple[Payload, jax.Array]:
  """Encodes a chunk the model computed on the device (K before RoPE) into a codec payload.

  int8: per-channel absmax over the C tokens. int4: per (group of G tokens, channel) min-max
  range, shrunk by the INT4_CLIP_RATIOS candidate with the least squared error, float16 scale and
  zero. cachegen (arXiv 2310.07240 section 5.2): anchors are the means of groups of T tokens,
  int8-quantized per channel; every token's delta against its dequantized anchor is quantized
  with step `max(bin * rms(deltas) / CACHEGEN_STEPS_PER_RMS, max|delta| / 127)` per channel, the
  bin growing with the layer group (CACHEGEN_LEVEL_BINS; the second term only keeps codes within
  +-127). Entropy coding follows on the host, in storage. Compiles once per codec, level and
  chunk shape.

  Args:
    kv_L2CKH: float32/bfloat16/float16[L, 2, C, K, H], K before RoPE, and V.
    codec: "raw", "int8", "int4" or "cachegen".
    level: a level of CODEC_LEVELS[codec] (cachegen: 0 finest .. 3 coarsest; others 0).
    interpret: run the Pallas kernel `kv_encode_<codec>` in interpret mode (CPU tests).
    use_pallas: False runs the pure-jnp reference instead (the CPU engine's path).
    group_tokens: int4 group G; default `kvjax.codecs.int4_group_tokens(C)` (the registry's
      rule, which storage shares); must divide C.
    anchor_stride: CacheGen tokens per anchor T; default
      `kvjax.codecs.cachegen_anchor_stride(C)`; must divide C.
    platform: the target ("cpu" | "tpu" | "cuda"); None: the platform being compiled for.
      "cuda" uses the Triton kernel `kv_encode_<codec>_gpu` (kvjax/kernels/kv_codec_gpu.py; C,
      H, C / G, C / T powers of two); it also runs with interpret=True on CPU and lowers for
      CUDA on a CPU host.

  Returns:
    (payload, finite): the payload as device arrays, and a bool scalar that is False when the KV
    holds NaN/inf (or int4's float16 scale/zero overflow). Check it before storing the payload
    (`kv_encode_host` does).

  Raises:
    ValueError: unknown codec or level, a chunk of the wrong rank, shape or dtype, or compiled
      Pallas (use_pallas=True, interpret=False) for a CPU target.
  """
  group, stride = _check_encode(kv_L2CKH, codec, level, group_tokens, anchor_stride)
  platform = _check_backend(interpret, use_pallas and codec != CODEC_RAW, platform)
  return _kv_encode_jit(kv_L2CKH, codec=codec, level=int(level), group=group, stride=stride,
                        interpret=bool(interpret), use_pallas=bool(use_pallas), platform=platform)


def kv_encode_host(kv_L2CKH: jax.Array, codec: str, level: int = 0,
                   **kwargs) -> dict[str, np.ndarray]:
  """`kv_encode`, then copies the payload to the host as the contract's `{name: np.ndarray}`.

  Args:
    kv_L2CKH, codec, level, **kwargs: as for `kv_encode`.

  Returns:
    The payload dict (what storage turns into bytes).

  Raises:
    ValueError: the KV holds NaN/inf (nothing must be stored), or `kv_encode`'s errors.
  """
  payload, finite = kv_encode(kv_L2CKH, codec, level, **kwargs)
  if not bool(finite):
    raise ValueError(f"KV chunk {list(kv_L2CKH.shape)} holds NaN/inf (or values beyond the "
                     f"{codec} codec's range); refusing to encode it")
  return payload_arrays(payload)
