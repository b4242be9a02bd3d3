"""Bad input gets a 4xx OpenAI-style body; faults fail one request and never the server.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy model);
the real tiny model's run is tests/integration/serve/serve_errors_test.py."""

import json
import typing

import httpx
import openai
from absl.testing import absltest, parameterized

from kvjax.serve import protocol
from kvjax.serve import HttpServer, ServeState, backend_from_llm, close_backend, create_app
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

MSGS = [{"role": "user", "content": "hi"}]
CHUNK = 32


def completion(**kw):
  return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
  return {"model": "tiny", "messages": MSGS, "max_tokens": 2, **kw}


# (name, endpoint, body, status, param, code); bodies that are str are sent as raw bytes.
BAD = [
    ("empty_prompt", "completions", completion(prompt=""), 400, "prompt", "invalid_value"),
    ("empty_token_prompt", "completions", completion(prompt=[]), 400, "prompt", "invalid_value"),
    ("token_outside_vocab", "completions", completion(prompt=[1, 999]), 400,
     "prompt", "invalid_value"),
    ("batched_prompts", "completions", completion(prompt=["a", "b"]), 400,
     "prompt", "invalid_value"),
    ("empty_messages", "chat/completions", chat(messages=[]), 400, "messages", "invalid_value"),
    ("prompt_beyond_context", "completions", completion(prompt="a" * 600), 400, "prompt",
     "context_length_exceeded"),
    ("messages_beyond_context", "chat/completions",
     chat(messages=[{"role": "user", "content": "a" * 600}]), 400, "messages",
     "context_length_exceeded"),
    ("max_tokens_zero", "completions", completion(max_tokens=0), 400,
     "max_tokens", "invalid_value"),
    ("max_tokens_negative", "chat/completions", chat(max_tokens=-3), 400,
     "max_tokens", "invalid_value"),
    ("max_tokens_too_large", "completions", completion(max_tokens=100_000), 400, "max_tokens",
     "context_length_exceeded"),
    ("max_completion_tokens_too_large", "chat/completions",
     chat(max_tokens=None, max_completion_tokens=511), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("max_tokens_as_string", "completions", completion(max_tokens="5"), 400,
     "max_tokens", "invalid_type"),
    ("max_tokens_as_float", "completions", completion(max_tokens=5.0), 400,
     "max_tokens", "invalid_type"),
    ("temperature_as_string", "chat/completions", chat(temperature="hot"), 400, "temperature",
     "invalid_type"),
    ("temperature_too_high", "chat/completions", chat(temperature=3), 400,
     "temperature", "invalid_value"),
    ("temperature_nan", "chat/completions", chat(temperature=float("nan")), 400, "temperature",
     "invalid_value"),
    ("top_p_zero", "completions", completion(top_p=0), 400, "top_p", "invalid_value"),
    ("top_p_bool", "completions", completion(top_p=True), 400, "top_p", "invalid_type"),
    ("stream_as_string", "completions", completion(stream="yes"), 400, "stream", "invalid_type"),
    ("seed_as_float", "completions", completion(seed=1.5), 400, "seed", "invalid_type"),
    ("seed_beyond_int64", "completions", completion(seed=2**63), 400, "seed", "invalid_value"),
    ("seed_below_int64", "chat/completions", chat(seed=-2**63 - 1), 400, "seed", "invalid_value"),
    ("stop_as_int", "completions", completion(stop=5), 400, "stop", "invalid_type"),
    ("stop_empty_string", "completions", completion(stop=[""]), 400, "stop", "invalid_value"),
    ("logprobs_as_string", "completions", completion(logprobs="x"), 400,
     "logprobs", "invalid_type"),
    ("messages_as_string", "chat/completions", chat(messages="hi"), 400,
     "messages", "invalid_type"),
    ("content_as_int", "chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", "invalid_type"),
    ("image_part", "chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]), 400,
     "messages[0]", "invalid_value"),
    ("unknown_role", "chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role", "invalid_value"),
    ("cache_salt_as_int", "completions", completion(cache_salt=7), 400,
     "cache_salt", "invalid_type"),
    ("unknown_field", "completions", completion(foo=1), 400, "foo", "unknown_parameter"),
    ("unknown_message_field", "chat/completions",
     chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]), 400,
     "messages[0].mood", "unknown_parameter"),
    ("invalid_json", "completions", '{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("empty_body", "chat/completions", "", 400, None, "invalid_json"),
    ("json_array", "completions", "[1, 2]", 400, None, "invalid_type"),
    ("missing_model", "completions", {"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ("unknown_model", "completions", completion(model="gpt-9"), 404, "model", "model_not_found"),
    ("unknown_model_chat", "chat/completions", chat(model="gpt-9"), 404, "model",
     "model_not_found"),
    ("n_zero", "completions", completion(n=0), 400, "n", "invalid_value"),
    ("n_too_many_chat", "chat/completions", chat(n=129), 400, "n", "invalid_value"),
    ("presence_penalty_too_high", "chat/completions", chat(presence_penalty=2.5), 400,
     "presence_penalty", "invalid_value"),
    ("logit_bias_key_not_an_id", "completions", completion(logit_bias={"x": 1}), 400,
     "logit_bias", "invalid_value"),
    ("logit_bias_too_large", "chat/completions", chat(logit_bias={"5": 101}), 400,
     "logit_bias", "invalid_value"),
    ("logit_bias_outside_vocab", "completions", completion(logit_bias={"99999": 1}), 400,
     "logit_bias", "invalid_value"),
    ("reasoning_effort", "chat/completions", chat(reasoning_effort="low"), 400,
     "reasoning_effort", "unsupported_parameter"),
    ("modalities", "chat/completions", chat(modalities=["text", "audio"]), 400, "modalities",
     "unsupported_parameter"),
    ("prediction", "chat/completions", chat(prediction={"type": "content", "content": "x"}),
     400, "prediction", "unsupported_parameter"),
    ("web_search_options", "chat/completions", chat(web_search_options={}), 400,
     "web_search_options", "unsupported_parameter"),
    ("chat_field_on_completions", "completions", completion(messages=MSGS), 400, "messages",
     "unknown_parameter"),
    ("n_with_session", "chat/completions", chat(n=2, session_id="s1"), 400, "n",
     "unsupported_value"),
    ("stream_options_without_stream", "completions",
     completion(stream_options={"include_usage": True}), 400, "stream_options", "invalid_value"),
    ("echo", "completions", completion(echo=True), 400, "echo", "unsupported_value"),
    ("tool_without_function", "chat/completions", chat(tools=[{"type": "function"}]), 400,
     "tools[0].function", "missing_required_parameter"),
]


class OpenAIParamsTest(absltest.TestCase):
  """The protocol's lists of OpenAI's own fields are the `openai` package's request types, so
  an OpenAI field kvjax does not serve gets "not supported", never the typo wording."""

  def test_lists_match_the_openai_package(self):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    for ours, theirs in ((protocol.OPENAI_CHAT_PARAMS, chat_params.CompletionCreateParamsBase),
                         (protocol.OPENAI_COMPLETION_PARAMS,
                          completion_create_params.CompletionCreateParamsBase)):
      self.assertEqual(set(typing.get_type_hints(theirs)) - {"stream"}, ours - {"stream"})

  def test_every_openai_field_is_taken_or_named_unsupported(self):
    for model, names, body in (
        (protocol.ChatCompletionRequest, protocol.OPENAI_CHAT_PARAMS, chat()),
        (protocol.CompletionRequest, protocol.OPENAI_COMPLETION_PARAMS, completion())):
      for name in sorted(names - set(model.model_fields)):
        with self.subTest(name=name), self.assertRaises(protocol.ApiError) as e:
          protocol.parse(model, json.dumps({**body, name: 1}).encode())
        self.assertEqual((e.exception.param, e.exception.code), (name, "unsupported_parameter"))
        self.assertIn(f"{name} is not supported", e.exception.message)


class ServeErrorsUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    # Store faults: no device hit may serve them, and load-only issues a load for every stored
    # chunk (under Cake, compute could take every chunk before a load was issued, and no read
    # would fail: the test failed that way once under CI load).
    return engines.fake_llm(max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store="memory://",
                            kv_chunk_size=CHUNK, kv_merge_mode="load_only",
                            enable_prefix_caching=False)

  def post(self, endpoint, body):
    data = body.encode() if isinstance(body, str) else json.dumps(
        {k: v for k, v in body.items() if v is not None})
    return httpx.post(f"{self.srv.url}/v1/{endpoint}", content=data,
                      headers={"Content-Type": "application/json"}, timeout=60)

  def assert_works(self):
    out = self.client.completions.create(model="tiny", prompt="fine", max_tokens=3,
                                         temperature=0)
    self.assertEqual(out.usage.completion_tokens, 3)

  def assert_error(self, r, status, param=None, code=None, type_="invalid_request_error"):
    self.assertEqual(r.status_code, status, r.text)
    err = r.json()["error"]
    self.assertEqual(set(err), {"message", "type", "param", "code"})
    self.assertEqual((err["type"], err["param"], err["code"]), (type_, param, code), err)
    self.assertTrue(err["message"])

  @parameterized.named_parameters(*BAD)
  def test_bad_request_gets_openai_error_and_the_next_works(self, endpoint, body, status, param,
                                                            code):
    self.assert_error(self.post(endpoint, body), status, param, code)
    if isinstance(body, dict) and not body.get("stream") and "stream_options" not in body:
      r = self.post(endpoint, {**body, "stream": True})  # streams are checked the same way
      self.assertEqual(r.status_code, status)
    self.assert_works()

  def test_openai_client_raises_its_typed_errors(self):
    with self.assertRaises(openai.NotFoundError) as e:
      self.client.completions.create(model="nope", prompt="x", max_tokens=1)
    self.assertEqual(e.exception.code, "model_not_found")
    with self.assertRaises(openai.BadRequestError) as e:
      self.client.completions.create(model="tiny", prompt="x", max_tokens=1, n=0)
    self.assertEqual((e.exception.param, e.exception.code), ("n", "invalid_value"))
    with self.assertRaises(openai.BadRequestError) as e:
      self.client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1,
                                          reasoning_effort="low")
    self.assertEqual((e.exception.param, e.exception.code),
                     ("reasoning_effort", "unsupported_parameter"))
    self.assertIn("reasoning_effort is not supported", e.exception.message)
    self.assert_works()

  def test_a_non_text_content_part_is_named_in_the_error(self):
    r = self.post("chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]))
    self.assert_error(r, 400, "messages[0]", "invalid_value")
    self.assertIn("'input_audio' are not supported", r.json()["error"]["message"])

  def test_seeds_at_the_int64_ends_are_served(self):
    for seed in (2**63 - 1, -2**63):
      r = self.post("completions", completion(seed=seed, max_tokens=2))
      self.assertEqual(r.status_code, 200, r.text)

  def test_explicit_nulls_mean_defaults(self):
    r = self.post("completions", '{"model": "tiny", "prompt": "x", "max_tokens": 2, "n": null, '
                  '"temperature": null, "stream": null, "stop": null, "seed": null}')
    self.assertEqual(r.status_code, 200, r.text)
    self.assertEqual(r.json()["usage"]["completion_tokens"], 2)

  def test_unknown_route_and_method(self):
    self.assert_error(httpx.get(self.srv.url + "/v1/nothing"), 404, code="not_found")
    self.assert_error(httpx.get(self.srv.url + "/v1/completions"), 405,
                      code="method_not_allowed")

  # ---------------------------------------------------------------------------------- faults
  def patch_engine(self, name, fn):
    engine = self.llm.engine
    original = getattr(engine, name)
    setattr(engine, name, lambda *a, **kw: fn(original, *a, **kw))
    self.addCleanup(delattr, engine, name)

  def test_exception_in_add_request_fails_only_that_request(self):
    def add(original, ids, params, **kw):
      if ids[:5] == list(b"BOOM!"):
        raise RuntimeError("injected add fault")
      return original(ids, params, **kw)

    self.patch_engine("add_request", add)
    r = self.post("completions", completion(prompt="BOOM! please"))
    self.assert_error(r, 500, type_="server_error")
    self.assertIn("injected add fault", r.json()["error"]["message"])
    self.assert_works()
    self.assertTrue(self.srv.backend.engine.alive)

  def test_exception_in_step_fails_its_requests_and_serving_continues(self):
    fail = [True]

    def step(original):
      if fail[0]:
        fail[0] = False
        raise RuntimeError("injected step fault")
      return original()

    before = self.srv.scrape()[("kvjax_engine_step_failures_total", ())]
    self.patch_engine("step", step)
    r = self.post("completions", completion())
    self.assert_error(r, 500, type_="server_error")
    self.assertIn("injected step fault", r.json()["error"]["message"])
    self.assertFalse(self.srv.engine_call(lambda e: e.has_unfinished_requests()))
    self.assert_works()
    self.assertEqual(self.srv.scrape()[("kvjax_engine_step_failures_total", ())], before + 1)

  def test_fault_mid_stream_ends_the_stream_with_an_error_event(self):
    calls = [0]

    def step(original):
      calls[0] += 1
      if calls[0] == 3:
        raise RuntimeError("injected mid-stream fault")
      return original()

    self.patch_engine("step", step)
    with self.assertRaisesRegex(openai.APIError, "mid-stream fault"):
      for _ in self.client.completions.create(model="tiny", prompt="hello", max_tokens=20,
                                              stream=True):
        pass
    self.assert_works()

  def test_store_read_fault_degrades_to_compute(self):
    prompt = "A long shared document about stores, tiers, links and faults. " * 2
    body = completion(prompt=prompt, max_tokens=4, temperature=0, cache_salt="faulty")
    first = self.post("completions", body).json()
    self.srv.flush()
    tier = self.llm.kv_store.store.tiers[0]

    async def broken_get(*args, **kwargs):
      raise OSError("injected store read fault")

    tier.get = broken_get
    self.addCleanup(delattr, tier, "get")
    before = self.srv.scrape()
    second = self.post("completions", body)
    self.assertEqual(second.status_code, 200)
    second = second.json()
    self.assertEqual(second["choices"][0]["text"], first["choices"][0]["text"])
    self.assertEqual(second["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
    self.assertEqual(second["kvjax"]["tokens_computed"], len(prompt))
    # Every load failed, and the chunks were computed instead.
    self.assertGreaterEqual(second["kvjax"]["rejected_chunks"], 1)
    merge = second["kvjax"]["merge"]
    self.assertEqual(merge["chunks_loaded"], [])
    self.assertEqual(sorted(merge["chunks_computed"]), list(range(merge["num_chunks"])))
    after = self.srv.scrape()
    key = ("kvjax_store_rejected_chunks_total", (("reason", "read_error"), ("tier", "disk")))
    self.assertGreaterEqual(after[key] - before.get(key, 0), 1)  # every chunk read fails
    warned = [k for k in after if k[0] == "kvjax_store_warnings_total"]
    self.assertGreater(sum(after[k] - before.get(k, 0) for k in warned), 0)


class StartupUnitTest(absltest.TestCase):

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(max_num_seqs=1, chunk_sizes=(16,))

  def test_health_is_503_until_the_backend_is_attached(self):
    state = ServeState()
    http = HttpServer(create_app(state), "127.0.0.1", 0)
    http.start()
    backend = None
    try:
      r = httpx.get(http.url + "/health")
      self.assertEqual((r.status_code, r.json()["status"]), (503, "loading"))
      r = httpx.post(http.url + "/v1/completions", json=completion())
      self.assertEqual(r.status_code, 503)
      self.assertEqual(r.json()["error"]["type"], "server_error")
      backend = backend_from_llm(self.make_llm())
      state.attach(backend)
      self.assertEqual(httpx.get(http.url + "/health").status_code, 200)
      r = httpx.post(http.url + "/v1/completions", json=completion())
      self.assertEqual(r.json()["usage"]["completion_tokens"], 2)
    finally:
      http.stop()
      close_backend(backend, None)


if __name__ == "__main__":
  absltest.main()
