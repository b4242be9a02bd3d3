"""The default dtype per platform (`kvjax.config.options.resolve_dtype`): float32 on the CPU,
bfloat16 weights and KV on GPU and TPU, decided from the platform's name (no device needed)."""

import jax.numpy as jnp
from absl.testing import absltest, parameterized

from kvjax.config import options
from kvjax.entrypoints import llm


class DtypeDefaultTest(parameterized.TestCase):

  @parameterized.parameters(("cpu", "float32"), ("gpu", "bfloat16"), ("cuda", "bfloat16"),
                            ("rocm", "bfloat16"), ("tpu", "bfloat16"))
  def test_auto_per_platform(self, platform, want):
    self.assertEqual(options.resolve_dtype("auto", platform), want)

  @parameterized.parameters(("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("f32", "float32"),
                            ("float32", "float32"))
  def test_explicit_name_wins_everywhere(self, name, want):
    for platform in ("cpu", "gpu", "tpu"):
      self.assertEqual(options.resolve_dtype(name, platform), want)

  def test_llm_resolves_through_the_same_table(self):
    self.assertEqual(llm.resolve_dtype("auto", "cpu"), jnp.float32)
    self.assertEqual(llm.resolve_dtype("auto", "gpu"), jnp.bfloat16)
    self.assertEqual(llm.resolve_dtype("auto", "tpu"), jnp.bfloat16)
    self.assertEqual(llm.resolve_dtype("f32", "gpu"), jnp.float32)

  def test_bad_names_raise(self):
    with self.assertRaisesRegex(ValueError, "float16"):
      options.resolve_dtype("float16", "cpu")
    with self.assertRaisesRegex(ValueError, "unknown platform 'metal'"):
      options.resolve_dtype("auto", "metal")


if __name__ == "__main__":
  absltest.main()
