"""Structured output (`kvjax/engine/grammar.py`, `kvjax/serve/structured.py`): the mask in
sampling, JSON-schema outputs valid in N/N sampled runs of the fake model (random logits: only
the grammar makes them JSON), `json_object`, forced tool calls (plain and streamed), a forced
call's session turn 2 loading every token of turn 1, and the 400s."""

import json
from unittest import mock

import httpx
import jsonschema
import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.engine import grammar, sampling
from kvjax.scheduler.request import StructuredOutput
from kvjax.serve import structured
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "why": {"type": "string", "maxLength": 12}},
    "required": ["answer", "n", "why"], "additionalProperties": False}
PROMPT = list(b"user: hi\nassistant: ")
RUNS = 8
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"], "additionalProperties": False}}}
SKIP = {"type": "function", "function": {"name": "skip", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


class SampleMaskTest(absltest.TestCase):

  def test_greedy_and_sampled_tokens_stay_in_the_mask(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32)
    allowed = np.zeros(64, bool)
    allowed[[3, 17, 40]] = True
    greedy = sampling.sample_token(logits, SamplingParams(temperature=0), rng, allowed)
    self.assertEqual(greedy, [3, 17, 40][int(np.argmax(logits[[3, 17, 40]]))])
    picks = {sampling.sample_token(logits, SamplingParams(temperature=2.0, top_k=50), rng,
                                   allowed) for _ in range(200)}
    self.assertEqual(picks, {3, 17, 40})
    self.assertEqual(sampling.sample_token(logits, SamplingParams(temperature=0), rng),
                     int(np.argmax(logits)))


class EngineGrammarTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.engine = engines.fake_engine()

  def generate(self, spec, seed, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 120), temperature=1.0, seed=seed,
                            structured=spec, **kw)
    return engines.generate(self.engine, [PROMPT], params)[0]

  def test_json_schema_outputs_are_valid_in_every_run(self):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    for seed in range(RUNS):
      out = self.generate(spec, seed)
      self.assertEqual(out.finish_reason, "stop", out.text)
      jsonschema.validate(json.loads(out.text), SCHEMA)  # raises when invalid

  def test_without_the_grammar_the_fake_model_writes_no_json(self):
    out = self.generate(None, 0, max_tokens=20)
    with self.assertRaises(ValueError):
      json.loads(out.text)

  def test_an_invalid_grammar_is_a_value_error(self):
    with self.assertRaisesRegex(ValueError, "invalid grammar"):
      self.generate(StructuredOutput(lark="start: undefined_rule"), 0)

  def test_structured_output_takes_one_grammar(self):
    for bad in (dict(), dict(json_schema="{}", lark="start: \"a\""), dict(lark="")):
      with self.assertRaises(ValueError):
        StructuredOutput(**bad)


class StructuredServeUnitTest(ServedLLMTestCase, parameterized.TestCase):

  @classmethod
  def make_llm(cls):
    # The tools block and a two-turn history take more than tiny's 512 bytes of context.
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=2, max_seq_len=2048,
                            max_model_len=2048)

  def chat(self, messages=None, **kw):
    kw.setdefault("max_tokens", 120)
    kw.setdefault("temperature", 1.0)
    return self.client.chat.completions.create(
        model="tiny", messages=messages or [{"role": "user", "content": "hi"}], **kw)

  def test_json_schema_replies_validate_in_every_run(self):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    for seed in range(RUNS):
      out = self.chat(response_format=fmt, seed=seed)
      self.assertEqual(out.choices[0].finish_reason, "stop")
      jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)

  def test_json_object_replies_parse(self):
    for seed in range(RUNS):
      out = self.chat(response_format={"type": "json_object"}, seed=seed)
      self.assertIsInstance(json.loads(out.choices[0].message.content), dict)

  def check_call(self, call, names=("pick", "skip")):
    self.assertIn(call.function.name, names)
    schema = {"pick": PICK, "skip": SKIP}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    self.assertTrue(call.id.startswith("call_"))

  @parameterized.named_parameters(
      ("required", "required", ("pick", "skip")),
      ("named", {"type": "function", "function": {"name": "skip"}}, ("skip",)))
  def test_a_forced_tool_call_is_a_valid_call(self, choice, names):
    for seed in range(4):
      out = self.chat(tools=[PICK, SKIP], tool_choice=choice, seed=seed,
                      parallel_tool_calls=False)
      choice_ = out.choices[0]
      self.assertEqual(choice_.finish_reason, "tool_calls")
      self.assertIsNone(choice_.message.content)
      self.assertLen(choice_.message.tool_calls, 1)
      self.check_call(choice_.message.tool_calls[0], names)

  def test_a_streamed_forced_call_equals_the_plain_one(self):
    # One call: the byte tokenizer has no end-of-sequence token, so after a call the fake model
    # could only go on with another one (a parallel grammar) until max_tokens.
    kw = dict(tools=[PICK, SKIP], tool_choice="required", seed=3, temperature=0.0,
              parallel_tool_calls=False)
    plain = self.chat(**kw).choices[0]
    chunks = list(self.chat(stream=True, **kw))
    calls = [c for ch in chunks for d in [ch.choices[0].delta] if ch.choices
             for c in d.tool_calls or ()]
    self.assertEqual([(c.index, c.type, c.function.name, c.function.arguments) for c in calls],
                     [(i, "function", c.function.name, c.function.arguments)
                      for i, c in enumerate(plain.message.tool_calls)])
    self.assertEqual([ch.choices[0].finish_reason for ch in chunks if ch.choices][-1],
                     "tool_calls")
    self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in chunks
                             if ch.choices), "")

  def test_n_choices_each_read_their_forced_call_streamed_or_not(self):
    kw = dict(tools=[PICK, SKIP], tool_choice="required", seed=5, n=2,
              parallel_tool_calls=False)
    plain = self.chat(**kw).choices
    self.assertEqual([c.index for c in plain], [0, 1])
    for c in plain:
      self.assertEqual(c.finish_reason, "tool_calls")
      self.assertIsNone(c.message.content)
      self.assertLen(c.message.tool_calls, 1)
      self.check_call(c.message.tool_calls[0])
    chunks = [ch for ch in self.chat(stream=True, **kw) if ch.choices]
    for i in (0, 1):
      mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == i]
      calls = [c for ch in mine for c in ch.delta.tool_calls or ()]
      self.assertEqual([(c.function.name, c.function.arguments) for c in calls],
                       [(c.function.name, c.function.arguments)
                        for c in plain[i].message.tool_calls])
      self.assertEqual("".join(ch.delta.content or "" for ch in mine), "")
      self.assertEqual(mine[-1].finish_reason, "tool_calls")

  def test_turn_two_after_a_tool_call_loads_every_token_of_turn_one(self):
    msgs = [{"role": "user", "content": "Pick a number."}]
    kw = dict(tools=[PICK], temperature=0.0, parallel_tool_calls=False,
              extra_body={"session_id": "agent"})
    r1 = self.chat(msgs, tool_choice="required", **kw)
    self.assertEqual(r1.choices[0].finish_reason, "tool_calls")
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    call = r1.choices[0].message.tool_calls[0]
    msgs += [r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    r2 = self.chat(msgs, max_tokens=8, **kw)
    session = r2.model_extra["kvjax"]["session"]
    self.assertEqual((session["outcome"], session["reused_tokens"]), ("extended", n1))
    # Every token of turn 1 with KV (all but its last sampled one) is a device prefix hit.
    self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, n1 - 1)

  @parameterized.named_parameters(
      ("schema_missing", dict(response_format={"type": "json_schema",
                                               "json_schema": {"name": "a"}}),
       "response_format.json_schema"),
      ("schema_malformed", dict(response_format={"type": "json_schema", "json_schema": {
          "name": "a", "schema": {"type": "object", "properties": 3}}}),
       "response_format.json_schema.schema"),
      ("format_and_forced_call", dict(response_format={"type": "json_object"},
                                      tools=[PICK], tool_choice="required"),
       "response_format"))
  def test_bad_structured_requests_are_400s(self, fields, param):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(f"{self.srv.url}/v1/chat/completions", json=body, timeout=60)
    self.assertEqual(r.status_code, 400, r.text)
    self.assertEqual(r.json()["error"]["param"], param, r.text)


class MissingLibraryTest(absltest.TestCase):

  def test_without_llguidance_a_structured_request_is_a_400_saying_what_to_install(self):
    from kvjax.serve import protocol  # pylint: disable=import-outside-toplevel
    for fields, param in ((dict(response_format={"type": "json_object"}), "response_format"),
                          (dict(tools=[PICK], tool_choice="required"), "tool_choice")):
      req = protocol.parse(protocol.ChatCompletionRequest, json.dumps(
          {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).encode())
      with mock.patch.object(grammar, "available", return_value=False):
        with self.assertRaises(protocol.ApiError) as e:
          structured.structured_output(req)
      self.assertEqual((e.exception.status, e.exception.param), (400, param))
      self.assertIn("pip install kvjax[structured]", e.exception.message)
    self.assertIsNone(structured.structured_output(protocol.parse(
        protocol.ChatCompletionRequest,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}')))


class ToolCallGrammarTest(absltest.TestCase):

  def test_a_forced_call_is_written_as_the_canonical_call(self):
    from kvjax.serve import protocol, tool_calls  # pylint: disable=import-outside-toplevel
    tool = protocol.Tool.model_validate(PICK)
    lark = structured.tool_call_grammar([tool], parallel=False)
    self.assertIn("%json", lark)
    grammar.grammar_text(StructuredOutput(lark=lark))  # valid
    engine = engines.fake_engine()
    out = engines.generate(engine, [PROMPT], SamplingParams(
        max_tokens=100, temperature=0.0, structured=StructuredOutput(lark=lark)))[0]
    parsed = tool_calls.parse_reply(out.text, ["pick"])
    self.assertLen(parsed.calls, 1)
    self.assertEqual(out.text, tool_calls.call_text("pick", parsed.calls[0].arguments))


if __name__ == "__main__":
  absltest.main()
