"""The store client: the saver (bounded queue, drops, flush) and the load pipeline (queue,
refill as reads land, staging, release, cancel)."""

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from kvjax.connector import KVStoreClient, SaveJob
from kvjax.connector.device import DeviceSeam, decode_on_device, held_nbytes
from kvjax.models.runner.device_seam import JaxDeviceSeam
from kvjax.testing.fake_runner import NumpyDeviceSeam
from kvjax.storage.format import entropy, keys
from kvjax.storage.tiering.tiers import KVStore
from kvjax.storage.format.types import (ChunkHit, ChunkMiss, ChunkRecord, Encoding, KVLayout,
                                        MissReason)

LAYOUT = KVLayout(num_layers=2, chunk_size=4, num_kv_heads=1, head_dim=2, dtype="float32")


class EmptyStore:
  """The whole `kvjax.storage.KVStore` protocol over no chunks; fakes below override parts."""

  def __init__(self):
    self.tiers = []
    self.limiters = {}
    self.local_dirs = {}

  async def lookup(self, hashes):
    return [f[0] if f is not None else None for f in await self.peek(hashes)]

  async def peek(self, hashes):
    return [None for _ in hashes]

  async def get(self, chunk_hash, token_ids, namespace, layout, *, promote=True, choose=None,
                origin=None, layer_start=0):
    return ChunkMiss(chunk_hash, MissReason.ABSENT)

  async def put(self, chunk_hash, parent_hash, token_ids, namespace, kv=None, *, layout=None,
                payloads=(), origin=None):
    return []

  async def delete(self, chunk_hash):
    return []

  async def drain(self):
    pass

  def hint(self, upcoming):
    pass

  async def prefetch(self, chunk_hash, token_ids, namespace, layout, *, origin=None):
    return None

  def host_capacity(self):
    return None

  async def usage(self):
    return []

  async def enforce_capacity(self):
    pass

  @property
  def stats(self):
    return {}


class BlockingStore(EmptyStore):
  """Records puts; the first put waits until released."""

  def __init__(self):
    super().__init__()
    self.puts = []
    self.entered = threading.Event()
    self.release = threading.Event()

  async def put(self, chunk_hash, parent_hash, token_ids, namespace, kv=None, *, layout=None,
                payloads=(), origin=None):
    self.entered.set()
    await asyncio.get_running_loop().run_in_executor(None, self.release.wait)
    self.puts.append((chunk_hash, parent_hash, tuple(token_ids), kv.copy()))
    return ["disk"]


def job(index=0, offset=0.0, **kw):
  """A save job of chunk `index` (hash "h<index>", parent "h<index-1>" or the root)."""
  kv = np.arange(np.prod(LAYOUT.shape), dtype=np.float32).reshape(LAYOUT.shape) + offset
  return SaveJob(namespace="root", chunk_hash=f"h{index}",
                 parent=f"h{index - 1}" if index else "root",
                 token_ids=tuple(range(index * 4, index * 4 + 4)), kv=kv, **kw)


class SaverTest(absltest.TestCase):

  def test_fakes_implement_the_whole_store_protocol(self):
    for store in (EmptyStore(), BlockingStore(), GatedStore({})):
      self.assertIsInstance(store, KVStore)

  def test_full_queue_drops_and_counts_then_flush_writes_the_rest(self):
    store = BlockingStore()
    client = KVStoreClient(store, model_fingerprint="fp", layout=LAYOUT, kv_layout_version=1,
                           device=JaxDeviceSeam(), max_pending_saves=1)
    self.assertTrue(client.submit_save(job()))
    self.assertTrue(store.entered.wait(timeout=30))  # the saver holds job 1
    self.assertTrue(client.submit_save(job(offset=100.0)))  # queued
    self.assertFalse(client.submit_save(job(offset=200.0)))  # dropped, never blocks
    self.assertEqual(client.saver_stats.jobs_dropped, 1)
    store.release.set()
    client.flush()
    self.assertEqual(client.saver_stats.jobs_done, 2)
    self.assertEqual(client.saver_stats.chunks_saved, 2)
    client.close()

  def test_each_chunk_is_stored_with_its_parent_in_one_host_copy(self):
    store = BlockingStore()
    store.release.set()
    client = KVStoreClient(store, model_fingerprint="fp", layout=LAYOUT, kv_layout_version=1,
                           device=JaxDeviceSeam())
    jobs = [job(0), job(1, offset=100.0)]
    for j in jobs:
      client.submit_save(j)
    client.flush()
    self.assertEqual([p[:3] for p in store.puts],
                     [("h0", "root", (0, 1, 2, 3)), ("h1", "h0", (4, 5, 6, 7))])
    np.testing.assert_array_equal(store.puts[1][3], jobs[1].kv)
    client.close()


class GatedStore(EmptyStore):
  """Serves lookups and gets from a dict; each get waits for its own gate."""

  def __init__(self, chunks):
    super().__init__()
    self.chunks = chunks  # hash -> kv
    self.gates = {h: threading.Event() for h in chunks}

  def _record(self, chunk_hash, token_ids=(), namespace="root"):
    kv = self.chunks[chunk_hash]
    return ChunkRecord(chunk_hash, "p", tuple(token_ids), namespace, LAYOUT, (
        Encoding("raw", 1, 0, "o", kv.nbytes, "c"),))

  async def peek(self, hashes):
    return [("disk", self._record(h)) if h in self.chunks else None for h in hashes]

  async def get(self, chunk_hash, token_ids, namespace, layout, *, promote=True, choose=None,
                origin=None, layer_start=0):
    await asyncio.get_running_loop().run_in_executor(None, self.gates[chunk_hash].wait)
    record = self._record(chunk_hash, token_ids, namespace)
    return ChunkHit(record=record, encoding=record.encodings[0], kv=self.chunks[chunk_hash],
                    tier="disk")


class LoaderTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    probe = KVStoreClient(GatedStore({}), model_fingerprint="fp", layout=LAYOUT,
                          kv_layout_version=1, device=JaxDeviceSeam())
    self.prompt = list(range(13))  # 3 full chunks of 4 before the last token
    self.hashes = probe.lookup(self.prompt, None).hashes
    probe.close()
    self.kv = {h: np.full(LAYOUT.shape, i, np.float32) for i, h in enumerate(self.hashes[:3])}
    self.store = GatedStore(self.kv)
    self.client = KVStoreClient(self.store, model_fingerprint="fp", layout=LAYOUT,
                                kv_layout_version=1, device=JaxDeviceSeam())
    self.addCleanup(self.client.close)

  def test_lookup_lists_the_present_chunks_never_the_last_token(self):
    del self.store.chunks[self.hashes[1]]
    got = self.client.lookup(self.prompt, None)
    self.assertEqual(got.hits, [True, False, True])
    self.assertLen(got.hashes, 3)

  def test_loads_land_in_completion_order_and_release_staging_when_taken(self):
    lookup = self.client.lookup(self.prompt, None)
    for i in (2, 1):
      self.client.start_load("r", i, lookup, self.prompt, max_in_flight=2)
    self.assertEqual(self.client.loads_in_flight("r"), 2)
    self.store.gates[self.hashes[1]].set()
    first = self.client.landed(wait_s=30)
    self.assertEqual([(r.index, r.ok, r.tier) for r in first], [(1, True, "disk")])
    np.testing.assert_array_equal(self.client.take("r", 1).kv, self.kv[self.hashes[1]])
    self.store.gates[self.hashes[2]].set()
    self.assertEqual([r.index for r in self.client.landed(wait_s=30)], [2])
    self.assertEqual(self.client.loader_stats.staged_bytes, self.kv[self.hashes[2]].nbytes)
    self.client.release("r", 2)  # unwanted after all: its staging is freed
    stats = self.client.loader_stats
    self.assertEqual((stats.started, stats.landed, stats.in_flight, stats.staged_bytes),
                     (2, 2, 0, 0))

  def test_queued_loads_start_in_order_as_reads_land(self):
    lookup = self.client.lookup(self.prompt, None)
    for i in (2, 1, 0):
      self.client.start_load("r", i, lookup, self.prompt, max_in_flight=1)
    stats = self.client.loader_stats
    self.assertEqual((stats.in_flight, stats.queued), (1, 2))  # one read at once, two queued
    self.client.release("r", 0)  # a queued load never starts; it is reported as released
    for i in (2, 1):
      self.store.gates[self.hashes[i]].set()
    got = []
    while len(got) < 3:
      got += self.client.landed(wait_s=30)
    self.assertEqual(sorted((r.index, r.ok, r.reason) for r in got),
                     [(0, False, "released"), (1, True, ""), (2, True, "")])
    self.assertEqual(self.client.loader_stats.started, 2)
    self.assertGreater(min(r.link_s for r in got if r.ok), 0)

  def test_a_later_request_waits_for_the_queued_loads_of_one_before_it(self):
    # Both requests read the same tier: the link serves them in the order the scheduler
    # queued their loads, never splitting its bandwidth between "r" and "s" while "r" waits.
    lookup = self.client.lookup(self.prompt, None)
    for i in (2, 1):
      self.client.start_load("r", i, lookup, self.prompt, max_in_flight=1)
    self.client.start_load("s", 0, lookup, self.prompt, max_in_flight=1)
    stats = self.client.loader_stats
    self.assertEqual((stats.in_flight, stats.queued), (1, 2))  # "s" waits behind r's chunk 1
    self.store.gates[self.hashes[2]].set()
    self.assertEqual([(r.request_id, r.index) for r in self.client.landed(wait_s=30)],
                     [("r", 2)])
    stats = self.client.loader_stats  # r's chunk 1 has started: "s" starts beside it
    self.assertEqual((stats.started, stats.in_flight, stats.queued), (3, 2, 0))
    for i in (1, 0):
      self.store.gates[self.hashes[i]].set()
    got = []
    while len(got) < 2:
      got += self.client.landed(wait_s=30)
    self.assertEqual(sorted((r.request_id, r.index, r.ok) for r in got),
                     [("r", 1, True), ("s", 0, True)])

  def test_cancel_drops_queued_reading_and_staged_loads(self):
    lookup = self.client.lookup(self.prompt, None)
    for i in (2, 1, 0):
      self.client.start_load("r", i, lookup, self.prompt, max_in_flight=2)
    self.client.start_load("other", 0, lookup, self.prompt)
    self.store.gates[self.hashes[2]].set()
    self.assertEqual([r.index for r in self.client.landed(wait_s=30)], [2])
    self.assertEqual(self.client.cancel_loads("r"), 3)  # staged 2, reading 1, queued 0
    self.assertEqual(self.client.loader_stats.staged_bytes, 0)
    for g in self.store.gates.values():
      g.set()
    got = self.client.landed(wait_s=30)
    self.assertEqual([(r.request_id, r.index) for r in got], [("other", 0)])
    self.assertEqual(self.client.loads_in_flight(), 0)


  def test_the_client_keeps_each_open_requests_lookup_and_key_chain(self):
    lookup = self.client.open_request("r", self.prompt, None)
    self.assertEqual(lookup.hashes, self.hashes)
    self.assertTrue(self.client.is_open("r"))
    self.client.start_request_load("r", 1)  # its own lookup and prompt
    self.store.gates[self.hashes[1]].set()
    self.assertEqual([(r.index, r.ok) for r in self.client.landed(wait_s=30)], [(1, True)])
    np.testing.assert_array_equal(self.client.take("r", 1).kv, self.kv[self.hashes[1]])
    # Output tokens grow the chain, chained from the prompt's keys.
    seq = self.prompt + [20, 21, 22]  # 16 tokens: 4 full chunks
    self.client.extend_request_keys("r", seq, 4)
    want = self.client.extend_chunk_hashes(lookup, self.hashes, seq, 4)
    self.assertEqual(self.client.request_chunk_key("r", 0),
                     (lookup.namespace, want[0], lookup.namespace))
    self.assertEqual(self.client.request_chunk_key("r", 3), (lookup.namespace, want[3], want[2]))
    self.assertEqual(self.client.request_tail_key("r", seq, 14),
                     (lookup.namespace,) + self.client.tail_key(lookup.namespace, want, seq,
                                                                14)[1:])
    self.assertIsNone(self.client.request_tail_key("r", seq, 12))
    job = self.client.request_tail_job("r", seq, 14, "rows")  # the tail's key, tokens padded
    ns, parent, key = self.client.request_tail_key("r", seq, 14)
    self.assertEqual((job.namespace, job.parent, job.chunk_hash, job.kv), (ns, parent, key, "rows"))
    self.assertEqual(tuple(job.token_ids), tuple(keys.tail_token_ids(seq[12:14], 4)))
    with self.assertRaisesRegex(ValueError, "no tail"):
      self.client.request_tail_job("r", seq, 12, "rows")
    self.assertEqual([w.request_id for w in self.client.lookahead_requests(["x", "r"])], ["r"])
    self.client.start_request_load("r", 2)
    self.assertEqual(self.client.close_request("r"), 1)  # its load is dropped with its keys
    self.assertFalse(self.client.is_open("r"))
    with self.assertRaisesRegex(KeyError, "not open"):
      self.client.request_chunk_key("r", 0)
    self.assertEqual(self.client.close_request("r"), 0)  # idempotent
    for g in self.store.gates.values():  # the abandoned read's executor thread ends
      g.set()


class EntropyDecoderPlatformTest(absltest.TestCase):

  def test_decoder_follows_the_target_platform_not_the_host(self):
    # The runner's target (plain data) picks the rANS decoder of its device seam: the Pallas
    # kernel for a GPU or TPU target even on this CPU host (a program built for a topology), the
    # jnp reference for CPU; None: the platform being compiled for (here the CPU backend).
    host = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    for platform, want in ((None, (host, host != "cpu")), ("cpu", ("cpu", False)),
                           ("cuda", ("cuda", True)), ("tpu", ("tpu", True))):
      seam = JaxDeviceSeam(platform)
      client = KVStoreClient(EmptyStore(), model_fingerprint="fp", layout=LAYOUT,
                             kv_layout_version=1, device=seam)
      try:
        self.assertEqual((client.device.platform, client.device.use_pallas_entropy), want,
                         platform)
      finally:
        client.close()
    seam = JaxDeviceSeam("tpu", use_pallas_entropy=False)
    self.assertFalse(seam.use_pallas_entropy)  # an explicit choice wins
    with self.assertRaisesRegex(ValueError, "platform"):
      JaxDeviceSeam("metal")


class DeviceSeamTest(absltest.TestCase):

  def test_the_runners_seams_decode_the_same_codes(self):
    # The paged runner's seam (jax, on the device) and the fake's (numpy, on the host) are both
    # the connector's `DeviceSeam`, and decode one rANS-coded array to the same int16 codes; a
    # damaged stream is a CORRUPT miss through either.
    rng = np.random.default_rng(0)
    q = rng.integers(-40, 40, (2, 2, 8, 16)).astype(np.int16)
    codes = entropy.parse_components_rans(entropy.encode_components_rans(q), q.shape)
    enc = Encoding("kvtc", 5, 3, "obj", 100, "0" * 32)
    record = ChunkRecord("h", "p", (), "root", LAYOUT, (enc,))
    a = codes.arrays[-1]  # a lane state damaged past every checksum: only the decoder sees it
    states = a.states.copy()
    states[-1, 0, 0] += 1
    bad = codes._replace(arrays=codes.arrays[:-1] + (a._replace(states=states),))
    for seam in (JaxDeviceSeam("cpu"), NumpyDeviceSeam()):
      self.assertIsInstance(seam, DeviceSeam)
      got = decode_on_device(ChunkHit(record, enc, None, "disk", {"q": codes}), seam)
      np.testing.assert_array_equal(np.asarray(seam.get(got.payload["q"])), q)
      miss = decode_on_device(ChunkHit(record, enc, None, "disk", {"q": bad}), seam)
      self.assertEqual(miss.reason, MissReason.CORRUPT, type(seam).__name__)


class StagedBytesTest(absltest.TestCase):

  def test_device_decoded_arrays_count_toward_staging(self):
    # A chunk whose codes were rANS-decoded on the device holds them there (int16, several times
    # its stored bytes): the staging budget charges both; a host-only payload, its stored bytes.
    enc = Encoding("kvtc", 5, 3, "obj", 100, "0" * 32)
    on_device = ChunkHit(None, enc, None, "disk",
                         {"q": jnp.zeros((4, 8), jnp.int16), "step": np.zeros(2, np.float32)})
    on_host = ChunkHit(None, enc, None, "disk", {"q": np.zeros((4, 8), np.int16)})
    seam = JaxDeviceSeam()
    self.assertEqual(held_nbytes(on_device, seam), 100 + 4 * 8 * 2)
    self.assertEqual(held_nbytes(on_host, seam), 100)


if __name__ == "__main__":
  absltest.main()
