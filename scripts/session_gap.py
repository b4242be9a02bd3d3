"""The placement-gap sweep's summary for `bench_sessions.py --gap` (plain data, no flags).

A sweep record is one simulation: `slots`, `basis` ("footprint" or "live") and `value` (the
capacity point), `label` ("lru", "fifo", "lookahead_w<N>"), `policy`, `capacity_ratio` (host +
disk over the trace's KV footprint), `live_multiple` (over the load's mean live KV),
`token_hit_rate` and `tier_hit_rate` ({tier: share of history tokens}).
"""

from __future__ import annotations

TARGET_LRU = 0.20  # the placement target: look-ahead >= LRU + 20 points
TARGET_FIFO = 0.30  # and >= FIFO + 30 points


def gap_summary(loads) -> dict:
  """Per load and capacity point, look-ahead's gaps over LRU and FIFO (prefix hit rate and host
  share); the largest of each over the whole sweep, with their settings."""
  points, largest = [], {}
  for load in loads:
    by_point: dict = {}
    for r in load["runs"]:
      by_point.setdefault((r["basis"], r["value"]), {})[r["label"]] = r
    for (basis, value), runs in by_point.items():
      lru, fifo = runs["lru"], runs["fifo"]
      las = [r for r in runs.values() if r["policy"] == "lookahead"]
      best = max(las, key=lambda r: r["token_hit_rate"])
      p = {"slots": load["slots"], "basis": basis, "value": value,
           "capacity_ratio": lru["capacity_ratio"], "live_multiple": lru["live_multiple"],
           "lru": lru["token_hit_rate"], "fifo": fifo["token_hit_rate"],
           "lru_host": lru["tier_hit_rate"]["host"], "fifo_host": fifo["tier_hit_rate"]["host"],
           "lookahead": {r["label"]: r["token_hit_rate"] for r in las},
           "lookahead_host": {r["label"]: r["tier_hit_rate"]["host"] for r in las},
           "best_lookahead_label": best["label"],
           "best_minus_lru": best["token_hit_rate"] - lru["token_hit_rate"],
           "best_minus_fifo": best["token_hit_rate"] - fifo["token_hit_rate"]}
      points.append(p)
      for la, b in [(r, b) for r in las for b in ("lru", "fifo")]:
        name = f"{la['label']}_minus_{b}"
        gap = la["token_hit_rate"] - p[b]
        if name not in largest or gap > largest[name]["gap"]:
          largest[name] = {"gap": gap, "slots": load["slots"], "basis": basis, "value": value,
                           "capacity_ratio": p["capacity_ratio"],
                           "live_multiple": p["live_multiple"], "lookahead_label": la["label"],
                           "lookahead": la["token_hit_rate"], "lru": p["lru"], "fifo": p["fifo"],
                           "lookahead_host": la["tier_hit_rate"]["host"],
                           "lru_host": p["lru_host"], "fifo_host": p["fifo_host"]}
  for b in ("lru", "fifo"):
    name = f"any_window_minus_{b}"
    best = max((v for k, v in largest.items() if k.endswith(f"_minus_{b}")),
               key=lambda v: v["gap"])
    largest[name] = best
  both = max(points, key=lambda p: min(p["best_minus_lru"] - TARGET_LRU,
                                       p["best_minus_fifo"] - TARGET_FIFO))
  return {"points": points, "largest": largest,
          "closest_to_target": {**both, "target": f"lookahead >= lru + {TARGET_LRU:.2f} and >= "
                                                  f"fifo + {TARGET_FIFO:.2f}",
                                "met": both["best_minus_lru"] >= TARGET_LRU
                                and both["best_minus_fifo"] >= TARGET_FIFO}}


def gap_table(runs, labels, key) -> str:
  """One row per capacity point, one column per label: `key` of each record ("host": its
  host-tier share)."""
  def val(r):
    return r["tier_hit_rate"]["host"] if key == "host" else r[key]
  head = (f"{'basis':>9} {'value':>6} {'cap/fp':>7} {'x live':>6} "
          + " ".join(f"{lab.replace('lookahead_', 'la_'):>8}" for lab in labels))
  rows, seen = [head], {}
  for r in runs:
    seen.setdefault((r["basis"], r["value"]), {})[r["label"]] = r
  for (basis, value), by in seen.items():
    r0 = by[labels[0]]
    rows.append(f"{basis:>9} {value:>6g} {r0['capacity_ratio']:>7.4f} {r0['live_multiple']:>6.2f} "
                + " ".join(f"{val(by[lab]):>8.3f}" for lab in labels))
  return "\n".join(rows)
