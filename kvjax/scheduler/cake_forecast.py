"""A Cake merge's forecasts: when loads land, when they turn late, what compute costs.

Plain functions over a merge's state (`kvjax/scheduler/cake_state.py`) and the cost model; the
`CakeMerge` (`kvjax/scheduler/cake.py`) owns the state and decides with these predictions which
chunk to load and which positions to compute (Cake, arXiv 2410.03065, section 4 and Appendix A).
Time is the engine clock in seconds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from kvjax.scheduler.cake_state import ChunkState, LoadInFlight
from kvjax.scheduler.cost_model import CostModel


def ideal_merge_s(compute_prefix_s: Sequence[float],
                  load_top_s: Sequence[float]) -> tuple[float, int]:
  """The ideal bound `min over m of max(C(m), L(N - m))` and its best split `m`.

  Cake, arXiv 2410.03065, section 4: computing the first `m` chunks and loading the last `N - m`
  in parallel finishes at `max(C(m), L(N - m))`; no schedule of the same work beats the best `m`.

  Args:
    compute_prefix_s: `C(m)` for m = 0..N: seconds to compute the first m chunks (C(0) = 0).
    load_top_s: `L(k)` for k = 0..N: seconds to load the last k chunks (L(0) = 0).

  Returns:
    (seconds, m); the smallest m among ties.

  Raises:
    ValueError: if the two sequences differ in length or are empty.
  """
  if not compute_prefix_s or len(compute_prefix_s) != len(load_top_s):
    raise ValueError(f"need C(0..N) and L(0..N) of equal length, got {len(compute_prefix_s)} and "
                     f"{len(load_top_s)}")
  n = len(compute_prefix_s) - 1
  return min((max(compute_prefix_s[m], load_top_s[n - m]), m) for m in range(n + 1))


def span_s(start: int, end: int, step: int, cost: CostModel) -> float:
  """Cost-model seconds to compute `[start, end)` in steps of `step` tokens."""
  total, s = 0.0, start
  while s < end:
    k = min(step, end - s)
    total += cost.predict_compute_s(s, k)
    s += k
  return total


def late_at_s(in_flight: Mapping[int, LoadInFlight], last_landing_s: float, late_factor: float,
              share: float, chunk_size: int, prefix_tokens: int,
              cost: CostModel) -> dict[int, float]:
  """When each in-flight load turns late: `late_factor` times its latency as the current model
  predicts it (link in issue order, busy until the last landing), counted from when the link
  would start it (a load queued behind others is not late for waiting its turn), and at least
  the compute time of its chunk (at compute share `share`) after its predicted landing.

  The second bound is the ski-rental rule: giving up on a load costs computing its chunk, so
  compute waits for an overdue load as long as that computation would take, never more (at most
  twice the better choice in hindsight). A per-chunk latency of milliseconds against compute
  steps of a second must not make jitter of a millisecond hand a chunk to compute.

  Args:
    in_flight: chunk -> its load, in issue order.
    last_landing_s: when the last load landed (-inf: none yet).
    late_factor: `CakeMerge`'s `late_factor`.
    share: the merge's compute share of a step's wall time, in (0, 1].
    chunk_size: C, tokens per chunk.
    prefix_tokens: the prefix's end (a stored tail's unit ends there).
    cost: the engine's cost model.
  """
  out = {}
  xfer_end, dec_end = last_landing_s, -math.inf
  c = chunk_size
  for j, ld in in_flight.items():
    xfer_start = max(ld.issue_s, xfer_end)
    xfer_end = xfer_start + cost.transfer_s_per_byte * ld.nbytes
    dec_end = max(xfer_end, dec_end) + cost.decode_s_per_byte * ld.nbytes
    grace_s = cost.predict_compute_s(j * c, min((j + 1) * c, prefix_tokens) - j * c) / share
    out[j] = max(xfer_start + late_factor * (dec_end - xfer_start), dec_end + grace_s)
  return out


def free_slots(max_loads_in_flight: int, num_in_flight: int,
               states: Sequence[ChunkState]) -> int:
  """Free issue slots `landings` heaps: the slots `max_loads_in_flight` leaves beside the loads
  in flight, never more than the stored chunks left to issue (`ChunkState.HIT`).

  Each chunk left to issue takes one slot, and a slot it frees lands no earlier than now, so
  more free slots forecast the same landings; without the bound a large `max_loads_in_flight`
  (staging bytes over a small chunk: millions) cost seconds a step in building the heap.

  Args:
    max_loads_in_flight: `CakeMerge.max_loads_in_flight`, >= 1 (may be huge).
    num_in_flight: loads issued and not yet finished.
    states: each chunk's state, in chunk order.

  Returns:
    min(max(0, max_loads_in_flight - num_in_flight), number of HIT chunks).
  """
  to_issue = sum(1 for st in states if st is ChunkState.HIT)
  return min(max(0, max_loads_in_flight - num_in_flight), to_issue)


def landings(now_s: float, cost: CostModel, in_flight: Mapping[int, LoadInFlight],
             last_landing_s: float, max_loads_in_flight: int, states: Sequence[ChunkState],
             nbytes: Sequence[int], link_free_s: float = -math.inf
             ) -> tuple[dict[int, float], dict[int, float]]:
  """Predicted landing and transfer-start times of in-flight loads and of stored chunks.

  Model: the link moves one chunk at a time in issue order (transfer = nbytes / bandwidth); one
  decoder follows in the same order; a chunk lands when decoded; a new load is issued when one
  of `max_loads_in_flight` slots frees, highest chunk first; loads in flight started moving no
  earlier than the last landing. The oldest load in flight bounds the bandwidth (a censored
  observation: it has moved at most its bytes since it started); overdue loads are assumed to
  land now. A stored chunk (`ChunkState.HIT`) is costed at `nbytes[j]`, its smallest encoding,
  and starts moving no earlier than `link_free_s` (joint planning: when the shared link is free
  of the loads of the requests ahead; -inf alone).

  Returns:
    (chunk -> landing time, chunk -> transfer start), seconds.
  """
  land: dict[int, float] = {}
  start: dict[int, float] = {}
  tpb, dpb = cost.transfer_s_per_byte, cost.decode_s_per_byte
  if in_flight:
    head = next(iter(in_flight.values()))
    since = max(head.issue_s, last_landing_s)
    if head.nbytes > 0 and now_s > since:
      tpb = max(tpb, (now_s - since - dpb * head.nbytes) / head.nbytes)
  # The link was busy with earlier loads until the last one landed.
  xfer_end, dec_end = last_landing_s, -math.inf
  slots = []
  for j, ld in in_flight.items():
    xs = max(ld.issue_s, xfer_end)
    xfer_end = xs + tpb * ld.nbytes
    dec_end = max(xfer_end, dec_end) + dpb * ld.nbytes
    land[j], start[j] = max(dec_end, now_s), xs
    slots.append(land[j])
  slots += [now_s] * free_slots(max_loads_in_flight, len(in_flight), states)
  heapq.heapify(slots)
  for j in reversed(range(len(states))):
    if states[j] is not ChunkState.HIT:
      continue
    n = nbytes[j]
    issue = heapq.heappop(slots)
    xs = max(issue, xfer_end, now_s, link_free_s)
    xfer_end = xs + tpb * n
    dec_end = max(xfer_end, dec_end) + dpb * n
    land[j], start[j] = dec_end, xs
    heapq.heappush(slots, dec_end)
  return land, start




def split_at(compute_s: Sequence[float], load_s: Sequence[float], suffix_s: float,
             compute_free_s: float, link_free_s: float) -> tuple[float, int, float, float]:
  """A merge's best meeting point given when compute and the link are free for it.

  Cake's split (arXiv 2410.03065, section 4) started late on either side: compute takes the
  units below `m` (front to back), the link loads the loadable units from `m` up, and compute
  then owes what no load can spare above `m` (holes) and the suffix:
  `max(compute_free_s + F(m), link_free_s + L(m)) + A(m)`. With `compute_free_s = link_free_s
  = now` it is the merge's ideal bound alone.

  Args:
    compute_s: per prefix unit left (from the compute frontier's up), seconds to compute it (0
      for a unit resident or landed).
    load_s: per unit, seconds it holds the link if loaded (0 for one resident or landed);
      `math.inf` where it cannot load (a hole, or the unit compute has begun).
    suffix_s: seconds to compute the suffix once the prefix is present.
    compute_free_s: when compute is free for this merge (engine clock, seconds).
    link_free_s: when the link is free for this merge's loads (engine clock, seconds).

  Returns:
    (finish, m, link busy until, compute seconds taken) of the best split; the smallest m
    among ties.

  Raises:
    ValueError: if `compute_s` and `load_s` differ in length.
  """
  u = len(compute_s)
  if len(load_s) != u:
    raise ValueError(f"{u} compute and {len(load_s)} load seconds: one of each per unit")
  load_top = [0.0] * (u + 1)  # L(m): the link's seconds for the loadable units from m up
  owed_top = [suffix_s] * (u + 1)  # A(m): compute owed from m up whatever loads
  for j in reversed(range(u)):
    loadable = math.isfinite(load_s[j])
    load_top[j] = load_top[j + 1] + (load_s[j] if loadable else 0.0)
    owed_top[j] = owed_top[j + 1] + (0.0 if loadable else compute_s[j])
  best, front = None, 0.0
  for m in range(u + 1):
    link_until = link_free_s + load_top[m]
    finish = max(compute_free_s + front, link_until) + owed_top[m]
    if best is None or finish < best[0]:
      best = (finish, m, link_until, front + owed_top[m])
    if m < u:
      front += compute_s[m]
  return best
