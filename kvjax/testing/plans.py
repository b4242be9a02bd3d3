"""Driving a `Scheduler` without an engine, for exact-plan tests."""

from __future__ import annotations

from kvjax.scheduler import LoadReport, Scheduler, SchedulerOutput, StepResult


def plan_steps(s: Scheduler, steps: int, start: int = 0,
               land_loads: bool = True) -> list[SchedulerOutput]:
  """Plans `steps` steps of `s`, 1 s apart from time `start`, and reports each back as an
  engine would: a request whose prompt ends in the step (or that decodes) samples token 1;
  every load issued lands half a second later from the host tier (when `land_loads`).

  Returns:
    Each step's plan, in order.
  """
  plans = []
  for k in range(start, start + steps):
    plan = s.schedule(now_s=float(k))
    plans.append(plan)
    s.update(StepResult(
        now_s=k + 0.5,
        sampled=tuple((c.request_id, 1) for c in plan.prefills if c.is_last)
        + tuple((d.request_id, 1) for d in plan.decodes),
        loads=tuple(LoadReport(ld.request_id, ld.index, True, 100, tier="host", done_s=k + 0.5)
                    for ld in plan.loads) if land_loads else ()))
  return plans


def prefills(plan: SchedulerOutput) -> list[tuple]:
  """A plan's prefill chunks as (request id, start, tokens)."""
  return [(c.request_id, c.start, c.num_tokens) for c in plan.prefills]
