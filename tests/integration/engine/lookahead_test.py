"""Look-ahead prefetch and eviction in the real tiers, and session pinning (CachedAttention,
arXiv 2403.19708, section 3.3) on the tiny model, a host tier of two chunks over a disk tier:
the scripted tier trace is tests/unit/engine/lookahead_unit_test.py's with `LLM("tiny")` instead
of the fake runner; session pinning is this file's own."""

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.storage.format import keys
from tests.unit.engine import lookahead_unit_test as unit

C, GREEDY = unit.C, unit.GREEDY


def tiny(**options):
  return real_llm("tiny", cache_dir="", **options)


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class LookaheadTest(unit.LookaheadUnitTest):

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)


class SessionPinningTest(unit.LookaheadCase):
  """A session's pinned chunks (its prompt, reply and tail) stay in the host tier until it is
  closed."""

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def test_pinned_session_chunks_survive_until_closed(self):
    # Host of 4 chunks: pins may take half (2 chunks: the session's prompt + reply chunks).
    llm = self.make_llm(self.create_tempdir().full_path, 0, host_chunks=4)
    kv = llm.kv_store
    turn = llm.sessions.begin("s1")
    prompt = llm.sessions.prompt(turn, [{"role": "user", "content": "a" * 60}])
    out = llm.generate({"prompt_token_ids": list(prompt.token_ids)},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    llm.sessions.finish(turn, prompt, out.token_ids, out.text)
    llm.flush()
    ids = list(prompt.token_ids) + list(out.token_ids)
    n = len(ids) // C
    hashes = keys.chunk_hashes(kv.namespace(None), ids)
    self.assertEqual([p.token_ids for p in llm.sessions.pinned()], [tuple(ids)])
    kv.wait_prefetches()
    self.assertEqual(kv.prefetch_stats.pinned_chunks, n)
    rng = np.random.default_rng(12)
    others = [[int(t) for t in rng.integers(0, 256, 140)] for _ in range(2)]
    for o in others:  # 8 chunks through a host tier of 4: LRU would evict the session's
      llm.generate({"prompt_token_ids": o}, GREEDY)
      llm.flush()
    self.assertEqual(kv._run(kv.store.host.contains(hashes)), [True] * n)
    self.assertTrue(llm.close_session("s1"))
    self.assertEqual(llm.sessions.pinned(), ())
    kv.wait_prefetches()
    self.assertEqual(kv.prefetch_stats.pinned_chunks, 0)
    for o in others:
      llm.generate({"prompt_token_ids": [t ^ 1 for t in o]}, GREEDY)
      llm.flush()
    self.assertEqual(kv._run(kv.store.host.contains(hashes)), [False] * n)
    llm.close()

  @pytest.mark.slow  # 16 s of the default suite's budget; the pins' logic: the test above
  def test_a_pinned_session_keeps_its_stored_tail(self):
    # Host of 8 chunks: pins may take 4, the session's 2 full chunks and its tail.
    llm = self.make_llm(self.create_tempdir().full_path, 0, host_chunks=8)
    kv = llm.kv_store
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "a" * 60}], p, session_id="s2")[0]
    llm.flush()
    ids = out.prompt_token_ids + out.token_ids
    hashes = keys.chunk_hashes(kv.namespace(None), ids)
    self.assertLen(hashes, 2)
    tail = keys.tail_hash(hashes[1], ids[2 * C:-1])
    kv.wait_prefetches()
    self.assertEqual(kv.prefetch_stats.pinned_chunks, 3)
    rng = np.random.default_rng(13)
    for o in [[int(t) for t in rng.integers(0, 256, 140)] for _ in range(3)]:
      llm.generate({"prompt_token_ids": o}, GREEDY)  # 12 chunks through the host tier
      llm.flush()
    self.assertEqual(kv._run(kv.store.host.contains(list(hashes) + [tail])), [True] * 3)
    llm.close()


if __name__ == "__main__":
  absltest.main()
