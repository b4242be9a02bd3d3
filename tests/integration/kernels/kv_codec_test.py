"""KV codec kernels: interpret-mode Pallas and the jnp reference against numpy oracles and hand
computed cases; NaN-poisoned caches; bad input; error bounds on synthetic KV."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import codecs
from kvjax.kernels import kv_codec as kc
from kvjax.kernels import kv_codec_ref as kref
from kvjax.kernels import kv_payloads as kp
from kvjax.models.nn import layers

# Both execution paths run every test body: the Pallas kernels (interpret mode on CPU, compiled
# on an accelerator), and the pure-jnp reference path the CPU engine uses.
INTERPRET = jax.default_backend() == "cpu"
MODES = (dict(testcase_name="pallas", use_pallas=True),
         dict(testcase_name="reference", use_pallas=False))
# The codecs whose math lives in kv_codec.py; kvtc needs a calibrated transform and is tested in
# tests/integration/kernels/kvtc_test.py.
KV_CODECS = {c: lv for c, lv in codecs.CODEC_LEVELS.items() if c != codecs.KVTC}
CODEC_LEVELS = [(c, lv) for c in KV_CODECS for lv in KV_CODECS[c]]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Decoded values vs the numpy oracle: f32 allows FMA/ulp differences; bf16 one rounding step.
TOL = {"float32": dict(rtol=2e-6, atol=2e-6), "bfloat16": dict(rtol=2 ** -7, atol=1e-6)}
# Tiny sizes with a non-power-of-two head count (SmolLM2 has K = 3).
L, C, K, H, SLOTS, S_MAX = 3, 32, 3, 8, 2, 48


def modes_x(*rest):
  """MODES crossed with parameter tuples `rest` (each a (name, dict))."""
  out = []
  for m in MODES:
    for name, kw in rest:
      out.append(dict(m, testcase_name=f"{m['testcase_name']}_{name}", **kw))
  return out


def split(cases, is_default):
  """(default cases, slow cases) of named parameter dicts."""
  return ([c for c in cases if is_default(c)], [c for c in cases if not is_default(c)])


# CacheGen's levels change only a constant: the default run keeps its finest and coarsest.
CACHEGEN_EDGE_LEVELS = (0, max(codecs.CODEC_LEVELS["cachegen"]))


def edge_level(case):
  return case["codec"] != "cachegen" or case["level"] in CACHEGEN_EDGE_LEVELS


CODEC_CASES = [(f"{c}{lv}", dict(codec=c, level=lv)) for c, lv in CODEC_LEVELS]
# Encoding: every codec and level in f32, and every codec once in bf16 (levels change constants).
ENCODE_CASES = [(f"{c}{lv}_{d}", dict(codec=c, level=lv, dtype=d))
                for c, lv in CODEC_LEVELS for d in DTYPES if lv == 0 or d == "float32"]
# Decoding does not depend on the level: every codec in both cache dtypes.
DECODE_CASES = [(f"{c}_{d}", dict(codec=c, level=max(KV_CODECS[c]), dtype=d))
                for c in KV_CODECS for d in DTYPES]
# Default run: each codec in each mode once, the cache dtypes alternating (each mode and each
# codec still sees both dtypes); the other half `slow`.
_CODEC_INDEX = {c: i for i, c in enumerate(KV_CODECS)}
DECODE_DEFAULT, DECODE_SLOW = split(
    modes_x(*DECODE_CASES),
    lambda c: (_CODEC_INDEX[c["codec"]] + c["use_pallas"]) % 2 == list(DTYPES).index(c["dtype"]))
ENCODE_DEFAULT, ENCODE_SLOW = split(modes_x(*ENCODE_CASES), edge_level)
ERROR_BOUND_DEFAULT, ERROR_BOUND_SLOW = split(modes_x(*CODEC_CASES), edge_level)
HALF_STEP_DEFAULT, HALF_STEP_SLOW = split(
    modes_x(("int8", dict(codec="int8", level=0)), *CODEC_CASES[3:]), edge_level)


def random_kv(seed=0, shape=(L, 2, C, K, H)):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape) * rng.uniform(0.5, 3.0, size=shape[-1])).astype(np.float32)


def synthetic_kv(seed=0, num_layers=L, c=C, k=K, h=H):
  """Gaussian KV with outlier channels and token-wise locality, like real LLM KV.

  K: per-channel offsets, two outlier channels per head (10x offset, 4x spread); both K and V: a
  slowly varying component per channel (a smoothed random walk) plus i.i.d. noise.
  """
  rng = np.random.default_rng(seed)
  shape = (num_layers, 2, c, k, h)
  walk = np.cumsum(rng.normal(size=shape), axis=2) / np.sqrt(c / 8)
  x = 0.5 * walk + 0.8 * rng.normal(size=shape)
  spread = np.ones((num_layers, 2, 1, k, h))
  offset = np.zeros((num_layers, 2, 1, k, h))
  offset[:, 0] = rng.normal(size=(num_layers, 1, k, h))
  for layer in range(num_layers):
    for head in range(k):
      ch = rng.choice(h, 2, replace=False)
      offset[layer, 0, 0, head, ch] *= 10
      spread[layer, 0, 0, head, ch] *= 4
  return (x * spread + offset).astype(np.float32)


def rope_tables(start, c=C, h=H, theta=100.0):
  """cos/sin f32[C, H] at positions start..start+C-1, HF rotate_half layout."""
  inv_freq = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h)
  ang = (start + np.arange(c))[:, None] * np.concatenate([inv_freq, inv_freq])[None]
  return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def nan_cache(dtype, num_layers=L, slots=SLOTS, s_max=S_MAX, k=K, h=H):
  return jnp.full((num_layers, slots, s_max, k, h), jnp.nan, dtype)


def np_dequantize(codec, arrays):
  """Numpy oracle of the contract's dequantization: f32[L, 2, C, K, H]."""
  a = {n: np.asarray(v).astype(np.float32) if n != "q" else np.asarray(v)
       for n, v in arrays.items()}
  if codec == "raw":
    return a["values"]
  if codec == "int8":
    return a["q"].astype(np.float32) * a["scale"][:, :, None]
  if codec == "int4":
    q = a["q"].astype(np.int32)
    codes = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float32)
    codes[..., 0::2] = q & 15
    codes[..., 1::2] = q >> 4
    g = codes.shape[2] // a["scale"].shape[2]
    return codes * np.repeat(a["scale"], g, axis=2) + np.repeat(a["zero"], g, axis=2)
  t = a["delta_q"].shape[2] // a["anchor_q"].shape[2]
  anchor = np.repeat(a["anchor_q"] * a["anchor_scale"][:, :, None], t, axis=2)
  return anchor + a["delta_q"] * a["delta_step"][:, :, None]


def np_rope(x_CKH, cos_CH, sin_CH):
  half = x_CKH.shape[-1] // 2
  rotated = np.concatenate([-x_CKH[..., half:], x_CKH[..., :half]], axis=-1)
  return x_CKH * cos_CH[:, None] + rotated * sin_CH[:, None]


def as_f32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def rel_err(x_hat, x):
  return float(np.linalg.norm(x_hat - x) / np.linalg.norm(x))


class KVDecodeTest(parameterized.TestCase):

  def decode(self, payload, k, v, slot, start, cos, sin, use_pallas):
    return kc.kv_decode(payload, k, v, np.int32(slot), np.int32(start), cos, sin,
                        interpret=INTERPRET, use_pallas=use_pallas)

  @parameterized.named_parameters(*DECODE_DEFAULT)
  def test_matches_oracle_and_leaves_the_rest_untouched(self, use_pallas, codec, level, dtype):
    self._check_matches_oracle_and_leaves_the_rest_untouched(use_pallas, codec, level, dtype)

  @parameterized.named_parameters(*DECODE_SLOW)
  @pytest.mark.slow
  def test_matches_oracle_and_leaves_the_rest_untouched_slow(self, use_pallas, codec, level,
                                                             dtype):
    self._check_matches_oracle_and_leaves_the_rest_untouched(use_pallas, codec, level, dtype)

  def _check_matches_oracle_and_leaves_the_rest_untouched(self, use_pallas, codec, level, dtype):
    payload = kref.encode_reference(random_kv(1), codec, level, group_tokens=16)
    slot, start = 1, 5  # not block aligned
    cos, sin = rope_tables(start)
    k_in, v_in = nan_cache(DTYPES[dtype]), nan_cache(DTYPES[dtype])
    k, v = self.decode(payload, k_in, v_in, slot, start, cos, sin, use_pallas)
    self.assertTrue(k_in.is_deleted() and v_in.is_deleted())  # donated, updated in place
    self.assertEqual(k.dtype, DTYPES[dtype])
    self.assertEqual(k.shape, (L, SLOTS, S_MAX, K, H))
    x = np_dequantize(codec, kc.payload_arrays(payload))
    want_k = np_rope(x[:, 0], cos, sin)
    got_k, got_v = as_f32(k), as_f32(v)
    block = np.s_[:, slot, start:start + C]
    np.testing.assert_allclose(got_k[block], want_k, **TOL[dtype])
    np.testing.assert_allclose(got_v[block], x[:, 1], **TOL[dtype])
    # Every position outside [start, start + C) of the slot, and every other slot, stays NaN.
    for got in (got_k, got_v):
      self.assertFalse(np.isnan(got[block]).any())
      outside = np.ones(got.shape, bool)
      outside[block] = False
      self.assertTrue(np.isnan(got[outside]).all())

  @parameterized.named_parameters(*modes_x(*[(d, dict(dtype=d)) for d in DTYPES]))
  def test_raw_round_trip_is_bit_exact(self, use_pallas, dtype):
    kv = jnp.asarray(random_kv(2), DTYPES[dtype])
    payload, finite = kc.kv_encode(kv, "raw", interpret=INTERPRET, use_pallas=use_pallas)
    self.assertTrue(bool(finite))
    arrays = kc.payload_arrays(payload)
    np.testing.assert_array_equal(arrays["values"], np.asarray(kv))
    payload = kc.payload_from_arrays("raw", arrays)
    np.testing.assert_array_equal(np.asarray(kref.dequantize_reference(payload)), as_f32(kv))
    start = 7
    cos, sin = rope_tables(start)
    k, v = self.decode(payload, nan_cache(DTYPES[dtype]), nan_cache(DTYPES[dtype]), 0, start,
                       cos, sin, use_pallas)
    np.testing.assert_array_equal(np.asarray(v[:, 0, start:start + C]), np.asarray(kv[:, 1]))
    # K matches the raw insert's rotation (`layers.apply_rope`, as `PagedModelRunner.insert_chunk`
    # applies it) at the same positions, cast to the cache dtype.
    inv_freq = 1.0 / 100.0 ** (np.arange(0, H, 2, dtype=np.float64) / H)
    positions_1C = (start + jnp.arange(C, dtype=jnp.int32))[None]
    want_k = layers.apply_rope(kv[:, 0], positions_1C, jnp.asarray(inv_freq, jnp.float32))
    np.testing.assert_allclose(as_f32(k[:, 0, start:start + C]),
                               as_f32(want_k.astype(DTYPES[dtype])), **TOL[dtype])

  def hand_decode(self, payload, use_pallas):
    """1 layer, 2 tokens, 1 head, H = 4, at slot 1 positions [1, 3) of a 4-position cache.

    RoPE tables chosen by hand: token 0 angle 0 (cos 1, sin 0), token 1 angle 90 degrees (cos 0,
    sin 1), so token 1's K becomes rotate_half(x) = [-x2, -x3, x0, x1].
    """
    cos = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    sin = np.array([[0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    k, v = self.decode(payload, nan_cache(jnp.float32, 1, 2, 4, 1, 4),
                       nan_cache(jnp.float32, 1, 2, 4, 1, 4), 1, 1, cos, sin, use_pallas)
    k, v = np.asarray(k), np.asarray(v)
    self.assertTrue(np.isnan(k[:, 0]).all() and np.isnan(k[:, 1, [0, 3]]).all())
    self.assertTrue(np.isnan(v[:, 0]).all() and np.isnan(v[:, 1, [0, 3]]).all())
    return k[0, 1, 1:3, 0], v[0, 1, 1:3, 0]

  @parameterized.named_parameters(*MODES)
  def test_hand_raw(self, use_pallas):
    values = np.zeros((1, 2, 2, 1, 4), np.float32)
    values[0, 0, :, 0] = [[1, 2, 3, 4], [5, 6, 7, 8]]
    values[0, 1, :, 0] = [[-1, -2, -3, -4], [0.5, 0, 0, 9]]
    # A 3-4-5 angle for token 1: x * 0.6 + rotate_half(x) * 0.8.
    cos = np.array([[1, 1, 1, 1], [0.6, 0.6, 0.6, 0.6]], np.float32)
    sin = np.array([[0, 0, 0, 0], [0.8, 0.8, 0.8, 0.8]], np.float32)
    k, v = self.decode(kp.RawPayload(values), nan_cache(jnp.float32, 1, 1, 2, 1, 4),
                       nan_cache(jnp.float32, 1, 1, 2, 1, 4), 0, 0, cos, sin, use_pallas)
    # [5,6,7,8] * 0.6 = [3, 3.6, 4.2, 4.8]; [-7,-8,5,6] * 0.8 = [-5.6, -6.4, 4, 4.8].
    np.testing.assert_allclose(np.asarray(k)[0, 0, :, 0],
                               [[1, 2, 3, 4], [-2.6, -2.8, 8.2, 9.6]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(v)[0, 0, :, 0], values[0, 1, :, 0])

  @parameterized.named_parameters(*MODES)
  def test_hand_int8(self, use_pallas):
    q = np.zeros((1, 2, 2, 1, 4), np.int8)
    q[0, 0, :, 0] = [[2, -4, 6, 8], [1, 0, -1, 127]]
    q[0, 1, :, 0] = [[10, 20, 30, 40], [-10, -20, -30, -40]]
    scale = np.array([[[[0.5, 0.25, 1, 2]], [[1, 0.5, 0.25, 0.125]]]], np.float32)
    k, v = self.hand_decode(kp.Int8Payload(q, scale), use_pallas)
    # K: [1, -1, 6, 16] and [0.5, 0, -1, 254] -> rotated [1, -254, 0.5, 0].
    np.testing.assert_array_equal(k, [[1, -1, 6, 16], [1, -254, 0.5, 0]])
    np.testing.assert_array_equal(v, [[10, 10, 7.5, 5], [-10, -10, -7.5, -5]])

  @parameterized.named_parameters(*MODES)
  def test_hand_int4(self, use_pallas):
    # Codes [1, 2, 3, 4] and [15, 0, 7, 8]: bytes (even h low nibble) [1 | 2<<4, 3 | 4<<4] and
    # [15 | 0<<4, 7 | 8<<4]; one group of G = 2 tokens.
    q = np.zeros((1, 2, 2, 1, 2), np.uint8)
    q[0, :, :, 0] = [[33, 67], [15, 135]]
    scale = np.zeros((1, 2, 1, 1, 4), np.float16)
    zero = np.zeros((1, 2, 1, 1, 4), np.float16)
    scale[0, 0, 0, 0] = [0.5, 1, 2, 0.25]
    zero[0, 0, 0, 0] = [-1, 0, 1, 2]
    scale[0, 1, 0, 0] = 1
    k, v = self.hand_decode(kp.Int4Payload(q, scale, zero), use_pallas)
    # K: [1*.5-1, 2, 3*2+1, 4*.25+2] = [-0.5, 2, 7, 3]; [6.5, 0, 15, 4] -> [-15, -4, 6.5, 0].
    np.testing.assert_array_equal(k, [[-0.5, 2, 7, 3], [-15, -4, 6.5, 0]])
    np.testing.assert_array_equal(v, [[1, 2, 3, 4], [15, 0, 7, 8]])

  @parameterized.named_parameters(*MODES)
  def test_hand_cachegen(self, use_pallas):
    # One anchor for both tokens (A = 1, T = 2); K and V share the numbers.
    anchor_q = np.zeros((1, 2, 1, 1, 4), np.int8)
    anchor_q[0, :, 0, 0] = [10, -20, 0, 127]
    anchor_scale = np.tile(np.array([0.5, 0.25, 1, 1], np.float32), (1, 2, 1, 1))
    delta_q = np.zeros((1, 2, 2, 1, 4), np.int8)
    delta_q[0, :, :, 0] = [[1, 2, 3, -4], [-1, 0, 0, 4]]
    delta_step = np.tile(np.array([0.25, 0.5, 1, 0.5], np.float32), (1, 2, 1, 1))
    payload = kp.CacheGenPayload(anchor_q, anchor_scale, delta_q, delta_step)
    k, v = self.hand_decode(payload, use_pallas)
    # anchor [5, -5, 0, 127]; deltas [.25, 1, 3, -2] and [-.25, 0, 0, 2].
    np.testing.assert_array_equal(v, [[5.25, -4, 3, 125], [4.75, -5, 0, 129]])
    np.testing.assert_array_equal(k, [[5.25, -4, 3, 125], [0, -129, 4.75, -5]])

  @parameterized.named_parameters(*MODES)
  def test_bad_input(self, use_pallas):
    payload = kref.encode_reference(random_kv(3), "int8")
    cos, sin = rope_tables(0)
    cache = lambda: nan_cache(jnp.float32)  # noqa: E731
    cases = {
        "outside": dict(start=S_MAX - C + 1),
        "slot": dict(slot=SLOTS),
        "negative": dict(start=-1),
        "float start": dict(start=np.float32(1)),
        "cos shape": dict(cos=cos[:-1]),
        "sin dtype": dict(sin=sin.astype(np.int32)),
        "cache dtype": dict(k=jnp.zeros((L, SLOTS, S_MAX, K, H), jnp.int32),
                            v=jnp.zeros((L, SLOTS, S_MAX, K, H), jnp.int32)),
        "cache heads": dict(k=nan_cache(jnp.float32, k=K + 1), v=nan_cache(jnp.float32, k=K + 1)),
        "k != v": dict(v=nan_cache(jnp.bfloat16)),
        "short cache": dict(k=nan_cache(jnp.float32, s_max=C - 1),
                            v=nan_cache(jnp.float32, s_max=C - 1)),
        "payload dtype": dict(payload=kp.Int8Payload(payload.q.astype(jnp.int16), payload.scale)),
        "payload shape": dict(payload=kp.Int8Payload(payload.q, payload.scale[:, :, :1])),
        "not a payload": dict(payload=(payload.q, payload.scale)),
        "int4 groups": dict(payload=kp.Int4Payload(
            jnp.zeros((L, 2, C, K, H // 2), jnp.uint8), jnp.zeros((L, 2, 5, K, H), jnp.float16),
            jnp.zeros((L, 2, 5, K, H), jnp.float16))),
        "cachegen anchors": dict(payload=kp.CacheGenPayload(
            jnp.zeros((L, 2, 3, K, H), jnp.int8), jnp.zeros((L, 2, K, H)),
            jnp.zeros((L, 2, C, K, H), jnp.int8), jnp.zeros((L, 2, K, H)))),
    }
    for name, bad in cases.items():
      args = dict(payload=payload, k=cache(), v=cache(), slot=np.int32(0), start=np.int32(0),
                  cos=cos, sin=sin)
      args.update(bad)
      with self.subTest(name), self.assertRaises(ValueError):
        kc.kv_decode(args["payload"], args["k"], args["v"], args["slot"], args["start"],
                     args["cos"], args["sin"], interpret=INTERPRET, use_pallas=use_pallas)

  @parameterized.named_parameters(*MODES)
  def test_traced_slot_and_start(self, use_pallas):
    payload = kref.encode_reference(random_kv(4), "cachegen", 1)
    cos, sin = rope_tables(3)

    @jax.jit
    def run(k, v, slot, start):
      return kc.kv_decode(payload, k, v, slot, start, cos, sin, interpret=INTERPRET,
                          use_pallas=use_pallas)

    k, _ = run(nan_cache(jnp.float32), nan_cache(jnp.float32), jnp.int32(1), jnp.int32(3))
    want, _ = kref.kv_decode_reference(payload, nan_cache(jnp.float32), nan_cache(jnp.float32), 1,
                                     3, cos, sin)
    np.testing.assert_allclose(np.asarray(k), np.asarray(want), **TOL["float32"])


class KVEncodeTest(parameterized.TestCase):

  @parameterized.named_parameters(*ENCODE_DEFAULT)
  def test_matches_reference(self, use_pallas, codec, level, dtype):
    self._check_matches_reference(use_pallas, codec, level, dtype)

  @parameterized.named_parameters(*ENCODE_SLOW)
  @pytest.mark.slow
  def test_matches_reference_slow(self, use_pallas, codec, level, dtype):
    self._check_matches_reference(use_pallas, codec, level, dtype)

  def _check_matches_reference(self, use_pallas, codec, level, dtype):
    kv = jnp.asarray(random_kv(5), DTYPES[dtype])
    payload, finite = kc.kv_encode(kv, codec, level, interpret=INTERPRET, use_pallas=use_pallas)
    want = kref.encode_reference(kv, codec, level)
    self.assertTrue(bool(finite))
    self.assertIsInstance(payload, kp.PAYLOAD_TYPES[codec])
    kp.validate_payload(payload)
    for name, got, ref in zip(want._fields, payload, want):
      got, ref = np.asarray(got), np.asarray(ref)
      self.assertEqual((got.shape, got.dtype), (ref.shape, ref.dtype), name)
      if codec in ("int8", "int4"):  # exact arithmetic (kvjax/kernels/exact_quant.py)
        np.testing.assert_array_equal(got, ref, err_msg=name)
      elif np.issubdtype(ref.dtype, np.integer):
        # Reductions may sum in another order: a code sitting on a rounding boundary may move by
        # one step; nothing more, and almost never.
        diff = np.abs(got.astype(np.int32) - ref.astype(np.int32))
        if name == "q" and codec == "int4":
          diff = np.maximum(np.abs((got & 15) - (ref & 15)), np.abs((got >> 4) - (ref >> 4)))
        self.assertLessEqual(diff.max(), 1, name)
        self.assertLessEqual(np.count_nonzero(diff), max(1, diff.size // 1000), name)
      else:
        np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=1e-5,
                                   err_msg=name)

  @parameterized.named_parameters(*MODES)
  def test_hand_int8(self, use_pallas):
    kv = np.zeros((1, 2, 2, 1, 4), np.float32)
    kv[0, 0, :, 0] = [[1, 0, -2, 0], [-4, 0, 0.5, 3]]
    kv[0, 1] = 2 * kv[0, 0]
    p, _ = kc.kv_encode(kv, "int8", interpret=INTERPRET, use_pallas=use_pallas)
    # absmax [4, 0, 2, 3]: 1 / (4/127) = 31.75 -> 32; 0.5 / (2/127) = 31.75 -> 32; zero channel 0.
    want_q = [[32, 0, -127, 0], [-127, 0, 32, 127]]
    np.testing.assert_array_equal(np.asarray(p.q)[0, 0, :, 0], want_q)
    np.testing.assert_array_equal(np.asarray(p.q)[0, 1, :, 0], want_q)
    # absmax / 127 at 16 significant bits (kvjax/kernels/exact_quant.py): within 2**-16.
    np.testing.assert_allclose(np.asarray(p.scale)[0, :, 0],
                               [[4 / 127, 0, 2 / 127, 3 / 127], [8 / 127, 0, 4 / 127, 6 / 127]],
                               rtol=2.0 ** -16)

  @parameterized.named_parameters(*MODES)
  def test_hand_int4(self, use_pallas):
    kv = np.zeros((1, 2, 2, 1, 4), np.float32)
    kv[0, 0, :, 0] = [[0, 1, 2, 3], [15, 16, 32, 3]]
    kv[0, 1] = -kv[0, 0]
    p, _ = kc.kv_encode(kv, "int4", interpret=INTERPRET, use_pallas=use_pallas, group_tokens=2)
    # K ranges [0,15], [1,16], [2,32], [3,3]: scale [1, 1, 2, 0], zero = min, codes [0..] and
    # [15, 15, 15, 0] (a flat channel has scale 0 and code 0). Bytes: low nibble = even h.
    np.testing.assert_array_equal(np.asarray(p.q)[0, 0, :, 0], [[0, 0], [255, 15]])
    np.testing.assert_array_equal(np.asarray(p.scale)[0, 0, 0, 0], [1, 1, 2, 0])
    np.testing.assert_array_equal(np.asarray(p.zero)[0, 0, 0, 0], [0, 1, 2, 3])
    # V = -K: zeros are the minima [-15, -16, -32, -3]; codes [15, 15, 15, 0] then all 0.
    np.testing.assert_array_equal(np.asarray(p.q)[0, 1, :, 0], [[255, 15], [0, 0]])
    np.testing.assert_array_equal(np.asarray(p.zero)[0, 1, 0, 0], [-15, -16, -32, -3])
    np.testing.assert_array_equal(np.asarray(kref.dequantize_reference(p)), kv)

  @parameterized.named_parameters(*MODES)
  def test_hand_cachegen(self, use_pallas):
    # 3 layers with the same data, C = 4 tokens, anchors every T = 2, H = 2, level 1.
    kv = np.zeros((3, 2, 4, 1, 2), np.float32)
    kv[:, :, :, 0, 0] = [126, 128, 0, 0]
    p, _ = kc.kv_encode(kv, "cachegen", 1, interpret=INTERPRET, use_pallas=use_pallas,
                        anchor_stride=2)
    # Channel 0: anchors (group means) [127, 0] -> scale 127/127 = 1, codes [127, 0]; deltas
    # [-1, 1, 0, 0], rms sqrt(1/2). Layer groups 0, 1, 2 have bins 0.5, 1, 1.5 at level 1:
    # step = bin * rms / 6 (above max|delta| / 127), codes round(+-1 / step).
    steps = np.array([0.5, 1, 1.5]) * np.sqrt(0.5) / 6
    np.testing.assert_array_equal(np.asarray(p.anchor_q)[:, :, :, 0, 0], np.full((3, 2, 2),
                                                                                [127, 0]))
    np.testing.assert_allclose(np.asarray(p.anchor_scale)[:, :, 0, 0], 1.0)
    np.testing.assert_allclose(np.asarray(p.delta_step)[:, :, 0, 0],
                               np.stack([steps, steps], 1), rtol=1e-6)
    want_dq = np.round(1 / steps)  # 17, 8, 6
    np.testing.assert_array_equal(want_dq, [17, 8, 6])
    for layer in range(3):
      np.testing.assert_array_equal(np.asarray(p.delta_q)[layer, :, :, 0, 0],
                                    np.tile([-want_dq[layer], want_dq[layer], 0, 0], (2, 1)))
    # Channel 1 is all zero: zero scales, steps and codes.
    for name in p._fields:
      self.assertFalse(np.asarray(getattr(p, name))[..., 1].any(), name)

  @parameterized.named_parameters(*modes_x(*[(c, dict(codec=c)) for c in KV_CODECS]))
  def test_nan_and_inf_detected(self, use_pallas, codec):
    for bad in (np.nan, np.inf, -np.inf):
      kv = random_kv(6)
      kv[1, 1, 3, 2, 5] = bad
      _, finite = kc.kv_encode(kv, codec, interpret=INTERPRET, use_pallas=use_pallas)
      self.assertFalse(bool(finite))
      with self.assertRaisesRegex(ValueError, "NaN/inf"):
        kc.kv_encode_host(kv, codec, interpret=INTERPRET, use_pallas=use_pallas)

  @parameterized.named_parameters(*MODES)
  def test_int4_float16_overflow_detected(self, use_pallas):
    kv = random_kv(7)
    kv[0, 0, 0, 0, 0] = -1e6  # finite in f32, beyond float16's zero/scale range
    _, finite = kc.kv_encode(kv, "int4", interpret=INTERPRET, use_pallas=use_pallas)
    self.assertFalse(bool(finite))

  @parameterized.named_parameters(*MODES)
  def test_bad_input(self, use_pallas):
    kv = random_kv(8)
    cases = {
        "codec": (kv, "zstd", 0, {}), "level": (kv, "int8", 1, {}),
        "cachegen level": (kv, "cachegen", 4, {}), "bool level": (kv, "cachegen", True, {}),
        "rank": (kv[0], "int8", 0, {}), "axis 1": (kv[:, :1], "int8", 0, {}),
        "dtype": (kv.astype(np.int32), "int8", 0, {}), "odd H": (kv[..., :7], "int4", 0, {}),
        "group": (kv, "int4", 0, dict(group_tokens=5)),
        "stride": (kv, "cachegen", 0, dict(anchor_stride=0)),
        "list": (kv.tolist(), "int8", 0, {}),
        "stride vs C": (kv[:, :, :24], "cachegen", 0, dict(anchor_stride=16)),
        "group vs C": (kv[:, :, :24], "int4", 0, dict(group_tokens=16)),
    }
    for name, (x, codec, level, kw) in cases.items():
      with self.subTest(name), self.assertRaises(ValueError):
        kc.kv_encode(x, codec, level, interpret=INTERPRET, use_pallas=use_pallas, **kw)

  @parameterized.named_parameters(*MODES)
  def test_other_codecs_ignore_the_cachegen_stride(self, use_pallas):
    kv = random_kv(13)[:, :, :24]  # C = 24: 16 does not divide it, and int8 needs no stride
    payload, finite = kc.kv_encode(kv, "int8", interpret=INTERPRET, use_pallas=use_pallas)
    self.assertTrue(bool(finite))
    self.assertLess(rel_err(np.asarray(kref.dequantize_reference(payload)), kv), 0.01)

  @parameterized.named_parameters(*ERROR_BOUND_DEFAULT)
  def test_error_bound_on_synthetic_kv(self, use_pallas, codec, level):
    self._check_error_bound_on_synthetic_kv(use_pallas, codec, level)

  @parameterized.named_parameters(*ERROR_BOUND_SLOW)
  @pytest.mark.slow
  def test_error_bound_on_synthetic_kv_slow(self, use_pallas, codec, level):
    self._check_error_bound_on_synthetic_kv(use_pallas, codec, level)

  def _check_error_bound_on_synthetic_kv(self, use_pallas, codec, level):
    bound = {("raw", 0): 0.0, ("int8", 0): 0.01, ("int4", 0): 0.08, ("cachegen", 0): 0.02,
             ("cachegen", 1): 0.04, ("cachegen", 2): 0.08, ("cachegen", 3): 0.16}
    kv = synthetic_kv()
    payload, _ = kc.kv_encode(kv, codec, level, interpret=INTERPRET, use_pallas=use_pallas)
    err = rel_err(np.asarray(kref.dequantize_reference(payload)), kv)
    self.assertLessEqual(err, bound[codec, level])
    if codec != "raw":
      self.assertGreater(err, bound[codec, level] / 20)  # really quantized

  @parameterized.named_parameters(*HALF_STEP_DEFAULT)
  def test_each_value_within_half_a_step(self, use_pallas, codec, level):
    self._check_each_value_within_half_a_step(use_pallas, codec, level)

  @parameterized.named_parameters(*HALF_STEP_SLOW)
  @pytest.mark.slow
  def test_each_value_within_half_a_step_slow(self, use_pallas, codec, level):
    self._check_each_value_within_half_a_step(use_pallas, codec, level)

  def _check_each_value_within_half_a_step(self, use_pallas, codec, level):
    # A spike 1000x the rest must not clip: the step covers max|delta| / 127.
    kv = synthetic_kv(1)
    kv[1, 1, 17, 0, 3] = 1000.0
    p, _ = kc.kv_encode(kv, codec, level, interpret=INTERPRET, use_pallas=use_pallas)
    err = np.abs(np.asarray(kref.dequantize_reference(p)) - kv)
    step = p.scale if codec == "int8" else p.delta_step
    half = np.asarray(step)[:, :, None] / 2
    self.assertTrue((err <= half * (1 + 1e-5) + 1e-6).all())


class PayloadTest(absltest.TestCase):

  def test_compiled_pallas_on_cpu_is_a_clear_error(self):
    if jax.default_backend() != "cpu":
      self.skipTest("only CPU refuses compiled Pallas")
    kv = random_kv(12)
    with self.assertRaisesRegex(ValueError, "use_pallas=False"):
      kc.kv_encode(kv, "int8")
    payload = kref.encode_reference(kv, "int8")
    cos, sin = rope_tables(0)
    with self.assertRaisesRegex(ValueError, "interpret=True"):
      kc.kv_decode(payload, nan_cache(jnp.float32), nan_cache(jnp.float32), 0, 0, cos, sin)

  def test_dict_round_trip(self):
    kv = random_kv(9)
    for codec, level in CODEC_LEVELS:
      payload = kref.encode_reference(kv, codec, level, group_tokens=8)
      arrays = kc.payload_arrays(payload)
      self.assertEqual(list(arrays), list(kp.PAYLOAD_TYPES[codec]._fields))
      self.assertTrue(all(isinstance(a, np.ndarray) for a in arrays.values()))
      back = kc.payload_from_arrays(codec, arrays)
      self.assertEqual(kp.codec_of(back), codec)
      for a, b in zip(back, payload):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_contract_shapes(self):
    p = kref.encode_reference(random_kv(10), "int4", group_tokens=8)
    self.assertEqual((p.q.shape, p.q.dtype), ((L, 2, C, K, H // 2), jnp.uint8))
    self.assertEqual((p.scale.shape, p.scale.dtype), ((L, 2, C // 8, K, H), jnp.float16))
    p = kref.encode_reference(random_kv(10), "cachegen", 2)
    self.assertEqual(p.anchor_q.shape, (L, 2, C // codecs.CACHEGEN_ANCHOR_STRIDE, K, H))
    self.assertEqual(p.delta_step.shape, (L, 2, K, H))
    self.assertEqual(kp.validate_payload(p), (L, C, K, H))

  def test_bad_dicts(self):
    arrays = kc.payload_arrays(kref.encode_reference(random_kv(11), "int8"))
    with self.assertRaisesRegex(ValueError, "unknown codec"):
      kc.payload_from_arrays("int3", arrays)
    with self.assertRaisesRegex(ValueError, "needs arrays"):
      kc.payload_from_arrays("int8", {"q": arrays["q"]})
    with self.assertRaisesRegex(ValueError, "needs arrays"):
      kc.payload_from_arrays("int8", dict(arrays, extra=arrays["q"]))
    with self.assertRaisesRegex(ValueError, "int8.scale"):
      kc.payload_from_arrays("int8", dict(arrays, scale=arrays["scale"].astype(np.float16)))
    with self.assertRaisesRegex(ValueError, "raw.values"):
      kc.payload_from_arrays("raw", {"values": arrays["q"]})


if __name__ == "__main__":
  absltest.main()
