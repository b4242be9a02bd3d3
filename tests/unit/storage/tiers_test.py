"""Host tier, tiered lookup/get/put, promotion, fall-through, capacity eviction and configs."""

import asyncio

import numpy as np
from absl.testing import absltest, parameterized

from kvjax._typing import ChunkHash
from kvjax.storage.format import checksum
from kvjax.storage.tiering.eviction import FIFOPolicy, LRUPolicy
from kvjax.storage.backends.link import LinkLimiter
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.tiers import (DEFAULT_DISK_CAPACITY_BYTES, HostMemoryTier, KVStore,
                                         StoreConfig, Tier, TierConfig, TieredStore, build_tiers,
                                         url_kind)
from kvjax.storage.format.types import (ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                        EncodedPayload, Encoding, KVLayout, MissReason)

NS = "ns0"
C = 4
LAYOUT = KVLayout(num_layers=2, chunk_size=C, num_kv_heads=1, head_dim=2, dtype="float32")
NBYTES = LAYOUT.nbytes  # 2 * 2 * 4 * 1 * 2 * 4 = 128


def run(coro):
  return asyncio.run(coro)


def kv_of(i):
  return np.full(LAYOUT.shape, float(i), np.float32)


def toks(i):
  return tuple(range(i * C, (i + 1) * C))


def chain(n, prefix="c"):
  """Hashes and parents of an n-chunk prefix chain c0 -> c1 -> ..."""
  hs = [ChunkHash(f"{prefix}{i}") for i in range(n)]
  return hs, [ChunkHash("root")] + hs[:-1]


class FakeTier:
  """A dict-backed `Tier` that verifies like a store and can hold a corrupt copy."""

  def __init__(self, name):
    self.name = name
    self.data = {}          # hash -> (record, kv)
    self.corrupt = set()
    self.contains_calls = 0
    self.gets = []

  async def contains(self, hashes):
    self.contains_calls += 1
    return [h in self.data for h in hashes]

  async def peek(self, hashes):
    return [self.data[h][0] if h in self.data else None for h in hashes]

  async def get(self, chunk_hash, token_ids, namespace, layout, *, choose=None, origin=None,
                layer_start=0):
    self.gets.append(chunk_hash)
    if chunk_hash not in self.data:
      return ChunkMiss(chunk_hash, MissReason.ABSENT)
    rec, kv = self.data[chunk_hash]
    if rec.token_ids != tuple(token_ids):
      return ChunkMiss(chunk_hash, MissReason.TOKEN_MISMATCH)
    if chunk_hash in self.corrupt:
      return ChunkMiss(chunk_hash, MissReason.CHECKSUM_MISMATCH)
    hit = ChunkHit(rec, rec.encodings[0], kv, self.name)
    return hit.from_layer(layer_start, kv[layer_start:].nbytes) if layer_start else hit

  async def put(self, chunk_hash, parent_hash, token_ids, namespace, kv=None, *, layout=None,
                payloads=(), origin=None):
    if kv is None or payloads:
      raise NotImplementedError("FakeTier holds raw KV only")
    if chunk_hash in self.data:
      return False
    enc = Encoding("raw", 1, 0, f"data/{chunk_hash}", int(kv.nbytes),
                   checksum.digest(kv))
    rec = ChunkRecord(chunk_hash, parent_hash, tuple(token_ids), namespace,
                      KVLayout(kv.shape[0], kv.shape[2], kv.shape[3], kv.shape[4], kv.dtype.name),
                      (enc,))
    self.data[chunk_hash] = (rec, np.array(kv))
    return True

  async def delete(self, chunk_hash):
    self.corrupt.discard(chunk_hash)
    return self.data.pop(chunk_hash, None) is not None

  async def records(self):
    return [rec for rec, _ in self.data.values()]

  def snapshot(self):
    return {"chunks": len(self.data)}


class HostMemoryTierTest(parameterized.TestCase):

  def test_every_tier_and_fake_has_the_whole_protocol(self):
    for t in (HostMemoryTier(None), FakeTier("d"), ChunkStore("memory://proto")):
      self.assertIsInstance(t, Tier)
    self.assertIsInstance(TieredStore([HostMemoryTier(None), FakeTier("d")]), KVStore)

  def test_is_a_tier_and_round_trips(self):
    t = HostMemoryTier(10 * NBYTES)
    self.assertIsInstance(t, Tier)
    self.assertEqual(t.snapshot(), {"chunks": 0, "used_bytes": 0, "capacity_bytes": 10 * NBYTES,
                                    "evictions": 0, "demoting_chunks": 0})
    kv = kv_of(3)
    self.assertTrue(run(t.put("h", "root", toks(0), NS, kv)))
    kv[...] = -1  # the tier holds its own copy
    hit = run(t.get("h", list(toks(0)), NS, LAYOUT))
    self.assertIsInstance(hit, ChunkHit)
    np.testing.assert_array_equal(hit.kv, kv_of(3))
    self.assertFalse(hit.kv.flags.writeable)
    self.assertEqual(hit.tier, "host")
    self.assertEqual(hit.record.layout, LAYOUT)
    self.assertEqual(hit.encoding.checksum, checksum.digest(kv_of(3)))
    self.assertEqual(t.used_bytes, NBYTES)
    self.assertEqual(run(t.contains(["h", "x"])), [True, False])
    self.assertEqual([r.chunk_hash for r in run(t.records())], ["h"])
    self.assertFalse(run(t.put("h", "root", toks(0), NS, kv_of(3))))  # already there
    self.assertTrue(run(t.delete("h")))
    self.assertFalse(run(t.delete("h")))
    self.assertEqual(t.used_bytes, 0)

  @parameterized.named_parameters(
      ("absent", "x", toks(0), NS, LAYOUT, MissReason.ABSENT),
      ("tokens", "h", toks(1), NS, LAYOUT, MissReason.TOKEN_MISMATCH),
      ("namespace", "h", toks(0), "other", LAYOUT, MissReason.NAMESPACE_MISMATCH),
      ("layout", "h", toks(0), NS,
       KVLayout(2, C, 2, 2, "float32"), MissReason.LAYOUT_MISMATCH),
      ("dtype", "h", toks(0), NS,
       KVLayout(2, C, 1, 2, "bfloat16"), MissReason.DTYPE_MISMATCH),
  )
  def test_get_verifies_like_a_store(self, h, tokens, ns, layout, reason):
    t = HostMemoryTier(None)
    run(t.put("h", "root", toks(0), NS, kv_of(0)))
    miss = run(t.get(h, tokens, ns, layout))
    self.assertIsInstance(miss, ChunkMiss)
    self.assertEqual(miss.reason, reason)

  def test_get_checks_the_records_origin(self):
    # The stored-chunk guard on the host tier: the record's model and layout version, when both
    # the record and the reader name one (a record without one is checked by its namespace).
    mine = ChunkOrigin("model-a", 1)
    t = HostMemoryTier(None)
    run(t.put("h", "root", toks(0), NS, kv_of(0), origin=mine))
    run(t.put("old", "root", toks(1), NS, kv_of(1)))
    self.assertEqual(run(t.peek(["h", "old"]))[0].origin, mine)
    for origin, reason in ((ChunkOrigin("model-b", 1), MissReason.MODEL_MISMATCH),
                           (ChunkOrigin("model-a", 2), MissReason.LAYOUT_MISMATCH)):
      miss = run(t.get("h", toks(0), NS, LAYOUT, origin=origin))
      self.assertIsInstance(miss, ChunkMiss)
      self.assertEqual(miss.reason, reason)
    for h, tokens, origin in (("h", toks(0), mine), ("h", toks(0), None),
                              ("old", toks(1), mine)):
      self.assertIsInstance(run(t.get(h, tokens, NS, LAYOUT, origin=origin)), ChunkHit)
    # A put under another origin does not add encodings to a chunk held under this one.
    self.assertFalse(run(t.put("h", "root", toks(0), NS, layout=LAYOUT, origin=ChunkOrigin(
        "model-b", 1), payloads=[EncodedPayload("int8", 0, {
            "q": np.zeros((2, 2, C, 1, 2), np.int8),
            "scale": np.ones((2, 2, 1, 2), np.float32)})])))

  def test_put_rejects_a_bad_shape(self):
    with self.assertRaisesRegex(ValueError, "L, 2, C=4"):
      run(HostMemoryTier(None).put("h", "root", toks(0), NS, np.zeros((2, 2, 3, 1, 2))))

  def test_chunk_larger_than_capacity_is_not_stored(self):
    t = HostMemoryTier(NBYTES - 1)
    self.assertFalse(run(t.put("h", "root", toks(0), NS, kv_of(0))))
    self.assertEqual((len(t), t.used_bytes), (0, 0))

  def test_capacity_evicts_suffix_before_prefix_by_lru(self):
    t = HostMemoryTier(3 * NBYTES)
    hs, ps = chain(2)
    run(t.put(hs[0], ps[0], toks(0), NS, kv_of(0)))
    run(t.put(hs[1], ps[1], toks(1), NS, kv_of(1)))
    run(t.put("x", "root", toks(9), NS, kv_of(9)))
    run(t.get("x", toks(9), NS, LAYOUT))  # x most recent; c0 least recent but has a child
    self.assertTrue(run(t.put("y", "root", toks(8), NS, kv_of(8))))
    self.assertEqual(sorted(r.chunk_hash for r in run(t.records())), ["c0", "x", "y"])
    self.assertTrue(run(t.put("z", "root", toks(7), NS, kv_of(7))))
    self.assertEqual(sorted(r.chunk_hash for r in run(t.records())), ["x", "y", "z"])
    self.assertEqual(t.evictions, 2)
    self.assertEqual(t.used_bytes, 3 * NBYTES)

  def test_hinted_chunks_block_a_put_that_needs_their_room(self):
    t = HostMemoryTier(2 * NBYTES)
    run(t.put("a", "root", toks(0), NS, kv_of(0)))
    run(t.put("b", "root", toks(1), NS, kv_of(1)))
    t.hint([["a", "b"]])
    self.assertFalse(run(t.put("c", "root", toks(2), NS, kv_of(2))))
    self.assertEqual(sorted(r.chunk_hash for r in run(t.records())), ["a", "b"])
    t.hint([["a"]])
    self.assertTrue(run(t.put("c", "root", toks(2), NS, kv_of(2))))
    self.assertEqual(sorted(r.chunk_hash for r in run(t.records())), ["a", "c"])

  def test_fifo_policy(self):
    t = HostMemoryTier(2 * NBYTES, policy=FIFOPolicy())
    run(t.put("a", "root", toks(0), NS, kv_of(0)))
    run(t.put("b", "root", toks(1), NS, kv_of(1)))
    run(t.get("a", toks(0), NS, LAYOUT))  # recency does not matter to FIFO
    run(t.put("c", "root", toks(2), NS, kv_of(2)))
    self.assertEqual(sorted(r.chunk_hash for r in run(t.records())), ["b", "c"])

  def test_bfloat16_is_stored(self):
    import ml_dtypes  # noqa: PLC0415
    kv = np.ones(LAYOUT.shape, ml_dtypes.bfloat16)
    t = HostMemoryTier(None)
    run(t.put("h", "root", toks(0), NS, kv))
    layout = KVLayout(2, C, 1, 2, "bfloat16")
    self.assertIsInstance(run(t.get("h", toks(0), NS, layout)), ChunkHit)


def three_tiers(host_capacity=10 * NBYTES, **kwargs):
  host, disk, remote = HostMemoryTier(host_capacity), FakeTier("disk"), FakeTier("remote")
  return host, disk, remote, TieredStore([host, disk, remote], **kwargs)


async def fill(tier, hashes, parents, idx):
  for h, p, i in zip(hashes, parents, idx):
    await tier.put(h, p, toks(i), NS, kv_of(i))


class TieredStoreTest(absltest.TestCase):

  def test_lookup_reports_the_highest_tier_with_one_contains_each(self):
    host, disk, remote, store = three_tiers()
    run(fill(host, ["a"], ["root"], [0]))
    run(fill(disk, ["a", "b"], ["root", "a"], [0, 1]))
    run(fill(remote, ["b", "c"], ["a", "b"], [1, 2]))
    self.assertEqual(run(store.lookup(["a", "b", "c", "d"])), ["host", "disk", "remote", None])
    self.assertEqual((disk.contains_calls, remote.contains_calls), (1, 1))
    self.assertEqual(run(store.lookup([])), [])

  def test_peek_gives_the_highest_tier_and_its_record(self):
    host, disk, remote, store = three_tiers()
    run(fill(disk, ["a", "b"], ["root", "a"], [0, 1]))
    run(fill(remote, ["b", "c"], ["a", "b"], [1, 2]))
    got = run(store.peek(["a", "b", "c", "d"]))
    self.assertEqual(got, [("disk", disk.data["a"][0]), ("disk", disk.data["b"][0]),
                           ("remote", remote.data["c"][0]), None])
    self.assertEqual(run(store.peek([])), [])

  def test_delete_removes_from_every_tier(self):
    host, disk, remote, store = three_tiers()
    run(fill(disk, ["a"], ["root"], [0]))
    run(fill(remote, ["a", "b"], ["root", "a"], [0, 1]))
    run(store.get("a", toks(0), NS, LAYOUT))  # promoted into host
    self.assertEqual(run(store.delete("a")), ["host", "disk", "remote"])
    self.assertEqual(run(store.lookup(["a", "b"])), [None, "remote"])
    self.assertEqual(run(store.delete("a")), [])

  def test_lower_hit_is_promoted_into_host(self):
    host, disk, remote, store = three_tiers()
    run(fill(remote, ["c"], ["root"], [5]))
    hit = run(store.get("c", toks(5), NS, LAYOUT))
    self.assertEqual(hit.tier, "remote")
    np.testing.assert_array_equal(hit.kv, kv_of(5))
    self.assertEqual(run(store.lookup(["c"])), ["host"])
    again = run(store.get("c", toks(5), NS, LAYOUT))
    self.assertEqual(again.tier, "host")
    self.assertEqual(again.record.encodings[0].checksum, hit.encoding.checksum)
    stats = store.stats
    self.assertEqual(stats["host"].promotions, 1)
    self.assertEqual(stats["host"].hits, 1)
    self.assertEqual(stats["remote"].hits, 1)
    self.assertEqual(stats["host"].misses, {"absent": 1})
    self.assertEqual(stats["disk"].misses, {"absent": 1})

  def test_prefetch_copies_a_lower_chunk_up_once(self):
    host, _, remote, store = three_tiers()
    run(fill(remote, ["c"], ["root"], [5]))
    self.assertEqual(store.host_capacity(), ("host", host.capacity_bytes))
    self.assertEqual(run(store.prefetch("c", toks(5), NS, LAYOUT)), "remote")
    self.assertEqual(run(store.lookup(["c"])), ["host"])
    self.assertIsNone(run(store.prefetch("c", toks(5), NS, LAYOUT)))  # already in host
    self.assertIsNone(run(store.prefetch("x", toks(5), NS, LAYOUT)))  # nowhere
    self.assertIsNone(run(store.prefetch("c", toks(6), NS, LAYOUT)))  # host copy: not read
    self.assertEqual(store.stats["host"].promotions, 1)

  def test_prefetch_is_declined_when_only_hinted_chunks_could_make_room(self):
    host, disk, _, store = three_tiers(host_capacity=NBYTES)
    run(store.put("a", "root", toks(1), NS, kv_of(1)))
    store.hint([["a"]])
    run(fill(disk, ["c"], ["root"], [5]))
    self.assertIsNone(run(store.prefetch("c", toks(5), NS, LAYOUT)))
    self.assertEqual(run(host.contains(["a", "c"])), [True, False])

  def test_no_promotion_when_asked_not_to(self):
    host, _, remote, store = three_tiers()
    run(fill(remote, ["c"], ["root"], [5]))
    self.assertEqual(run(store.get("c", toks(5), NS, LAYOUT, promote=False)).tier, "remote")
    self.assertEqual(len(host), 0)

  def test_corrupt_upper_copy_falls_through_and_is_replaced(self):
    host, disk, remote, store = three_tiers()
    run(fill(disk, ["c"], ["root"], [5]))
    run(fill(remote, ["c"], ["root"], [5]))
    disk.corrupt.add("c")
    hit = run(store.get("c", toks(5), NS, LAYOUT))
    self.assertEqual(hit.tier, "remote")
    self.assertNotIn("c", disk.data)  # the bad copy was dropped
    stats = store.stats
    self.assertEqual(stats["disk"].misses, {"checksum_mismatch": 1})
    self.assertEqual(stats["disk"].dropped, 1)
    self.assertEqual(stats["host"].promotions, 1)

  def test_all_miss_reports_the_informative_reason(self):
    _, disk, _, store = three_tiers()
    run(fill(disk, ["c"], ["root"], [5]))
    miss = run(store.get("c", toks(6), NS, LAYOUT))
    self.assertEqual(miss.reason, MissReason.TOKEN_MISMATCH)
    self.assertIn("c", disk.data)  # another request's chunk is not a bad copy
    self.assertEqual(run(store.get("zz", toks(0), NS, LAYOUT)).reason, MissReason.ABSENT)

  def test_a_raising_tier_is_a_read_error_and_the_next_tier_serves(self):
    host, disk, remote, store = three_tiers()

    async def boom(*args):
      raise OSError("unreachable")
    disk.get = boom
    disk.contains = boom
    run(fill(remote, ["c"], ["root"], [5]))
    self.assertEqual(run(store.lookup(["c"])), ["remote"])
    self.assertEqual(run(store.get("c", toks(5), NS, LAYOUT)).tier, "remote")
    self.assertEqual(store.stats["disk"].misses, {"read_error": 1})

  def test_put_writes_through_host_and_first_persistent_tier(self):
    host, disk, remote, store = three_tiers()
    self.assertEqual(run(store.put("a", "root", toks(0), NS, kv_of(0))), ["host", "disk"])
    self.assertEqual(run(store.lookup(["a"])), ["host"])
    self.assertNotIn("a", remote.data)
    self.assertEqual(run(store.put("a", "root", toks(0), NS, kv_of(0))), [])
    _, _, remote2, store2 = three_tiers(write_all_persistent=True)
    self.assertEqual(run(store2.put("a", "root", toks(0), NS, kv_of(0))),
                     ["host", "disk", "remote"])

  def test_a_failing_persistent_put_is_counted_not_raised(self):
    host, disk, _, store = three_tiers()

    async def boom(*args):
      raise OSError("disk full")
    disk.put = boom
    self.assertEqual(run(store.put("a", "root", toks(0), NS, kv_of(0))), ["host"])
    self.assertEqual(store.stats["disk"].put_errors, 1)

  def test_disk_capacity_evicts_suffix_first_and_respects_hints(self):
    disk = FakeTier("disk")
    store = TieredStore([disk], capacities=[4 * NBYTES])
    hs, ps = chain(3)

    async def scenario():
      for i in range(3):
        await store.put(hs[i], ps[i], toks(i), NS, kv_of(i))
      await store.put("x", "root", toks(9), NS, kv_of(9))          # full: c0 c1 c2 x
      await store.get("c0", toks(0), NS, LAYOUT)                    # c0 recent, but a prefix
      await store.put("y", "root", toks(8), NS, kv_of(8))          # evicts c2 (deepest leaf)
      snap1 = sorted(disk.data)
      store.hint([["c0", "c1"]])
      await store.put("z", "root", toks(7), NS, kv_of(7))          # c1 hinted: evicts x
      snap2 = sorted(disk.data)
      store.hint([])
      await store.put("w", "root", toks(6), NS, kv_of(6))          # c1 is the oldest leaf
      return snap1, snap2, sorted(disk.data)

    snap1, snap2, snap3 = run(scenario())
    self.assertEqual(snap1, ["c0", "c1", "x", "y"])
    self.assertEqual(snap2, ["c0", "c1", "y", "z"])
    self.assertEqual(snap3, ["c0", "w", "y", "z"])
    self.assertEqual(store.stats["disk"].evictions, 3)

  def test_disk_capacity_counts_chunks_already_on_disk(self):
    disk = FakeTier("disk")
    run(fill(disk, ["old1", "old2", "old3"], ["root"] * 3, [1, 2, 3]))
    store = TieredStore([disk], capacities=[3 * NBYTES], policies=[LRUPolicy()])
    run(store.put("new", "root", toks(0), NS, kv_of(0)))
    self.assertEqual(sorted(disk.data), ["new", "old2", "old3"])  # unknown recency: by hash
    self.assertEqual(store.stats["disk"].evictions, 1)

  def test_enforce_capacity_rescans(self):
    disk = FakeTier("disk")
    store = TieredStore([disk], capacities=[2 * NBYTES])
    run(store.put("a", "root", toks(0), NS, kv_of(0)))
    run(fill(disk, ["b", "c"], ["root", "root"], [1, 2]))  # another writer
    run(store.enforce_capacity())
    self.assertLen(disk.data, 2)
    self.assertIn("a", disk.data)  # ours was touched; b and c are of unknown recency

  def test_hint_reaches_host_policy(self):
    host, _, _, store = three_tiers(host_capacity=NBYTES)
    store.hint([["a"]])
    self.assertEqual(host.policy.hinted, {"a"})

  def test_construction_errors(self):
    host = HostMemoryTier(NBYTES)
    with self.assertRaisesRegex(ValueError, "at least one"):
      TieredStore([])
    with self.assertRaisesRegex(ValueError, "distinct"):
      TieredStore([FakeTier("d"), FakeTier("d")])
    with self.assertRaisesRegex(ValueError, "own policy"):
      TieredStore([host, FakeTier("d")], capacities=[NBYTES, None])
    with self.assertRaisesRegex(ValueError, "2 tiers but 1"):
      TieredStore([host, FakeTier("d")], policies=[None])
    with self.assertRaisesRegex(TypeError, "Tier interface"):
      TieredStore([object()])


class ConfigTest(parameterized.TestCase):

  @parameterized.parameters(
      ("memory://", "disk"), ("memory://x", "disk"), ("file:///tmp/kv", "disk"),
      ("/tmp/kv", "disk"), ("", "disk"), ("ocdbt+file:///tmp/kv", "disk"),
      ("s3://bucket/prefix", "remote"))
  def test_from_url(self, url, kind):
    cfg = StoreConfig.from_url(url)
    self.assertEqual(cfg.tiers, (TierConfig(kind, url=url),))
    self.assertEqual(url_kind(url), kind)

  def test_from_url_with_host_on_top(self):
    cfg = StoreConfig.from_url("memory://", host_capacity_bytes=1 << 30, link_bytes_per_s=1e6)
    self.assertEqual([t.kind for t in cfg.tiers], ["host", "disk"])
    self.assertEqual(cfg.tier_names, ("host", "disk"))
    self.assertEqual(cfg.tiers[1].link_bytes_per_s, 1e6)

  def test_default_capacities(self):
    self.assertEqual(TierConfig("disk", url="memory://").effective_capacity_bytes,
                     DEFAULT_DISK_CAPACITY_BYTES)
    self.assertEqual(DEFAULT_DISK_CAPACITY_BYTES, 20 * 2**30)
    self.assertIsNone(TierConfig("remote", url="s3://b").effective_capacity_bytes)

  def test_names_number_repeated_kinds(self):
    cfg = StoreConfig((TierConfig("disk", url="memory://a"), TierConfig("disk", url="memory://b"),
                       TierConfig("remote", url="s3://b", name="far")))
    self.assertEqual(cfg.tier_names, ("disk1", "disk2", "far"))

  @parameterized.named_parameters(
      ("bad_kind", dict(kind="tape", url="memory://"), "kind"),
      ("host_url", dict(kind="host", url="memory://", capacity_bytes=1), "no url"),
      ("host_no_capacity", dict(kind="host"), "needs capacity_bytes"),
      ("host_link", dict(kind="host", capacity_bytes=1, link_bytes_per_s=5.0), "not link"),
      ("disk_no_url", dict(kind="disk"), "needs a url"),
      ("bad_scheme", dict(kind="remote", url="ftp://x"), "unknown store URL scheme 'ftp'"),
      ("zero_capacity", dict(kind="disk", url="memory://", capacity_bytes=0), "positive"),
      ("zero_link", dict(kind="disk", url="memory://", link_bytes_per_s=0.0), "positive"),
      ("link_both", dict(kind="disk", url="memory://", link_bytes_per_s=1.0, link_trace="t"),
       "not both"),
  )
  def test_tier_config_errors(self, kwargs, pattern):
    with self.assertRaisesRegex(ValueError, pattern):
      TierConfig(**kwargs)

  def test_store_config_errors(self):
    host = TierConfig("host", capacity_bytes=1)
    disk = TierConfig("disk", url="memory://")
    named = TierConfig("remote", url="s3://b", name="disk")
    for tiers, pattern in [((), "at least one"), ((disk, host), "must be the first"),
                           ((host, host, disk), "at most one host"), ((host,), "below the host"),
                           ((disk, named), "distinct")]:
      with self.subTest(pattern=pattern), self.assertRaisesRegex(ValueError, pattern):
        StoreConfig(tiers)


class BuildTiersTest(absltest.TestCase):

  def test_builds_tiers_with_one_limiter_each(self):
    trace = self.create_tempfile(content="0 1000\n5 2000\n").full_path
    cfg = StoreConfig((TierConfig("host", capacity_bytes=4 * NBYTES),
                       TierConfig("disk", url="memory://d", link_bytes_per_s=5e8),
                       TierConfig("remote", url="s3://b/p", link_trace=trace,
                                  capacity_bytes=10 * NBYTES)))
    made = []

    def make(url, name, limiter):
      made.append((url, name, limiter))
      return FakeTier(name)

    store = build_tiers(cfg, make_chunk_store=make, host_policy=FIFOPolicy())
    self.assertEqual([t.name for t in store.tiers], ["host", "disk", "remote"])
    self.assertIsInstance(store.host, HostMemoryTier)
    self.assertEqual(store.host.capacity_bytes, 4 * NBYTES)
    self.assertIsInstance(store.host.policy, FIFOPolicy)
    self.assertEqual([(u, n) for u, n, _ in made], [("memory://d", "disk"), ("s3://b/p", "remote")])
    self.assertIs(made[0][2], store.limiters["disk"])
    self.assertEqual(store.limiters["disk"].current_rate(), 5e8)
    self.assertEqual(store.limiters["remote"].trace, ((0.0, 1000.0), (5.0, 2000.0)))
    self.assertEqual(store.planner.stats().capacity_bytes["disk"], DEFAULT_DISK_CAPACITY_BYTES)
    self.assertEqual(store.planner.stats().capacity_bytes["remote"], 10 * NBYTES)
    self.assertEqual(run(store.put("a", "root", toks(0), NS, kv_of(0))), ["host", "disk"])

  def test_unlimited_link_when_unset(self):
    cfg = StoreConfig.from_url("memory://")
    store = build_tiers(cfg, make_chunk_store=lambda u, n, lim: FakeTier(n))
    self.assertIsInstance(store.limiters["disk"], LinkLimiter)
    self.assertTrue(store.limiters["disk"].unlimited)
    self.assertIsNone(store.host)

  def test_bad_trace_file(self):
    trace = self.create_tempfile(content="0 1000\noops\n").full_path
    cfg = StoreConfig((TierConfig("disk", url="memory://", link_trace=trace),))
    with self.assertRaisesRegex(ValueError, ":2: bad trace line"):
      build_tiers(cfg, make_chunk_store=lambda u, n, lim: FakeTier(n))


if __name__ == "__main__":
  absltest.main()
