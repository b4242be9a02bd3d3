"""Serve hardening through the real server: body limits, a busy event loop, hosts, origins, JSON
only, API keys, the waiting-queue bound.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy model;
nothing here depends on the model's numbers); the real tiny model's run and special tokens in
SmolLM2's user text are tests/integration/serve/serve_hardening_test.py."""

import concurrent.futures
import json
import threading

import httpx
import openai
from absl.testing import absltest, parameterized

from kvjax.serve import HttpPolicy, HttpServer, ServeState, ServerConfig, create_app
from kvjax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, host_name
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

JSON = {"Content-Type": "application/json"}
HEALTH_TIMEOUT_S = 5.0  # generous: the server answers at once unless its event loop is blocked
MiB = 2**20


def tiny_llm(**kw):
  return engines.fake_llm(chunk_sizes=(16, 32), **kw)


def completion(**kw):
  return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **kw}


class GatedTokenizer:
  """Wraps a tokenizer: records encode calls and holds each one until `release` is set."""

  def __init__(self, inner, *, hold: bool = True):
    self.inner = inner
    self.calls: list[tuple[str, dict]] = []
    self.entered = threading.Event()
    self.release = threading.Event()
    if not hold:
      self.release.set()

  @property
  def max_token_chars(self):
    return self.inner.max_token_chars

  def _gate(self, name, kwargs):
    self.calls.append((name, kwargs))
    self.entered.set()
    self.release.wait(60)

  def encode(self, text, add_special_tokens=True, **kwargs):
    self._gate("encode", kwargs)
    return self.inner.encode(text, add_special_tokens, **kwargs)

  def encode_chat(self, messages, add_generation_prompt=True, **kwargs):
    self._gate("encode_chat", kwargs)
    return self.inner.encode_chat(messages, add_generation_prompt, **kwargs)

  def decode(self, ids, skip_special_tokens=False):
    return self.inner.decode(ids, skip_special_tokens)


def chunked(head: bytes, filler_bytes: int, tail: bytes, during=None, chunk: int = MiB):
  """A body generator (sent chunked, no Content-Length) that calls `during()` after its first
  megabyte is sent, while the rest is still to come."""
  yield head
  sent = 0
  while sent < filler_bytes:
    n = min(chunk, filler_bytes - sent)
    yield b"a" * n
    sent += n
    if during is not None and sent == n:
      during()
  yield tail


class LimitsUnitTest(ServedLLMTestCase):
  """Default options: 4 MiB bodies, loopback hosts, no CORS, no key."""

  @classmethod
  def make_llm(cls):
    return tiny_llm(max_num_seqs=2)

  def gate(self, hold=True):
    gated = GatedTokenizer(self.srv.backend.tokenizer, hold=hold)
    original = self.srv.backend.tokenizer
    self.srv.backend.tokenizer = gated
    self.addCleanup(setattr, self.srv.backend, "tokenizer", original)
    self.addCleanup(gated.release.set)
    return gated

  def health(self):
    return httpx.get(self.srv.url + "/health", timeout=HEALTH_TIMEOUT_S)

  def assert_error(self, r, status, code, param=None):
    self.assertEqual(r.status_code, status, r.text)
    self.assertEqual(r.json(), {"error": {"message": r.json()["error"]["message"],
                                          "type": "invalid_request_error", "param": param,
                                          "code": code}})
    return r.json()["error"]["message"]

  def assert_works(self):
    out = self.client.completions.create(model="tiny", prompt="fine", max_tokens=3)
    self.assertEqual(out.usage.completion_tokens, 3)

  # ------------------------------------------------------------------------------ body size
  def test_20mb_body_with_content_length_gets_413_before_parsing(self):
    gated = self.gate(hold=False)
    before = self.srv.scrape().get(
        ("kvjax_request_errors_total", (("status", "413"), ("type", "invalid_request_error"))), 0)
    body = json.dumps(completion(prompt="a" * (20 * MiB))).encode()
    r = httpx.post(self.srv.url + "/v1/completions", content=body, headers=JSON, timeout=60)
    message = self.assert_error(r, 413, "request_too_large")
    self.assertIn(str(DEFAULT_MAX_REQUEST_BYTES), message)
    self.assertEqual(gated.calls, [])
    after = self.srv.scrape()[
        ("kvjax_request_errors_total", (("status", "413"), ("type", "invalid_request_error")))]
    self.assertEqual(after, before + 1)
    self.assert_works()

  def test_openai_client_gets_413_for_a_5mb_prompt(self):
    with self.assertRaises(openai.APIStatusError) as e:
      self.client.completions.create(model="tiny", prompt="a" * (5 * MiB), max_tokens=1)
    self.assertEqual(e.exception.status_code, 413)
    self.assertEqual(e.exception.code, "request_too_large")

  def test_chunked_20mb_body_gets_413_and_health_answers_meanwhile(self):
    health = []
    body = chunked(b'{"model": "tiny", "prompt": "', 20 * MiB, b'"}',
                   during=lambda: health.append(self.health()))
    r = httpx.post(self.srv.url + "/v1/completions", content=body, headers=JSON, timeout=60)
    self.assertEqual("transfer-encoding" in r.request.headers, True)
    self.assertNotIn("content-length", r.request.headers)
    self.assert_error(r, 413, "request_too_large")
    self.assertLen(health, 1)
    self.assertEqual((health[0].status_code, health[0].json()["status"]), (200, "ok"))
    self.assert_works()

  def test_body_at_the_limit_is_parsed(self):
    filler = DEFAULT_MAX_REQUEST_BYTES - len(b'{"model": "tiny", "prompt": ""}')
    body = b'{"model": "tiny", "prompt": "' + b"a" * filler + b'"}'
    self.assertLen(body, DEFAULT_MAX_REQUEST_BYTES)
    r = httpx.post(self.srv.url + "/v1/completions", content=body, headers=JSON, timeout=60)
    self.assert_error(r, 400, "context_length_exceeded", "prompt")  # parsed: too long a prompt
    r = httpx.post(self.srv.url + "/v1/completions", content=body[:-2] + b'a"}', headers=JSON,
                   timeout=60)
    self.assert_error(r, 413, "request_too_large")

  # ------------------------------------------------------------------------- length cap
  def test_3mb_prompt_is_rejected_before_tokenizing_and_health_answers_meanwhile(self):
    gated = self.gate(hold=False)
    health = []
    body = chunked(b'{"model": "tiny", "max_tokens": 1, "prompt": "', 3 * MiB, b'"}',
                   during=lambda: health.append(self.health()))
    r = httpx.post(self.srv.url + "/v1/completions", content=body, headers=JSON, timeout=60)
    message = self.assert_error(r, 400, "context_length_exceeded", "prompt")
    self.assertIn(f"has {3 * MiB} characters, more than 512 tokens can hold", message)
    self.assertEqual(gated.calls, [])
    self.assertEqual(health[0].status_code, 200)

  def test_chat_characters_are_capped_before_rendering(self):
    gated = self.gate(hold=False)
    msgs = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 213}]
    with self.assertRaises(openai.BadRequestError) as e:
      self.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    self.assertEqual((e.exception.code, e.exception.param),
                     ("context_length_exceeded", "messages"))
    self.assertIn("your messages have 513 characters", str(e.exception))
    self.assertEqual(gated.calls, [])

  def test_prompt_at_the_character_cap_is_tokenized(self):
    gated = self.gate(hold=False)
    with self.assertRaises(openai.BadRequestError) as e:  # 512 chars -> 512 tokens: no room
      self.client.completions.create(model="tiny", prompt="a" * 512, max_tokens=1)
    self.assertIn("resulted in 512 tokens", str(e.exception))
    self.assertEqual(gated.calls, [("encode", {"parse_special": False})])

  # ---------------------------------------------------------------- tokenizing off the loop
  @parameterized.named_parameters(
      ("completion", "completions", completion(max_tokens=3), "encode"),
      ("chat", "chat/completions",
       {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
       "encode_chat"))
  def test_tokenizing_runs_off_the_event_loop(self, endpoint, body, call):
    gated = self.gate()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pending = pool.submit(httpx.post, f"{self.srv.url}/v1/{endpoint}", json=body, timeout=120)
      self.assertTrue(gated.entered.wait(60))
      # The request is held inside the tokenizer; the loop still answers everyone else.
      self.assertEqual(self.health().status_code, 200)
      r = httpx.get(self.srv.url + "/v1/models", timeout=HEALTH_TIMEOUT_S)
      self.assertEqual(r.json()["data"][0]["id"], "tiny")
      self.assertFalse(pending.done())
      gated.release.set()
      r = pending.result(timeout=120)
    self.assertEqual(r.status_code, 200, r.text)
    self.assertEqual(r.json()["usage"]["completion_tokens"], 3)
    self.assertEqual([name for name, _ in gated.calls], [call])

  # ------------------------------------------------------------------------ content type
  @parameterized.named_parameters(
      ("text_plain", "text/plain"), ("form", "application/x-www-form-urlencoded"),
      ("multipart", "multipart/form-data; boundary=x"), ("json_lookalike", "application/jsonp"))
  def test_only_json_bodies(self, ctype):
    r = httpx.post(self.srv.url + "/v1/completions", content=json.dumps(completion()),
                   headers={"Content-Type": ctype}, timeout=60)
    message = self.assert_error(r, 415, "unsupported_media_type")
    self.assertIn(ctype, message)

  def test_body_without_content_type_is_refused(self):
    r = httpx.post(self.srv.url + "/v1/completions", content=json.dumps(completion()),
                   headers={"Content-Type": ""}, timeout=60)
    self.assert_error(r, 415, "unsupported_media_type")

  def test_json_with_charset_and_bodyless_admin_post_are_served(self):
    r = httpx.post(self.srv.url + "/v1/completions", content=json.dumps(completion()),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=60)
    self.assertEqual(r.json()["usage"]["completion_tokens"], 2)
    self.assertEqual(httpx.post(self.srv.url + "/admin/flush_kv", timeout=60).status_code, 200)

  # ------------------------------------------------------------------------- hosts, CORS
  @parameterized.named_parameters(
      ("foreign", "evil.example", 400), ("foreign_with_port", "evil.example:8000", 400),
      ("rebinding_ip", "10.0.0.7", 400), ("localhost", "localhost", 200),
      ("localhost_port", "LocalHost:8000", 200), ("ipv4", "127.0.0.1:1", 200),
      ("other_loopback_ipv4", "127.0.0.2", 200), ("ipv6", "[::1]:8000", 200))
  def test_host_header_on_loopback(self, host, status):
    for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"),
                         ("GET", "/v1/models")):
      r = httpx.request(method, self.srv.url + path, headers={"Host": host},
                        json=completion() if method == "POST" else None, timeout=60)
      self.assertEqual(r.status_code, status, (path, r.text))
      if status == 400:
        self.assertEqual(r.json()["error"]["code"], "invalid_host")

  def test_no_cors_headers_by_default(self):
    origin = {"Origin": "http://evil.example"}
    r = httpx.get(self.srv.url + "/v1/models", headers=origin)
    self.assertEqual(r.status_code, 200)
    self.assertFalse([h for h in r.headers if h.startswith("access-control-")])
    r = httpx.options(self.srv.url + "/v1/completions",
                      headers={**origin, "Access-Control-Request-Method": "POST"})
    self.assertEqual(r.status_code, 405)
    self.assertFalse([h for h in r.headers if h.startswith("access-control-")])


class WaitingQueueUnitTest(ServedLLMTestCase):
  """One decode slot and no waiting room: a second request while one runs gets 429."""

  serve_options = {"max_waiting_requests": 0}

  @classmethod
  def make_llm(cls):
    return tiny_llm(max_num_seqs=1)

  def hold_engine(self):
    """Makes the engine thread wait after its next step until the returned event is set (the
    running request stays unfinished meanwhile); returns (entered, release) events."""
    engine, entered, release = self.llm.engine, threading.Event(), threading.Event()
    original = engine.step

    def step():
      outputs = original()
      entered.set()
      release.wait(60)
      return outputs

    engine.step = step
    self.addCleanup(delattr, engine, "step")
    self.addCleanup(release.set)
    return entered, release

  def test_429_beyond_the_queue_then_served_again(self):
    key = ("kvjax_request_errors_total", (("status", "429"), ("type", "rate_limit_exceeded")))
    before = self.srv.scrape().get(key, 0)
    entered, release = self.hold_engine()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      running = pool.submit(self.client.completions.create, model="tiny", prompt="long",
                            max_tokens=5)
      self.assertTrue(entered.wait(60))  # it holds the only slot until released
      with self.assertRaises(openai.RateLimitError) as e:
        self.client.completions.create(model="tiny", prompt="x", max_tokens=1)
      self.assertEqual(e.exception.code, "too_many_waiting_requests")
      self.assertEqual(e.exception.body["type"], "rate_limit_exceeded")
      self.assertEqual(e.exception.response.headers["retry-after"], "1")
      r = httpx.post(self.srv.url + "/v1/chat/completions", timeout=60, json={
          "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
          "stream": True})
      self.assertEqual(r.status_code, 429)  # streams are refused before they start
      self.assertEqual(httpx.get(self.srv.url + "/health", timeout=HEALTH_TIMEOUT_S).status_code,
                       200)
      release.set()
      self.assertEqual(running.result(timeout=120).usage.completion_tokens, 5)
    out = self.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    self.assertEqual(out.usage.completion_tokens, 2)
    self.assertEqual(self.srv.scrape()[key], before + 2)

  def test_requests_the_engine_rejects_free_their_place(self):
    engine = self.llm.engine
    original = engine.add_request

    def add(ids, params, **kw):
      if ids[:3] == list(b"BAD"):
        raise ValueError("injected rejection")
      return original(ids, params, **kw)

    engine.add_request = add
    self.addCleanup(delattr, engine, "add_request")
    for _ in range(3):  # each rejection releases its place: no 429 for the next
      with self.assertRaisesRegex(openai.BadRequestError, "injected rejection"):
        self.client.completions.create(model="tiny", prompt="BAD", max_tokens=1)
    out = self.client.completions.create(model="tiny", prompt="x", max_tokens=2)
    self.assertEqual(out.usage.completion_tokens, 2)


class ApiKeyUnitTest(ServedLLMTestCase):

  serve_options = {"policy": HttpPolicy(api_key="s3cret-key")}

  @classmethod
  def make_llm(cls):
    return tiny_llm(max_num_seqs=1)

  def test_openai_client_with_the_key_is_served(self):
    out = self.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    self.assertEqual(out.usage.completion_tokens, 2)
    self.assertEqual([m.id for m in self.client.models.list().data], ["tiny"])
    self.srv.flush()  # /admin/flush_kv with the key

  @parameterized.named_parameters(
      ("wrong_key", "Bearer s3cret-kez"), ("prefix_of_key", "Bearer s3cret"),
      ("longer_key", "Bearer s3cret-key2"), ("no_scheme", "s3cret-key"),
      ("basic_scheme", "Basic s3cret-key"), ("empty_bearer", "Bearer"), ("none", None))
  def test_without_the_key_every_guarded_path_is_401(self, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/v1/models/tiny"),
                         ("POST", "/admin/flush_kv"), ("GET", "/docs"), ("GET", "/nothing")):
      r = httpx.request(method, self.srv.url + path, headers=headers, timeout=60,
                        json=completion() if path.startswith("/v1/c") else None)
      self.assertEqual(r.status_code, 401, (path, r.text))
      self.assertEqual(r.json()["error"]["code"], "invalid_api_key")
      self.assertEqual(r.headers["www-authenticate"], "Bearer")

  def test_openai_client_with_a_wrong_key_raises_authentication_error(self):
    client = openai.OpenAI(base_url=self.srv.url + "/v1", api_key="wrong", max_retries=0)
    with self.assertRaises(openai.AuthenticationError) as e:
      client.completions.create(model="tiny", prompt="x", max_tokens=1)
    self.assertEqual(e.exception.code, "invalid_api_key")

  def test_bearer_scheme_is_case_insensitive(self):
    r = httpx.get(self.srv.url + "/v1/models", headers={"Authorization": "bearer s3cret-key"})
    self.assertEqual(r.status_code, 200)

  def test_health_and_metrics_stay_open(self):
    self.assertEqual(httpx.get(self.srv.url + "/health").json()["status"], "ok")
    r = httpx.get(self.srv.url + "/metrics")
    self.assertEqual(r.status_code, 200)
    self.assertIn("kvjax_requests_total", r.text)


class PolicyServerTest(parameterized.TestCase):
  """Options that need no model: a server whose backend is never attached (routes answer 503
  once past the guard)."""

  def serve(self, policy):
    http = HttpServer(create_app(ServeState(), policy), "127.0.0.1", 0)
    http.start()
    self.addCleanup(http.stop)
    return http.url

  def test_auth_health_and_metrics_closes_them(self):
    url = self.serve(HttpPolicy(api_key="k", auth_health_and_metrics=True))
    for path in ("/health", "/metrics"):
      self.assertEqual(httpx.get(url + path).status_code, 401)
      self.assertEqual(httpx.get(url + path, headers={"Authorization": "Bearer k"}).status_code,
                       503 if path == "/health" else 200)

  def test_allowed_hosts_add_names_on_loopback(self):
    url = self.serve(HttpPolicy(allowed_hosts=("llm.example", "*.corp.example")))
    for host, status in (("llm.example", 503), ("a.corp.example:8000", 503),
                         ("corp.example", 400), ("localhost", 503), ("evil.example", 400)):
      r = httpx.get(url + "/health", headers={"Host": host})
      self.assertEqual(r.status_code, status, host)

  def test_allowed_origins_get_cors(self):
    url = self.serve(HttpPolicy(allowed_origins=("https://app.example",), api_key="k"))
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "https://app.example",
                                                             **pre})
    self.assertEqual(r.status_code, 200)  # preflights carry no key: answered before the check
    self.assertEqual(r.headers["access-control-allow-origin"], "https://app.example")
    self.assertIn("authorization", r.headers["access-control-allow-headers"].lower())
    r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                             **pre})
    self.assertEqual(r.status_code, 400)
    self.assertNotIn("access-control-allow-origin", r.headers)
    r = httpx.get(url + "/v1/models", headers={"Origin": "https://app.example",
                                               "Authorization": "Bearer k"})
    self.assertEqual((r.status_code, r.headers["access-control-allow-origin"]),
                     (503, "https://app.example"))
    r = httpx.get(url + "/health", headers={"Origin": "https://evil.example"})
    self.assertNotIn("access-control-allow-origin", r.headers)


class HttpPolicyTest(parameterized.TestCase):

  @parameterized.parameters(
      ("LocalHost:8000", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
      ("example.com.", "example.com"), ("10.0.0.1:80", "10.0.0.1"), ("::1", "::1"))
  def test_host_name(self, header, name):
    self.assertEqual(host_name(header), name)

  @parameterized.named_parameters(
      ("loopback_default", "127.0.0.1", None, {"localhost": True, "127.0.0.9": True,
                                               "[::1]": True, "evil.example": False,
                                               "localhost.evil.example": False}),
      ("ipv6_loopback", "::1", None, {"[::1]:1": True, "evil.example": False}),
      ("all_interfaces_default", "0.0.0.0", None, {"evil.example": True, "localhost": True}),
      ("all_interfaces_narrowed", "0.0.0.0", ("llm.example",),
       {"llm.example": True, "LLM.example:80": True, "localhost": False, "evil.example": False}),
      ("wildcard", "127.0.0.1", ("*",), {"evil.example": True}),
      ("subdomains", "192.168.1.5", ("*.example",),
       {"a.example": True, "a.b.example": True, "example": False, "aexample": False}))
  def test_host_allowed(self, bind, allowed, cases):
    policy = HttpPolicy(bind_host=bind, allowed_hosts=allowed)
    self.assertEqual({h: policy.host_allowed(h) for h in cases}, cases)
    self.assertTrue(policy.host_allowed(None))  # HTTP/1.0 without Host

  def test_needs_key(self):
    self.assertFalse(HttpPolicy().needs_key("/v1/models"))
    keyed = HttpPolicy(api_key="k")
    self.assertEqual([keyed.needs_key(p) for p in ("/v1/models", "/admin/flush_kv", "/health",
                                                    "/metrics", "/sessions/1")],
                     [True, True, False, False, True])
    self.assertTrue(HttpPolicy(api_key="k", auth_health_and_metrics=True).needs_key("/health"))

  @parameterized.parameters(
      (dict(max_request_bytes=0), "max_request_bytes"), (dict(api_key=""), "api_key"),
      (dict(allowed_hosts=("",)), "allowed_hosts"), (dict(allowed_hosts=("a/b",)), "a/b"),
      (dict(allowed_origins=("app.example",)), "not an origin"))
  def test_bad_policy(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      HttpPolicy(**kwargs)
    with self.assertRaisesRegex(ValueError, message):
      ServerConfig.from_flat(**kwargs)

  def test_server_config_policy(self):
    config = ServerConfig.from_flat(host="0.0.0.0", max_request_bytes=10, api_key="k",
                          allowed_hosts=("a.example",), allowed_origins=("https://b.example",))
    self.assertEqual(config.http_policy(), HttpPolicy(
        bind_host="0.0.0.0", max_request_bytes=10, allowed_hosts=("a.example",),
        allowed_origins=("https://b.example",), api_key="k"))
    with self.assertRaisesRegex(ValueError, "max_waiting_requests"):
      ServerConfig.from_flat(max_waiting_requests=-1)
    self.assertNotIn("s3cret", repr(ServerConfig.from_flat(api_key="s3cret")))
    self.assertNotIn("s3cret", repr(HttpPolicy(api_key="s3cret")))


if __name__ == "__main__":
  absltest.main()
