"""Tests of scripts/bench_codec_greedy.py: agreement metrics on fixed token arrays, the prompt
draw, and the phase on the fake runner through real file stores."""

import pathlib
import sys
import tempfile

import numpy as np
from absl.testing import absltest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "scripts"))
import bench_codec_greedy as greedy  # noqa: E402  pylint: disable=wrong-import-position

from kvjax.testing.engines import fake_llm  # noqa: E402

C = 16


class AgreementTest(absltest.TestCase):

  def test_identical(self):
    self.assertEqual(greedy.agreement([5, 6, 7, 8], [5, 6, 7, 8], 4),
                     {"exact": True, "first_divergence": None, "prefix_fraction": 1.0,
                      "token_agreement": 1.0})

  def test_one_token_differs_then_realigns(self):
    self.assertEqual(greedy.agreement([1, 2, 3, 4], [1, 2, 9, 4], 4),
                     {"exact": False, "first_divergence": 2, "prefix_fraction": 0.5,
                      "token_agreement": 0.75})

  def test_first_token_differs(self):
    m = greedy.agreement([1, 2, 3, 4, 5], [7, 2, 3, 4, 5], 5)
    self.assertEqual((m["first_divergence"], m["prefix_fraction"], m["token_agreement"]),
                     (0, 0.0, 0.8))

  def test_both_stop_at_the_same_token(self):
    # Both answers ended (EOS) after 2 tokens: the padded positions agree.
    self.assertTrue(greedy.agreement([1, 2], [1, 2], 4)["exact"])

  def test_one_answer_ends_early(self):
    self.assertEqual(greedy.agreement([1, 2], [1, 2, 3, 4], 4),
                     {"exact": False, "first_divergence": 2, "prefix_fraction": 0.5,
                      "token_agreement": 0.5})

  def test_too_many_tokens_raises(self):
    with self.assertRaisesRegex(ValueError, "at most n tokens"):
      greedy.agreement([1, 2, 3], [1, 2], 2)


class SummarizeTest(absltest.TestCase):

  def test_wilson_hand_values(self):
    np.testing.assert_allclose(greedy.wilson(0, 10), [0.0, 0.27753], atol=1e-5)
    np.testing.assert_allclose(greedy.wilson(5, 10), [0.23659, 0.76341], atol=1e-5)
    np.testing.assert_allclose(greedy.wilson(10, 10), [0.72247, 1.0], atol=1e-5)
    self.assertIsNone(greedy.wilson(0, 0))

  def test_summary_of_fixed_rows(self):
    ref = [1, 2, 3, 4]
    outs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 9, 3, 4], [0, 0, 0, 0]]
    s = greedy.summarize([greedy.agreement(ref, o, 4) for o in outs], 4, seed=0)
    self.assertEqual(s["prompts"], 4)
    self.assertEqual((s["exact_match"]["count"], s["exact_match"]["rate"]), (2, 0.5))
    self.assertAlmostEqual(s["prefix_fraction"]["mean"], (1 + 1 + 0.25 + 0) / 4)
    self.assertAlmostEqual(s["token_agreement"]["mean"], (1 + 1 + 0.75 + 0) / 4)
    self.assertEqual(s["first_divergence"]["diverged"], 2)
    self.assertAlmostEqual(s["first_divergence"]["mean"], 0.5)
    self.assertEqual(s["first_divergence"]["min"], 0)

  def test_none_diverged(self):
    s = greedy.summarize([greedy.agreement([1], [1], 1)] * 3, 1, seed=0)
    self.assertEqual(s["first_divergence"], {"diverged": 0, "mean": None, "ci95_t": None,
                                             "median": None, "min": None})


def _encode_chat(messages):
  """One token per character of each message's content plus 2 per message."""
  out = []
  for m in messages:
    out += [2 if m["role"] == "user" else 3] + [ord(ch) % 256 for ch in m["content"]] + [4]
  return out


def _conv(cid, *contents):
  return {"id": cid, "conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": c}
                                       for i, c in enumerate(contents)]}


class SharegptPromptsTest(absltest.TestCase):

  def test_the_first_turn_in_a_window_is_taken(self):
    convs = [
        _conv("short", "a" * 10),                      # 12 tokens: no full chunk before the last
        _conv("tail", "b" * 16),                       # 18 tokens: tail 1 (17 % 16)
        _conv("later", "c" * 3, "d" * 3, "e" * 40),    # 5, then 5 + 5 + 42 = 52: tail 51 % 16 = 3
        _conv("too_long", "f" * 80),                   # 82 tokens > 64
        _conv("wide_tail", "g" * 26),                  # 28 tokens: tail 27 % 16 = 11 >= 4
        _conv("dup", "b" * 16, "x", "y"),              # first chunk equals "tail"'s
    ]
    got = greedy.sharegpt_prompts(convs, _encode_chat, 2, max_tokens=64, max_tail=4, chunk=C,
                                  seed=0)
    self.assertCountEqual([(p["id"], p["user_turn"], p["tokens"]) for p in got],
                          [("tail", 0, 18), ("later", 1, 52)])
    for p in got:
      self.assertEqual(p["ids"], _encode_chat(
          [{"role": "user" if i % 2 == 0 else "assistant", "content": t["value"]}
           for i, t in enumerate(next(c for c in convs if c["id"] == p["id"])["conversations"]
                                 [:2 * p["user_turn"] + 1])]))

  def test_too_few_raises(self):
    with self.assertRaisesRegex(ValueError, "only 1 ShareGPT prompts"):
      greedy.sharegpt_prompts([_conv("tail", "b" * 16)], _encode_chat, 2, max_tokens=64,
                              max_tail=4, chunk=C, seed=0)

  def test_bounds_without_a_chunk_raise(self):
    with self.assertRaisesRegex(ValueError, "max_tail"):
      greedy.sharegpt_prompts([], _encode_chat, 1, max_tokens=16, max_tail=4, chunk=C, seed=0)


def _prompts():
  rng = np.random.default_rng(0)
  return [{"id": f"p{i}", "user_turn": 0,
           "ids": [int(t) for t in rng.integers(0, 256, C * (1 + i % 2) + 1 + i)]}
          for i in range(4)]


def _make_llm(merge_mode="load_only"):
  def make(codec, level, url):
    return fake_llm("tiny", kv_store=url, kv_codec=codec, kv_codec_levels=(level,),
                    kv_merge_mode=merge_mode if codec != "raw" else "load_only",
                    kv_codec_consistent=False, kv_chunk_size=C, chunk_sizes=(16, 32, 64),
                    max_num_seqs=4)
  return make


LEVELS = [greedy.Level("raw", "raw", 0), greedy.Level("int8", "int8", 0),
          greedy.Level("int4", "int4", 0)]


class PhaseOnFakeRunnerTest(absltest.TestCase):
  """The phase through real file stores on the fake runner (raw, int8, int4)."""

  def test_every_stored_chunk_is_loaded_and_raw_matches_itself(self):
    prompts = _prompts()
    seen = []
    with tempfile.TemporaryDirectory() as d:
      out = greedy.run_phase(_make_llm(), LEVELS, prompts, 6, d, 0,
                             on_level=lambda r: seen.append(list(r["levels"])))
      self.assertEqual(sorted(pathlib.Path(d).iterdir()), [])  # every store deleted
    self.assertEqual(seen, [["raw"], ["raw", "int8"], ["raw", "int8", "int4"]])
    self.assertTrue(out["complete"])
    self.assertEqual(out["failed"], [])
    chunks = sum((len(p["ids"]) - 1) // C for p in prompts)  # 1 + 2 + 1 + 2
    self.assertEqual(chunks, 6)
    for label, r in out["levels"].items():
      self.assertEqual(r["load_failures"], [], label)
      self.assertEqual(r["stored_chunks"], chunks)
      self.assertEqual(r["loaded_tokens"], chunks * C, label)
      self.assertEqual(r["summary"]["prompts"], 4)
    # A lossless load answers the cold run's tokens.
    self.assertEqual(out["levels"]["raw"]["summary"]["exact_match"]["count"], 4)
    self.assertEqual(out["levels"]["raw"]["store"]["saver"]["chunks_saved"], chunks)
    for label in ("int8", "int4"):
      self.assertEqual(out["levels"][label]["store"]["chunks"], chunks)
      self.assertEqual(out["levels"][label]["store"]["published"], chunks)
    self.assertLess(out["levels"]["int4"]["store"]["stored_bytes"],
                    out["levels"]["int8"]["store"]["stored_bytes"])
    self.assertEqual([len(r) for r in out["reference"]], [6] * 4)

  def test_a_level_whose_chunks_are_not_loaded_fails(self):
    with tempfile.TemporaryDirectory() as d:
      out = greedy.run_phase(_make_llm("compute_only"), LEVELS[:2], _prompts(), 4, d, 0)
    self.assertEqual(out["failed"], ["int8"])
    self.assertEqual([f["why"] for f in out["levels"]["int8"]["load_failures"]],
                     ["loaded 0 of 16 stored tokens", "loaded 0 of 32 stored tokens",
                      "loaded 0 of 16 stored tokens", "loaded 0 of 32 stored tokens"])

  def test_raw_must_come_first(self):
    with self.assertRaisesRegex(ValueError, "raw first"):
      greedy.run_phase(_make_llm(), LEVELS[1:], _prompts(), 4, "/nonexistent", 0)


if __name__ == "__main__":
  absltest.main()
