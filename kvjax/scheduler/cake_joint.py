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
    merges     `CakeMerge.set_backlog(compute_free_s, link_free_s, meeting_index)`: each
               chooses its meeting point against its own backlog (a later request loads more of its prefix: the
               link reaches it while compute serves the ones ahead)
    loads      issued in priority order; a request's loads wait while the link's backlog ahead
               of it exceeds the issue horizon (one step and the link's latency), so the link
               serves the requests in order instead of splitting its bandwidth
    compute    the budget left to merges goes in priority order; while a merge has loads to
               come, those behind it add only what keeps the step (everything planned in it
               so far, priced as the runner runs it: padded to its compiled bucket,
               `step_s`) ending before those loads are predicted to land, so its next piece
               is not held up behind their long step; in a step where a merge samples its
               first token (its last piece here, or its suffix among the step's prefills
               once its prefix is all present), those behind it add only what costs that
               token less than the step they would otherwise need (`added_s`,
               `beside_first_token_s`): the bucket's free room, not a bucket more;
               a merge behind others leaves no chunk at or above its planned meeting
               point part-computed (its rest would join the merge's last step)

Plain functions over the merges' plain answers (`CakeMerge.outlook`); the `Scheduler`
(`kvjax/scheduler/scheduler.py`) owns the merges, calls `plan` once a step and applies it.
The CacheFlow paper (arXiv 2604.25080) plans batches of restoring requests jointly under
contention in the same spirit; this is a greedy list schedule, not its solver.
"""

from __future__ import annotations

import bisect
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
  """How much a compute piece of a merge behind may add to a step in which a merge ahead
  finishes its prompt (it samples its first token at the step's end), in seconds.

  A piece that adds `x` to the step (`added_s`: its tokens, its attention, and any bucket the
  step grows into) delays that first token by `x` when it joins. Run in a step of its own
  instead, it takes at least the step's floor `a` (the fixed cost
  `CostModel.compute_coefficients[0]`) and at least `x` (a roofline: the fixed cost overlaps
  the tokens' compute, and the cost model's `a + b n` is a line fitted through it). So the own
  step costs each of the `behind` merges `max(0, a - x)` more than joining, and the piece
  joins only while `x <= behind * (a - x)`, that is `x <= a * behind / (behind + 1)`. Little
  on a machine whose step time grows with its tokens (a CPU: a few dozen tokens, or the free
  room of the step's padded bucket), most of a step where a step's time is mostly fixed (an
  accelerator at small batches).

  With the runner's buckets known, the piece also stays within the free room of the step's
  bucket (`Scheduler._offer_within`): that room costs nothing whatever the model says, while
  a bucket more rests on the fit's split of a step into `a` and `b`, which a machine that
  turns busy breaks (its steps come in two or three shapes; a busy 2-core CPU's fit put `a`
  at 0.7 s against a floor near 0, and a follower's 256 tokens beside a leader's last step
  cost that first token 1.5 s, not the 0.5 s allowed).

  Args:
    behind: merges that still prefill behind the one that finishes (>= 0).
    cost: the engine's cost model.
  """
  a = cost.compute_coefficients[0]
  return a * behind / (behind + 1)


def padded_tokens(tokens: int, buckets: Sequence[int]) -> int:
  """The tokens a step of `tokens` tokens runs: the smallest of `buckets` (the runner's
  compiled token counts, ascending) that holds them; `tokens` itself past the largest or with
  no buckets."""
  i = bisect.bisect_left(buckets, tokens)
  return buckets[i] if i < len(buckets) else tokens


def step_s(pieces: Sequence[tuple[int, int]], cost: CostModel,
           buckets: Sequence[int] = ()) -> float:
  """The predicted seconds of a step holding `pieces` ((start, tokens) each: the prefill chunks
  and decodes planned in it), 0 for none, as the runner runs it: one fixed cost `a`, `b` per
  token of the step padded to its bucket (`padded_tokens`: the padding runs the same matmuls),
  and each piece's attention over the positions before it (`CostModel.predict_step_s`, the
  shape the model learns steps in).

  Args:
    pieces: (start position, tokens) per prefill chunk or decode.
    cost: the engine's cost model.
    buckets: the runner's compiled step token counts, ascending (`SchedulerConfig.step_buckets`;
      (): a step runs its tokens).
  """
  if not pieces:
    return 0.0
  return cost.predict_step_s(pieces, padded_tokens(sum(n for _, n in pieces), buckets))


def added_s(pieces: Sequence[tuple[int, int]], start: int, num_tokens: int, cost: CostModel,
            buckets: Sequence[int] = ()) -> float:
  """What a piece of `num_tokens` tokens at `start` adds to a step holding `pieces` (`step_s`),
  in seconds: its attention, its tokens, and the bucket the step grows into; next to nothing
  where it fills padding the step runs anyway; its whole step (the fixed cost too) when the
  step is empty."""
  return (step_s([*pieces, (start, num_tokens)], cost, buckets)
          - step_s(pieces, cost, buckets))


def largest_fitting(offer: int, plan_sizes: Sequence[int], fits: Callable[[int], bool]) -> int:
  """The largest piece a merge may be offered: `offer` itself or the largest compiled size
  below it for which `fits(tokens)` holds (it grows with the tokens), 0 when none does.

  Args:
    offer: the tokens the step could give it.
    plan_sizes: the compiled sizes, ascending.
    fits: whether a piece of that many tokens keeps the step within its limits.
  """
  for n in [offer, *(s for s in reversed(plan_sizes) if s < offer)]:
    if n > 0 and fits(n):
      return n
  return 0
