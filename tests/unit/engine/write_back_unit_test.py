"""Write-back placement end to end (CachedAttention, arXiv 2403.19708, section 3.3.2): the tiny
model over a host tier of two chunks and a disk tier; the saves land in the host tier only, its
victims are demoted to disk, and a second run loads them from there with the cold run's output.

On the fake runner; the `LLM` option (`kv_placement`) is tested in
tests/integration/engine/write_back_llm_test.py."""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.format import keys
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
C = 32
X = [int(t) for t in np.random.default_rng(5).integers(0, 256, 140)]  # 4 candidate chunks


def chunk_bytes():
  cfg = fake_model_config()
  return cfg.n_layers * 2 * C * cfg.n_kv_heads * cfg.head_dim * 4  # f32


class WriteBackEngineUnitTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = engines.fake_engine(max_num_seqs=1, chunk_sizes=(16, 32, 64))
    cls.cold = engines.generate(cold, [X], GREEDY)[0].token_ids
    engines.close_engine(cold)
    cls.chunk = chunk_bytes()

  def test_second_run_loads_demoted_chunks_from_disk(self):
    tmp = self.create_tempdir().full_path
    store = StoreConfig((TierConfig("host", capacity_bytes=2 * self.chunk),
                         TierConfig("disk", url=f"file://{tmp}")), placement="write_back")
    llm = engines.fake_engine(max_num_seqs=1, chunk_sizes=(16, 32, 64), kv_store=store,
                              kv_chunk_size=C, merge_mode="load_only",
                              enable_prefix_caching=False)
    try:
      first = engines.generate(llm, [X], GREEDY)[0]
      llm.kv_store.flush()
      kv = llm.kv_store
      hashes = keys.chunk_hashes(kv.namespace(None), X)[:4]
      on_disk = kv._run(kv.store.tiers[1].contains(hashes))
      in_host = kv._run(kv.store.host.contains(hashes))
      second = engines.generate(llm, [X], GREEDY)[0]
      llm.kv_store.flush()
      stats = {t.name: t for t in llm.stats().tiers}
    finally:
      engines.close_engine(llm)
    self.assertEqual(first.token_ids, self.cold)
    self.assertEqual(second.token_ids, self.cold)
    self.assertEqual(second.num_cached_tokens, 4 * C)
    # Saved chain X0 -> X1 -> X2 -> X3 into a host of two chunks: a save never displaces its
    # own prefix (`kvjax.storage.tiering.placement`, the one planner), so X2 and X3 go straight to the
    # disk and the prefix stays in the host (the host used to evict X1, then X0, by its own
    # rule, and demote them).
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


if __name__ == "__main__":
  absltest.main()
