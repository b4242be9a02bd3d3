"""The layer axis of Cake: the meeting chunk split along layers, exact plans.

Cost models are frozen (`learn=False`): compute costs 1 s per 16-token chunk anywhere, and a
100-byte chunk takes 1.5 s on the link. The model has L = 4 layers; compute may take k = 1, 2
or 3 of them. With chunks 0..3 stored and two loads in flight, the token-only plan computes
chunks 0-2 (3 s) and loads chunk 3 (lands at 1.5 s): the prefix is done at 3 s. Split along
layers, chunk 2 computes layers [0, 2) (0.5 s, done at 2.5 s) while the link moves its layers
[2, 4) (0.75 s after chunk 3, landing at 2.25 s): done at 2.5 s. The split is decided when
the link is within a step of reaching the chunk (at 0.5 s; at 0 s it waits), on that step's
rates.
"""

from absl.testing import absltest

from kvjax.scheduler import (CakeMerge, ChunkState, CostModel, InsertItem, LoadConfig,
                             LoadItem, LoadReport, LoadVerdict, PrefillChunk, Request,
                             SamplingParams, Scheduler, SchedulerConfig, StepResult, StoredChunk,
                             StoredPrefix, Candidate, Writer)
from kvjax.scheduler import layer_split

C, L, POINTS = 16, 4, (1, 2, 3)
COST = CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False, bandwidth_bytes_per_s=100 / 1.5)


def merge(**kw):
  return CakeMerge(65, C, [True] * 4, chunk_nbytes=100, max_loads_in_flight=2, num_layers=L,
                   layer_split_points=POINTS, **kw)


def start(m):
  """Chunk 3 loads whole at 0 s; compute takes chunk 0; chunk 2 is split at 0.5 s."""
  assert m.next_load(0.0, COST) == 3
  assert m.next_load(0.0, COST) is None  # the link reaches chunk 2 at 1.5 s: decided later
  assert m.next_compute(16, [16], 0.0, COST) == (0, 16)
  assert m.next_load(0.5, COST) == 2
  assert m.next_load(0.5, COST) is None


def land(m, index, now, ok=True):
  verdict = m.load_done(index, ok, 100, now)
  if verdict is LoadVerdict.INSERT:
    m.inserted(index)
  return verdict


class BestLayersTest(absltest.TestCase):

  def test_balances_the_two_sides(self):
    # compute [2, 3), link [1.5, 3.0): k = 2 gives max(2.5, 2.25).
    self.assertEqual(layer_split.best_layers(2.0, 3.0, 1.5, 3.0, 4, POINTS), (2.5, 2))

  def test_a_free_link_loads_whole_and_a_slow_one_computes_whole(self):
    self.assertEqual(layer_split.best_layers(3.0, 4.0, 0.0, 1.5, 4, POINTS), (3.0, 0))
    self.assertEqual(layer_split.best_layers(0.0, 1.0, 0.0, 9.0, 4, POINTS), (1.0, 4))

  def test_ties_take_the_larger_k(self):
    # Equal sides: done(k) = max(k / 4, 1 - k / 4) is least at k = 2; loading whole and
    # computing whole tie at 1.0, and compute takes it (as token-only Cake does).
    self.assertEqual(layer_split.best_layers(0.0, 1.0, 0.0, 1.0, 4, POINTS), (0.5, 2))
    self.assertEqual(layer_split.best_layers(0.0, 1.0, 0.0, 1.0, 4, ()), (1.0, 4))
    # done(3) = max(0.75, 1.0) ties computing whole (1.0): the larger k, 4.
    self.assertEqual(layer_split.best_layers(0.0, 1.0, 0.0, 4.0, 4, (1, 3)), (1.0, 4))

  def test_split_bytes_and_points_are_checked(self):
    self.assertEqual(layer_split.split_nbytes(100, 4, 2), 50)
    self.assertEqual(layer_split.check_points([1, 2], 4), (1, 2))
    self.assertEqual(layer_split.check_points((), 0), ())
    for bad in ((0,), (4,), (2, 1), (1, 1)):
      with self.assertRaisesRegex(ValueError, "layer split points"):
        layer_split.check_points(bad, 4)
    with self.assertRaisesRegex(ValueError, "num_layers"):
      LoadConfig(layer_split_points=(1,), num_layers=0)


class MergeLayerSplitTest(absltest.TestCase):

  def test_the_meeting_chunk_is_split_and_the_prefix_done_sooner(self):
    m = merge()
    start(m)
    self.assertEqual((m.load_layer_start(3), m.load_nbytes(3)), (0, 100))
    self.assertEqual((m.load_layer_start(2), m.load_nbytes(2)), (2, 50))
    self.assertEqual((m.split_layers(2), m.trace.layer_splits), (2, {2: 2}))
    self.assertIsNone(m.compute_layers(0))
    self.assertEqual(m.next_compute(16, [16], 1.0, COST), (16, 16))
    self.assertIs(land(m, 3, 1.5), LoadVerdict.INSERT)
    # Chunk 2: its layers [0, 2) only.
    self.assertEqual(m.next_compute(16, [16], 2.0, COST), (32, 16))
    self.assertEqual(m.compute_layers(32), 2)
    self.assertFalse(m.is_prefix_done)
    # Its high layers have not landed: nothing above it may run.
    self.assertIsNone(m.next_compute(16, [16], 2.1, COST))
    self.assertIs(land(m, 2, 2.25), LoadVerdict.INSERT)
    self.assertTrue(m.is_prefix_done)
    self.assertEqual(m.next_compute(16, [16], 2.5, COST), (64, 1))
    self.assertEqual(m.chunk_writers(), "CCSL")
    self.assertNotIn(Writer.NONE, m.writer_map())
    self.assertEqual((m.trace.chunks_computed, m.trace.chunks_loaded), ([0, 1], [3, 2]))

  def test_high_layers_landing_first_then_low_layers(self):
    m = merge()
    start(m)
    land(m, 3, 0.6)
    land(m, 2, 0.7)  # RESIDENT, but its low layers are compute's: the frontier stops there
    self.assertEqual([m.next_compute(16, [16], t, COST) for t in (1.0, 2.0, 3.0)],
                     [(16, 16), (32, 16), (64, 1)])
    self.assertEqual(m.compute_layers(32), 2)
    self.assertEqual(m.chunk_writers(), "CCSL")

  def test_a_rejected_split_load_is_computed_whole(self):
    m = merge()
    start(m)
    steps = [m.next_compute(16, [16], t, COST) for t in (1.0, 2.0)]
    self.assertEqual(steps, [(16, 16), (32, 16)])
    land(m, 3, 1.5)
    self.assertIs(land(m, 2, 2.25, ok=False), LoadVerdict.REJECTED)
    self.assertEqual(m.split_layers(2), 0)
    self.assertEqual(m.next_compute(16, [16], 2.5, COST), (32, 16))  # all layers now
    self.assertIsNone(m.compute_layers(32))
    self.assertEqual(m.next_compute(16, [16], 3.5, COST), (64, 1))
    self.assertEqual(m.chunk_writers(), "CCCL")
    self.assertEqual(m.trace.chunks_rejected, [2])

  def test_a_late_split_load_is_given_up_and_its_chunk_computed_whole(self):
    m = merge()
    start(m)
    for t in (1.0, 2.0):
      m.next_compute(16, [16], t, COST)
    land(m, 3, 1.5)
    self.assertIsNone(m.next_compute(16, [16], 2.5, COST))  # waits for its high layers
    self.assertEqual(m.next_compute(16, [16], 100.0, COST), (32, 16))  # late: all layers
    self.assertIs(m.states[2], ChunkState.COMPUTED)
    self.assertIs(land(m, 2, 101.0), LoadVerdict.WASTED)
    self.assertEqual(m.next_compute(16, [16], 101.0, COST), (64, 1))
    self.assertEqual(m.chunk_writers(), "CCCL")

  def test_no_split_behind_more_than_one_load_of_its_own(self):
    # A 0.25 s link and four loads in flight: at 0 s chunks 3, 2, 1 go whole (landing at 0.25,
    # 0.5 and 0.75 s). Chunk 0 would balance at k = 3 (compute 0.75 s, its high layers at
    # 0.81 s), but three loads are ahead of it: on a wrong rate they land late and compute,
    # waiting for its high layers, idles. It is left to compute, whole.
    fast = CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False, bandwidth_bytes_per_s=400.0)
    m = CakeMerge(65, C, [True] * 4, chunk_nbytes=100, max_loads_in_flight=4, num_layers=L,
                  layer_split_points=POINTS)
    self.assertEqual([m.next_load(0.0, fast) for _ in range(4)], [3, 2, 1, None])
    self.assertEqual(m.trace.layer_splits, {})
    self.assertEqual(m.next_compute(16, [16], 0.0, fast), (0, 16))
    self.assertIsNone(m.compute_layers(0))
    for j, t in ((3, 0.25), (2, 0.5), (1, 0.75)):
      land(m, j, t)
    self.assertEqual(m.next_compute(16, [16], 1.0, fast), (64, 1))
    self.assertEqual(m.chunk_writers(), "CLLL")

  def test_no_split_when_planned_jointly(self):
    # The same merge told a backlog (joint planning with other restoring requests; here one
    # that frees both sides now, so only the rule differs from `start`) loads chunk 2 whole
    # or computes it: never splits.
    m = merge()
    m.set_backlog(0.0, 0.0)
    self.assertEqual(m.next_load(0.0, COST), 3)
    self.assertEqual(m.next_compute(16, [16], 0.0, COST), (0, 16))
    m.next_load(0.5, COST)
    self.assertEqual((m.trace.layer_splits, m.split_layers(2)), ({}, 0))

  def test_off_plans_token_only(self):
    m = CakeMerge(65, C, [True] * 4, chunk_nbytes=100, max_loads_in_flight=2, num_layers=L)
    self.assertEqual([m.next_load(0.0, COST) for _ in range(2)], [3, None])
    self.assertEqual(m.next_compute(16, [16], 0.0, COST), (0, 16))
    self.assertIsNone(m.next_load(0.5, COST))
    self.assertEqual(m.trace.layer_splits, {})

  def test_only_a_layer_sliceable_encoding_is_split(self):
    for sliceable, want in ((True, (2, 50)), (False, None)):
      enc = [(Candidate("raw/0", 100, 0, layer_sliceable=sliceable),)] * 4
      m = CakeMerge(65, C, [True] * 4, encodings=enc, max_loads_in_flight=2, num_layers=L,
                    layer_split_points=POINTS)
      self.assertEqual(m.next_load(0.0, COST), 3)
      self.assertEqual(m.next_compute(16, [16], 0.0, COST), (0, 16))
      got = m.next_load(0.5, COST)
      self.assertEqual(got and (m.load_layer_start(got), m.load_nbytes(got)), want)


class SchedulerLayerSplitTest(absltest.TestCase):

  def test_plans_carry_the_layer_ranges(self):
    s = Scheduler(SchedulerConfig(num_slots=1, token_budget=16, chunk_sizes=(16,)), COST,
                  load_config=LoadConfig(max_loads_in_flight=2, max_loads_ahead=2,
                                         check_writes=True, layer_split_points=POINTS,
                                         num_layers=L))
    cand = (Candidate("raw/0", 100, 0, layer_sliceable=True),)
    s.add_request(Request("x", list(range(65)), SamplingParams(max_tokens=1)),
                  StoredPrefix(C, tuple(StoredChunk("host", cand) for _ in range(4))))
    plans = []
    # (step start, step end, loads landed during it: chunk, bytes, when)
    for t, end, landed in ((0.0, 1.0, ()), (1.0, 2.0, ((3, 100, 1.5),)),
                           (2.0, 2.5, ((2, 50, 2.25),)), (2.5, 2.6, ())):
      plan = s.schedule(now_s=t)
      plans.append(plan)
      s.update(StepResult(now_s=end, sampled=tuple(
          (c.request_id, 1) for c in plan.prefills if c.is_last), loads=tuple(
          LoadReport("x", j, True, nb, tier="host", done_s=at, link_s=1.5 * nb / 100)
          for j, nb, at in landed)))
    # Chunk 3 loads whole at 0 s; chunk 2 is split when the link nears it (1 s): layers
    # [2, 4) on the link, [0, 2) computed.
    self.assertEqual([p.loads for p in plans],
                     [(LoadItem("x", 3, "raw/0", 100, 2),),
                      (LoadItem("x", 2, "raw/0", 50, 2, layer_start=2),), (), ()])
    self.assertEqual([p.prefills for p in plans],
                     [(PrefillChunk("x", 0, 0, 16, False),),
                      (PrefillChunk("x", 0, 16, 16, False),),
                      (PrefillChunk("x", 0, 32, 16, False, num_layers=2),),
                      (PrefillChunk("x", 0, 64, 1, True),)])
    self.assertEqual(plans[2].prefills[0].saves, ())
    self.assertEqual([p.inserts for p in plans],
                     [(), (), (InsertItem("x", 3, 0, 48),),
                      (InsertItem("x", 2, 0, 32, layer_start=2),)])
    self.assertEqual(s.merge("x").chunk_writers(), "CCSL")


if __name__ == "__main__":
  absltest.main()
