"""Device rANS decoders: the Pallas kernel (interpret mode on CPU, compiled on an accelerator)
and the jit'd jnp reference, byte-exact against storage's numpy encoder and decoder; garbage
in the padding; forged words; bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.kernels import rans_decode as rd
from kvjax.storage.format import rans

INTERPRET = jax.default_backend() == "cpu"
MODES = (dict(testcase_name="pallas", use_pallas=True),
         dict(testcase_name="reference", use_pallas=False))


def decode(arrays, use_pallas):
  kw = arrays._asdict()
  if use_pallas:
    return rd.rans_decode(**kw, interpret=INTERPRET)
  return rd.rans_decode_reference(**kw)


def laplace_symbols(seed, shape, scale):
  rng = np.random.default_rng(seed)
  return np.clip(np.rint(rng.laplace(0.0, scale, size=shape)) + 128, 0, 255).astype(np.uint8)


def cases():
  """Small, so that interpret mode (one Python-level program per block) stays fast."""
  rng = np.random.default_rng(3)
  ragged = rng.integers(0, 21, (2, 13))
  ragged[0, :4] = 0
  ragged[1, 5] = 20
  skew = np.where(rng.random((2, 20, 9)) < 0.99, 7, rng.integers(0, 256, (2, 20, 9)))
  return [
      ("laplace", laplace_symbols(0, (2, 24, 16), 2.0), None, dict(lanes=8)),
      ("one_symbol", np.full((1, 16, 5), 3, np.uint8), None, {}),
      ("uniform_256", rng.integers(0, 256, (1, 16, 8)).astype(np.uint8), None, dict(lanes=4)),
      ("skewed", skew.astype(np.uint8), None, dict(lanes=4)),
      ("ragged_lanes_5", laplace_symbols(1, (2, 20, 13), 1.0), ragged, dict(lanes=5)),
      ("empty", laplace_symbols(2, (2, 4, 3), 1.0), np.zeros((2, 3), int), {}),
      ("scale_bits_15", laplace_symbols(3, (1, 16, 8), 5.0), None,
       dict(scale_bits=15, lanes=8)),
      ("alphabet_16bit", rng.integers(0, 5000, (1, 12, 6)).astype(np.uint16), None,
       dict(scale_bits=13, lanes=8)),
      # The same 16-bit alphabet (65,536 symbols in the tables) at scale 9: the kernel's
      # compare-and-count tables (slots x alphabet) 16x smaller than at scale 13.
      ("alphabet_16bit_small", rng.integers(0, 300, (1, 12, 6)).astype(np.uint16), None,
       dict(scale_bits=9, lanes=8)),
      # A full TPU row (128 lanes, up to 128 words a step: two word rows) and 9 blocks (two
      # programs of 8 rows).
      ("lanes_128", laplace_symbols(4, (3, 12, 300), 30.0), None, dict(lanes=128)),
      # Format version 2's segments: streams of 20 cut into lanes of at most 6 steps (4 lanes
      # each, the last of 2), ragged and empty streams; and version 1's bytes (a lane each).
      ("segments_ragged", laplace_symbols(1, (2, 20, 13), 1.0), ragged,
       dict(lanes=8, lane_steps=6)),
      ("version_1", laplace_symbols(5, (2, 24, 16), 2.0), None, dict(lanes=8, version=1)),
  ]


# Cases that run only under `-m slow`, in both modes (each a compile of its own): their paths are
# the default cases' (a full alphabet, a skewed one: other frequencies through the same tables;
# alphabet_16bit: the 16-bit path of alphabet_16bit_small at scale 13).
SLOW_CASES = ("uniform_256", "skewed", "alphabet_16bit")


def modes_x(rest, slow=False):
  return [dict(m, testcase_name=f"{m['testcase_name']}_{name}", symbols=s, lengths=l, kwargs=k)
          for m in MODES for name, s, l, k in rest
          if (name in SLOW_CASES) == slow]


class RansDecodeTest(parameterized.TestCase):

  @parameterized.named_parameters(*modes_x(cases()))
  def test_matches_numpy_encoder_and_decoder(self, use_pallas, symbols, lengths, kwargs):
    self._check_matches_numpy_encoder_and_decoder(use_pallas, symbols, lengths, kwargs)

  @parameterized.named_parameters(*modes_x(cases(), slow=True))
  @pytest.mark.slow
  def test_matches_numpy_encoder_and_decoder_slow(self, use_pallas, symbols, lengths, kwargs):
    self._check_matches_numpy_encoder_and_decoder(use_pallas, symbols, lengths, kwargs)

  def _check_matches_numpy_encoder_and_decoder(self, use_pallas, symbols, lengths, kwargs):
    arrays = rans.parse(rans.encode(symbols, lengths, **kwargs))
    want = rans.decode_arrays(arrays)
    got, ok = decode(arrays, use_pallas)
    self.assertEqual(got.dtype, jnp.int32)
    self.assertEqual(got.shape, symbols.shape)
    np.testing.assert_array_equal(np.asarray(got), want)
    self.assertTrue(bool(ok))

  @parameterized.named_parameters(*MODES)
  def test_hand_computed(self, use_pallas):
    # Two symbols at 2048 / 4096 each: states (65536 // 2048) << 12 + c, no words.
    arrays = rans.parse(rans.encode(np.array([[[1, 0]]], np.uint8), lanes=2))
    np.testing.assert_array_equal(arrays.states, [[[133120, 131072]]])
    got, ok = decode(arrays, use_pallas)
    np.testing.assert_array_equal(np.asarray(got), [[[1, 0]]])
    self.assertTrue(bool(ok))

  @parameterized.named_parameters(*MODES)
  def test_garbage_in_padding_is_never_read(self, use_pallas):
    symbols = laplace_symbols(5, (2, 24, 10), 3.0)
    arrays = rans.parse(rans.encode(symbols, lanes=4), words_per_block=300)
    words = arrays.words.copy()
    cols = np.arange(words.shape[2])[None, None, :]
    pad = cols >= arrays.num_words[..., None]
    words[pad] = np.random.default_rng(0).integers(0, 1 << 16, int(pad.sum()))
    got, ok = decode(arrays._replace(words=words), use_pallas)
    np.testing.assert_array_equal(np.asarray(got), symbols)
    self.assertTrue(bool(ok))

  @parameterized.named_parameters(*MODES)
  def test_forged_words_are_not_ok(self, use_pallas):
    arrays = rans.parse(rans.encode(laplace_symbols(6, (1, 24, 8), 3.0), lanes=8))
    words = arrays.words.copy()
    words[0, 0, 3] ^= 0x0100
    _, ok = decode(arrays._replace(words=words), use_pallas)
    self.assertFalse(bool(ok))
    fewer = arrays.num_words - 1
    _, ok = decode(arrays._replace(num_words=fewer), use_pallas)
    self.assertFalse(bool(ok))

  @parameterized.named_parameters(*MODES)
  def test_device_arrays_and_uint32_words(self, use_pallas):
    symbols = laplace_symbols(7, (1, 16, 8), 2.0)
    arrays = rans.parse(rans.encode(symbols, lanes=8))
    dev = arrays._replace(**{k: jnp.asarray(v) for k, v in arrays._asdict().items()
                             if isinstance(v, np.ndarray)})
    got, ok = decode(dev._replace(words=dev.words.astype(jnp.uint32)), use_pallas)
    np.testing.assert_array_equal(np.asarray(got), symbols)
    self.assertTrue(bool(ok))

  def test_decode_tables(self):
    freqs = np.zeros((2, 5), np.int32)
    freqs[0, [1, 3]] = [100, 156]
    freqs[1, 4] = 256
    sym, fb = rd.decode_tables(jnp.asarray(freqs), 8)
    sym, fb = np.asarray(sym), np.asarray(fb)
    np.testing.assert_array_equal(sym[0], [1] * 100 + [3] * 156)
    np.testing.assert_array_equal(fb[0] & 0xFFFF, [100] * 100 + [156] * 156)
    np.testing.assert_array_equal(fb[0] >> 16, list(range(100)) + list(range(156)))
    np.testing.assert_array_equal(sym[1], [4] * 256)
    np.testing.assert_array_equal(fb[1] >> 16, np.arange(256))
    want = rans.decode_tables(freqs, 8)
    np.testing.assert_array_equal(sym, want[0])
    np.testing.assert_array_equal(fb & 0xFFFF, want[1])
    np.testing.assert_array_equal(fb >> 16, want[2])
    # The TPU kernel's compare-and-count tables: the same, as int32.
    sym_t, fb_t = rd.tpu_tables(jnp.asarray(freqs), 8)
    self.assertEqual((sym_t.dtype, fb_t.dtype), (jnp.int32, jnp.int32))
    np.testing.assert_array_equal(np.asarray(sym_t), sym)
    np.testing.assert_array_equal(np.asarray(fb_t), fb.astype(np.int32))
    # Zero frequencies between and after present symbols, at scale 15.
    freqs = np.zeros((1, 300), np.int32)
    freqs[0, [0, 7, 8, 250]] = [1, 30000, 2000, 767]
    sym_t, fb_t = rd.tpu_tables(jnp.asarray(freqs), 15)
    want = rans.decode_tables(freqs, 15)
    np.testing.assert_array_equal(np.asarray(sym_t), want[0])
    np.testing.assert_array_equal(np.asarray(fb_t) & 0xFFFF, want[1])
    np.testing.assert_array_equal(np.asarray(fb_t) >> 16, want[2])

  def test_bad_arguments(self):
    arrays = rans.parse(rans.encode(laplace_symbols(8, (1, 4, 4), 1.0), lanes=4))
    kw = arrays._asdict()
    for change, pattern in [
        (dict(scale_bits=16), "scale_bits"),
        (dict(num_streams=5), "num_streams"),
        (dict(num_steps=-1), "num_steps"),
        (dict(segments=0), "segments"),
        (dict(segments=5), "segments"),            # more segments than the 4 steps
        (dict(segments=2), "num_streams"),         # 4 streams x 2 lanes do not fit 4 lanes
        (dict(states=arrays.states.astype(np.int32)), "uint32"),
        (dict(words=arrays.words[0]), "words has shape"),
        (dict(lengths=arrays.lengths[:, :, :2]), "lengths has shape"),
        (dict(freqs=arrays.freqs.astype(np.float32)), "integer"),
    ]:
      with self.subTest(pattern):
        with self.assertRaisesRegex(ValueError, pattern):
          rd.rans_decode_reference(**dict(kw, **change))
    if jax.default_backend() == "cpu":
      with self.assertRaisesRegex(ValueError, "GPU or TPU"):
        rd.rans_decode(**kw)
    wide = rans.parse(rans.encode(laplace_symbols(9, (1, 2, 130), 1.0), lanes=130))
    with self.assertRaisesRegex(ValueError, "at most 128 lanes"):
      rd.rans_decode(**wide._asdict(), interpret=True, platform="tpu")
    # Blocks over the VMEM it asks for (traced only: nothing is allocated).
    sds = jax.ShapeDtypeStruct
    with self.assertRaisesRegex(ValueError, "MiB of VMEM"):
      jax.eval_shape(lambda *a: rd.rans_decode(*a, scale_bits=12, num_streams=128,
                                               num_steps=512, platform="tpu"),
                     sds((1, 1, 1 << 22), jnp.uint16), sds((1, 1, 128), jnp.uint32),
                     sds((1, 1, 128), jnp.int32), sds((1, 1), jnp.int32),
                     sds((1, 256), jnp.int32))


if __name__ == "__main__":
  absltest.main()
