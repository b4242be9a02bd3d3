"""The engine's side of the KV store: namespaced keys, verified prefix loads, asynchronous saves.

Architecture. The store (`kvjax.storage.TieredStore`) is asyncio code; the engine is one plain
thread that owns the device. `KVStoreClient` is a small front over parts that each own their
state, lock and thread, and ask each other only through narrow calls:

    engine thread ── open_request() ─> PrefixLookups ─ store loop: which prefix chunks does any
                  │                  tier hold (keys being saved count: Saver.pending_keys);
                  │                  then OpenRequests keeps the request's lookup and key chain
                  ├─ start_request_load() ─> Loader: queue ─> store loop: get + verify +
                  │                  entropy-decode (on the device for kvtc's rANS codes), a
                  │                  few reads at once; the next starts as one lands. A read
                  │                  waits for its prefetch (Prefetcher.in_flight) and its save
                  │                  (Saver.pending) first
                  │  landed() <──── LoadReports (plain data for the scheduler)
                  │  take() <────── a staged chunk, when the scheduler plans its insertion
                  ├─ release() / cancel_loads(): unwanted loads never start, staging is freed
                  ├─ transfer() ─> HostToDevice: staged chunks layer group by layer group
                  ├─ submit_save() ─> Saver: bounded queue ─> saver thread: one device -> host
                  │                  copy per chunk, put (data, then record)
                  ├─ set_lookahead() ─> Prefetcher ─ store loop: hint the window's chunks
                  │                  (never evicted), prefetch those only a lower tier holds
                  │                  into the host tier, a few bytes in flight, within its room
                  └─ set_pins() ──────> Prefetcher: open sessions' chunks join the hint

    part            owns                                         threads that call it
    StoreLoop       the event loop and its thread                any (run / submit)
    KeyScheme       nothing (frozen: namespaces, tail keys)      any
    PrefixLookups   lookup failures                              engine
    OpenRequests    each open request's lookup and key chain     engine
    Loader          load queue, reads, staging, reports, stats   engine; store loop (reads)
    Prefetcher      window, pins, hint, prefetches, their stats  engine, registry; store loop
    Saver           save queue, keys being saved, saver thread   engine, registry; saver
    HostToDevice    transfer queue and thread                    engine; transfer thread

The client keeps each request's prefix lookup and chained chunk keys from admission to its end
(`open_request` ... `close_request`; the engine names requests by id and gets plain data back:
`start_request_load` (given the plan's encoding id: the codec choice is made here),
`request_chunk_key`, `request_tail_key`, `request_tail_job` (the tail's key scheme stays here),
`lookahead_requests`). The scheduler owns which loads exist and what they mean. Loads never
block the engine: `start_load` returns at once and reads are refilled on the event loop the moment
one lands, so a long engine step never idles the link. The link time each report carries is
measured by the loader, from the read's start or the previous landing (whichever is later), so
it is the link's (and verifier's) rate, not the engine's pacing. Saves never block the engine
either: when the queue is full the job is dropped and counted. `flush()` waits until every
queued save is written (tests and `LLM.flush()` use it).

Look-ahead (CachedAttention, arXiv 2403.19708, section 3.3). The scheduler names the requests
that will read stored chunks next (`SchedulerOutput.lookahead`); the engine hands their prefix
lookups here when the window changes (`set_lookahead`), and the session registry hands the open
sessions' token ids (`set_pins`). On the event loop, the union of their chunk hashes becomes the
store's hint (`TieredStore.hint`: no tier evicts them), and chunks of windowed requests that only
a lower tier holds are copied up to the host tier (`TieredStore.prefetch`), in window order,
at most `prefetch_bytes` in flight, and only while the window's chunks plus the pinned ones fit
the host tier; a chunk that a load is already reading is left to it (a load promotes what it
reads). A load of a chunk whose prefetch is in flight waits for it and reads the host copy (one
read of the lower tier, not two). Outcomes (`prefetch_stats`): issued (a copy made), useful (a
load later read it from the host tier), wasted (it left the window unread: evicted, computed
instead, or its request ended).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any, Sequence

import numpy as np

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.connector.device import DeviceSeam
from kvjax.connector.loader import Loader
from kvjax.connector.lookup import KeyScheme, PrefixLookups
from kvjax.connector.loop import StoreLoop
from kvjax.connector.prefetch import Prefetcher
from kvjax.connector.records import (LoaderStats, LookaheadRequest, PrefetchStats, PrefixLookup,
                                     SaveJob, SaverStats, TierSnapshot)
from kvjax.connector.request_keys import OpenRequests
from kvjax.connector.saver import Saver
from kvjax.connector.transfer import HostToDevice, LayerTransfer
from kvjax.scheduler.output import LoadReport
from kvjax.storage.format import keys
from kvjax.storage.backends.chunk_store import choose_codec
from kvjax.storage.tiering.tiers import TierUsage
from kvjax.storage.format.types import ChunkHit, KVLayout

_log = logging.getLogger(__name__)


class KVStoreClient:
  """Keys, loads and saves for one model's KV layout over a `TieredStore`.

  A front: it builds its parts (`lookups`, `requests`, `loader`, `prefetcher`, `saver`,
  `to_device`, over one `loop`; the module docstring says who owns what) and forwards to them.

  Args:
    store: the tiered store (async API).
    model_fingerprint: seeds every key (`kvjax.models.loading.fingerprint`).
    layout: stored chunk layout `[L, 2, C, K, H]` and dtype.
    kv_layout_version: `kvjax.models.nn.kv_cache.KV_LAYOUT_VERSION`.
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
    device_link: the emulated host -> device link (a `kvjax.storage.backends.link.LinkLimiter`), or
      None: every staged chunk's bytes pass it on their way into the KV cache (`transfer`,
      `charge_device`).
    device: the runner's device seam (`kvjax.connector.device.DeviceSeam`; a runner's
      `device_seam()`): every device call of the connector goes through it (host -> device puts,
      device -> host copies of saved chunks, and the device decode of a landed chunk whose arrays
      the reader left entropy-coded, `storage.format.entropy.RansCodes`: kvtc's "rans-bands" `q`). A
      chunk whose streams fail the decoder's `ok` check is a miss (`MissReason.CORRUPT`),
      recomputed like any bad chunk.
    prefetch_bytes: look-ahead prefetch reads' bytes in flight at most (the first never
      waits); None: 4 raw chunks.
    consistent: the engine runs `kv_codec_consistent` (a lossy codec's one level,
      `codec_levels[0]`, in every stored and loaded chunk): keys carry that encoding
      (`keys.KeyNamespace.encoding`, `key_encoding`), so such an engine finds and writes its
      own chunks beside other encodings' chunks of the same prompt.
    settle_loads: every `landed` first waits until no load is queued or reading (a link
      infinitely fast against compute; a test seam: an engine on a fake clock then plans the
      same whatever the loader thread's pace on a busy machine).
  """

  def __init__(self, store, *, model_fingerprint: str, layout: KVLayout, kv_layout_version: int,
               max_pending_saves: int = 16, timeout_s: float = 60.0, codec: str = "raw",
               codec_levels: Sequence[int] = (0,), staging_bytes: int = 1 << 30,
               kvtc_transform_id: bytes | None = None, device_link=None,
               device: DeviceSeam, prefetch_bytes: int | None = None, consistent: bool = False,
               settle_loads: bool = False):
    self.store = store
    self._settle_loads = settle_loads
    self.codec = codec
    self.codec_levels = tuple(codec_levels)
    #: `KeyNamespace.encoding` of every key: "codec/level" of the one level a
    #: `kv_codec_consistent` engine stores and loads (lossy codecs), else None.
    self.key_encoding = (str(codecs.EncodingId(codec, self.codec_levels[0]))
                         if consistent and codec != codecs.RAW else None)
    #: The runner's device seam: the connector's only way to the device.
    self.device = device
    self.scheme = KeyScheme(model_fingerprint, layout, kv_layout_version, codec,
                            self.key_encoding)
    self._closed = False
    self.loop = StoreLoop(timeout_s)
    self.saver = Saver(store, self.scheme, self.loop, device, max_pending_saves)
    self.lookups = PrefixLookups(store, self.scheme, self.loop, self.saver.pending_keys)
    self.requests = OpenRequests(self.scheme)
    self.prefetcher = Prefetcher(store, self.scheme, self.loop, prefetch_bytes)
    self.loader = Loader(store, self.scheme, self.loop, device, self.saver, self.prefetcher,
                         staging_bytes=staging_bytes, kvtc_transform_id=kvtc_transform_id)
    self.to_device = HostToDevice(device, device_link)
    host = store.host_capacity()
    if codec == "raw" and host is not None and host[1] is not None and host[1] < layout.nbytes:
      _log.warning("host tier %r holds %d bytes, less than one raw chunk (%d bytes): it will "
                   "hold no chunk", host[0], host[1], layout.nbytes)

  # ------------------------------------------------------------------ configuration (read-only)
  @property
  def layout(self) -> KVLayout:
    return self.scheme.layout

  @property
  def chunk_size(self) -> int:
    return self.scheme.chunk_size

  @property
  def origin(self):
    """What every chunk this client stores records as its origin, and every chunk it loads must
    have recorded (`kvjax.storage.format.types.ChunkOrigin`; the stored-chunk guard)."""
    return self.scheme.origin

  @property
  def device_link(self):
    return self.to_device.device_link

  @property
  def kvtc_transform_id(self) -> bytes | None:
    return self.loader.kvtc_transform_id

  @property
  def staging_bytes(self) -> int:
    return self.loader.staging_bytes

  @property
  def prefetch_bytes(self) -> int:
    return self.prefetcher.prefetch_bytes

  @property
  def stores_tails(self) -> bool:
    """Whether session tails are stored and looked up (`KeyScheme.stores_tails`)."""
    return self.scheme.stores_tails

  def _run(self, coro):
    return self.loop.run(coro)

  # ------------------------------------------------------------------------------ keys, lookups
  def namespace(self, cache_salt: str | None) -> keys.KeyNamespace:
    return self.scheme.namespace(cache_salt)

  def tail_key(self, namespace: str, hashes: Sequence[ChunkHash], token_ids: Sequence[int],
               end: int) -> tuple[int, ChunkHash, ChunkHash] | None:
    """`KeyScheme.tail_key`."""
    return self.scheme.tail_key(namespace, hashes, token_ids, end)

  def lookup(self, prompt_ids: Sequence[int], cache_salt: str | None, *,
             history_tokens: int = 0) -> PrefixLookup:
    """`PrefixLookups.lookup`: which prefix chunks (and session tail) any tier holds."""
    return self.lookups.lookup(prompt_ids, cache_salt, history_tokens=history_tokens)

  @property
  def lookup_failures(self) -> int:
    return self.lookups.failures

  def extend_chunk_hashes(self, lookup: PrefixLookup, hashes: Sequence[ChunkHash],
                          token_ids: Sequence[int], num_chunks: int) -> list[ChunkHash]:
    """`hashes` (chained keys of the first chunks of `token_ids`, under `lookup`'s namespace)
    extended to `num_chunks` keys (`KeyScheme.extend_chunk_hashes`).

    Raises:
      ValueError: `token_ids` shorter than `num_chunks` chunks.
    """
    return self.scheme.extend_chunk_hashes(lookup.namespace, hashes, token_ids, num_chunks)

  def read_raw_chunks(self, lookup: PrefixLookup, token_ids: Sequence[int],
                      indices: Sequence[int]) -> dict[int, np.ndarray]:
    """`PrefixLookups.read_raw_chunks` (session re-rotation)."""
    return self.lookups.read_raw_chunks(lookup, token_ids, indices)

  def put_raw_chunks(self, cache_salt: str | None, token_ids: Sequence[int],
                     chunks: Sequence[np.ndarray], *, first: int = 0) -> int:
    """`PrefixLookups.put_raw_chunks` (session re-rotation).

    Raises:
      ValueError: `first` < 0 or chunks past the end of `token_ids`.
    """
    return self.lookups.put_raw_chunks(cache_salt, token_ids, chunks, first=first)

  # ----------------------------------------------------------------------- open requests' keys
  def open_request(self, request_id: Any, prompt_ids: Sequence[int], cache_salt: str | None, *,
                   history_tokens: int = 0) -> PrefixLookup:
    """Looks the prompt up (`lookup`, one batch) and keeps its lookup and key chain for the
    request until `close_request`; returns the lookup (plain data). A request id still open is
    replaced."""
    lookup = self.lookup(prompt_ids, cache_salt, history_tokens=history_tokens)
    self.requests.open(request_id, lookup, prompt_ids)
    return lookup

  def is_open(self, request_id: Any) -> bool:
    """Whether `open_request` keeps state for the request."""
    return self.requests.is_open(request_id)

  def close_request(self, request_id: Any) -> int:
    """Forgets the request's lookup and keys and drops its loads (`cancel_loads`); returns how
    many loads were dropped. Idempotent."""
    self.requests.close(request_id)
    return self.loader.cancel(request_id)

  def start_request_load(self, request_id: Any, index: int, *,
                         encoding: codecs.EncodingId | None = None, nbytes: int = 0,
                         max_in_flight: int = 2, layer_start: int = 0) -> None:
    """`start_load` of chunk `index` of an open request's prompt, with its own lookup.

    `encoding` is the level policy's pick (the scheduler's `LoadItem.encoding`): that encoding
    is read (`kvjax.storage.backends.chunk_store.choose_codec`); None: the loader's own choice. The
    codec choice stays behind the client: the engine hands over the plan's plain id.
    `layer_start` k > 0 (`LoadItem.layer_start`) reads layers `[k, L)` alone (`Loader.start`).

    Raises:
      KeyError: the request is not open.
    """
    choose = None if encoding is None else choose_codec(encoding.codec, encoding.level)
    r = self.requests.get(request_id)
    self.loader.start(request_id, index, r.lookup, r.prompt_ids, choose=choose, nbytes=nbytes,
                      max_in_flight=max_in_flight, layer_start=layer_start)

  def lookahead_requests(self, request_ids: Sequence[Any]) -> list[LookaheadRequest]:
    """The look-ahead window's records (`lookahead_request`) of those of `request_ids` that are
    open, in order."""
    return [self.prefetcher.lookahead_request(rid, r.lookup, r.prompt_ids)
            for rid, r in self.requests.open_of(request_ids)]

  def extend_request_keys(self, request_id: Any, token_ids: Sequence[int],
                          num_chunks: int) -> None:
    """`OpenRequests.extend`.

    Raises:
      KeyError: the request is not open; ValueError: `token_ids` shorter than `num_chunks`
        chunks.
    """
    self.requests.extend(request_id, token_ids, num_chunks)

  def request_chunk_key(self, request_id: Any, index: int) -> tuple[str, ChunkHash, str]:
    """`OpenRequests.chunk_key`: `(namespace root, key, parent key)`.

    Raises:
      KeyError: the request is not open; IndexError: the chain is shorter.
    """
    return self.requests.chunk_key(request_id, index)

  def request_tail_key(self, request_id: Any, token_ids: Sequence[int], end: int
                       ) -> tuple[str, ChunkHash, ChunkHash] | None:
    """`OpenRequests.tail_key`: `(namespace root, parent key, key)`, or None.

    Raises:
      KeyError: the request is not open.
    """
    return self.requests.tail_key(request_id, token_ids, end)

  def request_tail_job(self, request_id: Any, token_ids: Sequence[int], end: int,
                       kv: Any) -> SaveJob:
    """`OpenRequests.tail_job`: the tail's `SaveJob` (the key scheme stays behind the client).

    Raises:
      KeyError: the request is not open; ValueError: `end` is a multiple of C (no tail).
    """
    return self.requests.tail_job(request_id, token_ids, end, kv)

  # ---------------------------------------------------------------------------------- loads
  def start_load(self, request_id: Any, index: int, lookup: PrefixLookup,
                 prompt_ids: Sequence[int], *, choose=None, nbytes: int = 0,
                 max_in_flight: int = 2, layer_start: int = 0) -> None:
    """`Loader.start`: queues a background load; its `LoadReport` comes from `landed()`."""
    self.loader.start(request_id, index, lookup, prompt_ids, choose=choose, nbytes=nbytes,
                      max_in_flight=max_in_flight, layer_start=layer_start)

  def warmup_entropy(self, codec: str, level: int, arrays) -> None:
    """`Loader.warmup_entropy`.

    Raises:
      ValueError: a payload that does not match the layout; RuntimeError: the decode failed.
    """
    self.loader.warmup_entropy(codec, level, arrays)

  def landed(self, wait_s: float | None = None) -> list[LoadReport]:
    """`Loader.landed`: the reports of every load that finished since the last call (with
    `settle_loads`, after every load started so far finished).

    Raises:
      TimeoutError: with `settle_loads`, a load still in flight after the client's timeout.
    """
    if self._settle_loads and not self.loader.wait_idle(self.loop.timeout_s):
      raise TimeoutError(f"a store load did not land within {self.loop.timeout_s} s")
    return self.loader.landed(wait_s)

  def take(self, request_id: Any, index: int) -> ChunkHit:
    """`Loader.take`.

    Raises:
      KeyError: if the chunk is not staged (a planner bug).
    """
    return self.loader.take(request_id, index)

  def release(self, request_id: Any, index: int) -> None:
    """`Loader.release`."""
    self.loader.release(request_id, index)

  def cancel_loads(self, request_id: Any) -> int:
    """`Loader.cancel`: drops every queued, reading and staged load of the request."""
    return self.loader.cancel(request_id)

  def loads_in_flight(self, request_id: Any = None) -> int:
    """Loads queued or reading (of one request, or all)."""
    return self.loader.in_flight(request_id)

  def tier_snapshots(self) -> tuple[TierSnapshot, ...]:
    """Per-tier counters (misses, loaded bytes, link limiter), plain data."""
    return self.loader.tier_snapshots()

  @property
  def loader_stats(self) -> LoaderStats:
    return self.loader.stats

  # --------------------------------------------------------------------------------- look-ahead
  def lookahead_request(self, request_id: Any, lookup: PrefixLookup,
                        prompt_ids: Sequence[int]) -> LookaheadRequest:
    """`Prefetcher.lookahead_request`."""
    return self.prefetcher.lookahead_request(request_id, lookup, prompt_ids)

  def set_lookahead(self, requests: Sequence[LookaheadRequest]) -> None:
    """Replaces the look-ahead window (the engine calls it when the scheduler's window
    changed): its chunks join the store's hint and those only a lower tier holds are
    prefetched into the host tier, on the event loop. Never blocks."""
    self.prefetcher.set_lookahead(requests)

  def set_pins(self, sessions: Sequence[tuple[str | None, Sequence[int]]]) -> None:
    """Replaces the pinned sessions: per session, most important first, its `cache_salt` and
    exact token ids (its last turn's prompt and output). Their full chunks join the store's
    hint (never evicted), as many whole sessions as fit half the host tier (the other half is
    the window's), each with its stored tail (`stores_tails`, a chunk's bytes) while that fits
    too. The session registry owns which sessions are pinned (`SessionRegistry.pinned`). Never
    blocks on the store. Without a host tier nothing is pinned: pins keep sessions in the host
    tier, and a persistent tier's own LRU order keeps recent sessions (pinning there would let
    open sessions hold a bounded store over its capacity)."""
    self.prefetcher.set_pins(sessions)

  def wait_prefetches(self, timeout_s: float | None = None) -> None:
    """Blocks until no prefetch is in flight or startable (tests, benchmarks)."""
    self.prefetcher.wait(timeout_s)

  @property
  def prefetch_stats(self) -> PrefetchStats:
    return self.prefetcher.stats

  # --------------------------------------------------------------------------- host -> device
  def transfer(self, chunks: Sequence[np.ndarray], groups: Sequence[tuple[int, int]]
               ) -> list[LayerTransfer]:
    """`HostToDevice.transfer`: staged raw chunks to the device in layer groups. Never
    blocks."""
    return self.to_device.transfer(chunks, groups)

  def charge_device(self, nbytes: int) -> None:
    """`HostToDevice.charge_device`."""
    self.to_device.charge_device(nbytes)

  # ---------------------------------------------------------------------------------- saves
  def submit_save(self, job: SaveJob) -> bool:
    """Queues a save without blocking; returns False (and counts it) when the queue is full.
    Until it is written (or has failed), lookups find its key as `SAVING`."""
    return self.saver.submit(job)

  def drop_tail(self, cache_salt: str | None, token_ids: Sequence[int]
                ) -> concurrent.futures.Future | None:
    """Deletes, in the background, the stored tail a finished session turn left (`tail_key` of
    its ids but the last sampled one) once no session will extend that turn any more: the
    session's next turn superseded it, or the session was closed, expired or evicted (the
    session registry says so, `SessionRegistry.set_tail_sink`). A tail only a session's next
    turn ever looks up would otherwise stay until evicted. (Two sessions with the very same
    history share its tail: the other's next turn then recomputes those tokens.) Never blocks;
    returns the delete's future (None: no tail), which callers need not wait for."""
    return self.saver.drop_tail(cache_salt, token_ids)

  @property
  def saver_stats(self) -> SaverStats:
    return self.saver.stats

  def flush(self) -> None:
    """Blocks until every queued save has been written (or has failed and been counted), and
    every demotion those saves started (write-back placement) is done."""
    self.saver.join()
    self._run(self.store.drain())

  # ------------------------------------------------------------------------------- capacity
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
        return os.path.join(d, "sessions", self.scheme.model_fingerprint)
    return None

  def close(self) -> None:
    """Writes pending saves, then stops the saver and the event loop."""
    if self._closed:
      return
    self._closed = True
    self.to_device.close()
    self.saver.close()
    try:  # demotions in flight (write-back) are written before the loop stops
      self._run(self.store.drain())
    except Exception as e:  # noqa: BLE001 - closing must not fail on a stuck tier
      _log.warning("waiting for demotions at close failed: %r", e)
    self.loop.stop()
