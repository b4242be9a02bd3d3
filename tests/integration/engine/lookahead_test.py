"""Look-ahead prefetch and eviction in the real tiers, and session pinning (CachedAttention,
arXiv 2403.19708, section 3.3): a scripted tier trace on the tiny model, a host tier of two
chunks over a disk tier."""

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.connector import LookaheadRequest
from kvjax.storage import StoreConfig, TierConfig, keys

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
C = 32
RNG = np.random.default_rng(11)
X = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 full candidate chunks
Y = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 other chunks
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_llm(tmp, window, host_chunks=2, **kw):
  # Chunk bytes of the tiny model (f32): layers x 2 x C x kv heads x head dim x 4.
  probe = real_llm("tiny", cache_dir="", compile_on_init=False)
  nbytes = probe.engine.runner.model_config
  chunk = nbytes.n_layers * 2 * C * nbytes.n_kv_heads * nbytes.head_dim * 4
  probe.close()
  store = StoreConfig((TierConfig("host", capacity_bytes=host_chunks * chunk),
                       TierConfig("disk", url=f"file://{tmp}")))
  return real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64), kv_store=store,
                  kv_chunk_size=C, kv_merge_mode="load_only", enable_prefix_caching=False,
                  kv_lookahead_window=window, **kw)


def host_holds(llm, ids, salt=None):
  kv = llm.kv_store
  hashes = keys.chunk_hashes(kv.namespace(salt), ids)[:(len(ids) - 1) // C]
  return kv._run(kv.store.host.contains(hashes))


class LookaheadTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64))
    cls.cold = cold.generate({"prompt_token_ids": X}, GREEDY)[0].token_ids
    cold.close()

  def trace(self, window):
    """X computed (saved to host and disk), then Y pushes X's chunks out of the host tier; then
    Y again, running (the one slot) while X waits with its chunks on disk only."""
    llm = make_llm(self.create_tempdir().full_path, window)
    llm.generate({"prompt_token_ids": X}, GREEDY)
    llm.flush()
    llm.generate({"prompt_token_ids": Y}, GREEDY)
    llm.flush()
    self.assertEqual(host_holds(llm, X), [False, False])
    self.assertEqual(host_holds(llm, Y), [True, True])
    eng = llm.engine
    busy = eng.add_request([(int(t) + 1) % 256 for t in Y], LONG)  # holds the slot for a while
    eng.step()
    xid = eng.add_request(X, GREEDY)
    eng.step()  # X waits; the plan's window covers it (window > 0)
    self.assertEqual(eng.stats().num_waiting, 1)
    llm.kv_store.wait_prefetches()
    return llm, xid, busy

  def finish(self, llm, xid):
    outs = {}
    while llm.engine.has_unfinished_requests():
      for o in llm.engine.step():
        if o.finished:
          outs[o.request_id] = o
    return outs[xid]

  @pytest.mark.slow  # same assertions on the fake runner: lookahead_unit_test.py
  def test_window_prefetches_waiting_chunks_into_host(self):
    llm, xid, _ = self.trace(window=8)
    self.assertEqual(host_holds(llm, X), [True, True])  # prefetched ahead of scheduling
    out = self.finish(llm, xid)
    self.assertEqual(out.metrics.loaded_from_tiers, ["host", "host"])
    self.assertEqual(out.token_ids, self.cold)  # a hit equals the cold run
    pf = llm.engine.stats().prefetch
    self.assertEqual((pf.issued, pf.useful, pf.wasted, pf.in_flight), (2, 2, 0, 0))
    host = next(t for t in llm.engine.stats().tiers if t.name == "host")
    self.assertGreaterEqual(host.evictions, 2)
    llm.close()

  @pytest.mark.slow  # same assertions on the fake runner: lookahead_unit_test.py
  def test_window_zero_loads_from_disk(self):
    llm, xid, _ = self.trace(window=0)
    out = self.finish(llm, xid)
    self.assertEqual(out.metrics.loaded_from_tiers, ["disk", "disk"])
    self.assertEqual(out.token_ids, self.cold)
    pf = llm.engine.stats().prefetch
    self.assertEqual((pf.started, pf.issued, pf.useful, pf.wasted), (0, 0, 0, 0))
    llm.close()

  @pytest.mark.slow  # same assertions on the fake runner: lookahead_unit_test.py
  def test_hinted_chunks_survive_a_put_that_lru_would_evict_them_with(self):
    llm = make_llm(self.create_tempdir().full_path, 8)
    kv = llm.kv_store
    llm.generate({"prompt_token_ids": X}, GREEDY)
    llm.flush()
    self.assertEqual(host_holds(llm, X), [True, True])
    lookup = kv.lookup(X, None)
    kv.set_lookahead([LookaheadRequest("x", lookup.namespace, tuple(lookup.hashes[:2]),
                                       tuple(lookup.present), tuple(X[:2 * C]),
                                       (kv.layout.nbytes,) * 2)])
    kv.wait_prefetches()
    llm.generate({"prompt_token_ids": Y}, GREEDY)  # under LRU its chunks would evict X's
    llm.flush()
    self.assertEqual(host_holds(llm, X), [True, True])
    self.assertEqual(host_holds(llm, Y), [False, False])  # the host declined them: disk only
    kv.set_lookahead([])
    kv.wait_prefetches()
    llm.generate({"prompt_token_ids": Y}, GREEDY)  # promoted from disk: now X's go
    llm.flush()
    self.assertEqual(host_holds(llm, X), [False, False])
    llm.close()

  def test_pinned_session_chunks_survive_until_closed(self):
    # Host of 4 chunks: pins may take half (2 chunks: the session's prompt + reply chunks).
    llm = make_llm(self.create_tempdir().full_path, 0, host_chunks=4)
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
    others = [[int(t) for t in RNG.integers(0, 256, 140)] for _ in range(2)]
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

  def test_a_pinned_session_keeps_its_stored_tail(self):
    # Host of 8 chunks: pins may take 4, the session's 2 full chunks and its tail.
    llm = make_llm(self.create_tempdir().full_path, 0, host_chunks=8)
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
    for o in [[int(t) for t in RNG.integers(0, 256, 140)] for _ in range(3)]:
      llm.generate({"prompt_token_ids": o}, GREEDY)  # 12 chunks through the host tier
      llm.flush()
    self.assertEqual(kv._run(kv.store.host.contains(list(hashes) + [tail])), [True] * 3)
    llm.close()


if __name__ == "__main__":
  absltest.main()
