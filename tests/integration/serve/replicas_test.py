"""Two replicas on one S3-compatible store hit each other's chunks (issue 14, part 4).

A moto S3 server on 127.0.0.1 (a thread of this process) is the shared store. In the default
suite two `LLM` engines in this process, each with its own store client, play the replicas; a
slow test starts two `python -m kvjax.serve` processes with the same `--kv_store=s3://...` and
`--s3_endpoint_url`. Either way replica B serves replica A's document with the chunks A saved
(cached, loaded from the remote tier) and the same text as A's cold run. The replicas load every
stored chunk (`load_only`), so the cached token counts are exact; with Cake they would compute a
front whose length depends on the measured link and compute speeds.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
from unittest import mock

import httpx
import msgpack
import numpy as np
import pytest
import zmq
from absl.testing import absltest

try:
  import boto3
  import moto.server  # noqa: F401 (the server in kvjax/testing/s3.py)
except ImportError as e:
  raise ImportError("tests/integration/serve/replicas_test.py needs moto[server] and boto3: "
                    "pip install -e '.[test]'") from e

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.serve import kv_events
from kvjax.testing import vllm_hash
from kvjax.testing.s3 import MotoServer

REPO = pathlib.Path(__file__).resolve().parents[3]
BUCKET = "kvjax-replicas"
REGION = "us-east-1"
C = 16  # kv_chunk_size


def document(seed=0, n=100):
  return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


class SharedS3TestCase(absltest.TestCase):
  """moto's S3 server for the class, fake credentials in the environment, one bucket."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.moto = MotoServer()
    cls.moto.start()
    cls.endpoint = cls.moto.endpoint
    cls.aws_env = {"AWS_ACCESS_KEY_ID": "kvjax-test", "AWS_SECRET_ACCESS_KEY": "kvjax-test",
                   "AWS_REGION": REGION}
    cls.env = mock.patch.dict(os.environ, {**cls.aws_env, "AWS_ENDPOINT_URL": cls.endpoint})
    cls.env.start()
    boto3.client("s3", endpoint_url=cls.endpoint, region_name=REGION).create_bucket(
        Bucket=BUCKET)

  @classmethod
  def tearDownClass(cls):
    cls.env.stop()
    cls.moto.stop()
    super().tearDownClass()

  def stored_objects(self, prefix):
    s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION)
    return s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0)


class TwoEnginesOneStoreTest(SharedS3TestCase):

  def replica(self, prefix):
    # load_only: every stored chunk is loaded (Cake would compute a timing-dependent front).
    return real_llm("tiny", cache_dir="", chunk_sizes=(16, 32, 64), max_num_seqs=2,
                    kv_store=f"s3://{BUCKET}/{prefix}", kv_chunk_size=C, kv_merge_mode="load_only")

  def test_replica_b_serves_replica_as_document_from_the_store(self):
    a, b = self.replica("engines"), self.replica("engines")
    try:
      self.assertEqual(a.fingerprint, b.fingerprint)  # same model: same key namespace
      doc = {"prompt_token_ids": document()}
      q = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
      cold = a.generate(doc, q)[0]
      self.assertEqual(cold.num_cached_tokens, 0)
      a.flush()  # A's saves are in S3 now
      self.assertGreater(self.stored_objects("engines"), 0)
      warm = b.generate(doc, q)[0]
      self.assertEqual(warm.num_cached_tokens, C * ((100 - 1) // C))  # every full chunk but
      self.assertEqual(warm.metrics.num_loaded_tokens, 96)               # the last token's
      self.assertEqual(set(warm.metrics.loaded_from_tiers), {"remote"})
      self.assertEqual(warm.token_ids, cold.token_ids)
      self.assertEqual(warm.text, cold.text)
      # And the other way round: B's document, A loads.
      other = {"prompt_token_ids": document(1, 140)}
      b_cold = b.generate(other, q)[0]
      self.assertEqual(b_cold.num_cached_tokens, 0)
      b.flush()
      a_warm = a.generate(other, q)[0]
      self.assertEqual(a_warm.num_cached_tokens, C * ((140 - 1) // C))
      self.assertEqual(set(a_warm.metrics.loaded_from_tiers), {"remote"})
      self.assertEqual(a_warm.token_ids, b_cold.token_ids)
    finally:
      a.close()
      b.close()


def start_server(env, *flags, log):
  env = {**os.environ, **env,
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  env.pop("AWS_ENDPOINT_URL", None)  # the flag must be enough
  proc = subprocess.Popen([sys.executable, "-m", "kvjax.serve", "--model=tiny", "--port=0",
                           "--cache_dir=", "--chunk_sizes=16,32,64", "--max_num_seqs=2",
                           "--enable_admin", *flags], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=log, text=True)
  port = int(re.search(r"port (\d+)", proc.stdout.readline()).group(1))
  lines = [proc.stdout.readline()]
  while lines[-1] and not lines[-1].startswith("kvjax: ready"):
    lines.append(proc.stdout.readline())
  if not lines[-1]:
    log.seek(0)
    raise AssertionError(f"server exited: {log.read()}")
  return proc, f"http://127.0.0.1:{port}", "".join(lines)


def stop_server(proc):
  proc.send_signal(signal.SIGINT)
  proc.communicate(timeout=120)
  return proc.returncode


@pytest.mark.slow
class TwoServersOneStoreTest(SharedS3TestCase):

  def replayed_stored_hashes(self, endpoint):
    """Block hashes of every `BlockStored` a replay from sequence 0 returns, in order."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    hashes = []
    try:
      sock.send_multipart([b"", (0).to_bytes(8, "big")])
      while True:
        self.assertTrue(sock.poll(30_000), "no replay answer")
        _, seq, payload = sock.recv_multipart()
        if seq == kv_events.END_SEQ:
          return hashes
        for ev in msgpack.unpackb(payload)[1]:
          if ev[0] == "BlockStored":
            hashes.extend(ev[1])
    finally:
      sock.close()

  def test_replica_b_serves_replica_as_document(self):
    flags = (f"--kv_store=s3://{BUCKET}/servers", f"--kv_chunk_size={C}",
             "--kv_merge_mode=load_only",
             f"--s3_endpoint_url={self.endpoint}", f"--s3_region={REGION}")
    logs = [open(self.create_tempfile().full_path, "w+") for _ in range(2)]
    procs = []
    try:
      events = ("--kv_events_endpoint=tcp://127.0.0.1:*", "--kv_events_topic=kv@pod-a@tiny",
                "--kv_events_replay_endpoint=tcp://127.0.0.1:*", "--kv_events_hash_seed=42")
      procs.append(start_server(self.aws_env, *flags, *events, log=logs[0]))
      procs.append(start_server(self.aws_env, *flags, log=logs[1]))
      body = {"model": "tiny", "prompt": document(), "max_tokens": 8, "temperature": 0,
              "ignore_eos": True}
      (_, url_a, out_a), (_, url_b, _) = procs
      cold = httpx.post(url_a + "/v1/completions", json=body, timeout=120).json()
      self.assertEqual(httpx.post(url_a + "/admin/flush_kv", timeout=120).status_code, 200)
      warm = httpx.post(url_b + "/v1/completions", json=body, timeout=120).json()
      self.assertEqual(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
      self.assertEqual(warm["usage"]["prompt_tokens_details"]["cached_tokens"], 96)
      self.assertEqual(warm["kvjax"]["loaded_from_tiers"], {"remote": 96 // C})
      self.assertEqual(warm["choices"][0]["text"], cold["choices"][0]["text"])
      # Replica A published its device blocks; a replay from 0 returns them (no slow joiner).
      replay = re.search(r"replays on (\S+)", out_a).group(1)
      stored = self.replayed_stored_hashes(replay)
      self.assertEqual(stored[:6], vllm_hash.block_keys(document(), "42", 16)[:6])
    finally:
      codes = [stop_server(p) for p, _, _ in procs]
    for code, log in zip(codes, logs):
      log.seek(0)
      self.assertEqual(code, 0, log.read())


if __name__ == "__main__":
  absltest.main()
