"""The engine's output records, plain data (vLLM v1 keeps `EngineCoreOutput` apart from the core).

`RequestOutput` (with its `RequestMetrics` and vLLM's `CompletionOutput` view) is what
`kvjax.engine.engine.Engine.step` returns per request; `EngineStats` is the one snapshot of the
engine's accounting the server's metrics and health read. Nothing here holds a reference to the
engine, the scheduler or the store client.
"""

from __future__ import annotations

import dataclasses

from kvjax._typing import RequestId
from kvjax.connector import LoaderStats, PrefetchStats, SaverStats, TierSnapshot
from kvjax.engine.core import LoopStats
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.kv_cache_manager import KVCacheStats


@dataclasses.dataclass
class RequestMetrics:
  """Per-request timing and token accounting.

  Attributes:
    arrival_s: when the engine accepted the request (engine clock, seconds).
    scheduled_s: when its first scheduled step began: the executor's clock as it starts the
      plan that first admitted the request from the waiting queue (given a slot); None while it
      waits.
    first_token_s: when the first output token was sampled.
    finished_s: when the request finished.
    ttft_s: time to first token, seconds (`first_token_s - arrival_s`: queueing included).
    prefill_s: prefill wall time, seconds: `first_token_s - scheduled_s`, from the request's
      first scheduled step to its first token (loads, inserts, its prefill chunks and the steps
      it shared with other requests; not the queueing before it was admitted), so
      0 <= prefill_s <= ttft_s. None until the first token.
    num_computed_tokens: prompt tokens whose KV was computed by prefill.
    num_loaded_tokens: prompt tokens whose KV was loaded from the store or served from the
      device prefix cache.
    num_device_cached_tokens: of those, tokens served from the device prefix cache.
    num_rejected_chunks: stored chunks that failed verification and were computed instead.
    num_wasted_chunks: loads that landed after compute had taken their chunk (dropped).
    loaded_from_tiers: tier of each loaded chunk, in order; "device" once per device prefix
      hit, first.
    loaded_chunks: `(chunk index, tier)` of each store chunk inserted, in insertion order.
    merge: the Cake merge trace (chunks computed, loaded and wasted, meeting index, level of each
      loaded chunk, seconds per side), or None when nothing was stored.
    lookup_s: seconds of the batched store lookup at admission (0 without a store).
  """

  arrival_s: float
  scheduled_s: float | None = None
  first_token_s: float | None = None
  finished_s: float | None = None
  ttft_s: float | None = None
  prefill_s: float | None = None
  num_computed_tokens: int = 0
  num_loaded_tokens: int = 0
  num_device_cached_tokens: int = 0
  num_rejected_chunks: int = 0
  num_wasted_chunks: int = 0
  loaded_from_tiers: list[str] = dataclasses.field(default_factory=list)
  loaded_chunks: list[tuple[int, str]] = dataclasses.field(default_factory=list)
  merge: MergeTrace | None = None
  lookup_s: float = 0.0


@dataclasses.dataclass
class CompletionOutput:
  """One generated sequence (vLLM's shape): text, ids, reason, per-token top log-probs."""

  index: int
  text: str
  token_ids: list[int]
  finish_reason: str | None
  logprobs: list[dict[int, float]] | None


@dataclasses.dataclass
class RequestOutput:
  """A request's result (or progress, while `finished` is False).

  Attributes:
    request_id: the request's id.
    prompt: the prompt text, when given as text.
    prompt_token_ids: the prompt's tokens.
    text: generated text (special tokens skipped; a matched stop string removed); filled when
      the request finishes.
    token_ids: generated tokens.
    finish_reason: "stop" (EOS, stop token or stop string), "length", "abort", or None.
    logprobs: per generated token, a dict of token id to log-probability, when asked.
    num_cached_tokens: prompt tokens served from the prefix cache.
    metrics: timing and token accounting.
    finished: whether generation ended.
    forked: `n` > 1 (`LLM.generate`): the other choices, 1 to n - 1, forked from this
      request's prompt (their own text, tokens, reason and log-probs); empty otherwise.
  """

  request_id: RequestId
  prompt: str | None
  prompt_token_ids: list[int]
  text: str
  token_ids: list[int]
  finish_reason: str | None
  logprobs: list[dict[int, float]] | None
  num_cached_tokens: int
  metrics: RequestMetrics
  finished: bool
  forked: list[CompletionOutput] = dataclasses.field(default_factory=list)

  @property
  def outputs(self) -> list[CompletionOutput]:
    """vLLM-style view: one `CompletionOutput` per choice (this request's, then `forked`)."""
    return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason,
                             self.logprobs)] + list(self.forked)

  def as_choice(self, index: int) -> CompletionOutput:
    """This request's sequence as choice `index` of a forked (`n` > 1) request."""
    return CompletionOutput(index, self.text, self.token_ids, self.finish_reason, self.logprobs)


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """One snapshot of the engine's accounting, plain data (the server's metrics and health read
  it; nothing reads the engine's internals).

  Attributes:
    num_waiting: requests queued for a slot.
    num_running: requests holding a slot.
    loop: the step loop's accounting (steps, planner seconds).
    loader: the store client's load accounting (None without a store).
    saver: the saver's accounting (None without a store).
    lookup_failures: store lookups that failed and degraded to computing.
    link_bandwidth_bytes_per_s: the planner's estimate of the store link.
    kv_cache_ok: the KV cache buffers are alive (False after a failed step consumed them).
    tiers: per store tier, its counters (empty without a store).
    kv_cache: the KV pool and device prefix cache (blocks, usage, hits, preemptions).
    kv_cache_bytes: device bytes reserved for KV (the pool), int.
    kv_cache_peak_used_bytes: bytes of the most pool blocks held at once.
    prefetch: look-ahead prefetch accounting (issued, useful, wasted; None without a store).
  """

  num_waiting: int
  num_running: int
  loop: LoopStats
  loader: LoaderStats | None
  saver: SaverStats | None
  lookup_failures: int
  link_bandwidth_bytes_per_s: float
  kv_cache_ok: bool
  tiers: tuple[TierSnapshot, ...] = ()
  kv_cache: KVCacheStats | None = None
  kv_cache_bytes: int = 0
  kv_cache_peak_used_bytes: int = 0
  prefetch: PrefetchStats | None = None
