"""The engine's bidirectional prefix path (Cake) on the real tiny model: hits equal cold runs in
every merge mode.

Compute from the front and loads from the back meet wherever timing puts them; whatever the
meeting point, the greedy tokens and the first token's log-probabilities must equal a cold run
(the simulator in tests/unit/testing/cake_sim_test.py forces each meeting point exactly). The
tests are tests/unit/engine/cake_engine_unit_test.py's with `LLM("tiny")` instead of the fake
runner (each engine keeps the per-position writer map on, so a position written twice raises);
a hit beside decodes is this file's own.
"""

import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from tests.unit.engine import cake_engine_unit_test as unit

C, PARAMS, PROMPT = unit.C, unit.PARAMS, unit.PROMPT
#: Per codec, a loaded hit's first-token log-probs against the cold run's (real KV).
CODEC_LOGPROB_TOL = {"raw": 0.0, "int8": 1e-3, "int4": 2e-2, "cachegen": 2e-3}


def tiny(**options):
  return real_llm("tiny", cache_dir="", **options)


class CakeEngineHitTest(unit.CakeEngineHitUnitTest):
  """Faults, codecs and option checks on the real model's numbers."""

  LOGPROB_DELTA = 1e-4
  CODEC_LOGPROB_TOL = CODEC_LOGPROB_TOL

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def runner_calls(self, llm):
    return None  # the jit'd runner records no calls

  def test_a_hit_beside_decodes_waits_for_its_loads_and_equals_cold(self):
    """Short first-token steps, rule c: a store hit admitted while another request decodes
    gets a step that computes nothing and waits for its loads (a tiny model's chunks are
    predicted to land far within half a step); its tail then computes with the decode, and
    every answer equals its cold run."""
    n = 3 * C + 17
    for short in (True, False):
      llm = self.make_llm("memory://", mode="load_only", short_first_token_steps=short)
      engine = llm.engine
      llm.generate({"prompt_token_ids": PROMPT[:3 * C + 1]}, PARAMS)
      llm.flush()
      steps = []
      engine.add_step_observer(steps.append)
      other = engine.add_request(PROMPT[40:60], SamplingParams(max_tokens=12, temperature=0.0))
      while len(steps) < 3:  # the other request's prompt, then two decodes
        engine.step()
      hit = engine.add_request(PROMPT[:n], PARAMS)
      done = {}
      while engine.has_unfinished_requests():
        for o in engine.step():
          if o.finished:
            done[o.request_id] = o
      self.assert_equals_cold(done[hit], n)
      self.assertEqual(done[hit].num_cached_tokens, 3 * C)
      first = next(i for i, rec in enumerate(steps) if rec.plan.loads)
      waited = steps[first].plan
      self.assertEqual(bool(waited.wait_s), short)
      self.assertEqual(not waited.decodes, short)  # the decode waits out the loads
      if short:
        # Nothing computes until the hit's chunks are in; then its tail goes with the decode.
        tail = next(rec.plan for rec in steps[first:] if rec.plan.prefills)
        self.assertEqual([(c.request_id, c.start, c.num_tokens, c.is_last)
                          for c in tail.prefills],
                         [(hit, 3 * C, 16, False), (hit, 4 * C, 1, True)])
        self.assertEqual([d.request_id for d in tail.decodes], [other])
      cold_llm = self.make_llm(None)
      cold = cold_llm.generate({"prompt_token_ids": PROMPT[40:60]},
                               SamplingParams(max_tokens=12, temperature=0.0))[0]
      cold_llm.close()
      self.assertEqual(done[other].token_ids, cold.token_ids)
      llm.close()


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class CakeEngineTest(unit.CakeEngineUnitTest):
  """Every stored prefix length in every merge mode, the TTFT target, cancelled loads."""

  LOGPROB_DELTA = 1e-4
  CODEC_LOGPROB_TOL = CODEC_LOGPROB_TOL

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def runner_calls(self, llm):
    return None


if __name__ == "__main__":
  absltest.main()
