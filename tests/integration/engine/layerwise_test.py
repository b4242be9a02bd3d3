"""Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1) on the tiny model:
a store hit inserted layer group by layer group inside the step gives the same greedy tokens and
first-token log-probs as the whole-chunk path, the order is group g of every chunk before layer
group g runs, and the split step equals the one-call step."""

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.models.kv_cache import paged_block_nbytes
from kvjax.models.llama import Llama
from kvjax.models.paged_runner import PagedModelRunner
from kvjax.models.runner_api import PagedRunnerConfig, SeqChunk, layer_groups
from kvjax.models.registry import load_model
from kvjax.storage import StoreConfig, TierConfig

B, C = 16, 32
CHUNKS = (16, 32, 64)
TINY = load_model("tiny")
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=5)
RNG = np.random.default_rng(7)
HISTORY = [int(t) for t in RNG.integers(0, 256, 130)]
NEW = [int(t) for t in RNG.integers(0, 256, 20)]


def llm(groups, **kw):
  store = StoreConfig((TierConfig("host", capacity_bytes=64 << 20),
                       TierConfig("disk", url="memory://")))
  return real_llm("tiny", cache_dir="", chunk_sizes=CHUNKS, block_size=B,
                  kv_cache_memory_bytes=256 * paged_block_nbytes(TINY.config, B, jnp.float32),
                  kv_store=store, kv_chunk_size=C, enable_prefix_caching=False,
                  kv_layerwise_groups=groups, **kw)


def run_hit(engine_llm):
  """Stores HISTORY's chunks (turn 1), then serves HISTORY + NEW from the store (turn 2)."""
  engine_llm.generate([{"prompt_token_ids": HISTORY}], SamplingParams(max_tokens=1))
  engine_llm.flush()
  return engine_llm.generate([{"prompt_token_ids": HISTORY + NEW}], GREEDY)[0]


class LayerGroupsTest(parameterized.TestCase):

  def test_layer_groups_tile_in_order(self):
    self.assertEqual(layer_groups(30, 4), ((0, 8), (8, 16), (16, 23), (23, 30)))
    self.assertEqual(layer_groups(30, 1), ((0, 30),))
    self.assertEqual(layer_groups(2, 2), ((0, 1), (1, 2)))
    for bad in (0, 31, True):
      with self.assertRaises(ValueError):
        layer_groups(30, bad)

  def test_split_step_equals_one_call(self):
    model = Llama.from_params(TINY.config, TINY.params)
    cfg = PagedRunnerConfig(num_blocks=64, block_size=B, chunk_sizes=CHUNKS,
                            max_num_batched_tokens=128)
    one, split = PagedModelRunner(model, cfg), PagedModelRunner(model, cfg)
    toks = [int(t) for t in RNG.integers(0, 256, 70)]
    kv = RNG.standard_normal((TINY.config.n_layers, 2, C, TINY.config.n_kv_heads,
                              TINY.config.head_dim)).astype(np.float32)
    one.insert_chunk(kv, [20, 21], 0)
    for l0, l1 in layer_groups(TINY.config.n_layers, 2):
      split.insert_chunk_layers(kv[l0:l1], [20, 21], 0, l0)
    seqs = [SeqChunk(toks[:40], C, [20, 21] + list(range(2, 8))),
            SeqChunk(toks[40:], 0, list(range(8, 16)))]
    a, b = one.step(seqs), split.step_grouped(seqs, 2)
    np.testing.assert_allclose(np.asarray(b.logits_SV), np.asarray(a.logits_SV), atol=1e-5)
    np.testing.assert_allclose(np.asarray(b.k_pre_rope_LTKH), np.asarray(a.k_pre_rope_LTKH),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(split.pool.k_LPBF), np.asarray(one.pool.k_LPBF),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(split.pool.v_LPBF), np.asarray(one.pool.v_LPBF))
    with self.assertRaises(ValueError):
      split.insert_chunk_layers(kv, [20, 21], 0, 1)  # layers [1, 3) of a 2-layer model

  @parameterized.parameters(1, 3, 8, 11)
  def test_chunks_in_one_call_equal_one_by_one(self, n):
    # 3 pads to 4 by repeating the last chunk; 11 is a batch of 8 and one of 3 (padded to 4).
    model = Llama.from_params(TINY.config, TINY.params)
    cfg = PagedRunnerConfig(num_blocks=64, block_size=B, chunk_sizes=CHUNKS,
                            max_num_batched_tokens=128)
    batched, single = PagedModelRunner(model, cfg), PagedModelRunner(model, cfg)
    shape = (TINY.config.n_layers, 2, C, TINY.config.n_kv_heads, TINY.config.head_dim)
    kvs = [RNG.standard_normal(shape).astype(np.float32) for _ in range(n)]
    tables = [[40 - 2 * j, 41 - 2 * j] for j in range(n)]  # any blocks, not in order
    starts = [C * (j % 5) for j in range(n)]
    for kv, blocks, start in zip(kvs, tables, starts):
      single.insert_chunk(kv, blocks, start)
    for l0, l1 in layer_groups(TINY.config.n_layers, 2):
      batched.insert_chunks_layers([kv[l0:l1] for kv in kvs], tables, starts, l0)
    np.testing.assert_array_equal(np.asarray(batched.pool.v_LPBF),
                                  np.asarray(single.pool.v_LPBF))
    np.testing.assert_allclose(np.asarray(batched.pool.k_LPBF), np.asarray(single.pool.k_LPBF),
                               atol=1e-6)

  def test_chunks_in_one_call_bad_input(self):
    model = Llama.from_params(TINY.config, TINY.params)
    runner = PagedModelRunner(model, PagedRunnerConfig(num_blocks=64, block_size=B,
                                                       chunk_sizes=CHUNKS,
                                                       max_num_batched_tokens=128))
    kv = np.zeros((1, 2, C, TINY.config.n_kv_heads, TINY.config.head_dim), np.float32)
    for args, message in ((([], [], [], 0), "at least one"),
                          (([kv, kv], [[1, 2]], [0, 0], 0), "one of each per chunk"),
                          (([kv, kv[:, :, :B]], [[1, 2], [3]], [0, 0], 0), "of one shape"),
                          (([kv], [[1, 2]], [0], 2), "within 2 layers"),
                          (([kv], [[1, 99]], [0], 0), "inside the pool")):
      with self.assertRaisesRegex(ValueError, message):
        runner.insert_chunks_layers(*args)


class LayerwiseEngineTest(parameterized.TestCase):

  # The engine's layer-wise path (both modes, the group order) runs on the fake runner in the
  # default suite (layerwise_unit_test.py); the real model's numbers of a split step and of
  # layer-group inserts are LayerGroupsTest above. Two real engines per mode here: slow.
  @parameterized.parameters("cake", "load_only")
  @pytest.mark.slow
  def test_equals_whole_chunk_path(self, mode):
    want = run_hit(llm(1, kv_merge_mode=mode))
    lw = llm(2, kv_merge_mode=mode)
    lw.engine.layerwise_trace = trace = []
    got = run_hit(lw)
    self.assertEqual(got.token_ids, want.token_ids)
    if mode == "load_only":
      self.assertIn(("layers", 1), trace)  # the hit did go in layer-wise
      self.assertGreater(want.num_cached_tokens, 0)
      self.assertEqual(got.num_cached_tokens, want.num_cached_tokens)
      self.assertIn("host", got.metrics.loaded_from_tiers)
    # Cake's meeting point follows timing (how far compute gets before loads land, and so
    # whether any loaded chunk shares a step with compute): what it loads, and whether that
    # goes in layer-wise, may differ between the two runs; the answer may not. Chunks computed
    # in one run and loaded in the other differ by float rounding, hence the looser bound.
    delta = 1e-5 if mode == "load_only" else 1e-4
    for g, w in zip(got.logprobs, want.logprobs):
      self.assertEqual(set(g), set(w))
      for k, v in w.items():
        self.assertAlmostEqual(g[k], v, delta=delta)

  @pytest.mark.slow  # same assertions on the fake runner: layerwise_unit_test.py
  def test_group_order_trace(self):
    lw = llm(2, kv_merge_mode="load_only", kv_device_link_bytes_per_s=2e9)
    trace = []
    lw.engine.layerwise_trace = trace
    out = run_hit(lw)
    rid = out.request_id
    n = (len(HISTORY) + len(NEW) - 1) // C  # stored chunks of the prompt: 0 .. n-1
    want = []
    for g in range(2):
      want += [("insert", rid, j, g) for j in range(n)] + [("layers", g)]
    self.assertEqual(trace, want)  # one layer-wise step: every chunk's group g, then group g
    self.assertEqual(out.num_cached_tokens, n * C)
    self.assertEqual(lw.kv_store.device_link.bytes_granted,
                     n * lw.kv_store.layout.nbytes)

  def test_bad_option(self):
    for bad in (0, 3, True):
      with self.assertRaises(ValueError):
        llm(bad)


if __name__ == "__main__":
  absltest.main()
