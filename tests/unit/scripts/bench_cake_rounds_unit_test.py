"""scripts/bench_cake.py's rounds and validity on a scripted bench (no model, no engine).

A fake `Bench` returns `Run` records with hand-set timings: compute-only computes one 256-token
chunk per second, load-only lands one prefix chunk per second from the back, so the ideal bound
of a 2,048-token prompt (7 prefix chunks) is max(C(4), L(3)) = 4 s + the 1 s suffix + 0.1 s for
the first token = 5.1 s, in every round.
"""

import pathlib
import sys

from absl import flags
from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import bench_cake as bc  # noqa: E402  pylint: disable=wrong-import-position
import benchlib  # noqa: E402  pylint: disable=wrong-import-position

N, CHUNK, PREFIX = 2048, 256, 7


class FakeBench:
  """Scripted runs; `calls` is the order the modes ran in (with their link ratio)."""

  codec = "raw"

  def __init__(self, kvjax_ttfts, kvjax_cpu=1.0, behind_s=(), split_ttfts=()):
    self.kvjax_ttfts = list(kvjax_ttfts)
    self.split_ttfts = list(split_ttfts)  # --layer_split auto: the runs that may split
    self.behind_s = list(behind_s)  # --restoring: each other request's TTFT, this much later
    self.kvjax_cpu = kvjax_cpu  # CPU share of the kvjax runs (the others get 1.0)
    self.calls = []

  def prefix_bytes(self, ids):
    del ids
    return PREFIX * 100, [100] * PREFIX

  def run(self, mode, ids, *, share_at=None, link=None, cap_s=None, more=(), layer_split=False):
    del share_at, cap_s
    self.more = [len(x) for x in more]
    self.calls.append((mode if link is None else f"{mode}@{link[1] / 100:g}")
                      + ("/split" if layer_split else ""))
    prefills, landings, ttft = [], [], None
    if mode == "compute_only":
      prefills = [(j * CHUNK, CHUNK, float(j), j + 1.0) for j in range(len(ids) // CHUNK)]
      ttft = 8.1
    elif mode == "load_only":
      landings = [(j, 0.0, float(PREFIX - j), 100, True) for j in range(PREFIX)]
      prefills = [(PREFIX * CHUNK, CHUNK, 7.0, 8.0)]
      ttft = 8.1
    else:
      ttft = (self.split_ttfts if layer_split else self.kvjax_ttfts).pop(0)
    return bc.Run(mode=mode, seq_len=len(ids), ttft_s=ttft, censored=False, lookup_s=0.0,
                  first_token_id=7, merge=None, num_loaded_tokens=0, num_computed_tokens=0,
                  prefills=prefills, landings=landings, inserts=[], steps=[(0.0, 1.0, 1e-4)],
                  other_prefills=[], wall_s=ttft,
                  cpu_cores=self.kvjax_cpu if mode == "cake" else 1.0, loadavg_1m=0.5,
                  ttft_per_request_s=[ttft] + [ttft + d for d in self.behind_s][:len(more)],
                  first_tokens=[7] * (1 + len(more)))


class Bar:

  def set_description(self, text):
    del text

  def update(self, n):
    del n


class GridBlockRoundsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()  # the script's flag defaults (chunk 256, budget 512)

  def block(self, kvjax_ttfts, kvjax_cpu=1.0):
    bench = FakeBench(kvjax_ttfts, kvjax_cpu)
    cells, kv_runs, order = bc.grid_block(bench, [list(range(N))], N, 100.0, ["1"], 3, Bar())
    return bench, cells, kv_runs, order

  def test_settings_run_in_rotated_rounds_after_the_b_star_run(self):
    bench, cells, kv_runs, order = self.block([5.5, 5.6, 5.4])
    self.assertEqual(order, [["compute_only", "load_only@1", "cake@1"],
                             ["load_only@1", "cake@1", "compute_only"],
                             ["cake@1", "compute_only", "load_only@1"]])
    self.assertEqual(bench.calls, ["compute_only"] + [m for names in order for m in names])
    self.assertLen(kv_runs, 3)
    (cell,) = cells
    self.assertAlmostEqual(cell["b_star_bytes_per_s"], 100.0)  # 700 bytes in 7 s
    self.assertSequenceAlmostEqual(cell["ttft_ideal_reps_s"], [5.1, 5.1, 5.1])
    self.assertEqual(cell["summary"]["kvjax"]["median"], 5.5)
    self.assertAlmostEqual(cell["summary"]["kvjax"]["spread"], 0.2 / 5.5)
    self.assertAlmostEqual(cell["speedup_vs_best"], 8.1 / 5.5)
    self.assertEqual(cell["cpu_cores"]["cake"], [1.0, 1.0, 1.0])
    self.assertFalse(cell["invalid"])
    bc.mark_invalid(cell)  # keeps the rounds' verdict
    self.assertFalse(cell["invalid"])
    self.assertEqual(bc.headline(cells)["cell"], "raw/100%/2048/x1")

  def test_faster_than_its_bound_is_invalid_and_never_the_headline(self):
    _, cells, _, _ = self.block([4.0, 4.1, 3.9])  # 4.0 s against a 5.1 s bound, spread 5%
    (cell,) = cells
    self.assertTrue(cell["invalid"])
    self.assertIsNone(bc.headline(cells))
    self.assertEqual(bc.check_targets(cells)["kvjax_ge_0.97x_best"]["cells"], 0)

  def test_unsteady_cpu_shares_are_no_headline(self):
    _, cells, _, _ = self.block([5.5, 5.6, 5.4], kvjax_cpu=0.5)  # kvjax got half the CPU
    self.assertFalse(cells[0]["invalid"])
    self.assertEqual(cells[0]["cpu_cores"]["cake"], [0.5, 0.5, 0.5])
    self.assertIsNone(bc.headline(cells))

  def test_an_old_single_run_cell_is_judged_on_its_values(self):
    # benchmarks/results/archive/cake.json, 4,096 tokens at B*: 8.49 s against 10.38 s.
    old = {"ttft_kvjax_s": 8.49, "ttft_ideal_s": 10.38}
    bc.mark_invalid(old)
    self.assertTrue(old["invalid"])
    ok = {"ttft_kvjax_s": 4.52, "ttft_ideal_s": 4.40}
    bc.mark_invalid(ok)
    self.assertFalse(ok["invalid"])

  def test_one_round_is_never_a_headline(self):
    bench = FakeBench([5.5])
    cells, _, order = bc.grid_block(bench, [list(range(N))], N, 100.0, ["1"], 1, Bar())
    self.assertEqual(order, benchlib.interleaved_rounds(["compute_only", "load_only@1",
                                                         "cake@1"], 1))
    self.assertFalse(cells[0]["invalid"])
    self.assertIsNone(bc.headline(cells))

  def test_several_restoring_take_the_mean_and_the_bound_alone(self):
    # N = 3: the other two requests' first tokens come 1 s and 2 s after the first one's in
    # every run, so each mode's TTFT is its first request's + 1 s; the bound is the N = 1
    # cell's (5.1 s), run before it.
    _, alone, _, _ = self.block([5.5, 5.6, 5.4])
    bench = FakeBench([5.5, 5.6, 5.4], behind_s=[1.0, 2.0])
    cells, _, _ = bc.grid_block(bench, [list(range(N))] * 3, N, 100.0, ["1"], 3, Bar(),
                                restoring=3, alone=alone)
    self.assertEqual(bench.more, [N, N])
    (cell,) = cells
    self.assertEqual((cell["restoring"], cell["busy"]), (3, False))
    self.assertAlmostEqual(cell["ttft_kvjax_s"], 6.5)
    self.assertAlmostEqual(cell["ttft_compute_only_s"], 9.1)
    self.assertSequenceAlmostEqual(cell["ttft_per_request_reps_s"]["cake"][0], [5.5, 6.5, 7.5])
    self.assertSequenceAlmostEqual(cell["ttft_ideal_reps_s"], [5.1, 5.1, 5.1])
    self.assertAlmostEqual(cell["speedup_vs_best"], 9.1 / 6.5)
    self.assertFalse(cell["invalid"])
    self.assertEqual(bc.cell_key(cell), "raw/100%/2048/x1/N3")
    self.assertEqual(bc.headline(cells), None)  # the headline stays one request's
    # Without its N = 1 cell: no bound, no check.
    cells, _, _ = bc.grid_block(FakeBench([5.5] * 3, behind_s=[1.0]), [list(range(N))] * 2, N,
                                100.0, ["1"], 3, Bar(), restoring=2)
    self.assertIsNone(cells[0]["ttft_ideal_s"])
    self.assertFalse(cells[0]["invalid"])

  def test_the_layer_split_joins_the_rounds_on_the_same_engine(self):
    # --layer_split auto: Cake runs that may split (4.8 s, 5.0 s, 4.9 s) are interleaved with
    # the token-only ones (5.5, 5.6, 5.4 s) on one engine; the cell compares their medians.
    bench = FakeBench([5.5, 5.6, 5.4], split_ttfts=[4.8, 5.0, 4.9])
    cells, kv_runs, order = bc.grid_block(bench, [list(range(N))], N, 100.0, ["1"], 3, Bar(),
                                          split=True)
    self.assertEqual(order[0], ["compute_only", "load_only@1", "cake@1", "cake_split@1"])
    self.assertEqual(bench.calls[:5], ["compute_only", "compute_only", "load_only@1", "cake@1",
                                       "cake@1/split"])
    self.assertLen(kv_runs, 3)  # the token-only runs: the planner figures stay the default's
    (cell,) = cells
    self.assertAlmostEqual(cell["ttft_kvjax_s"], 5.5)
    self.assertAlmostEqual(cell["ttft_kvjax_split_s"], 4.9)
    self.assertAlmostEqual(cell["split_over_token_only"], 5.5 / 4.9)
    self.assertAlmostEqual(cell["speedup_vs_best_split"], 8.1 / 4.9)
    self.assertEqual(cell["ttft_kvjax_split_reps_s"], [4.8, 5.0, 4.9])
    self.assertFalse(cell["split_invalid"])  # 4.9 s against a 5.1 s bound: within the spread
    groups = bc.groups(cells)
    self.assertEqual(groups["N1/quiet"]["worst_speedup_vs_best"], round(8.1 / 5.5, 3))
    self.assertEqual(groups["N1/quiet"]["split_over_token_only"],
                     {"raw/100%/2048/x1": round(5.5 / 4.9, 3)})


if __name__ == "__main__":
  absltest.main()
