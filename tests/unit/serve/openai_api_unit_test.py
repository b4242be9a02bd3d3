"""The server through the official `openai` client: tiny model, memory store, port 0.

On the fake runner (`kvjax.testing.engines.fake_llm`: the server over `LLM` over a numpy model);
the real tiny model's run is tests/integration/serve/openai_api_test.py."""

import asyncio
import socket

import httpx
import openai
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

CHUNK = 32
GREEDY = dict(temperature=0.0, max_tokens=8)
DOC = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm "
       "windowsill and the bird sings a long song about spring rain and river stones. ")


class OpenAIApiUnitTest(ServedLLMTestCase):

  @classmethod
  def tiny_llm(cls, **kw):
    """The served `LLM` and the offline reference: the tiny model's sizes on the fake runner."""
    return engines.fake_llm(chunk_sizes=(16, 32, 64), **kw)

  @classmethod
  def make_llm(cls):
    cls.ref = cls.tiny_llm(max_num_seqs=1)
    cls.addClassCleanup(cls.ref.close)
    # Load-only makes "the whole stored prefix is loaded" exact; Cake's own timing-dependent
    # meeting point is covered by tests/integration/engine/cake_engine_test.py and the notebook
    # test.
    # No device prefix cache: the store-hit tests count loads from the store.
    return cls.tiny_llm(max_num_seqs=4, kv_store="memory://", kv_chunk_size=CHUNK,
                        enable_prefix_caching=False, kv_merge_mode="load_only")

  def ref_text(self, prompt, max_tokens=8):
    return self.ref.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]

  def ref_chat(self, content, max_tokens=8):
    return self.ref.chat([{"role": "user", "content": content}],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]

  # ---------------------------------------------------------------------------------- basics
  def test_models_and_health(self):
    self.assertEqual([m.id for m in self.client.models.list().data], ["tiny"])
    self.assertEqual(self.client.models.retrieve("tiny").id, "tiny")
    r = httpx.get(self.srv.url + "/health")
    self.assertEqual((r.status_code, r.json()["status"]), (200, "ok"))

  def test_completion_equals_offline_greedy(self):
    resp = self.client.completions.create(model="tiny", prompt="Hello there", **GREEDY,
                                          extra_body={"cache_salt": "basic"})
    want = self.ref_text("Hello there")
    choice = resp.choices[0]
    self.assertEqual((choice.text, choice.finish_reason), (want.text, "length"))
    self.assertEqual((resp.usage.prompt_tokens, resp.usage.completion_tokens), (11, 8))
    self.assertEqual(resp.usage.prompt_tokens_details.cached_tokens, 0)
    ext = resp.model_extra["kvjax"]
    self.assertEqual((ext["tokens_computed"], ext["tokens_loaded"]), (11, 0))
    self.assertGreater(ext["ttft_s"], 0)

  def test_completion_stream_concatenates_to_the_plain_text(self):
    want = self.ref_text("Streaming", max_tokens=12)
    chunks = list(self.client.completions.create(
        model="tiny", prompt="Streaming", temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": "basic"}))
    self.assertEqual("".join(c.choices[0].text for c in chunks if c.choices), want.text)
    self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices][-1], "length")
    self.assertEqual(chunks[-1].choices, [])
    self.assertEqual(chunks[-1].usage.completion_tokens, 12)
    self.assertEqual(chunks[-1].model_extra["kvjax"]["prompt_tokens"], 9)

  def test_chat_plain_and_stream(self):
    msgs = [{"role": "user", "content": "Say something"}]
    want = self.ref_chat("Say something", max_tokens=10)
    resp = self.client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                               max_tokens=10)
    self.assertEqual(resp.choices[0].message.content, want.text)
    self.assertEqual(resp.choices[0].message.role, "assistant")
    self.assertEqual(resp.usage.prompt_tokens, len(want.prompt_token_ids))
    stream = self.client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                                 max_tokens=10, stream=True)
    chunks = list(stream)
    self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
    self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks), want.text)
    self.assertEqual(chunks[-1].choices[0].finish_reason, "length")
    self.assertIn("kvjax", chunks[-1].model_extra)

  def test_chat_logprobs(self):
    resp = self.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "lp"}], temperature=0,
        max_tokens=3, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    self.assertLen(content, 3)
    for tok in content:
      self.assertLen(tok.top_logprobs, 2)
      self.assertEqual(tok.logprob, tok.top_logprobs[0].logprob)  # greedy picks the top one

  def test_stop_strings_match_offline_generate(self):
    free = self.ref_text("stop here", max_tokens=12).text
    stop = free[4:6] if len(free) >= 6 else "zz"
    want = self.ref.generate("stop here", SamplingParams(temperature=0.0, max_tokens=12,
                                                         stop=[stop]))[0]
    plain = self.client.completions.create(model="tiny", prompt="stop here", temperature=0,
                                           max_tokens=12, stop=[stop])
    self.assertEqual((plain.choices[0].text, plain.choices[0].finish_reason),
                     (want.text, want.finish_reason))
    chunks = list(self.client.completions.create(model="tiny", prompt="stop here",
                                                 temperature=0, max_tokens=12, stop=[stop],
                                                 stream=True))
    self.assertEqual("".join(c.choices[0].text for c in chunks), want.text)

  # ---------------------------------------------------------------------------- prefix cache
  def test_second_request_hits_the_stored_prefix_and_salt_isolates(self):
    prompt = DOC + "Question one?"
    first = self.client.completions.create(model="tiny", prompt=prompt, **GREEDY,
                                           extra_body={"cache_salt": "tenant-a"})
    self.assertEqual(first.usage.prompt_tokens_details.cached_tokens, 0)
    self.srv.flush()
    second = self.client.completions.create(model="tiny", prompt=prompt, **GREEDY,
                                            extra_body={"cache_salt": "tenant-a"})
    n = len(prompt)
    self.assertEqual(second.usage.prompt_tokens_details.cached_tokens,
                     CHUNK * ((n - 1) // CHUNK))
    self.assertGreater(second.usage.prompt_tokens_details.cached_tokens, 0)
    self.assertEqual(second.choices[0].text, first.choices[0].text)
    self.assertEqual(second.choices[0].text, self.ref_text(prompt).text)
    ext = second.model_extra["kvjax"]
    self.assertEqual(ext["tokens_loaded"], CHUNK * ((n - 1) // CHUNK))
    self.assertEqual(ext["loaded_from_tiers"], {"disk": (n - 1) // CHUNK})
    for resp in (first, second):  # the prefill wall time, cold and hit: the engine's figure
      got = resp.model_extra["kvjax"]
      em = got["engine_metrics"]
      self.assertEqual(got["prefill_s"], em["prefill_s"])
      self.assertEqual(em["prefill_s"], em["first_token_s"] - em["scheduled_s"])
      self.assertBetween(got["prefill_s"], 0.0, em["ttft_s"])
      self.assertLessEqual(em["ttft_s"], got["ttft_s"])  # the server's TTFT includes tokenizing
    other = self.client.completions.create(model="tiny", prompt=prompt, **GREEDY,
                                           extra_body={"cache_salt": "tenant-b"})
    self.assertEqual(other.usage.prompt_tokens_details.cached_tokens, 0)
    self.assertEqual(other.choices[0].text, first.choices[0].text)

  def test_a_session_turn_loads_the_last_turn_whole_from_the_store(self):
    # No device prefix cache here: turn 2's history comes from the store alone, its full chunks
    # and turn 1's stored tail (the tokens after its last full chunk).
    msgs = [{"role": "user", "content": DOC[:100]}]
    body = {"session_id": "tail", "cache_salt": "tails"}
    r1 = self.client.chat.completions.create(model="tiny", messages=msgs, **GREEDY,
                                             extra_body=body)
    self.srv.flush()
    n1 = r1.usage.prompt_tokens + r1.usage.completion_tokens
    self.assertTrue((n1 - 1) % CHUNK)  # turn 1 ends inside a chunk
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Go on."}]
    r2 = self.client.chat.completions.create(model="tiny", messages=msgs, **GREEDY,
                                             extra_body=body)
    self.assertEqual(r2.model_extra["kvjax"]["session"]["outcome"], "extended")
    self.assertEqual(r2.usage.prompt_tokens_details.cached_tokens, n1 - 1)
    self.assertEqual(r2.model_extra["kvjax"]["loaded_from_tiers"],
                     {"disk": (n1 - 1) // CHUNK + 1})
    info = self.llm.sessions.get("tail", "tails")
    cold = self.ref.generate({"prompt_token_ids": list(info.token_ids[:r2.usage.prompt_tokens])},
                             SamplingParams(temperature=0.0, max_tokens=8))[0]
    self.assertEqual(r2.choices[0].message.content, cold.text)

  def test_truncate_prompt_tokens_cuts_exactly_and_bad_values_are_400(self):
    prompt = DOC * 2
    cut = list(prompt.encode())[-100:]  # the byte tokenizer: one id per byte
    kw = dict(model="tiny", prompt=prompt, **GREEDY)
    first = self.client.completions.create(
        **kw, extra_body={"cache_salt": "trunc", "truncate_prompt_tokens": 100})
    self.assertEqual(first.usage.prompt_tokens, 100)
    want = self.ref.generate({"prompt_token_ids": cut},
                             SamplingParams(temperature=0.0, max_tokens=8))[0]
    self.assertEqual(first.choices[0].text, want.text)
    self.srv.flush()
    before = self.srv.scrape()
    second = self.client.completions.create(
        **kw, extra_body={"cache_salt": "trunc", "truncate_prompt_tokens": 100})
    self.assertEqual(second.choices[0].text, want.text)
    ext = second.model_extra["kvjax"]
    n = 99 // CHUNK
    self.assertEqual(sorted(ext["loaded_chunks"], key=lambda c: c["index"]),
                     [{"index": i, "tier": "disk"} for i in range(n)])
    after = self.srv.scrape()
    key = ("kvjax_prefix_cache_hit_tokens_by_tier_total", (("tier", "disk"),))
    self.assertEqual(after.get(key, 0) - before.get(key, 0), n * CHUNK)
    for bad in (0, -1):
      with self.assertRaises(openai.BadRequestError) as e:
        self.client.completions.create(**kw, extra_body={"truncate_prompt_tokens": bad})
      self.assertIn("truncate_prompt_tokens", str(e.exception))
    with self.assertRaises(openai.BadRequestError) as e:
      self.client.chat.completions.create(
          model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY,
          extra_body={"cache_salt": "kvjax-rerotated:abc"})
    self.assertIn("reserved", str(e.exception))

  # ----------------------------------------------------------------------------- concurrency
  def test_sixteen_concurrent_streams_equal_each_run_alone(self):
    prompts = [f"Client {i} asks: " + DOC[:20 + 7 * i] for i in range(16)]
    alone = [self.client.completions.create(model="tiny", prompt=p, temperature=0,
                                            max_tokens=6 + i % 5,
                                            extra_body={"cache_salt": "alone"}).choices[0].text
             for i, p in enumerate(prompts)]

    async def one(client, i, p):
      stream = await client.completions.create(model="tiny", prompt=p, temperature=0,
                                               max_tokens=6 + i % 5, stream=True,
                                               extra_body={"cache_salt": "together"})
      return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
      async with openai.AsyncOpenAI(base_url=self.srv.url + "/v1", api_key="unused",
                                    max_retries=0) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))

    self.assertEqual(asyncio.run(all_at_once()), alone)

  # ------------------------------------------------------------------------------ disconnect
  def assert_aborted_and_idle(self, before):
    self.assertFalse(self.srv.engine_call(lambda e: e.has_unfinished_requests()))
    self.assertEqual(self.srv.backend.engine.stats.aborted, before + 1)
    after = self.srv.scrape()[("kvjax_aborted_requests_total", ())]
    self.assertEqual(after, before + 1)
    ok = self.client.completions.create(model="tiny", prompt="still alive", **GREEDY)
    self.assertEqual(ok.choices[0].finish_reason, "length")

  def test_stream_client_disconnect_aborts_the_request(self):
    before = self.srv.backend.engine.stats.aborted
    _, proceed, aborted = self.hold_after_first_output()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "disconnect me"}],
            "max_tokens": 400, "stream": True}  # chat: the role chunk comes with token one
    self.leave_chat_stream_after_first_event(body)
    self.assertTrue(aborted.wait(60))
    proceed.set()
    self.assert_aborted_and_idle(before)

  def test_plain_client_disconnect_aborts_the_request(self):
    before = self.srv.backend.engine.stats.aborted
    emitted, proceed, aborted = self.hold_after_first_output()
    body = (b'{"model": "tiny", "prompt": "disconnect me too", "max_tokens": 400}')
    with socket.create_connection(("127.0.0.1", self.srv.http.port)) as s:
      s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)
      self.assertTrue(emitted.wait(60))
    self.assertTrue(aborted.wait(60))
    proceed.set()
    self.assert_aborted_and_idle(before)

  # --------------------------------------------------------------------------------- metrics
  def test_metrics_parse_and_count_tokens(self):
    before = self.srv.scrape()
    resp = self.client.completions.create(model="tiny", prompt="count my tokens", **GREEDY,
                                          extra_body={"cache_salt": "metrics"})
    after = self.srv.scrape()

    def delta(name, **labels):
      key = (name, tuple(sorted(labels.items())))
      return after.get(key, 0.0) - before.get(key, 0.0)

    self.assertEqual(delta("kvjax_prompt_tokens_total", source="computed"),
                     resp.usage.prompt_tokens)
    self.assertEqual(delta("kvjax_prompt_tokens_total", source="loaded"), 0)
    self.assertEqual(delta("kvjax_generation_tokens_total"), resp.usage.completion_tokens)
    self.assertEqual(delta("kvjax_prefix_cache_queried_tokens_total"), resp.usage.prompt_tokens)
    self.assertEqual(delta("kvjax_time_to_first_token_seconds_count"), 1)
    self.assertEqual(delta("kvjax_prefill_time_seconds_count"), 1)
    self.assertAlmostEqual(delta("kvjax_prefill_time_seconds_sum"),
                           resp.model_extra["kvjax"]["prefill_s"])
    self.assertEqual(delta("kvjax_requests_total", endpoint="completions",
                           finish_reason="length"), 1)
    for name in ("kvjax_num_requests_waiting", "kvjax_num_requests_running"):
      self.assertEqual(after[(name, ())], 0)
    self.assertIn(("kvjax_link_bandwidth_bytes_per_second", (("tier", "disk"),)), after)
    self.assertIn(("kvjax_store_read_bytes_total", (("tier", "disk"),)), after)
    for outcome in ("issued", "useful", "wasted"):
      self.assertIn(("kvjax_kv_prefetch_total", (("outcome", outcome),)), after)
    self.assertIn(("kvjax_store_evictions_total", (("tier", "disk"),)), after)
    self.assertIn(("kvjax_store_demotions_total", (("tier", "disk"),)), after)
    self.assertIn(("kvjax_store_demotion_drops_total", (("tier", "disk"),)), after)


if __name__ == "__main__":
  absltest.main()
