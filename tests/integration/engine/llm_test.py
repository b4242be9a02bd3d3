"""The offline API on the random tiny model: outputs against the oracle, batching, validation."""

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.engine.engine import Engine
from kvjax.models.loading.registry import load_model
from kvjax.scheduler import SchedulerConfig
from kvjax.testing import oracle

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = [list(np.random.default_rng(i).integers(0, 256, n)) for i, n in
           enumerate((5, 40, 130))]
PROMPTS = [[int(t) for t in p] for p in PROMPTS]


TINY = load_model("tiny")


def oracle_greedy(prompt, n):
  return oracle.oracle_greedy(TINY.config, TINY.params, prompt, n)


class AsciiTokenizer:
  """Maps every id to one capital letter, so stop strings are easy to aim at."""

  eos_id = None

  def encode(self, text, add_special_tokens=True):
    return [ord(c) - 65 for c in text]

  def decode(self, ids, skip_special_tokens=False):
    return "".join(chr(65 + i % 26) for i in ids)


class LLMTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64))
    cls.want = [oracle_greedy(p, GREEDY.max_tokens) for p in PROMPTS]

  def test_greedy_equals_oracle_and_batching_changes_nothing(self):
    outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    self.assertEqual([o.token_ids for o in outs], self.want)
    for o, p in zip(outs, PROMPTS):
      self.assertEqual(o.finish_reason, "length")
      self.assertEqual(o.prompt_token_ids, p)
      self.assertEqual(o.metrics.num_computed_tokens, len(p))
      self.assertEqual((o.num_cached_tokens, o.metrics.num_loaded_tokens), (0, 0))
      self.assertGreater(o.metrics.ttft_s, 0.0)
      self.assertEqual(o.outputs[0].token_ids, o.token_ids)
    alone = self.llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY)
    self.assertEqual(alone[0].token_ids, self.want[2])

  @pytest.mark.slow  # 9 s on the tiny model; the default suite's budget
  def test_prefill_time_starts_at_admission_cold_and_hit(self):
    # One slot: the second and third requests wait in the queue until the one before finishes;
    # the third repeats the 130-token prompt, so all its tokens but the last are served from the device prefix cache.
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64))
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[2], PROMPTS[1], PROMPTS[2])],
                        GREEDY)
    self.assertEqual([o.token_ids for o in outs], [self.want[2], self.want[1], self.want[2]])
    self.assertEqual([o.metrics.num_device_cached_tokens for o in outs], [0, 0, 129])
    for o in outs:
      m = o.metrics
      self.assertIsNotNone(m.scheduled_s)
      self.assertEqual(m.prefill_s, m.first_token_s - m.scheduled_s)
      self.assertEqual(m.ttft_s, m.first_token_s - m.arrival_s)
      self.assertBetween(m.prefill_s, 0.0, m.ttft_s)
    for before, after in zip(outs, outs[1:]):  # admitted only once the slot was free
      self.assertGreaterEqual(after.metrics.scheduled_s, before.metrics.finished_s)
      self.assertGreaterEqual(after.metrics.ttft_s - after.metrics.prefill_s,
                              before.metrics.finished_s - after.metrics.arrival_s)

  @pytest.mark.slow  # 9 s on the tiny model; the default suite's budget
  def test_one_chunk_size_gives_the_same_tokens(self):
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16,))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    self.assertEqual([o.token_ids for o in outs], self.want)

  def test_long_prefill_token_threshold_shares_the_step_and_keeps_the_tokens(self):
    # The 130-token prompt takes 32 a step of the 64-token budget; the 40-token one the rest.
    # Its 8 left go first in the second step with fewest tokens left first (the default; they
    # end its prompt, so the long one takes one smallest chunk after them), after the long
    # prompt's 32 first come first served; the same tokens either way.
    for order, rest in (("shortest_first", [[(1, 32, 8), (0, 32, 16)], [(0, 48, 32)],
                                            [(0, 80, 32)], [(0, 112, 16), (0, 128, 2)]]),
                        ("fcfs", [[(0, 32, 32), (1, 32, 8)], [(0, 64, 32)], [(0, 96, 32)],
                                  [(0, 128, 2)]])):
      llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                     long_prefill_token_threshold=32, prefill_order=order)
      steps = []
      llm.engine.add_step_observer(lambda rec, steps=steps: steps.append(
          [(c.request_id, c.start, c.num_tokens) for c in rec.plan.prefills]))
      outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[2], PROMPTS[1])], GREEDY)
      self.assertEqual([o.token_ids for o in outs], [self.want[2], self.want[1]], order)
      ids = [o.request_id for o in outs]
      self.assertEqual([s for s in steps if s][:5],
                       [[(ids[0], 0, 32), (ids[1], 0, 32)]]
                       + [[(ids[i], start, n) for i, start, n in step] for step in rest], order)
    with self.assertRaisesRegex(ValueError, "prefill_order='lifo'; use one of"):
      real_llm("tiny", cache_dir="", prefill_order="lifo")

  def test_text_prompt_uses_the_tokenizer(self):
    out = self.llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))[0]
    self.assertEqual(out.prompt_token_ids, list(b"hello"))
    self.assertEqual(out.prompt, "hello")
    self.assertEqual(out.token_ids, oracle_greedy(list(b"hello"), 3))
    self.assertEqual(out.text, self.llm.get_tokenizer().decode(out.token_ids))
    chat = self.llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0]
    self.assertEqual(chat.prompt_token_ids, list(b"user: hi\nassistant: "))

  def test_logprobs_are_top_k_plus_sampled(self):
    out = self.llm.generate({"prompt_token_ids": PROMPTS[1]},
                            SamplingParams(max_tokens=3, temperature=0, logprobs=4))[0]
    self.assertLen(out.logprobs, 3)
    for tok, lp in zip(out.token_ids, out.logprobs):
      self.assertLen(lp, 4)
      self.assertEqual(max(lp, key=lp.get), tok)
      self.assertTrue(all(v <= 0 for v in lp.values()))
      self.assertLess(sum(np.exp(list(lp.values()))), 1.0 + 1e-9)

  def test_seeded_sampling_is_reproducible(self):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    a = self.llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].token_ids
    b = self.llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].token_ids
    c = self.llm.generate({"prompt_token_ids": PROMPTS[0]},
                          SamplingParams(max_tokens=8, temperature=1.0, seed=6))[0].token_ids
    self.assertEqual(a, b)
    self.assertNotEqual(a, c)
    top1 = self.llm.generate({"prompt_token_ids": PROMPTS[0]},
                             SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=1))
    self.assertEqual(top1[0].token_ids, self.want[0])

  def test_bad_input_raises_and_queues_nothing(self):
    cases = [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [300]}, r"\[300\].*vocabulary \[0, 256\)"),
        ({"prompt_token_ids": [1] * 500}, "500 tokens plus max_tokens=16 exceeds.*512"),
        ({"prompt_token_ids": ["a"]}, "list of ints"),
        ({"prompt_token_ids": [1], "cache_salt": 3}, "cache_salt must be a string"),
        ({"prompt_token_ids": [1], "prompt": "x"}, "exactly one of"),
        ({"prompt_tokens": [1]}, "string or a dict"),
        (3, "string or"),
    ]
    for prompt, msg in cases:
      with self.subTest(prompt=str(prompt)[:20]):
        with self.assertRaisesRegex(ValueError, msg):
          self.llm.generate(["fine", prompt], SamplingParams(max_tokens=16))
        self.assertFalse(self.llm.engine.has_unfinished_requests())
    with self.assertRaisesRegex(ValueError, "sampling_params must be a SamplingParams"):
      self.llm.generate("hi", {"max_tokens": 3})
    for bad in (123, None, b"hi", []):
      with self.assertRaisesRegex(ValueError, "prompts must be|a prompt must be"):
        self.llm.generate(bad)
    for kwargs, msg in ((dict(max_num_seqs=0), "max_num_seqs=0"),
                        (dict(max_model_len=100000), "max_model_len=100000 exceeds"),
                        (dict(chunk_sizes=(32, 16)), "ascending"),
                        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
                        (dict(max_num_batched_tokens=8), "max_num_batched_tokens=8 is below"),
                        (dict(long_prefill_token_threshold=-1),
                         r"long_prefill_token_threshold=-1 must be an int >= 0"),
                        (dict(long_prefill_token_threshold=8),
                         "long_prefill_token_threshold=8 is below the smallest chunk size 16")):
      with self.assertRaisesRegex(ValueError, msg):
        real_llm("tiny", cache_dir="", **kwargs)
    with self.assertRaisesRegex(ValueError, "unknown model 'gpt-5'"):
      real_llm("gpt-5", cache_dir="")
    with self.assertRaisesRegex(ValueError, "dtype 'int8'"):
      real_llm("tiny", cache_dir="", dtype="int8")


class StopTest(absltest.TestCase):

  def test_stop_string_and_stop_token(self):
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32))
    engine = Engine(llm.engine.runner, AsciiTokenizer(),
                    SchedulerConfig(num_slots=1, chunk_sizes=(16, 32), token_budget=32))
    prompt = PROMPTS[1]
    want = oracle_greedy(prompt, 6)
    text = "".join(chr(65 + i % 26) for i in want)

    def run(params):
      engine.add_request(prompt, params)
      while True:
        for out in engine.step():
          if out.finished:
            return out

    out = run(SamplingParams(max_tokens=6, temperature=0, stop=[text[3:5]]))
    self.assertEqual(out.finish_reason, "stop")
    self.assertEqual(out.text, text[:text.find(text[3:5])])
    out = run(SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[want[2]]))
    self.assertEqual(out.finish_reason, "stop")
    self.assertEqual(out.token_ids, want[:want.index(want[2]) + 1])


if __name__ == "__main__":
  absltest.main()
