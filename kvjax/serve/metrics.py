"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Request metrics are updated on the engine thread as outputs appear (`on_output`); queue, KV pool,
device prefix-cache, preemption, store, link and saver figures are read when `/metrics` is
scraped (`_StoreCollector`), all from one `Engine.stats()` snapshot (`EngineStats`: its
`saver` is None without a store, and the families of an absent part are left out). vLLM's names of the figures vLLM has (`vllm:kv_cache_usage_perc`,
`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:prefix_cache_queries`/`hits`,
`vllm:num_preemptions`, and `vllm:cache_config_info{block_size,
num_gpu_blocks}`) are served beside the `kvjax_` ones, with the same values: what the Gateway
API Inference Extension's model-server protocol asks for (queue depth, running requests, KV
cache utilisation; block size and pool blocks for its approximate prefix-cache scorer), so
llm-d's inference scheduler can route to kvjax replicas as to vLLM pods. Chat-session counters
come from one `SessionRegistry.stats()` snapshot per scrape (`_SessionCollector`). Store warnings
(a failed lookup, read or save, each of which degrades to computing) are counted by a logging
handler on the store's loggers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvjax.engine import RequestOutput

_log = logging.getLogger(__name__)
#: Loggers whose warnings mean a store fault that was degraded to computing.
STORE_LOGGERS = ("kvjax.connector", "kvjax.storage")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _WarningCounter(logging.Handler):
  def __init__(self, counter: Counter):
    super().__init__(logging.WARNING)
    self._counter = counter

  def emit(self, record: logging.LogRecord) -> None:
    self._counter.labels(logger=record.name).inc()


class _StoreCollector(Collector):
  """Reads engine-loop counters and one engine snapshot (queue, KV pool, store) per scrape."""

  def __init__(self, engine_stats: Callable[[], Any] | None, loop_stats: Any):
    self._engine_stats = engine_stats
    self._loop_stats = loop_stats

  def collect(self):
    loop = self._loop_stats
    if loop is not None:
      yield CounterMetricFamily("kvjax_engine_step_failures", "Engine steps that raised.",
                                loop.step_failures)
      yield CounterMetricFamily("kvjax_aborted_requests",
                                "Unfinished requests aborted (client gone).", loop.aborted)
    snap = None
    if self._engine_stats is not None:
      try:
        snap = self._engine_stats()  # the one snapshot every engine figure below comes from
      except Exception:  # noqa: BLE001 - a scrape must not fail on an engine in flux
        _log.exception("reading engine stats failed")
    if snap is not None:
      waiting, running = snap.num_waiting, snap.num_running
    elif loop is not None:
      waiting, running = loop.waiting, loop.running
    else:
      return
    for name in ("kvjax_num_requests_waiting", "vllm:num_requests_waiting"):
      yield GaugeMetricFamily(name, "Requests queued in the engine, not yet running.", waiting)
    for name in ("kvjax_num_requests_running", "vllm:num_requests_running"):
      yield GaugeMetricFamily(name, "Requests running (sequences holding pool blocks).",
                              running)
    if snap is None:
      return
    kv_bytes = GaugeMetricFamily("kvjax_kv_cache_bytes", "Device KV memory: reserved (the pool "
                                 "or every slot) and the peak held by requests since start.",
                                 labels=["state"])
    kv_bytes.add_metric(["reserved"], snap.kv_cache_bytes)
    kv_bytes.add_metric(["peak_used"], snap.kv_cache_peak_used_bytes)
    yield kv_bytes
    if snap.kv_cache is not None:
      yield from _kv_cache_families(snap.kv_cache)
    if snap.saver is None:
      return  # no store
    rejected = CounterMetricFamily("kvjax_store_rejected_chunks",
                                   "Stored chunks read but rejected, by tier and reason.",
                                   labels=["tier", "reason"])
    read = CounterMetricFamily("kvjax_store_read_bytes",
                               "Stored bytes of verified chunk loads, by tier.", labels=["tier"])
    rate = GaugeMetricFamily("kvjax_link_bandwidth_bytes_per_second",
                             "Emulated link rate now, by tier (+Inf: unlimited).",
                             labels=["tier"])
    granted = CounterMetricFamily("kvjax_link_granted_bytes",
                                  "Bytes the link limiter let through, by tier (rate() of it is "
                                  "the bandwidth in use).", labels=["tier"])
    evictions = CounterMetricFamily("kvjax_store_evictions",
                                    "Stored chunks evicted for capacity, by tier.",
                                    labels=["tier"])
    hits = CounterMetricFamily("kvjax_store_tier_hits", "Verified chunk reads served, by tier "
                               "(loads, prefetches, re-rotation reads).", labels=["tier"])
    demotions = CounterMetricFamily("kvjax_store_demotions", "Chunks a tier evicted and demoted "
                                    "to the tier below (write-back placement), by tier.",
                                    labels=["tier"])
    demotion_drops = CounterMetricFamily("kvjax_store_demotion_drops", "Chunks a tier evicted "
                                         "whose demotion failed (lost), by tier.",
                                         labels=["tier"])
    for t in snap.tiers:
      for reason, n in t.misses.items():
        if reason != "absent":
          rejected.add_metric([t.name, reason], n)
      read.add_metric([t.name], t.loaded_bytes)
      if t.link_bytes_per_s is not None:
        rate.add_metric([t.name], t.link_bytes_per_s)
        granted.add_metric([t.name], t.link_granted_bytes)
      evictions.add_metric([t.name], t.evictions)
      hits.add_metric([t.name], t.hits)
      demotions.add_metric([t.name], t.demotions_out)
      demotion_drops.add_metric([t.name], t.demotion_drops)
    yield from (rejected, read, rate, granted, evictions, hits, demotions, demotion_drops)
    if snap.prefetch is not None:
      pf = CounterMetricFamily(
          "kvjax_kv_prefetch", "Look-ahead prefetches into the host tier: issued (a chunk copied "
          "up ahead of its load), useful (later loaded from the host), wasted (left the window "
          "unread).", labels=["outcome"])
      for outcome, n in (("issued", snap.prefetch.issued), ("useful", snap.prefetch.useful),
                         ("wasted", snap.prefetch.wasted)):
        pf.add_metric([outcome], n)
      yield pf
    fam = CounterMetricFamily("kvjax_kv_saver", "Asynchronous KV saves, by outcome.",
                              labels=["outcome"])
    for outcome, n in dataclasses.asdict(snap.saver).items():
      fam.add_metric([outcome], n)
    yield fam


class _SessionCollector(Collector):
  """Chat-session counters from one `SessionStats` snapshot per scrape."""

  def __init__(self, session_stats: Callable[[], Any]):
    self._session_stats = session_stats

  def collect(self):
    st = self._session_stats()
    turns = CounterMetricFamily(
        "kvjax_session_turns", "Chat turns under a session_id, by how their prompt was made: "
        "first (no earlier turn), extended (the session's exact ids plus the new part), "
        "not_extended (the messages did not extend the session: templated, a miss).",
        labels=["outcome"])
    for outcome, n in (("first", st.first), ("extended", st.extended),
                       ("not_extended", st.not_extended)):
      turns.add_metric([outcome], n)
    yield turns
    ended = CounterMetricFamily("kvjax_session_turns_ended", "Session turns that ended: "
                                "recorded (finished) or abandoned (aborted, failed).",
                                labels=["result"])
    ended.add_metric(["recorded"], st.turns)
    ended.add_metric(["abandoned"], st.abandoned)
    yield ended
    dropped = CounterMetricFamily("kvjax_sessions_dropped", "Sessions dropped: expired (idle "
                                  "past the TTL), evicted (over max_sessions or "
                                  "max_session_tokens), closed.", labels=["reason"])
    for reason, n in (("expired", st.expired), ("evicted", st.evicted), ("closed", st.closed)):
      dropped.add_metric([reason], n)
    yield dropped
    yield CounterMetricFamily("kvjax_session_conflicts", "Turns refused with 409: their session "
                              "was busy.", st.conflicts)
    yield GaugeMetricFamily("kvjax_sessions_open", "Chat sessions held.", st.open_sessions)
    yield GaugeMetricFamily("kvjax_sessions_busy", "Chat sessions with a turn in flight.",
                            st.busy_sessions)
    yield GaugeMetricFamily("kvjax_session_tokens", "Token ids held over all chat sessions.",
                            st.open_tokens)
    later = st.extended + st.not_extended
    yield GaugeMetricFamily("kvjax_session_hit_rate", "Of the session turns with an earlier "
                            "turn, the fraction whose prompt extended the session's exact ids "
                            "(NaN before any).", st.extended / later if later else math.nan)
    trunc = CounterMetricFamily("kvjax_session_truncations", "Session turns cut to their limit: "
                                "truncated (all), rerotated (of those, on re-rotated kept KV).",
                                labels=["kind"])
    trunc.add_metric(["truncated"], st.truncated)
    trunc.add_metric(["rerotated"], st.rerotated)
    yield trunc
    yield CounterMetricFamily("kvjax_session_dropped_turns", "Whole turns dropped by session "
                              "truncation (drop_oldest_turns).", st.dropped_turns)
    yield CounterMetricFamily("kvjax_session_rerotated_tokens", "Prompt tokens loaded as "
                              "re-rotated kept KV instead of computed.", st.rerotated_tokens)


def _kv_cache_families(kv) -> list:
  """The paged pool's and device prefix cache's families (`KVCacheStats`): usage as vLLM's
  `kv_cache_usage_perc` (a fraction in [0, 1], under both names), blocks, device prefix-cache
  lookups and tokens, evictions, preemptions."""
  out = [GaugeMetricFamily(name, "Fraction of the KV block pool in use (1 = full), in [0, 1].",
                           kv.usage)
         for name in ("kvjax_kv_cache_usage_perc", "vllm:kv_cache_usage_perc")]
  # vLLM's info gauge (value 1, the configuration in labels): the inference scheduler's
  # approximate prefix-cache scorer reads `block_size` and `num_gpu_blocks` from it.
  info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (vLLM's info "
                           "gauge): tokens per block, blocks in the device pool.",
                           labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
  info.add_metric([str(kv.block_size), str(kv.num_blocks), str(kv.enable_prefix_caching)], 1.0)
  out.append(info)
  blocks = GaugeMetricFamily("kvjax_kv_cache_blocks", "KV pool blocks: all usable, free "
                             "(allocatable now, evictable cached included), cached (indexed).",
                             labels=["state"])
  blocks.add_metric(["total"], kv.num_blocks)
  blocks.add_metric(["free"], kv.num_free_blocks)
  blocks.add_metric(["cached"], kv.num_cached_blocks)
  blocks.add_metric(["peak_used"], kv.peak_used_blocks)
  out.append(blocks)
  for name, doc, value in (
      ("kvjax_device_prefix_cache_queries", "Device prefix-cache lookups (one per admission or "
       "resumption).", kv.queries),
      ("kvjax_device_prefix_cache_hits", "Device prefix-cache lookups that found a block.",
       kv.hits),
      ("kvjax_device_prefix_cache_query_tokens", "Tokens looked up in the device prefix cache.",
       kv.query_tokens),
      ("kvjax_device_prefix_cache_hit_tokens", "Tokens served from device-resident blocks.",
       kv.hit_tokens),
      ("vllm:prefix_cache_queries", "Tokens looked up in the device prefix cache (vLLM's name).",
       kv.query_tokens),
      ("vllm:prefix_cache_hits", "Tokens served from the device prefix cache (vLLM's name).",
       kv.hit_tokens),
      ("kvjax_kv_cache_evictions", "Cached blocks evicted to make room.", kv.evictions),
      ("kvjax_num_preemptions", "Requests preempted because the pool ran out.", kv.preemptions),
      ("vllm:num_preemptions", "Requests preempted (vLLM's name).", kv.preemptions)):
    out.append(CounterMetricFamily(name, doc, value))
  return out


class ServeMetrics:
  """The server's metrics.

  Args:
    engine_stats: `Engine.stats` (or None): its snapshot gives the tier, link and saver counters.
    loop_stats: `AsyncEngine.stats` (queue depth, running, failures), or None.
    session_stats: `SessionRegistry.stats` (or None: no session families).
  """

  def __init__(self, engine_stats: Callable[[], Any] | None = None, loop_stats: Any = None,
               session_stats: Callable[[], Any] | None = None):
    self.registry = r = CollectorRegistry()
    self.ttft = Histogram("kvjax_time_to_first_token_seconds",
                          "Submission to the engine (after tokenizing) to first token, seconds.",
                          registry=r, buckets=_TTFT_BUCKETS)
    self.prefill = Histogram("kvjax_prefill_time_seconds",
                             "Prefill wall time: a request's first scheduled step to its first "
                             "token (queueing before admission excluded), seconds.",
                             registry=r, buckets=_TTFT_BUCKETS)
    self.e2e = Histogram("kvjax_e2e_request_latency_seconds",
                         "Submission to the engine to the last token, seconds.", registry=r,
                         buckets=_TTFT_BUCKETS)
    self.prompt_tokens = Counter("kvjax_prompt_tokens",
                                 "Prompt tokens of finished requests, by how their KV was made: "
                                 "computed, loaded from the store, or device (prefix-cache "
                                 "blocks already on the device).",
                                 ["source"], registry=r)
    self.generation_tokens = Counter("kvjax_generation_tokens", "Output tokens.", registry=r)
    self.prefix_queried = Counter("kvjax_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache.", registry=r)
    self.prefix_hits = Counter("kvjax_prefix_cache_hit_tokens",
                               "Prompt tokens served from the prefix cache.", registry=r)
    self.hit_rate = Gauge("kvjax_prefix_cache_hit_rate",
                          "Hit tokens / queried tokens since start.", registry=r)
    self.request_rejected = Counter("kvjax_request_rejected_chunks",
                                    "Stored chunks rejected while serving requests.", registry=r)
    self.loaded_chunks = Counter("kvjax_store_loaded_chunks", "Chunks loaded, by tier.",
                                 ["tier"], registry=r)
    self.hit_tokens = Counter("kvjax_prefix_cache_hit_tokens_by_tier",
                              "Prompt tokens served from the cache, by tier (device: the device "
                              "prefix cache; else the store tier each chunk was loaded from).",
                              ["tier"], registry=r)
    self.requests = Counter("kvjax_requests", "Finished requests, by endpoint and reason.",
                            ["endpoint", "finish_reason"], registry=r)
    self.errors = Counter("kvjax_request_errors", "Error responses, by status and type.",
                          ["status", "type"], registry=r)
    self.store_warnings = Counter("kvjax_store_warnings",
                                  "Store faults degraded to compute (warnings), by logger.",
                                  ["logger"], registry=r)
    r.register(_StoreCollector(engine_stats, loop_stats))
    if session_stats is not None:
      r.register(_SessionCollector(session_stats))
    self._handler = _WarningCounter(self.store_warnings)
    for name in STORE_LOGGERS:
      logging.getLogger(name).addHandler(self._handler)
    self._lock = threading.Lock()
    self._queried = self._hits = 0

  def close(self) -> None:
    for name in STORE_LOGGERS:
      logging.getLogger(name).removeHandler(self._handler)

  def on_output(self, out: RequestOutput, ttft_s: float | None, elapsed_s: float) -> None:
    """Engine-thread hook: TTFT on the first output, latency and token accounting on the last."""
    if ttft_s is not None:
      self.ttft.observe(ttft_s)
      if out.metrics.prefill_s is not None:
        self.prefill.observe(out.metrics.prefill_s)
    if not out.finished:
      return
    self.e2e.observe(elapsed_s)
    m = out.metrics
    n_prompt = len(out.prompt_token_ids)
    device = m.num_device_cached_tokens
    self.prompt_tokens.labels(source="device").inc(device)
    self.prompt_tokens.labels(source="loaded").inc(m.num_loaded_tokens - device)
    self.prompt_tokens.labels(source="computed").inc(m.num_computed_tokens)
    self.generation_tokens.inc(len(out.token_ids))
    self.prefix_queried.inc(n_prompt)
    self.prefix_hits.inc(out.num_cached_tokens)
    self.request_rejected.inc(m.num_rejected_chunks)
    for tier in m.loaded_from_tiers:
      self.loaded_chunks.labels(tier=str(tier)).inc()
    self.hit_tokens.labels(tier="device").inc(device)
    stored = [t for t in m.loaded_from_tiers if t != "device"]
    for tier in stored:  # every store chunk holds the same number of tokens
      self.hit_tokens.labels(tier=str(tier)).inc((m.num_loaded_tokens - device) / len(stored))
    with self._lock:
      self._queried += n_prompt
      self._hits += out.num_cached_tokens
      self.hit_rate.set(self._hits / self._queried if self._queried else math.nan)

  def render(self) -> bytes:
    return generate_latest(self.registry)
