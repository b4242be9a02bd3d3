"""LLaMA building blocks as pure functions: RMSNorm, RoPE (with LLaMA-3 scaling), SwiGLU.

Parameters live in `kvjax.models.nn.llama.Llama`; these functions only do the math, so the scanned
layer body, the weight loaders and the KV codec kernels share one definition of each.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.nn.config import LlamaConfig


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019) computed in f32, returned in `x.dtype`.

  Args:
    x: [..., D] activations.
    scale: [D] learned gain.
    eps: added to the mean square.
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
  """Inverse rotary frequencies, f32[H // 2], with LLaMA-3 scaling when configured.

  The scaling rule is Meta's `apply_scaling` (LLaMA 3.1): high-frequency components are kept,
  low-frequency ones are divided by `factor`, and the band between is interpolated.
  """
  h = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  s = cfg.rope_scaling
  if s is not None:
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def _cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)            # [..., H]
  return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_BTnH: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array,
               *, inverse: bool = False) -> jax.Array:
  """Rotates heads by their positions (RoPE, Su et al. 2021; Hugging Face `rotate_half` layout).

  Args:
    x_BTnH: [B, T, n, H] queries or keys (n = N or K), any float dtype.
    positions_BT: int[B, T] absolute token positions.
    inv_freq: f32[H // 2] from `rope_inv_freq`.
    inverse: rotate by minus the angle (undoes a previous `apply_rope` at the same positions).

  Returns:
    [B, T, n, H] in `x_BTnH.dtype`; the rotation itself runs in f32.
  """
  cos_BTH, sin_BTH = _cos_sin(positions_BT, inv_freq)
  cos = cos_BTH[:, :, None, :]
  sin = sin_BTH[:, :, None, :]
  if inverse:
    sin = -sin
  x32 = x_BTnH.astype(jnp.float32)
  return (x32 * cos + _rotate_half(x32) * sin).astype(x_BTnH.dtype)


def swiglu(x_BTD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array,
           w_down_FD: jax.Array) -> jax.Array:
  """SwiGLU MLP (Shazeer 2020) as in LLaMA: down(silu(gate(x)) * up(x)). Shapes [B, T, D]."""
  gate_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, w_gate_DF)
  up_BTF = jnp.einsum("BTD,DF->BTF", x_BTD, w_up_DF)
  return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate_BTF) * up_BTF, w_down_FD)
