"""The connector's load pipeline: queued background loads of stored prefix chunks, read and
verified on the store's event loop, staged until the scheduler plans their insertion."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import threading
import time
from typing import Any, Sequence

import numpy as np

from kvjax import codecs
from kvjax.connector.device import DeviceSeam, decode_on_device, held_nbytes
from kvjax.connector.lookup import KeyScheme
from kvjax.connector.loop import StoreLoop
from kvjax.connector.prefetch import Prefetcher
from kvjax.connector.records import LoaderStats, Pending, PrefixLookup, TierSnapshot
from kvjax.connector.saver import Saver
from kvjax.scheduler.output import LoadReport
from kvjax.storage.format import codecs as storage_codecs
from kvjax.storage.format import entropy, keys
from kvjax.storage.format.types import ChunkHit, ChunkMiss, MissReason


class Loader:
  """Background loads: queue, reads in flight, staged chunks, their reports and accounting.

  Owns, under its own lock: the queue of loads not started, the reads in flight and the
  landed chunks staged for insertion (`staging_bytes` bounds both), the reports not yet taken
  (`landed`), the bytes loaded per tier and `loader_stats`. Called from the engine thread
  (`start`, `landed`, `take`, `release`, `cancel`); reads run and land on the store loop
  (`_read`, `_on_land`), device entropy decodes on a worker thread. A read waits for the
  chunk's prefetch (`Prefetcher.in_flight`) and its save (`Saver.pending`) first, and tells
  the prefetcher what it reads (`load_started`, `load_ended`, `load_landed`).

  Args:
    store: the tiered store.
    scheme: the key scheme (layout, origin).
    loop: the connector's event loop.
    device: the runner's device seam (entropy decode, staged device bytes).
    saver: the saver (loads of a key being saved wait for its write).
    prefetcher: the look-ahead prefetcher.
    staging_bytes: stored bytes of reads in flight plus landed chunks not yet inserted, at most
      (a read that would pass it waits; the first never does).
    kvtc_transform_id: the 16-byte identity of this model's kvtc transform, or None; a kvtc
      chunk coded with another (or any, when None) is a miss (`MissReason.UNKNOWN_CODEC`).
  """

  def __init__(self, store, scheme: KeyScheme, loop: StoreLoop, device: DeviceSeam,
               saver: Saver, prefetcher: Prefetcher, *, staging_bytes: int = 1 << 30,
               kvtc_transform_id: bytes | None = None):
    self._store = store
    self._scheme = scheme
    self._loop = loop
    self._device = device
    self._saver = saver
    self._prefetcher = prefetcher
    self.staging_bytes = staging_bytes
    self.kvtc_transform_id = kvtc_transform_id
    self._lock = threading.Lock()
    self._stats = LoaderStats()
    self._queue: collections.deque[Pending] = collections.deque()
    self._reading: dict[tuple[Any, int], Pending] = {}
    self._staged: dict[tuple[Any, int], ChunkHit] = {}
    self._reports: list[LoadReport] = []
    self._reported = threading.Event()
    self._idle = threading.Condition(self._lock)  # notified when nothing is queued or reading
    self._last_done_s = -math.inf
    self._loaded_by_tier: dict[str, tuple[int, int]] = {}
    self._busy_since_s = 0.0

  def start(self, request_id: Any, index: int, lookup: PrefixLookup,
                 prompt_ids: Sequence[int], *, choose=None, nbytes: int = 0,
                 max_in_flight: int = 2, layer_start: int = 0) -> None:
    """Queues a background load of prompt chunk `index`; its `LoadReport` comes from `landed()`.

    Loads of one tier run in the order they were queued (the scheduler queues them in its
    priority order: a request's reads never pass those of a request queued before it on the
    same link), each request's `max_in_flight` at a time, and the next starts the moment one
    lands (on the store's event loop, not at the engine's next step), while the staged and
    reading bytes stay within `staging_bytes`. The read, verification and
    entropy decoding run on the event loop (tensorstore async reads; the link and byte limiters
    bound them). Never blocks the caller.

    Args:
      request_id: the owner; `cancel(request_id)` drops its loads.
      index: chunk index within the prompt; the lookup's stored tail when it is
        `lookup.tail.index`.
      lookup: the prompt's `PrefixLookup`.
      prompt_ids: the prompt's tokens.
      choose: optional `Callable[[Sequence[Encoding]], Encoding | None]` picking the encoding
        (codec level) to read.
      nbytes: the planner's stored bytes for it (for the staging budget).
      max_in_flight: the request's reads at once, >= 1.
      layer_start: 0, or k > 0 to read layers `[k, L)` alone (`LoadItem.layer_start`; the
        store reads and verifies those layers' bytes and the staged hit holds them,
        `ChunkHit.layer_start`).
    """
    c = self._scheme.chunk_size
    tail = lookup.tail
    if tail is not None and index == tail.index:  # the stored tail, padded to C ids
      key, tokens = tail.chunk_hash, keys.tail_token_ids(
          prompt_ids[index * c:index * c + tail.num_tokens], c)
    else:
      key, tokens = lookup.hashes[index], tuple(prompt_ids[index * c:(index + 1) * c])
    tier = tail.tier if tail is not None and index == tail.index else (
        lookup.present[index] if index < len(lookup.present) else None)
    item = Pending(request_id, index, key, tokens, lookup.namespace, choose,
                    int(nbytes) or self._scheme.layout.nbytes, max(1, int(max_in_flight)),
                    layer_start=int(layer_start), tier=tier)
    with self._lock:
      self._queue.append(item)
    self._pump()

  def _pump(self) -> None:
    """Starts queued reads in order while per-request concurrency and the staging budget allow.

    A read waits for the earlier reads of its request and for those of its tier queued before
    it: a tier's link serves the requests in the order their loads were queued, where letting a
    later request's reads start beside a waiting one would split the link's bandwidth between
    them and delay both. A read of another tier passes (its link is another). The byte budget
    never blocks the first read (no deadlock when one chunk exceeds it).
    """
    with self._lock:
      reading_of = collections.Counter(k[0] for k in self._reading)
      held = self._stats.staged_bytes + sum(p.nbytes for p in self._reading.values())
      waiting_tiers: set[str | None] = set()  # a read of these waits in the queue
      for item in list(self._queue):
        if item.tier in waiting_tiers or reading_of[item.request_id] >= item.max_in_flight:
          waiting_tiers.add(item.tier)
          continue
        if held and held + item.nbytes > self.staging_bytes:
          break
        self._queue.remove(item)
        now = time.perf_counter()
        if not self._reading:
          self._busy_since_s = now
        item.started_s = now
        self._reading[(item.request_id, item.index)] = item
        reading_of[item.request_id] += 1
        held += item.nbytes
        self._stats.started += 1
        item.future = self._loop.submit(self._read(item))

  async def _read(self, item: Pending) -> None:
    prefetch = self._prefetcher.in_flight(item.chunk_hash)
    if prefetch is not None:  # its prefetch is moving it up: read the host copy it makes
      await asyncio.wait({prefetch})
    saving = self._saver.pending(item.chunk_hash)
    if saving is not None:  # found while its save was queued or being written: wait for it
      # (on the loop, no worker thread: the write itself needs one; shielded, so a cancelled
      # load never cancels the future other loads of the key wait on)
      await asyncio.shield(asyncio.wrap_future(saving))
    self._prefetcher.load_started(item.chunk_hash)  # no prefetch of it starts meanwhile
    try:
      got = await self._store.get(item.chunk_hash, item.token_ids, item.namespace,
                                  self._scheme.layout, origin=self._scheme.origin,
                                  layer_start=item.layer_start,
                                  **({"choose": item.choose} if item.choose is not None else {}))
    except Exception as e:  # noqa: BLE001 - a failed read is a miss, never a user error
      got = ChunkMiss(item.chunk_hash, MissReason.READ_ERROR, repr(e))
    finally:
      self._prefetcher.load_ended(item.chunk_hash)
    got = self._check_transform(got)
    if isinstance(got, ChunkHit) and any(isinstance(a, entropy.RansCodes)
                                         for a in got.payload.values()):
      try:
        got = await asyncio.to_thread(self._decode_on_device, got)
      except Exception as e:  # noqa: BLE001 - a failed decode is a miss, never a user error
        got = ChunkMiss(item.chunk_hash, MissReason.READ_ERROR, f"device entropy decode: {e!r}")
    self._on_land(item, got, time.perf_counter())

  def warmup_entropy(self, codec: str, level: int, arrays) -> None:
    """Compiles the device entropy decoder a landed chunk of this layout would use: codes
    `arrays` (a host payload of `codec`, e.g. of a zero chunk) into stored bytes, reads them
    back as the store does and decodes what the reader left coded. No-op for codecs the reader
    decodes on the host.

    Raises:
      ValueError: a payload that does not match the layout; RuntimeError: the decode failed.
    """
    layout = self._scheme.layout
    blob = storage_codecs.encode_payload(codec, level, arrays, layout)
    payload = storage_codecs.decode_payload(codec, storage_codecs.CURRENT_VERSION[codec], level,
                                            blob, layout, defer_entropy=True)
    for name, a in payload.items():
      if isinstance(a, entropy.RansCodes) and not self._rans_decode(a)[1]:
        raise RuntimeError(f"warming up the device entropy decoder: {name} did not decode")

  def _rans_decode(self, a: entropy.RansCodes):
    """(codes on the device, ok: bool) of one array the reader left rANS-coded (the runner's
    device seam, `DeviceSeam.decode_entropy`).

    Raises:
      ValueError: band arrays that do not fit together."""
    return self._device.decode_entropy(a)

  def _decode_on_device(self, got: ChunkHit) -> ChunkHit | ChunkMiss:
    """Decodes every entropy-coded array of a landed chunk on the device
    (`kvjax.connector.device.decode_on_device`); a failed `ok` check is a CORRUPT miss."""
    with self._lock:
      self._stats.device_decoded += 1
    return decode_on_device(got, self._device)

  def _check_transform(self, got: ChunkHit | ChunkMiss) -> ChunkHit | ChunkMiss:
    """A kvtc hit coded with another transform than this model's becomes a miss."""
    if not isinstance(got, ChunkHit) or got.encoding.codec != codecs.KVTC:
      return got
    tid = got.payload.get("transform_id") if isinstance(got.payload, dict) else None
    if tid is None or self.kvtc_transform_id is None or (
        bytes(np.asarray(tid, np.uint8)) != self.kvtc_transform_id):
      return ChunkMiss(got.record.chunk_hash, MissReason.UNKNOWN_CODEC,
                       "kvtc chunk coded with another transform")
    return got

  def _on_land(self, item: Pending, got: ChunkHit | ChunkMiss, done_s: float) -> None:
    key = (item.request_id, item.index)
    with self._lock:
      if self._reading.get(key) is not item:
        return  # its request ended meanwhile: drop it
      del self._reading[key]
      self._notify_if_idle()
      ok = isinstance(got, ChunkHit)
      nbytes = int(got.nbytes) if ok else 0
      link_s = max(0.0, done_s - max(item.started_s, self._last_done_s))
      self._last_done_s = max(self._last_done_s, done_s)
      if not self._reading:
        self._stats.link_busy_s += done_s - self._busy_since_s
      self._stats.landed += 1
      self._stats.read_bytes += nbytes
      if ok:
        b, n = self._loaded_by_tier.get(got.tier, (0, 0))
        self._loaded_by_tier[got.tier] = (b + nbytes, n + 1)
        self._prefetcher.load_landed(item.chunk_hash, got.tier)
      if ok and not item.released:
        self._staged[key] = got
        self._stats.staged_bytes += held_nbytes(got, self._device)
      self._reports.append(LoadReport(
          request_id=item.request_id, index=item.index, ok=ok, nbytes=nbytes,
          tier=got.tier if ok else "",
          encoding=f"{got.encoding.codec}/{got.encoding.level}" if ok else None,
          started_s=item.started_s, done_s=done_s, link_s=link_s,
          reason="" if ok else got.reason.value))
      self._reported.set()
    self._pump()

  def landed(self, wait_s: float | None = None) -> list[LoadReport]:
    """Takes the reports of every load that finished since the last call (`started_s` and
    `done_s` on `time.perf_counter`; the engine moves them onto its clock,
    `KVLoads.landed`).

    Args:
      wait_s: if none has finished, block up to this long for one (None: do not block).
    """
    if wait_s is not None and wait_s > 0 and not self._reports:
      self._reported.wait(wait_s)
    with self._lock:
      out, self._reports = self._reports, []
      self._reported.clear()
    return out

  def take(self, request_id: Any, index: int) -> ChunkHit:
    """Hands over a staged chunk for insertion (its staging is released).

    Raises:
      KeyError: if the chunk is not staged (a planner bug).
    """
    with self._lock:
      hit = self._staged.pop((request_id, index))
      self._stats.staged_bytes -= held_nbytes(hit, self._device)
    self._pump()
    return hit

  def release(self, request_id: Any, index: int) -> None:
    """The scheduler no longer wants chunk `index`'s load: a queued one never starts (reported
    as a miss, reason "released"), a reading one is dropped when it lands, a staged one is freed.
    Idempotent."""
    key = (request_id, index)
    with self._lock:
      queued = next((p for p in self._queue if (p.request_id, p.index) == key), None)
      if queued is not None:
        self._queue.remove(queued)
        self._stats.cancelled += 1
        self._reports.append(LoadReport(request_id, index, ok=False, nbytes=0,
                                        reason="released"))
        self._reported.set()
        self._notify_if_idle()
      elif key in self._reading:
        self._reading[key].released = True
      elif key in self._staged:
        self._stats.staged_bytes -= held_nbytes(self._staged.pop(key), self._device)
        self._stats.released_staged += 1
    self._pump()

  def cancel(self, request_id: Any) -> int:
    """Drops every queued, reading and staged load of the request (no reports); returns how
    many."""
    with self._lock:
      queued = [p for p in self._queue if p.request_id == request_id]
      for p in queued:
        self._queue.remove(p)
      reading = [k for k in self._reading if k[0] == request_id]
      for k in reading:
        self._reading.pop(k).future.cancel()
      staged = [k for k in self._staged if k[0] == request_id]
      for k in staged:
        self._stats.staged_bytes -= held_nbytes(self._staged.pop(k), self._device)
      self._reports = [r for r in self._reports if r.request_id != request_id]
      n = len(queued) + len(reading) + len(staged)
      self._stats.cancelled += len(queued) + len(reading)
      self._stats.abandoned_reads += len(reading)
      self._stats.released_staged += len(staged)
      self._notify_if_idle()
    self._pump()
    return n

  def _is_idle(self) -> bool:
    """Nothing is queued or reading (the caller holds the lock)."""
    return not self._queue and not self._reading

  def _notify_if_idle(self) -> None:
    """Wakes `wait_idle` when the loader is idle (the caller holds the lock)."""
    if self._is_idle():
      self._idle.notify_all()

  def wait_idle(self, timeout_s: float) -> bool:
    """Blocks until no load is queued or reading (every load started so far has landed, failed,
    or been released or cancelled); False if `timeout_s` passed first."""
    with self._idle:
      return self._idle.wait_for(self._is_idle, timeout_s)

  def in_flight(self, request_id: Any = None) -> int:
    """Loads queued or reading (of one request, or all)."""
    with self._lock:
      if request_id is None:
        return len(self._queue) + len(self._reading)
      return (sum(1 for p in self._queue if p.request_id == request_id)
              + sum(1 for k in self._reading if k[0] == request_id))

  def tier_snapshots(self) -> tuple[TierSnapshot, ...]:
    """Per-tier counters (misses, loaded bytes, link limiter), plain data."""
    stats = self._store.stats
    out = []
    with self._lock:
      loaded = dict(self._loaded_by_tier)
    for tier in self._store.tiers:
      s = stats.get(tier.name)
      limiter = self._store.limiters.get(tier.name)
      nbytes, nchunks = loaded.get(tier.name, (0, 0))
      out.append(TierSnapshot(
          tier.name, dict(s.misses) if s is not None else {}, nbytes, nchunks,
          float(limiter.current_rate()) if limiter is not None else None,
          int(limiter.bytes_granted) if limiter is not None else 0,
          s.hits if s is not None else 0, s.evictions if s is not None else 0,
          s.promotions if s is not None else 0, s.demotions_in if s is not None else 0,
          s.demotions_out if s is not None else 0, s.demotion_drops if s is not None else 0,
          s.bytes_written if s is not None else 0))
    return tuple(out)

  @property
  def stats(self) -> LoaderStats:
    """A snapshot of the load accounting."""
    with self._lock:
      return dataclasses.replace(self._stats, queued=len(self._queue),
                                 in_flight=len(self._reading))
