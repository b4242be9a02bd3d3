"""rANS Triton kernel (kvjax/kernels/rans_decode_gpu.py): byte-exact against storage's numpy
decoder in interpret mode (odd lane counts, ragged and empty streams, odd W and T, all padded to
powers of two inside); forged words give ok=False; the CUDA lowering on CPU through `jax.export`
at a kvtc band's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax import export

from kvjax.kernels import rans_decode as rd
from kvjax.storage.format import rans

INTERPRET = jax.default_backend() != "gpu"


def laplace_symbols(seed, shape, scale):
  rng = np.random.default_rng(seed)
  return np.clip(np.rint(rng.laplace(0.0, scale, size=shape)) + 128, 0, 255).astype(np.uint8)


def decode_gpu(arrays):
  return rd.rans_decode(**arrays._asdict(), interpret=INTERPRET, platform="cuda")


class RansDecodeGpuTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("ragged_lanes_5_w_300", laplace_symbols(1, (2, 20, 13), 1.0),
       np.random.default_rng(3).integers(0, 21, (2, 13)), dict(lanes=5), 300),
      ("uniform_t_13", np.random.default_rng(4).integers(0, 256, (1, 13, 8)).astype(np.uint8),
       None, dict(lanes=4), None),
      ("empty", laplace_symbols(2, (2, 4, 3), 1.0), np.zeros((2, 3), int), {}, None),
      # Format version 2's segments: lanes of at most 6 of the 20 steps, ragged streams.
      ("segments_ragged", laplace_symbols(1, (2, 20, 13), 1.0),
       np.random.default_rng(3).integers(0, 21, (2, 13)), dict(lanes=8, lane_steps=6), None),
  )
  def test_matches_numpy_decoder(self, symbols, lengths, kwargs, words_per_block):
    self._check_matches_numpy_decoder(symbols, lengths, kwargs, words_per_block)

  # Paths the default cases take too (8 full lanes; other scale bits: other table constants).
  @parameterized.named_parameters(
      ("laplace_lanes_8", laplace_symbols(0, (2, 24, 16), 2.0), None, dict(lanes=8), None),
      ("scale_bits_15", laplace_symbols(3, (1, 16, 8), 5.0), None, dict(scale_bits=15, lanes=8),
       None),
  )
  @pytest.mark.slow
  def test_matches_numpy_decoder_slow(self, symbols, lengths, kwargs, words_per_block):
    self._check_matches_numpy_decoder(symbols, lengths, kwargs, words_per_block)

  def _check_matches_numpy_decoder(self, symbols, lengths, kwargs, words_per_block):
    arrays = rans.parse(rans.encode(symbols, lengths, **kwargs), words_per_block=words_per_block)
    want = rans.decode_arrays(arrays)
    got, ok = decode_gpu(arrays)
    self.assertEqual((got.dtype, got.shape), (jnp.int32, symbols.shape))
    np.testing.assert_array_equal(np.asarray(got), want)
    self.assertTrue(bool(ok))
    ref, _ = rd.rans_decode_reference(**arrays._asdict())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))

  def test_forged_words_are_not_ok(self):
    arrays = rans.parse(rans.encode(laplace_symbols(5, (1, 24, 8), 3.0), lanes=4))
    words = np.asarray(arrays.words).copy()
    words[0, 0, 0] ^= 0x5A5A
    _, ok = decode_gpu(arrays._replace(words=words))
    self.assertFalse(bool(ok))

  def test_lowers_for_cuda_at_a_kvtc_band_shape(self):
    # A SmolLM2 kvtc band: 60 models (30 layers x K/V), 256 steps, 32-lane blocks; W and B as
    # storage pads them (odd W on purpose: padded to a power of two inside).
    m, j, b, t, w = 60, 4, 32, 256, 3000
    sds = jax.ShapeDtypeStruct
    fn = jax.jit(lambda words, states, lengths, num_words, freqs: rd.rans_decode(
        words, states, lengths, num_words, freqs, scale_bits=12, num_streams=j * b,
        num_steps=t, platform="cuda"))
    exp = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            sds((m, j, w), jnp.uint16), sds((m, j, b), jnp.uint32), sds((m, j, b), jnp.int32),
            sds((m, j), jnp.int32), sds((m, 256), jnp.int32))
    text = exp.mlir_module()
    self.assertIn("rans_decode_gpu", text)
    self.assertIn("__gpu$xla.gpu.triton", text)


if __name__ == "__main__":
  absltest.main()
