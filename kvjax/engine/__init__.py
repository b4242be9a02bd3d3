"""The engine room: executes the scheduler's plans on the model and owns device KV memory."""

from kvjax.engine.core import EngineCore, LoopStats, StepRecord
from kvjax.engine.engine import Engine, EngineStats, RequestMetrics, RequestOutput
from kvjax.engine.llm import LLM
from kvjax.scheduler.cake import MergeTrace

__all__ = ["Engine", "EngineCore", "EngineStats", "LLM", "LoopStats", "MergeTrace",
           "RequestMetrics", "RequestOutput", "StepRecord"]
