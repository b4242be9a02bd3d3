"""The paged KV pool on the real tiny model: the same tests as
tests/unit/engine/paged_engine_unit_test.py (equal to each prompt alone, device prefix hits,
store hits and cold runs agree, no block leaks through aborts and preemptions, shared blocks are
never written) with `LLM("tiny")` instead of the fake runner; the default pool's size and a
lossy codec's pool are this file's own."""

import jax.numpy as jnp
import pytest
from absl.testing import absltest

from kvjax.testing.engines import real_llm
from tests.unit.engine import paged_engine_unit_test as unit

B, C, CHUNKS, GREEDY, PROMPTS = unit.B, unit.C, unit.CHUNKS, unit.GREEDY, unit.PROMPTS
ids = unit.ids


def tiny(**options):
  return real_llm("tiny", cache_dir="", **options)


def poison_pool(runner, blocks):
  """NaN in the jit'd runner's pool blocks `blocks` (K and V)."""
  pool = runner.pool
  runner.pool = pool.replace(pool.k_LPBF.at[:, blocks].set(jnp.nan),
                             pool.v_LPBF.at[:, blocks].set(jnp.nan))


class PagedEngineHitTest(unit.PagedEngineHitUnitTest):
  """Alone and batched, block and chunk edges, a partly device-served chunk: real numbers."""

  LOGPROB_DELTA = 1e-4

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def runner_calls(self, llm):
    return None  # the jit'd runner records no calls

  def poison_blocks(self, runner, blocks):
    poison_pool(runner, blocks)

  @pytest.mark.slow  # 34 s of the default suite's budget; the fake runs it there
  def test_device_store_and_cold_agree_at_block_and_chunk_edges(self):
    super().test_device_store_and_cold_agree_at_block_and_chunk_edges()

  @pytest.mark.slow  # 17 s of the default suite's budget; the fake runs it there
  def test_a_chunk_partly_served_from_device_blocks_is_saved_too(self):
    super().test_a_chunk_partly_served_from_device_blocks_is_saved_too()

  @pytest.mark.slow  # 26 s of the default suite's budget; the fake runs it there
  def test_equals_alone_one_and_four_a_step(self):
    super().test_equals_alone_one_and_four_a_step()


@pytest.mark.slow  # the assertions run on the fake runner in the default suite
class PagedEngineTest(unit.PagedEngineUnitTest):

  LOGPROB_DELTA = 1e-4

  @classmethod
  def build_llm(cls, **options):
    return tiny(**options)

  def runner_calls(self, llm):
    return None

  def poison_blocks(self, runner, blocks):
    poison_pool(runner, blocks)


class DefaultLayoutTest(absltest.TestCase):

  def test_the_default_cpu_pool_holds_max_num_seqs_sequences_of_max_model_len(self):
    llm = real_llm("tiny", cache_dir="", max_num_seqs=2, max_model_len=64, chunk_sizes=CHUNKS,
                   compile_on_init=False)
    # 2 sequences x 64 tokens = 8 blocks of 16 (every block usable); far below 2 GiB.
    self.assertEqual(llm.engine.runner.num_blocks, 2 * 64 // B)
    self.assertEqual(llm.engine.stats().kv_cache.num_blocks, 2 * 64 // B)
    llm.close()

  def test_a_lossy_codec_with_a_store_keeps_the_pool_and_the_prefix_cache(self):
    llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=CHUNKS, block_size=B,
                   kv_store="memory://lossy-pool", kv_chunk_size=C, kv_codec="int8")
    prompt = PROMPTS[2]
    first = llm.generate(ids([prompt]), GREEDY)[0]
    second = llm.generate(ids([prompt]), GREEDY)[0]
    self.assertIsNotNone(llm.engine.stats().kv_cache)
    self.assertEqual(second.metrics.num_device_cached_tokens, (len(prompt) - 1) // C * C)
    self.assertEqual((second.token_ids, second.logprobs), (first.token_ids, first.logprobs))
    llm.close()


if __name__ == "__main__":
  absltest.main()
