"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Request metrics are updated on the engine thread as outputs appear (`on_output`); store, link,
saver and queue figures are read when `/metrics` is scraped (`_StoreCollector`), by attribute
access only, so an engine without some of them reports what it has. Store warnings (a failed
lookup, read or save, each of which degrades to computing) are counted by a logging handler on
the store's loggers.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvjax.engine import RequestOutput

_log = logging.getLogger(__name__)
#: Loggers whose warnings mean a store fault that was degraded to computing.
STORE_LOGGERS = ("kvjax.engine.kv_store_client", "kvjax.storage")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _WarningCounter(logging.Handler):
  def __init__(self, counter: Counter):
    super().__init__(logging.WARNING)
    self._counter = counter

  def emit(self, record: logging.LogRecord) -> None:
    self._counter.labels(logger=record.name).inc()


class _StoreCollector(Collector):
  """Reads store, link, saver and engine-loop counters at scrape time."""

  def __init__(self, kv_store: Any, loop_stats: Any):
    self._kv_store = kv_store
    self._loop_stats = loop_stats

  def collect(self):
    stats = self._loop_stats
    if stats is not None:
      yield GaugeMetricFamily("kvjax_num_requests_waiting",
                              "Requests queued in the engine without a slot.", stats.waiting)
      yield GaugeMetricFamily("kvjax_num_requests_running", "Requests holding a decode slot.",
                              stats.running)
      yield CounterMetricFamily("kvjax_engine_step_failures", "Engine steps that raised.",
                                stats.step_failures)
      yield CounterMetricFamily("kvjax_aborted_requests",
                                "Unfinished requests aborted (client gone).", stats.aborted)
    if self._kv_store is None:
      return
    store = getattr(self._kv_store, "store", None)
    rejected = CounterMetricFamily("kvjax_store_rejected_chunks",
                                   "Stored chunks read but rejected, by tier and reason.",
                                   labels=["tier", "reason"])
    try:
      for tier, s in (getattr(store, "stats", None) or {}).items():
        for reason, n in getattr(s, "misses", {}).items():
          if reason != "absent":
            rejected.add_metric([tier, reason], n)
    except Exception:  # noqa: BLE001 - a scrape must not fail on a store in flux
      _log.exception("reading tier stats failed")
    yield rejected
    read = CounterMetricFamily("kvjax_store_read_bytes",
                               "Bytes of verified chunk reads, by tier (tiers that count them).",
                               labels=["tier"])
    for tier in getattr(store, "tiers", []):
      snap = getattr(getattr(tier, "stats", None), "snapshot", None)
      if callable(snap):
        read.add_metric([getattr(tier, "name", "?")], snap().get("bytes_read", 0))
    yield read
    rate = GaugeMetricFamily("kvjax_link_bandwidth_bytes_per_second",
                             "Emulated link rate now, by tier (+Inf: unlimited).",
                             labels=["tier"])
    granted = CounterMetricFamily("kvjax_link_granted_bytes",
                                  "Bytes the link limiter let through, by tier (rate() of it is "
                                  "the bandwidth in use).", labels=["tier"])
    for name, limiter in (getattr(store, "limiters", None) or {}).items():
      rate.add_metric([name], float(limiter.current_rate()))
      granted.add_metric([name], getattr(limiter, "bytes_granted", 0))
    yield rate
    yield granted
    saver = getattr(self._kv_store, "saver_stats", None)
    if saver is not None:
      fam = CounterMetricFamily("kvjax_kv_saver", "Asynchronous KV saves, by outcome.",
                                labels=["outcome"])
      for field in ("jobs_done", "chunks_saved", "chunks_already_stored", "jobs_dropped",
                    "failures"):
        fam.add_metric([field], getattr(saver, field, 0))
      yield fam


class ServeMetrics:
  """The server's metrics.

  Args:
    kv_store: the engine's store client (or None): scraped for tier, link and saver counters.
    loop_stats: `AsyncEngine.stats` (queue depth, running, failures), or None.
  """

  def __init__(self, kv_store: Any = None, loop_stats: Any = None):
    self.registry = r = CollectorRegistry()
    self.ttft = Histogram("kvjax_time_to_first_token_seconds",
                          "Submission to the engine (after tokenizing) to first token, seconds.",
                          registry=r, buckets=_TTFT_BUCKETS)
    self.e2e = Histogram("kvjax_e2e_request_latency_seconds",
                         "Submission to the engine to the last token, seconds.", registry=r,
                         buckets=_TTFT_BUCKETS)
    self.prompt_tokens = Counter("kvjax_prompt_tokens",
                                 "Prompt tokens of finished requests, by how their KV was made.",
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
    self.requests = Counter("kvjax_requests", "Finished requests, by endpoint and reason.",
                            ["endpoint", "finish_reason"], registry=r)
    self.errors = Counter("kvjax_request_errors", "Error responses, by status and type.",
                          ["status", "type"], registry=r)
    self.store_warnings = Counter("kvjax_store_warnings",
                                  "Store faults degraded to compute (warnings), by logger.",
                                  ["logger"], registry=r)
    r.register(_StoreCollector(kv_store, loop_stats))
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
    if not out.finished:
      return
    self.e2e.observe(elapsed_s)
    m = out.metrics
    n_prompt = len(out.prompt_token_ids)
    loaded = getattr(m, "num_loaded_tokens", 0) or 0
    self.prompt_tokens.labels(source="loaded").inc(loaded)
    self.prompt_tokens.labels(source="computed").inc(getattr(m, "num_computed_tokens", 0) or 0)
    self.generation_tokens.inc(len(out.token_ids))
    self.prefix_queried.inc(n_prompt)
    self.prefix_hits.inc(out.num_cached_tokens)
    self.request_rejected.inc(getattr(m, "num_rejected_chunks", 0) or 0)
    for tier in getattr(m, "loaded_from_tiers", None) or []:
      self.loaded_chunks.labels(tier=str(tier)).inc()
    with self._lock:
      self._queried += n_prompt
      self._hits += out.num_cached_tokens
      self.hit_rate.set(self._hits / self._queried if self._queried else math.nan)

  def render(self) -> bytes:
    return generate_latest(self.registry)
