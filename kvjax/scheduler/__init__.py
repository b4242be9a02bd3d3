"""The scheduler room: plain Python (no JAX): requests, token-budget step plans, the Cake planner.

The scheduler owns every request; the records in `output` are the only things that cross to the
executor and back.
"""

from kvjax.scheduler.cake import (CakeMerge, ChunkState, DoubleWriteError, LoadVerdict, MergeMode,
                                  MergeTrace, Writer, ideal_merge_s)
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.output import (ComputeTiming, DecodeItem, InsertItem, LoadItem, LoadReport,
                                    PrefillChunk, SaveItem, SchedulerOutput, StepResult,
                                    StoredChunk, StoredPrefix)
from kvjax.scheduler.request import Request, RequestStatus, SamplingParams
from kvjax.scheduler.config import LoadConfig, SchedulerConfig
from kvjax.scheduler.prefill_policy import chunk_tokens
from kvjax.scheduler.scheduler import Scheduler
from kvjax.scheduler.transfer_policy import loads_ahead, reads_at_once

__all__ = ["CakeMerge", "Candidate", "ChunkState", "ComputeTiming", "CostModel", "DecodeItem",
           "DoubleWriteError", "InsertItem", "LoadConfig", "LoadItem", "LoadReport", "LoadVerdict",
           "MergeMode", "MergeTrace", "PrefillChunk", "Request", "RequestStatus", "SamplingParams",
           "SaveItem", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepResult",
           "StoredChunk", "StoredPrefix", "Writer", "chunk_tokens", "ideal_merge_s",
           "loads_ahead", "reads_at_once"]
