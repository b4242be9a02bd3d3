"""The engine's bidirectional prefix path (Cake) on the fake runner: hits equal cold runs in
every merge mode, at every stored prefix length; missing, truncated and corrupt chunks are
computed; each codec's chunks load; cancelled loads release their staging.

The fake runner (`kvjax.testing.fake_runner`) is a small numpy attention model whose logits
depend on the KV its block tables really hold, so a wrong load or insert changes the answer and
a right one equals the cold run bit for bit. The tests run through `LLM` (`engines.fake_llm`);
tests/integration/engine/cake_engine_test.py subclasses `CakeEngineHitUnitTest` and
`CakeEngineUnitTest` with the real tiny model (`build_llm`) and its tolerances.
"""

import os

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams, codecs
from kvjax.storage.format import keys
from kvjax.testing import engines

C = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 256, 3 * C + 17)]
LENGTHS = (1, C - 1, C, C + 1, 3 * C, 3 * C + 17)


def gen(llm, n, params=PARAMS, salt=None):
  """`PROMPT[:n]` through `llm.generate` (under `salt`, a key namespace, when given)."""
  prompt = {"prompt_token_ids": PROMPT[:n]}
  if salt is not None:
    prompt["cache_salt"] = salt
  return llm.generate(prompt, params)[0]


class CakeEngineCase(parameterized.TestCase):
  """The tests' `LLM`s, cold runs and checks: the fake runner here, the real tiny model in
  tests/integration/engine/cake_engine_test.py (which overrides `build_llm`, the tolerances and
  `runner_calls`)."""

  #: A hit's first-token log-probs against the cold run's: bit for bit on the fake.
  LOGPROB_DELTA = 0.0
  #: Per codec, a loaded hit's first-token log-probs against the cold run's. The fake's Gaussian
  #: KV is not what the reference codecs' bins were tuned on (real KV): its errors are larger.
  CODEC_LOGPROB_TOL = {"raw": 0.0, "int8": 0.05, "int4": 0.5, "cachegen": 0.75}

  @classmethod
  def build_llm(cls, **options):
    return engines.fake_llm(**options)

  @classmethod
  def make_llm(cls, store, mode="cake", **kw):
    """An `LLM` of these tests over `store` (a URL or None) with the per-position writer map on
    (a position written twice raises)."""
    kw.setdefault("enable_prefix_caching", False)  # store loads are counted: no device hits
    kw.setdefault("max_num_seqs", 2)
    llm = cls.build_llm(chunk_sizes=(16, 32, 64), kv_store=store,
                        kv_chunk_size=C, kv_merge_mode=mode, **kw)
    llm.engine.check_writes = True
    return llm

  def runner_calls(self, llm):
    """The runner's recorded calls (`FakeRunner.calls`); None where the runner records none."""
    return llm.engine.runner.calls

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = cls.make_llm(None)
    cls.cold = {n: gen(cold, n) for n in LENGTHS}
    cold.close()

  def assert_equals_cold(self, out, n):
    want = self.cold[n]
    self.assertEqual(out.token_ids, want.token_ids)
    got_lp, want_lp = out.logprobs[0], want.logprobs[0]
    self.assertEqual(set(got_lp), set(want_lp))
    for t in want_lp:  # a delta of 0: equal bit for bit
      self.assertAlmostEqual(got_lp[t], want_lp[t], delta=self.LOGPROB_DELTA)

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


class CakeEngineHitUnitTest(CakeEngineCase):
  """The cases the real tiny model also runs in the default suite: faults, codecs, options."""

  @parameterized.parameters("cake", "load_only")
  def test_missing_middle_and_corrupt_chunks_are_computed(self, mode):
    root = self.create_tempdir().full_path
    llm = self.make_llm(f"file://{root}", mode=mode)
    n = 3 * C + 17
    gen(llm, n)
    llm.flush()
    hashes = keys.chunk_hashes(llm.kv_store.namespace(None), PROMPT[:n])
    os.remove(os.path.join(root, "index", f"{hashes[1]}.json"))  # missing middle chunk
    data = []
    for d, _, files in os.walk(os.path.join(root, "data")):
      data += [os.path.join(d, f) for f in files if hashes[2] in d or hashes[2] in f]
    self.assertNotEmpty(data)
    for victim in data:  # truncate chunk 2's data: it fails when loaded
      with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = gen(llm, n)
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

  @parameterized.parameters("raw", "int8", "int4", "cachegen")
  def test_chunks_stored_with_each_codec_load_and_decode(self, codec):
    llm = self.make_llm(engines.memory_store_url(), mode="load_only", kv_codec=codec)
    n = 3 * C + 17
    gen(llm, n)
    llm.flush()
    out = gen(llm, n)
    self.assertEqual(out.num_cached_tokens, 4 * C)
    levels = set(out.metrics.merge.levels.values())
    # The one level stored by default (kvjax.codecs.DEFAULT_LEVELS) is the one loaded.
    self.assertEqual(levels, {f"{codec}/{codecs.DEFAULT_LEVELS[codec]}"})
    calls = self.runner_calls(llm)
    if calls is not None:
      self.assertEqual([c[0] for c in calls if c[0].startswith("insert")][-4:],
                       ["insert_chunk" if codec == "raw" else "insert_payload"] * 4)
    want = self.cold[n]
    if codec == "raw":
      self.assert_equals_cold(out, n)  # lossless: identical to a cold run
    else:
      self.assertNotEqual(out.logprobs[0], want.logprobs[0])  # lossy: the loaded KV is not
    for t, lp in want.logprobs[0].items():
      if t in out.logprobs[0]:
        self.assertAlmostEqual(out.logprobs[0][t], lp, delta=self.CODEC_LOGPROB_TOL[codec])
    self.assertEqual(out.token_ids[0], want.token_ids[0])
    llm.close()

  def test_bad_codec_options(self):
    with self.assertRaisesRegex(ValueError, "kv_codec='zip'"):
      self.make_llm("memory://", kv_codec="zip")
    with self.assertRaisesRegex(ValueError, "kv_codec_levels"):
      self.make_llm("memory://", kv_codec="int8", kv_codec_levels=(2,))
    with self.assertRaisesRegex(ValueError, "kv_merge_mode='both'"):
      self.make_llm("memory://", mode="both")


class CakeEngineUnitTest(CakeEngineCase):
  """Every stored prefix length in every merge mode, the TTFT target's level, cancelled loads
  (the real tiny model runs them in the slow suite)."""

  @parameterized.product(mode=("cake", "load_only", "compute_only"), n=LENGTHS)
  def test_every_stored_prefix_length_equals_cold(self, mode, n):
    llm = self.make_llm(engines.memory_store_url(), mode=mode)
    for stored in range((n - 1) // C + 1):
      with self.subTest(stored_chunks=stored):
        salt = f"stored-{stored}"  # a fresh key namespace per case (tenant isolation)
        if stored:  # store exactly `stored` chunks of the prompt's prefix
          gen(llm, stored * C + 1, salt=salt)
          llm.flush()
        out = gen(llm, n, salt=salt)
        self.assert_equals_cold(out, n)
        self.assert_accounting(out, n, stored)
        if mode == "compute_only":
          self.assertEqual(out.num_cached_tokens, 0)
        if mode == "load_only":
          self.assertEqual(out.num_cached_tokens, C * min(stored, (n - 1) // C))
    llm.close()

  def test_a_tight_ttft_target_loads_the_smallest_level(self):
    llm = self.make_llm(engines.memory_store_url(), mode="load_only", kv_codec="cachegen",
                        kv_codec_levels=(0, 1, 2, 3), kv_ttft_target_s=1e-9,
                        kv_codec_consistent=False)  # a level chosen by timing, on purpose
    n = 3 * C + 17
    gen(llm, n)
    llm.flush()
    out = gen(llm, n)
    self.assertEqual(set(out.metrics.merge.levels.values()), {"cachegen/3"})
    llm.close()

  def test_cancelled_loads_release_their_staging(self):
    llm = self.make_llm(engines.memory_store_url())
    e = llm.engine
    n = 3 * C + 17
    gen(llm, n, SamplingParams(max_tokens=1))
    llm.flush()
    rng = np.random.default_rng(0)
    for i in range(100):
      rid = e.add_request(PROMPT[:int(rng.integers(1, n + 1))],
                          SamplingParams(max_tokens=int(rng.integers(1, 3))))
      for _ in range(int(rng.integers(0, 3))):  # abort some mid-flight, others run to the end
        e.step()
      if i % 3 == 0:
        e.abort_request(rid)
      while e.has_unfinished_requests():
        e.step()
    stats = e.stats().loader
    self.assertEqual((stats.queued, stats.in_flight, stats.staged_bytes), (0, 0, 0))
    self.assertEqual(stats.started, stats.landed + stats.abandoned_reads)
    self.assertEqual(llm.kv_store.loads_in_flight(), 0)
    self.assertGreater(stats.started, 0)
    llm.close()


class CakeEngineFakeUnitTest(CakeEngineCase):
  """Cases on the fake runner alone: the fake model itself, a swapped insert, a flipped byte,
  the consistent codec's independence of the meeting point, several restoring prompts."""

  def test_the_fake_model_tells_prompts_and_positions_apart(self):
    # Different last tokens and a shifted prompt give different answers (the assertions
    # above could not pass with a model that ignores its KV).
    llm = self.make_llm(None)
    a = gen(llm, 3 * C + 17)
    b = llm.generate({"prompt_token_ids": PROMPT[:3 * C + 16] + [(PROMPT[3 * C + 16] + 1) % 256]},
                     PARAMS)[0]
    c = llm.generate({"prompt_token_ids": [7] + PROMPT[1:3 * C + 17]}, PARAMS)[0]
    self.assertNotEqual(a.logprobs[0], b.logprobs[0])
    self.assertNotEqual(a.logprobs[0], c.logprobs[0])
    llm.close()

  def test_a_wrong_chunk_changes_the_answer(self):
    # Chunk 1's stored KV replaced by chunk 2's: the load "succeeds" (same shape, valid
    # record), and the answer differs from cold: the fake's logits read the loaded KV.
    llm = self.make_llm(engines.memory_store_url(), mode="load_only")
    n = 3 * C + 17
    gen(llm, n)
    llm.flush()
    runner = llm.engine.runner
    real_insert = runner.insert_chunk
    swapped = []

    def insert_elsewhere(kv, blocks, start):
      swapped.append(start)
      real_insert(kv[:, :, ::-1], blocks, start)  # the chunk's rows in reverse order

    runner.insert_chunk = insert_elsewhere
    out = gen(llm, n)
    self.assertTrue(swapped)
    self.assertNotEqual(out.logprobs[0], self.cold[n].logprobs[0])
    llm.close()

  def test_a_flipped_byte_is_detected_and_computed(self):
    root = self.create_tempdir().full_path
    llm = self.make_llm(f"file://{root}", mode="load_only")
    n = 3 * C + 17
    gen(llm, n)
    llm.flush()
    hashes = keys.chunk_hashes(llm.kv_store.namespace(None), PROMPT[:n])
    victims = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(root, "data"))
               for f in files if hashes[0] in d or hashes[0] in f]
    self.assertNotEmpty(victims)
    for victim in victims:  # one flipped byte in the middle of chunk 0's values
      with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    out = gen(llm, n)
    self.assert_equals_cold(out, n)
    self.assertEqual(out.metrics.merge.chunks_rejected, [0])
    self.assertIn(0, out.metrics.merge.chunks_computed)
    llm.close()

  def assert_consistent(self, **kw):
    # kv_codec_consistent: every computed chunk passes through the stored encoding, so a hit
    # of any length, loaded whole or met by compute anywhere, equals the cold run exactly.
    for mode in ("load_only", "cake"):
      llm = self.make_llm(engines.memory_store_url(), mode=mode, kv_codec="int8",
                          kv_codec_consistent=True, **kw)
      n = 3 * C + 17
      cold = gen(llm, n, salt="cold")
      for stored in range(1, 4):
        salt = f"stored-{stored}"
        gen(llm, stored * C + 1, salt=salt)
        llm.flush()
        out = gen(llm, n, salt=salt)
        self.assertEqual((out.token_ids, out.logprobs[0]), (cold.token_ids, cold.logprobs[0]))
        if mode == "load_only":
          self.assertEqual(out.num_cached_tokens, stored * C)
      llm.close()

  def test_consistent_codec_outputs_do_not_depend_on_the_meeting_point(self):
    self.assert_consistent(max_num_batched_tokens=C)  # one store chunk per step

  def test_consistent_codec_outputs_with_several_chunks_a_step(self):
    """A token budget of several store chunks: consistent mode still plans one store chunk of
    a request per step (in one ragged step a later chunk would attend to an earlier chunk's KV
    before its round trip through the codec, while a hit's attends to the decoded chunk)."""
    self.assert_consistent()

  @parameterized.parameters("cake", "load_only")
  def test_several_prompts_restoring_at_once_equal_cold(self, mode):
    # Four prompts with stored prefixes arrive together: the scheduler plans them jointly
    # (shortest remaining first over the shared link and budget, `kvjax/scheduler/cake_joint.py`)
    # and each answer equals its cold run bit for bit.
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(0, 256, n)]}
               for n in (2 * C + 5, 5 * C + 1, 3 * C + 17, 4 * C + 3)]
    cold_llm = self.make_llm(None, max_num_seqs=4)
    cold = cold_llm.generate(prompts, PARAMS)
    cold_llm.close()
    llm = self.make_llm(engines.memory_store_url(), mode=mode, max_num_seqs=4)
    for p in prompts:
      llm.generate(p, PARAMS)
    llm.flush()
    outs = llm.generate(prompts, PARAMS)
    for p, out, want in zip(prompts, outs, cold):
      self.assertEqual(out.token_ids, want.token_ids)
      self.assertEqual(out.logprobs[0], want.logprobs[0])
      trace = out.metrics.merge
      n = len(p["prompt_token_ids"])
      self.assertEqual(set(trace.chunks_computed) | set(trace.chunks_loaded),
                       set(range((n - 1) // C)))
      if mode == "load_only":
        self.assertEqual(out.num_cached_tokens, C * ((n - 1) // C))
    llm.close()


if __name__ == "__main__":
  absltest.main()
