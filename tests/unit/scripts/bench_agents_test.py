"""Tests of scripts/bench_agents.py without a server: the workload generator, the theoretical
share arithmetic and the miss attribution (plain records)."""

import pathlib
import random
import sys

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import bench_agents as ba  # noqa: E402  pylint: disable=wrong-import-position


def row(turn, prompt, cached, theory, **kw):
  return {"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
          "theoretical_cached": theory, "block_tokens": 16, "error": None, "ttft_s": 1.0,
          "session_outcome": "first" if turn == 1 else "extended", "rejected_chunks": 0, **kw}


class WorkloadTest(absltest.TestCase):

  def test_sessions_follow_the_published_shape_and_the_seed(self):
    plans = ba.make_sessions(3, 40, turns_range=(20, 60), scale=1.0, think_s=0.5, pause_s=30.0,
                             pause_share=0.2, stagger_s=2.0)
    self.assertEqual(plans, ba.make_sessions(3, 40, turns_range=(20, 60), scale=1.0,
                                             think_s=0.5, pause_s=30.0, pause_share=0.2,
                                             stagger_s=2.0))
    self.assertLen(plans, 40)
    self.assertEqual([p.start_s for p in plans[:3]], [0.0, 2.0, 4.0])
    self.assertLen({p.session_id for p in plans}, 40)
    turns = [len(p.turns) + 1 for p in plans]
    self.assertTrue(all(20 <= t <= 60 for t in turns), turns)
    sizes = [t.result_words for p in plans for t in p.turns]
    self.assertTrue(all(200 <= s <= 8000 for s in sizes), (min(sizes), max(sizes)))
    self.assertLess(min(sizes), 400)  # log-uniform over the range: both ends are reached
    self.assertGreater(max(sizes), 4000)
    pauses = [t for p in plans for t in p.turns if t.pause]
    self.assertTrue(all(t.think_s == 30.0 for t in pauses))
    self.assertBetween(len(pauses) / len(sizes), 0.15, 0.25)

  def test_scale_shrinks_tool_results_and_bad_ranges_are_refused(self):
    full = ba.make_sessions(0, 4, turns_range=(5, 5), scale=1.0, think_s=0.0, pause_s=1.0,
                            pause_share=0.0, stagger_s=0.0)
    small = ba.make_sessions(0, 4, turns_range=(5, 5), scale=0.01, think_s=0.0, pause_s=1.0,
                             pause_share=0.0, stagger_s=0.0)
    for f, s in zip(full, small):
      self.assertLen(f.turns, 4)
      for tf, ts in zip(f.turns, s.turns):
        self.assertEqual(ts.result_words, max(1, round(tf.result_words * 0.01)))
        self.assertEqual((tf.think_s, tf.pause), (0.0, False))
    for bad in ({"turns_range": (5, 4)}, {"scale": 0.0}, {"pause_share": 1.5}):
      kw = {"turns_range": (2, 3), "scale": 1.0, "think_s": 0.0, "pause_s": 1.0,
            "pause_share": 0.0, "stagger_s": 0.0, **bad}
      with self.assertRaises(ValueError):
        ba.make_sessions(0, 2, **kw)

  def test_words_and_tools(self):
    text = ba.words(random.Random(0), 30)
    self.assertLen(text.split(), 30)
    self.assertLen(text.splitlines(), 3)
    self.assertEqual([t["function"]["name"] for t in ba.tools()], list(ba.TOOL_NAMES))


class TheoryTest(absltest.TestCase):

  def test_common_prefix(self):
    self.assertEqual(ba.common_prefix([1, 2, 3], [1, 2, 4, 5]), 2)
    self.assertEqual(ba.common_prefix([1, 2], [1, 2, 3]), 2)
    self.assertEqual(ba.common_prefix([], [1]), 0)

  def test_first_turns_share_the_longest_prefix_seen_before(self):
    prompts = [[1, 2, 3, 4, 9], [1, 2, 3, 5, 9], [1, 2, 3, 4, 8, 8], [7], [1, 2, 3, 4, 9]]
    # The last prompt equals the first: all of it but its last token.
    self.assertEqual(ba.first_turn_theoretical(prompts), [0, 3, 4, 0, 4])

  def test_later_turns_hold_the_last_turn_but_its_last_sampled_token(self):
    self.assertEqual(ba.theoretical_cached(1000, 24, 1500), 1023)
    self.assertEqual(ba.theoretical_cached(1000, 24, 1010), 1009)  # capped: prompt - 1
    self.assertEqual(ba.theoretical_cached(0, 0, 5), 0)

  def test_summary_weights_by_tokens_and_attributes_misses(self):
    rows = [row(1, 1000, 992, 1000 - 1),  # shared prefix cut inside a block
            row(2, 2000, 1023, 1023),
            row(3, 3000, 0, 2023, session_outcome="not_extended"),
            row(4, 4000, 3000, 3023),  # evicted or never saved
            row(5, 5000, 1000, 4023, rejected_chunks=2),
            row(6, 6000, 0, 5023, session_outcome="first"),
            row(7, 100, 0, 50, error="APIError: boom")]
    causes = [ba.attribute_miss(r) for r in rows]
    self.assertEqual(causes, ["first_turn_partial", None, "template_drift",
                              "evicted_unsaved_or_in_flight", "rejected", "session_dropped",
                              "request_error"])
    s = ba.summarize_rows(rows)
    self.assertEqual((s["turns"], s["errors"], s["prompt_tokens"]), (7, 1, 21000))
    self.assertEqual(s["cached_tokens"], 992 + 1023 + 3000 + 1000)
    self.assertEqual(s["theoretical_cached_tokens"], 999 + 1023 + 2023 + 3023 + 4023 + 5023)
    self.assertAlmostEqual(s["gap_points"], 100 * (16114 - 6015) / 21000)
    self.assertEqual(s["missed_tokens_by_cause"],
                     {"first_turn_partial": 7, "template_drift": 2023,
                      "evicted_unsaved_or_in_flight": 23, "rejected": 3023,
                      "session_dropped": 5023, "request_error": 50})
    self.assertEqual((s["later_turns_exact"], s["later_turns"]), (1, 5))
    self.assertEqual(s["ttft_p50_s"], 1.0)

  def test_a_lossy_codec_reuses_whole_chunks_of_earlier_prefills(self):
    rows = [row(2, 1198, 1024, 1103, session="a"),  # out of order: annotate sorts
            row(1, 1074, 0, 0, session="a"),
            row(3, 1279, 1024, 1227, session="a"),
            row(4, 1344, 1024, 1308, session="a"),  # 1279-token prompt: chunk 5 ended in decode
            row(5, 1420, 1024, 1373, session="a"),  # a whole chunk of its last prefill missing
            row(1, 1074, 256, 1057, session="b")]   # a concurrent first turn: in flight
    ba.annotate(rows, "kvtc", 256)
    got = [(r["session"], r["turn"], r["prev_prompt_tokens"], r["whole_chunk_theoretical"],
            r["miss_cause"]) for r in rows]
    self.assertEqual(got, [
        ("a", 1, None, 0, None),
        ("a", 2, 1074, 1024, "lossy_chunk_alignment"),
        ("a", 3, 1198, 1024, "lossy_chunk_alignment"),
        ("a", 4, 1279, 1024, "lossy_chunk_alignment"),
        ("a", 5, 1344, 1280, "evicted_unsaved_or_in_flight"),
        ("b", 1, None, 1024, "evicted_unsaved_or_in_flight")])
    s = ba.summarize_rows(rows)
    prompt = 1074 + 1198 + 1279 + 1344 + 1420 + 1074
    self.assertAlmostEqual(s["whole_chunk_theoretical_share"], (3 * 1024 + 1280 + 1024) / prompt)
    self.assertAlmostEqual(s["gap_to_whole_chunks_points"],
                           100 * (3 * 1024 + 1280 + 1024 - 4 * 1024 - 256) / prompt)
    raw = ba.annotate([dict(r, cached_tokens=r["theoretical_cached"]) for r in rows], "raw", 256)
    self.assertTrue(all(r["whole_chunk_theoretical"] is None and r["miss_cause"] is None
                        for r in raw))
    self.assertIsNone(ba.summarize_rows(raw)["whole_chunk_theoretical_share"])

  def test_percentile_is_linear(self):
    self.assertEqual(ba.percentile([4.0, 1.0, 3.0, 2.0], 50), 2.5)
    self.assertAlmostEqual(ba.percentile(list(range(101)), 99), 99.0)
    self.assertIsNone(ba.percentile([], 50))


if __name__ == "__main__":
  absltest.main()
