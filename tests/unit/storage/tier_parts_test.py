"""The parts of the real tiers and of the chunk store built alone over `memory://` stores: the
tiers' books (`TierLedger`), the mover (`TierMover`: it executes move records) and the store's
maintenance (`StoreAdmin`), each asked only through its own calls."""

import asyncio

import numpy as np
from absl.testing import absltest

from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.host_tier import HostMemoryTier
from kvjax.storage.tiering.placement import Demote, Drop, Insert
from kvjax.storage.backends.store_admin import DataObject, StoreAdmin
from kvjax.storage.tiering.tier_ledger import TierLedger
from kvjax.storage.tiering.tier_mover import TierMover
from kvjax.storage.format.types import KVLayout, MissReason
from kvjax.testing.engines import memory_store_url

LAYOUT = KVLayout(num_layers=2, chunk_size=4, num_kv_heads=1, head_dim=2, dtype="float32")
C = LAYOUT.chunk_size
ROOT = "ab" * 16
HASHES = ["c0" * 16, "c1" * 16, "c2" * 16]


def chunk(i: int) -> np.ndarray:
  return np.full(LAYOUT.shape, float(i), np.float32)


async def put_chunks(store, n: int = 3) -> None:
  """`n` chunks, each its own chain (parent: the namespace root)."""
  for i in range(n):
    await store.put(HASHES[i], ROOT, tuple(range(i * C, (i + 1) * C)), ROOT, chunk(i))


class TierLedgerTest(absltest.TestCase):

  def test_counters_and_snapshots(self):
    ledger = TierLedger(["host", "disk"])
    ledger.count("disk", "hits")
    ledger.count("disk", "bytes_read", 40)
    ledger.miss("disk", MissReason.CORRUPT.value)
    snap = ledger.stats()
    ledger.miss("disk", MissReason.CORRUPT.value)
    self.assertEqual((snap["disk"].hits, snap["disk"].bytes_read, snap["disk"].misses),
                     (1, 40, {"corrupt": 1}))  # a snapshot: later counts do not reach it
    self.assertEqual(ledger.stats()["disk"].misses, {"corrupt": 2})
    self.assertEqual(ledger.value("host", "hits"), 0)

  def test_reads_in_progress(self):
    ledger = TierLedger(["disk"])
    ledger.read_started("disk", HASHES[1])
    ledger.read_started("disk", HASHES[1])
    ledger.read_ended("disk", HASHES[1])
    self.assertEqual(ledger.reading(), {HASHES[1]})
    ledger.read_ended("disk", HASHES[1])
    self.assertFalse(ledger.is_reading("disk", HASHES[1]))
    self.assertEqual(ledger.reading(), set())


class TierMoverTest(absltest.TestCase):
  """The mover executes move records it is given, and decides nothing."""

  def make(self):
    host = HostMemoryTier(None)
    disk = ChunkStore(memory_store_url("mover"), name="disk")
    ledger = TierLedger(["host", "disk"])
    lost = []
    mover = TierMover([host, disk], host, ledger, lambda k, t: lost.append((k, t)),
                      demotion_bytes_in_flight=1 << 20, record=True)
    return host, disk, ledger, lost, mover

  def test_demote_copies_then_deletes_and_drop_deletes(self):
    host, disk, ledger, lost, mover = self.make()
    nb = LAYOUT.nbytes

    async def body():
      await put_chunks(host, 2)
      await put_chunks(disk, 1)
      mover.start([Demote(HASHES[0], "host", "disk", nb), Demote(HASHES[1], "host", "disk", nb),
                   Drop(HASHES[0], "disk", nb)])  # after its demotion (one key: in order)
      await mover.drain()
      return (await host.contains(HASHES[:2]), await disk.contains(HASHES),
              await disk.get(HASHES[1], tuple(range(C, 2 * C)), ROOT, LAYOUT))

    on_host, on_disk, hit = asyncio.run(body())
    self.assertEqual(on_host, [False, False])
    self.assertEqual(on_disk, [False, True, False])
    np.testing.assert_array_equal(hit.kv, chunk(1))
    self.assertEqual(lost, [])
    self.assertEqual(mover.executed, [Demote(HASHES[0], "host", "disk", nb),
                                      Demote(HASHES[1], "host", "disk", nb),
                                      Drop(HASHES[0], "disk", nb)])
    stats = ledger.stats()
    # HASHES[0] was on the disk already: no write.
    self.assertEqual((stats["host"].demotions_out, stats["host"].demotions_unneeded,
                      stats["disk"].demotions_in, stats["disk"].evictions), (1, 1, 1, 1))

  def test_a_failed_insert_is_reported_lost(self):
    host, disk, ledger, lost, mover = self.make()

    async def boom(tier):
      raise OSError("disk full")

    ok = asyncio.run(mover.insert(Insert(HASHES[0], "disk", 8), boom))
    self.assertFalse(ok)
    self.assertEqual(lost, [(HASHES[0], "disk")])
    self.assertEqual(ledger.stats()["disk"].put_errors, 1)


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
