"""Stored session tails (CachedAttention, arXiv 2403.19708, section 3.2.2) on the real tiny
model: the same tests as tests/unit/engine/session_tails_unit_test.py (tail hits equal cold
runs; a tail never hits other tokens, never shadows a stored full chunk, is only saved for
session turns, is found while its save is queued, and a corrupt one is recomputed) with
`LLM("tiny")` instead of the fake runner; the `LLM.chat` turn is this file's own."""

import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from tests.unit.engine import session_tails_unit_test as unit

C = unit.C


def tiny(**options):
  return real_llm("tiny", cache_dir="", **options)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class SessionTailTest(unit.SessionTailUnitTest):

  LOGPROB_DELTA = 1e-5

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)


class ChatSessionTailTest(unit.SessionTailCase):
  """`LLM.chat` on the real tiny model: turn two loads turn one, tail included."""

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def test_llm_chat_turn_two_loads_turn_one_whole_from_the_store(self):
    llm = self.make_llm("memory://", kv_merge_mode="load_only")
    try:
      p = SamplingParams(max_tokens=9, temperature=0)
      msgs = [{"role": "user", "content": "Tell me about the sea and the ships on it"}]
      out1 = llm.chat(msgs, p, session_id="sea")[0]
      llm.flush()
      head = out1.prompt_token_ids + out1.token_ids
      self.assertTrue((len(head) - 1) % C)  # turn 1 ends inside a chunk: a tail is stored
      msgs += [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "More"}]
      out2 = llm.chat(msgs, p, session_id="sea")[0]
      self.assertEqual(out2.prompt_token_ids[:len(head)], head)
      self.assertEqual(out2.num_cached_tokens, len(head) - 1)  # every token with KV
      cold = llm.generate({"prompt_token_ids": out2.prompt_token_ids, "cache_salt": "cold"},
                          p)[0]
      self.assertEqual(out2.token_ids, cold.token_ids)
    finally:
      llm.close()


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class UnwrittenSavesTest(unit.UnwrittenSavesUnitTest):

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class CorruptTailTest(unit.CorruptTailUnitTest):

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)


if __name__ == "__main__":
  absltest.main()
