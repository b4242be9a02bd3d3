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
from typing import Protocol

from kvjax._typing import RequestId
from kvjax.scheduler.cake import MergeTrace
from kvjax.scheduler.output import SchedulerOutput, StepResult
from kvjax.scheduler.scheduler import Scheduler


class Executor(Protocol):
  """Runs plans. `now_s` is its clock (seconds, monotonic); `execute` runs one plan in field
  order and reports what happened."""

  def now_s(self) -> float: ...

  def execute(self, plan: SchedulerOutput) -> StepResult: ...


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

  def step(self, token_budget: int | None = None
           ) -> tuple[SchedulerOutput, StepResult, dict[RequestId, MergeTrace]]:
    """Plans, executes and reports one step; returns the three records."""
    t0 = time.perf_counter()
    plan = self.scheduler.schedule(now_s=self.executor.now_s(), token_budget=token_budget)
    t1 = time.perf_counter()
    result = self.executor.execute(plan)
    t2 = time.perf_counter()
    traces = self.scheduler.update(result)
    self.stats.planner_s += (t1 - t0) + (time.perf_counter() - t2)
    self.stats.steps += 1
    self.stats.empty_steps += plan.is_empty
    return plan, result, traces
