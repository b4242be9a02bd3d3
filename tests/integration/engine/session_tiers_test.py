"""Sessions across tiers, the correctness target of issue 12 (CachedAttention, arXiv
2403.19708): 8 chat sessions, each over its own 4K-token document holding a unique code word,
whose KV is demoted to disk by a tiny host tier; their next turns run together with 32 short
requests, load the history from disk, answer with their own code word and equal their cold runs
(greedy tokens). Slow: about 64K tokens of prefill on the real SmolLM2."""

import pathlib
import shutil
import tempfile

import pytest
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.models.loading.registry import DEFAULT_MODEL
from kvjax.testing.engines import real_llm
from kvjax.sessions import EXTENDED
from kvjax.storage import StoreConfig, TierConfig

DATA = pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "books"
WORDS = ("PELICAN", "MARIGOLD", "OBSIDIAN", "TANGERINE", "WALRUS", "QUASAR", "HARPOON",
         "GLACIER")
CHUNK = 256


def documents(tok, n_tokens: int = 4000):
  """One 4K-token passage per code word, cut from the books, the word stated at both ends."""
  books = sorted(DATA.glob("*.txt"))
  if not books:
    raise absltest.SkipTest(f"no books under {DATA}")
  text = "".join(b.read_text(encoding="utf-8") for b in books)
  out = []
  for i, word in enumerate(WORDS):
    body = text[40_000 * i + 5_000:40_000 * i + 5_000 + 4 * n_tokens]
    ids = tok.encode(body, add_special_tokens=False)[:n_tokens - 60]
    out.append(f"The secret code word is {word}. Remember it.\n\n{tok.decode(ids)}\n\n"
               f"Reminder: the secret code word is {word}.")
  return out


@pytest.mark.slow
class SessionsOnDiskTest(absltest.TestCase):

  def test_eight_documents_demoted_to_disk_answer_their_code_words(self):
    tmp = tempfile.mkdtemp(prefix="kvjax-session-tiers-")
    chunk_bytes = 30 * 2 * CHUNK * 3 * 64 * 4  # SmolLM2, f32
    store = StoreConfig((TierConfig("host", capacity_bytes=3 * chunk_bytes),
                         TierConfig("disk", url=f"{tmp}/kv")))
    # Sessions never expire here: on a busy 2-core machine turn 1 of all 8 takes minutes.
    # Load-only: every stored chunk is loaded (with Cake, compute may take the front chunks under
    # load, which made a first run's hit count timing-dependent: 13 of 15 chunks).
    llm = real_llm(DEFAULT_MODEL, kv_store=store, kv_chunk_size=CHUNK, max_model_len=4608,
                   max_num_seqs=4, session_ttl_s=None, kv_merge_mode="load_only")
    try:
      tok = llm.get_tokenizer()
      ask = "What is the secret code word? Reply with the code word only."
      # 12 tokens: "The code word is MARIGOLD" (6 tokens cut the word: "... is MARIG").
      p = SamplingParams(max_tokens=12, temperature=0)
      convs = []
      for i, doc in enumerate(documents(tok)):
        msgs = [{"role": "user", "content": f"{doc}\n\n{ask}"}]
        out = llm.chat(msgs, p, session_id=f"doc{i}")[0]
        self.assertGreater(len(out.prompt_token_ids), 3900)
        convs.append(msgs + [{"role": "assistant", "content": out.text},
                             {"role": "user", "content": "Say the code word again."}])
      llm.flush()
      llm.reset_prefix_cache()  # nothing on the device: the history must come from the store
      # Turn 2 of every session together with 32 short requests, in one batch.
      turns = [llm.sessions.begin(f"doc{i}") for i in range(len(WORDS))]
      prompts = [llm.sessions.prompt(t, c) for t, c in zip(turns, convs)]
      self.assertEqual({pr.outcome for pr in prompts}, {EXTENDED})
      short = [{"prompt_token_ids": tok.encode_chat(
          [{"role": "user", "content": f"Count to {i % 7 + 2}."}])} for i in range(32)]
      outs = llm.generate([{"prompt_token_ids": list(pr.token_ids)} for pr in prompts] + short,
                          [p] * len(prompts) + [SamplingParams(max_tokens=4, temperature=0)] * 32)
      for t, pr, out in zip(turns, prompts, outs):
        llm.sessions.finish(t, pr, out.token_ids, out.text)
      llm.flush()
      colds = llm.generate([{"prompt_token_ids": list(pr.token_ids), "cache_salt": f"cold-{w}"}
                            for w, pr in zip(WORDS, prompts)], p)
      for word, out, cold in zip(WORDS, outs, colds):
        with self.subTest(word=word):
          self.assertEqual(out.token_ids, cold.token_ids, (word, out.text, cold.text))
          self.assertIn(word.lower(), out.text.lower(), (word, out.text))
          self.assertEqual(cold.num_cached_tokens, 0)
          # Loaded from the store, most of it from disk (the host tier holds 3 chunks).
          tiers = out.metrics.loaded_from_tiers
          self.assertGreaterEqual(out.num_cached_tokens, 15 * CHUNK)
          self.assertGreaterEqual(tiers.count("disk"), 10, tiers)
      disk = next(t for t in llm.engine.stats().tiers if t.name == "disk")
      self.assertGreaterEqual(disk.loaded_chunks, 10 * len(WORDS))
    finally:
      llm.close()
      shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  absltest.main()
