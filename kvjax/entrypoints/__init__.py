"""Entry points: what a user or a front end builds an engine with.

The composition root (`root.build_engine_parts`) builds the model, runner, store client, sessions
and `Engine` from the configuration tree (`kvjax.config`); `LLM` (offline generation, chat
sessions, the server's engine) is a facade over those parts; `builder` is what the server builds
with. Nothing below this room imports it.
"""

from kvjax.entrypoints.llm import LLM, StartupEvent, log_startup, print_startup

__all__ = ["LLM", "StartupEvent", "log_startup", "print_startup"]
