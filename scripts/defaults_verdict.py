"""The verdict of `scripts/bench_defaults.py` on its cells (plain data, no flags, no model), so
tests can import it: a cell per setting and workload is the median over interleaved rounds;
the defaults are judged against the best other setting per metric, by the median of the
paired per-round ratios, and a loss is told from the machine's noise (same plans) and from a
trade-off (the winner loses elsewhere)."""

from __future__ import annotations

import statistics

import benchlib  # scripts/benchlib.py

#: A loss: defaults / best other above this, by both the paired ratio and the ratio of medians.
LOSS_RATIO = 1.10


def median_cell(runs: list[dict]) -> dict:
  """The median of each timing over the rounds (`summary`: `benchlib.summarize`, with min, max
  and spread); steps, plan fingerprints and CPU shares per round."""
  out = dict(runs[0])
  out["summary"] = {}
  for k in runs[0]:
    if k.endswith("_s") and all(r.get(k) is not None for r in runs):
      out["summary"][k] = benchlib.summarize([r[k] for r in runs])
      out[k] = out["summary"][k]["median"]
  out.pop("cpu_share", None)
  out["cpu_share_per_round"] = [r.get("cpu_share") for r in runs]
  out["steps_per_round"] = [r["steps"] for r in runs]
  out["plans_per_round"] = [r["plan"] for r in runs]
  out["reps"] = runs
  return out


def judge(row: dict, metric: str) -> dict | None:
  """Defaults against the best other setting of a workload, on one metric.

  best other: the lowest median. ratio: the median over rounds of the paired ratio defaults /
  best other (measured in the same round, under nearly the same load). same_plans: every round
  planned the same steps under both, so a ratio away from 1 is the machine's noise."""
  d = row["defaults"]
  others = {n: c[metric] for n, c in row.items() if n != "defaults" and c[metric] is not None}
  if not others or d[metric] is None:
    return None
  win = min(others, key=others.get)
  pairs = [(a[metric], b[metric]) for a, b in zip(d["reps"], row[win]["reps"])
           if a[metric] is not None and b[metric]]
  paired = [a / b for a, b in pairs]
  return {"defaults_median": d[metric], "best_other": win, "best_other_median": others[win],
          "paired_ratios": paired,
          "ratio_defaults_over_best": statistics.median(paired) if paired else None,
          "ratio_of_medians": d[metric] / others[win] if others[win] else None,
          "same_plans": d["plans_per_round"] == row[win]["plans_per_round"]}


def is_loss(v: dict) -> bool:
  """Whether a `judge` record flags a loss (both ratios above `LOSS_RATIO`)."""
  r, q = v["ratio_defaults_over_best"], v["ratio_of_medians"]
  return r is not None and q is not None and min(r, q) > LOSS_RATIO


def trade_off(row: dict, winner: str) -> dict:
  """Where the defaults beat `winner` by more than `LOSS_RATIO` on a timing of the workload
  (wall, TTFTs, the hits' or the cold prompt's TTFT...): {timing: median over rounds of the
  paired ratio winner / defaults}; what `winner` costs in exchange for its win."""
  d, w = row["defaults"], row[winner]
  out = {}
  for k in d["summary"]:
    pairs = [(b[k], a[k]) for a, b in zip(d["reps"], w["reps"])
             if a.get(k) and b.get(k) is not None]
    if pairs:
      ratio = statistics.median(b / a for b, a in pairs)
      if ratio > LOSS_RATIO:
        out[k] = ratio
  return out


def workloads_summary(cells: dict, verdict: dict) -> dict:
  """Per workload: `defaults_over_best` (the median paired ratio defaults / the best other
  setting on the metric where the smaller of it and the ratio of medians is largest: the metric
  closest to a loss), `best_setting` and `metric` (where it is), `status`
  ("within 10%", "same plans" where every round planned the same steps as the defaults, so the
  ratio is the machine's noise, or "trade-off" where the winner loses to the defaults by more
  than 10% on another timing, named in `trade_off`, or "loss"), and `per_metric`."""
  out = {}
  for w, per in verdict.items():
    if not per:
      continue
    metric = max(per, key=lambda m: min(per[m]["ratio_defaults_over_best"] or 0.0,
                                        per[m]["ratio_of_medians"] or 0.0))
    v = per[metric]
    losses = {m: x for m, x in per.items() if is_loss(x)}
    statuses, offs = [], {}
    for m, x in losses.items():
      if x["same_plans"]:
        statuses.append("same plans")
        continue
      offs[m] = {"best_setting": x["best_other"],
                 "winner_over_defaults": trade_off(cells[w], x["best_other"])}
      statuses.append("trade-off" if offs[m]["winner_over_defaults"] else "loss")
    status = ("loss" if "loss" in statuses else "trade-off" if "trade-off" in statuses
              else "same plans" if statuses else "within 10%")
    out[w] = {"defaults_over_best": v["ratio_defaults_over_best"],
              "best_setting": v["best_other"], "metric": metric, "status": status,
              "trade_off": offs,
              "per_metric": {m: {"defaults_over_best": x["ratio_defaults_over_best"],
                                 "ratio_of_medians": x["ratio_of_medians"],
                                 "best_setting": x["best_other"], "same_plans": x["same_plans"]}
                             for m, x in per.items()}}
  return out
