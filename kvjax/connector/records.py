"""Plain records of the KV connector: lookups, stats, save jobs, look-ahead requests."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax._typing import ChunkHash
from kvjax.storage.format.types import ChunkRecord

#: `PrefixLookup.present` of a chunk no tier holds yet whose save is queued or being written:
#: a hit whose load waits for that write, then reads and verifies it like any chunk.
SAVING = "saving"


@dataclasses.dataclass(frozen=True)
class StoredTail:
  """A stored tail some tier holds for a prompt: the m < C tokens after its last stored full
  chunk that ended a finished session turn (`keys.tail_hash`), loadable as chunk `index`.

  Attributes:
    index: the chunk it lies in: positions `[index * C, index * C + num_tokens)`.
    num_tokens: m, its real tokens (its record holds C ids, the rest `keys.TAIL_PAD_ID`).
    chunk_hash: its key.
    tier: the tier holding it, or `SAVING`.
    record: that tier's index record (None while saving).
  """

  index: int
  num_tokens: int
  chunk_hash: ChunkHash
  tier: str
  record: ChunkRecord | None = None


@dataclasses.dataclass(frozen=True)
class PrefixLookup:
  """Which full chunks of a prompt's prefix some tier holds (one batched lookup, no data read).

  Attributes:
    hashes: keys of all full chunks of the prompt, in order.
    namespace: the key namespace root (hex) the hashes are under.
    present: per candidate chunk (full chunks of `prompt[:-1]`, never the last token), the tier
      holding it, `SAVING` (its save is queued or being written), or None.
    records: per candidate chunk, the index record that tier holds (its encodings and their
      stored bytes), or None (for a present chunk: no record listed, it is read as raw).
    tail: the stored tail found for the prompt's known history (`lookup(history_tokens=)`), or
      None; never with a present chunk at or after its index.
  """

  hashes: list[ChunkHash]
  namespace: str
  present: list[str | None]
  records: list[ChunkRecord | None] = dataclasses.field(default_factory=list)
  tail: StoredTail | None = None

  @property
  def hits(self) -> list[bool]:
    return [t is not None for t in self.present]


@dataclasses.dataclass
class LoaderStats:
  """Background-load accounting (a snapshot; `KVStoreClient.loader_stats`).

  Attributes:
    started: reads started.
    landed: loads reported (landed or failed).
    cancelled: loads dropped before they landed (their request ended, or the scheduler
      released them): queued ones never start, reading ones are abandoned.
    abandoned_reads: of those, reads that had started (`started == landed + abandoned_reads`
      once nothing is in flight).
    released_staged: landed chunks freed without being inserted.
    queued: loads handed over and not yet started.
    in_flight: reads started and not yet landed.
    staged_bytes: bytes held by landed chunks not yet taken (inserted) or released: their stored
      bytes, plus the arrays decoded on the device (kvtc's int16 codes from "rans-bands", 5.9 MB
      for a SmolLM2 chunk, several times its stored bytes), so the staging budget bounds what
      staging holds on the device too.
    link_busy_s: seconds with at least one read in flight.
    read_bytes: stored bytes of every landed read.
    device_decoded: landed chunks whose entropy coding was decoded on the device (kvtc
      "rans-bands"), including those whose decode failed its check (a CORRUPT miss).
  """

  started: int = 0
  landed: int = 0
  cancelled: int = 0
  abandoned_reads: int = 0
  released_staged: int = 0
  queued: int = 0
  in_flight: int = 0
  staged_bytes: int = 0
  link_busy_s: float = 0.0
  read_bytes: int = 0
  device_decoded: int = 0


@dataclasses.dataclass(frozen=True)
class TierSnapshot:
  """One tier's counters as the server's metrics show them.

  Attributes:
    name: the tier.
    misses: failed reads by `MissReason` value.
    loaded_bytes: stored bytes of chunks loaded from it.
    loaded_chunks: chunks loaded from it.
    link_bytes_per_s: its emulated link's rate now (inf: unlimited; None: no limiter).
    link_granted_bytes: bytes its link limiter let through.
    hits: verified reads it served (loads, prefetches and re-rotation reads).
    evictions: chunks it evicted for capacity.
    promotions: chunks copied into it from a lower tier (reads and prefetches).
    demotions_in: chunks written into it by a demotion from the tier above (write-back).
    demotions_out: chunks it evicted that the tier below took by a demotion.
    demotion_drops: chunks it evicted and lost (the demotion failed or was declined).
    written_bytes: bytes of chunks published into it (saves, promotions, demotions).
  """

  name: str
  misses: dict[str, int]
  loaded_bytes: int
  loaded_chunks: int
  link_bytes_per_s: float | None
  link_granted_bytes: int
  hits: int = 0
  evictions: int = 0
  promotions: int = 0
  demotions_in: int = 0
  demotions_out: int = 0
  demotion_drops: int = 0
  written_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class LookaheadRequest:
  """One request of the look-ahead window, as the store client needs it (plain data).

  Attributes:
    request_id: the request.
    namespace: its key namespace root (hex).
    hashes: keys of its candidate prefix chunks (`PrefixLookup.present`'s), in order.
    present: per chunk, the tier its lookup found it in, or None.
    token_ids: its prompt's first `len(hashes) * C` tokens.
    nbytes: per chunk, the host bytes a copy takes.
  """

  request_id: Any
  namespace: str
  hashes: tuple[ChunkHash, ...]
  present: tuple[str | None, ...]
  token_ids: tuple[int, ...]
  nbytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefetchStats:
  """Look-ahead prefetch accounting (a snapshot; `KVStoreClient.prefetch_stats`).

  Attributes:
    issued: chunks copied from a lower tier into the host tier ahead of their loads.
    useful: of those, chunks a load later read from the host tier.
    wasted: of those, chunks that left the window unread (evicted, computed, request ended).
    started: prefetch reads started (a read that found the host already holding the chunk, no
      good lower copy, or no room in the host tier copies nothing and is not issued).
    in_flight: prefetch reads not yet done.
    hinted_chunks: chunks in the store's hint now (window plus pinned sessions).
    pinned_chunks: of those, chunks of pinned sessions.
  """

  issued: int = 0
  useful: int = 0
  wasted: int = 0
  started: int = 0
  in_flight: int = 0
  hinted_chunks: int = 0
  pinned_chunks: int = 0


@dataclasses.dataclass
class Pending:
  """A load queued or reading (the loader's own record)."""

  request_id: Any
  index: int
  chunk_hash: ChunkHash
  token_ids: tuple[int, ...]
  namespace: str
  choose: Any
  nbytes: int
  max_in_flight: int
  released: bool = False
  future: Any = None
  started_s: float = 0.0
  layer_start: int = 0  # k > 0: read layers [k, L) only
  tier: str | None = None  # the tier its lookup found it in: reads of one tier keep queue order


@dataclasses.dataclass
class SaveJob:
  """One full chunk to store, handed over as soon as prefill computed it.

  Attributes:
    namespace: key namespace root (hex).
    chunk_hash: its key.
    parent: the previous chunk's key (the namespace root for chunk 0).
    token_ids: its C tokens.
    kv: `[L, 2, C, K, H]` K before RoPE and V, a device (or host) array, for raw chunks.
    payloads: for the other codecs, (codec, level, payload arrays, finite flag) per stored
      level, device arrays from one device call (`PagedModelRunner.encode_levels`).
    replace: its stored copy was rejected: delete it, then write afresh.
    verify_existing: if a copy is stored already, read it back and rewrite it when bad.
  """

  namespace: str
  chunk_hash: ChunkHash
  parent: str
  token_ids: tuple[int, ...]
  kv: Any = None
  payloads: list[tuple[str, int, Any, Any]] | None = None
  replace: bool = False
  verify_existing: bool = False


@dataclasses.dataclass
class SaverStats:
  jobs_done: int = 0
  chunks_saved: int = 0
  chunks_already_stored: int = 0
  jobs_dropped: int = 0
  failures: int = 0
  tails_dropped: int = 0  # superseded session tails deleted (`KVStoreClient.drop_tail`)



