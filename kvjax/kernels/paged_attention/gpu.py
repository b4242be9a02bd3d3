"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), split-K (flash-decoding).

Grid `(W query tiles, K kv heads, P kv splits)`. Program (w, h, p) holds the `tq * Gp` query rows
of tile w for kv head h (the G query heads of that kv head, padded to a power of two Gp, so one
GQA group shares every K/V load) and walks its share of the tile's visible kv blocks in steps of
n pool blocks: a `fori_loop` with dynamic bounds, loading `k_pool[block_ids, :, h, :]` by a
gather on the block table row. The P splits keep the GPU full when the batch is small (a batch-1
32K decode has W * K = 16 programs without them); their (o, m, l) partials are merged in jnp.

    tile w, kv head h:  visible blocks 0 ........................ cdiv(kv_len, Bs) - 1
    split p:            [ p=0 steps ][ p=1 steps ] ... [ p=P-1 steps ]   (cdiv(steps, P) each)

Triton wants power-of-two array sizes and dots of at least 16 x 16: `tq * Gp`, `n * block_size`
and H must be powers of two >= 16 (checked). Studied for shapes: jax `pallas/ops/gpu/
paged_attention.py` and `decode_attention.py`; written here. Compiled only on a GPU
(scripts/device_check.sh); the tests run it in interpret mode and lower it for CUDA on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.kernels.paged_attention import tiles as tiles_lib
from kvjax.kernels.platform import resolve_platform
from kvjax.kernels.paged_attention.reference import (MASK_VALUE, cdiv, check_shapes, check_values,
                                                     resolve_scale, unfold_pool)

# ---------------------------------------------------------------------------------------------
# Block sizes.

#: Query rows (tokens x padded group) per program; tq = rows // Gp tokens per tile.
DEFAULT_GPU_QUERY_ROWS = 16
#: KV tokens per loop step, rounded up to whole pool blocks.
DEFAULT_GPU_KV_TOKENS_PER_STEP = 64
#: KV splits per (tile, kv head).
DEFAULT_GPU_KV_SPLITS = 8
DEFAULT_GPU_NUM_WARPS = 4
DEFAULT_GPU_NUM_STAGES = 2


def _pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# Kernel body.

def _gpu_kernel(seq_ref, pos0_ref, kv_len_ref,  # int32 [W] each (whole arrays)
                bt_ref,                          # int32 [S, Mp], Mp a multiple of n
                q_ref,                           # [R, H]   R = tq * Gp, (token, group) order
                k_ref, v_ref,                    # [num_blocks, Bs, H]  kv head h of the pool
                o_ref,                           # f32 [R, H] unnormalized partial
                m_ref, l_ref,                    # f32 [R]
                *, sm_scale, group_pad, blocks_per_step, num_splits):
  w, split = pl.program_id(0), pl.program_id(2)
  r_, h_ = q_ref.shape
  bs_ = k_ref.shape[1]
  n = blocks_per_step
  step_tokens = n * bs_
  seq, pos0, kv_len = seq_ref[w], pos0_ref[w], kv_len_ref[w]
  num_steps = cdiv(kv_len, step_tokens)
  per_split = cdiv(num_steps, num_splits)
  lo = jnp.minimum(split * per_split, num_steps)
  hi = jnp.minimum(lo + per_split, num_steps)
  q_RH = q_ref[...]
  # f32 stays f32 (no TF32) so the f32 check against the reference can be tight.
  prec = jax.lax.Precision.HIGHEST if q_RH.dtype == jnp.float32 else None
  qpos_R = pos0 + jnp.arange(r_, dtype=jnp.int32) // group_pad

  def body(i, carry):
    o_RH, m_R, l_R = carry
    ids_n = bt_ref[seq, pl.ds(i * n, n)]
    k_SH = k_ref[ids_n].reshape(step_tokens, h_)
    v_SH = v_ref[ids_n].reshape(step_tokens, h_)
    kv_pos_S = i * step_tokens + jnp.arange(step_tokens, dtype=jnp.int32)
    in_len_S = kv_pos_S < kv_len
    v_SH = jnp.where(in_len_S[:, None], v_SH, jnp.zeros_like(v_SH))  # stale/NaN past context
    s_RS = plgpu.dot(q_RH, k_SH.astype(q_RH.dtype), trans_b=True, precision=prec) * sm_scale
    valid_RS = (kv_pos_S[None, :] <= qpos_R[:, None]) & in_len_S[None, :]
    s_RS = jnp.where(valid_RS, s_RS, MASK_VALUE)
    m_new = jnp.maximum(m_R, jnp.max(s_RS, axis=1))
    p_RS = jnp.where(valid_RS, jnp.exp(s_RS - m_new[:, None]), 0.0)
    corr = jnp.exp(m_R - m_new)
    l_new = l_R * corr + jnp.sum(p_RS, axis=1)
    o_new = o_RH * corr[:, None] + plgpu.dot(p_RS.astype(v_SH.dtype), v_SH,
                                                 precision=prec)
    return o_new, m_new, l_new

  init = (jnp.zeros((r_, h_), jnp.float32), jnp.full((r_,), MASK_VALUE, jnp.float32),
          jnp.zeros((r_,), jnp.float32))
  o_RH, m_R, l_R = jax.lax.fori_loop(lo, hi, body, init)
  o_ref[...] = o_RH
  m_ref[...] = m_R
  l_ref[...] = l_R


# ---------------------------------------------------------------------------------------------
# Jitted wrapper.

@functools.partial(jax.jit, static_argnames=("sm_scale", "query_rows", "blocks_per_step",
                                             "num_splits", "num_warps", "num_stages",
                                             "interpret", "num_kv_heads"))
def _gpu_jit(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc, num_seqs, *,
             sm_scale, query_rows, blocks_per_step, num_splits, num_warps, num_stages,
             interpret, num_kv_heads):
  t_, n_, h_ = q_TNH.shape
  # The engine's folded pool [P, B, K * H] read as [P, B, K, H]: a bitcast (row-major on GPU).
  k_pool = unfold_pool(k_pool, h_, num_kv_heads)
  v_pool = unfold_pool(v_pool, h_, num_kv_heads)
  p_, bs_, k_, _ = k_pool.shape
  gp = _pow2(n_ // k_)
  tq = query_rows // gp
  s_, m_ = block_tables.shape
  n = blocks_per_step
  width = cdiv(m_, n) * n
  bt = jnp.clip(jnp.pad(block_tables, ((0, 0), (0, width - m_))), 0, p_ - 1)
  tiles = tiles_lib.make_tiles(query_start_loc, context_lens, num_seqs, t_, tq)
  q_WKRH = tiles_lib.gather_queries(q_TNH, tiles, tq, k_, gp)
  w_ = q_WKRH.shape[0]
  whole = lambda shape: pl.BlockSpec(shape, lambda w, h, p: (0,) * len(shape))
  pool_spec = pl.BlockSpec((p_, bs_, None, h_), lambda w, h, p: (0, 0, h, 0))
  part = lambda *tail: jax.ShapeDtypeStruct((num_splits, w_, k_) + tail, jnp.float32)
  o_p, m_p, l_p = pl.pallas_call(
      functools.partial(_gpu_kernel, sm_scale=sm_scale, group_pad=gp, blocks_per_step=n,
                        num_splits=num_splits),
      grid=(w_, k_, num_splits),
      in_specs=[whole((w_,)), whole((w_,)), whole((w_,)), whole((s_, width)),
                pl.BlockSpec((None, None, query_rows, h_), lambda w, h, p: (w, h, 0, 0)),
                pool_spec, pool_spec],
      out_specs=[pl.BlockSpec((None, None, None, query_rows, h_),
                              lambda w, h, p: (p, w, h, 0, 0)),
                 pl.BlockSpec((None, None, None, query_rows), lambda w, h, p: (p, w, h, 0)),
                 pl.BlockSpec((None, None, None, query_rows), lambda w, h, p: (p, w, h, 0))],
      out_shape=[part(query_rows, h_), part(query_rows), part(query_rows)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="ragged_paged_attention_gpu",
  )(tiles.seq, tiles.pos0, tiles.kv_len, bt, q_WKRH, k_pool, v_pool)
  o_WKRH = tiles_lib.combine_splits(o_p, m_p, l_p)
  return tiles_lib.scatter_outputs(o_WKRH, tiles, tq, n_, q_TNH.dtype)


def gpu_block_sizes(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, *,
                    query_rows: int = DEFAULT_GPU_QUERY_ROWS,
                    kv_tokens_per_step: int = DEFAULT_GPU_KV_TOKENS_PER_STEP) -> tuple[int, int]:
  """Checks Triton's size rules; returns (query_rows, blocks_per_step).

  Raises:
    ValueError: query_rows not a power of two >= 16 and >= Gp, H not a power of two >= 16, or
      n * block_size not a power of two >= 16.
  """
  gp = _pow2(num_heads // num_kv_heads)
  ok = lambda x: x >= 16 and x & (x - 1) == 0
  if not ok(query_rows) or query_rows < gp:
    raise ValueError(f"query_rows={query_rows} must be a power of two >= 16 and >= the padded "
                     f"group {gp}")
  if not ok(head_dim):
    raise ValueError(f"head dim {head_dim}: the Triton kernel needs a power of two >= 16")
  n = cdiv(int(kv_tokens_per_step), block_size)
  if not ok(n * block_size):
    raise ValueError(f"kv step of {n} blocks x {block_size} tokens must be a power of two >= 16; "
                     "pick kv_tokens_per_step accordingly")
  return int(query_rows), n


def paged_attention_gpu(
    q_TNH: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs,
    *,
    sm_scale: float | None = None,
    query_rows: int = DEFAULT_GPU_QUERY_ROWS,
    kv_tokens_per_step: int = DEFAULT_GPU_KV_TOKENS_PER_STEP,
    num_kv_splits: int = DEFAULT_GPU_KV_SPLITS,
    num_warps: int = DEFAULT_GPU_NUM_WARPS,
    num_stages: int = DEFAULT_GPU_NUM_STAGES,
    interpret: bool = False,
    platform: str | None = None,
    num_kv_heads: int | None = None,
) -> jax.Array:
  """Ragged paged attention, Pallas GPU kernel `ragged_paged_attention_gpu` (Triton).

  Same arguments, semantics and result as `paged_attention_reference` (zeros for padded rows).

  Args:
    query_rows: query rows per program, tokens x padded GQA group (static, power of two >= 16).
    kv_tokens_per_step: kv tokens per loop step, rounded up to whole pool blocks (static).
    num_kv_splits: split-K partitions per (tile, kv head), merged after the kernel (static).
    num_warps, num_stages: Triton launch parameters.
    interpret: run in Pallas interpret mode (CPU tests); False compiles with Triton (GPU only).
    platform: the target ("cpu" | "tpu" | "cuda"); None: the platform being compiled for
      (`kvjax.kernels.platform.resolve_platform`).
    num_kv_heads: K of a 3-D pool `[P, B, F]` (static); default F // H.

  Raises:
    ValueError: as `paged_attention_reference`; see `gpu_block_sizes`; interpret=False for a
      target other than CUDA.
  """
  t_, n_, h_, _, bs_, k_, _, _ = check_shapes(q_TNH, k_pool, v_pool, block_tables, context_lens,
                                              query_start_loc, num_seqs, num_kv_heads)
  check_values(q_TNH, k_pool, block_tables, context_lens, query_start_loc, num_seqs)
  rows, n = gpu_block_sizes(n_, k_, h_, bs_, query_rows=query_rows,
                            kv_tokens_per_step=kv_tokens_per_step)
  if num_kv_splits < 1:
    raise ValueError(f"num_kv_splits={num_kv_splits} must be positive")
  if not interpret and resolve_platform(platform) != "cuda":
    raise ValueError("paged_attention_gpu compiles for GPU only; pass interpret=True elsewhere")
  return _gpu_jit(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                  jnp.asarray(num_seqs, jnp.int32).reshape(()),
                  sm_scale=resolve_scale(sm_scale, h_), query_rows=rows, blocks_per_step=n,
                  num_splits=int(num_kv_splits), num_warps=int(num_warps),
                  num_stages=int(num_stages), interpret=bool(interpret), num_kv_heads=k_)
