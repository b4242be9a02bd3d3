"""`python -m kvjax.serve` multi-host (issue 14): 2 processes x 2 host devices over 127.0.0.1,
`--tensor_parallel_size=4`; process 0 serves HTTP and answers a greedy completion with the
tokens one device gives; process 1 opens no port and exits when process 0 stops."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm

REPO = pathlib.Path(__file__).resolve().parents[3]
FLAGS = ["--model=tiny-tp", "--cache_dir=", "--chunk_sizes=16,32", "--max_num_seqs=2",
         "--kv_store=none", "--tensor_parallel_size=4", "--num_processes=2"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class MultiHostServeTest(absltest.TestCase):

  @pytest.mark.slow  # two server processes compile the tiny model over a 4-device mesh
  def test_process_zero_serves_and_process_one_follows(self):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    coord = f"--coordinator_address=127.0.0.1:{free_port()}"
    logs = [open(self.create_tempfile().full_path, "w+") for _ in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "kvjax.serve", *FLAGS, coord, f"--process_id={i}", "--port=0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE if i == 0 else logs[i], stderr=logs[i],
        text=True) for i in range(2)]
    try:
      first = procs[0].stdout.readline()
      port = int(re.search(r"port (\d+)", first).group(1))
      line = first
      while line and not line.startswith("kvjax: ready"):
        line = procs[0].stdout.readline()
      logs[0].seek(0)
      self.assertTrue(line, f"process 0 exited: {logs[0].read()[-3000:]}")
      r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
          "model": "tiny-tp", "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0})
      self.assertEqual(r.status_code, 200, r.text)
      got = r.json()["choices"][0]["text"]
    finally:
      procs[0].send_signal(signal.SIGINT)
      procs[0].communicate(timeout=120)
      procs[1].wait(timeout=120)
    for i, p in enumerate(procs):
      logs[i].seek(0)
      self.assertEqual(p.returncode, 0, f"process {i}: {logs[i].read()[-3000:]}")
    llm = real_llm("tiny-tp", cache_dir="", chunk_sizes=(16, 32), max_num_seqs=2)
    want = llm.generate("The capital of France is",
                        SamplingParams(max_tokens=8, temperature=0))[0].text
    llm.close()
    self.assertEqual(got, want)


if __name__ == "__main__":
  absltest.main()
