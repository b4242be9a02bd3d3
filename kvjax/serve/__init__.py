"""kvjax's OpenAI-compatible server (`python -m kvjax.serve`).

The serve room imports only the engine and request types (docs/architecture.md, "Rooms").

The public names are imported lazily (as `kvjax.LLM` is), so `python -m kvjax.serve` installs its
signal handlers before JAX and uvicorn load: a Ctrl-C during those seconds stops the server
instead of landing in an import (or in JAX's garbage-collection callback, which swallows it).
"""

import importlib

__all__ = ["AsyncEngine", "Backend", "EngineFault", "HttpPolicy", "HttpServer", "ServeState",
           "ServerConfig", "backend_from_llm", "close_backend", "create_app", "load_backend"]

_LAZY = {"Backend": "kvjax.serve.app", "ServeState": "kvjax.serve.app",
         "create_app": "kvjax.serve.app", "AsyncEngine": "kvjax.serve.async_engine",
         "EngineFault": "kvjax.serve.async_engine", "HttpPolicy": "kvjax.serve.guard",
         "HttpServer": "kvjax.serve.server", "ServerConfig": "kvjax.serve.server",
         "backend_from_llm": "kvjax.serve.server", "close_backend": "kvjax.serve.server",
         "load_backend": "kvjax.serve.server"}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'kvjax.serve' has no attribute {name!r}")
