"""kvjax: get the KV cache of a long prompt onto the accelerator as fast as the machine allows.

Public API (vLLM's shape): `LLM`, `SamplingParams`, `RequestOutput`, and `EngineOptions` (every
`LLM` option as one frozen record, `kvjax.config`). They are imported lazily, so tools that need
only the store (`python -m kvjax.store`) start without loading JAX.
"""

import importlib

__all__ = ["EngineOptions", "LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"EngineOptions": "kvjax.config", "LLM": "kvjax.entrypoints.llm",
         "RequestOutput": "kvjax.engine.outputs", "SamplingParams": "kvjax.scheduler.request"}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'kvjax' has no attribute {name!r}")
