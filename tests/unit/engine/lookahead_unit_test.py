"""Look-ahead prefetch and eviction in the real tiers (CachedAttention, arXiv 2403.19708,
section 3.3) on the fake runner: a scripted tier trace, a host tier of two chunks over a disk
tier. The tests run through `LLM` (`engines.fake_llm`); tests/integration/engine/lookahead_test.py
subclasses them with the real tiny model (`build_llm`) and adds session pinning."""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.connector import LookaheadRequest
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.format import keys
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
C = 32
RNG = np.random.default_rng(11)
X = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 full candidate chunks
Y = [int(t) for t in RNG.integers(0, 256, 70)]      # 2 other chunks
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
_M = fake_model_config()  # the tiny model's sizes
CHUNK_NBYTES = _M.n_layers * 2 * C * _M.n_kv_heads * _M.head_dim * 4  # f32


def host_holds(llm, ids, salt=None):
  """Per full chunk of `ids` before its last token: whether the host tier holds it."""
  kv = llm.kv_store
  hashes = keys.chunk_hashes(kv.namespace(salt), ids)[:(len(ids) - 1) // C]
  return kv._run(kv.store.host.contains(hashes))  # pylint: disable=protected-access


def gen(llm, ids):
  out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
  llm.flush()
  return out


class LookaheadCase(absltest.TestCase):
  """The tests' `LLM`s: the fake runner here, the real tiny model in
  tests/integration/engine/lookahead_test.py (which overrides `build_llm`)."""

  @classmethod
  def build_llm(cls, **options):
    return engines.fake_llm(**options)

  @classmethod
  def make_llm(cls, tmp, window, host_chunks=2, **kw):
    """One sequence at a time over a host tier of `host_chunks` chunks and a disk tier in
    `tmp`, load-only (every stored chunk loads), look-ahead window `window`."""
    store = StoreConfig((TierConfig("host", capacity_bytes=host_chunks * CHUNK_NBYTES),
                         TierConfig("disk", url=f"file://{tmp}")))
    return cls.build_llm(max_num_seqs=1, chunk_sizes=(16, 32, 64), kv_store=store,
                         kv_chunk_size=C, kv_merge_mode="load_only",
                         enable_prefix_caching=False, kv_lookahead_window=window, **kw)


class LookaheadUnitTest(LookaheadCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = cls.build_llm(max_num_seqs=1, chunk_sizes=(16, 32, 64))
    cls.cold = cold.generate({"prompt_token_ids": X}, GREEDY)[0].token_ids
    cold.close()

  def trace(self, window):
    """X computed (saved to host and disk), then Y pushes X's chunks out of the host tier; then
    Y again, running (the one slot) while X waits with its chunks on disk only."""
    llm = self.make_llm(self.create_tempdir().full_path, window)
    gen(llm, X)
    gen(llm, Y)
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

  def test_window_zero_loads_from_disk(self):
    llm, xid, _ = self.trace(window=0)
    out = self.finish(llm, xid)
    self.assertEqual(out.metrics.loaded_from_tiers, ["disk", "disk"])
    self.assertEqual(out.token_ids, self.cold)
    pf = llm.engine.stats().prefetch
    self.assertEqual((pf.started, pf.issued, pf.useful, pf.wasted), (0, 0, 0, 0))
    llm.close()

  def test_hinted_chunks_survive_a_put_that_lru_would_evict_them_with(self):
    llm = self.make_llm(self.create_tempdir().full_path, 8)
    kv = llm.kv_store
    gen(llm, X)
    self.assertEqual(host_holds(llm, X), [True, True])
    lookup = kv.lookup(X, None)
    kv.set_lookahead([LookaheadRequest("x", lookup.namespace, tuple(lookup.hashes[:2]),
                                       tuple(lookup.present), tuple(X[:2 * C]),
                                       (kv.layout.nbytes,) * 2)])
    kv.wait_prefetches()
    gen(llm, Y)  # under LRU its chunks would evict X's
    self.assertEqual(host_holds(llm, X), [True, True])
    self.assertEqual(host_holds(llm, Y), [False, False])  # the host declined them: disk only
    kv.set_lookahead([])
    kv.wait_prefetches()
    gen(llm, Y)  # promoted from disk: now X's go
    self.assertEqual(host_holds(llm, X), [False, False])
    llm.close()


if __name__ == "__main__":
  absltest.main()
