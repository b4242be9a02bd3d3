"""A Cake merge's compute share: how fast its compute runs in wall time, step by step.

A merge plans in cost-model seconds (`kvjax/scheduler/cost_model.py`: the time a step of its
tokens would take alone), but its request shares each step with decodes and other prefills, so
its compute advances by only a share of the step's wall time. `ComputeShare` estimates that
share from the steps the `CakeMerge` (`kvjax/scheduler/cake.py`) planned (predicted seconds over
the step's measured wall time, smoothed) and tracks the step under way: when its compute is
predicted to be busy until, and the step size its predictions assume. Time is the engine clock
in seconds. Owned by one merge, which is its only caller.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class ComputeShare:
  """Cost-model seconds of one request's compute per wall second of a step, in (0, 1].

  Args:
    prior: the share before a step has been observed, in (0, 1]; None takes the first budget
      offered over the largest compiled size (`offered`; 64 of 512 tokens: 1/8).
    chunk_size: the step size predictions assume until a budget is offered, tokens.

  Attributes:
    share: the current estimate.
    busy_until_s: when the compute planned in this step is predicted to finish (wall clock).
    step_tokens: the step size predictions of future compute assume (the largest compiled size
      within the last budget offered).
  """

  def __init__(self, prior: float | None, chunk_size: int):
    self.share = 1.0 if prior is None else float(prior)
    self._from_budget = prior is None
    self._step_now_s: float | None = None
    self._step_pred_s = 0.0
    self._step_waited = False
    self._step_queued = False
    self.busy_until_s = -math.inf
    self.step_tokens = chunk_size

  def begin_step(self, now_s: float) -> None:
    """Starts a new step when `now_s` moves; samples the share of the previous one (its
    predicted compute seconds over its wall time; not a step that only waited for loads)."""
    if self._step_now_s is not None and now_s == self._step_now_s:
      return
    if (self._step_now_s is not None and now_s > self._step_now_s and not self._step_queued
        and not (self._step_waited and self._step_pred_s == 0)):
      sample = self._step_pred_s / (now_s - self._step_now_s)
      self.share = min(1.0, max(1e-3, 0.5 * self.share + 0.5 * sample))
      self._from_budget = False
    self._step_now_s = now_s
    self._step_pred_s = 0.0
    self._step_waited = False
    self._step_queued = False
    self.busy_until_s = now_s

  def offered(self, budget_tokens: int, sizes: Sequence[int]) -> None:
    """The merge was offered `budget_tokens` of this step (compiled `sizes`, ascending)."""
    if self._from_budget and budget_tokens > 0:
      self.share = min(1.0, budget_tokens / sizes[-1])
      self._from_budget = False
    if budget_tokens >= sizes[0]:  # the step size future predictions assume
      self.step_tokens = max(s for s in sizes if s <= budget_tokens)

  def queued(self) -> None:
    """The merge got no budget this step because other restoring requests' compute went first
    (joint planning, `kvjax/scheduler/cake_joint.py`): the step says nothing of its share (its
    wait is the planner's, not the machine's), so it is not sampled."""
    self._step_queued = True

  def waited(self) -> None:
    """Compute waited for loads in this step."""
    self._step_waited = True

  def planned(self, pred_s: float) -> None:
    """A compute step of `pred_s` cost-model seconds was planned in this step."""
    self._step_pred_s += pred_s
    self.busy_until_s = self._step_now_s + self._step_pred_s / self.share
