"""Structured output and tool calls with the real SmolLM2-135M-Instruct through the `openai`
client (slow): sampled json_schema replies valid in N/N runs, json_object replies that parse,
a forced tool call, and a tool-call session whose turn 2 loads every token of turn 1."""

import json

import jsonschema
import pytest
from absl.testing import absltest

from kvjax.models.loading.registry import DEFAULT_MODEL
from kvjax.testing.engines import real_llm
from kvjax.testing.serve import ServedLLMTestCase

RUNS = 5
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                  "maxItems": 3}},
    "required": ["city", "population_millions", "landmarks"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.slow
class StructuredRealTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return real_llm(DEFAULT_MODEL, max_num_seqs=2, chunk_sizes=(16, 32, 64, 128))

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.client = cls.client.with_options(timeout=600)

  def chat(self, messages, **kw):
    return self.client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, **kw)

  def test_json_schema_replies_are_valid_in_every_run(self):
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(RUNS):
      out = self.chat(msgs, response_format=fmt, temperature=0.8, seed=seed, max_tokens=120)
      self.assertEqual(out.choices[0].finish_reason, "stop", out.choices[0].message.content)
      jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)

  def test_json_object_replies_parse(self):
    msgs = [{"role": "user", "content": "Give me a JSON object about a dog."}]
    for seed in range(RUNS):
      out = self.chat(msgs, response_format={"type": "json_object"}, temperature=0.8,
                      seed=seed, max_tokens=160)
      if out.choices[0].finish_reason == "stop":
        self.assertIsInstance(json.loads(out.choices[0].message.content), dict)
      else:  # cut by max_tokens: a prefix of an object
        self.assertTrue(out.choices[0].message.content.startswith("{"))

  def test_a_tool_call_session_keeps_every_token(self):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(tools=[WEATHER], temperature=0, max_tokens=60,
              extra_body={"session_id": "real-agent"})
    r1 = self.chat(msgs, tool_choice="required", **kw)
    self.assertEqual(r1.choices[0].finish_reason, "tool_calls")
    call = r1.choices[0].message.tool_calls[0]
    self.assertEqual(call.function.name, "get_weather")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    msgs += [r1.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    r2 = self.chat(msgs, **kw)
    self.assertEqual(r2.model_extra["kvjax"]["session"]["outcome"], "extended")
    self.assertEqual(r2.model_extra["kvjax"]["session"]["reused_tokens"], n1)
    self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, n1 - 1)


if __name__ == "__main__":
  absltest.main()
