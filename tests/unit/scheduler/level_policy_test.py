"""Exact encoding choices of the CacheGen-style level policy, at the boundaries."""

import math

from absl.testing import absltest, parameterized

from kvjax.scheduler.level_policy import (Candidate, load_time_s, pick_encoding,
                                          pick_encoding_for_ttft, ttft_deadline_s)

# Most accurate first; sizes halve per level.
FINE = Candidate("fine", 1000, 0)
MID = Candidate("mid", 500, 1)
COARSE = Candidate("coarse", 250, 2)
ALL = (COARSE, FINE, MID)  # any order


class LoadTimeTest(parameterized.TestCase):

  @parameterized.parameters(
      (1000, 1000.0, math.inf, 1.0),   # raw: transfer only
      (1000, 1000.0, 4000.0, 1.0),     # decode (0.25 s) hides behind the transfer
      (1000, 4000.0, 1000.0, 1.0),     # decode-bound: 1 s decode, 0.25 s transfer
      (0, 1.0, 1.0, 0.0),
  )
  def test_max_of_transfer_and_decode(self, nbytes, bw, dec, want):
    self.assertEqual(load_time_s(nbytes, bw, dec), want)

  def test_bad_rates(self):
    with self.assertRaisesRegex(ValueError, "bandwidth_bytes_per_s=0"):
      load_time_s(1, 0.0)
    with self.assertRaisesRegex(ValueError, "decode_bytes_per_s=-1"):
      load_time_s(1, 1.0, -1)


class PickEncodingTest(parameterized.TestCase):

  @parameterized.parameters(
      # bandwidth 1000 B/s: fine lands in 1.0 s, mid 0.5 s, coarse 0.25 s after now=10.
      (11.0, "fine"),      # exactly at the deadline counts as in time
      (10.999, "mid"),     # just short of fine
      (10.5, "mid"),
      (10.4999, "coarse"),
      (10.25, "coarse"),
      (10.2, "coarse"),    # nothing lands in time: the smallest
      (math.inf, "fine"),
  )
  def test_most_accurate_in_time_else_smallest(self, deadline, want):
    self.assertEqual(pick_encoding(ALL, 1000.0, math.inf, 10.0, deadline).name, want)

  def test_decode_rate_counts(self):
    # Decoding at 500 B/s: fine takes 2 s, mid 1 s, coarse 0.5 s although the link is fast.
    self.assertEqual(pick_encoding(ALL, 1e9, 500.0, 0.0, 1.0).name, "mid")
    self.assertEqual(pick_encoding(ALL, 1e9, 500.0, 0.0, 0.99).name, "coarse")

  def test_smallest_breaks_ties_by_quality(self):
    a, b = Candidate("a", 100, 3), Candidate("b", 100, 1)
    self.assertEqual(pick_encoding((a, b), 1.0, math.inf, 0.0, 1.0).name, "b")

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "no candidate"):
      pick_encoding((), 1.0, math.inf, 0.0, 1.0)
    with self.assertRaisesRegex(ValueError, "nbytes=-1"):
      Candidate("x", -1, 0)


class TtftTargetTest(parameterized.TestCase):

  @parameterized.parameters(
      # arrival 0, target 4 s, now 1: 3 s left over 3 chunks -> 1 s for this chunk.
      (1.0, 0.0, 4.0, 3, 2.0),
      (1.0, 0.0, 4.0, 1, 4.0),
      (5.0, 0.0, 4.0, 2, 5.0),   # target passed: deadline is now (smallest encoding)
  )
  def test_even_share_of_time_left(self, now, arrival, target, left, want):
    self.assertEqual(ttft_deadline_s(now, arrival, target, left), want)

  def test_pick_for_ttft(self):
    # 1000 B/s; 1 s per chunk allowed -> fine (1.0 s) fits exactly; with 4 chunks left, 0.75 s
    # each -> mid.
    self.assertEqual(pick_encoding_for_ttft(ALL, 1000.0, math.inf, 1.0, 0.0, 4.0, 3).name, "fine")
    self.assertEqual(pick_encoding_for_ttft(ALL, 1000.0, math.inf, 1.0, 0.0, 4.0, 4).name, "mid")

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "chunks_left=0"):
      ttft_deadline_s(0.0, 0.0, 1.0, 0)
    with self.assertRaisesRegex(ValueError, "kv_ttft_target_s=0"):
      ttft_deadline_s(0.0, 0.0, 0, 1)


if __name__ == "__main__":
  absltest.main()
