"""The scheduler room: plain Python (no JAX): requests, token-budget step plans, the Cake planner."""

from kvjax.scheduler.cake import (CakeMerge, ChunkState, DoubleWriteError, LoadVerdict, MergeMode,
                                  MergeTrace, Writer, ideal_merge_s)
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.request import Request, RequestStatus, SamplingParams
from kvjax.scheduler.scheduler import (DecodeItem, LoadItem, PrefillChunk, Scheduler, SchedulerConfig,
                                       SchedulerOutput, chunk_tokens)

__all__ = ["CakeMerge", "Candidate", "ChunkState", "CostModel", "DecodeItem", "DoubleWriteError",
           "LoadItem", "LoadVerdict", "MergeMode", "MergeTrace", "PrefillChunk", "Request",
           "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "Writer", "chunk_tokens", "ideal_merge_s"]
