"""Truncation that keeps the cache (CachedAttention, arXiv 2403.19708, section 3.4) through
`LLM`: `truncate_prompt_tokens` (a plain left cut that stays exact), and session re-rotation
(`session_rerotate`): the staged chunks are the kept tokens' stored KV, gathered token by token,
under a private namespace no ordinary request reaches.

On the fake runner (`kvjax.testing.engines.fake_llm`: `LLM` over a numpy model); the real
tiny model's run of the same tests is tests/integration/engine/truncation_test.py."""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax import sessions
from kvjax.engine.rerotation import stage_rerotated
from kvjax.testing import engines


def two_truncated_turns(llm, session_id: str):
  """Session `session_id` under cache_salt "t": turn 1 (150 x's), flushed, then turn 2 (turn 1's
  reply and 60 y's) truncated to `max_model_len - 48` tokens; 8 greedy tokens each.

  Returns:
    (sampling params, the messages of turn 2, turn 1's output, turn 2's output, the limit).
  """
  p = SamplingParams(max_tokens=8, temperature=0)
  msgs = [{"role": "user", "content": "x" * 150}]
  out1 = llm.chat(msgs, p, session_id=session_id, cache_salt="t")[0]
  llm.flush()
  msgs += [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "y" * 60}]
  limit = llm.max_model_len - 8 - 40
  out2 = llm.chat(msgs, SamplingParams(max_tokens=8, temperature=0,
                                       truncate_prompt_tokens=limit),
                  session_id=session_id, cache_salt="t")[0]
  return p, msgs, out1, out2, limit


class TruncatePromptTokensUnitTest(absltest.TestCase):
  """`SamplingParams.truncate_prompt_tokens` and re-rotation on the tiny model (its byte
  tokenizer has no message marks: the session policy is a left cut, one shifted span)."""

  @classmethod
  def make_llm(cls, **options):
    """The `LLM` under test (tests/integration/engine/truncation_test.py: the real tiny model)."""
    return engines.fake_llm(**options)

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.llm = cls.make_llm(chunk_sizes=(16, 32, 64), max_num_seqs=2,
                           max_model_len=256, kv_store="memory://", kv_chunk_size=16,
                           session_truncation="drop_oldest_turns", session_rerotate=True,
                           session_rerotate_boundary_chunks=0,  # every staged chunk from the first
                           kv_merge_mode="load_only")  # every stored chunk loads: exact hit counts

  @classmethod
  def tearDownClass(cls):
    cls.llm.close()
    super().tearDownClass()

  def test_bad_values_raise(self):
    for bad in (0, -1, True, 1.5, "3"):
      with self.assertRaisesRegex(ValueError, "truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)
    with self.assertRaisesRegex(ValueError, "may not start with"):
      self.llm.generate({"prompt_token_ids": [1, 2, 3],
                         "cache_salt": sessions.REROTATED_SALT_PREFIX + "x"})
    with self.assertRaisesRegex(ValueError, "needs a kv_store"):
      self.make_llm(session_truncation="drop_oldest_turns", session_rerotate=True)
    with self.assertRaisesRegex(ValueError, "needs session_truncation"):
      self.make_llm(kv_store="memory://", session_rerotate=True)
    for bad in (-1, True, 1.5):
      with self.assertRaisesRegex(ValueError, "session_rerotate_boundary_chunks"):
        self.make_llm(kv_store="memory://", session_truncation="drop_oldest_turns",
                      session_rerotate=True, session_rerotate_boundary_chunks=bad)
    with self.assertRaisesRegex(ValueError, "boundary_chunks"):
      stage_rerotated(self.llm.kv_store, [1, 2], None, [1, 2], [], "x", boundary_chunks=-1)

  def test_plain_truncation_keeps_the_last_tokens_and_stays_exact(self):
    ids = [int(x) for x in np.random.default_rng(0).integers(3, 250, 120)]
    p = SamplingParams(max_tokens=6, temperature=0, logprobs=2, truncate_prompt_tokens=70)
    cold = self.llm.generate({"prompt_token_ids": ids, "cache_salt": "cold-plain"}, p)[0]
    self.assertEqual(cold.prompt_token_ids, ids[-70:])
    self.llm.flush()
    warm = self.llm.generate({"prompt_token_ids": ids, "cache_salt": "cold-plain"}, p)[0]
    self.assertEqual(warm.num_cached_tokens, 69)  # a prefix hit on the truncated ids
    plain = self.llm.generate({"prompt_token_ids": ids[-70:], "cache_salt": "other"},
                              SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    self.assertEqual(warm.token_ids, cold.token_ids)
    self.assertEqual(plain.token_ids, cold.token_ids)
    np.testing.assert_allclose([d[t] for d, t in zip(warm.logprobs, warm.token_ids)],
                               [d[t] for d, t in zip(cold.logprobs, cold.token_ids)],
                               atol=1e-5)

  def test_a_rerotated_session_turn_loads_the_kept_kv_from_a_private_namespace(self):
    llm, c = self.llm, 16
    p, msgs, out1, out2, limit = two_truncated_turns(llm, "rr")
    pr = llm.last_session_prompt
    tr = pr.truncation
    self.assertEqual(len(out2.prompt_token_ids), limit)
    self.assertEqual(list(tr.token_ids), out2.prompt_token_ids)
    (span,) = tr.spans
    self.assertGreater(span.src_start, 0)
    self.assertTrue(pr.kv_salt.startswith(sessions.REROTATED_SALT_PREFIX))
    # Staged: target chunks whose every token's source chunk is stored (turn 1's full
    # chunks of prompt + output: every token but the last sampled one has KV).
    stored_end = (len(out1.prompt_token_ids) + len(out1.token_ids) - 1) // c * c
    want = min((stored_end - span.src_start) // c, (limit - 1) // c) * c
    self.assertEqual(pr.rerotated_tokens, want)
    self.assertGreaterEqual(out2.num_cached_tokens, want)
    # The staged chunks hold the source tokens' stored KV, token for token.
    kv = llm.kv_store
    src = kv.read_raw_chunks(kv.lookup(list(tr.source_ids), "t"), list(tr.source_ids),
                             range(len(tr.source_ids) // c))
    dst = kv.read_raw_chunks(kv.lookup(list(tr.token_ids), pr.kv_salt), list(tr.token_ids),
                             range(want // c))
    self.assertLen(dst, want // c)
    for j, chunk in dst.items():
      for t in range(c):
        s = span.src_start + j * c + t
        np.testing.assert_array_equal(chunk[:, :, t], src[s // c][:, :, s % c])
    # Never an ordinary hit: the same ids under the tenant's salt find none of it in the store
    # and answer as a cold run does.
    ordinary = llm.generate({"prompt_token_ids": list(tr.token_ids), "cache_salt": "t"}, p)[0]
    cold = llm.generate({"prompt_token_ids": list(tr.token_ids), "cache_salt": "cold-rr"}, p)[0]
    self.assertEqual(ordinary.metrics.num_loaded_tokens
                     - ordinary.metrics.num_device_cached_tokens, 0)
    self.assertEqual(ordinary.token_ids, cold.token_ids)
    # The next turn extends the re-rotated one under its private namespace.
    llm.flush()
    msgs += [{"role": "assistant", "content": out2.text}, {"role": "user", "content": "z"}]
    out3 = llm.chat(msgs, p, session_id="rr", cache_salt="t")[0]
    self.assertEqual(llm.last_session_prompt.kv_salt, pr.kv_salt)
    self.assertIsNone(llm.last_session_prompt.truncation)
    # Every token of turn 2's prompt (its reply's partial last block is not stored, and a
    # request with store hits takes whole device chunks only).
    self.assertGreaterEqual(out3.num_cached_tokens, limit)
    stats = llm.sessions.stats()
    self.assertEqual((stats.truncated, stats.rerotated, stats.rerotated_tokens), (1, 1, want))

  def test_the_turn_asks_for_load_only_whatever_the_engine_mode(self):
    # The session turn's request options carry the merge mode: even an engine that ignores
    # hits (compute_only) loads the re-rotated chunks, as no other merge would be exact.
    llm, c = self.make_llm(chunk_sizes=(16, 32, 64), max_num_seqs=2, max_model_len=256,
                           kv_store="memory://", kv_chunk_size=16,
                           session_truncation="drop_oldest_turns", session_rerotate=True,
                           session_rerotate_boundary_chunks=0,
                           kv_merge_mode="compute_only"), 16
    try:
      p, _, out1, out2, _ = two_truncated_turns(llm, "co")
      pr = llm.last_session_prompt
      self.assertTrue(sessions.is_rerotated_salt(pr.kv_salt))
      self.assertGreaterEqual(pr.rerotated_tokens, c)
      self.assertEqual(out2.metrics.num_loaded_tokens - out2.metrics.num_device_cached_tokens,
                       pr.rerotated_tokens)
      # An ordinary request on this engine still ignores its hits.
      again = llm.generate({"prompt_token_ids": out1.prompt_token_ids, "cache_salt": "t"}, p)[0]
      self.assertEqual(again.metrics.num_loaded_tokens - again.metrics.num_device_cached_tokens,
                       0)
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
