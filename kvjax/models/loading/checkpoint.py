"""Orbax cache of converted parameters, so the second start skips GGUF dequantization.

    <cache root>/params/<source key>/
        params/      orbax StandardCheckpointer tree of canonical f32 arrays
        meta.json    config, model fingerprint, source path, converter version

The source key hashes the source files' paths, sizes and modification times plus the converter
version, so a changed file or converter gets a fresh entry. An entry is written to a temporary
directory and renamed into place, so a crash never leaves a half entry that looks whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Callable, Sequence

import numpy as np

from kvjax._typing import ModelFingerprint
from kvjax.models.nn.config import LlamaConfig
from kvjax.models.loading.fingerprint import model_fingerprint

#: Bump when the conversion (canonical layout, un-permutation) or the fingerprint changes
#: (2: model families, `kvjax.models.loading.fingerprint` v2).
CONVERTER_VERSION = 2

_log = logging.getLogger(__name__)


def source_key(paths: Sequence[str]) -> str:
  """Hex SHA-256 of the source files' absolute paths, sizes, mtimes and the converter version."""
  h = hashlib.sha256(f"kvjax-converter-v{CONVERTER_VERSION}".encode())
  for p in sorted(os.path.abspath(p) for p in paths):
    st = os.stat(p)
    h.update(f"\0{p}\0{st.st_size}\0{st.st_mtime_ns}".encode())
  return h.hexdigest()


def entry_dir(cache_dir: str, source_paths: Sequence[str]) -> str:
  """The cache entry directory for these source files."""
  return os.path.join(cache_dir, source_key(source_paths))


def cached_config(source_paths: Sequence[str], cache_dir: str | None) -> LlamaConfig | None:
  """The config of these source files' cache entry (its meta.json alone, no weights), or None
  when there is no readable entry (`load_converted` rebuilds a bad one)."""
  if cache_dir is None:
    return None
  try:
    with open(os.path.join(entry_dir(cache_dir, source_paths), "meta.json")) as f:
      return LlamaConfig.from_dict(json.load(f)["config"])
  except Exception:  # noqa: BLE001 - any failure means: no usable entry
    return None


def load_converted(
    source_paths: Sequence[str],
    convert: Callable[[], tuple[LlamaConfig, dict[str, np.ndarray]]],
    cache_dir: str | None,
) -> tuple[LlamaConfig, dict[str, np.ndarray], ModelFingerprint]:
  """Returns (config, canonical params, fingerprint), from the cache when possible.

  Args:
    source_paths: files the conversion reads (their stat identifies the entry).
    convert: the (slow) conversion, run on a cache miss.
    cache_dir: `<cache root>/params`, or None to skip caching.

  A corrupt or unreadable entry is logged, removed and rebuilt.
  """
  if cache_dir is None:
    cfg, params = convert()
    return cfg, params, model_fingerprint(cfg, params)
  import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy import, only when caching)

  entry = entry_dir(cache_dir, source_paths)
  meta_path = os.path.join(entry, "meta.json")
  if os.path.exists(meta_path):
    try:
      with open(meta_path) as f:
        meta = json.load(f)
      cfg = LlamaConfig.from_dict(meta["config"])
      restored = ocp.StandardCheckpointer().restore(os.path.join(entry, "params"))
      params = {k: np.asarray(v, np.float32) for k, v in restored.items()}
      return cfg, params, ModelFingerprint(meta["fingerprint"])
    except Exception as e:  # noqa: BLE001 - any failure means: rebuild the entry
      _log.warning("converted-params cache entry %s is unreadable (%s); rebuilding", entry, e)
      shutil.rmtree(entry, ignore_errors=True)
  cfg, params = convert()
  fingerprint = model_fingerprint(cfg, params)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir)
  try:
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.join(tmp, "params"), params)
    ckptr.wait_until_finished()
    with open(os.path.join(tmp, "meta.json"), "w") as f:
      json.dump({"config": json.loads(cfg.to_json()), "fingerprint": fingerprint,
                 "sources": [os.path.abspath(p) for p in source_paths],
                 "converter_version": CONVERTER_VERSION}, f, indent=1)
    os.replace(tmp, entry)
  except OSError as e:
    _log.warning("could not cache converted params at %s: %s", entry, e)
    shutil.rmtree(tmp, ignore_errors=True)
  return cfg, params, fingerprint
