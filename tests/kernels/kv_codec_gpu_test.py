"""KV codec Triton kernels (kvjax/kernels/kv_codec_gpu.py): interpret mode against the jnp
references, every codec, encode and decode; the CUDA lowering on CPU at the engine's model shapes
(SmolLM2-135M, LLaMA-3.1-8B), through `jax.export`; the platform argument."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import export

from kvjax import codecs
from kvjax.kernels import kv_codec as kc
from kvjax.kernels import kv_codec_gpu as gpu

# Interpret mode on CPU; compiled on a GPU (the Triton bodies run only there or interpreted).
INTERPRET = jax.default_backend() != "gpu"
# CacheGen's levels change only a constant factor: its finest and coarsest.
ENCODE = [(codecs.INT8, 0), (codecs.INT4, 0), (codecs.CACHEGEN, 0),
          (codecs.CACHEGEN, max(codecs.CODEC_LEVELS[codecs.CACHEGEN]))]
DECODE = [codecs.RAW, codecs.INT8, codecs.INT4, codecs.CACHEGEN]
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

  # (dtype, C, int4 G / CacheGen 2T; None: the registry's rule for C)
  @parameterized.product(codec_level=ENCODE, case=(("float32", 32, None), ("bfloat16", 64, 8)))
  def test_encode_matches_reference(self, codec_level, case):
    codec, level = codec_level
    dtype, c, tokens = case
    kw = {}
    if tokens and codec == codecs.INT4:
      kw["group_tokens"] = tokens
    if tokens and codec == codecs.CACHEGEN:
      kw["anchor_stride"] = tokens // 2
    x = jnp.asarray(synthetic_kv(1, c), dtype)
    want = kc.encode_reference(x, codec, level, **kw)
    got, finite = kc.kv_encode(x, codec, level, interpret=INTERPRET, platform="cuda", **kw)
    self.assertTrue(bool(finite))
    self.assertIsInstance(got, type(want))
    for name, a, b in zip(want._fields, want, got):
      self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype), name)
      if jnp.issubdtype(a.dtype, jnp.integer):
        # Codes: identical but for a value that sits on a rounding boundary after a last-ulp
        # difference of its scale (reduction order); never more than one step.
        diff = np.abs(np.asarray(a, np.int32) - np.asarray(b, np.int32))
        self.assertLessEqual(int(diff.max()), 1, name)
        self.assertLessEqual(float(np.mean(diff > 0)), 1e-3, name)
      else:
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                                   rtol=1e-6, atol=0, err_msg=name)

  @parameterized.product(codec=DECODE, dtype=("float32", "bfloat16"))
  def test_decode_matches_reference(self, codec, dtype):
    # C = 128 runs two token tiles of 64 per (layer, kv head).
    c = 128
    d = jnp.dtype(dtype)
    x = jnp.asarray(synthetic_kv(2, c), d)
    payload = kc.RawPayload(x) if codec == codecs.RAW else kc.encode_reference(x, codec, 1 if (
        codec == codecs.CACHEGEN) else 0)
    slot, start, s_max = 1, 5, c + 16
    cos, sin = rope_tables(start, c)
    cache = jnp.full((L, 2, s_max, K, H), jnp.nan, d)
    want_k, want_v = kc.kv_decode_reference(payload, cache, cache, slot, start, cos, sin)
    got_k, got_v = kc.kv_decode(payload, jnp.copy(cache), jnp.copy(cache), slot, start, cos, sin,
                                interpret=INTERPRET, platform="cuda")
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == "float32" else dict(rtol=2 ** -7, atol=1e-6)
    for want, got in ((want_k, got_k), (want_v, got_v)):
      w, g = np.asarray(want, np.float32), np.asarray(got, np.float32)
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w))  # untouched slots stay NaN
      np.testing.assert_allclose(g[~np.isnan(w)], w[~np.isnan(w)], **tol)

  def test_round_half_even_matches_jnp_round(self):
    x = jnp.asarray(np.concatenate([np.arange(-8, 8, 0.25), [0.5, 1.5, 2.5, -0.5, -2.5, 1e7 + 0.5,
                                                              3.4e38, -3.4e38, 0.0, -0.0]]),
                    jnp.float32)
    np.testing.assert_array_equal(np.asarray(gpu.round_half_even(x)), np.asarray(jnp.round(x)))

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
    payload = jax.eval_shape(lambda x: kc.encode_reference(x, codec, level), x)
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
