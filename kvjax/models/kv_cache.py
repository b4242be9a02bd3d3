"""The device KV cache: fixed decode slots, JetStream style.

    k_LBSKH, v_LBSKH   [L, slots, S_max, K, H]   keys AFTER RoPE (attention reads them as they are)
    lengths_B          int32[slots]              tokens written per slot (prefix [0, length))

RoPE contract (DESIGN.md section 4): the device cache holds K after RoPE; the store holds K before
RoPE, so `prefill_chunk` hands the saver the chunk's pre-RoPE K and whatever inserts a stored chunk
rotates it to the chunk's target positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.kernels.attention import DEFAULT_BLOCK_SIZE
from kvjax.models.config import LlamaConfig
from kvjax.models.layers import apply_rope

#: Version of the stored KV layout `[L, 2, C, K, H]`, K before RoPE (HF `rotate_half` layout).
#: Bump it whenever what a stored chunk means changes; it seeds the store's key namespace.
KV_LAYOUT_VERSION = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """KV cache for `slots` sequences of up to `S_max` tokens.

  Attributes:
    k_LBSKH: [L, slots, S_max, K, H] keys after RoPE, cache dtype.
    v_LBSKH: [L, slots, S_max, K, H] values, cache dtype.
    lengths_B: int32[slots] valid tokens per slot.
  """

  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  lengths_B: jax.Array

  @property
  def num_slots(self) -> int:
    return self.k_LBSKH.shape[1]

  @property
  def max_seq_len(self) -> int:
    """S_max, positions per slot (a multiple of the attention block size)."""
    return self.k_LBSKH.shape[2]

  @property
  def nbytes(self) -> int:
    return self.k_LBSKH.nbytes + self.v_LBSKH.nbytes + self.lengths_B.nbytes


def cache_len_for(max_seq_len: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
  """S_max: `max_seq_len` rounded up to a whole number of attention blocks."""
  return -(-max_seq_len // block_size) * block_size


def init_kv_cache(cfg: LlamaConfig, num_slots: int, max_seq_len: int, dtype=jnp.float32,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
  """Allocates a zeroed cache of `num_slots` x `cache_len_for(max_seq_len)` positions.

  Raises:
    ValueError: if `num_slots` or `max_seq_len` is not positive.
  """
  if num_slots <= 0 or max_seq_len <= 0:
    raise ValueError(f"num_slots={num_slots} and max_seq_len={max_seq_len} must be positive")
  shape = (cfg.n_layers, num_slots, cache_len_for(max_seq_len, block_size), cfg.n_kv_heads,
           cfg.head_dim)
  return KVCache(k_LBSKH=jnp.zeros(shape, dtype), v_LBSKH=jnp.zeros(shape, dtype),
                 lengths_B=jnp.zeros((num_slots,), jnp.int32))


def insert_chunk(cache: KVCache, kv_L2CKH: jax.Array, slot: jax.Array, start: jax.Array,
                 inv_freq: jax.Array) -> KVCache:
  """Writes one stored chunk into a slot at positions `[start, start + C)`, rotating K there.

  The store holds K before RoPE (DESIGN.md section 4), so a chunk is valid at any position; this
  applies RoPE at its target positions in f32, then casts to the cache dtype. The jnp path; the
  codec issue's Pallas `kv_decode` kernel fuses dequantization into the same step.

  Args:
    cache: the KV cache (donated by the jitted caller).
    kv_L2CKH: [L, 2, C, K, H] K before RoPE and V, any float dtype.
    slot: int32 scalar decode slot.
    start: int32 scalar position of the chunk's first token.
    inv_freq: f32[H // 2] rotary inverse frequencies of the model.

  Returns:
    The cache with the chunk written; lengths are left to the caller's plan.
  """
  c = kv_L2CKH.shape[2]
  positions_1C = (start + jnp.arange(c, dtype=jnp.int32))[None]
  k_LCKH = apply_rope(kv_L2CKH[:, 0], positions_1C, inv_freq)  # L plays the batch axis here
  v_LCKH = kv_L2CKH[:, 1]
  zero = jnp.int32(0)
  idx = (zero, slot, start, zero, zero)
  k = jax.lax.dynamic_update_slice(cache.k_LBSKH, k_LCKH.astype(cache.k_LBSKH.dtype)[:, None],
                                   idx)
  v = jax.lax.dynamic_update_slice(cache.v_LBSKH, v_LCKH.astype(cache.v_LBSKH.dtype)[:, None],
                                   idx)
  return KVCache(k, v, cache.lengths_B)


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
