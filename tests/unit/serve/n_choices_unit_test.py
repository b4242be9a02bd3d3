"""`n` > 1, penalties and logit_bias through the official `openai` client (fake runner).

The prompt is computed once for n choices (the engine's plans, counted exactly), each choice
equals the offline `LLM.generate` with the same `n` and seed, streams interleave deltas by
index, and usage counts the prompt once. The real model's run:
tests/integration/serve/n_choices_test.py."""

import collections

from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing import engines
from kvjax.testing.serve import ServedLLMTestCase

MSGS = [{"role": "user", "content": "Tell me about the rain over the river stones."}]
N = 4


class NChoicesUnitTest(ServedLLMTestCase):

  @classmethod
  def tiny_llm(cls, **kw):
    # A store too: forks are opened in its client (their decodes complete and save chunks).
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=4, kv_store="memory://",
                            kv_chunk_size=16, **kw)

  @classmethod
  def make_llm(cls):
    cls.ref = cls.tiny_llm()
    cls.addClassCleanup(cls.ref.close)
    llm = cls.tiny_llm()
    cls.plans = []  # every step's plan (appended by the engine thread)
    llm.engine.add_step_observer(lambda rec: cls.plans.append(rec.plan))
    return llm

  def offline(self, n, msgs=MSGS, **kw):
    ids = self.ref.get_tokenizer().encode_chat(msgs, add_generation_prompt=True)
    out = self.ref.generate({"prompt_token_ids": ids}, SamplingParams(n=n, **kw))[0]
    return ids, out

  def test_n4_shares_one_prefill_and_equals_offline_choices(self):
    msgs = [{"role": "user", "content": "A prompt no other test sends, so nothing is cached."}]
    self.plans.clear()
    resp = self.client.chat.completions.create(model="tiny", messages=msgs, n=N, seed=7,
                                               temperature=1.0, max_tokens=12)
    ids, ref = self.offline(N, msgs, seed=7, temperature=1.0, max_tokens=12)
    self.assertEqual([c.index for c in resp.choices], list(range(N)))
    self.assertEqual([c.message.content for c in resp.choices], [o.text for o in ref.outputs])
    self.assertEqual([c.finish_reason for c in resp.choices],
                     [o.finish_reason for o in ref.outputs])
    self.assertGreater(len({c.message.content for c in resp.choices}), 1)
    self.assertEqual(resp.usage.prompt_tokens, len(ids))  # once
    self.assertEqual(resp.usage.completion_tokens, sum(len(o.token_ids) for o in ref.outputs))
    self.assertEqual(sum(c.num_tokens for p in self.plans for c in p.prefills), len(ids))
    self.assertEqual(sum(len(p.forks) for p in self.plans), N - 1)
    again = self.client.chat.completions.create(model="tiny", messages=msgs, n=N, seed=7,
                                                temperature=1.0, max_tokens=12)
    self.assertEqual([c.message.content for c in again.choices],
                     [c.message.content for c in resp.choices])

  def test_stream_interleaves_choices_by_index(self):
    stream = self.client.completions.create(
        model="tiny", prompt="Rain on the river", n=3, seed=11, max_tokens=10, stream=True,
        stream_options={"include_usage": True})
    text, finish, usage = collections.defaultdict(str), {}, None
    for chunk in stream:
      for c in chunk.choices:
        text[c.index] += c.text
        if c.finish_reason:
          finish[c.index] = c.finish_reason
      usage = chunk.usage or usage
    whole = self.client.completions.create(model="tiny", prompt="Rain on the river", n=3,
                                           seed=11, max_tokens=10)
    self.assertEqual([text[i] for i in range(3)], [c.text for c in whole.choices])
    self.assertEqual(finish, {c.index: c.finish_reason for c in whole.choices})
    self.assertEqual((usage.prompt_tokens, usage.completion_tokens),
                     (whole.usage.prompt_tokens, whole.usage.completion_tokens))

  def test_greedy_choices_are_equal_and_penalties_and_bias_apply(self):
    resp = self.client.chat.completions.create(model="tiny", messages=MSGS, n=3,
                                               temperature=0, max_tokens=10)
    self.assertLen({c.message.content for c in resp.choices}, 1)
    ids, ref = self.offline(3, temperature=0, max_tokens=10, presence_penalty=-0.5,
                            frequency_penalty=-1.5)
    resp = self.client.chat.completions.create(
        model="tiny", messages=MSGS, n=3, temperature=0, max_tokens=10, presence_penalty=-0.5,
        frequency_penalty=-1.5)
    self.assertEqual([c.message.content for c in resp.choices], [o.text for o in ref.outputs])
    first = ref.outputs[0].token_ids[0]
    resp = self.client.chat.completions.create(
        model="tiny", messages=MSGS, temperature=0, max_tokens=10,
        logit_bias={str(first): -100}, logprobs=True, top_logprobs=1)
    self.assertNotEqual(resp.choices[0].logprobs.content[0].token,
                        self.ref.get_tokenizer().decode([first]))


class NChoicesDisconnectUnitTest(ServedLLMTestCase):

  @classmethod
  def make_llm(cls):
    return engines.fake_llm(chunk_sizes=(16, 32, 64), max_num_seqs=4)

  def test_a_client_leaving_a_stream_aborts_every_choice(self):
    """The engine is held after the first outputs; the client reads one event and leaves: all
    three choices are aborted, nothing is left running, and the server still answers."""
    backend = self.srv.backend.engine
    _, proceed, aborted = self.hold_after_first_output(aborts=3)
    before = backend.stats.aborted
    body = {"model": "tiny", "messages": [{"role": "user", "content": "leave me"}], "n": 3,
            "max_tokens": 400, "stream": True, "ignore_eos": True}  # chat: role chunks first
    self.leave_chat_stream_after_first_event(body)
    self.assertTrue(aborted.wait(60))
    proceed.set()
    self.assertFalse(self.srv.engine_call(lambda e: e.has_unfinished_requests()))
    self.assertEqual(backend.stats.aborted, before + 3)
    ok = self.client.completions.create(model="tiny", prompt="still alive", n=2, max_tokens=3)
    self.assertEqual([c.finish_reason for c in ok.choices], ["length", "length"])
    self.assertLen(set(self.aborted_request_ids), 3)  # each choice aborted once
    self.assertLen(self.aborted_request_ids, 3)


if __name__ == "__main__":
  absltest.main()
