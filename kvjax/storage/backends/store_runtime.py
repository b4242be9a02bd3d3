"""What every chunk store shares at run time: its counters, the byte limiter on data in
flight (orbax `serialization/limits.py`), the tensorstore context resources, and the one
background event loop behind the `*_sync` calls (`run_sync`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import threading
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from kvjax.storage.format.types import MissReason

_T = TypeVar("_T")


class Limiter(Protocol):
  """A link emulator: `acquire(nbytes)` returns when `nbytes` may pass."""

  async def acquire(self, nbytes: int) -> None:
    ...


def default_context_spec() -> dict[str, Any]:
  """Context resources of a store: a cache pool and concurrency limits."""
  return {
      "cache_pool": {"total_bytes_limit": 64 << 20},
      "data_copy_concurrency": {"limit": max(1, os.cpu_count() or 1)},
      "file_io_concurrency": {"limit": 64},
  }


@dataclasses.dataclass
class StoreStats:
  """Counters of one store; mutate through the store, read with `snapshot()`.

  Attributes:
    hits: verified reads.
    misses_by_reason: misses per `MissReason`.
    bytes_read: value bytes of verified reads.
    bytes_written: value bytes of published puts.
    puts: published puts.
    put_conflicts: puts that found the record already present (lost the race or came late).
    put_failures: puts that failed on a backend error (no record published).
    ranged_reads: reads of a layer range `[k, L)` that read those layers' bytes alone.
    ranged_whole_reads: reads of a layer range of a record without layer checksums (record
      format 1 or 2): read and verified whole, then sliced (correct, not cheaper).
  """

  hits: int = 0
  misses_by_reason: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  bytes_read: int = 0
  bytes_written: int = 0
  puts: int = 0
  put_conflicts: int = 0
  put_failures: int = 0
  ranged_reads: int = 0
  ranged_whole_reads: int = 0
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                            compare=False)

  def add(self, **deltas: int) -> None:
    with self._lock:
      for k, v in deltas.items():
        setattr(self, k, getattr(self, k) + v)

  def miss(self, reason: MissReason) -> None:
    with self._lock:
      self.misses_by_reason[reason] += 1

  def snapshot(self) -> dict[str, Any]:
    """A consistent copy; `misses_by_reason` maps reason values (str) to counts."""
    with self._lock:
      return {
          "hits": self.hits,
          "misses_by_reason": {r.value: n for r, n in self.misses_by_reason.items()},
          "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
          "puts": self.puts, "put_conflicts": self.put_conflicts,
          "put_failures": self.put_failures, "ranged_reads": self.ranged_reads,
          "ranged_whole_reads": self.ranged_whole_reads,
      }


class _Waiter:
  __slots__ = ("nbytes", "loop", "future", "granted")

  def __init__(self, nbytes: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    self.nbytes, self.loop, self.future, self.granted = nbytes, loop, future, False


class ByteLimiter:
  """Bounds bytes in flight, FIFO; usable from several event loops and threads at once.

  A request larger than the limit is clamped to it, so it runs alone instead of never.
  """

  def __init__(self, max_bytes: int):
    if max_bytes <= 0:
      raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    self._max = max_bytes
    self._used = 0
    self._lock = threading.Lock()
    self._waiters: collections.deque[_Waiter] = collections.deque()

  @property
  def in_use(self) -> int:
    return self._used

  async def acquire(self, nbytes: int) -> None:
    n = min(max(0, nbytes), self._max)
    with self._lock:
      if not self._waiters and self._used + n <= self._max:
        self._used += n
        return
      loop = asyncio.get_running_loop()
      waiter = _Waiter(n, loop, loop.create_future())
      self._waiters.append(waiter)
    try:
      await waiter.future
    except asyncio.CancelledError:
      with self._lock:
        granted = waiter.granted
        if not granted:
          self._waiters.remove(waiter)
      if granted:
        self.release(n)
      raise

  def release(self, nbytes: int) -> None:
    n = min(max(0, nbytes), self._max)
    with self._lock:
      self._used -= n
      while self._waiters and self._used + self._waiters[0].nbytes <= self._max:
        w = self._waiters.popleft()
        w.granted = True
        self._used += w.nbytes
        w.loop.call_soon_threadsafe(_resolve, w.future)

  @contextlib.asynccontextmanager
  async def hold(self, nbytes: int):
    await self.acquire(nbytes)
    try:
      yield
    finally:
      self.release(nbytes)


def _resolve(future: asyncio.Future) -> None:
  if not future.done():
    future.set_result(None)


_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
  """The module's one background event loop (started on first use, daemon thread)."""
  global _loop, _loop_thread
  with _loop_lock:
    if _loop is None or _loop_thread is None or not _loop_thread.is_alive():
      loop = asyncio.new_event_loop()
      thread = threading.Thread(target=loop.run_forever, name="kvjax-chunk-store", daemon=True)
      thread.start()
      _loop, _loop_thread = loop, thread
    return _loop


def run_sync(coro: Awaitable[_T]) -> _T:
  """Runs a coroutine on the background loop and waits for it (from any thread but that loop's).

  Raises:
    RuntimeError: called from the background loop's own thread (it would deadlock).
  """
  loop = _background_loop()
  if threading.current_thread() is _loop_thread:
    if asyncio.iscoroutine(coro):
      coro.close()
    raise RuntimeError("sync store call from the store's own event loop; await the async API")
  return asyncio.run_coroutine_threadsafe(coro, loop).result()
