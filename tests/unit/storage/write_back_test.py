"""Write-back placement of `TieredStore`: demotion host -> disk -> remote, cross-tier victims,
the race between a read and a demotion, counters. Exact traces over a host tier of a few chunks
and real (in-memory) chunk stores below it."""

import asyncio
import itertools

import numpy as np
from absl.testing import absltest

from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.eviction import FIFOPolicy, LRUPolicy
from kvjax.storage.tiering.host_tier import HostMemoryTier
from kvjax.storage.tiering.tiers import StoreConfig, TierConfig, TieredStore, build_tiers
from kvjax.storage.format.types import ChunkHit, ChunkMiss, KVLayout, MissReason

NS = "ns-root"  # the namespace id is the parent of a first chunk
C = 4
LAYOUT = KVLayout(num_layers=2, chunk_size=C, num_kv_heads=1, head_dim=2, dtype="float32")
NBYTES = LAYOUT.nbytes  # 128
_ids = itertools.count()


def kv_of(i):
  return np.full(LAYOUT.shape, float(i), np.float32)


def toks(i):
  return tuple(range(i * C, (i + 1) * C))


def mem(name):
  return ChunkStore(f"memory://wb-{name}-{next(_ids)}", name=name)


def store_of(host_chunks=2, disk_chunks=None, remote=False, **kwargs):
  host = HostMemoryTier(host_chunks * NBYTES)
  tiers = [host, mem("disk")] + ([mem("remote")] if remote else [])
  caps = [None, None if disk_chunks is None else disk_chunks * NBYTES] + (
      [None] if remote else [])
  return TieredStore(tiers, capacities=caps, placement="write_back", **kwargs)


async def held(tier, names):
  return [n for n, f in zip(names, await tier.contains(names)) if f]


class WriteBackTest(absltest.TestCase):

  def test_host_victim_is_demoted_and_a_disk_hit_promotes(self):
    store = store_of(host_chunks=2)
    host, disk = store.tiers[0], store.tiers[1]
    names = ["A", "B", "C"]

    async def body():
      for i, n in enumerate(names):  # three independent first chunks
        self.assertEqual(await store.put(n, NS, toks(i), NS, kv_of(i)), ["host"])
      await store.drain()
      self.assertEqual(await held(host, names), ["B", "C"])
      self.assertEqual(await held(disk, names), ["A"])  # only the victim was written to disk
      self.assertEqual(await store.lookup(names), ["disk", "host", "host"])
      hit = await store.get("A", toks(0), NS, LAYOUT)
      self.assertIsInstance(hit, ChunkHit)
      self.assertEqual(hit.tier, "disk")
      np.testing.assert_array_equal(hit.kv, kv_of(0))
      await store.drain()  # the promotion evicted B (LRU): demoted
      self.assertEqual(await held(host, names), ["A", "C"])
      self.assertEqual(await held(disk, names), ["A", "B"])
      again = await store.get("A", toks(0), NS, LAYOUT)
      self.assertEqual(again.tier, "host")
      # A (promoted from disk) is evicted again: disk already holds it, nothing is written.
      await store.put("D", NS, toks(3), NS, kv_of(3))
      await store.put("E", NS, toks(4), NS, kv_of(4))
      await store.drain()
      self.assertEqual(await held(host, names + ["D", "E"]), ["D", "E"])
      self.assertEqual(await held(disk, names + ["D", "E"]), ["A", "B", "C"])
      return store.stats

    stats = asyncio.run(body())
    self.assertEqual(stats["host"].puts, 5)
    self.assertEqual(stats["disk"].puts, 0)  # write-back: no put reached the disk
    self.assertEqual(stats["host"].evictions, 4)
    self.assertEqual(stats["host"].demotions_out, 3)       # A, B, C written once each
    self.assertEqual(stats["host"].demotions_unneeded, 1)  # A's second eviction
    self.assertEqual(stats["disk"].demotions_in, 3)
    self.assertEqual(stats["host"].demotion_drops, 0)
    self.assertEqual(stats["host"].promotions, 1)
    self.assertEqual(stats["disk"].bytes_written, 3 * NBYTES)
    self.assertEqual(stats["host"].bytes_written, 6 * NBYTES)  # 5 puts and 1 promotion

  def test_write_through_writes_every_put_to_disk(self):
    host, disk = HostMemoryTier(2 * NBYTES), mem("disk")
    store = TieredStore([host, disk])

    async def body():
      for i, n in enumerate("ABC"):
        self.assertEqual(await store.put(n, NS, toks(i), NS, kv_of(i)), ["host", "disk"])
      await store.drain()
      return await held(disk, list("ABC"))

    self.assertEqual(asyncio.run(body()), ["A", "B", "C"])
    self.assertEqual(store.stats["host"].demotions_out, 0)
    self.assertEqual(store.stats["disk"].bytes_written, 3 * NBYTES)

  def test_hinted_chunk_is_neither_evicted_nor_demoted(self):
    store = store_of(host_chunks=2)
    host, disk = store.tiers[0], store.tiers[1]

    async def body():
      await store.put("A", NS, toks(0), NS, kv_of(0))
      store.hint([["A"]])
      await store.put("B", NS, toks(1), NS, kv_of(1))
      await store.put("C", NS, toks(2), NS, kv_of(2))  # evicts B, not the hinted A
      await store.drain()
      return await held(host, list("ABC")), await held(disk, list("ABC"))

    self.assertEqual(asyncio.run(body()), (["A", "C"], ["B"]))

  def test_a_put_the_host_declines_goes_to_disk(self):
    store = store_of(host_chunks=1)
    host, disk = store.tiers[0], store.tiers[1]

    async def body():
      await store.put("A", NS, toks(0), NS, kv_of(0))
      store.hint([["A"]])  # no room without evicting A
      self.assertEqual(await store.put("B", NS, toks(1), NS, kv_of(1)), ["disk"])
      self.assertEqual(await store.put("B", NS, toks(1), NS, kv_of(1)), [])  # on disk already
      await store.drain()
      return await held(host, ["A", "B"]), await held(disk, ["A", "B"])

    self.assertEqual(asyncio.run(body()), (["A"], ["B"]))

  def test_suffix_chunks_are_demoted_before_their_prefix(self):
    store = store_of(host_chunks=3)
    host, disk = store.tiers[0], store.tiers[1]
    hs = ["p0", "p1", "p2"]

    async def body():
      for i, (h, parent) in enumerate(zip(hs, [NS] + hs[:-1])):
        await store.put(h, parent, toks(i), NS, kv_of(i))
      await store.put("x", NS, toks(9), NS, kv_of(9))  # evicts the chain's leaf p2
      await store.drain()
      return await held(host, hs + ["x"]), await held(disk, hs + ["x"])

    self.assertEqual(asyncio.run(body()), (["p0", "p1", "x"], ["p2"]))

  def test_a_chunk_whose_parent_is_nowhere_is_dropped_not_demoted(self):
    store = store_of(host_chunks=1)
    disk = store.tiers[1]

    async def body():
      await store.put("child", "gone-parent", toks(1), NS, kv_of(1))
      await store.put("B", NS, toks(2), NS, kv_of(2))
      await store.drain()
      return await held(disk, ["child", "B"])

    self.assertEqual(asyncio.run(body()), [])
    self.assertEqual(store.stats["host"].orphans_dropped, 1)
    self.assertEqual(store.stats["host"].demotions_out, 0)

  def test_disk_victims_cascade_to_remote_and_orphans_go_first(self):
    store = store_of(host_chunks=1, disk_chunks=2, remote=True)
    host, disk, remote = store.tiers
    names = ["A", "B", "C", "D"]

    async def body():
      for i, n in enumerate(names):
        await store.put(n, NS, toks(i), NS, kv_of(i))
      await store.drain()
      out = [await held(t, names) for t in store.tiers]
      # An orphan on disk (its parent is in no tier) is evicted before an older live chunk.
      await disk.put("orphan", "nowhere", toks(7), NS, kv_of(7))
      await store.enforce_capacity()  # a write behind the store's back: seen at a rescan
      await store.put("E", NS, toks(4), NS, kv_of(4))
      await store.drain()
      out.append([await held(t, names + ["E", "orphan"]) for t in store.tiers])
      hit = await store.get("A", toks(0), NS, LAYOUT)
      return out, hit

    (h, d, r, after), hit = asyncio.run(body())
    self.assertEqual((h, d, r), (["D"], ["B", "C"], ["A"]))  # A: host -> disk -> remote
    self.assertEqual(after, [["E"], ["C", "D"], ["A", "B"]])
    self.assertEqual(hit.tier, "remote")
    np.testing.assert_array_equal(hit.kv, kv_of(0))
    stats = store.stats
    self.assertEqual(stats["disk"].demotions_out, 2)  # A, then B
    self.assertEqual(stats["remote"].demotions_in, 2)
    self.assertEqual(stats["disk"].orphans_dropped, 1)

  def test_a_corrupt_demoted_copy_is_a_miss_and_is_dropped(self):
    store = store_of(host_chunks=1)
    disk = store.tiers[1]

    async def body():
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))
      await store.drain()
      rec = (await disk.peek(["A"]))[0]
      root = await disk.kvstore()
      key = rec.encodings[0].object
      data = bytearray((await root.read(key)).value)
      data[5] ^= 0x40
      await root.write(key, bytes(data))
      miss = await store.get("A", toks(0), NS, LAYOUT)
      return miss, await store.lookup(["A"])

    miss, where = asyncio.run(body())
    self.assertIsInstance(miss, ChunkMiss)
    self.assertEqual(miss.reason, MissReason.CHECKSUM_MISMATCH)
    self.assertEqual(where, [None])  # the bad copy was deleted: the next save replaces it
    self.assertEqual(store.stats["disk"].dropped, 1)

  def test_a_failed_demotion_is_counted_and_the_chunk_is_lost(self):
    store = store_of(host_chunks=1)
    disk = store.tiers[1]

    async def boom(*args, **kwargs):
      raise OSError("disk full")
    disk.put = boom

    async def body():
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))
      await store.drain()
      return await store.lookup(["A", "B"])

    self.assertEqual(asyncio.run(body()), [None, "host"])
    self.assertEqual(store.stats["host"].demotion_drops, 1)
    self.assertEqual(store.stats["disk"].put_errors, 1)

  def test_a_read_racing_a_demotion_finds_the_host_copy_then_the_disk_copy(self):
    store = store_of(host_chunks=1)
    host, disk = store.tiers[0], store.tiers[1]
    gate = asyncio.Event
    real_put = disk.put
    seen = []

    async def body():
      release = gate()
      entered = gate()

      async def slow_put(*args, **kwargs):
        entered.set()
        await release.wait()
        return await real_put(*args, **kwargs)
      disk.put = slow_put
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))  # evicts A: its demotion waits
      await entered.wait()
      # A left the host's capacity but is still served by it while the disk write is pending.
      seen.append((host.used_bytes, host.snapshot()["demoting_chunks"]))
      seen.append(await store.lookup(["A"]))
      hit = await store.get("A", toks(0), NS, LAYOUT, promote=False)
      seen.append(hit.tier)
      release.set()
      await store.drain()
      seen.append(await store.lookup(["A"]))
      hit = await store.get("A", toks(0), NS, LAYOUT, promote=False)
      seen.append(hit.tier)
      np.testing.assert_array_equal(hit.kv, kv_of(0))

    asyncio.run(body())
    self.assertEqual(seen, [(NBYTES, 1), ["host"], "host", ["disk"], "disk"])

  def test_a_chunk_being_read_from_disk_is_not_its_victim(self):
    store = store_of(host_chunks=1, disk_chunks=1)
    disk = store.tiers[1]
    real_get = disk.get

    async def body():
      reading, release = asyncio.Event(), asyncio.Event()

      async def slow_get(*args, **kwargs):
        reading.set()
        await release.wait()
        return await real_get(*args, **kwargs)
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))  # A -> disk
      await store.drain()
      disk.get = slow_get
      load = asyncio.create_task(store.get("A", toks(0), NS, LAYOUT, promote=False))
      await reading.wait()
      disk.get = real_get
      await store.put("C", NS, toks(2), NS, kv_of(2))  # B -> disk: over capacity, A is read
      await store.drain()
      during = await held(disk, ["A", "B"])
      release.set()
      hit = await load
      return during, hit

    during, hit = asyncio.run(body())
    # The disk holds one chunk: LRU would evict A, but a load is reading it, so B cannot go
    # there: the planner drops it from the host before writing anything (the old second
    # cascade wrote B to the disk and then evicted it).
    self.assertEqual(during, ["A"])
    self.assertEqual(store.stats["disk"].evictions, 0)
    self.assertEqual(store.stats["disk"].demotions_in, 1)  # A only
    self.assertEqual(store.stats["host"].demotion_drops, 1)  # B: the disk would not take it
    self.assertEqual(hit.tier, "disk")
    np.testing.assert_array_equal(hit.kv, kv_of(0))

  def test_puts_wait_for_room_among_demotions_in_flight(self):
    store = store_of(host_chunks=1, demotion_bytes_in_flight=NBYTES)
    host, disk = store.tiers[0], store.tiers[1]
    real_put, real_host_put = disk.put, host.put
    order = []

    async def body():
      entered, release = asyncio.Event(), asyncio.Event()

      async def slow_put(h, *args, **kwargs):
        order.append(f"demote {h}")
        entered.set()
        await release.wait()
        return await real_put(h, *args, **kwargs)

      async def host_put(h, *args, **kwargs):
        order.append(f"host {h}")
        return await real_host_put(h, *args, **kwargs)
      disk.put, host.put = slow_put, host_put
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))  # A's demotion holds the bound
      await entered.wait()
      third = asyncio.create_task(store.put("C", NS, toks(2), NS, kv_of(2)))
      for _ in range(20):  # yields only: C would finish in these if it did not wait
        await asyncio.sleep(0)
      order.append(f"C done {third.done()}")
      release.set()
      await third
      await store.drain()
      return await held(disk, list("ABC"))

    self.assertEqual(asyncio.run(body()), ["A", "B"])
    self.assertEqual(order, ["host A", "host B", "demote A", "C done False", "host C",
                             "demote B"])

  def test_delete_reaches_a_chunk_being_demoted(self):
    store = store_of(host_chunks=1)
    disk = store.tiers[1]

    async def body():
      entered, release = asyncio.Event(), asyncio.Event()

      async def slow_contains(hashes):
        entered.set()
        await release.wait()
        return [False for _ in hashes]
      real_contains = disk.contains
      disk.contains = slow_contains
      await store.put("A", NS, toks(0), NS, kv_of(0))
      await store.put("B", NS, toks(1), NS, kv_of(1))
      await entered.wait()
      gone = await store.delete("A")
      disk.contains = real_contains
      release.set()
      await store.drain()
      return gone, await store.lookup(["A"])

    self.assertEqual(asyncio.run(body()), (["host"], [None]))  # not written to disk after all
    self.assertEqual(store.stats["host"].demotions_out, 0)


class ConfigTest(absltest.TestCase):

  def test_store_config_placement_and_eviction(self):
    tiers = (TierConfig("host", capacity_bytes=2 * NBYTES), TierConfig("disk", url="memory://x"))
    self.assertEqual(StoreConfig(tiers).placement, "write_through")
    with self.assertRaisesRegex(ValueError, "placement"):
      StoreConfig(tiers, placement="write_around")
    with self.assertRaisesRegex(ValueError, "eviction"):
      StoreConfig(tiers, eviction="random")
    with self.assertRaisesRegex(ValueError, "demotion_bytes_in_flight"):
      StoreConfig(tiers, demotion_bytes_in_flight=0)
    store = build_tiers(StoreConfig(tiers, placement="write_back", eviction="fifo",
                                    demotion_bytes_in_flight=3 * NBYTES),
                        make_chunk_store=lambda url, name, limiter: ChunkStore(url, name=name))
    self.assertEqual(store.placement, "write_back")
    self.assertTrue(store.host.demote)
    self.assertIsInstance(store.host.policy, FIFOPolicy)
    self.assertEqual(store.demotion_bytes_in_flight, 3 * NBYTES)
    lru = build_tiers(StoreConfig(tiers),
                      make_chunk_store=lambda url, name, limiter: ChunkStore(url, name=name))
    self.assertIsInstance(lru.host.policy, LRUPolicy)
    self.assertFalse(lru.host.demote)
    self.assertEqual(StoreConfig.from_url("memory://y", host_capacity_bytes=NBYTES,
                                          placement="write_back").placement, "write_back")

  def test_write_back_with_write_all_persistent_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "write-through only"):
      TieredStore([HostMemoryTier(NBYTES), mem("disk")], placement="write_back",
                  write_all_persistent=True)


if __name__ == "__main__":
  absltest.main()
