"""Lossy codecs with `kv_codec_consistent`: the answer does not depend on the meeting point.

Every mix of computed and loaded chunks (compute-only, load-only, Cake at any timing, a missing
chunk in the middle) must give the same greedy tokens and bit-identical log-probabilities as the
cold run that stored the chunks (issue: identical requests get identical answers).
"""

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm

C = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 256, 5 * C + 7)]


def make_llm(store, codec, mode="cake", **kw):
  kw.setdefault("enable_prefix_caching", False)  # meeting points over the store: no device hits
  llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
                 kv_chunk_size=C, kv_merge_mode=mode, kv_codec=codec, **kw)
  llm.engine.check_writes = True
  return llm


class ConsistentCodecTest(parameterized.TestCase):

  @parameterized.parameters("int8", "cachegen")
  def test_every_meeting_point_gives_the_cold_answer_bit_for_bit(self, codec):
    store = self.create_tempdir().full_path
    writer = make_llm(store, codec, "compute_only")
    cold = writer.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    writer.flush()
    outs = []
    for mode in ("compute_only", "load_only", "cake", "cake"):
      reader = make_llm(store, codec, mode)
      outs.append((mode, reader.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]))
      reader.close()
    writer.close()
    loaded = [len(o.metrics.merge.chunks_loaded) for _, o in outs]
    self.assertEqual(loaded[0], 0)
    self.assertEqual(loaded[1], (len(PROMPT) - 1) // C)  # load_only loads every stored chunk
    for mode, out in outs:
      self.assertEqual(out.token_ids, cold.token_ids, mode)
      self.assertEqual(out.logprobs, cold.logprobs, mode)  # exactly, not within a tolerance

  def test_device_prefix_hits_give_the_cold_answer_bit_for_bit(self):
    # The device prefix cache on (the default): a repeat of the prompt is served from the
    # blocks of the first run, which must hold the round-tripped KV (what a load or a cold
    # engine's own round trip gives), not the KV compute wrote before the round trip.
    cold_llm = make_llm(self.create_tempdir().full_path, "int8", "compute_only")
    cold = cold_llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    cold_llm.close()
    llm = make_llm(self.create_tempdir().full_path, "int8", enable_prefix_caching=True)
    first = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    second = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    llm.close()
    self.assertEqual(first.metrics.num_device_cached_tokens, 0)
    self.assertEqual(second.metrics.num_device_cached_tokens, (len(PROMPT) - 1) // C * C)
    for out in (first, second):
      self.assertEqual(out.token_ids, cold.token_ids)
      self.assertEqual(out.logprobs, cold.logprobs)  # exactly

  def test_a_follow_up_prompt_gets_the_cold_answer_bit_for_bit(self):
    # Turn 1's output completes a store chunk by decoding (87 + 9 = 96 = 6 chunks); turn 2
    # extends turn 1. The device prefix cache and the store hold only chunks whose KV passed
    # through the codec after a prefill (the prompt's whole chunks), never decode KV, so turn 2
    # equals a cold engine's answer.
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5)
    llm = make_llm(self.create_tempdir().full_path, "int8", enable_prefix_caching=True)
    turn1 = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    follow_up = PROMPT + turn1.token_ids + [1, 2, 3]
    llm.flush()
    turn2 = llm.generate({"prompt_token_ids": follow_up}, params)[0]
    llm.close()
    self.assertEqual(turn2.metrics.num_device_cached_tokens, len(PROMPT) // C * C)
    self.assertEqual(turn2.num_cached_tokens, len(PROMPT) // C * C)  # no stored decode chunk
    cold_llm = make_llm(self.create_tempdir().full_path, "int8", "compute_only")
    cold = cold_llm.generate({"prompt_token_ids": follow_up}, params)[0]
    cold_llm.close()
    self.assertEqual((turn2.token_ids, turn2.logprobs), (cold.token_ids, cold.logprobs))

  def test_a_batch_neighbour_does_not_change_the_answer(self):
    # The same request alone and beside another prompt (other token buckets per step).
    store = self.create_tempdir().full_path
    writer = make_llm(store, "int8", "compute_only")
    alone = writer.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    writer.flush()
    writer.close()
    other = [int(t) for t in np.random.default_rng(9).integers(0, 256, 3 * C + 2)]
    reader = make_llm(store, "int8", "cake")
    both = reader.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": other}], PARAMS)
    reader.close()
    self.assertEqual((both[0].token_ids, both[0].logprobs), (alone.token_ids, alone.logprobs))

  def test_inconsistent_mode_is_still_available_and_levels_are_fixed(self):
    llm = make_llm("memory://consistent-off", "cachegen", kv_codec_levels=[1, 3],
                   kv_codec_consistent=False)
    out = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    self.assertLen(out.token_ids, PARAMS.max_tokens)
    llm.close()
    consistent = make_llm(self.create_tempdir().full_path, "cachegen", kv_codec_levels=[1, 3])
    consistent.generate({"prompt_token_ids": PROMPT}, PARAMS)
    consistent.flush()
    out = consistent.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(max_tokens=1, temperature=0.0))[0]
    levels = set(map(str, out.metrics.merge.levels.values()))
    self.assertLessEqual(levels, {"cachegen/1"})  # never the coarser level, whatever the timing
    consistent.close()

  def test_a_prompt_stored_in_another_encoding_gets_its_own_chunks(self):
    # A store whose chunks of PROMPT hold raw only (written by a raw engine): a consistent int8
    # engine cannot use them (its output must equal its own cold run) and a record is written
    # once, so with shared keys it would recompute PROMPT on every request. Its keys carry its
    # encoding: it writes int8 chunks beside the raw ones, and the repeat loads them.
    store = self.create_tempdir().full_path
    raw = make_llm(store, "raw", "load_only")
    raw.generate({"prompt_token_ids": PROMPT}, PARAMS)
    raw.flush()
    raw_keys = raw.kv_store.lookup(PROMPT, None).hashes
    raw.close()
    lossy = make_llm(store, "int8", "load_only")
    self.assertEqual(lossy.kv_store.key_encoding, "int8/0")
    self.assertNotEqual(lossy.kv_store.lookup(PROMPT, None).hashes[0], raw_keys[0])
    first = lossy.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    lossy.flush()
    second = lossy.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    self.assertEqual(first.num_cached_tokens, 0)
    self.assertEqual(second.num_cached_tokens, (len(PROMPT) - 1) // C * C)
    self.assertEqual((second.token_ids, second.logprobs), (first.token_ids, first.logprobs))
    lossy.close()
    # The raw engine still finds its own chunks (keys without an encoding are unchanged).
    raw = make_llm(store, "raw", "load_only")
    self.assertEqual(raw.kv_store.lookup(PROMPT, None).hashes, raw_keys)
    again = raw.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    self.assertEqual(again.num_cached_tokens, (len(PROMPT) - 1) // C * C)
    raw.close()

  def test_consistent_needs_the_chunk_size_compiled(self):
    with self.assertRaisesRegex(ValueError, "kv_codec_consistent=True needs kv_chunk_size=48"):
      real_llm("tiny", cache_dir="", chunk_sizes=(16, 32), kv_store="memory://x", kv_chunk_size=48,
               kv_codec="int8", kv_codec_consistent=True, compile_on_init=False)
    with self.assertRaisesRegex(ValueError, "kv_chunk_size=24 must be a whole number of blocks"):
      real_llm("tiny", cache_dir="", chunk_sizes=(16, 24), kv_store="memory://x", kv_chunk_size=24,
               kv_codec="int8", kv_codec_consistent=True, compile_on_init=False)


if __name__ == "__main__":
  absltest.main()
