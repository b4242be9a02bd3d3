"""Scheduler-aware KV placement across a tier hierarchy (pure Python, no I/O).

CachedAttention / AttentionStore (Gao et al., arXiv 2403.19708, section 3.3) keeps every
session's KV in a hierarchy of tiers (HBM, host DRAM, SSD) and places it with hints from the
job scheduler: chunks that the next requests of the waiting queue need are fetched toward the
top before those requests run (look-ahead prefetching, section 3.3.1), and eviction never
pushes out what that window needs while something else can go, demoting victims to the next
tier rather than discarding them (look-ahead eviction, section 3.3.2).

`TierHierarchy` is that planner over an ordered list of tiers (top first, e.g. device, host,
disk; the bottom one may be unbounded, e.g. a remote store). It owns all placement state
(which key lives in which tier, bytes used per tier, recency, the current window) and answers
three events with plain data, a list of moves for a data mover to carry out:

    save(key, nbytes, parent)   a new chunk enters the top tier it fits   -> [Demote.., Insert]
    access(keys)                a scheduled request reads its chunks      -> AccessResult
                                (hits per tier; hits below the top are promoted into it)
    lookahead(window)           the keys of the next requests, queue order -> [Promote.., ...]

By default tiers are exclusive: a key lives in exactly one tier, and a move takes it out of its
source. With `copies=True` (the real tiers, `kvjax.storage.tiering.tiers.TieredStore`, which execute
these moves) a key may be held by several tiers: a promotion copies, a victim held elsewhere
leaves its tier by a `Drop` (no write), and a write-through save inserts a second copy.
Making room in tier t cascades downward (section 3.3.2): each victim of t is demoted into t+1
after room is made there, by t+1's own victims, and only the bottom bounded tier drops (one
exception: a victim that tier t+1 cannot take without displacing chunks the window needs
sooner is dropped from t).

    save/promote into t ──> victims of t ──Demote──> t+1 ──> victims of t+1 ──Demote──> ...
                                                                   bottom bounded tier: Drop

Orphans (held chunks whose parent is held nowhere: a lookup reads a chain from its root, so
they can never hit) outside the window are every tier's first victims and are dropped, never
demoted (`drop_orphans`).

One victim rule for the window, in the simulator and the real tiers alike: a chunk is displaced
only by a chunk needed sooner (its window rank; a scheduled access is needed now, unless its
request still waits in the window, whose rank it keeps). This is Belady's rule restricted to
what the queue shows (CachedAttention, arXiv 2403.19708, section 3.3.2). The real tiers used
to keep every hinted chunk unconditionally; that declined a prefetch for the next request
whenever the host held chunks of a request twenty places later, and made the simulator's
figures say nothing about the server.

Policies (`POLICIES`, by name) decide the victims and whether to prefetch:

  * "lookahead": victims are chosen in three phases, stopping once enough bytes are freed:
      1. chunks outside the window, least recently used first, suffixes before the prefixes
         they extend (only a leaf of the prefix forest is a candidate; taking it may expose its
         parent, which then competes on its own recency; see `kvjax.storage.tiering.eviction`);
      2. the same chunks ignoring the leaf rule (a prefix whose suffix must stay);
      3. window chunks whose next use is farther than the incoming chunk's (farthest first,
         suffixes first): an incoming chunk outside the window never displaces a window chunk.
    Prefetch moves the window's chunks toward the top tier in queue order, under each tier's
    capacity and optional link budget (bytes into the tier per `lookahead` call).
  * "lru" / "fifo": the same cascade with victims by least recent use / first insertion, no
    window, no prefix order, no prefetch (the paper's baselines).
  * "none": nothing is stored; every access misses.

"Leaf" is judged within the tier for demotions, and across all tiers for drops from the bottom
tier (a chunk that a cached suffix extends anywhere goes last). Keys are opaque strings, e.g.
the chained chunk hashes of `kvjax.storage.format.keys` (a chunk's parent is its prefix chunk).

The policies are the classes of `kvjax.storage.tiering.eviction` (one registry, `POLICIES`), the same
ones the real tiers (`kvjax.storage.tiering.tiers`) build; every phase above picks its victims with the
one leaf-first function, `eviction.leaf_first`. `PlacementPolicy.victims` remains for a
`HostMemoryTier` used alone (outside a `TieredStore`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Collection, Mapping, Sequence

from kvjax.storage.tiering.eviction import (POLICIES, LeafFirst, PlacementPolicy, leaf_first,
                                            make_policy)

__all__ = ["POLICIES", "AccessResult", "Demote", "Drop", "Insert", "Move", "PlacementPolicy",
           "PlacementStats", "Promote", "TierHierarchy", "TierSpec", "make_policy"]

_INF = math.inf
_NOW = -1  # rank of the request being scheduled: nearer than any window position


@dataclasses.dataclass(frozen=True)
class TierSpec:
  """One tier of the hierarchy.

  Attributes:
    name: distinct tier name (e.g. "host").
    capacity_bytes: bytes the tier may hold; None: unbounded (the bottom tier only).
    prefetch_bytes_per_interval: bytes that prefetching may move INTO this tier per
      `TierHierarchy.lookahead` call (its link budget); None: unlimited.
  """

  name: str
  capacity_bytes: int | None
  prefetch_bytes_per_interval: int | None = None


@dataclasses.dataclass(frozen=True)
class Insert:
  """A saved chunk is written into `tier` (`nbytes` bytes)."""

  key: str
  tier: str
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Promote:
  """Move `key` up from tier `src` into tier `dst` (on access, or a prefetch)."""

  key: str
  src: str
  dst: str
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Demote:
  """Move `key` down from tier `src` into tier `dst` to make room in `src`."""

  key: str
  src: str
  dst: str
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Drop:
  """Delete `key` from `tier`: it leaves the hierarchy, unless another tier keeps a copy.

  `why` (not compared): "victim" (the bottom bounded tier, or no room below), "copy" (another
  tier keeps a copy: no write needed) or "orphan" (its prefix is held nowhere: it can never
  hit).
  """

  key: str
  tier: str
  nbytes: int
  why: str = dataclasses.field(default="victim", compare=False)


Move = Insert | Promote | Demote | Drop


@dataclasses.dataclass(frozen=True)
class AccessResult:
  """What one `TierHierarchy.access` found and moved.

  Attributes:
    tiers: per requested key, the tier it was found in before any move, or None (a miss).
    moves: the promotions (and the demotions and drops that made room for them), in order.
  """

  tiers: tuple[str | None, ...]
  moves: tuple[Move, ...]


@dataclasses.dataclass
class PlacementStats:
  """Counters and occupancy of a `TierHierarchy` (a snapshot; chunk counts, bytes).

  Attributes:
    hits: per tier, accessed chunks found there.
    misses: accessed chunks found in no tier.
    saves: chunks inserted by `save`.
    rejected_saves: saves that found no tier (all of them under "none").
    promotions: chunks promoted by `access`.
    prefetches_issued: chunks promoted by `lookahead`.
    prefetches_useful: prefetched chunks accessed before being demoted or dropped.
    prefetches_wasted: prefetched chunks demoted or dropped before being accessed.
    demotions: chunks moved down a tier to make room.
    drops: per tier, chunks deleted from it to make room.
    chunks: per tier, chunks held now.
    used_bytes: per tier, bytes held now.
    capacity_bytes: per tier, its capacity (None: unbounded).
  """

  hits: dict[str, int]
  misses: int = 0
  saves: int = 0
  rejected_saves: int = 0
  promotions: int = 0
  prefetches_issued: int = 0
  prefetches_useful: int = 0
  prefetches_wasted: int = 0
  demotions: int = 0
  drops: dict[str, int] = dataclasses.field(default_factory=dict)
  chunks: dict[str, int] = dataclasses.field(default_factory=dict)
  used_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  capacity_bytes: dict[str, int | None] = dataclasses.field(default_factory=dict)

  @property
  def prefetches_pending(self) -> int:
    """Prefetched chunks neither accessed nor moved away yet."""
    return self.prefetches_issued - self.prefetches_useful - self.prefetches_wasted


@dataclasses.dataclass(eq=False)
class _Entry:
  key: str
  parent: str | None
  nbytes: int
  tier: int | None  # its highest copy; None while detached (being promoted)
  last_access: int
  inserted: int
  lower: list[int] = dataclasses.field(default_factory=list)  # tiers below `tier` with a copy
  stamps: dict[int, int] = dataclasses.field(default_factory=dict)  # tier -> current heap item

  def held(self) -> list[int]:
    """Every tier holding a copy, top first."""
    return ([] if self.tier is None else [self.tier]) + self.lower


class TierHierarchy:
  """The placement planner: owns which key lives in which tier and emits moves as plain data.

  Not thread-safe; one owner calls it (a simulation loop, or `kvjax.storage.tiering.tiers.TieredStore`
  on its event loop, whose mover executes the moves).

  Args:
    tiers: top first; names distinct; every tier but the last bounded.
    policy: a registry name (`POLICIES`) or a `PlacementPolicy`.
    promote_on_access: an access promotes hits below the top tier into the highest tier that
      can take them.
    copies: a key may be held by several tiers (the real tiers' model): a promotion copies
      (its source keeps a clean copy), a victim that has a copy in another tier is dropped
      from its tier without a write, and `save(..., through=...)` writes more copies.
      False: tiers are exclusive (the simulator's default).
    drop_orphans: a held chunk whose parent is held nowhere (it can never hit: a lookup reads
      a chain from its root) is the first victim and is dropped, never demoted.

  Raises:
    ValueError: no tiers, repeated names, a capacity or link budget that is not a positive int
      (or None), an unbounded tier above the bottom, or an unknown policy name.
  """

  def __init__(self, tiers: Sequence[TierSpec], policy: str | PlacementPolicy = "lookahead", *,
               promote_on_access: bool = True, copies: bool = False,
               drop_orphans: bool = True):
    self.tiers = tuple(tiers)
    if not self.tiers:
      raise ValueError("a TierHierarchy needs at least one tier")
    names = [t.name for t in self.tiers]
    if len(set(names)) != len(names):
      raise ValueError(f"tier names must be distinct, got {names}")
    for i, t in enumerate(self.tiers):
      for field, v in (("capacity_bytes", t.capacity_bytes),
                       ("prefetch_bytes_per_interval", t.prefetch_bytes_per_interval)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
          raise ValueError(f"tier {t.name!r}: {field} must be a positive int or None, got {v!r}")
      if t.capacity_bytes is None and i != len(self.tiers) - 1:
        raise ValueError(f"tier {t.name!r} is unbounded but not the bottom tier")
    self.policy = make_policy(policy) if isinstance(policy, str) else policy
    self.promote_on_access = promote_on_access
    self.copies = copies
    self.drop_orphans = drop_orphans
    self._names = names
    self._caps = [t.capacity_bytes for t in self.tiers]
    self._used = [0] * len(self.tiers)
    self._members: list[dict[str, None]] = [{} for _ in self.tiers]  # insertion-ordered sets
    self._heaps: list[list[tuple[int, int, str]]] = [[] for _ in self.tiers]
    # Per tier, window chunks that `_victims` took out of the heap (phase 1 skips them): key ->
    # their heap item; back into the heap when they leave the window (`lookahead`), so a victim
    # search does not pop every window chunk again. A valid item is in the heap or here, never
    # both.
    self._parked: list[dict[str, tuple[int, int, str]]] = [{} for _ in self.tiers]
    self._entries: dict[str, _Entry] = {}
    self._children: dict[str, set[str]] = {}  # parent key -> cached children (parent may be gone)
    self._orphans: set[str] = set()  # held keys whose parent is held nowhere: they never hit
    self._rank: dict[str, int] = {}  # window key -> position of the first request needing it
    self._prefetched: set[str] = set()  # prefetched, not yet accessed or moved away
    self._clock = itertools.count(1)
    self._stamps = itertools.count(1)
    self._stats = PlacementStats(hits={n: 0 for n in names}, drops={n: 0 for n in names})

  # -- reading -----------------------------------------------------------------------------------

  def where(self, key: str) -> str | None:
    """The highest tier holding `key`, or None."""
    e = self._entries.get(key)
    return None if e is None or e.tier is None else self._names[e.tier]

  def held_in(self, key: str) -> list[str]:
    """Every tier holding a copy of `key`, top first ([] if none)."""
    e = self._entries.get(key)
    return [] if e is None else [self._names[t] for t in e.held()]

  def tier_keys(self, tier: str) -> list[str]:
    """Keys held by `tier`, in the order they entered it.

    Raises:
      ValueError: an unknown tier name.
    """
    return list(self._members[self._index(tier)])

  def stats(self) -> PlacementStats:
    """A snapshot of the counters and each tier's occupancy (plain data; safe to keep)."""
    s = self._stats
    return dataclasses.replace(
        s, hits=dict(s.hits), drops=dict(s.drops),
        chunks={n: len(m) for n, m in zip(self._names, self._members)},
        used_bytes=dict(zip(self._names, self._used)),
        capacity_bytes=dict(zip(self._names, self._caps)))

  # -- events ------------------------------------------------------------------------------------

  def save(self, key: str, nbytes: int, parent: str | None = None, *,
           through: Sequence[str] = (), keep: Collection[str] = ()) -> list[Move]:
    """A new chunk: it enters the highest tier that fits it, room made by the cascade.

    A key already held is only refreshed (its recency), with no move. Under "lookahead" a chunk
    outside the window never displaces a window chunk (it goes to a lower tier instead), and
    never displaces its own cached prefix chain; it is rejected if no tier has room without
    that.

    Args:
      key: the chunk's key (e.g. its chained chunk hash).
      nbytes: its size in bytes (> 0).
      parent: the key of the prefix chunk it extends, or None for a first chunk.
      through: with `copies`, lower tiers that also get a copy (write-through: the first
        persistent tier), room made there the same way; no copy where there is no room.
      keep: chunks that must not be chosen as victims now (e.g. being read).

    Returns:
      The moves, room first, ending with the `Insert`(s); [] if already held or rejected
      (counted in `PlacementStats.rejected_saves`).

    Raises:
      ValueError: `nbytes` not a positive int; `through` an unknown tier, or given without
        `copies`.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
      raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    also = sorted(self._index(n) for n in through)
    if also and not self.copies:
      raise ValueError("through= needs a TierHierarchy with copies=True")
    if not self.policy.caches:
      self._stats.rejected_saves += 1
      return []
    held = self._entries.get(key)
    if held is not None:
      self._touch(held)
      return []
    now = next(self._clock)
    e = _Entry(key, parent, nbytes, None, now, now)
    rank = self._rank.get(key, _INF)
    pinned = self._chain(key, parent) | set(keep)
    moves: list[Move] = []
    for t in range(len(self.tiers)):
      if self._fits(t, nbytes) and self._make_room(t, nbytes, pinned, rank, moves):
        self._register(e)
        self._attach(e, t)
        self._stats.saves += 1
        moves.append(Insert(key, self._names[t], nbytes))
        for a in also:
          if (a > t and self._fits(a, nbytes) and key in self._entries
              and self._make_room(a, nbytes, pinned, rank, moves)):
            self._attach(e, a)
            moves.append(Insert(key, self._names[a], nbytes))
        return moves
    self._stats.rejected_saves += 1
    return moves

  def access(self, keys: Sequence[str], *, promote: bool | None = None,
             keep: Collection[str] = ()) -> AccessResult:
    """A scheduled request reads `keys`: counts hits per tier and misses, refreshes recency,
    and (with `promote_on_access`) promotes hits below the top tier, in order.

    Args:
      keys: the chunks the request needs, prefix first.
      promote: overrides `promote_on_access` for this call (None: keep it).
      keep: chunks that must not be chosen as victims now (e.g. being read).

    Returns:
      Where each key was found (its highest copy; None: a miss) and the moves made.
    """
    keys = list(keys)
    if not self.policy.caches:
      self._stats.misses += len(keys)
      return AccessResult((None,) * len(keys), ())
    found: list[str | None] = []
    for k in keys:
      e = self._entries.get(k)
      if e is None:
        self._stats.misses += 1
        found.append(None)
        continue
      self._stats.hits[self._names[e.tier]] += 1
      found.append(self._names[e.tier])
      if k in self._prefetched:
        self._prefetched.discard(k)
        self._stats.prefetches_useful += 1
      self._touch(e)
    moves: list[Move] = []
    if self.promote_on_access if promote is None else promote:
      pinned, failed = set(keys) | set(keep), {}
      for k in keys:
        e = self._entries.get(k)
        # Needed now; a chunk its request still holds in the window ranks there (the real
        # engine's window keeps running requests): it never displaces that request's chunks.
        rank = self._rank.get(k, _NOW)
        if e is not None and e.tier and self._promote(e, pinned, rank, None, failed, moves):
          self._stats.promotions += 1
    return AccessResult(tuple(found), tuple(moves))

  def lookahead(self, window: Sequence[Sequence[str]],
                budgets: Mapping[str, int | None] | None = None, *,
                prefetch: bool = True) -> list[Move]:
    """The next requests of the waiting queue, in queue order: sets the window that eviction
    protects and (policy "lookahead") prefetches its chunks toward the top tier.

    The window replaces the previous one. Prefetch walks the window in queue order, each
    request's keys in the order given, and promotes every chunk below the top tier into the
    highest tier that takes it: within that tier's capacity (room is made only from chunks
    outside the window or needed later than this request), and within its link budget.

    Args:
      window: per upcoming request, the keys it needs; [] clears the window.
      budgets: tier name -> bytes prefetch may move into it during this call, overriding
        `TierSpec.prefetch_bytes_per_interval` (None: unlimited).
      prefetch: False sets the window only (the real tiers prefetch chunk by chunk,
        `prefetch_one`, as their link allows).

    Returns:
      The moves (promotions and the room made for them), in order; [] for policies without
      prefetch.

    Raises:
      ValueError: a budget for an unknown tier, or a negative budget.
    """
    budget = [t.prefetch_bytes_per_interval for t in self.tiers]
    for name, b in (budgets or {}).items():
      if name not in self._names:
        raise ValueError(f"budget for unknown tier {name!r}; tiers: {self._names}")
      if b is not None and b < 0:
        raise ValueError(f"budget for tier {name!r} must be >= 0 or None, got {b!r}")
      budget[self._names.index(name)] = b
    self._rank = {}
    if not self.policy.window_aware:
      return []
    for i, req in enumerate(window):
      for k in req:
        self._rank.setdefault(k, i)
    for t, parked in enumerate(self._parked):  # chunks that left the window compete again
      for k in [k for k in parked if k not in self._rank]:
        item = parked.pop(k)
        if self._valid(item, t) is not None:
          heapq.heappush(self._heaps[t], item)
    moves: list[Move] = []
    if not (prefetch and self.policy.caches and self.policy.prefetches):
      return moves
    failed: dict[int, tuple[float, int]] = {}
    for i, req in enumerate(window):
      for k in req:
        e = self._entries.get(k)
        if e is None or not e.tier or self._rank[k] != i:
          continue
        if self._promote(e, {k}, i, budget, failed, moves):
          self._stats.prefetches_issued += 1
          self._prefetched.add(k)
    return moves

  def prefetch_one(self, key: str, *, keep: Collection[str] = ()) -> list[Move]:
    """Prefetches one chunk toward the top tier, as `lookahead` would (the caller, e.g. the
    real tiers' prefetcher, chose it): its rank is its request's window position (outside the
    window: after every window chunk), so room comes only from chunks needed later.

    Args:
      key: the chunk.
      keep: chunks that must not be chosen as victims now (e.g. being read).

    Returns:
      The moves ending with its `Promote`; [] if it is not held, already in the top tier, the
      policy caches nothing, or no tier above has room.
    """
    e = self._entries.get(key)
    if e is None or not e.tier or not self.policy.caches:
      return []
    moves: list[Move] = []
    if self._promote(e, {key} | set(keep), self._rank.get(key, _INF), None, {}, moves):
      self._stats.prefetches_issued += 1
      self._prefetched.add(key)
    return moves

  def adopt(self, key: str, tier: str, nbytes: int, parent: str | None = None) -> list[Move]:
    """A copy found in `tier` that the planner did not place (written before this process, or
    by another writer): it is recorded as least recent, and the tier is brought under its
    capacity by the usual victims (the adopted copy among them).

    Returns:
      The moves that made the tier fit again; [] if it fits or the copy was known.

    Raises:
      ValueError: an unknown tier; `nbytes` not a positive int.
    """
    t = self._index(tier)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
      raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    e = self._entries.get(key)
    if e is not None and t in e.held():
      return []
    if e is None:
      e = _Entry(key, parent, nbytes, None, 0, 0)
      self._register(e)
    elif not self.copies:
      return []  # held elsewhere in an exclusive hierarchy: the planner's copy stands
    self._attach(e, t)
    moves: list[Move] = []
    self._make_room(t, 0, set(), _INF, moves)
    return moves

  def forget(self, key: str, tier: str | None = None) -> None:
    """A copy left `tier` (None: every tier) outside the planner (a bad copy deleted, a
    failed write): the planner stops counting it; no move."""
    e = self._entries.get(key)
    if e is None:
      return
    for t in list(e.held()):
      if tier is None or self._names[t] == tier:
        self._detach(e, t)
    if e.tier is None:
      self._remove_entry(e)

  # -- mechanics ---------------------------------------------------------------------------------

  def _index(self, tier: str) -> int:
    if tier not in self._names:
      raise ValueError(f"unknown tier {tier!r}; tiers: {self._names}")
    return self._names.index(tier)

  def _chain(self, key: str, parent: str | None) -> set[str]:
    """`key` and its cached prefix chain (a save never evicts its own prefix)."""
    pinned = {key}
    p = parent
    while self.policy.chain_aware and p in self._entries and p not in pinned:
      pinned.add(p)
      p = self._entries[p].parent
    return pinned

  def _fits(self, t: int, nbytes: int) -> bool:
    return self._caps[t] is None or nbytes <= self._caps[t]

  def _push(self, e: _Entry, t: int) -> None:
    stamp = next(self._stamps)
    e.stamps[t] = stamp
    heap = self._heaps[t]
    heapq.heappush(heap, (self.policy.order(e.last_access, e.inserted), stamp, e.key))
    if len(heap) > 2 * len(self._members[t]) + 64:  # drop stale items
      live = [self._entries[k] for k in self._members[t]]
      heap[:] = [(self.policy.order(x.last_access, x.inserted), x.stamps[t], x.key)
                 for x in live]
      heapq.heapify(heap)
      self._parked[t].clear()  # every member is in the heap again

  def _register(self, e: _Entry) -> None:
    """Enters a new entry into the chain maps: its parent's children, the orphans (a parent
    not held), and its own children, no longer orphans."""
    self._entries[e.key] = e
    if e.parent is not None:
      self._children.setdefault(e.parent, set()).add(e.key)
      if e.parent not in self._entries:
        self._orphans.add(e.key)
    for c in self._children.get(e.key, ()):
      self._orphans.discard(c)  # its parent is back

  def _attach(self, e: _Entry, t: int) -> None:
    """A copy of `e` enters tier `t`."""
    if e.tier is None:
      e.tier = t
    elif t < e.tier:
      e.lower.insert(0, e.tier)
      e.tier = t
    else:
      e.lower.append(t)
      e.lower.sort()
    self._used[t] += e.nbytes
    self._members[t][e.key] = None
    self._push(e, t)

  def _detach(self, e: _Entry, t: int | None = None) -> int:
    """The copy of `e` in tier `t` (default its highest) leaves it; its heap item is stale."""
    t = e.tier if t is None else t
    self._used[t] -= e.nbytes
    del self._members[t][e.key]
    del e.stamps[t]
    if t == e.tier:
      e.tier = e.lower.pop(0) if e.lower else None
    else:
      e.lower.remove(t)
    return t

  def _remove_entry(self, e: _Entry) -> None:
    """`e` is held nowhere now: it leaves the planner; its cached children become orphans."""
    del self._entries[e.key]
    self._orphans.discard(e.key)
    if e.parent is not None and e.parent in self._children:
      self._children[e.parent].discard(e.key)
      if not self._children[e.parent]:
        del self._children[e.parent]
    self._orphans.update(c for c in self._children.get(e.key, ()) if c in self._entries)

  def _touch(self, e: _Entry) -> None:
    e.last_access = next(self._clock)
    for t in e.held():
      self._push(e, t)

  def _valid(self, item: tuple[int, int, str], t: int) -> _Entry | None:
    e = self._entries.get(item[2])
    return e if e is not None and e.stamps.get(t) == item[1] else None

  def _victims(self, t: int, need: int, pinned: set[str], rank: float) -> list[_Entry] | None:
    """Chunks of tier `t` to move out, in order, freeing at least `need` bytes, or None.

    `rank` is the incoming chunk's next use (a window position; -1: now; inf: not in the
    window): window chunks are eligible only when needed later than that. Orphans outside the
    window go first (they can never hit), then the three phases of the module docstring; each
    walks its candidates with `eviction.leaf_first`. Nothing is moved here.
    """
    heap = self._heaps[t]
    popped: list[tuple[int, int, str]] = []
    parked = self._parked[t]
    entries, children = self._entries, self._children
    bottom = t == len(self.tiers) - 1

    def leaf_in_tier(e: _Entry, gone: set[str]) -> bool:
      return not any(c not in gone and t in entries[c].held() for c in children.get(e.key, ()))

    def leaf_anywhere(e: _Entry, gone: set[str]) -> bool:
      return not any(c not in gone for c in children.get(e.key, ()))

    leaves = (leaf_anywhere if bottom else leaf_in_tier) if self.policy.chain_aware else None
    st = LeafFirst()
    # Phase 0: orphans outside the window, in policy order (no chunk's chain reaches them).
    dead = [entries[k] for k in self._orphans if self.drop_orphans and k not in pinned
            and k not in self._rank and k in self._members[t]]
    if dead:
      order = self.policy.order
      dead.sort(key=lambda e: (order(e.last_access, e.inserted), e.key))
      leaf_first(dead, need, None, st)

    def outside_window():
      """Heap order; pops lazily (`leaf_first` stops pulling once enough is freed)."""
      while heap:
        item = heapq.heappop(heap)
        e = self._valid(item, t)
        if e is None:
          continue  # stale
        if e.key in pinned or e.key in st.gone:
          popped.append(item)
          continue
        if e.key in self._rank:
          parked[e.key] = item  # out of the heap while it is in the window
          continue
        popped.append(item)
        yield e

    # Phase 1: outside the window, policy order, leaves first.
    # "Leaf" within the tier; across all tiers for the bottom one (its victims are dropped).
    leaf_first(outside_window(), need, leaves, st)
    # Phase 2: prefixes whose suffixes must stay.
    if st.waiting and st.freed < need:
      leaf_first(list(st.waiting.values()), need, None, st)
    # Phase 3: window chunks needed later than the incoming one, farthest first.
    if st.freed < need:  # phase 1 emptied the heap: every window chunk of the tier is parked
      windowed = []
      for k, item in list(parked.items()):
        e = self._valid(item, t)
        if e is None:
          del parked[k]  # moved or gone since it was parked
        elif k not in pinned and k not in st.gone:
          windowed.append(e)
      order = self.policy.order
      later = sorted((e for e in windowed if self._rank[e.key] > rank),
                     key=lambda e: (-self._rank[e.key], order(e.last_access, e.inserted)))
      leaf_first(later, need, leaves, st)
      if st.waiting and st.freed < need:
        leaf_first(list(st.waiting.values()), need, None, st)
    for item in popped:
      if item[2] not in st.gone:
        heapq.heappush(heap, item)
    return st.chosen if st.freed >= need else None

  def _make_room(self, t: int, need: int, pinned: set[str], rank: float,
                 moves: list[Move]) -> bool:
    """Frees `need` bytes in tier `t` (victims demoted, room made below first; the bottom
    bounded tier drops). False, with nothing moved, if the victims cannot free enough.

    A victim with a copy in another tier (`copies`) leaves `t` by a `Drop` of that copy (no
    write); an orphan is dropped, never demoted.
    """
    cap = self._caps[t]
    if cap is None or cap - self._used[t] >= need:
      return True
    victims = self._victims(t, need - (cap - self._used[t]), pinned, rank)
    if victims is None:
      return False
    for e in victims:
      self._detach(e, t)
      if e.tier is not None:  # another tier keeps a copy
        self._stats.drops[self._names[t]] += 1
        moves.append(Drop(e.key, self._names[t], e.nbytes, "copy"))
        continue
      orphan = self.drop_orphans and e.key in self._orphans
      below = t + 1
      if (below < len(self.tiers) and not orphan
          and self._fits(below, e.nbytes)
          and self._make_room(below, e.nbytes, pinned, self._rank.get(e.key, _INF), moves)):
        self._attach(e, below)
        self._stats.demotions += 1
        moves.append(Demote(e.key, self._names[t], self._names[below], e.nbytes))
      else:  # the bottom bounded tier, an orphan, or a lower tier that keeps better chunks
        self._remove_entry(e)
        self._stats.drops[self._names[t]] += 1
        moves.append(Drop(e.key, self._names[t], e.nbytes, "orphan" if orphan else "victim"))
      if e.key in self._prefetched:
        self._prefetched.discard(e.key)
        self._stats.prefetches_wasted += 1
    return True

  def _promote(self, e: _Entry, pinned: set[str], rank: float, budget: list[int | None] | None,
               failed: dict[int, tuple[float, int]], moves: list[Move]) -> bool:
    """Moves `e` into the highest tier above it that takes it (within `budget`, bytes per tier,
    consumed here); False if none does. Exclusive tiers: `e` leaves its tier first, so a victim
    demoted into that tier may take its place; with `copies` its source copy stays.

    `failed` remembers, per tier, the (rank, bytes) of a promotion that found no room: within
    one planning call a chunk needed no sooner and no smaller cannot find room either (the
    chunks it may displace are a subset), so the scan is skipped.
    """
    src = e.tier
    for dst in range(src):
      if not self._fits(dst, e.nbytes):
        continue
      if budget is not None and budget[dst] is not None and budget[dst] < e.nbytes:
        continue
      f = failed.get(dst)
      if f is not None and rank >= f[0] and e.nbytes >= f[1]:
        continue
      if not self.copies:
        self._detach(e)
      if self._make_room(dst, e.nbytes, pinned, rank, moves):
        self._attach(e, dst)
        if budget is not None and budget[dst] is not None:
          budget[dst] -= e.nbytes
        moves.append(Promote(e.key, self._names[src], self._names[dst], e.nbytes))
        return True
      if not self.copies:
        self._attach(e, src)
      failed[dst] = (rank, e.nbytes)
    return False
