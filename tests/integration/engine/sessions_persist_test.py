"""Sessions that survive a restart (`SessionRegistry.set_persistence`, `SessionFiles`): a
session's last turn is a file beside a local store, so an `LLM` built later over the same store
folder extends the conversation and loads its stored tail; the hit output equals a cold run.
Files are bound to the model's fingerprint, the salt and the id; closing, expiring and evicting
delete them."""

import json
import os
import stat
import tempfile
import time

import pytest
from absl.testing import absltest

from kvjax import LLM
from kvjax.testing.engines import real_llm
from kvjax.sessions import EXTENDED, FIRST, SessionConfig, SessionFiles, SessionRegistry
from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from tests.unit.engine import sessions_persist_unit_test as unit

C = unit.C


def make_llm(store_dir: str, **kw) -> LLM:
  # No device prefix cache and load-only: every cached token is a store hit, counted exactly.
  return real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                  kv_store=f"file://{store_dir}", kv_chunk_size=C,
                  block_size=16, enable_prefix_caching=False, kv_merge_mode="load_only", **kw)


@pytest.mark.slow  # same assertions on the fake runner: sessions_persist_unit_test.py
class RestartTest(unit.RestartUnitTest):

  @classmethod
  def make_llm(cls, store_dir: str, **kw) -> LLM:
    return make_llm(store_dir, **kw)


class SessionFilesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tok = ByteTokenizer()
    self.dir = tempfile.mkdtemp()

  def registry(self, scope="fp", **config):
    reg = SessionRegistry(self.tok, SessionConfig(**config))
    reg.set_persistence(self.dir, scope=scope)
    return reg

  def turn(self, reg, sid, salt=None, user="hi", reply="ok"):
    t = reg.begin(sid, salt)
    msgs = [{"role": "user", "content": user}] if t.last is None else [
        {"role": r, "content": c} for r, c in t.last.messages] + [
            {"role": "assistant", "content": t.last.output_text},
            {"role": "user", "content": user}]
    p = reg.prompt(t, msgs)
    reg.finish(t, p, self.tok.encode(reply), reply)
    return p

  def files(self):
    return sorted(f for f in os.listdir(self.dir) if f.endswith(".json"))

  def test_a_new_registry_continues_the_session(self):
    self.turn(self.registry(), "s", "salt")
    reg = self.registry()
    self.assertEqual(self.turn(reg, "s", "salt", user="more").outcome, EXTENDED)
    self.assertEqual(reg.get("s", "salt").turns, 2)

  def test_the_file_is_private_and_keeps_no_salt(self):
    self.turn(self.registry(), "s", "secret-salt")
    (name,) = self.files()
    path = os.path.join(self.dir, name)
    self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    self.assertNotIn("secret-salt", text)
    self.assertTrue(json.loads(text)["kv_salt_is_salt"])
    self.assertNotIn("s", [n[:-5] for n in self.files()])  # named by a digest

  def test_another_model_never_reads_it(self):
    self.turn(self.registry(scope="fp-a"), "s")
    reg = self.registry(scope="fp-b")
    self.assertIsNone(reg.get("s"))
    self.assertEqual(self.turn(reg, "s").outcome, FIRST)

  def test_close_deletes_the_file_even_before_it_was_read(self):
    self.turn(self.registry(), "s")
    reg = self.registry()
    self.assertTrue(reg.close("s"))
    self.assertEqual(self.files(), [])
    self.assertFalse(self.registry().close("s"))

  def test_eviction_deletes_the_file(self):
    reg = self.registry(max_sessions=1)
    self.turn(reg, "a")
    self.turn(reg, "b")  # a is evicted
    self.assertLen(self.files(), 1)
    self.assertIsNone(self.registry(max_sessions=1).get("a"))
    self.assertIsNotNone(self.registry(max_sessions=1).get("b"))

  def test_expired_files_are_deleted(self):
    self.turn(self.registry(), "old")
    (name,) = self.files()
    path = os.path.join(self.dir, name)
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    rec["saved_at"] -= 100
    with open(path, "w", encoding="utf-8") as f:
      json.dump(rec, f)
    reg = SessionRegistry(self.tok, SessionConfig(ttl_s=50))
    reg.set_persistence(self.dir, scope="other")  # no prune by mtime yet: the file is recent
    reg.set_persistence(self.dir, scope="fp")
    self.assertIsNone(reg.get("old"))  # saved 100 s ago, TTL 50 s
    self.assertEqual(self.files(), [])
    self.assertEqual(reg.stats().expired, 1)

  def test_prune_at_start_by_age_and_count(self):
    reg = self.registry()
    for sid in ("a", "b", "c"):
      self.turn(reg, sid)
    files = SessionFiles(self.dir, "fp")
    now = time.time()
    for i, sid in enumerate(("a", "b", "c")):
      os.utime(files.path(sid, None), (now - 10 * (3 - i), now - 10 * (3 - i)))
    self.assertEqual(files.prune(ttl_s=None, max_files=2), 1)  # a, the oldest
    self.assertFalse(os.path.exists(files.path("a", None)))
    self.assertEqual(files.prune(ttl_s=15, max_files=10), 1)  # b: 20 s old
    self.assertEqual([os.path.exists(files.path(s, None)) for s in "bc"], [False, True])

  def test_a_malformed_file_is_ignored_and_deleted(self):
    files = SessionFiles(self.dir, "fp")
    with open(files.path("s", None), "w", encoding="utf-8") as f:
      f.write('{"version": 1, "scope": "fp", "session_id": "s"')  # torn
    reg = self.registry()
    self.assertIsNone(reg.get("s"))
    self.assertEqual(self.files(), [])

  def test_superseded_and_dropped_turns_go_to_the_tail_sink(self):
    reg = self.registry(max_sessions=2)
    got = []
    reg.set_tail_sink(lambda salt, ids: got.append((salt, bytes(ids))))
    p1 = self.turn(reg, "a", "salt")
    self.assertEqual(got, [])
    self.turn(reg, "a", "salt", user="more")  # turn 1 superseded
    self.assertEqual(got, [("salt", bytes(p1.token_ids) + b"ok")])
    self.turn(reg, "b")
    self.turn(reg, "c")  # a evicted (max_sessions=2): its last turn
    self.assertEqual(got[1][0], "salt")
    self.assertTrue(got[1][1].endswith(b"more\nassistant: ok"))
    reg.close("b")  # c's last turn is the same: their one tail stays for c
    self.assertLen(got, 2)
    reg.close("c")
    self.assertEqual(got[2], (None, b"user: hi\nassistant: ok"))

  def test_a_tail_two_sessions_share_goes_when_neither_extends_it(self):
    reg = self.registry()
    got = []
    reg.set_tail_sink(lambda salt, ids: got.append((salt, bytes(ids))))
    p1 = self.turn(reg, "a", "salt")
    self.turn(reg, "b", "salt")  # the very same history: one stored tail
    self.turn(reg, "c")  # the same history under another salt: another tail
    self.turn(reg, "a", "salt", user="more")  # b's next turn still loads the tail
    self.assertEqual(got, [])
    self.turn(reg, "b", "salt", user="more")
    self.assertEqual(got, [("salt", bytes(p1.token_ids) + b"ok")])

  def test_memory_only_without_a_folder(self):
    reg = SessionRegistry(self.tok)
    reg.set_persistence(None, scope="fp")
    self.turn(reg, "s")
    self.assertIsNone(reg.persistence_dir)
    self.assertEqual(self.files(), [])


class NoLocalStoreTest(unit.NoLocalStoreUnitTest):

  @classmethod
  def make_llm(cls, **kw) -> LLM:
    return real_llm("tiny", cache_dir="", **kw)


if __name__ == "__main__":
  absltest.main()
