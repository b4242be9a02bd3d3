"""Sessions across tiers (CachedAttention, arXiv 2403.19708) on the fake runner: 8 chat
sessions, each over its own document, whose KV a small host tier demotes to disk; their next
turns run together with 32 short requests, load the history mostly from disk and equal their
cold runs bit for bit. The real SmolLM2 run (with code words the model must recall) is the slow
tests/integration/engine/session_tiers_test.py."""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.sessions import EXTENDED
from kvjax.storage import StoreConfig, TierConfig
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

CHUNK = 32
SESSIONS = 8
_M = fake_model_config()
CHUNK_NBYTES = _M.n_layers * 2 * CHUNK * _M.n_kv_heads * _M.head_dim * 4  # f32


def document(i: int) -> str:
  rng = np.random.default_rng(100 + i)
  return "".join(chr(int(c)) for c in rng.integers(97, 123, 200))


class SessionsOnDiskUnitTest(absltest.TestCase):

  def test_eight_sessions_demoted_to_disk_equal_their_cold_runs(self):
    tmp = self.create_tempdir().full_path
    store = StoreConfig((TierConfig("host", capacity_bytes=3 * CHUNK_NBYTES),
                         TierConfig("disk", url=f"{tmp}/kv")))
    llm = engines.fake_llm(kv_store=store, kv_chunk_size=CHUNK, max_num_seqs=4,
                           session_ttl_s=None, kv_merge_mode="load_only",
                           chunk_sizes=(16, 32, 64))
    try:
      p = SamplingParams(max_tokens=12, temperature=0)
      convs = []
      for i in range(SESSIONS):
        msgs = [{"role": "user", "content": f"{document(i)}\n\nWhat is it?"}]
        out = llm.chat(msgs, p, session_id=f"doc{i}")[0]
        self.assertGreater(len(out.prompt_token_ids), 210)
        convs.append(msgs + [{"role": "assistant", "content": out.text},
                             {"role": "user", "content": "Again."}])
        llm.flush()  # the fake computes faster than the saver writes: keep its queue short
      self.assertEqual(llm.engine.stats().saver.jobs_dropped, 0)
      llm.reset_prefix_cache()  # nothing on the device: the history must come from the store
      turns = [llm.sessions.begin(f"doc{i}") for i in range(SESSIONS)]
      prompts = [llm.sessions.prompt(t, c) for t, c in zip(turns, convs)]
      self.assertEqual({pr.outcome for pr in prompts}, {EXTENDED})
      short = [{"prompt_token_ids": list(f"Count to {i % 7 + 2}.".encode())} for i in range(32)]
      outs = llm.generate([{"prompt_token_ids": list(pr.token_ids)} for pr in prompts] + short,
                          [p] * len(prompts) + [SamplingParams(max_tokens=4, temperature=0)] * 32)
      for t, pr, out in zip(turns, prompts, outs):
        llm.sessions.finish(t, pr, out.token_ids, out.text)
      llm.flush()
      colds = llm.generate([{"prompt_token_ids": list(pr.token_ids), "cache_salt": f"cold-{i}"}
                            for i, pr in enumerate(prompts)], p)
      for i, (out, cold, pr) in enumerate(zip(outs, colds, prompts)):
        with self.subTest(session=i):
          self.assertEqual(out.token_ids, cold.token_ids)
          self.assertEqual(cold.num_cached_tokens, 0)
          # Every full chunk of turn 1 loaded (a plain request: no stored tail), most of it
          # from disk (the host holds 3).
          full = pr.history_tokens // CHUNK
          self.assertEqual(out.num_cached_tokens, pr.history_tokens // CHUNK * CHUNK)
          self.assertEqual(out.metrics.num_rejected_chunks, 0)
          tiers = out.metrics.loaded_from_tiers
          self.assertGreaterEqual(tiers.count("disk"), full - 3, tiers)
      disk = next(t for t in llm.engine.stats().tiers if t.name == "disk")
      self.assertGreaterEqual(disk.loaded_chunks, (full - 3) * SESSIONS)
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
