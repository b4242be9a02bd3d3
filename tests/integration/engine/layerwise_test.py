"""Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1) on the tiny model:
the split step equals the one-call step and batched layer-group inserts equal one by one; the
engine's tests are tests/unit/engine/layerwise_unit_test.py's with `LLM("tiny")` instead of the
fake runner (a store hit inserted layer group by layer group gives the whole-chunk path's and
the cold run's answer, group g of every chunk before layer group g runs)."""

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.testing.engines import real_llm
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk, layer_groups
from kvjax.models.loading.registry import load_model
from tests.unit.engine import layerwise_unit_test as unit

B, C = 16, 32
CHUNKS = (16, 32, 64)
TINY = load_model("tiny")
RNG = np.random.default_rng(7)


class LayerGroupsTest(parameterized.TestCase):

  def test_layer_groups_tile_in_order(self):
    self.assertEqual(layer_groups(30, 4), ((0, 8), (8, 16), (16, 23), (23, 30)))
    self.assertEqual(layer_groups(30, 1), ((0, 30),))
    self.assertEqual(layer_groups(2, 2), ((0, 1), (1, 2)))
    for bad in (0, 31, True):
      with self.assertRaises(ValueError):
        layer_groups(30, bad)

  @pytest.mark.slow  # 9 s; the fake runner's groups: tests/unit/engine/layerwise_unit_test.py
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


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class LayerwiseEngineTest(unit.LayerwiseEngineUnitTest):
  """The engine's layer-wise path (both modes, the group order) on the real model; the real
  numbers of a split step and of layer-group inserts are LayerGroupsTest above."""

  # Chunks computed in one run and loaded in the other differ by float rounding.
  LOGPROB_DELTA = 1e-4

  @classmethod
  def build_llm(cls, **options):
    return real_llm("tiny", cache_dir="", **options)

  def runner_calls(self, llm):
    return None  # the jit'd runner records no calls


if __name__ == "__main__":
  absltest.main()
