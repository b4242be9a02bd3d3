"""Whether a model's weights fit the device, decided before any weight is read or placed.

    checkpoint config (shapes only) --param_nbytes(cfg, dtype)--> bytes the weights take
    device.memory_stats()        --device_free_bytes(device)--> bytes_limit - bytes_in_use
                                                                (None: not reported, e.g. CPU)
    check_weights_fit(...)  ValueError naming both figures when the first exceeds the second

`LLM(...)` runs the check before it converts or loads a checkpoint (converting an 8B GGUF takes
minutes), so a model too large for the device is refused at once. The KV pool and the compiled
step need memory too (`pool_memory`); this check bounds the weights alone, so a model it admits
can still leave too little for the pool, which `build_paged_runner` then reports.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from kvjax.models.nn.config import LlamaConfig
from kvjax.models.nn.llama import param_shapes


def param_count(cfg: LlamaConfig) -> int:
  """The parameters of `cfg`'s model (`llama.param_shapes`: embedding, L layers, final norm,
  and `lm_head` unless tied)."""
  return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def param_nbytes(cfg: LlamaConfig, dtype: Any) -> int:
  """Bytes `cfg`'s weights take on the device in `dtype` (e.g. `jnp.bfloat16`: 2 per
  parameter; SmolLM2-135M: 134,515,008 parameters, 269,030,016 bytes)."""
  return param_count(cfg) * jnp.dtype(dtype).itemsize


def device_free_bytes(device: Any) -> int | None:
  """Bytes free on `device` now: its `memory_stats()`'s `bytes_limit` less `bytes_in_use`.

  Args:
    device: a `jax.Device` (or any object with its `memory_stats()`).

  Returns:
    The free bytes, or None where the platform reports no limit (the CPU's `memory_stats()` is
    None): the caller skips the check there.
  """
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  if not limit:
    return None
  return max(0, int(limit) - int(stats.get("bytes_in_use", 0)))


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def check_weights_fit(cfg: LlamaConfig, dtype: Any, free_bytes: int | None, *,
                      tensor_parallel_size: int = 1, where: str = "the device",
                      model: str | None = None) -> None:
  """Refuses a model whose weights do not fit the device's free memory.

  With tensor parallelism each device holds about `1 / tensor_parallel_size` of the weights
  (norms and some embeddings are replicated, so this share is a lower bound: the check refuses
  only what cannot fit).

  Args:
    cfg: the model's architecture (its parameter shapes).
    dtype: the weights' dtype on the device (`LLM`'s resolved `dtype`).
    free_bytes: free bytes per device (`device_free_bytes`); None: not reported, no check.
    tensor_parallel_size: devices the weights are sharded over.
    where: the device, for the message (e.g. "cuda:0").
    model: the model as the user named it, for the message; default `cfg.name`.

  Raises:
    ValueError: the weights' bytes per device exceed `free_bytes`; the message names both
      figures, the parameter count, the dtype and what to change.
  """
  if free_bytes is None:
    return
  total = param_nbytes(cfg, dtype)
  need = -(-total // tensor_parallel_size)
  if need <= free_bytes:
    return
  name = jnp.dtype(dtype).name
  share = (f"{_gib(need)} per device over tensor_parallel_size={tensor_parallel_size}"
           if tensor_parallel_size > 1 else _gib(need))
  hints = []
  if jnp.dtype(dtype).itemsize > 2:
    hints.append("dtype='bfloat16' (half the bytes)")
  hints.append("more devices (tensor_parallel_size)")
  hints.append("a smaller model")
  raise ValueError(f"{model or cfg.name}'s weights do not fit {where}: {param_count(cfg):,} parameters "
                   f"in {name} take {share}, but {where} has {_gib(free_bytes)} free; use "
                   f"{', '.join(hints)}")
