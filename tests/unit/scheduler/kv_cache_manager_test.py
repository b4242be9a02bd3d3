"""Exact traces of the device block pool, its prefix cache, and block keys against store keys."""

import random

from absl.testing import absltest, parameterized

from kvjax import block_hash as bh
from kvjax.scheduler.block_pool import (AllBlocksClearedEvent, BlockPool, BlockRemovedEvent,
                                        BlockStoredEvent)
from kvjax.scheduler.kv_cache_manager import KVCacheManager, KVCacheStats
from kvjax.scheduler.request import Request, SamplingParams
from kvjax.storage.format import keys


def ns(salt=None, chunk_size=8):
  return keys.KeyNamespace("f" * 64, "float32", 1, chunk_size, salt)


ROOT = ns().root_hash()


def req(rid, tokens, outputs=()):
  r = Request(rid, list(tokens), SamplingParams(max_tokens=64))
  r.output_token_ids = list(outputs)
  return r


def h(i):
  """A stand-in chained hash for pool-level tests."""
  return bh.BlockHash(f"h{i}")


class BlockHashTest(parameterized.TestCase):

  def test_block_hash_is_the_store_chunk_hash_function(self):
    rng = random.Random(0)
    for n in (0, 1, 4, 17):
      toks = [rng.randrange(-2**63, 2**63) for _ in range(n)]
      for extras in ((), ("img", b"\x00", 7), ("",)):
        self.assertEqual(bh.hash_block_tokens(ROOT, toks, extras),
                         keys.hash_chunk(ROOT, toks, extras))

  def test_block_keys_at_the_chunk_size_are_the_store_chunk_keys(self):
    toks = list(range(1000, 1029))
    self.assertEqual(bh.block_hashes(ROOT, toks, 8), keys.chunk_hashes(ns(), toks))
    self.assertLen(bh.block_hashes(ROOT, toks, 8), 3)  # the 5-token tail has no key
    self.assertEqual(bh.block_hashes(ROOT, toks, 4, max_tokens=11), bh.block_hashes(
        ROOT, toks[:8], 4))

  @parameterized.parameters((4, 8), (2, 8), (8, 8), (16, 256))
  def test_block_and_chunk_keys_name_the_same_prefixes(self, block_size, chunk_size):
    r = bh.blocks_per_chunk(block_size, chunk_size)
    rng = random.Random(block_size)
    base = [rng.randrange(50) for _ in range(5 * chunk_size)]
    for common in sorted({0, 1, block_size - 1, block_size, chunk_size - 1, chunk_size,
                          chunk_size + 1, 3 * chunk_size + 1, 5 * chunk_size}):
      other = base[:common] + [t + 100 for t in base[common:]]
      b1, b2 = bh.block_hashes(ROOT, base, block_size), bh.block_hashes(ROOT, other, block_size)
      c1, c2 = keys.chunk_hashes(ns(chunk_size=chunk_size), base), keys.chunk_hashes(
          ns(chunk_size=chunk_size), other)
      same_blocks = [x == y for x, y in zip(b1, b2)]
      same_chunks = [x == y for x, y in zip(c1, c2)]
      self.assertEqual(sum(same_blocks), common // block_size)
      self.assertEqual(sum(same_chunks), common // chunk_size)
      for j in range(len(c1)):
        blocks = bh.blocks_of_chunk(j, block_size, chunk_size)
        self.assertEqual(blocks, range(j * r, (j + 1) * r))
        self.assertEqual([bh.chunk_of_block(i, block_size, chunk_size) for i in blocks], [j] * r)
        self.assertEqual(same_chunks[j], same_blocks[blocks[-1]])
      # A device hit of the common full blocks makes exactly the common full chunks resident.
      self.assertEqual(bh.full_chunks_in_blocks(common // block_size, block_size, chunk_size),
                       common // chunk_size)

  def test_salt_and_namespace_change_every_block_key(self):
    toks = list(range(12))
    roots = [ns().root_hash(), ns("").root_hash(), ns("tenant").root_hash(),
             keys.KeyNamespace("e" * 64, "float32", 1, 8).root_hash()]
    chains = [bh.block_hashes(r, toks, 4) for r in roots]
    for i in range(3):
      self.assertLen({c[i] for c in chains}, 4)

  def test_the_last_token_rule(self):
    # A hit never covers the last prompt token: floor((n - 1) / unit) whole units.
    got = [bh.loadable_units(n, 4) for n in (0, 1, 4, 5, 8, 9, 12, 13)]
    self.assertEqual(got, [0, 0, 0, 1, 1, 2, 2, 3])
    self.assertEqual(bh.loadable_units(256, 256), 0)
    self.assertEqual(bh.loadable_units(257, 256), 1)

  def test_a_chunk_is_whole_blocks(self):
    self.assertEqual(bh.blocks_per_chunk(16, 64), 4)
    with self.assertRaisesRegex(ValueError,
                                "kv_chunk_size=24 must be a whole number of blocks of "
                                "block_size=16"):
      bh.blocks_per_chunk(16, 24)

  def test_bad_sizes_raise(self):
    for b, c in ((3, 8), (0, 8), (8, 4), (True, 8)):
      with self.assertRaisesRegex(ValueError, "block_size|chunk_size|multiple"):
        bh.blocks_per_chunk(b, c)
    with self.assertRaisesRegex(ValueError, "block_size"):
      bh.block_hashes(ROOT, [1, 2], 0)
    with self.assertRaisesRegex(ValueError, "int64"):
      bh.hash_block_tokens(ROOT, [2**63])
    with self.assertRaises(TypeError):
      bh.hash_block_tokens(ROOT, [1], (True,))


class BlockPoolTest(absltest.TestCase):

  def test_allocation_trace(self):
    pool = BlockPool(6, 4)
    self.assertEqual(pool.allocate(2), [0, 1])
    self.assertEqual(pool.allocate(3), [2, 3, 4])
    pool.free([1, 0])
    self.assertEqual((pool.num_free, pool.usage), (3, 0.5))
    self.assertEqual(pool.allocate(2), [5, 1])  # oldest free first: 5 was never used, then 1
    self.assertEqual(pool.allocate(0), [])
    with self.assertRaisesRegex(ValueError, "cannot allocate 2 blocks: only 1 free"):
      pool.allocate(2)
    self.assertEqual(pool.allocate(1), [0])
    self.assertEqual(pool.usage, 1.0)
    pool.verify()

  def test_peak_used_blocks_counts_held_blocks_not_cached_ones(self):
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    pool.cache_block(a[0], h(0), "root")
    self.assertEqual(pool.peak_used_blocks, 3)
    pool.free(a)  # a[0] stays cached at ref 0: free, not in use
    self.assertEqual(pool.allocate(2), [3, 4])
    self.assertEqual(pool.peak_used_blocks, 3)
    pool.touch([a[0]])  # a hit revives the cached block: 3 held again, then 4
    self.assertEqual(pool.peak_used_blocks, 3)
    pool.allocate(1)
    self.assertEqual(pool.peak_used_blocks, 4)

  def test_null_block_is_never_handed_out(self):
    pool = BlockPool(4, 16, reserve_null_block=True)
    self.assertEqual((pool.null_block, pool.num_usable_blocks), (0, 3))
    self.assertEqual(pool.allocate(3), [1, 2, 3])
    with self.assertRaisesRegex(ValueError, "not a usable block id"):
      pool.free([0])
    with self.assertRaisesRegex(ValueError, "no usable block"):
      BlockPool(1, 16, reserve_null_block=True)

  def test_cached_blocks_stay_until_the_pool_needs_room(self):
    pool = BlockPool(4, 4)
    a = pool.allocate(3)
    self.assertTrue(pool.cache_block(a[0], h(0), "root"))
    self.assertTrue(pool.cache_block(a[1], h(1), h(0)))
    pool.free(a)
    self.assertEqual((pool.num_free, pool.num_cached, pool.num_evictable, pool.usage),
                     (4, 2, 2, 0.0))
    self.assertEqual(pool.allocate(2), [3, 2])  # uncached free blocks go first
    self.assertEqual(pool.lookup(h(0)), 0)
    self.assertEqual(pool.allocate(1), [1])  # then the leaf h1
    self.assertEqual((pool.lookup(h(1)), pool.num_evictions, pool.block_hash(1)), (None, 1, None))
    pool.verify()

  def test_eviction_takes_leaves_first_then_least_recently_released(self):
    pool = BlockPool(5, 4)
    a = pool.allocate(3)  # one chain a0 <- a1 <- a2
    b = pool.allocate(2)  # another chain b0 <- b1
    for i, blk in enumerate(a):
      pool.cache_block(blk, h(i), h(i - 1) if i else "root")
    pool.cache_block(b[0], h(10), "root")
    pool.cache_block(b[1], h(11), h(10))
    pool.free(a)  # root first: pure LRU would evict a0, the parent of two cached blocks
    pool.free(b)
    self.assertEqual([pool.allocate(1)[0] for _ in range(5)], [2, 1, 0, 4, 3])
    self.assertEqual(pool.num_evictions, 5)
    pool.verify()

  def test_a_branching_prefix_outlives_both_branches(self):
    pool = BlockPool(3, 4)
    p, c, d = pool.allocate(3)
    pool.cache_block(p, h(0), "root")
    pool.cache_block(c, h(1), h(0))
    pool.cache_block(d, h(2), h(0))
    pool.free([p])  # released first, but both its children are cached
    pool.free([d])
    pool.free([c])
    self.assertEqual(pool.allocate(3), [d, c, p])
    pool.verify()

  def test_touch_revives_an_evictable_block(self):
    pool = BlockPool(2, 4)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(0), "root")
    pool.free([a, b])
    pool.touch([a])
    self.assertEqual((pool.ref_count(a), pool.num_free, pool.num_evictable), (1, 1, 0))
    with self.assertRaisesRegex(ValueError, "free and uncached"):
      pool.touch([b])
    pool.touch([a])
    self.assertTrue(pool.is_shared(a))
    pool.free([a, a])
    self.assertEqual(pool.allocate(2), [b, a])
    pool.verify()

  def test_an_evictable_parent_of_a_block_in_use_is_evicted_when_nothing_else_is_left(self):
    # Two requests computed the same first block; the second's copy stayed unindexed and its
    # next block is indexed under the first's hash. The first's block is then a ref-0 non-leaf.
    pool = BlockPool(3, 4)
    x, y, z = pool.allocate(3)
    pool.cache_block(x, h(0), "root")
    self.assertFalse(pool.cache_block(y, h(0), "root"))  # y: same prefix, stays plain
    pool.cache_block(z, h(1), h(0))
    pool.free([x])
    self.assertEqual(pool.allocate(1), [x])
    self.assertEqual((pool.lookup(h(0)), pool.lookup(h(1))), (None, z))
    pool.free([z, y, x])
    self.assertEqual(pool.allocate(3), [y, x, z])
    pool.verify()

  def test_a_leaf_that_gains_a_child_waits_for_it(self):
    pool = BlockPool(4, 4)
    x, y, z, w = pool.allocate(4)
    pool.cache_block(x, h(0), "root")
    pool.free([x])  # an evictable leaf, released first
    self.assertFalse(pool.cache_block(y, h(0), "root"))
    pool.cache_block(z, h(1), h(0))  # now x has a cached child (z, in use)
    pool.cache_block(w, h(5), "root")
    pool.free([w])  # a leaf released after x
    self.assertEqual(pool.allocate(1), [w])
    pool.free([z])
    self.assertEqual(pool.allocate(2), [z, x])  # z is a leaf again, then x
    pool.verify()

  def test_repeated_hits_keep_the_lru_order_and_a_bounded_heap(self):
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3)
    for i, blk in enumerate((a, b, c)):
      pool.cache_block(blk, h(i), "root")
    pool.free([a, b, c])
    for i in range(300):  # every hit and release leaves a stale heap entry behind
      blk = (a, b, c)[i % 3] if i < 299 else a
      pool.touch([blk])
      pool.free([blk])
    self.assertLessEqual(len(pool._leaf_heap), 4 * 3 + 64 + 1)
    self.assertEqual(pool.allocate(3), [c, b, a])  # a was hit last
    pool.verify()

  def test_bad_calls_raise(self):
    pool = BlockPool(2, 4)
    (a,) = pool.allocate(1)
    with self.assertRaisesRegex(ValueError, "freed more often"):
      pool.free([1])
    with self.assertRaisesRegex(ValueError, "not a usable block id"):
      pool.ref_count(2)
    with self.assertRaisesRegex(ValueError, "not in use"):
      pool.cache_block(1, h(0), "root")
    pool.cache_block(a, h(0), "root")
    with self.assertRaisesRegex(ValueError, "already cached"):
      pool.cache_block(a, h(1), "root")
    for bad in ((0, 4), (4, 0), (2.0, 4)):
      with self.assertRaisesRegex(ValueError, "positive int"):
        BlockPool(*bad)
    with self.assertRaisesRegex(ValueError, "n must be"):
      pool.allocate(-1)

  def test_reset_prefix_cache(self):
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, h(0), "root")
    pool.cache_block(b, h(1), h(0))
    pool.free([b, a])
    self.assertEqual(pool.reset_prefix_cache(), 2)
    self.assertEqual((pool.num_cached, pool.num_evictable, pool.num_free), (0, 0, 2))
    self.assertEqual(pool.allocate(2), [b, a])
    self.assertEqual(pool.num_evictions, 0)
    pool.verify()


def run(mgr, r, n, *, computed, hits=()):
  """Allocates, 'writes' n tokens, indexes the full blocks; returns the new blocks."""
  new = mgr.allocate_slots(r.request_id, n, num_computed_tokens=computed, new_computed_blocks=hits)
  if new is not None:
    mgr.cache_full_blocks(r, computed + len(hits) * mgr.block_size + n)
  return new


class KVCacheManagerTest(parameterized.TestCase):

  def test_prefix_sharing_trace_and_ref_counts(self):
    mgr = KVCacheManager(6, 4, namespace_root=ROOT)
    a = req("a", range(10))
    self.assertEqual(mgr.get_computed_blocks(a), ([], 0))
    self.assertEqual(mgr.allocate_slots("a", 10, num_computed_tokens=0), [0, 1, 2])
    self.assertEqual(mgr.cache_full_blocks(a, 10), [0, 1])  # block 2 holds 2 tokens
    b = req("b", list(range(8)) + [50, 51, 52])
    hits, n = mgr.get_computed_blocks(b)
    self.assertEqual((hits, n), ([0, 1], 8))
    self.assertEqual(mgr.allocate_slots("b", 3, num_computed_tokens=0, new_computed_blocks=hits),
                     [3])
    self.assertEqual(mgr.block_table("b"), (0, 1, 3))
    self.assertEqual([mgr.pool.ref_count(i) for i in range(6)], [2, 2, 1, 1, 0, 0])
    self.assertEqual([mgr.is_shared(i) for i in range(4)], [True, True, False, False])
    self.assertEqual(mgr.free("a"), 3)
    self.assertEqual([mgr.pool.ref_count(i) for i in range(4)], [1, 1, 0, 1])
    self.assertEqual(mgr.free("b"), 3)
    self.assertEqual(mgr.stats(), KVCacheStats(
        num_blocks=6, num_free_blocks=6, num_cached_blocks=2, usage=0.0, queries=2,
        query_tokens=21, hits=1, hit_tokens=8, evictions=0, preemptions=0,
        peak_used_blocks=4, block_size=4))  # a: 3 blocks, b: one new one, the shared two once
    self.assertAlmostEqual(mgr.stats().hit_rate, 8 / 21)
    # Uncached blocks are reused first; the cached prefix survives.
    c = req("c", range(100, 116))
    self.assertEqual(mgr.get_computed_blocks(c), ([], 0))
    self.assertEqual(mgr.allocate_slots("c", 16, num_computed_tokens=0), [4, 5, 2, 3])
    self.assertEqual(mgr.get_computed_blocks(req("d", range(9))), ([0, 1], 8))
    mgr.pool.verify()

  def test_a_finished_requests_partial_last_block_is_taken_over_by_the_next_turn(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    a = req("a", range(10))  # blocks [0 1 2 3][4 5 6 7][8 9 . .]
    mgr.get_computed_blocks(a)
    self.assertEqual(mgr.allocate_slots("a", 10, num_computed_tokens=0), [0, 1, 2])
    a.num_computed_tokens = 10
    mgr.cache_full_blocks(a, 10)
    self.assertEqual(mgr.free("a", a), 3)
    self.assertEqual((mgr.pool.num_parked, mgr.pool.num_free, mgr.pool.is_parked(2)),
                     (1, 8, True))
    # The next turn extends a: full blocks 0, 1 and the parked block's two tokens hit.
    b = req("b", list(range(10)) + [60, 61, 62])
    hits, n = mgr.get_computed_blocks(b)
    self.assertEqual((hits, n), ([0, 1, 2], 10))
    self.assertEqual(mgr.allocate_slots("b", 3, num_computed_tokens=0, new_computed_blocks=hits),
                     [3])
    self.assertEqual(mgr.block_table("b"), (0, 1, 2, 3))
    self.assertEqual([mgr.pool.ref_count(i) for i in range(4)], [1, 1, 1, 1])
    self.assertFalse(mgr.pool.is_parked(2))  # taken over: nobody else can take it
    self.assertEqual(mgr.get_computed_blocks(req("c", list(range(10)) + [70])), ([0, 1], 8))
    b.num_computed_tokens = 13
    self.assertEqual(mgr.cache_full_blocks(b, 13), [2])  # full now: indexed like any block
    mgr.pool.verify()

  @parameterized.parameters(
      (list(range(10)) + [60], [0, 1, 2], 10),  # the parked tokens, then one more to compute
      (list(range(10)), [0, 1, 2], 9),  # never the last token
      (list(range(9)) + [99, 5], [0, 1, 2], 9),  # the hit ends at the first differing token
      (list(range(8)) + [99, 5, 6], [0, 1], 8))
  def test_partial_hits_end_at_the_first_differing_token(self, tokens, want_blocks, want_n):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    a = req("a", range(10))
    mgr.get_computed_blocks(a)
    mgr.allocate_slots("a", 10, num_computed_tokens=0)
    a.num_computed_tokens = 10
    mgr.cache_full_blocks(a, 10)
    mgr.free("a", a)
    hits, n = mgr.get_computed_blocks(req("b", tokens))
    self.assertEqual((hits, n), (want_blocks, want_n))

  def test_parking_rules(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    for rid, n, done in (("full", 8, 8), ("unfinished", 10, 6), ("aborted", 10, 10)):
      r = req(rid, range(100, 110))
      mgr.get_computed_blocks(r)
      mgr.allocate_slots(rid, n, num_computed_tokens=0)
      r.num_computed_tokens = done
      mgr.cache_full_blocks(r, min(done, 8))
      mgr.free(rid, r if rid != "aborted" else None)
    # A block-aligned end parks nothing; an unfinished prefill (6 of 10) parks nothing; a free
    # without the request (an error) parks nothing.
    self.assertEqual(mgr.pool.num_parked, 0)
    # A second turn parked under the same parent replaces the first's block.
    for rid, tail in (("t1", [1]), ("t2", [2, 3])):
      r = req(rid, list(range(100, 104)) + tail)
      hits, n = mgr.get_computed_blocks(r)
      mgr.allocate_slots(rid, len(r.prompt_token_ids) - n, num_computed_tokens=0,
                         new_computed_blocks=hits)
      r.num_computed_tokens = len(r.prompt_token_ids)
      mgr.free(rid, r)
    self.assertEqual(mgr.pool.num_parked, 1)
    self.assertEqual(mgr.get_computed_blocks(req("u", list(range(100, 104)) + [2, 3, 4]))[1], 6)
    self.assertEqual(mgr.get_computed_blocks(req("v", list(range(100, 104)) + [1, 9]))[1], 4)
    self.assertEqual(mgr.reset_prefix_cache(), 2)
    self.assertEqual((mgr.pool.num_parked, mgr.pool.num_free), (0, 8))
    mgr.pool.verify()

  @parameterized.parameters((1, 0), (3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12),
                            (14, 12), (17, 12))
  def test_hits_never_cover_the_last_token(self, prompt_len, want_hit_tokens):
    mgr = KVCacheManager(16, 4, namespace_root=ROOT)
    warm = req("warm", range(14))
    run(mgr, warm, 14, computed=0)  # indexes blocks [0:4) [4:8) [8:12)
    mgr.free("warm")
    r = req("r", list(range(14))[:prompt_len] + [99] * max(0, prompt_len - 14))
    hits, n = mgr.get_computed_blocks(r)
    self.assertEqual((hits, n), (list(range(want_hit_tokens // 4)), want_hit_tokens))
    new = mgr.allocate_slots("r", prompt_len - n, num_computed_tokens=0, new_computed_blocks=hits)
    self.assertLen(mgr.block_table("r"), -(-prompt_len // 4))
    self.assertEqual(tuple(new), mgr.block_table("r")[len(hits):])

  def test_generated_tokens_are_cached_and_hit(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    a = req("a", range(3))
    self.assertEqual(run(mgr, a, 3, computed=0), [0])
    computed, grown = 3, []
    for t in range(6):  # decode: the sampled token's KV is written the step after
      a.output_token_ids.append(100 + t)
      new = run(mgr, a, 1, computed=computed)
      computed += 1
      grown.append(new)
    self.assertEqual(grown, [[], [1], [], [], [], [2]])
    self.assertEqual(mgr.block_table("a"), (0, 1, 2))
    self.assertEqual([mgr.pool.is_cached(b) for b in (0, 1, 2)], [True, True, False])
    mgr.free("a")
    follow = req("f", [0, 1, 2, 100, 101, 102, 103, 104, 7])
    self.assertEqual(mgr.get_computed_blocks(follow), ([0, 1], 8))

  def test_salts_and_namespaces_isolate_hits(self):
    salted, other_model = ns("tenant").root_hash(), keys.KeyNamespace(
        "e" * 64, "float32", 1, 8).root_hash()
    mgr = KVCacheManager(16, 4, namespace_root=ROOT)
    run(mgr, req("a", range(9)), 9, computed=0)
    mgr.free("a")
    r = req("s", range(9))
    mgr.get_computed_blocks(r, namespace_root=salted)
    run(mgr, r, 9, computed=0)
    mgr.free("s")
    self.assertEqual(mgr.get_computed_blocks(req("x", range(9)), namespace_root=other_model),
                     ([], 0))
    self.assertEqual(mgr.get_computed_blocks(req("y", range(9)), namespace_root=salted),
                     ([3, 4], 8))
    self.assertEqual(mgr.get_computed_blocks(req("z", range(9))), ([0, 1], 8))
    self.assertEqual(mgr.get_computed_blocks(req("e", range(9)), namespace_root=ns(
        "").root_hash()), ([], 0))

  def test_pool_short_returns_none_then_preempt_the_newest(self):
    mgr = KVCacheManager(4, 4, namespace_root=ROOT)
    a, b = req("a", range(8)), req("b", range(20, 27))
    run(mgr, a, 8, computed=0)
    run(mgr, b, 7, computed=0)
    before = mgr.stats()
    a.output_token_ids.append(9)
    self.assertIsNone(mgr.allocate_slots("a", 1, num_computed_tokens=8))
    self.assertEqual((mgr.stats(), mgr.block_table("a")), (before, (0, 1)))
    victim = mgr.choose_victim(["a", "b"])
    self.assertEqual((victim, mgr.preempt(victim)), ("b", 2))
    self.assertEqual(mgr.allocate_slots("a", 1, num_computed_tokens=8), [3])  # b's tail block
    self.assertEqual(mgr.stats().preemptions, 1)
    # b resumes later from its own cached first block.
    mgr.free("a")
    self.assertEqual(mgr.get_computed_blocks(b), ([2], 4))
    self.assertEqual(mgr.allocate_slots("b", 3, num_computed_tokens=0, new_computed_blocks=[2]),
                     [3])
    with self.assertRaisesRegex(ValueError, "no running request"):
      mgr.choose_victim([])

  def test_evictable_hits_count_as_taken(self):
    mgr = KVCacheManager(4, 4, namespace_root=ROOT)
    run(mgr, req("a", range(9)), 9, computed=0)  # blocks 0, 1 cached; 2 holds one token
    mgr.free("a")
    r = req("r", list(range(8)) + list(range(50, 59)))  # 17 tokens: 2 hits + 9 new -> 3 more
    hits, _ = mgr.get_computed_blocks(r)
    self.assertIsNone(mgr.allocate_slots("r", 9, num_computed_tokens=0, new_computed_blocks=hits))
    self.assertEqual(mgr.stats().evictions, 0)
    self.assertEqual(mgr.allocate_slots("r", 8, num_computed_tokens=0, new_computed_blocks=hits),
                     [3, 2])  # never-used 3 first, then a's freed tail block

  def test_lookahead_slots(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    self.assertEqual(mgr.allocate_slots("a", 5, num_computed_tokens=0, num_lookahead_tokens=3),
                     [0, 1])
    self.assertEqual(mgr.allocate_slots("a", 1, num_computed_tokens=5, num_lookahead_tokens=3),
                     [2])

  def test_check_fits(self):
    mgr = KVCacheManager(4, 4, namespace_root=ROOT, reserve_null_block=True)
    self.assertEqual((mgr.check_fits(0), mgr.check_fits(12)), (0, 3))
    with self.assertRaisesRegex(ValueError, "13 tokens needs 4 KV blocks of 4 tokens, but the "
                                "pool has 3"):
      mgr.check_fits(13)
    with self.assertRaisesRegex(ValueError, "num_tokens"):
      mgr.check_fits(-1)

  def test_bad_calls_raise(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    a = req("a", range(9))
    run(mgr, a, 9, computed=0)
    with self.assertRaisesRegex(ValueError, "already holds 3 blocks"):
      mgr.get_computed_blocks(a)
    with self.assertRaisesRegex(ValueError, "holds 3 blocks of 4 tokens"):
      mgr.allocate_slots("a", 1, num_computed_tokens=13)
    with self.assertRaisesRegex(ValueError, "only on the first allocation"):
      mgr.allocate_slots("a", 1, num_computed_tokens=9, new_computed_blocks=[0])
    with self.assertRaisesRegex(ValueError, "num_new_tokens"):
      mgr.allocate_slots("a", -1, num_computed_tokens=9)
    with self.assertRaisesRegex(ValueError, "beyond its 9 tokens"):
      mgr.cache_full_blocks(a, 10)
    with self.assertRaisesRegex(ValueError, "unknown request"):
      mgr.block_table("nope")
    with self.assertRaisesRegex(ValueError, "unknown request"):
      mgr.preempt("nope")
    self.assertEqual(mgr.free("nope"), 0)
    # A stale lookup: the hit is evicted before the allocation.
    mgr.free("a")
    b = req("b", range(9))
    hits, _ = mgr.get_computed_blocks(b)
    mgr.allocate_slots("filler", 32, num_computed_tokens=0)
    with self.assertRaisesRegex(ValueError, "not its cached prefix block 0"):
      mgr.allocate_slots("b", 1, num_computed_tokens=0, new_computed_blocks=hits)
    with self.assertRaisesRegex(ValueError, "namespace_root"):
      KVCacheManager(8, 4, namespace_root="")

  def test_disabled_prefix_caching_never_hits(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT, enable_prefix_caching=False)
    a = req("a", range(9))
    self.assertEqual(run(mgr, a, 9, computed=0), [0, 1, 2])
    self.assertEqual(mgr.cache_full_blocks(a, 9), [])
    mgr.free("a")
    self.assertEqual(mgr.get_computed_blocks(req("b", range(9))), ([], 0))
    self.assertEqual((mgr.stats().num_cached_blocks, mgr.stats().queries), (0, 0))

  def test_reset_prefix_cache(self):
    mgr = KVCacheManager(8, 4, namespace_root=ROOT)
    run(mgr, req("a", range(9)), 9, computed=0)
    mgr.free("a")
    b = req("b", range(20, 25))
    run(mgr, b, 5, computed=0)
    self.assertEqual(mgr.reset_prefix_cache(), 3)
    self.assertEqual(mgr.get_computed_blocks(req("c", range(9))), ([], 0))
    # A request running at the reset indexes nothing more: its next full block chains from
    # a prefix that is no longer cached.
    b.output_token_ids.extend([1, 2, 3, 4])
    self.assertEqual(mgr.allocate_slots("b", 4, num_computed_tokens=5), [5])
    self.assertEqual(mgr.cache_full_blocks(b, 9), [])
    mgr.free("b")
    self.assertEqual(mgr.stats().num_cached_blocks, 0)
    self.assertEqual(mgr.pool.num_free, 8)
    mgr.pool.verify()


class KVCacheEventsTest(absltest.TestCase):
  """The index changes the manager records for the KV event publisher (issue 14)."""

  def test_stored_removed_and_cleared_in_order(self):
    mgr = KVCacheManager(4, 4, namespace_root=ROOT)
    a = req("a", range(9))  # [0 1 2 3][4 5 6 7][8 . . .]
    mgr.get_computed_blocks(a)
    mgr.allocate_slots("a", 9, num_computed_tokens=0)
    a.num_computed_tokens = 9
    mgr.cache_full_blocks(a, 9)
    self.assertEqual(mgr.drain_events().events, ())  # off by default: nothing accumulates
    mgr.free("a")
    mgr.set_record_events(True)
    a2 = req("a2", range(9))
    hits, _ = mgr.get_computed_blocks(a2)
    mgr.allocate_slots("a2", 1, num_computed_tokens=0, new_computed_blocks=hits)
    a2.num_computed_tokens = 9
    self.assertEqual(mgr.cache_full_blocks(a2, 9), [])  # hits: indexed already, no event
    self.assertEqual(mgr.drain_events().events, ())
    mgr.free("a2")
    mgr.reset_prefix_cache()
    self.assertEqual(mgr.drain_events().events, (AllBlocksClearedEvent(),))

    a3 = req("a3", range(9))
    mgr.get_computed_blocks(a3)
    self.assertEqual(mgr.allocate_slots("a3", 9, num_computed_tokens=0), [2, 3, 1])
    a3.num_computed_tokens = 9
    mgr.cache_full_blocks(a3, 9)
    ha = bh.block_hashes(ROOT, list(range(9)), 4)
    batch = mgr.drain_events()
    self.assertEqual((batch.namespace_root, batch.block_size), (ROOT, 4))
    self.assertEqual(batch.events, (BlockStoredEvent(ha[0], ROOT, (0, 1, 2, 3)),
                                    BlockStoredEvent(ha[1], ha[0], (4, 5, 6, 7))))
    self.assertEqual(mgr.drain_events().events, ())  # drained
    mgr.free("a3")  # no request given: nothing parked; blocks 2, 3 cached, 1 free
    b = req("b", range(100, 116))  # 4 blocks: the free ones, then evictions, leaves first
    mgr.get_computed_blocks(b)
    mgr.allocate_slots("b", 16, num_computed_tokens=0)
    self.assertEqual(mgr.drain_events().events,
                     (BlockRemovedEvent(ha[1]), BlockRemovedEvent(ha[0])))
    b.num_computed_tokens = 16
    mgr.cache_full_blocks(b, 16)
    hb = bh.block_hashes(ROOT, list(range(100, 116)), 4)
    self.assertEqual([e.block_hash for e in mgr.drain_events().events], hb)
    mgr.free("b")
    mgr.reset_prefix_cache()
    mgr.set_record_events(False)
    mgr.reset_prefix_cache()
    self.assertEqual(mgr.drain_events().events, ())  # stopping drops what was pending

  def test_a_salted_sequence_chains_from_its_own_root(self):
    mgr = KVCacheManager(4, 4, namespace_root=ROOT)
    mgr.set_record_events(True)
    salted = ns("t1").root_hash()
    r = req("r", range(5))
    mgr.get_computed_blocks(r, namespace_root=salted)
    mgr.allocate_slots("r", 5, num_computed_tokens=0)
    r.num_computed_tokens = 5
    mgr.cache_full_blocks(r, 5)
    batch = mgr.drain_events()
    self.assertEqual(batch.namespace_root, ROOT)
    self.assertEqual(batch.events, (BlockStoredEvent(bh.block_hashes(salted, [0, 1, 2, 3], 4)[0],
                                                     salted, (0, 1, 2, 3)),))


class RandomizedNoLeakTest(parameterized.TestCase):
  """1000 random operations under a fake scheduler, with a fake device that records which token
  each KV slot holds: every hit must read back exactly the request's own tokens."""

  @parameterized.parameters(0, 1, 2)
  def test_random_operations(self, seed):
    rng = random.Random(seed)
    b, num_blocks = 4, 24
    mgr = KVCacheManager(num_blocks, b, namespace_root=ROOT, reserve_null_block=seed == 2)
    pool = mgr.pool
    roots = [ROOT, ns("tenant").root_hash()]
    prefixes = [[rng.randrange(30) for _ in range(40)] for _ in range(3)]
    device = {}  # block -> [(root, token) per slot]
    live = {}  # rid -> dict(req, root, computed, max_tokens)
    running, waiting = [], []
    counter = 0
    parked_hits = [0]
    histories = []  # (root, tokens with KV) of cleanly finished requests: follow-up turns

    def write(rid, start, n):
      st = live[rid]
      table = mgr.block_table(rid)
      tokens = st["req"].prompt_token_ids + st["req"].output_token_ids
      for pos in range(start, start + n):
        blk = table[pos // b]
        self.assertFalse(pool.is_shared(blk), f"write into shared block {blk}")
        self.assertFalse(pool.is_cached(blk), f"write into cached block {blk}")
        device.setdefault(blk, [None] * b)[pos % b] = (st["root"], tokens[pos])

    def preempt_until(rid, alloc):
      """Retries `alloc` after preempting the newest running request; False if rid itself."""
      while (new := alloc()) is None:
        victim = mgr.choose_victim(running)
        mgr.preempt(victim)
        running.remove(victim)
        live[victim]["computed"] = 0
        waiting.insert(0, victim)
        if victim == rid:
          return None
      return new

    def check_new(rid, new):
      for blk in new:
        self.assertEqual(pool.ref_count(blk), 1)
        self.assertFalse(pool.is_cached(blk))
        for other in running:
          if other != rid:
            self.assertNotIn(blk, mgr.block_table(other))

    def admit():
      rid = waiting[0]
      st = live[rid]
      r = st["req"]
      hits, n_hit = mgr.get_computed_blocks(r, namespace_root=st["root"])
      parked_hits[0] += bool(n_hit % b)
      tokens = r.prompt_token_ids + r.output_token_ids
      for i, blk in enumerate(hits):  # the device holds exactly this request's prefix
        want = [(st["root"], t) for t in tokens[i * b:min((i + 1) * b, n_hit)]]
        self.assertEqual(device[blk][:len(want)], want)  # a parked block: its first tokens
      self.assertLess(n_hit, r.num_tokens)
      n = min(rng.choice((4, 8, 16, 64)), r.num_tokens - n_hit)
      new = mgr.allocate_slots(rid, n, num_computed_tokens=0, new_computed_blocks=hits)
      if new is None:
        return  # stays waiting: a waiting request never preempts
      check_new(rid, new)
      waiting.remove(rid)
      running.append(rid)
      st["computed"] = n_hit
      step(rid, n, allocated=True)

    def step(rid, n=None, allocated=False):
      st = live[rid]
      r = st["req"]
      if n is None:
        n = min(rng.choice((1, 1, 4, 16)), r.num_tokens - st["computed"])
      if not allocated:
        new = preempt_until(rid, lambda: mgr.allocate_slots(
            rid, n, num_computed_tokens=st["computed"]))
        if new is None:
          return
        check_new(rid, new)
      write(rid, st["computed"], n)
      st["computed"] += n
      mgr.cache_full_blocks(r, st["computed"])
      if st["computed"] == r.num_tokens:  # the step's last token gives the next token
        r.output_token_ids.append(rng.randrange(30))
        if len(r.output_token_ids) == st["max_tokens"]:
          finish(rid)

    def finish(rid):
      r = live[rid]["req"]
      if rid in running and rng.random() < 0.7:  # a clean finish parks a partial last block
        r.num_computed_tokens = live[rid]["computed"]
        histories.append((live[rid]["root"], (r.prompt_token_ids + r.output_token_ids)[
            :r.num_computed_tokens]))
        mgr.free(rid, r if r.num_computed_tokens >= r.num_prefill_tokens else None)
      else:
        mgr.free(rid)
      for q in (running, waiting):
        if rid in q:
          q.remove(rid)
      del live[rid]

    for _ in range(1000):
      op = rng.random()
      if op < 0.2:
        counter += 1
        rid = f"r{counter}"
        prompt = rng.choice(prefixes)[:rng.randrange(1, 41)] + [
            rng.randrange(30) for _ in range(rng.randrange(0, 20))]
        max_tokens = rng.randrange(1, 12)
        if rng.random() < 0.03:
          prompt = list(range(200))
        root = rng.choice(roots)
        follow_up = histories and rng.random() < 0.5
        if follow_up:  # the next turn of the conversation that finished last, admitted first
          root, history = histories.pop()
          prompt = list(history) + [rng.randrange(30) for _ in range(rng.randrange(1, 8))]
        try:
          mgr.check_fits(len(prompt) + max_tokens)
        except ValueError:
          self.assertGreater(-(-(len(prompt) + max_tokens) // b), pool.num_usable_blocks)
          continue
        live[rid] = dict(req=req(rid, prompt), root=root, computed=0,
                         max_tokens=max_tokens)
        waiting.insert(0 if follow_up else len(waiting), rid)
      elif op < 0.45 and waiting:
        admit()
      elif op < 0.93 and running:
        step(rng.choice(running))
      elif op < 1.0 and live:
        finish(rng.choice(sorted(live)))  # abort, running or waiting
      pool.verify()
      refs = {}
      for rid in running:
        table = mgr.block_table(rid)
        self.assertLen(set(table), len(table))
        self.assertGreaterEqual(len(table) * b, live[rid]["computed"])
        for blk in table:
          refs[blk] = refs.get(blk, 0) + 1
      for blk in range(pool.num_blocks - pool.num_usable_blocks, pool.num_blocks):
        self.assertEqual(pool.ref_count(blk), refs.get(blk, 0))

    stats = mgr.stats()
    self.assertGreater(stats.hits, 10)
    self.assertGreater(stats.preemptions, 5)
    self.assertGreater(stats.evictions, 10)
    self.assertGreaterEqual(parked_hits[0], 2, "no follow-up turn took a parked block")
    for rid in sorted(live):
      finish(rid)
    pool.verify()
    self.assertEqual(pool.num_free, pool.num_usable_blocks)
    self.assertEqual(pool.num_evictable, pool.num_cached + pool.num_parked)
    self.assertEqual(mgr.stats().usage, 0.0)


class ForkTest(absltest.TestCase):
  """`KVCacheManager.fork` (n > 1): full blocks shared, the partly filled last block copied."""

  def test_fork_shares_full_blocks_and_copies_the_partial_one(self):
    kvm = KVCacheManager(8, 4, namespace_root=ROOT)
    parent = req("p", range(10))
    self.assertEqual(kvm.allocate_slots("p", 10, num_computed_tokens=0), [0, 1, 2])
    self.assertEqual(kvm.fork("p", "c1", 10), ((2, 3),))
    self.assertEqual(kvm.block_table("c1"), (0, 1, 3))
    self.assertEqual([kvm.pool.ref_count(b) for b in range(4)], [2, 2, 1, 1])
    self.assertEqual(kvm.fork("p", "c2", 8), ())  # whole blocks: nothing to copy
    self.assertEqual(kvm.block_table("c2"), (0, 1))
    self.assertEqual([kvm.pool.ref_count(b) for b in range(4)], [3, 3, 1, 1])
    parent.num_computed_tokens = 10
    kvm.cache_full_blocks(parent, 10)
    kvm.free("p", parent)
    kvm.free("c2")
    self.assertEqual([kvm.pool.ref_count(b) for b in range(4)], [1, 1, 0, 1])  # c1's
    self.assertEqual(kvm.get_computed_blocks(req("q", range(10)))[1], 9)  # parked: 8 + 1

  def test_fork_with_the_pool_short_changes_nothing(self):
    kvm = KVCacheManager(3, 4, namespace_root=ROOT)
    kvm.allocate_slots("p", 10, num_computed_tokens=0)
    self.assertIsNone(kvm.fork("p", "c", 10))
    self.assertEqual([kvm.pool.ref_count(b) for b in range(3)], [1, 1, 1])
    with self.assertRaises(ValueError):
      kvm.fork("p", "c", 13)  # beyond the parent's blocks
    with self.assertRaises(ValueError):
      kvm.fork("nobody", "c", 4)


if __name__ == "__main__":
  absltest.main()
