"""The device KV cache: one pool of blocks shared by every sequence (issue 11).

    k_LPBKH, v_LPBKH   [L, P, B, K, H]   keys AFTER RoPE (attention reads them as they are)

RoPE contract (DESIGN.md section 4): the device pool holds K after RoPE; the store holds K before
RoPE, so a step hands the saver its tokens' pre-RoPE K and whatever inserts a stored chunk
rotates it to the chunk's target positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.models.config import LlamaConfig

#: Version of the stored KV layout `[L, 2, C, K, H]`, K before RoPE (HF `rotate_half` layout).
#: Bump it whenever what a stored chunk means changes; it seeds the store's key namespace.
KV_LAYOUT_VERSION = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """The paged device KV pool: one pool of blocks shared by every sequence (issue 11).

      k_LPBKH, v_LPBKH   [L, P, B, K, H]   P blocks of B tokens per layer; keys AFTER RoPE

  Token position p of a sequence whose block table is `bt` lives at `[:, bt[p // B], p % B]`.
  Which block belongs to whom is the scheduler's `KVCacheManager`; the pool itself holds no
  lengths or owners.

  Attributes:
    k_LPBKH: [L, num_blocks, block_size, K, H] keys after RoPE, cache dtype.
    v_LPBKH: [L, num_blocks, block_size, K, H] values, cache dtype.
  """

  k_LPBKH: jax.Array
  v_LPBKH: jax.Array

  @property
  def num_blocks(self) -> int:
    return self.k_LPBKH.shape[1]

  @property
  def block_size(self) -> int:
    return self.k_LPBKH.shape[2]

  @property
  def nbytes(self) -> int:
    return self.k_LPBKH.nbytes + self.v_LPBKH.nbytes


def paged_block_nbytes(cfg: LlamaConfig, block_size: int, dtype) -> int:
  """Bytes one pool block takes over all layers, K and V: 2 * L * B * K * H * itemsize."""
  return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_paged_kv_cache(cfg: LlamaConfig, num_blocks: int, block_size: int,
                        dtype=jnp.float32) -> PagedKVCache:
  """Allocates a zeroed pool of `num_blocks` blocks of `block_size` tokens.

  Raises:
    ValueError: if `num_blocks` or `block_size` is not positive.
  """
  if num_blocks <= 0 or block_size <= 0:
    raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
  shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
  return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_chunk_blocks(pool: PagedKVCache, k_LCKH: jax.Array, v_LCKH: jax.Array,
                       block_ids_R: jax.Array) -> PagedKVCache:
  """Writes a chunk of C = R * B tokens (K already rotated) into R whole pool blocks.

  Args:
    pool: the pool (donated by the jitted caller).
    k_LCKH: [L, C, K, H] keys after RoPE at their target positions, any float dtype.
    v_LCKH: [L, C, K, H] values.
    block_ids_R: int32[R] the blocks holding the chunk's positions, in order.

  Returns:
    The pool with those blocks overwritten (cast to the pool dtype); every other block untouched.
  """
  l_, c, k_, h_ = k_LCKH.shape
  r = block_ids_R.shape[0]
  b = pool.block_size
  if r * b != c:
    raise ValueError(f"a chunk of {c} tokens needs {c // b} blocks of {b}, got {r} block ids")
  k = pool.k_LPBKH.at[:, block_ids_R].set(
      k_LCKH.reshape(l_, r, b, k_, h_).astype(pool.k_LPBKH.dtype))
  v = pool.v_LPBKH.at[:, block_ids_R].set(
      v_LCKH.reshape(l_, r, b, k_, h_).astype(pool.v_LPBKH.dtype))
  return PagedKVCache(k, v)
