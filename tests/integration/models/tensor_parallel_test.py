"""Tensor parallelism (issue 14) on host-platform CPU devices: every N gives the one-device
greedy tokens and first-token log-probs (1e-4, f32), cold and from a store chunk saved at
another N; sizes that do not split the heads are refused at LLM(...).

The device count is fixed when jax starts, so the checks run in one subprocess
(`kvjax.testing.tp_driver`) with `--xla_force_host_platform_device_count`; this process keeps
its single device.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from absl.testing import absltest

from kvjax.models.runner import sharding
from kvjax.models.nn.config import tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_driver(devices: int, *args: str) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "tp.json")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvjax.testing.tp_driver", f"--out={out}",
                           *args], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
      raise AssertionError(f"tp_driver failed:\n{proc.stderr[-4000:]}")
    with open(out, encoding="utf-8") as f:
      return json.load(f)


class TPAssertions(absltest.TestCase):

  def assert_same(self, got, want, what):
    self.assertEqual([o["token_ids"] for o in got], [o["token_ids"] for o in want], what)
    for g, w in zip(got, want):
      self.assertEqual(set(g["logprobs"]), set(w["logprobs"]), what)
      for k, v in w["logprobs"].items():
        self.assertAlmostEqual(g["logprobs"][k], v, delta=1e-4, msg=what)

  def assert_ring(self, result, sizes, lengths, chunk):
    runs = result["runs"]
    want = runs["1"]["cold"]
    # Every whole stored chunk before the prompt's last token is loaded (that token computes).
    cached = [(n - 1) // chunk * chunk for n in lengths]
    for n in sizes:
      run = runs[str(n)]
      self.assert_same(run["cold"], want, f"cold at N={n}")
      self.assertEqual([o["num_cached_tokens"] for o in run["cold"]], [0] * len(lengths))
      self.assert_same(run["hit"], want, f"N={run['hit_by']} hitting chunks saved at N={n}")
      self.assertEqual([o["num_cached_tokens"] for o in run["hit"]], cached,
                       f"N={run['hit_by']} hitting chunks saved at N={n}")


class TensorParallelTest(TPAssertions):

  def test_sizes_checked_without_devices(self):
    cfg = tiny(n_heads=8, n_kv_heads=2)
    for n in (1, 2, 4, 8):
      sharding.check_tensor_parallel_size(cfg, n, num_devices=8)
    for n, why in ((3, "attention heads"), (16, "attention heads"), (0, "positive int")):
      with self.assertRaisesRegex(ValueError, why):
        sharding.check_tensor_parallel_size(cfg, n, num_devices=8)
    with self.assertRaisesRegex(ValueError, "needs 8 devices"):
      sharding.check_tensor_parallel_size(cfg, 8, num_devices=4)
    # A size the model refuses is named as such, not with advice to add devices.
    with self.assertRaisesRegex(ValueError, "attention heads"):
      sharding.check_tensor_parallel_size(cfg, 3, num_devices=1)
    with self.assertRaisesRegex(ValueError, "KV heads"):  # 12 q heads, 3 KV heads, N = 2
      sharding.check_tensor_parallel_size(tiny(n_heads=12, n_kv_heads=3), 2, num_devices=8)

  @pytest.mark.slow  # about 36 s of the default suite's 10 minutes; run with -m slow
  def test_tiny_at_8_cold_and_across_store(self):
    """N = 8 over 2 KV heads (each repeated 4 times), one subprocess."""
    lengths = ("5", "130")
    r = run_driver(8, "--model=tiny-tp", "--sizes=1,8", f"--lengths={','.join(lengths)}",
                   "--refuse=tiny:4,tiny-tp:3,tiny-tp:16",
                   "--payload_codecs=raw,int8,int4,cachegen")
    self.assertEqual(r["devices"], 8)
    self.assert_ring(r, (1, 8), [int(n) for n in lengths], 32)
    # Over 8 devices, the pool holds 4 copies of each of the 2 KV heads, one per device.
    self.assertEqual(r["runs"]["8"]["pool_heads"], 8)
    self.assertEqual(r["runs"]["8"]["pool_shard_heads"], 1)
    # Stored payloads decoded per shard (the codec kernel on each device's heads) give the
    # blocks one device decodes, for every codec.
    want = r["payload_blocks"]["1"]
    for n in ("8",):
      for codec, blocks in r["payload_blocks"][n].items():
        np.testing.assert_allclose(blocks, want[codec], atol=1e-5, rtol=0,
                                   err_msg=f"{codec} at N={n}")
    refused = r["refused"]
    self.assertIn("does not divide tiny's 6 attention heads", refused["tiny:4"])
    self.assertIn("does not divide tiny-tp's 8 attention heads", refused["tiny-tp:3"])
    self.assertIn("does not divide tiny-tp's 8 attention heads", refused["tiny-tp:16"])

  @pytest.mark.slow
  def test_tiny_at_2_and_4(self):
    r = run_driver(8, "--model=tiny-tp", "--sizes=1,2,4", "--lengths=5,40,130",
                   "--payload_codecs=raw,int8,int4,cachegen")
    self.assert_ring(r, (1, 2, 4), [5, 40, 130], 32)
    self.assertEqual(r["runs"]["2"]["pool_shard_heads"], 1)  # 2 KV heads split over 2
    self.assertEqual(r["runs"]["4"]["pool_heads"], 4)  # each repeated twice over 4
    for n in ("2", "4"):
      for codec, blocks in r["payload_blocks"][n].items():
        np.testing.assert_allclose(blocks, r["payload_blocks"]["1"][codec], atol=1e-5, rtol=0,
                                   err_msg=f"{codec} at N={n}")

  @pytest.mark.slow
  def test_smollm2_at_3_cold_and_across_store(self):
    r = run_driver(3, "--model=SmolLM2-135M-Instruct", "--sizes=1,3", "--lengths=20,100",
                   "--max_tokens=8")
    self.assert_ring(r, (1, 3), [20, 100], 32)
    self.assertEqual(r["runs"]["3"]["pool_shard_heads"], 1)  # 3 KV heads, one per device


if __name__ == "__main__":
  absltest.main()
