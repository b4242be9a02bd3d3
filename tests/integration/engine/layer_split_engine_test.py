"""The layer axis of Cake on the real tiny model: tests/unit/engine/layer_split_unit_test.py's
assertions on jit'd programs (a split chunk's layers [k, L) inserted by the layer insert
program; its low layers [0, k) computed by a layer-wise step that stops the piece at k,
`PagedModelRunner.step_begin`), logprobs within 1e-5 of the cold run, and the runner's
token-layer counts showing the piece ran k of L layers.

The split engine is an `Engine` built on a `real_llm`'s runner and store client, with the layer
axis on and a frozen cost model.
"""

import dataclasses

import pytest

from kvjax.engine.engine import Engine
from kvjax.testing import engines
from kvjax.testing.engines import real_llm
from tests.unit.engine import layer_split_unit_test as unit

C = unit.C


def make_llm(store):
  return real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                  kv_store=store, kv_chunk_size=C, enable_prefix_caching=False)


@pytest.mark.slow
class LayerSplitEngineTest(unit.LayerSplitEngineUnitTest):

  logprob_delta = 1e-5

  def setUp(self):
    super().setUp()
    self._llms = []

  def tearDown(self):
    for llm in self._llms:
      llm.close()
    super().tearDown()

  def cold_engine(self):
    llm = make_llm(None)
    self._llms.append(llm)
    return llm.engine

  def split_engine(self):
    llm = make_llm(engines.memory_store_url())
    self._llms.append(llm)
    e = llm.engine
    load_config = dataclasses.replace(llm.options.load_config(), check_writes=True,
                                      layer_split="auto")
    return Engine(e.runner, e.tokenizer, llm.options.scheduler_config(), load_config,
                  kv_store=e.kv_store,
                  cost_model=unit.frozen_cost(e.kv_store.layout.nbytes),
                  clock=unit.counter_clock())

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
