"""Ragged paged attention over a block pool: one call for a batch of decodes and prefill chunks.

All sequences share one KV pool per layer, `[num_blocks, block_size, K * H]` (K after RoPE, heads
folded into the last axis: the engine's layout; `[num_blocks, block_size, K, H]` is accepted too); a
sequence's kv position p lives in block `block_tables[s, p // block_size]`, slot
`p % block_size`. A step's query tokens of every sequence are flattened into `q_TNH` (T padded to
a bucket); `query_start_loc` (vLLM's name) cuts them per sequence and `context_lens` counts each
sequence's kv tokens including this step's, so query row i of a sequence with q_len rows and
context L attends causally to kv positions `<= L - q_len + i`. Decodes are q_len = 1.

    q_TNH     |s0 prefill chunk (q0 rows)|s1|s2|s3 chunk ...|pad|      query_start_loc
    pool      [blk 0][blk 1][blk 2] ...    block_tables[s] -> the blocks of s, any order

Implementations (same arguments, same result; padded rows are zeros):
  paged_attention_reference  pure jnp, the CPU path; cost follows each sequence's real context
  paged_attention_gpu        Pallas GPU (Triton lowering), split-K over kv blocks
  paged_attention_tpu        Pallas TPU (Mosaic), scalar-prefetched block tables in index maps
`paged_attention` picks one for the target platform (`kvjax.kernels.platform`: the devices the
program compiles for, not the host).
"""

from __future__ import annotations

import jax

from kvjax.kernels.paged_attention.gpu import gpu_block_sizes, paged_attention_gpu
from kvjax.kernels.paged_attention.reference import (MASK_VALUE, check_shapes, check_values,
                                                     paged_attention_reference)
from kvjax.kernels.paged_attention.tpu import paged_attention_tpu
from kvjax.kernels.platform import resolve_platform

IMPLEMENTATIONS = ("reference", "gpu", "tpu")


def default_implementation(platform: str | None = None) -> str:
  """'gpu' for platform "cuda", 'tpu' for "tpu", else 'reference'; None: the platform being
  compiled for (`kvjax.kernels.platform.resolve_platform`)."""
  if platform == "gpu":  # jax's name of the CUDA platform
    platform = "cuda"
  return {"cuda": "gpu", "tpu": "tpu"}.get(resolve_platform(platform), "reference")


def paged_attention(q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc, num_seqs,
                    *, sm_scale: float | None = None, implementation: str | None = None,
                    interpret: bool = False, platform: str | None = None,
                    num_kv_heads: int | None = None, **block_sizes) -> jax.Array:
  """Ragged paged attention with the implementation for `platform` (or `implementation`).

  Arguments and result as `paged_attention_reference`; `block_sizes` go to the chosen
  implementation (e.g. `num_kv_splits` for "gpu"); `interpret` to the Pallas ones. `platform`
  ("cpu" | "tpu" | "cuda"; None: the platform being compiled for) picks the implementation
  when none is given and is what the Pallas ones compile for. `num_kv_heads`: K of a pool
  `[P, B, F]` whose last axis is padded past K * H (`kvjax.models.nn.kv_cache.PoolLayout`).

  Raises:
    ValueError: unknown implementation, or as the chosen implementation raises.
  """
  impl = implementation or default_implementation(platform)
  args = (q_TNH, k_pool, v_pool, block_tables, context_lens, query_start_loc, num_seqs)
  if impl == "reference":
    return paged_attention_reference(*args, sm_scale=sm_scale, num_kv_heads=num_kv_heads,
                                     **block_sizes)
  if impl == "gpu":
    return paged_attention_gpu(*args, sm_scale=sm_scale, interpret=interpret, platform=platform,
                               num_kv_heads=num_kv_heads, **block_sizes)
  if impl == "tpu":
    return paged_attention_tpu(*args, sm_scale=sm_scale, interpret=interpret, platform=platform,
                               num_kv_heads=num_kv_heads, **block_sizes)
  raise ValueError(f"implementation={impl!r}, want one of {IMPLEMENTATIONS}")


__all__ = ["IMPLEMENTATIONS", "MASK_VALUE", "check_shapes", "check_values",
           "default_implementation", "gpu_block_sizes", "paged_attention", "paged_attention_gpu",
           "paged_attention_reference", "paged_attention_tpu"]
