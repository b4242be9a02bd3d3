"""kvjax's OpenAI-compatible server (`python -m kvjax.serve`).

The serve room imports only the engine and request types (DESIGN.md section 2).
"""

from kvjax.serve.app import Backend, ServeState, create_app
from kvjax.serve.async_engine import AsyncEngine, EngineFault
from kvjax.serve.guard import HttpPolicy
from kvjax.serve.server import (HttpServer, ServerConfig, backend_from_llm, close_backend,
                                load_backend)

__all__ = ["AsyncEngine", "Backend", "EngineFault", "HttpPolicy", "HttpServer", "ServeState",
           "ServerConfig", "backend_from_llm", "close_backend", "create_app", "load_backend"]
