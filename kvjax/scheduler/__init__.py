"""The scheduler room: plain Python (no JAX): requests, token-budget step plans."""

from kvjax.scheduler.request import Request, RequestStatus, SamplingParams
from kvjax.scheduler.scheduler import (DecodeItem, LoadItem, PrefillChunk, Scheduler, SchedulerConfig,
                                       SchedulerOutput, chunk_tokens)

__all__ = ["DecodeItem", "LoadItem", "PrefillChunk", "Request", "RequestStatus", "SamplingParams",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "chunk_tokens"]
