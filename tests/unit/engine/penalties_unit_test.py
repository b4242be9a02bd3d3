"""Presence and frequency penalties and logit bias: the device step against OpenAI's formula in
numpy, the parameter checks, and their effect on the fake engine's tokens."""

import numpy as np
from absl.testing import absltest, parameterized

from kvjax.engine import sampling
from kvjax.scheduler import SamplingParams
from kvjax.scheduler.request import MAX_LOGIT_BIAS, SamplingParamsError
from kvjax.testing import engines

V = 64


def openai_formula(logits, generated, presence, frequency, bias):
  """OpenAI's API reference, token by token: mu[j] -= c[j] * alpha_frequency +
  float(c[j] > 0) * alpha_presence, plus the bias (float64, written independently)."""
  out = np.asarray(logits, np.float64).copy()
  for j in range(len(out)):
    c = generated.count(j)
    out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    out[j] += bias.get(j, 0.0)
  return out


class ProcessLogitsTest(parameterized.TestCase):

  def test_device_step_equals_openai_formula_and_leaves_other_rows_exact(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32)
    generated = [5, 5, 9, 5, 63]
    counts = np.bincount(generated, minlength=V).astype(np.int32)
    params = SamplingParams(presence_penalty=0.75, frequency_penalty=-1.5,
                            logit_bias={0: -100, 9: 3.5, 40: 100})
    bias = dict(params.logit_bias)
    got = np.asarray(sampling.process_logits(
        logits, [(params, counts), (SamplingParams(), None), (params, np.zeros(V, np.int32))]))
    want = openai_formula(logits[0], generated, 0.75, -1.5, bias)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got[0], sampling.penalize_reference(logits[0], counts, params),
                               rtol=0, atol=1e-5)
    changed = np.flatnonzero(got[0] != logits[0]).tolist()
    self.assertEqual(changed, [0, 5, 9, 40, 63])  # exactly the generated and biased tokens
    np.testing.assert_array_equal(got[1], logits[1])  # a row without penalties: bit for bit
    np.testing.assert_allclose(got[2], openai_formula(logits[2], [], 0.75, -1.5, bias),
                               atol=1e-4)

  @parameterized.named_parameters(
      ("presence_high", dict(presence_penalty=2.5), "presence_penalty"),
      ("frequency_low", dict(frequency_penalty=-2.01), "frequency_penalty"),
      ("bias_value", dict(logit_bias={3: 101}), "logit_bias"),
      ("bias_id", dict(logit_bias={-1: 1}), "logit_bias"),
      ("bias_entries", dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}),
       "logit_bias"),
      ("n_zero", dict(n=0), "n"),
      ("top_p_zero", dict(top_p=0.0), "top_p"))
  def test_bad_values_name_the_field(self, kwargs, field):
    with self.assertRaises(SamplingParamsError) as e:
      SamplingParams(**kwargs)
    self.assertEqual(e.exception.param, field)
    self.assertTrue(str(e.exception).startswith(field), str(e.exception))
    self.assertNotIn("SamplingParams", str(e.exception))


class PenaltiesEngineTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.engine = engines.fake_engine()
    self.prompt = list(range(1, 30))

  def run_one(self, **kw):
    return engines.generate(self.engine, [self.prompt],
                            SamplingParams(max_tokens=12, temperature=0, **kw))[0].token_ids

  def test_bias_minus_100_bans_and_plus_100_forces(self):
    plain = self.run_one()
    banned = plain[0]
    without = self.run_one(logit_bias={banned: -100})
    self.assertNotIn(banned, without)
    forced = next(t for t in range(1, 200) if t not in plain)
    self.assertEqual(self.run_one(logit_bias={forced: 100}), [forced] * 12)

  def test_penalties_follow_the_formula_token_by_token(self):
    """Greedy under penalties picks, at every step, the best token of the raw
    log-probabilities (the model's, returned as they are) minus OpenAI's penalty of the tokens
    generated so far; a negative penalty makes the fake model repeat itself."""
    plain = self.run_one()
    out = engines.generate(self.engine, [self.prompt], SamplingParams(
        max_tokens=12, temperature=0, frequency_penalty=-1.5, presence_penalty=-0.5,
        logprobs=20))[0]
    self.assertNotEqual(out.token_ids, plain)
    self.assertEqual(out.token_ids[:9], plain[:9])  # the same until a repeat pays
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
      before = out.token_ids[:i]
      score = {t: v - (before.count(t) * -1.5 + (t in before) * -0.5) for t, v in lp.items()}
      self.assertEqual(max(score, key=score.get), token, i)
    self.assertLess(len(set(out.token_ids)), len(set(plain)))

  def test_logit_bias_outside_the_vocabulary_names_the_field(self):
    vocab = self.engine.runner.model_config.vocab_size
    with self.assertRaises(SamplingParamsError) as e:
      self.engine.add_request(self.prompt, SamplingParams(logit_bias={vocab + 3: 1}))
    self.assertEqual(e.exception.param, "logit_bias")


if __name__ == "__main__":
  absltest.main()
