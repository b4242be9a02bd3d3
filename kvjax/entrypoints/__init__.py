"""Entry points: what a user or a front end builds an engine with.

`LLM` (offline generation, chat sessions, the server's engine) reads the configuration tree
(`kvjax.config`), loads the model, and builds the runner, the scheduler, the store client and the
`Engine`; `builder` turns the server's configuration into an `LLM`. Nothing below this room
imports it.
"""

from kvjax.entrypoints.llm import LLM, StartupEvent, log_startup, print_startup

__all__ = ["LLM", "StartupEvent", "log_startup", "print_startup"]
