"""Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1) in the engine, on
the fake runner: a store hit inserted layer group by layer group inside the step gives the cold
run's answer bit for bit, and the order is group g of every chunk before layer group g runs.

The real runner's layer-group programs (split step equals one call, batched inserts) are tested
in tests/integration/engine/layerwise_test.py."""

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.models.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.storage import StoreConfig, TierConfig
from kvjax.testing import engines
from kvjax.testing.fake_runner import FakeRunner

B, C = 16, 32
CHUNKS = (16, 32, 64)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5)
RNG = np.random.default_rng(7)
HISTORY = [int(t) for t in RNG.integers(0, 256, 130)]
NEW = [int(t) for t in RNG.integers(0, 256, 20)]


def make_engine(groups, **kw):
  store = StoreConfig((TierConfig("host", capacity_bytes=64 << 20),
                       TierConfig("disk", url=engines.memory_store_url())))
  return engines.fake_engine(chunk_sizes=CHUNKS, block_size=B, num_blocks=256, kv_store=store,
                             kv_chunk_size=C, enable_prefix_caching=False,
                             layerwise_groups=groups, **kw)


def run_hit(engine):
  """Stores HISTORY's chunks (turn 1), then serves HISTORY + NEW from the store (turn 2)."""
  engines.generate(engine, [HISTORY], SamplingParams(max_tokens=1))
  engine.kv_store.flush()
  return engines.generate(engine, [HISTORY + NEW], GREEDY)[0]


class FakeSplitStepTest(absltest.TestCase):

  def test_split_step_and_layer_inserts_equal_one_call_exactly(self):
    cfg = PagedRunnerConfig(num_blocks=64, block_size=B, chunk_sizes=CHUNKS,
                            max_num_batched_tokens=128)
    one, split = FakeRunner(cfg), FakeRunner(cfg)
    m = one.model_config
    toks = [int(t) for t in RNG.integers(0, 256, 70)]
    kv = RNG.standard_normal((m.n_layers, 2, C, m.n_kv_heads, m.head_dim)).astype(np.float32)
    one.insert_chunk(kv, [20, 21], 0)
    split.insert_chunk_layers(kv[:1], [20, 21], 0, 0)
    split.insert_chunk_layers(kv[1:], [20, 21], 0, 1)
    seqs = [SeqChunk(toks[:40], C, [20, 21] + list(range(2, 8))),
            SeqChunk(toks[40:], 0, list(range(8, 16)))]
    a, b = one.step(seqs), split.step_grouped(seqs, 2)
    np.testing.assert_array_equal(b.logits_SV, a.logits_SV)
    np.testing.assert_array_equal(b.k_pre_rope_LTKH, a.k_pre_rope_LTKH)
    np.testing.assert_array_equal(split.k_LPBKH, one.k_LPBKH)
    # K before RoPE reads back exactly, whatever the position.
    k, v = one.read_pre_rope([20, 21], 0, C)
    np.testing.assert_array_equal(k, kv[:, 0])
    np.testing.assert_array_equal(v, kv[:, 1])
    with self.assertRaises(ValueError):
      split.insert_chunk_layers(kv, [20, 21], 0, 1)  # layers [1, 3) of a 2-layer model


class LayerwiseEngineUnitTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = engines.fake_engine(chunk_sizes=CHUNKS, block_size=B)
    cls.cold = engines.generate(cold, [HISTORY + NEW], GREEDY)[0]
    engines.close_engine(cold)

  @parameterized.parameters("cake", "load_only")
  def test_equals_whole_chunk_path_and_cold(self, mode):
    whole = make_engine(1, merge_mode=mode)
    want = run_hit(whole)
    lw = make_engine(2, merge_mode=mode)
    lw.layerwise_trace = trace = []
    got = run_hit(lw)
    for out in (want, got):  # bit for bit, whatever the meeting point
      self.assertEqual((out.token_ids, out.logprobs), (self.cold.token_ids, self.cold.logprobs))
    if mode == "load_only":
      self.assertIn(("layers", 1), trace)  # the hit did go in layer-wise
      self.assertGreater(want.num_cached_tokens, 0)
      self.assertEqual(got.num_cached_tokens, want.num_cached_tokens)
      self.assertIn("host", got.metrics.loaded_from_tiers)
      self.assertTrue(any(c[0] == "insert_chunk_layers" for c in lw.runner.calls))
    engines.close_engine(whole)
    engines.close_engine(lw)

  def test_group_order_trace(self):
    lw = make_engine(2, merge_mode="load_only", kv_device_link_bytes_per_s=2e9)
    trace = []
    lw.layerwise_trace = trace
    out = run_hit(lw)
    rid = out.request_id
    n = (len(HISTORY) + len(NEW) - 1) // C  # stored chunks of the prompt: 0 .. n-1
    want = []
    for g in range(2):
      want += [("insert", rid, j, g) for j in range(n)] + [("layers", g)]
    self.assertEqual(trace, want)  # one layer-wise step: every chunk's group g, then group g
    self.assertEqual(out.num_cached_tokens, n * C)
    self.assertEqual(lw.kv_store.device_link.bytes_granted, n * lw.kv_store.layout.nbytes)
    engines.close_engine(lw)


if __name__ == "__main__":
  absltest.main()
