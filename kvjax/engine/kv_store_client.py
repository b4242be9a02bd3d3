"""The engine's side of the KV store: namespaced keys, verified prefix loads, asynchronous saves.

Architecture. The store (`kvjax.storage.TieredStore`) is asyncio code; the engine is one plain
thread that owns the device. This client runs the store's coroutines on its own event-loop thread
and adds a saver thread:

    engine thread ── lookup() ─────> event loop: which prefix chunks does any tier hold
                  ├─ start_load() ─> queue ─> event loop: get + verify + entropy-decode (on the
                  │                           device for kvtc's rANS codes), a few reads at
                  │                           once; the next starts as one lands
                  │  landed() <──── LoadReports (plain data for the scheduler)
                  │  take() <────── a staged chunk, when the scheduler plans its insertion
                  ├─ release() / cancel_loads(): unwanted loads never start, staging is freed
                  ├─ submit_save() ─> bounded queue ─> saver thread: one device -> host copy
                  │                                    per chunk, put (data, then record)
                  ├─ set_lookahead() ─> event loop: hint the window's chunks (never evicted),
                  │                     prefetch those only a lower tier holds into the host
                  │                     tier, a few bytes in flight, within the host's room
                  └─ set_pins() ──────> event loop: open sessions' chunks join the hint

The client owns the load pipeline's state (queue, reads in flight, staged payloads) and its
accounting (`loader_stats`); the scheduler owns which loads exist and what they mean. Loads never
block the engine: `start_load` returns at once and reads are refilled on the event loop the moment
one lands, so a long engine step never idles the link. The link time each report carries is
measured here, from the read's start or the previous landing (whichever is later), so it is the
link's (and verifier's) rate, not the engine's pacing. Saves never block the engine either: when
the queue is full the job is dropped and counted. `flush()` waits until every queued save is
written (tests and `LLM.flush()` use it).

Look-ahead (CachedAttention, arXiv 2403.19708, section 3.3). The scheduler names the requests
that will read stored chunks next (`SchedulerOutput.lookahead`); the engine hands their prefix
lookups here when the window changes (`set_lookahead`), and the session registry hands the open
sessions' token ids (`set_pins`). On the event loop, the union of their chunk hashes becomes the
store's hint (`TieredStore.hint`: no tier evicts them), and chunks of windowed requests that only
a lower tier holds are copied up to the host tier (`TieredStore.prefetch`), in window order,
at most `prefetch_bytes` in flight, and only while the window's chunks plus the pinned ones fit
the host tier; a chunk that a load is already reading is left to it (a load promotes what it
reads), and a load that starts while its chunk's prefetch is in flight waits for it. A load of a chunk whose prefetch is in flight waits for it and reads the host
copy (one read of the lower tier, not two). Outcomes (`prefetch_stats`): issued (a copy made),
useful (a load later read it from the host tier), wasted (it left the window unread: evicted,
computed instead, or its request ended).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import math
import logging
import os
import queue
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.kernels import kvtc_rans
from kvjax.kernels.platform import resolve_platform
from kvjax.scheduler.output import LoadReport
from kvjax.storage import codecs as storage_codecs
from kvjax.storage import entropy, keys
from kvjax.storage.tiers import TierUsage
from kvjax.storage.types import (ChunkHit, ChunkMiss, ChunkRecord, EncodedPayload, KVLayout,
                                MissReason)

_log = logging.getLogger(__name__)

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
class _Pending:
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


class LayerTransfer:
  """One staged chunk moving host -> device layer group by layer group (layer-wise
  pre-loading, CachedAttention arXiv 2403.19708, section 3.2.1), on the client's transfer
  thread, each group's bytes charged to the host -> device link (`KVStoreClient(device_link=)`)
  before it is put on the device.

  Attributes:
    groups: the layer ranges `(l0, l1)`, in transfer order.
  """

  def __init__(self, groups: Sequence[tuple[int, int]]):
    self.groups = tuple(groups)
    self._arrays: list[Any] = [None] * len(self.groups)
    self._error: BaseException | None = None
    self._cond = threading.Condition()

  def _set(self, g: int, array: Any = None, error: BaseException | None = None) -> None:
    with self._cond:
      if error is not None:
        self._error = error
      else:
        self._arrays[g] = array
      self._cond.notify_all()

  def wait(self, g: int, timeout_s: float | None = None):
    """Blocks until layer group `g` is on the device; returns it, `[l1 - l0, 2, C, K, H]`.

    Raises:
      RuntimeError: its transfer failed, or `timeout_s` passed.
    """
    with self._cond:
      if not self._cond.wait_for(lambda: self._arrays[g] is not None or self._error is not None,
                                 timeout_s):
        raise RuntimeError(f"layer group {g} of a chunk did not reach the device in {timeout_s} s")
      if self._error is not None:
        raise RuntimeError(f"moving a chunk to the device failed: {self._error!r}")
      return self._arrays[g]


@dataclasses.dataclass
class SaverStats:
  jobs_done: int = 0
  chunks_saved: int = 0
  chunks_already_stored: int = 0
  jobs_dropped: int = 0
  failures: int = 0
  tails_dropped: int = 0  # superseded session tails deleted (`KVStoreClient.drop_tail`)



def _held_nbytes(hit: ChunkHit) -> int:
  """Bytes a staged chunk holds: its stored bytes plus every array already decoded on the device
  (`KVStoreClient._decode_on_device`)."""
  return int(hit.encoding.nbytes) + sum(int(a.nbytes) for a in hit.payload.values()
                                        if isinstance(a, jax.Array))

class KVStoreClient:
  """Keys, loads and saves for one model's KV layout over a `TieredStore`.

  Args:
    store: the tiered store (async API).
    model_fingerprint: seeds every key (`kvjax.models.fingerprint`).
    layout: stored chunk layout `[L, 2, C, K, H]` and dtype.
    kv_layout_version: `kvjax.models.kv_cache.KV_LAYOUT_VERSION`.
    max_pending_saves: save jobs queued at most; more are dropped and counted.
    timeout_s: bound on one store operation seen from the engine, seconds.
    codec: the encoding new chunks are stored with: "raw" (the KV dtype, lossless), "int8",
      "int4" or "cachegen" (CacheGen, arXiv 2310.07240 section 5.2).
    codec_levels: the levels stored side by side (cachegen: 0 finest .. 3 coarsest).
    staging_bytes: stored bytes of reads in flight plus landed chunks not yet inserted, at most
      (a read that would pass it waits; the first never does).
    kvtc_transform_id: the 16-byte identity of this model's kvtc transform
      (`KVTCTransform.transform_id`), or None; a loaded kvtc chunk coded with another transform
      (or any kvtc chunk when None) is a miss (`MissReason.UNKNOWN_CODEC`), never decoded.
    use_pallas_entropy: how a landed chunk whose arrays the reader left entropy-coded
      (`storage.entropy.RansCodes`: kvtc's "rans-bands" `q`) is decoded on the device: the Pallas
      rANS kernel (True) or the jit'd jnp reference (False); None: Pallas when `platform` is GPU
      or TPU, the jnp reference on CPU (measured faster there than the numpy host decoder,
      `scripts/bench_rans.py`). A chunk whose streams fail the decoder's `ok` check is a miss
      (`MissReason.CORRUPT`), recomputed like any bad chunk.
    platform: the target platform of the runner whose cache the chunks go to ("cpu" | "tpu" |
      "cuda", `kvjax.kernels.platform`; a paged runner's `platform`): the entropy decoder is
      chosen and compiled for it, not for the host. None: the platform being compiled for
      (`resolve_platform`: the default backend outside an abstract mesh).
    prefetch_bytes: look-ahead prefetch reads' bytes in flight at most (the first never
      waits); None: 4 raw chunks.
    consistent: the engine runs `kv_codec_consistent` (a lossy codec's one level,
      `codec_levels[0]`, in every stored and loaded chunk): keys carry that encoding
      (`keys.KeyNamespace.encoding`, `key_encoding`), so such an engine finds and writes its
      own chunks beside other encodings' chunks of the same prompt.
  """

  def __init__(self, store, *, model_fingerprint: str, layout: KVLayout, kv_layout_version: int,
               max_pending_saves: int = 16, timeout_s: float = 60.0, codec: str = "raw",
               codec_levels: Sequence[int] = (0,), staging_bytes: int = 1 << 30,
               kvtc_transform_id: bytes | None = None, device_link=None,
               use_pallas_entropy: bool | None = None, platform: str | None = None,
               prefetch_bytes: int | None = None, consistent: bool = False):
    self.codec = codec
    #: `KeyNamespace.encoding` of every key: "codec/level" of the one level a
    #: `kv_codec_consistent` engine stores and loads (lossy codecs), else None.
    self.key_encoding = (str(codecs.EncodingId(codec, tuple(codec_levels)[0]))
                         if consistent and codec != codecs.RAW else None)
    #: The entropy decoder's target platform ("cpu" | "tpu" | "cuda").
    self.platform = resolve_platform(platform)
    self.use_pallas_entropy = (self.platform != "cpu" if use_pallas_entropy is None
                               else bool(use_pallas_entropy))
    #: The emulated host -> device link (a `kvjax.storage.link.LinkLimiter`), or None: every
    #: staged chunk's bytes pass it on their way into the KV cache (`transfer`, `charge_device`).
    self.device_link = device_link
    self._transfers: queue.Queue = queue.Queue()
    self._transfer_thread: threading.Thread | None = None
    self.kvtc_transform_id = kvtc_transform_id
    self.codec_levels = tuple(codec_levels)
    self.store = store
    self.layout = layout
    self.chunk_size = layout.chunk_size
    self._fingerprint = model_fingerprint
    self._layout_version = kv_layout_version
    self._timeout_s = timeout_s
    self.saver_stats = SaverStats()
    self._loop = asyncio.new_event_loop()
    self._loop_thread = threading.Thread(target=self._loop.run_forever, name="kvjax-store-loop",
                                         daemon=True)
    self._loop_thread.start()
    self._jobs: queue.Queue[SaveJob | None] = queue.Queue(maxsize=max_pending_saves)
    # Keys of saves queued or being written: [jobs, a future done with the last] (`_lock`).
    self._saving: dict[ChunkHash, list] = {}
    self._saver = threading.Thread(target=self._save_loop, name="kvjax-saver", daemon=True)
    self._saver.start()
    self._closed = False
    self.lookup_failures = 0
    self.staging_bytes = staging_bytes
    self._lock = threading.Lock()
    self._stats = LoaderStats()
    self._queue: collections.deque[_Pending] = collections.deque()
    self._reading: dict[tuple[Any, int], _Pending] = {}
    self._staged: dict[tuple[Any, int], ChunkHit] = {}
    self._reports: list[LoadReport] = []
    self._reported = threading.Event()
    self._last_done_s = -math.inf
    self._loaded_by_tier: dict[str, tuple[int, int]] = {}
    self._busy_since_s = 0.0
    # Look-ahead state. `_window`, `_pins` are replaced under `_lock` by the engine and the
    # session registry; everything else below is touched on the event loop only.
    self.prefetch_bytes = (int(prefetch_bytes) if prefetch_bytes is not None
                           else 4 * layout.nbytes)
    self._window: tuple[LookaheadRequest, ...] = ()
    self._pins: tuple[tuple[ChunkHash, ...], ...] = ()
    self._hint_key: tuple | None = None
    self._prefetching: dict[ChunkHash, tuple[asyncio.Task, int]] = {}
    self._prefetched: set[ChunkHash] = set()  # issued, not yet read from the host or wasted
    self._tried: set[ChunkHash] = set()       # started for the current window
    self._store_reads: collections.Counter = collections.Counter()  # loads reading a chunk now
    self._pf = PrefetchStats()
    host = store.host_capacity()
    if codec == "raw" and host is not None and host[1] is not None and host[1] < layout.nbytes:
      _log.warning("host tier %r holds %d bytes, less than one raw chunk (%d bytes): it will "
                   "hold no chunk", host[0], host[1], layout.nbytes)

  # ----------------------------------------------------------------------------- keys
  def namespace(self, cache_salt: str | None) -> keys.KeyNamespace:
    return keys.KeyNamespace(model_fingerprint=self._fingerprint, kv_dtype=self.layout.dtype,
                             kv_layout_version=self._layout_version,
                             chunk_size=self.chunk_size, cache_salt=cache_salt,
                             encoding=self.key_encoding)

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

  # ----------------------------------------------------------------------------- loads
  @property
  def stores_tails(self) -> bool:
    """Whether session tails are stored and looked up (`keys.tail_hash`): raw chunks only (a
    lossy tail could make a session turn's answer depend on whether its tail was stored)."""
    return self.codec == codecs.RAW and self.key_encoding is None

  def tail_key(self, namespace: str, hashes: Sequence[ChunkHash], token_ids: Sequence[int],
               end: int) -> tuple[int, ChunkHash, ChunkHash] | None:
    """`(index, parent, key)` of the tail of `token_ids[:end]` (the tokens after its last full
    chunk) under namespace root `namespace`, `hashes` being the chained keys of its first full
    chunks (at least `end // C`); None when `end` is a multiple of C (no tail)."""
    k, m = divmod(end, self.chunk_size)
    if not m:
      return None
    parent = hashes[k - 1] if k else ChunkHash(namespace)
    return k, parent, keys.tail_hash(parent, token_ids[k * self.chunk_size:end])

  def lookup(self, prompt_ids: Sequence[int], cache_salt: str | None, *,
             history_tokens: int = 0) -> PrefixLookup:
    """Asks every tier, in one batch, which prefix chunks of the prompt are stored.

    Candidates are the full chunks of `prompt_ids[:-1]` (a hit never covers the last prompt
    token). With `history_tokens` h (a session turn: the prompt's first h tokens are the
    previous turn's prompt and output but its last sampled token, whose KV the previous request
    left, `stores_tails`), the same batch asks for the tail of `prompt_ids[:h]`
    (`keys.tail_hash`); it is kept only when no chunk at or after its index is present (a full
    chunk covers more). With raw chunks, a chunk or tail no tier holds yet whose save is queued
    or being written is present as `SAVING` (a turn sent the moment the last one answered still
    finds its history; its load waits for the write). A store that fails the lookup degrades to
    "nothing present" with a warning.
    """
    ns = self.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, prompt_ids)
    root = ns.root_hash()
    candidates = hashes[:(len(prompt_ids) - 1) // self.chunk_size]
    tail = None
    if self.stores_tails and 0 < history_tokens < len(prompt_ids):
      tail = self.tail_key(root, hashes, prompt_ids, history_tokens)
    present: list[str | None] = [None] * len(candidates)
    records: list[ChunkRecord | None] = [None] * len(candidates)
    stored_tail = None
    if candidates or tail is not None:
      try:
        asked = candidates + ([tail[2]] if tail else [])
        saving = set()
        if self.codec == codecs.RAW:  # a hit without a record is read as raw (`records`)
          with self._lock:  # before the peek: one that lands meanwhile is stored either way
            saving = {h for h in asked if h in self._saving}
        found = self._run(self.store.peek(asked))
        found = [f if f is not None or h not in saving else (SAVING, None)
                 for h, f in zip(asked, found)]
        present = [f[0] if f is not None else None for f in found[:len(candidates)]]
        records = [f[1] if f is not None else None for f in found[:len(candidates)]]
        if tail is not None and found[-1] is not None and not any(present[tail[0]:]):
          stored_tail = StoredTail(tail[0], history_tokens - tail[0] * self.chunk_size, tail[2],
                                   found[-1][0], found[-1][1])
      except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute
        self.lookup_failures += 1
        present = [None] * len(candidates)
        records = [None] * len(candidates)
        _log.warning("KV store lookup failed (%r); computing the prompt instead", e)
    return PrefixLookup(hashes=hashes, namespace=root, present=present, records=records,
                        tail=stored_tail)

  def extend_chunk_hashes(self, lookup: PrefixLookup, hashes: Sequence[ChunkHash],
                          token_ids: Sequence[int], num_chunks: int) -> list[ChunkHash]:
    """`hashes` (chained keys of the first chunks of `token_ids`, under `lookup`'s namespace)
    extended to `num_chunks` keys: the keys of a sequence that grew past its prompt (output
    tokens), chained from the prompt's.

    Raises:
      ValueError: `token_ids` shorter than `num_chunks` chunks.
    """
    c = self.chunk_size
    if len(token_ids) < num_chunks * c:
      raise ValueError(f"{num_chunks} chunks of {c} need {num_chunks * c} tokens, got "
                       f"{len(token_ids)}")
    out = list(hashes)
    for j in range(len(out), num_chunks):
      out.append(keys.hash_chunk(out[-1] if out else ChunkHash(lookup.namespace),
                                 token_ids[j * c:(j + 1) * c]))
    return out

  def read_raw_chunks(self, lookup: PrefixLookup, token_ids: Sequence[int],
                      indices: Sequence[int]) -> dict[int, np.ndarray]:
    """Reads prefix chunks synchronously (verified like every load; not through the load
    pipeline, no staging): `{index: [L, 2, C, K, H] K before RoPE and V}` for each of `indices`
    the lookup found stored with a raw encoding and that verified; the others are left out (a
    lossy-only chunk, a miss). Used by session re-rotation
    (`kvjax.engine.rerotation.stage_rerotated`).
    """
    c = self.chunk_size
    want = [i for i in indices if i < len(lookup.present) and lookup.present[i] is not None]
    if not want:
      return {}

    async def read_all():
      return await asyncio.gather(*(self.store.get(
          lookup.hashes[i], tuple(token_ids[i * c:(i + 1) * c]), lookup.namespace, self.layout,
          choose=lambda encs: next((e for e in encs if e.codec == codecs.RAW), None))
          for i in want), return_exceptions=True)

    out = {}
    for i, got in zip(want, self._run(read_all())):
      if isinstance(got, ChunkHit) and got.kv is not None:
        out[i] = np.asarray(got.kv)
    return out

  def put_raw_chunks(self, cache_salt: str | None, token_ids: Sequence[int],
                     chunks: Sequence[np.ndarray], *, first: int = 0) -> int:
    """Writes `chunks` (`[L, 2, C, K, H]` each, K before RoPE) synchronously as chunks
    `[first, first + len(chunks))` of `token_ids` under `cache_salt`'s namespace (chained keys
    as every chunk: the chunks before `first` need not be stored, keys chain through token
    ids); returns how many the store published or already held.

    Raises:
      ValueError: `first` < 0 or chunks past the end of `token_ids`.
    """
    c = self.chunk_size
    if first < 0 or (first + len(chunks)) * c > len(token_ids):
      raise ValueError(f"chunks [{first}, {first + len(chunks)}) of {c} tokens do not fit "
                       f"{len(token_ids)} tokens")
    ns = self.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, token_ids, max_tokens=(first + len(chunks)) * c)
    root = ns.root_hash()

    async def put_all():
      return await asyncio.gather(*(self.store.put(
          hashes[i], hashes[i - 1] if i else root, tuple(token_ids[i * c:(i + 1) * c]), root,
          np.asarray(chunks[i - first])) for i in range(first, first + len(chunks))),
          return_exceptions=True)

    return sum(not isinstance(r, BaseException) for r in self._run(put_all()))

  def start_load(self, request_id: Any, index: int, lookup: PrefixLookup,
                 prompt_ids: Sequence[int], *, choose=None, nbytes: int = 0,
                 max_in_flight: int = 2) -> None:
    """Queues a background load of prompt chunk `index`; its `LoadReport` comes from `landed()`.

    Loads run in the order they were queued, each request's `max_in_flight` at a time, and the
    next starts the moment one lands (on the store's event loop, not at the engine's next step),
    while the staged and reading bytes stay within `staging_bytes`. The read, verification and
    entropy decoding run on the event loop (tensorstore async reads; the link and byte limiters
    bound them). Never blocks the caller.

    Args:
      request_id: the owner; `cancel_loads(request_id)` drops its loads.
      index: chunk index within the prompt; the lookup's stored tail when it is
        `lookup.tail.index`.
      lookup: the prompt's `PrefixLookup`.
      prompt_ids: the prompt's tokens.
      choose: optional `Callable[[Sequence[Encoding]], Encoding | None]` picking the encoding
        (codec level) to read.
      nbytes: the planner's stored bytes for it (for the staging budget).
      max_in_flight: the request's reads at once, >= 1.
    """
    c = self.chunk_size
    tail = lookup.tail
    if tail is not None and index == tail.index:  # the stored tail, padded to C ids
      key, tokens = tail.chunk_hash, keys.tail_token_ids(
          prompt_ids[index * c:index * c + tail.num_tokens], c)
    else:
      key, tokens = lookup.hashes[index], tuple(prompt_ids[index * c:(index + 1) * c])
    item = _Pending(request_id, index, key, tokens, lookup.namespace, choose,
                    int(nbytes) or self.layout.nbytes, max(1, int(max_in_flight)))
    with self._lock:
      self._queue.append(item)
    self._pump()

  def _pump(self) -> None:
    """Starts queued reads in order while per-request concurrency and the staging budget allow.

    A request's read waits only for its own earlier reads (per-request order); the byte budget
    never blocks the first read (no deadlock when one chunk exceeds it).
    """
    with self._lock:
      reading_of = collections.Counter(k[0] for k in self._reading)
      held = self._stats.staged_bytes + sum(p.nbytes for p in self._reading.values())
      for item in list(self._queue):
        if reading_of[item.request_id] >= item.max_in_flight:
          continue
        if held and held + item.nbytes > self.staging_bytes:
          break
        self._queue.remove(item)
        now = time.perf_counter()
        if not self._reading:
          self._busy_since_s = now
        item.started_s = now
        self._reading[(item.request_id, item.index)] = item
        reading_of[item.request_id] += 1
        held += item.nbytes
        self._stats.started += 1
        item.future = asyncio.run_coroutine_threadsafe(self._read(item), self._loop)

  async def _read(self, item: _Pending) -> None:
    pending = self._prefetching.get(item.chunk_hash)
    if pending is not None:  # its prefetch is moving it up: read the host copy it makes
      await asyncio.wait({pending[0]})
    with self._lock:
      saving = self._saving.get(item.chunk_hash)
    if saving is not None:  # found while its save was queued or being written: wait for it
      # (on the loop, no worker thread: the write itself needs one; shielded, so a cancelled
      # load never cancels the future other loads of the key wait on)
      await asyncio.shield(asyncio.wrap_future(saving[1]))
    self._store_reads[item.chunk_hash] += 1  # no prefetch of it starts meanwhile
    try:
      got = await self.store.get(item.chunk_hash, item.token_ids, item.namespace, self.layout,
                                 **({"choose": item.choose} if item.choose is not None else {}))
    except Exception as e:  # noqa: BLE001 - a failed read is a miss, never a user error
      got = ChunkMiss(item.chunk_hash, MissReason.READ_ERROR, repr(e))
    finally:
      self._store_reads[item.chunk_hash] -= 1
      if not self._store_reads[item.chunk_hash]:
        del self._store_reads[item.chunk_hash]
    got = self._check_transform(got)
    if isinstance(got, ChunkHit) and any(isinstance(a, entropy.RansCodes)
                                         for a in got.payload.values()):
      try:
        got = await asyncio.to_thread(self._decode_on_device, got)
      except Exception as e:  # noqa: BLE001 - a failed decode is a miss, never a user error
        got = ChunkMiss(item.chunk_hash, MissReason.READ_ERROR, f"device entropy decode: {e!r}")
    self._on_land(item, got, time.perf_counter())

  def warmup_entropy(self, codec: str, level: int, arrays) -> None:
    """Compiles the device entropy decoder a landed chunk of this layout would use: codes
    `arrays` (a host payload of `codec`, e.g. of a zero chunk) into stored bytes, reads them
    back as the store does and decodes what the reader left coded. No-op for codecs the reader
    decodes on the host.

    Raises:
      ValueError: a payload that does not match the layout; RuntimeError: the decode failed.
    """
    blob = storage_codecs.encode_payload(codec, level, arrays, self.layout)
    payload = storage_codecs.decode_payload(codec, storage_codecs.CURRENT_VERSION[codec], level,
                                            blob, self.layout, defer_entropy=True)
    for name, a in payload.items():
      if isinstance(a, entropy.RansCodes) and not self._rans_decode(a)[1]:
        raise RuntimeError(f"warming up the device entropy decoder: {name} did not decode")

  def _rans_decode(self, a: entropy.RansCodes):
    """(codes on the device, ok: bool) of one array the reader left rANS-coded.

    Raises:
      ValueError: band arrays that do not fit together (`kvtc_rans.pack_bands`)."""
    packed = kvtc_rans.pack_bands(a.shape, a.bands, a.offsets, a.arrays)
    q, ok = kvtc_rans.decode_codes(packed, use_pallas=self.use_pallas_entropy,
                                   platform=self.platform)
    return q, bool(ok)

  def _decode_on_device(self, got: ChunkHit) -> ChunkHit | ChunkMiss:
    """Host bytes -> device -> rANS decode of every entropy-coded array (one jit'd call each,
    `kvtc_rans.decode_codes`); a failed `ok` check is a CORRUPT miss. The staged payload then
    holds the int16 codes as a device array, for the runner's dequantize -> inverse transform ->
    RoPE -> cache write."""
    with self._lock:
      self._stats.device_decoded += 1
    arrays = dict(got.payload)
    for name, a in got.payload.items():
      if not isinstance(a, entropy.RansCodes):
        continue
      try:
        q, ok = self._rans_decode(a)
      except ValueError as e:
        return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT, f"{name}: {e}")
      if not ok:
        return ChunkMiss(got.record.chunk_hash, MissReason.CORRUPT,
                         f"{name}: rANS streams did not decode to their initial state")
      arrays[name] = q
    return dataclasses.replace(got, payload=arrays)

  def _check_transform(self, got: ChunkHit | ChunkMiss) -> ChunkHit | ChunkMiss:
    """A kvtc hit coded with another transform than this model's becomes a miss."""
    if not isinstance(got, ChunkHit) or got.encoding.codec != codecs.KVTC:
      return got
    tid = got.payload.get("transform_id") if isinstance(got.payload, dict) else None
    if tid is None or self.kvtc_transform_id is None or (
        bytes(np.asarray(tid, np.uint8)) != self.kvtc_transform_id):
      return ChunkMiss(got.record.chunk_hash, MissReason.UNKNOWN_CODEC,
                       "kvtc chunk coded with another transform")
    return got

  def _on_land(self, item: _Pending, got: ChunkHit | ChunkMiss, done_s: float) -> None:
    key = (item.request_id, item.index)
    with self._lock:
      if self._reading.get(key) is not item:
        return  # its request ended meanwhile: drop it
      del self._reading[key]
      ok = isinstance(got, ChunkHit)
      nbytes = int(got.encoding.nbytes) if ok else 0
      link_s = max(0.0, done_s - max(item.started_s, self._last_done_s))
      self._last_done_s = max(self._last_done_s, done_s)
      if not self._reading:
        self._stats.link_busy_s += done_s - self._busy_since_s
      self._stats.landed += 1
      self._stats.read_bytes += nbytes
      if ok:
        b, n = self._loaded_by_tier.get(got.tier, (0, 0))
        self._loaded_by_tier[got.tier] = (b + nbytes, n + 1)
        if item.chunk_hash in self._prefetched and got.tier == self._host_name():
          self._prefetched.discard(item.chunk_hash)
          self._pf = dataclasses.replace(self._pf, useful=self._pf.useful + 1)
      if ok and not item.released:
        self._staged[key] = got
        self._stats.staged_bytes += _held_nbytes(got)
      self._reports.append(LoadReport(
          request_id=item.request_id, index=item.index, ok=ok, nbytes=nbytes,
          tier=got.tier if ok else "",
          encoding=f"{got.encoding.codec}/{got.encoding.level}" if ok else None,
          started_s=item.started_s, done_s=done_s, link_s=link_s,
          reason="" if ok else got.reason.value))
      self._reported.set()
    self._pump()

  def landed(self, wait_s: float | None = None) -> list[LoadReport]:
    """Takes the reports of every load that finished since the last call.

    Args:
      wait_s: if none has finished, block up to this long for one (None: do not block).
    """
    if wait_s is not None and wait_s > 0 and not self._reports:
      self._reported.wait(wait_s)
    with self._lock:
      out, self._reports = self._reports, []
      self._reported.clear()
    return out

  def take(self, request_id: Any, index: int) -> ChunkHit:
    """Hands over a staged chunk for insertion (its staging is released).

    Raises:
      KeyError: if the chunk is not staged (a planner bug).
    """
    with self._lock:
      hit = self._staged.pop((request_id, index))
      self._stats.staged_bytes -= _held_nbytes(hit)
    self._pump()
    return hit

  def release(self, request_id: Any, index: int) -> None:
    """The scheduler no longer wants chunk `index`'s load: a queued one never starts (reported
    as a miss, reason "released"), a reading one is dropped when it lands, a staged one is freed.
    Idempotent."""
    key = (request_id, index)
    with self._lock:
      queued = next((p for p in self._queue if (p.request_id, p.index) == key), None)
      if queued is not None:
        self._queue.remove(queued)
        self._stats.cancelled += 1
        self._reports.append(LoadReport(request_id, index, ok=False, nbytes=0,
                                        reason="released"))
        self._reported.set()
      elif key in self._reading:
        self._reading[key].released = True
      elif key in self._staged:
        self._stats.staged_bytes -= _held_nbytes(self._staged.pop(key))
        self._stats.released_staged += 1
    self._pump()

  def cancel_loads(self, request_id: Any) -> int:
    """Drops every queued, reading and staged load of the request (no reports); returns how
    many."""
    with self._lock:
      queued = [p for p in self._queue if p.request_id == request_id]
      for p in queued:
        self._queue.remove(p)
      reading = [k for k in self._reading if k[0] == request_id]
      for k in reading:
        self._reading.pop(k).future.cancel()
      staged = [k for k in self._staged if k[0] == request_id]
      for k in staged:
        self._stats.staged_bytes -= _held_nbytes(self._staged.pop(k))
      self._reports = [r for r in self._reports if r.request_id != request_id]
      n = len(queued) + len(reading) + len(staged)
      self._stats.cancelled += len(queued) + len(reading)
      self._stats.abandoned_reads += len(reading)
      self._stats.released_staged += len(staged)
    self._pump()
    return n

  def loads_in_flight(self, request_id: Any = None) -> int:
    """Loads queued or reading (of one request, or all)."""
    with self._lock:
      if request_id is None:
        return len(self._queue) + len(self._reading)
      return (sum(1 for p in self._queue if p.request_id == request_id)
              + sum(1 for k in self._reading if k[0] == request_id))

  def tier_snapshots(self) -> tuple[TierSnapshot, ...]:
    """Per-tier counters (misses, loaded bytes, link limiter), plain data."""
    stats = self.store.stats
    out = []
    with self._lock:
      loaded = dict(self._loaded_by_tier)
    for tier in self.store.tiers:
      s = stats.get(tier.name)
      limiter = self.store.limiters.get(tier.name)
      nbytes, nchunks = loaded.get(tier.name, (0, 0))
      out.append(TierSnapshot(
          tier.name, dict(s.misses) if s is not None else {}, nbytes, nchunks,
          float(limiter.current_rate()) if limiter is not None else None,
          int(limiter.bytes_granted) if limiter is not None else 0,
          s.hits if s is not None else 0, s.evictions if s is not None else 0,
          s.promotions if s is not None else 0, s.demotions_in if s is not None else 0,
          s.demotions_out if s is not None else 0, s.demotion_drops if s is not None else 0,
          s.bytes_written if s is not None else 0))
    return tuple(out)

  @property
  def loader_stats(self) -> LoaderStats:
    """A snapshot of the load accounting."""
    with self._lock:
      return dataclasses.replace(self._stats, queued=len(self._queue),
                                 in_flight=len(self._reading))

  # ----------------------------------------------------------------------------- look-ahead
  def lookahead_request(self, request_id: Any, lookup: PrefixLookup,
                        prompt_ids: Sequence[int]) -> LookaheadRequest:
    """One request of the look-ahead window from its own lookup: its candidate chunks, where
    each was found, their tokens and their stored bytes (the largest encoding; raw chunks: the
    layout's)."""
    n, c = len(lookup.present), self.chunk_size
    records = lookup.records or [None] * n
    nbytes = tuple(self.layout.nbytes if rec is None or self.codec == codecs.RAW
                   else max(e.nbytes for e in rec.encodings) for rec in records)
    return LookaheadRequest(request_id, lookup.namespace, tuple(lookup.hashes[:n]),
                            tuple(lookup.present), tuple(prompt_ids[:n * c]), nbytes)

  def set_lookahead(self, requests: Sequence[LookaheadRequest]) -> None:
    """Replaces the look-ahead window (the engine calls it when the scheduler's window
    changed): its chunks join the store's hint and those only a lower tier holds are
    prefetched into the host tier, on the event loop. Never blocks."""
    with self._lock:
      self._window = tuple(requests)
    self._loop.call_soon_threadsafe(self._refresh)

  def set_pins(self, sessions: Sequence[tuple[str | None, Sequence[int]]]) -> None:
    """Replaces the pinned sessions: per session, most important first, its `cache_salt` and
    exact token ids (its last turn's prompt and output). Their full chunks join the store's
    hint (never evicted), as many whole sessions as fit half the host tier (the other half is
    the window's), each with its stored tail (`stores_tails`, a chunk's bytes) while that fits
    too. The session registry owns which sessions are pinned (`SessionRegistry.pinned`). Never
    blocks on the store. Without a host tier nothing is pinned: pins keep sessions in the host
    tier, and a persistent tier's own LRU order keeps recent sessions (pinning there would let
    open sessions hold a bounded store over its capacity)."""
    host = self.store.host_capacity()
    cap = host[1] // 2 if host is not None and host[1] is not None else None
    pins, used, nb = [], 0, self.layout.nbytes
    for salt, ids in sessions if host is not None else ():
      ns, ids = self.namespace(salt), list(ids)
      hashes = tuple(keys.chunk_hashes(ns, ids))
      if cap is not None and used + len(hashes) * nb > cap:
        continue
      used += len(hashes) * nb
      tail = self.tail_key(ns.root_hash(), hashes, ids, len(ids) - 1) if (
          self.stores_tails and ids) else None
      if tail is not None and (cap is None or used + nb <= cap):
        hashes += (tail[2],)
        used += nb
      pins.append(hashes)
    with self._lock:
      self._pins = tuple(pins)
    self._loop.call_soon_threadsafe(self._refresh)

  def _host_name(self) -> str | None:
    host = self.store.host_capacity()
    return host[0] if host is not None else None

  def _refresh(self) -> None:
    """Event loop: applies the window and pins as the store's hint (when they changed), counts
    prefetched chunks that left the window unread as wasted, and starts prefetches."""
    with self._lock:
      window, pins = self._window, self._pins
    upcoming = [r.hashes for r in window] + [p for p in pins]
    key = tuple(upcoming)
    if key != self._hint_key:
      self._hint_key = key
      self.store.hint(upcoming)
    wanted = {h for r in window for h in r.hashes}
    gone = self._prefetched - wanted
    self._prefetched -= gone
    self._tried &= wanted
    with self._lock:
      self._pf = dataclasses.replace(
          self._pf, wasted=self._pf.wasted + len(gone),
          hinted_chunks=len({h for hs in upcoming for h in hs}),
          pinned_chunks=len({h for hs in pins for h in hs}))
    self._fill_prefetch()

  def _fill_prefetch(self) -> None:
    """Event loop: starts prefetches of windowed chunks that only a lower tier holds, in window
    order, while the window's chunks (and the pinned ones) fit the host tier and the bytes in
    flight stay within `prefetch_bytes`."""
    host = self.store.host_capacity()
    if host is None:
      return
    name, cap = host
    with self._lock:
      window, pins = self._window, self._pins
    room = None if cap is None else cap - len({h for p in pins for h in p}) * self.layout.nbytes
    in_flight = sum(n for _, n in self._prefetching.values())
    seen: set[ChunkHash] = {h for p in pins for h in p}
    loading = self._store_reads  # a load reads them from its tier now and promotes them
    need = 0
    for r in window:
      for h, tier, nb, j in zip(r.hashes, r.present, r.nbytes, itertools.count()):
        if tier is None or h in seen:
          continue
        seen.add(h)
        need += nb
        if room is not None and need > room:
          return  # the window's chunks beyond this would not fit the host tier
        if tier in (name, SAVING) or h in self._tried or h in loading:
          continue
        if in_flight and in_flight + nb > self.prefetch_bytes:
          return
        c = self.chunk_size
        self._tried.add(h)
        task = self._loop.create_task(self.store.prefetch(
            h, r.token_ids[j * c:(j + 1) * c], r.namespace, self.layout))
        self._prefetching[h] = (task, nb)
        in_flight += nb
        with self._lock:
          self._pf = dataclasses.replace(self._pf, started=self._pf.started + 1)
        task.add_done_callback(lambda t, h=h: self._prefetch_done(h, t))

  def _prefetch_done(self, chunk_hash: ChunkHash, task: asyncio.Task) -> None:
    self._prefetching.pop(chunk_hash, None)
    err = None if task.cancelled() else task.exception()
    if err is not None:  # a failed prefetch only costs the read: the load falls through
      _log.warning("prefetch of a KV chunk failed: %r", err)
    copied = not task.cancelled() and err is None and task.result() is not None
    if copied:
      with self._lock:
        still = any(chunk_hash in r.hashes for r in self._window)
        self._pf = dataclasses.replace(self._pf, issued=self._pf.issued + 1,
                                       wasted=self._pf.wasted + (not still))
      if still:
        self._prefetched.add(chunk_hash)
    self._fill_prefetch()

  def wait_prefetches(self, timeout_s: float | None = None) -> None:
    """Blocks until no prefetch is in flight or startable (tests, benchmarks)."""
    async def idle():
      while self._prefetching:
        await asyncio.wait([t for t, _ in self._prefetching.values()])
    asyncio.run_coroutine_threadsafe(idle(), self._loop).result(timeout_s or self._timeout_s)

  @property
  def prefetch_stats(self) -> PrefetchStats:
    """A snapshot of the look-ahead prefetch accounting."""
    with self._lock:
      return dataclasses.replace(self._pf, in_flight=len(self._prefetching))

  # ----------------------------------------------------------------------------- host -> device
  def transfer(self, chunks: Sequence[np.ndarray], groups: Sequence[tuple[int, int]]
               ) -> list[LayerTransfer]:
    """Starts moving staged raw chunks to the device in layer groups, group-major (group 0 of
    every chunk, then group 1, ...), on one transfer thread (the link is one pipe). Every piece
    is booked on `device_link` (when set) now, back to back in that order, as copies queued on
    a copy engine are (`LinkLimiter.reserve`): the thread puts a piece on the device once its
    booked time has passed, and its own pauses between pieces never idle the link. Never
    blocks.

    Args:
      chunks: `[L, 2, C, K, H]` host arrays (a `ChunkHit.kv`).
      groups: layer ranges `(l0, l1)` tiling the chunks' layers, in order.

    Returns:
      One `LayerTransfer` per chunk, in order.
    """
    if self._transfer_thread is None:
      self._transfer_thread = threading.Thread(target=self._transfer_loop,
                                               name="kvjax-host-to-device", daemon=True)
      self._transfer_thread.start()
    out = [LayerTransfer(groups) for _ in chunks]
    link = self.device_link
    for g, (l0, l1) in enumerate(groups):
      for t, kv in zip(out, chunks):
        piece = kv[l0:l1]
        self._transfers.put((t, g, piece, None if link is None else link.reserve(piece.nbytes)))
    return out

  def charge_device(self, nbytes: int) -> None:
    """Charges `nbytes` to the host -> device link (blocking), when one is set: a chunk
    inserted whole pays its transfer before the insertion."""
    if self.device_link is not None:
      self.device_link.acquire_blocking(int(nbytes))

  def _transfer_loop(self) -> None:
    while True:
      job = self._transfers.get()
      if job is None:
        return
      t, g, piece, done_s = job
      try:
        if done_s is not None:
          self.device_link.wait_reserved(done_s, int(piece.nbytes))
        # Not waited for here: on a CPU backend the copy would queue behind the step's compute
        # and pace the emulated link by the engine (an accelerator's copy engine does not).
        t._set(g, jax.device_put(np.ascontiguousarray(piece)))
      except Exception as e:  # noqa: BLE001 - reported to the waiter
        t._set(g, error=e)

  def drop_tail(self, cache_salt: str | None, token_ids: Sequence[int]
                ) -> concurrent.futures.Future | None:
    """Deletes, in the background, the stored tail a finished session turn left (`tail_key` of
    its ids but the last sampled one) once no session will extend that turn any more: the
    session's next turn superseded it, or the session was closed, expired or evicted (the
    session registry says so, `SessionRegistry.set_tail_sink`). A tail only a session's next
    turn ever looks up would otherwise stay until evicted. (Two sessions with the very same
    history share its tail: the other's next turn then recomputes those tokens.) Never blocks;
    returns the delete's future (None: no tail), which callers need not wait for."""
    ids = [int(t) for t in token_ids]
    if not self.stores_tails or len(ids) < 2:
      return None
    ns = self.namespace(cache_salt)
    end = len(ids) - 1
    tail = self.tail_key(ns.root_hash(), keys.chunk_hashes(ns, ids, max_tokens=end), ids, end)
    if tail is None:
      return None
    return asyncio.run_coroutine_threadsafe(self._drop_tail(tail[2]), self._loop)

  async def _drop_tail(self, key: ChunkHash) -> None:
    with self._lock:
      saving = self._saving.get(key)
    if saving is not None:  # still being written: delete it once it is
      await asyncio.shield(asyncio.wrap_future(saving[1]))
    try:
      if await self.store.delete(key):
        self.saver_stats.tails_dropped += 1
    except Exception as e:  # noqa: BLE001 - best effort: the tier's LRU evicts it later
      _log.warning("deleting a superseded session tail failed: %r", e)

  # ----------------------------------------------------------------------------- capacity
  def usage(self) -> list[TierUsage]:
    """What each persistent tier holds now: chunks, stored bytes, capacity (blocking; lists
    every tier's records: start-up and tools, not the request path)."""
    return self._run(self.store.usage())

  def enforce_capacity(self) -> None:
    """Evicts from every bounded persistent tier until it fits its capacity (blocking; e.g. at
    start over a store a larger capacity filled)."""
    self._run(self.store.enforce_capacity())

  def session_dir(self) -> str | None:
    """The folder for session files beside the store (`SessionRegistry.set_persistence`):
    `<dir>/sessions/<model fingerprint>` of the first persistent tier on a local directory;
    None when no tier is one (memory://, s3://: sessions then live in memory only)."""
    for tier in self.store.tiers:
      d = self.store.local_dirs.get(tier.name)
      if d is not None:
        return os.path.join(d, "sessions", self._fingerprint)
    return None

  # ----------------------------------------------------------------------------- saves
  def submit_save(self, job: SaveJob) -> bool:
    """Queues a save without blocking; returns False (and counts it) when the queue is full.
    Until it is written (or has failed), lookups find its key as `SAVING`."""
    with self._lock:
      entry = self._saving.setdefault(job.chunk_hash, [0, concurrent.futures.Future()])
      entry[0] += 1
    try:
      self._jobs.put_nowait(job)
      return True
    except queue.Full:
      self.saver_stats.jobs_dropped += 1
      self._save_ended(job.chunk_hash)
      return False

  def _save_ended(self, chunk_hash: ChunkHash) -> None:
    with self._lock:
      entry = self._saving[chunk_hash]
      entry[0] -= 1
      if not entry[0]:
        del self._saving[chunk_hash]
        entry[1].set_result(None)

  def flush(self) -> None:
    """Blocks until every queued save has been written (or has failed and been counted), and
    every demotion those saves started (write-back placement) is done."""
    self._jobs.join()
    self._run(self.store.drain())

  def _save_loop(self) -> None:
    while True:
      job = self._jobs.get()
      try:
        if job is None:
          return
        self._save(job)
        self.saver_stats.jobs_done += 1
      except Exception as e:  # noqa: BLE001 - a failed save must not kill the saver
        self.saver_stats.failures += 1
        _log.warning("saving KV chunks failed: %r", e)
      finally:
        if job is not None:
          self._save_ended(job.chunk_hash)
        self._jobs.task_done()

  def _save(self, job: SaveJob) -> None:
    """Copies the chunk (or its encoded levels) to the host in one transfer, then stores it."""
    host = jax.device_get(job.kv if job.payloads is None else job.payloads)
    if job.payloads is None:
      put = lambda: self.store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                   np.asarray(host))
    else:
      encoded = []
      for codec, level, arrays, finite in host:
        if not bool(finite):
          raise ValueError(f"KV chunk holds NaN/inf (or values beyond the {codec} codec's "
                           "range); refusing to store it")
        encoded.append(EncodedPayload(codec, level, {k: np.asarray(v) for k, v in arrays.items()}))
      put = lambda: self.store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                   layout=self.layout, payloads=encoded)
    if job.replace:
      self._run(self._delete_everywhere(job.chunk_hash))
    published = self._run(put())
    if not published and job.verify_existing:
      got = self._run(self.store.get(job.chunk_hash, job.token_ids, job.namespace, self.layout,
                                     promote=False))
      if isinstance(got, ChunkMiss) and got.reason is not MissReason.ABSENT:
        self._run(self._delete_everywhere(job.chunk_hash))
        published = self._run(put())
    if published:
      self.saver_stats.chunks_saved += 1
    else:
      self.saver_stats.chunks_already_stored += 1

  async def _delete_everywhere(self, chunk_hash: ChunkHash) -> None:
    await asyncio.gather(*(t.delete(chunk_hash) for t in self.store.tiers))

  def close(self) -> None:
    """Writes pending saves, then stops the saver and the event loop."""
    if self._closed:
      return
    self._closed = True
    if self._transfer_thread is not None:
      self._transfers.put(None)
      self._transfer_thread.join()
    self._jobs.put(None)
    self._saver.join()
    try:  # demotions in flight (write-back) are written before the loop stops
      self._run(self.store.drain())
    except Exception as e:  # noqa: BLE001 - closing must not fail on a stuck tier
      _log.warning("waiting for demotions at close failed: %r", e)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._loop_thread.join()
