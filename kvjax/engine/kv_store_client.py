"""The engine's side of the KV store: namespaced keys, verified prefix loads, asynchronous saves.

Architecture. The store (`kvjax.storage.TieredStore`) is asyncio code; the engine is one plain
thread that owns the device. This client runs the store's coroutines on its own event-loop thread
and adds a saver thread:

    engine thread ── lookup() ───────> event loop: which prefix chunks does any tier hold
                  ├─ start_load() ───> event loop: get + verify + entropy-decode one chunk
                  │  landed() <────── landed loads (the engine inserts them between steps)
                  └─ submit_save() ──> bounded queue ──> saver thread: device -> host, slice
                                                         full chunks, put (data, then record)

Loads never block the engine: `start_load` returns at once and `landed()` hands over what has
arrived; `cancel_loads` drops a request's loads and releases their staging. Saves never block the
engine either: when the queue is full the job is dropped and counted. `flush()` waits until every
queued save is written (tests and `LLM.flush()` use it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Sequence

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.storage import keys
from kvjax.storage.types import (ChunkHit, ChunkMiss, ChunkRecord, EncodedPayload, KVLayout,
                                MissReason)

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrefixLookup:
  """Which full chunks of a prompt's prefix some tier holds (one batched lookup, no data read).

  Attributes:
    hashes: keys of all full chunks of the prompt, in order.
    namespace: the key namespace root (hex) the hashes are under.
    present: per candidate chunk (full chunks of `prompt[:-1]`, never the last token), the tier
      holding it or None.
    records: per candidate chunk, the index record that tier holds (its encodings and their
      stored bytes), or None.
  """

  hashes: list[ChunkHash]
  namespace: str
  present: list[str | None]
  records: list[ChunkRecord | None] = dataclasses.field(default_factory=list)

  @property
  def hits(self) -> list[bool]:
    return [t is not None for t in self.present]


@dataclasses.dataclass
class LoadResult:
  """One background chunk load that has landed (or failed).

  Attributes:
    request_id: the request it was started for.
    index: prompt chunk index.
    result: the verified hit (host arrays) or the miss and its reason.
    started_s: when the load was started (client clock, seconds).
    done_s: when it landed.
  """

  request_id: Any
  index: int
  result: ChunkHit | ChunkMiss
  started_s: float
  done_s: float

  @property
  def nbytes(self) -> int:
    """Stored bytes read (0 for a miss)."""
    return self.result.encoding.nbytes if isinstance(self.result, ChunkHit) else 0


@dataclasses.dataclass
class LoaderStats:
  """Background-load accounting.

  Attributes:
    started: loads started.
    landed: loads handed to the engine.
    cancelled: loads dropped because their request ended first (their staging released).
    in_flight: loads started and not yet landed or cancelled.
    staged_bytes: stored bytes landed on the host and not yet taken by the engine.
  """

  started: int = 0
  landed: int = 0
  cancelled: int = 0
  in_flight: int = 0
  staged_bytes: int = 0


@dataclasses.dataclass
class SaveJob:
  """Full prompt chunks `[first_chunk, len(hashes))` to store, from prefill outputs.

  Attributes:
    namespace: key namespace root (hex).
    hashes: keys of all full chunks of the prompt.
    token_ids: the prompt's tokens.
    chunks: indices of the full chunks to save (those computed, not loaded), ascending.
    replace: chunk indices whose stored copy was rejected: deleted, then written afresh.
    pieces: (start position, K before RoPE [L, T, K, H], V [L, T, K, H]) device or host arrays
      covering at least the positions of `chunks`.
  """

  namespace: str
  hashes: list[ChunkHash]
  token_ids: list[int]
  chunks: list[int]
  replace: set[int]
  pieces: list[tuple[int, Any, Any]]


@dataclasses.dataclass
class SaverStats:
  jobs_done: int = 0
  chunks_saved: int = 0
  chunks_already_stored: int = 0
  jobs_dropped: int = 0
  failures: int = 0


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
    encode: `(kv [L, 2, C, K, H], codec, level) -> {name: array}` payload encoder (the runner's
      device-side `kv_encode`); needed for every codec but raw.
  """

  def __init__(self, store, *, model_fingerprint: str, layout: KVLayout, kv_layout_version: int,
               max_pending_saves: int = 16, timeout_s: float = 60.0, codec: str = "raw",
               codec_levels: Sequence[int] = (0,), encode=None):
    if codec != "raw" and encode is None:
      raise ValueError(f"codec {codec!r} needs an encoder")
    self.codec = codec
    self.codec_levels = tuple(codec_levels)
    self._encode = encode
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
    self._saver = threading.Thread(target=self._save_loop, name="kvjax-saver", daemon=True)
    self._saver.start()
    self._closed = False
    self.lookup_failures = 0
    self.loader_stats = LoaderStats()
    self._load_lock = threading.Lock()
    self._in_flight: dict[tuple[Any, int], Any] = {}
    self._landed: list[LoadResult] = []
    self._landed_event = threading.Event()

  # ----------------------------------------------------------------------------- keys
  def namespace(self, cache_salt: str | None) -> keys.KeyNamespace:
    return keys.KeyNamespace(model_fingerprint=self._fingerprint, kv_dtype=self.layout.dtype,
                             kv_layout_version=self._layout_version,
                             chunk_size=self.chunk_size, cache_salt=cache_salt)

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout_s)

  # ----------------------------------------------------------------------------- loads
  def lookup(self, prompt_ids: Sequence[int], cache_salt: str | None) -> PrefixLookup:
    """Asks every tier, in one batch, which prefix chunks of the prompt are stored.

    Candidates are the full chunks of `prompt_ids[:-1]` (a hit never covers the last prompt
    token). A store that fails the lookup degrades to "nothing present" with a warning.
    """
    ns = self.namespace(cache_salt)
    hashes = keys.chunk_hashes(ns, prompt_ids)
    candidates = hashes[:(len(prompt_ids) - 1) // self.chunk_size]
    present: list[str | None] = [None] * len(candidates)
    records: list[ChunkRecord | None] = [None] * len(candidates)
    if candidates:
      try:
        found = self._run(self.store.peek(candidates))
        present = [f[0] if f is not None else None for f in found]
        records = [f[1] if f is not None else None for f in found]
      except Exception as e:  # noqa: BLE001 - an unreachable store degrades to compute
        self.lookup_failures += 1
        present = [None] * len(candidates)
        _log.warning("KV store lookup failed (%r); computing the prompt instead", e)
    return PrefixLookup(hashes=hashes, namespace=ns.root_hash(), present=present,
                        records=records)

  def start_load(self, request_id: Any, index: int, lookup: PrefixLookup,
                 prompt_ids: Sequence[int], choose=None) -> None:
    """Starts a background load of prompt chunk `index`; it lands in `landed()` later.

    The read runs on the store's event loop (tensorstore async reads; the link limiter and byte
    limiter bound it); verification and entropy decoding happen there too, on the host. Never
    blocks the engine.

    Args:
      request_id: the owner; `cancel_loads(request_id)` drops its loads.
      index: chunk index within the prompt.
      lookup: the prompt's `PrefixLookup`.
      prompt_ids: the prompt's tokens.
      choose: optional `Callable[[Sequence[Encoding]], Encoding | None]` picking the encoding
        (codec level) to read.
    """
    c = self.chunk_size
    key = (request_id, index)
    started = time.perf_counter()

    async def load() -> None:
      try:
        got = await self.store.get(lookup.hashes[index], prompt_ids[index * c:(index + 1) * c],
                                   lookup.namespace, self.layout, **(
                                       {"choose": choose} if choose is not None else {}))
      except Exception as e:  # noqa: BLE001 - a failed read is a miss, never a user error
        got = ChunkMiss(lookup.hashes[index], MissReason.READ_ERROR, repr(e))
      self._land(LoadResult(request_id, index, got, started, time.perf_counter()))

    with self._load_lock:
      self.loader_stats.started += 1
      self.loader_stats.in_flight += 1
      self._in_flight[key] = asyncio.run_coroutine_threadsafe(load(), self._loop)

  def _land(self, result: LoadResult) -> None:
    with self._load_lock:
      if self._in_flight.pop((result.request_id, result.index), None) is None:
        return  # cancelled meanwhile: drop it (its staging is released with it)
      self.loader_stats.in_flight -= 1
      self.loader_stats.staged_bytes += result.nbytes
      self._landed.append(result)
      self._landed_event.set()

  def landed(self, wait_s: float | None = None) -> list[LoadResult]:
    """Takes every landed load (ownership passes to the caller: staging is released).

    Args:
      wait_s: if no load has landed, block up to this long for one (None: do not block).
    """
    if wait_s is not None and not self._landed:
      self._landed_event.wait(wait_s)
    with self._load_lock:
      out, self._landed = self._landed, []
      self._landed_event.clear()
      for r in out:
        self.loader_stats.staged_bytes -= r.nbytes
        self.loader_stats.landed += 1
    return out

  def cancel_loads(self, request_id: Any) -> int:
    """Drops the request's in-flight and landed-but-untaken loads; returns how many."""
    with self._load_lock:
      keys_ = [k for k in self._in_flight if k[0] == request_id]
      for k in keys_:
        self._in_flight.pop(k).cancel()
      kept = [r for r in self._landed if r.request_id != request_id]
      dropped = [r for r in self._landed if r.request_id == request_id]
      self._landed = kept
      self.loader_stats.in_flight -= len(keys_)
      self.loader_stats.staged_bytes -= sum(r.nbytes for r in dropped)
      n = len(keys_) + len(dropped)
      self.loader_stats.cancelled += n
      if not self._landed:
        self._landed_event.clear()
    return n

  def loads_in_flight(self, request_id: Any = None) -> int:
    with self._load_lock:
      if request_id is None:
        return len(self._in_flight)
      return sum(1 for k in self._in_flight if k[0] == request_id)

  # ----------------------------------------------------------------------------- saves
  def submit_save(self, job: SaveJob) -> bool:
    """Queues a save without blocking; returns False (and counts it) when the queue is full."""
    if not job.chunks:
      return True
    try:
      self._jobs.put_nowait(job)
      return True
    except queue.Full:
      self.saver_stats.jobs_dropped += 1
      return False

  def flush(self) -> None:
    """Blocks until every queued save has been written (or has failed and been counted)."""
    self._jobs.join()

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
        self._jobs.task_done()

  def _save(self, job: SaveJob) -> None:
    c = self.chunk_size
    # After a rejection, stored chunks further along may be bad too: check each one we would
    # skip, and rewrite the bad ones, so one save repairs the chain.
    check_existing = bool(job.replace)
    for i in job.chunks:
      kv = self._chunk_from_pieces(job.pieces, i * c)
      parent = job.hashes[i - 1] if i else job.namespace
      tokens = job.token_ids[i * c:(i + 1) * c]
      if i in job.replace:
        self._run(self._delete_everywhere(job.hashes[i]))
      put = self._put_coro_factory(job.hashes[i], parent, tokens, job.namespace, kv)
      published = self._run(put())
      if not published and check_existing:
        got = self._run(self.store.get(job.hashes[i], tokens, job.namespace, self.layout,
                                       promote=False))
        if isinstance(got, ChunkMiss) and got.reason is not MissReason.ABSENT:
          self._run(self._delete_everywhere(job.hashes[i]))
          published = self._run(put())
      if published:
        self.saver_stats.chunks_saved += 1
      else:
        self.saver_stats.chunks_already_stored += 1

  def _put_coro_factory(self, chunk_hash, parent, tokens, namespace, kv):
    """A coroutine factory storing `kv` with the configured codec (levels side by side)."""
    if self.codec == "raw":
      return lambda: self.store.put(chunk_hash, parent, tokens, namespace, kv)
    payloads = [EncodedPayload(self.codec, level, self._encode(kv, self.codec, level))
                for level in self.codec_levels]
    return lambda: self.store.put(chunk_hash, parent, tokens, namespace, layout=self.layout,
                                  payloads=payloads)

  def _chunk_from_pieces(self, pieces, lo: int) -> np.ndarray:
    """`[L, 2, C, K, H]` of positions `[lo, lo + C)` gathered from prefill pieces (to host).

    Raises:
      ValueError: if the pieces do not cover every position.
    """
    c = self.chunk_size
    hi = lo + c
    kv = np.zeros((self.layout.num_layers, 2, c, self.layout.num_kv_heads,
                   self.layout.head_dim), self.layout.dtype)
    covered = np.zeros(c, bool)
    for start, k_piece, v_piece in pieces:
      a, b = max(start, lo), min(start + k_piece.shape[1], hi)
      if a < b:
        kv[:, 0, a - lo:b - lo] = np.asarray(k_piece[:, a - start:b - start])
        kv[:, 1, a - lo:b - lo] = np.asarray(v_piece[:, a - start:b - start])
        covered[a - lo:b - lo] = True
    if not covered.all():
      raise ValueError(f"save job covers {covered.sum()} of the {c} positions from {lo}")
    return kv

  async def _delete_everywhere(self, chunk_hash: ChunkHash) -> None:
    await asyncio.gather(*(t.delete(chunk_hash) for t in self.store.tiers))

  def close(self) -> None:
    """Writes pending saves, then stops the saver and the event loop."""
    if self._closed:
      return
    self._closed = True
    self._jobs.put(None)
    self._saver.join()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._loop_thread.join()
