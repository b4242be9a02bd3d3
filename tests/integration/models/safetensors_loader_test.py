"""Tests of the Hugging Face safetensors checkpoint reader and writer."""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from kvjax.models.nn import config
from kvjax.models.nn.llama import param_shapes
from kvjax.models.loading import safetensors_loader as st


def random_params(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}


class SafetensorsLoaderTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path

  def assert_params_equal(self, got, want):
    self.assertEqual(set(got), set(want))
    for k in want:
      self.assertEqual(got[k].dtype, np.float32, k)
      self.assertEqual(got[k].shape, want[k].shape, k)
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)

  @parameterized.named_parameters(
      ("tied", dict()),
      ("untied", dict(tie_embeddings=False)),
      ("llama3_scaling", dict(rope_scaling=config.RopeScaling(), tie_embeddings=False)),
      ("mha_explicit_head_dim", dict(n_heads=4, n_kv_heads=4, head_dim=16)),
      ("mistral", dict(family="mistral", tie_embeddings=False)),
      ("qwen2_biases", dict(family="qwen2", attention_bias=True)),
      ("qwen3_qk_norm", dict(family="qwen3", qk_norm=True, head_dim=16, tie_embeddings=False)),
  )
  def test_round_trip_exact(self, overrides):
    cfg = config.tiny(**overrides)
    params = random_params(cfg)
    st.save_safetensors(self.dir, cfg, params)
    self.assertTrue(os.path.isfile(os.path.join(self.dir, "model.safetensors")))
    got_cfg, got = st.load_safetensors(self.dir)
    self.assertEqual(got_cfg, cfg)
    self.assert_params_equal(got, params)

  def test_sharded_round_trip(self):
    cfg = config.tiny(tie_embeddings=False)
    params = random_params(cfg)
    st.save_safetensors(self.dir, cfg, params, max_shard_bytes=64 * 1024)
    files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
    self.assertGreater(len(files), 2)
    self.assertNotIn("model.safetensors", files)
    with open(os.path.join(self.dir, "model.safetensors.index.json")) as f:
      self.assertEqual(set(json.load(f)["weight_map"].values()), set(files))
    got_cfg, got = st.load_safetensors(self.dir)
    self.assertEqual(got_cfg, cfg)
    self.assert_params_equal(got, params)

  @parameterized.parameters(("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16))
  def test_half_precision_upcast(self, dtype, np_dtype):
    cfg = config.tiny()
    params = random_params(cfg)
    st.save_safetensors(self.dir, cfg, params, dtype=dtype)
    _, got = st.load_safetensors(self.dir)
    for k in params:
      self.assertEqual(got[k].dtype, np.float32, k)
      np.testing.assert_array_equal(got[k], params[k].astype(np_dtype).astype(np.float32), k)

  def test_hf_layout(self):
    # q_proj row o = head o // H, dim o % H; canonical wq[d, n, h] = q_proj[n * H + h, d].
    cfg = config.tiny()
    params = random_params(cfg)
    hf = st.to_hf_tensors(cfg, params)
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    self.assertEqual(q.shape, (cfg.n_heads * cfg.head_dim, cfg.d_model))
    self.assertEqual(q[2 * cfg.head_dim + 5, 7], params["layers.wq"][1, 7, 2, 5])
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    self.assertEqual(o[7, 3 * cfg.head_dim + 1], params["layers.wo"][0, 3, 1, 7])
    self.assertEqual(hf["model.layers.0.mlp.down_proj.weight"][4, 9],
                     params["layers.w_down"][0, 9, 4])

  def test_hf_defaults(self):
    # MHA, head_dim = d_model / n_heads and untied: the HF defaults.
    cfg = config.tiny(n_kv_heads=6, tie_embeddings=False)
    st.save_safetensors(self.dir, cfg, random_params(cfg))
    path = os.path.join(self.dir, "config.json")
    with open(path) as f:
      hf = json.load(f)
    for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "_name_or_path"):
      del hf[key]
    with open(path, "w") as f:
      json.dump(hf, f)
    got, _ = st.load_safetensors(self.dir)
    self.assertEqual(got.name, os.path.basename(self.dir))
    self.assertEqual(got.head_dim, cfg.d_model // cfg.n_heads)
    self.assertEqual(got.n_kv_heads, cfg.n_heads)
    self.assertFalse(got.tie_embeddings)

  def write_config(self, **changes):
    cfg = config.tiny()
    st.save_safetensors(self.dir, cfg, random_params(cfg))
    path = os.path.join(self.dir, "config.json")
    with open(path) as f:
      hf = json.load(f)
    hf.update(changes)
    with open(path, "w") as f:
      json.dump(hf, f)

  @parameterized.named_parameters(
      ("architecture", dict(architectures=["GPT2LMHeadModel"]),
       r"GPT2LMHeadModel.*\['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', "
       r"'Qwen3ForCausalLM'\]"),
      ("architecture_and_model_type", dict(architectures=["MistralForCausalLM"]),
       "model_type 'llama', expected 'mistral'"),
      ("model_type", dict(model_type="gpt2"), "model_type 'gpt2'.*expected 'llama'"),
      ("bias", dict(attention_bias=True), "attention_bias"),
      ("rope_type", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
      ("shape", dict(intermediate_size=64), r"gate_proj.weight.*\(96, 48\).*\(64, 48\)"),
  )
  def test_bad_config(self, changes, regex):
    self.write_config(**changes)
    with self.assertRaisesRegex(ValueError, regex):
      st.load_safetensors(self.dir)

  def test_missing_config_field(self):
    self.write_config()
    path = os.path.join(self.dir, "config.json")
    with open(path) as f:
      hf = json.load(f)
    del hf["hidden_size"]
    with open(path, "w") as f:
      json.dump(hf, f)
    with self.assertRaisesRegex(ValueError, "hidden_size"):
      st.load_safetensors(self.dir)

  def test_missing_files(self):
    with self.assertRaisesRegex(FileNotFoundError, "config.json"):
      st.load_safetensors(self.dir)
    self.write_config()
    os.remove(os.path.join(self.dir, "model.safetensors"))
    with self.assertRaisesRegex(FileNotFoundError, "model.safetensors"):
      st.load_safetensors(self.dir)

  def test_missing_tensor(self):
    cfg = config.tiny(tie_embeddings=False)
    hf = st.to_hf_tensors(cfg, random_params(cfg))
    del hf["lm_head.weight"]
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()},
              os.path.join(self.dir, "model.safetensors"))
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      json.dump(st.config_to_hf(cfg), f)
    with self.assertRaisesRegex(ValueError, "'lm_head.weight' is missing"):
      st.load_safetensors(self.dir)

  def test_tied_ignores_lm_head(self):
    cfg = config.tiny()
    hf = st.to_hf_tensors(cfg, random_params(cfg))
    hf["lm_head.weight"] = np.zeros((cfg.vocab_size, cfg.d_model), np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()},
              os.path.join(self.dir, "model.safetensors"))
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      json.dump(st.config_to_hf(cfg), f)
    _, got = st.load_safetensors(self.dir)
    self.assertNotIn("lm_head", got)

  def test_save_rejects_incomplete_params(self):
    cfg = config.tiny(tie_embeddings=False)
    params = random_params(cfg)
    del params["lm_head"]
    with self.assertRaisesRegex(ValueError, "lm_head"):
      st.save_safetensors(self.dir, cfg, params)
    with self.assertRaisesRegex(ValueError, "dtype"):
      st.save_safetensors(self.dir, config.tiny(), random_params(config.tiny()), dtype="int8")


if __name__ == "__main__":
  absltest.main()
