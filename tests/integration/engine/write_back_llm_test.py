"""Write-back placement end to end (CachedAttention, arXiv 2403.19708, section 3.3.2): the tiny
model over a host tier of two chunks and a disk tier; the saves land in the host tier only, its
victims are demoted to disk, and a second run loads them from there with the cold run's output."""

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.format import keys

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
C = 32
X = [int(t) for t in np.random.default_rng(5).integers(0, 256, 140)]  # 4 candidate chunks


def chunk_bytes():
  probe = real_llm("tiny", cache_dir="", compile_on_init=False)
  cfg = probe.engine.runner.model_config
  probe.close()
  return cfg.n_layers * 2 * C * cfg.n_kv_heads * cfg.head_dim * 4  # f32


@pytest.mark.slow  # same assertions on the fake runner: write_back_unit_test.py
class WriteBackLLMTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64))
    cls.cold = cold.generate({"prompt_token_ids": X}, GREEDY)[0].token_ids
    cold.close()
    cls.chunk = chunk_bytes()

  def test_second_run_loads_demoted_chunks_from_disk(self):
    tmp = self.create_tempdir().full_path
    store = StoreConfig((TierConfig("host", capacity_bytes=2 * self.chunk),
                         TierConfig("disk", url=f"file://{tmp}")))
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16, 32, 64), kv_store=store,
                   kv_chunk_size=C, kv_merge_mode="load_only", enable_prefix_caching=False,
                   kv_placement="write_back")
    try:
      first = llm.generate({"prompt_token_ids": X}, GREEDY)[0]
      llm.flush()
      kv = llm.kv_store
      hashes = keys.chunk_hashes(kv.namespace(None), X)[:4]
      on_disk = kv._run(kv.store.tiers[1].contains(hashes))
      in_host = kv._run(kv.store.host.contains(hashes))
      second = llm.generate({"prompt_token_ids": X}, GREEDY)[0]
      llm.flush()
      stats = {t.name: t for t in llm.engine.stats().tiers}
    finally:
      llm.close()
    self.assertEqual(first.token_ids, self.cold)
    self.assertEqual(second.token_ids, self.cold)
    self.assertEqual(second.num_cached_tokens, 4 * C)
    # Saved chain X0 -> X1 -> X2 -> X3 into a host of two chunks: a save never displaces its
    # own prefix (`kvjax.storage.tiering.placement`, the one planner), so X2 and X3 go straight to the
    # disk and the prefix stays in the host.
    self.assertEqual(in_host, [True, True, False, False])
    # (in the order the loads landed: host reads first)
    self.assertEqual(sorted(second.metrics.loaded_from_tiers), ["disk", "disk", "host", "host"])
    self.assertEqual(on_disk, [False, False, True, True])  # each chunk written once
    self.assertEqual(stats["disk"].written_bytes, 2 * self.chunk)
    self.assertEqual(stats["host"].demotions_out, 0)
    self.assertEqual(stats["host"].demotion_drops, 0)
    # The look-ahead window hints all four chunks: the host declines the disk hits' copies rather
    # than evict the request's own chunks, so nothing is demoted twice.
    self.assertEqual(stats["host"].promotions, 0)


class PlacementOptionTest(absltest.TestCase):

  def test_a_bad_placement_is_rejected(self):
    with self.assertRaisesRegex(ValueError, "kv_placement"):
      real_llm("tiny", cache_dir="", compile_on_init=False, kv_store="memory://wb-bad",
               kv_placement="write_around")


if __name__ == "__main__":
  absltest.main()
