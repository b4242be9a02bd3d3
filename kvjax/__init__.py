"""kvjax: get the KV cache of a long prompt onto the accelerator as fast as the machine allows.

Public API (vLLM's shape): `LLM`, `SamplingParams`, `RequestOutput`.
"""

from kvjax.engine.engine import RequestOutput
from kvjax.engine.llm import LLM
from kvjax.scheduler.request import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
