"""What the engine sees of a tiered store: the `KVStore` interface and its plain-data records
(`TierStats` per tier, `TierUsage` per persistent tier). `kvjax.storage.tiering.tiers.TieredStore` is
the implementation; test fakes implement all of `KVStore`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage.tiering.host_tier import Tier
from kvjax.storage.backends.link import LinkLimiter
from kvjax.storage.format.types import (Chooser, ChunkHit, ChunkMiss, ChunkOrigin, ChunkRecord,
                                        EncodedPayload, KVLayout)

__all__ = ["KVStore", "TierStats", "TierUsage"]


@dataclasses.dataclass
class TierStats:
  """Counters of one tier.

  Attributes:
    hits: verified reads served.
    bytes_read: stored bytes of those reads (`ChunkHit.nbytes`: the encoding's, or a layer
      range's share of them).
    misses: failed reads by `MissReason` value.
    promotions: chunks copied into this tier from a lower one.
    evictions: chunks evicted for capacity.
    puts: chunks published by `TieredStore.put` or promotion.
    put_errors: writes that raised.
    dropped: bad copies (corrupt, checksum mismatch, missing data) deleted after a read.
    demotions_in: chunks written into this tier by a demotion from the tier above (write-back).
    demotions_out: chunks this tier evicted that the tier below took by a demotion.
    demotions_unneeded: chunks this tier evicted that the tier below already held (no write).
    demotion_drops: chunks this tier evicted and lost: the demotion failed, the tier below
      declined it, or there is no tier below (a later request recomputes them).
    orphans_dropped: chunks this tier evicted without demoting them (or chose first as victims)
      because no tier holds their parent: they can never hit.
    bytes_written: bytes of the chunks published into this tier (puts, promotions, demotions;
      the arrays given, before a tier's own encoding).
  """

  hits: int = 0
  bytes_read: int = 0
  misses: dict[str, int] = dataclasses.field(default_factory=dict)
  promotions: int = 0
  evictions: int = 0
  puts: int = 0
  put_errors: int = 0
  dropped: int = 0
  demotions_in: int = 0
  demotions_out: int = 0
  demotions_unneeded: int = 0
  demotion_drops: int = 0
  orphans_dropped: int = 0
  bytes_written: int = 0


@runtime_checkable
class KVStore(Protocol):
  """What the engine's store client uses of a store: `TieredStore` has all of it, and so must
  every test fake (no caller probes for a method)."""

  tiers: list[Tier]
  limiters: dict[str, LinkLimiter]
  local_dirs: dict[str, str]

  async def lookup(self, hashes: Sequence[ChunkHash]) -> list[str | None]:
    """The highest tier holding each chunk, or None."""

  async def peek(self, hashes: Sequence[ChunkHash]
                 ) -> list[tuple[str, ChunkRecord | None] | None]:
    """(tier, record) of the highest tier holding each chunk, or None."""

  async def get(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                layout: KVLayout, *, promote: bool = True, choose: Chooser | None = None,
                origin: ChunkOrigin | None = None, layer_start: int = 0) -> ChunkHit | ChunkMiss:
    """A verified read from the highest tier with a good copy (layers `[layer_start, L)` only
    when `layer_start` > 0)."""

  async def put(self, chunk_hash: ChunkHash, parent_hash: ChunkHash, token_ids: Sequence[int],
                namespace: str, kv: np.ndarray | None = None, *, layout: KVLayout | None = None,
                payloads: Sequence[EncodedPayload] = (),
                origin: ChunkOrigin | None = None) -> list[str]:
    """Write-through; the names of the tiers that published the chunk."""

  async def delete(self, chunk_hash: ChunkHash) -> list[str]:
    """Removes a chunk from every tier; the names of the tiers that held it."""

  async def drain(self) -> None:
    """Waits until every demotion started so far is done (write-back; else returns at once)."""

  def hint(self, upcoming: Sequence[Sequence[ChunkHash]]) -> None:
    """The look-ahead window for eviction."""

  async def prefetch(self, chunk_hash: ChunkHash, token_ids: Sequence[int], namespace: str,
                     layout: KVLayout, *, origin: ChunkOrigin | None = None) -> str | None:
    """Copies a chunk held only below the host tier up into it; the tier it came from."""

  def host_capacity(self) -> tuple[str, int | None] | None:
    """(name, capacity in bytes or None) of the host tier, or None without one."""

  @property
  def stats(self) -> dict[str, TierStats]:
    """A snapshot of each tier's counters, by tier name."""

  async def usage(self) -> list[TierUsage]:
    """What each persistent tier holds now (chunks, bytes, capacity)."""

  async def enforce_capacity(self) -> None:
    """Brings every bounded persistent tier under its capacity."""


@dataclasses.dataclass(frozen=True)
class TierUsage:
  """What one persistent tier holds now (`TieredStore.usage`), plain data.

  Attributes:
    name: the tier.
    chunks: chunks it holds (index records; session tails included).
    nbytes: their stored bytes (every encoding, `Encoding.nbytes`).
    capacity_bytes: its byte limit, or None (unbounded).
  """

  name: str
  chunks: int
  nbytes: int
  capacity_bytes: int | None
