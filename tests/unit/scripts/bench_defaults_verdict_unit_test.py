"""scripts/bench_defaults.py's verdict (scripts/defaults_verdict.py) on hand-set cells (no
model): a loss, a trade-off, the machine's noise (same plans) and a win within 10% are told
apart, and `bench_defaults.py --rejudge` rewrites a results file's verdict from its cells."""

import json
import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

SCRIPTS = pathlib.Path(__file__).resolve().parents[3] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import defaults_verdict as bd  # noqa: E402  pylint: disable=wrong-import-position


def cell(wall: list[float], ttft: list[float], plan: str, **extra: list[float]) -> dict:
  """A setting's median cell over rounds, as `median_cell` makes it."""
  reps = [{"wall_s": w, "ttft_p50_s": t, "ttft_p99_s": t, "steps": 10, "plan": plan,
           **{k: v[i] for k, v in extra.items()}} for i, (w, t) in enumerate(zip(wall, ttft))]
  return bd.median_cell(reps)


def judge_all(cells: dict) -> dict:
  verdict = {w: {m: bd.judge(row, m) for m in ("wall_s", "ttft_p50_s", "ttft_p99_s")}
             for w, row in cells.items()}
  return bd.workloads_summary(cells, verdict)


class VerdictTest(absltest.TestCase):

  def test_within_ten_percent(self):
    out = judge_all({"a": {"defaults": cell([10, 10, 10], [1.0, 1.0, 1.0], "p"),
                           "x": cell([9.5, 9.5, 9.5], [1.0, 1.0, 1.0], "q")}})["a"]
    self.assertEqual(out["status"], "within 10%")
    self.assertAlmostEqual(out["per_metric"]["wall_s"]["defaults_over_best"], 10 / 9.5)
    self.assertEqual(out["per_metric"]["wall_s"]["best_setting"], "x")

  def test_same_plans_is_noise(self):
    out = judge_all({"a": {"defaults": cell([10, 10, 10], [2.0, 2.0, 2.0], "p"),
                           "x": cell([5, 5, 5], [1.0, 1.0, 1.0], "p")}})["a"]
    self.assertEqual(out["status"], "same plans")
    self.assertAlmostEqual(out["defaults_over_best"], 2.0)

  def test_loss_without_a_price_is_a_loss(self):
    out = judge_all({"a": {"defaults": cell([10, 10, 10], [2.0, 2.0, 2.0], "p"),
                           "x": cell([10, 10, 10], [1.0, 1.0, 1.0], "q")}})["a"]
    self.assertEqual(out["status"], "loss")
    self.assertEqual(out["best_setting"], "x")
    self.assertEqual(out["metric"], "ttft_p50_s")
    self.assertEqual(out["trade_off"]["ttft_p50_s"]["winner_over_defaults"], {})

  def test_trade_off_names_what_the_winner_costs(self):
    out = judge_all({"c": {
        "defaults": cell([10, 10, 10], [2.0, 2.0, 2.0], "p", cold_ttft_s=[5, 5, 5]),
        "x": cell([12, 12, 12], [1.0, 1.0, 1.0], "q", cold_ttft_s=[8, 8, 8])}})["c"]
    self.assertEqual(out["status"], "trade-off")
    costs = out["trade_off"]["ttft_p50_s"]["winner_over_defaults"]
    self.assertEqual(sorted(costs), ["cold_ttft_s", "wall_s"])
    self.assertAlmostEqual(costs["cold_ttft_s"], 1.6)
    self.assertAlmostEqual(costs["wall_s"], 1.2)

  def test_rejudge_rewrites_verdict_and_keeps_provenance(self):
    cells = {"a": {"defaults": cell([10, 10, 10], [2.0, 2.0, 2.0], "p"),
                   "x": cell([10, 10, 10], [1.0, 1.0, 1.0], "q")}}
    with tempfile.TemporaryDirectory() as tmp:
      path = pathlib.Path(tmp) / "bench_defaults_quick.json"
      path.write_text(json.dumps({"argv": ["run"], "git_sha": "abc", "cells": cells}))
      subprocess.run([sys.executable, str(SCRIPTS / "bench_defaults.py"), f"--rejudge={path}"],
                     check=True, capture_output=True, timeout=120)
      record = json.loads(path.read_text())
    self.assertEqual(record["argv"], ["run"])
    self.assertEqual(record["git_sha"], "abc")
    self.assertEqual(record["workloads"]["a"]["status"], "loss")
    self.assertIn("argv", record["rejudged_by"])


if __name__ == "__main__":
  absltest.main()
