"""Tool calls (`kvjax/serve/tool_calls.py`): the reply parser and its streamed form, the default
rendering of tools, calls and results, the exact-token rule across a tool-call turn (the next
turn extends the session's ids), and the server's 400s and bodies on the fake runner."""

import json

import httpx
from absl.testing import absltest, parameterized

from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.serve import completions, protocol, tool_calls
from kvjax.sessions import EXTENDED, NOT_EXTENDED, SessionRegistry
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMES = ("get_weather", "get_time")
# A reply as a model writes it: its own spacing inside the JSON, text before the call.
RAW = ('Let me look.\n<tool_call>\n{"name":"get_weather", "arguments":{"city":"Paris"}}\n'
       '</tool_call>')


def request(**fields) -> protocol.ChatCompletionRequest:
  body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
  req = protocol.parse(protocol.ChatCompletionRequest, json.dumps(body).encode())
  req.check_supported()
  tool_calls.check_request(req)
  return req


def history_after(reply_calls, content=None, result="18 C, sunny"):
  """A conversation: the user's question, the assistant's calls, a result per call."""
  calls = [{"id": f"call_{i}", "type": "function",
            "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(reply_calls)]
  return [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": content, "tool_calls": calls},
          *[{"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls]]


class ParseReplyTest(parameterized.TestCase):

  def test_calls_and_the_text_before_them(self):
    two = RAW + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    self.assertEqual(tool_calls.parse_reply(two, NAMES), tool_calls.ParsedReply(
        "Let me look.", (tool_calls.ParsedCall("get_weather", '{"city": "Paris"}'),
                         tool_calls.ParsedCall("get_time", "{}"))))
    self.assertEqual(tool_calls.parse_reply(two, NAMES, parallel=False).calls,
                     (tool_calls.ParsedCall("get_weather", '{"city": "Paris"}'),))

  def test_an_unclosed_last_block_and_string_arguments_parse(self):
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
    self.assertEqual(tool_calls.parse_reply(text, NAMES), tool_calls.ParsedReply(
        None, (tool_calls.ParsedCall("get_weather", '{"city": "Oslo"}'),)))

  @parameterized.named_parameters(
      ("no_block", "It is sunny."),
      ("bad_json", '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'),
      ("unknown_function", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
      ("arguments_not_an_object", '<tool_call>{"name": "get_time", "arguments": 3}</tool_call>'),
      ("one_good_one_bad", RAW + "<tool_call>oops</tool_call>"))
  def test_no_calls_leave_the_whole_text_as_content(self, text):
    self.assertEqual(tool_calls.parse_reply(text, NAMES), tool_calls.ParsedReply(text, ()))

  @parameterized.named_parameters(("calls", RAW + "\n"), ("no_calls", "Plain <tool answer>  "),
                                  ("broken", "Hi <tool_call>{oops</tool_call>"))
  def test_the_stream_gives_what_the_body_gives(self, text):
    for step in (1, 2, 7):
      pieces = [text[i:i + step] for i in range(0, len(text), step)]
      stream = tool_calls.CallStream(NAMES, parallel=True)
      streamed = "".join(stream.update(p) for p in pieces[:-1])
      tail, calls = stream.finish(pieces[-1])
      parsed = tool_calls.parse_reply(text, NAMES)
      self.assertEqual([(c["index"], c["type"], c["function"]["name"],
                         c["function"]["arguments"]) for c in calls],
                       [(i, "function", c.name, c.arguments) for i, c in enumerate(parsed.calls)])
      self.assertTrue(all(c["id"].startswith("call_") for c in calls))
      self.assertEqual(streamed + tail, parsed.content if parsed.calls else text, step)


class RenderTest(absltest.TestCase):

  def test_the_length_cap_counts_tools_and_calls(self):
    req = request(tools=[WEATHER], messages=history_after([("get_weather", '{"city": "P"}')]))
    self.assertEqual(tool_calls.text_chars(req),
                     len("Weather in Paris?") + len("get_weather") + len('{"city": "P"}')
                     + len("18 C, sunny") + len(tool_calls.tools_text(req.tools)))

  def test_tools_calls_and_results_as_plain_messages(self):
    req = request(tools=[WEATHER, TIME], messages=[
        {"role": "developer", "content": "Be brief."},
        *history_after([("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])])
    conv = tool_calls.render_conversation(req)
    self.assertEqual([m["role"] for m in conv], ["system", "user", "assistant", "user"])
    self.assertEqual(conv[0]["content"], "Be brief.\n\n" + tool_calls.tools_text(req.tools))
    self.assertIn('{"type": "function", "function": {"name": "get_weather"',
                  conv[0]["content"])
    self.assertEqual(conv[2]["content"],
                     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call><tool_call>\n{"name": "get_time", "arguments": {}}\n'
                     "</tool_call>")
    self.assertEqual(conv[3]["content"], "<tool_response>\n18 C, sunny\n</tool_response>\n"
                     "<tool_response>\n18 C, sunny\n</tool_response>")

  def test_replies_are_read_for_calls_unless_tool_choice_is_none(self):
    self.assertTrue(tool_calls.parses_calls(request(tools=[TIME])))
    self.assertTrue(tool_calls.parses_calls(request(tools=[TIME], tool_choice="auto")))
    self.assertFalse(tool_calls.parses_calls(request(tools=[TIME], tool_choice="none")))
    self.assertFalse(tool_calls.parses_calls(request()))
    # The tools block is rendered whatever the choice: one prompt, one cached prefix.
    self.assertEqual(tool_calls.render_conversation(request(tools=[TIME], tool_choice="none")),
                     tool_calls.render_conversation(request(tools=[TIME])))

  def test_a_canonical_call_parses_back_to_itself(self):
    text = tool_calls.call_text("get_weather", '{"city": "Paris"}')
    self.assertEqual(tool_calls.parse_reply(text, NAMES).calls,
                     (tool_calls.ParsedCall("get_weather", '{"city": "Paris"}'),))

  def test_the_sessions_last_reply_is_rendered_verbatim(self):
    req = request(tools=[WEATHER], messages=history_after(
        [("get_weather", '{"city": "Paris"}')], content="Let me look."))
    self.assertEqual(tool_calls.render_conversation(req, RAW)[2]["content"], RAW)
    other = request(tools=[WEATHER], messages=history_after(
        [("get_weather", '{"city": "Rome"}')], content="Let me look."))
    self.assertNotEqual(tool_calls.render_conversation(other, RAW)[2]["content"], RAW)


class ExactTokensTest(absltest.TestCase):
  """Turn 2 of a tool-using session is turn 1's exact ids plus the new part."""

  def run_two_turns(self, use_last_reply: bool):
    tok = ByteTokenizer()
    reg = SessionRegistry(tok)
    first = request(tools=[WEATHER], messages=[{"role": "user", "content": "Weather in Paris?"}])
    lease = reg.begin("s")
    prompt1 = reg.prompt(lease, tool_calls.render_conversation(first))
    reply_ids = tok.encode(RAW)
    self.assertTrue(reg.finish(lease, prompt1, reply_ids, RAW))
    parsed = tool_calls.parse_reply(RAW, NAMES)
    body_calls = tool_calls.message_calls(parsed.calls)  # what the client got back
    second = request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": parsed.content, "tool_calls": body_calls},
        {"role": "tool", "tool_call_id": body_calls[0]["id"], "content": "18 C, sunny"}])
    lease = reg.begin("s")
    last = lease.last.output_text if use_last_reply else None
    prompt2 = reg.prompt(lease, tool_calls.render_conversation(second, last))
    return prompt1.token_ids + tuple(reply_ids), prompt2

  def test_turn_two_extends_turn_one_exact_ids(self):
    turn1, prompt2 = self.run_two_turns(use_last_reply=True)
    self.assertEqual(prompt2.outcome, EXTENDED)
    self.assertEqual(prompt2.reused_tokens, len(turn1))
    self.assertEqual(prompt2.token_ids[:len(turn1)], turn1)
    self.assertEqual(bytes(prompt2.token_ids[len(turn1):]).decode(),
                     "\nuser: <tool_response>\n18 C, sunny\n</tool_response>\nassistant: ")

  def test_the_canonical_rendering_alone_would_miss(self):
    _, prompt2 = self.run_two_turns(use_last_reply=False)  # the model's spacing is not canonical
    self.assertEqual(prompt2.outcome, NOT_EXTENDED)

  def test_session_plan_passes_the_last_reply(self):
    tok = ByteTokenizer()
    reg = SessionRegistry(tok)
    first = request(tools=[WEATHER], session_id="s",
                    messages=[{"role": "user", "content": "Weather in Paris?"}])
    lease = reg.begin("s")
    plan = completions.session_plan(reg, lease, first)
    reg.finish(lease, plan.prompt, tok.encode(RAW), RAW)
    parsed = tool_calls.parse_reply(RAW, NAMES)
    calls = tool_calls.message_calls(parsed.calls)
    second = request(tools=[WEATHER], session_id="s", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": parsed.content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 C"}])
    plan2 = completions.session_plan(reg, reg.begin("s"), second)
    self.assertEqual(plan2.prompt.outcome, EXTENDED)
    self.assertEqual(plan2.prompt.reused_tokens, len(plan.token_ids) + len(RAW.encode()))


BAD = [
    ("function_missing", dict(tools=[{"type": "function"}]), "tools[0].function"),
    ("bad_name", dict(tools=[{"type": "function", "function": {"name": "get weather"}}]),
     "tools[0].function.name"),
    ("twice", dict(tools=[TIME, TIME]), "tools[1].function.name"),
    ("not_an_object_schema", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), "tools[0].function.parameters"),
    ("malformed_schema", dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 5}}}]),
     "tools[0].function.parameters"),
    ("required_without_tools", dict(tool_choice="required"), "tool_choice"),
    ("unknown_named", dict(tools=[TIME], tool_choice={"type": "function",
                                                      "function": {"name": "nope"}}),
     "tool_choice"),
    ("tool_without_call", dict(messages=[{"role": "user", "content": "x"},
                                         {"role": "tool", "tool_call_id": "c1",
                                          "content": "y"}]), "messages[1]"),
    ("tool_without_id", dict(messages=[{"role": "tool", "content": "y"}]),
     "messages[0].tool_call_id"),
    ("calls_on_a_user", dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
     "messages[0].tool_calls"),
]


class ToolCallsServeUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=2)

  def post(self, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **fields}
    return httpx.post(f"{self.srv.url}/v1/chat/completions", json=body, timeout=60)

  @parameterized.named_parameters(*BAD)
  def test_a_malformed_tool_request_is_a_400_naming_the_field(self, fields, param):
    r = self.post(**fields)
    self.assertEqual(r.status_code, 400, r.text)
    self.assertEqual(r.json()["error"]["param"], param, r.text)

  def test_a_tool_history_is_served_with_the_rendered_prompt(self):
    # The tiny model's context is 512 bytes: the history without the tools block, then the
    # tools block with one short function.
    for fields in (dict(messages=history_after([("get_weather", '{"city": "Paris"}')])),
                   dict(tools=[{"type": "function", "function": {"name": "t"}}])):
      out = self.client.chat.completions.create(
          model="tiny", **{"messages": [{"role": "user", "content": "hi"}], **fields},
          max_tokens=4, temperature=0)
      ids = ByteTokenizer().encode_chat(tool_calls.render_conversation(request(**fields)))
      self.assertEqual(out.usage.prompt_tokens, len(ids))
      self.assertEqual(out.choices[0].finish_reason, "length")  # random bytes: no call
      self.assertIsNone(out.choices[0].message.tool_calls)


if __name__ == "__main__":
  absltest.main()
