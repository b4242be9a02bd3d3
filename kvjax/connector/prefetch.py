"""The connector's look-ahead (CachedAttention, arXiv 2403.19708, section 3.3): the window's and
the pinned sessions' chunks become the store's hint, and chunks only a lower tier holds are
prefetched into the host tier."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from typing import Any, Sequence

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.connector.records import SAVING, LookaheadRequest, PrefetchStats, PrefixLookup
from kvjax.storage import keys

_log = logging.getLogger(__name__)


class PrefetchMixin:
  """Look-ahead hints and prefetches of `KVStoreClient` (`kvjax/connector/client.py` owns
  the state)."""

  def lookahead_request(self, request_id: Any, lookup: PrefixLookup,
                        prompt_ids: Sequence[int]) -> LookaheadRequest:
    """One request of the look-ahead window from its own lookup: its candidate chunks, where
    each was found, their tokens and their stored bytes (the largest encoding; raw chunks: the
    layout's)."""
    n, c = len(lookup.present), self.chunk_size
    records = lookup.records or [None] * n
    nbytes = tuple(self.layout.nbytes if rec is None or self.codec == codecs.RAW
                   else max(e.nbytes for e in rec.encodings) for rec in records)
    return LookaheadRequest(request_id, lookup.namespace, tuple(lookup.hashes[:n]),
                            tuple(lookup.present), tuple(prompt_ids[:n * c]), nbytes)

  def set_lookahead(self, requests: Sequence[LookaheadRequest]) -> None:
    """Replaces the look-ahead window (the engine calls it when the scheduler's window
    changed): its chunks join the store's hint and those only a lower tier holds are
    prefetched into the host tier, on the event loop. Never blocks."""
    with self._lock:
      self._window = tuple(requests)
    self._loop.call_soon_threadsafe(self._refresh)

  def set_pins(self, sessions: Sequence[tuple[str | None, Sequence[int]]]) -> None:
    """Replaces the pinned sessions: per session, most important first, its `cache_salt` and
    exact token ids (its last turn's prompt and output). Their full chunks join the store's
    hint (never evicted), as many whole sessions as fit half the host tier (the other half is
    the window's), each with its stored tail (`stores_tails`, a chunk's bytes) while that fits
    too. The session registry owns which sessions are pinned (`SessionRegistry.pinned`). Never
    blocks on the store. Without a host tier nothing is pinned: pins keep sessions in the host
    tier, and a persistent tier's own LRU order keeps recent sessions (pinning there would let
    open sessions hold a bounded store over its capacity)."""
    host = self.store.host_capacity()
    cap = host[1] // 2 if host is not None and host[1] is not None else None
    pins, used, nb = [], 0, self.layout.nbytes
    for salt, ids in sessions if host is not None else ():
      ns, ids = self.namespace(salt), list(ids)
      hashes = tuple(keys.chunk_hashes(ns, ids))
      if cap is not None and used + len(hashes) * nb > cap:
        continue
      used += len(hashes) * nb
      tail = self.tail_key(ns.root_hash(), hashes, ids, len(ids) - 1) if (
          self.stores_tails and ids) else None
      if tail is not None and (cap is None or used + nb <= cap):
        hashes += (tail[2],)
        used += nb
      pins.append(hashes)
    with self._lock:
      self._pins = tuple(pins)
    self._loop.call_soon_threadsafe(self._refresh)

  def _host_name(self) -> str | None:
    host = self.store.host_capacity()
    return host[0] if host is not None else None

  def _refresh(self) -> None:
    """Event loop: applies the window and pins as the store's hint (when they changed), counts
    prefetched chunks that left the window unread as wasted, and starts prefetches."""
    with self._lock:
      window, pins = self._window, self._pins
    upcoming = [r.hashes for r in window] + [p for p in pins]
    key = tuple(upcoming)
    if key != self._hint_key:
      self._hint_key = key
      self.store.hint(upcoming)
    wanted = {h for r in window for h in r.hashes}
    gone = self._prefetched - wanted
    self._prefetched -= gone
    self._tried &= wanted
    with self._lock:
      self._pf = dataclasses.replace(
          self._pf, wasted=self._pf.wasted + len(gone),
          hinted_chunks=len({h for hs in upcoming for h in hs}),
          pinned_chunks=len({h for hs in pins for h in hs}))
    self._fill_prefetch()

  def _fill_prefetch(self) -> None:
    """Event loop: starts prefetches of windowed chunks that only a lower tier holds, in window
    order, while the window's chunks (and the pinned ones) fit the host tier and the bytes in
    flight stay within `prefetch_bytes`."""
    host = self.store.host_capacity()
    if host is None:
      return
    name, cap = host
    with self._lock:
      window, pins = self._window, self._pins
    room = None if cap is None else cap - len({h for p in pins for h in p}) * self.layout.nbytes
    in_flight = sum(n for _, n in self._prefetching.values())
    seen: set[ChunkHash] = {h for p in pins for h in p}
    loading = self._store_reads  # a load reads them from its tier now and promotes them
    need = 0
    for r in window:
      for h, tier, nb, j in zip(r.hashes, r.present, r.nbytes, itertools.count()):
        if tier is None or h in seen:
          continue
        seen.add(h)
        need += nb
        if room is not None and need > room:
          return  # the window's chunks beyond this would not fit the host tier
        if tier in (name, SAVING) or h in self._tried or h in loading:
          continue
        if in_flight and in_flight + nb > self.prefetch_bytes:
          return
        c = self.chunk_size
        self._tried.add(h)
        task = self._loop.create_task(self.store.prefetch(
            h, r.token_ids[j * c:(j + 1) * c], r.namespace, self.layout, origin=self.origin))
        self._prefetching[h] = (task, nb)
        in_flight += nb
        with self._lock:
          self._pf = dataclasses.replace(self._pf, started=self._pf.started + 1)
        task.add_done_callback(lambda t, h=h: self._prefetch_done(h, t))

  def _prefetch_done(self, chunk_hash: ChunkHash, task: asyncio.Task) -> None:
    self._prefetching.pop(chunk_hash, None)
    err = None if task.cancelled() else task.exception()
    if err is not None:  # a failed prefetch only costs the read: the load falls through
      _log.warning("prefetch of a KV chunk failed: %r", err)
    copied = not task.cancelled() and err is None and task.result() is not None
    if copied:
      with self._lock:
        still = any(chunk_hash in r.hashes for r in self._window)
        self._pf = dataclasses.replace(self._pf, issued=self._pf.issued + 1,
                                       wasted=self._pf.wasted + (not still))
      if still:
        self._prefetched.add(chunk_hash)
    self._fill_prefetch()

  def wait_prefetches(self, timeout_s: float | None = None) -> None:
    """Blocks until no prefetch is in flight or startable (tests, benchmarks)."""
    async def idle():
      while self._prefetching:
        await asyncio.wait([t for t, _ in self._prefetching.values()])
    asyncio.run_coroutine_threadsafe(idle(), self._loop).result(timeout_s or self._timeout_s)

  @property
  def prefetch_stats(self) -> PrefetchStats:
    """A snapshot of the look-ahead prefetch accounting."""
    with self._lock:
      return dataclasses.replace(self._pf, in_flight=len(self._prefetching))

