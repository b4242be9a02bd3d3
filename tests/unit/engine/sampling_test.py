"""Host sampling: greedy, top-k, top-p and log-probabilities on hand-made logits."""

import numpy as np
from absl.testing import absltest

from kvjax.engine import sampling
from kvjax.scheduler import SamplingParams

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))


class SamplingTest(absltest.TestCase):

  def test_greedy(self):
    self.assertEqual(sampling.sample_token(LOGITS, SamplingParams(temperature=0), None), 0)

  def test_top_k_and_top_p_restrict_support(self):
    rng = np.random.default_rng(0)
    seen_k = {sampling.sample_token(LOGITS, SamplingParams(top_k=2), rng) for _ in range(300)}
    self.assertEqual(seen_k, {0, 1})
    # Mass 0.5 + 0.3 reaches top_p=0.7 after two tokens: token 2 and 3 never appear.
    seen_p = {sampling.sample_token(LOGITS, SamplingParams(top_p=0.7), rng) for _ in range(300)}
    self.assertEqual(seen_p, {0, 1})
    seen_all = {sampling.sample_token(LOGITS, SamplingParams(), rng) for _ in range(2000)}
    self.assertEqual(seen_all, {0, 1, 2, 3})

  def test_top_logprobs(self):
    got = sampling.top_logprobs(LOGITS, 2, 3)
    self.assertEqual(list(got), [0, 1, 3])
    np.testing.assert_allclose([got[0], got[1], got[3]], np.log([0.5, 0.3, 0.05]), rtol=1e-6)
    self.assertEqual(list(sampling.top_logprobs(LOGITS, 0, 2)), [2])


if __name__ == "__main__":
  absltest.main()
