"""Link emulation: a token-bucket limiter on one tier's reads (`docs/design/storage-format.md`).

Benchmarks reproduce the papers' links (7-100 Gbps on a GPU, Cake arXiv 2410.03065 section 6;
CacheGen arXiv 2310.07240 section 7) and their fluctuations by pacing every read of a tier through
one `LinkLimiter`. The rate is a constant or a trace of steps `(t_s, bytes_per_s)`, with `t_s`
relative to the limiter's start; the last step's rate holds forever.

Architecture: the link is one serial pipe. A request reserves the pipe from
`max(now, tail)` (tail: when everything granted before it is through) until the area under the
rate curve reaches its size, then sleeps until that finish time. Reservations are made in call
order under a lock, so waiting is FIFO across coroutines and threads alike, and a request of any
size is paced across the rate steps it spans (in effect split into the pieces each step carries):

    bytes/s
      ^          ____________
      |_________|            |_______       rate trace
      |
      +---[=====A=====][===B===][==C==]---> t       A, B, C called at about the same time
          now       A done    B done  C done

An optional burst allowance (`burst_bytes`, the bucket's depth) fills while the pipe idles and is
spent before pacing; the default 0 makes the link a pure pipe, so a transfer of n bytes at r bytes/s
takes exactly n / r seconds.

Clock and sleep are injectable so tests run on a fake clock and never really sleep.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

#: Separators allowed between the two fields of a trace line.
_FIELD_SEP = re.compile(r"[\s,]+")


def gbps(x: float) -> float:
  """Returns the bytes/s of a link of `x` gigabits/s (10^9 bits), e.g. `gbps(100) == 12.5e9`."""
  return x * 1e9 / 8


def mbps(x: float) -> float:
  """Returns the bytes/s of a link of `x` megabits/s (10^6 bits), e.g. `mbps(8) == 1e6`."""
  return x * 1e6 / 8


def validate_trace(trace: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
  """Checks a rate trace and returns it as a tuple of `(t_s, bytes_per_s)` floats.

  Args:
    trace: steps `(t_s, bytes_per_s)`: `t_s` seconds since the limiter's start, strictly
      increasing and starting at 0; `bytes_per_s` >= 0 (0: the link is down; `inf`: unlimited
      during that step); the last rate holds forever and must be positive.

  Returns:
    The validated steps.

  Raises:
    ValueError: an empty trace, a first step not at 0, times not strictly increasing or not
      finite, a negative or NaN rate, or a last rate of 0 (a transfer would never end).
  """
  steps = tuple((float(t), float(r)) for t, r in trace)
  if not steps:
    raise ValueError("a link trace needs at least one step")
  if steps[0][0] != 0.0:
    raise ValueError(f"a link trace must start at t=0 s, got {steps[0][0]}")
  for i, (t, r) in enumerate(steps):
    if not math.isfinite(t):
      raise ValueError(f"trace step {i}: time {t} is not finite")
    if i and t <= steps[i - 1][0]:
      raise ValueError(f"trace step {i}: time {t} s is not after {steps[i - 1][0]} s")
    if math.isnan(r) or r < 0:
      raise ValueError(f"trace step {i}: rate {r} bytes/s must be >= 0")
  if steps[-1][1] == 0:
    raise ValueError("the last step of a link trace holds forever and must have a positive rate")
  return steps


def load_trace(path: str | os.PathLike) -> tuple[tuple[float, float], ...]:
  """Reads a rate trace file.

  One step a line: `seconds bytes_per_s`, separated by whitespace or a comma. `#` starts a
  comment; blank lines are skipped. Example:

      # t_s, bytes_per_s
      0    3.125e9    # 25 Gbps
      2.5  8.75e8     # 7 Gbps from 2.5 s on

  Args:
    path: the trace file.

  Returns:
    The validated steps (see `validate_trace`).

  Raises:
    OSError: the file cannot be read.
    ValueError: a line without exactly two numbers (the message names the line), or a trace that
      `validate_trace` rejects.
  """
  steps = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      text = line.split("#", 1)[0].strip()
      if not text:
        continue
      fields = [x for x in _FIELD_SEP.split(text) if x]
      try:
        if len(fields) != 2:
          raise ValueError(f"want 2 fields, got {len(fields)}")
        t, r = float(fields[0]), float(fields[1])
      except ValueError as e:
        raise ValueError(f"{path}:{lineno}: bad trace line {line.rstrip()!r} ({e}); want "
                         "'seconds bytes_per_s'") from None
      steps.append((t, r))
  try:
    return validate_trace(steps)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def _steps(bytes_per_s: float | None,
           trace: Sequence[tuple[float, float]] | None) -> tuple[tuple[float, float], ...]:
  """The rate steps of a constant rate or a trace (validated); see `LinkLimiter`."""
  if trace is not None and bytes_per_s is not None:
    raise ValueError("give either bytes_per_s or trace, not both")
  if trace is not None:
    return validate_trace(trace)
  rate = math.inf if bytes_per_s is None else float(bytes_per_s)
  if math.isnan(rate) or rate <= 0:
    raise ValueError(f"bytes_per_s must be positive (or None for unlimited), got {bytes_per_s}")
  return ((0.0, rate),)


class LinkLimiter:
  """A token-bucket limiter shared by all reads of one tier.

  Attributes:
    bytes_granted: bytes of all `acquire` calls that have returned.
    unlimited: True when no step of the rate limits (no waiting ever).
    burst_bytes: depth of the bucket (bytes granted at once after an idle spell).
  """

  def __init__(self, bytes_per_s: float | None = None, *,
               trace: Sequence[tuple[float, float]] | None = None,
               burst_bytes: int = 0,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
               blocking_sleep: Callable[[float], object] = time.sleep,
               start_s: float | None = None):
    """Creates a limiter.

    Args:
      bytes_per_s: constant rate, bytes/s; None or `inf` for an unlimited link.
      trace: rate steps instead of a constant (see `validate_trace`, `load_trace`).
      burst_bytes: bucket depth, bytes; full at the start.
      clock: monotonic clock, seconds.
      sleep: async sleep, seconds (for `acquire`).
      blocking_sleep: blocking sleep, seconds (for `acquire_blocking`).
      start_s: clock time at which the trace starts; default: now.

    Raises:
      ValueError: both or a bad `bytes_per_s` (<= 0 or NaN) and `trace`, a bad trace, or a
        negative `burst_bytes`.
    """
    steps = _steps(bytes_per_s, trace)
    if burst_bytes < 0:
      raise ValueError(f"burst_bytes must be >= 0, got {burst_bytes}")
    self.burst_bytes = int(burst_bytes)
    self._clock = clock
    self._sleep = sleep
    self._blocking_sleep = blocking_sleep
    self._lock = threading.Lock()
    self.bytes_granted = 0
    self._arm(steps, start_s)

  def _arm(self, steps: tuple[tuple[float, float], ...], start_s: float | None) -> None:
    self._times = [t for t, _ in steps]
    self._rates = [r for _, r in steps]
    self.unlimited = all(r == math.inf for r in self._rates)
    self._t0 = self._clock() if start_s is None else float(start_s)
    self._tail = self._t0          # clock time at which the pipe is free
    self._credit = float(self.burst_bytes)

  def reset(self, bytes_per_s: float | None = None, *,
            trace: Sequence[tuple[float, float]] | None = None,
            start_s: float | None = None) -> None:
    """Re-arms the link with a new constant rate or trace, starting now (or at `start_s`).

    Reservations made before are forgotten (the pipe is free from the new start and the bucket
    is full); `bytes_granted` keeps counting. Benchmarks re-arm a store's link between runs, e.g.
    to sweep bandwidths on one engine or to start a trace at a request's arrival.

    Args:
      bytes_per_s: constant rate, bytes/s; None (and no trace) or `inf` for an unlimited link.
      trace: rate steps instead of a constant (see `validate_trace`).
      start_s: clock time at which the trace starts; default: now.

    Raises:
      ValueError: as the constructor, for a bad rate or trace or both given.
    """
    steps = _steps(bytes_per_s, trace)
    with self._lock:
      self._arm(steps, start_s)

  @property
  def trace(self) -> tuple[tuple[float, float], ...]:
    """The rate steps `(t_s, bytes_per_s)`, relative to the start."""
    return tuple(zip(self._times, self._rates))

  def current_rate(self, t: float | None = None) -> float:
    """Returns the link rate, bytes/s, at clock time `t` (default: now)."""
    rel = (self._clock() if t is None else t) - self._t0
    return self._rates[max(bisect.bisect_right(self._times, rel) - 1, 0)]

  def transfer_time(self, nbytes: int, start_s: float | None = None) -> float:
    """Returns the seconds `nbytes` take from clock time `start_s` on an idle link (no burst)."""
    start = self._clock() if start_s is None else start_s
    return self._finish_time(start, nbytes) - start

  def _finish_time(self, start: float, nbytes: float) -> float:
    """Clock time at which `nbytes` sent from `start` are through."""
    if nbytes <= 0:
      return start
    t = start - self._t0
    i = max(bisect.bisect_right(self._times, t) - 1, 0)
    remaining = float(nbytes)
    while True:
      rate = self._rates[i]
      end = self._times[i + 1] if i + 1 < len(self._times) else math.inf
      if rate == math.inf:
        return self._t0 + t
      if rate > 0:
        carried = rate * (end - t)
        if carried >= remaining:
          return self._t0 + t + remaining / rate
        remaining -= carried
      t, i = end, i + 1

  def _bytes_between(self, a: float, b: float) -> float:
    """Bytes the link carries between clock times `a` <= `b`."""
    total, t = 0.0, a - self._t0
    b_rel = b - self._t0
    i = max(bisect.bisect_right(self._times, t) - 1, 0)
    while t < b_rel:
      end = min(self._times[i + 1] if i + 1 < len(self._times) else math.inf, b_rel)
      if self._rates[i] > 0:
        total += self._rates[i] * (end - t)
      t, i = end, i + 1
    return total

  def reserve(self, nbytes: int) -> float:
    """Books the pipe for `nbytes` now, after everything booked before, without waiting: a
    copy queued on a copy engine (pieces booked back to back keep the pipe busy, whatever the
    caller does between them). `acquire` and `acquire_blocking` book and wait; a caller that
    books ahead waits with `wait_reserved`.

    Returns:
      The clock time, seconds, at which the bytes are through.

    Raises:
      ValueError: `nbytes` < 0.
    """
    if nbytes < 0:
      raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    with self._lock:
      now = self._clock()
      if self.unlimited or nbytes == 0:
        return now
      if now > self._tail:  # idle since tail: the bucket refills, the pipe is free from now
        if self.burst_bytes:
          self._credit = min(float(self.burst_bytes),
                             self._credit + self._bytes_between(self._tail, now))
        self._tail = now
      take = min(self._credit, float(nbytes))
      self._credit -= take
      self._tail = self._finish_time(self._tail, nbytes - take)
      return self._tail

  def _granted(self, nbytes: int) -> None:
    with self._lock:
      self.bytes_granted += nbytes

  async def acquire(self, nbytes: int) -> None:
    """Waits until `nbytes` have been granted at the link's rate, after earlier callers.

    A cancelled waiter keeps its reservation: the link time it booked is spent anyway.

    Args:
      nbytes: bytes about to be read.

    Raises:
      ValueError: `nbytes` < 0.
    """
    done = self.reserve(nbytes)
    delay = done - self._clock()
    if delay > 0:
      await self._sleep(delay)
    self._granted(nbytes)

  def acquire_blocking(self, nbytes: int) -> None:
    """Like `acquire`, for threads: blocks the calling thread.

    Raises:
      ValueError: `nbytes` < 0.
    """
    self.wait_reserved(self.reserve(nbytes), nbytes)

  def wait_reserved(self, done_s: float, nbytes: int) -> None:
    """Blocks the calling thread until `done_s` (a `reserve` result for `nbytes` bytes), then
    counts them granted."""
    delay = done_s - self._clock()
    if delay > 0:
      self._blocking_sleep(delay)
    self._granted(nbytes)

  def __repr__(self) -> str:
    if self.unlimited:
      return "LinkLimiter(unlimited)"
    if len(self._rates) == 1:
      return f"LinkLimiter({self._rates[0]:.4g} bytes/s)"
    return f"LinkLimiter(trace of {len(self._rates)} steps)"
