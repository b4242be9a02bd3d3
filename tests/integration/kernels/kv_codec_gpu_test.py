"""KV codec Triton kernels (kvjax/kernels/kv_codec_gpu.py): interpret mode against the jnp
references, every codec, encode and decode; the CUDA lowering on CPU at the engine's model shapes
(SmolLM2-135M, LLaMA-3.1-8B), through `jax.export`; the platform argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized
from jax import export

from kvjax import codecs
from kvjax.kernels import exact_quant
from kvjax.kernels import kv_codec as kc
from kvjax.kernels import kv_codec_ref as kref
from kvjax.kernels import kv_payloads as kp
from kvjax.kernels import kv_codec_gpu as gpu

# Interpret mode on CPU; compiled on a GPU (the Triton bodies run only there or interpreted).
INTERPRET = jax.default_backend() != "gpu"
# CacheGen's levels change only a constant factor: its finest and coarsest.
ENCODE = [(codecs.INT8, 0), (codecs.INT4, 0), (codecs.CACHEGEN, 0),
          (codecs.CACHEGEN, max(codecs.CODEC_LEVELS[codecs.CACHEGEN]))]
DECODE = [codecs.RAW, codecs.INT8, codecs.INT4, codecs.CACHEGEN]
# (dtype, C, int4 G / CacheGen 2T; None: the registry's rule for C)
ENCODE_CASES = (("float32", 32, None), ("bfloat16", 64, 8))
DTYPES = ("float32", "bfloat16")
L, K, H = 2, 3, 16
# Engine shapes, bf16 chunks of 256 tokens: (layers, kv heads, head dim).
MODELS = {"smollm2": (30, 3, 64), "llama31_8b": (32, 8, 128)}


def synthetic_kv(seed, c, num_layers=L, k=K, h=H):
  """Gaussian KV with per-channel offsets and spreads, and a slow walk along the tokens."""
  rng = np.random.default_rng(seed)
  shape = (num_layers, 2, c, k, h)
  walk = np.cumsum(rng.normal(size=shape), axis=2) / np.sqrt(c / 4)
  x = rng.normal(size=shape) * rng.uniform(0.2, 3.0, size=h) + rng.normal(size=h) * 2 + walk
  return x.astype(np.float32)


def rope_tables(start, c, h=H):
  inv = 100.0 ** (-np.arange(0, h, 2) / h)
  ang = np.arange(start, start + c)[:, None] * inv[None]
  ang = np.concatenate([ang, ang], axis=1)
  return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _dis():
  """`jax.export` refuses custom calls it does not know as stable; the Triton call is one."""
  return [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


class KvCodecGpuTest(parameterized.TestCase):

  # The default run: each codec (and CacheGen's finest and coarsest level) once, the two
  # (dtype, C, tokens) cases alternating; the other half of the product is `slow`.
  @parameterized.parameters(*[(cl, ENCODE_CASES[i % 2]) for i, cl in enumerate(ENCODE)])
  def test_encode_matches_reference(self, codec_level, case):
    self._check_encode_matches_reference(codec_level, case)

  @parameterized.parameters(*[(cl, ENCODE_CASES[1 - i % 2]) for i, cl in enumerate(ENCODE)])
  @pytest.mark.slow
  def test_encode_matches_reference_slow(self, codec_level, case):
    self._check_encode_matches_reference(codec_level, case)

  def _check_encode_matches_reference(self, codec_level, case):
    codec, level = codec_level
    dtype, c, tokens = case
    kw = {}
    if tokens and codec == codecs.INT4:
      kw["group_tokens"] = tokens
    if tokens and codec == codecs.CACHEGEN:
      kw["anchor_stride"] = tokens // 2
    x = jnp.asarray(synthetic_kv(1, c), dtype)
    want = kref.encode_reference(x, codec, level, **kw)
    got, finite = kc.kv_encode(x, codec, level, interpret=INTERPRET, platform="cuda", **kw)
    self.assertTrue(bool(finite))
    self.assertIsInstance(got, type(want))
    for name, a, b in zip(want._fields, want, got):
      self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype), name)
      if codec in (codecs.INT8, codecs.INT4):
        # int8 and int4 (kvjax/kernels/exact_quant.py) are exact arithmetic: the same bytes on
        # every backend, whatever its division, fused multiply-adds or reduction order.
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
      elif jnp.issubdtype(a.dtype, jnp.integer):
        # Codes: identical but for a value that sits on a rounding boundary after a last-ulp
        # difference of its scale (reduction order); never more than one step.
        diff = np.abs(np.asarray(a, np.int32) - np.asarray(b, np.int32))
        self.assertLessEqual(int(diff.max()), 1, name)
        self.assertLessEqual(float(np.mean(diff > 0)), 1e-3, name)
      else:
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   rtol=1e-6, atol=0, err_msg=name)

  # The default run: each codec once, the cache dtypes alternating; the rest `slow`.
  @parameterized.parameters(*[(c, DTYPES[i % 2]) for i, c in enumerate(DECODE)])
  def test_decode_matches_reference(self, codec, dtype):
    self._check_decode_matches_reference(codec, dtype)

  @parameterized.parameters(*[(c, DTYPES[1 - i % 2]) for i, c in enumerate(DECODE)])
  @pytest.mark.slow
  def test_decode_matches_reference_slow(self, codec, dtype):
    self._check_decode_matches_reference(codec, dtype)

  def _check_decode_matches_reference(self, codec, dtype):
    # C = 128 runs two token tiles of 64 per (layer, kv head).
    c = 128
    d = jnp.dtype(dtype)
    x = jnp.asarray(synthetic_kv(2, c), d)
    payload = kp.RawPayload(x) if codec == codecs.RAW else kref.encode_reference(x, codec, 1 if (
        codec == codecs.CACHEGEN) else 0)
    slot, start, s_max = 1, 5, c + 16
    cos, sin = rope_tables(start, c)
    cache = jnp.full((L, 2, s_max, K, H), jnp.nan, d)
    want_k, want_v = kref.kv_decode_reference(payload, cache, cache, slot, start, cos, sin)
    got_k, got_v = kc.kv_decode(payload, jnp.copy(cache), jnp.copy(cache), slot, start, cos, sin,
                                interpret=INTERPRET, platform="cuda")
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=1e-6)
    for want, got in ((want_k, got_k), (want_v, got_v)):
      w, g = np.asarray(want, np.float32), np.asarray(got, np.float32)
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w))  # untouched slots stay NaN
      np.testing.assert_allclose(g[~np.isnan(w)], w[~np.isnan(w)], **tol)
    if codec != codecs.CACHEGEN:
      # V of raw / int8 / int4 is one rounding per value (int4: code * scale is exact, so a
      # fused multiply-add rounds the same): bit-identical on any backend. K's RoPE (and
      # CacheGen's two products) may round once where another backend rounds twice: within
      # one ulp of the cache dtype there (scripts/device_check_codec.py checks it on a GPU).
      np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))

  def test_round_half_even_matches_jnp_round(self):
    x = jnp.asarray(np.concatenate([np.arange(-8, 8, 0.25), [0.5, 1.5, 2.5, -0.5, -2.5, 1e7 + 0.5,
                                                              3.4e38, -3.4e38, 0.0, -0.0]]),
                    jnp.float32)
    np.testing.assert_array_equal(np.asarray(exact_quant.round_half_even(x)),
                                  np.asarray(jnp.round(x)))

  def test_round_f16_matches_cast(self):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(size=4096) * 10.0 ** rng.integers(-9, 6, size=4096),
                        [0.0, -0.0, 65504.0, 65519.9, 65520.0, -1e6, 2.0 ** -25, 3 * 2.0 ** -26,
                         np.inf, -np.inf]]).astype(np.float32)
    with np.errstate(over="ignore"):  # 1e6 and 65520 overflow float16: inf, as round_f16
      want = x.astype(np.float16).astype(np.float32)
    got = np.asarray(exact_quant.round_f16(jnp.asarray(x)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

  def test_int4_codes_exact_whatever_the_division(self):
    # Triton divides with PTX div.full.f32 (up to 2 ulp off), TPUs with a reciprocal estimate:
    # the codes must not depend on it. Quotients on and next to every rounding boundary, an
    # estimate from the exact quotient, from a division a few ulps off, and off by one step.
    rng = np.random.default_rng(4)
    scale = np.float16(rng.uniform(0.01, 4.0, size=(1, 512))).astype(np.float32)
    k = rng.integers(-2, 18, size=(64, 512)) + 0.5
    ties = (k * scale).astype(np.float32)                      # exact: on the boundary
    d = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)),
                        np.nextafter(ties, np.float32(-np.inf)),
                        (rng.uniform(-3, 20, size=(64, 512)) * scale).astype(np.float32)])
    scale = np.broadcast_to(scale, d.shape)
    rounded = np.round(d.astype(np.float64) / scale.astype(np.float64))
    exact = np.clip(rounded, 0, 15)
    q = d / scale
    for estimate in (np.floor(q + 0.5), np.floor(q * (1 + 2e-7) + 0.5),
                     np.floor(q * (1 - 2e-7) + 0.5), rounded + 1, rounded - 1):
      got = exact_quant.correct_codes(jnp.asarray(d), jnp.asarray(scale),
                                   jnp.asarray(estimate.astype(np.float32)))
      np.testing.assert_array_equal(np.asarray(got), exact)
    np.testing.assert_array_equal(np.asarray(exact_quant.int4_codes(jnp.asarray(d),
                                                                  jnp.asarray(scale))), exact)
    # scale 0 (a flat channel): code 0.
    self.assertEqual(float(exact_quant.int4_codes(jnp.float32(3.0), jnp.float32(0.0))), 0.0)

  def test_int8_codes_exact_whatever_the_division(self):
    # Values on and next to the rounding boundaries of their channel's scale; the codes are
    # the round-half-even of the exact quotient, the scale max|x| / 127 at 16 bits.
    rng = np.random.default_rng(7)
    absmax = np.float32(rng.uniform(0.5, 8.0, size=64))
    scale = np.asarray(exact_quant.round_mantissa(jnp.asarray(absmax * np.float32(1 / 127)),
                                                  exact_quant.INT8_SCALE_BITS))
    self.assertTrue(np.all(np.abs(scale / (absmax / 127) - 1) <= 2.0 ** -16))
    k = rng.integers(-127, 127, size=(96, 64)) + 0.5
    ties = (k * scale).astype(np.float32)
    x = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)),
                        np.nextafter(ties, np.float32(-np.inf)), absmax[None], -absmax[None]])
    codes, got_scale = (np.asarray(a) for a in exact_quant.int8_quantize(jnp.asarray(x), axis=0))
    np.testing.assert_array_equal(got_scale[0], scale)
    want = np.clip(np.round(x.astype(np.float64) / scale.astype(np.float64)), -127, 127)
    np.testing.assert_array_equal(codes, want)
    self.assertEqual(int(np.abs(codes).max()), 127)

  def test_int4_fit_independent_of_summation_order(self):
    # The clipping search compares error sums of integers below 2**24: exact in float32, so
    # any backend's reduction tree picks the same candidate. Reversing and shuffling the
    # tokens of a group permutes the codes and changes nothing else.
    x = jnp.asarray(synthetic_kv(5, 64, num_layers=1, k=2, h=64), jnp.bfloat16)
    x = x.astype(jnp.float32).reshape(2, 64, 128)              # [groups, G tokens, channels]
    codes, scale, zero = (np.asarray(a) for a in exact_quant.int4_fit(x, axis=1))
    perm = np.random.default_rng(6).permutation(64)
    for order in (perm, np.arange(64)[::-1]):
      c2, s2, z2 = (np.asarray(a) for a in exact_quant.int4_fit(x[:, order], axis=1))
      np.testing.assert_array_equal(s2, scale)
      np.testing.assert_array_equal(z2, zero)
      np.testing.assert_array_equal(c2, codes[:, order])

  def test_shapes_triton_cannot_tile_raise(self):
    x = jnp.zeros((1, 2, 24, 1, 16), jnp.float32)  # C = 24: not a power of two
    with self.assertRaisesRegex(ValueError, "powers of two"):
      kc.kv_encode(x, codecs.INT8, interpret=True, platform="cuda")
    with self.assertRaisesRegex(ValueError, "platform"):
      kc.kv_encode(x, codecs.INT8, interpret=True, platform="metal")
    with self.assertRaisesRegex(ValueError, "GPU or TPU"):
      kc.kv_encode(x, codecs.INT8, platform="cpu")

  @parameterized.product(model=tuple(MODELS), codec=DECODE)
  def test_lowers_for_cuda_at_model_shapes(self, model, codec):
    # The Pallas -> Triton lowering runs on the CPU jaxlib for a CUDA target: every op, block
    # and size of the engine's chunks (C = 256, bf16) is accepted.
    num_layers, k, h = MODELS[model]
    c = 256
    x = jax.ShapeDtypeStruct((num_layers, 2, c, k, h), jnp.bfloat16)
    level = max(codecs.CODEC_LEVELS[codec])
    if codec != codecs.RAW:
      enc = export.export(jax.jit(lambda x: kc.kv_encode(x, codec, level, platform="cuda")),
                          platforms=["cuda"], disabled_checks=_dis())(x)
      self.assertIn(f"kv_encode_{codec}_gpu", enc.mlir_module())
    payload = jax.eval_shape(lambda x: kref.encode_reference(x, codec, level), x)
    cache = jax.ShapeDtypeStruct((num_layers, 2, 4 * c, k, h), jnp.bfloat16)
    cs = jax.ShapeDtypeStruct((c, h), jnp.float32)
    dec = export.export(
        jax.jit(lambda p, kc_, vc, cos, sin: kc.kv_decode(p, kc_, vc, 1, c, cos, sin,
                                                           platform="cuda")),
        platforms=["cuda"], disabled_checks=_dis())(payload, cache, cache, cs, cs)
    text = dec.mlir_module()
    self.assertIn(f"kv_decode_{codec}_gpu", text)
    self.assertIn("__gpu$xla.gpu.triton", text)


if __name__ == "__main__":
  absltest.main()
