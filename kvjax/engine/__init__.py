"""The engine room: runs scheduler plans on the model and owns device KV memory."""

from kvjax.engine.engine import Engine, RequestMetrics, RequestOutput
from kvjax.engine.llm import LLM

__all__ = ["Engine", "LLM", "RequestMetrics", "RequestOutput"]
