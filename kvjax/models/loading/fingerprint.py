"""Model fingerprint: the identity the KV store's keys are seeded from.

Two models share stored KV only if they compute the same KV: same architecture, same config, same
weights. The fingerprint hashes all three (the architecture is the config's `family`, so a
Mistral and a LLaMA checkpoint of identical tensors still never share a chunk) (weights in the canonical layout as f32 bytes, so a GGUF
and a safetensors copy of identical weights agree). It is computed once per converted checkpoint
and cached beside it (`kvjax.models.loading.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Mapping

import numpy as np

from kvjax._typing import ModelFingerprint
from kvjax.models.nn.config import LlamaConfig

#: Bump when the fingerprint's recipe changes (2: the config's family, biases and q/k norm).
FINGERPRINT_VERSION = 2


def model_fingerprint(cfg: LlamaConfig, params: Mapping[str, np.ndarray]) -> ModelFingerprint:
  """SHA-256 (hex) over architecture, config and every parameter's name, shape and f32 bytes.

  Args:
    cfg: the model's config (its name is excluded: renaming a checkpoint keeps its cache).
    params: canonical flat parameters (`kvjax.models.nn.llama.param_shapes`).
  """
  h = hashlib.sha256()
  h.update(f"kvjax-fingerprint-v{FINGERPRINT_VERSION}\0{cfg.family}\0".encode())
  h.update(dataclasses.replace(cfg, name="").to_json().encode())
  for name in sorted(params):
    arr = np.ascontiguousarray(np.asarray(params[name], dtype=np.float32))
    h.update(f"\0{name}\0{arr.shape}\0".encode())
    h.update(memoryview(arr).cast("B"))
  return ModelFingerprint(h.hexdigest())
