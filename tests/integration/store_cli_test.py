"""Tests of `python -m kvjax.store {ls,du,verify,gc}` on small file and ocdbt+file stores."""

import io
import json
import os
import pathlib
import subprocess
import sys
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from kvjax.storage.backends import chunk_store
from kvjax.storage.format import keys
from kvjax.storage.format.types import KVLayout
from kvjax.store import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
C = 4
LAYOUT = KVLayout(num_layers=2, chunk_size=C, num_kv_heads=2, head_dim=8, dtype="float32")
NS_A = keys.KeyNamespace("model-a", "float32", 1, C)
NS_B = keys.KeyNamespace("model-b", "float32", 1, C)
TOKENS = list(range(1000, 1000 + 4 * C))


def run_cli(*argv):
  """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
  out, err = io.StringIO(), io.StringIO()
  rc = cli.main(["kvjax.store", *argv], stdout=out, stderr=err)
  return rc, out.getvalue(), err.getvalue()


class StoreCliTest(parameterized.TestCase):

  def build(self, backend):
    """A store with chunks a0..a2 (namespace A; a1 corrupted), b0 (namespace B), one orphan.

    Returns:
      The store URL.
    """
    tmp = self.create_tempdir().full_path
    self.dir = os.path.join(tmp, "store")
    url = {"file": self.dir, "ocdbt": f"ocdbt+file://{self.dir}"}[backend]
    store = chunk_store.ChunkStore(url)
    self.a = keys.chunk_hashes(NS_A, TOKENS)  # 4 chunks; a[3] becomes the orphan.
    self.b = keys.chunk_hashes(NS_B, TOKENS[:C])
    rng = np.random.default_rng(0)

    def kv():
      return rng.standard_normal(LAYOUT.shape, dtype=np.float32)

    parent = NS_A.root_hash()
    for i, h in enumerate(self.a):
      self.assertTrue(store.put_sync(h, parent, TOKENS[i * C:(i + 1) * C], NS_A.root_hash(),
                                     kv()))
      parent = h
    self.assertTrue(store.put_sync(self.b[0], NS_B.root_hash(), TOKENS[:C], NS_B.root_hash(),
                                   kv()))

    async def damage():
      root = await store.kvstore()
      # Corrupt a[1]: flip a bit inside layer 0's values.
      shard = [k.decode() for k in await root.list()
               if k.decode().startswith(f"data/{self.a[1]}/raw-")]
      self.assertLen(shard, 1)
      data = bytearray((await root.read(shard[0])).value)
      data[5] ^= 0x40
      await root.write(shard[0], bytes(data))
      # Orphan a[3]'s data object: drop its record.
      await root.write(chunk_store.index_key(self.a[3]), None)
      self.orphan = [k.decode() for k in await root.list()
                     if k.decode().startswith(f"data/{self.a[3]}/")]
      self.orphan_bytes = sum([len((await root.read(k)).value) for k in self.orphan])

    chunk_store.run_sync(damage())
    store.close()
    self.ns_a, self.ns_b = NS_A.root_hash(), NS_B.root_hash()
    return url

  def test_ls_shows_a_stored_tails_real_tokens(self):
    url = os.path.join(self.create_tempdir().full_path, "store")
    store = chunk_store.ChunkStore(url)
    root = NS_A.root_hash()
    tail = keys.tail_hash(root, TOKENS[:2])
    kv = np.zeros(LAYOUT.shape, np.float32)
    self.assertTrue(store.put_sync(tail, root, keys.tail_token_ids(TOKENS[:2], C), root, kv))
    store.close()
    rc, out, err = run_cli("ls", "--store", url)
    self.assertEqual((rc, err), (0, ""))
    self.assertEqual(out.splitlines()[1].split()[:3], [tail[:12], root[:12], "2/4"])

  @parameterized.parameters("file", "ocdbt")
  def test_ls(self, backend):
    url = self.build(backend)
    rc, out, err = run_cli("ls", "--store", url)
    self.assertEqual((rc, err), (0, ""))
    lines = out.splitlines()
    self.assertLen(lines, 1 + 4)  # Header, a0, a1, a2, b0.
    self.assertTrue(lines[0].startswith("chunk "))
    want = sorted([*self.a[:3], self.b[0]])
    self.assertEqual([line.split()[0] for line in lines[1:]], [h[:12] for h in want])
    line = next(line for line in lines if line.startswith(self.b[0][:12]))
    self.assertEqual(line.split(), [self.b[0][:12], self.ns_b[:12], "4", "2,4,2,8,float32",
                                    "raw/0/1024"])

    rc, out, _ = run_cli("ls", "--store", url, "--namespace", self.ns_a[:8], "--json")
    self.assertEqual(rc, 0)
    records = json.loads(out)
    self.assertEqual([r["chunk_hash"] for r in records], sorted(self.a[:3]))
    self.assertEqual({r["namespace"] for r in records}, {self.ns_a})
    self.assertEqual(records[0]["layout"], {"num_layers": 2, "chunk_size": 4, "num_kv_heads": 2,
                                            "head_dim": 8, "dtype": "float32"})

  @parameterized.parameters("file", "ocdbt")
  def test_du(self, backend):
    url = self.build(backend)
    rc, out, err = run_cli("du", "--store", url)
    self.assertEqual((rc, err), (0, ""))
    lines = out.splitlines()
    ns_lines = sorted([f"  namespace {self.ns_a[:12]}: 3 chunks",
                       f"  namespace {self.ns_b[:12]}: 1 chunks"],
                      key=lambda s: s.split()[1])
    self.assertEqual(lines[:4], ["records: 4", *ns_lines,
                                 "stored bytes (values): 4096 (4.0 KiB)"])
    self.assertTrue(lines[4].startswith("on disk: "), lines[4])
    self.assertEqual(lines[5], f"orphaned data objects: 1 ({self.orphan_bytes} bytes)")
    self.assertLen(lines, 6)

    rc, out, _ = run_cli("du", "--store", url, "--json", "--namespace", self.ns_b)
    self.assertEqual(rc, 0)
    usage = json.loads(out)
    self.assertEqual(usage["records"], 1)
    self.assertEqual(usage["chunks_per_namespace"], {self.ns_b: 1})
    self.assertEqual(usage["stored_bytes"], 1024)
    self.assertEqual((usage["orphans"], usage["orphan_bytes"]), (1, self.orphan_bytes))
    self.assertGreater(usage["disk_bytes"], 5 * 1024)  # 5 data objects, 4 records.
    walked = sum(p.stat().st_size for p in pathlib.Path(self.dir).rglob("*") if p.is_file())
    self.assertEqual(usage["disk_bytes"], walked)

  @parameterized.parameters("file", "ocdbt")
  def test_verify_and_delete_bad(self, backend):
    url = self.build(backend)
    rc, out, err = run_cli("verify", "--store", url)
    self.assertEqual((rc, err), (1, ""))
    self.assertEqual(out.splitlines(), [f"BAD {self.a[1]} checksum_mismatch",
                                        "verified 4 chunks: 3 ok, 1 bad"])

    rc, out, _ = run_cli("verify", "--store", url, "--namespace", self.ns_b)
    self.assertEqual((rc, out), (0, "verified 1 chunks: 1 ok, 0 bad\n"))

    rc, out, _ = run_cli("verify", "--store", url, "--delete_bad", "--json")
    self.assertEqual(rc, 1)
    self.assertEqual(json.loads(out), {"checked": 4, "bad": [
        {"chunk_hash": self.a[1], "reason": "checksum_mismatch", "detail": "",
         "deleted": True}]})
    rc, out, _ = run_cli("verify", "--store", url)
    self.assertEqual((rc, out), (0, "verified 3 chunks: 3 ok, 0 bad\n"))
    # The bad chunk's record and data are gone; only the orphan is left for gc.
    rc, out, _ = run_cli("du", "--store", url, "--json")
    self.assertEqual((json.loads(out)["records"], json.loads(out)["orphans"]), (3, 1))

  @parameterized.parameters("file", "ocdbt")
  def test_gc(self, backend):
    url = self.build(backend)
    obj = "/".join(self.orphan[0].split("/")[:3])
    rc, out, err = run_cli("gc", "--store", url, "--dry_run")
    self.assertEqual((rc, err), (0, ""))
    self.assertEqual(out.splitlines(), [
        f"would remove {obj} ({self.orphan_bytes} bytes)",
        f"would remove 1 unreferenced data objects ({self.orphan_bytes} bytes)"])
    rc, out, _ = run_cli("gc", "--store", url)
    self.assertEqual((rc, out), (0, "removed 1 unreferenced data objects\n"))
    rc, out, _ = run_cli("gc", "--store", url, "--dry_run", "--json")
    self.assertEqual((rc, json.loads(out)), (0, {"dry_run": True, "orphans": []}))
    # gc removed only garbage: the referenced chunks still verify (a1 still bad).
    rc, out, _ = run_cli("verify", "--store", url)
    self.assertEqual((rc, out.splitlines()[-1]), (1, "verified 4 chunks: 3 ok, 1 bad"))

  def test_malformed_record(self):
    url = self.build("file")
    path = pathlib.Path(self.dir, "index", f"{self.b[0]}.json")
    path.write_bytes(b"{not json")
    rc, out, _ = run_cli("ls", "--store", url)
    self.assertEqual((rc, out.splitlines()[-1]), (0, f"{self.b[0][:12]}  MALFORMED RECORD"))
    rc, out, _ = run_cli("verify", "--store", url, "--delete_bad")
    self.assertEqual(rc, 1)
    self.assertEqual(sorted(out.splitlines()[:-1]), sorted([
        f"BAD {self.a[1]} checksum_mismatch (deleted)",
        f"BAD {self.b[0]} corrupt (deleted)  malformed index record"]))
    self.assertEqual(out.splitlines()[-1], "verified 4 chunks: 2 ok, 2 bad, 2 deleted")
    self.assertFalse(path.exists())
    # The file kvstore leaves empty directories behind; no data file is left.
    self.assertEqual([p for p in pathlib.Path(self.dir, "data", self.b[0]).rglob("*")
                      if p.is_file()], [])

  @parameterized.named_parameters(
      ("missing_dir", ["ls", "--store", "/nonexistent/kvjax-store"], "does not exist"),
      ("missing_ocdbt_dir", ["du", "--store", "ocdbt+file:///nonexistent/kv"], "does not exist"),
      ("unknown_scheme", ["ls", "--store", "gopher://x/y"], "unknown store URL scheme 'gopher'"),
      ("no_command", ["--store", "/tmp"], "want one command"),
      ("two_commands", ["ls", "du"], "want one command"),
      ("unknown_command", ["fsck"], "want one command"),
      ("unknown_flag", ["ls", "--colour"], "colour"),
  )
  def test_errors_exit_2_with_one_line(self, argv, message):
    rc, out, err = run_cli(*argv)
    self.assertEqual((rc, out), (2, ""))
    self.assertLen(err.splitlines(), 1, err)
    self.assertIn(message, err)

  def test_default_store_is_the_cache_roots(self):
    # Without --store: <$KVJAX_CACHE_DIR>/store, the server's default store, not ~/.cache.
    self.build("file")  # self.dir = <tmp>/store
    with mock.patch.dict(os.environ, {"KVJAX_CACHE_DIR": os.path.dirname(self.dir)}):
      rc, out, err = run_cli("ls")
    self.assertEqual(rc, 0, err)
    self.assertLen(out.splitlines(), 5, out)  # the header and the store's 4 records
    self.assertIn(self.a[0][:12], out)

  def test_help(self):
    rc, out, _ = run_cli("--help")
    self.assertEqual(rc, 0)
    for word in ("ls", "du", "verify", "gc", "--store", "--delete_bad", "--dry_run"):
      self.assertIn(word, out)

  def test_subprocess(self):
    url = self.build("file")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "kvjax.store", "verify", "--store", url],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    self.assertEqual(proc.returncode, 1, proc.stderr)
    self.assertEqual(proc.stdout.splitlines(), [f"BAD {self.a[1]} checksum_mismatch",
                                                "verified 4 chunks: 3 ok, 1 bad"])
    proc = subprocess.run([sys.executable, "-m", "kvjax.store", "ls", "--store",
                           "s3x://bucket"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    self.assertEqual(proc.returncode, 2)
    self.assertEqual(proc.stdout, "")
    self.assertNotIn("Traceback", proc.stderr)
    self.assertEqual(proc.stderr.strip().splitlines(),
                     ["python -m kvjax.store ls: unknown store URL scheme 's3x' in 's3x://bucket'"])


if __name__ == "__main__":
  absltest.main()
