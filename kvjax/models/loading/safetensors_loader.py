"""Hugging Face checkpoints (`config.json` + safetensors) <-> canonical float32 parameters.

The architectures `ARCHITECTURES` names (LLaMA, Mistral, Qwen2/Qwen2.5, Qwen3) share one layout.
Hugging Face stores linear weights as `[out, in]` (PyTorch `Linear.weight`) and already in
`rotate_half` RoPE order, so Q/K need no permutation, only transposes and head splits:

  model.embed_tokens.weight          [V, D]      -> embed [V, D]
  model.layers.{i}.self_attn.q_proj  [N*H, D]    -> layers.wq [L, D, N, H]  (k, v: K*H rows)
  model.layers.{i}.self_attn.o_proj  [D, N*H]    -> layers.wo [L, N, H, D]
  model.layers.{i}.mlp.gate_proj/up_proj [F, D]  -> layers.w_gate / w_up [L, D, F]
  model.layers.{i}.mlp.down_proj     [D, F]      -> layers.w_down [L, F, D]
  model.layers.{i}.input_layernorm / post_attention_layernorm [D] -> layers.attn_norm / mlp_norm
  model.norm.weight [D] -> final_norm;  lm_head.weight [V, D] -> lm_head [D, V] (untied only)
  Qwen2 (attention_bias): self_attn.{q,k,v}_proj.bias [N*H] / [K*H] -> layers.bq [L, N, H], ...
  Qwen3 (qk_norm): self_attn.q_norm.weight, k_norm.weight [H] -> layers.q_norm, k_norm [L, H]

A sliding attention window (Mistral's `sliding_window`, Qwen's with `use_sliding_window`)
shorter than `max_position_embeddings` is not implemented: the context is limited to the window
instead (`max_seq_len` = the window), where full causal attention computes exactly what the
windowed one does, and a warning says so.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from kvjax.models.nn.config import LlamaConfig, RopeScaling

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Hugging Face `architectures` entry -> (`model_type`, `LlamaConfig.family`).
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
_FAMILY_ARCHITECTURE = {family: arch for arch, (_, family) in ARCHITECTURES.items()}
_log = logging.getLogger(__name__)

# HF per-layer name (after "model.layers.{i}.") -> (canonical name, kind).
_LAYER_TENSORS = (
    ("input_layernorm.weight", "layers.attn_norm", "norm"),
    ("self_attn.q_proj.weight", "layers.wq", "q"),
    ("self_attn.k_proj.weight", "layers.wk", "k"),
    ("self_attn.v_proj.weight", "layers.wv", "k"),
    ("self_attn.o_proj.weight", "layers.wo", "o"),
    ("post_attention_layernorm.weight", "layers.mlp_norm", "norm"),
    ("mlp.gate_proj.weight", "layers.w_gate", "in"),
    ("mlp.up_proj.weight", "layers.w_up", "in"),
    ("mlp.down_proj.weight", "layers.w_down", "out"),
)
_BIAS_TENSORS = (
    ("self_attn.q_proj.bias", "layers.bq", "bq"),
    ("self_attn.k_proj.bias", "layers.bk", "bk"),
    ("self_attn.v_proj.bias", "layers.bv", "bk"),
)
_QK_NORM_TENSORS = (
    ("self_attn.q_norm.weight", "layers.q_norm", "norm"),
    ("self_attn.k_norm.weight", "layers.k_norm", "norm"),
)
_SAVE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _layer_tensors(cfg: LlamaConfig) -> tuple[tuple[str, str, str], ...]:
  """(HF suffix, canonical name, kind) of every per-layer tensor of `cfg`'s family."""
  return (_LAYER_TENSORS + (_BIAS_TENSORS if cfg.attention_bias else ())
          + (_QK_NORM_TENSORS if cfg.qk_norm else ()))


def _family(hf: dict[str, Any], name: str) -> str:
  """`LlamaConfig.family` of a config.json: from `architectures` when present, else from
  `model_type` (default "llama").

  Raises:
    ValueError: an architecture or model_type not in `ARCHITECTURES`, naming the supported ones.
  """
  supported = sorted(ARCHITECTURES)
  archs = hf.get("architectures")
  if archs is not None:
    known = [a for a in archs if a in ARCHITECTURES] if isinstance(archs, list) else []
    if not known:
      raise ValueError(f"{name}: unsupported architectures {archs}; kvjax runs {supported}")
    model_type, family = ARCHITECTURES[known[0]]
    if hf.get("model_type", model_type) != model_type:
      raise ValueError(f"{name}: unsupported model_type {hf.get('model_type')!r}, expected "
                       f"{model_type!r} for {known[0]}")
    return family
  model_type = hf.get("model_type", "llama")
  for mt, family in ARCHITECTURES.values():
    if mt == model_type:
      return family
  raise ValueError(f"{name}: unsupported model_type {model_type!r}, expected one of "
                   f"{sorted(mt for mt, _ in ARCHITECTURES.values())} (kvjax runs {supported})")


def _rope(hf: dict[str, Any], name: str) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from `rope_theta`/`rope_scaling` or transformers 5's
  `rope_parameters` (one dict with `rope_type` and `rope_theta`).

  Raises:
    ValueError: a rope type other than "default" and "llama3".
  """
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling") if params is None else params
  theta = hf.get("rope_theta")
  if theta is None and params is not None:
    theta = params.get("rope_theta")
  theta = float(10000.0 if theta is None else theta)
  if scaling is None:
    return theta, None
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind == "llama3":
    return theta, RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position=int(scaling["original_max_position_embeddings"]))
  raise ValueError(f"{name}: unsupported rope_scaling type {kind!r} (only 'default', 'llama3')")


def _context_length(hf: dict[str, Any], family: str, name: str) -> int:
  """`max_position_embeddings`, or the sliding window when that is shorter (module docstring)."""
  max_pos = int(hf.get("max_position_embeddings", 2048))
  window = hf.get("sliding_window")
  if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
    window = None
  if family == "llama" or window is None or int(window) >= max_pos:
    return max_pos
  _log.warning("%s: sliding_window=%d < max_position_embeddings=%d is not implemented; the "
               "context is limited to %d tokens (exact there)", name, window, max_pos, window)
  return int(window)


def config_from_hf(hf: dict[str, Any], name: str) -> LlamaConfig:
  """`LlamaConfig` from a Hugging Face `config.json` dict of an architecture in `ARCHITECTURES`.

  Args:
    hf: parsed config.json.
    name: config name (checkpoint directory name, or `_name_or_path`).

  Returns:
    The config (`max_seq_len` is `max_position_embeddings`, or a shorter sliding window).
    Qwen2 always has q/k/v biases (its o_proj none), Qwen3 always a q/k RMSNorm.

  Raises:
    ValueError: an unsupported architecture or model_type (naming the supported ones), a
      missing field, MLP biases, an activation other than silu, or an unsupported rope scaling.
  """
  family = _family(hf, name)
  if hf.get("mlp_bias"):
    raise ValueError(f"{name}: mlp_bias=true is not supported")
  if family != "qwen2" and hf.get("attention_bias"):
    # LLaMA's and Qwen3's attention_bias also puts a bias on o_proj, which kvjax lacks.
    raise ValueError(f"{name}: attention_bias=true is not supported for {family} (only "
                     "Qwen2's q/k/v biases are)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")

  def req(key: str) -> Any:
    if key not in hf:
      raise ValueError(f"{name}: config.json lacks {key!r}")
    return hf[key]

  d_model, n_heads = int(req("hidden_size")), int(req("num_attention_heads"))
  rope_theta, rope_scaling = _rope(hf, name)
  return LlamaConfig(
      name=name,
      vocab_size=int(req("vocab_size")),
      d_model=d_model,
      n_layers=int(req("num_hidden_layers")),
      n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
      head_dim=int(hf.get("head_dim") or d_model // n_heads),
      mlp_dim=int(req("intermediate_size")),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=_context_length(hf, family, name),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      family=family,
      attention_bias=family == "qwen2",
      qk_norm=family == "qwen3")


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, Any]:
  """Hugging Face `config.json` dict for `cfg` (inverse of `config_from_hf`).

  Raises:
    ValueError: biases other than Qwen2's or a q/k norm other than Qwen3's (no Hugging Face
      architecture has that shape).
  """
  if cfg.qk_norm != (cfg.family == "qwen3") or cfg.attention_bias != (cfg.family == "qwen2"):
    raise ValueError(f"{cfg.name}: family {cfg.family!r} with attention_bias="
                     f"{cfg.attention_bias}, qk_norm={cfg.qk_norm} has no Hugging Face config")
  s = cfg.rope_scaling
  return {
      "architectures": [_FAMILY_ARCHITECTURE[cfg.family]],
      "model_type": ARCHITECTURES[_FAMILY_ARCHITECTURE[cfg.family]][0],
      "_name_or_path": cfg.name,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim,
      "hidden_act": "silu",
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None if s is None else {
          "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
          "high_freq_factor": s.high_freq_factor,
          "original_max_position_embeddings": s.original_max_position},
      "rms_norm_eps": cfg.rms_eps,
      "max_position_embeddings": cfg.max_seq_len,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": False if cfg.family == "qwen2" else cfg.attention_bias,
      "mlp_bias": False,
      "torch_dtype": dtype,
  }


def _weight_files(model_dir: str) -> dict[str, str]:
  """HF tensor name -> safetensors file path (single file or sharded index)."""
  single = os.path.join(model_dir, SINGLE_FILE)
  index = os.path.join(model_dir, INDEX_FILE)
  if os.path.isfile(single):  # transformers' order: the single file wins.
    with safe_open(single, framework="numpy") as f:
      return {k: single for k in f.keys()}
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: no 'weight_map' object")
    return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
  raise FileNotFoundError(f"{model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _canonical(w: np.ndarray, kind: str, cfg: LlamaConfig) -> np.ndarray:
  d, h = cfg.d_model, cfg.head_dim
  if kind == "norm":
    return w
  if kind == "bq":
    return w.reshape(cfg.n_heads, h)
  if kind == "bk":
    return w.reshape(cfg.n_kv_heads, h)
  if kind == "q":
    return w.T.reshape(d, cfg.n_heads, h)
  if kind == "k":
    return w.T.reshape(d, cfg.n_kv_heads, h)
  if kind == "o":
    return w.T.reshape(cfg.n_heads, h, d)
  return w.T  # "in": [F, D] -> [D, F]; "out": [D, F] -> [F, D].


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  d, f, h = cfg.d_model, cfg.mlp_dim, cfg.head_dim
  return {
      "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (cfg.n_heads * h, d),
      "self_attn.k_proj.weight": (cfg.n_kv_heads * h, d),
      "self_attn.v_proj.weight": (cfg.n_kv_heads * h, d),
      "self_attn.o_proj.weight": (d, cfg.n_heads * h),
      "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
      "self_attn.q_proj.bias": (cfg.n_heads * h,), "self_attn.k_proj.bias": (cfg.n_kv_heads * h,),
      "self_attn.v_proj.bias": (cfg.n_kv_heads * h,),
      "self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (h,),
  }


def read_safetensors_config(model_dir: str | os.PathLike[str],
                            name: str | None = None) -> LlamaConfig:
  """The architecture of a Hugging Face checkpoint directory (`ARCHITECTURES`), from its
  `config.json` alone (no weight file is opened). `name` names the model in errors (default:
  the config's `_name_or_path`, else the folder's name).

  Raises:
    FileNotFoundError: config.json is missing.
    ValueError: invalid JSON, or not a supported config (`config_from_hf`).
  """
  model_dir = os.fspath(model_dir)
  config_path = os.path.join(model_dir, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found")
  with open(config_path) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{config_path}: invalid JSON: {e}") from e
  if not isinstance(hf, dict):
    raise ValueError(f"{config_path}: expected a JSON object")
  if name is None:
    name = hf.get("_name_or_path") or os.path.basename(os.path.normpath(model_dir))
  return config_from_hf(hf, str(name))


def load_safetensors(
    model_dir: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face checkpoint directory (`ARCHITECTURES`) into canonical float32
  parameters.

  Args:
    model_dir: directory with `config.json` and `model.safetensors` or a sharded
      `model.safetensors.index.json`.

  Returns:
    `(cfg, params)`: params maps canonical names to f32 numpy arrays (bf16/f16 are upcast), e.g.
    `layers.wq` f32[L, D, N, H]; `lm_head` f32[D, V] only when `cfg.tie_embeddings` is false.

  Raises:
    FileNotFoundError: the directory, config.json or weight files are missing.
    ValueError: not a supported config, a tensor is missing, or its shape disagrees with the
      config (message names tensor, got, expected).
  """
  model_dir = os.fspath(model_dir)
  cfg = read_safetensors_config(model_dir)
  files = _weight_files(model_dir)
  handles: dict[str, Any] = {}

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    path = files.get(name)
    if path is None:
      raise ValueError(f"{model_dir}: tensor {name!r} is missing")
    if path not in handles:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} (shard holding {name!r}) not found")
      handles[path] = safe_open(path, framework="numpy")
    w = handles[path].get_tensor(name)
    if tuple(w.shape) != shape:
      raise ValueError(f"{model_dir}: tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
    return np.asarray(w, dtype=np.float32)

  v, d, n_layers = cfg.vocab_size, cfg.d_model, cfg.n_layers
  params = {"embed": get("model.embed_tokens.weight", (v, d))}
  shapes = _hf_shapes(cfg)
  for suffix, canon, kind in _layer_tensors(cfg):
    stacked = None
    for i in range(n_layers):
      w = _canonical(get(f"model.layers.{i}.{suffix}", shapes[suffix]), kind, cfg)
      if stacked is None:
        stacked = np.empty((n_layers, *w.shape), np.float32)
      stacked[i] = w
    params[canon] = stacked
  params["final_norm"] = get("model.norm.weight", (d,))
  if not cfg.tie_embeddings:
    params["lm_head"] = np.ascontiguousarray(get("lm_head.weight", (v, d)).T)
  return cfg, params


def to_hf_tensors(cfg: LlamaConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Canonical params -> HF-named `[out, in]` float32 arrays (inverse of the load conversion)."""
  d = cfg.d_model
  out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
  for i in range(cfg.n_layers):
    for suffix, canon, kind in _layer_tensors(cfg):
      w = np.asarray(params[canon][i])
      if kind in ("bq", "bk"):
        w = w.reshape(-1)
      elif kind in ("q", "k"):
        w = w.reshape(d, -1).T
      elif kind == "o":
        w = w.reshape(-1, d).T
      elif kind in ("in", "out"):
        w = w.T
      out[f"model.layers.{i}.{suffix}"] = w
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"]).T
  return out


def save_safetensors(model_dir: str | os.PathLike[str], cfg: LlamaConfig,
                     params: dict[str, np.ndarray], *, dtype: str = "float32",
                     max_shard_bytes: int | None = None) -> None:
  """Writes `params` as a Hugging Face checkpoint of `cfg.family` (inverse of
  `load_safetensors`).

  Args:
    model_dir: output directory (created if needed; an existing model.safetensors or index is
      removed first).
    cfg: architecture, written as config.json.
    params: canonical f32 parameters (see `load_safetensors`).
    dtype: stored dtype, "float32", "float16" or "bfloat16".
    max_shard_bytes: when set, split tensors into `model-0000i-of-0000n.safetensors` shards of
      at most this many bytes (a tensor never split) plus `model.safetensors.index.json`;
      otherwise write one `model.safetensors`.

  Raises:
    ValueError: unknown dtype, or a canonical parameter is missing.
  """
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
  required = {"embed", "final_norm", *(c for _, c, _ in _layer_tensors(cfg))}
  if not cfg.tie_embeddings:
    required.add("lm_head")
  missing = sorted(required - params.keys())
  if missing:
    raise ValueError(f"params lack {missing}")
  model_dir = os.fspath(model_dir)
  os.makedirs(model_dir, exist_ok=True)
  np_dtype = _SAVE_DTYPES[dtype]
  tensors = {k: np.ascontiguousarray(np.asarray(w, np.float32).astype(np_dtype))
             for k, w in to_hf_tensors(cfg, params).items()}
  metadata = {"format": "pt"}
  for stale in (SINGLE_FILE, INDEX_FILE):  # Never leave the other layout behind.
    if os.path.isfile(os.path.join(model_dir, stale)):
      os.remove(os.path.join(model_dir, stale))
  if max_shard_bytes is None:
    save_file(tensors, os.path.join(model_dir, SINGLE_FILE), metadata=metadata)
  else:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, w in tensors.items():
      if shards[-1] and size + w.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][k] = w
      size += w.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(model_dir, fname), metadata=metadata)
      weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
             "weight_map": weight_map}
    with open(os.path.join(model_dir, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  with open(os.path.join(model_dir, CONFIG_FILE), "w") as f:
    json.dump(config_to_hf(cfg, dtype), f, indent=2)
