"""kvtc (`kvjax.kernels.kvtc`): encode -> stored bytes -> decode, error bounds per level, RoPE and
the cache write, and the transform identity."""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from kvjax import codecs
from kvjax.kernels import kv_codec as kc
from kvjax.kernels import kvtc
from kvjax.storage import codecs as stored
from kvjax.storage import entropy
from kvjax.storage.types import KVLayout

L, K, H, C = 2, 3, 8, 32
D = K * H


def correlated_kv(c, seed):
  """[L, 2, C, K, H] with a few strong directions per (layer, K/V), like real KV."""
  rng = np.random.default_rng(seed)
  mix = rng.normal(size=(L, 2, D, D)) * (0.7 ** np.arange(D))[:, None]
  z = rng.normal(size=(L, 2, c, D))
  x = np.einsum("lacd,lade->lace", z, mix) + rng.normal(size=(L, 2, 1, D))
  return x.reshape(L, 2, c, K, H).astype(np.float32)


def fit(kv, sensitivity):
  x = kv.reshape(L, 2, -1, D).astype(np.float64)
  mean = x.mean(axis=2)
  basis, var = np.empty((L, 2, D, D)), np.empty((L, 2, D))
  for l in range(L):
    for a in range(2):
      w, v = np.linalg.eigh(np.cov(x[l, a].T, bias=True))
      order = np.argsort(-w)
      basis[l, a], var[l, a] = v[:, order], np.maximum(w[order], 0)
  return kvtc.KVTCTransform(mean.astype(np.float32), basis.astype(np.float32),
                            var.astype(np.float32), np.asarray(sensitivity, np.float32), K, H)


SENS = np.array([[0.5, 10.0], [1.0, 20.0]])  # V more sensitive than K, as on SmolLM2


class KVTCTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.t = fit(correlated_kv(512, seed=0), SENS)
    cls.kv = correlated_kv(C, seed=1)
    cls.layout = KVLayout(L, C, K, H, "float32")

  @parameterized.parameters(0, 1, 2, 3)
  def test_bytes_round_trip_and_decode_into_the_cache(self, level):
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, level)
    self.assertEqual({n: (a.dtype, a.shape) for n, a in arrays.items()},
                     stored.payload_spec("kvtc", 1, level, self.layout))
    blob = stored.encode_payload("kvtc", level, arrays, self.layout)
    self.assertEqual([e.coding for e in stored.read_header(blob).arrays][0], "pco-bands")
    back = stored.decode_payload("kvtc", 1, level, blob, self.layout)
    for name, a in arrays.items():
      np.testing.assert_array_equal(back[name], a, err_msg=name)
    self.assertEqual(bytes(back["transform_id"]), self.t.transform_id)
    payload = kvtc.payload_from_arrays(back)
    ref = np.asarray(kvtc.dequantize_reference(payload, self.t, K, H))
    cache = jnp.full((L, 2, C + 3, K, H), jnp.nan, jnp.float32)
    k, v = kvtc.kvtc_decode(payload, self.t.device_arrays(), cache, cache.copy(), 1, 2,
                            jnp.ones((C, H)), jnp.zeros((C, H)))
    np.testing.assert_allclose(np.asarray(k)[:, 1, 2:2 + C], ref[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v)[:, 1, 2:2 + C], ref[:, 1], rtol=1e-5, atol=1e-5)
    self.assertTrue(np.isnan(np.asarray(k)[:, 0]).all())
    self.assertTrue(np.isnan(np.asarray(v)[:, 1, :2]).all())

  def test_error_bounds_per_level(self):
    errs = []
    for level in codecs.CODEC_LEVELS["kvtc"]:
      arrays = kvtc.kvtc_encode_host(self.kv, self.t, level)
      step = self.t.steps(level)
      np.testing.assert_array_equal(arrays["step"], step)
      x_hat = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), self.t, K,
                                                   H))
      err = (x_hat - self.kv).reshape(L, 2, C, D)
      # Orthonormal basis: per token, ||error|| <= sqrt(D) * step / 2 (rounding, no clipping).
      bound = np.sqrt(D) * step[:, :, None] / 2 * (1 + 1e-4) + 1e-5
      self.assertTrue((np.linalg.norm(err, axis=-1) <= bound).all(), level)
      errs.append(float(np.linalg.norm(err) / np.linalg.norm(self.kv)))
    self.assertEqual(errs, sorted(errs))
    self.assertLess(errs[0], 0.05)
    # Steps follow the sensitivity: step ~ 1 / sqrt(s), so V (20x) is sqrt(20) finer than K.
    s1 = self.t.steps(1)
    np.testing.assert_allclose(s1[1, 0] / s1[1, 1], np.sqrt(20.0), rtol=1e-5)
    np.testing.assert_allclose(
        s1, np.sqrt(12 * kvtc.KVTC_LEVEL_KL[1] / (2 * L * SENS)), rtol=1e-5)

  def test_rope_at_the_positions(self):
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, 0)
    payload = kvtc.payload_from_arrays(arrays)
    angles = (5 + np.arange(C))[:, None] * (1.0 / 10000 ** (np.arange(H // 2) / (H // 2)))
    angles = np.concatenate([angles, angles], -1)
    cache = jnp.zeros((L, 1, C + 5, K, H), jnp.float32)
    k, _ = kvtc.kvtc_decode(payload, self.t.device_arrays(), cache, cache.copy(), 0, 5,
                            np.cos(angles), np.sin(angles))
    x = np.asarray(kvtc.dequantize_reference(payload, self.t, K, H))[:, 0]
    rot = np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1)
    want = x * np.cos(angles)[:, None] + rot * np.sin(angles)[:, None]
    np.testing.assert_allclose(np.asarray(k)[:, 0, 5:], want, rtol=1e-5, atol=1e-5)

  def test_the_transform_identity(self):
    other = kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance,
                               self.t.sensitivity * 2, K, H)
    same = kvtc.KVTCTransform(self.t.mean.copy(), self.t.basis.copy(), self.t.variance.copy(),
                              self.t.sensitivity.copy(), K, H)
    self.assertLen(self.t.transform_id, 16)
    self.assertEqual(same.transform_id, self.t.transform_id)
    self.assertNotEqual(other.transform_id, self.t.transform_id)
    payload = kvtc.payload_from_arrays(kvtc.kvtc_encode_host(self.kv, self.t, 1))
    cache = jnp.zeros((L, 1, C, K, H), jnp.float32)
    with self.assertRaisesRegex(ValueError, "another transform"):
      kvtc.kvtc_decode(payload, other.device_arrays(), cache, cache.copy(), 0, 0,
                       jnp.ones((C, H)), jnp.zeros((C, H)))

  def test_bad_inputs_raise(self):
    with self.assertRaisesRegex(ValueError, "levels"):
      kvtc.kvtc_encode(self.kv, self.t, 4)
    with self.assertRaisesRegex(ValueError, "K \\* H"):
      kvtc.kvtc_encode(self.kv[:, :, :, :2], self.t, 0)
    with self.assertRaisesRegex(ValueError, "NaN"):
      kvtc.kvtc_encode_host(np.full_like(self.kv, np.nan), self.t, 0)
    with self.assertRaisesRegex(ValueError, "needs arrays"):
      kvtc.payload_from_arrays({"q": np.zeros((L, 2, C, D), np.int16)})
    with self.assertRaisesRegex(ValueError, "sensitivity"):
      kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance, self.t.sensitivity * 0, K, H)
    payload = kvtc.payload_from_arrays(kvtc.kvtc_encode_host(self.kv, self.t, 0))
    cache = jnp.zeros((L, 1, C, K, H), jnp.float32)
    with self.assertRaisesRegex(ValueError, "Pallas"):
      kvtc.kvtc_decode(payload, self.t.device_arrays(), cache, cache.copy(), 0, 0,
                       jnp.ones((C, H)), jnp.zeros((C, H)), use_pallas=True)

  def test_entropy_bands_round_trip_and_damage(self):
    rng = np.random.default_rng(3)
    q = (rng.normal(size=(L, 2, C, D)) * np.geomspace(300, 0.1, D)).round().astype(np.int16)
    blob = entropy.encode_components(q)
    np.testing.assert_array_equal(entropy.decode_components(blob, q.shape), q)
    with self.assertRaises(entropy.EntropyError):
      entropy.decode_components(blob[:-3], q.shape)
    with self.assertRaises(entropy.EntropyError):
      entropy.decode_components(blob, (L, 2, C, D - 1))
    self.assertLess(len(blob), q.nbytes / 2)


if __name__ == "__main__":
  absltest.main()
