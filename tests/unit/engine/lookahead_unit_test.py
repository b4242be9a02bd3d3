"""Look-ahead prefetch and eviction in the real tiers (CachedAttention, arXiv 2403.19708,
section 3.3) on the fake runner: a scripted tier trace, a host tier of two chunks over a disk
tier. Session pinning through `LLM` is tested in tests/integration/engine/lookahead_test.py."""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.connector import LookaheadRequest
from kvjax.storage import StoreConfig, TierConfig, keys
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
C = 32
RNG = np.random.default_rng(11)
X = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 full candidate chunks
Y = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 other chunks
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
_M = fake_model_config()
CHUNK_NBYTES = _M.n_layers * 2 * C * _M.n_kv_heads * _M.head_dim * 4  # f32


def make_engine(tmp, window, host_chunks=2, **kw):
  store = StoreConfig((TierConfig("host", capacity_bytes=host_chunks * CHUNK_NBYTES),
                       TierConfig("disk", url=f"file://{tmp}")))
  return engines.fake_engine(max_num_seqs=1, chunk_sizes=(16, 32, 64), kv_store=store,
                             kv_chunk_size=C, merge_mode="load_only",
                             enable_prefix_caching=False, lookahead_window=window, **kw)


def host_holds(eng, ids, salt=None):
  kv = eng.kv_store
  hashes = keys.chunk_hashes(kv.namespace(salt), ids)[:(len(ids) - 1) // C]
  return kv._run(kv.store.host.contains(hashes))


def gen(eng, ids):
  out = engines.generate(eng, [ids], GREEDY)[0]
  eng.kv_store.flush()
  return out


class LookaheadUnitTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = engines.fake_engine(max_num_seqs=1, chunk_sizes=(16, 32, 64))
    cls.cold = engines.generate(cold, [X], GREEDY)[0].token_ids
    engines.close_engine(cold)

  def trace(self, window):
    """X computed (saved to host and disk), then Y pushes X's chunks out of the host tier; then
    Y again, running (the one slot) while X waits with its chunks on disk only."""
    eng = make_engine(self.create_tempdir().full_path, window)
    gen(eng, X)
    gen(eng, Y)
    self.assertEqual(host_holds(eng, X), [False, False])
    self.assertEqual(host_holds(eng, Y), [True, True])
    busy = eng.add_request([(int(t) + 1) % 256 for t in Y], LONG)  # holds the slot for a while
    eng.step()
    xid = eng.add_request(X, GREEDY)
    eng.step()  # X waits; the plan's window covers it (window > 0)
    self.assertEqual(eng.stats().num_waiting, 1)
    eng.kv_store.wait_prefetches()
    return eng, xid, busy

  def finish(self, eng, xid):
    outs = {}
    while eng.has_unfinished_requests():
      for o in eng.step():
        if o.finished:
          outs[o.request_id] = o
    return outs[xid]

  def test_window_prefetches_waiting_chunks_into_host(self):
    eng, xid, _ = self.trace(window=8)
    self.assertEqual(host_holds(eng, X), [True, True])  # prefetched ahead of scheduling
    out = self.finish(eng, xid)
    self.assertEqual(out.metrics.loaded_from_tiers, ["host", "host"])
    self.assertEqual(out.token_ids, self.cold)  # a hit equals the cold run
    pf = eng.stats().prefetch
    self.assertEqual((pf.issued, pf.useful, pf.wasted, pf.in_flight), (2, 2, 0, 0))
    host = next(t for t in eng.stats().tiers if t.name == "host")
    self.assertGreaterEqual(host.evictions, 2)
    engines.close_engine(eng)

  def test_window_zero_loads_from_disk(self):
    eng, xid, _ = self.trace(window=0)
    out = self.finish(eng, xid)
    self.assertEqual(out.metrics.loaded_from_tiers, ["disk", "disk"])
    self.assertEqual(out.token_ids, self.cold)
    pf = eng.stats().prefetch
    self.assertEqual((pf.started, pf.issued, pf.useful, pf.wasted), (0, 0, 0, 0))
    engines.close_engine(eng)

  def test_hinted_chunks_survive_a_put_that_lru_would_evict_them_with(self):
    eng = make_engine(self.create_tempdir().full_path, 8)
    kv = eng.kv_store
    gen(eng, X)
    self.assertEqual(host_holds(eng, X), [True, True])
    lookup = kv.lookup(X, None)
    kv.set_lookahead([LookaheadRequest("x", lookup.namespace, tuple(lookup.hashes[:2]),
                                       tuple(lookup.present), tuple(X[:2 * C]),
                                       (kv.layout.nbytes,) * 2)])
    kv.wait_prefetches()
    gen(eng, Y)  # under LRU its chunks would evict X's
    self.assertEqual(host_holds(eng, X), [True, True])
    self.assertEqual(host_holds(eng, Y), [False, False])  # the host declined them: disk only
    kv.set_lookahead([])
    kv.wait_prefetches()
    gen(eng, Y)  # promoted from disk: now X's go
    self.assertEqual(host_holds(eng, X), [False, False])
    engines.close_engine(eng)


if __name__ == "__main__":
  absltest.main()
