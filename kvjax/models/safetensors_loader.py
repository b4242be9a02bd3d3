"""Hugging Face LLaMA checkpoints (`config.json` + safetensors) <-> canonical float32 parameters.

Hugging Face stores `LlamaForCausalLM` linear weights as `[out, in]` (PyTorch `Linear.weight`) and
already in `rotate_half` RoPE order, so Q/K need no permutation, only transposes and head splits:

  model.embed_tokens.weight          [V, D]      -> embed [V, D]
  model.layers.{i}.self_attn.q_proj  [N*H, D]    -> layers.wq [L, D, N, H]  (k, v: K*H rows)
  model.layers.{i}.self_attn.o_proj  [D, N*H]    -> layers.wo [L, N, H, D]
  model.layers.{i}.mlp.gate_proj/up_proj [F, D]  -> layers.w_gate / w_up [L, D, F]
  model.layers.{i}.mlp.down_proj     [D, F]      -> layers.w_down [L, F, D]
  model.layers.{i}.input_layernorm / post_attention_layernorm [D] -> layers.attn_norm / mlp_norm
  model.norm.weight [D] -> final_norm;  lm_head.weight [V, D] -> lm_head [D, V] (untied only)
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from kvjax.models.config import LlamaConfig, RopeScaling

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ARCHITECTURE = "LlamaForCausalLM"
_MODEL_TYPE = "llama"

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
_SAVE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def config_from_hf(hf: dict[str, Any], name: str) -> LlamaConfig:
  """`LlamaConfig` from a Hugging Face `LlamaForCausalLM` `config.json` dict.

  Args:
    hf: parsed config.json.
    name: config name (checkpoint directory name, or `_name_or_path`).

  Returns:
    The config (`max_seq_len` is `max_position_embeddings`).

  Raises:
    ValueError: not a LLaMA config (`architectures` / `model_type`), a missing field, biases, or an
      unsupported rope scaling type.
  """
  archs = hf.get("architectures")
  if archs is not None and _ARCHITECTURE not in archs:
    raise ValueError(f"{name}: unsupported architectures {archs}, expected [{_ARCHITECTURE!r}]")
  if hf.get("model_type", _MODEL_TYPE) != _MODEL_TYPE:
    raise ValueError(
        f"{name}: unsupported model_type {hf.get('model_type')!r}, expected {_MODEL_TYPE!r}")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{name}: {flag}=true is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{name}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")

  def req(key: str) -> Any:
    if key not in hf:
      raise ValueError(f"{name}: config.json lacks {key!r}")
    return hf[key]

  d_model, n_heads = int(req("hidden_size")), int(req("num_attention_heads"))
  scaling = hf.get("rope_scaling")
  rope_scaling = None
  if scaling is not None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
      rope_scaling = RopeScaling(
          factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
          high_freq_factor=float(scaling["high_freq_factor"]),
          original_max_position=int(scaling["original_max_position_embeddings"]))
    elif kind != "default":
      raise ValueError(f"{name}: unsupported rope_scaling type {kind!r} (only 'llama3')")
  return LlamaConfig(
      name=name,
      vocab_size=int(req("vocab_size")),
      d_model=d_model,
      n_layers=int(req("num_hidden_layers")),
      n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
      head_dim=int(hf.get("head_dim") or d_model // n_heads),
      mlp_dim=int(req("intermediate_size")),
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rope_scaling=rope_scaling,
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def config_to_hf(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, Any]:
  """Hugging Face `config.json` dict for `cfg` (inverse of `config_from_hf`)."""
  s = cfg.rope_scaling
  return {
      "architectures": [_ARCHITECTURE],
      "model_type": _MODEL_TYPE,
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
      "attention_bias": False,
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
  }


def read_safetensors_config(model_dir: str | os.PathLike[str]) -> LlamaConfig:
  """The architecture of a Hugging Face LLaMA checkpoint directory, from its `config.json`
  alone (no weight file is opened).

  Raises:
    FileNotFoundError: config.json is missing.
    ValueError: invalid JSON, or not a supported LLaMA config.
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
  name = hf.get("_name_or_path") or os.path.basename(os.path.normpath(model_dir))
  return config_from_hf(hf, str(name))


def load_safetensors(
    model_dir: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face LLaMA checkpoint directory into canonical float32 parameters.

  Args:
    model_dir: directory with `config.json` and `model.safetensors` or a sharded
      `model.safetensors.index.json`.

  Returns:
    `(cfg, params)`: params maps canonical names to f32 numpy arrays (bf16/f16 are upcast), e.g.
    `layers.wq` f32[L, D, N, H]; `lm_head` f32[D, V] only when `cfg.tie_embeddings` is false.

  Raises:
    FileNotFoundError: the directory, config.json or weight files are missing.
    ValueError: not a LLaMA config, a tensor is missing, or its shape disagrees with the config
      (message names tensor, got, expected).
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
  for suffix, canon, kind in _LAYER_TENSORS:
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
    for suffix, canon, kind in _LAYER_TENSORS:
      w = np.asarray(params[canon][i])
      if kind in ("q", "k"):
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
  """Writes `params` as a Hugging Face LLaMA checkpoint (inverse of `load_safetensors`).

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
  required = {"embed", "final_norm", *(c for _, c, _ in _LAYER_TENSORS)}
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
