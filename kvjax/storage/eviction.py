"""Eviction policies for capacity-bounded tiers: which chunks go when room is needed.

A policy sees plain records (`EntryInfo`) and returns victims; the tier deletes them. Policies
are scheduler-aware through `hint`: the engine passes the chunk hashes of the requests in its
look-ahead window, and a hinted chunk is never evicted while the hint stands (CachedAttention,
arXiv 2403.19708, section 3.3: never evict what the window needs).

`LRUPolicy` also follows the prefix structure. A chunk is useful only with its prefix (a request
reads a prefix chain from the root), so CachedAttention (section 3.3) evicts suffix chunks before
the prefix chunks they extend. Here only leaves are candidates: a chunk whose children are all
gone (or being evicted). Evicting a leaf may expose its parent, which then competes on its own
recency:

    root -> A -> B -> C          candidates: C and Y (leaves); A and B wait for C
         \\-> X -> Y              after C goes, B joins; a parent is in effect as recent as
                                  its most recent remaining descendant

Hinted chunks block their ancestors too (a hinted child keeps its parent).
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
from collections.abc import Mapping, Sequence

from kvjax._typing import ChunkHash


@dataclasses.dataclass(frozen=True)
class EntryInfo:
  """What a policy knows about one stored chunk.

  Attributes:
    chunk_hash: the chunk's key.
    parent_hash: the previous chunk's key (the namespace root for a first chunk).
    nbytes: bytes the chunk occupies in the tier.
    last_access: monotonic counter of its last read or write (higher: more recent).
    depth: index of the chunk in its prefix chain among the chunks present in the tier
      (0: its parent is not in the tier); see `chain_depths`.
    inserted: monotonic counter of when it was stored (for FIFO).
  """

  chunk_hash: ChunkHash
  parent_hash: ChunkHash
  nbytes: int
  last_access: int
  depth: int = 0
  inserted: int = 0


def chain_depths(parents: Mapping[ChunkHash, ChunkHash]) -> dict[ChunkHash, int]:
  """Returns each chunk's depth in its prefix chain, counting only chunks present.

  Args:
    parents: chunk hash -> parent hash, for every chunk in the tier.

  Returns:
    chunk hash -> depth: 0 when the parent is absent, else the parent's depth + 1. A parent
    cycle (impossible with chained SHA-256 keys, but not trusted) is cut, so every depth is
    finite.
  """
  depths: dict[ChunkHash, int] = {}
  for start in parents:
    path, seen, h = [], set(), start
    while h in parents and h not in depths and h not in seen:
      seen.add(h)
      path.append(h)
      h = parents[h]
    if h in seen:  # a cycle: break it at h
      depths[h] = 0
    base = depths.get(h, -1) if h in parents else -1
    for x in reversed(path):
      if x not in depths:
        base += 1
        depths[x] = base
      else:
        base = depths[x]
  return depths


class EvictionPolicy(abc.ABC):
  """Chooses victims; holds the current hint set.

  Attributes:
    chain_aware: evict only leaves of the prefix forest (suffixes before prefixes).
  """

  chain_aware: bool = True

  def __init__(self):
    self._hinted: frozenset[ChunkHash] = frozenset()

  @property
  def hinted(self) -> frozenset[ChunkHash]:
    """Chunk hashes of the current hint (never evicted)."""
    return self._hinted

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """Replaces the hint set with the chunks of the upcoming requests.

    Args:
      upcoming: per upcoming request, its chunk hashes (the look-ahead window); an empty
        sequence clears the hint.
    """
    self._hinted = frozenset(h for req in upcoming for h in req)

  @abc.abstractmethod
  def order_key(self, entry: EntryInfo) -> tuple:
    """Sort key among candidates; lowest goes first."""

  def victims(self, entries: Sequence[EntryInfo], need_bytes: int,
              keep: frozenset[ChunkHash] | set[ChunkHash] = frozenset()) -> list[ChunkHash]:
    """Returns chunks to evict, in eviction order, freeing at least `need_bytes`.

    Hinted chunks and `keep` (e.g. chunks a load is reading now) are never chosen, and like
    hinted ones they keep their ancestors. When the other chunks (or, for a chain-aware policy,
    the ones reachable leaf by leaf) cannot free `need_bytes`, all of them are returned: the
    caller compares the freed bytes with what it needs.

    Args:
      entries: every chunk in the tier.
      need_bytes: bytes to free; <= 0 returns [].
      keep: chunks not to choose this time.
    """
    if need_bytes <= 0:
      return []
    hinted = self._hinted | frozenset(keep) if keep else self._hinted
    if not self.chain_aware:
      order = sorted((e for e in entries if e.chunk_hash not in hinted), key=self.order_key)
      return _take(order, need_bytes)
    by_hash = {e.chunk_hash: e for e in entries}
    children = {h: 0 for h in by_hash}
    for e in entries:
      if e.parent_hash in by_hash and e.parent_hash != e.chunk_hash:
        children[e.parent_hash] += 1
    heap = [(self.order_key(e), e.chunk_hash) for e in entries
            if not children[e.chunk_hash] and e.chunk_hash not in hinted]
    heapq.heapify(heap)
    out, freed = [], 0
    while heap and freed < need_bytes:
      _, h = heapq.heappop(heap)
      out.append(h)
      freed += by_hash[h].nbytes
      parent = by_hash[h].parent_hash
      if parent in by_hash and parent != h:
        children[parent] -= 1
        if not children[parent] and parent not in hinted:
          heapq.heappush(heap, (self.order_key(by_hash[parent]), parent))
    return out


def _take(order: Sequence[EntryInfo], need_bytes: int) -> list[ChunkHash]:
  out, freed = [], 0
  for e in order:
    if freed >= need_bytes:
      break
    out.append(e.chunk_hash)
    freed += e.nbytes
  return out


class LRUPolicy(EvictionPolicy):
  """Least recently used first, suffixes before their prefixes, hinted chunks never (default).

  Ties in recency go to the deeper chunk, then to the hash (deterministic).
  CachedAttention, arXiv 2403.19708, section 3.3.
  """

  chain_aware = True

  def order_key(self, entry: EntryInfo) -> tuple:
    return (entry.last_access, -entry.depth, entry.chunk_hash)


class FIFOPolicy(EvictionPolicy):
  """First stored, first evicted; a baseline for bench_sessions.

  Ignores recency and, unless `chain_aware=True`, the prefix structure (so it may evict a prefix
  and keep its suffix, as a plain FIFO cache would). Honors hints if any are given.
  """

  def __init__(self, chain_aware: bool = False):
    super().__init__()
    self.chain_aware = chain_aware

  def order_key(self, entry: EntryInfo) -> tuple:
    return (entry.inserted, -entry.depth, entry.chunk_hash)
