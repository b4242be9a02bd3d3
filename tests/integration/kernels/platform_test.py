"""Kernels choose by the target platform (`kvjax.kernels.platform`), not the host: names, the
devices' platform, explicit targets, and wrappers that refuse compiled Pallas for a CPU target."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from kvjax.kernels import kv_codec
from kvjax.kernels import paged_attention as pa
from kvjax.kernels import platform as platform_lib


class PlatformTest(absltest.TestCase):

  def test_names_and_resolution(self):
    self.assertEqual(platform_lib.platform_name("gpu"), "cuda")
    self.assertEqual(platform_lib.platform_name("tpu"), "tpu")
    self.assertEqual(platform_lib.platform_of(jax.devices("cpu")), "cpu")
    self.assertEqual(platform_lib.resolve_platform(), jax.default_backend().replace("gpu", "cuda"))
    self.assertEqual(platform_lib.resolve_platform("tpu"), "tpu")  # a target, not the host
    with self.assertRaisesRegex(ValueError, "rocm"):
      platform_lib.platform_name("rocm")
    with self.assertRaisesRegex(ValueError, "platform='gpu'"):
      platform_lib.resolve_platform("gpu")

  def test_attention_implementation_follows_the_target(self):
    self.assertEqual(pa.default_implementation("tpu"), "tpu")
    self.assertEqual(pa.default_implementation("cuda"), "gpu")
    self.assertEqual(pa.default_implementation("cpu"), "reference")

  def test_compiled_pallas_for_a_cpu_target_is_refused(self):
    q = jnp.zeros((4, 2, 16))
    pool = jnp.zeros((2, 8, 2, 16))
    args = (q, pool, pool, jnp.zeros((1, 1), jnp.int32), jnp.array([4], jnp.int32),
            jnp.array([0, 4], jnp.int32), 1)
    with self.assertRaisesRegex(ValueError, "interpret=True"):
      pa.paged_attention_tpu(*args, platform="cpu")
    with self.assertRaisesRegex(ValueError, "interpret=True"):
      pa.paged_attention_gpu(*args, query_rows=16, platform="tpu")
    chunk = jnp.asarray(np.ones((1, 2, 16, 1, 8), np.float32))
    with self.assertRaisesRegex(ValueError, "use_pallas=False"):
      kv_codec.kv_encode(chunk, "int8", platform="cpu")
    payload, _ = kv_codec.kv_encode(chunk, "int8", use_pallas=False, platform="cpu")
    self.assertEqual(payload.q.shape, (1, 2, 16, 1, 8))


if __name__ == "__main__":
  absltest.main()
