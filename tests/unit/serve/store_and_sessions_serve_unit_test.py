"""The server's sessions as a product: a session that survives a restart of the server over the
same store folder (its next turn extends the conversation and loads the stored tail, the output
equal to a cold run); 400s with clear messages for a null user content, an over-long
`cache_salt` and a lone-surrogate escape.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy
model); the real tiny model's run is tests/integration/serve/store_and_sessions_serve_test.py."""

import tempfile

import httpx
import openai
from absl.testing import absltest

from kvjax import LLM
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase, serving

C = 32
GREEDY = dict(temperature=0.0, max_tokens=6)
USER1 = "Tell me about stored session caches, briefly, please: " + "y" * 30


def make_llm(store: str) -> LLM:
  # No device prefix cache, load-only: every cached token of turn 2 is a store hit.
  return engines.fake_llm(max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
             kv_chunk_size=C, block_size=16,
             enable_prefix_caching=False, kv_merge_mode="load_only")


def chat(srv, messages, **extra):
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
  return client.chat.completions.create(model="tiny", messages=messages, extra_body=extra,
                                        **GREEDY)


class RestartUnitTest(absltest.TestCase):

  @classmethod
  def make_llm(cls, store: str) -> LLM:
    """The served `LLM` (tests/integration/serve/store_and_sessions_serve_test.py: the real tiny
    model)."""
    return make_llm(store)

  def test_a_session_survives_a_server_restart(self):
    store = f"file://{tempfile.mkdtemp()}"
    m1 = [{"role": "user", "content": USER1}]
    llm = self.make_llm(store)
    try:
      with serving(llm) as srv:
        r1 = chat(srv, m1, session_id="chat-1", cache_salt="tenant")
        srv.flush()
    finally:
      llm.close()
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    self.assertNotEqual((n1 - 1) % C, 0)  # turn 1 leaves a stored tail
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "and after a restart?"}]
    llm = self.make_llm(store)  # the restarted server
    try:
      with serving(llm) as srv:
        r2 = chat(srv, m2, session_id="chat-1", cache_salt="tenant")
        session = r2.model_extra["kvjax"]["session"]
        self.assertEqual((session["turn"], session["outcome"], session["reused_tokens"]),
                         (2, "extended", n1))
        self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, n1 - 1)
        prompt_ids = list(llm.sessions.get("chat-1", "tenant").token_ids[
            :r2.usage.prompt_tokens])
        cold = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused").completions.create(
            model="tiny", prompt=prompt_ids, extra_body={"cache_salt": "cold"}, **GREEDY)
        self.assertEqual(cold.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertEqual(r2.choices[0].message.content, cold.choices[0].text)
        other = chat(srv, m2, session_id="chat-1", cache_salt="another-tenant")
        self.assertEqual(other.model_extra["kvjax"]["session"]["outcome"], "first")
    finally:
      llm.close()


class ValidationUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16, 32), max_num_seqs=2)

  def post(self, body: bytes | dict):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(self.srv.url + "/v1/chat/completions", timeout=60,
                      headers={"Content-Type": "application/json"}, **kw)

  def assert_400(self, r, message: str, param: str | None):
    self.assertEqual(r.status_code, 400, r.text)
    err = r.json()["error"]
    self.assertIn(message, err["message"])
    self.assertEqual(err["param"], param)

  def test_null_content_of_a_user_message(self):
    for role in ("user", "system"):
      r = self.post({"model": "tiny", "max_tokens": 1,
                     "messages": [{"role": "user", "content": "hi"},
                                  {"role": role, "content": None}]})
      self.assert_400(r, f"messages[1].content is null: a '{role}' message needs content",
                      "messages[1].content")
    r = self.post({"model": "tiny", "max_tokens": 1,  # an assistant's may be null (OpenAI)
                   "messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": None},
                                {"role": "user", "content": "again"}]})
    self.assertEqual(r.status_code, 200, r.text)

  def test_cache_salt_length(self):
    msgs = [{"role": "user", "content": "hi"}]
    r = self.post({"model": "tiny", "max_tokens": 1, "messages": msgs, "cache_salt": "s" * 257})
    self.assert_400(r, "cache_salt is 257 characters; at most 256 are allowed", "cache_salt")
    r = self.post({"model": "tiny", "max_tokens": 1, "messages": msgs, "cache_salt": "s" * 256})
    self.assertEqual(r.status_code, 200, r.text)
    r = httpx.post(self.srv.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "max_tokens": 1, "prompt": "hi",
                         "cache_salt": "s" * 100_000})
    self.assert_400(r, "cache_salt is 100000 characters", "cache_salt")
    r = httpx.delete(f"{self.srv.url}/v1/sessions/x", params={"cache_salt": "s" * 300},
                     timeout=60)
    self.assert_400(r, "cache_salt is 300 characters", "cache_salt")

  def test_a_lone_surrogate_escape(self):
    for text, escape in (("\\ud800", "\\ud800"), ("a\\udc00b", "\\udc00"),
                         ("\\ud83d\\u0041", "\\ud83d")):
      body = ('{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", '
              f'"content": "{text}"}}]}}').encode()
      r = self.post(body)
      self.assert_400(r, f"The JSON body holds an invalid unicode escape: '{escape}' at line 1",
                      None)
      self.assertIn("is a lone surrogate", r.json()["error"]["message"])
      self.assertNotIn("hex escape", r.json()["error"]["message"])
    ok = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", ' \
         b'"content": "\\ud83d\\ude00 \\\\ud800"}]}'  # a pair, and an escaped backslash
    self.assertEqual(self.post(ok).status_code, 200)


if __name__ == "__main__":
  absltest.main()
