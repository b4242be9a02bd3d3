"""The connector's look-ahead (CachedAttention, arXiv 2403.19708, section 3.3): the window's and
the pinned sessions' chunks become the store's hint, and chunks only a lower tier holds are
prefetched into the host tier."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
from typing import Any, Sequence

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.connector.lookup import KeyScheme
from kvjax.connector.loop import StoreLoop
from kvjax.connector.records import SAVING, LookaheadRequest, PrefetchStats, PrefixLookup
from kvjax.storage.format import keys

_log = logging.getLogger(__name__)


class Prefetcher:
  """Look-ahead hints and host-tier prefetches.

  Owns: the window and the pins (replaced under its lock by the engine thread and the session
  registry), its accounting (`stats`, under the lock), and, on the store loop only, the hint
  last applied, the prefetches in flight, the chunks prefetched and not yet read or wasted,
  those tried for this window, and the chunks loads are reading now (the loader says so:
  `load_started` / `load_ended`; a prefetch never starts for one, a load promotes what it
  reads). The loader asks `in_flight(key)` before it reads and tells `load_landed` where a
  read came from (a prefetched chunk read from the host tier was useful).

  Args:
    store: the tiered store (`hint`, `prefetch`, `host_capacity`).
    scheme: the key scheme (pinned sessions' keys, tails, origin, layout).
    loop: the connector's event loop.
    prefetch_bytes: prefetch reads' bytes in flight at most (the first never waits); None: 4
      raw chunks.
  """

  def __init__(self, store, scheme: KeyScheme, loop: StoreLoop,
               prefetch_bytes: int | None = None):
    self._store = store
    self._scheme = scheme
    self._loop = loop
    self.prefetch_bytes = (int(prefetch_bytes) if prefetch_bytes is not None
                           else 4 * scheme.layout.nbytes)
    self._lock = threading.Lock()
    self._window: tuple[LookaheadRequest, ...] = ()
    self._pins: tuple[tuple[ChunkHash, ...], ...] = ()
    self._pf = PrefetchStats()
    # The store loop's own (never touched from another thread):
    self._hint_key: tuple | None = None
    self._prefetching: dict[ChunkHash, tuple[asyncio.Task, int]] = {}
    self._prefetched: set[ChunkHash] = set()  # issued, not yet read from the host or wasted
    self._tried: set[ChunkHash] = set()       # started for the current window
    self._loading: collections.Counter = collections.Counter()  # loads reading a chunk now

  # ---------------------------------------------------- the loader's calls (store loop only)
  def in_flight(self, chunk_hash: ChunkHash) -> asyncio.Task | None:
    """The prefetch moving `chunk_hash` up now, or None (a load waits for it, then reads the
    host copy: one read of the lower tier, not two)."""
    pending = self._prefetching.get(chunk_hash)
    return None if pending is None else pending[0]

  def load_started(self, chunk_hash: ChunkHash) -> None:
    """A load began reading `chunk_hash` from the store: no prefetch of it starts meanwhile."""
    self._loading[chunk_hash] += 1

  def load_ended(self, chunk_hash: ChunkHash) -> None:
    self._loading[chunk_hash] -= 1
    if not self._loading[chunk_hash]:
      del self._loading[chunk_hash]

  def load_landed(self, chunk_hash: ChunkHash, tier: str) -> None:
    """A load read `chunk_hash` from `tier`: a prefetched chunk read from the host tier was
    useful."""
    if chunk_hash in self._prefetched and tier == self._host_name():
      self._prefetched.discard(chunk_hash)
      with self._lock:
        self._pf = dataclasses.replace(self._pf, useful=self._pf.useful + 1)

  # -------------------------------------------------------------- the engine's and registry's
  def lookahead_request(self, request_id: Any, lookup: PrefixLookup,
                        prompt_ids: Sequence[int]) -> LookaheadRequest:
    """One request of the look-ahead window from its own lookup: its candidate chunks, where
    each was found, their tokens and their stored bytes (the largest encoding; raw chunks: the
    layout's)."""
    s = self._scheme
    n, c = len(lookup.present), s.chunk_size
    records = lookup.records or [None] * n
    nbytes = tuple(s.layout.nbytes if rec is None or s.codec == codecs.RAW
                   else max(e.nbytes for e in rec.encodings) for rec in records)
    return LookaheadRequest(request_id, lookup.namespace, tuple(lookup.hashes[:n]),
                            tuple(lookup.present), tuple(prompt_ids[:n * c]), nbytes)

  def set_lookahead(self, requests: Sequence[LookaheadRequest]) -> None:
    """Replaces the look-ahead window: its chunks join the store's hint and those only a lower
    tier holds are prefetched into the host tier, on the event loop. Never blocks."""
    with self._lock:
      self._window = tuple(requests)
    self._loop.call_soon(self._refresh)

  def set_pins(self, sessions: Sequence[tuple[str | None, Sequence[int]]]) -> None:
    """Replaces the pinned sessions (see `KVStoreClient.set_pins`). Never blocks on the
    store."""
    s = self._scheme
    host = self._store.host_capacity()
    cap = host[1] // 2 if host is not None and host[1] is not None else None
    pins, used, nb = [], 0, s.layout.nbytes
    for salt, ids in sessions if host is not None else ():
      ns, ids = s.namespace(salt), list(ids)
      hashes = tuple(keys.chunk_hashes(ns, ids))
      if cap is not None and used + len(hashes) * nb > cap:
        continue
      used += len(hashes) * nb
      tail = s.tail_key(ns.root_hash(), hashes, ids, len(ids) - 1) if (
          s.stores_tails and ids) else None
      if tail is not None and (cap is None or used + nb <= cap):
        hashes += (tail[2],)
        used += nb
      pins.append(hashes)
    with self._lock:
      self._pins = tuple(pins)
    self._loop.call_soon(self._refresh)

  def _host_name(self) -> str | None:
    host = self._store.host_capacity()
    return host[0] if host is not None else None

  # ----------------------------------------------------------------------- the store loop's
  def _refresh(self) -> None:
    """Event loop: applies the window and pins as the store's hint (when they changed), counts
    prefetched chunks that left the window unread as wasted, and starts prefetches."""
    with self._lock:
      window, pins = self._window, self._pins
    upcoming = [r.hashes for r in window] + [p for p in pins]
    key = tuple(upcoming)
    if key != self._hint_key:
      self._hint_key = key
      self._store.hint(upcoming)
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
    host = self._store.host_capacity()
    if host is None:
      return
    name, cap = host
    s = self._scheme
    with self._lock:
      window, pins = self._window, self._pins
    room = None if cap is None else cap - len({h for p in pins for h in p}) * s.layout.nbytes
    in_flight = sum(n for _, n in self._prefetching.values())
    seen: set[ChunkHash] = {h for p in pins for h in p}
    need = 0
    for r in window:
      for h, tier, nb, j in zip(r.hashes, r.present, r.nbytes, itertools.count()):
        if tier is None or h in seen:
          continue
        seen.add(h)
        need += nb
        if room is not None and need > room:
          return  # the window's chunks beyond this would not fit the host tier
        if tier in (name, SAVING) or h in self._tried or h in self._loading:
          continue
        if in_flight and in_flight + nb > self.prefetch_bytes:
          return
        c = s.chunk_size
        self._tried.add(h)
        task = self._loop.loop.create_task(self._store.prefetch(
            h, r.token_ids[j * c:(j + 1) * c], r.namespace, s.layout, origin=s.origin))
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

  def wait(self, timeout_s: float | None = None) -> None:
    """Blocks until no prefetch is in flight or startable (tests, benchmarks)."""
    async def idle():
      while self._prefetching:
        await asyncio.wait([t for t, _ in self._prefetching.values()])
    self._loop.run(idle(), timeout_s)

  @property
  def stats(self) -> PrefetchStats:
    """A snapshot of the prefetch accounting (`in_flight` read without the loop: a count)."""
    with self._lock:
      return dataclasses.replace(self._pf, in_flight=len(self._prefetching))
