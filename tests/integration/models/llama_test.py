"""Chunked prefill and decode on the tiny config, on the paged runner, against the naive
full-sequence oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from flax import nnx

from kvjax.models.nn import config, layers
from kvjax.models.nn.llama import Llama, param_shapes
from kvjax.models.runner.paged_runner import PagedModelRunner
from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk
from kvjax.models.loading.registry import tiny_params
from kvjax.testing.oracle import ATOL, oracle_forward

CFG = config.tiny()
PARAMS = tiny_params(CFG, seed=1)
# Larger weights than init so attention is far from uniform and mistakes show.
PARAMS = {k: (v if k.endswith("norm") else v * 8.0) for k, v in PARAMS.items()}
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, 150).astype(np.int32)
B, MAX_LEN = 16, 256
# Two sequences' block tables over a pool of 32 blocks (what the engine's slots 0 and 1 were).
TABLES = {0: list(range(MAX_LEN // B)), 1: list(range(MAX_LEN // B, 2 * MAX_LEN // B))}
# Chunk size 1 lets a step hold a whole prompt as one-token entries of one sequence (each sees
# the earlier ones), so every token's logits come out of one step.
CHUNK_SIZES = (1, 16, 32, 64, 128, 256)


_RUNNERS = {}


def make_runner(dtype=jnp.float32, cfg=CFG, params=None):
  """A runner with a zeroed pool; compiled programs are shared across tests."""
  key = (jnp.dtype(dtype).name, cfg)
  if key not in _RUNNERS:
    model = Llama.from_params(cfg, params if params is not None else PARAMS, dtype=dtype)
    _RUNNERS[key] = PagedModelRunner(model, PagedRunnerConfig(
        num_blocks=2 * MAX_LEN // B, block_size=B, max_num_seqs=2, max_num_batched_tokens=MAX_LEN,
        max_seq_len=MAX_LEN, chunk_sizes=CHUNK_SIZES))
  runner = _RUNNERS[key]
  runner.reset()
  return runner


def chunked_prefill(runner, tokens, chunk, slot=1):
  """Each chunk one step entry: (logits at each chunk's last token, K before RoPE, V)."""
  logits, k_pre, v = [], [], []
  for start in range(0, len(tokens), chunk):
    out = runner.step([SeqChunk(tokens[start:start + chunk], start, TABLES[slot])])
    logits.append(np.asarray(out.logits_SV[0]))
    k_pre.append(np.asarray(out.k_pre_rope_LTKH))
    v.append(np.asarray(out.v_LTKH))
  return np.stack(logits), np.concatenate(k_pre, 1), np.concatenate(v, 1)


def token_logits(runner, tokens, chunk, slot=1, start=0):
  """Each chunk one step of one-token entries: the logits of every token, f32[T, V]."""
  logits = []
  for a in range(0, len(tokens), chunk):
    piece = tokens[a:a + chunk]
    out = runner.step([SeqChunk([int(t)], start + a + i, TABLES[slot])
                       for i, t in enumerate(piece)])
    logits.append(np.asarray(out.logits_SV))
  return np.concatenate(logits)


def chunk_ends(n, chunk):
  return [min(s + chunk, n) - 1 for s in range(0, n, chunk)]


def seq_kv(runner, slot, n):
  """The pool's K (after RoPE) and V of a sequence's first n positions, [L, n, K, H] each."""
  k, v = runner.read_blocks(TABLES[slot])
  return np.asarray(k)[:, :n], np.asarray(v)[:, :n]


class LlamaTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.want_logits, cls.want_k_pre, cls.want_v = oracle_forward(CFG, PARAMS, TOKENS)
    full = make_runner()
    cls.full_logits = token_logits(full, TOKENS, 256)
    cls.full_pool = jax.tree.map(np.asarray, full.pool)

  def test_full_prefill_matches_oracle(self):
    np.testing.assert_allclose(self.full_logits, self.want_logits, atol=ATOL["float32"])

  @parameterized.parameters(7, 150)  # odd chunks across blocks; one chunk of the whole prompt
  def test_chunked_prefill_equals_full_prefill(self, chunk):
    self._check_chunked_prefill_equals_full_prefill(chunk)

  @parameterized.parameters(1, 64)
  @pytest.mark.slow
  def test_chunked_prefill_equals_full_prefill_slow(self, chunk):
    self._check_chunked_prefill_equals_full_prefill(chunk)

  def _check_chunked_prefill_equals_full_prefill(self, chunk):
    runner = make_runner()
    logits, k_pre, v = chunked_prefill(runner, TOKENS, chunk)
    ends = chunk_ends(len(TOKENS), chunk)
    np.testing.assert_allclose(logits, self.full_logits[ends], atol=ATOL["float32"])
    np.testing.assert_allclose(logits, self.want_logits[ends], atol=ATOL["float32"])
    np.testing.assert_allclose(k_pre, self.want_k_pre, atol=1e-5)
    np.testing.assert_allclose(v, self.want_v, atol=1e-5)
    n = len(TOKENS)
    k, v = seq_kv(runner, 1, MAX_LEN)
    full_k = self.full_pool.layout.unfold(self.full_pool.k_LPBF[:, TABLES[1]]).reshape(k.shape)
    full_v = self.full_pool.layout.unfold(self.full_pool.v_LPBF[:, TABLES[1]]).reshape(v.shape)
    np.testing.assert_allclose(k[:, :n], full_k[:, :n], atol=1e-5)
    np.testing.assert_allclose(v[:, :n], full_v[:, :n], atol=1e-5)
    # Padding never writes: everything past the prompt and the other sequence's blocks stay 0.
    self.assertEqual(np.abs(k[:, n:]).max(), 0.0)
    self.assertEqual(np.abs(seq_kv(runner, 0, MAX_LEN)[0]).max(), 0.0)
    # Every token's logits, the chunks' tokens as one-token entries.
    runner = make_runner()
    np.testing.assert_allclose(token_logits(runner, TOKENS, chunk), self.want_logits,
                               atol=ATOL["float32"])

  def test_pre_rope_keys_rerotated_equal_cache_keys(self):
    runner = make_runner()
    _, k_pre, _ = chunked_prefill(runner, TOKENS, 64)
    pos = np.arange(len(TOKENS))[None]
    rotated = layers.apply_rope(jnp.asarray(k_pre), pos, jnp.asarray(layers.rope_inv_freq(CFG)))
    np.testing.assert_allclose(np.asarray(rotated), seq_kv(runner, 1, len(TOKENS))[0],
                               atol=1e-6)
    unrotated = layers.apply_rope(rotated, pos, jnp.asarray(layers.rope_inv_freq(CFG)),
                                  inverse=True)
    np.testing.assert_allclose(np.asarray(unrotated), k_pre, atol=1e-5)

  def test_decode_after_chunked_prefill_equals_oracle(self):
    self._check_decode_after_chunked_prefill_equals_oracle(7)

  @parameterized.parameters(1, 150)
  @pytest.mark.slow
  def test_decode_after_chunked_prefill_equals_oracle_slow(self, chunk):
    self._check_decode_after_chunked_prefill_equals_oracle(chunk)

  def _check_decode_after_chunked_prefill_equals_oracle(self, chunk):
    prompt, extra = TOKENS[:140], TOKENS[140:]
    runner = make_runner()
    chunked_prefill(runner, prompt, chunk, slot=1)
    # Sequence 0, shorter, decodes in the same steps.
    other = TOKENS[::-1][:30].copy()
    runner.step([SeqChunk(other, 0, TABLES[0])])
    other_next = TOKENS[:len(extra)]
    want_other, _, _ = oracle_forward(CFG, PARAMS, np.concatenate([other, other_next]))
    for i, tok in enumerate(extra):
      out = runner.step([SeqChunk([int(other_next[i])], 30 + i, TABLES[0]),
                         SeqChunk([int(tok)], 140 + i, TABLES[1])])
      logits = np.asarray(out.logits_SV)
      np.testing.assert_allclose(logits[1], self.want_logits[140 + i], atol=ATOL["float32"])
      np.testing.assert_allclose(logits[0], want_other[30 + i], atol=ATOL["float32"])

  def test_inserted_chunks_equal_computed_cache(self):
    runner = make_runner()
    _, k_pre, v = chunked_prefill(runner, TOKENS, 64)
    want_k, want_v = (x.copy() for x in seq_kv(runner, 1, 128))
    runner.reset()
    for start in (64, 0):  # any order: stored K is position-free until rotated
      kv = np.stack([k_pre[:, start:start + 64], v[:, start:start + 64]], axis=1)
      runner.insert_chunk(kv, TABLES[0][start // B:(start + 64) // B], start)
    got_k, got_v = seq_kv(runner, 0, 128)
    np.testing.assert_allclose(got_k, want_k, atol=1e-6)
    np.testing.assert_array_equal(got_v, want_v)
    # Then the rest of the prompt computed after the inserted prefix matches the oracle.
    logits = token_logits(runner, TOKENS[128:], 64, slot=0, start=128)
    np.testing.assert_allclose(logits, self.want_logits[128:], atol=ATOL["float32"])
    with self.assertRaisesRegex(ValueError, "shape"):
      runner.insert_chunk(kv[:, :, :, :1], TABLES[0][:4], 0)
    with self.assertRaisesRegex(ValueError, "whole blocks"):
      runner.insert_chunk(kv, TABLES[0][:4], 250)

  def test_other_sequences_blocks_are_untouched_by_a_step(self):
    runner = make_runner()
    runner.step([SeqChunk(TOKENS[:20], 0, TABLES[1])])
    before = np.asarray(runner.pool.k_LPBF).copy()
    runner.step([SeqChunk([5], 0, TABLES[0])])
    after = np.asarray(runner.pool.k_LPBF)
    np.testing.assert_array_equal(after[:, TABLES[1]], before[:, TABLES[1]])
    self.assertGreater(np.abs(after[:, TABLES[0][0], 0]).max(), 0.0)

  @pytest.mark.slow  # 11 s; the whole-prompt case below too
  def test_bfloat16_close_to_f32(self):
    # 40 tokens in steps of 16 one-token entries (one compiled size), across pool blocks.
    runner = make_runner(dtype=jnp.bfloat16)
    logits = token_logits(runner, TOKENS[:40], 16)
    self.assertEqual(runner.pool.k_LPBF.dtype, jnp.bfloat16)
    np.testing.assert_allclose(logits, self.want_logits[:40], atol=ATOL["bfloat16"])

  @pytest.mark.slow
  def test_bfloat16_close_to_f32_whole_prompt(self):
    runner = make_runner(dtype=jnp.bfloat16)
    logits = token_logits(runner, TOKENS, 64)
    self.assertEqual(runner.pool.k_LPBF.dtype, jnp.bfloat16)
    np.testing.assert_allclose(logits, self.want_logits, atol=ATOL["bfloat16"])

  @pytest.mark.slow  # 12 s; LLaMA-3 rope scaling: families_test's llama case (slow) too
  def test_untied_head_and_llama3_rope(self):
    cfg = config.tiny(tie_embeddings=False, rope_scaling=config.RopeScaling(
        factor=8.0, original_max_position=64), rope_theta=500000.0)
    params = tiny_params(cfg, seed=3)
    want, _, _ = oracle_forward(cfg, params, TOKENS[:70])
    runner = make_runner(cfg=cfg, params=params)
    logits = token_logits(runner, TOKENS[:70], 16)
    np.testing.assert_allclose(logits, want, atol=ATOL["float32"])

  def test_step_rejects_chunks_that_do_not_fit(self):
    runner = make_runner()
    with self.assertRaisesRegex(ValueError, "compiled sizes"):
      runner.step([SeqChunk(np.zeros(300, np.int32), 0, TABLES[0])])
    with self.assertRaisesRegex(ValueError, "max_seq_len 256"):
      runner.step([SeqChunk(np.zeros(16, np.int32), 250, TABLES[0])])
    with self.assertRaisesRegex(ValueError, "with 1 blocks"):
      runner.step([SeqChunk(np.zeros(17, np.int32), 0, TABLES[0][:1])])

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
