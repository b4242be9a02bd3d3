"""kvtc chunks stored with the "rans-bands" coding, loaded through the engine: entropy-decoded on
the device (`kvjax.kernels.kvtc_rans`, by the store client), the same output as the same run with
"pco-bands" (host-decoded; the codes are identical), and damaged or truncated rANS arrays are
misses that are recomputed."""

import os
import tempfile
from unittest import mock

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.storage.format import codecs, entropy

C = 32
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 256, 3 * C + 7)]


class KVTCRansEngineTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.cache_dir = os.path.join(cls.tmp, "cache")  # one calibration for every LLM below
    cls.make_llm(cls, "kv-calibrate").close()
    # The tiny model's calibrated steps round every code to one value; 1e3 x the sensitivity
    # (steps / 32) gives codes of a few values and streams with words to decode. Not more: token
    # 0's codes are 64x wider (kvtc.KVTC_PROTECT_STEP), and at 1e4 chunk 0's band tables outgrow
    # its plain bytes, so chunk 0 would be stored "plain" and decoded on the host.
    params = os.path.join(cls.cache_dir, "params")
    (name,) = [f for f in os.listdir(params) if f.startswith("kvtc-")]
    with np.load(os.path.join(params, name)) as f:
      arrays = dict(f)
    arrays["sensitivity"] = arrays["sensitivity"] * 1e3
    np.savez(os.path.join(params, name), **arrays)

  def make_llm(self, store):
    return real_llm("tiny", cache_dir=self.cache_dir, max_num_seqs=1, chunk_sizes=(32, 64),
                    kv_store=os.path.join(self.tmp, store), kv_chunk_size=C, kv_codec="kvtc",
                    kv_merge_mode="load_only",
                    enable_prefix_caching=False)  # repeats load from the store, not the device

  def cold_then_warm(self, store, coding):
    """(cold output, warm output, loader stats) with kvtc's q stored in `coding`."""
    llm = self.make_llm(store)
    try:
      with mock.patch.object(codecs, "KVTC_Q_CODING", coding):
        cold = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
        llm.flush()
      warm = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
      return cold, warm, llm.kv_store.loader_stats
    finally:
      llm.close()

  def test_rans_bands_load_equals_pco_bands_load(self):
    cold_r, warm_r, stats_r = self.cold_then_warm("kv-rans", "rans-bands")
    cold_p, warm_p, stats_p = self.cold_then_warm("kv-pco", "pco-bands")
    self.assertEqual(warm_r.metrics.num_loaded_tokens, 3 * C)
    self.assertEqual(warm_p.metrics.num_loaded_tokens, 3 * C)
    self.assertEqual(stats_r.device_decoded, 3)  # every loaded chunk decoded on the device
    self.assertEqual((stats_r.staged_bytes, stats_p.staged_bytes), (0, 0))  # all released
    self.assertEqual(stats_p.device_decoded, 0)  # pco-bands: decoded on the host
    self.assertEqual(cold_r.token_ids, cold_p.token_ids)
    self.assertEqual(warm_r.token_ids, warm_p.token_ids)
    self.assertEqual(warm_r.logprobs, warm_p.logprobs)  # identical codes, identical decode
    self.assertEqual(warm_r.token_ids[0], cold_r.token_ids[0])

  def test_damaged_rans_arrays_are_recomputed(self):
    parse = entropy.parse_components_rans

    def forged(data, shape):  # a lane state damaged past every checksum: only the decoder sees it
      p = parse(data, shape)
      a = p.arrays[-1]
      states = a.states.copy()
      states[-1, 0, 0] += 1
      return p._replace(arrays=p.arrays[:-1] + (a._replace(states=states),))

    def truncated(data, shape):
      return parse(bytes(data)[:-1], shape)

    llm = self.make_llm("kv-damaged")
    try:
      cold = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
      llm.flush()
      for damage in (forged, truncated):
        with mock.patch.object(entropy, "parse_components_rans", damage), self.assertLogs(
            "kvjax.engine.engine", "WARNING") as logs:
          before = llm.kv_store.loader_stats.device_decoded
          out = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
          llm.flush()
        self.assertLen([m for m in logs.output if "not loaded: corrupt" in m], 3, logs.output)
        self.assertEqual(out.metrics.num_loaded_tokens, 0, damage.__name__)
        self.assertEqual(out.token_ids, cold.token_ids, damage.__name__)
        decoded = llm.kv_store.loader_stats.device_decoded - before
        self.assertEqual(decoded, 3 if damage is forged else 0, damage.__name__)
      warm = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]  # undamaged again
      self.assertEqual(warm.metrics.num_loaded_tokens, 3 * C)
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
