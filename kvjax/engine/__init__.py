"""The engine room: executes the scheduler's plans on the model and owns device KV memory."""

from kvjax.engine.core import EngineCore, LoopStats, StepRecord
from kvjax.engine.engine import Engine
from kvjax.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from kvjax.engine.llm import LLM
from kvjax.scheduler.block_pool import (AllBlocksClearedEvent, BlockRemovedEvent,
                                        BlockStoredEvent)
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.kv_cache_manager import KVCacheEvents

__all__ = ["AllBlocksClearedEvent", "BlockRemovedEvent", "BlockStoredEvent", "Engine",
           "EngineCore", "EngineStats", "KVCacheEvents", "LLM", "LoopStats", "MergeTrace",
           "RequestMetrics", "RequestOutput", "StepRecord"]
