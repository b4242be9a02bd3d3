"""Tests of scripts/session_replay.py's per-turn accounting (plain rows, no server)."""

import json
import pathlib
import sys
import tempfile

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import session_replay as sr  # noqa: E402  pylint: disable=wrong-import-position


def row(conv, turn, *, prompt, cached, completion, reusable=None, ttft=1.0, server=0.5,
        outcome=None, error=None, prefill=None, tiers=None):
  return sr.TurnRow("session", conv, turn, ttft_s=ttft, server_ttft_s=server, e2e_s=2.0,
                    prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                    reusable_tokens=reusable, session_outcome=outcome, error=error,
                    prefill_s=prefill, loaded_from_tiers=tiers)


def count(role, content):
  """A fake templated-token counter: one token per character plus 3 of template."""
  return len(content) + 3


def conv(*texts, roles=None):
  roles = roles or ["human" if i % 2 == 0 else "gpt" for i in range(len(texts))]
  return {"conversations": [{"from": r, "value": t} for r, t in zip(roles, texts)]}


class SaverOutcomesTest(absltest.TestCase):

  def test_reads_the_saver_counters_of_a_metrics_page(self):
    page = "\n".join([
        "# HELP kvjax_kv_saver_total Asynchronous KV saves, by outcome.",
        "# TYPE kvjax_kv_saver_total counter",
        'kvjax_kv_saver_total{outcome="chunks_saved"} 27.0',
        'kvjax_kv_saver_total{outcome="jobs_dropped"} 2.0',
        "# HELP kvjax_sessions_open Open sessions.",
        "# TYPE kvjax_sessions_open gauge",
        "kvjax_sessions_open 4.0", ""])
    self.assertEqual(sr.saver_outcomes(page), {"chunks_saved": 27.0, "jobs_dropped": 2.0})
    self.assertEqual(sr.saver_outcomes(""), {})


class SummarizeTest(absltest.TestCase):

  def test_turns_after_the_first_count_reuse_of_the_previous_turn(self):
    rows = [row(0, 1, prompt=100, cached=0, completion=20, ttft=3.0, outcome="first"),
            row(0, 2, prompt=140, cached=119, completion=20, reusable=119, ttft=0.5,
                server=0.4, outcome="extended"),
            row(1, 1, prompt=50, cached=0, completion=10, ttft=2.0, outcome="first"),
            row(1, 2, prompt=80, cached=48, completion=10, reusable=59, ttft=1.5, server=0.8,
                outcome="not_extended"),
            row(1, 3, prompt=0, cached=0, completion=0, error="APIError: boom")]
    s = sr.summarize(rows, wall_s=10.0)
    self.assertEqual((s["turns"], s["errors"], s["turns_ge2"]), (5, 1, 2))
    self.assertEqual((s["reusable_tokens_ge2"], s["cached_tokens_ge2"]), (178, 167))
    self.assertAlmostEqual(s["cached_of_reusable"], 167 / 178)
    self.assertEqual(s["turns_reusing_every_token"], 0.5)
    self.assertAlmostEqual(s["prefill_tokens_per_s_ge2"], 220 / 1.2)
    self.assertEqual(s["ttft_ge2_p50_s"], 1.0)
    self.assertEqual(s["ttft_turn1_p50_s"], 2.5)
    self.assertEqual(s["session_outcomes"], {"extended": 1, "first": 2, "not_extended": 1})
    self.assertIsNone(s["prefill_tokens_per_prefill_s_ge2"])  # no prefill times reported

  def test_prefill_throughput_is_per_prefill_wall_second(self):
    rows = [row(0, 1, prompt=100, cached=0, completion=20, prefill=2.0),
            row(0, 2, prompt=140, cached=119, completion=20, reusable=119, server=0.4,
                prefill=0.25, tiers={"device": 1}),
            row(0, 3, prompt=200, cached=159, completion=20, reusable=159, server=0.6,
                prefill=0.15, tiers={"device": 1, "host": 2})]
    s = sr.summarize(rows, wall_s=5.0)
    self.assertAlmostEqual(s["prefill_tokens_per_prefill_s_ge2"], 340 / 0.4)
    self.assertAlmostEqual(s["prefill_tokens_per_s_ge2"], 340 / 1.0)
    self.assertAlmostEqual(s["prefill_wall_ge2_sum_s"], 0.4)
    self.assertAlmostEqual(s["prefill_wall_ge2_p50_s"], 0.2)
    self.assertAlmostEqual(s["history_share_ge2"], 278 / 340)
    self.assertEqual(s["loaded_chunks_ge2_by_tier"], {"device": 2, "host": 2})

  def test_store_hits_are_counted_against_the_full_chunks_of_the_history(self):
    # Chunks of 16 tokens: turn 2 can reuse 119 tokens, 112 of them in full chunks (7), and got
    # them all from the store; turn 3 can reuse 159 (144 in 9 chunks) and got 8 chunks (128).
    rows = [row(0, 1, prompt=100, cached=0, completion=20, prefill=2.0),
            row(0, 2, prompt=140, cached=112, completion=20, reusable=119, prefill=0.3,
                tiers={"host": 5, "disk": 2}),
            row(0, 3, prompt=200, cached=128, completion=20, reusable=159, prefill=0.5,
                tiers={"host": 8})]
    s = sr.summarize(rows, wall_s=5.0, chunk_tokens=16)
    self.assertEqual(s["reusable_chunk_tokens_ge2"], 112 + 144)
    self.assertAlmostEqual(s["cached_of_reusable_chunks"], (112 + 128) / (112 + 144))
    self.assertEqual(s["turns_reusing_every_chunk"], 0.5)
    self.assertAlmostEqual(s["cached_of_reusable"], 240 / 278)
    self.assertEqual(s["loaded_chunks_ge2_by_tier"], {"host": 13, "disk": 2})
    self.assertNotIn("cached_of_reusable_chunks", sr.summarize(rows, wall_s=5.0))

  def test_turn1_overlap_split(self):
    def timed(conv, turn, prompt, sched, first):
      r = row(conv, turn, prompt=prompt, cached=0, completion=8, prefill=first - sched)
      r.engine_scheduled_s, r.engine_first_token_s = sched, first
      return r

    rows = [timed(0, 1, 1000, 10.0, 20.0), timed(1, 1, 900, 15.0, 22.0),  # cold: 10-22 s
            timed(2, 2, 300, 18.0, 24.0),   # overlaps both cold prefills: 18-22 s, 4 s
            timed(3, 2, 200, 30.0, 31.0),   # after them
            timed(3, 3, 100, 5.0, 9.0),     # before them
            row(4, 2, prompt=50, cached=0, completion=8, prefill=1.0)]  # no timestamps
    got = sr.turn1_overlap_split(rows)
    self.assertEqual(got["overlapping"], {"turns": 1, "prefill_wall_p50_s": 6.0,
                                          "prefill_wall_sum_s": 6.0,
                                          "prefill_tokens_per_prefill_s": 50.0,
                                          "turn1_overlap_mean_s": 4.0})
    self.assertEqual(got["other"], {"turns": 2, "prefill_wall_p50_s": 2.5,
                                    "prefill_wall_sum_s": 5.0,
                                    "prefill_tokens_per_prefill_s": 60.0,
                                    "turn1_overlap_mean_s": 0.0})

  def test_history_dominant_rule(self):
    cfg = sr.ReplayConfig(history_tokens=100, max_history_tokens=400, history_share=0.8,
                          max_prompt_tokens=600, max_tokens=10, turns=4, min_turns=2)
    data = [
        # 0: history 10 (system) + 53 + 63 = 126 >= 100 after one round; the replayed user
        #    messages follow (the gpt ones are replaced by the model's replies): turn 1 is 160
        #    tokens, turn 2 adds 24 to a history of 173 (88%), turn 3 24 to 210 (90%); 'd' * 300
        #    would be 304 new tokens to 247 (45% < 80%), so the replay stops before it.
        conv("a" * 50, "x" * 60, "q" * 30, "y" * 10, "b" * 20, "z" * 10, "c" * 20, "w" * 5,
             "d" * 300),
        conv("a" * 500, "x" * 60, "q", "y", "b"),  # its first round passes 400 tokens
        conv("a" * 50, "x" * 60, "q" * 5),  # no turn after the first replayed one
        conv("a" * 50, "x" * 60, "q", "y", "b", roles=["human", "gpt", "gpt", "human",
                                                      "human"]),  # not alternating
    ]
    got = sr.pick_history_dominant(data, count, 10, cfg)
    self.assertLen(got, 1)
    c = got[0]
    self.assertEqual((c.source_index, c.history_tokens), (0, 10 + 53 + 63))
    self.assertEqual(c.history, ({"role": "user", "content": "a" * 50},
                                 {"role": "assistant", "content": "x" * 60}))
    self.assertEqual(c.users, ("q" * 30, "b" * 20, "c" * 20))  # 'd' * 300 breaks the share

  def test_conversations_need_two_user_turns_and_are_cut(self):
    data = [{"conversations": [{"from": "human", "value": "a" * 50},
                               {"from": "gpt", "value": "x"},
                               {"from": "human", "value": "b"}, {"from": "gpt", "value": "y"},
                               {"from": "human", "value": "c"}]},
            {"conversations": [{"from": "human", "value": "only one"}]}]
    with tempfile.TemporaryDirectory() as d:
      path = pathlib.Path(d) / "t.json"
      path.write_text(json.dumps(data))
      got = sr.load_conversations(path, 5, turns=2, turn_chars=10, seed=0)
    self.assertEqual(got, [["a" * 10, "b"]])


if __name__ == "__main__":
  absltest.main()
