"""`python -m kvjax.serve` as a process: port 0 printed, ready line, requests, clean Ctrl-C."""

import os
import pathlib
import re
import signal
import subprocess
import sys

import httpx
import jax.numpy as jnp
import openai
import pytest
from absl.testing import absltest

from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.models.loading.registry import load_model

REPO = pathlib.Path(__file__).resolve().parents[3]
TINY = ["--model=tiny", "--port=0", "--cache_dir=", "--chunk_sizes=16,32", "--max_num_seqs=1"]


def start(*flags, stderr=subprocess.PIPE, env=None):
  env = {**os.environ, **(env or {}),
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
    self.assertIn("kvjax: stopping (writing pending KV saves)", out)

  def test_a_bad_flag_value_is_one_line(self):
    # Found by a fresh-user check: absl's usage text (every flag, ~200 lines) came first. The
    # process once; the other bad values and `main`'s unexpected arguments are checked
    # in-process (tests/unit/serve/serve_main_flags_unit_test.py).
    proc = start("--model=tiny", "--port=0", "--kv_lookahead_window=-3")
    out, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1, err)
    self.assertIn("error: kv_lookahead_window=-3 must be an int", err)
    self.assertEqual(err.count("\n"), 1, err)  # one line: no traceback
    self.assertNotIn("--kv_store:", err)  # no flag listing
    self.assertEqual(out, "")  # nothing listened

  # A server subprocess (~8 s); the key and the limits are also tested in-process
  # (serve_hardening_test), the environment variable only here.
  @pytest.mark.slow
  def test_api_key_from_the_environment_and_request_limits(self):
    log = open(self.create_tempfile().full_path, "w+")
    proc = start(*TINY, "--kv_store=none", "--max_request_bytes=2000",
                 "--max_waiting_requests=0", stderr=log, env={"KVJAX_API_KEY": "k3y"})
    try:
      port = int(re.search(r"port (\d+)", proc.stdout.readline()).group(1))
      url = f"http://127.0.0.1:{port}"
      line = proc.stdout.readline()
      while line and not line.startswith("kvjax: ready"):
        line = proc.stdout.readline()
      self.assertTrue(line, "server exited")
      self.assertIn('-H "Authorization: Bearer $KVJAX_API_KEY"', proc.stdout.readline())
      self.assertEqual(httpx.get(url + "/health").status_code, 200)  # open without the key
      self.assertEqual(httpx.get(url + "/v1/models").status_code, 401)
      client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
      self.assertEqual(client.completions.create(model="tiny", prompt="hi",
                                                 max_tokens=2).usage.completion_tokens, 2)
      with self.assertRaises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="a" * 2000, max_tokens=1)
      self.assertEqual((e.exception.status_code, e.exception.code), (413, "request_too_large"))
      r = httpx.get(url + "/health", headers={"Host": "evil.example"})
      self.assertEqual(r.json()["error"]["code"], "invalid_host")
    finally:
      proc.send_signal(signal.SIGINT)
      proc.communicate(timeout=60)
    log.seek(0)
    self.assertEqual(proc.returncode, 0, log.read())

  # A server subprocess (~8 s); the paged server is also tested in-process (paged_serve_test).
  @pytest.mark.slow
  def test_paged_layout_flags(self):
    block_nbytes = paged_block_nbytes(load_model("tiny").config, 16, jnp.float32)
    log = open(self.create_tempfile().full_path, "w+")
    proc = start(*TINY, "--kv_store=none", "--block_size=16",
                 f"--kv_cache_memory_bytes={12 * block_nbytes}", "--no_enable_prefix_caching",
                 stderr=log)
    try:
      port = int(re.search(r"port (\d+)", proc.stdout.readline()).group(1))
      url = f"http://127.0.0.1:{port}"
      line = proc.stdout.readline()
      while line and not line.startswith("kvjax: ready"):
        line = proc.stdout.readline()
      log.seek(0)
      self.assertTrue(line, f"server exited: {log.read()}")
      body = {"model": "tiny", "prompt": list(range(40)), "max_tokens": 2}
      exts = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["kvjax"]
              for _ in range(2)]
      self.assertEqual([e["tokens_device_cached"] for e in exts], [0, 0])
      text = httpx.get(url + "/metrics").text
      self.assertIn('kvjax_kv_cache_blocks{state="total"} 12.0', text)
      self.assertIn("vllm:kv_cache_usage_perc 0.0", text)
      self.assertIn("vllm:prefix_cache_queries_total 0.0", text)  # off: no lookups
      self.assertIn("vllm:prefix_cache_hits_total 0.0", text)
    finally:
      proc.send_signal(signal.SIGINT)
      proc.communicate(timeout=60)
    log.seek(0)
    self.assertEqual(proc.returncode, 0, log.read())

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
    proc = start(*TINY, "--auth_health_and_metrics", env={"KVJAX_API_KEY": ""})
    _, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1)
    self.assertIn("--auth_health_and_metrics needs --api_key", err)
    proc = start(*TINY, "--allowed_origins=app.example")
    _, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1)
    self.assertIn("not an origin", err)
    proc = start(*TINY, "--kv_cache_layout=paged")  # the option is gone: one KV layout
    _, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1)
    self.assertIn("kv_cache_layout", err)
    proc = start(*TINY, "--long_prefill_token_threshold=-1")
    _, err = proc.communicate(timeout=120)
    self.assertEqual(proc.returncode, 1)
    self.assertIn("long_prefill_token_threshold=-1 must be an int >= 0", err)


if __name__ == "__main__":
  absltest.main()
