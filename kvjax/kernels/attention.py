"""Attention of new query tokens over a slotted KV cache, costing only the real prefix.

The cache is `[L, slots, S_max, K, H]`. A step's queries attend to the cache blocks
`[0, ceil(max(kv_lens) / block_size))` only: a `fori_loop` with a dynamic trip count walks them
with an online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, section 3.1),
so a chunk at position p costs O(p) while the program compiles once per query shape. Masking a
full `S_max` cache instead makes every chunk cost the same, which hides the property Cake
(arXiv 2410.03065, section 3) exploits: compute cost grows with position, load cost does not.

    cache positions   0        block     2*block    ...                          S_max
                      |--------|---------|-----...--|--------------------------------|
    read (prefill)    [=========== blocks < ceil(kv_len / block) ===]  never touched

This module is the pure-jnp reference path (the CPU backend); a Pallas version slots in beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_BLOCK_SIZE = 256
_MASK_VALUE = -1e30


def _check(q_BTNH, k_cache_LBSKH, v_cache_LBSKH, block_size):
  if q_BTNH.ndim != 4 or k_cache_LBSKH.ndim != 5:
    raise ValueError(f"want q [B,T,N,H] and cache [L,B,S,K,H], got {q_BTNH.shape} and "
                     f"{k_cache_LBSKH.shape}")
  if k_cache_LBSKH.shape != v_cache_LBSKH.shape:
    raise ValueError(f"K and V caches differ: {k_cache_LBSKH.shape} vs {v_cache_LBSKH.shape}")
  n, h = q_BTNH.shape[2:]
  k, hk = k_cache_LBSKH.shape[3:]
  if h != hk or n % k:
    raise ValueError(f"q heads {n}x{h} do not group over cache heads {k}x{hk}")
  if k_cache_LBSKH.shape[2] % block_size:
    raise ValueError(f"cache length {k_cache_LBSKH.shape[2]} is not a multiple of "
                     f"block_size={block_size}")


@functools.partial(jax.named_call, name="ragged_cache_attention")
def ragged_cache_attention_reference(
    q_BTNH: jax.Array,
    k_cache_LBSKH: jax.Array,
    v_cache_LBSKH: jax.Array,
    layer: jax.Array,
    first_slot: jax.Array,
    q_positions_BT: jax.Array,
    kv_lens_B: jax.Array,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
  """Causal grouped-query attention of queries over cache slots `[first_slot, first_slot + B)`.

  Query t of row b sees cache position s iff `s <= q_positions_BT[b, t]` and `s < kv_lens_B[b]`.
  The caller has already written this step's keys and values into the cache.

  Args:
    q_BTNH: [B, T, N, H] queries after RoPE, compute dtype. Scaling by 1/sqrt(H) happens here.
    k_cache_LBSKH: [L, slots, S_max, K, H] keys after RoPE.
    v_cache_LBSKH: [L, slots, S_max, K, H] values.
    layer: int32 scalar, the layer to read.
    first_slot: int32 scalar; rows b read cache slot `first_slot + b` (B = 1 with the request's
      slot for prefill; B = slots with first_slot 0 for a batched decode).
    q_positions_BT: int32[B, T] absolute positions of the queries.
    kv_lens_B: int32[B] valid cache length per row, in tokens; 0 gives zeros for that row.
    block_size: cache tokens per loop iteration (static); must divide S_max.

  Returns:
    [B, T, N, H] attention output in `q_BTNH.dtype`.

  Raises:
    ValueError: on inconsistent shapes.
  """
  _check(q_BTNH, k_cache_LBSKH, v_cache_LBSKH, block_size)
  b_, t_, n_, h_ = q_BTNH.shape
  k_ = k_cache_LBSKH.shape[3]
  g_ = n_ // k_
  # Head-major inside the loop: batch dims (B, K) lead every dot, which XLA's CPU backend runs
  # about twice as fast as the token-major layout.
  q_BKTGH = (q_BTNH.astype(jnp.float32) * (h_ ** -0.5)).astype(q_BTNH.dtype)
  q_BKTGH = q_BKTGH.reshape(b_, t_, k_, g_, h_).transpose(0, 2, 1, 3, 4)
  num_blocks = (jnp.max(kv_lens_B) + block_size - 1) // block_size

  def body(blk, carry):
    m_BKTG, l_BKTG, acc_BKTGH = carry
    start = blk * block_size
    k_BSKH = jax.lax.dynamic_slice(
        k_cache_LBSKH, (layer, first_slot, start, 0, 0), (1, b_, block_size, k_, h_))[0]
    v_BSKH = jax.lax.dynamic_slice(
        v_cache_LBSKH, (layer, first_slot, start, 0, 0), (1, b_, block_size, k_, h_))[0]
    kv_pos_S = start + jnp.arange(block_size, dtype=jnp.int32)
    # Positions past kv_len may hold stale or non-finite values: zero V there so 0 * garbage
    # cannot poison the sum (masked scores are replaced, not multiplied).
    in_len_BS = kv_pos_S[None, :] < kv_lens_B[:, None]
    v_BSKH = jnp.where(in_len_BS[:, :, None, None], v_BSKH, jnp.zeros((), v_BSKH.dtype))
    k_BKSH = k_BSKH.transpose(0, 2, 1, 3).astype(q_BKTGH.dtype)
    v_BKSH = v_BSKH.transpose(0, 2, 1, 3)
    s_BKTGS = jnp.einsum("BKTGH,BKSH->BKTGS", q_BKTGH, k_BKSH,
                         preferred_element_type=jnp.float32)
    valid_BTS = ((kv_pos_S[None, None, :] <= q_positions_BT[:, :, None])
                 & in_len_BS[:, None, :])
    valid_BKTGS = valid_BTS[:, None, :, None, :]
    s_BKTGS = jnp.where(valid_BKTGS, s_BKTGS, _MASK_VALUE)
    m_new = jnp.maximum(m_BKTG, jnp.max(s_BKTGS, axis=-1))
    # Masked scores underflow to exactly 0 here: every row's first block holds position 0, so m
    # is finite after it. A row with kv_len 0 sums ones over zeroed V and returns zeros.
    p_BKTGS = jnp.exp(s_BKTGS - m_new[..., None])
    correction = jnp.exp(m_BKTG - m_new)
    l_new = l_BKTG * correction + jnp.sum(p_BKTGS, axis=-1)
    pv_BKTGH = jnp.einsum("BKTGS,BKSH->BKTGH", p_BKTGS.astype(v_BKSH.dtype), v_BKSH,
                          preferred_element_type=jnp.float32)
    acc_new = acc_BKTGH * correction[..., None] + pv_BKTGH
    return m_new, l_new, acc_new

  init = (jnp.full((b_, k_, t_, g_), _MASK_VALUE, jnp.float32),
          jnp.zeros((b_, k_, t_, g_), jnp.float32),
          jnp.zeros((b_, k_, t_, g_, h_), jnp.float32))
  _, l_BKTG, acc_BKTGH = jax.lax.fori_loop(0, num_blocks, body, init)
  out_BKTGH = acc_BKTGH / jnp.maximum(l_BKTG, 1e-30)[..., None]
  out_BTNH = out_BKTGH.transpose(0, 2, 1, 3, 4).reshape(b_, t_, n_, h_)
  return out_BTNH.astype(q_BTNH.dtype)


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
