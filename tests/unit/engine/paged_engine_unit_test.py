"""The paged engine's logic on the fake runner: device prefix hits, store hits and cold runs
agree bit for bit at block and chunk edges, exact plans of a device hit beside a cold prefill,
no block leaks through aborts and preemptions, shared blocks are never written.

The same assertions on the real tiny model are tests/integration/engine/paged_engine_test.py (slow-marked
where this file covers them).
"""

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing import engines

B, C = 16, 32
CHUNKS = (16, 32, 64)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(0, 256, n)]
           for i, n in enumerate((5, 40, 130))]


def paged(num_blocks=256, **kw):
  kw.setdefault("max_num_seqs", 4)
  return engines.fake_engine(chunk_sizes=CHUNKS, block_size=B, num_blocks=num_blocks, **kw)


class PagedEngineUnitTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.alone = paged(max_num_seqs=1, enable_prefix_caching=False)

  @classmethod
  def tearDownClass(cls):
    engines.close_engine(cls.alone)
    super().tearDownClass()

  def want(self, prompts, params=GREEDY):
    """Each prompt alone on an engine that caches nothing: the cold answer."""
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    return [engines.generate(self.alone, [p], sp)[0] for p, sp in zip(prompts, params)]

  def assert_same(self, got, want):
    self.assertEqual([o.token_ids for o in got], [o.token_ids for o in want])
    self.assertEqual([o.logprobs and o.logprobs[0] for o in got],
                     [o.logprobs and o.logprobs[0] for o in want])  # bit for bit

  def test_a_device_hit_queued_during_a_cold_prefill_goes_first_and_equals_a_cold_run(self):
    eng = paged(max_num_batched_tokens=64)
    steps = []
    eng.add_step_observer(lambda rec: steps.append(
        [(c.request_id, c.start, c.num_tokens) for c in rec.plan.prefills]))
    head = PROMPTS[1][:32]
    engines.generate(eng, [head], GREEDY)  # its 2 blocks stay on the device
    cold = eng.add_request(PROMPTS[2], GREEDY)  # 130 tokens: 64 a step
    done = {}
    for o in eng.step():
      done[o.request_id] = o
    hit = eng.add_request(head + [7] * 8, GREEDY)  # 32 tokens on the device, 8 new
    while eng.has_unfinished_requests():
      for o in eng.step():
        if o.finished:
          done[o.request_id] = o
    self.assertEqual([s for s in steps if s][-3:], [[(cold, 0, 64)],
                                                    [(hit, 32, 8), (cold, 64, 16)],
                                                    [(cold, 80, 32), (cold, 112, 16),
                                                     (cold, 128, 2)]])
    self.assertEqual(done[hit].num_cached_tokens, 32)
    self.assert_same([done[cold], done[hit]], self.want([PROMPTS[2], head + [7] * 8]))

  def test_batched_equals_alone(self):
    want = self.want(PROMPTS)
    for seqs in (1, 2, 4):
      eng = paged(max_num_seqs=seqs, enable_prefix_caching=False)
      got = engines.generate(eng, PROMPTS, GREEDY)
      self.assert_same(got, want)
      for o, p in zip(got, PROMPTS):
        self.assertEqual((o.num_cached_tokens, o.metrics.num_computed_tokens), (0, len(p)))
      stats = eng.stats().kv_cache
      self.assertEqual(stats.num_free_blocks, stats.num_blocks)
      self.assertEqual(stats.num_cached_blocks, 0)

  def test_device_store_and_cold_agree_at_block_and_chunk_edges(self):
    lengths = (1, B - 1, B, B + 1, C - 1, C, C + 1, 3 * C + 17)
    prompts = [[int(t) for t in np.random.default_rng(100 + n).integers(0, 256, n)]
               for n in lengths]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=3)
    want = self.want(prompts, params)
    # Load-only: every stored chunk is loaded, whatever the machine's speed (Cake's meeting point
    # follows measured times, so under load it may compute the whole prompt and load nothing).
    eng = paged(kv_store=engines.memory_store_url(), kv_chunk_size=C, merge_mode="load_only")
    cold = [engines.generate(eng, [p], params)[0] for p in prompts]
    self.assert_same(cold, want)
    self.assertEqual([o.num_cached_tokens for o in cold], [0] * len(lengths))
    eng.kv_store.flush()
    device = [engines.generate(eng, [p], params)[0] for p in prompts]
    self.assert_same(device, want)
    for o, n in zip(device, lengths):
      hit = (n - 1) // B * B
      kv_end = n + params.max_tokens - 1  # positions with KV after the cold run
      if kv_end // B == (n - 1) // B:  # its parked last block holds the rest of the prompt
        hit = n - 1
      self.assertEqual(o.metrics.num_device_cached_tokens, hit, n)
      self.assertEqual(o.num_cached_tokens, hit, n)
      self.assertEqual(o.metrics.loaded_from_tiers, ["device"] if hit else [], n)
      self.assertEqual(o.metrics.num_computed_tokens, n - hit, n)
    self.assertGreater(eng.reset_prefix_cache(), 0)
    store = [engines.generate(eng, [p], params)[0] for p in prompts]
    self.assert_same(store, want)
    for o, n in zip(store, lengths):
      self.assertEqual(o.metrics.num_device_cached_tokens, 0)
      self.assertEqual(o.metrics.num_loaded_tokens + o.metrics.num_computed_tokens, n)
      self.assertNotIn("device", o.metrics.loaded_from_tiers)
    self.assertGreater(store[-1].metrics.num_loaded_tokens, 0)
    engines.close_engine(eng)

  def test_the_next_turn_reuses_every_token_with_kv_on_the_device(self):
    # Turn 1: 40 prompt tokens + 6 generated: KV for 45 positions, blocks [16][16][13 of 16].
    # The partly filled block is parked at finish; turn 2 (turn 1's ids + 5 new tokens) takes
    # it over with both full blocks: 45 tokens from the device, 6 computed.
    for store in (None, engines.memory_store_url()):
      eng = paged(kv_store=store, kv_chunk_size=C)
      p1 = PROMPTS[1]
      turn1 = engines.generate(eng, [p1], GREEDY)[0]
      if store:
        eng.kv_store.flush()
      p2 = p1 + turn1.token_ids + [7, 8, 9, 10, 11]
      turn2 = engines.generate(eng, [p2], GREEDY)[0]
      self.assert_same([turn2], self.want([p2]))
      self.assertEqual((turn2.metrics.num_device_cached_tokens,
                        turn2.metrics.num_computed_tokens, turn2.metrics.loaded_from_tiers),
                       (45, 6, ["device"]), store)
    # Turn 2 owns that block now; turn 2 of another branch gets the whole blocks only.
    branch = p1 + turn1.token_ids[:3] + [1, 2, 3]
    got = engines.generate(eng, [branch], GREEDY)[0]
    self.assert_same([got], self.want([branch]))
    self.assertEqual(got.metrics.num_device_cached_tokens, 32)
    stats = eng.stats().kv_cache
    self.assertEqual(stats.num_free_blocks, stats.num_blocks)
    engines.close_engine(eng)

  def test_generated_tokens_are_saved_and_the_next_turn_loads_them(self):
    # Turn 1: 40 prompt tokens + 60 generated; KV exists for 99 positions: chunk 0 is saved by
    # prefill, chunk 1 (straddling the prompt's end, [32, 64)) by the decode at 63, chunk 2 by
    # the decode at 95. Turn 2 sends turn 1's exact ids plus 5 new tokens and loads all three.
    eng = paged(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                enable_prefix_caching=False, merge_mode="load_only")
    p1 = PROMPTS[1]
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=3)
    turn1 = engines.generate(eng, [p1], params)[0]
    eng.kv_store.flush()
    saver = eng.stats().saver
    self.assertEqual((saver.chunks_saved, saver.jobs_dropped), (3, 0))
    p2 = p1 + turn1.token_ids + [7, 8, 9, 10, 11]
    turn2 = engines.generate(eng, [p2], params)[0]
    self.assert_same([turn2], self.want([p2], params))
    self.assertEqual(turn2.num_cached_tokens, 3 * C)
    self.assertEqual(turn2.metrics.num_computed_tokens, len(p2) - 3 * C)
    other = list(p2)
    other[70] = (other[70] + 1) % 256
    got = engines.generate(eng, [other], params)[0]
    self.assert_same([got], self.want([other], params))
    self.assertEqual(got.num_cached_tokens, 2 * C)
    engines.close_engine(eng)

  def test_a_chunk_partly_served_from_device_blocks_is_saved_too(self):
    # b shares only a's first block: b's chunk 0 is half a device hit, half computed. It is
    # saved all the same (its head read back from the pool, K un-rotated), so after the device
    # forgets, c loads it from the store.
    eng = paged(kv_store=engines.memory_store_url(), kv_chunk_size=C, merge_mode="load_only")
    rng = np.random.default_rng(11)
    a = [int(t) for t in rng.integers(0, 256, 46)]
    b = a[:B] + [int(t) for t in rng.integers(0, 256, 30)]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)
    engines.generate(eng, [a], params)
    eng.kv_store.flush()
    saved = eng.stats().saver.chunks_saved
    got_b = engines.generate(eng, [b], params)[0]
    self.assertEqual(got_b.metrics.num_device_cached_tokens, B)
    eng.kv_store.flush()
    self.assertEqual(eng.stats().saver.chunks_saved, saved + 1)
    self.assertTrue(any(c[0] == "read_pre_rope" for c in eng.runner.calls))
    eng.reset_prefix_cache()
    c = b[:40] + [1, 2, 3]
    got_c = engines.generate(eng, [c], params)[0]
    self.assertEqual((got_c.metrics.num_device_cached_tokens, got_c.num_cached_tokens), (0, C))
    self.assert_same([got_c], self.want([c], params))
    engines.close_engine(eng)

  def test_cache_salt_isolates_device_hits(self):
    eng = paged()
    p = PROMPTS[2]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = engines.generate(eng, [p], params, cache_salt="a")[0]
    other = engines.generate(eng, [p], params, cache_salt="b")[0]
    again = engines.generate(eng, [p], params, cache_salt="a")[0]
    self.assertEqual((first.num_cached_tokens, other.num_cached_tokens), (0, 0))
    self.assertEqual(again.num_cached_tokens, len(p) - 1)  # full blocks, then the parked one
    self.assertEqual(first.token_ids, again.token_ids)
    self.assertEqual(first.token_ids, other.token_ids)

  def test_request_that_can_never_fit_is_refused(self):
    eng = paged(num_blocks=8)  # 128 tokens
    with self.assertRaisesRegex(ValueError, "needs 9 KV blocks"):
      engines.generate(eng, [[1] * 120], SamplingParams(max_tokens=10))
    self.assertLen(engines.generate(eng, [[1] * 100], SamplingParams(max_tokens=10))[0]
                   .token_ids, 10)

  def test_shared_blocks_are_never_written(self):
    eng = paged(num_blocks=64)
    tables = {}
    eng.add_step_observer(lambda rec: tables.update(rec.plan.block_tables))
    rng = np.random.default_rng(7)
    a = [int(t) for t in rng.integers(0, 256, 70)]
    out_a = engines.generate(eng, [a], SamplingParams(max_tokens=11, temperature=0.0))[0]
    shared = list(tables[out_a.request_id][:4])  # positions [0, 64): full, indexed blocks
    runner = eng.runner
    k0, v0 = runner.read_blocks(shared)
    poison = np.setdiff1d(np.arange(runner.num_blocks), shared)  # every other block: NaN
    runner.k_LPBKH[:, poison] = np.nan
    runner.v_LPBKH[:, poison] = np.nan
    b = a[:64] + [int(t) for t in rng.integers(0, 256, 20)]
    c = a[:64] + [int(t) for t in rng.integers(0, 256, 9)]
    got = engines.generate(eng, [b, c, a], GREEDY)
    self.assert_same(got, self.want([b, c, a]))
    self.assertEqual([o.num_cached_tokens for o in got], [64, 64, 64])
    for o in got:
      self.assertEqual(tuple(tables[o.request_id][:4]), tuple(shared))
    k1, v1 = runner.read_blocks(shared)
    np.testing.assert_array_equal(k1, k0)
    np.testing.assert_array_equal(v1, v0)

  def test_mixed_requests_with_aborts_and_preemptions_leak_no_block(self):
    eng = paged(num_blocks=24, max_num_seqs=8)  # 384 tokens for 8 sequences: preemptions
    rng = np.random.default_rng(3)
    bases = [[int(t) for t in rng.integers(0, 256, 48)] for _ in range(4)]
    prompts, params = [], []
    total = 60
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
    finished = [(i, done[r]) for i, r in enumerate(rids) if r in done]
    want = self.want([prompts[i] for i, _ in finished], [params[i] for i, _ in finished])
    self.assertEqual([o.token_ids for _, o in finished], [w.token_ids for w in want])
    # A preempted request's prefix hits are counted once: never more cached than prompt tokens.
    over = [(i, o.num_cached_tokens, len(prompts[i])) for i, o in finished
            if o.num_cached_tokens > len(prompts[i])]
    self.assertEqual(over, [])


if __name__ == "__main__":
  absltest.main()
