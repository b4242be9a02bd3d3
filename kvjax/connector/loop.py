"""The connector's event loop: one thread running the store's coroutines.

The store (`kvjax.storage.TieredStore`) is asyncio code; the engine, the saver and the session
registry are plain threads. `StoreLoop` owns the loop and its thread; every other part of the
connector runs store coroutines through it (`run` blocks the caller, `submit` does not).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine


class StoreLoop:
  """An asyncio event loop on its own daemon thread ("kvjax-store-loop").

  Owns: the loop and its thread. Called from any thread; `call_soon` callbacks and submitted
  coroutines run on the loop thread.

  Args:
    timeout_s: bound on one blocking `run`, seconds.
  """

  def __init__(self, timeout_s: float = 60.0):
    self.timeout_s = timeout_s
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, name="kvjax-store-loop",
                                    daemon=True)
    self._thread.start()

  def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
    """Runs `coro` on the loop and blocks for its result (at most `timeout_s`, default the
    loop's bound).

    Raises:
      TimeoutError: it did not finish in time; whatever `coro` raised.
    """
    return self.submit(coro).result(timeout_s or self.timeout_s)

  def submit(self, coro: Coroutine) -> concurrent.futures.Future:
    """Starts `coro` on the loop; returns its future without waiting."""
    return asyncio.run_coroutine_threadsafe(coro, self.loop)

  def call_soon(self, fn: Callable[[], Any]) -> None:
    """Runs `fn()` on the loop thread, soon."""
    self.loop.call_soon_threadsafe(fn)

  def stop(self) -> None:
    """Stops the loop and joins its thread."""
    self.loop.call_soon_threadsafe(self.loop.stop)
    self._thread.join()
