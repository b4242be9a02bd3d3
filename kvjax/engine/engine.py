"""The engine: runs the scheduler's plans on the model runner and turns logits into tokens.

Architecture. One engine thread owns the device (the model state and the KV cache); nothing else
touches the cache. Each `step()`:

    landed loads          ->  CakeMerge.load_done: insert (kv_decode), drop wasted, note rejected
    new loads             ->  CakeMerge.next_load, last chunk first, to the background loaders
    scheduler.schedule()  ->  SchedulerOutput(decodes, prefills)     plain data
    runner.decode_step    ->  one token for every decoding slot       one jit call
    runner.prefill_chunk  ->  each planned chunk, in plan order       one jit call each
    sampling, stop checks ->  finished requests leave their slots; their new chunks go to the saver

Prefix caching is bidirectional (Cake, arXiv 2410.03065, Appendix A): `add_request` asks the
store which prefix chunks it holds (one batched lookup, no data); the request gets a `CakeMerge`.
Background loaders (`KVStoreClient.start_load`: tensorstore async reads on the store's event loop,
verification and host-side entropy decoding there) fetch stored chunks from the last to the first;
the scheduler gives the merge's compute side the token budget left after decodes and ordinary
prefills. Only this thread writes the cache: a landed chunk is inserted between steps, and the
merge guarantees no position is written twice. When a step has nothing to run but loads are in
flight, the engine blocks until one lands (no polling).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Protocol, Sequence

import logging

import numpy as np

from kvjax import codecs
from kvjax._typing import RequestId
from kvjax.engine import sampling
from kvjax.engine.kv_store_client import KVStoreClient, LoadResult, PrefixLookup, SaveJob
from kvjax.models.runner import ModelRunner
from kvjax.scheduler.cake import CakeMerge, ChunkState, LoadVerdict, MergeMode, MergeTrace
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.request import Request, SamplingParams
from kvjax.scheduler.scheduler import Scheduler, SchedulerConfig
from kvjax.storage.chunk_store import choose_codec
from kvjax.storage.types import ChunkHit

_log = logging.getLogger(__name__)

#: Longest single wait for a load to land, seconds (the engine re-plans after it).
_MAX_LOAD_WAIT_S = 1.0

#: Accuracy order of the encodings this engine decodes (0 = exact): the registry's, from their
#: measured errors (`kvjax.codecs.ACCURACY_RANK`). The level policy loads the most accurate
#: encoding that lands in time (CacheGen, arXiv 2310.07240, section 5.3).
QUALITY_RANK = codecs.ACCURACY_RANK


def _encoding_name(codec: str, level: int) -> str:
  """The display form ("cachegen/2") of an encoding, as the merge trace records it."""
  return str(codecs.EncodingId(codec, level))


def _candidates(record, raw_nbytes: int) -> list[Candidate]:
  """The encodings of a stored chunk this engine can decode, as level-policy candidates.

  A chunk whose tier lists no record (a tier without `peek`) is taken as raw. Each candidate's
  name is its `codecs.EncodingId`.
  """
  if record is None:
    raw = codecs.EncodingId(codecs.RAW, 0)
    return [Candidate(raw, raw_nbytes, QUALITY_RANK[raw])]
  out = []
  for e in record.encodings:
    if codecs.is_decodable(e.codec, e.codec_version, e.level):
      eid = codecs.EncodingId(e.codec, e.level)
      out.append(Candidate(eid, int(e.nbytes), QUALITY_RANK[eid]))
  return out


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
    num_wasted_chunks: loads that landed after compute had taken their chunk (dropped).
    loaded_from_tiers: tier of each loaded chunk, in order.
    merge: the Cake merge trace (chunks computed, loaded and wasted, meeting index, level of each
      loaded chunk, seconds per side), or None when nothing was stored.
  """

  arrival_s: float
  first_token_s: float | None = None
  finished_s: float | None = None
  ttft_s: float | None = None
  num_computed_tokens: int = 0
  num_loaded_tokens: int = 0
  num_rejected_chunks: int = 0
  num_wasted_chunks: int = 0
  loaded_from_tiers: list[str] = dataclasses.field(default_factory=list)
  merge: MergeTrace | None = None


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
  pieces: list[tuple[int, Any, Any]] = dataclasses.field(default_factory=list)
  lookup: PrefixLookup | None = None
  rejected: set[int] = dataclasses.field(default_factory=set)
  staged: list[LoadResult] = dataclasses.field(default_factory=list)  # landed before a slot


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
    merge_mode: how a stored prefix becomes resident: "cake" (compute from the front, load from
      the back), "compute_only" (ignore the store's hits; still save) or "load_only" (wait for
      every stored chunk, then compute the rest): the two baselines share the machinery.
    max_loads_in_flight: background chunk loads per request at once.
    kv_ttft_target_s: pick each loaded chunk's encoding level for this TTFT target (seconds)
      instead of for the time compute would finish that chunk.
    check_writes: keep a per-position writer map per request and raise if a position of the KV
      cache would be written twice (debug; tests keep it on).

  Raises:
    ValueError: unknown merge mode, or a scheduler config that does not match the runner.
  """

  def __init__(self, runner: ModelRunner, tokenizer: TokenizerLike | None,
               scheduler_config: SchedulerConfig | None = None, *, seed: int = 0,
               clock: Callable[[], float] = time.perf_counter,
               kv_store: KVStoreClient | None = None, merge_mode: str = "cake",
               max_loads_in_flight: int = 2, kv_ttft_target_s: float | None = None,
               check_writes: bool = False):
    try:
      self.merge_mode = MergeMode(merge_mode)
    except ValueError:
      raise ValueError(f"merge_mode={merge_mode!r}; use one of "
                       f"{[m.value for m in MergeMode]}") from None
    self.max_loads_in_flight = max_loads_in_flight
    self.kv_ttft_target_s = kv_ttft_target_s
    self.check_writes = check_writes
    self.cost_model = CostModel()
    self._last_landing_s = 0.0
    self._timed_sizes: set[int] = set()  # chunk sizes run once (the first run compiles)
    #: Stored bytes of landed chunks held for requests that have no slot yet.
    self.staged_bytes = 0
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
    self.scheduler = Scheduler(scheduler_config, self.cost_model)
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

    With a store, one batched lookup finds which prefix chunks are stored (no data is read
    here); the request then gets a `CakeMerge` and its chunks load in the background once it holds
    a slot. `cache_salt` isolates tenants: prompts share stored KV only under equal salts.

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
      lookup = tracked.lookup = self.kv_store.lookup(ids, cache_salt)
      hits, encodings = lookup.hits, None
      if lookup.records:  # choose levels per chunk from the stored encodings
        raw_nbytes = self.kv_store.layout.nbytes
        encodings = [_candidates(r, raw_nbytes) if h else None
                     for h, r in zip(hits, lookup.records)]
        hits = [bool(e) for e in encodings]  # nothing decodable: compute it
        encodings = [e or None for e in encodings]
      if any(hits):
        request.merge = CakeMerge(
            len(ids), self.kv_store.chunk_size, hits, self.merge_mode,
            chunk_nbytes=None if encodings is not None else self.kv_store.layout.nbytes,
            encodings=encodings, max_loads_in_flight=self.max_loads_in_flight,
            kv_ttft_target_s=self.kv_ttft_target_s, arrival_s=request.arrival_s,
            check_writes=self.check_writes)
        tracked.metrics.merge = request.merge.trace
    self.scheduler.add_request(request)
    self._tracked[rid] = tracked
    return rid

  def abort_request(self, request_id: RequestId) -> None:
    """Ends a request wherever it is (queued, prefilling, decoding); its loads are cancelled and
    their staging released. Unknown ids are ignored."""
    if self.scheduler.finish_request(request_id, "abort") is not None:
      tracked = self._tracked.pop(request_id, None)
      if tracked is not None:
        self.staged_bytes -= sum(r.nbytes for r in tracked.staged)
      if self.kv_store is not None:
        self.kv_store.cancel_loads(request_id)

  def has_unfinished_requests(self) -> bool:
    return self.scheduler.has_unfinished()

  # ----------------------------------------------------------------------------- stepping
  def step(self) -> list[RequestOutput]:
    """Runs one planned step; returns outputs of requests that produced a token this step.

    Lands finished loads (inserting their chunks), issues new ones, then runs the plan. A step
    with nothing to compute while loads are in flight blocks until one lands.
    """
    if self.kv_store is not None:
      self._take_loads(self.kv_store.landed())
      self._issue_loads()
    plan = self.scheduler.schedule(now_s=self._clock())
    self._insert_staged()
    if plan.is_empty:
      self._wait_for_loads()
      return []
    emitted: list[RequestOutput] = []
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
      t0 = time.perf_counter()
      out = self.runner.prefill_chunk(ids, chunk.slot, chunk.start)
      out.logits.block_until_ready()  # the cost model needs this chunk's own time
      size = self.runner.bucket_for(chunk.num_tokens)
      if size in self._timed_sizes:  # a size's first run includes its compile
        self.cost_model.observe_compute(chunk.start, chunk.num_tokens, time.perf_counter() - t0)
      self._timed_sizes.add(size)
      tracked.metrics.num_computed_tokens += chunk.num_tokens
      if self.kv_store is not None:
        tracked.pieces.append((chunk.start, out.k_pre_rope_LTKH, out.v_LTKH))
      if chunk.is_last:
        self._save_prompt(tracked)
        emitted.append(self._emit(chunk.request_id, np.asarray(out.logits)))
    return emitted

  # ----------------------------------------------------------------------------- loads
  def _issue_loads(self) -> None:
    """Asks each Cake merge for loads (last chunk first) and starts them.

    Loads start at arrival, before the request holds a slot: chunks that land before it has one
    are staged on the host (`staged_bytes`) and inserted when it is admitted.
    """
    for r in self.scheduler.cake_requests(include_waiting=True):
      tracked = self._tracked[r.request_id]
      while (index := r.merge.next_load(self._clock(), self.cost_model)) is not None:
        chosen = r.merge.load_encoding(index)
        choose = None
        if chosen is not None:  # the level policy's pick, named by its EncodingId
          choose = choose_codec(chosen.name.codec, chosen.name.level)
        self.kv_store.start_load(r.request_id, index, tracked.lookup, r.prompt_token_ids,
                                 choose=choose)

  def _take_loads(self, results: list[LoadResult]) -> None:
    """Hands landed loads to their merges; inserts the chunks the merges accept."""
    for res in results:
      tracked = self._tracked.get(res.request_id)
      merge = tracked.request.merge if tracked is not None else None
      if merge is None:
        continue  # the request ended meanwhile: the load is dropped
      ok = isinstance(res.result, ChunkHit)
      if ok:
        # The link's time for this chunk: since it started, or since the previous landing if
        # that was later (concurrent reads share the link).
        busy = res.done_s - max(res.started_s, self._last_landing_s)
        self._last_landing_s = max(self._last_landing_s, res.done_s)
        if busy > 0:
          self.cost_model.observe_load(res.nbytes, busy)
      verdict = merge.load_done(res.index, ok, res.nbytes, self._clock(),
                                level=self._level_name(res))
      m = tracked.metrics
      if verdict is LoadVerdict.INSERT:
        if tracked.request.slot is None:
          tracked.staged.append(res)
          self.staged_bytes += res.nbytes
        else:
          self._insert_landed(tracked, res)
      elif verdict is LoadVerdict.REJECTED:
        m.num_rejected_chunks += 1
        tracked.rejected.add(res.index)
        _log.warning("stored chunk %d of %s rejected: %s %s", res.index, res.request_id,
                     res.result.reason.value, res.result.detail)
      else:
        m.num_wasted_chunks += 1

  def _insert_landed(self, tracked: _Tracked, res: LoadResult) -> None:
    c = self.kv_store.chunk_size
    self._insert(res, tracked.request.slot, res.index * c)
    tracked.request.merge.inserted(res.index)
    tracked.metrics.num_loaded_tokens += c
    tracked.metrics.loaded_from_tiers.append(res.result.tier)

  def _insert_staged(self) -> None:
    """Inserts chunks that landed before their request was admitted (it now holds a slot)."""
    if not self.staged_bytes:
      return
    for tracked in self._tracked.values():
      if tracked.staged and tracked.request.slot is not None:
        for res in tracked.staged:
          self._insert_landed(tracked, res)
          self.staged_bytes -= res.nbytes
        tracked.staged = []

  def _level_name(self, res: LoadResult) -> str | None:
    if not isinstance(res.result, ChunkHit):
      return None
    return _encoding_name(res.result.encoding.codec, res.result.encoding.level)

  def _insert(self, res: LoadResult, slot: int, start: int) -> None:
    """Decodes a landed chunk into the slot at `[start, start + C)` (RoPE applied to K there)."""
    hit = res.result
    if hit.kv is not None:
      self.runner.insert_chunk(hit.kv, slot, start)
    else:
      self.runner.insert_payload(hit.encoding.codec, hit.payload, slot, start)

  def _wait_for_loads(self) -> None:
    """Blocks until a load lands (or a merge's recheck time comes), then hands it over."""
    if self.kv_store is None or not self.kv_store.loads_in_flight():
      return
    now = self._clock()
    wait = _MAX_LOAD_WAIT_S
    for r in self.scheduler.cake_requests():
      t = r.merge.recheck_s(now, self.cost_model)
      if t is not None:
        wait = min(wait, max(0.0, t - now))
    self._take_loads(self.kv_store.landed(wait_s=wait))

  # ----------------------------------------------------------------------------- saves
  def _save_prompt(self, tracked: _Tracked) -> None:
    """Hands the prompt's computed full chunks to the saver (off the TTFT path)."""
    if self.kv_store is None or tracked.lookup is None:
      return
    lookup, merge = tracked.lookup, tracked.request.merge
    resident = set() if merge is None else {
        i for i, st in enumerate(merge.states) if st is ChunkState.RESIDENT}
    self.kv_store.submit_save(SaveJob(
        namespace=lookup.namespace, hashes=lookup.hashes,
        token_ids=tracked.request.prompt_token_ids,
        chunks=[i for i in range(len(lookup.hashes)) if i not in resident],
        replace=set(tracked.rejected), pieces=tracked.pieces))
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
      if self.kv_store is not None:
        self.kv_store.cancel_loads(rid)  # late loads of chunks compute took
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
