"""Ragged paged attention: constants, input validation and the pure-jnp reference (the CPU path).

The reference walks the prefill chunks one sequence at a time (`fori_loop` to the dynamic
`num_seqs`), a chunk's queries one tile at a time, and a tile's visible KV a few pool blocks at a
time (`fori_loop` with a dynamic trip count, online softmax: Milakov & Gimelshein 2018;
FlashAttention, Dao et al. 2022, section 3.1). A tile reads only the blocks holding positions it
can see, so a step costs the sum over sequences of q_len x visible context, never the pool size
nor the longest sequence of the batch. Decodes (q_len 1) run together after that loop, split-KV
(`_attend_decodes`): each decode's context is cut into kv steps, the steps of all decodes form one
work list, and each iteration gathers and scores 16 of them at once, so 48 decodes cost a few large
dots per layer, not 48 small loops (a 48-decode step at 1.5K context ran 2x faster on the 2-core
VM), and still the sum of their real lengths.

    sequence s:  block_tables[s] = [7, 2, 9, ...]      kv positions 0 .. L-1 live in those blocks
    pool block   7          2          9
                 |==========|==========|=====.....|    . = past L (stale or NaN), never used
    query tile   rows i0 .. i0+R-1 see kv positions <= L - q_len + i      (causal)
    loop         steps over ceil((L - q_len + i_last + 1) / step_tokens) groups of blocks
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------
# Constants and block sizes.

#: Score of a masked (query, key) pair before the softmax; finite so max/exp never see inf - inf.
MASK_VALUE = -1e30
#: Query tokens per tile of a prefill chunk in the reference.
DEFAULT_REFERENCE_QUERY_BLOCK = 16
#: KV tokens the reference reads per loop iteration (rounded to whole pool blocks).
DEFAULT_REFERENCE_KV_TOKENS_PER_STEP = 128
#: A prefill chunk of at least this many query rows runs in tiles of this many rows, each reading
#: `DEFAULT_REFERENCE_LONG_KV_TOKENS_PER_STEP` kv tokens per iteration: on CPU, few large dots
#: beat many small ones (a 2,048-token SmolLM2 prefill in 512-token chunks ran 1.5x faster than
#: with 16-row tiles on the 2-core VM), while short chunks keep the small tiles.
DEFAULT_REFERENCE_LONG_QUERY_BLOCK = 256
DEFAULT_REFERENCE_LONG_KV_TOKENS_PER_STEP = 512
#: Decode work items (one sequence's kv step each) per loop iteration of the batched decode.
DEFAULT_REFERENCE_DECODE_ITEMS_PER_ITER = 16
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def cdiv(a, b):
  """Ceiling division for Python ints and int32 arrays alike."""
  return (a + b - 1) // b


# ---------------------------------------------------------------------------------------------
# Validation.

def check_shapes(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                 num_seqs, num_kv_heads: int | None = None
                 ) -> tuple[int, int, int, int, int, int, int, int]:
  """Checks ranks, dtypes and sizes; returns (T, N, H, num_blocks, block_size, K, S, M).

  A 3-D pool `[P, B, F]` holds K heads in its first `K * H` lanes (`num_kv_heads`; default
  `F // H`); the rest is padding (`kvjax.models.nn.kv_cache.PoolLayout`).

  Raises:
    ValueError: on any inconsistency, naming the offending argument.
  """
  def arr(x, name, ndim):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
      raise ValueError(f"{name} must have rank {ndim}, got shape {getattr(x, 'shape', x)}")
    return x
  arr(q_TNH, "q_TNH", 3)
  for name, x in (("k_pool", k_pool), ("v_pool", v_pool)):
    if not hasattr(x, "shape") or len(x.shape) not in (3, 4):
      raise ValueError(f"{name} must be [P, B, K * H] or [P, B, K, H], got shape "
                       f"{getattr(x, 'shape', x)}")
  arr(block_tables, "block_tables", 2)
  arr(context_lens, "context_lens", 1)
  arr(query_start_loc, "query_start_loc", 1)
  if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
    raise ValueError(f"k_pool {k_pool.dtype}{list(k_pool.shape)} and v_pool "
                     f"{v_pool.dtype}{list(v_pool.shape)} differ")
  if q_TNH.dtype not in _FLOAT_DTYPES or k_pool.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"q and pools must be float32/bfloat16/float16, got {q_TNH.dtype} and "
                     f"{k_pool.dtype}")
  t_, n_, h_ = q_TNH.shape
  if len(k_pool.shape) == 3:  # heads folded into the last axis
    p_, bs_, f_ = k_pool.shape
    k_ = f_ // h_ if num_kv_heads is None else int(num_kv_heads)
    hk_ = h_ if 0 < k_ * h_ <= f_ and (num_kv_heads is not None or f_ % h_ == 0) else f_
  else:
    p_, bs_, k_, hk_ = k_pool.shape
  if hk_ != h_ or not k_ or n_ % k_:
    raise ValueError(f"q heads {n_}x{h_} do not group over pool heads {k_}x{hk_} (need N % K == "
                     f"0 and equal head dims)")
  s_, m_ = block_tables.shape
  if context_lens.shape != (s_,) or query_start_loc.shape != (s_ + 1,):
    raise ValueError(f"with block_tables {list(block_tables.shape)} want context_lens [{s_}] and "
                     f"query_start_loc [{s_ + 1}], got {list(context_lens.shape)} and "
                     f"{list(query_start_loc.shape)}")
  for name, x in (("block_tables", block_tables), ("context_lens", context_lens),
                  ("query_start_loc", query_start_loc)):
    if x.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {x.dtype}")
  ns = jnp.asarray(num_seqs)
  if ns.size != 1 or not jnp.issubdtype(ns.dtype, jnp.integer):
    raise ValueError(f"num_seqs must be one integer (scalar or [1]), got {ns.dtype}{ns.shape}")
  if min(t_, p_, bs_, s_, m_) < 1:
    raise ValueError(f"empty axis: q_TNH {q_TNH.shape}, pool {k_pool.shape}, block_tables "
                     f"{block_tables.shape}")
  return t_, n_, h_, p_, bs_, k_, s_, m_


def unfold_pool(pool, head_dim: int, num_kv_heads: int | None = None):
  """A pool `[P, B, F]` (heads folded, the engine's layout: K heads in the first K * H lanes)
  as `[P, B, K, H]`; a 4-D pool as it is. A free reshape on CPU and GPU (row-major, F = K * H
  there); the TPU kernel reads the folded layout directly instead."""
  if len(pool.shape) == 4:
    return pool
  p_, b_, f_ = pool.shape
  k_ = f_ // head_dim if num_kv_heads is None else int(num_kv_heads)
  if k_ * head_dim != f_:
    pool = pool[:, :, :k_ * head_dim]
  return pool.reshape(p_, b_, k_, head_dim)


def fold_pool(pool):
  """A pool `[P, B, K, H]` as `[P, B, K * H]`; a 3-D pool as it is."""
  if len(pool.shape) == 3:
    return pool
  p_, b_, k_, h_ = pool.shape
  return pool.reshape(p_, b_, k_ * h_)


def _is_concrete(*xs) -> bool:
  try:
    for x in xs:
      np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return False
  return True


def check_values(q_TNH, k_pool, block_tables, context_lens, query_start_loc, num_seqs) -> None:
  """Checks the per-sequence metadata when it is concrete (outside jit); a no-op under tracing.

  Raises:
    ValueError: num_seqs outside [0, S]; query_start_loc not starting at 0, decreasing or past T;
      a context shorter than its query; a sequence needing more blocks than its table row has;
      a used block id outside [0, num_blocks).
  """
  if not _is_concrete(block_tables, context_lens, query_start_loc, num_seqs):
    return
  t_ = q_TNH.shape[0]
  p_, bs_ = k_pool.shape[:2]
  s_, m_ = block_tables.shape
  ns = int(np.asarray(num_seqs).reshape(()))
  if not 0 <= ns <= s_:
    raise ValueError(f"num_seqs={ns} outside [0, {s_}]")
  qsl = np.asarray(query_start_loc)[:ns + 1]
  lens = np.asarray(context_lens)[:ns]
  if qsl[0] != 0 or np.any(np.diff(qsl) < 0) or qsl[-1] > t_:
    raise ValueError(f"query_start_loc[:num_seqs + 1] must rise from 0 to at most T={t_}, got "
                     f"{qsl.tolist()}")
  q_lens = np.diff(qsl)
  if np.any(lens < q_lens):
    s = int(np.argmax(lens < q_lens))
    raise ValueError(f"sequence {s}: context_lens={lens[s]} < its query length {q_lens[s]} "
                     "(context_lens counts this step's tokens too)")
  need = (lens + bs_ - 1) // bs_
  if np.any(need > m_):
    s = int(np.argmax(need > m_))
    raise ValueError(f"sequence {s}: context {lens[s]} needs {need[s]} blocks of {bs_}, "
                     f"block_tables has {m_} columns")
  bt = np.asarray(block_tables)
  for s in range(ns):
    used = bt[s, :need[s]]
    if np.any((used < 0) | (used >= p_)):
      raise ValueError(f"sequence {s}: block ids {used.tolist()} outside [0, {p_})")


# ---------------------------------------------------------------------------------------------
# Reference.

def _attend_tile(q_RKGH, pos0, rows, bt_row, k_pool, v_pool, *, sm_scale, blocks_per_step,
                 count):
  """Online-softmax attention of one query tile over the pool blocks of one sequence.

  Row r (r < rows) has absolute position pos0 + r and sees kv positions <= pos0 + r; rows >= rows
  see nothing and give zeros. Returns (f32[R, K, G, H], kv loop iterations run).
  """
  r_, k_, g_, h_ = q_RKGH.shape
  bs_ = k_pool.shape[1]
  step_tokens = blocks_per_step * bs_
  kv_len = jnp.maximum(pos0 + rows, 0)  # kv positions [0, kv_len) are visible to some row
  num_steps = cdiv(kv_len, step_tokens)
  # Head-major: batch dim K leads every dot (XLA CPU runs that layout about twice as fast).
  q_KQH = q_RKGH.transpose(1, 0, 2, 3).reshape(k_, r_ * g_, h_)
  qpos_Q = pos0 + jnp.repeat(jnp.arange(r_, dtype=jnp.int32), g_)
  row_ok_Q = jnp.repeat(jnp.arange(r_) < rows, g_)

  def body(i, carry):
    m_KQ, l_KQ, acc_KQH = carry
    ids = jax.lax.dynamic_slice(bt_row, (i * blocks_per_step,), (blocks_per_step,))
    k_SKH = k_pool[ids].reshape(step_tokens, k_, h_)
    v_SKH = v_pool[ids].reshape(step_tokens, k_, h_)
    kv_pos_S = i * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32)
    in_len_S = kv_pos_S < kv_len
    # Past the context the pool holds stale or NaN values: zero V there (0 * NaN is NaN); masked
    # scores are replaced, not multiplied, so K needs no cleaning.
    v_KSH = jnp.where(in_len_S[:, None, None], v_SKH, 0).transpose(1, 0, 2)
    k_KSH = k_SKH.transpose(1, 0, 2)
    s_KQS = jnp.einsum("KQH,KSH->KQS", q_KQH, k_KSH.astype(q_KQH.dtype),
                       preferred_element_type=jnp.float32) * sm_scale
    valid_QS = ((kv_pos_S[None, :] <= qpos_Q[:, None]) & in_len_S[None, :] & row_ok_Q[:, None])
    s_KQS = jnp.where(valid_QS[None], s_KQS, MASK_VALUE)
    m_new = jnp.maximum(m_KQ, jnp.max(s_KQS, axis=-1))
    p_KQS = jnp.where(valid_QS[None], jnp.exp(s_KQS - m_new[..., None]), 0.0)
    corr = jnp.exp(m_KQ - m_new)
    l_new = l_KQ * corr + jnp.sum(p_KQS, axis=-1)
    pv_KQH = jnp.einsum("KQS,KSH->KQH", p_KQS.astype(v_KSH.dtype), v_KSH,
                        preferred_element_type=jnp.float32)
    return m_new, l_new, acc_KQH * corr[..., None] + pv_KQH

  init = (jnp.full((k_, r_ * g_), MASK_VALUE, jnp.float32),
          jnp.zeros((k_, r_ * g_), jnp.float32), jnp.zeros((k_, r_ * g_, h_), jnp.float32))
  _, l_KQ, acc_KQH = jax.lax.fori_loop(0, num_steps, body, init)
  out_KQH = acc_KQH / jnp.where(l_KQ > 0, l_KQ, 1.0)[..., None]
  out_RKGH = out_KQH.reshape(k_, r_, g_, h_).transpose(1, 0, 2, 3)
  return out_RKGH, count + num_steps


def _attend_decodes(q_TKGH, bt, context_lens, query_start_loc, ns, k_pool, v_pool, *,
                     sm_scale, blocks_per_step, items_per_iter):
  """Every decode of the batch at once, split-KV (flash-decoding: Dao et al. 2023).

  A decode of context L is ceil(L / step) work items, one per kv step of `blocks_per_step`
  blocks; the items of all decodes form one list, and each loop iteration runs
  `items_per_iter` of them as one batched gather and two batched dots, folding each item's
  partial softmax into its sequence's running (max, sum, accumulator) by scatter. So a step
  costs the sum of the decodes' real lengths (rounded to kv steps) and a few large dots rather
  than one small loop per sequence; a long decode beside short ones adds only its own items.

  Returns (f32[S, K, G, H] outputs per sequence (zeros for non-decodes), int32 work items run).
  """
  s_ = context_lens.shape[0]
  _, k_, g_, h_ = q_TKGH.shape
  bs_ = k_pool.shape[1]
  step_tokens = blocks_per_step * bs_
  q_lens = query_start_loc[1:] - query_start_loc[:-1]
  is_dec = (jnp.arange(s_) < ns) & (q_lens == 1)
  n_items = jnp.where(is_dec, cdiv(context_lens, step_tokens), 0)
  ends = jnp.cumsum(n_items)
  starts = ends - n_items
  total = ends[-1]
  q_SKGH = q_TKGH[jnp.clip(query_start_loc[:-1], 0, q_TKGH.shape[0] - 1)]
  col_B = jnp.arange(blocks_per_step, dtype=jnp.int32)
  tok_T = jnp.arange(step_tokens, dtype=jnp.int32)

  def body(j, carry):
    m_SKG, l_SKG, acc_SKGH = carry
    w_I = j * items_per_iter + jnp.arange(items_per_iter, dtype=jnp.int32)
    live_I = w_I < total
    seq_I = jnp.clip(jnp.searchsorted(ends, w_I, side="right"), 0, s_ - 1).astype(jnp.int32)
    step_I = w_I - starts[seq_I]
    cols_IB = jnp.clip(step_I[:, None] * blocks_per_step + col_B[None], 0, bt.shape[1] - 1)
    ids_IB = jnp.take_along_axis(bt[seq_I], cols_IB, axis=1)
    k_ITKH = k_pool[ids_IB].reshape(items_per_iter, step_tokens, k_, h_)
    v_ITKH = v_pool[ids_IB].reshape(items_per_iter, step_tokens, k_, h_)
    pos_IT = step_I[:, None] * step_tokens + tok_T[None]
    ok_IT = (pos_IT < context_lens[seq_I][:, None]) & live_I[:, None]
    q_IKGH = q_SKGH[seq_I]
    s_IKGT = jnp.einsum("IKGH,ITKH->IKGT", q_IKGH, k_ITKH.astype(q_IKGH.dtype),
                        preferred_element_type=jnp.float32) * sm_scale
    ok = ok_IT[:, None, None, :]
    s_IKGT = jnp.where(ok, s_IKGT, MASK_VALUE)
    m_IKG = jnp.max(s_IKGT, axis=-1)
    p_IKGT = jnp.where(ok, jnp.exp(s_IKGT - m_IKG[..., None]), 0.0)
    l_IKG = jnp.sum(p_IKGT, axis=-1)
    # Past the context the pool holds stale or NaN values: zero V there (0 * NaN is NaN).
    v_ITKH = jnp.where(ok_IT[:, :, None, None], v_ITKH, 0)
    acc_IKGH = jnp.einsum("IKGT,ITKH->IKGH", p_IKGT.astype(v_ITKH.dtype), v_ITKH,
                          preferred_element_type=jnp.float32)
    dest_I = jnp.where(live_I, seq_I, s_)  # out of range: dropped by the scatters
    m_new = m_SKG.at[dest_I].max(m_IKG, mode="drop")
    corr_SKG = jnp.exp(m_SKG - m_new)
    corr_IKG = jnp.exp(m_IKG - m_new[seq_I])
    l_SKG = (l_SKG * corr_SKG).at[dest_I].add(l_IKG * corr_IKG, mode="drop")
    acc_SKGH = (acc_SKGH * corr_SKG[..., None]).at[dest_I].add(
        acc_IKGH * corr_IKG[..., None], mode="drop")
    return m_new, l_SKG, acc_SKGH

  init = (jnp.full((s_, k_, g_), MASK_VALUE, jnp.float32), jnp.zeros((s_, k_, g_), jnp.float32),
          jnp.zeros((s_, k_, g_, h_), jnp.float32))
  _, l_SKG, acc_SKGH = jax.lax.fori_loop(0, cdiv(total, items_per_iter), body, init)
  out_SKGH = acc_SKGH / jnp.where(l_SKG > 0, l_SKG, 1.0)[..., None]
  return jnp.where(is_dec[:, None, None, None], out_SKGH, 0.0), total


@functools.partial(jax.jit, static_argnames=("sm_scale", "query_block", "blocks_per_step",
                                             "long_query_block", "long_blocks_per_step",
                                             "decode_blocks_per_step", "decode_items_per_iter",
                                             "num_kv_heads"))
def _reference_jit(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc, num_seqs,
                   *, sm_scale, query_block, blocks_per_step, long_query_block,
                   long_blocks_per_step, decode_blocks_per_step, decode_items_per_iter,
                   num_kv_heads):
  t_, n_, h_ = q_TNH.shape
  k_pool = unfold_pool(k_pool, h_, num_kv_heads)
  v_pool = unfold_pool(v_pool, h_, num_kv_heads)
  p_, _, k_, _ = k_pool.shape
  g_ = n_ // k_
  s_, m_ = block_tables.shape
  tq, tq_long = query_block, long_query_block
  pad = max(tq, tq_long)
  # Whole kv steps of either tile size fit in a row (a clamped slice would read wrong blocks).
  unit = math.lcm(blocks_per_step, long_blocks_per_step, decode_blocks_per_step)
  width = cdiv(m_, unit) * unit
  # Clip ids so a garbage entry past a sequence's last block can never index out of the pool.
  bt = jnp.clip(jnp.pad(block_tables, ((0, 0), (0, width - m_))), 0, p_ - 1)
  q_TKGH = jnp.pad(q_TNH.reshape(t_, k_, g_, h_), ((0, pad), (0, 0), (0, 0), (0, 0)))
  ns = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, s_)
  attend = functools.partial(_attend_tile, k_pool=k_pool, v_pool=v_pool, sm_scale=sm_scale,
                             blocks_per_step=blocks_per_step)
  attend_long = functools.partial(_attend_tile, k_pool=k_pool, v_pool=v_pool, sm_scale=sm_scale,
                                  blocks_per_step=long_blocks_per_step)

  def put(out, o_RKGH, start, rows):
    old = jax.lax.dynamic_slice_in_dim(out, start, o_RKGH.shape[0])
    keep = (jnp.arange(o_RKGH.shape[0]) < rows)[:, None, None, None]
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, o_RKGH, old), start, 0)

  def per_seq(s, carry):
    start, q_len, ctx = query_start_loc[s], query_start_loc[s + 1] - query_start_loc[s], \
        context_lens[s]

    def decode(carry):  # every decode runs batched, after this loop
      return carry

    def prefill_in(rows_per_tile, attend_tile):
      def prefill(carry):
        def tile(j, carry):
          out, count = carry
          q_RKGH = jax.lax.dynamic_slice_in_dim(q_TKGH, start + j * rows_per_tile,
                                                rows_per_tile)
          rows = jnp.minimum(rows_per_tile, q_len - j * rows_per_tile)
          o, count = attend_tile(q_RKGH, ctx - q_len + j * rows_per_tile, rows, bt[s],
                                 count=count)
          return put(out, o, start + j * rows_per_tile, rows), count
        return jax.lax.fori_loop(0, cdiv(q_len, rows_per_tile), tile, carry)
      return prefill

    def prefill(carry):
      return jax.lax.cond(q_len >= tq_long, prefill_in(tq_long, attend_long),
                          prefill_in(tq, attend), carry)

    return jax.lax.cond(q_len == 1, decode, prefill, carry)

  init = (jnp.zeros((t_ + pad, k_, g_, h_), jnp.float32), jnp.zeros((), jnp.int32))
  out, count = jax.lax.fori_loop(0, ns, per_seq, init)
  dec_SKGH, dec_count = _attend_decodes(
      q_TKGH, bt, context_lens, query_start_loc, ns, k_pool, v_pool, sm_scale=sm_scale,
      blocks_per_step=decode_blocks_per_step, items_per_iter=decode_items_per_iter)
  q_lens = query_start_loc[1:] - query_start_loc[:-1]
  is_dec = (jnp.arange(s_) < ns) & (q_lens == 1)
  rows = jnp.where(is_dec, query_start_loc[:-1], t_ + pad)  # out of range: dropped
  out = out.at[rows].set(dec_SKGH, mode="drop")
  return out[:t_].reshape(t_, n_, h_).astype(q_TNH.dtype), count + dec_count


def resolve_scale(sm_scale, head_dim: int) -> float:
  return float(head_dim ** -0.5 if sm_scale is None else sm_scale)


def paged_attention_reference(
    q_TNH: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs,
    *,
    sm_scale: float | None = None,
    query_block: int = DEFAULT_REFERENCE_QUERY_BLOCK,
    kv_tokens_per_step: int = DEFAULT_REFERENCE_KV_TOKENS_PER_STEP,
    long_query_block: int = DEFAULT_REFERENCE_LONG_QUERY_BLOCK,
    long_kv_tokens_per_step: int = DEFAULT_REFERENCE_LONG_KV_TOKENS_PER_STEP,
    decode_kv_tokens_per_step: int | None = None,
    decode_items_per_iter: int = DEFAULT_REFERENCE_DECODE_ITEMS_PER_ITER,
    return_num_kv_steps: bool = False,
    num_kv_heads: int | None = None,
):
  """Causal GQA attention of a ragged batch (decodes and prefill chunks) over a paged KV pool.

  Sequence s owns query rows `query_start_loc[s] : query_start_loc[s + 1]` of `q_TNH` (q_len
  rows) and kv positions `0 .. context_lens[s] - 1` (L, this step's tokens included), position p
  stored at `pool[block_tables[s, p // block_size], p % block_size]`. Query row i of the
  sequence attends to kv positions `<= L - q_len + i`. The caller has already written this step's
  keys and values into the pool. Pure jnp; jit-able with a static T.

  Args:
    q_TNH: [T, N, H] queries after RoPE (f32, bf16 or f16), all sequences' tokens flattened in
      order; T may be padded past `query_start_loc[num_seqs]`.
    k_pool: [num_blocks, block_size, F] keys after RoPE of one layer, heads folded into the
      last axis head-major: K heads in the first K * H lanes, padding after (the engine's pool,
      `kvjax.models.nn.kv_cache.PagedKVCache`); or [num_blocks, block_size, K, H]. N % K == 0
      (G = N / K).
    v_pool: values, same shape and dtype. Unused blocks and slots may hold
      anything, NaN included: they are never read into the result.
    block_tables: int32[S, max_blocks_per_seq]; entries past a sequence's last block are ignored.
    context_lens: int32[S], L per sequence, in tokens.
    query_start_loc: int32[S + 1], cumulative query lengths from 0 (vLLM's name).
    num_seqs: int32 scalar or [1]; sequences >= num_seqs are padding and ignored.
    sm_scale: softmax scale applied to q.k; default 1 / sqrt(H).
    query_block: query rows per tile of a prefill chunk (static); decodes use one row.
    kv_tokens_per_step: kv tokens per loop iteration, rounded up to whole blocks (static).
    long_query_block: a prefill chunk of at least this many rows runs in tiles of this many rows
      (static; large dots are cheaper per FLOP on CPU).
    long_kv_tokens_per_step: kv tokens per loop iteration of those tiles (static).
    decode_kv_tokens_per_step: kv tokens per work item of the batched decodes, rounded up to
      whole blocks (static); default `kv_tokens_per_step`.
    decode_items_per_iter: decode work items gathered and scored per loop iteration (static).
    return_num_kv_steps: also return the int32 number of kv steps run (tests): one per
      (prefill tile, kv loop iteration) and one per decode work item, padding excluded.
    num_kv_heads: K of a 3-D pool (static); default F // H (no padding).

  Returns:
    [T, N, H] in `q_TNH.dtype`: the attention output for each real token; zeros for rows past
    `query_start_loc[num_seqs]` and for a row that sees no kv position. With
    `return_num_kv_steps`, a pair (output, int32 scalar).

  Raises:
    ValueError: on inconsistent shapes or dtypes; when the metadata is concrete, also on bad
      values (see `check_values`).
  """
  _, _, h_, _, bs_, k_, _, _ = check_shapes(q_TNH, k_pool, v_pool, block_tables, context_lens,
                                            query_start_loc, num_seqs, num_kv_heads)
  check_values(q_TNH, k_pool, block_tables, context_lens, query_start_loc, num_seqs)
  if decode_kv_tokens_per_step is None:
    decode_kv_tokens_per_step = kv_tokens_per_step
  if min(query_block, kv_tokens_per_step, long_query_block, long_kv_tokens_per_step,
         decode_kv_tokens_per_step, decode_items_per_iter) < 1:
    raise ValueError(f"query_block={query_block}, kv_tokens_per_step={kv_tokens_per_step}, "
                     f"long_query_block={long_query_block}, long_kv_tokens_per_step="
                     f"{long_kv_tokens_per_step}, decode_kv_tokens_per_step="
                     f"{decode_kv_tokens_per_step} and decode_items_per_iter="
                     f"{decode_items_per_iter} must be positive")
  out, steps = _reference_jit(q_TNH, k_pool, v_pool, block_tables, context_lens,
                              query_start_loc, jnp.asarray(num_seqs, jnp.int32).reshape(()),
                              sm_scale=resolve_scale(sm_scale, h_), query_block=int(query_block),
                              blocks_per_step=cdiv(int(kv_tokens_per_step), bs_),
                              long_query_block=int(long_query_block),
                              long_blocks_per_step=cdiv(int(long_kv_tokens_per_step), bs_),
                              decode_blocks_per_step=cdiv(int(decode_kv_tokens_per_step), bs_),
                              decode_items_per_iter=int(decode_items_per_iter), num_kv_heads=k_)
  return (out, steps) if return_num_kv_steps else out
