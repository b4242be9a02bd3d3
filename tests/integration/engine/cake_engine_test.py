"""The engine's bidirectional prefix path (Cake): hits equal cold runs in every merge mode.

Compute from the front and loads from the back meet wherever timing puts them; whatever the
meeting point, the greedy tokens and the first token's log-probabilities must equal a cold run
(the simulator in tests/unit/testing/cake_sim_test.py forces each meeting point exactly). Each engine
here keeps the per-position writer map on, so a position written twice raises.
"""

import os

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import SamplingParams, codecs
from kvjax.testing.engines import real_llm

C = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 256, 3 * C + 17)]
LENGTHS = (1, C - 1, C, C + 1, 3 * C, 3 * C + 17)


def make_llm(store, mode="cake", **kw):
  kw.setdefault("enable_prefix_caching", False)  # store loads are counted: no device hits
  llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store,
                 kv_chunk_size=C, kv_merge_mode=mode, **kw)
  llm.engine.check_writes = True
  return llm


class CakeEngineTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = make_llm(None)
    cls.cold = {n: cold.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)[0] for n in LENGTHS}

  def assert_equals_cold(self, out, n):
    want = self.cold[n]
    self.assertEqual(out.token_ids, want.token_ids)
    got_lp, want_lp = out.logprobs[0], want.logprobs[0]
    self.assertEqual(set(got_lp), set(want_lp))
    for t in want_lp:
      self.assertAlmostEqual(got_lp[t], want_lp[t], delta=1e-4)

  def assert_accounting(self, out, n, stored_chunks):
    trace = out.metrics.merge
    candidates = (n - 1) // C  # full chunks before the last token
    if trace is None:  # nothing stored: plain prefill
      self.assertEqual(min(stored_chunks, candidates), 0)
      self.assertEqual(out.metrics.num_computed_tokens, n)
      return
    self.assertEqual(trace.num_chunks, candidates)
    self.assertLessEqual(len(trace.chunks_loaded), stored_chunks)
    done = set(trace.chunks_computed) | set(trace.chunks_loaded)
    self.assertEqual(done, set(range(candidates)))  # every prefix chunk written ...
    self.assertFalse(set(trace.chunks_computed) & set(trace.chunks_loaded))  # ... once
    self.assertEqual(out.num_cached_tokens, C * len(trace.chunks_loaded))
    self.assertEqual(out.metrics.num_computed_tokens + out.num_cached_tokens, n)

  @parameterized.product(mode=("cake", "load_only", "compute_only"), n=LENGTHS)
  @pytest.mark.slow  # same assertions on the fake runner: cake_engine_unit_test.py
  def test_every_stored_prefix_length_equals_cold(self, mode, n):
    llm = make_llm("memory://", mode=mode)
    for stored in range((n - 1) // C + 1):
      with self.subTest(stored_chunks=stored):
        salt = f"stored-{stored}"  # a fresh key namespace per case (tenant isolation)
        if stored:  # store exactly `stored` chunks of the prompt's prefix
          llm.generate({"prompt_token_ids": PROMPT[:stored * C + 1], "cache_salt": salt},
                       PARAMS)
          llm.flush()
        out = llm.generate({"prompt_token_ids": PROMPT[:n], "cache_salt": salt}, PARAMS)[0]
        self.assert_equals_cold(out, n)
        self.assert_accounting(out, n, stored)
        if mode == "compute_only":
          self.assertEqual(out.num_cached_tokens, 0)
        if mode == "load_only":
          self.assertEqual(out.num_cached_tokens, C * min(stored, (n - 1) // C))
    llm.close()

  @parameterized.parameters("cake", "load_only")
  def test_missing_middle_and_corrupt_chunks_are_computed(self, mode):
    root = self.create_tempdir().full_path
    llm = make_llm(f"file://{root}", mode=mode)
    n = 3 * C + 17
    llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)
    llm.flush()
    from kvjax.storage import keys  # noqa: PLC0415
    hashes = keys.chunk_hashes(llm.kv_store.namespace(None), PROMPT[:n])
    os.remove(os.path.join(root, "index", f"{hashes[1]}.json"))  # missing middle chunk
    data = []
    for d, _, files in os.walk(os.path.join(root, "data")):
      data += [os.path.join(d, f) for f in files if hashes[2] in d or hashes[2] in f]
    for victim in data:  # truncate chunk 2's data: it fails when loaded
      with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)[0]
    self.assert_equals_cold(out, n)
    self.assert_accounting(out, n, 4)
    trace = out.metrics.merge
    self.assertIn(1, trace.chunks_computed)
    self.assertIn(2, trace.chunks_computed)
    if mode == "load_only":
      # Insertion order depends on when the reads land (they refill as they land, and chunks
      # that land in one step are inserted in index order): compare the sets.
      self.assertEqual((sorted(trace.chunks_loaded), trace.chunks_rejected), ([0, 3], [2]))
    llm.close()

  @parameterized.parameters(("raw", 0.0), ("int8", 1e-3), ("int4", 2e-2), ("cachegen", 2e-3))
  def test_chunks_stored_with_each_codec_load_and_decode(self, codec, logprob_tol):
    llm = make_llm("memory://", mode="load_only", kv_codec=codec)
    n = 3 * C + 17
    llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)
    llm.flush()
    out = llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)[0]
    self.assertEqual(out.num_cached_tokens, 4 * C)
    levels = set(out.metrics.merge.levels.values())
    # The one level stored by default (kvjax.codecs.DEFAULT_LEVELS) is the one loaded.
    self.assertEqual(levels, {f"{codec}/{codecs.DEFAULT_LEVELS[codec]}"})
    want = self.cold[n]
    if codec == "raw":
      self.assert_equals_cold(out, n)  # lossless: identical to a cold run
    for t, lp in want.logprobs[0].items():
      if t in out.logprobs[0]:
        self.assertAlmostEqual(out.logprobs[0][t], lp, delta=logprob_tol)
    self.assertEqual(out.token_ids[0], want.token_ids[0])
    llm.close()

  @pytest.mark.slow  # same assertions on the fake runner: cake_engine_unit_test.py
  def test_a_tight_ttft_target_loads_the_smallest_level(self):
    llm = make_llm("memory://", mode="load_only", kv_codec="cachegen",
                   kv_codec_levels=(0, 1, 2, 3), kv_ttft_target_s=1e-9,
                   kv_codec_consistent=False)  # a level chosen by timing, on purpose
    n = 3 * C + 17
    llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)
    llm.flush()
    out = llm.generate({"prompt_token_ids": PROMPT[:n]}, PARAMS)[0]
    self.assertEqual(set(out.metrics.merge.levels.values()), {"cachegen/3"})
    llm.close()

  def test_bad_codec_options(self):
    with self.assertRaisesRegex(ValueError, "kv_codec='zip'"):
      make_llm("memory://", kv_codec="zip")
    with self.assertRaisesRegex(ValueError, "kv_codec_levels"):
      make_llm("memory://", kv_codec="int8", kv_codec_levels=(2,))
    with self.assertRaisesRegex(ValueError, "kv_merge_mode='both'"):
      make_llm("memory://", mode="both")

  @pytest.mark.slow  # same assertions on the fake runner: cake_engine_unit_test.py
  def test_cancelled_loads_release_their_staging(self):
    llm = make_llm("memory://")
    engine = llm.engine
    n = 3 * C + 17
    llm.generate({"prompt_token_ids": PROMPT[:n]}, SamplingParams(max_tokens=1))
    llm.flush()
    rng = np.random.default_rng(0)
    for i in range(100):
      rid = engine.add_request(PROMPT[:int(rng.integers(1, n + 1))],
                               SamplingParams(max_tokens=int(rng.integers(1, 3))))
      for _ in range(int(rng.integers(0, 3))):  # abort some mid-flight, others run to the end
        engine.step()
      if i % 3 == 0:
        engine.abort_request(rid)
      while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats().loader
    self.assertEqual((stats.queued, stats.in_flight, stats.staged_bytes), (0, 0, 0))
    self.assertEqual(stats.started, stats.landed + stats.abandoned_reads)
    self.assertEqual(llm.kv_store.loads_in_flight(), 0)
    self.assertGreater(stats.started, 0)
    llm.close()

  def test_a_hit_beside_decodes_waits_for_its_loads_and_equals_cold(self):
    """Short first-token steps, rule c: a store hit admitted while another request decodes
    gets a step that computes nothing and waits for its loads (a tiny model's chunks are
    predicted to land far within half a step); its tail then computes with the decode, and
    every answer equals its cold run."""
    n = 3 * C + 17
    for short in (True, False):
      llm = make_llm("memory://", mode="load_only", short_first_token_steps=short)
      engine = llm.engine
      llm.generate({"prompt_token_ids": PROMPT[:3 * C + 1]}, PARAMS)
      llm.flush()
      steps = []
      engine.add_step_observer(steps.append)
      other = engine.add_request(PROMPT[40:60], SamplingParams(max_tokens=12, temperature=0.0))
      while len(steps) < 3:  # the other request's prompt, then two decodes
        engine.step()
      hit = engine.add_request(PROMPT[:n], PARAMS)
      done = {}
      while engine.has_unfinished_requests():
        for o in engine.step():
          if o.finished:
            done[o.request_id] = o
      self.assert_equals_cold(done[hit], n)
      self.assertEqual(done[hit].num_cached_tokens, 3 * C)
      first = next(i for i, rec in enumerate(steps) if rec.plan.loads)
      waited = steps[first].plan
      self.assertEqual(bool(waited.wait_s), short)
      self.assertEqual(not waited.decodes, short)  # the decode waits out the loads
      if short:
        # Nothing computes until the hit's chunks are in; then its tail goes with the decode.
        tail = next(rec.plan for rec in steps[first:] if rec.plan.prefills)
        self.assertEqual([(c.request_id, c.start, c.num_tokens, c.is_last)
                          for c in tail.prefills],
                         [(hit, 3 * C, 16, False), (hit, 4 * C, 1, True)])
        self.assertEqual([d.request_id for d in tail.decodes], [other])
      cold = make_llm(None).generate({"prompt_token_ids": PROMPT[40:60]},
                                     SamplingParams(max_tokens=12, temperature=0.0))[0]
      self.assertEqual(done[other].token_ids, cold.token_ids)
      llm.close()


if __name__ == "__main__":
  absltest.main()
