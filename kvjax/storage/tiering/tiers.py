"""Storage tiers: host memory over disk over remote, with capacities, eviction and link limits.

CachedAttention, arXiv 2403.19708, section 3: KV of past turns lives in a hierarchy of tiers,
each with a capacity; reads come from the highest tier that holds a chunk and are promoted
toward the accelerator; eviction never drops what the look-ahead window needs and drops suffix
chunks before prefix chunks.

One tier engine: every placement decision (which tier a save enters, which hit is promoted,
which victims are demoted or dropped, what a prefetch may displace) is made by the planner the
session simulator runs, `kvjax.storage.tiering.placement.TierHierarchy` (`TieredStore.planner`, built
with `copies=True`: a promotion keeps its source copy, a victim held elsewhere is dropped
without a write). The store asks it and hands its moves to the mover
(`kvjax/storage/tiering/tier_mover.py`), which copies bytes between tiers and counts them; neither the
host tier nor a persistent tier evicts on its own. `tests/unit/storage/tier_replay_test.py`
replays one trace through both and gets the same moves.

Architecture:

    engine ── lookup(hashes) ─► one batched `contains` per tier (gathered): where each chunk is
           ── get(hash, ...) ─► host ─miss─► disk ─miss─► remote     (any miss falls through;
                                 ▲            │                       a corrupt copy is dropped)
                                 └─ promote ──┘  planner.access: a hit below the top may be
                                                 copied up (the encoding that was read)
           ── put(hash, ...) ─► planner.save: the highest tier with room (write-through: plus a
                                copy in the first persistent tier); victims demoted or dropped
           ── hint(window) ──► planner.lookahead: window chunks are displaced only by chunks
                                needed sooner
           ── prefetch(hash) ─► planner.prefetch_one: copy a lower chunk up, if room allows

Write-back placement (`placement="write_back"`, CachedAttention section 3.3.2): a put goes to the
host tier only (lower when the host has no room without displacing the window or the chunk's own
prefix). A host victim is DEMOTED: written, in the encodings the host holds, to the next tier,
unless a lower tier already holds it (a chunk promoted from disk costs no write: a `Drop` of the
host copy) or it can never hit (an orphan: its parent is a non-root chunk that no tier holds; it
goes first and is dropped). A persistent tier's victims cascade the same way to the tier below.
Demotions and drops run as tasks on the store's event loop, off the load path, with at most
`demotion_bytes_in_flight` bytes being written (a put waits for room; a promotion is skipped when
there is none); a demotion that fails is counted in `demotion_drops` and the chunk is lost (a
later request recomputes it).

Races: moves of one chunk run in the planner's order; a demoted host chunk stays readable in the
host tier (outside its capacity count) until the lower tier has published it, and a persistent
tier's victim is written below before it is deleted, so a read (top down) finds a copy; a chunk
a load is reading is not chosen as a victim.

What the planner did not place (a disk store from an earlier process, another writer's chunks)
is adopted as least recent: a persistent tier's records on its first write, on
`enforce_capacity`, and a chunk a read finds where the planner did not expect it.

A `Tier` is anything with the async chunk-store interface: `HostMemoryTier` here, and the
tensorstore `ChunkStore` for disk and remote tiers (reads paced by a `LinkLimiter`).

`TierConfig` / `StoreConfig` are the frozen configuration; `build_tiers` turns one into a
`TieredStore`, given a factory for chunk stores (the engine passes the real `ChunkStore`).

Modules and parts: this one holds `TieredStore`'s reads, writes and hints and `build_tiers`;
`kvjax/storage/tiering/placement.py` the planner; `kvjax/storage/tiering/tier_api.py` the `KVStore` interface
and its records (`TierStats`, `TierUsage`); `kvjax/storage/tiering/tier_ledger.py` the books
(`TierLedger`: counters, reads in progress); `kvjax/storage/tiering/tier_mover.py` the mover
(`TierMover`: executes moves). The store owns the planner, one ledger and one mover; the mover
records in the ledger and reports a lost copy back (`planner.forget`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage.format import codecs, keys
from kvjax.storage.backends import specs
from kvjax.storage.tiering.eviction import LRUPolicy, PlacementPolicy, make_policy
from kvjax.storage.tiering.host_tier import HostMemoryTier, Tier
from kvjax.storage.backends.link import LinkLimiter, load_trace
from kvjax.storage.tiering.store_config import (DEFAULT_DEMOTION_BYTES_IN_FLIGHT,
                                                DEFAULT_DISK_CAPACITY_BYTES,
                                                DEFAULT_STORE_CAPACITY_BYTES, PLACEMENTS,
                                                StoreConfig, TierConfig, url_kind)
from kvjax.storage.tiering.placement import Drop, Insert, Move, Promote, TierHierarchy, TierSpec
from kvjax.storage.tiering.tier_api import KVStore, TierStats, TierUsage
from kvjax.storage.tiering.tier_ledger import TierLedger
from kvjax.storage.tiering.tier_mover import TierMover
from kvjax.storage.format.types import (Chooser, ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                        EncodedPayload, KVLayout, MissReason)

__all__ = ["DEFAULT_DISK_CAPACITY_BYTES", "DEFAULT_STORE_CAPACITY_BYTES", "HostMemoryTier",
           "KVStore", "StoreConfig", "Tier", "TierConfig", "TierUsage",
           "TierStats", "TieredStore", "build_tiers", "url_kind"]

log = logging.getLogger(__name__)

#: Misses that mean the stored copy is bad (not merely another request's chunk): it is deleted
#: from its tier so a good copy can take its place.
_BAD_COPY = frozenset({MissReason.CORRUPT, MissReason.CHECKSUM_MISMATCH, MissReason.MISSING_DATA})

#: The planner's bound for a tier without one above the bottom (more bytes than exist).
_UNBOUNDED = 1 << 62


class TieredStore:
  """Tiers searched from the top, whose placement the planner decides and the mover executes
  (see the module docstring).

  Attributes:
    tiers: the tiers, top first.
    host: the host tier (the first `HostMemoryTier`), or None.
    limiters: tier name -> its link limiter (set by `build_tiers`).
    local_dirs: persistent tier name -> its local directory, for tiers on a local file store
      (set by `build_tiers`; `specs.local_dir`).
    placement: "write_through" or "write_back".
    demotion_bytes_in_flight: bytes of demotions being written at most.
    planner: its `TierHierarchy` (placement: which tier holds each chunk, recency, window).
    mover: its `TierMover` (executes the planner's moves).
  """

  def __init__(self, tiers: Sequence[Tier], *,
               policies: Sequence[PlacementPolicy | None] | None = None,
               capacities: Sequence[int | None] | None = None,
               write_all_persistent: bool = False, drop_bad_copies: bool = True,
               placement: str = "write_through",
               demotion_bytes_in_flight: int = DEFAULT_DEMOTION_BYTES_IN_FLIGHT,
               record_moves: bool = False):
    """Creates a store over `tiers`.

    Args:
      tiers: top first; names distinct.
      policies: per tier, a `PlacementPolicy` (None for a `HostMemoryTier`, which brings its
        own). The hierarchy runs one policy: the host tier's, else the first one given, else
        `LRUPolicy()`.
      capacities: per tier, the byte limit of a persistent tier (None: unbounded); must be None
        for a `HostMemoryTier` (it has its own).
      write_all_persistent: `put` writes every persistent tier, not only the first.
      drop_bad_copies: delete a copy whose read found it corrupt, so a good one can replace it.
      placement: "write_through" (a put also writes a copy into the first persistent tier) or
        "write_back" (`StoreConfig.placement`).
      demotion_bytes_in_flight: bytes of demotions being written at most (a put waits for
        room; at least one demotion always runs).
      record_moves: keep every executed move in `mover.executed` (tests).

    Raises:
      ValueError: no tiers, repeated names, lengths that do not match, a policy or capacity given
        for a host tier, a non-positive capacity, an unknown placement, write-back with
        `write_all_persistent`, or a non-positive `demotion_bytes_in_flight`.
      TypeError: a tier without the `Tier` interface.
    """
    self.tiers = list(tiers)
    if not self.tiers:
      raise ValueError("a TieredStore needs at least one tier")
    for t in self.tiers:
      if not isinstance(t, Tier):
        raise TypeError(f"{t!r} does not implement the Tier interface")
    names = [t.name for t in self.tiers]
    if len(set(names)) != len(names):
      raise ValueError(f"tier names must be distinct, got {names}")
    n = len(self.tiers)
    policies = list(policies) if policies is not None else [None] * n
    capacities = list(capacities) if capacities is not None else [None] * n
    if len(policies) != n or len(capacities) != n:
      raise ValueError(f"{n} tiers but {len(policies)} policies and {len(capacities)} capacities")
    self.host = next((t for t in self.tiers if isinstance(t, HostMemoryTier)), None)
    caps: list[int | None] = []
    for t, p, c in zip(self.tiers, policies, capacities):
      if isinstance(t, HostMemoryTier):
        if p is not None or c is not None:
          raise ValueError(f"host tier {t.name!r} has its own policy and capacity")
        caps.append(t.capacity_bytes)
        continue
      if c is not None and c <= 0:
        raise ValueError(f"capacity of tier {t.name!r} must be positive, got {c}")
      caps.append(c)
    if placement not in PLACEMENTS:
      raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if placement == "write_back" and write_all_persistent:
      raise ValueError("write_all_persistent writes every tier: it is write-through only")
    if demotion_bytes_in_flight <= 0:
      raise ValueError(f"demotion_bytes_in_flight must be positive, got "
                       f"{demotion_bytes_in_flight}")
    self.write_all_persistent = write_all_persistent
    self.drop_bad_copies = drop_bad_copies
    self.placement = placement
    self.demotion_bytes_in_flight = int(demotion_bytes_in_flight)
    if self.host is not None:
      self.host.managed = True  # the planner owns its capacity
      if placement == "write_back":
        self.host.demote = True
    policy = (self.host.policy if self.host is not None
              else next((p for p in policies if p is not None), None)) or LRUPolicy()
    # Only the bottom tier may be unbounded in the planner; an unbounded tier above it (a host
    # tier without a limit, a remote over a remote) is bounded by more bytes than exist.
    specs_ = [TierSpec(name, _UNBOUNDED if c is None and i < n - 1 else c)
              for i, (name, c) in enumerate(zip(names, caps))]
    self.planner = TierHierarchy(specs_, policy, copies=True,
                                 drop_orphans=placement == "write_back")
    self._persistent = [t for t in self.tiers if not isinstance(t, HostMemoryTier)]
    self._scanned: set[str] = set()  # persistent tiers whose records the planner has adopted
    self.limiters: dict[str, LinkLimiter] = {}
    self.local_dirs: dict[str, str] = {}
    self._ledger = TierLedger(names)
    self.mover = TierMover(self.tiers, self.host, self._ledger, self.planner.forget,
                           demotion_bytes_in_flight=self.demotion_bytes_in_flight,
                           record=record_moves)

  # -- bookkeeping ------------------------------------------------------------------------------

  @property
  def stats(self) -> dict[str, TierStats]:
    """A snapshot of each tier's counters, by tier name."""
    return self._ledger.stats()

  async def drain(self) -> None:
    """Waits until every move started so far (on this event loop) is done."""
    await self.mover.drain()

  async def usage(self) -> list[TierUsage]:
    """What each persistent tier holds now, top first (lists every tier's records)."""
    out = []
    for t, c in zip(self.tiers, self.planner.tiers):
      if isinstance(t, HostMemoryTier):
        continue
      recs = await t.records()
      cap = None if c.capacity_bytes in (None, _UNBOUNDED) else c.capacity_bytes
      out.append(TierUsage(t.name, len(recs), sum(record_nbytes(r) for r in recs), cap))
    return out

  async def enforce_capacity(self) -> None:
    """Brings every bounded persistent tier under its capacity: its records are listed afresh
    (chunks another writer added are adopted as least recent, chunks gone are forgotten) and
    the planner's victims are moved out; waits for those moves."""
    for t in self._persistent:
      self._scanned.discard(t.name)
      await self._scan(t)
    await self.mover.drain()

  async def _scan(self, t: Tier) -> None:
    """Once per persistent tier (and on `enforce_capacity`): the planner adopts the chunks it
    holds that it did not place (by hash: unknown recency), in hash order."""
    if t.name in self._scanned:
      return
    self._scanned.add(t.name)
    recs = sorted(await t.records(), key=lambda r: r.chunk_hash)
    present = {r.chunk_hash for r in recs}
    for k in self.planner.tier_keys(t.name):
      if k not in present:
        self.planner.forget(k, t.name)
    for r in recs:
      self._execute_background(self.planner.adopt(r.chunk_hash, t.name, max(record_nbytes(r), 1),
                                                  _parent(r)))

  def _execute_background(self, moves: Sequence[Move]) -> None:
    """Hands the moves of one planner call (demotions and drops only) to the mover."""
    self.mover.note(moves)
    self._start(moves)

  def _start(self, moves: Sequence[Move]) -> None:
    """Counts why each drop happens, then starts the demotions and drops among `moves`."""
    for m in moves:
      if isinstance(m, Drop) and m.why == "copy":
        self._ledger.count(m.tier, "demotions_unneeded")  # another tier keeps a copy
      elif isinstance(m, Drop) and m.why == "orphan":
        self._ledger.count(m.tier, "orphans_dropped")
      elif isinstance(m, Drop) and m.tier != self.tiers[-1].name:
        self._ledger.count(m.tier, "demotion_drops")  # the tiers below would not take it
    self.mover.start(moves)

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """The look-ahead window: the planner protects its chunks from eviction (one victim rule
    for the simulator and the real tiers: `kvjax.storage.tiering.placement`).

    Args:
      upcoming: per upcoming request, its chunk hashes, in queue order; a chunk is displaced
        only by one needed sooner (CachedAttention, arXiv 2403.19708, section 3.3.2).
    """
    if self.host is not None:
      self.host.hint(upcoming)
    self.planner.lookahead(upcoming, prefetch=False)

  def host_capacity(self) -> tuple[str, int | None] | None:
    """(name, byte capacity or None for unbounded) of the host tier; None without one."""
    if self.host is None:
      return None
    return self.host.name, self.host.capacity_bytes

  async def prefetch(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                     layout: KVLayout, *, origin: ChunkOrigin | None = None) -> str | None:
    """Look-ahead prefetch (CachedAttention, arXiv 2403.19708, section 3.3.1): copies one chunk
    that only a tier below the host holds up into the host tier, verified like any read.

    The planner decides (`TierHierarchy.prefetch_one`: room only from chunks needed later than
    this one), before anything is read. Counted as a promotion of the host tier and a hit of
    the tier read.

    Args:
      chunk_hash, token_ids, namespace, layout, origin: as `get`.

    Returns:
      The name of the tier the chunk was read from when the host tier now holds a copy made by
      this call; None when there is no host tier, the host already held it, the planner finds
      no room for it, no lower tier has a good copy, or the copy failed.
    """
    if self.host is None or (await self.host.contains([chunk_hash]))[0]:
      return None
    if self.planner.where(chunk_hash) is None and not self.mover.busy(chunk_hash):
      found = (await self.peek([chunk_hash]))[0]
      if found is None or found[1] is None:
        return None
      await self._adopt(found[0], found[1])
    moves = self.planner.prefetch_one(chunk_hash, keep=self._ledger.reading())
    if not moves:
      return None
    up = moves[-1]  # into the host, or the highest tier below it with room
    self.mover.note(moves)
    self._start(moves[:-1])
    names = [t.name for t in self.tiers]
    got = await self._read(chunk_hash, token_ids, namespace, layout, None, origin,
                           start=names.index(up.dst) + 1)
    if not isinstance(got, ChunkHit):
      self.planner.forget(chunk_hash, up.dst)
      return None
    stored = await self._copy_up(up, got)
    return got.tier if stored and up.dst == self.host.name else None

  async def _adopt(self, tier: str, rec: ChunkRecord) -> None:
    """The planner adopts a copy found in `tier` that it did not place."""
    t = self.tiers[[x.name for x in self.tiers].index(tier)]
    if not isinstance(t, HostMemoryTier):
      await self._scan(t)
    if tier not in self.planner.held_in(rec.chunk_hash):
      self._execute_background(self.planner.adopt(rec.chunk_hash, tier,
                                                  max(record_nbytes(rec), 1), _parent(rec)))

  # -- reads ------------------------------------------------------------------------------------

  async def lookup(self, hashes: Sequence[ChunkHash]) -> list[str | None]:
    """Where each chunk lives: the name of the highest tier holding it, or None.

    One batched `contains` per tier, all tiers concurrently. A tier whose `contains` raises
    counts as holding nothing (logged).
    """
    hashes = list(hashes)
    if not hashes:
      return []

    async def one(t: Tier) -> list[bool]:
      try:
        return list(await t.contains(hashes))
      except Exception:  # noqa: BLE001  (a failing tier must not fail the request)
        log.warning("contains failed on tier %s", t.name, exc_info=True)
        return [False] * len(hashes)

    found = await asyncio.gather(*(one(t) for t in self.tiers))
    out: list[str | None] = [None] * len(hashes)
    for t, flags in zip(self.tiers, found):
      for i, f in enumerate(flags):
        if f and out[i] is None:
          out[i] = t.name
    return out

  async def peek(self, hashes: Sequence[ChunkHash]
                 ) -> list[tuple[str, ChunkRecord | None] | None]:
    """Like `lookup`, with the record the highest holding tier has (its encodings and sizes).

    One batched `Tier.peek` per tier, all tiers concurrently; a tier that raises holds nothing
    (logged). A present chunk always comes with its record.
    """
    hashes = list(hashes)
    if not hashes:
      return []

    async def one(t: Tier) -> list[ChunkRecord | None]:
      try:
        return list(await t.peek(hashes))
      except Exception:  # noqa: BLE001  (a failing tier must not fail the request)
        log.warning("peek failed on tier %s", t.name, exc_info=True)
        return [None] * len(hashes)

    found = await asyncio.gather(*(one(t) for t in self.tiers))
    out: list[tuple[str, ChunkRecord | None] | None] = [None] * len(hashes)
    for t, recs in zip(self.tiers, found):
      for i, rec in enumerate(recs):
        if rec is not None and out[i] is None:
          out[i] = (t.name, rec)
    return out

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, promote: bool = True, choose: Chooser | None = None,
                origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """Reads one chunk (or its layers `[layer_start, L)`) from the highest tier that has a good
    copy.

    Tiers are tried top down; any miss falls through to the next tier (a bad copy is deleted
    when `drop_bad_copies`). The read is an access of the planner, which may promote a hit
    below the top tier (`promote`; skipped while the demotions in flight hold their bound).

    Args:
      chunk_hash: the chunk's key.
      token_ids: the C token ids it must hold.
      namespace: hex root hash of the key namespace it must be under.
      layout: the shape and dtype it must have.
      promote: let the planner copy a lower-tier hit up (the encoding that was read).
      choose: which encoding to read, per tier (see `ChunkStore.get`); a tier whose encodings it
        declines misses with UNKNOWN_CODEC and the next tier is tried.
      origin: the model and layout version it must come from (`ChunkRecord.mismatch`; a
        mismatch is a miss with its own reason, counted per tier), or None.
      layer_start: k in `[0, L)`; k > 0 asks every tier for layers `[k, L)` alone
        (`ChunkStore.get`: a raw hit's `kv` is `[L - k, 2, C, K, H]`, its `nbytes` and the
        tier's `bytes_read` those layers' bytes). A partial hit is never promoted.

    Returns:
      The hit (its `tier` names where it was read), or the first miss that is not ABSENT (else
      ABSENT) when no tier has a good copy.

    Raises:
      ValueError: `layer_start` not in `[0, L)`.
    """
    if not 0 <= layer_start < layout.num_layers:
      raise ValueError(f"layer_start {layer_start} not in [0, {layout.num_layers})")
    res = await self._read(chunk_hash, token_ids, namespace, layout, choose, origin,
                           layer_start=layer_start)
    if not isinstance(res, ChunkHit):
      return res
    promote = promote and not res.layer_start  # some layers only: nothing to copy up
    if res.tier not in self.planner.held_in(chunk_hash) and not self.mover.busy(chunk_hash):
      await self._adopt(res.tier, res.record)  # not a copy in transit: one the planner missed
    promote = promote and self.host is not None and self.mover.has_room()
    moves = list(self.planner.access([chunk_hash], promote=promote,
                                     keep=self._ledger.reading()).moves)
    up = moves[-1] if moves and isinstance(moves[-1], Promote) else None
    self.mover.note(moves)
    self._start(moves[:-1] if up is not None else moves)
    if up is not None:
      await self._copy_up(up, res)
    elif promote and self.planner.where(chunk_hash) == self.host.name != res.tier:
      # The host holds the chunk in other encodings only: the one read joins them (the
      # placement is unchanged, as the planner has it).
      await self._copy_up(Promote(chunk_hash, res.tier, self.host.name, 0), res)
    return res

  async def _read(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                  layout: KVLayout, choose: Chooser | None, origin: ChunkOrigin | None, *,
                  start: int = 0, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """The top-down verified read of `get` from tier `start` on (no planner access)."""
    first_miss: ChunkMiss | None = None
    for t in self.tiers[start:]:
      # The planner does not choose a chunk being read as a victim.
      self._ledger.read_started(t.name, chunk_hash)
      try:
        res = await t.get(chunk_hash, token_ids, namespace, layout, choose=choose, origin=origin,
                          layer_start=layer_start)
      except Exception as e:  # noqa: BLE001  (a failing tier is a miss, never a user error)
        log.warning("get failed on tier %s", t.name, exc_info=True)
        res = ChunkMiss(chunk_hash, MissReason.READ_ERROR, repr(e))
      finally:
        self._ledger.read_ended(t.name, chunk_hash)
      if isinstance(res, ChunkHit):
        self._ledger.count(t.name, "hits")
        self._ledger.count(t.name, "bytes_read", int(res.nbytes))
        return res
      self._ledger.miss(t.name, res.reason.value)
      if res.reason == MissReason.ABSENT and not self.mover.busy(chunk_hash):
        self.planner.forget(chunk_hash, t.name)  # gone behind the planner's back
      if res.reason in _BAD_COPY and self.drop_bad_copies:
        await self._drop(t, chunk_hash)
      if first_miss is None or (first_miss.reason == MissReason.ABSENT
                                and res.reason != MissReason.ABSENT):
        first_miss = res
    if first_miss is None:
      first_miss = ChunkMiss(chunk_hash, MissReason.ABSENT)
    return first_miss

  async def _copy_up(self, move: Promote, hit: ChunkHit) -> bool:
    """Executes the planner's promotion with the bytes a read got (the encoding read)."""
    rec = hit.record

    async def write(tier: Tier) -> bool:
      if isinstance(tier, HostMemoryTier) and hit.encoding.codec == "raw":
        return await tier.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace,
                              hit.kv, checksum=hit.encoding.checksum,
                              checksum_algo=hit.encoding.checksum_algo, origin=rec.origin)
      raw = hit.kv if hit.encoding.codec == "raw" else None
      payloads = () if raw is not None else (
          EncodedPayload(hit.encoding.codec, hit.encoding.level, hit.payload),)
      return await tier.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace, raw,
                            layout=rec.layout, payloads=payloads, origin=rec.origin)

    stored = await self.mover.insert(move, write)
    if stored:
      self._ledger.count(move.dst, "promotions")
      self._ledger.count(move.dst, "bytes_written", int(hit.encoding.nbytes))
    return stored

  async def delete(self, chunk_hash: ChunkHash) -> list[str]:
    """Removes a chunk from every tier (e.g. before rewriting a bad copy).

    Returns:
      Names of the tiers that held it. A tier whose delete raises is logged and skipped.
    """
    async def one(t: Tier) -> bool:
      try:
        return bool(await t.delete(chunk_hash))
      except Exception:  # noqa: BLE001
        log.warning("delete failed on tier %s", t.name, exc_info=True)
        return False

    self.planner.forget(chunk_hash)
    done = await asyncio.gather(*(one(t) for t in self.tiers))
    return [t.name for t, gone in zip(self.tiers, done) if gone]

  async def _drop(self, t: Tier, chunk_hash: ChunkHash) -> None:
    try:
      if await t.delete(chunk_hash):
        self._ledger.count(t.name, "dropped")
    except Exception:  # noqa: BLE001
      log.warning("delete of a bad copy failed on tier %s", t.name, exc_info=True)
    self.planner.forget(chunk_hash, t.name)

  # -- writes -----------------------------------------------------------------------------------

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (),
                origin: ChunkOrigin | None = None) -> list[str]:
    """Saves a chunk where the planner places it.

    The planner's `save` decides: the highest tier with room (room made by its victims:
    demoted, or dropped when a copy stays elsewhere), plus, write-through, a copy in the first
    persistent tier (every persistent tier with `write_all_persistent`), which survives the
    process (CachedAttention saves each turn's KV). A chunk the planner already places is only
    refreshed. A write that raises is logged and counted, never raised: saving is best effort.

    Args:
      chunk_hash: the chunk's key.
      parent_hash: the previous chunk's key.
      token_ids: the C token ids.
      namespace: hex root hash of the key namespace.
      kv: raw `[L, 2, C, K, H]` values, K before RoPE, or None.
      layout: the raw layout (default `kv`'s; required without `kv`).
      payloads: codec payloads stored beside or instead of `kv` (see `ChunkStore.put`).
      origin: the model and layout version that computed it, kept in every tier's record.

    Returns:
      Names of the tiers that published the chunk by this call (already present: not listed).

    Raises:
      ValueError: invalid input (checked once, before any tier is written; see
        `codecs.check_encodings`).
    """
    token_ids = tuple(int(t) for t in token_ids)
    codecs.check_encodings(token_ids, kv, layout, payloads)
    # A tail's raw values are stored without their padding rows (`ChunkStore.put`).
    nbytes = (0 if kv is None else int(kv.nbytes) * keys.stored_rows(token_ids)
              // len(token_ids)) + sum(
        codecs.payload_nbytes(p.arrays) for p in payloads)
    for t in self._persistent:
      await self._scan(t)
    through: list[str] = []
    if self.placement == "write_through" and self.host is not None and self._persistent:
      through = [t.name for t in
                 (self._persistent if self.write_all_persistent else self._persistent[:1])]
    elif self.write_all_persistent:
      through = [t.name for t in self._persistent[1:]]
    await self.mover.demotion_room()
    parent = None if parent_hash == namespace else parent_hash
    moves = self.planner.save(chunk_hash, max(nbytes, 1), parent, through=through,
                              keep=self._ledger.reading())
    inserts = [m for m in moves if isinstance(m, Insert)]
    self.mover.note(moves)
    self._start([m for m in moves if not isinstance(m, Insert)])

    async def write(t: Tier) -> bool:
      ok = await t.put(chunk_hash, parent_hash, token_ids, namespace, kv, layout=layout,
                       payloads=tuple(payloads), origin=origin)
      if ok:
        self._ledger.count(t.name, "puts")
        self._ledger.count(t.name, "bytes_written", nbytes)
      return bool(ok)

    done = await asyncio.gather(*(self.mover.insert(m, write) for m in inserts))
    return [m.tier for m, ok in zip(inserts, done) if ok]


def _parent(rec: ChunkRecord) -> str | None:
  """The planner's parent of a stored chunk: None for a first chunk (its parent is the
  namespace root)."""
  return None if rec.parent_hash == rec.namespace else rec.parent_hash


def record_nbytes(rec: ChunkRecord) -> int:
  """Stored bytes of a record (every encoding)."""
  return sum(e.nbytes for e in rec.encodings)


def build_tiers(config: StoreConfig, *,
                make_chunk_store: Callable[[str, str, LinkLimiter], Tier],
                host_policy: PlacementPolicy | None = None,
                policy_factory: Callable[[], PlacementPolicy] | None = None,
                write_all_persistent: bool = False) -> TieredStore:
  """Builds a `TieredStore` from its configuration.

  Args:
    config: the tiers, top first.
    make_chunk_store: `(url, name, limiter) -> Tier` for disk and remote tiers (the engine passes
      the tensorstore `ChunkStore`).
    host_policy: eviction policy of the host tier (default: by `config.eviction`).
    policy_factory: makes the eviction policy of each persistent tier (default: by
      `config.eviction`).
    write_all_persistent: see `TieredStore`.

  Returns:
    The store; `store.limiters` maps each disk or remote tier's name to its `LinkLimiter`
    (unlimited when the config sets no link).

  Raises:
    ValueError: a bad link trace file (see `link.load_trace`).
    OSError: a link trace file that cannot be read.
  """
  tiers: list[Tier] = []
  policies: list[PlacementPolicy | None] = []
  capacities: list[int | None] = []
  limiters: dict[str, LinkLimiter] = {}
  factory = policy_factory or functools.partial(make_policy, config.eviction, tier=True)
  for tc, name in zip(config.tiers, config.tier_names):
    if tc.kind == "host":
      tiers.append(HostMemoryTier(tc.capacity_bytes, name=name,
                                  policy=host_policy if host_policy is not None else factory()))
      policies.append(None)
      capacities.append(None)
      continue
    if tc.link_trace is not None:
      limiter = LinkLimiter(trace=load_trace(tc.link_trace))
    else:
      limiter = LinkLimiter(tc.link_bytes_per_s)
    limiters[name] = limiter
    tiers.append(make_chunk_store(tc.url, name, limiter))
    policies.append(factory())
    capacities.append(tc.effective_capacity_bytes)
  store = TieredStore(tiers, policies=policies, capacities=capacities,
                      write_all_persistent=write_all_persistent, placement=config.placement,
                      demotion_bytes_in_flight=(config.demotion_bytes_in_flight
                                                or DEFAULT_DEMOTION_BYTES_IN_FLIGHT))
  store.limiters = limiters
  store.local_dirs = {name: d for tc, name in zip(config.tiers, config.tier_names)
                      if tc.url is not None and (d := specs.local_dir(tc.url)) is not None}
  return store
