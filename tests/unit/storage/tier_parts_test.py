"""The parts of the real tiers and of the chunk store built alone over `memory://` stores: the
tiers' books (`TierLedger`), the mover (`TierMover`) and the store's maintenance
(`StoreAdmin`), each asked only through its own calls."""

import asyncio

import numpy as np
from absl.testing import absltest

from kvjax.storage.chunk_store import ChunkStore
from kvjax.storage.eviction import LRUPolicy
from kvjax.storage.store_admin import DataObject, StoreAdmin
from kvjax.storage.tier_ledger import PersistentTier, TierLedger
from kvjax.storage.tier_mover import TierMover
from kvjax.storage.types import KVLayout, MissReason
from kvjax.testing.engines import memory_store_url

LAYOUT = KVLayout(num_layers=2, chunk_size=4, num_kv_heads=1, head_dim=2, dtype="float32")
C = LAYOUT.chunk_size
ROOT = "ab" * 16
HASHES = ["c0" * 16, "c1" * 16, "c2" * 16]


def chunk(i: int) -> np.ndarray:
  return np.full(LAYOUT.shape, float(i), np.float32)


async def put_chunks(store: ChunkStore, n: int = 3) -> None:
  """`n` chunks, each its own chain (parent: the namespace root)."""
  for i in range(n):
    await store.put(HASHES[i], ROOT, tuple(range(i * C, (i + 1) * C)), ROOT, chunk(i))


class TierLedgerTest(absltest.TestCase):

  def test_counters_and_snapshots(self):
    ledger = TierLedger(["host", "disk"], {"disk": PersistentTier(None, LRUPolicy())})
    ledger.count("disk", "hits")
    ledger.count("disk", "bytes_read", 40)
    ledger.miss("disk", MissReason.CORRUPT.value)
    snap = ledger.stats()
    ledger.miss("disk", MissReason.CORRUPT.value)
    self.assertEqual((snap["disk"].hits, snap["disk"].bytes_read, snap["disk"].misses),
                     (1, 40, {"corrupt": 1}))  # a snapshot: later counts do not reach it
    self.assertEqual(ledger.stats()["disk"].misses, {"corrupt": 2})
    self.assertEqual(ledger.value("host", "hits"), 0)
    self.assertFalse(ledger.begin_eviction("disk"))  # unbounded: never a pass

  def test_an_eviction_view_ranks_by_recency_and_keeps_reads(self):
    store = ChunkStore(memory_store_url("ledger"), name="disk")
    asyncio.run(put_chunks(store))
    recs = asyncio.run(store.records())
    ledger = TierLedger(["disk"], {"disk": PersistentTier(2 * LAYOUT.nbytes, LRUPolicy())})
    for h in (HASHES[2], HASHES[0], HASHES[1]):
      ledger.touch("disk", h, new=True)
    ledger.read_started("disk", HASHES[1])
    self.assertTrue(ledger.begin_eviction("disk"))
    self.assertFalse(ledger.begin_eviction("disk"))  # one pass at a time
    need, infos, reading = ledger.eviction_view("disk", recs)
    self.assertEqual(need, LAYOUT.nbytes)
    self.assertEqual({i.chunk_hash: i.last_access for i in infos},
                     {HASHES[2]: 1, HASHES[0]: 2, HASHES[1]: 3})
    self.assertEqual(reading, {HASHES[1]})
    ledger.forget("disk", HASHES[2])
    self.assertFalse(ledger.end_eviction("disk"))  # the mirror now fits
    ledger.read_ended("disk", HASHES[1])
    self.assertFalse(ledger.is_reading("disk", HASHES[1]))


class TierMoverTest(absltest.TestCase):

  def evict(self, reading=()):
    """Three chunks in a tier that holds two; touched 0, 1, 2, then 0 again."""
    disk = ChunkStore(memory_store_url("mover"), name="disk")
    persistent = {"disk": PersistentTier(2 * LAYOUT.nbytes, LRUPolicy())}
    ledger = TierLedger(["disk"], persistent)

    async def held(hashes):
      return [None] * len(hashes)

    mover = TierMover([disk], None, persistent, ledger, held, placement="write_through",
                      demotion_bytes_in_flight=1 << 20)

    async def body():
      await put_chunks(disk)
      for i in (0, 1, 2, 0):
        ledger.touch("disk", HASHES[i])
      for h in reading:
        ledger.read_started("disk", h)
      await mover.enforce(disk)
      return await disk.contains(HASHES)

    return asyncio.run(body()), ledger

  def test_the_least_recent_chunk_goes(self):
    held, ledger = self.evict()
    self.assertEqual(held, [True, False, True])
    self.assertEqual(ledger.stats()["disk"].evictions, 1)

  def test_a_chunk_being_read_stays(self):
    held, _ = self.evict(reading=[HASHES[1]])
    self.assertEqual(held, [True, True, False])


class StoreAdminTest(absltest.TestCase):

  def test_orphans_are_listed_and_collected(self):
    store = ChunkStore(memory_store_url("admin"), name="disk")
    admin = StoreAdmin(store)
    orphan = f"data/{HASHES[2]}/raw-0-{'0' * 32}"

    async def body():
      await put_chunks(store, 2)
      root = await store.kvstore()
      await root.write(orphan, b"x" * 10)
      index = await admin.scan()
      found = await admin.orphans(index)
      verified = [await admin.verify(r) for r in index.records]
      removed = await admin.gc()
      return index, found, verified, removed, await admin.orphans()

    index, found, verified, removed, after = asyncio.run(body())
    self.assertEqual([r.chunk_hash for r in index.records], HASHES[:2])
    self.assertEqual(found, [DataObject(orphan, 10)])
    self.assertEqual(verified, [None, None])
    self.assertEqual((removed, after), (1, []))
    self.assertIsNone(admin.local_dir())  # memory://: no directory
    with self.assertRaisesRegex(ValueError, "not a plain file store"):
      admin.object_files(index.records[0])


if __name__ == "__main__":
  absltest.main()
