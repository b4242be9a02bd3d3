"""Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1) in the engine, on
the fake runner: a store hit inserted layer group by layer group inside the step gives the cold
run's answer bit for bit, and the order is group g of every chunk before layer group g runs.

The engine's tests run through `LLM` (`engines.fake_llm`); tests/integration/engine/layerwise_test.py
subclasses `LayerwiseEngineUnitTest` with the real tiny model (`build_llm`) and tests the real
runner's layer-group programs (split step equals one call, batched inserts)."""

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.storage import StoreConfig, TierConfig
from kvjax.testing import engines
from kvjax.testing.fake_runner import FakeRunner, fake_model_config

B, C = 16, 32
CHUNKS = (16, 32, 64)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5)
RNG = np.random.default_rng(7)
HISTORY = [int(t) for t in RNG.integers(0, 256, 130)]
NEW = [int(t) for t in RNG.integers(0, 256, 20)]
BLOCK_NBYTES = paged_block_nbytes(fake_model_config(), B, "float32")  # tiny's sizes, f32


def run_hit(llm):
  """Stores HISTORY's chunks (turn 1), then serves HISTORY + NEW from the store (turn 2)."""
  llm.generate({"prompt_token_ids": HISTORY}, SamplingParams(max_tokens=1))
  llm.flush()
  return llm.generate({"prompt_token_ids": HISTORY + NEW}, GREEDY)[0]


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
  """The engine's layer-wise path: the fake runner here, the real tiny model in
  tests/integration/engine/layerwise_test.py (which overrides `build_llm`, `LOGPROB_DELTA` and
  `runner_calls`)."""

  #: A hit's log-probs against the cold run's: bit for bit on the fake.
  LOGPROB_DELTA = 0.0

  @classmethod
  def build_llm(cls, **options):
    return engines.fake_llm(**options)

  @classmethod
  def make_llm(cls, groups, **kw):
    """Layer groups `groups`, a pool of 256 blocks, a host tier over a memory "disk"."""
    store = StoreConfig((TierConfig("host", capacity_bytes=64 << 20),
                         TierConfig("disk", url=engines.memory_store_url())))
    return cls.build_llm(chunk_sizes=CHUNKS, block_size=B,
                         kv_cache_memory_bytes=256 * BLOCK_NBYTES, kv_store=store,
                         kv_chunk_size=C, enable_prefix_caching=False,
                         kv_layerwise_groups=groups, **kw)

  def runner_calls(self, llm):
    """The runner's recorded calls (`FakeRunner.calls`); None where the runner records none."""
    return llm.engine.runner.calls

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = cls.build_llm(chunk_sizes=CHUNKS, block_size=B)
    cls.cold = cold.generate({"prompt_token_ids": HISTORY + NEW}, GREEDY)[0]
    cold.close()

  def assert_equals_cold(self, out):
    self.assertEqual(out.token_ids, self.cold.token_ids)
    self.assertEqual([set(d) for d in out.logprobs], [set(d) for d in self.cold.logprobs])
    for got, want in zip(out.logprobs, self.cold.logprobs):
      for t, lp in want.items():  # a delta of 0: equal bit for bit
        self.assertAlmostEqual(got[t], lp, delta=self.LOGPROB_DELTA)

  @parameterized.parameters("cake", "load_only")
  def test_equals_whole_chunk_path_and_cold(self, mode):
    whole = self.make_llm(1, kv_merge_mode=mode)
    want = run_hit(whole)
    lw = self.make_llm(2, kv_merge_mode=mode)
    lw.engine.layerwise_trace = trace = []
    got = run_hit(lw)
    # Whatever the meeting point (Cake's follows timing: what it loads, and whether that goes in
    # layer-wise, may differ between the two runs), the answer may not.
    self.assertEqual(got.token_ids, want.token_ids)
    for out in (want, got):
      self.assert_equals_cold(out)
    if mode == "load_only":
      self.assertIn(("layers", 1), trace)  # the hit did go in layer-wise
      self.assertGreater(want.num_cached_tokens, 0)
      self.assertEqual(got.num_cached_tokens, want.num_cached_tokens)
      self.assertIn("host", got.metrics.loaded_from_tiers)
      calls = self.runner_calls(lw)
      if calls is not None:
        self.assertTrue(any(c[0] == "insert_chunk_layers" for c in calls))
    whole.close()
    lw.close()

  def test_group_order_trace(self):
    lw = self.make_llm(2, kv_merge_mode="load_only", kv_device_link_bytes_per_s=2e9)
    lw.engine.layerwise_trace = trace = []
    out = run_hit(lw)
    rid = out.request_id
    n = (len(HISTORY) + len(NEW) - 1) // C  # stored chunks of the prompt: 0 .. n-1
    want = []
    for g in range(2):
      want += [("insert", rid, j, g) for j in range(n)] + [("layers", g)]
    self.assertEqual(trace, want)  # one layer-wise step: every chunk's group g, then group g
    self.assertEqual(out.num_cached_tokens, n * C)
    self.assertEqual(lw.kv_store.device_link.bytes_granted, n * lw.kv_store.layout.nbytes)
    lw.close()

  def test_bad_option(self):
    for bad in (0, 3, True):  # tiny has 2 layers
      with self.assertRaises(ValueError):
        self.make_llm(bad)


if __name__ == "__main__":
  absltest.main()
