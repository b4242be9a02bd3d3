"""Look-ahead vs LRU on the real tiers where capacity binds (CachedAttention, arXiv 2403.19708,
section 3.3), with the simulator's figure beside each.

The 1,000 ShareGPT conversations of ../shared/data/sharegpt/sharegpt_v3_multiturn_1000.json
(token counts from SmolLM2's tokenizer, chat template included) are scheduled exactly as the
session simulator schedules them (`kvjax.testing.session_sim.build_schedule`: Poisson arrivals,
think times, `--slots` requests served at once from one FCFS queue), and the same schedule is
replayed through a real `TieredStore` (`kvjax/storage/tiering/tiers.py`): a `HostMemoryTier` over a
bounded `memory://` `ChunkStore` disk tier, write-back, no model (a hit rate is about
placement). At each instant the queue changes the store gets the window (`hint`: the history
chunks of the first `--window` waiting requests, queue order) and, under look-ahead, prefetches
the window's chunks that only the disk holds (`prefetch`, queue order); a dispatched request
reads its history chunks (`get`, first to last); a finished one saves every full chunk of its
history and this turn (`put`). Capacities: host + disk = `--live_multiples` x the schedule's
mean live KV, split `--host_ratio` : `--disk_ratio` (the setting where the simulator shows the
paper's gap). Chunks hold a small stand-in array (8 bytes a token); capacities are scaled by the
same factor, so every tier holds exactly the chunks it would at 23,040 B/token.

Policies: "lru" (least recently used, no window, no prefix order: the paper's baseline) and
"lookahead" at each of `--windows` ("all": the whole waiting queue). The real tiers' decisions
are the planner's (`kvjax.storage.tiering.placement.TierHierarchy`, the one tier engine); the simulator
column replays the planner alone with exclusive tiers (`session_sim.simulate`), the real column
holds copies (a promoted chunk keeps its disk copy).

Hit rate = of the history tokens in full chunks, those in chunks found counting from the first
chunk up to the first miss (what a prefix cache can use); exact counts, valid on any machine.

    nice -n 19 .venv/bin/python scripts/bench_tier_lookahead.py            # all 1,000
    nice -n 19 .venv/bin/python scripts/bench_tier_lookahead.py --quick    # 100 (smoke test)

Writes benchmarks/results/bench_tier_lookahead.json (…_quick.json) and .png. Exits non-zero if
a run fails.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import pathlib
import sys
import time
import zlib

import numpy as np
from absl import app, flags

import benchlib  # scripts/benchlib.py
from kvjax.storage.backends.chunk_store import ChunkStore
from kvjax.storage.tiering.eviction import make_policy
from kvjax.storage.tiering.host_tier import HostMemoryTier
from kvjax.storage.tiering.placement import TierSpec
from kvjax.storage.tiering.tiers import TieredStore
from kvjax.storage.format.types import ChunkHit, KVLayout
from kvjax.testing import session_sim as ss

REPO = pathlib.Path(__file__).resolve().parent.parent
TRACE = pathlib.Path("sharegpt") / "sharegpt_v3_multiturn_1000.json"
NS = "bench-ns"

_DATA = flags.DEFINE_string("data_dir", str(REPO.parent / "shared" / "data"),
                            "The shared real-workload data (sharegpt/).")
_QUICK = flags.DEFINE_bool("quick", False, "The first 100 conversations only.")
_CONVS = flags.DEFINE_integer("conversations", 0, "Conversations replayed (0: all; --quick: 100).")
_SLOTS = flags.DEFINE_integer("slots", 24, "Requests served at once (24: a queue forms).")
_LIVE = flags.DEFINE_list("live_multiples", ["1"], "Host + disk capacity over the mean live KV.")
_WINDOWS = flags.DEFINE_list("windows", ["16", "all"], "Look-ahead windows (requests; all: the "
                             "whole waiting queue).")
_HOST = flags.DEFINE_float("host_ratio", 0.1, "Host part of host + disk, as host : disk.")
_DISK = flags.DEFINE_float("disk_ratio", 0.5, "Disk part of host + disk, as host : disk.")
_CHUNK = flags.DEFINE_integer("chunk_tokens", 256, "Tokens per stored chunk.")
_COUNTS = flags.DEFINE_enum("token_counts", "smollm2", ["smollm2", "chars4"],
                            "How message tokens are counted.")
_OUT = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Results folder.")


def chunk_ids(key: str, c: int) -> tuple[int, ...]:
  base = zlib.crc32(key.encode())
  return tuple((base + i) % 49_152 for i in range(c))


async def replay_real(convs, schedule, policy: str, window: int, host_chunks: int,
                      disk_chunks: int, c: int) -> tuple[ss.SimResult, dict]:
  """`session_sim.simulate`'s loop over a real `TieredStore` (see the module docstring)."""
  layout = KVLayout(num_layers=1, chunk_size=c, num_kv_heads=1, head_dim=1, dtype="float32")
  nb = layout.nbytes
  host = HostMemoryTier(host_chunks * nb, policy=make_policy(policy))
  disk = ChunkStore(f"memory://bench-tier-{policy}-{window}-{time.monotonic_ns()}", name="disk")
  store = TieredStore([host, disk], capacities=[None, disk_chunks * nb], placement="write_back")
  kv = np.zeros(layout.shape, np.float32)
  res = ss.SimResult(policy=policy, window=window, tiers={"host": host_chunks * nb,
                                                         "disk": disk_chunks * nb},
                     hit_tokens_by_tier={"host": 0, "disk": 0})
  keys = [[f"{cv.conv_id}/{j}" for j in range(cv.total_tokens // c)] for cv in convs]
  queue: collections.deque[int] = collections.deque()
  prefetched = 0
  events = schedule.events
  i = 0
  while i < len(events):
    now = events[i][0]
    changed = False
    while i < len(events) and events[i][0] == now:
      _, kind, r = events[i]
      i += 1
      req = schedule.requests[r]
      ks = keys[req.conv]
      if kind == "arrive":
        queue.append(r)
        changed = True
      elif kind == "dispatch":
        queue.popleft()
        changed = True
        n = req.history_tokens // c
        res.turns += 1
        res.history_tokens += req.history_tokens
        if n == 0:
          continue
        found = []
        for k in ks[:n]:
          got = await store.get(k, chunk_ids(k, c), NS, layout)
          found.append(got.tier if isinstance(got, ChunkHit) else None)
        res.count_lookup(found, c)
      else:  # finish: save every full chunk (held ones are only refreshed)
        end = (req.history_tokens + req.prompt_tokens + req.reply_tokens) // c
        for j in range(end):
          await store.put(ks[j], ks[j - 1] if j else NS, chunk_ids(ks[j], c), NS, kv)
    if changed:
      win = [keys[schedule.requests[r].conv][:schedule.requests[r].history_tokens // c]
             for r in itertools.islice(queue, window)]
      store.hint(win)
      if policy == "lookahead":
        for req_keys in win:
          for k in req_keys:
            if store.planner.where(k) == "disk":
              if await store.prefetch(k, chunk_ids(k, c), NS, layout) is not None:
                prefetched += 1
    await store.drain()
  stats = store.stats
  extra = {"prefetched": prefetched,
           "tiers": {n: {f: getattr(s, f) for f in ("hits", "promotions", "evictions",
                                                  "demotions_out", "demotions_in",
                                                  "demotions_unneeded", "demotion_drops",
                                                  "orphans_dropped", "puts")}
                     for n, s in stats.items()},
           "planner": dataclasses.asdict(store.planner.stats())}
  return res, extra


def main(argv):
  del argv
  prov = benchlib.provenance(("kvjax", "numpy", "tensorstore", "tokenizers", "matplotlib",
                              "absl-py"))
  t0 = time.perf_counter()
  limit = _CONVS.value or (100 if _QUICK.value else None)
  if _COUNTS.value == "smollm2":
    count, system = ss.smollm2_token_counter()
    counts_how = "SmolLM2 tokenizer, ChatML template per message + default system"
  else:
    count, system = (lambda role, text: (len(text) + 3) // 4 + 5), 21
    counts_how = "characters / 4 + 5 per message"
  convs = ss.load_sharegpt(str(pathlib.Path(_DATA.value) / TRACE), count, system_tokens=system,
                           limit=limit)
  base = ss.SimConfig(chunk_tokens=_CHUNK.value, num_slots=_SLOTS.value)
  schedule = ss.build_schedule(convs, base)
  sim_nb = base.chunk_bytes
  live = schedule.mean_live_kv_tokens * base.kv_bytes_per_token
  host_share = _HOST.value / (_HOST.value + _DISK.value)
  variants = [("lru", "lru", 0)] + [
      (f"lookahead_w{w}", "lookahead", len(schedule.requests) if w == "all" else int(w))
      for w in _WINDOWS.value]
  runs, failed = [], []
  for m in [float(x) for x in _LIVE.value]:
    total = m * live
    host_b = max(1, int(total * host_share))
    disk_b = max(1, int(total) - host_b)
    host_chunks, disk_chunks = host_b // sim_nb, disk_b // sim_nb
    tiers = [TierSpec("host", host_b), TierSpec("disk", disk_b)]
    for label, policy, window in variants:
      try:
        sim = ss.simulate(convs, schedule, policy, tiers, dataclasses.replace(base, window=window))
        t1 = time.perf_counter()
        real, extra = asyncio.run(replay_real(convs, schedule, policy, window, host_chunks,
                                              disk_chunks, _CHUNK.value))
      except Exception as e:  # noqa: BLE001  (reported; the script exits non-zero)
        failed.append(f"{label} at {m}x live: {e!r}")
        print(f"FAILED {label} at {m}x live: {e!r}", file=sys.stderr)
        continue
      row = {"label": label, "policy": policy, "window": window, "live_multiple": m,
             "host_chunks": host_chunks, "disk_chunks": disk_chunks,
             "real": real.to_dict() | extra, "sim": sim.to_dict(),
             "real_replay_s_loaded_machine": round(time.perf_counter() - t1, 1)}
      runs.append(row)
      print(f"{m:g}x live  {label:>16}: real {real.token_hit_rate:.4f} (host "
            f"{real.hit_tokens_by_tier['host'] / max(real.chunk_tokens, 1):.4f})  "
            f"sim {sim.token_hit_rate:.4f}", flush=True)
  gaps = []
  for m in sorted({r["live_multiple"] for r in runs}):
    lru = next((r for r in runs if r["live_multiple"] == m and r["policy"] == "lru"), None)
    for r in runs:
      if lru is not None and r["live_multiple"] == m and r["policy"] == "lookahead":
        gaps.append({"live_multiple": m, "label": r["label"],
                     "real_points": round(100 * (r["real"]["token_hit_rate"]
                                                 - lru["real"]["token_hit_rate"]), 2),
                     "sim_points": round(100 * (r["sim"]["token_hit_rate"]
                                                - lru["sim"]["token_hit_rate"]), 2)})
  record = {**prov, "trace": str(TRACE), "conversations": len(convs), "token_counts": counts_how,
            "chunk_tokens": _CHUNK.value, "slots": _SLOTS.value,
            "schedule": schedule.summary() | {"live_kv_bytes": live},
            "capacity": "host + disk = live_multiple x mean live KV (at 23,040 B/token), split "
                        f"{_HOST.value} : {_DISK.value}; real tiers: HostMemoryTier over a "
                        "memory:// ChunkStore, write-back; chunk arrays scaled to 8 B/token, "
                        "capacities by the same factor (whole chunks)",
            "hit_rate": "prefix hit rate: history tokens of chunks found up to the first miss",
            "runs": runs, "gaps_over_lru": gaps, "failed": failed,
            "wall_s_loaded_machine": round(time.perf_counter() - t0, 1)}
  out = pathlib.Path(_OUT.value)
  name = "bench_tier_lookahead" + ("_quick" if _QUICK.value else "")
  benchlib.write_json(out / f"{name}.json", record)
  plt = benchlib.pyplot()
  fig, ax = plt.subplots(figsize=(10, 4.5))
  short = lambda r: "LRU" if r["policy"] == "lru" else f"LA w{r['label'].split('_w')[1]}"
  labels = [f"{short(r)}\n{r['live_multiple']:g}x live" for r in runs]
  x = np.arange(len(runs))
  ax.bar(x - 0.2, [r["real"]["token_hit_rate"] for r in runs], 0.4, label="real tiers")
  ax.bar(x + 0.2, [r["sim"]["token_hit_rate"] for r in runs], 0.4, label="simulator")
  ax.set_xticks(x, labels, fontsize=8)
  ax.set_ylabel("prefix hit rate of history tokens")
  ax.set_ylim(0, 1)
  ax.set_title(f"Look-ahead vs LRU, {len(convs)} ShareGPT conversations, {_SLOTS.value} slots")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / f"{name}.png", dpi=120)
  for g in gaps:
    print(f"{g['live_multiple']:g}x live {g['label']}: real {g['real_points']:+.2f} points over "
          f"LRU, sim {g['sim_points']:+.2f}")
  if failed:
    print("failed: " + "; ".join(failed), file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
