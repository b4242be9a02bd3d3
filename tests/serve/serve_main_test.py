"""`python -m kvjax.serve` as a process: port 0 printed, ready line, requests, clean Ctrl-C."""

import os
import pathlib
import re
import signal
import subprocess
import sys

import httpx
import pytest
from absl.testing import absltest

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--model=tiny", "--port=0", "--cache_dir=", "--chunk_sizes=16,32", "--max_num_seqs=1"]


def start(*flags, stderr=subprocess.PIPE):
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  return subprocess.Popen([sys.executable, "-m", "kvjax.serve", *flags], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=stderr, text=True)


class ServeMainTest(absltest.TestCase):

  def test_port_zero_ready_request_and_sigint(self):
    log = open(self.create_tempfile().full_path, "w+")  # a file: stderr cannot fill a pipe
    proc = start(*TINY, "--kv_store=memory://", "--kv_chunk_size=16", "--enable_admin",
                 stderr=log)
    try:
      first = proc.stdout.readline()
      port = int(re.search(r"port (\d+)", first).group(1))
      url = f"http://127.0.0.1:{port}"
      ready = [first]
      while not ready[-1].startswith("kvjax: ready"):
        line = proc.stdout.readline()
        if not line:
          log.seek(0)
          self.fail(f"server exited: {''.join(ready)} {log.read()}")
        ready.append(line)
      self.assertIn(f"curl {url}/v1/chat/completions", proc.stdout.readline())
      self.assertEqual(httpx.get(url + "/health").status_code, 200)
      r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
          "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
      self.assertEqual(r.json()["usage"]["completion_tokens"], 3)
      self.assertEqual(httpx.post(url + "/admin/flush_kv", timeout=60).status_code, 200)
    finally:
      proc.send_signal(signal.SIGINT)
      out, _ = proc.communicate(timeout=60)
    log.seek(0)
    self.assertEqual(proc.returncode, 0, log.read())
    self.assertIn("stopping", out)

  @pytest.mark.slow
  def test_bad_flags_and_models_exit_with_a_message(self):
    proc = start(*TINY, "--kv_codec=zstd")
    _, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1)
    self.assertIn("kv_codec", err)
    proc = start("--model=no-such-model", "--port=0", "--kv_store=none")
    out, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 2)
    self.assertIn("unknown model 'no-such-model'", err)


if __name__ == "__main__":
  absltest.main()
