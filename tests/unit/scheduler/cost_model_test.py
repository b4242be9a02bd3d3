"""The online cost model: least-squares compute fit, EWMA link and decode rates."""

import math
import random

from absl.testing import absltest, parameterized

from kvjax.scheduler.cost_model import DEFAULT_COMPUTE_PRIOR, CostModel


def linear(a, b, c):
  return lambda s, n: a + b * n + c * n * (s + (n - 1) / 2)


class ComputeFitTest(parameterized.TestCase):

  def test_prior_is_the_measured_cpu_curve(self):
    m = CostModel()
    self.assertAlmostEqual(m.predict_compute_s(0, 256), 0.69, places=3)
    self.assertAlmostEqual(m.predict_compute_s(7936, 256), 3.40, places=3)
    self.assertEqual(m.predict_compute_s(0, 0), 0.0)

  def test_one_observation_rescales_the_prior_shape(self):
    # A machine 100x faster than the prior: one chunk at position 0 is enough to rescale every
    # prediction, including those far along the prompt.
    m = CostModel()
    m.observe_compute(0, 256, 0.0069)
    self.assertAlmostEqual(m.predict_compute_s(0, 256), 0.0069, places=6)
    self.assertAlmostEqual(m.predict_compute_s(7936, 256), 0.0340, places=4)

  @parameterized.parameters((0.0, 1e-3, 2e-7), (0.05, 2e-3, 0.0), (0.01, 0.0, 5e-7))
  def test_recovers_linear_costs(self, a, b, c):
    truth = linear(a, b, c)
    m = CostModel(prior_weight=1e-6, forget=1.0)
    for start in range(0, 8192, 512):
      for n in (16, 64, 256, 512):
        m.observe_compute(start, n, truth(start, n))
    for start, n in ((0, 256), (4000, 128), (7936, 256)):
      self.assertAlmostEqual(m.predict_compute_s(start, n), truth(start, n), places=5)
    got = m.compute_coefficients
    self.assertAlmostEqual(got[0], a, places=5)
    self.assertAlmostEqual(got[1] * 1e3, b * 1e3, places=4)
    self.assertAlmostEqual(got[2] * 1e7, c * 1e7, places=3)

  def test_a_step_of_several_pieces_is_one_observation(self):
    # Steps of one or two pieces, padded to a bucket of 64 or 128 tokens: t = a + b * padded
    # + c * (each piece's n * m). Observed whole, the fit recovers a, b and c exactly. Split
    # pro rata into one observation per piece (each its own unpadded step), the same steps
    # fit the 0.05 s floor as 0.011 s.
    a, b, c = 0.05, 1e-3, 2e-7
    steps = []
    for start in range(0, 4096, 256):
      for pieces in (((start, 64),), ((start, 32), (0, 16)), ((start, 96),),
                     ((start, 64), (start + 512, 64))):
        tokens = sum(n for _, n in pieces)
        padded = 64 if tokens <= 64 else 128
        steps.append((pieces, padded, a + b * padded
                      + c * sum(n * (s + (n - 1) / 2) for s, n in pieces)))
    whole = CostModel(prior_weight=1e-6, forget=1.0)
    split = CostModel(prior_weight=1e-6, forget=1.0)
    for pieces, padded, seconds in steps:
      whole.observe_step(pieces, padded, seconds)
      tokens = sum(n for _, n in pieces)
      for s, n in pieces:
        split.observe_compute(s, n, seconds * n / tokens)
    got = whole.compute_coefficients
    self.assertAlmostEqual(got[0], a, places=6)
    self.assertAlmostEqual(got[1] * 1e3, b * 1e3, places=5)
    self.assertAlmostEqual(got[2] * 1e7, c * 1e7, places=4)
    self.assertEqual(whole.num_compute_observations, len(steps))
    self.assertLess(split.compute_coefficients[0], a / 4)
    # One piece, unpadded: the same as observe_compute.
    one, other = CostModel(), CostModel()
    one.observe_step(((512, 64),), 64, 0.3)
    other.observe_compute(512, 64, 0.3)
    self.assertEqual(one.compute_coefficients, other.compute_coefficients)

  def test_coefficients_stay_non_negative(self):
    m = CostModel(prior_weight=1e-6)
    # Costs that fall with position would fit c < 0: it is pinned at 0.
    for start in range(0, 4096, 256):
      m.observe_compute(start, 256, 1.0 - start * 1e-4)
    self.assertTrue(all(v >= 0 for v in m.compute_coefficients))

  def test_the_pace_follows_a_machine_that_turns_busy_and_quiet(self):
    # 100 quiet pieces fit the cost exactly; then another process takes half the machine
    # (every piece 2x) for five pieces at the prompt's front, then leaves. Busy, the model
    # prices pieces at 0, 2,048 and 3,840 at 2.08x, 1.75x and 1.65x their quiet cost; the slow
    # fit alone (pace_ewma 0) at 1.23x, 1.04x and 0.98x. Quiet again, five and 35 pieces later,
    # the worst of the three is 1.18x and 1.13x (the fit alone 1.20x and 1.14x: both still hold
    # the busy pieces, which the pace, one number, cannot unbend).
    truth = linear(0.02, 2.4e-3, 1.3e-6)
    pieces = [(start, 256) for start in range(0, 4096, 256)]
    probe = ((0, 256), (2048, 256), (3840, 256))
    got = {}
    for pace_ewma in (0.3, 0.0):
      m = CostModel(prior_weight=1e-6, pace_ewma=pace_ewma, relevel_steps=0)  # the pace alone
      for i in range(100):
        m.observe_compute(*pieces[i % 16], truth(*pieces[i % 16]))
      self.assertAlmostEqual(m.pace, 1.0, places=6)
      got[pace_ewma] = []
      for factor, count in ((2, 5), (1, 5), (1, 30)):
        for i in range(count):
          m.observe_compute(*pieces[i % 16], factor * truth(*pieces[i % 16]))
        got[pace_ewma].append([m.predict_compute_s(*x) / truth(*x) for x in probe])
    (busy, quiet, settled), (busy0, quiet0, settled0) = got[0.3], got[0.0]
    self.assertGreater(min(busy), 1.6)
    self.assertLess(max(busy0), 1.25)
    for mine, fit_alone in ((quiet, quiet0), (settled, settled0)):
      self.assertLessEqual(max(abs(r - 1) for r in mine), max(abs(r - 1) for r in fit_alone))

  def test_a_machine_that_turns_busy_relevels_the_history(self):
    # The trace of four restores on a busy 2-core VM: a quiet history of 512-token steps
    # priced exactly, then a competing process makes every step 1.65x slower, and the engine
    # runs only the shape a restore makes (a request's last 256 tokens at 1,792). Fed as it
    # was, the fit tilted and priced 512 tokens at the front at 0.69x their busy time; the
    # history rescaled after five such steps, it prices them within 2%. Quiet again, five
    # steps later it relevels back.
    truth = linear(*DEFAULT_COMPUTE_PRIOR)
    got = {}
    for steps in (5, 0):
      m = CostModel(relevel_steps=steps)
      for i in range(30):
        start = (i % 4) * 512
        m.observe_compute(start, 512, truth(start, 512))
      for _ in range(5):
        m.observe_compute(1792, 256, 1.65 * truth(1792, 256))
      busy = m.predict_compute_s(0, 512) / (1.65 * truth(0, 512))
      for _ in range(5):
        m.observe_compute(1792, 256, truth(1792, 256))
      got[steps] = (busy, m.predict_compute_s(0, 512) / truth(0, 512), m.num_relevels)
    self.assertAlmostEqual(got[5][0], 1.0, delta=0.02)
    self.assertAlmostEqual(got[5][1], 1.0, delta=0.02)
    self.assertEqual(got[5][2], 2)
    self.assertLess(got[0][0], 0.8)
    self.assertEqual(got[0][2], 0)

  def test_noise_does_not_relevel(self):
    # +-20% noise on every shape from a decode to 512 tokens, 2,000 steps: never five in a row
    # beyond 1.25x on one side (without the 64-token floor, decodes late in the prompt, which
    # the noisy fit of `a` prices worst, relevelled it).
    truth = linear(*DEFAULT_COMPUTE_PRIOR)
    rng = random.Random(0)
    m = CostModel()
    shapes = [(s, n) for s in range(0, 8192, 256) for n in (1, 16, 256, 512)]
    for _ in range(2000):
      s, n = rng.choice(shapes)
      m.observe_compute(s, n, truth(s, n) * rng.uniform(0.8, 1.2))
    self.assertEqual(m.num_relevels, 0)
    self.assertAlmostEqual(m.predict_compute_s(0, 512) / truth(0, 512), 1.0, delta=0.1)

  def test_frozen_model_ignores_observations(self):
    m = CostModel(compute_prior=(0.0, 1.0, 0.0), learn=False, bandwidth_bytes_per_s=10.0)
    m.observe_compute(0, 4, 100.0)
    m.observe_load(100, 100.0)
    self.assertEqual(m.predict_compute_s(0, 4), 4.0)
    self.assertEqual(m.predict_transfer_s(100), 10.0)
    self.assertTrue(m.load_rate_known)

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "num_tokens=0"):
      CostModel().observe_compute(0, 0, 1.0)
    with self.assertRaisesRegex(ValueError, "padded_tokens=32"):
      CostModel().observe_step(((0, 16), (16, 32)), 32, 1.0)
    with self.assertRaisesRegex(ValueError, "pieces=\\(\\)"):
      CostModel().observe_step((), 16, 1.0)
    with self.assertRaisesRegex(ValueError, "compute_prior"):
      CostModel(compute_prior=(0.0, 0.0, 0.0))
    with self.assertRaisesRegex(ValueError, "forget"):
      CostModel(forget=0.0)
    with self.assertRaisesRegex(ValueError, "relevel_steps"):
      CostModel(relevel_steps=-1)
    with self.assertRaisesRegex(ValueError, "relevel_steps"):
      CostModel(relevel_steps=True)
    with self.assertRaisesRegex(ValueError, "relevel_ratio"):
      CostModel(relevel_ratio=1.0)
    with self.assertRaisesRegex(ValueError, "pace_ewma"):
      CostModel(pace_ewma=1.5)
    self.assertEqual(len(DEFAULT_COMPUTE_PRIOR), 3)


class LoadRateTest(absltest.TestCase):

  def test_first_observation_replaces_prior_then_ewma(self):
    m = CostModel(bandwidth_bytes_per_s=1e9, ewma=0.5)
    self.assertFalse(m.load_rate_known)
    m.observe_load(1000, 1.0)            # 1000 B/s
    self.assertTrue(m.load_rate_known)
    self.assertEqual(m.bandwidth_bytes_per_s, 1000.0)
    m.observe_load(1000, 3.0)            # EWMA of seconds per byte: (1 + 3) / 2 ms per byte
    self.assertEqual(m.predict_transfer_s(1000), 2.0)
    self.assertEqual(m.bandwidth_bytes_per_s, 500.0)

  def test_load_is_max_of_transfer_and_decode(self):
    m = CostModel(bandwidth_bytes_per_s=1000.0)
    self.assertEqual(m.decode_bytes_per_s, math.inf)
    self.assertEqual(m.predict_load_s(1000), 1.0)
    m.observe_decode(1000, 2.0)
    self.assertEqual(m.predict_decode_s(1000), 2.0)
    self.assertEqual(m.predict_load_s(1000), 2.0)
    m.observe_decode(1000, 0.0)          # free decode samples pull toward 0
    self.assertEqual(m.predict_decode_s(1000), 1.0)

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "seconds=0"):
      CostModel().observe_load(10, 0.0)
    with self.assertRaisesRegex(ValueError, "nbytes=-1"):
      CostModel().observe_decode(-1, 1.0)


if __name__ == "__main__":
  absltest.main()
