"""Chunked prefill and decode on the tiny config against the naive full-sequence oracle."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from kvjax.models import config, layers
from kvjax.models.llama import Llama, param_shapes
from kvjax.models.registry import tiny_params
from kvjax.models.runner import ModelRunner, RunnerConfig
from kvjax.testing.oracle import ATOL, oracle_forward

CFG = config.tiny()
PARAMS = tiny_params(CFG, seed=1)
# Larger weights than init so attention is far from uniform and mistakes show.
PARAMS = {k: (v if k.endswith("norm") else v * 8.0) for k, v in PARAMS.items()}
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, 150).astype(np.int32)
CHUNK_SIZES = (16, 32, 64, 128, 256)


_RUNNERS = {}


def make_runner(dtype=jnp.float32, cfg=CFG, params=None):
  """A runner with a zeroed cache; compiled programs are shared across tests."""
  key = (jnp.dtype(dtype).name, cfg)
  if key not in _RUNNERS:
    model = Llama.from_params(cfg, params if params is not None else PARAMS, dtype=dtype)
    _RUNNERS[key] = ModelRunner(model, RunnerConfig(num_slots=2, max_seq_len=256,
                                                    chunk_sizes=CHUNK_SIZES, block_size=64))
  runner = _RUNNERS[key]
  runner.reset()
  return runner


def chunked_prefill(runner, tokens, chunk, slot=1):
  logits, k_pre, v = [], [], []
  for start in range(0, len(tokens), chunk):
    out = runner.prefill_chunk(tokens[start:start + chunk], slot, start, all_logits=True)
    logits.append(np.asarray(out.logits))
    k_pre.append(np.asarray(out.k_pre_rope_LTKH))
    v.append(np.asarray(out.v_LTKH))
  return np.concatenate(logits), np.concatenate(k_pre, 1), np.concatenate(v, 1)


class LlamaTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.want_logits, cls.want_k_pre, cls.want_v = oracle_forward(CFG, PARAMS, TOKENS)
    full = make_runner()
    cls.full_logits, _, _ = chunked_prefill(full, TOKENS, 256)
    cls.full_cache = jax.tree.map(np.asarray, full.cache)

  def test_full_prefill_matches_oracle(self):
    np.testing.assert_allclose(self.full_logits, self.want_logits, atol=ATOL["float32"])

  @parameterized.parameters(1, 7, 64, 150)
  def test_chunked_prefill_equals_full_prefill(self, chunk):
    runner = make_runner()
    logits, k_pre, v = chunked_prefill(runner, TOKENS, chunk)
    np.testing.assert_allclose(logits, self.full_logits, atol=ATOL["float32"])
    np.testing.assert_allclose(logits, self.want_logits, atol=ATOL["float32"])
    np.testing.assert_allclose(k_pre, self.want_k_pre, atol=1e-5)
    np.testing.assert_allclose(v, self.want_v, atol=1e-5)
    n = len(TOKENS)
    cache = runner.cache
    np.testing.assert_allclose(np.asarray(cache.k_LBSKH)[:, 1, :n],
                               self.full_cache.k_LBSKH[:, 1, :n], atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.v_LBSKH)[:, 1, :n],
                               self.full_cache.v_LBSKH[:, 1, :n], atol=1e-5)
    self.assertEqual(int(cache.lengths_B[1]), n)
    # Padding never writes: everything past the prompt and the other slot stay zero.
    self.assertEqual(np.abs(np.asarray(cache.k_LBSKH)[:, 1, n:]).max(), 0.0)
    self.assertEqual(np.abs(np.asarray(cache.k_LBSKH)[:, 0]).max(), 0.0)

  def test_pre_rope_keys_rerotated_equal_cache_keys(self):
    runner = make_runner()
    _, k_pre, _ = chunked_prefill(runner, TOKENS, 64)
    pos = np.arange(len(TOKENS))[None]
    rotated = layers.apply_rope(jnp.asarray(k_pre), pos, jnp.asarray(layers.rope_inv_freq(CFG)))
    np.testing.assert_allclose(np.asarray(rotated),
                               np.asarray(runner.cache.k_LBSKH)[:, 1, :len(TOKENS)], atol=1e-6)
    unrotated = layers.apply_rope(rotated, pos, jnp.asarray(layers.rope_inv_freq(CFG)),
                                  inverse=True)
    np.testing.assert_allclose(np.asarray(unrotated), k_pre, atol=1e-5)

  @parameterized.parameters(1, 7, 150)
  def test_decode_after_chunked_prefill_equals_oracle(self, chunk):
    prompt, extra = TOKENS[:140], TOKENS[140:]
    runner = make_runner()
    chunked_prefill(runner, prompt, chunk, slot=1)
    # Slot 0 holds another, shorter sequence decoding at the same time.
    other = TOKENS[::-1][:30].copy()
    runner.prefill_chunk(other, 0, 0)
    other_next = TOKENS[:len(extra)]
    want_other, _, _ = oracle_forward(CFG, PARAMS, np.concatenate([other, other_next]))
    for i, tok in enumerate(extra):
      logits = np.asarray(runner.decode_step(np.array([other_next[i], tok]),
                                             np.array([30 + i, 140 + i]), np.array([True, True])))
      np.testing.assert_allclose(logits[1], self.want_logits[140 + i], atol=ATOL["float32"])
      np.testing.assert_allclose(logits[0], want_other[30 + i], atol=ATOL["float32"])
    self.assertEqual(runner.cache.lengths_B.tolist(), [30 + len(extra), 150])

  def test_inserted_chunks_equal_computed_cache(self):
    runner = make_runner()
    _, k_pre, v = chunked_prefill(runner, TOKENS, 64)
    want_k = np.asarray(runner.cache.k_LBSKH)[:, 1, :128].copy()
    want_v = np.asarray(runner.cache.v_LBSKH)[:, 1, :128].copy()
    runner.reset()
    for start in (64, 0):  # any order: stored K is position-free until rotated
      kv = np.stack([k_pre[:, start:start + 64], v[:, start:start + 64]], axis=1)
      runner.insert_chunk(kv, 0, start)
    np.testing.assert_allclose(np.asarray(runner.cache.k_LBSKH)[:, 0, :128], want_k, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(runner.cache.v_LBSKH)[:, 0, :128], want_v)
    # Then the rest of the prompt computed after the inserted prefix matches the oracle.
    out = runner.prefill_chunk(TOKENS[128:], 0, 128, all_logits=True)
    np.testing.assert_allclose(np.asarray(out.logits), self.want_logits[128:],
                               atol=ATOL["float32"])
    with self.assertRaisesRegex(ValueError, "shape"):
      runner.insert_chunk(kv[:, :, :, :1], 0, 0)
    with self.assertRaisesRegex(ValueError, "does not fit"):
      runner.insert_chunk(kv, 0, 250)

  def test_inactive_slot_is_untouched_by_decode(self):
    runner = make_runner()
    runner.prefill_chunk(TOKENS[:20], 1, 0)
    before = np.asarray(runner.cache.k_LBSKH).copy()
    runner.decode_step(np.array([5, 0]), np.array([0, 0]), np.array([True, False]))
    after = np.asarray(runner.cache.k_LBSKH)
    np.testing.assert_array_equal(after[:, 1], before[:, 1])
    self.assertGreater(np.abs(after[:, 0, 0]).max(), 0.0)

  def test_bfloat16_close_to_f32(self):
    runner = make_runner(dtype=jnp.bfloat16)
    logits, _, _ = chunked_prefill(runner, TOKENS, 64)
    self.assertEqual(runner.cache.k_LBSKH.dtype, jnp.bfloat16)
    np.testing.assert_allclose(logits, self.want_logits, atol=ATOL["bfloat16"])

  def test_untied_head_and_llama3_rope(self):
    cfg = config.tiny(tie_embeddings=False, rope_scaling=config.RopeScaling(
        factor=8.0, original_max_position=64), rope_theta=500000.0)
    params = tiny_params(cfg, seed=3)
    want, _, _ = oracle_forward(cfg, params, TOKENS[:70])
    runner = make_runner(cfg=cfg, params=params)
    logits, _, _ = chunked_prefill(runner, TOKENS[:70], 16)
    np.testing.assert_allclose(logits, want, atol=ATOL["float32"])

  def test_prefill_rejects_chunks_that_do_not_fit(self):
    runner = make_runner()
    with self.assertRaisesRegex(ValueError, "compiled sizes"):
      runner.prefill_chunk(np.zeros(300, np.int32), 0, 0)
    with self.assertRaisesRegex(ValueError, "max_seq_len=256"):
      runner.prefill_chunk(np.zeros(16, np.int32), 0, 250)
    with self.assertRaisesRegex(ValueError, "slot 2"):
      runner.prefill_chunk(np.zeros(16, np.int32), 2, 0)

  def test_params_round_trip_and_shape_errors(self):
    model = Llama.from_params(CFG, PARAMS)
    got = model.to_params()
    self.assertEqual(set(got), set(param_shapes(CFG)))
    for k in PARAMS:
      np.testing.assert_array_equal(got[k], PARAMS[k])
    bad = dict(PARAMS, **{"layers.wq": PARAMS["layers.wq"][:, :, :1]})
    with self.assertRaisesRegex(ValueError, "layers.wq"):
      Llama.from_params(CFG, bad)
    with self.assertRaisesRegex(ValueError, "missing.*final_norm"):
      Llama.from_params(CFG, {k: v for k, v in PARAMS.items() if k != "final_norm"})


class RopeTest(absltest.TestCase):

  def test_llama3_scaling_keeps_high_and_divides_low_frequencies(self):
    plain = layers.rope_inv_freq(config.llama3_8b().__class__(
        **{**config.llama3_8b().__dict__, "rope_scaling": None}))
    scaled = layers.rope_inv_freq(config.llama3_8b())
    self.assertAlmostEqual(float(scaled[0]), float(plain[0]), places=7)  # wavelength 2*pi
    self.assertAlmostEqual(float(scaled[-1]), float(plain[-1]) / 8.0, places=12)
    wavelen = 2 * np.pi / plain
    medium = (wavelen >= 8192 / 4) & (wavelen <= 8192 / 1)
    self.assertTrue(medium.any())
    self.assertTrue(np.all(scaled[medium] < plain[medium]))
    self.assertTrue(np.all(scaled[medium] > plain[medium] / 8.0))


class PresetShapeTest(parameterized.TestCase):

  @parameterized.parameters(
      ("llama2_7b", 6_738_415_616), ("llama3_8b", 8_030_261_248),
      ("llama3_70b", 70_553_706_496), ("smollm2_135m", 134_515_008))
  def test_preset_param_counts_at_shape_level(self, preset, want):
    cfg = config.PRESETS[preset]()
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    _, state, _ = nnx.split(model, nnx.Param, ...)
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    self.assertEqual(total, want)
    self.assertEqual(cfg.num_params(), want)


if __name__ == "__main__":
  absltest.main()
