"""Chat sessions through the server (`session_id`, `close_session`, DELETE /v1/sessions/{id}):
exact-id extension visible in usage and device prefix hits, 409 on a busy session, salts,
aborted and failed turns, metrics. The tiny model (byte tokenizer, paged, device prefix cache).

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy
model); the real tiny model's run is tests/integration/serve/sessions_serve_test.py."""

import concurrent.futures
import socket
import threading

import httpx
import openai
from absl.testing import absltest

from kvjax.serve import ServerConfig
from kvjax.serve.guard import HttpPolicy
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

B = 16  # tokens per pool block (the default block_size)
GREEDY = dict(temperature=0.0, max_tokens=12)


def suffix(user: str) -> list[int]:
  """The byte tokenizer's template text after the assistant's reply, for a next user message."""
  return list(f"\nuser: {user}\nassistant: ".encode())


class SessionsServeUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=4)

  def chat(self, messages, session_id=None, salt=None, **kw):
    extra = {}
    if session_id is not None:
      extra["session_id"] = session_id
    if salt is not None:
      extra["cache_salt"] = salt
    extra.update(kw.pop("extra", {}))
    return self.client.chat.completions.create(model="tiny", messages=messages,
                                               extra_body=extra, **{**GREEDY, **kw})

  def next_messages(self, messages, resp, user):
    return messages + [{"role": "assistant", "content": resp.choices[0].message.content},
                       {"role": "user", "content": user}]

  def delete(self, session_id, **params):
    return httpx.delete(f"{self.srv.url}/v1/sessions/{session_id}", params=params, timeout=60)

  def delta(self, before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)

  # ------------------------------------------------------------------------------ extension
  def test_turn_two_is_turn_one_exact_ids_plus_the_suffix(self):
    before = self.srv.scrape()
    m1 = [{"role": "user", "content": "Tell me about session caches"}]
    r1 = self.chat(m1, "ext", "s-ext")
    self.assertEqual(r1.model_extra["kvjax"]["session"],
                     {"id": "ext", "turn": 1, "outcome": "first", "extended": False,
                      "reused_tokens": 0, "reason": None, "closed": False, "truncation": None})
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    m2 = self.next_messages(m1, r1, "and then?")
    r2 = self.chat(m2, "ext", "s-ext")
    session = r2.model_extra["kvjax"]["session"]
    self.assertEqual((session["turn"], session["outcome"], session["extended"],
                      session["reused_tokens"]), (2, "extended", True, n1))
    self.assertEqual(r2.usage.prompt_tokens, n1 + len(suffix("and then?")))
    # Every token of turn 1 with KV (all but its last sampled one) is a device prefix hit: the
    # full blocks, then turn 1's parked partly filled last block.
    self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, n1 - 1)
    info = self.llm.sessions.get("ext", "s-ext")
    self.assertEqual(info.turns, 2)
    self.assertLen(info.token_ids, r2.usage.prompt_tokens + r2.usage.completion_tokens)
    turn1 = list(m1[0]["content"].encode())
    self.assertEqual(list(info.token_ids[:n1][:len(turn1) + 6]), list(b"user: ") + turn1)
    self.assertEqual(list(info.token_ids[n1:r2.usage.prompt_tokens]), suffix("and then?"))
    after = self.srv.scrape()
    self.assertEqual(self.delta(before, after, "kvjax_session_turns_total", outcome="first"), 1)
    self.assertEqual(self.delta(before, after, "kvjax_session_turns_total", outcome="extended"),
                     1)
    self.assertEqual(self.delta(before, after, "kvjax_session_turns_ended_total",
                                result="recorded"), 2)

  def test_edited_history_falls_back_to_the_template(self):
    m1 = [{"role": "user", "content": "first question"}]
    r1 = self.chat(m1, "edit")
    edited = [{"role": "user", "content": "another question"},
              {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "more"}]
    before = self.srv.scrape()
    r2 = self.chat(edited, "edit")
    session = r2.model_extra["kvjax"]["session"]
    self.assertEqual((session["outcome"], session["extended"], session["reused_tokens"]),
                     ("not_extended", False, 0))
    self.assertIn("messages[0]", session["reason"])
    tok = self.llm.get_tokenizer()
    self.assertEqual(r2.usage.prompt_tokens, len(tok.encode_chat(edited)))
    self.assertEqual(self.delta(before, self.srv.scrape(), "kvjax_session_turns_total",
                                outcome="not_extended"), 1)
    r3 = self.chat(self.next_messages(edited, r2, "again"), "edit")  # extends the new turn
    self.assertEqual(r3.model_extra["kvjax"]["session"]["outcome"], "extended")

  def test_a_streamed_turn_records_its_ids(self):
    m1 = [{"role": "user", "content": "stream this"}]
    chunks = list(self.chat(m1, "stream", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    self.assertEqual(chunks[-1].model_extra["kvjax"]["session"]["turn"], 1)
    m2 = m1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
    r2 = self.chat(m2, "stream")
    self.assertEqual(r2.model_extra["kvjax"]["session"]["outcome"], "extended")
    self.assertEqual(r2.usage.prompt_tokens,
                     usage.prompt_tokens + usage.completion_tokens + len(suffix("next")))

  # --------------------------------------------------------------------------- concurrency
  def test_a_second_request_on_a_busy_session_gets_409(self):
    entered, release = self.hold_steps()  # holds the first turn inside the engine
    m1 = [{"role": "user", "content": "busy"}]
    before = self.srv.scrape()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      first = pool.submit(self.chat, m1, "busy")
      self.assertTrue(entered.wait(60))  # the first turn holds its session
      with self.assertRaises(openai.ConflictError) as cm:  # a retrying client: no retry
        self.client.with_options(max_retries=2).chat.completions.create(
            model="tiny", messages=m1, extra_body={"session_id": "busy"}, **GREEDY)
      release()
      r1 = first.result(60)
    self.assertEqual(cm.exception.status_code, 409)
    self.assertEqual(cm.exception.body, {
        "message": cm.exception.body["message"], "type": "conflict_error", "param": "session_id",
        "code": "session_busy"})
    self.assertIn("busy", cm.exception.body["message"])
    self.assertEqual(cm.exception.response.headers["x-should-retry"], "false")
    self.assertEqual(self.delta(before, self.srv.scrape(), "kvjax_session_conflicts_total"), 1)
    r2 = self.chat(self.next_messages(m1, r1, "now"), "busy")  # free again once it finished
    self.assertEqual(r2.model_extra["kvjax"]["session"]["outcome"], "extended")

  def hold_steps(self):
    """Holds every engine step until `release()` (also at cleanup). Returns (an event set once
    a step is held, release)."""
    engine = self.llm.engine
    step, entered, proceed = engine.step, threading.Event(), threading.Event()

    def gated_step():
      entered.set()
      proceed.wait(60)
      return step()

    def release():
      engine.__dict__.pop("step", None)
      proceed.set()

    engine.step = gated_step
    self.addCleanup(release)
    return entered, release

  def note_release(self):
    """An event set when the registry releases a turn unrecorded."""
    reg, released = self.llm.sessions, threading.Event()
    release = reg.release

    def noted(turn):
      release(turn)
      released.set()

    reg.release = noted
    self.addCleanup(reg.__dict__.pop, "release", None)
    return released

  def test_a_failed_turn_leaves_the_session_as_before(self):
    m1 = [{"role": "user", "content": "fail later"}]
    r1 = self.chat(m1, "fail")
    before = self.llm.sessions.get("fail")
    engine = self.llm.engine

    def failing_step():
      del engine.step
      raise RuntimeError("injected step fault")

    engine.step = failing_step
    self.addCleanup(engine.__dict__.pop, "step", None)
    m2 = self.next_messages(m1, r1, "boom")
    with self.assertRaises(openai.InternalServerError):
      self.chat(m2, "fail")
    after = self.llm.sessions.get("fail")
    self.assertEqual((after.turns, after.token_ids, after.busy),
                     (before.turns, before.token_ids, False))
    r2 = self.chat(m2, "fail")
    self.assertEqual(r2.model_extra["kvjax"]["session"]["turn"], 2)
    self.assertEqual(r2.model_extra["kvjax"]["session"]["outcome"], "extended")

  def test_a_client_disconnect_leaves_the_session_as_before(self):
    m1 = [{"role": "user", "content": "leave early"}]
    r1 = self.chat(m1, "gone")
    before = self.llm.sessions.get("gone")
    entered, release = self.hold_steps()
    released = self.note_release()
    m2 = self.next_messages(m1, r1, "bye")
    body = httpx.Request("POST", "/", json={"model": "tiny", "messages": m2, "max_tokens": 50,
                                            "session_id": "gone"}).content
    with socket.create_connection(("127.0.0.1", self.srv.http.port)) as s:
      s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)
      self.assertTrue(entered.wait(60))
    self.assertTrue(released.wait(60))
    release()
    after = self.llm.sessions.get("gone")
    self.assertEqual((after.turns, after.token_ids, after.busy),
                     (before.turns, before.token_ids, False))
    self.assertEqual(self.chat(m2, "gone").model_extra["kvjax"]["session"]["outcome"],
                     "extended")

  def test_a_stream_the_client_leaves_leaves_the_session_as_before(self):
    m1 = [{"role": "user", "content": "stream and leave"}]
    r1 = self.chat(m1, "gone-stream")
    before = self.llm.sessions.get("gone-stream")
    _, proceed, _ = self.hold_after_first_output()  # every step after the first output held
    released = self.note_release()
    m2 = self.next_messages(m1, r1, "bye")
    body = {"model": "tiny", "messages": m2, "max_tokens": 50, "stream": True,
            "session_id": "gone-stream"}
    self.leave_chat_stream_after_first_event(body)
    self.assertTrue(released.wait(60))
    proceed.set()
    after = self.llm.sessions.get("gone-stream")
    self.assertEqual((after.turns, after.token_ids, after.busy),
                     (before.turns, before.token_ids, False))

  # ------------------------------------------------------------------- salts, close, DELETE
  def test_a_session_of_one_salt_is_invisible_under_another(self):
    m1 = [{"role": "user", "content": "tenant data"}]
    r1 = self.chat(m1, "shared", "tenant-a")
    m2 = self.next_messages(m1, r1, "more")
    rb = self.chat(m2, "shared", "tenant-b")
    self.assertEqual((rb.model_extra["kvjax"]["session"]["turn"],
                      rb.model_extra["kvjax"]["session"]["outcome"]), (1, "first"))
    self.assertEqual(rb.usage.prompt_tokens_details.cached_tokens, 0)  # nothing of tenant-a's
    self.assertEqual(self.delete("shared").status_code, 404)  # no salt: a third key
    self.assertEqual(self.delete("shared", cache_salt="tenant-b").status_code, 200)
    ra = self.chat(m2, "shared", "tenant-a")
    self.assertEqual(ra.model_extra["kvjax"]["session"]["outcome"], "extended")

  def test_delete_endpoint_and_close_session(self):
    m1 = [{"role": "user", "content": "close me"}]
    self.chat(m1, "del")
    r = self.delete("del")
    self.assertEqual((r.status_code, r.json()),
                     (200, {"id": "del", "object": "session.deleted", "deleted": True}))
    r = self.delete("del")
    self.assertEqual(r.status_code, 404)
    self.assertEqual(r.json()["error"]["code"], "session_not_found")
    self.assertEqual(r.json()["error"]["param"], "session_id")
    closing = self.chat(m1, "del", extra={"close_session": True})
    self.assertTrue(closing.model_extra["kvjax"]["session"]["closed"])
    self.assertEqual(self.delete("del").status_code, 404)
    self.assertEqual(self.chat(m1, "del").model_extra["kvjax"]["session"]["turn"], 1)

  def test_a_turn_whose_session_is_deleted_while_it_runs_says_closed(self):
    m1 = [{"role": "user", "content": "delete me mid-turn"}]
    self.chat(m1, "mid")
    entered, release = self.hold_steps()  # holds the turn inside the engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      turn = pool.submit(self.chat, m1, "mid")
      self.assertTrue(entered.wait(60))
      self.assertEqual(self.delete("mid").status_code, 200)
      release()
      r = turn.result(60)
    self.assertEqual({k: r.model_extra["kvjax"]["session"][k] for k in ("turn", "closed")},
                     {"turn": 2, "closed": True})
    self.assertIsNone(self.llm.sessions.get("mid"))
    self.assertEqual(self.chat(m1, "mid").model_extra["kvjax"]["session"]["turn"], 1)

  def test_bad_session_fields_get_400(self):
    m1 = [{"role": "user", "content": "x"}]
    for bad in ("", "x" * 129, "has space", "a/b", ".", "..", 5, True):
      r = httpx.post(self.srv.url + "/v1/chat/completions", timeout=60, json={
          "model": "tiny", "messages": m1, "max_tokens": 1, "session_id": bad})
      self.assertEqual(r.status_code, 400, bad)
      self.assertEqual(r.json()["error"]["param"], "session_id", r.json())
    for body, param in (({"close_session": True}, "close_session"),
                        ({"close_session": "yes", "session_id": "s"}, "close_session"),
                        ({"session_id": "s", "cache_salt": ""}, "cache_salt")):
      r = httpx.post(self.srv.url + "/v1/chat/completions", timeout=60, json={
          "model": "tiny", "messages": m1, "max_tokens": 1, **body})
      self.assertEqual((r.status_code, r.json()["error"]["param"]), (400, param), body)
    r = httpx.post(self.srv.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 1, "session_id": "s"})
    self.assertEqual(r.status_code, 400)
    self.assertIn("Unrecognized request argument supplied: session_id",
                  r.json()["error"]["message"])
    for path, params in (("bad%20id", {}), ("ok", {"cache_salt": ""}), ("ok", {"salt": "x"})):
      r = httpx.delete(f"{self.srv.url}/v1/sessions/{path}", params=params, timeout=60)
      self.assertEqual(r.status_code, 400, (path, params))
    with self.assertRaises(openai.BadRequestError):  # refused after the lease: released
      self.chat(m1, "toolong", max_tokens=100_000)
    self.assertIsNone(self.llm.sessions.get("toolong"))

  def test_session_flags_reach_the_llm(self):
    opts = ServerConfig.from_flat(model="tiny", session_ttl_s=5.0, max_sessions=3,
                                  max_session_tokens=100).llm_options()
    self.assertEqual((opts["session_ttl_s"], opts["max_sessions"], opts["max_session_tokens"]),
                     (5.0, 3, 100))
    with self.assertRaisesRegex(ValueError, "max_sessions=0"):
      ServerConfig.from_flat(max_sessions=0)
    self.assertEqual(self.llm.sessions.config.ttl_s, 600.0)


class SessionsWithApiKeyUnitTest(ServedLLMTestCase):
  """DELETE /v1/sessions needs the API key like every other route."""

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16,), max_num_seqs=1)

  serve_options = {"policy": HttpPolicy(api_key="k3y")}

  def test_delete_needs_the_key(self):
    self.client.chat.completions.create(model="tiny", max_tokens=2,
                                        messages=[{"role": "user", "content": "x"}],
                                        extra_body={"session_id": "auth"})
    url = f"{self.srv.url}/v1/sessions/auth"
    self.assertEqual(httpx.delete(url, timeout=60).status_code, 401)
    r = httpx.delete(url, timeout=60, headers=self.srv.auth_headers)
    self.assertEqual(r.status_code, 200)


class RerotatedTurnServeUnitTest(ServedLLMTestCase):
  """A session turn's merge mode travels in its request options through the server's engine
  thread (`AsyncEngine.submit`): a re-rotated turn loads its staged chunks even on an engine
  whose own mode ignores hits."""

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=2, max_model_len=256,
                            kv_store="memory://", kv_chunk_size=16,
                            session_truncation="drop_oldest_turns", session_rerotate=True,
                            session_rerotate_boundary_chunks=0, kv_merge_mode="compute_only")

  def test_a_rerotated_turn_loads_under_a_compute_only_engine(self):
    def chat(messages, **kw):
      return self.client.chat.completions.create(
          model="tiny", messages=messages, temperature=0.0, max_tokens=8,
          extra_body={"session_id": "co", "cache_salt": "t", **kw})

    m1 = [{"role": "user", "content": "x" * 150}]
    r1 = chat(m1)
    m2 = m1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "y" * 60}]
    r2 = chat(m2, truncate_prompt_tokens=256 - 8 - 40)
    staged = r2.model_extra["kvjax"]["session"]["truncation"]["rerotated_tokens"]
    self.assertGreaterEqual(staged, B)
    # Nothing of the private namespace is on the device: every cached token was loaded.
    self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, staged)


if __name__ == "__main__":
  absltest.main()
