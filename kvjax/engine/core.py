"""The step loop, shared by the real engine and the simulator: plan, execute, report back.

    plan   = scheduler.schedule(executor.now_s(), token_budget)     plain SchedulerOutput
    result = executor.execute(plan)                                  plain StepResult
    traces = scheduler.update(result)

The scheduler owns every request and plans everything (`kvjax.scheduler.scheduler`); an
executor owns what moves arrays and bytes (the model runner and the store client in
`kvjax.engine.engine.Engine`, a fake clock and a scripted link in `kvjax.testing.cake_sim`). The
two share no object: only the two records cross. Because the simulator is an executor under this
same loop, it cannot drift from the engine.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol

from kvjax._typing import RequestId
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.output import SchedulerOutput, StepResult
from kvjax.scheduler.scheduler import Scheduler


class Executor(Protocol):
  """Runs plans. `now_s` is its clock (seconds, monotonic); `execute` runs one plan in field
  order and reports what happened."""

  def now_s(self) -> float: ...

  def execute(self, plan: SchedulerOutput) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One step as an observer sees it: both records and the loop's own timing.

  Attributes:
    plan: the step's `SchedulerOutput`.
    result: what the executor reported.
    started_s: `time.perf_counter()` before `schedule`.
    ended_s: after `update`.
    planner_s: seconds in `schedule` plus `update`.
  """

  plan: SchedulerOutput
  result: StepResult
  started_s: float
  ended_s: float
  planner_s: float


@dataclasses.dataclass
class LoopStats:
  """Accounting of the loop itself (plain data).

  Attributes:
    steps: plans executed.
    empty_steps: plans with nothing to compute or insert (the executor waited for loads).
    planner_s: wall seconds spent in `schedule` and `update` (the planner's overhead).
  """

  steps: int = 0
  empty_steps: int = 0
  planner_s: float = 0.0


class EngineCore:
  """One scheduler, one executor, the loop between them.

  Args:
    scheduler: the owner of request state.
    executor: runs its plans.
  """

  def __init__(self, scheduler: Scheduler, executor: Executor):
    self.scheduler = scheduler
    self.executor = executor
    self.stats = LoopStats()
    #: Called with a `StepRecord` after every step (benchmarks record the stream; no other
    #: access to either side is needed).
    self.observers: list[Callable[[StepRecord], None]] = []

  def step(self, token_budget: int | None = None
           ) -> tuple[SchedulerOutput, StepResult, dict[RequestId, MergeTrace]]:
    """Plans, executes and reports one step; returns the three records."""
    t0 = time.perf_counter()
    plan = self.scheduler.schedule(now_s=self.executor.now_s(), token_budget=token_budget)
    t1 = time.perf_counter()
    result = self.executor.execute(plan)
    t2 = time.perf_counter()
    traces = self.scheduler.update(result)
    t3 = time.perf_counter()
    planner_s = (t1 - t0) + (t3 - t2)
    self.stats.planner_s += planner_s
    self.stats.steps += 1
    self.stats.empty_steps += plan.is_empty
    for observe in self.observers:
      observe(StepRecord(plan, result, t0, t3, planner_s))
    return plan, result, traces
