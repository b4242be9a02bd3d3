"""The paged engine's logic on the fake runner: device prefix hits, store hits and cold runs
agree bit for bit at block and chunk edges, exact plans of a device hit beside a cold prefill,
no block leaks through aborts and preemptions, shared blocks are never written.

The tests run through `LLM` (`engines.fake_llm`); tests/integration/engine/paged_engine_test.py
subclasses `PagedEngineHitUnitTest` and `PagedEngineUnitTest` with the real tiny model
(`build_llm`), its tolerance and its pool (`poison_blocks`).
"""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.models.nn.kv_cache import paged_block_nbytes
from kvjax.testing import engines
from kvjax.testing.fake_runner import fake_model_config

B, C = 16, 32
CHUNKS = (16, 32, 64)
BLOCK_NBYTES = paged_block_nbytes(fake_model_config(), B, "float32")  # tiny's sizes, f32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, 256, n)]
           for i, n in enumerate((5, 40, 130))]


def ids(prompts):
  return [{"prompt_token_ids": p} for p in prompts]


class PagedEngineCase(absltest.TestCase):
  """The tests' `LLM`s, the cold reference and checks: the fake runner here, the real tiny model
  in tests/integration/engine/paged_engine_test.py (which overrides `build_llm`,
  `LOGPROB_DELTA`, `runner_calls` and `poison_blocks`)."""

  #: A run's first-token log-probs against the reference's: bit for bit on the fake.
  LOGPROB_DELTA = 0.0

  @classmethod
  def build_llm(cls, **options):
    return engines.fake_llm(**options)

  @classmethod
  def paged(cls, num_blocks=256, **kw):
    """An `LLM` with a pool of `num_blocks` blocks of B tokens."""
    kw.setdefault("max_num_seqs", 4)
    return cls.build_llm(chunk_sizes=CHUNKS, block_size=B,
                         kv_cache_memory_bytes=num_blocks * BLOCK_NBYTES, **kw)

  def runner_calls(self, llm):
    """The runner's recorded calls (`FakeRunner.calls`); None where the runner records none."""
    return llm.engine.runner.calls

  def poison_blocks(self, runner, blocks):
    """Fills the K and V of pool blocks `blocks` with NaN (reading them fails loudly)."""
    runner.k_LPBKH[:, blocks] = np.nan
    runner.v_LPBKH[:, blocks] = np.nan

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.alone = cls.paged(max_num_seqs=1, enable_prefix_caching=False)

  @classmethod
  def tearDownClass(cls):
    cls.alone.close()
    super().tearDownClass()

  def want(self, prompts, params=GREEDY):
    """Each prompt alone on an `LLM` that caches nothing: the cold answer."""
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    return [self.alone.generate(ids([p]), sp)[0] for p, sp in zip(prompts, params)]

  def assert_same(self, got, want):
    self.assertEqual([o.token_ids for o in got], [o.token_ids for o in want])
    for g, w in zip(got, want):
      if w.logprobs:
        self.assertEqual(set(g.logprobs[0]), set(w.logprobs[0]))
        for k, v in w.logprobs[0].items():  # a delta of 0: equal bit for bit
          self.assertAlmostEqual(g.logprobs[0][k], v, delta=self.LOGPROB_DELTA)

  def check_equals_alone(self, *max_num_seqs):
    want = self.want(PROMPTS)
    for seqs in max_num_seqs:
      llm = self.paged(max_num_seqs=seqs, enable_prefix_caching=False)
      got = llm.generate(ids(PROMPTS), GREEDY)
      self.assert_same(got, want)
      for o, p in zip(got, PROMPTS):
        self.assertEqual((o.num_cached_tokens, o.metrics.num_computed_tokens), (0, len(p)))
      stats = llm.engine.stats().kv_cache
      self.assertEqual(stats.num_free_blocks, stats.num_blocks)
      self.assertEqual(stats.num_cached_blocks, 0)
      llm.close()


class PagedEngineHitUnitTest(PagedEngineCase):
  """The cases the real tiny model also runs in the default suite."""

  def test_equals_alone_one_and_four_a_step(self):
    self.check_equals_alone(1, 4)

  def test_device_store_and_cold_agree_at_block_and_chunk_edges(self):
    lengths = (1, B - 1, B, B + 1, C - 1, C, C + 1, 3 * C + 17)
    prompts = [[int(t) for t in np.random.default_rng(100 + n).integers(0, 256, n)]
               for n in lengths]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
    want = self.want(prompts, params)
    # Load-only: every stored chunk is loaded, whatever the machine's speed (Cake's meeting point
    # follows measured times, so under load it may compute the whole prompt and load nothing).
    llm = self.paged(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                     kv_merge_mode="load_only")
    cold = [llm.generate(ids([p]), params)[0] for p in prompts]
    self.assert_same(cold, want)
    self.assertEqual([o.num_cached_tokens for o in cold], [0] * len(lengths))
    llm.flush()
    device = [llm.generate(ids([p]), params)[0] for p in prompts]
    self.assert_same(device, want)
    for o, n in zip(device, lengths):
      hit = (n - 1) // B * B
      kv_end = n + params.max_tokens - 1  # positions with KV after the cold run
      if kv_end // B == (n - 1) // B:  # its parked last block holds the rest of the prompt
        hit = n - 1
      # The store holds whole chunks too, but the device holds all of them and more: no Cake
      # merge (whole chunks), the device serves token-granular.
      self.assertEqual(o.metrics.num_device_cached_tokens, hit, n)
      self.assertEqual(o.num_cached_tokens, hit, n)
      self.assertEqual(o.metrics.loaded_from_tiers, ["device"] if hit else [], n)
      self.assertEqual(o.metrics.num_computed_tokens, n - hit, n)
    self.assertGreater(llm.reset_prefix_cache(), 0)
    store = [llm.generate(ids([p]), params)[0] for p in prompts]
    self.assert_same(store, want)
    for o, n in zip(store, lengths):
      self.assertEqual(o.metrics.num_device_cached_tokens, 0)
      self.assertEqual(o.metrics.num_loaded_tokens + o.metrics.num_computed_tokens, n)
      self.assertNotIn("device", o.metrics.loaded_from_tiers)
    self.assertGreater(store[-1].metrics.num_loaded_tokens, 0)
    llm.close()

  def test_a_chunk_partly_served_from_device_blocks_is_saved_too(self):
    # b shares only a's first block (16 tokens, like a common system prompt): b's chunk 0 is
    # half a device hit, half computed. It is saved all the same (its head read back from the
    # pool, K un-rotated), so after the device forgets, c loads it from the store.
    llm = self.paged(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                     kv_merge_mode="load_only")
    rng = np.random.default_rng(11)
    a = [int(t) for t in rng.integers(0, 256, 46)]
    b = a[:B] + [int(t) for t in rng.integers(0, 256, 30)]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)
    llm.generate(ids([a]), params)
    llm.flush()
    saved = llm.engine.stats().saver.chunks_saved
    got_b = llm.generate(ids([b]), params)[0]
    self.assertEqual(got_b.metrics.num_device_cached_tokens, B)
    llm.flush()
    self.assertEqual(llm.engine.stats().saver.chunks_saved, saved + 1)
    calls = self.runner_calls(llm)
    if calls is not None:
      self.assertTrue(any(c[0] == "read_pre_rope" for c in calls))
    llm.reset_prefix_cache()
    c = b[:40] + [1, 2, 3]
    got_c = llm.generate(ids([c]), params)[0]
    self.assertEqual((got_c.metrics.num_device_cached_tokens, got_c.num_cached_tokens), (0, C))
    self.assert_same([got_c], self.want([c], params))
    llm.close()


class PagedEngineUnitTest(PagedEngineCase):
  """Plans, turns, salts, refusals, shared blocks and leaks (the real tiny model runs them in
  the slow suite)."""

  def test_equals_alone_two_a_step(self):
    self.check_equals_alone(2)

  def test_a_device_hit_queued_during_a_cold_prefill_goes_first_and_equals_a_cold_run(self):
    llm = self.paged(max_num_batched_tokens=64)
    eng = llm.engine
    steps = []
    eng.add_step_observer(lambda rec: steps.append(
        [(c.request_id, c.start, c.num_tokens) for c in rec.plan.prefills]))
    head = PROMPTS[1][:32]
    llm.generate(ids([head]), GREEDY)  # its 2 blocks stay on the device
    cold = eng.add_request(PROMPTS[2], GREEDY)  # 130 tokens: 64 a step
    done = {}
    for o in eng.step():
      done[o.request_id] = o
    hit = eng.add_request(head + [7] * 8, GREEDY)  # 32 tokens on the device, 8 new
    while eng.has_unfinished_requests():
      for o in eng.step():
        if o.finished:
          done[o.request_id] = o
    # The hit is admitted in the second step and its 8 tokens go first; its first token comes
    # with that step, so the cold prompt takes one smallest chunk after it (short first-token
    # steps) and still ends in its third step.
    self.assertEqual([s for s in steps if s][-3:], [[(cold, 0, 64)],
                                                    [(hit, 32, 8), (cold, 64, 16)],
                                                    [(cold, 80, 32), (cold, 112, 16),
                                                     (cold, 128, 2)]])
    self.assertEqual(done[hit].num_cached_tokens, 32)
    self.assert_same([done[cold], done[hit]], self.want([PROMPTS[2], head + [7] * 8]))
    llm.close()

  def test_the_next_turn_reuses_every_token_with_kv_on_the_device(self):
    # Turn 1: 40 prompt tokens + 6 generated: KV for 45 positions, blocks [16][16][13 of 16].
    # The partly filled block is parked at finish; turn 2 (turn 1's ids + 5 new tokens) takes
    # it over with both full blocks: 45 tokens from the device, 6 computed.
    for store in (None, engines.memory_store_url()):
      # With a store too: turn 1's chunk 0 is stored, but the device holds it and more, so
      # turn 2 takes the device path (token-granular), not a Cake merge (whole chunks).
      llm = self.paged(kv_store=store, kv_chunk_size=C)
      p1 = PROMPTS[1]
      turn1 = llm.generate(ids([p1]), GREEDY)[0]
      llm.flush()
      p2 = p1 + turn1.token_ids + [7, 8, 9, 10, 11]
      turn2 = llm.generate(ids([p2]), GREEDY)[0]
      self.assert_same([turn2], self.want([p2]))
      self.assertEqual((turn2.metrics.num_device_cached_tokens,
                        turn2.metrics.num_computed_tokens, turn2.metrics.loaded_from_tiers),
                       (45, 6, ["device"]), store)  # the last generated token, 5 new ones
      if store is None:
        llm.close()  # the one with a store goes on below
    # Turn 2 owns that block now; turn 2 of another branch gets the whole blocks only.
    branch = p1 + turn1.token_ids[:3] + [1, 2, 3]
    got = llm.generate(ids([branch]), GREEDY)[0]
    self.assert_same([got], self.want([branch]))
    self.assertEqual(got.metrics.num_device_cached_tokens, 32)
    stats = llm.engine.stats().kv_cache
    self.assertEqual(stats.num_free_blocks, stats.num_blocks)
    llm.close()

  def test_generated_tokens_are_saved_and_the_next_turn_loads_them(self):
    # Turn 1: 40 prompt tokens + 60 generated; KV exists for 99 positions: chunk 0 is saved by
    # prefill, chunk 1 (straddling the prompt's end, [32, 64)) by the decode at 63, chunk 2 by
    # the decode at 95. Turn 2 sends turn 1's exact ids plus 5 new tokens and loads all three.
    llm = self.paged(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                     enable_prefix_caching=False,
                     kv_merge_mode="load_only")  # every stored chunk loads: the count is exact
    p1 = PROMPTS[1]
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=3)
    turn1 = llm.generate(ids([p1]), params)[0]
    llm.flush()
    saver = llm.engine.stats().saver
    self.assertEqual((saver.chunks_saved, saver.jobs_dropped), (3, 0))
    p2 = p1 + turn1.token_ids + [7, 8, 9, 10, 11]
    turn2 = llm.generate(ids([p2]), params)[0]
    self.assert_same([turn2], self.want([p2], params))
    self.assertEqual(turn2.num_cached_tokens, 3 * C)
    self.assertEqual(turn2.metrics.num_computed_tokens, len(p2) - 3 * C)
    # A turn whose history differs in one generated token hits only the chunks before it.
    other = list(p2)
    other[70] = (other[70] + 1) % 256
    got = llm.generate(ids([other]), params)[0]
    self.assert_same([got], self.want([other], params))
    self.assertEqual(got.num_cached_tokens, 2 * C)
    llm.close()

  def test_cache_salt_isolates_device_hits(self):
    llm = self.paged()
    p = PROMPTS[2]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = llm.generate({"prompt_token_ids": p, "cache_salt": "a"}, params)[0]
    other = llm.generate({"prompt_token_ids": p, "cache_salt": "b"}, params)[0]
    again = llm.generate({"prompt_token_ids": p, "cache_salt": "a"}, params)[0]
    self.assertEqual((first.num_cached_tokens, other.num_cached_tokens), (0, 0))
    self.assertEqual(again.num_cached_tokens, len(p) - 1)  # full blocks, then the parked one
    self.assertEqual(first.token_ids, again.token_ids)
    self.assertEqual(first.token_ids, other.token_ids)
    llm.close()

  def test_request_that_can_never_fit_is_refused(self):
    llm = self.paged(num_blocks=8)  # 128 tokens
    with self.assertRaisesRegex(ValueError, "needs 9 KV blocks"):
      llm.generate(ids([[1] * 120]), SamplingParams(max_tokens=10))
    self.assertLen(llm.generate(ids([[1] * 100]), SamplingParams(max_tokens=10))[0].token_ids,
                   10)
    llm.close()

  def test_shared_blocks_are_never_written(self):
    llm = self.paged(num_blocks=64)
    tables = {}
    llm.engine.add_step_observer(lambda rec: tables.update(rec.plan.block_tables))
    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(0, 256, 70)]
    # 70 + 10 positions with KV: five full blocks, nothing parked (every unshared block may be
    # poisoned below).
    out_a = llm.generate(ids([a]), SamplingParams(max_tokens=11, temperature=0.0))[0]
    shared = list(tables[out_a.request_id][:4])  # positions [0, 64): full, indexed blocks
    runner = llm.engine.runner
    k0, v0 = (np.asarray(x) for x in runner.read_blocks(shared))
    self.poison_blocks(runner, np.setdiff1d(np.arange(runner.num_blocks), shared))
    b = a[:64] + [int(t) for t in rng.integers(0, 256, 20)]
    c = a[:64] + [int(t) for t in rng.integers(0, 256, 9)]
    got = llm.generate(ids([b, c, a]), GREEDY)
    self.assert_same(got, self.want([b, c, a]))
    self.assertEqual([o.num_cached_tokens for o in got], [64, 64, 64])
    for o in got:
      self.assertEqual(tuple(tables[o.request_id][:4]), tuple(shared))
    k1, v1 = (np.asarray(x) for x in runner.read_blocks(shared))
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(v1, v0)
    llm.close()

  def test_mixed_requests_with_aborts_and_preemptions_leak_no_block(self):
    llm = self.paged(num_blocks=24, max_num_seqs=8)  # 384 tokens for 8 sequences: preemptions
    eng = llm.engine
    rng = np.random.default_rng(3)
    bases = [[int(t) for t in rng.integers(0, 256, 48)] for _ in range(4)]
    prompts, params = [], []
    total = 60  # with 36 at once, enough to preempt and to abort some mid-flight
    for i in range(total):
      n = int(rng.integers(1, 90))
      p = (bases[i % 4] + [int(t) for t in rng.integers(0, 256, n)])[:n] if i % 3 else [
          int(t) for t in rng.integers(0, 256, n)]
      prompts.append(p)
      params.append(SamplingParams(max_tokens=int(rng.integers(1, 24)), temperature=0.0))
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts[:36], params[:36])]
    done, aborted, steps = {}, set(), 0
    while eng.has_unfinished_requests() or len(rids) < total:
      steps += 1
      if len(rids) < total and steps % 3 == 0:
        rids += [eng.add_request(p, sp) for p, sp in
                 zip(prompts[len(rids):len(rids) + 8], params[len(rids):len(rids) + 8])]
      if steps % 7 == 0:
        victim = rids[int(rng.integers(0, len(rids)))]
        if victim not in done and victim not in aborted:
          eng.abort_request(victim)
          aborted.add(victim)
      for o in eng.step():
        if o.finished:
          done[o.request_id] = o
      self.assertLess(steps, 5000)
    stats = eng.stats().kv_cache
    self.assertGreater(stats.preemptions, 0)
    self.assertGreater(len(aborted), 3)
    self.assertEqual(len(done) + len(aborted), total)
    self.assertEqual(stats.num_free_blocks, stats.num_blocks)  # every block free or cached
    self.assertGreater(stats.num_cached_blocks, 0)
    self.assertEqual(stats.usage, 0.0)
    eng._scheduler.kv_cache.pool.verify()  # pylint: disable=protected-access
    finished = [(i, done[r]) for i, r in enumerate(rids) if r in done]
    want = self.want([prompts[i] for i, _ in finished], [params[i] for i, _ in finished])
    self.assertEqual([o.token_ids for _, o in finished], [w.token_ids for w in want])
    # A preempted request's prefix hits are counted once: never more cached than prompt tokens.
    over = [(i, o.num_cached_tokens, len(prompts[i])) for i, o in finished
            if o.num_cached_tokens > len(prompts[i])]
    self.assertEqual(over, [])
    llm.close()


if __name__ == "__main__":
  absltest.main()
