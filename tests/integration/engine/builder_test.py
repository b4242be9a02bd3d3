"""The entry points' builder: default store URL, tier JSON, optional LLM options, warmup."""

import json
import os
from unittest import mock

import numpy as np
from absl.testing import absltest, parameterized

from kvjax import SamplingParams
from kvjax.entrypoints import builder
from kvjax.storage.tiering.tiers import StoreConfig, TierConfig


class BuilderTest(parameterized.TestCase):

  def test_default_store_url_follows_the_cache_root(self):
    with mock.patch.dict(os.environ, {"KVJAX_CACHE_DIR": "/srv/kvjax"}):
      self.assertEqual(builder.default_kv_store_url(), "file:///srv/kvjax/store")

  def test_tier_json_text_and_file(self):
    tiers = [{"kind": "host", "capacity_bytes": 1024},
             {"kind": "disk", "url": "/data/kv", "link_bytes_per_s": 1e9}]
    want = StoreConfig((TierConfig("host", capacity_bytes=1024),
                        TierConfig("disk", url="/data/kv", link_bytes_per_s=1e9)))
    self.assertEqual(builder.store_config_from_json(json.dumps(tiers)), want)
    path = self.create_tempfile(content=json.dumps(tiers)).full_path
    self.assertEqual(builder.store_config_from_json(path), want)

  def test_bad_tier_json(self):
    for text, message in (("{nope", "not JSON"), ('{"kind": "disk"}', "list of objects"),
                          ('[{"kind": "disk", "url": "/x", "speed": 1}]', "unknown keys"),
                          ('[{"kind": "tape", "url": "/x"}]', "tier kind"),
                          ('[{"kind": "host", "capacity_bytes": 0}]', "host tier: capacity"),
                          ('[{"kind": "host"}]', "host tier needs capacity_bytes"),
                          ('[{"kind": "host", "capacity_bytes": "1024"}]',
                           "capacity_bytes must be an int, got '1024'"),
                          ('[{"kind": "disk", "url": "/x", "link_bytes_per_s": "fast"}]',
                           "link_bytes_per_s must be a number"),
                          ("/no/such/tiers.json", "is not JSON, and no such file exists"),
                          ('[{"url": "/x"}]', "tier 0 has no 'kind'")):
      with self.assertRaisesRegex(ValueError, message):
        builder.store_config_from_json(text)

  def test_a_host_tier_smaller_than_one_chunk_is_warned_about(self):
    # Found by a fresh-user check: a 1000-byte host tier was accepted silently and never held
    # a chunk.
    from kvjax.testing.engines import real_llm  # pylint: disable=g-import-not-at-top
    tiers = StoreConfig.from_url("memory://", host_capacity_bytes=1000)
    with self.assertLogs("kvjax.connector", "WARNING") as logs:
      llm = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16,), kv_store=tiers,
                     kv_chunk_size=16)
    llm.close()
    self.assertTrue(any("less than one raw chunk" in m for m in logs.output), logs.output)

  @parameterized.parameters("raw", "cachegen")
  def test_warmup_leaves_generation_unchanged(self, codec):
    # The smallest config (one sequence, one chunk size): warm-up compiles every program of
    # the config, so each size more is a set of programs more.
    kw = dict(cache_dir="", compile_on_init=False, max_num_seqs=1, chunk_sizes=(16,),
              kv_store="memory://", kv_chunk_size=16, kv_codec=codec)
    cold, warmed = builder.build_llm("tiny", **kw), builder.build_llm("tiny", **kw)
    builder.warmup(warmed)
    prompt = {"prompt_token_ids": [int(t) for t in np.random.default_rng(3).integers(0, 256, 40)]}
    params = SamplingParams(max_tokens=5, temperature=0.0)
    self.assertEqual(warmed.generate(prompt, params)[0].token_ids,
                     cold.generate(prompt, params)[0].token_ids)
    for llm in (cold, warmed):
      llm.close()


if __name__ == "__main__":
  absltest.main()
