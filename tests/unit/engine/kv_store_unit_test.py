"""The engine with a prefix-cache store: hits equal cold runs, faults degrade to compute.

On the fake runner (`kvjax.testing.engines.fake_llm`: `LLM` over a numpy model); the real
tiny model's run of the same tests is tests/integration/engine/kv_store_test.py."""

import os

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.models.nn import config
from kvjax.models.loading import safetensors_loader
from kvjax.models.loading.registry import tiny_params
from kvjax.testing import engines

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
C = 32
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 256, 150)]


def store_options(store, **kw):
  """The `LLM` options of these tests, over a store URL (or None)."""
  # Load-only makes the chunk accounting exact (every stored chunk is loaded); the Cake merge's
  # own tests (cake_engine_test.py) cover the other modes.
  kw.setdefault("kv_merge_mode", "load_only")
  # These tests count store hits: a device prefix hit (paged layout) would serve them instead.
  kw.setdefault("enable_prefix_caching", False)
  return dict(max_num_seqs=2, chunk_sizes=(16, 32, 64), kv_store=store, kv_chunk_size=C, **kw)


class KVStoreCase(parameterized.TestCase):
  """The tests' `LLM`s and helpers: the fake runner here, the real tiny model in
  tests/integration/engine/kv_store_test.py (which overrides `build_llm`)."""

  @classmethod
  def build_llm(cls, model="tiny", **options):
    return engines.fake_llm(model, **options)

  @classmethod
  def make_llm(cls, store, **kw):
    return cls.build_llm(**store_options(store, **kw))

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cold = cls.make_llm(None)
    cls.cold = {n: cold.generate({"prompt_token_ids": PROMPT[:n]}, GREEDY)[0].token_ids
                for n in (150, 128)}

  def setUp(self):
    super().setUp()
    self.root = self.create_tempdir().full_path
    self.url = f"file://{self.root}"

  def run_prompt(self, llm, n=150, salt=None):
    prompt = {"prompt_token_ids": PROMPT[:n]}
    if salt is not None:
      prompt["cache_salt"] = salt
    out = llm.generate(prompt, GREEDY)[0]
    llm.flush()
    return out

  def _data_files(self):
    out = []
    for root, _, files in os.walk(os.path.join(self.root, "data")):
      out += [os.path.join(root, f) for f in files]
    return sorted(out)


class KVStoreHitUnitTest(KVStoreCase):
  """The cases the real tiny model also runs in the default suite."""

  @parameterized.parameters("file", "memory", "ocdbt")
  def test_second_request_hits_and_equals_cold(self, backend):
    url = {"file": self.url, "memory": "memory://", "ocdbt": f"ocdbt+file://{self.root}"}[backend]
    llm = self.make_llm(url)
    first = self.run_prompt(llm)
    self.assertEqual((first.num_cached_tokens, first.metrics.num_computed_tokens), (0, 150))
    self.assertEqual(llm.kv_store.saver_stats.chunks_saved, 150 // C)
    second = self.run_prompt(llm)
    self.assertEqual(second.num_cached_tokens, C * ((150 - 1) // C))  # 128
    self.assertEqual(second.metrics.num_loaded_tokens, 128)
    self.assertEqual(second.metrics.num_computed_tokens, 22)
    self.assertEqual(first.token_ids, self.cold[150])
    self.assertEqual(second.token_ids, self.cold[150])
    llm.close()

  def test_unwritable_store_and_bad_link_fail_fast(self):
    blocker = self.create_tempfile("not_a_dir").full_path
    with self.assertRaisesRegex(ValueError, "cannot create"):
      self.make_llm(f"file://{blocker}/store")
    with self.assertRaisesRegex(ValueError, "kv_link_bytes_per_s='fast'"):
      self.make_llm(self.url, kv_link_bytes_per_s="fast")
    with self.assertRaisesRegex(ValueError, "kv_store is empty"):
      self.make_llm("")

  def test_bad_store_arguments(self):
    with self.assertRaisesRegex(ValueError, "kv_chunk_size=0"):
      self.build_llm(kv_store=self.url, kv_chunk_size=0)
    with self.assertRaisesRegex(ValueError, "scheme|unknown|unsupported"):
      self.make_llm("gopher://x")


class KVStoreEngineUnitTest(KVStoreCase):

  def test_fresh_llm_on_the_same_store_hits(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)
    llm.close()
    fresh = self.make_llm(self.url)
    out = self.run_prompt(fresh)
    self.assertEqual(out.num_cached_tokens, 128)
    self.assertEqual(out.token_ids, self.cold[150])
    self.assertEqual(out.metrics.loaded_from_tiers, ["disk"] * 4)
    fresh.close()

  def test_prompt_of_whole_chunks_still_computes_its_last_token(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm, n=128)
    out = self.run_prompt(llm, n=128)
    self.assertEqual(out.num_cached_tokens, 96)
    self.assertEqual(out.metrics.num_computed_tokens, 32)
    self.assertEqual(out.token_ids, self.cold[128])
    llm.close()

  def test_cache_salts_never_share_hits(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm, salt="tenant-a")
    self.assertEqual(self.run_prompt(llm, salt="tenant-b").num_cached_tokens, 0)
    self.assertEqual(self.run_prompt(llm).num_cached_tokens, 0)
    hit = self.run_prompt(llm, salt="tenant-a")
    self.assertEqual(hit.num_cached_tokens, 128)
    self.assertEqual(hit.token_ids, self.cold[150])
    llm.close()

  def test_corrupt_chunk_is_rejected_recomputed_and_repaired(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)
    # Corrupt the data of one stored chunk (chunk 2 of 4 candidates): flip bytes in the middle.
    ns = llm.kv_store.namespace(None)
    from kvjax.storage.format import keys  # noqa: PLC0415
    h2 = keys.chunk_hashes(ns, PROMPT)[2]
    victims = [f for f in self._data_files() if h2 in f and not f.endswith(".json")]
    self.assertLen(victims, 1)
    with open(victims[0], "r+b") as f:
      f.seek(os.path.getsize(victims[0]) // 2)
      f.write(b"\xff" * 64)
    out = self.run_prompt(llm)
    self.assertEqual(out.token_ids, self.cold[150])
    self.assertEqual(out.metrics.num_rejected_chunks, 1)
    self.assertEqual(out.num_cached_tokens, 3 * C)  # chunks above the hole stay valid
    repaired = self.run_prompt(llm)
    self.assertEqual(repaired.metrics.num_rejected_chunks, 0)
    self.assertEqual(repaired.num_cached_tokens, 128)
    self.assertEqual(repaired.token_ids, self.cold[150])
    llm.close()

  def test_one_save_repairs_every_bad_chunk_of_the_chain(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)
    from kvjax.storage.format import keys  # noqa: PLC0415
    hashes = keys.chunk_hashes(llm.kv_store.namespace(None), PROMPT)
    for h in (hashes[1], hashes[3]):
      (victim,) = [f for f in self._data_files() if h in f and not f.endswith(".json")]
      with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = self.run_prompt(llm)
    self.assertEqual((out.num_cached_tokens, out.metrics.num_rejected_chunks), (2 * C, 2))
    self.assertEqual(out.token_ids, self.cold[150])
    repaired = self.run_prompt(llm)
    self.assertEqual((repaired.num_cached_tokens, repaired.metrics.num_rejected_chunks), (128, 0))
    self.assertEqual(repaired.token_ids, self.cold[150])
    llm.close()

  def test_chunks_of_another_dtype_or_model_never_hit(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)
    llm.close()
    bf16 = self.make_llm(self.url, dtype="bfloat16")
    out = self.run_prompt(bf16)
    self.assertEqual(out.num_cached_tokens, 0)  # nothing loaded: its tokens are a cold run's
    self.assertEqual(out.metrics.loaded_from_tiers, [])
    bf16.close()
    other_dir = self.create_tempdir("other_model").full_path
    cfg = config.tiny()
    safetensors_loader.save_safetensors(other_dir, cfg, tiny_params(cfg, seed=5))
    other = self.build_llm(other_dir, max_num_seqs=2, chunk_sizes=(16, 32, 64),
                           kv_store=self.url, kv_chunk_size=C)
    self.assertEqual(self.run_prompt(other).num_cached_tokens, 0)
    other.close()

  def test_missing_middle_chunk_is_computed_and_the_chunks_around_it_load(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)
    from kvjax.storage.format import keys  # noqa: PLC0415
    h1 = keys.chunk_hashes(llm.kv_store.namespace(None), PROMPT)[1]
    os.remove(os.path.join(self.root, "index", f"{h1}.json"))
    out = self.run_prompt(llm)
    self.assertEqual(out.num_cached_tokens, 3 * C)
    self.assertEqual(out.metrics.merge.chunks_computed, [1])
    self.assertEqual(out.metrics.num_rejected_chunks, 0)
    self.assertEqual(out.token_ids, self.cold[150])
    llm.close()

  def test_unreachable_store_degrades_to_compute(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)

    async def broken(*args, **kwargs):
      raise OSError("store unreachable")

    llm.kv_store.store.peek = broken
    llm.kv_store.store.put = broken
    out = self.run_prompt(llm)
    self.assertEqual(out.num_cached_tokens, 0)
    self.assertEqual(out.token_ids, self.cold[150])
    self.assertEqual(llm.kv_store.saver_stats.failures, 150 // C)  # one job per chunk
    self.assertEqual(llm.kv_store.lookup_failures, 1)
    llm.close()

  def test_store_lost_after_lookup_degrades_to_compute(self):
    llm = self.make_llm(self.url)
    self.run_prompt(llm)

    async def broken(*args, **kwargs):
      raise OSError("store unreachable")

    for tier in llm.kv_store.store.tiers:  # lookups still work; every read fails
      tier.get = broken
    out = self.run_prompt(llm)
    self.assertEqual(out.num_cached_tokens, 0)
    self.assertEqual(out.metrics.num_rejected_chunks, 4)
    self.assertEqual(out.token_ids, self.cold[150])
    llm.close()


if __name__ == "__main__":
  absltest.main()
