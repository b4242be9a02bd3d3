"""The paged pool's layout (`kvjax.models.nn.kv_cache.PoolLayout`: heads folded into the last axis,
padded to whole TPU lanes per shard) and the default pool size on an accelerator
(`kvjax.models.runner.pool_memory.pool_blocks_for_memory`, fed fake memory figures)."""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from kvjax.kernels import paged_attention as pa
from kvjax.models.runner import pool_memory as pm
from kvjax.models.nn.kv_cache import (PoolLayout, init_paged_kv_cache, read_pool_blocks,
                                      write_chunk_blocks, write_layer_blocks)
from kvjax.models.loading.registry import load_model

TINY = load_model("tiny").config  # 2 KV heads of 16


class PoolLayoutTest(absltest.TestCase):

  def test_widths(self):
    self.assertEqual(PoolLayout(3, 64).width, 192)  # CPU / GPU: a plain fold
    self.assertEqual(PoolLayout(3, 64, lane_multiple=128).width, 256)  # SmolLM2 on TPU
    self.assertEqual(PoolLayout(3, 64, shards=3, lane_multiple=128).width, 384)  # one per device
    self.assertEqual(PoolLayout(8, 128, shards=4, lane_multiple=128).width, 1024)  # 8B: none
    self.assertFalse(PoolLayout(8, 128, shards=8, lane_multiple=128).padded)
    with self.assertRaisesRegex(ValueError, "do not split"):
      PoolLayout(3, 64, shards=2)

  def test_fold_places_each_shards_heads_first_and_pads_with_zeros(self):
    layout = PoolLayout(4, 16, shards=2, lane_multiple=128)  # W = 128: heads at 0-31, 128-159
    x = jnp.arange(2 * 4 * 16, dtype=jnp.float32).reshape(2, 4, 16) + 1
    f = np.asarray(layout.fold(x))
    self.assertEqual(f.shape, (2, 256))
    np.testing.assert_array_equal(f[:, :32], np.asarray(x[:, :2]).reshape(2, 32))
    np.testing.assert_array_equal(f[:, 128:160], np.asarray(x[:, 2:]).reshape(2, 32))
    self.assertEqual(np.abs(f[:, 32:128]).sum() + np.abs(f[:, 160:]).sum(), 0.0)
    np.testing.assert_array_equal(np.asarray(layout.unfold(layout.fold(x))), np.asarray(x))

  def test_chunk_and_layer_writes_touch_only_their_blocks_and_read_back(self):
    rng = np.random.default_rng(0)
    for layout in (PoolLayout(2, 16), PoolLayout(2, 16, lane_multiple=128),
                   PoolLayout(2, 16, shards=2, lane_multiple=128)):
      pool = init_paged_kv_cache(TINY, 6, 4, jnp.float32, layout)
      l_ = TINY.n_layers
      k = rng.normal(size=(l_, 8, 2, 16)).astype(np.float32)
      v = rng.normal(size=(l_, 8, 2, 16)).astype(np.float32)
      pool = write_chunk_blocks(pool, k, v, jnp.asarray([4, 1], jnp.int32))
      got_k, got_v = read_pool_blocks(pool, jnp.asarray([4, 1], jnp.int32))
      np.testing.assert_array_equal(np.asarray(got_k), k)
      np.testing.assert_array_equal(np.asarray(got_v), v)
      others = np.asarray(pool.k_LPBF)[:, [0, 2, 3, 5]]
      self.assertEqual(np.abs(others).sum(), 0.0, layout)
      # Layers [1, 2) of another chunk into blocks 0 and 2: only that layer changes.
      k2 = rng.normal(size=(1, 1, 8, 2, 16)).astype(np.float32)
      pool2 = write_layer_blocks(pool, k2, k2, jnp.asarray([[0, 2]], jnp.int32), 1)
      got, _ = read_pool_blocks(pool2, jnp.asarray([0, 2], jnp.int32))
      np.testing.assert_array_equal(np.asarray(got)[1], k2[0, 0])
      self.assertEqual(np.abs(np.asarray(got)[0]).sum(), 0.0)
      np.testing.assert_array_equal(np.asarray(read_pool_blocks(pool2, jnp.asarray([4]))[0]),
                                    k[:, :4])

  def test_attention_reads_a_padded_pool_like_an_unpadded_one(self):
    # K = 2 heads of 16 padded to 128 lanes (TPU's layout), vs the plain [P, B, K, H] pool.
    rng = np.random.default_rng(1)
    layout = PoolLayout(2, 16, lane_multiple=128)
    k4 = rng.normal(size=(8, 4, 2, 16)).astype(np.float32)
    v4 = rng.normal(size=(8, 4, 2, 16)).astype(np.float32)
    q = jnp.asarray(rng.normal(size=(6, 4, 16)).astype(np.float32))
    meta = (jnp.asarray([[3, 0, 5], [6, 2, 1]], jnp.int32), jnp.asarray([9, 3], jnp.int32),
            jnp.asarray([0, 5, 6], jnp.int32), jnp.int32(2))
    want = pa.paged_attention(q, jnp.asarray(k4), jnp.asarray(v4), *meta,
                              implementation="reference")
    # Small tiles (4 query rows, 2 blocks a kv step): the interpreted TPU kernel stays cheap and
    # the 3-column tables still take two kv steps.
    blocks = dict(query_block=4, kv_tokens_per_step=8)
    for impl, kw in (("reference", {}), ("tpu", {"interpret": True})):
      got = pa.paged_attention(q, layout.fold(jnp.asarray(k4)), layout.fold(jnp.asarray(v4)),
                               *meta, implementation=impl, num_kv_heads=2, **blocks, **kw)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, err_msg=impl)


def fake(num_blocks, *, args, temp, out=None, alias=None):
  """A step's memory figures: `args` and `temp` in bytes."""
  return pm.ProgramMemory(num_blocks, argument_bytes=args, output_bytes=out or 0,
                          alias_bytes=alias or 0, temp_bytes=temp)


class PoolSizingTest(absltest.TestCase):

  def test_fits_the_fixed_part_and_a_per_block_part(self):
    # 2 GiB of weights and activations, 4 MiB per block (donated: output aliases the pool).
    gib, mib = 1 << 30, 1 << 20
    small = fake(128, args=2 * gib + 128 * 4 * mib, temp=0, out=128 * 4 * mib,
                 alias=128 * 4 * mib)
    large = fake(256, args=2 * gib + 256 * 4 * mib, temp=0, out=256 * 4 * mib,
                 alias=256 * 4 * mib)
    # 32 GiB, 5% margin, 1 GiB used elsewhere: (30.4 - 1 - 2) GiB / 4 MiB = 7014 blocks.
    n = pm.pool_blocks_for_memory(32 * gib, small, large, in_use_bytes=gib, margin=0.05)
    self.assertEqual(n, int((32 * gib * 0.95 - gib - 2 * gib) // (4 * mib)))
    self.assertEqual(n, 7014)

  def test_a_temporary_that_grows_with_the_pool_shrinks_it(self):
    # A step that copies its pool (temp = pool size) fits half as many blocks.
    gib, mib = 1 << 30, 1 << 20
    copy = lambda n: fake(n, args=gib + n * mib, temp=n * mib)
    clean = lambda n: fake(n, args=gib + n * mib, temp=0)
    with_copy = pm.pool_blocks_for_memory(16 * gib, copy(128), copy(256), margin=0.0)
    without = pm.pool_blocks_for_memory(16 * gib, clean(128), clean(256), margin=0.0)
    self.assertEqual(without, 15 * 1024)
    self.assertEqual(with_copy, 15 * 512)

  def test_refusals(self):
    gib = 1 << 30
    with self.assertRaisesRegex(ValueError, "no room for a pool"):
      pm.pool_blocks_for_memory(gib, fake(128, args=2 * gib, temp=0),
                                fake(256, args=2 * gib + 128, temp=0))
    with self.assertRaisesRegex(ValueError, "does not grow"):
      pm.pool_blocks_for_memory(gib, fake(128, args=5, temp=0), fake(256, args=5, temp=0))
    with self.assertRaisesRegex(ValueError, "two sizes"):
      pm.pool_blocks_for_memory(gib, fake(256, args=5, temp=0), fake(128, args=9, temp=0))

  def test_cpu_default_is_unchanged(self):
    self.assertEqual(pm.default_kv_cache_bytes(), pm.DEFAULT_CPU_KV_CACHE_BYTES)
    self.assertEqual(pm.default_kv_cache_bytes(1000), 1000)


if __name__ == "__main__":
  absltest.main()
