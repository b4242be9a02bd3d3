"""The engine room: executes the scheduler's plans on the model and owns device KV memory.

The entry points that build an engine (`LLM`, the server's builder) live in `kvjax.entrypoints`."""

from kvjax.engine.core import EngineCore, LoopStats, StepRecord
from kvjax.engine.engine import Engine
from kvjax.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from kvjax.scheduler.block_pool import (AllBlocksClearedEvent, BlockRemovedEvent,
                                        BlockStoredEvent)
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.kv_cache_manager import KVCacheEvents

__all__ = ["AllBlocksClearedEvent", "BlockRemovedEvent", "BlockStoredEvent", "Engine",
           "EngineCore", "EngineStats", "KVCacheEvents", "LoopStats", "MergeTrace",
           "RequestMetrics", "RequestOutput", "StepRecord"]
