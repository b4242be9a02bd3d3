"""Storage tiers: host memory over disk over remote, with capacities, eviction and link limits.

CachedAttention, arXiv 2403.19708, section 3: KV of past turns lives in a hierarchy of tiers,
each with a capacity; reads come from the highest tier that holds a chunk and are promoted
toward the accelerator; eviction never drops what the look-ahead window needs and drops suffix
chunks before prefix chunks. Every tier's victims are chosen by a `PlacementPolicy` of
`kvjax/storage/eviction.py` (the policy classes the planner `kvjax/storage/placement.py` runs,
built from the same registry, `eviction.make_policy`); the tiers execute its choices.

Architecture:

    engine ── lookup(hashes) ─► one batched `contains` per tier (gathered): where each chunk is
           ── get(hash, ...) ─► host ─miss─► disk ─miss─► remote     (any miss falls through;
                                 ▲            │                       a corrupt copy is dropped)
                                 └─ promote ──┘  a hit below the host tier is copied into it
                                                 (the encoding that was read)
           ── put(hash, ...) ─► host tier and the first persistent tier (write-through; raw KV
                                and/or codec payloads, all encodings in one put)
                                write-back: the host tier only; what it evicts is demoted
           ── hint(window) ──► every tier's policy: hinted chunks are not evicted

Write-back placement (`placement="write_back"`, CachedAttention section 3.3.2): a put goes to the
host tier only (to the first persistent tier when the host declines it). A chunk the host evicts
is DEMOTED: written, in the encodings the host holds, to the first persistent tier, unless that
tier already holds it (a chunk promoted from disk costs no write) or it can never hit (its parent
is a non-root chunk that no tier holds). A persistent tier over its capacity evicts orphans
(chunks whose prefix chain is broken in every tier) first, then by its policy, and demotes each
victim to the next persistent tier (if any) before deleting it. Demotions run as tasks on the
store's event loop, off the load path, with at most `demotion_bytes_in_flight` bytes being
written (a put waits for room; a promotion is skipped when there is none); a demotion that fails
is counted in `demotion_drops` and the chunk is lost (a later request recomputes it).

Races: an evicted host chunk stays readable in the host tier (outside its capacity count) until
the lower tier has published it, so a read finds the host copy or the lower one, never neither; a
persistent tier's victim is written below before it is deleted, and reads fall through top down;
a chunk a load is reading from a persistent tier is not chosen as its victim.

A `Tier` is anything with the async chunk-store interface: `HostMemoryTier` here, and the
tensorstore `ChunkStore` for disk and remote tiers (reads paced by a `LinkLimiter`). The host tier
evicts inside its own `put`; a persistent tier's capacity is enforced here after each write, from
its `records()` and `delete()`, with recency known from this process's reads and writes (chunks
found on disk at start count as least recent).

`TierConfig` / `StoreConfig` are the frozen configuration; `build_tiers` turns one into a
`TieredStore`, given a factory for chunk stores (the engine passes the real `ChunkStore`).

Modules and parts: this one holds `TieredStore`'s reads, writes and hints and `build_tiers`;
`kvjax/storage/tier_api.py` the `KVStore` interface and its records (`TierStats`, `TierUsage`);
`kvjax/storage/tier_ledger.py` the books (`TierLedger`: counters, persistent tiers' recency and
byte mirrors, reads in progress); `kvjax/storage/tier_mover.py` the mover (`TierMover`:
demotions and capacity eviction). The store owns one ledger and one mover; the mover records in
the ledger and asks the store only where chunks are held (`lookup`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage import codecs, keys, specs
from kvjax.storage.eviction import LRUPolicy, PlacementPolicy, make_policy
from kvjax.storage.host_tier import HostMemoryTier, Tier
from kvjax.storage.link import LinkLimiter, load_trace
from kvjax.storage.store_config import (DEFAULT_DEMOTION_BYTES_IN_FLIGHT,
                                        DEFAULT_DISK_CAPACITY_BYTES,
                                        DEFAULT_STORE_CAPACITY_BYTES, PLACEMENTS, StoreConfig,
                                        TierConfig, url_kind)
from kvjax.storage.tier_api import KVStore, TierStats, TierUsage
from kvjax.storage.tier_ledger import PersistentTier, TierLedger
from kvjax.storage.tier_mover import TierMover
from kvjax.storage.types import (Chooser, ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                 EncodedPayload, KVLayout, MissReason)

__all__ = ["DEFAULT_DISK_CAPACITY_BYTES", "DEFAULT_STORE_CAPACITY_BYTES", "HostMemoryTier",
           "KVStore", "StoreConfig", "Tier", "TierConfig", "TierUsage",
           "TierStats", "TieredStore", "build_tiers", "url_kind"]

log = logging.getLogger(__name__)

#: Misses that mean the stored copy is bad (not merely another request's chunk): it is deleted
#: from its tier so a good copy can take its place.
_BAD_COPY = frozenset({MissReason.CORRUPT, MissReason.CHECKSUM_MISMATCH, MissReason.MISSING_DATA})


class TieredStore:
  """Tiers searched from the top, with promotion, write-through or write-back, and capacity
  eviction (demotion in write-back; see the module docstring).

  Attributes:
    tiers: the tiers, top first.
    host: the host tier (the first `HostMemoryTier`), or None.
    limiters: tier name -> its link limiter (set by `build_tiers`).
    local_dirs: persistent tier name -> its local directory, for tiers on a local file store
      (set by `build_tiers`; `specs.local_dir`).
    placement: "write_through" or "write_back".
    demotion_bytes_in_flight: write-back: bytes of demotions being written at most.
    mover: its `TierMover` (demotions, capacity eviction).
  """

  def __init__(self, tiers: Sequence[Tier], *,
               policies: Sequence[PlacementPolicy | None] | None = None,
               capacities: Sequence[int | None] | None = None,
               write_all_persistent: bool = False, drop_bad_copies: bool = True,
               placement: str = "write_through",
               demotion_bytes_in_flight: int = DEFAULT_DEMOTION_BYTES_IN_FLIGHT):
    """Creates a store over `tiers`.

    Args:
      tiers: top first; names distinct.
      policies: per tier, the eviction policy of a persistent tier (default `LRUPolicy`); must be
        None for a `HostMemoryTier` (it has its own).
      capacities: per tier, the byte limit of a persistent tier (None: unbounded); must be None
        for a `HostMemoryTier` (it has its own).
      write_all_persistent: `put` writes every persistent tier, not only the first.
      drop_bad_copies: delete a copy whose read found it corrupt, so a good one can replace it.
      placement: "write_through" or "write_back" (`StoreConfig.placement`). Write-back turns on
        the host tier's `demote` (this store then owns its evicted chunks).
      demotion_bytes_in_flight: write-back: bytes of demotions being written at most (a put
        waits for room; at least one demotion always runs).

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
    self._persist: dict[str, PersistentTier] = {}
    for t, p, c in zip(self.tiers, policies, capacities):
      if isinstance(t, HostMemoryTier):
        if p is not None or c is not None:
          raise ValueError(f"host tier {t.name!r} has its own policy and capacity")
        continue
      if c is not None and c <= 0:
        raise ValueError(f"capacity of tier {t.name!r} must be positive, got {c}")
      self._persist[t.name] = PersistentTier(c, p if p is not None else LRUPolicy())
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
    if placement == "write_back" and self.host is not None:
      self.host.demote = True
    self.limiters: dict[str, LinkLimiter] = {}
    self.local_dirs: dict[str, str] = {}
    self._ledger = TierLedger(names, self._persist)
    self.mover = TierMover(self.tiers, self.host, self._persist, self._ledger, self.lookup,
                           placement=placement,
                           demotion_bytes_in_flight=self.demotion_bytes_in_flight)

  # -- bookkeeping ------------------------------------------------------------------------------

  @property
  def stats(self) -> dict[str, TierStats]:
    """A snapshot of each tier's counters, by tier name."""
    out = self._ledger.stats()
    if self.host is not None:
      out[self.host.name].evictions = self.host.evictions
    return out

  async def drain(self) -> None:
    """Waits until every demotion started so far (on this event loop) is done."""
    await self.mover.drain()

  async def usage(self) -> list[TierUsage]:
    """What each persistent tier holds now, top first (lists every tier's records)."""
    return await self.mover.usage()

  async def enforce_capacity(self) -> None:
    """Brings every bounded persistent tier under its capacity (rescanning its records)."""
    await self.mover.enforce_capacity()

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """Passes the look-ahead window's chunk hashes to every tier's policy.

    Args:
      upcoming: per upcoming request, its chunk hashes; hinted chunks are not evicted until the
        next `hint` replaces the set (CachedAttention, arXiv 2403.19708, section 3.3).
    """
    if self.host is not None:
      self.host.hint(upcoming)
    for p in self._persist.values():
      p.policy.hint(upcoming)

  def host_capacity(self) -> tuple[str, int | None] | None:
    """(name, byte capacity or None for unbounded) of the host tier; None without one."""
    if self.host is None:
      return None
    return self.host.name, self.host.capacity_bytes

  async def prefetch(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                     layout: KVLayout, *, origin: ChunkOrigin | None = None) -> str | None:
    """Look-ahead prefetch (CachedAttention, arXiv 2403.19708, section 3.3.1): copies one chunk
    that only a tier below the host holds up into the host tier, verified like any read.

    The host tier makes room by its policy (hinted chunks are never evicted: `hint` first), and
    declines the copy when it cannot. Counted as a promotion of the host tier and a hit of the
    tier read.

    Args:
      chunk_hash, token_ids, namespace, layout, origin: as `get`.

    Returns:
      The name of the tier the chunk was read from when the host tier now holds a copy made by
      this call; None when there is no host tier, the host already held it, it has no room for
      a raw chunk without evicting a hinted one (checked before reading), no lower tier has a
      good copy, or the host declined it.
    """
    if self.host is None or (await self.host.contains([chunk_hash]))[0]:
      return None
    if not self.host.can_admit(layout.nbytes):
      return None  # only hinted chunks could make room: do not spend the link on it
    before = self._ledger.value(self.host.name, "promotions")
    got = await self.get(chunk_hash, token_ids, namespace, layout, promote=True, origin=origin)
    if not isinstance(got, ChunkHit) or got.tier == self.host.name:
      return None
    promoted = self._ledger.value(self.host.name, "promotions") > before
    return got.tier if promoted and (await self.host.contains([chunk_hash]))[0] else None

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
                origin: ChunkOrigin | None = None) -> ChunkHit | ChunkMiss:
    """Reads one chunk from the highest tier that has a good copy.

    Tiers are tried top down; any miss falls through to the next tier (a bad copy is deleted
    when `drop_bad_copies`). A hit below the host tier is copied into it when `promote`.

    Args:
      chunk_hash: the chunk's key.
      token_ids: the C token ids it must hold.
      namespace: hex root hash of the key namespace it must be under.
      layout: the shape and dtype it must have.
      promote: copy a lower-tier hit into the host tier (the encoding that was read).
      choose: which encoding to read, per tier (see `ChunkStore.get`); a tier whose encodings it
        declines misses with UNKNOWN_CODEC and the next tier is tried.
      origin: the model and layout version it must come from (`ChunkRecord.mismatch`; a
        mismatch is a miss with its own reason, counted per tier), or None.

    Returns:
      The hit (its `tier` names where it was read), or the first miss that is not ABSENT (else
      ABSENT) when no tier has a good copy.
    """
    first_miss: ChunkMiss | None = None
    for i, t in enumerate(self.tiers):
      # A persistent tier does not choose a chunk being read as a victim.
      self._ledger.read_started(t.name, chunk_hash)
      try:
        res = await t.get(chunk_hash, token_ids, namespace, layout, choose=choose, origin=origin)
      except Exception as e:  # noqa: BLE001  (a failing tier is a miss, never a user error)
        log.warning("get failed on tier %s", t.name, exc_info=True)
        res = ChunkMiss(chunk_hash, MissReason.READ_ERROR, repr(e))
      finally:
        self._ledger.read_ended(t.name, chunk_hash)
      if isinstance(res, ChunkHit):
        self._ledger.count(t.name, "hits")
        self._ledger.count(t.name, "bytes_read", int(res.encoding.nbytes))
        self._ledger.touch(t.name, chunk_hash)
        if promote and self.host is not None and i > self.tiers.index(self.host):
          await self._promote(res)
        return res
      self._ledger.miss(t.name, res.reason.value)
      if res.reason in _BAD_COPY and self.drop_bad_copies:
        await self._drop(t, chunk_hash)
      if first_miss is None or (first_miss.reason == MissReason.ABSENT
                                and res.reason != MissReason.ABSENT):
        first_miss = res
    assert first_miss is not None
    return first_miss

  async def _promote(self, hit: ChunkHit) -> None:
    if self.host.demote and not self.mover.has_room():
      return  # the load path never waits for demotions: no copy now, no eviction
    rec = hit.record
    if hit.encoding.codec == "raw":
      stored = await self.host.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace,
                                   hit.kv, checksum=hit.encoding.checksum,
                                   checksum_algo=hit.encoding.checksum_algo, origin=rec.origin)
    else:
      stored = await self.host.put(
          rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace, layout=rec.layout,
          payloads=[EncodedPayload(hit.encoding.codec, hit.encoding.level, hit.payload)],
          origin=rec.origin)
    if stored:
      self._ledger.count(self.host.name, "promotions")
      self._ledger.count(self.host.name, "bytes_written", int(hit.encoding.nbytes))
    self.mover.start_demotions()

  async def delete(self, chunk_hash: ChunkHash) -> list[str]:
    """Removes a chunk from every tier (e.g. before rewriting a bad copy).

    Returns:
      Names of the tiers that held it. A tier whose delete raises is logged and skipped.
    """
    async def one(t: Tier) -> bool:
      try:
        gone = bool(await t.delete(chunk_hash))
      except Exception:  # noqa: BLE001
        log.warning("delete failed on tier %s", t.name, exc_info=True)
        return False
      self._ledger.forget(t.name, chunk_hash)
      return gone

    done = await asyncio.gather(*(one(t) for t in self.tiers))
    return [t.name for t, gone in zip(self.tiers, done) if gone]

  async def _drop(self, t: Tier, chunk_hash: ChunkHash) -> None:
    try:
      if await t.delete(chunk_hash):
        self._ledger.count(t.name, "dropped")
        self._ledger.forget(t.name, chunk_hash)
    except Exception:  # noqa: BLE001
      log.warning("delete of a bad copy failed on tier %s", t.name, exc_info=True)

  # -- writes -----------------------------------------------------------------------------------

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (),
                origin: ChunkOrigin | None = None) -> list[str]:
    """Writes a chunk through to the host tier and the first persistent tier.

    The host copy serves the next turn at once; the persistent copy survives the process
    (CachedAttention saves each turn's KV). Lower tiers are written only with
    `write_all_persistent`. A persistent tier over its capacity afterwards evicts by its policy.
    A write that raises is logged and counted, never raised: saving is best effort.

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
    persistent = [t for t in self.tiers if t.name in self._persist]
    targets = persistent if self.write_all_persistent else persistent[:1]
    write_back = self.placement == "write_back" and self.host is not None
    if self.host is not None:
      targets = [self.host] if write_back else [self.host, *targets]

    async def one(t: Tier) -> bool:
      try:
        ok = await t.put(chunk_hash, parent_hash, token_ids, namespace, kv, layout=layout,
                         payloads=tuple(payloads), origin=origin)
      except Exception:  # noqa: BLE001
        log.warning("put failed on tier %s", t.name, exc_info=True)
        self._ledger.count(t.name, "put_errors")
        return False
      if t.name in self._persist:
        self._ledger.touch(t.name, chunk_hash, new=bool(ok))
      if ok:
        self._ledger.count(t.name, "puts")
        self._ledger.count(t.name, "bytes_written", nbytes)
        if t.name in self._persist:  # an estimate (encoded sizes differ); rescanned when full
          self._ledger.wrote(t.name, chunk_hash, nbytes)
          await self.mover.enforce(t)
      return bool(ok)

    if write_back:
      await self.mover.demotion_room()
      if await one(self.host):
        self.mover.start_demotions()
        return [self.host.name]
      self.mover.start_demotions()
      if (await self.host.contains([chunk_hash]))[0] or not persistent:
        return []
      # The host declined it (no room but hinted chunks, or larger than the host): the first
      # persistent tier takes it, so write-back never loses a save the host cannot hold.
      return [persistent[0].name] if await one(persistent[0]) else []
    done = await asyncio.gather(*(one(t) for t in targets))
    return [t.name for t, ok in zip(targets, done) if ok]


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
