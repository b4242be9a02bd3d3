"""One engine thread serving many asyncio handlers.

Architecture (JetStream's orchestrator, reduced to one thread). The `Engine` is not thread-safe
and owns the device, so exactly one thread calls it:

    HTTP handlers (event loop) ── submit(add) / abort(rid) ──► command queue (thread-safe)
                                                                    │
    engine thread:  idle? block on the queue ◄──────────────────────┘
                    drain commands: add_request / abort_request / call(fn)
                    while requests are unfinished: step()
                    each output ── loop.call_soon_threadsafe(queue.put_nowait) ──► that request's
                                                                      asyncio.Queue (its handler)

The thread blocks on the command queue when it has nothing to run (no polling). A fault never
ends the loop: an exception in `add_request` fails that request (its handler answers 500, or 400
for a `ValueError`), and an exception in `step` fails the requests the engine held at that
moment (their state in the step is unknown); the slot cache is rebuilt if the failed step left it
unusable, and serving goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from kvjax.engine import Engine, RequestOutput
from kvjax.merge_mode import MergeMode
from kvjax.scheduler.request import SamplingParams

_log = logging.getLogger(__name__)


class EngineFault(Exception):
  """The engine failed this request; `status` 400 for a rejected request, else 500."""

  def __init__(self, message: str, status: int = 500):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class _Sink:
  """Where one request's outputs go: an asyncio queue on the handler's event loop."""

  loop: asyncio.AbstractEventLoop
  queue: asyncio.Queue
  submitted_s: float
  first_token_s: float | None = None

  def put(self, item: Any) -> None:
    try:
      self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
    except RuntimeError:  # the handler's loop is closed (server shutting down)
      pass


@dataclasses.dataclass
class LoopStats:
  """Counters of the engine thread (read from any thread).

  Attributes:
    steps: engine steps run.
    step_failures: steps that raised.
    add_failures: `add_request` calls that raised something other than ValueError.
    aborts_requested: aborts submitted by handlers.
    aborted: aborts the engine thread carried out on unfinished requests.
    waiting: requests queued in the engine, not yet in a slot (after the last step).
    running: requests holding a slot (after the last step).
  """

  steps: int = 0
  step_failures: int = 0
  add_failures: int = 0
  aborts_requested: int = 0
  aborted: int = 0
  waiting: int = 0
  running: int = 0


_STOP = object()


class AsyncEngine:
  """Runs an `Engine` on its own thread; asyncio handlers submit requests and read outputs.

  Args:
    engine: the engine; after `start()` only the engine thread touches it.
    max_unfinished: most requests submitted and not yet finished (running plus waiting); one
      more is refused with `EngineFault` 429. None: no bound.
    on_output: called on the engine thread for every output with (output, server-side TTFT in
      seconds on the first output else None, seconds since submission), e.g. to update metrics;
      its exceptions are logged and ignored.
    on_kv_events: called on the engine thread with the device prefix cache's index changes
      (`Engine.drain_kv_events()`, a `KVCacheEvents`) after every step and every `call` that
      produced some, e.g. to publish them (`kv_events.ZmqKVEventPublisher.publish`); set it
      before `start()` and turn recording on with `Engine.set_kv_events(True)`.
  """

  def __init__(self, engine: Engine,
               on_output: Callable[[RequestOutput, float | None, float], None] | None = None,
               *, max_unfinished: int | None = None):
    self._engine = engine
    self._max_unfinished = max_unfinished
    self._unfinished = 0  # submitted, not yet finished, failed or aborted
    self._unfinished_lock = threading.Lock()
    self.on_output = on_output
    self.on_kv_events: Callable[[Any], None] | None = None
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, _Sink] = {}
    self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
    self.stats = LoopStats()
    self._stopped = threading.Event()
    self._submit_lock = threading.Lock()  # submit's stop check and enqueue vs `_stop`'s drain

  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def shutdown(self, timeout_s: float | None = 60.0) -> None:
    """Fails every unfinished request (503) and ends the thread."""
    if self._thread.is_alive():
      self._commands.put(_STOP)
      self._thread.join(timeout_s)

  # --------------------------------------------------------------------- handler side
  def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
             cache_salt: str | None = None, *, history_tokens: int = 0,
             save_tail: bool = False, merge_mode: MergeMode | str | None = None,
             fork_of: str | None = None) -> asyncio.Queue:
    """Queues a request; returns the asyncio queue its outputs arrive on. `history_tokens`,
    `save_tail` and `merge_mode` are a session turn's (`Engine.add_request`,
    `kvjax.sessions.TurnPlan.request_options`); `fork_of` (`n` > 1) names a request submitted
    before whose prompt this one shares (`Engine.add_request(fork_of=)`).

    Items are `(output, ttft_s, elapsed_s)`: a `RequestOutput` (cumulative: it holds all tokens
    so far; the last has `finished=True`), the server-side time to first token (seconds, on the
    first output only, else None) and the seconds since submission; or one `EngineFault`. Call
    from a coroutine on the handler's loop.

    Raises:
      EngineFault: 503 while shutting down; 429 when `max_unfinished` requests are unfinished.
    """
    with self._submit_lock:  # a command never lands behind the stop unanswered (`_stop`)
      return self._submit(request_id, prompt_token_ids, params, cache_salt,
                          history_tokens=history_tokens, save_tail=save_tail,
                          merge_mode=merge_mode, fork_of=fork_of)

  def _submit(self, request_id, prompt_token_ids, params, cache_salt, *, history_tokens,
              save_tail, merge_mode, fork_of) -> asyncio.Queue:
    if self._stopped.is_set():
      raise EngineFault("the server is shutting down", status=503)
    with self._unfinished_lock:
      if self._max_unfinished is not None and self._unfinished >= self._max_unfinished:
        raise EngineFault(f"the server is busy: {self._unfinished} requests are running or "
                          "waiting, its limit (--max_waiting_requests plus --max_num_seqs); "
                          "retry later", status=429)
      self._unfinished += 1
    sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
    self._commands.put(("add", request_id, list(prompt_token_ids), params, cache_salt,
                        {"history_tokens": history_tokens, "save_tail": save_tail,
                         "merge_mode": merge_mode, "fork_of": fork_of}, sink))
    return sink.queue

  def abort(self, request_id: str) -> None:
    """Asks the engine thread to end a request and free its slot (no more outputs)."""
    self.stats.aborts_requested += 1
    self._commands.put(("abort", request_id))

  async def call(self, fn: Callable[[Engine], Any]) -> Any:
    """Runs `fn(engine)` on the engine thread between steps; returns its result."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def done(result, error):
      if fut.done():
        return
      if error is not None:
        fut.set_exception(error)
      else:
        fut.set_result(result)

    self._commands.put(("call", fn, lambda r, e: loop.call_soon_threadsafe(done, r, e)))
    return await fut

  # --------------------------------------------------------------------- engine thread
  def _run(self) -> None:
    while True:
      try:
        busy = self._engine.has_unfinished_requests()
        cmd = self._get_nowait() if busy else self._commands.get()
        while cmd is not None:
          if cmd is _STOP:
            self._stop()
            return
          self._handle(cmd)
          cmd = self._get_nowait()
        if self._engine.has_unfinished_requests():
          self._step()
      except Exception:  # noqa: BLE001 - the loop outlives any fault
        _log.exception("engine loop iteration failed; continuing")

  def _stop(self) -> None:
    """Fails every unfinished request and every command still queued behind the stop (a
    request submitted while the stop was on its way) with 503, then refuses new ones."""
    fault = EngineFault("the server is shutting down", status=503)
    with self._submit_lock:
      self._stopped.set()
      left = []
      while (cmd := self._get_nowait()) is not None:
        left.append(cmd)
    self._fail_all(fault)
    for cmd in left:
      if cmd is _STOP or cmd[0] == "abort":
        continue
      if cmd[0] == "add":
        self._release()
        cmd[-1].put(fault)
      else:  # "call"
        cmd[-1](None, fault)

  def _release(self) -> None:
    """One submitted request ended (finished, failed or aborted)."""
    with self._unfinished_lock:
      self._unfinished -= 1

  def _get_nowait(self):
    try:
      return self._commands.get_nowait()
    except queue.Empty:
      return None

  def _handle(self, cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "add":
      _, rid, ids, params, salt, options, sink = cmd
      try:
        self._engine.add_request(ids, params, request_id=rid, cache_salt=salt, **options)
      except ValueError as e:
        self._release()
        sink.put(EngineFault(str(e), status=400))
        return
      except Exception as e:  # noqa: BLE001 - fails this request only
        self._release()
        self.stats.add_failures += 1
        _log.exception("add_request(%s) failed", rid)
        sink.put(EngineFault(f"the engine failed to start this request: {e!r}"))
        return
      self._sinks[rid] = sink
    elif kind == "abort":
      rid = cmd[1]
      if self._sinks.pop(rid, None) is not None:
        self._release()
        self._engine.abort_request(rid)
        self.stats.aborted += 1
    elif kind == "call":
      _, fn, reply = cmd
      try:
        result, error = fn(self._engine), None
      except Exception as e:  # noqa: BLE001 - handed to the caller
        result, error = None, e
      self._emit_kv_events()  # e.g. a reset_prefix_cache
      reply(result, error)

  def _step(self) -> None:
    try:
      outputs = self._engine.step()
    except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
      self.stats.step_failures += 1
      _log.exception("engine step failed; failing the %d requests it held", len(self._sinks))
      self._fail_all(EngineFault(f"the engine failed while running this request: {e!r}"))
      self._repair_cache()
      return
    self.stats.steps += 1
    now = time.perf_counter()
    for out in outputs:
      sink = self._sinks.get(out.request_id)
      if sink is None:
        continue
      ttft = None
      if sink.first_token_s is None:
        sink.first_token_s = now
        ttft = now - sink.submitted_s
      if out.finished:
        del self._sinks[out.request_id]
        self._release()
      elapsed = now - sink.submitted_s
      if self.on_output is not None:
        try:
          self.on_output(out, ttft, elapsed)
        except Exception:  # noqa: BLE001 - metrics must not break serving
          _log.exception("on_output hook failed")
      sink.put((out, ttft, elapsed))
    snap = self._engine.stats()
    self.stats.waiting, self.stats.running = snap.num_waiting, snap.num_running
    self._emit_kv_events()

  def _emit_kv_events(self) -> None:
    if self.on_kv_events is None:
      return
    try:
      batch = self._engine.drain_kv_events()
      if batch is not None and batch.events:
        self.on_kv_events(batch)
    except Exception:  # noqa: BLE001 - events must not break serving
      _log.exception("publishing KV cache events failed")

  def _fail_all(self, fault: EngineFault) -> None:
    for rid, sink in list(self._sinks.items()):
      try:
        self._engine.abort_request(rid)
      except Exception:  # noqa: BLE001
        _log.exception("abort_request(%s) failed", rid)
      sink.put(fault)
      self._release()
    self._sinks.clear()
    self.stats.waiting = self.stats.running = 0

  def _repair_cache(self) -> None:
    """Rebuilds the device cache if a failed step consumed it (donated buffers)."""
    if not self._engine.stats().kv_cache_ok:
      _log.warning("the failed step left the KV cache deleted; rebuilding it")
      self._engine.reset_device()
