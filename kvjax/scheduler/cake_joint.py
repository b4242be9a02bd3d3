"""Joint Cake planning: several requests restoring stored prefixes at once share one link and
one step's token budget.

Each `CakeMerge` (`kvjax/scheduler/cake.py`) plans its own meeting point from when compute and
the link are free for it. Planned alone, every merge believes it has both to itself: its loads
queue beside the others' on the link (the store client runs each request's reads at once, so
they split the bandwidth), its compute waits for landings the shared link delivers late, and
every request finishes near the last one's time. Planned jointly, the restoring requests take
both resources in one order, and each merge is told when they are free for it:

    priority   remaining_s alone = Cake's split with both sides free now
               (`cake_forecast.split_at`); key = arrival_s + remaining_s, smallest first
               (shortest remaining first for requests that arrive together; a request is
               passed only by requests whose arrival + remaining is earlier, so one that
               waits is never starved: arrivals after its key all queue behind it)
    backlog    in that order: compute_free_s = now + the compute the requests ahead take at
               their own best split; link_free_s = when the link has moved their loads
                                      link ──[ r0's top chunks ][ r1's top ][ r2's top ]──>
                                   compute ──[ r0's front ][ r1's front ][ r2's front ]──>
    merges     `CakeMerge.set_backlog(compute_free_s, link_free_s)`: each chooses its meeting
               point against its own backlog (a later request loads more of its prefix: the
               link reaches it while compute serves the ones ahead)
    loads      issued in priority order; a request's loads wait while the link's backlog ahead
               of it exceeds the issue horizon (one step and the link's latency), so the link
               serves the requests in order instead of splitting its bandwidth
    compute    the budget left to merges goes in priority order; while a merge has loads to
               come, those behind it add only what keeps the step (everything planned in it
               so far, `seconds_left_in_step`) ending before those loads are predicted to
               land (`tokens_until`), so its next piece is not held up behind their long step;
               in a step where a merge samples its first token (its last piece here, or
               its suffix among the step's prefills once its prefix is all present), those
               behind it add only what costs that token less than the step they would
               otherwise need (`beside_first_token_s`)

Plain functions over the merges' plain answers (`CakeMerge.outlook`); the `Scheduler`
(`kvjax/scheduler/scheduler.py`) owns the merges, calls `plan` once a step and applies it.
The CacheFlow paper (arXiv 2604.25080) plans batches of restoring requests jointly under
contention in the same spirit; this is a greedy list schedule, not its solver.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvjax._typing import RequestId
from kvjax.scheduler import cake_forecast
from kvjax.scheduler.cake import CakeMerge
from kvjax.scheduler.cost_model import CostModel


@dataclasses.dataclass(frozen=True)
class JointEntry:
  """One restoring request's place in the joint plan.

  Attributes:
    request_id: the request.
    key_s: its priority, arrival + remaining seconds alone (engine clock); smaller goes first.
    compute_free_s: when compute is free of the requests ahead of it (engine clock, seconds).
    link_free_s: when the link is free of their loads (engine clock, seconds).
    finish_s: its predicted prefix finish at its best split against that backlog.
    meeting_index: that split's first loaded unit (a prefix unit index; `num_chunks`: none).
  """

  request_id: RequestId
  key_s: float
  compute_free_s: float
  link_free_s: float
  finish_s: float
  meeting_index: int


def plan(restoring: Sequence[tuple[RequestId, float, CakeMerge]], now_s: float,
         cost: CostModel, share: float) -> list[JointEntry]:
  """The joint plan of the requests restoring at `now_s`, in priority order.

  Args:
    restoring: (request id, arrival seconds, its merge) per request whose merge still has a
      prefix to restore, in admission order (the tie-break).
    now_s: the step's time (engine clock, seconds).
    cost: the engine's cost model.
    share: the fraction of a step's wall time the merges' compute gets, in (0, 1]: one for
      them all (the budget they share), so the order rests on their work, not on each one's
      noisy estimate of its own share.

  Returns:
    One `JointEntry` per request, highest priority first.
  """
  keyed = []
  for pos, (rid, arrival_s, m) in enumerate(restoring):
    compute_s, load_s, suffix_s = m.outlook(cost, share)
    alone = cake_forecast.split_at(compute_s, load_s, suffix_s, now_s, now_s)
    keyed.append((arrival_s + alone[0] - now_s, arrival_s, pos, rid, m, compute_s, load_s,
                  suffix_s))
  keyed.sort(key=lambda e: e[:3])
  out = []
  compute_t = link_t = now_s
  for key_s, _, _, rid, m, compute_s, load_s, suffix_s in keyed:
    finish, split, link_until, busy = cake_forecast.split_at(compute_s, load_s, suffix_s,
                                                             compute_t, link_t)
    first = m.num_chunks - len(compute_s)
    out.append(JointEntry(rid, key_s, compute_t, link_t, finish,
                          first + split if split < len(compute_s) else m.num_chunks))
    compute_t += busy
    link_t = link_until
  return out


def beside_first_token_s(behind: int, cost: CostModel) -> float:
  """How long a compute piece of a merge behind may take in a step where a merge ahead
  finishes its prompt (it samples its first token at the step's end), in seconds.

  A piece whose marginal compute is `x` delays that first token by `x` when it joins the step.
  Run in a step of its own instead, it takes at least the step's floor `a` (the fixed cost
  `CostModel.compute_coefficients[0]`) and at least `x` (a roofline: the fixed cost overlaps
  the tokens' compute, and the cost model's `a + b n` is a line fitted through it). So the own
  step costs each of the `behind` merges `max(0, a - x)` more than joining, and the
  piece joins only while `x <= behind * (a - x)`, that is `x <= a * behind / (behind + 1)`: a
  piece's whole prediction (its own `a` included) at most `a * (2 behind + 1) / (behind + 1)`.
  Little on a machine whose step time grows with its tokens (a CPU: a few dozen tokens), most
  of a step where a step's time is mostly fixed (an accelerator at small batches).

  Args:
    behind: merges that still prefill behind the one that finishes (>= 0).
    cost: the engine's cost model.
  """
  a = cost.compute_coefficients[0]
  return a * (2 * behind + 1) / (behind + 1)


def planned_step_s(pieces: Sequence[tuple[int, int]], cost: CostModel) -> float:
  """The predicted seconds of a step holding `pieces` ((start, tokens) each: the prefill chunks
  and decodes planned so far), 0 for none: one step's fixed cost `a` and each piece's marginal
  compute (its prediction less `a`)."""
  if not pieces:
    return 0.0
  a = cost.compute_coefficients[0]
  return a + sum(max(0.0, cost.predict_compute_s(s, n) - a) for s, n in pieces)


def seconds_left_in_step(until_s: float, pieces: Sequence[tuple[int, int]],
                         cost: CostModel) -> float:
  """How long a new piece's own prediction (its `a` included) may be so that a step already
  holding `pieces` still ends within `until_s` seconds (`planned_step_s`): `until_s` for an
  empty step, else `until_s` less the step's time so far plus the one fixed cost the piece's
  prediction counts again."""
  if not pieces:
    return until_s
  return until_s - planned_step_s(pieces, cost) + cost.compute_coefficients[0]


def tokens_until(seconds: float, start: int, plan_sizes: Sequence[int],
                 predict_compute_s: Callable[[int, int], float]) -> int:
  """The largest compiled size whose compute at `start` fits in `seconds` (0 when none does):
  what a merge behind one waiting for its loads may compute in this step.

  Args:
    seconds: time until the loads ahead are predicted to land.
    start: the merge's compute frontier (costs the step).
    plan_sizes: the compiled sizes, ascending.
    predict_compute_s: the cost model's `(start, tokens) -> seconds`.
  """
  for n in reversed(plan_sizes):  # compute grows with tokens: the first that fits is the largest
    if predict_compute_s(start, n) <= seconds:
      return n
  return 0
