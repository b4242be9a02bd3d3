"""Transfer policies: how far loads run ahead, which chunks are saved, when landed chunks wait.

Plain functions over the scheduler's records (a request's `CakeMerge` and `StoredPrefix`, token
counts); the `Scheduler` (`kvjax/scheduler/scheduler.py`) owns those and applies the answers.

Loads are issued ahead, as a queue: the executor runs each request's reads a few at a time and
starts the next the moment one lands, so a long step never idles the link. How far ahead is the
link's bandwidth-delay product, where the delay is the time until the next chance to issue (one
step) plus the link's latency (`loads_ahead`; reads at once: `reads_at_once`).
"""

from __future__ import annotations

import math

from kvjax.scheduler.cake import CakeMerge
from kvjax.scheduler.cake_state import ChunkState, MergeMode
from kvjax.scheduler.output import SaveItem, StoredPrefix


def loads_ahead(bandwidth_bytes_per_s: float, step_s: float, latency_s: float,
                chunk_nbytes: int, staging_bytes: int) -> int:
  """Loads to keep issued per request: the link's bandwidth-delay product in chunks.

  The delay is how long the link must stay busy without the scheduler: one step (the scheduler
  issues between steps) plus the link's latency. At least 2 (one moving, one queued), at most
  what the staging budget holds.
  """
  if chunk_nbytes <= 0 or not math.isfinite(bandwidth_bytes_per_s):
    return max(2, staging_bytes // max(1, chunk_nbytes))
  bdp = bandwidth_bytes_per_s * (step_s + latency_s) / chunk_nbytes
  return int(max(2, min(math.ceil(bdp) + 1, staging_bytes // chunk_nbytes)))


def reads_at_once(bandwidth_bytes_per_s: float, latency_s: float, chunk_nbytes: int) -> int:
  """Concurrent reads that cover the link's latency: ceil(bandwidth x latency / chunk) + 1, in
  [2, 16]."""
  if chunk_nbytes <= 0 or not math.isfinite(bandwidth_bytes_per_s):
    return 2
  return int(min(16, max(2, math.ceil(bandwidth_bytes_per_s * latency_s / chunk_nbytes) + 1)))


def largest_chunk_nbytes(stored: StoredPrefix) -> int:
  """Stored bytes of the largest encoding of any stored chunk (0 when none is stored)."""
  return max((max(c.nbytes for c in ch.candidates) for ch in stored.chunks
              if ch is not None and ch.candidates), default=0)


def defer_bytes(m: CakeMerge, stored: StoredPrefix) -> int | None:
  """Layer-wise pre-loading: the stored bytes (landed plus in flight) a request holds while its
  landed chunks wait for its other loads, or None when they must go in now (nothing landed, no
  load in flight, or compute waits at a landed chunk)."""
  states = m.states
  landed = sum(s is ChunkState.LANDED for s in states)
  if not landed or not m.in_flight:
    return None
  p, c = m.frontier, m.chunk_size
  if (m.mode is MergeMode.CAKE and p < m.prefix_tokens and p % c == 0
      and states[p // c] is ChunkState.LANDED):
    return None  # compute waits at it: it goes in now
  return (landed + len(m.in_flight)) * largest_chunk_nbytes(stored)


def decode_saves(c: int, end: int, hit_tokens: int) -> tuple[SaveItem, ...]:
  """With a store: the chunk a decode completes (`end`, the tokens computed with
  it, is a multiple of the store chunk size `c`), when no prefill step saved it: a chunk of
  generated tokens, or the one straddling the prompt's end. A chunk partly served from device
  blocks (`hit_tokens`) is saved too (the engine reads that part back from the pool); one
  wholly served from them is not."""
  j = end // c - 1
  if (j + 1) * c <= hit_tokens:
    return ()
  return (SaveItem(j),)


def saves(c: int, start: int, n: int, hit_tokens: int, num_prefill_tokens: int,
          stored: StoredPrefix | None, rejected: set[int]) -> tuple[SaveItem, ...]:
  """Store chunks (of `c` tokens) the step `[start, start + n)` completes that the store should
  get: chunks no tier holds, chunks whose stored copy was rejected (`rejected`), and (after a
  rejection) computed hits, checked. Loaded chunks are never saved back, nor chunks wholly
  within the device hit (`hit_tokens`) or past the prefill (`num_prefill_tokens`). `stored`: the
  request's store lookup (None without a merge)."""
  end = start + n
  out = []
  for j in range(start // c, end // c):
    if (j + 1) * c > end or (j + 1) * c <= start:
      continue
    if (j + 1) * c <= hit_tokens or (j + 1) * c > num_prefill_tokens:
      continue  # wholly a device hit (stored when it was computed), or past the prefill
    if stored is None or j >= len(stored.chunks) or stored.is_tail(j):
      out.append(SaveItem(j))  # not stored (a stored tail is not its full chunk)
    elif j in rejected:
      out.append(SaveItem(j, replace=True))
    elif stored.chunks[j] is None:
      out.append(SaveItem(j))
    elif rejected:
      out.append(SaveItem(j, verify_existing=True))
  # A chunk beyond the lookup's candidates (the prompt's last full chunk holds the last
  # token): saved like any computed chunk.
  return tuple(out)
