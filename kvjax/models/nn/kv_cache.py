"""The device KV cache: one pool of blocks shared by every sequence (docs/design/paged-memory.md).

    k_LPBF, v_LPBF   [L, P, B, F]   keys AFTER RoPE, heads folded into F (`PoolLayout`)

RoPE contract (docs/design/storage-format.md): the device pool holds K after RoPE; the store holds
K before RoPE, so a step hands the saver its tokens' pre-RoPE K and whatever inserts a stored
chunk rotates it to the chunk's target positions.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.models.nn.config import LlamaConfig

#: Version of the stored KV layout `[L, 2, C, K, H]`, K before RoPE (HF `rotate_half` layout).
#: Bump it whenever what a stored chunk means changes; it seeds the store's key namespace.
KV_LAYOUT_VERSION = 1


#: Lanes of a TPU vreg: the pool's last axis is padded to whole lanes on TPU (`PoolLayout`).
TPU_LANES = 128


def pool_lane_multiple(platform: str | None) -> int:
  """What the pool's per-shard width is rounded up to on `platform`: 128 lanes on "tpu" (a last
  axis that is not a multiple of 128 makes XLA pick another physical layout for the pool and
  convert it around every scatter and kernel), 1 (no padding) elsewhere."""
  return TPU_LANES if platform == "tpu" else 1


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  """Where the heads live in the pool's last axis `F`.

  The K' heads held (a KV head repeated r times under tensor parallelism counts r times) are
  cut into `shards` groups of `K' / shards` heads (one per device of the `tp` mesh); group s
  occupies lanes `[s * W, s * W + (K' / shards) * H)` of `F = shards * W`, head-major, with
  `W = (K' / shards) * H` rounded up to `lane_multiple` (the rest of each group is padding,
  zeros, never read). On CPU and GPU `lane_multiple` is 1: `F = K' * H`, a plain fold.

      SmolLM2 (K=3, H=64) on TPU, one shard:   F = 256   |h0 64|h1 64|h2 64|pad 64|
      LLaMA-3.1-8B (K=8, H=128), any TP:       F = 1024, no padding

  Attributes:
    num_kv_heads: K', heads held.
    head_dim: H.
    shards: head groups (the tensor-parallel size; 1 on one device).
    lane_multiple: each group's width is a multiple of it (`pool_lane_multiple`).
  """

  num_kv_heads: int
  head_dim: int
  shards: int = 1
  lane_multiple: int = 1

  def __post_init__(self):
    if self.num_kv_heads % self.shards:
      raise ValueError(f"{self.num_kv_heads} pool heads do not split over {self.shards} shards")

  @property
  def heads_per_shard(self) -> int:
    return self.num_kv_heads // self.shards

  @property
  def shard_width(self) -> int:
    """W: lanes of one shard's group, padding included."""
    m = self.lane_multiple
    return -(-self.heads_per_shard * self.head_dim // m) * m

  @property
  def width(self) -> int:
    """F: the pool's last axis."""
    return self.shards * self.shard_width

  @property
  def padded(self) -> bool:
    return self.width != self.num_kv_heads * self.head_dim

  def fold(self, x_KH: jax.Array) -> jax.Array:
    """`[..., K', H]` -> `[..., F]` (padding lanes zero)."""
    lead = x_KH.shape[:-2]
    x = x_KH.reshape(*lead, self.shards, self.heads_per_shard * self.head_dim)
    if self.padded:
      pad = self.shard_width - x.shape[-1]
      x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*lead, self.width)

  def unfold(self, x_F: jax.Array) -> jax.Array:
    """`[..., F]` -> `[..., K', H]` (padding dropped)."""
    lead = x_F.shape[:-1]
    x = x_F.reshape(*lead, self.shards, self.shard_width)
    if self.padded:
      x = x[..., :self.heads_per_shard * self.head_dim]
    return x.reshape(*lead, self.num_kv_heads, self.head_dim)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k_LPBF", "v_LPBF"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """The paged device KV pool: one pool of blocks shared by every sequence.

      k_LPBF, v_LPBF   [L, P, B, F]   P blocks of B tokens per layer; keys AFTER RoPE

  The heads are folded into the last (lane) axis, `F` as `layout` (`PoolLayout`) says: F = K * H
  head-major on CPU and GPU; on TPU each shard's heads padded to whole 128 lanes. That is the
  layout the paged attention kernels read (`kvjax.kernels.paged_attention`: blocks of `[B, F]`),
  and on TPU it is the chip's own tiled layout with no conversion: the pool goes to the kernels
  and to every scatter as it is. (`[L, P, B, K, H]` padded K to 8 sublanes and H to 128 lanes,
  and XLA converted the pool around every step and insert: 1-1.4 GB of temporaries per GB of
  pool on v6e, SmolLM2; `scripts/compile_check.py --pool_memory`.) Tensor parallelism shards F
  by head group (`kvjax.models.runner.sharding`).

  Token position p of a sequence whose block table is `bt` lives at `[:, bt[p // B], p % B]`.
  Which block belongs to whom is the scheduler's `KVCacheManager`; the pool itself holds no
  lengths or owners. Read and write it through the helpers below (`write_chunk_blocks`,
  `write_layer_blocks`, `write_token_rows`, `read_pool_blocks`, `flat_layers`), which hide
  the fold.

  Attributes:
    k_LPBF: [L, num_blocks, block_size, F] keys after RoPE, cache dtype.
    v_LPBF: [L, num_blocks, block_size, F] values, cache dtype.
    layout: where the heads live in F (static: part of the pytree's structure).
  """

  k_LPBF: jax.Array
  v_LPBF: jax.Array
  layout: PoolLayout

  @property
  def num_blocks(self) -> int:
    return self.k_LPBF.shape[1]

  @property
  def block_size(self) -> int:
    return self.k_LPBF.shape[2]

  @property
  def num_layers(self) -> int:
    return self.k_LPBF.shape[0]

  @property
  def nbytes(self) -> int:
    return self.k_LPBF.nbytes + self.v_LPBF.nbytes

  def replace(self, k_LPBF, v_LPBF) -> "PagedKVCache":
    """The same layout holding other arrays."""
    return PagedKVCache(k_LPBF, v_LPBF, self.layout)


def paged_pool_shape(num_layers: int, num_blocks: int, block_size: int,
                     layout: PoolLayout) -> tuple[int, int, int, int]:
  """The pool's K (and V) shape `[L, P, B, F]`."""
  return (num_layers, num_blocks, block_size, layout.width)


def paged_block_nbytes(cfg: LlamaConfig, block_size: int, dtype,
                       layout: PoolLayout | None = None) -> int:
  """Bytes one pool block takes over all layers, K and V: 2 * L * B * F * itemsize (F = K * H
  without a `layout`)."""
  f = cfg.n_kv_heads * cfg.head_dim if layout is None else layout.width
  return 2 * cfg.n_layers * block_size * f * jnp.dtype(dtype).itemsize


def init_paged_kv_cache(cfg: LlamaConfig, num_blocks: int, block_size: int,
                        dtype=jnp.float32, layout: PoolLayout | None = None) -> PagedKVCache:
  """Allocates a zeroed pool of `num_blocks` blocks of `block_size` tokens, `[L, P, B, F]`
  (`layout` default: the model's KV heads, one shard, no padding).

  Raises:
    ValueError: if `num_blocks` or `block_size` is not positive.
  """
  if num_blocks <= 0 or block_size <= 0:
    raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
  layout = layout or PoolLayout(cfg.n_kv_heads, cfg.head_dim)
  shape = paged_pool_shape(cfg.n_layers, num_blocks, block_size, layout)
  return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), layout)


def flat_layers(pool: PagedKVCache) -> tuple[jax.Array, jax.Array]:
  """The pool as one block axis over all layers, `[L * P, B, F]` (layer l's block p is row
  `l * P + p`): a merge of leading axes, free on every backend. What a step carries through
  its layers and hands to paged attention."""
  l_, p_, b_, f_ = pool.k_LPBF.shape
  return pool.k_LPBF.reshape(l_ * p_, b_, f_), pool.v_LPBF.reshape(l_ * p_, b_, f_)


def from_flat_layers(k_NBF: jax.Array, v_NBF: jax.Array, like: PagedKVCache) -> PagedKVCache:
  """Inverse of `flat_layers`: the pool `like` (its layer count and layout) holding them."""
  n_, b_, f_ = k_NBF.shape
  shape = (like.num_layers, n_ // like.num_layers, b_, f_)
  return like.replace(k_NBF.reshape(shape), v_NBF.reshape(shape))


def write_token_rows(layout: PoolLayout, k_NBF: jax.Array, v_NBF: jax.Array, rows_T: jax.Array,
                     cols_T: jax.Array, k_TKH: jax.Array,
                     v_TKH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Writes T tokens' K and V `[T, K', H]` into the flat pool `[N, B, F]` at `(rows, cols)`
  (block row, slot in block); a row outside `[0, N)` is dropped (padding). One scatter of
  whole F rows each, in place when the pool is donated or carried."""
  k = k_NBF.at[rows_T, cols_T].set(layout.fold(k_TKH).astype(k_NBF.dtype), mode="drop")
  v = v_NBF.at[rows_T, cols_T].set(layout.fold(v_TKH).astype(v_NBF.dtype), mode="drop")
  return k, v


def write_chunk_blocks(pool: PagedKVCache, k_LCKH: jax.Array, v_LCKH: jax.Array,
                       block_ids_R: jax.Array) -> PagedKVCache:
  """Writes a chunk of C = R * B tokens (K already rotated) into R whole pool blocks.

  A scatter of R blocks per layer: with the pool donated (every runner insert), XLA writes
  those blocks in place and leaves the rest of the pool untouched (no copy of the pool).

  Args:
    pool: the pool (donated by the jitted caller).
    k_LCKH: [L, C, K, H] keys after RoPE at their target positions, any float dtype.
    v_LCKH: [L, C, K, H] values.
    block_ids_R: int32[R] the blocks holding the chunk's positions, in order.

  Returns:
    The pool with those blocks overwritten (cast to the pool dtype); every other block untouched.

  Raises:
    ValueError: C is not R * B.
  """
  l_, c = k_LCKH.shape[:2]
  return write_layer_blocks(pool, k_LCKH.reshape(1, l_, c, -1, k_LCKH.shape[-1]),
                            v_LCKH.reshape(1, l_, c, -1, v_LCKH.shape[-1]),
                            block_ids_R[None], jnp.int32(0))


def write_layer_blocks(pool: PagedKVCache, k_nGCKH: jax.Array, v_nGCKH: jax.Array,
                       block_ids_nR: jax.Array, layer_start) -> PagedKVCache:
  """Writes layers `[layer_start, layer_start + G)` of n chunks of C = R * B tokens (K already
  rotated) into their blocks: one scatter per K and V, in place when the pool is donated.

  Args:
    pool: the pool (donated by the jitted caller).
    k_nGCKH: [n, G, C, K, H] keys after RoPE, any float dtype.
    v_nGCKH: [n, G, C, K, H] values.
    block_ids_nR: int32[n, R] each chunk's blocks, in order.
    layer_start: int32 scalar (may be traced), the first layer.

  Returns:
    The pool with those layers of those blocks overwritten.

  Raises:
    ValueError: C is not R * B.
  """
  n, g, c, k_, h_ = k_nGCKH.shape
  r = block_ids_nR.shape[1]
  b = pool.block_size
  if r * b != c:
    raise ValueError(f"a chunk of {c} tokens needs {c // b} blocks of {b}, got {r} block ids")
  li = (layer_start + jnp.arange(g, dtype=jnp.int32))[None, :, None]
  bi = block_ids_nR[:, None, :]
  shape = (n, g, r, b, k_, h_)
  fold = pool.layout.fold
  k = pool.k_LPBF.at[li, bi].set(fold(k_nGCKH.reshape(shape)).astype(pool.k_LPBF.dtype))
  v = pool.v_LPBF.at[li, bi].set(fold(v_nGCKH.reshape(shape)).astype(pool.v_LPBF.dtype))
  return pool.replace(k, v)


def read_pool_blocks(pool: PagedKVCache, block_ids_R: jax.Array,
                     head_stride: int = 1) -> tuple[jax.Array, jax.Array]:
  """K and V of R blocks over every layer, unfolded: ([L, R * B, K, H], [L, R * B, K, H]).

  Args:
    pool: the pool.
    block_ids_R: int32[R] the blocks, in order.
    head_stride: keep every `head_stride`-th head (a pool that repeats each KV head r times
      under tensor parallelism reads one copy with r).
  """
  l_, _, b, f_ = pool.k_LPBF.shape
  r = block_ids_R.shape[0]

  def one(x):
    x = pool.layout.unfold(x[:, block_ids_R].reshape(l_, r * b, f_))
    return x[:, :, ::head_stride] if head_stride > 1 else x
  return one(pool.k_LPBF), one(pool.v_LPBF)
