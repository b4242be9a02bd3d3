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
generator, the prompt text, log-probs, detokenized text and metrics. Its store side is two parts
it owns, one per direction: `kvjax/engine/kv_loads.py` (`KVLoads`: lookups into plain data,
loads, inserts, layer-wise pre-loading) and `kvjax/engine/kv_saves.py` (`KVSaves`: the KV rows of
a chunk still being computed, and the saves); its records are in `kvjax/engine/outputs.py`. When
a plan has nothing to compute but loads are outstanding, the engine blocks until one lands (no
polling), at most the plan's `wait_s`.

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
from typing import Callable, Protocol, Sequence

import numpy as np

from kvjax import codecs
from kvjax._typing import RequestId
from kvjax.connector import KVStoreClient
from kvjax.engine import grammar, sampling
from kvjax.engine.core import EngineCore, StepRecord
from kvjax.engine.kv_loads import KVLoads
from kvjax.engine.kv_saves import KVSaves
from kvjax.engine.outputs import EngineStats, RequestMetrics, RequestOutput
from kvjax.merge_mode import MergeMode, parse_merge_mode
from kvjax.models.runner.runner_api import Runner, SeqChunk
from kvjax.scheduler.config import LoadConfig, SchedulerConfig
from kvjax.scheduler.cost_model import CostModel
from kvjax.scheduler.kv_cache_manager import KVCacheEvents, KVCacheManager
from kvjax.scheduler.output import (ComputeTiming, ForkItem, InsertItem, InsertTiming,
                                    SchedulerOutput, StepResult, StepTiming)
from kvjax.scheduler.request import Request, SamplingParams, SamplingParamsError
from kvjax.scheduler.scheduler import Scheduler

_log = logging.getLogger(__name__)


class TokenizerLike(Protocol):
  eos_id: int | None

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


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
  #: int32[V] times each token was generated so far, when penalties need it (else None).
  counts_V: np.ndarray | None = None
  save_tail: bool = False  # a session turn: store its tail when it finishes (`KVSaves.save_tail`)
  constraint: grammar.Constraint | None = None  # `params.structured`'s grammar state


class Engine:
  """Executes the scheduler's plans on the model runner and the store client.

  Args:
    runner: the model runner (owns the device KV cache).
    tokenizer: used for EOS and stop strings; may be None for token-id-only use.
    scheduler_config: slots, token budget, chunk sizes, prefill policy and the device prefix
      cache (`SchedulerConfig`; `EngineOptions.scheduler_config()` derives it from the options);
      the slots and chunk sizes must match the runner's. None: the runner's sizes.
    load_config: how stored prefixes become resident (`LoadConfig`: merge mode, loads in
      flight, link latency, TTFT target, layer groups, look-ahead window, consistent, writer
      checks; `EngineOptions.load_config()`). The engine fits it to its runner and store: layer
      groups capped at the model's layers, no look-ahead and no consistency without a store (nor
      consistency with a raw codec), the client's staging bytes. None: `LoadConfig()`.
    kv_store: the prefix-cache store client, or None for no store. With `consistent`, keyed by
      the fixed encoding (`KVStoreClient(consistent=True)`).
    seed: seeds requests that give no seed of their own.
    clock: seconds, monotonic (tests may pass a fake).
    cost_model: the planner's `CostModel` (tests and simulations pass a frozen one); None (the
      default): a fresh one that learns from this engine's steps and loads.

  The KV cache is the runner's block pool (`docs/design/paged-memory.md`): the scheduler owns
  a `KVCacheManager` over it and each step is one ragged jit call. Everything is built from the
  options in one place, `kvjax.entrypoints.root.build_engine_parts`.

  Raises:
    ValueError: a scheduler config that does not match the runner, or a consistent engine over
      a client not keyed by its encoding.
  """

  def __init__(self, runner: Runner, tokenizer: TokenizerLike | None,
               scheduler_config: SchedulerConfig | None = None,
               load_config: LoadConfig | None = None, *,
               kv_store: KVStoreClient | None = None, seed: int = 0,
               clock: Callable[[], float] = time.perf_counter,
               cost_model: CostModel | None = None):
    load_config = load_config or LoadConfig()
    consistent = (load_config.consistent and kv_store is not None
                  and kv_store.codec != codecs.RAW)
    n_layers = runner.model_config.n_layers
    split = load_config.layer_split == "auto"
    layerwise_groups = min(load_config.layerwise_groups, n_layers)
    #: The layer groups a step holding a layer-split piece runs in: the layer-wise loading
    #: groups when on (a step may do both), else every layer its own; the runner stops a piece
    #: at their boundaries (`Runner.layer_split_points`), which the planner may choose. 0: off.
    self.layer_split_groups = 0 if not split else (
        layerwise_groups if layerwise_groups > 1 else n_layers)
    load_config = dataclasses.replace(
        load_config, consistent=consistent,
        lookahead_window=load_config.lookahead_window if kv_store is not None else 0,
        layerwise_groups=layerwise_groups,
        staging_bytes=kv_store.staging_bytes if kv_store is not None else 1 << 30,
        layer_split_points=(runner.layer_split_points(self.layer_split_groups) if split
                            else ()),
        num_layers=n_layers if split else 0)
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
    # The runner's: the joint rules price steps as the runner pads them.
    scheduler_config = dataclasses.replace(scheduler_config, step_buckets=tuple(runner.buckets))
    self._fixed_encoding = (codecs.EncodingId(kv_store.codec, kv_store.codec_levels[0])
                            if consistent else None)
    if consistent and kv_store.key_encoding != str(self._fixed_encoding):
      raise ValueError(f"a consistent engine ({self._fixed_encoding}) needs a store client "
                       "keyed by that encoding: KVStoreClient(consistent=True)")
    kv_cache = KVCacheManager(runner.num_blocks, runner.block_size,
                              namespace_root=self._namespace_root(None),
                              enable_prefix_caching=scheduler_config.enable_prefix_caching)
    self._scheduler = Scheduler(
        scheduler_config, cost_model if cost_model is not None else CostModel(),
        load_config=load_config,
        save_chunk_size=kv_store.chunk_size if kv_store is not None else None,
        consistent=consistent, kv_cache=kv_cache)
    self._core = EngineCore(self._scheduler, self)
    self._rng = np.random.default_rng(seed)
    self._grammars = grammar.Grammars(tokenizer, runner.model_config.vocab_size)
    self._clock = clock
    self._live: dict[RequestId, _Live] = {}
    self._ids = itertools.count()
    self._emitted: list[RequestOutput] = []
    # The store side of execution, one part per direction (None without a store).
    self._loads = (KVLoads(runner, kv_store, clock, self._fixed_encoding)
                   if kv_store is not None else None)
    self._saves = KVSaves(runner, kv_store) if kv_store is not None else None
    #: Block on the cache after each insert so `StepResult.inserts` times the device work
    #: (benchmarks; the next prefill waits for it anyway).
    self.timed_inserts = False
    #: A list to record layer-wise steps' order of inserts and layer groups in (tests), or None.
    self.layerwise_trace: list | None = None

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
      ValueError: empty prompt, token ids outside the vocabulary (prompt or `logit_bias`:
        `SamplingParamsError` naming `logit_bias` for the latter), or prompt plus `max_tokens`
        beyond the context length.
    """
    ids = [int(t) for t in prompt_token_ids]
    if not ids:
      raise ValueError("the prompt is empty: give at least one token")
    if params.truncate_prompt_tokens is not None:
      ids = ids[-params.truncate_prompt_tokens:]
    vocab = self.runner.model_config.vocab_size
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
    if bad_bias:
      raise SamplingParamsError("logit_bias", f"logit_bias token ids {bad_bias[:5]} are outside "
                                f"the vocabulary [0, {vocab})")
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
                  cache_salt: str | None = None,
                  merge_mode: MergeMode | str | None = None, history_tokens: int = 0,
                  save_tail: bool = False, fork_of: RequestId | str | None = None,
                  layer_split: bool = True) -> RequestId:
    """Validates and queues a request; returns its id.

    With a store, one batched lookup finds which prefix chunks are stored (no data is read
    here); the scheduler gets the answer as plain data and plans the merge. `cache_salt`
    isolates tenants: prompts share stored KV only under equal salts. `merge_mode` (a
    `kvjax.merge_mode.MergeMode` or its value) overrides the engine's for this request
    (benchmarks compare the modes on one warm engine; a session turn under re-rotated KV asks
    for load-only in its options, `kvjax.sessions.TurnPlan.request_options`: the engine reads no
    meaning into a salt). `layer_split=False` plans this request's merge token-only on an
    engine whose `kv_layer_split` is "auto" (no effect when it is "off").

    Session turns (a raw store: `KVStoreClient.stores_tails`): `save_tail` stores
    the request's tail when it finishes cleanly (its tokens after the last full chunk of its
    prompt and output but the last sampled token, `keys.tail_hash`), and `history_tokens` h
    (the prompt's first h tokens are such a finished turn's) looks that tail up too, so the
    next turn loads every historical token's KV even after the device evicted it
    (CachedAttention, arXiv 2403.19708, section 3.2.2).

    `n` > 1 (`fork_of`, the id of a request added before with the same prompt and salt, still
    unfinished): this request shares that request's prompt computation: the scheduler forks
    it from the parent's last prefill chunk (`Scheduler.add_request`), and this engine copies
    the parent's partly filled last block and samples this request's first token from the
    parent's logits with this request's own generator (seed). Its store lookup is not planned
    (the store client only keeps its key chain, for the chunks its decodes complete).

    Raises:
      ValueError: as `validate`, a duplicate id, a `cache_salt` that is not a string, an
        unknown `merge_mode`, a negative `history_tokens`, a `fork_of` that is not an
        unfinished request with the same prompt and salt, or a `layer_split` that is not a
        bool.
    """
    if not isinstance(layer_split, bool):
      raise ValueError(f"layer_split={layer_split!r} must be a bool")
    if cache_salt is not None and not isinstance(cache_salt, str):
      raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if merge_mode is not None:
      merge_mode = parse_merge_mode(merge_mode)
    if isinstance(history_tokens, bool) or not isinstance(history_tokens, int) or (
        history_tokens < 0):
      raise ValueError(f"history_tokens={history_tokens!r} must be an int >= 0")
    ids = self.validate(prompt_token_ids, params)
    rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
    if rid in self._live:
      raise ValueError(f"request id {rid!r} is already in use")
    constraint = (self._grammars.constraint(params.structured)
                  if params.structured is not None else None)
    seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
    arrival_s = self._clock()
    live = _Live(rid, prompt, ids, params, np.random.default_rng(seed),
                 RequestMetrics(arrival_s=arrival_s),
                 [] if params.logprobs is not None else None, constraint=constraint)
    if params.processes_logits:
      live.counts_V = np.zeros(self.runner.model_config.vocab_size, np.int32)
    stored = None
    if fork_of is not None:
      parent = self._live.get(RequestId(fork_of))
      if parent is None or parent.prompt_token_ids != ids:
        raise ValueError(f"fork_of={fork_of!r}: not an unfinished request with this prompt")
    if self._loads is not None:
      tails = self.kv_store.stores_tails
      live.save_tail = tails and save_tail and fork_of is None
      # A fork is opened too (its key chain: its decodes complete and save chunks), but its
      # prompt is its parent's: the scheduler gets no lookup for it.
      stored, live.metrics.lookup_s = self._loads.open_request(
          rid, ids, cache_salt, history_tokens if tails and fork_of is None else 0)
      stored = stored if fork_of is None else None
    try:
      self._scheduler.add_request(
          Request(rid, ids, params, arrival_s=arrival_s), stored, merge_mode=merge_mode,
          namespace_root=self._namespace_root(cache_salt),
          fork_of=RequestId(fork_of) if fork_of is not None else None,
          layer_split=layer_split)
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
    for rid in plan.preempted if kv is not None else ():
      self._saves.drop(rid)
      kv.cancel_loads(rid)
    for rid in plan.preempted:
      # Its blocks are freed: its readmission looks its prefix up again and counts those hits,
      # so the hits of this admission go (else cached tokens could pass the prompt's).
      if rid in self._live:
        m = self._live[rid].metrics
        m.num_loaded_tokens = m.num_device_cached_tokens = 0
        m.loaded_from_tiers.clear()
        m.loaded_chunks.clear()
    for rid, tokens in plan.device_hits:
      if rid not in self._live:
        continue  # aborted since
      m = self._live[rid].metrics
      m.num_loaded_tokens += tokens
      m.num_device_cached_tokens += tokens
      m.loaded_from_tiers.append("device")
    if kv is not None:
      for ins, tier in self._loads.execute(plan, tables, self._live, insert_timings, layered,
                                           timed=self.timed_inserts):
        self._record_loaded(ins, tier)
    if not plan.decodes and not plan.prefills:  # nothing to compute: loads and inserts at most
      reports = []
      if kv is not None and (plan.wait_s or plan.inserts):
        reports = self._loads.landed(wait_s=plan.wait_s)
      return StepResult(now_s=self._clock(), loads=tuple(self._log_misses(reports)),
                        inserts=tuple(insert_timings))
    sampled: list[tuple[RequestId, int]] = []
    finished: list[tuple[RequestId, str]] = []
    timings: list[ComputeTiming] = []
    step = self._execute_ragged(plan, tables, sampled, finished, timings, layered,
                                insert_timings)
    reports = self._loads.landed() if kv is not None else []
    return StepResult(now_s=self._clock(), sampled=tuple(sampled), finished=tuple(finished),
                      loads=tuple(self._log_misses(reports)), compute=tuple(timings),
                      inserts=tuple(insert_timings), step=step)

  def _execute_ragged(self, plan: SchedulerOutput, tables: dict, sampled: list, finished: list,
                      timings: list, layered: Sequence = (),
                      insert_timings: list | None = None) -> StepTiming:
    """Every decode and prefill chunk of the plan in ONE jit call
    (`PagedModelRunner.step`), then sampling, metrics and saves per chunk. Each prefill chunk's
    `ComputeTiming` gets the step's seconds pro rata to its tokens. With `layered` inserts
    (layer-wise pre-loading) the step runs as `plan.layer_groups` layer-group calls instead
    (`KVLoads.step_layerwise`).

    Returns:
      The call's `StepTiming` (the cost model's observation).
    """
    runner, kv = self.runner, self.kv_store
    seqs = [SeqChunk((d.token_id,), d.position, tables[d.request_id]) for d in plan.decodes]
    seqs += [SeqChunk(c.token_ids, c.start, tables[c.request_id], c.num_layers)
             for c in plan.prefills]
    total = sum(len(s.token_ids) for s in seqs)
    compiled = runner.is_compiled(total)
    split = any(c.num_layers is not None for c in plan.prefills)  # a split chunk's low layers
    t0, t0_clock = time.perf_counter(), self._clock()
    if layered:
      out, loaded = self._loads.step_layerwise(seqs, plan.layer_groups, layered, insert_timings,
                                               trace=self.layerwise_trace)
      for ins, tier in loaded:
        self._record_loaded(ins, tier)
    elif split:  # stops at a group boundary
      out = runner.step_grouped(seqs, self.layer_split_groups)
    else:
      out = runner.step(seqs)
    allowed = self._grammar_masks(plan)  # on the host while the device runs the step
    raw_SV = np.asarray(out.logits_SV)  # waits for the device: the step's own time
    seconds = time.perf_counter() - t0
    step = StepTiming(tuple((s.start, len(s.token_ids)) for s in seqs), runner.bucket_for(total),
                      seconds, includes_compile=not compiled,
                      full_depth=not split)
    logits_SV = self._processed(plan, raw_SV)
    for i, d in enumerate(plan.decodes):
      if kv is not None:  # every token's K before RoPE is kept until its chunk is complete
        o = out.offsets[i]
        live = self._live[d.request_id]
        self._saves.keep(d.request_id, live.prompt_token_ids, live.token_ids, d.position,
                         d.saves, (), out.k_pre_rope_LTKH[:, o:o + 1], out.v_LTKH[:, o:o + 1],
                         tables[d.request_id])
      self._sample(d.request_id, logits_SV[i], sampled, finished, tables[d.request_id],
                   raw_SV[i], allowed.get(d.request_id))
    base = len(plan.decodes)
    for j, chunk in enumerate(plan.prefills):
      timings.append(ComputeTiming(chunk.start, chunk.num_tokens,
                                   seconds * chunk.num_tokens / total, chunk.request_id,
                                   t0_clock, includes_compile=not compiled,
                                   num_layers=chunk.num_layers))
      live = self._live[chunk.request_id]
      if chunk.num_layers is not None:
        continue  # a layer-split chunk's low layers: its tokens count as loaded, never saved
      live.metrics.num_computed_tokens += chunk.num_tokens
      if kv is not None:
        o = out.offsets[base + j]
        self._saves.keep(chunk.request_id, live.prompt_token_ids, live.token_ids, chunk.start,
                         chunk.saves, chunk.roundtrip,
                         out.k_pre_rope_LTKH[:, o:o + chunk.num_tokens],
                         out.v_LTKH[:, o:o + chunk.num_tokens], tables[chunk.request_id])
      if chunk.is_last:
        self._sample(chunk.request_id, logits_SV[base + j], sampled, finished,
                     tables[chunk.request_id], raw_SV[base + j],
                     allowed.get(chunk.request_id))
        for fork in plan.forks:
          if fork.parent_id == chunk.request_id:
            self._fork(fork, raw_SV[base + j], sampled, finished, tables)

  def _fork(self, fork: ForkItem, raw_V: np.ndarray, sampled: list, finished: list,
            tables: dict) -> None:
    """A request forked from its parent's prompt (`ForkItem`): the parent's partly filled last
    block copied into the child's, then the child's first token sampled from the parent's last
    logits row (`raw_V`, processed for the child's own penalties and bias)."""
    if fork.copies:
      src, dst = zip(*fork.copies)
      self.runner.copy_blocks(src, dst)
    live = self._live.get(fork.child_id)
    if live is None:
      return  # aborted since
    logits_V = raw_V
    if live.counts_V is not None:
      logits_V = sampling.process_logits(raw_V[None], [(live.params, live.counts_V)])[0]
    allowed_V = live.constraint.allowed() if live.constraint is not None else None
    self._sample(fork.child_id, logits_V, sampled, finished, tables[fork.child_id], raw_V,
                 allowed_V)

  def _processed(self, plan: SchedulerOutput, raw_SV: np.ndarray) -> np.ndarray:
    """The step's logits after each sampling row's penalties and logit bias
    (`sampling.process_logits`, on the device); `raw_SV` itself when no row has any."""
    rows = [self._live[d.request_id] for d in plan.decodes]
    rows += [self._live[c.request_id] if c.is_last else None for c in plan.prefills]
    if not any(live is not None and live.counts_V is not None for live in rows):
      return raw_SV
    return sampling.process_logits(
        raw_SV, [(live.params, live.counts_V) if live is not None else (None, None)
                 for live in rows])

  def _grammar_masks(self, plan: SchedulerOutput) -> dict[RequestId, np.ndarray]:
    """bool[V] allowed tokens of each constrained request this step samples for (its grammar's
    state after its tokens so far: `kvjax/engine/grammar.py`)."""
    rids = [d.request_id for d in plan.decodes]
    rids += [c.request_id for c in plan.prefills if c.is_last]
    return {rid: self._live[rid].constraint.allowed() for rid in rids
            if self._live[rid].constraint is not None}

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
      self._saves.drop(rid)
      self.kv_store.close_request(rid)

  # ----------------------------------------------------------------------------- outputs
  def _sample(self, rid: RequestId, logits_V: np.ndarray, sampled: list, finished: list,
              where=None, raw_V: np.ndarray | None = None,
              allowed_V: np.ndarray | None = None) -> None:
    """Samples a request's next token from `logits_V` (penalized), among `allowed_V` under a
    grammar; on a finish, ends it (and, for a session turn, `where` being its block table,
    stores its tail). Log-probabilities are of `raw_V`, the model's logits (default:
    `logits_V`)."""
    live = self._live[rid]
    token = sampling.sample_token(logits_V, live.params, live.rng, allowed_V)
    if live.constraint is not None:
      live.constraint.accept(token)
    live.token_ids.append(token)
    if live.counts_V is not None:
      live.counts_V[token] += 1
    logits_V = logits_V if raw_V is None else raw_V
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
          self._saves.save_tail(rid, live.prompt_token_ids + live.token_ids, where)
        except Exception:  # noqa: BLE001 - a tail is a cache entry: its next turn computes it
          _log.exception("the stored tail of %s was not saved", rid)
      del self._live[rid]
      if self.kv_store is not None:
        self._saves.drop(rid)
        self.kv_store.close_request(rid)  # its keys; late loads of chunks compute took
    self._emitted.append(self._output(live, reason))

  def _finish_reason(self, live: _Live) -> str | None:
    params = live.params
    token = live.token_ids[-1]
    eos = self.tokenizer.eos_id if self.tokenizer is not None else None
    if token in params.stop_token_ids or (token == eos and not params.ignore_eos) or (
        live.constraint is not None and live.constraint.done):  # the grammar is complete
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
