"""A bounded store: a persistent tier never holds more than its capacity after a write, evicts
least recently used leaves first (suffixes before their prefixes), counts a session tail at its
real rows (a tail stores only those), and reports what it holds (`TieredStore.usage`)."""

import asyncio
import os
import tempfile
from unittest import mock

import numpy as np
from absl.testing import absltest

from kvjax.storage.backends import chunk_store as chunk_store_lib
from kvjax.storage.format import keys
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.tiers import StoreConfig, TierConfig, TieredStore, TierUsage, build_tiers
from kvjax.storage.format.types import ChunkHit, KVLayout

C = 8
LAYOUT = KVLayout(num_layers=2, chunk_size=C, num_kv_heads=1, head_dim=4, dtype="float32")
NB = LAYOUT.nbytes  # 512 bytes a chunk
NS = "ns"


def kv(seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(LAYOUT.shape).astype(np.float32)


def ids(seed: int) -> tuple[int, ...]:
  return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 1000, C))


def run(coro):
  return asyncio.run(coro)


class TailRowsTest(absltest.TestCase):
  """A tail (`keys.tail_token_ids`) stores its m real rows, not C."""

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.store = ChunkStore(f"file://{self.dir}", name="disk")
    self.tail_ids = keys.tail_token_ids([5, 6, 7], C)  # m = 3
    values = kv(1)
    values[:, :, 3:] = 0.0  # the engine pads with zeros
    self.values = values

  def test_stored_rows(self):
    self.assertEqual(keys.stored_rows(self.tail_ids), 3)
    self.assertEqual(keys.stored_rows(ids(0)), C)

  def test_a_tail_stores_its_real_rows_and_reads_back_padded(self):
    self.assertTrue(self.store.put_sync("t", NS, self.tail_ids, NS, self.values))
    rec = self.store.records_sync()[0]
    self.assertEqual(rec.encodings[0].nbytes, NB * 3 // C)  # 192 of 512 bytes
    files = self.store.object_files(rec)
    self.assertEqual([os.path.getsize(f) for f in files], [NB * 3 // C])
    got = self.store.get_sync("t", self.tail_ids, NS, LAYOUT)
    self.assertIsInstance(got, ChunkHit)
    np.testing.assert_array_equal(got.kv, self.values)  # bit-exact, zeros in the padding

  def test_padding_rows_read_back_as_zeros(self):
    values = kv(2)  # non-zero padding: it is not stored
    self.assertTrue(self.store.put_sync("t", NS, self.tail_ids, NS, values))
    got = self.store.get_sync("t", self.tail_ids, NS, LAYOUT)
    np.testing.assert_array_equal(got.kv[:, :, :3], values[:, :, :3])
    np.testing.assert_array_equal(got.kv[:, :, 3:], 0.0)

  def test_a_padded_tail_of_an_older_store_still_reads(self):
    with mock.patch.object(chunk_store_lib.chunk_keys, "stored_rows", len):
      self.assertTrue(self.store.put_sync("t", NS, self.tail_ids, NS, self.values))
    self.assertEqual(self.store.records_sync()[0].encodings[0].nbytes, NB)
    got = self.store.get_sync("t", self.tail_ids, NS, LAYOUT)
    self.assertIsInstance(got, ChunkHit)
    np.testing.assert_array_equal(got.kv, self.values)

  def test_a_truncated_tail_object_is_a_miss(self):
    self.assertTrue(self.store.put_sync("t", NS, self.tail_ids, NS, self.values))
    f = self.store.object_files(self.store.records_sync()[0])[0]
    with open(f, "r+b") as fh:
      fh.truncate(NB * 2 // C)
    got = self.store.get_sync("t", self.tail_ids, NS, LAYOUT)
    self.assertNotIsInstance(got, ChunkHit)


class CapacityTest(absltest.TestCase):

  def make(self, capacity_chunks: int, url: str = "memory://") -> TieredStore:
    return build_tiers(StoreConfig((TierConfig("disk", url=url,
                                               capacity_bytes=capacity_chunks * NB),)),
                       make_chunk_store=lambda u, name, limiter: ChunkStore(u, name=name))

  def held(self, store: TieredStore) -> set[str]:
    return {r.chunk_hash for r in run(store.tiers[0].records())}

  def put(self, store, h, parent, seed=0):
    return run(store.put(h, parent, ids(seed), NS, kv(seed)))

  def test_eviction_order_is_least_recent_leaf_first(self):
    store = self.make(3)
    for h, parent in (("a0", NS), ("a1", "a0"), ("a2", "a1")):
      self.put(store, h, parent)
    self.assertIsInstance(run(store.get("a0", ids(0), NS, LAYOUT)), ChunkHit)  # a0 most recent
    # Only leaves go: a2 first, then a1 (now a leaf, older than the b chunks), then a0, although
    # a0 was read after a1 and a2 were written.
    want = [{"a0", "a1", "b0"}, {"a0", "b0", "b1"}, {"b0", "b1", "b2"}]
    for (h, parent), held in zip((("b0", NS), ("b1", "b0"), ("b2", "b1")), want):
      self.put(store, h, parent)
      self.assertEqual(self.held(store), held)
    self.assertEqual(store.stats["disk"].evictions, 3)

  def test_never_over_capacity_after_many_writes(self):
    store = self.make(5)
    rng = np.random.default_rng(0)
    chains: dict[int, list[str]] = {}
    for i in range(60):
      chain = int(rng.integers(0, 6))
      hs = chains.setdefault(chain, [])
      h = f"c{chain}-{len(hs)}"
      tail = rng.random() < 0.3
      token_ids = keys.tail_token_ids(list(ids(i)[:3]), C) if tail else ids(i)
      run(store.put(h, hs[-1] if hs else NS, token_ids, NS, kv(i)))
      if not tail:
        hs.append(h)
      (usage,) = run(store.usage())
      self.assertLessEqual(usage.nbytes, 5 * NB)
      self.assertEqual(usage.capacity_bytes, 5 * NB)
    self.assertGreater(store.stats["disk"].evictions, 40)

  def test_a_tail_counts_its_real_rows(self):
    store = self.make(2)  # 1024 bytes
    self.put(store, "a0", NS)
    tail = lambda i: run(store.put(f"t{i}", "a0", keys.tail_token_ids([i, i, i], C), NS, kv(i)))
    tail(0)
    tail(1)  # a0 and two 3-row tails: 512 + 2 * 192 bytes (as whole chunks: 1536, over)
    self.assertEqual(run(store.usage()), [TierUsage("disk", 3, NB + 2 * NB * 3 // C, 2 * NB)])
    self.assertEqual(store.stats["disk"].evictions, 0)
    tail(2)
    tail(3)  # each over by one tail: the least recent goes
    self.assertEqual(self.held(store), {"a0", "t2", "t3"})
    self.assertEqual(store.stats["disk"].evictions, 2)

  def test_enforce_capacity_shrinks_a_store_filled_under_a_larger_one(self):
    d = tempfile.mkdtemp()
    big = self.make(6, url=f"file://{d}")
    for i in range(6):
      self.put(big, f"r{i}", NS, seed=i)
    small = self.make(2, url=f"file://{d}")
    self.assertEqual(run(small.usage())[0].nbytes, 6 * NB)  # listing alone evicts nothing
    run(small.enforce_capacity())
    self.assertEqual(run(small.usage()), [TierUsage("disk", 2, 2 * NB, 2 * NB)])

  def test_local_dirs(self):
    d = tempfile.mkdtemp()
    store = build_tiers(StoreConfig((TierConfig("host", capacity_bytes=NB),
                                     TierConfig("disk", url=f"file://{d}"),
                                     TierConfig("disk", url="memory://x"))),
                        make_chunk_store=lambda u, name, limiter: ChunkStore(u, name=name))
    self.assertEqual(store.local_dirs, {"disk1": d})


if __name__ == "__main__":
  absltest.main()
