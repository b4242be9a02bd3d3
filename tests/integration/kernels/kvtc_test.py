"""kvtc (`kvjax.kernels.kvtc`): encode -> stored bytes -> decode, error bounds per level, the
closed-loop inter-layer prediction against a numpy reference, RoPE and the cache write, the
transform identity, and version-1 chunks rejected."""

from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import codecs
from kvjax.kernels import kv_codec as kc
from kvjax.kernels import kvtc
from kvjax.models.loading import kv_calibration
from kvjax.storage.format import codecs as stored
from kvjax.storage.format import entropy
from kvjax.storage.format.types import KVLayout

L, K, H, C = 3, 3, 8, 32
D = K * H
#: The same mixing for every seed (the transform is fitted on one seed, applied to another).
_MIX = np.random.default_rng(100).normal(size=(L, 2, D, D)) * (0.7 ** np.arange(D))[:, None]
_LINK = np.random.default_rng(101).normal(size=(L, 2, 2 * D, D)) / np.sqrt(2 * D)
_MEAN = np.random.default_rng(102).normal(size=(L, 2, 1, D))


def correlated_kv(c, seed):
  """[L, 2, C, K, H] with a few strong directions per (layer, K/V) and each layer partly a
  linear function of the layer before, like real KV."""
  rng = np.random.default_rng(seed)
  x = np.einsum("lacd,lade->lace", rng.normal(size=(L, 2, c, D)), _MIX)
  for l in range(1, L):
    prev = np.concatenate([x[l - 1, 0], x[l - 1, 1]], -1)
    x[l] = 0.4 * x[l] + np.einsum("cf,afd->acd", prev, _LINK[l])
  return (x + _MEAN).reshape(L, 2, c, K, H).astype(np.float32)


def fit(kv, sensitivity):
  return kv_calibration.fit_transform(kv.reshape(L, 2, -1, D), sensitivity, K, H)


def reference_codes(kv, t, level, codes=None, rounding=kvtc.KVTC_ROUNDING,
                    offset=kvtc.KVTC_RECON_OFFSET, start=0):
  """numpy float64 of the module docstring's closed loop: (q, x̂); decodes `codes` if given."""
  x = kv.reshape(L, 2, -1, D).astype(np.float64) - t.mean[:, :, None]
  protect = start + np.arange(x.shape[2]) < kvtc.KVTC_PROTECT_TOKENS
  row = np.where(protect, kvtc.KVTC_PROTECT_STEP, 1.0)[:, None]          # [C, 1]
  step = t.steps(level).astype(np.float64)[:, :, None, None] * row       # [L, 2, C, 1]
  q, r = np.zeros(x.shape), np.zeros(x.shape)
  if codes is not None:
    q[...] = codes
  for l in range(L):
    prev = [r[l - j, a] if l >= j else np.zeros_like(x[0, 0]) for j in (1, 2) for a in (0, 1)]
    for a in range(2):
      f = np.concatenate(prev + [r[l, 0] if a else np.zeros_like(x[0, 0])], -1)
      p = f @ t.predictor[l, a]
      if codes is None:
        y = (x[l, a] - p) @ t.basis[l, a] / step[l, a]
        q[l, a] = np.clip(np.sign(y) * np.floor(np.abs(y) + rounding), -kvtc.KVTC_QMAX,
                          kvtc.KVTC_QMAX)
      y_hat = np.sign(q[l, a]) * np.maximum(np.abs(q[l, a]) - offset, 0) * step[l, a]
      r[l, a] = p + y_hat @ t.synthesis[l, a]
  return q, (r + t.mean[:, :, None]).reshape(kv.shape)


SENS = np.array([[0.5, 10.0], [1.0, 20.0], [2.0, 30.0]])  # V more sensitive than K (SmolLM2)
VERSION = codecs.CODEC_VERSIONS["kvtc"]
#: Largest coefficient error in steps: |y| - (q - offset) lies in [offset - rounding,
#: 1 - rounding + offset) for q != 0, and |y| < 1 - rounding for q = 0.
MAX_ERR = 1 - kvtc.KVTC_ROUNDING + kvtc.KVTC_RECON_OFFSET


class KVTCTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.t = fit(correlated_kv(512, seed=0), SENS)
    cls.kv = correlated_kv(C, seed=1)
    cls.layout = KVLayout(L, C, K, H, "float32")

  # Levels change the step sizes only: the default run keeps level 0 (the widest alphabets),
  # the default level 1 and the coarsest, 4; levels 2 and 3 are `slow`.
  @parameterized.parameters(0, 1, 4)
  def test_bytes_round_trip_and_decode_into_the_cache(self, level):
    self._check_bytes_round_trip_and_decode_into_the_cache(level)

  @parameterized.parameters(2, 3)
  @pytest.mark.slow
  def test_bytes_round_trip_and_decode_into_the_cache_slow(self, level):
    self._check_bytes_round_trip_and_decode_into_the_cache(level)

  def _check_bytes_round_trip_and_decode_into_the_cache(self, level):
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, level, start=2)
    self.assertEqual({n: (a.dtype, a.shape) for n, a in arrays.items()},
                     stored.payload_spec("kvtc", VERSION, level, self.layout))
    blob = stored.encode_payload("kvtc", level, arrays, self.layout)
    # Every level codes as rans-bands, this tiny chunk's level 0 too: its wide alphabets' rANS
    # tables (12,470 bytes with rANS format version 1 for 9,216 plain bytes, stored plain then)
    # are one zstd frame in version 2 (4,199 bytes in all).
    self.assertEqual([e.coding for e in stored.read_header(blob).arrays][0],
                     stored.KVTC_Q_CODING)
    back = stored.decode_payload("kvtc", VERSION, level, blob, self.layout)
    for name, a in arrays.items():
      np.testing.assert_array_equal(back[name], a, err_msg=name)
    self.assertEqual(bytes(back["transform_id"]), self.t.transform_id)
    payload = kvtc.payload_from_arrays(back)
    ref = np.asarray(kvtc.dequantize_reference(payload, self.t, K, H, start=2))
    cache = jnp.full((L, 2, C + 3, K, H), jnp.nan, jnp.float32)
    k, v = kvtc.kvtc_decode(payload, self.t.device_arrays(), cache, cache.copy(), 1, 2,
                            jnp.ones((C, H)), jnp.zeros((C, H)))
    np.testing.assert_allclose(np.asarray(k)[:, 1, 2:2 + C], ref[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v)[:, 1, 2:2 + C], ref[:, 1], rtol=1e-5, atol=1e-5)
    self.assertTrue(np.isnan(np.asarray(k)[:, 0]).all())
    self.assertTrue(np.isnan(np.asarray(v)[:, 1, :2]).all())

  def test_error_bounds_per_level(self):
    errs = []
    # A chunk past the protected first tokens (they have their own test below).
    for level in codecs.CODEC_LEVELS["kvtc"]:
      arrays = kvtc.kvtc_encode_host(self.kv, self.t, level, start=C)
      step = self.t.steps(level)
      np.testing.assert_array_equal(arrays["step"], step)
      x_hat = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), self.t, K,
                                                   H, start=C))
      err = (x_hat - self.kv).reshape(L, 2, C, D)
      # Orthonormal basis: per token, ||error|| <= sqrt(D) * step * E (no clipping), E the
      # largest coefficient error in steps (1/2 for rounding to nearest).
      bound = np.sqrt(D) * step[:, :, None] * MAX_ERR * (1 + 1e-4) + 1e-5
      self.assertTrue((np.linalg.norm(err, axis=-1) <= bound).all(), level)
      errs.append(float(np.linalg.norm(err) / np.linalg.norm(self.kv)))
    self.assertEqual(errs, sorted(errs))
    self.assertLess(errs[0], 0.05)
    # Steps follow the sensitivity: step ~ 1 / sqrt(s), so V (20x) is sqrt(20) finer than K.
    s1 = self.t.steps(1)
    np.testing.assert_allclose(s1[1, 0] / s1[1, 1], np.sqrt(20.0), rtol=1e-5)
    np.testing.assert_allclose(
        s1, np.sqrt(12 * kvtc.KVTC_LEVEL_KL[1] / (2 * L * SENS)), rtol=1e-5)

  @parameterized.parameters(0, 3)
  def test_closed_loop_prediction_matches_the_numpy_reference(self, level):
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, level, start=C)
    q_ref, x_ref = reference_codes(self.kv, self.t, level, start=C)
    # f32 vs f64 may round a code that sits on a .5 boundary the other way: at most a few.
    diff = arrays["q"].astype(np.float64) - q_ref
    self.assertLessEqual(np.abs(diff).max(), 1)
    self.assertLess(np.count_nonzero(diff), 0.002 * diff.size + 2)
    # Decoding the stored codes: the decoder predicts from the layers it decoded.
    x_hat = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), self.t, K, H,
                                                 start=C))
    _, x_dec = reference_codes(self.kv, self.t, level, codes=arrays["q"], start=C)
    np.testing.assert_allclose(x_hat, x_dec, rtol=1e-4, atol=1e-4)
    if not diff.any():
      np.testing.assert_allclose(x_hat, x_ref, rtol=1e-4, atol=1e-4)

  # Sizes of the tiny test model's chunks are compared under pcodec: rANS tables cost more than
  # such small chunks save, so "rans-bands" falls back to plain bytes for all of them.
  @mock.patch.object(stored, "KVTC_Q_CODING", "pco-bands")
  def test_prediction_saves_bytes_at_the_same_steps(self):
    t0 = kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance, self.t.sensitivity,
                            np.zeros_like(self.t.predictor), K, H)
    flat = kv_calibration.fit_transform(correlated_kv(512, seed=0).reshape(L, 2, -1, D), SENS,
                                        K, H, predict=False)
    np.testing.assert_array_equal(flat.predictor, 0)
    sizes = {}
    for name, t in (("predicted", self.t), ("flat", flat)):
      arrays = kvtc.kvtc_encode_host(self.kv, t, 1, start=0)
      sizes[name] = len(stored.encode_payload("kvtc", 1, arrays, self.layout))
      err = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), t, K, H,
                                                 start=0)) - self.kv
      bound = np.sqrt(D) * t.steps(1)[:, :, None] * MAX_ERR * (1 + 1e-4) + 1e-5
      self.assertTrue((np.linalg.norm(err.reshape(L, 2, C, D), axis=-1) <= bound).all(), name)
    self.assertLess(sizes["predicted"], 0.9 * sizes["flat"])
    self.assertNotEqual(t0.transform_id, self.t.transform_id)
    np.testing.assert_array_equal(self.t.predictor[0, 0], 0)   # layer 0's K has nothing before
    self.assertTrue(self.t.predictor[0, 1, 4 * D:].any())     # layer 0's V sees its own K

  @parameterized.parameters((0.5, 0.0), (0.3, 0.15), (kvtc.KVTC_ROUNDING, kvtc.KVTC_RECON_OFFSET))
  def test_deadzone_rounding_matches_the_numpy_reference(self, rounding, offset):
    step = self.t.steps(1)
    q, x_hat = kvtc.experiment_round_trip(jnp.asarray(self.kv), self.t.device_arrays(),
                                          jnp.asarray(step), rounding=rounding, offset=offset)
    q_ref, x_ref = reference_codes(self.kv, self.t, 1, rounding=rounding, offset=offset)
    diff = np.asarray(q, np.float64) - q_ref
    self.assertLessEqual(np.abs(diff).max(), 1)
    self.assertLess(np.count_nonzero(diff), 0.002 * diff.size + 2)
    if not diff.any():
      np.testing.assert_allclose(np.asarray(x_hat), x_ref, rtol=1e-4, atol=1e-4)
    # The shipped encoder is this rule at the module's constants.
    if (rounding, offset) == (kvtc.KVTC_ROUNDING, kvtc.KVTC_RECON_OFFSET):
      np.testing.assert_array_equal(kvtc.kvtc_encode_host(self.kv, self.t, 1, start=0)["q"],
                                    np.asarray(q))

  # Sizes of the tiny test model's chunks are compared under pcodec: rANS tables cost more than
  # such small chunks save, so "rans-bands" falls back to plain bytes for all of them.
  @mock.patch.object(stored, "KVTC_Q_CODING", "pco-bands")
  def test_deadzone_codes_are_smaller_than_rounded_ones(self):
    self.assertLess(kvtc.KVTC_ROUNDING, 0.5)
    step, dt = jnp.asarray(self.t.steps(2)), self.t.device_arrays()
    kv = jnp.asarray(self.kv)
    q_dz, _ = kvtc.experiment_round_trip(kv, dt, step, rounding=kvtc.KVTC_ROUNDING,
                                         offset=kvtc.KVTC_RECON_OFFSET)
    q_rn, _ = kvtc.experiment_round_trip(kv, dt, step, rounding=0.5, offset=0.0)
    q_dz, q_rn = np.asarray(q_dz), np.asarray(q_rn)
    self.assertGreater(np.count_nonzero(q_dz == 0), np.count_nonzero(q_rn == 0))
    dz = stored.encode_payload("kvtc", 2, kvtc.kvtc_encode_host(self.kv, self.t, 2, start=0),
                               self.layout)
    rn = {"q": q_rn, "step": np.asarray(step), "transform_id": np.frombuffer(
        self.t.transform_id, np.uint8)}
    self.assertLess(len(dz), len(stored.encode_payload("kvtc", 2, rn, self.layout)))

  # Sizes of the tiny test model's chunks are compared under pcodec: rANS tables cost more than
  # such small chunks save, so "rans-bands" falls back to plain bytes for all of them.
  @mock.patch.object(stored, "KVTC_Q_CODING", "pco-bands")
  def test_protected_first_tokens(self):
    # The same chunk at position 0 and at position C: the first KVTC_PROTECT_TOKENS tokens of a
    # sequence are coded at KVTC_PROTECT_STEP x the step, the other tokens alike.
    n = kvtc.KVTC_PROTECT_TOKENS
    first = kvtc.kvtc_encode_host(self.kv, self.t, 2, start=0)
    later = kvtc.kvtc_encode_host(self.kv, self.t, 2, start=C)
    x0 = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(first), self.t, K, H,
                                              start=0))
    x1 = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(later), self.t, K, H,
                                              start=C))
    err0 = np.square(x0 - self.kv).mean(axis=(0, 1, 3, 4))               # per token
    err1 = np.square(x1 - self.kv).mean(axis=(0, 1, 3, 4))
    self.assertLess(err0[:n].max(), 0.05 * err1[:n].min())
    # Tokens are coded independently of each other (the scan runs over layers per token).
    np.testing.assert_array_equal(first["q"][:, :, n:], later["q"][:, :, n:])
    self.assertGreater(np.abs(first["q"][:, :, :n]).sum(), 8 * np.abs(later["q"][:, :, :n]).sum())
    q_ref, x_ref = reference_codes(self.kv, self.t, 2, start=0)
    diff = first["q"].astype(np.float64) - q_ref
    self.assertLessEqual(np.abs(diff).max(), 1)
    # Decoded at the wrong position, the first tokens come out 64x too large: the decoder must
    # be given the encoder's start.
    wrong = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(first), self.t, K, H,
                                                 start=C))
    self.assertGreater(np.square(wrong - self.kv)[:, :, :n].mean(), 10 * err1[:n].mean())
    # A chunk at position 2 protects its first n - 2 tokens only.
    mid = kvtc.kvtc_encode_host(self.kv, self.t, 2, start=2)
    q_mid, _ = reference_codes(self.kv, self.t, 2, start=2)
    self.assertLessEqual(np.abs(mid["q"] - q_mid).max(), 1)
    # Cost: a few protected tokens of a chunk of C.
    b0 = len(stored.encode_payload("kvtc", 2, first, self.layout))
    b1 = len(stored.encode_payload("kvtc", 2, later, self.layout))
    self.assertGreater(b0, b1)
    self.assertLess(b0, 1.5 * b1)

  def test_older_versions_are_unknown(self):
    # Version 1 (no prediction), 2 (rounding to nearest, another level ladder), 3 (another
    # level ladder) and 4 (isotropic steps per layer, another ladder) chunks are misses to the
    # storage reader, recomputed; a v2 header is refused before any decoding.
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, 0, start=0)
    blob = stored.encode_payload("kvtc", 0, arrays, self.layout)
    self.assertEqual(stored.read_header(blob).version, VERSION)
    self.assertEqual(VERSION, 5)
    for old in (1, 2, 3, 4):
      with self.assertRaises(stored.UnknownCodec):
        stored.decode_payload("kvtc", old, 0, blob, self.layout)
      self.assertFalse(stored.is_decodable("kvtc", old, 0))
    v2 = bytearray(blob)
    at = blob.index(b"kvtc") + 4
    self.assertEqual(v2[at:at + 2], VERSION.to_bytes(2, "little"))
    v2[at:at + 2] = (2).to_bytes(2, "little")
    with self.assertRaises((stored.UnknownCodec, stored.CorruptPayload)):
      stored.decode_payload("kvtc", VERSION, 0, bytes(v2), self.layout)

  def test_whitened_transform_puts_the_error_where_the_metric_is_small(self):
    # A metric that weighs the first half of every (layer, K/V)'s channels 100x: the fit whitens
    # by it (analysis W V, synthesis V^T W^-1, exact inverses), the closed loop matches the numpy
    # reference, the error in the metric's norm is within the uniform step's bound, and the heavy
    # channels get far less error per channel than the light ones.
    w = np.where(np.arange(D) < D // 2, 100.0, 1.0)
    metric = np.broadcast_to(np.diag(w), (L, 2, D, D)).copy()
    t = kv_calibration.fit_transform(correlated_kv(512, seed=0).reshape(L, 2, -1, D), None, K,
                                     H, metric=metric, eps=0.0)
    np.testing.assert_array_equal(t.sensitivity, D)
    eye = np.einsum("lade,laef->ladf", t.basis, t.synthesis)
    np.testing.assert_allclose(eye, np.broadcast_to(np.eye(D), eye.shape), atol=1e-4)
    level = 2
    arrays = kvtc.kvtc_encode_host(self.kv, t, level, start=C)
    x_hat = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), t, K, H,
                                                 start=C))
    _, x_dec = reference_codes(self.kv, t, level, codes=arrays["q"], start=C)
    np.testing.assert_allclose(x_hat, x_dec, rtol=1e-4, atol=1e-4)
    err = (x_hat - self.kv).reshape(L, 2, C, D)
    weighted = np.sqrt(np.einsum("lacd,d,lacd->lac", err, w, err))
    bound = np.sqrt(D) * t.steps(level)[:, :, None] * MAX_ERR * (1 + 1e-4) + 1e-5
    self.assertTrue((weighted <= bound).all())
    rms = np.sqrt(np.mean(err ** 2, axis=(0, 1, 2)))
    self.assertLess(rms[:D // 2].mean() * 3, rms[D // 2:].mean())

  def test_rope_at_the_positions(self):
    arrays = kvtc.kvtc_encode_host(self.kv, self.t, 0, start=5)
    payload = kvtc.payload_from_arrays(arrays)
    angles = (5 + np.arange(C))[:, None] * (1.0 / 10000 ** (np.arange(H // 2) / (H // 2)))
    angles = np.concatenate([angles, angles], -1)
    cache = jnp.zeros((L, 1, C + 5, K, H), jnp.float32)
    k, _ = kvtc.kvtc_decode(payload, self.t.device_arrays(), cache, cache.copy(), 0, 5,
                            np.cos(angles), np.sin(angles))
    x = np.asarray(kvtc.dequantize_reference(payload, self.t, K, H, start=5))[:, 0]
    rot = np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1)
    want = x * np.cos(angles)[:, None] + rot * np.sin(angles)[:, None]
    np.testing.assert_allclose(np.asarray(k)[:, 0, 5:], want, rtol=1e-5, atol=1e-5)

  def test_the_transform_identity(self):
    other = kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance,
                               self.t.sensitivity * 2, self.t.predictor, K, H)
    same = kvtc.KVTCTransform(self.t.mean.copy(), self.t.basis.copy(), self.t.variance.copy(),
                              self.t.sensitivity.copy(), self.t.predictor.copy(), K, H)
    self.assertLen(self.t.transform_id, 16)
    self.assertEqual(same.transform_id, self.t.transform_id)
    self.assertNotEqual(other.transform_id, self.t.transform_id)
    payload = kvtc.payload_from_arrays(kvtc.kvtc_encode_host(self.kv, self.t, 1, start=0))
    cache = jnp.zeros((L, 1, C, K, H), jnp.float32)
    with self.assertRaisesRegex(ValueError, "another transform"):
      kvtc.kvtc_decode(payload, other.device_arrays(), cache, cache.copy(), 0, 0,
                       jnp.ones((C, H)), jnp.zeros((C, H)))

  def test_bad_inputs_raise(self):
    with self.assertRaisesRegex(ValueError, "levels"):
      kvtc.kvtc_encode(self.kv, self.t, 5, start=0)
    with self.assertRaisesRegex(ValueError, "K \\* H"):
      kvtc.kvtc_encode(self.kv[:, :, :, :2], self.t, 0, start=0)
    with self.assertRaisesRegex(ValueError, "start"):
      kvtc.kvtc_encode(self.kv, self.t, 0, start=-1)
    with self.assertRaisesRegex(ValueError, "NaN"):
      kvtc.kvtc_encode_host(np.full_like(self.kv, np.nan), self.t, 0, start=0)
    with self.assertRaisesRegex(ValueError, "needs arrays"):
      kvtc.payload_from_arrays({"q": np.zeros((L, 2, C, D), np.int16)})
    with self.assertRaisesRegex(ValueError, "sensitivity"):
      kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance, self.t.sensitivity * 0,
                         self.t.predictor, K, H)
    with self.assertRaisesRegex(ValueError, "predictor"):
      kvtc.KVTCTransform(self.t.mean, self.t.basis, self.t.variance, self.t.sensitivity,
                         self.t.predictor[:, :, :D], K, H)
    payload = kvtc.payload_from_arrays(kvtc.kvtc_encode_host(self.kv, self.t, 0, start=0))
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
