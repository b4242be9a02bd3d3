"""Stored session tails (CachedAttention, arXiv 2403.19708, section 3.2.2: every historical
token's KV is reusable): a finished session turn stores its last partial chunk under its own key
(`keys.tail_hash`), and the next turn, told its history length, loads it with the full chunks,
so it computes only its new tokens even when the device holds none of its blocks. Tail hits
equal cold runs; a tail never hits other tokens, never shadows a stored full chunk, is only
saved for session turns, and a corrupt one is recomputed.

On the fake runner through `LLM` (`engines.fake_llm`); tests/integration/engine/session_tails_test.py
subclasses these classes with the real tiny model (`build_llm`) and adds the `LLM.chat` turn."""

import os
import threading

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.connector import SAVING
from kvjax.storage import StoreConfig, TierConfig
from kvjax.storage.format import keys
from kvjax.testing import engines

C = 32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
RNG = np.random.default_rng(11)
TURN1 = [int(t) for t in RNG.integers(0, 256, 70)]
NEW = [int(t) for t in RNG.integers(0, 256, 20)]


def tiers():
  return StoreConfig((TierConfig("host", capacity_bytes=64 << 20),
                      TierConfig("disk", url=engines.memory_store_url())))


def run(llm, ids, params=GREEDY, flush=True, **options):
  """One request through `Engine.add_request` (session options included), run to its end
  (then, with `flush`, until its saves are written)."""
  engine = llm.engine
  rid = engine.add_request(ids, params, merge_mode=options.pop("merge_mode", "load_only"),
                           **options)
  while True:
    for out in engine.step():
      if out.request_id == rid and out.finished:
        if flush:
          llm.flush()
        return out


class SessionTailCase(parameterized.TestCase):
  """The tests' `LLM`s: the fake runner here, the real tiny model in
  tests/integration/engine/session_tails_test.py (which overrides `build_llm` and
  `LOGPROB_DELTA`)."""

  #: A tail hit's log-probs against the cold run's: bit for bit on the fake.
  LOGPROB_DELTA = 0.0

  @classmethod
  def build_llm(cls, **options):
    return engines.fake_llm(**options)

  @classmethod
  def make_llm(cls, store, **kw):
    # No device prefix cache: every hit is the store's (the device would serve the tail's
    # tokens from its parked block). Load-only (`run`'s default) makes the loaded-token counts
    # exact.
    return cls.build_llm(max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
                         kv_chunk_size=C, block_size=16, enable_prefix_caching=False, **kw)


class SessionTailUnitTest(SessionTailCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.llm = cls.make_llm(tiers())
    turn1 = run(cls.llm, TURN1, save_tail=True)
    cls.history = TURN1 + turn1.token_ids  # 76 ids: KV for the first 75 (the last is sampled)
    cls.prompt2 = cls.history + NEW
    cls.cold = run(cls.llm, cls.prompt2, cache_salt="cold")

  @classmethod
  def tearDownClass(cls):
    cls.llm.close()
    super().tearDownClass()

  def assert_equals_cold(self, out):
    self.assertEqual(out.token_ids, self.cold.token_ids)
    self.assertEqual([set(d) for d in out.logprobs], [set(d) for d in self.cold.logprobs])
    for got, want in zip(out.logprobs, self.cold.logprobs):
      for t, lp in want.items():  # a delta of 0: equal bit for bit
        self.assertAlmostEqual(got[t], lp, delta=self.LOGPROB_DELTA)

  @parameterized.parameters("load_only", "cake")
  def test_the_next_turn_loads_every_historical_token(self, mode):
    h = len(self.history) - 1
    out = run(self.llm, self.prompt2, history_tokens=h, merge_mode=mode)
    self.assert_equals_cold(out)
    if mode == "load_only":
      self.assertEqual(out.num_cached_tokens, h)  # 75: chunks 0 and 1, and the 11-token tail
      self.assertEqual(out.metrics.num_computed_tokens, len(self.prompt2) - h)
      self.assertEqual(sorted(i for i, _ in out.metrics.loaded_chunks), [0, 1, 2])

  def test_a_tail_never_hits_other_tokens(self):
    h = len(self.history) - 1
    other = list(self.prompt2)
    other[h - 1] = (other[h - 1] + 1) % 256  # the tail's last token differs
    cold = run(self.llm, other, cache_salt="cold-other")
    for ids, history in ((other, h), (self.prompt2, h - 1), (self.prompt2, h + 1)):
      out = run(self.llm, ids, history_tokens=history)
      self.assertEqual(out.num_cached_tokens, 2 * C)  # the full chunks alone
      if ids is other:
        self.assertEqual(out.token_ids, cold.token_ids)

  def test_only_a_session_turn_saves_its_tail(self):
    ids = [int(t) for t in RNG.integers(0, 256, 50)]
    plain = run(self.llm, ids, cache_salt="plain")
    turn = run(self.llm, ids, cache_salt="turn", save_tail=True)
    for salt, out, tail in (("plain", plain, False), ("turn", turn, True)):
      h = len(ids) + len(out.token_ids) - 1
      got = run(self.llm, ids + out.token_ids + NEW, cache_salt=salt, history_tokens=h)
      self.assertEqual(got.num_cached_tokens, h if tail else C)

  def test_a_stored_full_chunk_wins_over_the_tail(self):
    # A longer prompt through the same history stores chunk 2 whole: the lookup takes it.
    h, kv = len(self.history) - 1, self.llm.kv_store
    longer = self.history + NEW + NEW
    run(self.llm, longer, cache_salt="full")
    run(self.llm, TURN1, cache_salt="full", save_tail=True)
    self.assertEqual(kv.lookup(self.prompt2, "full", history_tokens=h).tail.num_tokens, h - 2 * C)
    lookup = kv.lookup(longer, "full", history_tokens=h)
    self.assertIsNone(lookup.tail)
    self.assertEqual(lookup.hits, [True] * 3)
    out = run(self.llm, longer, cache_salt="full", history_tokens=h)
    self.assertEqual(out.num_cached_tokens, 3 * C)

  def test_layer_wise_insertion_of_a_tail(self):
    llm = self.make_llm(tiers(), kv_layerwise_groups=2)
    try:
      first = run(llm, TURN1, save_tail=True)
      self.assertEqual(first.token_ids, self.history[len(TURN1):])
      llm.engine.layerwise_trace = trace = []
      out = run(llm, self.prompt2, history_tokens=len(self.history) - 1)
      self.assertIn(("insert", out.request_id, 2, 1), trace)  # the tail went in layer-wise
      self.assertEqual(out.num_cached_tokens, len(self.history) - 1)
      self.assert_equals_cold(out)
    finally:
      llm.close()


class UnwrittenSavesUnitTest(SessionTailCase):

  def test_the_next_turn_finds_history_whose_saves_are_still_queued(self):
    llm = self.make_llm(engines.memory_store_url())
    kv, gate = llm.kv_store, threading.Event()
    write = kv.saver.write
    kv.saver.write = lambda job: (gate.wait(60), write(job))  # the saver holds every job until told
    try:
      first = run(llm, TURN1, save_tail=True, flush=False)
      history = TURN1 + first.token_ids
      h = len(history) - 1
      lookup = kv.lookup(history + NEW, None, history_tokens=h)
      self.assertEqual(lookup.present, [SAVING, SAVING])  # chunks 0 and 1, queued
      self.assertEqual((lookup.tail.tier, lookup.tail.num_tokens), (SAVING, h - 2 * C))
      rid = llm.engine.add_request(history + NEW, GREEDY, merge_mode="load_only",
                                   history_tokens=h)
      gate.set()  # the loads wait for the writes, then read and verify them
      out = next(o for _ in range(1000) for o in llm.engine.step()
                 if o.request_id == rid and o.finished)
      self.assertEqual(out.num_cached_tokens, h)
      cold = run(llm, history + NEW, cache_salt="cold")
      self.assertEqual(out.token_ids, cold.token_ids)
    finally:
      gate.set()
      llm.close()


class CorruptTailUnitTest(SessionTailCase):

  def test_a_corrupt_tail_is_recomputed(self):
    root = self.create_tempdir().full_path
    llm = self.make_llm(f"file://{root}")
    try:
      first = run(llm, TURN1, save_tail=True)
      history = TURN1 + first.token_ids
      prompt2 = history + NEW
      h = len(history) - 1
      ns = llm.kv_store.namespace(None)
      tail_key = keys.tail_hash(keys.chunk_hashes(ns, history)[1], history[2 * C:h])
      files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "data"))
               for f in fs if tail_key in d]
      self.assertLen(files, 1)
      with open(files[0], "r+b") as f:
        f.seek(os.path.getsize(files[0]) // 2)
        f.write(b"\xff" * 64)
      cold = run(llm, prompt2, cache_salt="cold")
      out = run(llm, prompt2, history_tokens=h)
      self.assertEqual(out.metrics.num_rejected_chunks, 1)
      self.assertEqual(out.num_cached_tokens, 2 * C)
      self.assertEqual(out.token_ids, cold.token_ids)
    finally:
      llm.close()


if __name__ == "__main__":
  absltest.main()
