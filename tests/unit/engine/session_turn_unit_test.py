"""The one session-turn flow (`kvjax.sessions.run_turn`) and its output-token reservation: the
prompt of a turn under a truncation policy may take the context minus the turn's output limit,
or minus one token when it gives none; `LLM.chat` and the server's chat endpoint
(`kvjax.serve.completions.session_plan`) plan by it alike. Byte tokenizer, no model."""

import dataclasses
import json

from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.merge_mode import MergeMode
from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.serve import completions, protocol
from kvjax.sessions import (DROP_OLDEST_TURNS, REROTATED_SALT_PREFIX, TRUNCATE_NONE, SessionConfig,
                            SessionRegistry, output_reservation, prompt_limit, run_turn)
from kvjax.testing import engines

MSGS = [{"role": "user", "content": "x" * 200}]  # 200 + len("user: \nassistant: ") bytes


def _registry() -> SessionRegistry:
  return SessionRegistry(ByteTokenizer(), SessionConfig(truncation=DROP_OLDEST_TURNS))


def _chat_request(**fields) -> protocol.ChatCompletionRequest:
  body = {"model": "m", "messages": MSGS, "session_id": "s", **fields}
  return protocol.parse(protocol.ChatCompletionRequest, json.dumps(body).encode())


class ReservationRuleTest(absltest.TestCase):

  def test_the_output_limit_or_one_token(self):
    self.assertEqual(output_reservation(None), 1)
    self.assertEqual(output_reservation(7), 7)
    for bad in (0, -1, True, 1.5):
      with self.assertRaisesRegex(ValueError, "max_tokens"):
        output_reservation(bad)

  def test_prompt_limit(self):
    self.assertIsNone(prompt_limit(TRUNCATE_NONE, 100, 10, None))
    self.assertEqual(prompt_limit(TRUNCATE_NONE, 100, 10, 30), 30)
    self.assertEqual(prompt_limit(DROP_OLDEST_TURNS, 100, 10, None), 90)
    self.assertEqual(prompt_limit(DROP_OLDEST_TURNS, 100, None, None), 99)
    self.assertEqual(prompt_limit(DROP_OLDEST_TURNS, 100, 10, 50), 50)
    self.assertEqual(prompt_limit(DROP_OLDEST_TURNS, 100, 10, 95), 90)
    self.assertEqual(prompt_limit(DROP_OLDEST_TURNS, None, 10, 95), 95)


class RunTurnTest(absltest.TestCase):

  def test_a_cut_turn_keeps_room_for_its_output(self):
    reg = _registry()
    turn = reg.begin("s")
    plan = run_turn(reg, turn, MSGS, max_model_len=128, max_tokens=8,
                    truncate_prompt_tokens=1000)
    self.assertEqual((plan.limit, plan.reserved_output_tokens), (120, 8))
    self.assertLen(plan.token_ids, 120)  # a left cut (no message marks): the last 120 ids
    self.assertEqual(plan.token_ids, tuple(ByteTokenizer().encode_chat(MSGS))[-120:])
    self.assertEqual(plan.kv_salt, None)
    self.assertEqual(plan.request_options(), {"save_tail": True, "history_tokens": 0})
    reg.release(turn)

  def test_a_turn_under_rerotated_kv_asks_for_load_only(self):
    # The merge mode travels in the request's options; the engine reads nothing into the salt.
    reg = _registry()
    turn = reg.begin("s")
    plan = run_turn(reg, turn, MSGS, max_model_len=1024, max_tokens=8,
                    truncate_prompt_tokens=None)
    reg.release(turn)
    for salt in (REROTATED_SALT_PREFIX + "ab", REROTATED_SALT_PREFIX):
      self.assertEqual(dataclasses.replace(plan, kv_salt=salt, history_tokens=5).request_options(),
                       {"save_tail": True, "history_tokens": 5,
                        "merge_mode": MergeMode.LOAD_ONLY})
    for salt in (None, "tenant", "x" + REROTATED_SALT_PREFIX):
      self.assertNotIn("merge_mode", dataclasses.replace(plan, kv_salt=salt).request_options())

  def test_both_front_ends_plan_alike(self):
    # The server without max_tokens reserves one token; with it, max_tokens, as LLM.chat does.
    for fields, reserved in (({}, 1), ({"max_tokens": 8}, 8), ({"max_completion_tokens": 5}, 5)):
      reg = _registry()
      turn = reg.begin("s")
      plan = completions.session_plan(reg, turn, _chat_request(truncate_prompt_tokens=1000,
                                                               **fields), 128)
      self.assertEqual((plan.limit, plan.reserved_output_tokens), (128 - reserved, reserved))
      self.assertLen(plan.token_ids, 128 - reserved)
      reg.release(turn)
    llm = engines.fake_llm(compile_on_init=False, max_model_len=128,
                           session_truncation=DROP_OLDEST_TURNS)
    try:
      out = llm.chat(MSGS, SamplingParams(max_tokens=8, temperature=0,
                                          truncate_prompt_tokens=1000), session_id="s")[0]
      self.assertLen(out.prompt_token_ids, 120)
      self.assertLen(llm.last_session_prompt.token_ids, 120)
    finally:
      llm.close()

  def test_a_template_the_server_cannot_render_is_a_400(self):
    reg = SessionRegistry(None, SessionConfig())
    turn = reg.begin("s")
    with self.assertRaises(protocol.ApiError) as cm:
      completions.session_plan(reg, turn, _chat_request(), 128)
    self.assertEqual(cm.exception.status, 400)

  def test_a_staging_failure_is_not_a_messages_error(self):
    reg = SessionRegistry(ByteTokenizer(), SessionConfig(truncation=DROP_OLDEST_TURNS,
                                                         rerotate=True))

    def stage(*args, **kwargs):
      raise OSError("store down")

    turn = reg.begin("s")
    with self.assertRaisesRegex(OSError, "store down"):
      completions.session_plan(reg, turn, _chat_request(truncate_prompt_tokens=100), 128,
                               stage)


if __name__ == "__main__":
  absltest.main()
