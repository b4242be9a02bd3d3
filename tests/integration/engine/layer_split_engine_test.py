"""The layer axis of Cake on the real tiny model: tests/unit/engine/layer_split_unit_test.py's
assertions on jit'd programs (a split chunk's layers [k, L) inserted by the layer insert
program; its low layers computed by a full-depth step, which `PagedModelRunner` runs for a
`num_layers` piece: exact, not faster), logprobs within 1e-5 of the cold run.

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
    del e  # the real runner keeps no call log


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
