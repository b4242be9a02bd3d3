"""Each part of the KV store client built alone over `memory://` stores: the key scheme, the
prefix lookups, the open requests, the saver, the prefetcher, the loader and the host -> device
link, each asked only through its own calls (`kvjax/connector/client.py` builds them the same
way)."""

import asyncio
import threading

import numpy as np
from absl.testing import absltest

from kvjax.connector.loader import Loader
from kvjax.connector.lookup import KeyScheme, PrefixLookups
from kvjax.connector.loop import StoreLoop
from kvjax.connector.prefetch import Prefetcher
from kvjax.connector.records import SAVING, LookaheadRequest, SaveJob
from kvjax.connector.request_keys import OpenRequests
from kvjax.connector.saver import Saver
from kvjax.connector.transfer import HostToDevice
from kvjax.storage.format import keys
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.store_config import StoreConfig
from kvjax.storage.tiering.tiers import build_tiers
from kvjax.storage.format.types import ChunkHit, KVLayout
from kvjax.testing.engines import memory_store_url
from kvjax.testing.fake_runner import NumpyDeviceSeam

LAYOUT = KVLayout(num_layers=2, chunk_size=4, num_kv_heads=1, head_dim=2, dtype="float32")
C = LAYOUT.chunk_size
SCHEME = KeyScheme("fp", LAYOUT, 1)
TOKENS = list(range(100, 113))  # 3 full chunks and one token


def chunk(i: int) -> np.ndarray:
  return np.full(LAYOUT.shape, float(i), np.float32)


def make_store(host_bytes: int | None = None):
  config = StoreConfig.from_url(memory_store_url("parts"), host_capacity_bytes=host_bytes)
  return build_tiers(config, make_chunk_store=lambda url, name, limiter: ChunkStore(
      url, name=name, limiter=limiter))


class PartTestCase(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.loop = StoreLoop(timeout_s=30)
    self.addCleanup(self.loop.stop)


class KeySchemeTest(absltest.TestCase):

  def test_keys_chain_and_tails(self):
    ns = SCHEME.namespace(None)
    root = ns.root_hash()
    hashes = keys.chunk_hashes(ns, TOKENS)
    self.assertLen(hashes, 3)
    self.assertEqual(SCHEME.extend_chunk_hashes(root, hashes[:1], TOKENS, 3), hashes)
    self.assertIsNone(SCHEME.tail_key(root, hashes, TOKENS, 2 * C))
    self.assertEqual(SCHEME.tail_key(root, hashes, TOKENS, 2 * C + 3),
                     (2, hashes[1], keys.tail_hash(hashes[1], TOKENS[2 * C:2 * C + 3])))
    with self.assertRaisesRegex(ValueError, "4 chunks of 4 need 16 tokens, got 13"):
      SCHEME.extend_chunk_hashes(root, hashes, TOKENS, 4)

  def test_only_raw_unkeyed_chunks_store_tails(self):
    self.assertTrue(SCHEME.stores_tails)
    self.assertFalse(KeyScheme("fp", LAYOUT, 1, codec="int8").stores_tails)
    self.assertFalse(KeyScheme("fp", LAYOUT, 1, key_encoding="int8/0").stores_tails)
    self.assertNotEqual(KeyScheme("fp", LAYOUT, 1, key_encoding="int8/0").namespace(None),
                        SCHEME.namespace(None))
    self.assertEqual((SCHEME.origin.model_fingerprint, SCHEME.origin.kv_layout_version),
                     ("fp", 1))


class PrefixLookupsTest(PartTestCase):

  def test_lookup_finds_stored_and_saving_chunks(self):
    store = make_store()
    saving: set = set()
    lookups = PrefixLookups(store, SCHEME, self.loop, lambda hs: {h for h in hs if h in saving})
    self.assertEqual(lookups.put_raw_chunks(None, TOKENS, [chunk(0)]), 1)
    hashes = keys.chunk_hashes(SCHEME.namespace(None), TOKENS)
    saving.add(hashes[1])
    got = lookups.lookup(TOKENS, None)
    self.assertEqual(got.hashes, hashes)
    self.assertEqual(got.present, ["disk", SAVING, None])
    self.assertEqual(lookups.lookup(TOKENS, "other salt").present, [None, None, None])
    read = lookups.read_raw_chunks(got, TOKENS, [0, 1, 2])
    self.assertEqual(list(read), [0])  # chunk 1 is only being saved: no data yet
    np.testing.assert_array_equal(read[0], chunk(0))
    self.assertEqual(lookups.failures, 0)

  def test_a_failing_store_is_counted_and_finds_nothing(self):
    class Broken:
      async def peek(self, hashes):
        raise OSError("unreachable")

    lookups = PrefixLookups(Broken(), SCHEME, self.loop, lambda hs: set())
    self.assertEqual(lookups.lookup(TOKENS, None).present, [None, None, None])
    self.assertEqual(lookups.failures, 1)


class OpenRequestsTest(PartTestCase):

  def test_a_request_keeps_its_chain_until_closed(self):
    store = make_store()
    lookup = PrefixLookups(store, SCHEME, self.loop, lambda hs: set()).lookup(TOKENS[:9], None)
    requests = OpenRequests(SCHEME)
    requests.open("r", lookup, TOKENS[:9])
    ns = lookup.namespace
    full = keys.chunk_hashes(SCHEME.namespace(None), TOKENS)
    self.assertEqual(requests.chunk_key("r", 1), (ns, full[1], full[0]))
    with self.assertRaises(IndexError):
      requests.chunk_key("r", 2)  # the prompt has 2 full chunks
    self.assertEqual(requests.extend("r", TOKENS, 3).hashes, tuple(full))
    self.assertEqual(requests.chunk_key("r", 2), (ns, full[2], full[1]))
    job = requests.tail_job("r", TOKENS, 3 * C + 1, kv=chunk(7))
    self.assertEqual((job.parent, job.token_ids),
                     (full[2], keys.tail_token_ids(TOKENS[3 * C:], C)))
    with self.assertRaisesRegex(ValueError, "no tail: end=8"):
      requests.tail_job("r", TOKENS, 2 * C, kv=None)
    self.assertEqual([rid for rid, _ in requests.open_of(["x", "r"])], ["r"])
    requests.close("r")
    requests.close("r")  # idempotent
    self.assertFalse(requests.is_open("r"))
    with self.assertRaisesRegex(KeyError, "request 'r' is not open"):
      requests.get("r")


class SaverTest(PartTestCase):

  def test_saves_are_pending_until_written_and_drops_are_counted(self):
    store = make_store()
    saver = Saver(store, SCHEME, self.loop, NumpyDeviceSeam(), max_pending_saves=1)
    self.addCleanup(saver.close)
    taken, gate, write = threading.Event(), threading.Event(), saver.write
    saver.write = lambda job: (taken.set(), gate.wait(60), write(job))
    ns = SCHEME.namespace(None)
    root, hashes = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    jobs = [SaveJob(root, hashes[i], hashes[i - 1] if i else root,
                    tuple(TOKENS[i * C:(i + 1) * C]), kv=chunk(i)) for i in range(3)]
    self.assertTrue(saver.submit(jobs[0]))
    done = saver.pending(hashes[0])
    self.assertIsNotNone(done)
    self.assertTrue(taken.wait(60))  # the saver thread holds job 0: the queue is empty
    self.assertTrue(saver.submit(jobs[1]))   # queued
    self.assertFalse(saver.submit(jobs[2]))  # the queue holds one: dropped
    self.assertEqual(saver.pending_keys(hashes), {hashes[0], hashes[1]})
    gate.set()
    saver.join()
    self.assertTrue(done.done())
    self.assertEqual(saver.pending_keys(hashes), set())
    self.assertEqual((saver.stats.jobs_done, saver.stats.chunks_saved, saver.stats.jobs_dropped),
                     (2, 2, 1))
    self.assertEqual(self.loop.run(store.lookup(hashes)), ["disk", "disk", None])


  def test_a_replacing_save_rewrites_a_rejected_chunk(self):
    # A chunk the loader rejected after reading it (a damage only the decoder sees, so the
    # store never learned of it) is recomputed and saved with `replace`: the old copy goes
    # and the new one is written, not skipped as "already held" by the store's planner.
    store = make_store()
    saver = Saver(store, SCHEME, self.loop, NumpyDeviceSeam())
    self.addCleanup(saver.close)
    ns = SCHEME.namespace(None)
    root, (h0, *_) = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    saver.write(SaveJob(root, h0, root, tuple(TOKENS[:C]), kv=chunk(1)))
    saver.write(SaveJob(root, h0, root, tuple(TOKENS[:C]), kv=chunk(2), replace=True))
    self.assertEqual((saver.stats.chunks_saved, saver.stats.chunks_already_stored), (2, 0))
    got = self.loop.run(store.get(h0, TOKENS[:C], root, LAYOUT))
    self.assertIsInstance(got, ChunkHit)
    np.testing.assert_array_equal(got.kv, chunk(2))

  def test_close_ends_a_tail_delete_that_waited_for_its_save(self):
    store = make_store()
    saver = Saver(store, SCHEME, self.loop, NumpyDeviceSeam())
    gate, write = threading.Event(), saver.write
    saver.write = lambda job: (gate.wait(60), write(job))
    delete = store.delete

    async def slow_delete(key):  # many turns of the loop, no wall-clock wait
      for _ in range(2000):
        await asyncio.sleep(0)
      return await delete(key)

    store.delete = slow_delete
    ns = SCHEME.namespace(None)
    root, hashes = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    ids = TOKENS + [113, 114]  # 3 chunks, a 2-token tail (ids[:-1]), one sampled token
    tail = SCHEME.tail_key(root, keys.chunk_hashes(ns, ids, max_tokens=len(ids) - 1), ids,
                           len(ids) - 1)
    self.assertIsNotNone(tail)
    self.assertTrue(saver.submit(SaveJob(root, tail[2], hashes[-1], tuple(ids[3 * C:-1]),
                                         kv=chunk(9)[:, :, :2])))
    dropped = saver.drop_tail(None, ids)  # waits for the tail's save
    self.assertFalse(dropped.done())
    gate.set()
    saver.close()
    self.assertTrue(dropped.done())  # close waited for it: the loop may stop now
    self.assertEqual(saver.stats.tails_dropped, 1)
    self.assertEqual(self.loop.run(store.lookup([tail[2]])), [None])


class PrefetcherTest(PartTestCase):

  def test_a_windowed_chunk_only_disk_holds_is_copied_up(self):
    store = make_store(host_bytes=8 * LAYOUT.nbytes)
    ns = SCHEME.namespace(None)
    root, hashes = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    disk = store.tiers[1]
    self.loop.run(disk.put(hashes[0], root, tuple(TOKENS[:C]), root, chunk(0),
                           origin=SCHEME.origin))
    prefetcher = Prefetcher(store, SCHEME, self.loop)
    window = LookaheadRequest("r", root, tuple(hashes[:2]), ("disk", None),
                              tuple(TOKENS[:2 * C]), (LAYOUT.nbytes,) * 2)
    prefetcher.set_lookahead([window])
    prefetcher.wait()
    self.assertIsNone(prefetcher.in_flight(hashes[0]))
    self.assertEqual(self.loop.run(store.host.contains(hashes[:1])), [True])
    stats = prefetcher.stats
    self.assertEqual((stats.started, stats.issued, stats.useful, stats.hinted_chunks),
                     (1, 1, 0, 2))
    self.loop.run(self._landed(prefetcher, hashes[0], store.host.name))
    self.assertEqual(prefetcher.stats.useful, 1)
    prefetcher.set_lookahead([])
    prefetcher.wait()
    self.assertEqual(prefetcher.stats.wasted, 0)  # it was read before it left the window

  async def _landed(self, prefetcher, chunk_hash, tier):
    prefetcher.load_landed(chunk_hash, tier)  # the loader's call, on the store loop

  def test_a_chunk_a_load_is_reading_is_not_prefetched(self):
    store = make_store(host_bytes=8 * LAYOUT.nbytes)
    ns = SCHEME.namespace(None)
    root, hashes = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    prefetcher = Prefetcher(store, SCHEME, self.loop)

    async def started():
      prefetcher.load_started(hashes[0])

    self.loop.run(started())
    prefetcher.set_lookahead([LookaheadRequest("r", root, (hashes[0],), ("disk",),
                                               tuple(TOKENS[:C]), (LAYOUT.nbytes,))])
    prefetcher.wait()
    self.assertEqual(prefetcher.stats.started, 0)


class LoaderTest(PartTestCase):

  def test_a_load_lands_is_reported_and_taken(self):
    store = make_store()
    device = NumpyDeviceSeam()
    saver = Saver(store, SCHEME, self.loop, device)
    self.addCleanup(saver.close)
    lookups = PrefixLookups(store, SCHEME, self.loop, saver.pending_keys)
    lookups.put_raw_chunks(None, TOKENS, [chunk(0), chunk(1)])
    loader = Loader(store, SCHEME, self.loop, device, saver, Prefetcher(store, SCHEME, self.loop))
    lookup = lookups.lookup(TOKENS, None)
    for i in range(3):  # chunk 2 is not stored: a miss
      loader.start("r", i, lookup, TOKENS)
    reports = []
    while len(reports) < 3:
      reports += loader.landed(wait_s=30)
    self.assertEqual(sorted((r.index, r.ok, r.nbytes, r.tier, r.reason) for r in reports), [
        (0, True, LAYOUT.nbytes, "disk", ""), (1, True, LAYOUT.nbytes, "disk", ""),
        (2, False, 0, "", "absent")])
    self.assertEqual(loader.stats.staged_bytes, 2 * LAYOUT.nbytes)
    hit = loader.take("r", 1)
    self.assertIsInstance(hit, ChunkHit)
    np.testing.assert_array_equal(hit.kv, chunk(1))
    self.assertEqual(loader.cancel("r"), 1)  # chunk 0, staged
    stats = loader.stats
    self.assertEqual((stats.started, stats.landed, stats.staged_bytes, stats.released_staged,
                      loader.in_flight()), (3, 3, 0, 1, 0))
    self.assertEqual([(t.name, t.loaded_chunks) for t in loader.tier_snapshots()],
                     [("disk", 2)])

  def gated_saves(self):
    """A loader over a store whose saver writes only once `gate` is set, and chunk 0's save
    submitted: (loader, saver, gate, a lookup of `TOKENS`, the chunk keys)."""
    store = make_store()
    device = NumpyDeviceSeam()
    saver = Saver(store, SCHEME, self.loop, device)
    self.addCleanup(saver.close)
    gate, write = threading.Event(), saver.write
    saver.write = lambda job: (gate.wait(60), write(job))
    ns = SCHEME.namespace(None)
    root, hashes = ns.root_hash(), keys.chunk_hashes(ns, TOKENS)
    saver.submit(SaveJob(root, hashes[0], root, tuple(TOKENS[:C]), kv=chunk(5)))
    lookups = PrefixLookups(store, SCHEME, self.loop, saver.pending_keys)
    loader = Loader(store, SCHEME, self.loop, device, saver, Prefetcher(store, SCHEME, self.loop))
    return loader, saver, gate, lookups, hashes

  def test_a_load_waits_for_the_save_of_its_chunk(self):
    loader, _, gate, lookups, _ = self.gated_saves()
    lookup = lookups.lookup(TOKENS, None)
    self.assertEqual(lookup.present, [SAVING, None, None])
    loader.start("r", 0, lookup, TOKENS)
    self.assertEqual(loader.landed(), [])
    gate.set()
    reports = loader.landed(wait_s=30)
    self.assertEqual([(r.index, r.ok) for r in reports], [(0, True)])
    np.testing.assert_array_equal(loader.take("r", 0).kv, chunk(5))

  def test_wait_idle_returns_once_every_load_landed_or_was_cancelled(self):
    # The client's settle_loads: a load held by its chunk's save keeps the loader busy (a
    # zero timeout says so) until the save is written; a cancel also ends the wait.
    loader, saver, gate, lookups, hashes = self.gated_saves()
    lookup = lookups.lookup(TOKENS, None)
    self.assertTrue(loader.wait_idle(0))  # nothing started
    loader.start("r", 0, lookup, TOKENS)
    self.assertFalse(loader.wait_idle(0))
    gate.set()
    self.assertTrue(loader.wait_idle(30))
    self.assertEqual([(r.index, r.ok) for r in loader.landed()], [(0, True)])
    gate.clear()
    root = SCHEME.namespace(None).root_hash()
    saver.submit(SaveJob(root, hashes[1], hashes[0], tuple(TOKENS[C:2 * C]), kv=chunk(6)))
    loader.start("s", 1, lookups.lookup(TOKENS, None), TOKENS)
    self.assertFalse(loader.wait_idle(0))
    self.assertEqual(loader.cancel("s"), 1)
    self.assertTrue(loader.wait_idle(0))
    gate.set()


class HostToDeviceTest(absltest.TestCase):

  def test_layer_groups_arrive_in_order(self):
    to_device = HostToDevice(NumpyDeviceSeam())
    self.addCleanup(to_device.close)
    chunks = [chunk(1), chunk(2)]
    moves = to_device.transfer(chunks, [(0, 1), (1, 2)])
    for t, kv in zip(moves, chunks):
      for g, (l0, l1) in enumerate(t.groups):
        np.testing.assert_array_equal(t.wait(g, timeout_s=30), kv[l0:l1])
    to_device.charge_device(123)  # no link: nothing to charge, never blocks


if __name__ == "__main__":
  absltest.main()
