"""Joint Cake planning (`kvjax/scheduler/cake_joint.py`): the split against a backlog, the
priority order with its aging, each merge's backlog, and the scheduler's exact plans for several
requests restoring at once.

Cost models are frozen (`learn=False`): compute costs 1 s per 16-token chunk anywhere, a load
0.5 s per 100-byte chunk (200 B/s), so every figure is hand-checkable.
"""

import math

from absl.testing import absltest

from kvjax.scheduler import (CakeMerge, Candidate, CostModel, LoadConfig, Request,
                             SamplingParams, Scheduler, SchedulerConfig, StoredChunk,
                             StoredPrefix, cake_forecast, cake_joint)
from kvjax.scheduler.output import ComputeTiming, StepResult, StepTiming
from kvjax.testing.plans import plan_steps, prefills

T, F = True, False
C = 16
INF = math.inf


def model(bandwidth_bytes_per_s):
  return CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False,
                   bandwidth_bytes_per_s=bandwidth_bytes_per_s)


COST = model(200.0)  # a 100-byte chunk loads in 0.5 s; a chunk computes in 1 s


def req(rid, n, arrival_s=0.0):
  return Request(rid, list(range(n)), SamplingParams(max_tokens=4), arrival_s=arrival_s)


def stored(hits, nbytes=100):
  return StoredPrefix(C, tuple(StoredChunk("host", (Candidate("raw/0", nbytes, 0),)) if h
                               else None for h in hits))


class SplitAtTest(absltest.TestCase):

  def test_the_split_alone_and_behind_a_busy_link(self):
    # Units compute in 1 s and load in 0.5 s; the suffix takes 0.25 s. Alone: compute unit 0
    # while units 1-2 load (1 s each side). With the link busy until 1 s, m = 1 and m = 2 tie
    # at 2.25 s: the smallest wins.
    self.assertEqual(cake_forecast.split_at([1, 1, 1], [0.5] * 3, 0.25, 0.0, 0.0),
                     (1.25, 1, 1.0, 1.25))
    self.assertEqual(cake_forecast.split_at([1, 1, 1], [0.5] * 3, 0.25, 0.0, 1.0),
                     (2.25, 1, 2.0, 1.25))
    # Compute busy until 2 s: loading everything (m = 0) finishes first, at 2.25 s (m = 1:
    # 3.25 s).
    self.assertEqual(cake_forecast.split_at([1, 1, 1], [0.5] * 3, 0.25, 2.0, 0.0),
                     (2.25, 0, 1.5, 0.25))

  def test_a_hole_is_compute_s_whatever_the_split(self):
    # Unit 1 cannot load: every split owes its 1 s; all tie at 2.25 s, m = 0 wins.
    self.assertEqual(cake_forecast.split_at([1, 1, 1], [0.5, INF, 0.5], 0.25, 0.0, 0.0),
                     (2.25, 0, 1.0, 1.25))

  def test_bad_lengths(self):
    with self.assertRaisesRegex(ValueError, "one of each per unit"):
      cake_forecast.split_at([1, 1], [0.5], 0.0, 0.0, 0.0)

  def test_largest_fitting(self):
    f = COST.predict_compute_s  # 1/16 s a token
    fits = lambda n: f(0, n) <= 2.5  # noqa: E731
    self.assertEqual(cake_joint.largest_fitting(64, (16, 32, 64), fits), 32)
    self.assertEqual(cake_joint.largest_fitting(40, (16, 32, 64), fits), 40)  # the offer itself
    self.assertEqual(cake_joint.largest_fitting(64, (16, 32, 64), lambda n: f(0, n) <= 0.5), 0)

  def test_a_step_is_priced_padded_to_its_bucket(self):
    # 1 s a step and 1/1600 s a token: 16 tokens and a decode take 1.010625 s as 17 tokens,
    # 1.02 s padded to a bucket of 32. A 15-token piece beside them fills the padding: it adds
    # only... nothing (no attention term); a 16th token grows the step into the bucket of 64.
    gpu = CostModel(compute_prior=(1.0, 1 / 1600, 0.0), learn=False, bandwidth_bytes_per_s=1e-3)
    pieces = [(0, 16), (32, 1)]
    self.assertEqual(cake_joint.step_s([], gpu), 0.0)
    self.assertAlmostEqual(cake_joint.step_s(pieces, gpu), 1.010625)
    self.assertAlmostEqual(cake_joint.step_s(pieces, gpu, (8, 16, 32, 64)), 1.02)
    self.assertAlmostEqual(cake_joint.added_s(pieces, 64, 15, gpu, (8, 16, 32, 64)), 0.0)
    self.assertAlmostEqual(cake_joint.added_s(pieces, 64, 16, gpu, (8, 16, 32, 64)), 0.02)
    self.assertAlmostEqual(cake_joint.added_s(pieces, 64, 16, gpu), 0.01)
    self.assertAlmostEqual(cake_joint.added_s([], 64, 16, gpu, (8, 16, 32, 64)), 1.01)
    self.assertEqual([cake_joint.padded_tokens(n, (8, 16, 512)) for n in (1, 9, 16, 17, 600)],
                     [8, 16, 16, 512, 600])


class JointPlanTest(absltest.TestCase):

  def merges(self):
    a = CakeMerge(49, C, [T] * 3, chunk_nbytes=100)  # alone: 1.0625 s (m = 1)
    b = CakeMerge(81, C, [T] * 5, chunk_nbytes=100)  # alone: 2.0625 s (m = 1)
    return a, b

  def test_shortest_remaining_first_and_each_ones_backlog(self):
    a, b = self.merges()
    plan = cake_joint.plan([("b", 0.0, b), ("a", 0.0, a)], 0.0, COST, 1.0)
    self.assertEqual(plan, [
        # a first: it computes chunk 0 (1 s) and its 1-token suffix while chunks 1-2 load.
        cake_joint.JointEntry("a", 1.0625, 0.0, 0.0, 1.0625, 1),
        # b behind it: compute free at 1.0625 s, the link at 1 s; its best split still
        # computes chunk 0 and loads chunks 1-4 (2 s from 1 s).
        cake_joint.JointEntry("b", 2.0625, 1.0625, 1.0, 3.0625, 1)])

  def test_aging_a_request_that_waited_goes_first(self):
    # b arrived 5 s ago: its key (arrival + remaining) is -2.94 s, a's 1.06 s.
    a, b = self.merges()
    plan = cake_joint.plan([("a", 0.0, a), ("b", -5.0, b)], 0.0, COST, 1.0)
    self.assertEqual([(e.request_id, e.key_s) for e in plan], [("b", -2.9375), ("a", 1.0625)])
    self.assertEqual((plan[1].compute_free_s, plan[1].link_free_s), (1.0625, 2.0))

  def test_a_smaller_compute_share_prices_compute_slower(self):
    # At share 1/4 a chunk computes in 4 s and a token's suffix in 0.25 s: both load
    # everything, a first (1.75 s); b's loads start when a's end (1.5 s): 4.25 s.
    a, b = self.merges()
    plan = cake_joint.plan([("b", 0.0, b), ("a", 0.0, a)], 0.0, COST, 0.25)
    self.assertEqual([(e.request_id, e.meeting_index, e.finish_s) for e in plan],
                     [("a", 0, 1.75), ("b", 0, 4.25)])
    self.assertEqual((plan[1].compute_free_s, plan[1].link_free_s), (0.25, 1.5))


class MergeBacklogTest(absltest.TestCase):

  def test_a_step_queued_behind_others_is_not_taken_as_its_share(self):
    # Offered nothing at 0 s, then 16 tokens at 1 s. Alone, the empty step says its compute
    # got none of the step's wall time: the share halves. Queued behind another restoring
    # request's compute (joint planning), the step says nothing about its share.
    shares = []
    for backlog in (None, (5.0, 0.0)):
      m = CakeMerge(49, C, [T] * 3, chunk_nbytes=100, compute_share_prior=1.0)
      if backlog is not None:
        m.set_backlog(*backlog)
      self.assertIsNone(m.next_compute(0, (16,), 0.0, COST))
      m.next_compute(16, (16,), 1.0, COST)
      shares.append(m.compute_share)
    self.assertEqual(shares, [0.5, 1.0])

  def test_behind_others_no_chunk_the_plan_loads_is_left_part_computed(self):
    # 8 tokens fit the gap: half of 16-token chunk 0, whose other half would follow when the
    # compute ahead is done, at 0.75 s, and end at 1.25 s, before the chunk's load (behind
    # chunks 1-2 on a link free at 0 s) would land at 1.5 s. Head of the plan, or behind with
    # the plan computing chunk 0 (meeting 1), the merge takes them. Behind others with the plan
    # loading chunk 0 (meeting 0) it takes none: the chunk's other 8 would wait for its last
    # step, on its first token's path (it took 8 before).
    got = []
    for backlog in ((-INF, -INF, None), (0.75, 0.0, 1), (0.75, 0.0, 0)):
      m = CakeMerge(49, C, [T] * 3, chunk_nbytes=100, compute_share_prior=1.0)
      m.set_backlog(*backlog)
      got.append(m.next_compute(8, (4, 8, 16), 0.0, COST))
    self.assertEqual(got, [(0, 8), (0, 8), None])
    # A whole chunk stays the plan's to judge.
    m = CakeMerge(49, C, [T] * 3, chunk_nbytes=100, compute_share_prior=1.0)
    m.set_backlog(0.75, 0.0, 0)
    self.assertEqual(m.next_compute(16, (4, 8, 16), 0.0, COST), (0, 16))

  def test_expect_budget_checks_its_input(self):
    m = CakeMerge(49, C, [T] * 3, chunk_nbytes=100)
    with self.assertRaisesRegex(ValueError, "budget >= 0"):
      m.expect_budget(-1, (16,), 0.0)
    m.expect_budget(4, (4, 16), 0.0)
    self.assertEqual(m.compute_share, 0.25)


class SchedulerJointTest(absltest.TestCase):

  def test_the_shorter_restore_takes_the_budget_first(self):
    # Loads never help (a 1e-3 B/s link): both compute everything. Planned alone, x (admitted
    # first) takes the budget and y waits until x's last step; jointly y (8 tokens left after
    # 32) goes first: y's first token at step 0, x's at step 2 (mean 1 step sooner per pair).
    # x adds nothing to y's last step: at 1 s per 16 tokens and no fixed cost per step, each
    # token there would delay y's first token and save x nothing (y's step: 2.5 s, not 3.5).
    plans = {}
    for joint in (False, True):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)),
                    model(1e-3), load_config=LoadConfig(joint_planning=joint))
      s.add_request(req("x", 100), stored([F, T, T, T, T, T]))
      s.add_request(req("y", 40), stored([T, T]))
      plans[joint] = [prefills(p) for p in plan_steps(s, 4, land_loads=False)]
    self.assertEqual(plans[False], [[("x", 0, 64)], [("x", 64, 32), ("x", 96, 4), ("y", 0, 16)],
                                    [("y", 16, 16), ("y", 32, 8)], []])
    self.assertEqual(plans[True], [[("y", 0, 32), ("y", 32, 8)],
                                   [("x", 0, 32), ("x", 32, 16)],
                                   [("x", 48, 32), ("x", 80, 16), ("x", 96, 4)], []])

  def test_beside_a_first_token_only_what_costs_less_than_a_step(self):
    # The same two restores on a machine whose step time is mostly fixed (1 s a step, 1/1600 s
    # a token, an accelerator at small batches): x's piece beside y's last one costs y's first
    # token 0.01 s and saves x most of a step (1 s less the piece's own 0.01 s), so x fills the
    # rest of y's last step. The same with no fixed cost: nothing beside it (the test above).
    # A piece may add x <= a * behind / (behind + 1) to the step.
    gpu = CostModel(compute_prior=(1.0, 1 / 1600, 0.0), learn=False, bandwidth_bytes_per_s=1e-3)
    self.assertEqual(cake_joint.beside_first_token_s(1, gpu), 0.5)
    self.assertEqual(cake_joint.beside_first_token_s(3, gpu), 0.75)
    self.assertEqual(cake_joint.beside_first_token_s(3, model(1e-3)), 0.0)
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)), gpu,
                  load_config=LoadConfig(joint_planning=True))
    s.add_request(req("x", 100), stored([F, T, T, T, T, T]))
    s.add_request(req("y", 40), stored([T, T]))
    self.assertEqual([prefills(p) for p in plan_steps(s, 2, land_loads=False)][0],
                     [("y", 0, 32), ("y", 32, 8), ("x", 0, 16)])

  def test_beside_a_first_token_the_free_room_of_its_bucket(self):
    # 0.12 s a step and 1/160 s a token: beside y's last step (40 tokens) a piece may add
    # 0.06 s (behind = 1). Priced at its tokens, x's 16 add 0.1 s: x gets 8 (0.05 s), which
    # touch its chunk 0, so it owes the chunk's other 8 later anyway. The runner pads the step
    # to a bucket of 64 tokens: x's 24 fill padding it runs anyway (0 s more), its chunk 0 and
    # half of chunk 1 (its loads never help here); 32 would grow the step past the bucket.
    cpu = CostModel(compute_prior=(0.12, 1 / 160, 0.0), learn=False, bandwidth_bytes_per_s=1e-3)
    got = {}
    for buckets in ((), (8, 16, 32, 64)):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(8, 16, 32, 64),
                                    step_buckets=buckets),
                    cpu, load_config=LoadConfig(joint_planning=True))
      s.add_request(req("x", 100), stored([F, T, T, T, T, T]))
      s.add_request(req("y", 40), stored([T, T]))
      got[buckets] = prefills(plan_steps(s, 1, land_loads=False)[0])
    self.assertEqual(got[()], [("y", 0, 32), ("y", 32, 8), ("x", 0, 8)])
    self.assertEqual(got[(8, 16, 32, 64)],
                     [("y", 0, 32), ("y", 32, 8), ("x", 0, 16), ("x", 16, 8)])

  def test_beside_a_first_token_never_a_bucket_more(self):
    # A fit with a 0.7 s floor and 1 ms a token (a busy machine's fit: its floor is not
    # identified) lets a piece add 0.35 s beside y's last step (behind = 1), and x's 64 tokens
    # add 0.064 s as priced. But y's 64 tokens fill their bucket: x's would grow the step to
    # 128, which only the fit's split of a step into floor and tokens calls cheap. Without
    # buckets (no padding known) the rule stands on the fit alone.
    busy = CostModel(compute_prior=(0.7, 1e-3, 0.0), learn=False, bandwidth_bytes_per_s=1e-3)
    got = {}
    for buckets in ((), (16, 32, 64, 128)):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=128, chunk_sizes=(16, 32, 64),
                                    step_buckets=buckets),
                    busy, load_config=LoadConfig(joint_planning=True))
      s.add_request(req("x", 100), stored([F, T, T, T, T, T]))
      s.add_request(req("y", 64), stored([T, T, T]))
      got[buckets] = prefills(plan_steps(s, 1, land_loads=False)[0])
    self.assertEqual(got[()], [("y", 0, 64), ("x", 0, 64)])
    self.assertEqual(got[(16, 32, 64, 128)], [("y", 0, 64)])

  def test_the_steps_of_the_request_ahead_end_when_it_needs_them(self):
    # x: 2 stored chunks and a 9-token suffix; y: 6 stored chunks and a 1-token suffix; a
    # chunk loads in 1 s and computes in 1 s, no fixed cost per step. Step 0: x computes
    # chunk 0 while chunk 1 loads (lands at 1 s): y adds nothing, for the step must end by
    # then (y's chunk 0 beside it would end it at 2 s and hold x's suffix a step). Step 1:
    # x's prefix is all present, its suffix is planned among the prefills and samples x's
    # first token: y adds nothing beside it (each token would delay that first token and save
    # y no step's fixed cost). Planned before these rules, y took 16 tokens in both steps.
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)),
                  model(100.0), load_config=LoadConfig(joint_planning=True))
    s.add_request(req("x", 41), stored([T, T]))
    s.add_request(req("y", 97), stored([T] * 6))
    self.assertEqual([(prefills(p), [(ld.request_id, ld.index) for ld in p.loads])
                      for p in plan_steps(s, 4)],
                     [([("x", 0, 16)], [("x", 1), ("y", 5), ("y", 4), ("y", 3), ("y", 2)]),
                      ([("x", 32, 9)], [("y", 1)]),
                      ([], [("y", 0)]),
                      ([("y", 96, 1)], [])])

  def test_behind_an_overdue_load_the_step_stays_short(self):
    # As above, but x's chunk 1 (due at 1 s) has not landed at 1.25 s: x waits for it, and the
    # step must not hold x's suffix behind y's compute. Once a load is overdue its landing is
    # now, as the link model has it (`CakeMerge.loads_land_s`): y adds nothing. Planned with
    # no landing predicted for x, y took 48 tokens: a step of 3 s that x's suffix waits behind.
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)),
                  model(100.0), load_config=LoadConfig(joint_planning=True))
    s.add_request(req("x", 41), stored([T, T]))
    s.add_request(req("y", 97), stored([T] * 6))
    self.assertEqual(prefills(plan_steps(s, 1, land_loads=False)[0]), [("x", 0, 16)])
    self.assertEqual(prefills(s.schedule(now_s=1.25)), [])

  def test_loads_of_the_request_behind_wait_for_the_link(self):
    # Two identical restores; a chunk loads in 0.5 s and computes in 1 s, a step takes 1 s, so
    # each request keeps 4 loads ahead (the link's bandwidth-delay product + 1). Planned alone
    # both issue at step 0 and split the link. Jointly x goes first (its split: compute chunks
    # 0-1, load 2-5, the link busy until 2 s); y's loads wait until the link is predicted free
    # within the issue horizon (one step and the latency), at step 1.
    loads = {}
    for joint in (False, True):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=16, chunk_sizes=(16,)), COST,
                    load_config=LoadConfig(joint_planning=joint))
      s.add_request(req("x", 97), stored([T] * 6))
      s.add_request(req("y", 97), stored([T] * 6))
      loads[joint] = [[(ld.request_id, ld.index) for ld in p.loads]
                      for p in plan_steps(s, 2)]
    self.assertEqual(loads[False], [[("x", 5), ("x", 4), ("x", 3), ("x", 2), ("y", 5),
                                     ("y", 4), ("y", 3), ("y", 2)],
                                    [("x", 1), ("y", 1), ("y", 0)]])
    self.assertEqual(loads[True], [[("x", 5), ("x", 4), ("x", 3), ("x", 2)],
                                   [("x", 1), ("y", 5), ("y", 4), ("y", 3), ("y", 2)]])

  def test_one_restoring_request_plans_the_same_either_way(self):
    plans = {}
    for joint in (False, True):
      s = Scheduler(SchedulerConfig(num_slots=2, token_budget=32, chunk_sizes=(16, 32)), COST,
                    load_config=LoadConfig(joint_planning=joint))
      s.add_request(req("x", 97), stored([T] * 6))
      plans[joint] = [(prefills(p), [ld.index for ld in p.loads])
                      for p in plan_steps(s, 6)]
    self.assertEqual(plans[True], plans[False])

  def test_bad_option(self):
    with self.assertRaisesRegex(ValueError, "joint_planning"):
      LoadConfig(joint_planning=1)


class StepObservationTest(absltest.TestCase):
  """`Scheduler.update` teaches the cost model whole steps, as `step_s` prices them."""

  def test_a_step_is_one_observation(self):
    cost = CostModel()
    s = Scheduler(SchedulerConfig(num_slots=2, token_budget=64, chunk_sizes=(16, 32, 64)), cost)
    chunks = (ComputeTiming(0, 32, 0.5), ComputeTiming(96, 16, 0.25))
    s.update(StepResult(now_s=1.0, compute=chunks,
                        step=StepTiming(((0, 32), (96, 16)), 64, 0.75)))
    self.assertEqual(cost.num_compute_observations, 1)
    whole = CostModel()
    whole.observe_step(((0, 32), (96, 16)), 64, 0.75)
    self.assertEqual(cost.compute_coefficients, whole.compute_coefficients)
    # A call that compiled, or that ran a layer-split chunk's low layers, teaches nothing.
    for step in (StepTiming(((0, 32),), 32, 9.0, includes_compile=True),
                 StepTiming(((0, 32),), 32, 0.1, full_depth=False)):
      s.update(StepResult(now_s=2.0, compute=chunks, step=step))
    self.assertEqual(cost.num_compute_observations, 1)
    # An executor that reports chunks only (the simulator): each one its own step.
    s.update(StepResult(now_s=3.0, compute=chunks))
    self.assertEqual(cost.num_compute_observations, 3)


if __name__ == "__main__":
  absltest.main()
