"""The one placement policy: which chunks go when a tier needs room, and what the window keeps.

A policy (`PlacementPolicy`: its order and flags) parametrizes the one tier engine, the
placement planner `kvjax.storage.tiering.placement.TierHierarchy`, which the session simulator
(`kvjax.testing.session_sim`) and the real tiers (`kvjax.storage.tiering.tiers.TieredStore`, whose
mover executes its moves) both run; its victims are chosen with the one leaf-first function
(`leaf_first`) over chained hashes. `PlacementPolicy.victims` serves a `HostMemoryTier` used
alone (outside a store).

Used alone, policies are scheduler-aware through `hint`: a window-aware policy never evicts a
hinted chunk while the hint stands (CachedAttention, arXiv 2403.19708, section 3.3: never evict
what the window needs). In the planner the window ranks chunks instead: one is displaced only
by a chunk needed sooner (`kvjax/storage/tiering/placement.py`).

A chain-aware policy follows the prefix structure. A chunk is useful only with its prefix (a
request reads a prefix chain from the root), so CachedAttention (section 3.3) evicts suffix
chunks before the prefix chunks they extend. Only leaves are candidates: a chunk whose children
are all gone (or being evicted). Evicting a leaf may expose its parent, which then competes on
its own order (`leaf_first`):

    root -> A -> B -> C          candidates: C and Y (leaves); A and B wait for C
         \\-> X -> Y              after C goes, B joins; a parent is in effect as recent as
                                  its most recent remaining descendant

Hinted chunks block their ancestors too (a hinted child keeps its parent).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from kvjax._typing import ChunkHash

__all__ = ["POLICIES", "Candidate", "EntryInfo", "FIFOPolicy", "LRUPolicy", "LeafFirst", "LookaheadPolicy",
           "NoCache", "PlacementPolicy", "chain_depths", "leaf_first", "make_policy"]

_E = TypeVar("_E")


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

  @property
  def key(self) -> ChunkHash:
    """`chunk_hash`, as `leaf_first` reads a candidate."""
    return self.chunk_hash

  @property
  def parent(self) -> ChunkHash:
    """`parent_hash`, as `leaf_first` reads a candidate."""
    return self.parent_hash


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


class LeafFirst:
  """The outcome of `leaf_first` (mutable: a later call may continue it).

  Attributes:
    chosen: the victims, in eviction order.
    gone: their keys.
    freed: their bytes.
    waiting: candidates passed over as non-leaves and not taken, in candidate order (key ->
      candidate).
  """

  __slots__ = ("chosen", "gone", "freed", "waiting")

  def __init__(self):
    self.chosen: list[Any] = []
    self.gone: set[Hashable] = set()
    self.freed = 0
    self.waiting: dict[Hashable, Any] = {}


class Candidate(Protocol):
  """What `leaf_first` reads of a chunk (`EntryInfo` and the planner's entries have it)."""

  @property
  def key(self) -> Hashable:
    """The chunk's key (e.g. its chained hash)."""

  @property
  def parent(self) -> Hashable | None:
    """Its prefix chunk's key (None, or a key that is no candidate, for a first chunk)."""

  @property
  def nbytes(self) -> int:
    """Bytes it frees."""


def leaf_first(candidates: Iterable[_E], need: int,
               is_leaf: Callable[[_E, set[Hashable]], bool] | None,
               state: LeafFirst | None = None) -> LeafFirst:
  """The one leaf-first victim choice over chained hashes (CachedAttention, arXiv 2403.19708,
  section 3.3: suffixes before the prefixes they extend).

  Walks `candidates` in their order (the policy's: least recent first, farthest next use first,
  ...) until `need` bytes are freed. A leaf is taken; a candidate that is not a leaf yet waits,
  and is taken right after the last of its cached children goes (it then precedes every later
  candidate, as if it had been as recent as that child). Candidates are pulled lazily: none is
  pulled once `need` is met.

  Args:
    candidates: the chunks that may go (`Candidate`s: key, parent key, bytes), in eviction
      order; chunks that must stay are left out (if they extend a candidate, `is_leaf` keeps
      that candidate). The planner passes every chunk and lets non-leaves wait here;
      `PlacementPolicy.victims` passes the leaves only, adding a parent when its last child
      has gone (the same order, without keying chunks that are never reached).
    need: bytes to free; nothing is taken once `state.freed >= need`.
    is_leaf: `(candidate, gone keys) -> bool`: no cached chunk outside `gone` extends it; None
      ignores the prefix structure (every candidate is a leaf).
    state: a previous call's result to continue (its `gone` and `freed` count); default fresh.

  Returns:
    The victims (`chosen`, possibly freeing less than `need`: the caller checks `freed`), and
    the candidates that were passed over as non-leaves (`waiting`).
  """
  st = state if state is not None else LeafFirst()
  waiting: dict[Hashable, _E] = {}
  chosen, gone, freed = st.chosen, st.gone, st.freed
  if freed < need:
    for e in candidates:  # pulled one at a time: none once `need` is met
      if is_leaf is not None and not is_leaf(e, gone):
        waiting[e.key] = e
        continue
      chosen.append(e)
      gone.add(e.key)
      freed += e.nbytes
      p = e.parent
      while freed < need and p in waiting and is_leaf(waiting[p], gone):
        pe = waiting.pop(p)  # passed over earlier, so it comes before anything still queued
        chosen.append(pe)
        gone.add(pe.key)
        freed += pe.nbytes
        p = pe.parent
      if freed >= need:
        break
  st.freed = freed
  st.waiting = waiting
  return st


class PlacementPolicy:
  """What a policy decides; a mover (`TierHierarchy`, a tier) carries it out.

  Attributes:
    name: the registry name (`POLICIES`).
    caches: stores anything at all.
    window_aware: the look-ahead window (`hint`, `TierHierarchy.lookahead`) protects chunks
      from eviction.
    prefetches: the planner promotes window chunks toward the top tier.
    chain_aware: suffixes are evicted before the prefixes they extend (`leaf_first`).

  Args:
    chain_aware, window_aware: override the class defaults (None: keep them).
  """

  name = ""
  caches = True
  window_aware = True
  prefetches = False
  chain_aware = True

  def __init__(self, *, chain_aware: bool | None = None, window_aware: bool | None = None):
    if chain_aware is not None:
      self.chain_aware = chain_aware
    if window_aware is not None:
      self.window_aware = window_aware
    self._hinted: frozenset[ChunkHash] = frozenset()

  def order(self, last_access: int, inserted: int) -> int:
    """Eviction order among unprotected chunks; the lowest goes first.

    Args:
      last_access: logical time of the chunk's last save or access (higher: more recent).
      inserted: logical time it entered the tier.
    """
    return last_access

  def order_key(self, entry: EntryInfo) -> tuple:
    """Sort key of a stored chunk among candidates (lowest goes first): `order`, then the
    deeper chunk, then the hash (deterministic)."""
    return (self.order(entry.last_access, entry.inserted), -entry.depth, entry.chunk_hash)

  @property
  def hinted(self) -> frozenset[ChunkHash]:
    """Chunk hashes of the current hint (never evicted by a window-aware policy)."""
    return self._hinted

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """Replaces the hint set with the chunks of the upcoming requests.

    Args:
      upcoming: per upcoming request, its chunk hashes (the look-ahead window); an empty
        sequence clears the hint.
    """
    self._hinted = frozenset(h for req in upcoming for h in req)

  def victims(self, entries: Sequence[EntryInfo], need_bytes: int,
              keep: frozenset[ChunkHash] | set[ChunkHash] = frozenset()) -> list[ChunkHash]:
    """Returns chunks of one tier to evict, in eviction order, freeing at least `need_bytes`.

    Hinted chunks (window-aware policies) and `keep` (e.g. chunks a load is reading now) are
    never chosen, and they keep their ancestors. When the other chunks (or, for a chain-aware
    policy, the ones reachable leaf by leaf) cannot free `need_bytes`, all of them are returned:
    the caller compares the freed bytes with what it needs.

    Args:
      entries: every chunk in the tier.
      need_bytes: bytes to free; <= 0 returns [].
      keep: chunks not to choose this time.
    """
    if need_bytes <= 0:
      return []
    stay = self._hinted if self.window_aware else frozenset()
    stay = stay | frozenset(keep) if keep else stay
    key = self.order_key
    if not self.chain_aware:
      order = sorted((e for e in entries if e.chunk_hash not in stay), key=key)
      return [e.chunk_hash for e in leaf_first(order, need_bytes, None).chosen]
    by_hash = {e.chunk_hash: e for e in entries}
    waiting_on = dict.fromkeys(by_hash, 0)  # chunk -> its cached children not gone yet
    for e in entries:
      if e.parent_hash in by_hash and e.parent_hash != e.chunk_hash:
        waiting_on[e.parent_hash] += 1

    def is_leaf(e: EntryInfo, gone: set[ChunkHash]) -> bool:
      return not waiting_on[e.chunk_hash]  # `in_order` counts each child that went

    # Candidates in policy order, lazily: the leaves first, and a parent once the last of its
    # children has gone (the order `leaf_first` would take them in, without keying every chunk).
    heap = [(key(e), e.chunk_hash) for e in entries
            if not waiting_on[e.chunk_hash] and e.chunk_hash not in stay]
    heapq.heapify(heap)

    def in_order():
      while heap:
        e = by_hash[heapq.heappop(heap)[1]]
        yield e  # `leaf_first` takes it (a leaf) before pulling the next
        p = e.parent_hash
        if p in by_hash and p != e.chunk_hash:
          waiting_on[p] -= 1
          if not waiting_on[p] and p not in stay:
            heapq.heappush(heap, (key(by_hash[p]), p))

    return [e.chunk_hash for e in leaf_first(in_order(), need_bytes, is_leaf).chosen]


class LRUPolicy(PlacementPolicy):
  """Least recently used first; by default suffixes before their prefixes and hinted chunks
  never (what the real tiers run for `StoreConfig.eviction="lru"`). Ties in recency go to the
  deeper chunk, then to the hash. CachedAttention, arXiv 2403.19708, section 3.3."""

  name = "lru"


class FIFOPolicy(PlacementPolicy):
  """First stored, first evicted; a baseline for bench_sessions.

  Ignores recency and, unless `chain_aware=True`, the prefix structure (so it may evict a prefix
  and keep its suffix, as a plain FIFO cache would). Honors hints if any are given.
  """

  name = "fifo"
  chain_aware = False

  def order(self, last_access: int, inserted: int) -> int:
    return inserted


class LookaheadPolicy(LRUPolicy):
  """CachedAttention's scheduler-aware placement (arXiv 2403.19708, sections 3.3.1 and 3.3.2):
  prefetch the window, never evict it while anything else can go, farthest next use first,
  suffixes before prefixes, least recently used among the rest."""

  name = "lookahead"
  prefetches = True


class NoCache(PlacementPolicy):
  """No KV cache: saves are not stored and every access misses."""

  name = "none"
  caches = False
  window_aware = False
  chain_aware = False


#: Policy name -> (class, flags) of the planner's named policies: "lookahead" and the paper's
#: baselines "lru" and "fifo" (neither window- nor chain-aware), and "none". The real tiers
#: build the same classes with their class defaults (`make_policy(name, tier=True)`).
_NAMED: dict[str, tuple[type[PlacementPolicy], dict[str, bool]]] = {
    "lookahead": (LookaheadPolicy, {}),
    "lru": (LRUPolicy, {"chain_aware": False, "window_aware": False}),
    "fifo": (FIFOPolicy, {"window_aware": False}),
    "none": (NoCache, {}),
}

#: Policy name -> its class (the one registry; `make_policy` builds one).
POLICIES: dict[str, type[PlacementPolicy]] = {n: c for n, (c, _) in _NAMED.items()}


def make_policy(name: str, *, tier: bool = False) -> PlacementPolicy:
  """A new policy by registry name.

  Args:
    name: a `POLICIES` name.
    tier: the configuration the real tiers run (`StoreConfig.eviction`: the class defaults,
      window-aware, "lru" chain-aware); False: the planner's (the paper's baselines "lru" and
      "fifo" ignore the window and the prefix structure).

  Raises:
    ValueError: an unknown name (the message lists the known ones).
  """
  try:
    cls, flags = _NAMED[name]
  except KeyError:
    raise ValueError(f"unknown placement policy {name!r}; known: {sorted(POLICIES)}") from None
  return cls() if tier else cls(**flags)
