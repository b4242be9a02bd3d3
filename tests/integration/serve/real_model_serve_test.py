"""The server with the real SmolLM2-135M-Instruct: a chat answer, and a warm prefix hit (slow)."""

import pathlib
import shutil
import tempfile

import openai
import pytest
from absl.testing import absltest

from kvjax.models.loading.registry import DEFAULT_MODEL
from kvjax.testing.engines import real_llm
from kvjax.testing.serve import serving

BOOK = (pathlib.Path(__file__).resolve().parents[4] / "shared" / "data" / "books" /
        "pg1952_the_yellow_wallpaper_gilman.txt")


@pytest.mark.slow
class RealModelServeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.store_dir = tempfile.mkdtemp(prefix="kvjax-real-serve-")
    # Load-only: every stored chunk is loaded, whatever the machine's speed (Cake's meeting point
    # follows measured times: under load it may compute chunks the store holds).
    cls.llm = real_llm(DEFAULT_MODEL, max_num_seqs=2, kv_store=f"file://{cls.store_dir}/kv",
                       kv_chunk_size=128, chunk_sizes=(16, 32, 64, 128),
                       kv_merge_mode="load_only")
    cls._ctx = serving(cls.llm)
    cls.srv = cls._ctx.__enter__()
    cls.client = openai.OpenAI(base_url=cls.srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=600)

  @classmethod
  def tearDownClass(cls):
    cls._ctx.__exit__(None, None, None)
    cls.llm.close()
    shutil.rmtree(cls.store_dir, ignore_errors=True)
    super().tearDownClass()

  def test_chat_answers(self):
    resp = self.client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=20, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    self.assertIn("Paris", resp.choices[0].message.content)
    self.assertEqual(resp.choices[0].finish_reason, "stop")

  def test_long_prefix_is_loaded_when_warm(self):
    doc = (BOOK.read_text(encoding="utf-8")[:3000] if BOOK.is_file() else
           "The narrator rents a colonial mansion for the summer. " * 40)
    msgs = [{"role": "user", "content": doc + "\n\nWho is the narrator?"}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=24, temperature=0,
              extra_body={"cache_salt": "real-model-test"})
    cold = self.client.chat.completions.create(**kw)
    self.srv.flush()
    # The warm request loads from the store: the device prefix cache (on by default) would
    # otherwise serve the cold request's blocks (800 cached tokens, not 768 in stored chunks).
    self.srv.engine_call(lambda engine: engine.reset_prefix_cache())
    chunks = list(self.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    warm_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    self.assertEqual(cold.usage.prompt_tokens_details.cached_tokens, 0)
    self.assertEqual(usage.prompt_tokens_details.cached_tokens,
                     128 * ((usage.prompt_tokens - 1) // 128))
    self.assertEqual(warm_text, cold.choices[0].message.content)
    ext = chunks[-1].model_extra["kvjax"]
    self.assertEqual(ext["tokens_loaded"], usage.prompt_tokens_details.cached_tokens)
    self.assertEqual(ext["tokens_computed"], usage.prompt_tokens - ext["tokens_loaded"])


if __name__ == "__main__":
  absltest.main()
