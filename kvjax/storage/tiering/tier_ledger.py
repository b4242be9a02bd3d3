"""The books of the real tiers: per-tier counters and the reads in progress.

`TieredStore` (`kvjax/storage/tiering/tiers.py`, reads, writes and the planner's decisions) and its
`TierMover` (`kvjax/storage/tiering/tier_mover.py`, which executes the planner's moves) both record
here, through narrow calls; neither holds the other's state. Where each chunk lives, recency
and bytes per tier are the planner's (`kvjax.storage.tiering.placement.TierHierarchy`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from kvjax._typing import ChunkHash
from kvjax.storage.tiering.tier_api import TierStats


class TierLedger:
  """Counters of a `TieredStore`'s tiers and the reads in progress.

  Owns, under its one lock: each tier's `TierStats` and the reads in progress per (tier,
  chunk). Called from the store's event loop (reads, writes, moves) and from any thread
  (`stats`).

  Args:
    names: every tier's name, top first.
  """

  def __init__(self, names: Sequence[str]):
    self._lock = threading.Lock()
    self._stats = {name: TierStats() for name in names}
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

  def reading(self) -> set[ChunkHash]:
    """The chunks some read is reading now (any tier): the planner does not choose them."""
    with self._lock:
      return {h for _, h in self._reading}
