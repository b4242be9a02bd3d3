"""Exact move traces of the tier placement planner (CachedAttention, arXiv 2403.19708, 3.3).

Every chunk is 10 bytes; capacities are whole chunks. Traces were worked out by hand from the
rules in `kvjax/storage/tiering/placement.py`'s docstring; each test says why.
"""

from absl.testing import absltest, parameterized

from kvjax.storage.tiering.placement import (POLICIES, Demote, Drop, Insert, PlacementStats,
                                             Promote, TierHierarchy, TierSpec, make_policy)

N = 10  # bytes per chunk


def tiers(**caps):
  """TierSpecs in keyword order: name=capacity in chunks (None: unbounded)."""
  return [TierSpec(name, None if c is None else c * N) for name, c in caps.items()]


def saves(h, *specs):
  """Saves "key" or "key<parent" specs in order; returns each save's moves."""
  out = []
  for s in specs:
    key, _, parent = s.partition("<")
    out.append(h.save(key, N, parent or None))
  return out


class WindowTest(absltest.TestCase):

  def test_window_chunk_survives_where_lru_drops_it(self):
    lru = TierHierarchy(tiers(host=2), "lru")
    saves(lru, "a", "b")
    self.assertEqual(lru.lookahead([["a"]]), [])  # LRU ignores the window
    self.assertEqual(lru.save("c", N), [Drop("a", "host", N), Insert("c", "host", N)])

    la = TierHierarchy(tiers(host=2), "lookahead")
    saves(la, "a", "b")
    self.assertEqual(la.lookahead([["a"]]), [])  # already in the top tier
    self.assertEqual(la.save("c", N), [Drop("b", "host", N), Insert("c", "host", N)])
    self.assertEqual(la.where("a"), "host")

  def test_victims_are_demoted_not_dropped(self):
    h = TierHierarchy(tiers(host=2, disk=2), "lookahead")
    saves(h, "a", "b")
    h.lookahead([["a"]])
    self.assertEqual(h.save("c", N), [Demote("b", "host", "disk", N), Insert("c", "host", N)])

  def test_outside_chunk_never_displaces_window_chunks(self):
    # Host is all window: a new chunk goes to disk instead; a scheduled access (needed now) may
    # displace a window chunk, the one needed farthest first (c, rank 2).
    h = TierHierarchy(tiers(host=3, disk=3), "lookahead")
    saves(h, "a", "b", "c")
    self.assertEqual(h.lookahead([["a"], ["b"], ["c"]]), [])
    self.assertEqual(h.save("d", N), [Insert("d", "disk", N)])
    res = h.access(["d"])
    self.assertEqual(res.tiers, ("disk",))
    self.assertEqual(res.moves, (Demote("c", "host", "disk", N), Promote("d", "disk", "host", N)))

    lru = TierHierarchy(tiers(host=3, disk=3), "lru")
    saves(lru, "a", "b", "c")
    self.assertEqual(lru.save("d", N), [Demote("a", "host", "disk", N), Insert("d", "host", N)])

  def test_chunk_that_left_the_window_is_a_victim_again_in_recency_order(self):
    # The victim search sets window chunks aside (a is skipped while c is saved); once the
    # window moves on, a is again the least recently used and goes first.
    h = TierHierarchy(tiers(host=2), "lookahead")
    saves(h, "a", "b")
    h.lookahead([["a"]])
    self.assertEqual(h.save("c", N), [Drop("b", "host", N), Insert("c", "host", N)])
    h.lookahead([["c"]])
    self.assertEqual(h.save("d", N), [Drop("a", "host", N), Insert("d", "host", N)])
    h.lookahead([])
    self.assertEqual(h.save("e", N), [Drop("c", "host", N), Insert("e", "host", N)])
    self.assertEqual(h.tier_keys("host"), ["d", "e"])

  def test_window_chunk_set_aside_is_taken_once_across_heap_rebuilds(self):
    # Many refreshes rebuild the tier's heap while a window chunk is set aside; it must still
    # be evicted exactly once, and the bytes held must match the chunks held.
    h = TierHierarchy(tiers(host=3), "lookahead")
    saves(h, "a", "b", "c")
    h.lookahead([["a"]])
    self.assertEqual(h.save("d", N), [Drop("b", "host", N), Insert("d", "host", N)])
    for _ in range(200):  # 2 x 3 members + 64 items: the heap is rebuilt several times
      h.save("c", N)
      h.save("d", N)
    h.lookahead([])
    # A chunk of two chunks' size needs two victims in one search: a (least recent) and c.
    self.assertEqual(h.save("e", 2 * N),
                     [Drop("a", "host", N), Drop("c", "host", N), Insert("e", "host", 2 * N)])
    st = h.stats()
    self.assertEqual((st.chunks["host"], st.used_bytes["host"]), (2, 3 * N))
    self.assertEqual(st.drops["host"], 3)
    self.assertEqual(h.tier_keys("host"), ["d", "e"])

  def test_save_rejected_when_every_tier_keeps_window_chunks(self):
    h = TierHierarchy(tiers(host=1, disk=1), "lookahead")
    saves(h, "a", "b")  # b in host, a demoted to disk
    h.lookahead([["a", "b"]])
    self.assertEqual(h.save("c", N), [])
    self.assertEqual(h.stats().rejected_saves, 1)
    self.assertEqual((h.where("a"), h.where("b"), h.where("c")), ("disk", "host", None))


class CascadeTest(parameterized.TestCase):

  @parameterized.parameters("lru", "fifo", "lookahead")
  def test_device_host_disk_then_drop(self, policy):
    # Unrelated chunks and no window: every policy takes the oldest; room is made in the lower
    # tier first (its own victim goes down or out), then the victim moves into it.
    h = TierHierarchy(tiers(device=1, host=1, disk=1), policy)
    self.assertEqual(saves(h, "a", "b", "c", "d"), [
        [Insert("a", "device", N)],
        [Demote("a", "device", "host", N), Insert("b", "device", N)],
        [Demote("a", "host", "disk", N), Demote("b", "device", "host", N),
         Insert("c", "device", N)],
        [Drop("a", "disk", N), Demote("b", "host", "disk", N), Demote("c", "device", "host", N),
         Insert("d", "device", N)],
    ])
    s = h.stats()
    self.assertEqual((s.demotions, s.drops), (5, {"device": 0, "host": 0, "disk": 1}))
    self.assertEqual(s.chunks, {"device": 1, "host": 1, "disk": 1})
    self.assertEqual([h.where(k) for k in "abcd"], [None, "disk", "host", "device"])

  def test_unbounded_bottom_never_drops(self):
    h = TierHierarchy(tiers(host=1, remote=None), "lru")
    moves = saves(h, "a", "b", "c")
    self.assertEqual(moves[2], [Demote("b", "host", "remote", N), Insert("c", "host", N)])
    self.assertEqual(h.tier_keys("remote"), ["a", "b"])
    self.assertEqual(h.stats().drops, {"host": 0, "remote": 0})

  def test_access_promotes_and_swaps_with_a_full_lower_tier(self):
    # b leaves disk before room is made in host, so host's victim c takes its place: no drop.
    h = TierHierarchy(tiers(host=1, disk=2), "lru")
    saves(h, "a", "b", "c")  # host [c], disk [a, b]
    res = h.access(["b"])
    self.assertEqual(res.tiers, ("disk",))
    self.assertEqual(res.moves, (Demote("c", "host", "disk", N), Promote("b", "disk", "host", N)))
    self.assertEqual((h.tier_keys("host"), h.tier_keys("disk")), (["b"], ["a", "c"]))
    self.assertEqual(h.stats().promotions, 1)


class SuffixFirstTest(absltest.TestCase):

  def test_suffix_goes_before_its_older_prefix(self):
    # a1 extends a0. LRU drops a0 (oldest), leaving a1 useless; lookahead drops a1 first, then
    # a0 (a leaf now, and still the oldest).
    lru = TierHierarchy(tiers(host=3), "lru")
    saves(lru, "a0", "a1<a0", "b")
    self.assertEqual(lru.save("c", N), [Drop("a0", "host", N), Insert("c", "host", N)])

    la = TierHierarchy(tiers(host=3), "lookahead")
    saves(la, "a0", "a1<a0", "b")
    self.assertEqual(la.save("c", N), [Drop("a1", "host", N), Insert("c", "host", N)])
    self.assertEqual(la.save("d", N), [Drop("a0", "host", N), Insert("d", "host", N)])

  def test_one_eviction_takes_the_chain_from_its_tail(self):
    la = TierHierarchy(tiers(host=4), "lookahead")
    saves(la, "a0", "a1<a0", "a2<a1", "b")
    la.access(["b"])
    moves = la.save("big", 3 * N)
    self.assertEqual(moves, [Drop("a2", "host", N), Drop("a1", "host", N), Drop("a0", "host", N),
                             Insert("big", "host", 3 * N)])

  def test_bottom_tier_keeps_a_prefix_whose_suffix_is_cached_above(self):
    # host 1, disk 2. After a0, x, a1<a0: host [a1], disk [a0, x]. Saving y demotes a1 and the
    # disk must drop one: LRU drops a0 (oldest); lookahead keeps a0, whose suffix a1 is cached,
    # and drops x.
    moves = {}
    for policy in ("lru", "lookahead"):
      h = TierHierarchy(tiers(host=1, disk=2), policy)
      saves(h, "a0", "x", "a1<a0")
      self.assertEqual((h.tier_keys("host"), h.tier_keys("disk")), (["a1"], ["a0", "x"]))
      moves[policy] = h.save("y", N)
    self.assertEqual(moves["lru"], [Drop("a0", "disk", N), Demote("a1", "host", "disk", N),
                                    Insert("y", "host", N)])
    self.assertEqual(moves["lookahead"], [Drop("x", "disk", N), Demote("a1", "host", "disk", N),
                                          Insert("y", "host", N)])

  def test_save_never_evicts_its_own_prefix(self):
    h = TierHierarchy(tiers(host=2), "lookahead")
    saves(h, "a0", "a1<a0")
    self.assertEqual(h.save("a2", N, "a1"), [])  # the only victims are its own prefix
    self.assertEqual(h.stats().rejected_saves, 1)


class PrefetchTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    # host [b0, b1], disk [a1, a0]: b0 made room by demoting a1 (the suffix) first, then b1
    # demoted a0 (a leaf in host once a1 left).
    self.h = TierHierarchy(tiers(host=2, disk=None), "lookahead")
    moves = saves(self.h, "a0", "a1<a0", "b0", "b1<b0")
    self.assertEqual(moves[2:], [
        [Demote("a1", "host", "disk", N), Insert("b0", "host", N)],
        [Demote("a0", "host", "disk", N), Insert("b1", "host", N)]])

  def test_link_budget_limits_each_planning_call(self):
    h = self.h
    self.assertEqual(h.lookahead([["a0", "a1"]], budgets={"host": N}),
                     [Demote("b1", "host", "disk", N), Promote("a0", "disk", "host", N)])
    self.assertEqual(h.lookahead([["a0", "a1"]], budgets={"host": N}),
                     [Demote("b0", "host", "disk", N), Promote("a1", "disk", "host", N)])
    self.assertEqual(h.lookahead([["a0", "a1"]], budgets={"host": N}), [])
    self.assertEqual(h.stats().prefetches_issued, 2)

  def test_tier_budget_default_and_unlimited_override(self):
    h = TierHierarchy([TierSpec("host", 2 * N, prefetch_bytes_per_interval=N),
                       TierSpec("disk", None)], "lookahead")
    saves(h, "a0", "a1<a0", "b0", "b1<b0")
    self.assertEqual(h.lookahead([["a0", "a1"]]),
                     [Demote("b1", "host", "disk", N), Promote("a0", "disk", "host", N)])
    self.assertEqual(h.lookahead([["a0", "a1"]], budgets={"host": None}),
                     [Demote("b0", "host", "disk", N), Promote("a1", "disk", "host", N)])

  def test_capacity_never_displaces_nearer_requests(self):
    # b's chunks fill host and b is first in the queue: a (second) is not prefetched.
    self.assertEqual(self.h.lookahead([["b0", "b1"], ["a0", "a1"]]), [])
    self.assertEqual(self.h.tier_keys("host"), ["b0", "b1"])

  def test_queue_order_decides_who_gets_the_room(self):
    self.assertEqual(self.h.lookahead([["a0", "a1"], ["b0", "b1"]]), [
        Demote("b1", "host", "disk", N), Promote("a0", "disk", "host", N),
        Demote("b0", "host", "disk", N), Promote("a1", "disk", "host", N)])

  def test_policies_without_prefetch_move_nothing(self):
    for policy in ("lru", "fifo", "none"):
      h = TierHierarchy(tiers(host=2, disk=None), policy)
      saves(h, "a0", "a1<a0", "b0", "b1<b0")
      self.assertEqual(h.lookahead([["a0", "a1"]]), [], policy)


class OrderTest(absltest.TestCase):

  def test_lru_and_fifo_orders(self):
    out = {}
    for policy in ("lru", "fifo"):
      h = TierHierarchy(tiers(host=2), policy)
      saves(h, "a", "b")
      self.assertEqual(h.access(["a"]).tiers, ("host",))
      out[policy] = h.save("c", N)
    self.assertEqual(out["lru"], [Drop("b", "host", N), Insert("c", "host", N)])
    self.assertEqual(out["fifo"], [Drop("a", "host", N), Insert("c", "host", N)])

  def test_saving_a_held_chunk_refreshes_it(self):
    h = TierHierarchy(tiers(host=2), "lru")
    saves(h, "a", "b")
    self.assertEqual(h.save("a", N), [])
    self.assertEqual(h.save("c", N), [Drop("b", "host", N), Insert("c", "host", N)])
    self.assertEqual(h.stats().saves, 3)


class StatsTest(absltest.TestCase):

  def test_counts(self):
    h = TierHierarchy(tiers(host=2, disk=2), "lookahead")
    saves(h, "a", "b", "c", "d")  # host [c, d], disk [a, b]
    self.assertEqual(h.lookahead([["a"]]),
                     [Demote("c", "host", "disk", N), Promote("a", "disk", "host", N)])
    self.assertEqual(h.lookahead([["b"], ["a"]]),
                     [Demote("d", "host", "disk", N), Promote("b", "disk", "host", N)])
    # c is needed first now and a not at all: a was prefetched for nothing.
    self.assertEqual(h.lookahead([["c"], ["b"]]),
                     [Demote("a", "host", "disk", N), Promote("c", "disk", "host", N)])
    # The scheduled request reads c (a useful prefetch), d (on disk: promoted, displacing b,
    # the window's only chunk left in host) and e (a miss).
    res = h.access(["c", "d", "e"])
    self.assertEqual(res.tiers, ("host", "disk", None))
    self.assertEqual(res.moves, (Demote("b", "host", "disk", N),
                                 Promote("d", "disk", "host", N)))
    self.assertEqual(h.stats(), PlacementStats(
        hits={"host": 1, "disk": 1}, misses=1, saves=4, rejected_saves=0, promotions=1,
        prefetches_issued=3, prefetches_useful=1, prefetches_wasted=2, demotions=6,
        drops={"host": 0, "disk": 0}, chunks={"host": 2, "disk": 2},
        used_bytes={"host": 20, "disk": 20}, capacity_bytes={"host": 20, "disk": 20}))
    self.assertEqual(h.stats().prefetches_pending, 0)
    self.assertEqual((h.tier_keys("host"), h.tier_keys("disk")), (["c", "d"], ["a", "b"]))

  def test_none_caches_nothing(self):
    h = TierHierarchy(tiers(host=2, disk=2), "none")
    self.assertEqual(saves(h, "a", "b"), [[], []])
    self.assertEqual(h.lookahead([["a"]]), [])
    res = h.access(["a", "b"])
    self.assertEqual((res.tiers, res.moves), ((None, None), ()))
    s = h.stats()
    self.assertEqual((s.saves, s.rejected_saves, s.misses, s.hits), (0, 2, 2,
                                                                    {"host": 0, "disk": 0}))

  def test_snapshots_are_copies(self):
    h = TierHierarchy(tiers(host=1), "lru")
    s = h.stats()
    s.hits["host"] = 99
    self.assertEqual(h.stats().hits, {"host": 0})


class CopiesTest(absltest.TestCase):
  """`copies=True`, the real tiers' model (`TieredStore` executes these moves)."""

  def test_a_promotion_keeps_its_source_and_a_victim_held_below_is_dropped_unwritten(self):
    h = TierHierarchy(tiers(host=1, disk=2), "lookahead", copies=True)
    saves(h, "a")
    self.assertEqual(h.save("b", N), [Demote("a", "host", "disk", N), Insert("b", "host", N)])
    res = h.access(["a"])
    self.assertEqual(res.moves, (Demote("b", "host", "disk", N), Promote("a", "disk", "host", N)))
    self.assertEqual(h.held_in("a"), ["host", "disk"])  # the disk copy stays
    moves = h.save("c", N)
    self.assertEqual(moves, [Drop("a", "host", N), Insert("c", "host", N)])
    self.assertEqual(moves[0].why, "copy")  # no write: the disk holds it
    self.assertEqual(h.held_in("a"), ["disk"])
    self.assertEqual(h.stats().used_bytes, {"host": N, "disk": 2 * N})

  def test_write_through_saves_a_second_copy(self):
    h = TierHierarchy(tiers(host=1, disk=2), "lru", copies=True)
    self.assertEqual(h.save("a", N, through=["disk"]),
                     [Insert("a", "host", N), Insert("a", "disk", N)])
    self.assertEqual(h.save("b", N, through=["disk"]),
                     [Drop("a", "host", N), Insert("b", "host", N), Insert("b", "disk", N)])
    with self.assertRaisesRegex(ValueError, "copies=True"):
      TierHierarchy(tiers(host=1, disk=2)).save("a", N, through=["disk"])

  def test_prefetch_one_displaces_only_later_chunks(self):
    h = TierHierarchy(tiers(host=1, disk=2), "lookahead", copies=True)
    saves(h, "a", "b")  # a demoted to disk
    self.assertEqual(h.lookahead([["a"], ["b"]], prefetch=False), [])
    self.assertEqual(h.prefetch_one("a"),
                     [Demote("b", "host", "disk", N), Promote("a", "disk", "host", N)])
    self.assertEqual(h.prefetch_one("b"), [])  # needed after a: it cannot displace it

  def test_adopted_chunks_are_least_recent_and_forget_stops_counting(self):
    h = TierHierarchy(tiers(disk=2), "lru", copies=True)
    saves(h, "a", "b")
    self.assertEqual(h.adopt("old", "disk", N), [Drop("old", "disk", N)])
    h.forget("a")
    self.assertEqual(h.tier_keys("disk"), ["b"])
    self.assertEqual(h.stats().used_bytes, {"disk": N})


class OrphansTest(absltest.TestCase):

  def test_an_orphan_goes_first_and_is_dropped_not_demoted(self):
    h = TierHierarchy(tiers(host=2, disk=2), "lru")
    saves(h, "a", "x<gone")  # x extends a chunk held nowhere: it can never hit
    moves = h.save("b", N)
    self.assertEqual(moves, [Drop("x", "host", N), Insert("b", "host", N)])
    self.assertEqual(moves[0].why, "orphan")
    keep = TierHierarchy(tiers(host=2, disk=2), "lru", drop_orphans=False)
    saves(keep, "a", "x<gone")
    self.assertEqual(keep.save("b", N), [Demote("a", "host", "disk", N), Insert("b", "host", N)])


class ErrorsTest(absltest.TestCase):

  def test_registry(self):
    self.assertEqual(sorted(POLICIES), ["fifo", "lookahead", "lru", "none"])
    self.assertEqual(make_policy("lru").name, "lru")
    with self.assertRaisesRegex(ValueError, "unknown placement policy 'belady'"):
      make_policy("belady")

  def test_bad_tiers_and_inputs(self):
    with self.assertRaisesRegex(ValueError, "at least one tier"):
      TierHierarchy([])
    with self.assertRaisesRegex(ValueError, "distinct"):
      TierHierarchy([TierSpec("a", 10), TierSpec("a", 10)])
    with self.assertRaisesRegex(ValueError, "unbounded but not the bottom"):
      TierHierarchy([TierSpec("a", None), TierSpec("b", 10)])
    with self.assertRaisesRegex(ValueError, "capacity_bytes must be a positive int"):
      TierHierarchy([TierSpec("a", 0)])
    h = TierHierarchy(tiers(host=1))
    with self.assertRaisesRegex(ValueError, "nbytes must be a positive int"):
      h.save("a", 0)
    with self.assertRaisesRegex(ValueError, "unknown tier 'disk'"):
      h.lookahead([], budgets={"disk": 1})
    with self.assertRaisesRegex(ValueError, "unknown tier 'disk'"):
      h.tier_keys("disk")

  def test_too_big_for_every_tier(self):
    h = TierHierarchy(tiers(host=1, disk=2), "lru")
    self.assertEqual(h.save("huge", 3 * N), [])
    self.assertEqual(h.stats().rejected_saves, 1)
    self.assertEqual(h.save("mid", 2 * N), [Insert("mid", "disk", 2 * N)])


if __name__ == "__main__":
  absltest.main()
