"""The layer axis of a Cake merge: split the meeting chunk along layers.

CacheFlow (arXiv 2604.25080, section 4) splits a restoring prompt's loaded region along layers
as well as tokens: compute runs layers `[0, k)` of those tokens, the link moves only layers
`[k, L)` of each stored chunk. `k = 0` is Cake's token-only split (arXiv 2410.03065).

Which chunks to split. Computing a chunk costs more the later it sits (attention reads every
earlier token) while loading it costs the same anywhere, so each byte compute saves the link is
cheapest at the front. Splitting every loaded chunk at one k (computing the low layers of late,
expensive chunks) therefore buys the link's bytes at a worse price than computing one more
chunk from the front; the best plan of `(compute, load)` work per chunk is a fractional
knapsack: compute the chunks below the meeting point whole, load the chunks above it whole, and
split the ONE chunk where they meet along layers, so the two sides finish together instead of
one idling for up to a chunk (token-only Cake's rounding loss):

    chunk:      0     1     2     3     4     5     6     7
    layers   [ C ][ C ][ C ][ L ][ L ][ L ][ L ][ L ]   L-1
             [ C ][ C ][ C ][ L ][ L ][ L ][ L ][ L ]    k
             [ C ][ C ][ C ][ C ][ L ][ L ][ L ][ L ]  k-1
             [ C ][ C ][ C ][ C ][ L ][ L ][ L ][ L ]    0
                              ^ the meeting chunk: compute layers [0, k), load [k, L)

The merge (`kvjax/scheduler/cake.py`) asks `best_layers` when its next load would be the
meeting chunk; the answer is priced on the measured rates (`CostModel`): the chunk's compute
window and its predicted landing.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_points(points: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """The layer counts a merge may compute of a split chunk, checked.

  Args:
    points: each k in `[1, num_layers)`, ascending and distinct (the runner's layer-group
      boundaries, or every layer); () turns the layer axis off.
    num_layers: L, the model's layers (>= 1; unused when `points` is empty).

  Returns:
    `points` as a tuple.

  Raises:
    ValueError: a point outside `[1, num_layers)`, or points not ascending and distinct.
  """
  pts = tuple(points)
  if not pts:
    return pts
  if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 2:
    raise ValueError(f"num_layers={num_layers!r} must be an int >= 2 to split layers")
  if list(pts) != sorted(set(pts)) or any(
      isinstance(k, bool) or not isinstance(k, int) or not 0 < k < num_layers for k in pts):
    raise ValueError(f"layer split points {pts!r} must be ascending distinct ints in "
                     f"[1, {num_layers})")
  return pts


def split_nbytes(nbytes: int, num_layers: int, k: int) -> int:
  """Stored bytes of layers `[k, L)` of a layer-sliceable chunk of `nbytes` (every layer holds
  `nbytes / L`)."""
  return nbytes * (num_layers - k) // num_layers


def low_fraction(k: int, num_layers: int, share: float) -> float:
  """The wall time of a chunk's layers `[0, k)` over that of all its layers, at compute share
  `share` in (0, 1] (cost-model seconds of the merge's compute per wall second of a step).

  A step carries the merge's tokens beside other work: a full-depth piece of c seconds takes
  `c / share` of wall time, the others' `c / share - c` of it. A piece of the same tokens that
  stops after layer k - 1 saves only its own `(1 - k / L) c`: its wall time is
  `c (1 / share - 1 + k / L)`, the fraction `1 - share (1 - k / L)` of the full piece's. So the
  layer axis pays when the merge's compute owns the step (share 1: k / L) and hardly at all
  when it gets a thin slice of each step's token budget.
  """
  return 1.0 - share * (1.0 - k / num_layers)


def best_layers(compute_start_s: float, compute_end_s: float, link_start_s: float,
                land_s: float, num_layers: int, points: Sequence[int],
                share: float = 1.0, seen_after_s: float = 0.0) -> tuple[float, int]:
  """The split of one chunk that makes it present soonest.

  Compute would start the chunk at `compute_start_s` and finish all its layers at
  `compute_end_s`; a load of the whole chunk would start moving at `link_start_s` and land at
  `land_s`. Layers cost the same each (compute and bytes), so the chunk is present at

      done(k) = max(compute_start_s + f(k) * (compute_end_s - compute_start_s),
                    link_start_s + (L - k) / L * (land_s - link_start_s) + seen_after_s)

  for `0 < k < L`, with `f(k) = low_fraction(k, L, share)` (k / L at a full share),
  `done(0) = max(compute_start_s, land_s)` (loaded whole: the chunks below are computed first
  either way) and `done(L) = compute_end_s` (computed whole). `seen_after_s`: how long after
  its landing the engine sees a load its compute waits for (a landing during a step of other
  work is inserted at that step's end; 0 when the merge's compute owns the steps).

  Args:
    compute_start_s, compute_end_s: the chunk's compute window (engine clock, seconds).
    link_start_s, land_s: its whole load's transfer start and predicted landing.
    num_layers: L.
    points: the allowed `0 < k < L` (`check_points`).
    share: the merge's compute share of a step, in (0, 1] (`low_fraction`).
    seen_after_s: the delay of a landing compute waits for, seconds (see above).

  Returns:
    (done, k) with k in `{0, L} | points`, the LARGEST k among ties (fewer bytes on the link;
    token-only Cake likewise computes a chunk when the two sides tie).
  """
  best = (compute_end_s, num_layers)
  frac_c = compute_end_s - compute_start_s
  frac_l = land_s - link_start_s
  for k in sorted(points, reverse=True):
    done = max(compute_start_s + low_fraction(k, num_layers, share) * frac_c,
               link_start_s + (num_layers - k) / num_layers * frac_l + seen_after_s)
    if done < best[0]:
      best = (done, k)
  done0 = max(compute_start_s, land_s + seen_after_s)
  if done0 < best[0]:
    best = (done0, 0)
  return best
