"""kvtc codes decoded on the device from their rANS bands (`kvjax.kernels.kvtc_rans`): the jnp
reference and the Pallas kernel (interpret mode) byte-exact against the numpy host decoder and the
"pco-bands" path, forged streams flagged by `ok`, and bad band layouts rejected."""

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax.kernels import kvtc_rans
from kvjax.storage.format import entropy


def codes(shape, seed=0, top=20.0):
  rng = np.random.default_rng(seed)
  spread = np.geomspace(top, 0.05, shape[3])
  return np.clip(np.rint(rng.laplace(size=shape) * spread), -32767, 32767).astype(np.int16)


def parsed(q, steps=entropy.RANS_STEPS, **kwargs):
  return entropy.parse_components_rans(entropy.encode_components_rans(q, steps=steps, **kwargs),
                                       q.shape)


def inputs(p):
  return kvtc_rans.pack_bands(p.shape, p.bands, p.offsets, p.arrays)


def forge(p):
  """The band with the most words, its first block's words damaged (what the format's checksum
  stops, unless recomputed by a forger)."""
  b = int(np.argmax([int(a.num_words.max()) for a in p.arrays]))
  a = p.arrays[b]
  m, j = np.unravel_index(int(np.argmax(a.num_words)), a.num_words.shape)
  assert a.num_words[m, j] >= 3
  words = a.words.copy()
  words[m, j, :3] ^= 0x3C3C
  return p._replace(arrays=p.arrays[:b] + (a._replace(words=words),) + p.arrays[b + 1:])


class KVTCRansTest(parameterized.TestCase):

  @parameterized.parameters(((3, 2, 32, 24), 512), ((3, 2, 32, 24), 16), ((1, 2, 8, 3), 4),
                            # rANS format version 2's segments (lanes of at most 24 steps of
                            # streams of up to 512), and version 1's bytes.
                            ((3, 2, 32, 24), 512, dict(lane_steps=24)),
                            ((3, 2, 32, 24), 512, dict(version=1)))
  def test_reference_is_byte_exact(self, shape, steps, kwargs=None):
    self._check_reference_is_byte_exact(shape, steps, **(kwargs or {}))

  @pytest.mark.slow
  def test_reference_is_byte_exact_at_a_large_shape(self):
    self._check_reference_is_byte_exact((2, 2, 256, 192), 512)

  def _check_reference_is_byte_exact(self, shape, steps, **kwargs):
    q = codes(shape, seed=shape[3])
    p = parsed(q, steps, **kwargs)
    if "lane_steps" in kwargs:
      self.assertGreater(max(a.segments for a in p.arrays), 1)
    got, ok = kvtc_rans.decode_codes(inputs(p))
    self.assertTrue(bool(ok))
    self.assertEqual(got.dtype, np.int16)
    np.testing.assert_array_equal(np.asarray(got), entropy.decode_rans_codes(p))
    np.testing.assert_array_equal(np.asarray(got), q)
    pco = entropy.decode_components(entropy.encode_components(q), q.shape)
    np.testing.assert_array_equal(np.asarray(got), pco)

  def test_pallas_interpret_is_byte_exact(self):
    q = codes((1, 2, 16, 8), seed=1)
    p = parsed(q, steps=16, lane_steps=6)           # streams of 16 in lanes of 6, 6 and 4
    self.assertEqual({a.segments for a in p.arrays}, {3})
    ref, ok_ref = kvtc_rans.decode_codes(inputs(p))
    got, ok = kvtc_rans.decode_codes(inputs(p), use_pallas=True, interpret=True)
    self.assertTrue(bool(ok) and bool(ok_ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(got), q)
    _, ok_forged = kvtc_rans.decode_codes(inputs(forge(p)), use_pallas=True,
                                          interpret=True)
    self.assertFalse(bool(ok_forged))

  def test_forged_streams_are_flagged(self):
    q = codes((3, 2, 32, 24), seed=2)
    p = forge(parsed(q))
    got, ok = kvtc_rans.decode_codes(inputs(p))
    self.assertFalse(bool(ok))
    with self.assertRaises(entropy.EntropyError):
      entropy.decode_rans_codes(p)
    # A block that claims fewer words than it reads is flagged too.
    a = p.arrays[0]
    short = p._replace(arrays=(a._replace(num_words=a.num_words - 1),) + p.arrays[1:])
    _, ok = kvtc_rans.decode_codes(inputs(short))
    self.assertFalse(bool(ok))
    # So is a damaged initial state (even of a model whose codes are all one value: no words).
    q0 = np.zeros((1, 2, 8, 3), np.int16)
    p0 = parsed(q0)
    self.assertEqual(sum(int(a.num_words.sum()) for a in p0.arrays), 0)
    states = p0.arrays[0].states.copy()
    states[1, 0, 0] += 1
    p0 = p0._replace(arrays=(p0.arrays[0]._replace(states=states),) + p0.arrays[1:])
    got, ok = kvtc_rans.decode_codes(inputs(p0))
    self.assertFalse(bool(ok))

  def test_bad_layouts_raise(self):
    q = codes((3, 2, 32, 24), seed=3)
    p = parsed(q)
    packed = inputs(p)
    bands = packed.bands
    with self.assertRaisesRegex(ValueError, "tile"):
      kvtc_rans.decode_codes(packed._replace(bands=bands[1:]))
    with self.assertRaisesRegex(ValueError, "end at"):
      kvtc_rans.decode_codes(packed._replace(bands=bands[:-1]))
    with self.assertRaisesRegex(ValueError, "cover"):
      kvtc_rans.decode_codes(packed._replace(shape=(3, 2, 16, 24)))
    with self.assertRaisesRegex(ValueError, "shape"):
      kvtc_rans.decode_codes(packed._replace(shape=(3, 1, 32, 24)))
    with self.assertRaisesRegex(ValueError, "bands"):
      kvtc_rans.pack_bands(p.shape, p.bands, p.offsets[:-1], p.arrays)

  def test_shapes_do_not_depend_on_contents(self):
    # Two chunks of one shape with different spreads pack to the same shapes (one compile).
    a = inputs(parsed(codes((3, 2, 32, 24), seed=8, top=4.0)))
    b = inputs(parsed(codes((3, 2, 32, 24), seed=9, top=30.0)))
    shapes = lambda p: [np.shape(x) for band in p.bands for x in band[2:8]]
    self.assertEqual(shapes(a), shapes(b))
    self.assertEqual(a.words.shape, (4096,))
    self.assertEqual([kvtc_rans._bucket(n) for n in (1, 4096, 4097, 5000, 10 ** 6)],
                     [4096, 4096, 4871, 5793, 1048576])


if __name__ == "__main__":
  absltest.main()
