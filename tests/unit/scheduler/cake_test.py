"""The Cake planner: chunk states, verdicts, exact compute steps, and exact scheduler plans.

Cost models are frozen (`learn=False`) so every decision is hand-checkable: compute costs
1 s per 16-token chunk anywhere; FAST loads land at once (loads always help, compute waits for
them), SLOW loads never help.
"""

import sys

from absl.testing import absltest, parameterized

from kvjax.scheduler import cake_forecast
from kvjax.scheduler.kv_cache_manager import KVCacheManager
from kvjax.testing.plans import plan_steps, prefills
from kvjax.scheduler import (CakeMerge, Candidate, ChunkState, CostModel, DecodeItem,
                             LoadConfig, LoadReport, StepResult, StoredChunk, StoredPrefix,
                             DoubleWriteError, LoadVerdict, PrefillChunk, Request,
                             SamplingParams, Scheduler, SchedulerConfig, Writer, ideal_merge_s)

T, F = True, False
C = 16


def model(bandwidth_bytes_per_s):
  return CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False,
                   bandwidth_bytes_per_s=bandwidth_bytes_per_s)


FAST, SLOW = model(1e12), model(1e-3)
#: A stored chunk's bytes where a FAST link derives how many loads go ahead: the derived count is
#: capped by the staging budget over a chunk's bytes (1 GiB / 100 B is ten million loads ahead,
#: which cost seconds a step in the forecast; 1 MiB gives 1024), and any count above a request's
#: stored chunks plans the same.
MIB = 1 << 20


def land(merge, index, now, ok=True, nbytes=100):
  verdict = merge.load_done(index, ok, nbytes, now)
  if verdict is LoadVerdict.INSERT:
    merge.inserted(index)
  return verdict


def steps(merge, budget, now, sizes=(16, 32), cost=FAST):
  """Every step `merge` plans in one scheduler step of `budget` tokens."""
  out = []
  while (s := merge.next_compute(budget, sizes, now, cost)) is not None:
    out.append(s)
    budget -= s[1]
  return out


class CakeMergeTest(parameterized.TestCase):

  def test_compute_only_is_chunked_prefill(self):
    m = CakeMerge(65, C, [T] * 4, "compute_only")
    self.assertIsNone(m.next_load(0.0, FAST))
    self.assertEqual(steps(m, 64, 0.0), [(0, 32), (32, 32)])
    self.assertEqual(steps(m, 64, 1.0), [(64, 1)])
    self.assertEqual(m.chunk_writers(), "CCCC")
    self.assertEqual(m.trace.chunks_computed, [0, 1, 2, 3])
    self.assertEqual((m.trace.meeting_index, m.trace.loads_issued), (4, 0))
    self.assertTrue(m.is_done)

  def test_a_released_load_is_in_the_trace_and_the_chunk_a_hit_again(self):
    m = CakeMerge(130, C, [T, T, T, T], chunk_nbytes=100, max_loads_in_flight=4)
    self.assertEqual([m.next_load(0.0, FAST) for _ in range(2)], [3, 2])
    m.load_dropped(2, 0.1)
    self.assertIs(land(m, 3, 0.2), LoadVerdict.INSERT)
    t = m.trace
    self.assertEqual((t.loads_issued, t.chunks_released, t.chunks_wasted, t.chunks_rejected),
                     (2, [2], [], []))
    self.assertIs(m.states[2], ChunkState.HIT)

  def test_holes_rejects_and_resident_runs(self):
    #        chunk: 0  1  2  3  4  5  6  7   suffix [128, 130)
    m = CakeMerge(130, C, [F, F, T, T, F, T, T, T], chunk_nbytes=100, max_loads_in_flight=8)
    self.assertEqual([m.next_load(0.0, FAST) for _ in range(6)], [7, 6, 5, 3, 2, None])
    self.assertEqual(m.in_flight, (7, 6, 5, 3, 2))
    # Holes 0 and 1 are compute's; chunk 2 is loading and lands first: compute stops there.
    self.assertEqual(steps(m, 64, 0.0), [(0, 32)])
    self.assertIs(land(m, 7, 0.5), LoadVerdict.INSERT)
    self.assertIs(land(m, 3, 0.5, ok=False), LoadVerdict.REJECTED)
    self.assertIs(m.states[3], ChunkState.MISSING)
    for j in (2, 6, 5):
      self.assertIs(land(m, j, 0.5), LoadVerdict.INSERT)
    # Skip resident 2, compute the rejected 3 and the hole 4 (ending on the boundary before the
    # resident run 5..7), skip that run, compute the suffix tail.
    self.assertEqual(steps(m, 64, 1.0), [(48, 32), (128, 2)])
    self.assertEqual(m.chunk_writers(), "CCLCCLLL")
    self.assertNotIn(Writer.NONE, m.writer_map())
    t = m.trace
    self.assertEqual((t.chunks_computed, t.chunks_loaded, t.chunks_rejected),
                     ([0, 1, 3, 4], [7, 2, 6, 5], [3]))
    self.assertEqual((t.meeting_index, t.loaded_bytes, t.wasted_bytes), (2, 400, 0))

  def test_late_load_is_taken_by_compute_and_wasted(self):
    cost = model(4.0)  # 3 bytes: a load takes 0.75 s; compute 1 s per chunk
    m = CakeMerge(33, C, [T, T], chunk_nbytes=3, max_loads_in_flight=1)
    self.assertEqual(m.next_load(0.0, cost), 1)  # lands at 0.75 < 2.0, compute's finish of 1
    self.assertIsNone(m.next_load(0.0, cost))    # one load in flight at most
    # Chunk 0's load would land at 1.5, after compute finishes it at 1.0: compute takes it.
    self.assertEqual(steps(m, 16, 0.0, (16,), cost), [(0, 16)])
    # Chunk 1 is overdue but within its grace: its compute time (1 s) after its predicted landing
    # (0.75 s), which exceeds 2 x 0.75 s (the ski-rental rule): compute waits.
    self.assertEqual(steps(m, 16, 1.0, (16,), cost), [])
    self.assertEqual(m.recheck_s(1.0, cost), 1.75)
    self.assertEqual(steps(m, 16, 1.5, (16,), cost), [])
    self.assertEqual(steps(m, 16, 1.75, (16,), cost), [(16, 16)])
    self.assertEqual(steps(m, 16, 2.75, (16,), cost), [(32, 1)])
    self.assertIs(m.load_done(1, True, 3, 3.0), LoadVerdict.WASTED)
    self.assertEqual((m.trace.chunks_wasted, m.trace.wasted_bytes), ([1], 3))
    self.assertEqual(m.chunk_writers(), "CC")
    with self.assertRaisesRegex(ValueError, "no load in flight"):
      m.load_done(1, True, 3, 3.0)

  def test_load_only_waits_for_every_stored_chunk(self):
    m = CakeMerge(49, C, [T, F, T], "load_only", chunk_nbytes=10)
    self.assertEqual([m.next_load(0.0, SLOW) for _ in range(3)], [2, 0, None])  # no skipping
    self.assertEqual(steps(m, 64, 0.0), [])
    land(m, 2, 5.0)
    self.assertEqual(steps(m, 64, 5.0), [])
    land(m, 0, 9.0)
    self.assertEqual(steps(m, 64, 9.0), [(16, 16), (48, 1)])
    self.assertEqual(m.chunk_writers(), "LCL")

  def test_a_stored_tail_is_the_last_unit_loaded_first_and_the_suffix_starts_after_it(self):
    # Chunks 0 and 1, then a tail of 5 tokens in chunk 2: the prefix is [0, 37).
    m = CakeMerge(60, C, [T, T, T], "load_only", chunk_nbytes=10, max_loads_in_flight=4,
                  last_unit_tokens=5)
    self.assertEqual((m.prefix_tokens, [m.unit_tokens(j) for j in range(3)]), (37, [16, 16, 5]))
    self.assertEqual([m.next_load(0.0, FAST) for _ in range(4)], [2, 1, 0, None])
    land(m, 2, 1.0)
    self.assertEqual(m.writer_map()[32:38], [Writer.LOAD] * 5 + [Writer.NONE])
    self.assertEqual(steps(m, 64, 1.0), [])  # load-only: chunks 0 and 1 are still loading
    land(m, 0, 2.0)
    land(m, 1, 2.0)
    self.assertEqual(m.frontier, 37)
    # The suffix [37, 60) from the tail's end: up to the chunk boundary (padded), then the rest.
    self.assertEqual(steps(m, 64, 2.0), [(37, 16), (53, 7)])
    self.assertEqual(m.chunk_writers(), "LLL")
    self.assertEqual((m.trace.chunks_loaded, m.trace.chunks_computed), ([2, 0, 1], []))

  def test_compute_that_reaches_a_stored_tail_takes_its_whole_chunk(self):
    m = CakeMerge(60, C, [F, F, T], "cake", chunk_nbytes=10, last_unit_tokens=5)
    self.assertEqual(m.next_load(0.0, SLOW), None)  # the slow link cannot win the tail
    self.assertEqual(steps(m, 64, 0.0, cost=SLOW), [(0, 32), (32, 16), (48, 12)])
    self.assertEqual((m.chunk_writers(), m.trace.chunks_computed), ("CCC", [0, 1, 2]))
    self.assertIs(m.states[2], ChunkState.COMPUTED)
    # Compute stops at a landed tail and goes on from its end.
    t = CakeMerge(60, C, [F, T], "load_only", chunk_nbytes=10, last_unit_tokens=5)
    self.assertEqual(t.next_load(0.0, FAST), 1)
    land(t, 1, 0.0)
    self.assertEqual(steps(t, 64, 0.0, (8, 16, 32)), [(0, 16), (21, 32), (53, 7)])

  def test_steps_cross_store_chunks_only_on_their_boundaries(self):
    m = CakeMerge(49, C, [F, F, F])
    sizes = (8, 16, 32)
    self.assertEqual(steps(m, 24, 0.0, sizes), [(0, 16), (16, 8)])
    # From 24, 32 and 16 would end inside chunk 2: only 8 (to the boundary), then whole chunks.
    self.assertEqual(steps(m, 32, 1.0, sizes), [(24, 8), (32, 16), (48, 1)])

  def test_chunk_size_not_a_multiple_of_compiled_sizes(self):
    m = CakeMerge(49, 24, [F, F])
    self.assertEqual(steps(m, 32, 0.0, (16, 32)), [(0, 16), (16, 8)])  # 8: padded to 16
    self.assertEqual(steps(m, 32, 1.0, (16, 32)), [(24, 16), (40, 8), (48, 1)])

  def test_cancel_releases_in_flight_and_landed_chunks(self):
    m = CakeMerge(65, C, [T] * 4, chunk_nbytes=5, max_loads_in_flight=3)
    self.assertEqual([m.next_load(0.0, FAST) for _ in range(3)], [3, 2, 1])
    self.assertIs(m.load_done(3, True, 5, 0.1), LoadVerdict.INSERT)  # landed, not inserted
    self.assertEqual(m.cancel(), [1, 2, 3])
    self.assertEqual(m.cancel(), [1, 2, 3])  # idempotent
    self.assertIs(m.load_done(2, True, 5, 0.2), LoadVerdict.WASTED)
    self.assertIsNone(m.next_load(0.2, FAST))
    self.assertIsNone(m.next_compute(64, (16,), 0.2, FAST))
    self.assertEqual(m.trace.wasted_bytes, 5)

  def test_writer_map_refuses_a_second_write(self):
    m = CakeMerge(33, C, [F, F])
    self.assertEqual(steps(m, 16, 0.0, (16,)), [(0, 16)])
    with self.assertRaisesRegex(DoubleWriteError, "position 0 written by COMPUTE and again by LOAD"):
      m._write(0, C, Writer.LOAD)  # what an insert over computed positions would do

  def test_encoding_choice_default_deadline_and_ttft_target(self):
    fine, coarse = Candidate("fine", 1000, 0), Candidate("coarse", 100, 1)
    cost = model(1000.0)  # fine: 1 s, coarse: 0.1 s; compute 1 s per chunk
    m = CakeMerge(65, C, [T] * 4, encodings=[(fine, coarse)] * 4)
    # Chunk 3: compute reaches it at 3.0; fine lands at 1.0.
    self.assertEqual(m.next_load(0.0, cost), 3)
    self.assertIs(m.load_encoding(3), fine)
    # Chunk 2: the link is busy until 1.0; fine lands at 2.0 = when compute reaches chunk 2.
    self.assertEqual(m.next_load(0.0, cost), 2)
    self.assertIs(m.load_encoding(2), fine)
    self.assertEqual(m.load_done(3, True, 1000, 1.0), LoadVerdict.INSERT)
    self.assertEqual(m.trace.levels, {3: "fine"})
    # A TTFT target of 0.4 s over 4 chunks leaves 0.1 s for the first: coarse, just in time.
    m = CakeMerge(65, C, [T] * 4, encodings=[(fine, coarse)] * 4, kv_ttft_target_s=0.4)
    self.assertEqual(m.next_load(0.0, cost), 3)
    self.assertIs(m.load_encoding(3), coarse)

  def test_slow_link_loads_only_what_can_help(self):
    # Loads take 3.5 s; compute needs 4 s for all four chunks: only the top chunk can win.
    m = CakeMerge(65, C, [T] * 4, chunk_nbytes=7, max_loads_in_flight=4)
    cost = model(2.0)
    self.assertEqual(m.next_load(0.0, cost), 3)
    self.assertIsNone(m.next_load(0.0, cost))  # chunk 2 would land at 7.0 > 3.0
    self.assertIsNone(CakeMerge(65, C, [T] * 4, chunk_nbytes=9).next_load(0.0, cost))  # 4.5 s

  def cold_merge(self, mode):
    """A fresh engine's first hit: a learning cost model that has seen no load (its 1 GB/s
    link prior is a guess), four stored chunks of 100 B, compute 1 s per 16 tokens."""
    cost = CostModel(compute_prior=(0.0, 1 / C, 0.0))
    self.assertFalse(cost.load_rate_known)
    m = CakeMerge(4 * C + 8, C, [T] * 4, mode, chunk_nbytes=100, max_loads_in_flight=4,
                  compute_share_prior=1.0)
    return m, cost

  def test_cold_start_loads_that_land_within_a_compute_step_are_all_loaded(self):
    # Before the link is observed, compute waits for the first landing up to one compute step
    # (1 s for 16 tokens): loads landing at 10 ms leave compute the suffix alone, the very plan
    # of load_only (bench_defaults b and d: the defaults and load_only planned the same steps).
    plans = {}
    for mode in ("cake", "load_only"):
      m, cost = self.cold_merge(mode)
      self.assertEqual([m.next_load(0.0, cost) for _ in range(5)], [3, 2, 1, 0, None])
      self.assertEqual(steps(m, 64, 0.0, cost=cost), [])
      if mode == "cake":
        self.assertEqual(m.recheck_s(0.0, cost), 1.0)  # the wait is bounded: one step
      for j in (3, 2, 1, 0):
        land(m, j, 0.01)
      cost.observe_load(400, 0.01)
      plans[mode] = (steps(m, 64, 0.01, cost=cost), m.trace.chunks_computed,
                     m.trace.chunks_loaded, m.chunk_writers())
    self.assertEqual(plans["cake"], ([(64, 8)], [], [3, 2, 1, 0], "LLLL"))
    self.assertEqual(plans["cake"], plans["load_only"])

  def test_cold_start_waits_for_the_first_landing_at_most_one_compute_step(self):
    # No landing by 1 s (one 16-token step after the first issue): the link prior is only a
    # guess, so compute stops waiting and takes what the budget allows (chunks 0-3); their
    # loads, landing later, are wasted, and the suffix follows.
    m, cost = self.cold_merge("cake")
    self.assertEqual([m.next_load(0.0, cost) for _ in range(4)], [3, 2, 1, 0])
    self.assertEqual(steps(m, 64, 0.5, cost=cost), [])
    self.assertEqual(steps(m, 64, 1.0, cost=cost), [(0, 16), (16, 16), (32, 16), (48, 16)])
    self.assertEqual([m.load_done(j, True, 100, 1.2) for j in (3, 2, 1, 0)],
                     [LoadVerdict.WASTED] * 4)
    self.assertEqual(steps(m, 64, 2.0, cost=cost), [(64, 8)])
    self.assertEqual((m.trace.chunks_computed, m.trace.chunks_wasted, m.chunk_writers()),
                     ([0, 1, 2, 3], [3, 2, 1, 0], "CCCC"))

  @parameterized.parameters(
      dict(kw=dict(num_prompt_tokens=64, chunk_size=C, hits=[T] * 4), msg="last token"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[T] * 4), msg="chunk_nbytes"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=0, hits=[]), msg="chunk_size=0"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[1]), msg="bools"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[T], chunk_nbytes=[1, 2]),
           msg="chunk_nbytes for 2"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[T], encodings=[()]),
           msg="no candidate"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[], mode="both"), msg="both"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[T], chunk_nbytes=1,
                   last_unit_tokens=C), msg="last_unit_tokens=16"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[], last_unit_tokens=3),
           msg="after at least one unit"),
      dict(kw=dict(num_prompt_tokens=20, chunk_size=C, hits=[T, T], chunk_nbytes=1,
                   last_unit_tokens=4), msg="20 tokens"),
      dict(kw=dict(num_prompt_tokens=65, chunk_size=C, hits=[T, T], chunk_nbytes=1,
                   last_unit_tokens=4, resident=2), msg=r"\[0, 1\] \(whole chunks\)"),
  )
  def test_bad_construction(self, kw, msg):
    with self.assertRaisesRegex(ValueError, msg):
      CakeMerge(**kw)

  def test_bad_calls(self):
    m = CakeMerge(33, C, [T, T], chunk_nbytes=1)
    with self.assertRaisesRegex(ValueError, "budget_tokens=-1"):
      m.next_compute(-1, (16,), 0.0, FAST)
    with self.assertRaisesRegex(ValueError, "chunk_sizes"):
      m.next_compute(16, (32, 16), 0.0, FAST)
    with self.assertRaisesRegex(ValueError, "was not landed"):
      m.inserted(0)
    with self.assertRaisesRegex(ValueError, "no load in flight"):
      m.load_encoding(0)

  def test_ideal_merge(self):
    self.assertEqual(ideal_merge_s([0, 1, 2, 3, 4], [0, 1, 2, 3, 4]), (2, 2))
    self.assertEqual(ideal_merge_s([0, 5, 9], [0, 1, 2]), (2, 0))   # load everything
    self.assertEqual(ideal_merge_s([0, 1, 2], [0, 5, 9]), (2, 2))   # compute everything
    with self.assertRaisesRegex(ValueError, "equal length"):
      ideal_merge_s([0, 1], [0])


class LoadsLandTest(absltest.TestCase):
  """`CakeMerge.loads_land_s` and `tokens_left_after_loads`: what short first-token steps read."""

  def test_predicted_landing_of_every_stored_chunk_still_to_come(self):
    cost = model(160)  # a 100-byte chunk moves in 0.625 s, one at a time
    m = CakeMerge(100, C, [F, T, T, T], chunk_nbytes=100, max_loads_in_flight=2)
    self.assertEqual(m.tokens_left_after_loads(), 100 - 48)  # chunk 0 and the suffix
    self.assertAlmostEqual(m.loads_land_s(1.0, cost), 1.0 + 3 * 0.625)
    self.assertEqual([m.next_load(1.0, cost) for _ in range(2)], [3, 2])
    self.assertAlmostEqual(m.loads_land_s(1.5, cost), 1.0 + 3 * 0.625)
    # Chunk 3 was due at 1.625: overdue at 2.0, so the model is off for it (no prediction).
    self.assertIsNone(m.loads_land_s(2.0, cost))
    # Joint planning's reading: it lands now, and the link model, its bandwidth bounded by
    # the overdue head (1 s for 100 bytes), moves chunk 2 by 3.0 s and chunk 1 by 4.0 s.
    self.assertAlmostEqual(m.loads_land_s(2.0, cost, overdue_lands_now=True), 4.0)
    land(m, 3, 2.0)
    land(m, 2, 2.1)
    self.assertEqual(m.next_load(2.1, cost), 1)
    land(m, 1, 2.2)
    self.assertIsNone(m.loads_land_s(2.3, cost))  # nothing left to load
    self.assertEqual(m.tokens_left_after_loads(), 100 - 48)
    self.assertEqual(steps(m, 16, 2.3), [(0, 16)])
    self.assertEqual(m.tokens_left_after_loads(), 100 - 64)  # the suffix

  def test_free_slots_are_bounded_by_the_chunks_left_to_issue(self):
    # A FAST link over 100-byte chunks derives ten million loads ahead (staging / chunk bytes);
    # the forecast heaps one free slot per stored chunk left to issue, whatever the bound.
    H, L, M = ChunkState.HIT, ChunkState.LOADING, ChunkState.MISSING
    self.assertEqual(cake_forecast.free_slots(10_000_000, 0, [H] * 4), 4)
    self.assertEqual(cake_forecast.free_slots(sys.maxsize, 2, [M, H, H, L, L]), 2)
    self.assertEqual(cake_forecast.free_slots(3, 2, [H, H, H, L, L]), 1)  # the bound binds
    self.assertEqual(cake_forecast.free_slots(2, 2, [H, L, L]), 0)
    self.assertEqual(cake_forecast.free_slots(10_000_000, 1, [L, M, M]), 0)  # nothing to issue

  def test_a_huge_max_loads_in_flight_plans_as_the_stored_chunks_count(self):
    # A bound of sys.maxsize used to build a heap of that many slots each forecast (a
    # MemoryError; ten million: seconds a step). It forecasts and issues exactly as a bound of
    # one slot per stored chunk does.
    cost = model(160)  # a 100-byte chunk moves in 0.625 s, one at a time
    merges = [CakeMerge(100, C, [F, T, T, T], chunk_nbytes=100, max_loads_in_flight=k)
              for k in (3, sys.maxsize)]
    for m in merges:
      self.assertAlmostEqual(m.loads_land_s(1.0, cost), 1.0 + 3 * 0.625)
      self.assertEqual([m.next_load(1.0, cost) for _ in range(4)], [3, 2, 1, None])
      self.assertAlmostEqual(m.loads_land_s(1.5, cost), 1.0 + 3 * 0.625)
    states = [ChunkState.MISSING] + [ChunkState.HIT] * 3
    land_s = [cake_forecast.landings(1.0, cost, {}, float("-inf"), k, states, [100] * 4)
              for k in (3, sys.maxsize)]
    self.assertEqual(land_s[0], land_s[1])
    self.assertEqual(land_s[1][0], {3: 1.625, 2: 2.25, 1: 2.875})


def req(rid, n, max_tokens=4):
  return Request(rid, list(range(n)), SamplingParams(max_tokens=max_tokens))


def stored(hits, nbytes):
  """A lookup result: chunk j stored (one raw encoding of `nbytes`) where hits[j]."""
  return StoredPrefix(C, tuple(StoredChunk("host", (Candidate("raw/0", nbytes, 0),)) if h
                               else None for h in hits))


def landed(rid, indices, now, nbytes=100):
  return StepResult(now_s=now, loads=tuple(LoadReport(rid, j, True, nbytes, tier="host",
                                                      done_s=now) for j in indices))


class SchedulerCakeTest(absltest.TestCase):

  def test_cake_takes_what_decodes_and_ordinary_prefills_leave(self):
    s = Scheduler(SchedulerConfig(num_slots=3, token_budget=64, chunk_sizes=(16, 32, 64)), SLOW)
    a, x = req("a", 20), req("x", 66)
    s.add_request(a)
    s.add_request(x, stored([F, T, T, T], 10))
    plan = s.schedule(now_s=0.0)
    # a: 16 + a 4-token tail; x: 44 left -> 32 (12 fit no compiled size).
    self.assertEqual(plan.prefills, (PrefillChunk("a", 0, 0, 16, False),
                                     PrefillChunk("a", 0, 16, 4, True),
                                     PrefillChunk("x", 1, 0, 32, False)))
    self.assertEqual(plan.prefills[2].token_ids, tuple(range(32)))
    self.assertEqual((x.num_computed_tokens, plan.loads), (32, ()))
    s.update(StepResult(now_s=0.5, sampled=(("a", 5),)))
    b = req("b", 40)
    s.add_request(b)
    plan = s.schedule(now_s=1.0)
    # Decode a (1), admit b (32 + 8 tail), x gets the 23 left -> 16.
    self.assertEqual(plan.decodes, (DecodeItem("a", 0, 20, 5),))
    self.assertEqual(plan.prefills, (PrefillChunk("b", 2, 0, 32, False),
                                     PrefillChunk("b", 2, 32, 8, True),
                                     PrefillChunk("x", 1, 32, 16, False)))
    s.update(StepResult(now_s=1.5, sampled=(("a", 6), ("b", 7))))
    plan = s.schedule(now_s=2.0)
    # Two decodes; x: the last prefix chunk, then its 2-token suffix ends the prompt.
    self.assertEqual(plan.decodes, (DecodeItem("a", 0, 21, 6), DecodeItem("b", 2, 40, 7)))
    self.assertEqual(plan.prefills, (PrefillChunk("x", 1, 48, 16, False),
                                     PrefillChunk("x", 1, 64, 2, True)))
    self.assertEqual((x.num_computed_tokens, x.status.value), (66, "decoding"))
    self.assertEqual(s.merge("x").trace.loads_issued, 0)  # the link could never have helped
    traces = s.update(StepResult(now_s=2.5, sampled=(("x", 8),)))
    self.assertEqual(traces["x"].chunks_computed, [0, 1, 2, 3])  # a snapshot at the first token
    self.assertEqual(s.schedule(now_s=3.0).decodes,  # admission order
                     (DecodeItem("a", 0, 22, 6), DecodeItem("x", 1, 66, 8),
                      DecodeItem("b", 2, 41, 7)))

  def test_loads_queue_ahead_land_and_are_inserted_by_plan(self):
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=32, chunk_sizes=(16, 32)), FAST,
                  load_config=LoadConfig(max_loads_in_flight=2, max_loads_ahead=8,
                                         check_writes=True))
    d, x = req("d", 8), req("x", 130)
    s.add_request(d)
    s.add_request(x, stored([F, F, T, T, F, T, T, T], 100))
    plan = s.schedule(now_s=0.0)
    self.assertEqual(plan.prefills, (PrefillChunk("d", 0, 0, 8, True),
                                     PrefillChunk("x", 1, 0, 16, False)))
    # Every stored chunk is issued at once, last first: the executor refills as they land.
    self.assertEqual([(ld.index, ld.max_in_flight) for ld in plan.loads],
                     [(7, 2), (6, 2), (5, 2), (3, 2), (2, 2)])
    s.update(StepResult(now_s=0.5, sampled=(("d", 1),)))
    s.update(landed("x", (7, 6, 5, 3, 2), 0.6))
    plan = s.schedule(now_s=1.0)
    self.assertEqual([(i.index, i.slot, i.start) for i in plan.inserts],
                     [(2, 1, 32), (3, 1, 48), (5, 1, 80), (6, 1, 96), (7, 1, 112)])
    # x: its second hole; then chunks 2-3 are resident and the budget (31) fits no 16 more.
    self.assertEqual(plan.decodes, (DecodeItem("d", 0, 8, 1),))
    self.assertEqual(plan.prefills, (PrefillChunk("x", 1, 16, 16, False),))
    s.update(StepResult(now_s=1.5, sampled=(("d", 2),)))
    plan = s.schedule(now_s=2.0, token_budget=64)
    self.assertEqual(plan.decodes, (DecodeItem("d", 0, 9, 2),))
    self.assertEqual(plan.prefills, (PrefillChunk("x", 1, 64, 16, False),
                                     PrefillChunk("x", 1, 128, 2, True)))
    self.assertEqual(s.merge("x").chunk_writers(), "CCLLCLLL")

  def test_cake_requests_are_admitted_without_budget_and_cancelled_on_abort(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=32, chunk_sizes=(16, 32)), FAST,
                  load_config=LoadConfig(max_loads_ahead=1))
    x, y = req("x", 65), req("y", 65)
    s.add_request(x, stored([T] * 4, 1))
    s.add_request(y, stored([T] * 4, 1))
    self.assertEqual([r.request_id for r in s.cake_requests(include_waiting=True)], ["x", "y"])
    plan = s.schedule(now_s=0.0, token_budget=0)
    self.assertTrue(plan.is_empty)
    self.assertEqual([(ld.request_id, ld.index) for ld in plan.loads], [("x", 3), ("y", 3)])
    self.assertEqual((x.slot, [r.request_id for r in s.waiting]), (0, ["y"]))
    self.assertIsNotNone(plan.wait_s)  # the executor may block until a load lands
    s.finish_request("x", "abort")
    traces = s.update(StepResult(now_s=0.1, loads=(LoadReport("x", 3, True, 1, done_s=0.1),
                                                   LoadReport("y", 3, True, 1, done_s=0.1))))
    self.assertEqual(traces["x"].chunks_wasted, [3])  # abandoned at the abort
    plan = s.schedule(now_s=0.2)
    self.assertEqual(plan.finished_request_ids, ("x",))
    self.assertEqual(plan.prefills, ())  # y admitted; FAST loads beat compute
    self.assertEqual(y.slot, 0)

  def test_a_first_steps_loads_are_judged_at_the_compute_share_it_will_get(self):
    # Compute: 1 s per 16 tokens alone; the merge gets 4 of 16 tokens a step (share 1/4), so
    # chunk 0 takes it 4 s. Loads: 0.4 s a chunk, last first: chunk 0 lands at 1.2 s. At a full
    # share compute would finish chunk 0 at 1.0 s, first: judged so (before the step's budget
    # was known) the load was skipped, then compute at its real share waited for it, a whole
    # step (simulate_cake's 2K cell at 8 B*, share 12.5%: 0.86x load-only, now 1.00x).
    cost = model(250.0)
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=16, chunk_sizes=(4, 16)), cost,
                  load_config=LoadConfig(max_loads_ahead=4))
    s.add_request(req("x", 49), stored([T] * 3, 100))
    plan = s.schedule(now_s=0.0, token_budget=4)
    self.assertEqual([ld.index for ld in plan.loads], [2, 1, 0])
    self.assertEqual(plan.prefills, ())  # compute waits: every chunk lands by 1.2 s
    self.assertAlmostEqual(s.merge("x").compute_share, 0.25)

  def plan_steps(self, s, steps, land_loads=True, start=0):
    """Each of `steps` planned steps' prefills as (request id, start, tokens)
    (`kvjax.testing.plans.plan_steps`)."""
    return [prefills(p) for p in plan_steps(s, steps, start, land_loads)]

  def test_long_prefill_threshold_lets_a_hits_tail_share_a_cold_prefills_steps(self):
    plans = {}
    for t in (0, 32):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                    long_prefill_token_threshold=t, prefill_order="fcfs"), FAST)
      s.add_request(req("a", 200))                   # a cold prompt
      s.add_request(req("x", 66), stored([T] * 4, MIB))  # a store hit: its 2-token tail computes
      plans[t] = self.plan_steps(s, 4)
    # Off, first come first served: x's chunks land and go in at step 1, but a fills every
    # step until its last, so x's tail (and its first token) waits for step 3.
    self.assertEqual(plans[0], [[("a", 0, 64)], [("a", 64, 64)], [("a", 128, 64)],
                                [("a", 192, 8), ("x", 64, 2)]])
    # 32: a takes 32 a step, and x's tail goes in the step its chunks are inserted.
    self.assertEqual(plans[32], [[("a", 0, 32)], [("a", 32, 32), ("x", 64, 2)],
                                 [("a", 64, 32)], [("a", 96, 32)]])

  def test_shortest_first_computes_a_met_hits_tail_before_a_cold_prefill(self):
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)), FAST)
    self.assertEqual(s.config.prefill_order, "shortest_first")  # the default
    s.add_request(req("a", 200))
    s.add_request(req("x", 66), stored([T] * 4, MIB))
    # x's chunks go in at step 1 and leave it 2 tokens to compute: its tail goes first in that
    # very step, ahead of a's 136 left (x's first token two steps sooner than first come first
    # served). Its first token comes with the step, so the step stays short: a takes one
    # smallest chunk (16) after it. Then a takes pieces of what x's decodes leave (one token a
    # step), and ends a step later than first come first served.
    self.assertEqual(self.plan_steps(s, 5), [[("a", 0, 64)],
                                             [("x", 64, 2), ("a", 64, 16)],
                                             [("a", 80, 32), ("a", 112, 16)],
                                             [("a", 128, 32), ("a", 160, 16)],
                                             [("a", 176, 16), ("a", 192, 8)]])
    # Without short first-token steps, a takes the step's whole rest and ends in step 3.
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                  short_first_token_steps=False), FAST)
    s.add_request(req("a", 200))
    s.add_request(req("x", 66), stored([T] * 4, MIB))
    self.assertEqual(self.plan_steps(s, 4), [[("a", 0, 64)],
                                             [("x", 64, 2), ("a", 64, 32), ("a", 96, 16)],
                                             [("a", 112, 32), ("a", 144, 16)],
                                             [("a", 160, 32), ("a", 192, 8)]])

  def test_a_cold_prefills_step_ends_when_a_hits_loads_land(self):
    # Compute costs 1 s per 16 tokens; x's four 100-byte chunks take 2.5 s over the link.
    plans = {}
    for short in (True, False):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                    short_first_token_steps=short), model(160))
      s.add_request(req("a", 200))
      plans[short] = self.plan_steps(s, 1)
      s.add_request(req("x", 66), stored([T] * 4, 100))
      plans[short] += self.plan_steps(s, 3, start=1)
    # Step 1: x (2 tokens left once its loads are in, fewer than a's 136) is admitted and its
    # first three loads are issued (the link's bandwidth-delay product); its four chunks are
    # predicted to land in 2.5 s, so a takes 32 tokens (2 s), not 64 (4 s). Step 2: the last
    # load, 0.625 s: a takes one smallest chunk. Step 3: x's chunks are in and its tail goes
    # first; its first token comes with the step, so a takes one smallest chunk after it.
    self.assertEqual(plans[True], [[("a", 0, 64)], [("a", 64, 32)], [("a", 96, 16)],
                                   [("x", 64, 2), ("a", 112, 16)]])
    self.assertEqual(plans[False], [[("a", 0, 64)], [("a", 64, 64)], [("a", 128, 64)],
                                    [("x", 64, 2), ("a", 192, 8)]])

  def test_two_hits_tails_in_one_short_step_do_not_split_each_other(self):
    plans = {}
    for joint in (False, True):
      s = Scheduler(SchedulerConfig(num_slots=3, token_budget=64, chunk_sizes=(16, 32, 64)),
                    FAST, load_config=LoadConfig(joint_planning=joint))
      s.add_request(req("a", 200))
      s.add_request(req("x", 66), stored([T] * 4, MIB))  # 2 new tokens
      s.add_request(req("y", 84), stored([T] * 4, MIB))  # 20 new tokens
      plans[joint] = self.plan_steps(s, 3)
    # Planned alone, step 1: x's 2 end its prompt, so the longer prefills after it take 16 at
    # most; y's 20 are within twice that (32): y is short too and goes whole; a takes 16.
    self.assertEqual(plans[False], [[("a", 0, 64)],
                                    [("x", 64, 2), ("y", 64, 16), ("y", 80, 4), ("a", 64, 16)],
                                    [("a", 80, 32), ("a", 112, 16)]])
    # Jointly (the default), y is a merge behind x's first token: with no fixed cost per step,
    # each of its tokens there would delay that token and save y nothing
    # (`cake_joint.beside_first_token_s`), so its tail goes whole in the next step.
    self.assertEqual(plans[True], [[("a", 0, 64)],
                                   [("x", 64, 2), ("a", 64, 16)],
                                   [("y", 64, 16), ("y", 80, 4), ("a", 80, 16)]])

  def test_no_short_step_for_a_hit_with_more_left_than_the_cold_prefill_or_slow_loads(self):
    for x_tokens, cost in ((400, model(160)), (66, SLOW)):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)), cost)
      s.add_request(req("a", 200))
      self.plan_steps(s, 1)
      s.add_request(req("x", x_tokens), stored([T] * 4, 100))
      # 336 tokens left after x's loads (more than a's 136), or loads that never land in time:
      # a's step is whole.
      self.assertEqual(self.plan_steps(s, 1, start=1, land_loads=False), [[("a", 64, 64)]],
                       x_tokens)

  def waiting_step(self, short, bandwidth):
    """d decodes (its 8-token prompt took step 0, steps are 1 s apart); hit x (four stored
    100-byte chunks, 2 new tokens) arrives before step 1. Returns the scheduler and step 1's
    plan."""
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                  short_first_token_steps=short), model(bandwidth),
                  load_config=LoadConfig(max_loads_in_flight=4, max_loads_ahead=4))
    s.add_request(req("d", 8))
    self.plan_steps(s, 1)
    s.add_request(req("x", 66), stored([T] * 4, 100))
    return s, s.schedule(now_s=1.0)

  def test_a_step_waits_for_a_hits_loads_that_land_within_half_a_step(self):
    # 1,000 B/s: x's chunks land one after another, the last 0.4 s from now, within half the
    # last computing step (1 s). Step 1 computes nothing (d's decode waits) and the executor
    # may block for half a step; the next step, at 1.4 s, inserts x's chunks and computes its
    # tail with d's decode. Without the rule d decodes in step 1 and x's tail waits for the
    # step after, at 2.0 s.
    for short in (True, False):
      s, plan = self.waiting_step(short, 1000.0)
      self.assertEqual([(ld.request_id, ld.index) for ld in plan.loads],
                       [("x", 3), ("x", 2), ("x", 1), ("x", 0)], short)
      self.assertEqual(s.running["x"].slot, 1)  # admitted: its loads need no budget
      if short:
        self.assertEqual((plan.decodes, plan.prefills), ((), ()))
        self.assertAlmostEqual(plan.wait_s, 0.5)
      else:
        self.assertEqual(plan.decodes, (DecodeItem("d", 0, 8, 1),))
        self.assertIsNone(plan.wait_s)
      s.update(landed("x", (3, 2, 1, 0), 1.4))
      now = 1.4 if short else 2.0
      plan = s.schedule(now_s=now)
      self.assertEqual([i.index for i in plan.inserts], [0, 1, 2, 3], short)
      self.assertEqual(plan.prefills, (PrefillChunk("x", 1, 64, 2, True),), short)
      self.assertEqual(plan.decodes, (DecodeItem("d", 0, 8 + (not short), 1),), short)
      self.assertIsNone(plan.wait_s)

  def test_waiting_steps_insert_what_lands_and_stop_after_half_a_step(self):
    # Chunks 3 and 2 land at 1.2 s: inserted, and the run waits on (0.3 s more at most).
    s, plan = self.waiting_step(True, 1000.0)
    s.update(landed("x", (3, 2), 1.2))
    plan = s.schedule(now_s=1.2)
    self.assertEqual((plan.decodes, [i.index for i in plan.inserts]), ((), [2, 3]))
    self.assertAlmostEqual(plan.wait_s, 0.3)
    # Chunks 1 and 0 are late (the model said 1.4 s): at 1.45 s the run still waits; at 1.5 s
    # half a step has passed and d decodes (x's tail waits for its chunks).
    s.update(StepResult(now_s=1.45))
    self.assertEqual(s.schedule(now_s=1.45).decodes, ())
    s.update(StepResult(now_s=1.5))
    plan = s.schedule(now_s=1.5)
    self.assertEqual((plan.decodes, plan.prefills), ((DecodeItem("d", 0, 8, 1),), ()))
    self.assertIsNone(plan.wait_s)

  def test_no_waiting_step_for_loads_past_half_a_step(self):
    # 500 B/s: the last chunk lands 0.8 s from now, past half a step: d decodes.
    _, plan = self.waiting_step(True, 500.0)
    self.assertEqual(plan.decodes, (DecodeItem("d", 0, 8, 1),))
    self.assertIsNone(plan.wait_s)

  def test_a_merge_preempted_in_the_step_that_inserts_its_chunks_inserts_none(self):
    # "fcfs": a's 32 need 2 blocks; "shortest_first": x's 2-token suffix goes first, a gets a
    # 16-token piece of the 30 left and needs 1 block. The pool has none free either way.
    for order, a_step in (("fcfs", ("a", 32, 32)), ("shortest_first", ("a", 32, 16))):
      kvm = KVCacheManager(7, 16, namespace_root="ab" * 32)  # 112 tokens in all
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=32, chunk_sizes=(16, 32),
                                    prefill_order=order), FAST, kv_cache=kvm)
      s.add_request(req("a", 100))                       # 2 blocks at step 0, 2 more at step 1
      s.add_request(req("x", 66), stored([T] * 4, MIB))  # 5 blocks at admission (its prompt)
      plan = s.schedule(now_s=0.0)
      self.assertEqual([ld.index for ld in plan.loads], [3, 2, 1, 0], order)
      s.update(landed("x", [3, 2, 1, 0], 0.5))
      # Step 1 plans x's four inserts first; then a's blocks preempt x, the newest, and its
      # inserts (and suffix) leave the plan with it (its blocks are freed).
      plan = s.schedule(now_s=1.0)
      self.assertEqual(plan.preempted, ("x",), order)
      self.assertEqual(plan.inserts, (), order)
      self.assertEqual([(c.request_id, c.start, c.num_tokens) for c in plan.prefills],
                       [a_step], order)
      self.assertEqual([r.request_id for r in s.waiting], ["x"], order)

  def test_shortest_first_keeps_a_loading_merges_compute_after_ordinary_prefills(self):
    for order in ("fcfs", "shortest_first"):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                    prefill_order=order, short_first_token_steps=False), SLOW)
      s.add_request(req("a", 200))
      s.add_request(req("x", 66), stored([T] * 4, 100))
      # Loads never land: x's merge still loads, so its compute side (Cake's adaptive mode)
      # takes only what a leaves, whichever the order; a is never delayed. (Short first-token
      # steps would keep a's last step short, x's compute included: tested on their own.)
      self.assertEqual(self.plan_steps(s, 4, land_loads=False),
                       [[("a", 0, 64)], [("a", 64, 64)], [("a", 128, 64)],
                        [("a", 192, 8), ("x", 0, 32), ("x", 32, 16)]], order)

  def test_long_prefill_threshold_caps_a_merges_compute(self):
    plans = {}
    for t in (0, 32):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64),
                                    long_prefill_token_threshold=t), SLOW,  # compute it all
                    load_config=LoadConfig(joint_planning=False))
      s.add_request(req("x", 100), stored([F, T, T, T, T, T], 100))
      s.add_request(req("y", 40), stored([T, T], 100))
      plans[t] = self.plan_steps(s, 4, land_loads=False)
    # Off: merges planned alone take what is left oldest first, so y starts in x's last step.
    self.assertEqual(plans[0], [[("x", 0, 64)], [("x", 64, 32), ("x", 96, 4), ("y", 0, 16)],
                                [("y", 16, 16), ("y", 32, 8)], []])
    # 32: each merge's compute takes 32 a step at most; y's 8 left are under the threshold.
    # Step 1: y's prefix is all planned, so its 8 left (shortest first) go ahead of x's 68;
    # they end y's prefill, so the step's rest is one smallest chunk (short first-token steps).
    self.assertEqual(plans[32], [[("x", 0, 32), ("y", 0, 32)], [("y", 32, 8), ("x", 32, 16)],
                                 [("x", 48, 32)], [("x", 80, 16), ("x", 96, 4)]])

  def test_bad_requests_and_budgets(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=32, chunk_sizes=(16, 32)))
    with self.assertRaisesRegex(ValueError, "cover the last token"):
      s.add_request(req("y", 64), stored([T] * 4, 1))
    with self.assertRaisesRegex(ValueError, "token_budget=-1"):
      s.schedule(token_budget=-1)
    s.add_request(req("z", 65), stored([T] * 4, 1))
    with self.assertRaisesRegex(ValueError, "already scheduled"):
      s.add_request(req("z", 65))
    with self.assertRaisesRegex(ValueError, "needs now_s"):
      s.schedule()
    self.assertEqual([r.request_id for r in s.waiting], ["z"])  # nothing changed


if __name__ == "__main__":
  absltest.main()
