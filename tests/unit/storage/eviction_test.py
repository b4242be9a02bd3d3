"""Exact eviction orders of the LRU and FIFO policies, the one leaf-first function and the one
policy registry the planner and the real tiers build from."""

from absl.testing import absltest

from kvjax._typing import ChunkHash
from kvjax.storage.tiering import placement
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.eviction import (POLICIES, EntryInfo, FIFOPolicy, LeafFirst,
                                            LookaheadPolicy, LRUPolicy, NoCache, chain_depths,
                                            leaf_first, make_policy)
from kvjax.storage.tiering.store_config import StoreConfig, TierConfig
from kvjax.storage.tiering.tiers import build_tiers

ROOT = ChunkHash("root")


def entries(spec, nbytes=10):
  """spec: name -> (parent, last_access[, inserted]); depths from `chain_depths`."""
  parents = {ChunkHash(h): ChunkHash(v[0]) for h, v in spec.items()}
  depths = chain_depths(parents)
  return [EntryInfo(ChunkHash(h), ChunkHash(v[0]), nbytes, v[1], depths[ChunkHash(h)],
                    v[2] if len(v) > 2 else 0) for h, v in spec.items()]


class ChainDepthsTest(absltest.TestCase):

  def test_depth_counts_present_ancestors(self):
    parents = {"a": "root", "b": "a", "c": "b", "x": "a", "y": "gone", "z": "y"}
    self.assertEqual(chain_depths(parents), {"a": 0, "b": 1, "c": 2, "x": 1, "y": 0, "z": 1})

  def test_cycle_is_cut(self):
    depths = chain_depths({"a": "b", "b": "a", "c": "a"})
    self.assertEqual(set(depths), {"a", "b", "c"})
    self.assertEqual(depths["c"], depths["a"] + 1)


class LRUPolicyTest(absltest.TestCase):

  def test_plain_lru_on_independent_chunks(self):
    es = entries({"a": (ROOT, 5), "b": (ROOT, 1), "c": (ROOT, 3), "d": (ROOT, 9)})
    p = LRUPolicy()
    self.assertEqual(p.victims(es, 10), ["b"])
    self.assertEqual(p.victims(es, 11), ["b", "c"])
    self.assertEqual(p.victims(es, 40), ["b", "c", "a", "d"])
    self.assertEqual(p.victims(es, 0), [])

  def test_suffix_before_prefix_even_when_prefix_is_older(self):
    # Chain a -> b -> c written front to back (a oldest), plus an unrelated x.
    es = entries({"a": (ROOT, 1), "b": ("a", 2), "c": ("b", 3), "x": (ROOT, 4)})
    self.assertEqual(LRUPolicy().victims(es, 40), ["c", "b", "a", "x"])

  def test_parent_stays_while_a_kept_child_remains(self):
    # a has two children; y was read recently, so a must outlive y.
    es = entries({"a": (ROOT, 1), "b": ("a", 2), "y": ("a", 8), "x": (ROOT, 5)})
    self.assertEqual(LRUPolicy().victims(es, 30), ["b", "x", "y"])
    self.assertEqual(LRUPolicy().victims(es, 40), ["b", "x", "y", "a"])

  def test_recency_tie_goes_to_the_deeper_chunk(self):
    es = entries({"p": (ROOT, 7), "q": ("p", 7), "r": (ROOT, 7)})
    self.assertEqual(LRUPolicy().victims(es, 30), ["q", "p", "r"])

  def test_hinted_chunks_are_never_evicted_and_keep_their_ancestors(self):
    es = entries({"a": (ROOT, 1), "b": ("a", 2), "c": ("b", 3), "x": (ROOT, 4), "y": (ROOT, 5)})
    p = LRUPolicy()
    p.hint([["a", "b"], ["y"]])
    self.assertEqual(p.hinted, {"a", "b", "y"})
    self.assertEqual(p.victims(es, 20), ["c", "x"])
    self.assertEqual(p.victims(es, 100), ["c", "x"])  # short: the caller checks the bytes
    p.hint([["c"]])  # a hinted leaf holds its whole chain
    self.assertEqual(p.victims(es, 100), ["x", "y"])
    p.hint([])
    self.assertEqual(p.victims(es, 100), ["c", "b", "a", "x", "y"])

  def test_sizes_decide_how_many_go(self):
    es = [EntryInfo(ChunkHash("big"), ROOT, 100, 1), EntryInfo(ChunkHash("s1"), ROOT, 5, 2),
          EntryInfo(ChunkHash("s2"), ROOT, 5, 3)]
    self.assertEqual(LRUPolicy().victims(es, 101), ["big", "s1"])


class KeepTest(absltest.TestCase):

  def test_kept_chunks_are_not_chosen_and_keep_their_parent(self):
    es = [EntryInfo("a", "root", 10, 1, 0), EntryInfo("b", "a", 10, 2, 1),
          EntryInfo("x", "root", 10, 3, 0)]
    self.assertEqual(LRUPolicy().victims(es, 20), ["b", "a"])
    self.assertEqual(LRUPolicy().victims(es, 20, keep={"b"}), ["x"])


class FIFOPolicyTest(absltest.TestCase):

  def test_insertion_order_ignores_recency_and_chains(self):
    es = entries({"a": (ROOT, 9, 1), "b": ("a", 1, 2), "x": (ROOT, 5, 3)})
    self.assertEqual(FIFOPolicy().victims(es, 20), ["a", "b"])
    self.assertEqual(FIFOPolicy(chain_aware=True).victims(es, 20), ["b", "a"])

  def test_fifo_honors_hints(self):
    es = entries({"a": (ROOT, 9, 1), "b": (ROOT, 1, 2), "x": (ROOT, 5, 3)})
    p = FIFOPolicy()
    p.hint([["a"]])
    self.assertEqual(p.victims(es, 30), ["b", "x"])


class LeafFirstTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    # a -> b -> c and x, 10 bytes each; candidates in the order given.
    self.es = {e.chunk_hash: e for e in entries(
        {"a": (ROOT, 1), "b": ("a", 2), "c": ("b", 3), "x": (ROOT, 4)})}
    children = {"a": ["b"], "b": ["c"]}
    self.is_leaf = lambda e, gone: all(k in gone for k in children.get(e.key, ()))

  def keys(self, st):
    return [e.key for e in st.chosen]

  def test_a_passed_over_prefix_goes_right_after_its_last_suffix(self):
    order = [self.es[h] for h in ("a", "b", "x", "c")]
    st = leaf_first(order, 40, self.is_leaf)
    self.assertEqual(self.keys(st), ["x", "c", "b", "a"])
    self.assertEqual((st.freed, st.waiting), (40, {}))

  def test_stops_pulling_once_enough_is_freed(self):
    pulled = []

    def lazily():
      for h in ("x", "c", "b", "a"):
        pulled.append(h)
        yield self.es[h]

    st = leaf_first(lazily(), 10, self.is_leaf)
    self.assertEqual((self.keys(st), pulled), (["x"], ["x"]))

  def test_waiting_non_leaves_are_reported_and_a_later_call_continues(self):
    order = [self.es[h] for h in ("a", "b", "x")]  # c must stay: a and b are no leaves
    st = leaf_first(order, 30, self.is_leaf)
    self.assertEqual((self.keys(st), list(st.waiting)), (["x"], ["a", "b"]))
    leaf_first(list(st.waiting.values()), 30, None, st)  # the planner's phase 2
    self.assertEqual((self.keys(st), st.freed, st.gone), (["x", "a", "b"], 30, {"x", "a", "b"}))

  def test_without_a_leaf_test_every_candidate_is_a_leaf(self):
    st = leaf_first([self.es["a"], self.es["b"]], 15, None, LeafFirst())
    self.assertEqual(self.keys(st), ["a", "b"])


class RegistryTest(absltest.TestCase):

  def test_the_planner_and_the_tiers_build_the_same_classes(self):
    self.assertEqual(POLICIES, {"lookahead": LookaheadPolicy, "lru": LRUPolicy,
                                "fifo": FIFOPolicy, "none": NoCache})
    self.assertIs(placement.make_policy, make_policy)
    for name in ("lru", "fifo"):
      planner = placement.TierHierarchy([placement.TierSpec("host", None)], name).policy
      cfg = StoreConfig((TierConfig("host", capacity_bytes=100),
                         TierConfig("disk", url="memory://d", capacity_bytes=100)), eviction=name)
      store = build_tiers(cfg, make_chunk_store=lambda url, tier, limiter: ChunkStore(
          url, name=tier, limiter=limiter))  # opens nothing: only the policies are looked at
      self.assertIs(type(planner), type(store.host.policy), name)
      self.assertIs(type(planner), type(store.planner.policy), name)
      self.assertIs(type(planner), POLICIES[name], name)

  def test_the_tiers_run_the_window_the_planners_baselines_ignore_it(self):
    flags = lambda p: (p.chain_aware, p.window_aware, p.prefetches, p.caches)
    self.assertEqual(flags(make_policy("lru", tier=True)), (True, True, False, True))
    self.assertEqual(flags(make_policy("fifo", tier=True)), (False, True, False, True))
    self.assertEqual(flags(make_policy("lru")), (False, False, False, True))
    self.assertEqual(flags(make_policy("fifo")), (False, False, False, True))
    self.assertEqual(flags(make_policy("lookahead")), (True, True, True, True))
    self.assertEqual(flags(make_policy("none")), (False, False, False, False))

  def test_a_policy_that_ignores_the_window_may_evict_hinted_chunks(self):
    es = entries({"a": (ROOT, 1), "b": (ROOT, 2)})
    p = make_policy("lru")
    p.hint([["a"]])
    self.assertEqual(p.victims(es, 10), ["a"])
    q = make_policy("lru", tier=True)
    q.hint([["a"]])
    self.assertEqual(q.victims(es, 10), ["b"])

  def test_unknown_name(self):
    with self.assertRaisesRegex(ValueError, "unknown placement policy 'belady'"):
      make_policy("belady", tier=True)


if __name__ == "__main__":
  absltest.main()
