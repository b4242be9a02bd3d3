"""The connector's saves: a bounded queue drained by the saver thread (one device -> host copy
per chunk, then a put), and the background delete of superseded session tails."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from typing import Sequence

import numpy as np

from kvjax._typing import ChunkHash
from kvjax.connector.records import SaveJob
from kvjax.storage import keys
from kvjax.storage.types import EncodedPayload, MissReason, ChunkMiss

_log = logging.getLogger(__name__)


class SaverMixin:
  """Saves of `KVStoreClient` (`kvjax/connector/client.py` owns the state)."""

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
    host = self.device.get(job.kv if job.payloads is None else job.payloads)
    if job.payloads is None:
      put = lambda: self.store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                   np.asarray(host), origin=self.origin)
    else:
      encoded = []
      for codec, level, arrays, finite in host:
        if not bool(finite):
          raise ValueError(f"KV chunk holds NaN/inf (or values beyond the {codec} codec's "
                           "range); refusing to store it")
        encoded.append(EncodedPayload(codec, level, {k: np.asarray(v) for k, v in arrays.items()}))
      put = lambda: self.store.put(job.chunk_hash, job.parent, job.token_ids, job.namespace,
                                   layout=self.layout, payloads=encoded, origin=self.origin)
    if job.replace:
      self._run(self._delete_everywhere(job.chunk_hash))
    published = self._run(put())
    if not published and job.verify_existing:
      got = self._run(self.store.get(job.chunk_hash, job.token_ids, job.namespace, self.layout,
                                     promote=False, origin=self.origin))
      if isinstance(got, ChunkMiss) and got.reason is not MissReason.ABSENT:
        self._run(self._delete_everywhere(job.chunk_hash))
        published = self._run(put())
    if published:
      self.saver_stats.chunks_saved += 1
    else:
      self.saver_stats.chunks_already_stored += 1

  async def _delete_everywhere(self, chunk_hash: ChunkHash) -> None:
    await asyncio.gather(*(t.delete(chunk_hash) for t in self.store.tiers))

