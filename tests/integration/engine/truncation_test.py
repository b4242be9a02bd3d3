"""Truncation that keeps the cache (CachedAttention, arXiv 2403.19708, section 3.4):
`truncate_prompt` in token space with SmolLM2's tokenizer, `truncate_prompt_tokens` (a plain
left cut that stays exact), and session re-rotation (`session_rerotate`): the staged chunks are
the kept tokens' stored KV, gathered token by token, under a private namespace no ordinary
request reaches. The tiny model runs by default; the real model's turn dropping is slow."""

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.models.loading.registry import DEFAULT_MODEL
from kvjax.testing.engines import real_llm
from kvjax import sessions
from kvjax.engine.rerotation import stage_rerotated
from kvjax.models.runner.runner_api import SeqChunk
from kvjax.sessions import KeptSpan, truncate_prompt

from tests.integration.engine.sessions_test import smollm2_tokenizer
from tests.unit.engine import truncation_unit_test as unit


def conv(*turns, system=None):
  msgs = [{"role": "system", "content": system}] if system else []
  for i, t in enumerate(turns):
    msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
  return msgs


class TruncatePromptTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tok = smollm2_tokenizer()

  def test_drops_whole_oldest_turns_and_keeps_the_system_prompt(self):
    msgs = conv("first question " * 20, "first answer " * 20, "second question " * 20,
                "second answer " * 20, "third question", system="Be brief.")
    ids = tuple(self.tok.encode_chat(msgs))
    sys_ids = self.tok.encode_chat(msgs[:1], add_generation_prompt=False)
    last_two = self.tok.encode_chat(msgs[:1] + msgs[3:])
    # Dropping turn 1 leaves: system + turn 2 + the last user message.
    tr = truncate_prompt(self.tok, ids, len(last_two))
    self.assertEqual(tr.token_ids, tuple(last_two))
    self.assertEqual(tr.dropped_turns, 1)
    n_sys = len(sys_ids)
    self.assertEqual(tr.spans, (KeptSpan(0, 0, n_sys),
                                KeptSpan(len(ids) - (len(last_two) - n_sys), n_sys,
                                         len(last_two) - n_sys)))
    for sp in tr.spans:
      self.assertEqual(ids[sp.src_start:sp.src_start + sp.length],
                       tr.token_ids[sp.dst_start:sp.dst_start + sp.length])
    # One token less: turn 2 goes too.
    tr2 = truncate_prompt(self.tok, ids, len(last_two) - 1)
    self.assertEqual(tr2.token_ids,
                     tuple(self.tok.encode_chat(msgs[:1] + msgs[5:])))
    self.assertEqual(tr2.dropped_turns, 2)
    # Fits: unchanged.
    self.assertEqual(truncate_prompt(self.tok, ids, len(ids)).token_ids, ids)

  def test_a_last_turn_over_the_limit_is_a_plain_left_cut(self):
    ids = tuple(self.tok.encode_chat(conv("a " * 100, "b", "c " * 300)))
    tr = truncate_prompt(self.tok, ids, 200)
    self.assertEqual(tr.token_ids, ids[-200:])
    self.assertEqual((tr.dropped_turns, tr.spans), (0, (KeptSpan(len(ids) - 200, 0, 200),)))
    tr = truncate_prompt(self.tok, ids[:300], 50, policy=sessions.TRUNCATE_NONE)
    self.assertEqual(tr.token_ids, ids[250:300])
    # Unasked (no truncate_prompt_tokens), it would cut into the last turn: none.
    self.assertIsNone(truncate_prompt(self.tok, ids, 200, left_cut=False))
    self.assertEqual(truncate_prompt(self.tok, ids, len(ids), left_cut=False).token_ids, ids)


class RegistryTruncationTest(absltest.TestCase):
  """`SessionRegistry.prompt(limit=)`: the session goes on from the cut ids."""

  def test_the_next_turn_extends_the_truncated_ids(self):
    tok = smollm2_tokenizer()
    reg = sessions.SessionRegistry(tok, sessions.SessionConfig(truncation="drop_oldest_turns"))
    msgs = conv("one " * 80)
    t = reg.begin("s")
    p1 = reg.prompt(t, msgs, limit=1000)
    self.assertIsNone(p1.truncation)
    reply = tok.encode("Fine.", add_special_tokens=False) + [tok.eos_id]
    reg.finish(t, p1, reply, "Fine.")
    msgs += [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "two " * 80}]
    t = reg.begin("s")
    full = reg.prompt(t, msgs)  # no limit: the whole extension
    reg.release(t)
    t = reg.begin("s")
    p2 = reg.prompt(t, msgs, limit=len(full.token_ids) - 10)
    self.assertEqual(p2.truncation.dropped_turns, 1)
    self.assertEqual(p2.truncation.source_ids, full.token_ids)
    self.assertEqual(p2.token_ids, tuple(tok.encode_chat(msgs[2:])))  # default system + turn 2
    reg.finish(t, p2, reply, "Fine.")
    msgs += [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "three"}]
    t = reg.begin("s")
    p3 = reg.prompt(t, msgs, limit=10_000)
    self.assertEqual(p3.outcome, sessions.EXTENDED)
    self.assertEqual(p3.token_ids[:len(p2.token_ids) + len(reply)],
                     p2.token_ids + tuple(reply))
    self.assertIsNone(p3.truncation)
    st = reg.stats()
    self.assertEqual((st.truncated, st.dropped_turns, st.rerotated), (1, 1, 0))
    # A limit below 1 (max_tokens past the context) leaves the prompt to the context check.
    self.assertIsNone(reg.prompt(t, msgs, limit=0).truncation)

  def test_a_last_turn_over_the_limit_is_cut_only_when_the_request_asks(self):
    # Dropping whole turns cannot fit a long last message: the prompt goes back as is (the
    # context check refuses it, as without a session) unless truncate_prompt_tokens asked for
    # at most `limit` tokens, which is then a left cut.
    tok = smollm2_tokenizer()
    reg = sessions.SessionRegistry(tok, sessions.SessionConfig(truncation="drop_oldest_turns"))
    msgs = conv("What is the capital of France? " * 20)
    whole = tuple(tok.encode_chat(msgs))
    t = reg.begin("s")
    unasked = reg.prompt(t, msgs, limit=12)
    self.assertEqual((unasked.token_ids, unasked.truncation), (whole, None))
    asked = reg.prompt(t, msgs, limit=12, cut=True)
    self.assertEqual(asked.token_ids, whole[-12:])
    self.assertEqual((asked.truncation.dropped_turns, asked.truncation.dropped_tokens),
                     (0, len(whole) - 12))
    reg.release(t)
    self.assertEqual(reg.stats().truncated, 1)


class SessionMetricsTest(absltest.TestCase):

  def test_session_hit_rate_and_truncation_families(self):
    from kvjax.serve.metrics import _SessionCollector  # pylint: disable=g-import-not-at-top
    st = sessions.SessionStats(first=2, extended=3, not_extended=1, truncated=2, rerotated=1,
                               rerotated_tokens=128, dropped_turns=3)
    got = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
           for f in _SessionCollector(lambda: st).collect() for smp in f.samples}
    self.assertEqual(got[("kvjax_session_hit_rate", ())], 0.75)
    self.assertEqual(got[("kvjax_session_truncations_total", (("kind", "rerotated"),))], 1)
    self.assertEqual(got[("kvjax_session_dropped_turns_total", ())], 3)
    self.assertEqual(got[("kvjax_session_rerotated_tokens_total", ())], 128)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class TruncatePromptTokensTest(unit.TruncatePromptTokensUnitTest):
  """The same tests as tests/unit/engine/truncation_unit_test.py on the real tiny model."""

  @classmethod
  def make_llm(cls, **options):
    return real_llm("tiny", cache_dir="", **options)


class BoundaryRerotationTest(absltest.TestCase):
  """`session_rerotate_boundary_chunks=1`: the truncated prompt's first store chunk (the
  seam) is computed, the next ones load re-rotated, under a load-only
  merge whatever the engine's merge mode (a Cake meeting point would make the answer depend on
  timing); the answer equals a runner-level reference built from those pieces."""

  def test_first_chunk_computed_then_rerotated_chunks_equals_the_reference(self):
    c, n_out = 16, 8
    llm = real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), max_num_seqs=2,
                   max_model_len=256, kv_store="memory://", kv_chunk_size=c,
                   enable_prefix_caching=False, session_truncation="drop_oldest_turns",
                   session_rerotate=True, session_rerotate_boundary_chunks=1)  # merge mode: cake
    try:
      limit = llm.max_model_len - n_out - 40
      p = SamplingParams(max_tokens=n_out, temperature=0)
      p2 = SamplingParams(max_tokens=n_out, temperature=0, logprobs=1,
                          truncate_prompt_tokens=limit)

      def two_turns(session_id):
        msgs = [{"role": "user", "content": "x" * 150}]
        out1 = llm.chat(msgs, p, session_id=session_id, cache_salt="t")[0]
        llm.flush()
        msgs += [{"role": "assistant", "content": out1.text},
                 {"role": "user", "content": "y" * 60}]
        out2 = llm.chat(msgs, p2, session_id=session_id, cache_salt="t")[0]
        return out1, out2, llm.last_session_prompt

      out1, out2, pr = two_turns("b")
      tr = pr.truncation
      (span,) = tr.spans
      stored_end = (len(out1.prompt_token_ids) + len(out1.token_ids) - 1) // c * c
      k = min((stored_end - span.src_start) // c, (limit - 1) // c)
      self.assertGreater(k, 2)
      self.assertTrue(pr.kv_salt.startswith(sessions.REROTATED_SALT_PREFIX))
      self.assertEqual(pr.rerotated_tokens, (k - 1) * c)
      merge = out2.metrics.merge  # chunks past k: the source's unstored tail, computed
      self.assertEqual(merge.chunks_computed, [0, *range(k, (len(tr.token_ids) - 1) // c)])
      self.assertEqual(sorted(merge.chunks_loaded), list(range(1, k)))
      self.assertEqual(out2.num_cached_tokens, (k - 1) * c)
      # Reference on the runner: chunk 0 computed, chunks [1, k) the source tokens' stored KV
      # inserted at their new positions, the rest computed, then greedy decode.
      kv, runner = llm.kv_store, llm.engine.runner
      src_ids = list(tr.source_ids)
      src = kv.read_raw_chunks(kv.lookup(src_ids, "t"), src_ids, range(len(src_ids) // c))
      ids = list(tr.token_ids)
      b = runner.block_size  # no prefix cache: every block is free between requests
      table = list(range(-(-(len(ids) + n_out) // b)))
      for j in range(1, k):
        pos = [span.src_start + j * c + t for t in range(c)]
        runner.insert_chunk(np.stack([src[s // c][:, :, s % c] for s in pos], axis=2),
                            table[j * c // b:(j + 1) * c // b], j * c)
      runner.step([SeqChunk(ids[:c], 0, table)])
      for a in range(k * c, len(ids), 64):
        out = runner.step([SeqChunk(ids[a:a + 64], a, table)])
        logits = np.asarray(out.logits_SV[0], np.float64)
      first_lp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
      want = []
      for step in range(n_out):
        want.append(int(np.argmax(logits)))
        out = runner.step([SeqChunk([want[-1]], len(ids) + step, table)])
        logits = np.asarray(out.logits_SV[0], np.float64)
      self.assertEqual(out2.token_ids, want)
      np.testing.assert_allclose(out2.logprobs[0][want[0]], first_lp[want[0]], atol=1e-4)
      # The same turn again (another session, same history): the same private namespace, now
      # with chunk 0 stored as computed; the same answer.
      llm.flush()
      _, again, pr_again = two_turns("b2")
      self.assertEqual(pr_again.kv_salt, pr.kv_salt)
      self.assertEqual(again.token_ids, out2.token_ids)
      self.assertEqual(sorted(again.metrics.merge.chunks_loaded),
                       list(range((len(tr.token_ids) - 1) // c)))  # turn 2 saved the rest
    finally:
      llm.close()


@pytest.mark.slow
class RealModelTruncationTest(absltest.TestCase):
  """SmolLM2: a session over its context drops whole oldest turns; re-rotated or not."""

  def test_turns_are_dropped_and_rerotation_is_off_by_default(self):
    book = ("The schoolmaster was a lank, tall man with narrow shoulders and long arms, and "
            "he taught the children of the hollow to read and to fear the rod. ") * 6
    for rerotate in (False, True):
      llm = real_llm(DEFAULT_MODEL, kv_store="memory://", kv_chunk_size=32, max_model_len=512,
                     chunk_sizes=(16, 32, 64, 128), max_num_seqs=2,
                     session_truncation="drop_oldest_turns", session_rerotate=rerotate)
      p = SamplingParams(max_tokens=8, temperature=0)
      msgs, outs = [], []
      for i in range(4):
        msgs.append({"role": "user", "content": f"Part {i}. {book}\nSummarize part {i}."})
        outs.append(llm.chat(msgs, p, session_id="s")[0])
        llm.flush()
        msgs.append({"role": "assistant", "content": outs[-1].text})
      pr = llm.last_session_prompt
      self.assertGreaterEqual(pr.truncation.dropped_turns, 1)
      tok = llm.get_tokenizer()
      self.assertTrue(tok.decode(outs[-1].prompt_token_ids[:3]).startswith("<|im_start|>system"))
      if rerotate:
        self.assertTrue(pr.kv_salt.startswith(sessions.REROTATED_SALT_PREFIX))
        self.assertGreater(pr.rerotated_tokens, 0)
      else:
        # Exact: the truncated prompt computed (or hit by prefix) as any prompt.
        self.assertIsNone(pr.kv_salt)
        cold = llm.generate({"prompt_token_ids": outs[-1].prompt_token_ids,
                             "cache_salt": "cold"}, p)[0]
        self.assertEqual(outs[-1].token_ids, cold.token_ids)
      llm.close()


if __name__ == "__main__":
  absltest.main()
