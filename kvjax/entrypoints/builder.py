"""What the server builds an `LLM` with, for entry points that may not import lower rooms.

The server (`kvjax.serve`) imports only the engine, the configuration tree (`kvjax.config`) and
request types (docs/architecture.md), so the things it needs from below come through here:

    build_engine_parts(options, ...)  the composition root (`kvjax/entrypoints/root.py`): model,
                                  runner, store, sessions and engine from `EngineOptions`
    build_llm(model, **options)   `LLM(model, **options)` (`options=` an `EngineOptions`, or
                                  flat keywords)
    warmup(llm)                   compile every program a request can hit before serving
    default_kv_store_url()        file store under kvjax's cache root (`<root>/store`, the
                                  default of `python -m kvjax.store` too)
    store_config_from_json(text)  a tier list (JSON) -> `kvjax.storage.StoreConfig`
                                  (`kvjax.config.options.tiers_from_json`, what `kv_tiers` is
                                  parsed with)

The store's `StoreConfig` is made from the options in one place,
`KVStoreOptions.store_config()`, which the root calls.
"""

from __future__ import annotations

from typing import Any

from kvjax.config import EngineOptions
from kvjax.config.options import default_store_url, tiers_from_json
from kvjax.entrypoints.llm import LLM
from kvjax.entrypoints.root import EngineParts, build_engine_parts, close_parts

__all__ = ["EngineParts", "build_engine_parts", "build_llm", "close_parts",
           "default_kv_store_url", "store_config_from_json", "warmup"]

#: A tier list (JSON, or a JSON file's path) -> `StoreConfig` (ValueError on a bad one).
store_config_from_json = tiers_from_json


def default_kv_store_url() -> str:
  """`file://<cache root>/store`: `$KVJAX_CACHE_DIR/store` or `~/.cache/kvjax/store`."""
  return default_store_url()


def build_llm(model: str | None = None, *, options: EngineOptions | None = None,
              **flat: Any) -> LLM:
  """`LLM(model, options=options, **flat)` (`startup_progress` among `flat`).

  Raises:
    ValueError: as `LLM`.
  """
  return LLM(model, options=options, **flat)


def warmup(llm: LLM) -> None:
  """`llm.warmup()`: compiles every program serving uses (a no-op once done)."""
  llm.warmup()
