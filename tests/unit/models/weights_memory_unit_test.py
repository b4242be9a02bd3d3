"""A model whose weights do not fit the device is refused before its weights load
(`kvjax.models.runner.weights_memory`, `LLM(...)`): parameter bytes from the checkpoint's shapes and
the resolved dtype, against a device memory figure injected here (no accelerator needed)."""

import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest

from kvjax.entrypoints import llm as llm_module
from kvjax.entrypoints import root
from kvjax.models.loading import checkpoint, gguf_loader, registry
from kvjax.models.nn import config
from kvjax.models.runner.weights_memory import (check_weights_fit, device_free_bytes, param_count,
                                                param_nbytes)
from kvjax.testing.engines import fake_runner_seam

GIB = 2**30


class FakeDevice:
  """A device that reports `stats` from `memory_stats()` (None: as the CPU)."""

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


class ParamBytesTest(absltest.TestCase):

  def test_counts_from_the_shapes(self):
    # SmolLM2-135M (tied embeddings), LLaMA-3.1-8B (untied lm_head): published sizes.
    self.assertEqual(param_count(config.smollm2_135m()), 134_515_008)
    self.assertEqual(param_count(config.llama3_8b()), 8_030_261_248)
    self.assertEqual(param_nbytes(config.smollm2_135m(), jnp.float32), 538_060_032)
    self.assertEqual(param_nbytes(config.smollm2_135m(), jnp.bfloat16), 269_030_016)
    self.assertEqual(param_nbytes(config.llama3_8b(), jnp.bfloat16), 16_060_522_496)

  def test_the_default_gguf_config_reads_without_weights(self):
    cfg = registry.load_config()  # the GGUF's header only
    self.assertEqual(param_count(cfg), 134_515_008)
    self.assertEqual(registry.load_config("tiny"), config.tiny())

  def test_a_converted_entry_gives_the_config_without_parsing(self):
    cache_dir = self.create_tempdir().full_path
    gguf = gguf_loader.find_smollm2_gguf()
    entry = checkpoint.entry_dir(cache_dir, [gguf])
    os.makedirs(entry)
    want = config.tiny(name="from-the-cache")
    with open(os.path.join(entry, "meta.json"), "w") as f:
      json.dump({"config": json.loads(want.to_json())}, f)
    self.assertEqual(registry.load_config(cache_dir=cache_dir), want)
    with open(os.path.join(entry, "meta.json"), "w") as f:
      f.write("{truncated")  # unreadable: the GGUF's header instead
    self.assertEqual(param_count(registry.load_config(cache_dir=cache_dir)), 134_515_008)


class DeviceFreeBytesTest(absltest.TestCase):

  def test_limit_less_in_use(self):
    self.assertEqual(device_free_bytes(FakeDevice({"bytes_limit": 80 * GIB,
                                                   "bytes_in_use": GIB})), 79 * GIB)
    self.assertEqual(device_free_bytes(FakeDevice({"bytes_limit": 16 * GIB})), 16 * GIB)

  def test_none_where_not_reported(self):
    self.assertIsNone(device_free_bytes(FakeDevice(None)))
    self.assertIsNone(device_free_bytes(FakeDevice({"bytes_in_use": 5})))
    if jax.default_backend() == "cpu":
      self.assertIsNone(device_free_bytes(jax.local_devices()[0]))


class CheckWeightsFitTest(absltest.TestCase):

  def test_refuses_naming_both_figures(self):
    with self.assertRaises(ValueError) as e:
      check_weights_fit(config.llama3_8b(), jnp.bfloat16, 16_000_000_000, where="cuda:0")
    msg = str(e.exception)
    self.assertIn("Llama-3.1-8B's weights do not fit cuda:0", msg)
    self.assertIn("8,030,261,248 parameters in bfloat16 take 14.96 GiB (16,060,522,496 bytes)",
                  msg)
    self.assertIn("cuda:0 has 14.90 GiB (16,000,000,000 bytes) free", msg)
    self.assertNotIn("dtype='bfloat16'", msg)  # already bf16: no such hint

  def test_float32_hints_bfloat16(self):
    with self.assertRaisesRegex(ValueError, r"538,060,032 bytes.*dtype='bfloat16'"):
      check_weights_fit(config.smollm2_135m(), jnp.float32, 500_000_000)

  def test_fits_at_the_exact_figure_and_per_device_share(self):
    cfg = config.llama3_8b()
    check_weights_fit(cfg, jnp.bfloat16, 16_060_522_496)
    check_weights_fit(cfg, jnp.bfloat16, 8_030_261_248, tensor_parallel_size=2)
    with self.assertRaisesRegex(ValueError, "8,030,261,248 bytes\\) per device over "
                                "tensor_parallel_size=2"):
      check_weights_fit(cfg, jnp.bfloat16, 8_030_261_247, tensor_parallel_size=2)
    check_weights_fit(cfg, jnp.float32, None)  # not reported (CPU): no check


class LLMRefusesBeforeLoadingTest(absltest.TestCase):
  """`LLM(...)` with the device's free memory injected (`device_free_bytes` replaced)."""

  def build(self, free_bytes, model="tiny"):
    events = []
    with mock.patch.object(root, "device_free_bytes", return_value=free_bytes):
      llm = llm_module.LLM(model, cache_dir="", compile_on_init=False, dtype="float32",
                           startup_progress=events.append)
    return llm, events

  def test_too_small_refuses_before_any_weight_loads(self):
    with mock.patch.object(root, "load_model",
                           side_effect=AssertionError("weights loaded")) as load:
      with self.assertRaisesRegex(
          ValueError, r"SmolLM2-135M-Instruct's weights do not fit .*134,515,008 parameters "
          r"in float32 take 0.50 GiB \(538,060,032 bytes\), but .* has 0.25 GiB "
          r"\(268,435,456 bytes\) free"):
        self.build(GIB // 4, model="SmolLM2-135M-Instruct")
      with self.assertRaisesRegex(ValueError, r"tiny's weights .* \(216,000 bytes\).* "
                                  r"\(215,999 bytes\) free"):
        self.build(215_999)
    load.assert_not_called()

  def test_enough_memory_builds(self):
    with fake_runner_seam():
      llm, events = self.build(216_000)
    try:
      self.assertEqual(events[0].phase, "weights")
      self.assertEqual(llm.model_config, config.tiny())
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
