"""The host-memory tier: verified KV chunks in process memory, with a capacity and eviction.

The top tier of CachedAttention's hierarchy (arXiv 2403.19708, section 3): it holds read-only
copies of chunks, verifies a read exactly like a `ChunkStore` does (token ids, namespace, layout),
and evicts the victims its `PlacementPolicy` (`kvjax.storage.tiering.eviction`) chooses inside its own
`put`. A chunk may be held in several encodings (raw and codec payloads): the host keeps each
encoding's arrays as given (quantized codecs stay quantized, so host memory holds compressed
chunks; entropy coding is a byte format and is not kept here), and counts their bytes against
the capacity. `Tier` is the async
interface every tier shares.

With `demote=True` an evicted chunk is not dropped at once: it leaves the capacity count and
waits, still readable, as an `Evicted` record until it has been written to the next tier down
(`take_evicted`, then `release`), so a read racing a demotion finds either this copy or the
lower one.

Inside a `TieredStore` the tier is `managed`: the store's planner (`kvjax.storage.tiering.placement`)
owns its capacity and chooses its victims, so `put` never evicts, and the mover takes a victim
out with `start_leaving` (the same readable-until-`release` record) before writing it below.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage.format import checksum as checksums
from kvjax.storage.format import codecs
from kvjax.storage.format import entropy
from kvjax.storage.tiering.eviction import EntryInfo, LRUPolicy, PlacementPolicy, chain_depths
from kvjax.storage.format.types import (Chooser, ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                        EncodedPayload, Encoding, KVLayout, MissReason)


@runtime_checkable
class Tier(Protocol):
  """The async interface every tier has (`HostMemoryTier`, `ChunkStore`; test fakes implement
  all of it). `TieredStore` calls every method with every argument shown; no caller probes.
  """

  name: str

  async def contains(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    """Whether each chunk has a published record (a planning hint; `get` verifies)."""

  async def peek(self, hashes: Sequence[ChunkHash]) -> list[ChunkRecord | None]:
    """Each chunk's record (its encodings and stored sizes), None if absent or unreadable."""

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, choose: Chooser | None = None,
                origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """Reads and verifies one chunk in the encoding `choose` picks (None: raw, else first);
    `origin` (if given) is checked against the record's (`ChunkRecord.mismatch`). `layer_start`
    k > 0: a raw hit holds layers `[k, L)` only (`ChunkHit.layer_start`, `kv`
    `[L - k, 2, C, K, H]`); a tier that cannot read a range reads whole and slices; other
    codecs are read whole."""

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (),
                origin: ChunkOrigin | None = None) -> bool:
    """Stores one chunk (raw `kv` and/or codec payloads) with its `origin` in its record; True
    if this call published it."""

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    """Removes one chunk; True if it was there."""

  async def records(self) -> list[ChunkRecord]:
    """Every published record."""

  def snapshot(self) -> dict[str, Any]:
    """This tier's own counters as plain data (names differ by tier kind)."""


def _default_choose(encodings: Sequence[Encoding]) -> Encoding | None:
  return next((e for e in encodings if e.codec == "raw"), encodings[0] if encodings else None)


@dataclasses.dataclass
class _HostEntry:
  record: ChunkRecord
  arrays: dict[tuple[str, int], Mapping[str, np.ndarray]]  # (codec, level) -> read-only arrays
  nbytes: int
  last_access: int
  inserted: int


@dataclasses.dataclass(frozen=True, eq=False)
class Evicted:
  """A chunk the host tier evicted and holds, still readable, until its demotion is done.

  Attributes:
    record: its record (encodings as held here).
    payloads: every encoding held, as `EncodedPayload`s (raw: `{"values": kv}`), read-only.
    nbytes: bytes of those arrays.
  """

  record: ChunkRecord
  payloads: tuple[EncodedPayload, ...]
  nbytes: int


def _frozen_copy(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  out = {}
  for name, a in arrays.items():
    if isinstance(a, entropy.RansCodes):  # kept coded: host memory holds compressed chunks
      out[name] = a.frozen_copy()
      continue
    c = np.array(a, copy=True, order="C")
    c.setflags(write=False)
    out[name] = c
  return out


class HostMemoryTier:
  """Chunks in host memory, bounded by `capacity_bytes`, evicted by a policy. Thread-safe.

  Reads verify like `ChunkStore.get`, in the same order: other token ids, another namespace or
  another layout is a miss with that reason. Stored arrays are private read-only copies; `get`
  returns them without a copy.

  Attributes:
    name: tier name (reported in hits and stats).
    capacity_bytes: byte limit on the arrays held (all encodings); None for unbounded.
    policy: eviction policy.
    evictions: chunks evicted so far.
  """

  def __init__(self, capacity_bytes: int | None, name: str = "host",
               policy: PlacementPolicy | None = None, *, demote: bool = False):
    """Creates an empty tier.

    Args:
      capacity_bytes: byte limit (None: unbounded).
      name: tier name.
      policy: eviction policy (default `LRUPolicy`).
      demote: keep each evicted chunk readable, outside the capacity count, until `release`
        (the write-back placement demotes it to the next tier; see `take_evicted`).

    Raises:
      ValueError: `capacity_bytes` <= 0.
    """
    if capacity_bytes is not None and capacity_bytes <= 0:
      raise ValueError(f"capacity_bytes must be positive or None, got {capacity_bytes}")
    self.name = name
    self.capacity_bytes = capacity_bytes
    self.policy = policy if policy is not None else LRUPolicy()
    self.evictions = 0
    self.demote = demote
    self.managed = False  # set by `TieredStore`: its planner owns the capacity (put never evicts)
    self._entries: dict[ChunkHash, _HostEntry] = {}
    self._leaving: dict[ChunkHash, _HostEntry] = {}  # evicted, demotion not yet done
    self._evicted: list[_HostEntry] = []  # not yet taken by take_evicted
    self._used = 0
    self._counter = itertools.count(1)
    self._lock = threading.Lock()

  @property
  def used_bytes(self) -> int:
    """Bytes of arrays held."""
    return self._used

  def __len__(self) -> int:
    return len(self._entries)

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """Forwards the look-ahead window to the policy (see `PlacementPolicy.hint`)."""
    self.policy.hint(upcoming)

  async def contains(self, hashes: Sequence[ChunkHash]) -> list[bool]:
    with self._lock:
      return [h in self._entries or h in self._leaving for h in hashes]

  async def peek(self, hashes: Sequence[ChunkHash]) -> list[ChunkRecord | None]:
    """Each held chunk's record (listing the encodings held here), or None."""
    with self._lock:
      out = []
      for h in hashes:
        e = self._entries.get(h) or self._leaving.get(h)
        out.append(e.record if e is not None else None)
      return out

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, choose: Chooser | None = None,
                origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """Returns the chunk if its record matches (`ChunkRecord.mismatch`: model, layout, dtype,
    chunk size, token ids, namespace), else a miss.

    Args:
      chunk_hash, token_ids, namespace, layout, origin: as `ChunkStore.get`.
      choose: picks one of the held encodings (default: raw, else the first); None from it is an
        UNKNOWN_CODEC miss.
      layer_start: k in `[0, L)`; k > 0: a raw hit is a view of the held chunk's layers
        `[k, L)` (`kv` `[L - k, 2, C, K, H]`, `nbytes` those layers' share); other codecs are
        returned whole (`layer_start` 0).

    Raises:
      ValueError: `choose` returned something that is not one of the encodings it was given;
        `layer_start` not in `[0, L)`.
    """
    if not 0 <= layer_start < layout.num_layers:
      raise ValueError(f"layer_start {layer_start} not in [0, {layout.num_layers})")
    with self._lock:
      entry = self._entries.get(chunk_hash) or self._leaving.get(chunk_hash)
      if entry is None:
        return ChunkMiss(chunk_hash, MissReason.ABSENT)
      rec = entry.record
      bad = rec.mismatch(tuple(int(t) for t in token_ids), namespace, layout, origin)
      if bad is not None:
        return bad
      encoding = (choose or _default_choose)(rec.encodings)
      if encoding is None:
        return ChunkMiss(chunk_hash, MissReason.UNKNOWN_CODEC, "none chosen of " + ",".join(
            f"{e.codec}/{e.codec_version}/{e.level}" for e in rec.encodings))
      if encoding not in rec.encodings:
        raise ValueError(f"choose returned {encoding!r}, not one of the encodings it was given")
      entry.last_access = next(self._counter)
      arrays = entry.arrays[(encoding.codec, encoding.level)]
    kv = arrays["values"] if encoding.codec == "raw" else None
    hit = ChunkHit(record=rec, encoding=encoding, kv=kv, tier=self.name, payload=dict(arrays))
    if layer_start and kv is not None:  # held whole: a view of the layers asked for
      return hit.from_layer(layer_start, encoding.nbytes // layout.num_layers
                            * (layout.num_layers - layer_start))
    return hit

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (), checksum: str | None = None,
                checksum_algo: str = checksums.CURRENT,
                origin: ChunkOrigin | None = None) -> bool:
    """Stores copies of `kv` and/or `payloads`, evicting by the policy if the tier is full.

    A chunk already held gains the encodings it lacks (if its record matches: same token ids,
    namespace and layout); its recency is refreshed either way.

    Args:
      chunk_hash: the chunk's key.
      parent_hash: the previous chunk's key.
      token_ids: the C token ids of the chunk.
      namespace: hex root hash of the key namespace.
      kv: raw `[L, 2, C, K, H]` values, K before RoPE, or None.
      layout: the raw layout (default `kv`'s; required without `kv`).
      payloads: codec payloads to hold (`EncodedPayload`; see `ChunkStore.put`).
      checksum: hex checksum of `kv`'s bytes if the caller knows it (skips hashing), e.g. a
        promoted hit's `Encoding.checksum`.
      checksum_algo: the algorithm of `checksum` (`storage.format.checksum`).
      origin: the model and layout version that computed the KV (kept in the record).

    Returns:
      True if something was stored now; False if everything given is already held, the chunk is
      held under another record, the new encodings are larger than the capacity, or room cannot
      be made without evicting hinted chunks.

    Raises:
      ValueError: invalid input, as for `ChunkStore.put` (`codecs.check_encodings`).
    """
    token_ids = tuple(int(t) for t in token_ids)
    layout, checked = codecs.check_encodings(token_ids, kv, layout, payloads)
    with self._lock:
      held = self._entries.get(chunk_hash)
      if held is not None:
        held.last_access = next(self._counter)
        if held.record.mismatch(token_ids, namespace, layout, origin) is not None:
          return False
        checked = [p for p in checked if (p.codec, p.level) not in held.arrays]
        if not checked:
          return False
    nbytes = sum(codecs.payload_nbytes(p.arrays) for p in checked)
    if not self.managed and self.capacity_bytes is not None and nbytes > self.capacity_bytes:
      return False
    # Copy and hash outside the lock (the slow part); publish under it.
    new_arrays, new_encodings = {}, []
    for p in checked:
      arrays = _frozen_copy(p.arrays)
      known = p.codec == "raw" and checksum is not None
      digest = checksum if known else codecs.payload_checksum(arrays)
      new_arrays[(p.codec, p.level)] = arrays
      new_encodings.append(Encoding(
          codec=p.codec, codec_version=codecs.CURRENT_VERSION[p.codec], level=p.level,
          object=f"{self.name}/{chunk_hash}/{p.codec}-{p.level}",
          nbytes=codecs.payload_nbytes(arrays), checksum=digest,
          checksum_algo=checksum_algo if known else checksums.CURRENT))
    with self._lock:
      held = self._entries.get(chunk_hash)  # a concurrent put or delete may have changed it
      if held is not None and (
          held.record.mismatch(token_ids, namespace, layout, origin) is not None
          or any(k in held.arrays for k in new_arrays)):
        return False
      if not self.managed and self.capacity_bytes is not None:
        need = self._used + nbytes - self.capacity_bytes
        if need > 0 and not self._evict_locked(need, keep=chunk_hash):
          return False
      n = next(self._counter)
      if held is None:
        rec = ChunkRecord(chunk_hash=chunk_hash, parent_hash=parent_hash, token_ids=token_ids,
                          namespace=namespace, layout=layout, encodings=tuple(new_encodings),
                          origin=origin)
        self._entries[chunk_hash] = _HostEntry(rec, new_arrays, nbytes, last_access=n, inserted=n)
      else:
        encodings = held.record.encodings + tuple(new_encodings)
        encodings = tuple(sorted(encodings, key=lambda e: e.codec != "raw"))  # raw first
        held.record = dataclasses.replace(held.record, encodings=encodings)
        held.arrays.update(new_arrays)
        held.nbytes += nbytes
        held.last_access = n
      self._used += nbytes
      return True

  def can_admit(self, nbytes: int) -> bool:
    """Whether a new chunk of `nbytes` would fit now, evicting only what the policy may evict
    (never a hinted chunk); evicts nothing."""
    with self._lock:
      if self.capacity_bytes is None:
        return True
      need = self._used + int(nbytes) - self.capacity_bytes
      if need <= 0:
        return True
      infos = self._infos_locked()
      sizes = {i.chunk_hash: i.nbytes for i in infos}
      return sum(sizes.get(v, 0) for v in self.policy.victims(infos, need)) >= need

  def _evict_locked(self, need: int, keep: ChunkHash | None = None) -> bool:
    """Evicts at least `need` bytes by the policy (never `keep`), or nothing if it cannot."""
    infos = [i for i in self._infos_locked() if i.chunk_hash != keep]
    victims = self.policy.victims(infos, need)
    sizes = {i.chunk_hash: i.nbytes for i in infos}
    if any(v not in sizes for v in victims) or sum(sizes[v] for v in victims) < need:
      return False
    for v in victims:
      entry = self._entries.pop(v)
      self._used -= entry.nbytes
      self.evictions += 1
      if self.demote:
        self._leaving[v] = entry
        self._evicted.append(entry)
    return True

  def start_leaving(self, chunk_hash: ChunkHash) -> Evicted | None:
    """Takes a chunk its owner's planner chose as a victim out of the capacity count; it stays
    readable until `release`, while it is written below. None if it is not held."""
    with self._lock:
      entry = self._entries.pop(chunk_hash, None)
      if entry is None:
        return None
      self._used -= entry.nbytes
      self._leaving[chunk_hash] = entry
    return Evicted(entry.record, tuple(EncodedPayload(c, l, a)
                                       for (c, l), a in entry.arrays.items()), entry.nbytes)

  def take_evicted(self) -> list[Evicted]:
    """The chunks evicted since the last call, in eviction order (with `demote`; else []).

    Each stays readable here until `release`: the caller writes it to the next tier first.
    """
    with self._lock:
      taken, self._evicted = self._evicted, []
    return [Evicted(e.record, tuple(EncodedPayload(c, l, a) for (c, l), a in e.arrays.items()),
                    e.nbytes) for e in taken]

  def is_leaving(self, chunk_hash: ChunkHash) -> bool:
    """Whether an evicted chunk is held for its demotion (not yet released or deleted)."""
    with self._lock:
      return chunk_hash in self._leaving

  def release(self, chunk_hash: ChunkHash) -> bool:
    """Forgets an evicted chunk (its demotion is done, or failed); True if it was held."""
    with self._lock:
      return self._leaving.pop(chunk_hash, None) is not None

  @property
  def leaving_bytes(self) -> int:
    """Bytes of evicted chunks still held for their demotion."""
    with self._lock:
      return sum(e.nbytes for e in self._leaving.values())

  def _infos_locked(self) -> list[EntryInfo]:
    depths = chain_depths({h: e.record.parent_hash for h, e in self._entries.items()})
    return [EntryInfo(h, e.record.parent_hash, e.nbytes, e.last_access, depths[h],
                      e.inserted) for h, e in self._entries.items()]

  def entries(self) -> list[EntryInfo]:
    """What the policy sees: one `EntryInfo` per chunk held."""
    with self._lock:
      return self._infos_locked()

  async def delete(self, chunk_hash: ChunkHash) -> bool:
    with self._lock:
      leaving = self._leaving.pop(chunk_hash, None)
      entry = self._entries.pop(chunk_hash, None)
      if entry is None:
        return leaving is not None
      self._used -= entry.nbytes
      return True

  async def records(self) -> list[ChunkRecord]:
    with self._lock:
      return [e.record for e in self._entries.values()] + [
          e.record for h, e in self._leaving.items() if h not in self._entries]

  def snapshot(self) -> dict[str, Any]:
    """{"chunks", "used_bytes", "capacity_bytes" (None: unbounded), "evictions",
    "demoting_chunks" (evicted, held until their demotion is done)}."""
    with self._lock:
      return {"chunks": len(self._entries), "used_bytes": self._used,
              "capacity_bytes": self.capacity_bytes, "evictions": self.evictions,
              "demoting_chunks": len(self._leaving)}
