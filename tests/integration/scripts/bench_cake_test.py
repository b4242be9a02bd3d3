"""Tests of scripts/bench_cake.py's step-record timing (no monkeypatching: the engine's observer)."""

import pathlib
import sys

import numpy as np
from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import bench_cake as bench  # noqa: E402  pylint: disable=wrong-import-position

from kvjax import SamplingParams  # noqa: E402
from kvjax.testing.engines import real_llm  # noqa: E402
from kvjax.engine.core import StepRecord  # noqa: E402
from kvjax.scheduler.output import (ComputeTiming, InsertTiming, LoadReport,  # noqa: E402
                                    SchedulerOutput, StepResult)

C = 16
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 256, 4 * C + 5)]
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class RecorderTest(absltest.TestCase):

  def test_keeps_the_numbers_of_each_step_record(self):
    rec = bench.Recorder()
    result = StepResult(
        now_s=12.0,
        compute=(ComputeTiming(0, 32, 0.5, "a", started_s=10.0),),
        inserts=(InsertTiming("a", 3, 10.6, 0.01),),
        loads=(LoadReport("a", 3, ok=True, nbytes=100, started_s=9.0, done_s=9.5),
               LoadReport("a", 2, ok=False, nbytes=0, reason="released")))  # never started
    rec.observe(StepRecord(SchedulerOutput(), result, 9.9, 11.0, 0.002))
    self.assertEqual(rec.prefills, [("a", 0, 32, 10.0, 10.5)])
    self.assertEqual(rec.inserts, [("a", 3, 10.6, 10.6 + 0.01)])
    self.assertEqual(rec.landings, [("a", 3, 9.0, 9.5, 100, True)])
    self.assertEqual(rec.steps, [(9.9, 11.0, 0.002)])
    rec.clear()
    self.assertEqual((rec.prefills, rec.inserts, rec.landings, rec.steps), ([], [], [], []))

  def test_fit_falls_back_to_seconds_per_token(self):
    self.assertIsNone(bench._fit([]))
    self.assertEqual(bench._fit([(0, 100, 1.0, 3.0)]), (0.0, 0.02, 0.0))


class EngineStreamTest(absltest.TestCase):
  """A tiny model through the public observer, each request in its own merge mode."""

  def test_per_request_merge_mode_and_the_recorded_stream(self):
    llm = real_llm("tiny", cache_dir="", max_num_seqs=2, chunk_sizes=(16, 32, 64),
                   kv_store="memory://", kv_chunk_size=C,
                   enable_prefix_caching=False)  # every repeat reads the store

    eng = llm.engine
    eng.timed_inserts = True
    rec = bench.Recorder()
    eng.add_step_observer(rec.observe)
    llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
    llm.flush()
    firsts = {}
    for mode in ("compute_only", "load_only", "cake"):
      rec.clear()
      rid = eng.add_request(PROMPT, GREEDY, request_id=mode, merge_mode=mode)
      out = None
      while out is None:
        out = next((o for o in eng.step() if o.finished), None)
      firsts[mode] = out.token_ids[0]
      mine = [p for p in rec.prefills if p[0] == rid]
      self.assertEqual(sum(n for _, _, n, _, _ in mine), out.metrics.num_computed_tokens)
      self.assertTrue(all(t1 >= t0 >= out.metrics.arrival_s for *_, t0, t1 in mine))
      self.assertLen(rec.inserts, out.num_cached_tokens // C)
      self.assertGreaterEqual(len(rec.landings), len(rec.inserts))
      self.assertTrue(rec.steps and all(p >= 0 for *_, p in rec.steps))
      if mode == "compute_only":
        self.assertEqual(out.num_cached_tokens, 0)
        self.assertEqual(rec.landings, [])
      if mode == "load_only":
        self.assertEqual(out.num_cached_tokens, 4 * C)
    self.assertLen(set(firsts.values()), 1)
    with self.assertRaisesRegex(ValueError, "merge_mode"):
      eng.add_request(PROMPT, GREEDY, merge_mode="both")
    llm.close()


if __name__ == "__main__":
  absltest.main()
