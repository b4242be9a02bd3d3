"""The engine's bidirectional prefix path (Cake) on the fake runner: hits equal cold runs in
every merge mode, at every stored prefix length; missing, truncated and corrupt chunks are
computed; each codec's chunks load; cancelled loads release their staging.

The fake runner (`kvjax.testing.fake_runner`) is a small numpy attention model whose logits
depend on the KV its block tables really hold, so a wrong load or insert changes the answer and
a right one equals the cold run bit for bit. The same assertions on the real tiny model are
tests/integration/engine/cake_engine_test.py (slow-marked where this file covers them).
"""

import os

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams, codecs
from kvjax.storage import keys
from kvjax.testing import engines

C = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, 256, 3 * C + 17)]
LENGTHS = (1, C - 1, C, C + 1, 3 * C, 3 * C + 17)


def make_engine(store, mode="cake", **kw):
  kw.setdefault("enable_prefix_caching", False)  # store loads are counted: no device hits
  return engines.fake_engine(kv_store=store, kv_chunk_size=C, merge_mode=mode, max_num_seqs=2,
                             chunk_sizes=(16, 32, 64), **kw)


def gen(engine, n, params=PARAMS, **kw):
  return engines.generate(engine, [PROMPT[:n]], params, **kw)[0]


class CakeEngineUnitTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = make_engine(None)
    cls.cold = {n: gen(cold, n) for n in LENGTHS}
    engines.close_engine(cold)

  def assert_equals_cold(self, out, n):
    want = self.cold[n]
    self.assertEqual(out.token_ids, want.token_ids)
    self.assertEqual(out.logprobs[0], want.logprobs[0])  # bit for bit

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

  def test_the_fake_model_tells_prompts_and_positions_apart(self):
    # Different last tokens and a shifted prompt give different answers (the assertions
    # below could not pass with a model that ignores its KV).
    e = make_engine(None)
    a = gen(e, 3 * C + 17)
    b = engines.generate(e, [PROMPT[:3 * C + 16] + [(PROMPT[3 * C + 16] + 1) % 256]], PARAMS)[0]
    c = engines.generate(e, [[7] + PROMPT[1:3 * C + 17]], PARAMS)[0]
    self.assertNotEqual(a.logprobs[0], b.logprobs[0])
    self.assertNotEqual(a.logprobs[0], c.logprobs[0])
    engines.close_engine(e)

  def test_a_wrong_chunk_changes_the_answer(self):
    # Chunk 1's stored KV replaced by chunk 2's: the load "succeeds" (same shape, valid
    # record), and the answer differs from cold: the fake's logits read the loaded KV.
    e = make_engine(engines.memory_store_url(), mode="load_only")
    n = 3 * C + 17
    gen(e, n)
    e.kv_store.flush()
    runner = e.runner
    real_insert = runner.insert_chunk
    swapped = []

    def insert_elsewhere(kv, blocks, start):
      swapped.append(start)
      real_insert(kv[:, :, ::-1], blocks, start)  # the chunk's rows in reverse order

    runner.insert_chunk = insert_elsewhere
    out = gen(e, n)
    self.assertTrue(swapped)
    self.assertNotEqual(out.logprobs[0], self.cold[n].logprobs[0])
    engines.close_engine(e)

  @parameterized.product(mode=("cake", "load_only", "compute_only"), n=LENGTHS)
  def test_every_stored_prefix_length_equals_cold(self, mode, n):
    e = make_engine(engines.memory_store_url(), mode=mode)
    for stored in range((n - 1) // C + 1):
      with self.subTest(stored_chunks=stored):
        salt = f"stored-{stored}"  # a fresh key namespace per case (tenant isolation)
        if stored:  # store exactly `stored` chunks of the prompt's prefix
          gen(e, stored * C + 1, cache_salt=salt)
          e.kv_store.flush()
        out = gen(e, n, cache_salt=salt)
        self.assert_equals_cold(out, n)
        self.assert_accounting(out, n, stored)
        if mode == "compute_only":
          self.assertEqual(out.num_cached_tokens, 0)
        if mode == "load_only":
          self.assertEqual(out.num_cached_tokens, C * min(stored, (n - 1) // C))
    engines.close_engine(e)

  @parameterized.parameters("cake", "load_only")
  def test_missing_middle_and_corrupt_chunks_are_computed(self, mode):
    root = self.create_tempdir().full_path
    e = make_engine(f"file://{root}", mode=mode)
    n = 3 * C + 17
    gen(e, n)
    e.kv_store.flush()
    hashes = keys.chunk_hashes(e.kv_store.namespace(None), PROMPT[:n])
    os.remove(os.path.join(root, "index", f"{hashes[1]}.json"))  # missing middle chunk
    data = []
    for d, _, files in os.walk(os.path.join(root, "data")):
      data += [os.path.join(d, f) for f in files if hashes[2] in d or hashes[2] in f]
    self.assertNotEmpty(data)
    for victim in data:  # truncate chunk 2's data: it fails when loaded
      with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = gen(e, n)
    self.assert_equals_cold(out, n)
    self.assert_accounting(out, n, 4)
    trace = out.metrics.merge
    self.assertIn(1, trace.chunks_computed)
    self.assertIn(2, trace.chunks_computed)
    if mode == "load_only":
      self.assertEqual((sorted(trace.chunks_loaded), trace.chunks_rejected), ([0, 3], [2]))
    engines.close_engine(e)

  def test_a_flipped_byte_is_detected_and_computed(self):
    root = self.create_tempdir().full_path
    e = make_engine(f"file://{root}", mode="load_only")
    n = 3 * C + 17
    gen(e, n)
    e.kv_store.flush()
    hashes = keys.chunk_hashes(e.kv_store.namespace(None), PROMPT[:n])
    victims = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(root, "data"))
               for f in files if hashes[0] in d or hashes[0] in f]
    self.assertNotEmpty(victims)
    for victim in victims:  # one flipped byte in the middle of chunk 0's values
      with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    out = gen(e, n)
    self.assert_equals_cold(out, n)
    self.assertEqual(out.metrics.merge.chunks_rejected, [0])
    self.assertIn(0, out.metrics.merge.chunks_computed)
    engines.close_engine(e)

  # The fake's Gaussian KV is not what the reference codecs' bins were tuned on (real KV):
  # its errors are larger; the real model's tolerances are in cake_engine_test.py.
  @parameterized.parameters(("raw", 0.0), ("int8", 0.05), ("int4", 0.5), ("cachegen", 0.75))
  def test_chunks_stored_with_each_codec_load_and_decode(self, codec, logprob_tol):
    e = make_engine(engines.memory_store_url(), mode="load_only", kv_codec=codec)
    n = 3 * C + 17
    gen(e, n)
    e.kv_store.flush()
    out = gen(e, n)
    self.assertEqual(out.num_cached_tokens, 4 * C)
    levels = set(out.metrics.merge.levels.values())
    # The one level stored by default (kvjax.codecs.DEFAULT_LEVELS) is the one loaded.
    self.assertEqual(levels, {f"{codec}/{codecs.DEFAULT_LEVELS[codec]}"})
    self.assertEqual([c[0] for c in e.runner.calls if c[0].startswith("insert")][-4:],
                     ["insert_chunk" if codec == "raw" else "insert_payload"] * 4)
    want = self.cold[n]
    if codec == "raw":
      self.assert_equals_cold(out, n)  # lossless: identical to a cold run
    else:
      self.assertNotEqual(out.logprobs[0], want.logprobs[0])  # lossy: the loaded KV is not
    for t, lp in want.logprobs[0].items():
      if t in out.logprobs[0]:
        self.assertAlmostEqual(out.logprobs[0][t], lp, delta=logprob_tol)
    self.assertEqual(out.token_ids[0], want.token_ids[0])
    engines.close_engine(e)

  def assert_consistent(self, **kw):
    # kv_codec_consistent: every computed chunk passes through the stored encoding, so a hit
    # of any length, loaded whole or met by compute anywhere, equals the cold run exactly.
    for mode in ("load_only", "cake"):
      e = make_engine(engines.memory_store_url(), mode=mode, kv_codec="int8",
                      kv_codec_consistent=True, **kw)
      n = 3 * C + 17
      cold = gen(e, n, cache_salt="cold")
      for stored in range(1, 4):
        salt = f"stored-{stored}"
        gen(e, stored * C + 1, cache_salt=salt)
        e.kv_store.flush()
        out = gen(e, n, cache_salt=salt)
        self.assertEqual((out.token_ids, out.logprobs[0]), (cold.token_ids, cold.logprobs[0]))
        if mode == "load_only":
          self.assertEqual(out.num_cached_tokens, stored * C)
      engines.close_engine(e)

  def test_consistent_codec_outputs_do_not_depend_on_the_meeting_point(self):
    self.assert_consistent(max_num_batched_tokens=C)  # one store chunk per step

  def test_consistent_codec_outputs_with_several_chunks_a_step(self):
    """A token budget of several store chunks: consistent mode still plans one store chunk of
    a request per step (in one ragged step a later chunk would attend to an earlier chunk's KV
    before its round trip through the codec, while a hit's attends to the decoded chunk)."""
    self.assert_consistent()

  def test_a_tight_ttft_target_loads_the_smallest_level(self):
    e = make_engine(engines.memory_store_url(), mode="load_only", kv_codec="cachegen",
                    kv_codec_levels=(0, 1, 2, 3), kv_ttft_target_s=1e-9)
    n = 3 * C + 17
    gen(e, n)
    e.kv_store.flush()
    out = gen(e, n)
    self.assertEqual(set(out.metrics.merge.levels.values()), {"cachegen/3"})
    engines.close_engine(e)

  def test_cancelled_loads_release_their_staging(self):
    e = make_engine(engines.memory_store_url())
    n = 3 * C + 17
    gen(e, n, SamplingParams(max_tokens=1))
    e.kv_store.flush()
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
    self.assertEqual(e.kv_store.loads_in_flight(), 0)
    self.assertGreater(stats.started, 0)
    engines.close_engine(e)

  @parameterized.parameters("cake", "load_only")
  def test_several_prompts_restoring_at_once_equal_cold(self, mode):
    # Four prompts with stored prefixes arrive together: the scheduler plans them jointly
    # (shortest remaining first over the shared link and budget, `kvjax/scheduler/cake_joint.py`)
    # and each answer equals its cold run bit for bit.
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (2 * C + 5, 5 * C + 1,
                                                                   3 * C + 17, 4 * C + 3)]
    cold_engine = engines.fake_engine(kv_chunk_size=C, max_num_seqs=4, chunk_sizes=(16, 32, 64),
                                      enable_prefix_caching=False)
    cold = engines.generate(cold_engine, prompts, PARAMS)
    engines.close_engine(cold_engine)
    e = engines.fake_engine(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                            max_num_seqs=4, chunk_sizes=(16, 32, 64), merge_mode=mode,
                            enable_prefix_caching=False)
    for p in prompts:
      engines.generate(e, [p], PARAMS)
    e.kv_store.flush()
    outs = engines.generate(e, prompts, PARAMS)
    for p, out, want in zip(prompts, outs, cold):
      self.assertEqual(out.token_ids, want.token_ids)
      self.assertEqual(out.logprobs[0], want.logprobs[0])
      trace = out.metrics.merge
      self.assertEqual(set(trace.chunks_computed) | set(trace.chunks_loaded),
                       set(range((len(p) - 1) // C)))
      if mode == "load_only":
        self.assertEqual(out.num_cached_tokens, C * ((len(p) - 1) // C))
    engines.close_engine(e)


if __name__ == "__main__":
  absltest.main()
