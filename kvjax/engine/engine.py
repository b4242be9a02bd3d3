"""The engine: runs the scheduler's plans on the model runner and turns logits into tokens.

Architecture. One engine thread owns the device (the model state and the KV cache); nothing else
touches the cache. Each `step()`:

    scheduler.schedule()  ->  SchedulerOutput(decodes, prefills)     plain data
    runner.decode_step    ->  one token for every decoding slot       one jit call
    runner.prefill_chunk  ->  each planned chunk, in plan order       one jit call each
    sampling, stop checks ->  finished requests leave their slots

Later rooms plug in here: the store's lookup before a request is scheduled, loaders staging stored
chunks that the engine inserts between steps, and the saver taking each finished chunk's pre-RoPE
K and V.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kvjax._typing import RequestId
from kvjax.engine import sampling
from kvjax.engine.kv_store_client import KVStoreClient, PrefixLoad, SaveJob
from kvjax.models.runner import ModelRunner
from kvjax.scheduler.request import Request, SamplingParams
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig


class TokenizerLike(Protocol):
  eos_id: int | None

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclasses.dataclass
class RequestMetrics:
  """Per-request timing and token accounting.

  Attributes:
    arrival_s: when the engine accepted the request (engine clock, seconds).
    first_token_s: when the first output token was sampled.
    finished_s: when the request finished.
    ttft_s: time to first token, seconds.
    num_computed_tokens: prompt tokens whose KV was computed by prefill.
    num_loaded_tokens: prompt tokens whose KV was loaded from the store.
    num_rejected_chunks: stored chunks that failed verification and were computed instead.
    loaded_from_tiers: tier of each loaded chunk, in order.
  """

  arrival_s: float
  first_token_s: float | None = None
  finished_s: float | None = None
  ttft_s: float | None = None
  num_computed_tokens: int = 0
  num_loaded_tokens: int = 0
  num_rejected_chunks: int = 0
  loaded_from_tiers: list[str] = dataclasses.field(default_factory=list)


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

  @property
  def outputs(self) -> list[CompletionOutput]:
    """vLLM-style view: one `CompletionOutput`."""
    return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]


@dataclasses.dataclass
class _Tracked:
  request: Request
  prompt: str | None
  rng: np.random.Generator
  metrics: RequestMetrics
  logprobs: list[dict[int, float]] | None
  text: str = ""
  cache_salt: str | None = None
  staged: list[np.ndarray] = dataclasses.field(default_factory=list)
  pieces: list[tuple[int, Any, Any]] = dataclasses.field(default_factory=list)
  prefix: PrefixLoad | None = None


class Engine:
  """Serves many requests over fixed decode slots, one planned step at a time.

  Args:
    runner: the model runner (owns the device KV cache).
    tokenizer: used for EOS and stop strings; may be None for token-id-only use.
    scheduler_config: slots, token budget and chunk sizes; the slots and chunk sizes must match
      the runner's.
    seed: seeds requests that give no seed of their own.
    clock: seconds, monotonic (tests may pass a fake).
    kv_store: the prefix-cache store client, or None for no store.
  """

  def __init__(self, runner: ModelRunner, tokenizer: TokenizerLike | None,
               scheduler_config: SchedulerConfig | None = None, *, seed: int = 0,
               clock: Callable[[], float] = time.perf_counter,
               kv_store: KVStoreClient | None = None):
    self.runner = runner
    self.kv_store = kv_store
    self.tokenizer = tokenizer
    scheduler_config = scheduler_config or SchedulerConfig(
        num_slots=runner.config.num_slots, chunk_sizes=runner.chunk_sizes,
        token_budget=runner.max_chunk_size)
    if scheduler_config.num_slots != runner.config.num_slots or (
        scheduler_config.chunk_sizes != runner.chunk_sizes):
      raise ValueError("scheduler slots and chunk sizes must equal the runner's: "
                       f"{scheduler_config} vs {runner.config}")
    self.scheduler = Scheduler(scheduler_config)
    self._rng = np.random.default_rng(seed)
    self._clock = clock
    self._tracked: dict[RequestId, _Tracked] = {}
    self._ids = itertools.count()

  # ----------------------------------------------------------------------------- requests
  @property
  def max_seq_len(self) -> int:
    return self.runner.max_seq_len

  def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """Checks a request before it is queued; returns the prompt as a list of ints.

    Raises:
      ValueError: empty prompt, token ids outside the vocabulary, or prompt plus `max_tokens`
        beyond the context length.
    """
    ids = [int(t) for t in prompt_token_ids]
    if not ids:
      raise ValueError("the prompt is empty: give at least one token")
    vocab = self.runner.model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) + params.max_tokens > self.max_seq_len:
      raise ValueError(
          f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds the context "
          f"length of {self.max_seq_len} tokens; shorten the prompt or lower max_tokens")
    return ids

  def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                  prompt: str | None = None, request_id: str | None = None,
                  cache_salt: str | None = None) -> RequestId:
    """Validates and queues a request; returns its id.

    With a store, the prompt's stored prefix is fetched and verified here (plain prefix loading);
    its chunks are inserted when the request gets a slot. `cache_salt` isolates tenants: prompts
    share stored KV only under equal salts.

    Raises:
      ValueError: as `validate`, or a `cache_salt` that is not a string.
    """
    if cache_salt is not None and not isinstance(cache_salt, str):
      raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    ids = self.validate(prompt_token_ids, params)
    rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
    if rid in self._tracked:
      raise ValueError(f"request id {rid!r} is already in use")
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
    request = Request(rid, ids, params, arrival_s=self._clock())
    tracked = _Tracked(
        request=request, prompt=prompt, rng=np.random.default_rng(seed),
        metrics=RequestMetrics(arrival_s=request.arrival_s),
        logprobs=[] if params.logprobs is not None else None, cache_salt=cache_salt)
    if self.kv_store is not None:
      prefix = self.kv_store.load_prefix(ids, cache_salt)
      tracked.prefix, tracked.staged = prefix, prefix.chunks
      request.num_cached_tokens = len(prefix.chunks) * self.kv_store.chunk_size
      tracked.metrics.num_loaded_tokens = request.num_cached_tokens
      tracked.metrics.num_rejected_chunks = len(prefix.rejected)
      tracked.metrics.loaded_from_tiers = list(prefix.tiers)
    self.scheduler.add_request(request)
    self._tracked[rid] = tracked
    return rid

  def abort_request(self, request_id: RequestId) -> None:
    if self.scheduler.finish_request(request_id, "abort") is not None:
      self._tracked.pop(request_id, None)

  def has_unfinished_requests(self) -> bool:
    return self.scheduler.has_unfinished()

  # ----------------------------------------------------------------------------- stepping
  def step(self) -> list[RequestOutput]:
    """Runs one planned step; returns outputs of requests that produced a token this step."""
    plan = self.scheduler.schedule()
    emitted: list[RequestOutput] = []
    for load in plan.loads:
      tracked = self._tracked[load.request_id]
      c = self.kv_store.chunk_size
      for i, kv in enumerate(tracked.staged):
        self.runner.insert_chunk(kv, load.slot, i * c)
      tracked.staged = []
    if plan.decodes:
      b = self.runner.config.num_slots
      tokens, positions, active = np.zeros(b, np.int32), np.zeros(b, np.int32), np.zeros(b, bool)
      for d in plan.decodes:
        tokens[d.slot], positions[d.slot], active[d.slot] = d.token_id, d.position, True
      logits_BV = np.asarray(self.runner.decode_step(tokens, positions, active))
      for d in plan.decodes:
        emitted.append(self._emit(d.request_id, logits_BV[d.slot]))
    for chunk in plan.prefills:
      tracked = self._tracked[chunk.request_id]
      ids = tracked.request.prompt_token_ids[chunk.start:chunk.start + chunk.num_tokens]
      out = self.runner.prefill_chunk(ids, chunk.slot, chunk.start)
      tracked.metrics.num_computed_tokens += chunk.num_tokens
      if self.kv_store is not None:
        tracked.pieces.append((chunk.start, out.k_pre_rope_LTKH, out.v_LTKH))
      if chunk.is_last:
        self._save_prompt(tracked)
        emitted.append(self._emit(chunk.request_id, np.asarray(out.logits)))
    return emitted

  def _save_prompt(self, tracked: _Tracked) -> None:
    """Hands the prompt's computed full chunks to the saver (off the TTFT path)."""
    if self.kv_store is None or tracked.prefix is None:
      return
    prefix = tracked.prefix
    self.kv_store.submit_save(SaveJob(
        namespace=self.kv_store.namespace(tracked.cache_salt).root_hash(),
        hashes=prefix.hashes, token_ids=tracked.request.prompt_token_ids,
        first_chunk=len(prefix.chunks), replace={i for i, _ in prefix.rejected},
        pieces=tracked.pieces))
    tracked.pieces = []

  def _emit(self, rid: RequestId, logits_V: np.ndarray) -> RequestOutput:
    tracked = self._tracked[rid]
    r, params = tracked.request, tracked.request.sampling_params
    token = sampling.sample_token(logits_V, params, tracked.rng)
    r.output_token_ids.append(token)
    now = self._clock()
    if tracked.metrics.first_token_s is None:
      tracked.metrics.first_token_s = now
      tracked.metrics.ttft_s = now - tracked.metrics.arrival_s
    if tracked.logprobs is not None:
      tracked.logprobs.append(sampling.top_logprobs(logits_V, params.logprobs, token))
    reason = self._finish_reason(tracked)
    if reason is not None:
      self.scheduler.finish_request(rid, reason)
      tracked.metrics.finished_s = now
      del self._tracked[rid]
    return self._output(tracked, reason)

  def _finish_reason(self, tracked: _Tracked) -> str | None:
    r, params = tracked.request, tracked.request.sampling_params
    token = r.output_token_ids[-1]
    eos = getattr(self.tokenizer, "eos_id", None)
    if token in params.stop_token_ids or (token == eos and not params.ignore_eos):
      self._set_text(tracked)
      return "stop"
    if params.stop and self.tokenizer is not None:
      text = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
      hits = [text.find(s) for s in params.stop if s in text]
      if hits:
        tracked.text = text[:min(hits)]
        return "stop"
    if len(r.output_token_ids) >= params.max_tokens or r.num_tokens >= self.max_seq_len:
      self._set_text(tracked)
      return "length"
    return None

  def _set_text(self, tracked: _Tracked) -> None:
    if self.tokenizer is not None:
      tracked.text = self.tokenizer.decode(tracked.request.output_token_ids,
                                           skip_special_tokens=True)

  def _output(self, tracked: _Tracked, reason: str | None) -> RequestOutput:
    r = tracked.request
    return RequestOutput(
        request_id=r.request_id, prompt=tracked.prompt, prompt_token_ids=r.prompt_token_ids,
        text=tracked.text, token_ids=list(r.output_token_ids), finish_reason=reason,
        logprobs=list(tracked.logprobs) if tracked.logprobs is not None else None,
        num_cached_tokens=tracked.metrics.num_loaded_tokens, metrics=tracked.metrics,
        finished=reason is not None)
