"""The Cake merge on the deterministic simulator: meeting points, failures, baselines, bounds.

Hand-computable cells use 16-token store chunks, one or two chunks per step, flat or linear
compute costs, a link whose per-chunk time is a power of two, and a frozen cost model equal to
the truth, so TTFTs are exact. The realistic cells use the measured SmolLM2 CPU curve (0.69 s
per 256-token chunk at position 0 to 3.40 s at 7936) with a learning model.
"""

import dataclasses
import math

from absl.testing import absltest, parameterized

from kvjax.scheduler import CostModel, MergeMode, SchedulerConfig, ideal_merge_s
from kvjax.testing.cake_sim import (ChunkCosts, LinkScript, PiecewiseConstant, SimRequest,
                                    ideal_bound, load_curve_s, simulate, warm_cost_model)

C = 16
NB = 64  # stored bytes of a chunk


def flat(bandwidth, *, c=0.0):
  """1 s per 16-token chunk (+ c s/token/position) and a frozen model that knows it."""
  costs = ChunkCosts.linear(0.0, 1 / C, c)
  model = CostModel(compute_prior=(0.0, 1 / C, c), learn=False,
                    bandwidth_bytes_per_s=bandwidth)
  return costs, model


def run(spec, costs, model, link, *, budget=C, sizes=(16,), budget_script=None):
  out = simulate([spec], costs=costs, link=link, chunk_size=C, cost_model=model,
                 scheduler_config=SchedulerConfig(num_slots=2, token_budget=budget,
                                                  chunk_sizes=sizes),
                 budget=budget_script)
  return out, out.results[spec.request_id]


class ExactCellsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # Four chunks plus a 1-token suffix (1/16 s). T = seconds per chunk load.
      ("meet_in_the_middle", 64.0, MergeMode.CAKE, 2 + 1 / 16, "CCLL", 2),
      ("slower_link", 32.0, MergeMode.CAKE, 3 + 1 / 16, "CCCL", 3),
      ("fast_link_skips_compute", 4096.0, MergeMode.CAKE, 4 / 64 + 1 / 16, "LLLL", 0),
      ("slow_link_skips_loads", 8.0, MergeMode.CAKE, 4 + 1 / 16, "CCCC", 4),
      ("compute_only", 64.0, MergeMode.COMPUTE_ONLY, 4 + 1 / 16, "CCCC", 4),
      ("load_only", 64.0, MergeMode.LOAD_ONLY, 4 + 1 / 16, "LLLL", 0),
      ("load_only_fast", 4096.0, MergeMode.LOAD_ONLY, 4 / 64 + 1 / 16, "LLLL", 0),
  )
  def test_ttft(self, bandwidth, mode, ttft, writers, meeting):
    costs, model = flat(bandwidth)
    spec = SimRequest("a", 4 * C + 1, [True] * 4, mode, chunk_nbytes=NB)
    _, res = run(spec, costs, model, LinkScript.constant(bandwidth, max_in_flight=1))
    self.assertEqual(res.ttft_s, ttft)
    self.assertEqual((res.chunk_writers, res.meeting_index), (writers, meeting))
    self.assertEqual((res.unwritten_positions, res.trace.chunks_wasted), (0, []))

  @parameterized.named_parameters(
      # 2 s a chunk on the link: token-only computes chunks 0-2 (3 s) and loads chunk 3. Split
      # along L = 4 layers, chunk 2 computes 3 of them (0.75 s, to 2.75 s) while the link moves
      # its last layer (0.5 s after chunk 3, to 2.5 s).
      ("split", (1, 2, 3), 2.75 + 1 / 16, "CCSL", {2: 3}),
      ("off", (), 3 + 1 / 16, "CCCL", {}),
  )
  def test_layer_split_of_the_meeting_chunk(self, points, ttft, writers, splits):
    costs, model = flat(32.0)
    spec = SimRequest("a", 4 * C + 1, [True] * 4, chunk_nbytes=NB)
    out = simulate([spec], costs=costs, link=LinkScript.constant(32.0, max_in_flight=1),
                   chunk_size=C, cost_model=model, num_layers=4, layer_split_points=points,
                   scheduler_config=SchedulerConfig(num_slots=2, token_budget=C,
                                                    chunk_sizes=(16,)))
    res = out.results["a"]
    self.assertEqual(res.ttft_s, ttft)
    self.assertEqual((res.chunk_writers, res.trace.layer_splits), (writers, splits))
    self.assertEqual((res.unwritten_positions, res.trace.chunks_wasted), (0, []))

  def test_skip_sides(self):
    costs, model = flat(4096.0)
    _, res = run(SimRequest("a", 65, [True] * 4, chunk_nbytes=NB), costs, model,
                 LinkScript.constant(4096.0, max_in_flight=1))
    self.assertEqual(res.trace.chunks_computed, [])        # loads finish everything first
    costs, model = flat(8.0)                                # 8 s per load, 4 s of compute
    _, res = run(SimRequest("a", 65, [True] * 4, chunk_nbytes=NB), costs, model,
                 LinkScript.constant(8.0, max_in_flight=1))
    self.assertEqual(res.trace.loads_issued, 0)
    costs, model = flat(64 / 3.5)                           # 3.5 s: only the top chunk can win
    _, res = run(SimRequest("a", 65, [True] * 4, chunk_nbytes=NB), costs, model,
                 LinkScript.constant(64 / 3.5, max_in_flight=4))
    self.assertEqual((res.trace.loads_issued, res.chunk_writers), (1, "CCCL"))
    self.assertEqual(res.ttft_s, 3.5 + 1 / 16)

  def test_a_wrong_bandwidth_prior_costs_at_most_one_step(self):
    # The model believes 1 GB/s; the link needs 8 s per chunk. Compute waits one step (1 s) for
    # the first landing, then computes everything; the load lands at 8 s as waste.
    costs, _ = flat(8.0)
    model = CostModel(compute_prior=(0.0, 1 / C, 0.0), bandwidth_bytes_per_s=1e9)
    _, res = run(SimRequest("a", 65, [True] * 4, chunk_nbytes=NB), costs, model,
                 LinkScript.constant(8.0, max_in_flight=1))
    self.assertEqual(res.ttft_s, 1 + 4 + 1 / 16)
    self.assertEqual((res.chunk_writers, res.trace.chunks_wasted), ("CCCC", [3]))

  def test_missing_middle_chunk_is_computed_between_loads(self):
    costs, model = flat(4096.0)  # 1/64 s per load
    spec = SimRequest("a", 8 * C + 1, [True, True, True, False, True, True, True, True],
                      chunk_nbytes=NB)
    _, res = run(spec, costs, model, LinkScript.constant(4096.0, max_in_flight=1))
    self.assertEqual(res.chunk_writers, "LLLCLLLL")
    self.assertEqual(res.ttft_s, 7 / 64 + 1 + 1 / 16)  # chunk 0 lands 7th, then chunk 3, suffix
    self.assertEqual(res.unwritten_positions, 0)

  def test_rejected_chunk_mid_load_becomes_a_hole(self):
    costs, model = flat(4096.0)
    spec = SimRequest("a", 8 * C + 1, [True] * 8, chunk_nbytes=NB, reject=frozenset({3}))
    _, res = run(spec, costs, model, LinkScript.constant(4096.0, max_in_flight=1))
    self.assertEqual((res.chunk_writers, res.trace.chunks_rejected), ("LLLCLLLL", [3]))
    self.assertEqual(res.ttft_s, 8 / 64 + 1 + 1 / 16)

  def test_stalled_link_late_load_is_wasted(self):
    costs, model = flat(4096.0)
    # Two chunks move (1/64 s each), then the link stalls for 100 s.
    link = LinkScript(PiecewiseConstant((0.0, 2 / 64, 100.0), (4096.0, 0.0, 4096.0)), 1)
    _, res = run(SimRequest("a", 4 * C + 1, [True] * 4, chunk_nbytes=NB), costs, model, link)
    # Chunk 1's load (moving from 2/64, expected at 3/64) is given up one chunk's compute (1 s)
    # after it was due (the ski-rental rule; chunk 0 queued behind it goes with it): compute
    # takes chunks 0 and 1, one compute step later than a 2x-latency rule would, still a step
    # ahead of compute-only (4 + 1/16); the load lands at 100 + 1/64 as waste.
    self.assertEqual(res.chunk_writers, "CCLL")
    self.assertEqual(res.ttft_s, 2 / 64 + 1 + 2 + 1 / 16)
    self.assertLess(res.ttft_s, 4 + 1 / 16)
    self.assertEqual((res.trace.chunks_wasted, res.trace.wasted_bytes), ([1], NB))


def meeting_link(m, n_chunks, costs):
  """A per-chunk load time T that makes compute and loads meet at chunk boundary m.

  Compute takes chunk j iff it finishes it no later than its load lands: C(j + 1) <= (N - j) T.
  The first j where that fails is the meeting point; T is the middle of the interval that makes
  it m.
  """
  c = [0.0]
  for j in range(n_chunks):
    c.append(c[-1] + costs.compute_s(j * C, C))
  lo = c[m] / (n_chunks - m + 1) if m else 0.0
  hi = c[m + 1] / (n_chunks - m) if m < n_chunks else math.inf
  t = 2 * lo if math.isinf(hi) else (hi / 2 if m == 0 else (lo + hi) / 2)
  return t, c


class MeetingPointTest(parameterized.TestCase):

  @parameterized.product(m=list(range(9)), two_chunk_steps=[False, True])
  def test_meeting_forced_at_every_boundary(self, m, two_chunk_steps):
    n_chunks = 8
    costs, _ = flat(1.0, c=1 / (C * 64))  # chunk j costs 1.117 + j / 4 s
    t, c = meeting_link(m, n_chunks, costs)
    bandwidth = NB / t
    _, model = flat(bandwidth, c=1 / (C * 64))
    spec = SimRequest("a", n_chunks * C + 1, [True] * n_chunks, chunk_nbytes=NB)
    link = LinkScript.constant(bandwidth, max_in_flight=1)
    kw = dict(budget=2 * C, sizes=(16, 32)) if two_chunk_steps else {}
    _, res = run(spec, costs, model, link, **kw)
    self.assertEqual(res.meeting_index, m)
    self.assertEqual(res.chunk_writers, "C" * m + "L" * (n_chunks - m))
    self.assertEqual((res.unwritten_positions, res.trace.chunks_wasted), (0, []))
    suffix = costs.compute_s(n_chunks * C, 1)
    self.assertAlmostEqual(res.ttft_s, max(c[m], (n_chunks - m) * t) + suffix, places=9)
    # And that is the ideal bound of this link and these costs.
    ideal, best = ideal_merge_s(c, load_curve_s(link, NB, n_chunks))
    self.assertAlmostEqual(res.ttft_s, ideal + suffix, places=9)
    self.assertEqual(best, m)


CURVE = [0.69 + (3.40 - 0.69) * j / 31 for j in range(32)]  # SmolLM2-135M f32, 2 CPU cores
RAW = 30 * 2 * 256 * 3 * 64 * 4                              # bytes of a raw f32 chunk
SIZES = (16, 32, 64, 128, 256, 512)
REAL_C = 256


def real_cell(seq_len, ratio, share, link=None, budget_script=None):
  costs = ChunkCosts.from_chunk_curve(REAL_C, CURVE)
  n_chunks = (seq_len - 1) // REAL_C
  b_star = n_chunks * RAW / sum(costs.compute_s(j * REAL_C, REAL_C) for j in range(n_chunks))
  link = link or LinkScript.constant(ratio * b_star)
  if budget_script is None and share < 512:
    budget_script = PiecewiseConstant.constant(share)
  cfg = SchedulerConfig(num_slots=2, token_budget=512, chunk_sizes=SIZES)
  spec = SimRequest("a", seq_len, [True] * n_chunks, chunk_nbytes=RAW)
  out = {}
  for mode in MergeMode:
    model = warm_cost_model(costs, chunk_sizes=SIZES, max_position=seq_len,
                            bandwidth_bytes_per_s=ratio * b_star, nbytes=RAW)
    sim = simulate([dataclasses.replace(spec, mode=mode)], costs=costs, link=link,
                   scheduler_config=cfg, chunk_size=REAL_C, cost_model=model,
                   budget=budget_script)
    out[mode] = (sim.results["a"], sim.max_step_s)
  ideal = ideal_bound(spec, costs=costs, link=link, scheduler_config=cfg, chunk_size=REAL_C,
                      budget=budget_script)
  return out, ideal


class RealisticCellsTest(parameterized.TestCase):

  @parameterized.product(seq_len=[2048, 4096], ratio=[0.25, 1.0, 4.0], share=[64, 512])
  def test_within_one_step_of_the_ideal_and_never_behind_a_baseline(self, seq_len, ratio, share):
    out, ideal = real_cell(seq_len, ratio, share)
    cake, step_s = out[MergeMode.CAKE]
    self.assertLessEqual(cake.ttft_s, ideal.ttft_s + step_s)
    best_baseline = min(out[MergeMode.COMPUTE_ONLY][0].ttft_s, out[MergeMode.LOAD_ONLY][0].ttft_s)
    self.assertLessEqual(cake.ttft_s, best_baseline + 1e-9)
    self.assertEqual(cake.unwritten_positions, 0)

  def test_bandwidth_fluctuation_moves_the_meeting_point(self):
    seq_len, costs = 4096, ChunkCosts.from_chunk_curve(REAL_C, CURVE)
    n_chunks = (seq_len - 1) // REAL_C
    b_star = n_chunks * RAW / sum(costs.compute_s(j * REAL_C, REAL_C) for j in range(n_chunks))
    meetings = {}
    for name, after in (("drop", b_star / 8), ("steady", b_star), ("rise", 8 * b_star)):
      link = LinkScript(PiecewiseConstant((0.0, 3.0), (b_star, after)))
      out, ideal = real_cell(seq_len, 1.0, 512, link=link)
      cake, step_s = out[MergeMode.CAKE]
      self.assertLessEqual(cake.ttft_s, ideal.ttft_s + step_s, name)
      meetings[name] = cake.meeting_index
    # A slower link leaves more chunks to compute, a faster one fewer, with no retuning.
    self.assertGreater(meetings["drop"], meetings["steady"])
    self.assertGreater(meetings["steady"], meetings["rise"])

  def test_compute_budget_fluctuation_moves_the_meeting_point(self):
    meetings = {}
    for name, budget in (("steady", None),
                         ("squeezed", PiecewiseConstant((0.0, 3.0), (512, 64)))):
      out, ideal = real_cell(4096, 1.0, 512, budget_script=budget)
      cake, step_s = out[MergeMode.CAKE]
      self.assertLessEqual(cake.ttft_s, ideal.ttft_s + step_s, name)
      meetings[name] = cake.meeting_index
    self.assertLess(meetings["squeezed"], meetings["steady"])  # less compute: loads take more


class SimulatorTest(absltest.TestCase):

  def test_link_script_integrates_piecewise_bandwidth(self):
    link = LinkScript(PiecewiseConstant((0.0, 1.0, 3.0), (100.0, 0.0, 50.0)))
    self.assertEqual(link.transfer_end_s(0.0, 50), 0.5)
    self.assertEqual(link.transfer_end_s(0.5, 100), 4.0)   # 50 B by 1 s, stall, 50 B by 4 s
    self.assertEqual(LinkScript(PiecewiseConstant((0.0,), (0.0,))).transfer_end_s(0, 1), math.inf)
    with self.assertRaisesRegex(ValueError, "ascending starts from 0"):
      PiecewiseConstant((1.0,), (2.0,))

  def test_deterministic_and_with_competing_requests(self):
    costs, model = flat(64.0)
    reqs = [SimRequest("a", 65, [True] * 4, chunk_nbytes=NB),
            SimRequest("p", 40, None, arrival_s=0.5, max_tokens=3),
            SimRequest("b", 65, [True] * 4, chunk_nbytes=NB, arrival_s=1.0)]
    cfg = SchedulerConfig(num_slots=3, token_budget=32, chunk_sizes=(16, 32))
    first = simulate(reqs, costs=costs, link=LinkScript.constant(64.0, 1), chunk_size=C,
                     cost_model=model, scheduler_config=cfg)
    again = simulate(reqs, costs=costs, link=LinkScript.constant(64.0, 1), chunk_size=C,
                     cost_model=flat(64.0)[1], scheduler_config=cfg)
    self.assertEqual({k: r.ttft_s for k, r in first.results.items()},
                     {k: r.ttft_s for k, r in again.results.items()})
    for rid in ("a", "b"):
      self.assertEqual(first.results[rid].unwritten_positions, 0)
    self.assertIsNotNone(first.results["p"].ttft_s)


if __name__ == "__main__":
  absltest.main()
