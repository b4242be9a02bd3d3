"""The composition root (`kvjax/entrypoints/root.py`): one function builds the runner, store,
sessions and engine from `EngineOptions`, for `LLM`, the server and the test factories alike
(the fake runner is one argument). On the fake runner (no model, no compile)."""

import tempfile

from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.config import EngineOptions
from kvjax.entrypoints import LLM
from kvjax.entrypoints.root import build_engine_parts, close_parts
from kvjax.testing import engines

C = 32
PROMPT = [(7 * i + 3) % 251 + 1 for i in range(3 * C + 5)]
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def options(**flat):
  flat = {"model": "tiny", "cache_dir": "", "dtype": "float32", "max_num_seqs": 2,
          "chunk_sizes": (16, 32, 64), "kv_chunk_size": C, **flat}
  return EngineOptions.from_flat(**flat)


class RootTest(absltest.TestCase):

  def build(self, opts, runners=None, **kw):
    factory = engines.fake_runner_factory()

    def make(loaded, o):
      runner = factory(loaded, o)
      if runners is not None:
        runners.append(runner)
      return runner

    return build_engine_parts(opts, model=engines.fake_model(), make_runner=make, **kw)

  def test_the_parts_are_built_from_the_options(self):
    with tempfile.TemporaryDirectory() as d:
      opts = options(kv_store=f"file://{d}", kv_store_capacity_bytes=1 << 24, max_num_seqs=3)
      parts = self.build(opts)
      try:
        self.assertIs(parts.engine.runner, parts.runner)
        self.assertIs(parts.engine.kv_store, parts.kv_store)
        self.assertEqual(parts.store_config, opts.kv.store_config())
        self.assertEqual(parts.store_description, f"1 tier: disk file://{d} (16 MiB)")
        self.assertEqual(parts.runner.config.num_slots, 3)
        self.assertEqual(parts.kv_store.chunk_size, C)
        # The sessions registry is wired to the client: it persists beside the local store.
        self.assertEqual(parts.sessions.persistence_dir,
                         f"{d}/sessions/{engines.FAKE_FINGERPRINT}")
      finally:
        close_parts(parts)

  def test_no_store(self):
    parts = self.build(options())
    try:
      self.assertIsNone(parts.kv_store)
      self.assertIsNone(parts.store_config)
      self.assertIsNone(parts.engine.kv_store)
      self.assertIsNone(parts.sessions.persistence_dir)
    finally:
      close_parts(parts)

  def test_llm_from_parts_answers_as_the_engine_factory(self):
    url = engines.memory_store_url()
    # load_only: under Cake how many chunks load rather than compute follows the timing.
    llm = LLM.from_parts(self.build(options(kv_store=url, kv_merge_mode="load_only")),
                         startup_progress=None)
    engine = engines.fake_engine(kv_store=engines.memory_store_url(), kv_chunk_size=C,
                                 max_num_seqs=2, chunk_sizes=(16, 32, 64))
    try:
      cold = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
      llm.flush()
      llm.reset_prefix_cache()
      warm = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)[0]
      self.assertEqual(warm.num_cached_tokens, 3 * C)
      self.assertEqual(warm.token_ids, cold.token_ids)
      self.assertEqual(engines.generate(engine, [PROMPT], GREEDY)[0].token_ids, cold.token_ids)
    finally:
      llm.close()
      engines.close_engine(engine)

  def test_a_failure_after_the_runner_closes_it(self):
    runners = []
    with self.assertRaisesRegex(ValueError, "kv_chunk_size=512 must be an int in"):
      self.build(options(kv_store=engines.memory_store_url(), kv_chunk_size=512,
                         chunk_sizes=(16, 512)), runners)
    (runner,) = runners
    self.assertFalse(runner.cache_ok())  # closed

  def test_a_raising_progress_closes_what_was_built(self):
    runners = []

    def progress(event):
      if event.phase == "store":
        raise KeyboardInterrupt

    with self.assertRaises(KeyboardInterrupt):
      self.build(options(kv_store=engines.memory_store_url()), runners, progress=progress)
    self.assertFalse(runners[0].cache_ok())

  def test_kvtc_needs_the_model(self):
    with self.assertRaisesRegex(ValueError, "kvtc.* calibrates on the model itself"):
      self.build(options(kv_store=engines.memory_store_url(), kv_codec="kvtc"))


if __name__ == "__main__":
  absltest.main()
