"""Storage tiers: host memory over disk over remote, with capacities, eviction and link limits.

CachedAttention, arXiv 2403.19708, section 3: KV of past turns lives in a hierarchy of tiers,
each with a capacity; reads come from the highest tier that holds a chunk and are promoted
toward the accelerator; eviction never drops what the look-ahead window needs and drops suffix
chunks before prefix chunks (see `eviction.py`).

Architecture:

    engine ── lookup(hashes) ─► one batched `contains` per tier (gathered): where each chunk is
           ── get(hash, ...) ─► host ─miss─► disk ─miss─► remote     (any miss falls through;
                                 ▲            │                       a corrupt copy is dropped)
                                 └─ promote ──┘  a hit below the host tier is copied into it
           ── put(hash, ...) ─► host tier and the first persistent tier (write-through)
           ── hint(window) ──► every tier's policy: hinted chunks are not evicted

A `Tier` is anything with the async chunk-store interface: `HostMemoryTier` here, and the
tensorstore `ChunkStore` for disk and remote tiers (reads paced by a `LinkLimiter`). The host tier
evicts inside its own `put`; a persistent tier's capacity is enforced here after each write, from
its `records()` and `delete()`, with recency known from this process's reads and writes (chunks
found on disk at start count as least recent).

`TierConfig` / `StoreConfig` are the frozen configuration; `build_tiers` turns one into a
`TieredStore`, given a factory for chunk stores (the engine passes the real `ChunkStore`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage.eviction import EntryInfo, EvictionPolicy, LRUPolicy, chain_depths
from kvjax.storage.link import LinkLimiter, load_trace
from kvjax.storage.types import (ChunkHit, ChunkMiss, ChunkRecord, Encoding, KVLayout,
                                 MissReason)

log = logging.getLogger(__name__)

#: Byte limit of a disk tier when its config gives none (20 GiB: ~900k tokens of SmolLM2-135M
#: bf16 KV at 23,040 bytes per token).
DEFAULT_DISK_CAPACITY_BYTES = 20 * 2**30

#: Misses that mean the stored copy is bad (not merely another request's chunk): it is deleted
#: from its tier so a good copy can take its place.
_BAD_COPY = frozenset({MissReason.CORRUPT, MissReason.CHECKSUM_MISMATCH, MissReason.MISSING_DATA})


@runtime_checkable
class Tier(Protocol):
  """The async chunk-store interface every tier has (`HostMemoryTier`, `ChunkStore`)."""

  name: str

  async def contains(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    """Whether each chunk has a published record."""

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout) -> ChunkHit | ChunkMiss:
    """Reads and verifies one chunk."""

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray) -> bool:
    """Stores one chunk; True if this call published it."""

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    """Removes one chunk; True if it was there."""

  async def records(self) -> list[ChunkRecord]:
    """Every published record."""


def _layout_of(kv: np.ndarray) -> KVLayout:
  return KVLayout(num_layers=kv.shape[0], chunk_size=kv.shape[2], num_kv_heads=kv.shape[3],
                  head_dim=kv.shape[4], dtype=kv.dtype.name)


@dataclasses.dataclass
class _HostEntry:
  record: ChunkRecord
  kv: np.ndarray
  last_access: int
  inserted: int


class HostMemoryTier:
  """Chunks in host memory, bounded by `capacity_bytes`, evicted by a policy. Thread-safe.

  Reads verify like `ChunkStore.get`, in the same order: other token ids, another namespace or
  another layout is a miss with that reason. Stored arrays are private read-only copies; `get`
  returns them without a copy.

  Attributes:
    name: tier name (reported in hits and stats).
    capacity_bytes: byte limit; None for unbounded.
    policy: eviction policy.
    evictions: chunks evicted so far.
  """

  def __init__(self, capacity_bytes: int | None, name: str = "host",
               policy: EvictionPolicy | None = None):
    """Creates an empty tier.

    Raises:
      ValueError: `capacity_bytes` <= 0.
    """
    if capacity_bytes is not None and capacity_bytes <= 0:
      raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
    self.name = name
    self.capacity_bytes = capacity_bytes
    self.policy = policy if policy is not None else LRUPolicy()
    self.evictions = 0
    self._entries: dict[ChunkHash, _HostEntry] = {}
    self._used = 0
    self._counter = itertools.count(1)
    self._lock = threading.Lock()

  @property
  def used_bytes(self) -> int:
    """Bytes of KV held."""
    return self._used

  def __len__(self) -> int:
    return len(self._entries)

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """Forwards the look-ahead window to the policy (see `EvictionPolicy.hint`)."""
    self.policy.hint(upcoming)

  async def contains(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    with self._lock:
      return [h in self._entries for h in hashes]

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout) -> ChunkHit | ChunkMiss:
    """Returns the chunk if its namespace, token ids and layout match, else a miss."""
    with self._lock:
      entry = self._entries.get(chunk_hash)
      if entry is None:
        return ChunkMiss(chunk_hash, MissReason.ABSENT)
      rec = entry.record
      if rec.token_ids != tuple(int(t) for t in token_ids):
        return ChunkMiss(chunk_hash, MissReason.TOKEN_MISMATCH)
      if rec.namespace != namespace:
        return ChunkMiss(chunk_hash, MissReason.NAMESPACE_MISMATCH, rec.namespace)
      if rec.layout != layout:
        return ChunkMiss(chunk_hash, MissReason.LAYOUT_MISMATCH, f"stored {rec.layout}")
      entry.last_access = next(self._counter)
      return ChunkHit(record=rec, encoding=rec.encodings[0], kv=entry.kv, tier=self.name)

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray, *, checksum: str | None = None) -> bool:
    """Stores a copy of `kv`, evicting by the policy if the tier is full.

    Args:
      chunk_hash: the chunk's key.
      parent_hash: the previous chunk's key.
      token_ids: the C token ids of the chunk.
      namespace: hex root hash of the key namespace.
      kv: `[L, 2, C, K, H]` values, K before RoPE.
      checksum: hex SHA-256 of `kv`'s bytes if the caller knows it (skips hashing).

    Returns:
      True if stored now; False if already present (its recency is refreshed), larger than the
      capacity, or if room cannot be made without evicting hinted chunks.

    Raises:
      ValueError: `kv` is not `[L, 2, C, K, H]` with C == len(token_ids).
    """
    if kv.ndim != 5 or kv.shape[1] != 2 or kv.shape[2] != len(token_ids):
      raise ValueError(f"kv must be [L, 2, C={len(token_ids)}, K, H], got {kv.shape}")
    nbytes = int(kv.nbytes)
    if self.capacity_bytes is not None and nbytes > self.capacity_bytes:
      return False
    with self._lock:
      if chunk_hash in self._entries:
        self._entries[chunk_hash].last_access = next(self._counter)
        return False
    # Copy and hash outside the lock (the slow part); publish under it.
    data = np.array(kv, copy=True, order="C")
    data.setflags(write=False)
    if checksum is None:
      checksum = hashlib.sha256(data.reshape(-1).view(np.uint8)).hexdigest()
    enc = Encoding(codec="raw", codec_version=1, level=0, object=f"{self.name}/{chunk_hash}",
                   nbytes=nbytes, checksum=checksum)
    rec = ChunkRecord(chunk_hash=chunk_hash, parent_hash=parent_hash,
                      token_ids=tuple(int(t) for t in token_ids), namespace=namespace,
                      layout=_layout_of(data), encodings=(enc,))
    with self._lock:
      if chunk_hash in self._entries:  # a concurrent put won
        return False
      if self.capacity_bytes is not None:
        need = self._used + nbytes - self.capacity_bytes
        if need > 0 and not self._evict_locked(need):
          return False
      n = next(self._counter)
      self._entries[chunk_hash] = _HostEntry(rec, data, last_access=n, inserted=n)
      self._used += nbytes
      return True

  def _evict_locked(self, need: int) -> bool:
    """Evicts at least `need` bytes by the policy, or nothing if it cannot."""
    infos = self._infos_locked()
    victims = self.policy.victims(infos, need)
    sizes = {i.chunk_hash: i.nbytes for i in infos}
    if sum(sizes[v] for v in victims) < need:
      return False
    for v in victims:
      self._used -= self._entries.pop(v).kv.nbytes
      self.evictions += 1
    return True

  def _infos_locked(self) -> list[EntryInfo]:
    depths = chain_depths({h: e.record.parent_hash for h, e in self._entries.items()})
    return [EntryInfo(h, e.record.parent_hash, int(e.kv.nbytes), e.last_access, depths[h],
                      e.inserted) for h, e in self._entries.items()]

  def entries(self) -> list[EntryInfo]:
    """What the policy sees: one `EntryInfo` per chunk held."""
    with self._lock:
      return self._infos_locked()

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    with self._lock:
      entry = self._entries.pop(chunk_hash, None)
      if entry is None:
        return False
      self._used -= entry.kv.nbytes
      return True

  async def records(self) -> list[ChunkRecord]:
    with self._lock:
      return [e.record for e in self._entries.values()]


# ---------------------------------------------------------------------------------------------
# Configuration.

TierKind = Literal["host", "disk", "remote"]
_KINDS = ("host", "disk", "remote")


def url_kind(url: str) -> Literal["disk", "remote"]:
  """Classifies a store URL (forms of `specs.kvstore_spec`): local ones are "disk", s3 "remote".

  Raises:
    ValueError: an unknown scheme.
  """
  base = url[len("ocdbt+"):] if url.startswith("ocdbt+") else url
  if base.startswith("s3://"):
    return "remote"
  if base.startswith(("memory://", "file://")) or "://" not in base:
    return "disk"
  raise ValueError(f"unknown store URL scheme {base.split('://', 1)[0]!r} in {url!r}; want "
                   "memory://, file://, a path, ocdbt+file:// or s3://")


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """One tier.

  Attributes:
    kind: "host" (process memory), "disk" (a local store) or "remote" (a shared store).
    url: store URL for disk and remote tiers (see `specs.kvstore_spec`); None for host.
    capacity_bytes: byte limit. Required for host; disk defaults to
      `DEFAULT_DISK_CAPACITY_BYTES`; remote defaults to unbounded (left to the bucket's own
      lifecycle rules).
    link_bytes_per_s: emulated read bandwidth, bytes/s (see `link.gbps`); None: unlimited.
    link_trace: a rate trace file (see `link.load_trace`) instead of a constant.
    name: tier name in hits and stats; default: the kind, numbered if repeated.
  """

  kind: TierKind
  url: str | None = None
  capacity_bytes: int | None = None
  link_bytes_per_s: float | None = None
  link_trace: str | None = None
  name: str | None = None

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"tier kind must be one of {_KINDS}, got {self.kind!r}")
    if self.kind == "host":
      if self.url is not None:
        raise ValueError(f"a host tier takes no url, got {self.url!r}")
      if self.capacity_bytes is None:
        raise ValueError("a host tier needs capacity_bytes")
      if self.link_bytes_per_s is not None or self.link_trace is not None:
        raise ValueError("a host tier's reads are not link-limited; set the link on disk or "
                         "remote tiers")
    else:
      if self.url is None:
        raise ValueError(f"a {self.kind} tier needs a url")
      url_kind(self.url)
    if self.capacity_bytes is not None and self.capacity_bytes <= 0:
      raise ValueError(f"capacity_bytes must be positive, got {self.capacity_bytes}")
    if self.link_bytes_per_s is not None and self.link_trace is not None:
      raise ValueError("give link_bytes_per_s or link_trace, not both")
    if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
      raise ValueError(f"link_bytes_per_s must be positive, got {self.link_bytes_per_s}")
    if self.link_trace is not None and not self.link_trace:
      raise ValueError("link_trace must be a file path")

  @property
  def effective_capacity_bytes(self) -> int | None:
    """`capacity_bytes`, or the kind's default."""
    if self.capacity_bytes is None and self.kind == "disk":
      return DEFAULT_DISK_CAPACITY_BYTES
    return self.capacity_bytes


@dataclasses.dataclass(frozen=True)
class StoreConfig:
  """Tiers from the top (nearest the accelerator) down.

  Attributes:
    tiers: at least one; a host tier, if any, comes first and alone; names are distinct.
  """

  tiers: tuple[TierConfig, ...]

  def __post_init__(self):
    tiers = tuple(self.tiers)
    object.__setattr__(self, "tiers", tiers)
    if not tiers:
      raise ValueError("a store needs at least one tier")
    kinds = [t.kind for t in tiers]
    if kinds.count("host") > 1:
      raise ValueError("at most one host tier")
    if "host" in kinds and kinds[0] != "host":
      raise ValueError(f"the host tier must be the first (top) tier, got order {kinds}")
    if kinds == ["host"]:
      raise ValueError("a store needs a disk or remote tier below the host tier")
    names = self.tier_names
    if len(set(names)) != len(names):
      raise ValueError(f"tier names must be distinct, got {names}")

  @property
  def tier_names(self) -> tuple[str, ...]:
    """Each tier's name: its `name`, or its kind, numbered when the kind repeats."""
    counts = {k: sum(t.kind == k for t in self.tiers) for k in _KINDS}
    seen: dict[str, int] = {}
    out = []
    for t in self.tiers:
      seen[t.kind] = seen.get(t.kind, 0) + 1
      out.append(t.name or (t.kind if counts[t.kind] == 1 else f"{t.kind}{seen[t.kind]}"))
    return tuple(out)

  @classmethod
  def from_url(cls, url: str, *, host_capacity_bytes: int | None = None,
               capacity_bytes: int | None = None,
               link_bytes_per_s: float | None = None) -> "StoreConfig":
    """The simple `LLM(kv_store=url)` form: one tier, "disk" for local URLs, "remote" for s3.

    Args:
      url: store URL (memory://, file://, a path, ocdbt+file://, s3://).
      host_capacity_bytes: if given, a host tier of this size goes on top.
      capacity_bytes: the store tier's byte limit (default: by kind, see `TierConfig`).
      link_bytes_per_s: emulated read bandwidth of the store tier.

    Raises:
      ValueError: an unknown URL scheme or bad sizes.
    """
    tiers = [TierConfig(url_kind(url), url=url, capacity_bytes=capacity_bytes,
                        link_bytes_per_s=link_bytes_per_s)]
    if host_capacity_bytes is not None:
      tiers.insert(0, TierConfig("host", capacity_bytes=host_capacity_bytes))
    return cls(tuple(tiers))


# ---------------------------------------------------------------------------------------------
# The tiered store.

@dataclasses.dataclass
class TierStats:
  """Counters of one tier.

  Attributes:
    hits: verified reads served.
    misses: failed reads by `MissReason` value.
    promotions: chunks copied into this tier from a lower one.
    evictions: chunks evicted for capacity.
    puts: chunks published by `TieredStore.put` or promotion.
    put_errors: writes that raised.
    dropped: bad copies (corrupt, checksum mismatch, missing data) deleted after a read.
  """

  hits: int = 0
  misses: dict[str, int] = dataclasses.field(default_factory=dict)
  promotions: int = 0
  evictions: int = 0
  puts: int = 0
  put_errors: int = 0
  dropped: int = 0


@dataclasses.dataclass
class _Persistent:
  """Capacity bookkeeping of a persistent tier."""

  capacity_bytes: int | None
  policy: EvictionPolicy
  access: dict[ChunkHash, int] = dataclasses.field(default_factory=dict)
  inserted: dict[ChunkHash, int] = dataclasses.field(default_factory=dict)
  mirror: dict[ChunkHash, int] | None = None  # chunk -> bytes, from records() plus our puts
  evicting: bool = False


def _record_nbytes(rec: ChunkRecord) -> int:
  return sum(e.nbytes for e in rec.encodings)


class TieredStore:
  """Tiers searched from the top, with promotion, write-through and capacity eviction.

  Attributes:
    tiers: the tiers, top first.
    host: the host tier (the first `HostMemoryTier`), or None.
    limiters: tier name -> its link limiter (set by `build_tiers`).
  """

  def __init__(self, tiers: Sequence[Tier], *,
               policies: Sequence[EvictionPolicy | None] | None = None,
               capacities: Sequence[int | None] | None = None,
               write_all_persistent: bool = False, drop_bad_copies: bool = True):
    """Creates a store over `tiers`.

    Args:
      tiers: top first; names distinct.
      policies: per tier, the eviction policy of a persistent tier (default `LRUPolicy`); must be
        None for a `HostMemoryTier` (it has its own).
      capacities: per tier, the byte limit of a persistent tier (None: unbounded); must be None
        for a `HostMemoryTier` (it has its own).
      write_all_persistent: `put` writes every persistent tier, not only the first.
      drop_bad_copies: delete a copy whose read found it corrupt, so a good one can replace it.

    Raises:
      ValueError: no tiers, repeated names, lengths that do not match, a policy or capacity given
        for a host tier, or a non-positive capacity.
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
    self._persist: dict[str, _Persistent] = {}
    for t, p, c in zip(self.tiers, policies, capacities):
      if isinstance(t, HostMemoryTier):
        if p is not None or c is not None:
          raise ValueError(f"host tier {t.name!r} has its own policy and capacity")
        continue
      if c is not None and c <= 0:
        raise ValueError(f"capacity of tier {t.name!r} must be positive, got {c}")
      self._persist[t.name] = _Persistent(c, p if p is not None else LRUPolicy())
    self.write_all_persistent = write_all_persistent
    self.drop_bad_copies = drop_bad_copies
    self.limiters: dict[str, LinkLimiter] = {}
    self._stats = {name: TierStats() for name in names}
    self._lock = threading.Lock()
    self._counter = itertools.count(1)

  # -- bookkeeping ------------------------------------------------------------------------------

  @property
  def stats(self) -> dict[str, TierStats]:
    """A snapshot of each tier's counters, by tier name."""
    with self._lock:
      out = {k: dataclasses.replace(v, misses=dict(v.misses)) for k, v in self._stats.items()}
    if self.host is not None:
      out[self.host.name].evictions = self.host.evictions
    return out

  def _count(self, tier: str, field: str, n: int = 1) -> None:
    with self._lock:
      s = self._stats[tier]
      setattr(s, field, getattr(s, field) + n)

  def _touch(self, tier: str, chunk_hash: ChunkHash, *, new: bool = False) -> None:
    p = self._persist.get(tier)
    if p is None:
      return
    with self._lock:
      n = next(self._counter)
      p.access[chunk_hash] = n
      if new:
        p.inserted[chunk_hash] = n

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

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, promote: bool = True) -> ChunkHit | ChunkMiss:
    """Reads one chunk from the highest tier that has a good copy.

    Tiers are tried top down; any miss falls through to the next tier (a bad copy is deleted
    when `drop_bad_copies`). A hit below the host tier is copied into it when `promote`.

    Args:
      chunk_hash: the chunk's key.
      token_ids: the C token ids it must hold.
      namespace: hex root hash of the key namespace it must be under.
      layout: the shape and dtype it must have.
      promote: copy a lower-tier hit into the host tier.

    Returns:
      The hit (its `tier` names where it was read), or the first miss that is not ABSENT (else
      ABSENT) when no tier has a good copy.
    """
    first_miss: ChunkMiss | None = None
    for i, t in enumerate(self.tiers):
      try:
        res = await t.get(chunk_hash, token_ids, namespace, layout)
      except Exception as e:  # noqa: BLE001  (a failing tier is a miss, never a user error)
        log.warning("get failed on tier %s", t.name, exc_info=True)
        res = ChunkMiss(chunk_hash, MissReason.READ_ERROR, repr(e))
      if isinstance(res, ChunkHit):
        self._count(t.name, "hits")
        self._touch(t.name, chunk_hash)
        if promote and self.host is not None and i > self.tiers.index(self.host):
          await self._promote(res)
        return res
      with self._lock:
        m = self._stats[t.name].misses
        m[res.reason.value] = m.get(res.reason.value, 0) + 1
      if res.reason in _BAD_COPY and self.drop_bad_copies:
        await self._drop(t, chunk_hash)
      if first_miss is None or (first_miss.reason == MissReason.ABSENT
                                and res.reason != MissReason.ABSENT):
        first_miss = res
    assert first_miss is not None
    return first_miss

  async def _promote(self, hit: ChunkHit) -> None:
    rec = hit.record
    if await self.host.put(rec.chunk_hash, rec.parent_hash, rec.token_ids, rec.namespace, hit.kv,
                           checksum=hit.encoding.checksum):
      self._count(self.host.name, "promotions")

  async def _drop(self, t: Tier, chunk_hash: ChunkHash) -> None:
    try:
      if await t.delete(chunk_hash):
        self._count(t.name, "dropped")
        self._forget(t.name, chunk_hash)
    except Exception:  # noqa: BLE001
      log.warning("delete of a bad copy failed on tier %s", t.name, exc_info=True)

  def _forget(self, tier: str, chunk_hash: ChunkHash) -> None:
    p = self._persist.get(tier)
    if p is None:
      return
    with self._lock:
      p.access.pop(chunk_hash, None)
      p.inserted.pop(chunk_hash, None)
      if p.mirror is not None:
        p.mirror.pop(chunk_hash, None)

  # -- writes -----------------------------------------------------------------------------------

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray) -> list[str]:
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
      kv: `[L, 2, C, K, H]` values, K before RoPE.

    Returns:
      Names of the tiers that published the chunk by this call (already present: not listed).
    """
    persistent = [t for t in self.tiers if t.name in self._persist]
    targets = persistent if self.write_all_persistent else persistent[:1]
    if self.host is not None:
      targets = [self.host, *targets]

    async def one(t: Tier) -> bool:
      try:
        ok = await t.put(chunk_hash, parent_hash, token_ids, namespace, kv)
      except Exception:  # noqa: BLE001
        log.warning("put failed on tier %s", t.name, exc_info=True)
        self._count(t.name, "put_errors")
        return False
      if t.name in self._persist:
        self._touch(t.name, chunk_hash, new=bool(ok))
      if ok:
        self._count(t.name, "puts")
        p = self._persist.get(t.name)
        if p is not None:
          with self._lock:
            if p.mirror is not None:
              p.mirror[chunk_hash] = int(kv.nbytes)
          await self._enforce_capacity(t)
      return bool(ok)

    done = await asyncio.gather(*(one(t) for t in targets))
    return [t.name for t, ok in zip(targets, done) if ok]

  async def enforce_capacity(self) -> None:
    """Brings every bounded persistent tier under its capacity (rescanning its records)."""
    for t in self.tiers:
      p = self._persist.get(t.name)
      if p is not None and p.capacity_bytes is not None:
        with self._lock:
          p.mirror = None
        await self._enforce_capacity(t)

  async def _enforce_capacity(self, t: Tier) -> None:
    """Evicts from persistent tier `t` by its policy until it fits its capacity.

    The byte count is a mirror of `records()` updated by our own puts; when it says the tier is
    over capacity (or it is unknown) the records are listed afresh before choosing victims, so
    other writers' chunks count too. One pass runs at a time per tier.
    """
    p = self._persist[t.name]
    with self._lock:
      if p.capacity_bytes is None or p.evicting:
        return
      if p.mirror is not None and sum(p.mirror.values()) <= p.capacity_bytes:
        return
      p.evicting = True
    try:
      recs = await t.records()
      with self._lock:
        p.mirror = {r.chunk_hash: _record_nbytes(r) for r in recs}
        total = sum(p.mirror.values())
        if total <= p.capacity_bytes:
          return
        depths = chain_depths({r.chunk_hash: r.parent_hash for r in recs})
        infos = [EntryInfo(r.chunk_hash, r.parent_hash, p.mirror[r.chunk_hash],
                           p.access.get(r.chunk_hash, 0), depths[r.chunk_hash],
                           p.inserted.get(r.chunk_hash, 0)) for r in recs]
      for v in p.policy.victims(infos, total - p.capacity_bytes):
        try:
          gone = await t.delete(v)
        except Exception:  # noqa: BLE001
          log.warning("eviction delete failed on tier %s", t.name, exc_info=True)
          continue
        if gone:
          self._count(t.name, "evictions")
        self._forget(t.name, v)
    finally:
      with self._lock:
        p.evicting = False


def build_tiers(config: StoreConfig, *,
                make_chunk_store: Callable[[str, str, LinkLimiter], Tier],
                host_policy: EvictionPolicy | None = None,
                policy_factory: Callable[[], EvictionPolicy] = LRUPolicy,
                write_all_persistent: bool = False) -> TieredStore:
  """Builds a `TieredStore` from its configuration.

  Args:
    config: the tiers, top first.
    make_chunk_store: `(url, name, limiter) -> Tier` for disk and remote tiers (the engine passes
      the tensorstore `ChunkStore`).
    host_policy: eviction policy of the host tier (default `LRUPolicy`).
    policy_factory: makes the eviction policy of each persistent tier.
    write_all_persistent: see `TieredStore`.

  Returns:
    The store; `store.limiters` maps each disk or remote tier's name to its `LinkLimiter`
    (unlimited when the config sets no link).

  Raises:
    ValueError: a bad link trace file (see `link.load_trace`).
    OSError: a link trace file that cannot be read.
  """
  tiers: list[Tier] = []
  policies: list[EvictionPolicy | None] = []
  capacities: list[int | None] = []
  limiters: dict[str, LinkLimiter] = {}
  for tc, name in zip(config.tiers, config.tier_names):
    if tc.kind == "host":
      tiers.append(HostMemoryTier(tc.capacity_bytes, name=name, policy=host_policy))
      policies.append(None)
      capacities.append(None)
      continue
    if tc.link_trace is not None:
      limiter = LinkLimiter(trace=load_trace(tc.link_trace))
    else:
      limiter = LinkLimiter(tc.link_bytes_per_s)
    limiters[name] = limiter
    tiers.append(make_chunk_store(tc.url, name, limiter))
    policies.append(policy_factory())
    capacities.append(tc.effective_capacity_bytes)
  store = TieredStore(tiers, policies=policies, capacities=capacities,
                      write_all_persistent=write_all_persistent)
  store.limiters = limiters
  return store
