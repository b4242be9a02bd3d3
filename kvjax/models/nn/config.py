"""Frozen LLaMA-family configuration and presets.

One config covers the decoder families kvjax runs in its one model (`kvjax.models.nn.llama`):
LLaMA and Mistral (the same shape), Qwen2/Qwen2.5 (`attention_bias`: q/k/v biases) and Qwen3
(`qk_norm`: a per-head RMSNorm on queries and keys before RoPE, an explicit `head_dim`).

A config describes architecture only; the compute dtype, the number of decode slots and the cache
length are runtime choices of the engine (see `kvjax.engine.EngineConfig`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


#: Architecture families the one model runs (`LlamaConfig.family`).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """LLaMA-3 rotary frequency scaling (Meta's `apply_scaling`, LLaMA 3.1 model card).

  Wavelengths shorter than `original_max_position / high_freq_factor` are kept, those longer than
  `original_max_position / low_freq_factor` are divided by `factor`, and the band between is
  interpolated smoothly.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a LLaMA-family decoder.

  Attributes:
    name: preset or checkpoint name, for messages only (not part of the fingerprint's semantics,
      though it is hashed with the rest).
    vocab_size: V, tokens.
    d_model: D, model width.
    n_layers: L, decoder layers.
    n_heads: N, query heads.
    n_kv_heads: K, key/value heads (grouped-query attention when K < N).
    head_dim: H, per-head width.
    mlp_dim: F, SwiGLU hidden width.
    rope_theta: RoPE base frequency.
    rope_scaling: LLaMA-3 frequency scaling, or None.
    rms_eps: RMSNorm epsilon.
    max_seq_len: context length in tokens (prompt plus generated tokens).
    tie_embeddings: the LM head reuses the token embedding.
    family: the checkpoint's architecture family, one of `FAMILIES` ("llama", "mistral",
      "qwen2", "qwen3"); hashed into the model fingerprint, so two families never share
      stored KV even where their weights coincide.
    attention_bias: q/k/v projections carry biases (Qwen2/Qwen2.5).
    qk_norm: queries and keys get a per-head RMSNorm over H before RoPE (Qwen3).
  """

  name: str
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_eps: float = 1e-5
  max_seq_len: int = 4096
  tie_embeddings: bool = False
  family: str = "llama"
  attention_bias: bool = False
  qk_norm: bool = False

  def __post_init__(self):
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "mlp_dim", "max_seq_len"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig.{field} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (GQA)")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.family not in FAMILIES:
      raise ValueError(f"LlamaConfig.family must be one of {FAMILIES}, got {self.family!r}")

  @property
  def q_per_kv(self) -> int:
    """G: query heads sharing one key/value head."""
    return self.n_heads // self.n_kv_heads

  def kv_bytes_per_token(self, itemsize: int) -> int:
    """Bytes of K and V for one token over all layers at `itemsize` bytes per value."""
    return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, f, l = self.d_model, self.mlp_dim, self.n_layers
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    if self.attention_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + l * per_layer + d + head

  def to_json(self) -> str:
    """Canonical JSON (sorted keys), used by the model fingerprint."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return cls(**d)


def smollm2_135m() -> LlamaConfig:
  """SmolLM2-135M(-Instruct): 30 layers, d=576, 9 heads, 3 KV heads, tied embeddings."""
  return LlamaConfig(
      name="SmolLM2-135M-Instruct", vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
      n_kv_heads=3, head_dim=64, mlp_dim=1536, rope_theta=100000.0, rms_eps=1e-5,
      max_seq_len=8192, tie_embeddings=True)


def tiny(**overrides: Any) -> LlamaConfig:
  """A few-layer random model for tests: GQA with 3 KV heads, like SmolLM2."""
  cfg = dict(name="tiny", vocab_size=256, d_model=48, n_layers=2, n_heads=6, n_kv_heads=3,
             head_dim=8, mlp_dim=96, rope_theta=10000.0, rms_eps=1e-5, max_seq_len=512,
             tie_embeddings=True)
  cfg.update(overrides)
  return LlamaConfig(**cfg)


def llama2_7b() -> LlamaConfig:
  """LLaMA-2 7B (also the LongAlpaca-7B shape, whose context is extended to 32K)."""
  return LlamaConfig(
      name="Llama-2-7b", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
      head_dim=128, mlp_dim=11008, rope_theta=10000.0, rms_eps=1e-5, max_seq_len=4096)


def llama3_8b() -> LlamaConfig:
  """LLaMA-3.1 8B with LLaMA-3 RoPE scaling."""
  return LlamaConfig(
      name="Llama-3.1-8B", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
      n_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0,
      rope_scaling=RopeScaling(), rms_eps=1e-5, max_seq_len=131072)


def llama3_70b() -> LlamaConfig:
  """LLaMA-3.1 70B with LLaMA-3 RoPE scaling."""
  return LlamaConfig(
      name="Llama-3.1-70B", vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
      n_kv_heads=8, head_dim=128, mlp_dim=28672, rope_theta=500000.0,
      rope_scaling=RopeScaling(), rms_eps=1e-5, max_seq_len=131072)


def qwen3_8b() -> LlamaConfig:
  """Qwen3-8B: 36 layers, d=4096, 32 heads, 8 KV heads, head_dim 128, q/k RMSNorm, untied."""
  return LlamaConfig(
      name="Qwen3-8B", vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
      head_dim=128, mlp_dim=12288, rope_theta=1000000.0, rms_eps=1e-6, max_seq_len=40960,
      family="qwen3", qk_norm=True)


PRESETS = {
    "smollm2_135m": smollm2_135m,
    "tiny": tiny,
    "llama2_7b": llama2_7b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "qwen3_8b": qwen3_8b,
}
