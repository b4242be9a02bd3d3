"""Prefill policies: how a step's token budget is shared among prefills (plain functions).

The `Scheduler` (`kvjax/scheduler/scheduler.py`) owns every request and applies these rules in
`schedule`; the functions here read only what it hands them (token counts, request records in
queue order, predicted times) and keep no state but rule c's run (`LandingWait`, owned by the
scheduler).

Prefill order (`SchedulerConfig.prefill_order`, `prefill_order`): "shortest_first" (default),
fewest tokens left first, among ordinary prefills, merges whose stored chunks are all resident
(a hit with only its new tokens left), and the queue's first ordinary requests with fewer tokens
left than the longest of those, counted past their device-resident prefix (a device prefix-cache
hit's new tokens), admitted at their turn when a slot, the pool and the budget allow (queued
requests never pass each other); "fcfs", ordinary prefills oldest first.

Short first-token steps (`SchedulerConfig.short_first_token_steps`, with "shortest_first"): a
request's first token comes at the end of the step that computes its prompt's last token, so
that step's length is part of its TTFT, and so is the length of every step its loads wait out.
Three rules keep those steps short:

  a. once a prefill planned in the order above ends its prompt, the rest of the step takes at
     most as many tokens again as the step holds so far (its decodes and prefill tokens, the
     ended prompt's included), at least the smallest chunk size: a hit's 46-token tail rides
     with 32 tokens of a cold prompt, not with 466 (on the 2-core CPU at a 1.8K-token context,
     a step of 0.7 s instead of 2.2 s). The same for the queue: a long prompt admitted first
     come first served (it does not end within the step) leaves room for the short prompts
     queued right behind it that end within the step (`room_behind`; at least the smallest
     chunk size its own), so they are admitted in the same step, in queue order, with their
     first tokens;
  b. while a merge with fewer tokens left once its loads are in than the longest prefill under
     way has loads to come (holding a slot, or queued within the free slots' reach), the step
     takes only what the cost model says computes before those loads are predicted to land
     (`CakeMerge.loads_land_s`; at least the smallest chunk size), so the hit is inserted the
     moment they do (`landing_cap`). A load past its predicted landing turns this off (the
     model is off for it);
  c. when a merge (holding a slot with loads to come, or heading the queue with a slot free) has
     at most the token budget left once its loads are in, and they are predicted to land within
     half the last computing step, the step computes nothing: it admits the hit, issues its
     loads, and the executor blocks until a load lands (`wait_s`); the steps after insert what
     landed and wait again, until the hit's loads are all in or half that step has passed since
     the first waiting step (`LandingWait`). The hit's tail then computes in the next step
     instead of the one after it, and the decodes and prefills under way lose at most half a
     step (on the 2-core CPU, a host-tier hit of 28 chunks landed in about 10 ms beside 0.1 s
     decode steps).

Rules a and b cut only the longer prefills, under way and among the admissions alike (`cut`): a
prefill that ends its prompt within what the step has left is short (its first token comes with
the same step; cutting it would cost it a whole step to save the others its compute), and so is
one with at most twice the tokens left of the hit a rule serves (the hit's tokens left once its
loads are in; for a, the step so far or the smallest chunk size, the larger), so two hits' tails
in one step do not split each other; short prefills are planned whole. Many short prompts at
once are thus admitted as the budget allows, not one a step (64 prompts of 40 tokens: 12 a step,
as with the rules off; `tests/unit/scheduler/admission_test.py`). A long prompt beside hits pays a
few more, smaller steps (a step's fixed cost each); a step with no hit near its first token is
whole. Both rules are bounded: the longer prefills together still advance at least the smallest
chunk size a step. Rule c is bounded by half a step per hit (a stuck or slow load cannot hold
the others longer); it uses the one link estimate the cost model has for every tier, so a
disk-tier hit predicted as fast as a host hit may cost the others that half step for nothing.

Why "shortest_first": a store hit is mostly loads; once they are in, what it has left is its new
tokens, often a few dozen. First come first served puts them behind a long cold prompt's chunked
prefill, so the hit's first token waits for that whole prompt (on the 2-core CPU replay of
`scripts/bench_sessions.py`, hits beside a cold prefill waited 7.6 s at the median against
0.94 s for the others). Fewest tokens left first is shortest-remaining-time-first, which
minimises the mean time to first token; a merge still loading keeps Cake's leftover budget, so
the meeting point still moves by itself.

A prefill chunk is the largest compiled chunk size that fits the budget and the prompt's
remaining tokens, so only a prompt's last chunk is ever padded (`chunk_tokens`):

    prompt of 300 tokens, sizes (16, 32, ..., 512):  [0 --256--)[256 -32-)[288 12+pad)

Long prefills share the step (vLLM's `long_prefill_token_threshold`, `SchedulerConfig`): with a
threshold T > 0, each request's prefill takes at most T tokens of a step (`prefill_share`), so
one long prompt leaves the rest of the budget to the prefills and merges after it in the order
above. A request whose remaining prefill is at most T is not limited by it. T = 0: off. A Cake
merge's compute side is capped the same way (its chunk planner sees the capped budget, so its
predictions of where compute meets the loads assume the capped step); in consistent mode
(whole store chunks per prefill piece) the cap is at least one store chunk.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterable, Sequence

from kvjax._typing import RequestId
from kvjax.scheduler.request import Request

#: `SchedulerConfig.prefill_order` values.
FCFS = "fcfs"
SHORTEST_FIRST = "shortest_first"
PREFILL_ORDERS = (FCFS, SHORTEST_FIRST)

#: Longest single wait for a load to land, seconds (the executor asks for a new plan after it).
MAX_LOAD_WAIT_S = 1.0


def chunk_tokens(remaining: int, budget: int, chunk_sizes: tuple[int, ...]) -> int:
  """Tokens of the next prefill chunk: the largest compiled size that fits, or a short tail.

  Returns 0 when nothing fits. A prompt tail shorter than the smallest size is taken whole (the
  runner pads it).
  """
  limit = min(remaining, budget, chunk_sizes[-1])
  if limit <= 0:
    return 0
  i = bisect.bisect_right(chunk_sizes, limit)
  if i == 0:
    return remaining if remaining == limit else 0
  return chunk_sizes[i - 1]


def prefill_share(budget: int, cap: int | None) -> int:
  """The tokens one request's prefill may take of `budget` left in this step: at most the
  long-prefill threshold `cap` (None: off; vLLM caps a request whose remaining prefill exceeds
  it; capping every request is the same, since none takes more than it has left)."""
  return budget if cap is None else min(budget, cap)


def cut(left: int, exempt: int, share: int) -> bool:
  """Whether short first-token steps' cap applies to a prefill with `left` tokens left when its
  share of the step's rest is `share` tokens (`prefill_share`): not when it is short, i.e. it
  has at most `exempt` left or it ends its prompt within its share (its first token then comes
  with the same step: cutting it would cost it a whole step to save the others its compute)."""
  return left > exempt and left > share


def shortest_first(under_way: Sequence[tuple[Request, int]],
                   queued: Iterable[tuple[Request, int | None]]) -> list[Request]:
  """The "shortest_first" prefill order: fewest tokens left first (stable: ties keep order).

  Args:
    under_way: (request, tokens left) of the prefills under way, in admission order.
    queued: (request, tokens left) of the queue's first requests within the free slots' reach,
      in queue order, None for a merge's (consumed lazily: it stops at a merge, which is
      admitted whenever a slot is free anyway, and at the first with as many tokens left as the
      longest under way, so queued requests never pass each other).

  Returns:
    The requests under way and the queued ones that go before the first-come-first-served
    admissions, in the order they take the budget.
  """
  longest = max((n for _, n in under_way), default=0)
  out = list(under_way)
  ahead = 0  # the most tokens left of a queued request ahead: none passes one ahead of it
  for r, n in queued:
    if n is None:
      break
    ahead = max(ahead, n)
    if ahead >= longest:
      break
    out.append((r, ahead))
  return [r for r, _ in sorted(out, key=lambda x: x[1])]


def room_behind(budget: int, head_left: int | None, behind: Iterable[int | None], least: int,
                cap: int | None) -> int:
  """Rule a for the queue: the tokens the queue's head leaves for the short prompts queued right
  behind it when it is long (it does not end its prompt within `budget`), so they are admitted
  in the same step, in queue order, and their first tokens come with it; 0 when it is short.

  Args:
    budget: tokens left in the step.
    head_left: the head's tokens left (`Scheduler._queued_left`), None for a merge (0 room).
    behind: the tokens left of the requests behind it within the free slots' reach, in queue
      order, None for a merge (consumed lazily: it stops at a merge or a longer one).
    least: the smallest chunk size (the head keeps at least that).
    cap: the long-prefill threshold (`prefill_share`).
  """
  if head_left is None or head_left <= prefill_share(budget, cap):
    return 0
  room = 0
  for n in behind:
    if n is None:
      break
    if n > prefill_share(budget - least - room, cap) or room + n > budget - least:
      break
    room += n
  return room


def landing_cap(hits: Iterable[tuple[int, Callable[[], float | None]]], longest: int,
                now_s: float, start: int, plan_sizes: Sequence[int],
                predict_compute_s: Callable[[int, int], float]) -> tuple[int, int] | None:
  """Rule b: (the prefill tokens this step may take so that it ends when a store hit's last
  loads are predicted to land, that hit's tokens left once they are in), or None when no hit is
  that close.

  Args:
    hits: per merge in reach (`Scheduler._hits_in_reach`), (tokens left once its loads are in,
      a call predicting when they have landed, `CakeMerge.loads_land_s`; made only for a hit
      with fewer tokens left than `longest`). The earliest landing wins.
    longest: the most tokens left of the prefills in the order (those it would wait behind).
    now_s: the step's start, seconds.
    start: the furthest position the prefills in the order have reached (costs the step).
    plan_sizes: the compiled sizes the step plans with, ascending.
    predict_compute_s: the cost model's `(start, tokens) -> seconds`.

  Returns:
    At least the smallest chunk size: the prefills under way always advance.
  """
  best = None
  for left, land_s in hits:
    if left < longest:
      t = land_s()
      if t is not None and (best is None or t < best[0]):
        best = (t, left)
  if best is None:
    return None
  seconds = best[0] - now_s
  tokens = plan_sizes[0]
  for n in plan_sizes:
    if predict_compute_s(start, n) <= seconds:
      tokens = n
  return tokens, best[1]


@dataclasses.dataclass
class LandingWait:
  """Rule c's run of waiting steps: the hit it waits for (None: no run) and when it began.

  Owned by the `Scheduler`; `until` decides each step whether the step waits.
  """

  waiting_for: RequestId | None = None
  since_s: float = 0.0

  def stop(self) -> None:
    self.waiting_for = None

  def until(self, now_s: float, half_s: float, loads_to_come: Callable[[RequestId], bool],
            hits: Callable[[], Iterable[tuple[RequestId, int, Callable[[], float | None]]]],
            token_budget: int) -> float | None:
    """When this step should compute nothing and wait for a store hit's loads, the latest time
    it waits until (engine clock, seconds), else None.

    A run of waiting steps starts for a hit in reach that has at most `token_budget` tokens left
    once its loads are in (its tail then computes in one step) and whose loads are predicted to
    land within `half_s` (half the last computing step; the earliest of such hits). The run
    waits for that hit's loads until none is left to come or `half_s` has passed since the run
    began, whichever is first. The caller stops the run (`stop`) when no run may wait (no step
    computed yet, nothing else would compute, or a preemption).

    Args:
      now_s: the step's start, seconds.
      half_s: half the last computing step, seconds.
      loads_to_come: whether a request still has stored chunks to come (False when it is gone).
      hits: the hits in reach, (request id, tokens left once its loads are in, a call
        predicting when they have landed), called only when no run is under way.
      token_budget: the configured token budget per step.
    """
    rid = self.waiting_for
    if rid is not None:  # a run under way
      deadline = self.since_s + half_s
      if now_s < deadline and loads_to_come(rid):
        return deadline
      self.waiting_for = None
      return None
    best = None
    for hit, left, land_s in hits():
      if left <= token_budget:
        t = land_s()
        if t is not None and t - now_s <= half_s and (best is None or t < best[0]):
          best = (t, hit)
    if best is None:
      return None
    self.waiting_for, self.since_s = best[1], now_s
    return now_s + half_s


@dataclasses.dataclass
class StepCap:
  """Rules a and b within one step: `cap` is what the prefills with more than `exempt` tokens
  left may still take this step (None: no cap); `rule_a` holds until the first prefill of the
  order ends its prompt. One per `Scheduler.schedule` call."""

  cap: int | None = None
  exempt: int = 0
  rule_a: bool = False

  @classmethod
  def start(cls, short: bool, landing: tuple[int, int] | None) -> StepCap:
    """The step's cap: rule b's (`landing_cap`: tokens, the hit's tokens left) if any, and rule
    a pending when `short` (short first-token steps are on)."""
    out = cls(rule_a=short)
    if landing is not None:
      out.cap, out.exempt = landing[0], 2 * landing[1]
    return out

  def offer(self, left: Callable[[], int], budget: int, share: int) -> tuple[int, bool]:
    """(the tokens a prefill may take of the `budget` left, whether the cap applies to it):
    `left()` (called only under a cap) is its tokens left, `share` its `prefill_share`."""
    capped = self.cap is not None and cut(left(), self.exempt, share)
    return (min(budget, self.cap) if capped else budget), capped

  def took(self, n: int, capped: bool) -> None:
    """A prefill offered under the cap took `n` tokens."""
    if capped:
      self.cap -= n

  def ended(self, step_tokens: int, least: int) -> None:
    """Rule a: the first prefill of the order ended its prompt (its first token comes with this
    step): the longer prefills after it take at most as many tokens again as the step holds so
    far (`step_tokens`: its decodes and prefill tokens, this one's included; at least `least`,
    the smallest chunk size); one with at most twice that left is short too and goes whole."""
    self.rule_a = False
    n = max(step_tokens, least)
    self.cap = n if self.cap is None else min(self.cap, n)
    self.exempt = max(self.exempt, 2 * n)

  def rest(self, budget: int) -> int:
    """What the merges' compute may take of the `budget` left (the step's rest)."""
    return budget if self.cap is None else min(budget, self.cap)


def wait_s(now_s: float | None, land_at: float | None, idle_with_loads: bool,
           rechecks: Iterable[float | None]) -> float | None:
  """How long the executor blocks for a load to land before the next plan, seconds (None: no
  wait): until rule c's `land_at` (`LandingWait.until`), or, for a step that plans nothing
  while loads are outstanding (`idle_with_loads`), until the earliest time a merge may go on
  without a landing (`rechecks`: `CakeMerge.recheck_s` of each merge, consumed only then); at
  most `MAX_LOAD_WAIT_S` either way."""
  if land_at is not None:
    return min(MAX_LOAD_WAIT_S, max(0.0, land_at - now_s))
  if not idle_with_loads:
    return None
  out = MAX_LOAD_WAIT_S
  for t in rechecks:
    if t is not None:
      out = min(out, max(0.0, t - now_s))
  return out
