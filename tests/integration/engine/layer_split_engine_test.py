"""The layer axis of Cake on the real tiny model: tests/unit/engine/layer_split_unit_test.py's
assertions on jit'd programs (a split chunk's layers [k, L) inserted by the layer insert
program; its low layers [0, k) computed by a layer-wise step that stops the piece at k,
`PagedModelRunner.step_begin`), logprobs within 1e-5 of the cold run, and the runner's
token-layer counts showing the piece ran k of L layers.

The split engine is built by the composition root on the real tiny model with the layer axis
on, a frozen cost model, a counter clock and settled loads, as the unit test's.
"""

import pytest

from kvjax.entrypoints import root
from kvjax.config import EngineOptions
from kvjax.testing import engines
from kvjax.testing.engines import real_llm
from tests.unit.engine import layer_split_unit_test as unit

C = unit.C
OPTIONS = dict(cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_chunk_size=C,
               enable_prefix_caching=False)


def make_llm(store):
  return real_llm("tiny", kv_store=store, **OPTIONS)


@pytest.mark.slow
class LayerSplitEngineTest(unit.LayerSplitEngineUnitTest):

  logprob_delta = 1e-5

  def setUp(self):
    super().setUp()
    self._llms = []
    self._parts = []

  def tearDown(self):
    for llm in self._llms:
      llm.close()
    for parts in self._parts:
      root.close_parts(parts)
    super().tearDown()

  def cold_engine(self):
    llm = make_llm(None)
    self._llms.append(llm)
    return llm.engine

  def split_engine(self):
    options = EngineOptions.from_flat(model="tiny", dtype="float32",
                                      kv_store=engines.memory_store_url(),
                                      kv_layer_split="auto", **OPTIONS)
    parts = root.build_engine_parts(options, check_writes=True, clock=unit.counter_clock(),
                                    cost_model=unit.split_cost_model(), settle_loads=True)
    self._parts.append(parts)
    return parts.engine

  def close(self, engine):
    del engine  # the LLM that owns its runner and store closes them (tearDown)

  def assert_split_inserts(self, e):
    # The real runner keeps no call log; its counts show chunk 2's 16 tokens ran layer 0 of
    # the tiny model's 2 in each of the two warm runs, and nothing else stopped early.
    self.assertEqual(e.layer_split_groups, 2)
    self.assertEqual(e.runner.layer_split_points(2), (1,))
    self.assertEqual(e.runner.layer_counts().token_layers_skipped, 2 * C * (2 - 1))


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
