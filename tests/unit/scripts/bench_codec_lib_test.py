"""Tests of scripts/bench_codec_lib.py's model-free pieces (passages, metrics, intervals)."""

import math
import pathlib
import sys

import numpy as np
from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import bench_codec_lib as lib  # noqa: E402  pylint: disable=wrong-import-position


class PassageWindowsTest(absltest.TestCase):

  def test_every_book_first_then_by_length(self):
    lengths = {"a": 8000, "b": 17000, "c": 40000}
    windows = lib.passage_windows(lengths, 5, 4353)
    # a and b: one window each, in the middle; c: the other three, spread start to end.
    self.assertEqual(windows, [("a", 1823), ("b", 6323), ("c", 0), ("c", 17824), ("c", 35647)])
    for book in lengths:
      offsets = sorted(o for b, o in windows if b == book)
      self.assertTrue(all(o2 - o1 >= 4353 for o1, o2 in zip(offsets, offsets[1:])))
      self.assertTrue(all(0 <= o <= lengths[book] - 4353 for o in offsets))

  def test_fewer_books_than_windows_wanted(self):
    self.assertEqual(lib.passage_windows({"a": 100, "b": 50}, 1, 40), [("a", 30)])

  def test_too_many_windows_raises(self):
    with self.assertRaisesRegex(ValueError, "hold only 3 windows"):
      lib.passage_windows({"a": 100, "b": 50}, 4, 40)


class TokenMetricsTest(absltest.TestCase):

  def test_identical_logits(self):
    logits = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
    m = lib.token_metrics(logits, logits.copy(), np.arange(5))
    self.assertAlmostEqual(m["ppl_ratio"], 1.0)
    self.assertAlmostEqual(m["mean_kl"], 0.0)
    self.assertEqual(m["top1_agreement"], 1.0)
    self.assertIsNone(m["first_divergence"])

  def test_hand_computed(self):
    ref = np.array([[2, 0, 0], [0, 2, 0]], np.float32)
    other = np.array([[2, 0, 0], [2, 0, 0]], np.float32)
    m = lib.token_metrics(ref, other, np.array([0, 1]))
    e2 = math.exp(2)
    # Row 1: KL = (p_1 - p_0) * 2 with p = softmax([0, 2, 0]); row 0 is identical.
    self.assertAlmostEqual(m["mean_kl"], (e2 - 1) / (e2 + 2), places=6)
    # Row 1's target costs 2 nats more under `other`; the mean over 2 tokens is 1 nat.
    self.assertAlmostEqual(m["ppl_ratio"], math.e, places=5)
    self.assertEqual(m["first_divergence"], 1)
    self.assertEqual(m["top1_agreement"], 0.5)
    self.assertEqual(m["max_abs_logit_diff"], 2.0)


class MeanCiTest(absltest.TestCase):

  def test_t_interval(self):
    out = lib.mean_ci([1.0, 2.0, 3.0], seed=0)
    half = 4.302652729911275 / math.sqrt(3)  # t(0.975, 2) * sd 1 / sqrt(3)
    self.assertAlmostEqual(out["mean"], 2.0)
    np.testing.assert_allclose(out["ci95_t"], [2 - half, 2 + half])
    lo, hi = out["ci95_bootstrap"]
    self.assertTrue(1.0 <= lo <= 2.0 <= hi <= 3.0)

  def test_single_value_has_no_interval(self):
    out = lib.mean_ci([1.5], seed=0)
    self.assertEqual((out["mean"], out["n"], out["ci95_t"]), (1.5, 1, None))


if __name__ == "__main__":
  absltest.main()
