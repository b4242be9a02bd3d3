"""The engine: the executor of the scheduler's plans, and the offline request registry.

Ownership. The scheduler (`kvjax.scheduler.scheduler.Scheduler`) owns every request's state and
plans everything, loads included; this engine executes and reports back, one plain record each
way per step (`kvjax.engine.core.EngineCore`):

    schedule(now)  ──> SchedulerOutput   finished ids, releases, loads, inserts, decodes, prefills
    execute(plan)      drop finished requests' loads and staging; release unwanted loads;
                       queue new loads on the store client (they refill as they land);
                       insert staged chunks (jit'd kv_decode, RoPE at their positions);
                       run the decode step, then each prefill chunk (timed); sample tokens;
                       hand each completed chunk's KV to the saver at once
    update(result) <── StepResult        tokens, finishes, load reports, measured seconds

The engine owns the device (model state, KV cache), the store client (its load queue, staged
payloads and saver), and per request only what executing and answering need: the sampling
generator, the prompt text, log-probs, detokenized text, metrics and the KV pieces of a chunk
still being computed. When a plan has nothing to compute but loads are outstanding, the engine
blocks until one lands (no polling), at most the plan's `wait_s`.

Prefix caching is bidirectional (Cake, arXiv 2410.03065, Appendix A): `add_request` asks the
store which prefix chunks it holds (one batched lookup, no data) and gives the scheduler the
answer as plain data; the scheduler's merge plans loads from the last chunk and compute from the
first. Only this thread writes the cache, and the merge guarantees no position is written twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from typing import Any, Callable, Protocol, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import codecs
from kvjax._typing import RequestId
from kvjax.engine import sampling
from kvjax.engine.core import EngineCore, LoopStats, StepRecord
from kvjax.connector import (KVStoreClient, LoaderStats, PrefetchStats, SaveJob, SaverStats,
                             TierSnapshot)
from kvjax.models.paged_runner import PagedModelRunner
from kvjax.models.runner_api import SeqChunk
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.kv_cache_manager import KVCacheEvents, KVCacheManager, KVCacheStats
from kvjax.scheduler.level_policy import Candidate
from kvjax.scheduler.output import (ComputeTiming, InsertItem, InsertTiming, SaveItem,
                                    SchedulerOutput, StepResult, StoredChunk, StoredPrefix)
from kvjax.scheduler.request import Request, SamplingParams
from kvjax.scheduler.scheduler import LoadConfig, Scheduler, SchedulerConfig
from kvjax.sessions import REROTATED_SALT_PREFIX
from kvjax.storage import keys
from kvjax.storage.chunk_store import choose_codec

_log = logging.getLogger(__name__)

def _candidates(record, raw_nbytes: int) -> list[Candidate]:
  """The encodings of a stored chunk this engine can decode, as level-policy candidates.

  A chunk whose tier lists no record (a tier without `peek`) is taken as raw. Each candidate's
  name is its `codecs.EncodingId`.
  """
  if record is None:
    raw = codecs.EncodingId(codecs.RAW, 0)
    return [Candidate(raw, raw_nbytes, codecs.ACCURACY_RANK[raw])]
  out = []
  for e in record.encodings:
    if codecs.is_decodable(e.codec, e.codec_version, e.level):
      eid = codecs.EncodingId(e.codec, e.level)
      out.append(Candidate(eid, int(e.nbytes), codecs.ACCURACY_RANK[eid]))
  return out


def _first_rows(kv_L2CKH, rows: int):
  """A staged chunk's first `rows` positions (a stored tail's, `Engine._insert_rows`); the
  chunk itself when that is all of it."""
  return kv_L2CKH if rows == kv_L2CKH.shape[2] else kv_L2CKH[:, :, :rows]


class TokenizerLike(Protocol):
  eos_id: int | None

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


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


def device_namespace_root(cache_salt: str | None) -> str:
  """Root of device block hashes when there is no store: one engine holds one model, so only
  the salt must separate tenants (with a store, its chunk-key namespace is used instead)."""
  return hashlib.sha256(b"kvjax/device-prefix/v1\0" + repr(cache_salt).encode()).hexdigest()


@dataclasses.dataclass
class _Live:
  """What the engine keeps per request: only what executing and answering need."""

  request_id: RequestId
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  rng: np.random.Generator
  metrics: RequestMetrics
  logprobs: list[dict[int, float]] | None
  token_ids: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  pieces: list[tuple[int, Any, Any]] = dataclasses.field(default_factory=list)
  save_tail: bool = False  # a session turn: store its tail when it finishes (`_save_tail`)


class Engine:
  """Executes the scheduler's plans on the model runner and the store client.

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
    max_loads_in_flight: loads issued ahead per request (and its reads at once); None (default)
      derives them from the link's bandwidth-delay product (`kvjax.scheduler.scheduler`).
    kv_ttft_target_s: pick each loaded chunk's encoding level for this TTFT target (seconds)
      instead of for the time compute would finish that chunk.
    check_writes: keep a per-position writer map per request and raise if a position of the KV
      cache would be written twice (debug; tests keep it on).
    link_latency_s: the store link's latency prior, seconds (file: 1 ms; S3: tens of ms).
    consistent: with a lossy codec, make every output independent of which chunks were loaded
      (issue: identical requests must get identical answers): each request reads only the first
      stored level, and computed chunks pass through that same encode/decode, in steps of one
      store chunk (`Scheduler(consistent=True)`).
    enable_prefix_caching: keep finished requests' full blocks on the device and
      share them with later requests of the same prefix (namespace and `cache_salt`).
    layerwise_groups: layer-wise pre-loading (`LoadConfig.layerwise_groups`;
      capped at the model's layers); 1 (default) inserts stored chunks whole before the step.
    lookahead_window: with a store, waiting requests whose stored chunks are kept from
      eviction and prefetched toward the host tier (`LoadConfig.lookahead_window`; CachedAttention
      arXiv 2403.19708, section 3.3); 0: off (plain LRU, no prefetch).

  The KV cache is the runner's block pool (`docs/design/paged-memory.md`): the scheduler owns
  a `KVCacheManager` over it and each step is one ragged jit call.

  Raises:
    ValueError: unknown merge mode, or a scheduler config that does not match the runner.
  """

  def __init__(self, runner: PagedModelRunner, tokenizer: TokenizerLike | None,
               scheduler_config: SchedulerConfig | None = None, *, seed: int = 0,
               clock: Callable[[], float] = time.perf_counter,
               kv_store: KVStoreClient | None = None, merge_mode: str = "cake",
               max_loads_in_flight: int | None = None, kv_ttft_target_s: float | None = None,
               check_writes: bool = False, link_latency_s: float = 1e-3,
               consistent: bool = False, enable_prefix_caching: bool = True,
               layerwise_groups: int = 1, lookahead_window: int = 0):
    load_config = LoadConfig(merge_mode=merge_mode, max_loads_in_flight=max_loads_in_flight,
                             lookahead_window=lookahead_window if kv_store is not None else 0,
                             link_latency_s=link_latency_s, kv_ttft_target_s=kv_ttft_target_s,
                             check_writes=check_writes,
                             layerwise_groups=min(layerwise_groups, runner.model_config.n_layers),
                             staging_bytes=kv_store.staging_bytes if kv_store else 1 << 30)
    self.runner = runner
    self.kv_store = kv_store
    self.tokenizer = tokenizer
    scheduler_config = scheduler_config or SchedulerConfig(
        num_slots=runner.config.num_slots, chunk_sizes=runner.chunk_sizes,
        token_budget=runner.config.max_num_batched_tokens)
    if scheduler_config.num_slots != runner.config.num_slots or (
        scheduler_config.chunk_sizes != runner.chunk_sizes) or (
        scheduler_config.token_budget > runner.config.max_num_batched_tokens):
      raise ValueError("scheduler slots and chunk sizes must match the runner's, and its token "
                       f"budget fit it: {scheduler_config} vs {runner.config}")
    consistent = consistent and kv_store is not None and kv_store.codec != codecs.RAW
    self._fixed_encoding = (codecs.EncodingId(kv_store.codec, kv_store.codec_levels[0])
                            if consistent else None)
    if consistent and kv_store.key_encoding != str(self._fixed_encoding):
      raise ValueError(f"a consistent engine ({self._fixed_encoding}) needs a store client "
                       "keyed by that encoding: KVStoreClient(consistent=True)")
    kv_cache = KVCacheManager(runner.num_blocks, runner.block_size,
                              namespace_root=self._namespace_root(None),
                              enable_prefix_caching=enable_prefix_caching)
    self._scheduler = Scheduler(
        scheduler_config, CostModel(), load_config=load_config,
        save_chunk_size=kv_store.chunk_size if kv_store is not None else None,
        consistent=consistent, kv_cache=kv_cache)
    self._core = EngineCore(self._scheduler, self)
    self._rng = np.random.default_rng(seed)
    self._clock = clock
    self._live: dict[RequestId, _Live] = {}
    self._ids = itertools.count()
    self._emitted: list[RequestOutput] = []
    #: Block on the cache after each insert so `StepResult.inserts` times the device work
    #: (benchmarks; the next prefill waits for it anyway).
    self.timed_inserts = False
    #: A list to record layer-wise steps' order of inserts and layer groups in (tests), or None.
    self.layerwise_trace: list | None = None
    self._window_ids: tuple[RequestId, ...] = ()  # the look-ahead window last handed over

  # ----------------------------------------------------------------------------- requests
  @property
  def max_seq_len(self) -> int:
    return self.runner.max_seq_len

  def _namespace_root(self, cache_salt: str | None) -> str:
    if self.kv_store is not None:
      return self.kv_store.namespace(cache_salt).root_hash()
    return device_namespace_root(cache_salt)

  def reset_prefix_cache(self) -> int:
    """Empties the device prefix cache: no block computed before is a hit again. Returns
    blocks unindexed."""
    return self._scheduler.reset_prefix_cache()

  def set_kv_events(self, on: bool) -> None:
    """Records the device prefix cache's index changes for `drain_kv_events` (off by
    default, so nothing accumulates)."""
    self._scheduler.kv_cache.set_record_events(on)

  def drain_kv_events(self) -> KVCacheEvents:
    """The device prefix cache's index changes since the last drain (blocks stored, evicted,
    all cleared; see `KVCacheEvents`)."""
    return self._scheduler.kv_cache.drain_events()

  def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """Checks a request before it is queued; returns the prompt as a list of ints, cut to
    its last `params.truncate_prompt_tokens` tokens when that is set.

    Raises:
      ValueError: empty prompt, token ids outside the vocabulary, or prompt plus `max_tokens`
        beyond the context length.
    """
    ids = [int(t) for t in prompt_token_ids]
    if not ids:
      raise ValueError("the prompt is empty: give at least one token")
    if params.truncate_prompt_tokens is not None:
      ids = ids[-params.truncate_prompt_tokens:]
    vocab = self.runner.model_config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) + params.max_tokens > self.max_seq_len:
      raise ValueError(
          f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds the context "
          f"length of {self.max_seq_len} tokens; shorten the prompt or lower max_tokens")
    self._scheduler.check_fits(len(ids) + params.max_tokens)
    return ids

  def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                  prompt: str | None = None, request_id: str | None = None,
                  cache_salt: str | None = None, merge_mode: str | None = None,
                  history_tokens: int = 0, save_tail: bool = False) -> RequestId:
    """Validates and queues a request; returns its id.

    With a store, one batched lookup finds which prefix chunks are stored (no data is read
    here); the scheduler gets the answer as plain data and plans the merge. `cache_salt`
    isolates tenants: prompts share stored KV only under equal salts. `merge_mode` ("cake",
    "load_only", "compute_only") overrides the engine's for this request (benchmarks compare the
    modes on one warm engine). A request under a re-rotated session namespace
    (`kvjax.sessions.REROTATED_SALT_PREFIX`) runs "load_only" unless told otherwise: its stored
    KV is not what compute would give, so a Cake merge, whose meeting point depends on timing, would
    make the answer depend on it; load-only computes exactly the holes (the boundary chunks,
    `kvjax.engine.rerotation.stage_rerotated`) and the suffix.

    Session turns (a raw store: `KVStoreClient.stores_tails`): `save_tail` stores
    the request's tail when it finishes cleanly (its tokens after the last full chunk of its
    prompt and output but the last sampled token, `keys.tail_hash`), and `history_tokens` h
    (the prompt's first h tokens are such a finished turn's) looks that tail up too, so the
    next turn loads every historical token's KV even after the device evicted it
    (CachedAttention, arXiv 2403.19708, section 3.2.2).

    Raises:
      ValueError: as `validate`, a duplicate id, a `cache_salt` that is not a string, an
        unknown `merge_mode`, or a negative `history_tokens`.
    """
    if cache_salt is not None and not isinstance(cache_salt, str):
      raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if merge_mode is not None and merge_mode not in ("cake", "load_only", "compute_only"):
      raise ValueError(f"merge_mode={merge_mode!r}; use 'cake', 'load_only' or 'compute_only'")
    if isinstance(history_tokens, bool) or not isinstance(history_tokens, int) or (
        history_tokens < 0):
      raise ValueError(f"history_tokens={history_tokens!r} must be an int >= 0")
    if merge_mode is None and cache_salt is not None and cache_salt.startswith(
        REROTATED_SALT_PREFIX):
      merge_mode = "load_only"
    ids = self.validate(prompt_token_ids, params)
    rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
    if rid in self._live:
      raise ValueError(f"request id {rid!r} is already in use")
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
    arrival_s = self._clock()
    live = _Live(rid, prompt, ids, params, np.random.default_rng(seed),
                 RequestMetrics(arrival_s=arrival_s),
                 [] if params.logprobs is not None else None)
    stored = None
    if self.kv_store is not None:
      tails = self.kv_store.stores_tails
      live.save_tail = tails and save_tail
      t0 = time.perf_counter()
      lookup = self.kv_store.open_request(rid, ids, cache_salt,
                                          history_tokens=history_tokens if tails else 0)
      live.metrics.lookup_s = time.perf_counter() - t0
      raw_nbytes = self.kv_store.layout.nbytes
      chunks = []
      for tier, record in zip(lookup.present, lookup.records or [None] * len(lookup.present)):
        cands = _candidates(record, raw_nbytes) if tier is not None else []
        if self._fixed_encoding is not None:  # consistent: only the request's fixed encoding
          cands = [cand for cand in cands if cand.name == self._fixed_encoding]
        chunks.append(StoredChunk(tier, tuple(cands)) if cands else None)
      tail, tail_tokens = lookup.tail, 0
      if tail is not None:  # the merge's last unit: the chunks after it hold no hit
        cands = tuple(_candidates(tail.record, raw_nbytes))
        if cands:
          chunks = chunks[:tail.index] + [StoredChunk(tail.tier, cands)]
          tail_tokens = tail.num_tokens
      stored = StoredPrefix(self.kv_store.chunk_size, tuple(chunks), tail_tokens)
    try:
      self._scheduler.add_request(
          Request(rid, ids, params, arrival_s=arrival_s), stored, merge_mode=merge_mode,
          namespace_root=self._namespace_root(cache_salt))
    except BaseException:
      if self.kv_store is not None:
        self.kv_store.close_request(rid)
      raise
    self._live[rid] = live
    return rid

  def abort_request(self, request_id: RequestId) -> None:
    """Ends a request wherever it is (queued, prefilling, decoding); its loads are cancelled and
    their staging released. Unknown ids are ignored."""
    if self._scheduler.finish_request(request_id, "abort") is not None:
      self._forget(request_id)

  def has_unfinished_requests(self) -> bool:
    return self._scheduler.has_unfinished()

  def stats(self) -> EngineStats:
    """A snapshot of the engine's accounting (plain data)."""
    kv = self.kv_store
    kv_cache = self._scheduler.kv_cache.stats()
    reserved = self.runner.kv_cache_nbytes() if self.runner.cache_ok() else 0
    peak = (kv_cache.peak_used_blocks * self.runner.kv_block_nbytes()
            if reserved else reserved)
    return EngineStats(
        num_waiting=self._scheduler.num_waiting(), num_running=self._scheduler.num_running(),
        loop=dataclasses.replace(self._core.stats),
        loader=kv.loader_stats if kv is not None else None,
        saver=dataclasses.replace(kv.saver_stats) if kv is not None else None,
        lookup_failures=kv.lookup_failures if kv is not None else 0,
        link_bandwidth_bytes_per_s=self._scheduler.cost_model.bandwidth_bytes_per_s,
        kv_cache_ok=self.runner.cache_ok(),
        tiers=kv.tier_snapshots() if kv is not None else (),
        kv_cache=kv_cache, kv_cache_bytes=reserved, kv_cache_peak_used_bytes=peak,
        prefetch=kv.prefetch_stats if kv is not None else None)

  def reset_device(self) -> None:
    """Rebuilds the KV cache after a failed step consumed its buffers (requests are lost; the
    device prefix cache is emptied)."""
    self.runner.reset()
    self._scheduler.reset_prefix_cache()

  @property
  def check_writes(self) -> bool:
    """Whether new requests' merges keep a writer map (raising on a double write)."""
    return self._scheduler.load_config.check_writes

  @check_writes.setter
  def check_writes(self, on: bool) -> None:
    self._scheduler.set_check_writes(on)

  def add_step_observer(self, observe: Callable[[StepRecord], None]) -> None:
    """Calls `observe` with every step's `StepRecord` (plan, result, timing): plain data for
    benchmarks and traces."""
    self._core.observers.append(observe)

  # ----------------------------------------------------------------------------- stepping
  def step(self) -> list[RequestOutput]:
    """Runs one planned step; returns outputs of requests that produced a token this step."""
    self._emitted = []
    _, result, traces = self._core.step()
    for rid, trace in traces.items():
      live = self._live.get(rid)
      target = live.metrics if live is not None else None
      if target is None:
        target = next((o.metrics for o in self._emitted if o.request_id == rid), None)
      if target is not None:
        target.merge = trace
        target.num_rejected_chunks = len(trace.chunks_rejected)
        target.num_wasted_chunks = len(trace.chunks_wasted)
    return self._emitted

  def now_s(self) -> float:
    return self._clock()

  def execute(self, plan: SchedulerOutput) -> StepResult:
    """Runs one plan in field order (the `Executor` protocol) and reports what happened."""
    kv = self.kv_store
    insert_timings: list[InsertTiming] = []
    layered: list = []  # (InsertItem, ChunkHit, blocks) inserted layer-wise by the step
    for rid in plan.finished_request_ids:
      self._forget(rid)
    if plan.admitted:
      started_s = self._clock()
      for rid in plan.admitted:
        live = self._live.get(rid)
        if live is not None and live.metrics.scheduled_s is None:
          live.metrics.scheduled_s = started_s
    tables = dict(plan.block_tables)
    for rid in plan.preempted:
      live = self._live.get(rid)
      if live is not None:
        live.pieces = []
      if kv is not None:
        kv.cancel_loads(rid)
    for rid, tokens in plan.device_hits:
      if rid not in self._live:
        continue  # aborted since
      m = self._live[rid].metrics
      m.num_loaded_tokens += tokens
      m.num_device_cached_tokens += tokens
      m.loaded_from_tiers.append("device")
    if kv is not None:
      if plan.lookahead != self._window_ids:  # before the loads: a load may wait on a prefetch
        self._window_ids = plan.lookahead
        kv.set_lookahead(kv.lookahead_requests([rid for rid in plan.lookahead
                                                if rid in self._live]))
      for rid, index in plan.releases:
        kv.release(rid, index)
      for item in plan.loads:
        choose = None
        if item.encoding is not None:  # the level policy's pick, a `codecs.EncodingId`
          choose = choose_codec(item.encoding.codec, item.encoding.level)
        kv.start_request_load(item.request_id, item.index, choose=choose, nbytes=item.nbytes,
                              max_in_flight=item.max_in_flight)
      layerwise = plan.layer_groups > 1 and bool(plan.decodes or plan.prefills)
      for ins in plan.inserts:
        hit = kv.take(ins.request_id, ins.index)
        t0, t0_clock = time.perf_counter(), self._clock()
        rows = self._insert_rows(ins)
        where = self._chunk_blocks(tables[ins.request_id], ins.start, rows)
        if layerwise and hit.kv is not None:
          layered.append((ins, hit, where))  # inserted group by group inside the step
          continue
        kv.charge_device(hit.encoding.nbytes)  # the host -> device link, whole chunk
        if hit.kv is not None:
          self.runner.insert_chunk(_first_rows(hit.kv, rows), where, ins.start)
        elif ins.num_tokens is None:
          self.runner.insert_payload(hit.encoding.codec, hit.payload, where, ins.start)
        else:  # a stored tail is raw (`KVStoreClient.stores_tails`): never here
          raise ValueError(f"stored tail {ins.index} of {ins.request_id} is not raw")
        if self.timed_inserts:
          self.runner.block_until_ready()
        insert_timings.append(InsertTiming(ins.request_id, ins.index, t0_clock,
                                           time.perf_counter() - t0))
        self._record_loaded(ins, hit.tier)
    if not plan.decodes and not plan.prefills:  # nothing to compute: loads and inserts at most
      reports = []
      if kv is not None and (plan.wait_s or plan.inserts):
        reports = kv.landed(wait_s=plan.wait_s)
      return StepResult(now_s=self._clock(), loads=tuple(self._log_misses(reports)),
                        inserts=tuple(insert_timings))
    sampled: list[tuple[RequestId, int]] = []
    finished: list[tuple[RequestId, str]] = []
    timings: list[ComputeTiming] = []
    self._execute_ragged(plan, tables, sampled, finished, timings, layered, insert_timings)
    reports = kv.landed() if kv is not None else []
    return StepResult(now_s=self._clock(), sampled=tuple(sampled), finished=tuple(finished),
                      loads=tuple(self._log_misses(reports)), compute=tuple(timings),
                      inserts=tuple(insert_timings))

  def _insert_rows(self, ins: InsertItem) -> int:
    """Rows of a staged chunk an insert writes: the whole chunk, or a stored tail's m rows
    rounded up to whole blocks (the padding rows land in the request's own last block, past
    its tail, where compute writes next)."""
    c = self.kv_store.chunk_size
    if ins.num_tokens is None:
      return c
    b = self.runner.block_size
    return min(c, -(-ins.num_tokens // b) * b)

  def _chunk_blocks(self, table, start: int, n: int) -> tuple[int, ...]:
    """The blocks of a block table holding positions `[start, start + n)` (whole blocks)."""
    b = self.runner.block_size
    return tuple(table[start // b:(start + n) // b])

  def _execute_ragged(self, plan: SchedulerOutput, tables: dict, sampled: list, finished: list,
                      timings: list, layered: Sequence = (),
                      insert_timings: list | None = None) -> None:
    """Every decode and prefill chunk of the plan in ONE jit call
    (`PagedModelRunner.step`), then sampling, metrics and saves per chunk. Each prefill chunk's
    `ComputeTiming` gets the step's seconds pro rata to its tokens. With `layered` inserts
    (layer-wise pre-loading) the step runs as `plan.layer_groups` layer-group calls instead
    (`_step_layerwise`)."""
    runner, kv = self.runner, self.kv_store
    seqs = [SeqChunk((d.token_id,), d.position, tables[d.request_id]) for d in plan.decodes]
    seqs += [SeqChunk(c.token_ids, c.start, tables[c.request_id]) for c in plan.prefills]
    total = sum(len(s.token_ids) for s in seqs)
    compiled = runner.is_compiled(total)
    t0, t0_clock = time.perf_counter(), self._clock()
    if layered:
      out = self._step_layerwise(seqs, plan.layer_groups, layered, insert_timings)
    else:
      out = runner.step(seqs)
    logits_SV = np.asarray(out.logits_SV)  # waits for the device: the step's own time
    seconds = time.perf_counter() - t0
    for i, d in enumerate(plan.decodes):
      if kv is not None:  # every token's K before RoPE is kept until its chunk is complete
        o = out.offsets[i]
        self._save_chunks(self._live[d.request_id], d.position, d.saves, (),
                          out.k_pre_rope_LTKH[:, o:o + 1], out.v_LTKH[:, o:o + 1],
                          tables[d.request_id])
      self._sample(d.request_id, logits_SV[i], sampled, finished, tables[d.request_id])
    base = len(plan.decodes)
    for j, chunk in enumerate(plan.prefills):
      timings.append(ComputeTiming(chunk.start, chunk.num_tokens,
                                   seconds * chunk.num_tokens / total, chunk.request_id,
                                   t0_clock, includes_compile=not compiled))
      live = self._live[chunk.request_id]
      live.metrics.num_computed_tokens += chunk.num_tokens
      if kv is not None:
        o = out.offsets[base + j]
        self._save_chunks(live, chunk.start, chunk.saves, chunk.roundtrip,
                          out.k_pre_rope_LTKH[:, o:o + chunk.num_tokens],
                          out.v_LTKH[:, o:o + chunk.num_tokens], tables[chunk.request_id])
      if chunk.is_last:
        self._sample(chunk.request_id, logits_SV[base + j], sampled, finished,
                     tables[chunk.request_id])

  def _step_layerwise(self, seqs: Sequence[SeqChunk], groups: int, layered: Sequence,
                      insert_timings: list) -> Any:
    """Layer-wise pre-loading (CachedAttention, arXiv 2403.19708, section 3.2.1): the step's
    raw inserted chunks move host -> device layer group by layer group on the store client's
    transfer thread (each group charged to the emulated link) while the step runs: for each
    group g, wait for group g of every chunk, insert them (`insert_chunks_layers`: one call for
    the whole chunks, one per stored tail, whose rows differ), run layer group g
    (`PagedModelRunner.step_layers`). So the step's compute overlaps the transfer: about
    max(transfer, compute) instead of their sum. `layerwise_trace`, when a list, gets
    ("insert", request_id, chunk index, g) and ("layers", g) events in execution order."""
    runner, kv = self.runner, self.kv_store
    st = runner.step_begin(seqs, groups)
    transfers = kv.transfer([hit.kv for _, hit, _ in layered], st.groups)
    rows = [self._insert_rows(ins) for ins, _, _ in layered]
    whole = [i for i, r in enumerate(rows) if r == kv.chunk_size]
    tails = [[i] for i, r in enumerate(rows) if r != kv.chunk_size]  # each alone: rows differ
    batches = sorted(([whole] if whole else []) + tails)  # in chunk order
    spent = [0.0] * len(layered)
    started = self._clock()
    trace = self.layerwise_trace
    for g, (l0, _) in enumerate(st.groups):
      arrs = [tr.wait(g, timeout_s=60.0) for tr in transfers]
      for idx in batches:
        t0 = time.perf_counter()
        runner.insert_chunks_layers([_first_rows(arrs[i], rows[i]) for i in idx],
                                    [layered[i][2] for i in idx],
                                    [layered[i][0].start for i in idx], l0)
        share = (time.perf_counter() - t0) / len(idx)
        for i in idx:
          spent[i] += share
          if trace is not None:
            ins = layered[i][0]
            trace.append(("insert", ins.request_id, ins.index, g))
      runner.step_layers(st)
      if trace is not None:
        trace.append(("layers", g))
    for (ins, hit, _), sec in zip(layered, spent):
      insert_timings.append(InsertTiming(ins.request_id, ins.index, started, sec))
      self._record_loaded(ins, hit.tier)
    return runner.step_finish(st)

  def _record_loaded(self, ins: InsertItem, tier: str) -> None:
    """A store chunk (or stored tail) inserted into a request's KV: its metrics count it
    (whole-chunk and layer-wise inserts alike)."""
    live = self._live.get(ins.request_id)
    if live is not None:
      m = live.metrics
      m.num_loaded_tokens += (ins.num_tokens if ins.num_tokens is not None
                              else self.kv_store.chunk_size)
      m.loaded_from_tiers.append(tier)
      m.loaded_chunks.append((ins.index, tier))

  def _log_misses(self, reports):
    for rep in reports:
      if not rep.ok and rep.reason != "released":
        _log.warning("stored chunk %d of %s not loaded: %s", rep.index, rep.request_id,
                     rep.reason)
    return reports

  def _forget(self, rid: RequestId) -> None:
    self._live.pop(rid, None)
    if self.kv_store is not None:
      self.kv_store.close_request(rid)

  # ----------------------------------------------------------------------------- saves
  def _save_chunks(self, live: _Live, start: int, save_items: Sequence[SaveItem],
                   roundtrip: Sequence[int], k_LTKH, v_LTKH, where) -> None:
    """Keeps this step's KV of one request (a prefill chunk's rows, or a decode's one row at
    `start`) until its store chunks are complete; then, per completed chunk: passes it through
    the stored encoding when the plan says `roundtrip` (consistent codecs: encode, decode back
    into the cache), and hands it to the saver when it is in `save_items` (one device array per
    chunk, every level encoded in one device call; the saver makes the one device -> host copy).
    A chunk's tokens are the prompt's, then the output's. `where` is the request's block
    table."""
    kv, c = self.kv_store, self.kv_store.chunk_size
    if isinstance(k_LTKH, np.ndarray):  # the runner's `host_outputs` (CPU backend): own
      # copies, since a view would keep the whole step's output alive
      k_LTKH, v_LTKH = np.array(k_LTKH), np.array(v_LTKH)
    live.pieces.append((start, k_LTKH, v_LTKH))
    saves = {item.index: item for item in save_items}
    if saves:  # the client extends the request's key chain over its output when needed
      kv.extend_request_keys(live.request_id, live.prompt_token_ids + live.token_ids,
                             max(saves) + 1)
    for index in sorted(set(saves) | set(roundtrip)):
      lo, hi = index * c, (index + 1) * c
      kv_L2CKH = self._kept_rows(live, lo, hi, where)
      if kv_L2CKH.shape[2] != c:
        raise ValueError(f"chunk {index}: prefill pieces cover {kv_L2CKH.shape[2]} of {c}")
      payloads = None
      if kv.codec != codecs.RAW:
        payloads = self.runner.encode_levels(kv_L2CKH, kv.codec, kv.codec_levels, lo)
      if index in roundtrip and payloads is not None:
        # The first stored level is the request's fixed encoding (`_fixed_encoding`).
        blocks = self._chunk_blocks(where, lo, c)
        self.runner.insert_payload(kv.codec, payloads[0][2], blocks, lo)
      item = saves.get(index)
      if item is not None:
        tokens = (live.prompt_token_ids[lo:hi] if hi <= len(live.prompt_token_ids)
                  else (live.prompt_token_ids + live.token_ids)[lo:hi])
        namespace, key, parent = kv.request_chunk_key(live.request_id, index)
        kv.submit_save(SaveJob(
            namespace=namespace, chunk_hash=key, parent=parent, token_ids=tuple(tokens),
            kv=kv_L2CKH if payloads is None else None, payloads=payloads,
            replace=item.replace, verify_existing=item.verify_existing))
    end = start + k_LTKH.shape[1]
    keep_from = (end // c) * c  # pieces wholly below the last completed chunk end are done
    live.pieces = [p for p in live.pieces if p[0] + p[1].shape[1] > keep_from]

  def _kept_rows(self, live: _Live, lo: int, hi: int, where):
    """`[L, 2, hi - lo, K, H]`: a request's KV at positions `[lo, hi)`, K before RoPE, from
    the rows it kept (`live.pieces`, host arrays on the CPU backend, else device arrays, and so
    is the result); a head those do not cover is device-resident (a prefix hit this request
    did not compute) and is read back from its blocks, K un-rotated
    (`PagedModelRunner.read_pre_rope`; `lo` a multiple of the block size)."""
    xp = np if isinstance(live.pieces[-1][1], np.ndarray) else jnp
    ks, vs = [], []
    first = min(min((p[0] for p in live.pieces if p[0] + p[1].shape[1] > lo), default=hi), hi)
    if lo < first:
      b = self.runner.block_size
      k, v = self.runner.read_pre_rope(where[lo // b:-(-first // b)], lo, first - lo)
      ks.append(k)
      vs.append(v)
    for start, k, v in live.pieces:
      a, b = max(start, lo), min(start + k.shape[1], hi)
      if a < b:
        ks.append(k[:, a - start:b - start])
        vs.append(v[:, a - start:b - start])
    return xp.stack([xp.concatenate(ks, axis=1), xp.concatenate(vs, axis=1)], axis=1)

  def _save_tail(self, live: _Live, where) -> None:
    """Stores a finished session turn's tail: its KV after the last full chunk of its prompt
    and output but the last sampled token (which has no KV), padded to a chunk of C rows under
    `keys.tail_hash` (`keys.tail_token_ids`), so the next turn loads every historical token
    even once the device has evicted its blocks. Raw, like every chunk of a store that keeps
    tails (`KVStoreClient.stores_tails`); queued to the saver like any save (dropped and
    counted when its queue is full)."""
    kv, c = self.kv_store, self.kv_store.chunk_size
    seq = live.prompt_token_ids + live.token_ids
    end = len(seq) - 1
    k, m = divmod(end, c)
    if not m or not live.pieces:
      return  # no tail (its last chunk is full, saved as a chunk), or nothing kept
    namespace, parent, key = kv.request_tail_key(live.request_id, seq, end)
    rows = self._kept_rows(live, k * c, end, where)
    if rows.shape[2] != m:
      raise ValueError(f"tail of {live.request_id}: kept rows cover {rows.shape[2]} of {m}")
    xp = np if isinstance(rows, np.ndarray) else jnp
    padded = xp.pad(rows, ((0, 0), (0, 0), (0, c - m), (0, 0), (0, 0)))
    kv.submit_save(SaveJob(namespace=namespace, chunk_hash=key, parent=parent,
                           token_ids=keys.tail_token_ids(seq[k * c:end], c), kv=padded))

  # ----------------------------------------------------------------------------- outputs
  def _sample(self, rid: RequestId, logits_V: np.ndarray, sampled: list, finished: list,
              where=None) -> None:
    """Samples a request's next token; on a finish, ends it (and, for a session turn, `where`
    being its block table, stores its tail)."""
    live = self._live[rid]
    token = sampling.sample_token(logits_V, live.params, live.rng)
    live.token_ids.append(token)
    sampled.append((rid, token))
    now = self._clock()
    if live.metrics.first_token_s is None:
      live.metrics.first_token_s = now
      live.metrics.ttft_s = now - live.metrics.arrival_s
      if live.metrics.scheduled_s is not None:
        live.metrics.prefill_s = now - live.metrics.scheduled_s
    if live.logprobs is not None:
      live.logprobs.append(sampling.top_logprobs(logits_V, live.params.logprobs, token))
    reason = self._finish_reason(live)
    if reason is not None:
      finished.append((rid, reason))
      live.metrics.finished_s = now
      if live.save_tail:  # `where` is its block table
        try:
          self._save_tail(live, where)
        except Exception:  # noqa: BLE001 - a tail is a cache entry: its next turn computes it
          _log.exception("the stored tail of %s was not saved", rid)
      del self._live[rid]
      if self.kv_store is not None:
        self.kv_store.close_request(rid)  # its keys; late loads of chunks compute took
    self._emitted.append(self._output(live, reason))

  def _finish_reason(self, live: _Live) -> str | None:
    params = live.params
    token = live.token_ids[-1]
    eos = self.tokenizer.eos_id if self.tokenizer is not None else None
    if token in params.stop_token_ids or (token == eos and not params.ignore_eos):
      self._set_text(live)
      return "stop"
    if params.stop and self.tokenizer is not None:
      text = self.tokenizer.decode(live.token_ids, skip_special_tokens=True)
      hits = [text.find(s) for s in params.stop if s in text]
      if hits:
        live.text = text[:min(hits)]
        return "stop"
    if len(live.token_ids) >= params.max_tokens or (
        len(live.prompt_token_ids) + len(live.token_ids) >= self.max_seq_len):
      self._set_text(live)
      return "length"
    return None

  def _set_text(self, live: _Live) -> None:
    if self.tokenizer is not None:
      live.text = self.tokenizer.decode(live.token_ids, skip_special_tokens=True)

  def _output(self, live: _Live, reason: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=live.request_id, prompt=live.prompt, prompt_token_ids=live.prompt_token_ids,
        text=live.text, token_ids=list(live.token_ids), finish_reason=reason,
        logprobs=list(live.logprobs) if live.logprobs is not None else None,
        num_cached_tokens=live.metrics.num_loaded_tokens, metrics=live.metrics,
        finished=reason is not None)
