"""The host-memory tier: verified KV chunks in process memory, with a capacity and eviction.

The top tier of CachedAttention's hierarchy (arXiv 2403.19708, section 3): it holds read-only
copies of chunks, verifies a read exactly like a `ChunkStore` does (token ids, namespace, layout),
and evicts with an `EvictionPolicy` inside its own `put`. `Tier` is the async interface every
tier shares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage.eviction import EntryInfo, EvictionPolicy, LRUPolicy, chain_depths
from kvjax.storage.types import (ChunkHit, ChunkMiss, ChunkRecord, Encoding, KVLayout,
                                 MissReason)


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
      bad = rec.mismatch(tuple(int(t) for t in token_ids), namespace, layout)
      if bad is not None:
        return bad
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
