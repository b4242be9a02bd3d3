"""Tests of scripts/session_gap.py: the placement-gap sweep's summary (plain records)."""

import pathlib
import sys

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import session_gap as sg  # noqa: E402  pylint: disable=wrong-import-position


def run(label, hit, host, *, value, cap=0.05, live=1.0):
  return {"label": label, "policy": "lookahead" if label.startswith("lookahead") else label,
          "basis": "live", "value": value, "capacity_ratio": cap, "live_multiple": live,
          "token_hit_rate": hit, "tier_hit_rate": {"host": host, "disk": hit - host}}


class GapSummaryTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.loads = [
        {"slots": 32, "runs": [run("lru", 0.60, 0.10, value=1.0),
                               run("fifo", 0.58, 0.13, value=1.0),
                               run("lookahead_w16", 0.65, 0.28, value=1.0),
                               run("lookahead_wall", 0.65, 0.28, value=1.0),
                               run("lru", 1.0, 0.9, value=6.0, cap=0.3, live=6.0),
                               run("fifo", 0.95, 0.8, value=6.0, cap=0.3, live=6.0),
                               run("lookahead_w16", 1.0, 1.0, value=6.0, cap=0.3, live=6.0),
                               run("lookahead_wall", 1.0, 1.0, value=6.0, cap=0.3, live=6.0)]},
        {"slots": 24, "runs": [run("lru", 0.415, 0.07, value=1.0, cap=0.051),
                               run("fifo", 0.386, 0.10, value=1.0, cap=0.051),
                               run("lookahead_w16", 0.464, 0.38, value=1.0, cap=0.051),
                               run("lookahead_wall", 0.757, 0.68, value=1.0, cap=0.051)]}]

  def test_largest_gaps_name_their_settings(self):
    g = sg.gap_summary(self.loads)
    w16 = g["largest"]["lookahead_w16_minus_lru"]
    self.assertEqual((w16["slots"], w16["value"]), (32, 1.0))  # +5.0 beats +4.9 at 24 slots
    self.assertAlmostEqual(w16["gap"], 0.65 - 0.60)
    best = g["largest"]["any_window_minus_fifo"]
    self.assertEqual((best["slots"], best["lookahead_label"]), (24, "lookahead_wall"))
    self.assertAlmostEqual(best["gap"], 0.757 - 0.386)
    self.assertAlmostEqual(best["lookahead_host"], 0.68)
    self.assertAlmostEqual(best["capacity_ratio"], 0.051)
    self.assertLen(g["points"], 3)
    self.assertEqual([p["best_lookahead_label"] for p in g["points"]],
                     ["lookahead_w16", "lookahead_w16", "lookahead_wall"])  # ties: first

  def test_target_is_met_only_where_both_gaps_hold(self):
    g = sg.gap_summary(self.loads)
    self.assertTrue(g["closest_to_target"]["met"])
    self.assertEqual(g["closest_to_target"]["slots"], 24)
    self.loads[1]["runs"][3]["token_hit_rate"] = 0.64  # + 22.5 over LRU, + 25.4 over FIFO
    g = sg.gap_summary(self.loads)
    self.assertFalse(g["closest_to_target"]["met"])

  def test_table_has_one_row_per_capacity_point(self):
    rows = sg.gap_table(self.loads[0]["runs"], ["lru", "fifo", "lookahead_wall"], "host")
    lines = rows.splitlines()
    self.assertLen(lines, 3)
    self.assertEqual(lines[1].split()[-3:], ["0.100", "0.130", "0.280"])
    self.assertEqual(lines[2].split()[:4], ["live", "6", "0.3000", "6.00"])


if __name__ == "__main__":
  absltest.main()
