"""Multi-host as one program (issue 14): 2 processes over 127.0.0.1 (jax.distributed, CPU
collectives through gloo), 2 host devices each, give the same greedy tokens and first-token
log-probs (1e-4) as 1 process with 4 devices, cold and from the store chunks the run saved.

Covered: the whole `LLM` (scheduler and engine on process 0, every device call sent to process
1 by `kvjax.models.runner.multihost`), the sharded ragged step over a mesh spanning both processes,
warmup, store saves (process 0) and store-hit inserts (broadcast to every process), close.
Not covered here: the HTTP server on process 0 (flags only), lossy codecs (refused multi-host).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
from absl.testing import absltest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(num_processes: int, devices_each: int, tmp: str, name: str) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}",
             JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  out = os.path.join(tmp, f"{name}.json")
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "kvjax.testing.multihost_driver", f"--num_processes={num_processes}",
       f"--process_id={i}", f"--coordinator_address=127.0.0.1:{port}",
       f"--kv_store=file://{tmp}/{name}_store", f"--out={out}"],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for i in range(num_processes)]
  errors = []
  for i, p in enumerate(procs):
    try:
      _, err = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    if p.returncode:
      errors.append(f"process {i} exited {p.returncode}:\n{err[-3000:]}")
  if errors:
    raise AssertionError("\n".join(errors))
  with open(out, encoding="utf-8") as f:
    return json.load(f)


class MultiHostTest(absltest.TestCase):

  @pytest.mark.slow  # three processes compile the tiny model twice each: about a minute of CPU
  def test_two_processes_equal_one_with_the_same_devices(self):
    with tempfile.TemporaryDirectory() as tmp:
      one = run(1, 4, tmp, "one")
      two = run(2, 2, tmp, "two")
    self.assertEqual((one["processes"], one["devices"]), (1, 4))
    self.assertEqual((two["processes"], two["devices"]), (2, 4))
    for phase in ("cold", "hit"):
      self.assertEqual([o["token_ids"] for o in two[phase]],
                       [o["token_ids"] for o in one[phase]], phase)
      for g, w in zip(two[phase], one[phase]):
        self.assertEqual(set(g["logprobs"]), set(w["logprobs"]), phase)
        for k, v in w["logprobs"].items():
          self.assertAlmostEqual(g["logprobs"][k], v, delta=1e-4, msg=phase)
    self.assertEqual([o["token_ids"] for o in two["hit"]], [o["token_ids"] for o in two["cold"]])
    self.assertEqual([o["num_cached_tokens"] for o in two["cold"]], [0, 0, 0])
    self.assertEqual([o["num_cached_tokens"] for o in two["hit"]], [0, 32, 128])


if __name__ == "__main__":
  absltest.main()
