"""Sessions that survive a restart (`SessionRegistry.set_persistence`, `SessionFiles`): a
session's last turn is a file beside a local store, so an `LLM` built later over the same store
folder extends the conversation and loads its stored tail; the hit output equals a cold run.
Files are bound to the model's fingerprint, the salt and the id; closing, expiring and evicting
delete them.

On the fake runner (`kvjax.testing.engines.fake_llm`: `LLM` over a numpy model); the real
tiny model's run of the same tests is tests/integration/engine/sessions_persist_test.py."""

import os
import tempfile

from absl.testing import absltest

from kvjax import LLM, SamplingParams
from kvjax.storage.format import keys
from kvjax.sessions import EXTENDED, FIRST
from kvjax.testing import engines

C = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
USER1 = "Tell me about stored session caches, briefly, please: " + "x" * 30
USER2 = "And after a restart?"


def make_llm(store_dir: str, **kw) -> LLM:
  # No device prefix cache and load-only: every cached token is a store hit, counted exactly.
  return engines.fake_llm(max_num_seqs=2, chunk_sizes=(16, 32, 64),
             kv_store=f"file://{store_dir}", kv_chunk_size=C,
             block_size=16, enable_prefix_caching=False, kv_merge_mode="load_only", **kw)


def conversation(out1) -> list[dict[str, str]]:
  return [{"role": "user", "content": USER1}, {"role": "assistant", "content": out1.text},
          {"role": "user", "content": USER2}]


class RestartUnitTest(absltest.TestCase):

  @classmethod
  def make_llm(cls, store_dir: str, **kw) -> LLM:
    """The `LLM` under test (tests/integration/engine/sessions_persist_test.py: the real tiny
    model)."""
    return make_llm(store_dir, **kw)

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.dir = tempfile.mkdtemp()
    llm = cls.make_llm(cls.dir)
    try:
      (cls.out1,) = llm.chat([{"role": "user", "content": USER1}], GREEDY, session_id="s1",
                             cache_salt="tenant")
      cls.turn1 = llm.sessions.get("s1", "tenant")
      cls.session_dir = llm.sessions.persistence_dir
      llm.flush()
    finally:
      llm.close()
    cls.llm = cls.make_llm(cls.dir)  # the restarted one
    # Turn 2 first, before other tests store chunks of this conversation.
    kv = cls.llm.kv_store
    ids1 = list(cls.turn1.token_ids)
    cls.tail1 = kv.tail_key(kv.namespace("tenant").root_hash(),
                            keys.chunk_hashes(kv.namespace("tenant"), ids1), ids1,
                            len(ids1) - 1)[2]
    cls.tail1_before = kv._run(kv.store.lookup([cls.tail1]))
    sink, deletes = cls.llm.sessions._tail_sink, []  # the LLM's: `KVStoreClient.drop_tail`
    cls.llm.sessions.set_tail_sink(lambda salt, ids: deletes.append(sink(salt, ids)))
    (cls.out2,) = cls.llm.chat(conversation(cls.out1), GREEDY, session_id="s1",
                               cache_salt="tenant")
    cls.llm.flush()
    for f in deletes:
      f.result(60)
    cls.tail1_after = kv._run(kv.store.lookup([cls.tail1]))
    cls.prompt2 = cls.llm.last_session_prompt
    (cls.cold,) = cls.llm.generate(
        {"prompt_token_ids": list(cls.prompt2.token_ids), "cache_salt": "cold"}, GREEDY)

  @classmethod
  def tearDownClass(cls):
    cls.llm.close()
    super().tearDownClass()

  def test_the_restarted_llm_extends_the_session_and_loads_its_tail(self):
    self.assertEqual(self.llm.sessions.persistence_dir, self.session_dir)
    self.assertTrue(self.session_dir.startswith(os.path.join(self.dir, "sessions")))
    history = len(self.turn1.token_ids) - 1  # the last sampled token has no KV
    self.assertNotEqual(history % C, 0)  # a tail: the test needs one
    self.assertEqual(self.prompt2.outcome, EXTENDED)
    self.assertEqual(self.prompt2.token_ids[:len(self.turn1.token_ids)], self.turn1.token_ids)
    self.assertEqual(self.out2.num_cached_tokens, history)  # full chunks and the stored tail
    self.assertEqual(self.cold.num_cached_tokens, 0)
    self.assertEqual(self.out2.token_ids, self.cold.token_ids)
    self.assertEqual(self.llm.sessions.get("s1", "tenant").turns, 2)

  def test_turn_two_deleted_the_tail_it_superseded(self):
    self.assertEqual(self.tail1_before, ["disk"])
    self.assertEqual(self.tail1_after, [None])
    self.assertEqual(self.llm.kv_store.saver_stats.tails_dropped, 1)

  def test_another_salt_or_id_does_not_see_it(self):
    self.llm.chat(conversation(self.out1), GREEDY, session_id="s1", cache_salt="other")
    self.assertEqual(self.llm.last_session_prompt.outcome, FIRST)
    self.llm.chat(conversation(self.out1), GREEDY, session_id="s2", cache_salt="tenant")
    self.assertEqual(self.llm.last_session_prompt.outcome, FIRST)


class NoLocalStoreUnitTest(absltest.TestCase):

  @classmethod
  def make_llm(cls, **kw) -> LLM:
    """The `LLM` under test (tests/integration/engine/sessions_persist_test.py: the real tiny
    model)."""
    return engines.fake_llm(**kw)

  def test_a_memory_store_keeps_sessions_in_memory(self):
    llm = self.make_llm(max_num_seqs=2, chunk_sizes=(16, 32), kv_store="memory://",
                        kv_chunk_size=C, compile_on_init=False)
    try:
      self.assertIsNone(llm.sessions.persistence_dir)
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
