"""The connector's saves: a bounded queue drained by the saver thread (one device -> host copy
per chunk, then a put), and the background delete of superseded session tails."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Sequence

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.connector.device import DeviceSeam
from kvjax.connector.lookup import KeyScheme
from kvjax.connector.loop import StoreLoop
from kvjax.connector.records import SaveJob, SaverStats
from kvjax.storage.format import keys
from kvjax.storage.format.types import ChunkMiss, EncodedPayload, MissReason

_log = logging.getLogger(__name__)


class Saver:
  """Queued saves of full chunks and session tails, written by one saver thread.

  Owns: the job queue, the saver thread ("kvjax-saver"), the keys being saved (`pending`,
  under its own lock), the tail deletes in flight and `stats`. `submit` and `drop_tail` are called from the engine thread
  (and the session registry's), `pending`/`pending_keys` from the engine thread and the store
  loop (loads of a key being saved wait for its write); the saver thread runs `write`.

  Args:
    store: the tiered store.
    scheme: the key scheme (origin and layout of every put; tail keys).
    loop: the connector's event loop (the saver thread blocks on it for each put).
    device: the runner's device seam (one device -> host copy per job).
    max_pending_saves: jobs queued at most; more are dropped and counted.
  """

  def __init__(self, store, scheme: KeyScheme, loop: StoreLoop, device: DeviceSeam,
               max_pending_saves: int = 16):
    self._store = store
    self._scheme = scheme
    self._loop = loop
    self._device = device
    #: Saves done, dropped and failed (written by the saver thread and `submit`).
    self.stats = SaverStats()
    self._jobs: queue.Queue[SaveJob | None] = queue.Queue(maxsize=max_pending_saves)
    self._lock = threading.Lock()
    # Keys of saves queued or being written: [jobs, a future done with the last] (`_lock`).
    self._saving: dict[ChunkHash, list] = {}
    # Tail deletes started and not yet done (`_lock`): `join` and `close` wait for them, so
    # the loop never stops with a delete half done.
    self._dropping: set[concurrent.futures.Future] = set()
    self._thread = threading.Thread(target=self._save_loop, name="kvjax-saver", daemon=True)
    self._thread.start()

  def pending(self, chunk_hash: ChunkHash) -> concurrent.futures.Future | None:
    """A future done once the last queued save of `chunk_hash` is written (or has failed), or
    None when none is queued or being written."""
    with self._lock:
      entry = self._saving.get(chunk_hash)
      return None if entry is None else entry[1]

  def pending_keys(self, hashes: Sequence[ChunkHash]) -> set[ChunkHash]:
    """Those of `hashes` whose save is queued or being written."""
    with self._lock:
      return {h for h in hashes if h in self._saving}

  def submit(self, job: SaveJob) -> bool:
    """Queues a save without blocking; returns False (and counts it) when the queue is full.
    Until it is written (or has failed), `pending` names its key."""
    with self._lock:
      entry = self._saving.setdefault(job.chunk_hash, [0, concurrent.futures.Future()])
      entry[0] += 1
    try:
      self._jobs.put_nowait(job)
      return True
    except queue.Full:
      self.stats.jobs_dropped += 1
      self._save_ended(job.chunk_hash)
      return False

  def _save_ended(self, chunk_hash: ChunkHash) -> None:
    with self._lock:
      entry = self._saving[chunk_hash]
      entry[0] -= 1
      if not entry[0]:
        del self._saving[chunk_hash]
        entry[1].set_result(None)

  def join(self) -> None:
    """Blocks until every queued save has been written (or has failed and been counted) and
    every tail delete started before has ended."""
    self._jobs.join()
    self._wait_dropping()

  def close(self) -> None:
    """Writes the queued saves, then stops the saver thread; the tail deletes started before
    end first (a delete waiting for a save is then free to run)."""
    self._jobs.put(None)
    self._thread.join()
    self._wait_dropping()

  def _wait_dropping(self) -> None:
    with self._lock:
      dropping = list(self._dropping)
    concurrent.futures.wait(dropping)  # each ends: `_drop_tail` catches its own errors

  def drop_tail(self, cache_salt: str | None, token_ids: Sequence[int]
                ) -> concurrent.futures.Future | None:
    """Deletes, in the background, the stored tail a finished session turn left (`tail_key` of
    its ids but the last sampled one) once no session will extend that turn any more (see
    `KVStoreClient.drop_tail`); a tail still being written is deleted once it is. Never
    blocks; returns the delete's future (None: no tail)."""
    s = self._scheme
    ids = [int(t) for t in token_ids]
    if not s.stores_tails or len(ids) < 2:
      return None
    ns = s.namespace(cache_salt)
    end = len(ids) - 1
    tail = s.tail_key(ns.root_hash(), keys.chunk_hashes(ns, ids, max_tokens=end), ids, end)
    if tail is None:
      return None
    future = self._loop.submit(self._drop_tail(tail[2]))
    with self._lock:
      self._dropping.add(future)
    future.add_done_callback(self._drop_ended)
    return future

  def _drop_ended(self, future: concurrent.futures.Future) -> None:
    with self._lock:
      self._dropping.discard(future)

  async def _drop_tail(self, key: ChunkHash) -> None:
    saving = self.pending(key)
    if saving is not None:  # still being written: delete it once it is
      await asyncio.shield(asyncio.wrap_future(saving))
    try:
      if await self._store.delete(key):
        self.stats.tails_dropped += 1
    except Exception as e:  # noqa: BLE001 - best effort: the tier's LRU evicts it later
      _log.warning("deleting a superseded session tail failed: %r", e)

  def _save_loop(self) -> None:
    while True:
      job = self._jobs.get()
      try:
        if job is None:
          return
        self.write(job)
        self.stats.jobs_done += 1
      except Exception as e:  # noqa: BLE001 - a failed save must not kill the saver
        self.stats.failures += 1
        _log.warning("saving KV chunks failed: %r", e)
      finally:
        if job is not None:
          self._save_ended(job.chunk_hash)
        self._jobs.task_done()

  def write(self, job: SaveJob) -> None:
    """Writes one job now, on the calling thread (the saver thread's body): copies the chunk
    (or its encoded levels) to the host in one transfer, then stores it.

    Raises:
      ValueError: a coded chunk holding NaN/inf (never stored); whatever the store raised.
    """
    s, run = self._scheme, self._loop.run
    host = self._device.get(job.kv if job.payloads is None else job.payloads)
    if job.payloads is None:
      put = lambda: self._store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                    np.asarray(host), origin=s.origin)
    else:
      encoded = []
      for codec, level, arrays, finite in host:
        if not bool(finite):
          raise ValueError(f"KV chunk holds NaN/inf (or values beyond the {codec} codec's "
                           "range); refusing to store it")
        encoded.append(EncodedPayload(codec, level, {k: np.asarray(v) for k, v in arrays.items()}))
      put = lambda: self._store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                    layout=s.layout, payloads=encoded, origin=s.origin)
    if job.replace:
      run(self._delete_everywhere(job.chunk_hash))
    published = run(put())
    if not published and job.verify_existing:
      got = run(self._store.get(job.chunk_hash, job.token_ids, job.namespace, s.layout,
                                promote=False, origin=s.origin))
      if isinstance(got, ChunkMiss) and got.reason is not MissReason.ABSENT:
        run(self._delete_everywhere(job.chunk_hash))
        published = run(put())
    if published:
      self.stats.chunks_saved += 1
    else:
      self.stats.chunks_already_stored += 1

  async def _delete_everywhere(self, chunk_hash: ChunkHash) -> None:
    # Through the store, not tier by tier: its planner must forget the copies too, or the put
    # after it finds the chunk "held" and writes nothing (a corrupt chunk never healed).
    await self._store.delete(chunk_hash)
