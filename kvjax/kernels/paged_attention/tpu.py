"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Grid `(W query tiles, K / Kb kv-head groups, cdiv(M, n) kv steps)`; the tile metadata and the
block tables are scalar-prefetched into SMEM, and the pool BlockSpecs' index maps read the block
table, so the pipeline DMAs exactly the pool blocks a tile needs: n blocks per grid step, each a
`[block_size, F]` slab of the pool `[P, B, F]` (the engine's layout, `kvjax.models.nn.kv_cache.
PoolLayout`: heads folded into the lane axis and padded to whole 128 lanes, so a block is whole
(sublane, lane) tiles and the pool needs no conversion; head h of a slab is lanes
`[h * H, (h + 1) * H)`; with Kb < K heads per step, `[block_size, Kb * H]`). Steps past a tile's
last visible block clamp to that block (the same block index, so no new DMA) and skip compute
(`pl.when`): HBM traffic follows each tile's real context. Online softmax state lives in VMEM
scratch across the kv axis ("arbitrary"); the output block is written once, at the last kv step.

    grid step (w, g, j)    q block [1, Kb, tq*G, H]     k/v blocks i = 0..n-1: [1, Bs, Kb * H]
                           index (w, g, 0, 0)           (bt[seq[w], min(j*n+i, last[w])], 0, g)

Studied for shapes: jax `pallas/ops/tpu/ragged_paged_attention` (manual double-buffered DMA over
flattened queries) and `pallas/ops/tpu/paged_attention` (block-table index maps). Written here;
only run in interpret mode (no TPU reachable) and lowered for TPU in the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.kernels.paged_attention import tiles as tiles_lib
from kvjax.kernels.platform import resolve_platform
from kvjax.kernels.paged_attention.reference import (MASK_VALUE, cdiv, check_shapes, check_values,
                                                     fold_pool, resolve_scale)

# ---------------------------------------------------------------------------------------------
# Block sizes.

#: Query tokens per tile (rows per grid step are tq * G).
DEFAULT_TPU_QUERY_BLOCK = 8
#: KV tokens per grid step, rounded up to whole pool blocks.
DEFAULT_TPU_KV_TOKENS_PER_STEP = 128
#: Block-table entries one call scalar-prefetches into SMEM at most (512 KiB of int32; the chip
#: has 1 MiB, shared with the tile metadata). A longer table `[S, M]` (LLaMA-3.1-8B at 131,072
#: tokens: 41 x 8,192 entries, 1.3 MiB) is cut into windows of table columns, one kernel call
#: each, merged by their softmax statistics (`tiles.combine_splits`).
DEFAULT_TPU_MAX_TABLE_ENTRIES = 128 * 1024
_LANES = 128  # m and l scratch are lane-broadcast (Mosaic slices whole lanes).


# ---------------------------------------------------------------------------------------------
# Kernel body.

def _tpu_kernel(seq_ref, pos0_ref, kv_len_ref, bt_ref,  # SMEM int32 [W], [W], [W], [S, Mw]
                q_ref,                 # [1, Kb, R, H]  R = tq * G rows, (token, group) order
                *refs,                 # n k blocks, n v blocks [1, Bs, Kb * H]; o [1, Kb, R, H]
                                       # (+ partial: m, l [1, Kb, R, 128] f32);
                                       # scratch m, l [Kb, R, 128] f32, acc [Kb, R, H] f32
                sm_scale, group, blocks_per_step, col0=0, partial=False):
  del seq_ref, bt_ref  # used by the index maps only
  n = blocks_per_step
  k_refs, v_refs = refs[:n], refs[n:2 * n]
  if partial:  # one window of table columns from col0: unnormalized output and its m, l
    o_ref, mo_ref, lo_ref, m_ref, l_ref, acc_ref = refs[2 * n:]
  else:
    o_ref, m_ref, l_ref, acc_ref = refs[2 * n:]
  w, j = pl.program_id(0), pl.program_id(2)
  kb, r_, h_ = q_ref.shape[1:]
  bs_ = k_refs[0].shape[1]
  kv_len, pos0 = kv_len_ref[w], pos0_ref[w]

  @pl.when(j == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  qpos_RS = pos0 + jax.lax.broadcasted_iota(jnp.int32, (r_, bs_), 0) // group
  for i in range(n):
    start = (col0 + j * n + i) * bs_

    @pl.when(start < kv_len)
    def _step(i=i, start=start):
      kv_pos_RS = start + jax.lax.broadcasted_iota(jnp.int32, (r_, bs_), 1)
      valid_RS = (kv_pos_RS <= qpos_RS) & (kv_pos_RS < kv_len)
      in_len_S1 = start + jax.lax.broadcasted_iota(jnp.int32, (bs_, 1), 0) < kv_len
      for h in range(kb):
        q_RH = q_ref[0, h]
        k_SH = k_refs[i][0, :, h * h_:(h + 1) * h_].astype(q_RH.dtype)
        v_SH = jnp.where(in_len_S1, v_refs[i][0, :, h * h_:(h + 1) * h_], 0)  # stale/NaN past
        s_RS = jax.lax.dot_general(q_RH, k_SH, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32) * sm_scale
        s_RS = jnp.where(valid_RS, s_RS, MASK_VALUE)
        m_prev = m_ref[h][:, :1]                                       # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s_RS, axis=1, keepdims=True))
        p_RS = jnp.where(valid_RS, jnp.exp(s_RS - m_new), 0.0)
        corr = jnp.exp(m_prev - m_new)
        l_new = l_ref[h][:, :1] * corr + jnp.sum(p_RS, axis=1, keepdims=True)
        pv_RH = jax.lax.dot_general(p_RS.astype(v_SH.dtype), v_SH, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        acc_ref[h] = acc_ref[h] * corr + pv_RH
        m_ref[h] = jnp.broadcast_to(m_new, (r_, _LANES))
        l_ref[h] = jnp.broadcast_to(l_new, (r_, _LANES))

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    for h in range(kb):
      if partial:
        o_ref[0, h] = acc_ref[h]
        mo_ref[0, h] = m_ref[h]
        lo_ref[0, h] = l_ref[h]
      else:
        l_R1 = l_ref[h][:, :1]
        o_ref[0, h] = (acc_ref[h] / jnp.where(l_R1 > 0, l_R1, 1.0)).astype(o_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Jitted wrapper.

def _window_columns(s_: int, m_: int, n: int, max_entries: int) -> int:
  """Table columns per kernel call: all M when `S * M <= max_entries`, else the most whole kv
  steps (n columns each) whose `[S, Mw]` window fits, at least one step."""
  if s_ * m_ <= max_entries:
    return m_
  return max(1, max_entries // (s_ * n)) * n


@functools.partial(jax.jit, static_argnames=("sm_scale", "query_block", "blocks_per_step",
                                             "kv_heads_per_block", "max_table_entries",
                                             "interpret", "num_kv_heads"))
def _tpu_jit(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc, num_seqs, *,
             sm_scale, query_block, blocks_per_step, kv_heads_per_block, max_table_entries,
             interpret, num_kv_heads):
  t_, n_, h_ = q_TNH.shape
  p_, bs_, f_ = k_pool.shape
  k_ = num_kv_heads
  g_ = n_ // k_
  s_, m_ = block_tables.shape
  tq, n, kb = query_block, blocks_per_step, kv_heads_per_block
  r_ = tq * g_
  bt = jnp.clip(block_tables, 0, p_ - 1)  # a DMA must never leave the pool
  tiles = tiles_lib.make_tiles(query_start_loc, context_lens, num_seqs, t_, tq)
  q_WKRH = tiles_lib.gather_queries(q_TNH, tiles, tq, k_, g_)
  w_ = q_WKRH.shape[0]
  mw = _window_columns(s_, m_, n, max_table_entries)
  windows = [(c0, min(mw, m_ - c0)) for c0 in range(0, m_, mw)]
  partial = len(windows) > 1

  def call(col0, cols):
    steps = cdiv(cols, n)

    def kv_index(i):
      def index_map(w, g, j, seq_ref, pos0_ref, kv_len_ref, bt_ref):
        del pos0_ref
        last = jnp.maximum(cdiv(kv_len_ref[w], bs_) - 1, 0)
        col = jnp.clip(jnp.minimum(col0 + j * n + i, last) - col0, 0, cols - 1)
        return bt_ref[seq_ref[w], col], 0, g
      return index_map

    q_spec = pl.BlockSpec((1, kb, r_, h_), lambda w, g, j, *_: (w, g, 0, 0))
    stat_spec = pl.BlockSpec((1, kb, r_, _LANES), lambda w, g, j, *_: (w, g, 0, 0))
    # All K heads in one step: the whole F (padding lanes included, never read); else Kb * H
    # lanes (a multiple of 128, checked, with no padding in F).
    kv_specs = [pl.BlockSpec((1, bs_, f_ if kb == k_ else kb * h_), kv_index(i))
                for i in range(n)]
    stat_shape = jax.ShapeDtypeStruct((w_, k_, r_, _LANES), jnp.float32)
    out_shape = (jax.ShapeDtypeStruct(q_WKRH.shape, jnp.float32), stat_shape, stat_shape
                 ) if partial else jax.ShapeDtypeStruct(q_WKRH.shape, q_TNH.dtype)
    return pl.pallas_call(
        functools.partial(_tpu_kernel, sm_scale=sm_scale, group=g_, blocks_per_step=n,
                          col0=col0, partial=partial),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(w_, k_ // kb, steps),
            in_specs=[q_spec] + kv_specs + kv_specs,
            out_specs=(q_spec, stat_spec, stat_spec) if partial else q_spec,
            scratch_shapes=[pltpu.VMEM((kb, r_, _LANES), jnp.float32),
                            pltpu.VMEM((kb, r_, _LANES), jnp.float32),
                            pltpu.VMEM((kb, r_, h_), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(tiles.seq, tiles.pos0, tiles.kv_len, bt[:, col0:col0 + cols], q_WKRH,
      *([k_pool] * n), *([v_pool] * n))

  if not partial:
    o_WKRH = call(0, m_)
  else:
    parts = [call(c0, cols) for c0, cols in windows]
    o_WKRH = tiles_lib.combine_splits(jnp.stack([o for o, _, _ in parts]),
                                      jnp.stack([m[..., 0] for _, m, _ in parts]),
                                      jnp.stack([l[..., 0] for _, _, l in parts]))
  return tiles_lib.scatter_outputs(o_WKRH, tiles, tq, n_, q_TNH.dtype)


def paged_attention_tpu(
    q_TNH: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs,
    *,
    sm_scale: float | None = None,
    query_block: int = DEFAULT_TPU_QUERY_BLOCK,
    kv_tokens_per_step: int = DEFAULT_TPU_KV_TOKENS_PER_STEP,
    kv_heads_per_block: int | None = None,
    max_table_entries: int = DEFAULT_TPU_MAX_TABLE_ENTRIES,
    interpret: bool = False,
    platform: str | None = None,
    num_kv_heads: int | None = None,
) -> jax.Array:
  """Ragged paged attention, Pallas TPU kernel `ragged_paged_attention_tpu`.

  Same arguments, semantics and result as `paged_attention_reference` (zeros for padded rows).

  Args:
    query_block: query tokens per tile (static).
    kv_tokens_per_step: kv tokens per grid step, rounded up to whole pool blocks (static).
    kv_heads_per_block: kv heads per grid step, Kb; default all K. Must divide K and be K or
      have `Kb * H` a multiple of 128 (Mosaic's lane rule for the `[.., Kb * H]` pool blocks).
    max_table_entries: block-table entries one kernel call holds in SMEM (static); a longer
      `[S, M]` table is cut into windows of whole kv steps, one call each, merged by their
      softmax statistics.
    interpret: run in Pallas interpret mode (CPU tests); False compiles with Mosaic (TPU only).
    platform: the target ("cpu" | "tpu" | "cuda"); None: the platform being compiled for
      (`kvjax.kernels.platform.resolve_platform`: TPU topology devices count, the host does not).
    num_kv_heads: K of a 3-D pool `[P, B, F]` (static; the heads are its first K * H lanes);
      default F // H.

  Raises:
    ValueError: as `paged_attention_reference`; on a bad block size; interpret=False for a
      target other than TPU.
  """
  _, _, h_, _, bs_, k_, _, _ = check_shapes(q_TNH, k_pool, v_pool, block_tables, context_lens,
                                            query_start_loc, num_seqs, num_kv_heads)
  check_values(q_TNH, k_pool, block_tables, context_lens, query_start_loc, num_seqs)
  kb = k_ if kv_heads_per_block is None else int(kv_heads_per_block)
  padded = len(k_pool.shape) == 3 and k_pool.shape[2] != k_ * h_
  if kb < 1 or k_ % kb or (kb != k_ and ((kb * h_) % 128 or padded)):
    raise ValueError(f"kv_heads_per_block={kb} must divide K={k_} and be K or have Kb * H "
                     f"(H={h_}) a multiple of 128 in an unpadded pool")
  if query_block < 1 or kv_tokens_per_step < 1 or max_table_entries < 1:
    raise ValueError(f"query_block={query_block}, kv_tokens_per_step={kv_tokens_per_step}, "
                     f"max_table_entries={max_table_entries} must be positive")
  if not interpret and resolve_platform(platform) != "tpu":
    raise ValueError("paged_attention_tpu compiles for TPU only; pass interpret=True elsewhere")
  # A pool given as [P, B, K, H] is folded (a layout change on TPU: the engine's pool is folded
  # already, `kvjax.models.nn.kv_cache.PagedKVCache`).
  return _tpu_jit(q_TNH, fold_pool(k_pool), fold_pool(v_pool), block_tables, context_lens,
                  query_start_loc, jnp.asarray(num_seqs, jnp.int32).reshape(()),
                  sm_scale=resolve_scale(sm_scale, h_), query_block=int(query_block),
                  blocks_per_step=cdiv(int(kv_tokens_per_step), bs_), kv_heads_per_block=kb,
                  max_table_entries=int(max_table_entries), interpret=bool(interpret),
                  num_kv_heads=k_)
