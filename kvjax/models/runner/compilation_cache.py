"""JAX's persistent compilation cache under kvjax's cache root."""

from __future__ import annotations

import os

import jax

from kvjax._paths import default_cache_root

__all__ = ["default_cache_root", "enable_persistent_compilation_cache"]


def enable_persistent_compilation_cache(path: str | None = None) -> str:
  """Points JAX's persistent compilation cache at `path` (default `<cache root>/jax`).

  A second process start then loads compiled programs instead of recompiling. Leaves a cache
  directory the user configured alone.

  Returns:
    The cache directory in use.
  """
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = path or os.path.join(default_cache_root(), "jax")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a second start (and an `LLM` of the same options
  # after the server) then compiles nothing (at 0.5 s, the small programs of every start were
  # compiled again each time).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
