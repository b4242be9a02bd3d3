"""The books of the real tiers: per-tier counters, persistent tiers' recency and byte mirrors,
and the reads in progress.

`TieredStore` (`kvjax/storage/tiers.py`, reads and writes) and its `TierMover`
(`kvjax/storage/tier_mover.py`, demotions and capacity eviction) both record here, through
narrow calls; neither holds the other's state.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

from kvjax._typing import ChunkHash
from kvjax.storage.eviction import EntryInfo, PlacementPolicy, chain_depths
from kvjax.storage.tier_api import TierStats
from kvjax.storage.types import ChunkRecord


@dataclasses.dataclass(frozen=True)
class PersistentTier:
  """A persistent tier's settings: its byte capacity (None: unbounded) and its eviction policy
  (a part of its own: it keeps the hint)."""

  capacity_bytes: int | None
  policy: PlacementPolicy


@dataclasses.dataclass
class _Recency:
  """A persistent tier's bookkeeping (the ledger's own record)."""

  access: dict[ChunkHash, int] = dataclasses.field(default_factory=dict)
  inserted: dict[ChunkHash, int] = dataclasses.field(default_factory=dict)
  mirror: dict[ChunkHash, int] | None = None  # chunk -> bytes, from records() plus our puts
  evicting: bool = False


def record_nbytes(rec: ChunkRecord) -> int:
  return sum(e.nbytes for e in rec.encodings)


class TierLedger:
  """Counters and bookkeeping of a `TieredStore`'s tiers.

  Owns, under its one lock: each tier's `TierStats`, each persistent tier's recency (access and
  insertion order), byte mirror and eviction flag, and the reads in progress per (tier, chunk).
  Called from the store's event loop (reads, writes, demotions, evictions) and from any thread
  (`stats`).

  Args:
    names: every tier's name, top first.
    persistent: persistent tier name -> its settings.
  """

  def __init__(self, names: Sequence[str], persistent: dict[str, PersistentTier]):
    self._lock = threading.Lock()
    self._stats = {name: TierStats() for name in names}
    self._persistent = dict(persistent)
    self._books = {name: _Recency() for name in persistent}
    self._counter = itertools.count(1)
    self._reading: dict[tuple[str, ChunkHash], int] = {}  # (tier, chunk) -> reads in progress

  # -- counters ---------------------------------------------------------------------------------
  def stats(self) -> dict[str, TierStats]:
    """A snapshot of each tier's counters, by tier name."""
    with self._lock:
      return {k: dataclasses.replace(v, misses=dict(v.misses)) for k, v in self._stats.items()}

  def count(self, tier: str, field: str, n: int = 1) -> None:
    with self._lock:
      s = self._stats[tier]
      setattr(s, field, getattr(s, field) + n)

  def value(self, tier: str, field: str) -> int:
    with self._lock:
      return getattr(self._stats[tier], field)

  def miss(self, tier: str, reason: str) -> None:
    """Counts a failed read of `tier` by its `MissReason` value."""
    with self._lock:
      m = self._stats[tier].misses
      m[reason] = m.get(reason, 0) + 1

  # -- reads in progress ------------------------------------------------------------------------
  def read_started(self, tier: str, chunk_hash: ChunkHash) -> None:
    """A read of `chunk_hash` from `tier` began: the tier does not choose it as a victim."""
    key = (tier, chunk_hash)
    with self._lock:
      self._reading[key] = self._reading.get(key, 0) + 1

  def read_ended(self, tier: str, chunk_hash: ChunkHash) -> None:
    key = (tier, chunk_hash)
    with self._lock:
      n = self._reading.pop(key) - 1
      if n:
        self._reading[key] = n

  def is_reading(self, tier: str, chunk_hash: ChunkHash) -> bool:
    with self._lock:
      return (tier, chunk_hash) in self._reading

  # -- persistent tiers' recency and bytes ------------------------------------------------------
  def touch(self, tier: str, chunk_hash: ChunkHash, *, new: bool = False) -> None:
    """Records an access (and, `new`, an insertion) of a persistent tier's chunk; no-op for
    other tiers."""
    b = self._books.get(tier)
    if b is None:
      return
    with self._lock:
      n = next(self._counter)
      b.access[chunk_hash] = n
      if new:
        b.inserted[chunk_hash] = n

  def forget(self, tier: str, chunk_hash: ChunkHash) -> None:
    """`tier` no longer holds the chunk."""
    b = self._books.get(tier)
    if b is None:
      return
    with self._lock:
      b.access.pop(chunk_hash, None)
      b.inserted.pop(chunk_hash, None)
      if b.mirror is not None:
        b.mirror.pop(chunk_hash, None)

  def wrote(self, tier: str, chunk_hash: ChunkHash, nbytes: int) -> None:
    """A persistent tier published a chunk of about `nbytes` (an estimate until rescanned)."""
    b = self._books.get(tier)
    if b is None:
      return
    with self._lock:
      if b.mirror is not None:
        b.mirror[chunk_hash] = nbytes

  def rescan(self, tier: str) -> None:
    """Forgets `tier`'s byte mirror: its next eviction pass lists its records afresh."""
    with self._lock:
      self._books[tier].mirror = None

  def begin_eviction(self, tier: str) -> bool:
    """Starts an eviction pass of persistent tier `tier`: False (no pass) when it is unbounded,
    a pass is running, or its mirror says it fits."""
    cap, b = self._persistent[tier].capacity_bytes, self._books[tier]
    with self._lock:
      if cap is None or b.evicting:
        return False
      if b.mirror is not None and sum(b.mirror.values()) <= cap:
        return False
      b.evicting = True
      return True

  def eviction_view(self, tier: str, recs: Sequence[ChunkRecord]
                    ) -> tuple[int, list[EntryInfo], set[ChunkHash]] | None:
    """Resets `tier`'s mirror from its listed records; returns (bytes over capacity, the
    policy's view of each record, the chunks being read from it), or None when it fits."""
    cap, b = self._persistent[tier].capacity_bytes, self._books[tier]
    with self._lock:
      b.mirror = {r.chunk_hash: record_nbytes(r) for r in recs}
      total = sum(b.mirror.values())
      if total <= cap:
        return None
      depths = chain_depths({r.chunk_hash: r.parent_hash for r in recs})
      infos = [EntryInfo(r.chunk_hash, r.parent_hash, b.mirror[r.chunk_hash],
                         b.access.get(r.chunk_hash, 0), depths[r.chunk_hash],
                         b.inserted.get(r.chunk_hash, 0)) for r in recs]
      reading = {h for (name, h) in self._reading if name == tier}
    return total - cap, infos, reading

  def end_eviction(self, tier: str) -> bool:
    """Ends `tier`'s eviction pass; True when its mirror says it is still over capacity."""
    cap, b = self._persistent[tier].capacity_bytes, self._books[tier]
    with self._lock:
      b.evicting = False
      return b.mirror is not None and sum(b.mirror.values()) > cap
