"""A small numpy reference encoder of the codec contract (`kvjax.storage.format.codecs`), for tests.

It turns raw KV `[L, 2, C, K, H]` into valid payloads (`{name: np.ndarray}`) of every codec, so
storage tests and measurements have realistic symbols without JAX. It is not the production
encoder (that is `kvjax.kernels.kv_codec.kv_encode`); library code never imports it.

Quantizers (the contract's table in `kvjax.storage.format.codecs`; G and T from `kvjax.codecs`):
- int8: symmetric per channel, `scale = absmax over the C tokens / 127`.
- int4: asymmetric min-max per channel per group of G tokens, float16 scale and zero; codes are
  computed against the float16-rounded scale and zero, so `code * scale + zero` is what a decoder
  reproduces.
- cachegen (CacheGen, arXiv 2310.07240, section 5.2): one anchor per group of T tokens (the
  group's mean, per channel) quantized to int8 per channel (absmax / 127); every token's delta
  to its *dequantized* anchor quantized with `step = bin(layer group, level) * rms of that
  channel's deltas`, clipped to [-127, 127].
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvjax.storage.format import codecs

#: Bins per layer group (first, middle, last third of the layers) for each cachegen level, in
#: units of the channel's delta rms. They grow with depth as in CacheGen section C.2 (there
#: 0.5/1/1.5 in absolute units; 1:1.5:2 here), scaled so that real SmolLM2 KV lands near the
#: contract's error bounds. Measured relative L2 error on 8 chunks of 256 tokens of book text:
#: level 0 1.9-2.0%, level 1 3.9-4.1%, level 2 8.0-8.5%, level 3 15-16%.
CACHEGEN_BINS = {0: (0.08, 0.12, 0.16), 1: (0.16, 0.24, 0.32), 2: (0.4, 0.52, 0.64),
                 3: (0.8, 1.0, 1.2)}


def _f32(kv_L2CKH: np.ndarray) -> np.ndarray:
  x = np.asarray(kv_L2CKH).astype(np.float32)
  if x.ndim != 5 or x.shape[1] != 2:
    raise ValueError(f"kv must be [L, 2, C, K, H], got {x.shape}")
  if not np.isfinite(x).all():
    raise ValueError("kv holds NaN or inf")
  return x


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32),
                   where=b != 0)


def encode_int8(kv_L2CKH: np.ndarray) -> dict[str, np.ndarray]:
  """int8/1 payload: q int8[L, 2, C, K, H], scale float32[L, 2, K, H]."""
  x = _f32(kv_L2CKH)
  scale_L2KH = (np.abs(x).max(axis=2) / 127).astype(np.float32)
  q = np.clip(np.rint(_safe_div(x, scale_L2KH[:, :, None])), -127, 127).astype(np.int8)
  return {"q": q, "scale": scale_L2KH}


def decode_int8(p: dict[str, np.ndarray]) -> np.ndarray:
  return p["q"].astype(np.float32) * p["scale"][:, :, None]


def encode_int4(kv_L2CKH: np.ndarray, group_tokens: int | None = None) -> dict[str, np.ndarray]:
  """int4/1 payload: q uint8[L, 2, C, K, H//2], scale and zero float16[L, 2, C//G, K, H]."""
  x = _f32(kv_L2CKH)
  n_layers, _, c, n_kv_heads, head_dim = x.shape
  g = group_tokens or codecs.int4_group_tokens(c)
  x_L2gGKH = x.reshape(n_layers, 2, c // g, g, n_kv_heads, head_dim)
  lo = x_L2gGKH.min(axis=3)
  hi = x_L2gGKH.max(axis=3)
  zero = lo.astype(np.float16)
  scale = ((hi - lo) / 15).astype(np.float16)
  codes = np.rint(_safe_div(x_L2gGKH - zero.astype(np.float32)[:, :, :, None],
                            scale.astype(np.float32)[:, :, :, None]))
  codes = np.clip(codes, 0, 15).astype(np.uint8).reshape(x.shape)
  q = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
  return {"q": q, "scale": scale, "zero": zero}


def decode_int4(p: dict[str, np.ndarray]) -> np.ndarray:
  q = p["q"]
  codes = np.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
  n_groups = p["scale"].shape[2]
  g = codes.shape[2] // n_groups
  scale = np.repeat(p["scale"].astype(np.float32), g, axis=2)
  zero = np.repeat(p["zero"].astype(np.float32), g, axis=2)
  return codes.astype(np.float32) * scale + zero


def layer_bins(num_layers: int, level: int) -> np.ndarray:
  """float32[L]: the delta bin of each layer at `level` (three layer groups)."""
  groups = np.minimum(np.arange(num_layers) * 3 // max(num_layers, 1), 2)
  return np.asarray(CACHEGEN_BINS[level], np.float32)[groups]


def encode_cachegen(kv_L2CKH: np.ndarray, level: int = 1,
                    anchor_stride: int | None = None) -> dict[str, np.ndarray]:
  """cachegen/1 payload: anchor_q int8[L, 2, A, K, H], anchor_scale float32[L, 2, K, H],
  delta_q int8[L, 2, C, K, H], delta_step float32[L, 2, K, H]."""
  x = _f32(kv_L2CKH)
  n_layers, _, c, n_kv_heads, head_dim = x.shape
  t = anchor_stride or codecs.cachegen_anchor_stride(c)
  anchors_L2AKH = x.reshape(n_layers, 2, c // t, t, n_kv_heads, head_dim).mean(axis=3)
  anchor_scale = (np.abs(anchors_L2AKH).max(axis=2) / 127).astype(np.float32)
  anchor_q = np.clip(np.rint(_safe_div(anchors_L2AKH, anchor_scale[:, :, None])), -127,
                     127).astype(np.int8)
  anchor_hat = np.repeat(anchor_q.astype(np.float32) * anchor_scale[:, :, None], t, axis=2)
  delta = x - anchor_hat
  rms = np.sqrt(np.mean(np.square(delta), axis=2))
  delta_step = (layer_bins(n_layers, level)[:, None, None, None] * rms).astype(np.float32)
  delta_q = np.clip(np.rint(_safe_div(delta, delta_step[:, :, None])), -127,
                    127).astype(np.int8)
  return {"anchor_q": anchor_q, "anchor_scale": anchor_scale, "delta_q": delta_q,
          "delta_step": delta_step}


def decode_cachegen(p: dict[str, np.ndarray]) -> np.ndarray:
  t = p["delta_q"].shape[2] // p["anchor_q"].shape[2]
  anchor = np.repeat(p["anchor_q"].astype(np.float32) * p["anchor_scale"][:, :, None], t, axis=2)
  return anchor + p["delta_q"].astype(np.float32) * p["delta_step"][:, :, None]


def encode(codec: str, level: int, kv_L2CKH: np.ndarray) -> dict[str, np.ndarray]:
  """The payload of `kv` for `codec` at `level` (raw: `{"values": kv}`)."""
  if codec == "raw":
    return {"values": np.ascontiguousarray(kv_L2CKH)}
  if codec == "int8":
    return encode_int8(kv_L2CKH)
  if codec == "int4":
    return encode_int4(kv_L2CKH)
  if codec == "cachegen":
    return encode_cachegen(kv_L2CKH, level)
  raise ValueError(f"unknown codec {codec!r}")


def decode(codec: str, payload: dict[str, np.ndarray]) -> np.ndarray:
  """float32[L, 2, C, K, H] from a payload (the dequantized values x̂)."""
  if codec == "raw":
    return np.asarray(payload["values"]).astype(np.float32)
  return {"int8": decode_int8, "int4": decode_int4, "cachegen": decode_cachegen}[codec](payload)


def relative_error(kv_L2CKH: np.ndarray, kv_hat_L2CKH: np.ndarray) -> float:
  """||x̂ - x|| / ||x|| (L2 over the whole chunk)."""
  x = np.asarray(kv_L2CKH, np.float64)
  return float(np.linalg.norm(np.asarray(kv_hat_L2CKH, np.float64) - x) / np.linalg.norm(x))


def random_kv(shape, seed: int = 0, dtype: str = "float32") -> np.ndarray:
  """KV-like values: per-channel offsets and scales plus a slow drift over tokens plus noise."""
  rng = np.random.default_rng(seed)
  n_layers, two, c, n_kv_heads, head_dim = shape
  offset = rng.standard_normal((n_layers, two, 1, n_kv_heads, head_dim)) * 2
  scale = np.exp(rng.standard_normal((n_layers, two, 1, n_kv_heads, head_dim)) * 0.5)
  drift = np.cumsum(rng.standard_normal(shape) * 0.3, axis=2)
  x = offset + scale * (drift + rng.standard_normal(shape))
  return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
