"""Plain masked softmax attention over explicit keys: the oracle of the attention kernels and the
dense path of calibration (`kvjax.models.nn.llama.logits_after_context`, `context_kv`). Serving
attention reads the paged pool (`kvjax.kernels.paged_attention`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_attention_reference(q_BTNH, k_BSKH, v_BSKH, q_positions_BT, kv_positions_BS):
  """Plain masked softmax attention over explicit keys; the oracle for tests.

  Args:
    q_BTNH: [B, T, N, H]; k_BSKH, v_BSKH: [B, S, K, H]; positions are int32. Query t sees key s
    iff `kv_positions_BS[b, s] <= q_positions_BT[b, t]`.

  Returns:
    f32[B, T, N, H].
  """
  b_, t_, n_, h_ = q_BTNH.shape
  k_ = k_BSKH.shape[2]
  q = q_BTNH.astype(jnp.float32).reshape(b_, t_, k_, n_ // k_, h_) * h_ ** -0.5
  s = jnp.einsum("BTKGH,BSKH->BTKGS", q, k_BSKH.astype(jnp.float32))
  mask = kv_positions_BS[:, None, :] <= q_positions_BT[:, :, None]
  s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("BTKGS,BSKH->BTKGH", p, v_BSKH.astype(jnp.float32))
  return out.reshape(b_, t_, n_, h_)
