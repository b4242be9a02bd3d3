"""kvtc through the `LLM`: calibration at construction (cached with the model fingerprint,
deterministic), stored chunks loaded back close to cold, a chunk of another transform is a miss,
and bad options raise."""

import os
import tempfile

import numpy as np
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.models.loading import kv_calibration
from kvjax.models.nn.calibration_model import CalibrationModel
from kvjax.models.nn.llama import Llama
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.models.loading.registry import load_model

C = 32
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, 256, 3 * C + 9)]


def make_llm(cache_dir, store, **kw):
  kw.setdefault("enable_prefix_caching", False)  # repeats load from the store, not the device
  return real_llm("tiny", cache_dir=cache_dir, max_num_seqs=1, chunk_sizes=(32, 64),
                  kv_store=store, kv_chunk_size=C, kv_codec="kvtc", kv_merge_mode="load_only", **kw)


class KVTCEngineTest(absltest.TestCase):

  @pytest.mark.slow  # 13 s of the default suite's budget; the runner's coding: the tests below
  def test_calibration_is_deterministic_and_reports_each_step(self):
    loaded = load_model("tiny")
    ts, steps = [], [[], []]
    for run in range(2):
      model = CalibrationModel(Llama.from_params(loaded.config, loaded.params))
      ts.append(kv_calibration.calibrate_kvtc(
          model, loaded.tokenizer.encode(kv_calibration.calibration_text()), max_tokens=2048,
          progress=lambda done, total, run=run: steps[run].append((done, total))))
    # 2048 tokens: passages of the model's context, Fisher windows x 4 samples, the fit (the
    # start-up's "kvtc calibration k/N" lines).
    passages = -(-2048 // min(kv_calibration.PASSAGE_TOKENS, model.max_seq_len))
    window = min(kv_calibration.FISHER_CONTEXT, model.max_seq_len // 2)
    window += min(kv_calibration.FISHER_TAIL, model.max_seq_len - window)
    total = passages + kv_calibration.FISHER_SAMPLES * (2048 // window) + 1
    self.assertEqual(steps, [[(i, total) for i in range(1, total + 1)]] * 2)
    self.assertEqual(ts[0].transform_id, ts[1].transform_id)
    np.testing.assert_array_equal(ts[0].basis, ts[1].basis)
    t = ts[0]
    self.assertTrue((np.diff(t.variance, axis=-1) <= 1e-6).all())  # descending variance
    # Whitened by the model's Fisher metric: the synthesis inverts the analysis; one step for
    # every (layer, K/V).
    eye = np.einsum("lade,laef->ladf", t.basis, t.synthesis)
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(24), eye.shape), atol=1e-3)
    np.testing.assert_array_equal(t.sensitivity, 24)
    self.assertEqual(len(np.unique(t.steps(1))), 1)

  @pytest.mark.slow  # 15 s of the default suite's 300 s budget
  def test_stored_chunks_load_close_to_cold_and_other_transforms_miss(self):
    tmp = tempfile.mkdtemp()
    cache_dir, store = os.path.join(tmp, "cache"), os.path.join(tmp, "kv")
    llm = make_llm(cache_dir, store)
    tid = llm.kvtc_transform.transform_id
    self.assertEqual(llm.kv_store.codec_levels, (1,))  # one default level
    cached = [f for f in os.listdir(os.path.join(cache_dir, "params")) if f.startswith("kvtc-")]
    self.assertLen(cached, 1)
    cold = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    llm.flush()
    warm = llm.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    self.assertEqual(warm.num_cached_tokens, 3 * C)
    self.assertEqual(warm.metrics.num_loaded_tokens, 3 * C)
    self.assertEqual(set(warm.metrics.merge.levels.values()), {"kvtc/1"})
    self.assertEqual(warm.token_ids[0], cold.token_ids[0])
    for t, lp in cold.logprobs[0].items():
      if t in warm.logprobs[0]:
        self.assertAlmostEqual(warm.logprobs[0][t], lp, delta=0.1)
    llm.close()

    # A second LLM finds the cached transform (same identity, no recalibration needed).
    llm2 = make_llm(cache_dir, store)
    self.assertEqual(llm2.kvtc_transform.transform_id, tid)
    llm2.close()

    # Another transform (a cached file with other sensitivities): the stored chunks are misses.
    path = os.path.join(cache_dir, "params", cached[0])
    t = kv_calibration.load_transform(path, 3, 8)
    np.savez(path, mean=t.mean, basis=t.basis, variance=t.variance,
             sensitivity=t.sensitivity * 2, predictor=t.predictor, synthesis=t.synthesis)
    llm3 = make_llm(cache_dir, store)
    self.assertNotEqual(llm3.kvtc_transform.transform_id, tid)
    out = llm3.generate({"prompt_token_ids": PROMPT}, PARAMS)[0]
    self.assertEqual(out.metrics.num_loaded_tokens, 0)
    self.assertEqual(out.token_ids, cold.token_ids)
    llm3.close()

  def test_runner_codes_a_chunk_at_its_position(self):
    # PagedModelRunner.encode_levels codes the first token of a sequence finer (start=0) and
    # insert_payload decodes it at the same position: the pool then holds exactly the numpy
    # reference's reconstruction (RoPE applied), and the same KV coded as a later chunk differs
    # only in the protected token.
    import jax.numpy as jnp  # noqa: PLC0415
    from kvjax.kernels import kvtc  # noqa: PLC0415
    loaded = load_model("tiny")
    cfg = loaded.config
    runner = PagedModelRunner(Llama.from_params(cfg, loaded.params), PagedRunnerConfig(
        num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
        max_seq_len=4 * C, chunk_sizes=(32, 64)))
    out = runner.step([SeqChunk(PROMPT[:2 * C], 0, range(4))])             # blocks 0-3
    kv = jnp.stack([out.k_pre_rope_LTKH, out.v_LTKH], axis=1)               # [L, 2, 2C, K, H]
    d = cfg.n_kv_heads * cfg.head_dim
    runner.set_kvtc_transform(kv_calibration.fit_transform(
        np.asarray(kv).reshape(cfg.n_layers, 2, -1, d),
        np.ones((cfg.n_layers, 2)), cfg.n_kv_heads, cfg.head_dim))
    chunk = kv[:, :, :C]
    _, _, first, _ = runner.encode_levels(chunk, "kvtc", (2,), 0)[0]
    _, _, later, _ = runner.encode_levels(chunk, "kvtc", (2,), C)[0]
    first = {n: np.asarray(a) for n, a in first.items()}
    later = {n: np.asarray(a) for n, a in later.items()}
    n = kvtc.KVTC_PROTECT_TOKENS
    np.testing.assert_array_equal(first["q"][:, :, n:], later["q"][:, :, n:])
    self.assertFalse(np.array_equal(first["q"][:, :, :n], later["q"][:, :, :n]))
    first_blocks, later_blocks = (8, 9), (10, 11)  # a second sequence's blocks
    runner.insert_payload("kvtc", first, first_blocks, 0)
    want = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(first),
                                                runner.kvtc_transform, cfg.n_kv_heads,
                                                cfg.head_dim, start=0))
    v_first = np.asarray(runner.read_blocks(first_blocks)[1])
    np.testing.assert_allclose(v_first, want[:, 1], rtol=1e-5, atol=1e-5)
    k_pre, _ = runner.read_pre_rope(first_blocks, 0, C)  # K un-rotated: RoPE at positions 0..
    np.testing.assert_allclose(np.asarray(k_pre), want[:, 0], rtol=1e-4, atol=1e-4)
    exact = np.asarray(chunk)[:, 1, :n]
    err_first = np.abs(v_first[:, :n] - exact).max()
    runner.insert_payload("kvtc", later, later_blocks, C)
    err_later = np.abs(np.asarray(runner.read_blocks(later_blocks)[1])[:, :n] - exact).max()
    self.assertLess(err_first, err_later / 4)
    runner.close()

  def test_bad_options(self):
    with self.assertRaisesRegex(ValueError, "kv_codec_levels"):
      real_llm("gpt-5", cache_dir="", kv_store="memory://", kv_codec="kvtc", kv_codec_levels=(5,))
    with self.assertRaisesRegex(ValueError, "kv_codec_levels"):
      real_llm("gpt-5", cache_dir="", kv_store="memory://", kv_codec="kvtc", kv_codec_levels=())


if __name__ == "__main__":
  absltest.main()
