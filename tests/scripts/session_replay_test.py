"""Tests of scripts/session_replay.py's per-turn accounting (plain rows, no server)."""

import json
import pathlib
import sys
import tempfile

from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import session_replay as sr  # noqa: E402  pylint: disable=wrong-import-position


def row(conv, turn, *, prompt, cached, completion, reusable=None, ttft=1.0, server=0.5,
        outcome=None, error=None):
  return sr.TurnRow("session", conv, turn, ttft_s=ttft, server_ttft_s=server, e2e_s=2.0,
                    prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                    reusable_tokens=reusable, session_outcome=outcome, error=error)


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
