"""The engine's side of the KV store: namespaced keys, verified prefix loads, asynchronous saves.

Architecture. The store (`kvjax.storage.TieredStore`) is asyncio code; the engine is one plain
thread that owns the device. This client runs the store's coroutines on its own event-loop thread
and adds a saver thread:

    engine thread ── open_request() / lookup() ─> event loop: which prefix chunks does any tier
                  │                               hold (open_request keeps the request's keys)
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

The client owns each request's prefix lookup and chained chunk keys from admission to its end
(`open_request` ... `close_request`; the engine names requests by id and gets plain data back:
`start_request_load` (given the plan's encoding id: the codec choice is made here),
`request_chunk_key`, `request_tail_key`, `request_tail_job` (the tail's key scheme stays here),
`lookahead_requests`). It owns
the load pipeline's state (queue, reads in flight, staged payloads) and its
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
import logging
import math
import os
import queue
import threading
from typing import Any, Sequence

from kvjax import codecs
from kvjax._typing import ChunkHash
from kvjax.connector.device import DeviceSeam
from kvjax.connector.loader import LoaderMixin
from kvjax.connector.lookup import LookupMixin
from kvjax.connector.prefetch import PrefetchMixin
from kvjax.connector.records import (LoaderStats, LookaheadRequest, Pending, PrefetchStats, SaveJob,
                                     SaverStats)
from kvjax.connector.request_keys import RequestKeysMixin
from kvjax.connector.saver import SaverMixin
from kvjax.connector.transfer import TransferMixin
from kvjax.scheduler.output import LoadReport
from kvjax.storage.tiers import TierUsage
from kvjax.storage.types import ChunkHit, ChunkOrigin, KVLayout

_log = logging.getLogger(__name__)


class KVStoreClient(LookupMixin, RequestKeysMixin, LoaderMixin, PrefetchMixin, TransferMixin,
                    SaverMixin):
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
    device: the runner's device seam (`kvjax.connector.device.DeviceSeam`; a runner's
      `device_seam()`): every device call of the connector goes through it (host -> device puts,
      device -> host copies of saved chunks, and the device decode of a landed chunk whose arrays
      the reader left entropy-coded, `storage.entropy.RansCodes`: kvtc's "rans-bands" `q`). A
      chunk whose streams fail the decoder's `ok` check is a miss (`MissReason.CORRUPT`),
      recomputed like any bad chunk.
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
               device: DeviceSeam, prefetch_bytes: int | None = None, consistent: bool = False):
    self.codec = codec
    #: `KeyNamespace.encoding` of every key: "codec/level" of the one level a
    #: `kv_codec_consistent` engine stores and loads (lossy codecs), else None.
    self.key_encoding = (str(codecs.EncodingId(codec, tuple(codec_levels)[0]))
                         if consistent and codec != codecs.RAW else None)
    #: The runner's device seam: the connector's only way to the device.
    self.device = device
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
    #: What every chunk this client stores records as its origin, and every chunk it loads must
    #: have recorded (the stored-chunk guard, `ChunkRecord.mismatch`).
    self.origin = ChunkOrigin(model_fingerprint=model_fingerprint,
                              kv_layout_version=kv_layout_version)
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
    self._queue: collections.deque[Pending] = collections.deque()
    self._reading: dict[tuple[Any, int], Pending] = {}
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
    self._init_requests()  # each open request's lookup and key chain (`open_request`)
    host = store.host_capacity()
    if codec == "raw" and host is not None and host[1] is not None and host[1] < layout.nbytes:
      _log.warning("host tier %r holds %d bytes, less than one raw chunk (%d bytes): it will "
                   "hold no chunk", host[0], host[1], layout.nbytes)

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

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
