"""The layer axis of Cake on the engine and the fake runner: a meeting chunk split along layers
(compute layers [0, k), load [k, L)) answers exactly as a cold run.

The planner's cost model is frozen so the split is decided the same way every run: compute
costs 1 s per 16-token chunk and a stored chunk takes 1.5 s on the link, so with chunks 0-3
stored the planner loads chunk 3 whole and splits chunk 2 at k = 1 of the fake's L = 2 layers
(done at 2.5 s against 3 s token-only; tests/unit/scheduler/cake_layer_split_test.py has the
plan).
The engine's clock is a counter, so no load turns late, and the store client settles its loads
(`KVStoreClient(settle_loads=True)`: each step's reports wait for every load in flight), so the
plan never hinges on how fast the loader thread runs on a busy machine.
"""

import itertools

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.models.runner.runner_api import SeqChunk
from kvjax.scheduler import CostModel
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

C = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 4 * C + 1)]


def make_engine(store, **kw):
  return engines.fake_engine(kv_store=store, kv_chunk_size=C, max_num_seqs=2,
                             chunk_sizes=(16, 32, 64), enable_prefix_caching=False, **kw)


def frozen_cost(chunk_nbytes: int) -> CostModel:
  """1 s per 16-token chunk, 1.5 s per stored chunk on the link, learning nothing."""
  return CostModel(compute_prior=(0.0, 1 / C, 0.0), learn=False,
                   bandwidth_bytes_per_s=chunk_nbytes / 1.5)


def split_cost_model() -> CostModel:
  """`frozen_cost` of a float32 chunk of the tiny architecture (the fake's and the real tiny
  model's)."""
  cfg = fake_model_config()
  return frozen_cost(cfg.n_layers * 2 * C * cfg.n_kv_heads * cfg.head_dim * 4)


def counter_clock():
  ticks = itertools.count()
  return lambda: next(ticks) * 1e-3


class LayerSplitEngineUnitTest(absltest.TestCase):
  """The engine-level assertions; tests/integration/engine/layer_split_engine_test.py runs
  them on the real tiny model by overriding the factories and the tolerance."""

  #: Logprobs of a split run against the cold run: equal (the fake is exact).
  logprob_delta = 0.0

  def cold_engine(self):
    return make_engine(None)

  def split_engine(self):
    """An engine with a fresh store, the layer axis on, the frozen cost model, a counter clock
    and settled loads."""
    return make_engine(engines.memory_store_url(), layer_split="auto",
                       cost_model=split_cost_model(), clock=counter_clock(), settle_loads=True)

  def close(self, engine):
    engines.close_engine(engine)

  def assert_same(self, got, want):
    self.assertEqual(got.token_ids, want.token_ids)
    self.assertEqual(set(got.logprobs[0]), set(want.logprobs[0]))
    for t, lp in want.logprobs[0].items():
      self.assertAlmostEqual(got.logprobs[0][t], lp, delta=self.logprob_delta)

  def test_a_split_meeting_chunk_equals_the_cold_run(self):
    cold_engine = self.cold_engine()
    cold = engines.generate(cold_engine, [PROMPT], PARAMS)[0]
    self.close(cold_engine)
    e = self.split_engine()
    first = engines.generate(e, [PROMPT], PARAMS)[0]  # nothing stored yet: computes, saves
    e.kv_store.flush()
    before = e.kv_store.tier_snapshots()
    outs = [engines.generate(e, [PROMPT], PARAMS)[0] for _ in range(2)]
    self.assert_split_reads(e, before, outs)
    for out in outs:  # identical across repeats
      trace = out.metrics.merge
      self.assertEqual(trace.layer_splits, {2: 1})
      self.assertEqual((trace.chunks_computed, sorted(trace.chunks_loaded)), ([0, 1], [2, 3]))
      self.assertEqual(trace.chunk_writers, "CCSL")
      self.assertEqual((out.num_cached_tokens, out.metrics.num_computed_tokens),
                       (2 * C, 2 * C + 1))
    for got in [first] + outs:
      self.assert_same(got, cold)
    self.assertEqual(outs[0].token_ids, outs[1].token_ids)
    self.assertEqual(outs[0].logprobs, outs[1].logprobs)
    self.assert_split_inserts(e)
    self.close(e)

  def test_a_request_may_plan_token_only_on_a_splitting_engine(self):
    # layer_split=False: the same warm store and frozen plan, token-only (chunks 0-2 computed,
    # chunk 3 loaded whole), the same answer; anything but a bool is refused.
    cold_engine = self.cold_engine()
    cold = engines.generate(cold_engine, [PROMPT], PARAMS)[0]
    self.close(cold_engine)
    e = self.split_engine()
    engines.generate(e, [PROMPT], PARAMS)
    e.kv_store.flush()
    (out,) = engines.generate(e, [PROMPT], PARAMS, layer_split=False)
    trace = out.metrics.merge
    self.assertEqual((trace.layer_splits, trace.chunk_writers), ({}, "CCCL"))
    # Load reports come on the engine's clock (`KVLoads.landed`): the link's busy time is within
    # the counter's run, not wall time since boot minus a counter.
    self.assertBetween(trace.load_s, 0.0, e.now_s())
    self.assert_same(out, cold)
    with self.assertRaisesRegex(ValueError, "layer_split"):
      e.add_request(PROMPT, PARAMS, layer_split="off")
    self.close(e)

  def assert_split_reads(self, e, before, outs):
    """Each warm run read chunk 3 whole and only layers [k, L) of the split chunk 2 from the
    store: (1 + (L - k) / L) chunks of raw bytes, on the store's link as in its counters (one
    read of a layer range a run, the fake's L = 2, k = 1: 1.5 chunks, 9,216 of 12,288 bytes)."""
    layout = e.kv_store.layout
    (k,) = {out.metrics.merge.layer_splits[2] for out in outs}
    want = len(outs) * (layout.nbytes + layout.nbytes // layout.num_layers
                        * (layout.num_layers - k))
    after = e.kv_store.tier_snapshots()
    self.assertEqual(sum(a.loaded_bytes - b.loaded_bytes for a, b in zip(after, before)), want)
    self.assertEqual(sum(a.link_granted_bytes - b.link_granted_bytes
                         for a, b in zip(after, before)), want)
    self.assertEqual(sum(t.snapshot().get("ranged_reads", 0) for t in e.kv_store.store.tiers),
                     len(outs))

  def assert_split_inserts(self, e):
    # Chunk 2's layer 1 was inserted alone (twice: two warm runs); its layer 0 was computed.
    self.assertEqual([(c[2], c[3], c[4]) for c in e.runner.calls
                      if c[0] == "insert_chunk_layers"], [(32, 1, 1)] * 2)  # start, layer, G


class FakeRunnerLayerSplitTest(absltest.TestCase):

  def test_an_unknown_setting_is_refused(self):
    with self.assertRaisesRegex(ValueError, "layer_split='on'"):
      make_engine(None, layer_split="on")

  def test_the_fake_stops_a_piece_at_any_layer_and_the_engine_offers_them(self):
    e = make_engine(engines.memory_store_url(), layer_split="auto")
    self.addCleanup(engines.close_engine, e)
    self.assertEqual([e.runner.layer_split_points(g) for g in (1, 2)], [(1,), (1,)])
    self.assertEqual(e.layer_split_groups, 2)  # no layer-wise loading: every layer its own
    with self.assertRaises(ValueError):
      e.runner.layer_split_points(3)
    off = make_engine(None)
    self.addCleanup(engines.close_engine, off)
    self.assertEqual(off.layer_split_groups, 0)

  def test_the_fake_runner_stops_a_piece_after_its_layers(self):
    # Low layers computed, then the high layers inserted (and the other order) give the cold
    # pool and logits: the piece wrote layer 0 only.
    e0, e1 = engines.fake_engine(), engines.fake_engine()
    self.addCleanup(engines.close_engine, e0)
    self.addCleanup(engines.close_engine, e1)
    r0, r1 = e0.runner, e1.runner
    blocks = tuple(range(5))
    cold = r0.step([SeqChunk(PROMPT, 0, blocks)])
    k_pre, v = r0.read_pre_rope(blocks[2:3], 2 * C, C)
    high = np.stack([k_pre, v], axis=1)[1:]  # [1, 2, C, K, H]: layer 1 of chunk 2
    r1.step([SeqChunk(PROMPT[:2 * C], 0, blocks)])
    before = r1.read_blocks(blocks[2:3])
    r1.step([SeqChunk(PROMPT[2 * C:3 * C], 2 * C, blocks, num_layers=1)])
    after = r1.read_blocks(blocks[2:3])
    np.testing.assert_array_equal(before[0][1], after[0][1])  # layer 1 untouched
    r1.insert_chunks_layers([high], [blocks[2:3]], [2 * C], 1)
    warm = r1.step([SeqChunk(PROMPT[3 * C:], 3 * C, blocks)])
    np.testing.assert_array_equal(warm.logits_SV, r0.step(
        [SeqChunk(PROMPT[3 * C:], 3 * C, blocks)]).logits_SV)
    del cold
    with self.assertRaisesRegex(ValueError, "num_layers"):
      r1.step([SeqChunk(PROMPT[:C], 0, blocks, num_layers=3)])


if __name__ == "__main__":
  absltest.main()
