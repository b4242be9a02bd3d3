"""The model's dense, cache-free functions that kvtc calibration runs, jit'd.

`kvjax.models.loading.kv_calibration` fits the kvtc transform from the model's KV of a calibration text
and weighs it by a Fisher metric (the gradient of a continuation's log-likelihood with respect
to a context's KV). None of that needs a KV cache: each function here is a plain jit'd function
of the model's parameters (`kvjax.models.nn.llama.context_kv`, `logits_after_context`), compiled
once per shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.models.nn.llama import Llama, context_kv, logits_after_context


class CalibrationModel:
  """A model's parameters behind the jit'd functions calibration needs.

  Args:
    model: the model (its parameters are shared, not copied).
    max_seq_len: the longest sequence calibration may run (None: the model's context).

  Raises:
    ValueError: `max_seq_len` beyond the model's context.
  """

  def __init__(self, model: Llama, max_seq_len: int | None = None):
    self.model_config = model.cfg
    self.max_seq_len = max_seq_len or model.cfg.max_seq_len
    if self.max_seq_len > model.cfg.max_seq_len:
      raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's context "
                       f"{model.cfg.max_seq_len}")
    graphdef, self._state = nnx.split(model)

    def kv(state, tokens):
      return context_kv(nnx.merge(graphdef, state), tokens)

    def after_context(state, k_pre, v, tokens):
      return logits_after_context(nnx.merge(graphdef, state), k_pre, v, tokens)

    def context_grad(state, k_pre, v, tokens, targets):
      def log_likelihood(k_pre, v):
        logp_TV = jax.nn.log_softmax(after_context(state, k_pre, v, tokens), axis=-1)
        return jnp.sum(jnp.take_along_axis(logp_TV, targets[:, None], axis=-1))
      return jax.grad(log_likelihood, argnums=(0, 1))(k_pre, v)

    self._kv = jax.jit(kv)
    self._after_context = jax.jit(after_context)
    self._context_grad = jax.jit(context_grad)

  def context_kv(self, tokens_T) -> tuple[jax.Array, jax.Array]:
    """(f32[L, T, K, H] keys before RoPE, f32[L, T, K, H] values) of `tokens_T` (int[T], at
    positions 0..T-1; causal dense attention, `llama.context_kv`).

    Raises:
      ValueError: no tokens, or more than `max_seq_len`.
    """
    if not 1 <= len(tokens_T) <= self.max_seq_len:
      raise ValueError(f"{len(tokens_T)} tokens; calibration runs 1 to {self.max_seq_len}")
    return self._kv(self._state, jnp.asarray(tokens_T, jnp.int32))

  def logits_after_context(self, k_pre_LSKH, v_LSKH, tokens_T) -> jax.Array:
    """f32[T, V] logits of `tokens_T` after a given context KV (`llama.logits_after_context`:
    dense attention; compiled once per (S, T)).

    Args:
      k_pre_LSKH: f32[L, S, K, H] context keys before RoPE (positions 0..S-1).
      v_LSKH: f32[L, S, K, H] context values.
      tokens_T: int[T] tokens at positions S..S+T-1.
    """
    return self._after_context(self._state, jnp.asarray(k_pre_LSKH, jnp.float32),
                               jnp.asarray(v_LSKH, jnp.float32), jnp.asarray(tokens_T, jnp.int32))

  def context_kv_gradient(self, k_pre_LSKH, v_LSKH, tokens_T, targets_T
                          ) -> tuple[jax.Array, jax.Array]:
    """Gradient of `sum_t log p(targets_T[t] | context, tokens_T[:t+1])` with respect to the
    context KV: (f32[L, S, K, H] for K before RoPE, f32[L, S, K, H] for V). Arguments as
    `logits_after_context`, plus targets_T: int[T], the token each position is scored on."""
    return self._context_grad(self._state, jnp.asarray(k_pre_LSKH, jnp.float32),
                              jnp.asarray(v_LSKH, jnp.float32), jnp.asarray(tokens_T, jnp.int32),
                              jnp.asarray(targets_T, jnp.int32))
