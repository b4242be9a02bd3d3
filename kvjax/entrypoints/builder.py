"""Builds a warmed-up `LLM` from plain options, for entry points that may not import lower rooms.

The server (`kvjax.serve`) imports only the engine, the configuration tree (`kvjax.config`) and
request types (docs/architecture.md), so the things it needs from below come through here:

    default_kv_store_url()        file store under kvjax's cache root (`<root>/store`, the
                                  default of `python -m kvjax.store` too)
    store_config_from_json(text)  a tier list (JSON) -> `kvjax.storage.StoreConfig`
    store_config_from_url(url, ...)  one store URL with its capacity and link -> `StoreConfig`
    build_llm(model, **options)   `LLM(model, **options)` (`options=` an `EngineOptions`, or
                                  flat keywords)
    warmup(llm)                   compile every program a request can hit before serving

`LLM.__init__` stays the one construction path; nothing here duplicates it.
"""

from __future__ import annotations

import json
import os
from typing import Any


from kvjax.config import EngineOptions
from kvjax.entrypoints.llm import LLM
from kvjax.storage import specs
from kvjax.storage.tiers import DEFAULT_STORE_CAPACITY_BYTES, StoreConfig, TierConfig, url_kind

_TIER_KEYS = {f for f in TierConfig.__dataclass_fields__}


def default_kv_store_url() -> str:
  """`file://<cache root>/store`: `$KVJAX_CACHE_DIR/store` or `~/.cache/kvjax/store`."""
  return "file://" + specs.default_root()


def store_config_from_json(text: str) -> StoreConfig:
  """Parses a tier list into a `StoreConfig`.

  Args:
    text: JSON, or the path of a JSON file: a list of tiers, top first, each an object with the
      `TierConfig` fields, e.g. `[{"kind": "host", "capacity_bytes": 1073741824},
      {"kind": "disk", "url": "/data/kv", "link_bytes_per_s": 3.125e9}]`.

  Raises:
    ValueError: not JSON, not a list of objects, unknown keys, or invalid tiers.
  """
  if os.path.isfile(text):
    with open(text, encoding="utf-8") as f:
      text = f.read()
  try:
    tiers = json.loads(text)
  except json.JSONDecodeError as e:
    if not text.lstrip().startswith(("[", "{")):  # meant as a path
      raise ValueError(f"tier config {text!r} is not JSON, and no such file exists") from e
    raise ValueError(f"tier config is not JSON (nor a file): {e}") from e
  if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
    raise ValueError("tier config must be a JSON list of objects, e.g. "
                     '[{"kind": "disk", "url": "/data/kv"}]')
  for i, t in enumerate(tiers):
    unknown = set(t) - _TIER_KEYS
    if unknown:
      raise ValueError(f"tier {i}: unknown keys {sorted(unknown)}; known: {sorted(_TIER_KEYS)}")
    if "kind" not in t:
      raise ValueError(f"tier {i} has no 'kind'")
  return StoreConfig(tuple(TierConfig(**t) for t in tiers))


def store_config_from_url(url: str, *, capacity_bytes: int | None = None,
                          link_bytes_per_s: float | None = None,
                          link_trace: str | None = None) -> StoreConfig:
  """The one-tier `StoreConfig` of a store URL, with a byte limit.

  Args:
    url: a store URL (memory://, file://, a path, ocdbt+file://, s3://).
    capacity_bytes: the tier's byte limit; None: `DEFAULT_STORE_CAPACITY_BYTES` for a local
      (or memory) store, unbounded for s3:// (the bucket's lifecycle rules govern it).
    link_bytes_per_s, link_trace: the tier's emulated read link (see `TierConfig`).

  Raises:
    ValueError: an unknown URL scheme, a capacity that is not a positive int, a bad link.
  """
  kind = url_kind(url)
  if capacity_bytes is None and kind == "disk":
    capacity_bytes = DEFAULT_STORE_CAPACITY_BYTES
  return StoreConfig((TierConfig(kind, url=url, capacity_bytes=capacity_bytes,
                                 link_bytes_per_s=link_bytes_per_s, link_trace=link_trace),))


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
