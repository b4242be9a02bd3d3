"""Model resolution, the orbax converted-params cache, and the model fingerprint."""

import dataclasses
import json
import os

import numpy as np
from absl.testing import absltest

from kvjax import SamplingParams
from kvjax.testing.engines import real_llm
from kvjax.models.loading import checkpoint, safetensors_loader
from kvjax.models.nn import config
from kvjax.models.loading.fingerprint import model_fingerprint
from kvjax.models.loading.registry import load_model, tiny_params


class RegistryTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cfg = config.tiny()
    self.params = tiny_params(self.cfg)
    self.model_dir = self.create_tempdir("hf_tiny").full_path
    safetensors_loader.save_safetensors(self.model_dir, self.cfg, self.params)
    self.cache_dir = self.create_tempdir("cache").full_path

  def test_safetensors_dir_loads_and_caches_converted_params(self):
    first = load_model(self.model_dir, cache_dir=self.cache_dir)
    entries = os.listdir(self.cache_dir)
    self.assertLen(entries, 1)
    meta = json.load(open(os.path.join(self.cache_dir, entries[0], "meta.json")))
    self.assertEqual(meta["fingerprint"], first.fingerprint)
    second = load_model(self.model_dir, cache_dir=self.cache_dir)
    self.assertEqual(second.fingerprint, first.fingerprint)
    self.assertEqual(second.config, first.config)
    for k, v in self.params.items():
      np.testing.assert_array_equal(second.params[k], v, err_msg=k)
    # The same weights from another source give the same fingerprint (the name is excluded).
    self.assertEqual(first.fingerprint, load_model("tiny").fingerprint)

  def test_corrupt_cache_entry_is_rebuilt(self):
    want = load_model(self.model_dir, cache_dir=self.cache_dir)
    entry = os.path.join(self.cache_dir, os.listdir(self.cache_dir)[0])
    for root, _, files in os.walk(os.path.join(entry, "params")):
      for name in files:
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")
    got = load_model(self.model_dir, cache_dir=self.cache_dir)
    self.assertEqual(got.fingerprint, want.fingerprint)
    for k, v in self.params.items():
      np.testing.assert_array_equal(got.params[k], v, err_msg=k)

  def test_changed_source_file_gets_a_new_entry(self):
    load_model(self.model_dir, cache_dir=self.cache_dir)
    params = dict(self.params, final_norm=self.params["final_norm"] * 2)
    safetensors_loader.save_safetensors(self.model_dir, self.cfg, params)
    os.utime(os.path.join(self.model_dir, "model.safetensors"), ns=(1, 1))
    got = load_model(self.model_dir, cache_dir=self.cache_dir)
    np.testing.assert_array_equal(got.params["final_norm"], params["final_norm"])
    self.assertLen(os.listdir(self.cache_dir), 2)

  def test_llm_from_safetensors_equals_tiny(self):
    ids = {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}
    greedy = SamplingParams(max_tokens=4, temperature=0)
    a = real_llm(self.model_dir, cache_dir="", max_num_seqs=1, chunk_sizes=(16,))
    b = real_llm("tiny", cache_dir="", max_num_seqs=1, chunk_sizes=(16,))
    self.assertEqual(a.generate(ids, greedy)[0].token_ids, b.generate(ids, greedy)[0].token_ids)
    with self.assertRaisesRegex(ValueError, "no tokenizer"):
      a.generate("text needs a tokenizer", greedy)

  def test_missing_paths_raise(self):
    with self.assertRaisesRegex(FileNotFoundError, "nope.gguf"):
      load_model("/tmp/nope.gguf")
    empty = self.create_tempdir("empty").full_path
    with self.assertRaisesRegex(FileNotFoundError, "without config.json"):
      load_model(empty)
    with self.assertRaisesRegex(ValueError, "unknown model 'llama-9000'"):
      load_model("llama-9000")


class FingerprintTest(absltest.TestCase):

  def test_fingerprint_sees_every_weight_and_the_config(self):
    cfg = config.tiny()
    params = tiny_params(cfg)
    base = model_fingerprint(cfg, params)
    self.assertEqual(base, model_fingerprint(cfg, {k: v.copy() for k, v in params.items()}))
    self.assertEqual(base, model_fingerprint(dataclasses.replace(cfg, name="renamed"), params))
    nudged = {k: v.copy() for k, v in params.items()}
    nudged["layers.w_down"][1, 2, 3] += 1e-6
    self.assertNotEqual(base, model_fingerprint(cfg, nudged))
    self.assertNotEqual(base, model_fingerprint(dataclasses.replace(cfg, rope_theta=5e5), params))

  def test_source_key_follows_file_identity(self):
    d = self.create_tempdir()
    f = d.create_file("w.bin", content="abc")
    key = checkpoint.source_key([f.full_path])
    self.assertEqual(key, checkpoint.source_key([f.full_path]))
    f.write_text("abcd")
    self.assertNotEqual(key, checkpoint.source_key([f.full_path]))


if __name__ == "__main__":
  absltest.main()
