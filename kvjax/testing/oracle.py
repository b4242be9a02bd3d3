"""A deliberately naive full-sequence LLaMA forward pass: the oracle for cached, chunked paths.

No KV cache, no blocks, no scan: dense causal attention over the whole sequence in f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels.attention import dense_attention_reference
from kvjax.models.nn import layers
from kvjax.models.nn.config import LlamaConfig

#: Absolute tolerances for comparing a path against the oracle, by compute dtype.
ATOL = {"float32": 2e-4, "bfloat16": 1.5e-1}


def oracle_forward(cfg: LlamaConfig, params: dict[str, np.ndarray],
                   token_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Runs the whole sequence at positions 0..T-1.

  Returns:
    (f32[T, V] logits, f32[L, T, K, H] keys before RoPE, f32[L, T, K, H] values).
  """
  p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  out = _forward(cfg, p, jnp.asarray(token_ids, jnp.int32))
  return tuple(np.asarray(x) for x in out)


def oracle_greedy(cfg: LlamaConfig, params: dict[str, np.ndarray], prompt, num_tokens: int,
                  pad_to: int = 256) -> list[int]:
  """Greedy continuation by re-running the whole sequence each step (padded to one length:
  causal attention makes position i independent of what follows it)."""
  p = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
  ids = [int(t) for t in prompt]
  if len(ids) + num_tokens > pad_to:
    raise ValueError(f"prompt plus {num_tokens} tokens exceeds pad_to={pad_to}")
  for _ in range(num_tokens):
    logits, _, _ = _forward(cfg, p, jnp.asarray(ids + [0] * (pad_to - len(ids)), jnp.int32))
    ids.append(int(jnp.argmax(logits[len(ids) - 1])))
  return ids[len(prompt):]


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg: LlamaConfig, p, tokens):
  t = tokens.shape[0]
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  inv_freq = jnp.asarray(layers.rope_inv_freq(cfg))
  x = p["embed"][tokens][None]
  ks, vs = [], []
  for i in range(cfg.n_layers):
    h = layers.rms_norm(x, p["layers.attn_norm"][i], cfg.rms_eps)
    q = jnp.einsum("BTD,DNH->BTNH", h, p["layers.wq"][i])
    k = jnp.einsum("BTD,DKH->BTKH", h, p["layers.wk"][i])
    v = jnp.einsum("BTD,DKH->BTKH", h, p["layers.wv"][i])
    if cfg.attention_bias:
      q, k, v = q + p["layers.bq"][i], k + p["layers.bk"][i], v + p["layers.bv"][i]
    if cfg.qk_norm:
      q = layers.rms_norm(q, p["layers.q_norm"][i], cfg.rms_eps)
      k = layers.rms_norm(k, p["layers.k_norm"][i], cfg.rms_eps)
    ks.append(k[0])
    vs.append(v[0])
    q = layers.apply_rope(q, pos, inv_freq)
    k = layers.apply_rope(k, pos, inv_freq)
    attn = dense_attention_reference(q, k, v, pos, pos)
    x = x + jnp.einsum("BTNH,NHD->BTD", attn, p["layers.wo"][i])
    h = layers.rms_norm(x, p["layers.mlp_norm"][i], cfg.rms_eps)
    x = x + layers.swiglu(h, p["layers.w_gate"][i], p["layers.w_up"][i], p["layers.w_down"][i])
  x = layers.rms_norm(x, p["final_norm"], cfg.rms_eps)
  head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
  logits = jnp.einsum("BTD,DV->BTV", x, head)[0]
  return logits, jnp.stack(ks), jnp.stack(vs)
