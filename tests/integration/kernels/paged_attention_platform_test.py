"""paged_attention's `platform` argument: "cuda" builds the Triton kernel on a CPU host (lowered
through `jax.export` at the engine's head shapes), "cpu" the reference; a bad platform raises."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax import export

from kvjax.kernels import paged_attention as pa

# (q heads, kv heads, head dim)
MODELS = {"smollm2": (9, 3, 64), "llama31_8b": (32, 8, 128)}


def shapes(n, k, h, dtype=jnp.bfloat16):
  sds = jax.ShapeDtypeStruct
  return (sds((8, n, h), dtype), sds((64, 16, k, h), dtype), sds((64, 16, k, h), dtype),
          sds((4, 16), jnp.int32), sds((4,), jnp.int32), sds((5,), jnp.int32))


class PagedAttentionPlatformTest(parameterized.TestCase):

  @parameterized.parameters(*MODELS)
  def test_cuda_lowers_on_a_cpu_host(self, model):
    fn = jax.jit(lambda *a: pa.paged_attention(*a, jnp.int32(4), platform="cuda"))
    exp = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes(*MODELS[model]))
    text = exp.mlir_module()
    self.assertIn("ragged_paged_attention_gpu", text)
    self.assertIn("__gpu$xla.gpu.triton", text)

  def test_cpu_platform_is_the_reference_and_bad_platform_raises(self):
    self.assertEqual(pa.default_implementation("cuda"), "gpu")
    self.assertEqual(pa.default_implementation("cpu"), "reference")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 4, 16)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(4, 16, 2, 16)), jnp.float32)
    args = (q, pool, pool, jnp.array([[0, 1], [2, 3]], jnp.int32), jnp.array([5, 20], jnp.int32),
            jnp.array([0, 1, 2], jnp.int32), 2)
    np.testing.assert_array_equal(np.asarray(pa.paged_attention(*args, platform="cpu")),
                                  np.asarray(pa.paged_attention_reference(*args)))
    with self.assertRaisesRegex(ValueError, "platform"):
      pa.paged_attention_gpu(*args, platform="metal")
    with self.assertRaisesRegex(ValueError, "GPU only"):
      pa.paged_attention_gpu(*args, platform="cpu")


if __name__ == "__main__":
  absltest.main()
