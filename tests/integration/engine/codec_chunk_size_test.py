"""Codec options at `LLM(...)`: checked against the registry before weights load; chunk sizes the
kernels' old `min(64, C)` rule refused are saved and loaded back (no silent saver failure)."""

import numpy as np
import pytest
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm

PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


class CodecChunkSizeTest(parameterized.TestCase):

  def test_bad_options_raise_before_the_model_loads(self):
    # "gpt-5" is no model: reaching the loader would raise "unknown model" instead.
    for kwargs, msg in ((dict(kv_chunk_size=0), r"kv_chunk_size=0 with kv_codec='raw'.*>= 1"),
                        (dict(kv_chunk_size=2.5, kv_codec="int4"), r"kv_chunk_size=2\.5"),
                        (dict(kv_chunk_size=True), "kv_chunk_size=True"),
                        (dict(kv_codec="zip"), "kv_codec='zip'"),
                        (dict(kv_codec="int8", kv_codec_levels=(1,)), "kv_codec_levels="),
                        (dict(kv_codec="kvtc", kv_codec_levels="2"),
                         r"kv_codec_levels='2' must be a tuple of int levels")):
      with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, msg):
        real_llm("gpt-5", cache_dir="", kv_store="memory://", **kwargs)
    # Without a store the chunk size is unused and not checked; the model name is.
    with self.assertRaisesRegex(ValueError, "unknown model 'gpt-5'"):
      real_llm("gpt-5", cache_dir="", kv_chunk_size=0)

  # C = 96 and 100: the kernels used to take G = min(64, C) and T = min(16, C), which must divide
  # C, so every save of these failed in the saver thread.
  @parameterized.parameters(("int4", 96), ("cachegen", 100))
  @pytest.mark.slow  # 24 s of the default suite's budget (a regression of the kernels' tiles)
  def test_chunk_sizes_the_old_rule_refused_save_and_load(self, codec, c):
    # Blocks of 4 tokens: C = 96 and 100 are whole numbers of them. The repeat loads from the
    # store (no device prefix cache).
    llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(32, 64), kv_store="memory://",
                   kv_chunk_size=c, kv_codec=codec, kv_codec_levels=(0,), kv_merge_mode="load_only",
                   block_size=4, enable_prefix_caching=False)
    prompt = [int(t) for t in np.random.default_rng(c).integers(0, 256, 2 * c + 5)]
    cold = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    llm.flush()
    out = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    self.assertEqual(out.num_cached_tokens, 2 * c)
    self.assertEqual(set(out.metrics.merge.levels.values()), {f"{codec}/0"})
    self.assertEqual(out.token_ids[0], cold.token_ids[0])
    llm.close()


if __name__ == "__main__":
  absltest.main()
