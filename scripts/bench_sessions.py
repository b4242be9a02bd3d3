"""Multi-turn session caching across tiers: KV hit rates of placement policies.

Mode `--server` (scripts/session_replay.py): ShareGPT conversations replayed turn by turn on
the real server (`python -m kvjax.serve`), with `session_id` vs prefix hits vs recompute; see that
module's docstring. Writes <out_dir>/bench_sessions_server.json and prints a table.

    .venv/bin/python scripts/bench_sessions.py --nosim --server                # 50 convs x 4
    .venv/bin/python scripts/bench_sessions.py --nosim --server --server_quick  # 6 convs x 3

Mode `--sim` (the default): a trace-driven simulation with no model
(`kvjax.testing.session_sim`). The 1,000 ShareGPT conversations of
../shared/data/sharegpt/sharegpt_v3_multiturn_1000.json, token counts from SmolLM2's tokenizer
(chat template included; counted once per run, in memory), arrive as a Poisson process (1 new
conversation per second); each next turn arrives an exponential think time (mean 10 s; the
paper's distribution was not checked; `--think_time_dist=fixed`) after the previous reply; `--slots` requests run at once from one FCFS queue, each for 0.1 ms per
prompt token (history + new) + 25 ms per reply token. The KV of each turn's history is kept in
a host tier over a disk tier (the AttentionStore of CachedAttention, arXiv 2403.19708),
managed by `kvjax.storage.tiering.placement.TierHierarchy` under each policy:

  lookahead  CachedAttention section 3.3: the first `--window` waiting requests' chunks are
             prefetched toward host and never evicted while anything else can go; victims are
             demoted host -> disk, suffixes before prefixes, least recently used first
  lru, fifo  the same host -> disk -> drop cascade by recency / insertion; no window, no prefetch
  none       no cache

Capacities are ratios of the whole trace's KV footprint (every token of every conversation x
23,040 B/token, SmolLM2-135M in bf16). The sweep (`--sweep`) sets the disk tier's ratio and
scales the host tier with it (`--host_ratio` : `--disk_ratio`, default 0.1 : 0.5), so the sweep
point 0.5 is host 0.1 + disk 0.5. The service time does not depend on hits, so all policies
replay the same schedule and see the same windows. Two load levels: `--slots` (default 32)
and `--busy_slots` (default 24: a longer queue; 0 skips it); lookahead is also run at the
windows of `--window_sweep` (0: no window, i.e. suffix-first LRU with the same cascade).

    .venv/bin/python scripts/bench_sessions.py --quick     # 100 conversations (a smoke test:
                                                           # 100 s of arrivals, no queue)
    .venv/bin/python scripts/bench_sessions.py             # all 1,000 (about 25 s, 1 core)

Mode `--llm_lookahead`: the real engine (LLM API) replays a handful of ShareGPT conversations
turn by turn as chat sessions, each round's turns in one batch so that those beyond
`--llm_max_num_seqs` wait in the queue, with a tight host tier over a disk tier (emulated read
link) and the device prefix cache off; once with the look-ahead window off (0: plain LRU) and once
at `--llm_window`: host hit rate of history chunks, prefetch counters, TTFT of turns >= 2.
Writes <out_dir>/bench_sessions_llm_lookahead.json and .png.

    nice -n 19 .venv/bin/python scripts/bench_sessions.py --nosim --llm_lookahead

Mode `--llm_placement`: the same replay on the real engine, once per configuration of
`--llm_configs` (placement:eviction:window, each on a fresh LLM and disk tier, all advancing
conversation round by round in turn with the order rotated per round, after a discarded warm-up
replay): write_through vs write_back (`StoreConfig.placement`:
write-back saves go to the host tier only and its victims are demoted to disk), LRU vs FIFO
eviction (`StoreConfig.eviction`), look-ahead window 0 vs `--llm_window`, and "none" (no store:
recompute). Reports host hit share of history chunks, disk bytes written, demotions, TTFT, and
whether every configuration's greedy outputs are identical. Writes
<out_dir>/bench_sessions_llm_placement.json and .png.

    nice -n 19 .venv/bin/python scripts/bench_sessions.py --nosim --llm_placement

Mode `--gap` (with --nosim): where the look-ahead policy's gain over LRU and FIFO shows. The
simulation above over load levels (`--gap_slots`), capacities (host + disk split as
`--host_ratio` : `--disk_ratio`, at the `--sweep` footprint ratios and at `--gap_live_multiples`
of each load's mean live KV) and windows (`--gap_windows`; "all" is the whole waiting queue):
prefix hit rate and host-tier share per policy, the largest look-ahead - LRU and - FIFO gaps and
their settings. Writes <out_dir>/bench_sessions_sim_gap.{json,png} (35 min at nice 19 on a loaded
2-core VM).

    .venv/bin/python scripts/bench_sessions.py --nosim --gap

Writes <out_dir>/bench_sessions_sim.json (bench_sessions_sim_quick.json with --quick): machine,
versions, git SHA, seeds, settings, the trace's size, each load's queueing figures and every
run's hit counts and planner stats; and a plot of hit rate vs capacity per policy (.png).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import time

import numpy as np
from absl import app, flags

import session_gap  # scripts/session_gap.py
import session_replay  # scripts/session_replay.py
import benchlib  # scripts/benchlib.py
from benchlib import machine, pyplot
from kvjax.storage.tiering.placement import POLICIES, TierSpec
from kvjax.testing import session_sim as ss

REPO = pathlib.Path(__file__).resolve().parent.parent
TRACE = pathlib.Path("sharegpt") / "sharegpt_v3_multiturn_1000.json"

_SIM = flags.DEFINE_bool("sim", True, "Run the trace-driven simulation (no model).")
_DATA = flags.DEFINE_string("data_dir", str(REPO.parent / "shared" / "data"),
                            "The shared real-workload data (sharegpt/).")
_QUICK = flags.DEFINE_bool("quick", False, "Short run: the first 100 conversations.")
_CONVS = flags.DEFINE_integer("conversations", 0, "Conversations replayed (0: all; --quick: 100).")
_POLICIES = flags.DEFINE_list("policies", ["lookahead", "lru", "fifo", "none"],
                              f"Placement policies ({', '.join(sorted(POLICIES))}).")
_HOST = flags.DEFINE_float("host_ratio", 0.1, "Host tier capacity / trace KV footprint at the "
                           "sweep point equal to --disk_ratio.")
_DISK = flags.DEFINE_float("disk_ratio", 0.5, "Disk tier capacity / trace KV footprint (default "
                           "point).")
_SWEEP = flags.DEFINE_list("sweep", ["0.01", "0.02", "0.05", "0.1", "0.25", "0.5"],
                           "Disk capacity ratios; host = ratio x host_ratio / disk_ratio.")
_WINDOW = flags.DEFINE_integer("window", 16, "Waiting requests the look-ahead planner sees.")
_WINDOWS = flags.DEFINE_list("window_sweep", ["0", "4", "64"],
                             "Further windows to run lookahead at (sensitivity).")
_SLOTS = flags.DEFINE_integer("slots", 32, "Requests served at once.")
_BUSY = flags.DEFINE_integer("busy_slots", 24, "A second, busier load level (0: skip).")
_RATE = flags.DEFINE_float("arrival_rate", 1.0, "New conversations per second (Poisson).")
_THINK = flags.DEFINE_float("think_time_s", 10.0, "Mean seconds between a reply and the next turn.")
_THINK_DIST = flags.DEFINE_enum("think_time_dist", "exponential", ["exponential", "fixed"],
                                "Think-time distribution.")
_PREFILL = flags.DEFINE_float("prefill_s_per_token", 1e-4,
                              "Service seconds per prompt token (history + new prompt).")
_DECODE = flags.DEFINE_float("decode_s_per_token", 0.025, "Service seconds per reply token.")
_CHUNK = flags.DEFINE_integer("chunk_tokens", 256, "Tokens per stored chunk.")
_KV_BYTES = flags.DEFINE_integer("kv_bytes_per_token", ss.SMOLLM2_BF16_KV_BYTES_PER_TOKEN,
                                 "KV bytes per token (SmolLM2-135M bf16: 23040).")
_LINK = flags.DEFINE_float("prefetch_bytes_per_s", 0.0,
                           "Prefetch link into host, bytes/s (0: unlimited).")
_COUNTS = flags.DEFINE_enum("token_counts", "smollm2", ["smollm2", "chars4"],
                            "Token counts: SmolLM2's tokenizer, or characters / 4 (an estimate).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the arrivals and think times.")
_SERVER = flags.DEFINE_bool("server", False, "Replay conversations on the real server.")
_SERVER_QUICK = flags.DEFINE_bool("server_quick", False, "Server mode, short: 6 conversations x "
                                  "3 turns, 2 clients, 16 output tokens.")
_SERVER_ROUNDS = flags.DEFINE_integer("server_rounds", 3, "Server mode: interleaved rounds, each "
                                     "replaying every mode on a fresh server, the order rotated "
                                     "per round; figures are medians over rounds (--server_quick: 1).")
_SERVER_CONVS = flags.DEFINE_integer("server_conversations", 50, "Server mode: conversations.")
_SERVER_CLIENTS = flags.DEFINE_integer("server_clients", 8, "Server mode: concurrent sessions.")
_SERVER_TURNS = flags.DEFINE_integer("server_turns", 4, "Server mode: turns per conversation.")
_SERVER_CHARS = flags.DEFINE_integer("server_turn_chars", 600, "Server mode: characters kept of "
                                     "each user message.")
_SERVER_MIN_TURNS = flags.DEFINE_integer("server_min_turns", 2, "Server mode: replay only "
                                         "conversations with at least this many user turns.")
_SERVER_TAG = flags.DEFINE_string("server_tag", "", "Server mode: suffix of the output files' "
                                  "names (bench_sessions_server_<tag>.json).")
_SERVER_MAX_TOKENS = flags.DEFINE_integer("server_max_tokens", 48, "Server mode: reply tokens.")
_SERVER_MODES = flags.DEFINE_list("server_modes", ["session", "prefix", "recompute"],
                                  "Server mode: modes replayed, one fresh server each.")
_SERVER_HIST = flags.DEFINE_integer("server_history_tokens", 0, "Server mode: > 0 replays "
                                    "history-dominant conversations (scripts/session_replay.py): "
                                    "ShareGPT's first rounds up to this many templated tokens "
                                    "are turn 1's history.")
_SERVER_MAX_HIST = flags.DEFINE_integer("server_max_history_tokens", 4096, "Server mode: the "
                                        "longest such history.")
_SERVER_SHARE = flags.DEFINE_float("server_history_share", 0.88, "Server mode: the least share "
                                   "of history in each replayed turn >= 2's prompt.")
_SERVER_MAX_PROMPT = flags.DEFINE_integer("server_max_prompt_tokens", 4608, "Server mode: the "
                                          "longest replayed prompt.")
_SERVER_HOST = flags.DEFINE_integer("server_host_bytes", 0, "Server mode: > 0: the store is a "
                                    "host tier of this many bytes over the disk tier.")
_SERVER_DISK = flags.DEFINE_integer("server_disk_bytes", 0, "Server mode: the disk tier's "
                                    "capacity, bytes (0: its default).")
_SERVER_HOST_RATIO = flags.DEFINE_float("server_host_ratio", 0.0, "Server mode, history "
                                         "replay: host tier = this x the replay's KV footprint "
                                         "(overrides --server_host_bytes).")
_SERVER_DISK_RATIO = flags.DEFINE_float("server_disk_ratio", 0.0, "Server mode, history replay: "
                                        "disk tier = this x the footprint.")
_SERVER_CHUNK = flags.DEFINE_integer("server_kv_chunk_size", 256, "Server mode: tokens per "
                                     "stored KV chunk (the servers' --kv_chunk_size).")
_SERVER_FLAGS = flags.DEFINE_multi_string("server_flag", [], "Server mode: an extra flag of the "
                                          "started servers, repeatable.")
_LLM = flags.DEFINE_bool("llm_lookahead", False, "Replay conversations on the real engine "
                         "(LLM API) with a tight host tier over a disk tier, look-ahead window "
                         "0 vs --llm_window: host hits, prefetch counters, TTFT of turns >= 2.")
_LLM_CONVS = flags.DEFINE_integer("llm_conversations", 8, "LLM mode: conversations.")
_LLM_TURNS = flags.DEFINE_integer("llm_turns", 3, "LLM mode: turns per conversation.")
_LLM_CHARS = flags.DEFINE_integer("llm_turn_chars", 2400, "LLM mode: characters kept of each "
                                  "user message.")
_LLM_MAX_TOKENS = flags.DEFINE_integer("llm_max_tokens", 64, "LLM mode: reply tokens.")
_LLM_SEQS = flags.DEFINE_integer("llm_max_num_seqs", 2, "LLM mode: requests running at once "
                                 "(the rest of a round waits in the queue).")
_LLM_CHUNK = flags.DEFINE_integer("llm_chunk_tokens", 32, "LLM mode: tokens per stored chunk.")
_LLM_HOST = flags.DEFINE_integer("llm_host_chunks", 8, "LLM mode: host tier capacity, chunks.")
_LLM_DISK_BW = flags.DEFINE_float("llm_disk_bytes_per_s", 2e7, "LLM mode: emulated disk read "
                                  "link, bytes/s (0: unlimited).")
_LLM_WINDOW = flags.DEFINE_integer("llm_window", 8, "LLM mode: the look-ahead window compared "
                                   "with 0.")
_LLM_MERGE = flags.DEFINE_enum("llm_merge_mode", "load_only", ["load_only", "cake"],
                               "LLM mode: merge mode (load_only: every stored history chunk is "
                               "loaded, so the tier counts are exact).")
_LLM_PLACEMENT = flags.DEFINE_bool("llm_placement", False, "Replay conversations on the real "
                                   "engine under each configuration of --llm_configs.")
_LLM_CONFIGS = flags.DEFINE_list(
    "llm_configs", ["write_through:lru:0", "write_back:lru:0", "write_through:lru:8",
                    "write_back:lru:8", "write_through:fifo:0", "write_back:fifo:0", "none"],
    "LLM placement mode: placement:eviction:window per run, or none (no store: recompute).")
_LLM_MODEL = flags.DEFINE_string("llm_model", None, "LLM mode: model (default: SmolLM2-135M).")
_GAP = flags.DEFINE_bool("gap", False, "Simulation: the placement-gap sweep (where look-ahead "
                         "beats LRU and FIFO): load levels x capacities x windows; writes "
                         "bench_sessions_sim_gap.{json,png}.")
_GAP_SLOTS = flags.DEFINE_list("gap_slots", ["40", "32", "28", "24", "20"],
                               "Gap sweep: load levels, requests served at once.")
_GAP_LIVE = flags.DEFINE_list("gap_live_multiples", ["0.25", "0.5", "1", "1.5", "2", "3", "4",
                                                     "6"],
                              "Gap sweep: host + disk capacity as multiples of the load's mean "
                              "live KV, split host : disk as --host_ratio : --disk_ratio.")
_GAP_WINDOWS = flags.DEFINE_list("gap_windows", ["0", "4", "16", "64", "all"],
                                 "Gap sweep: look-ahead windows (requests; all: the whole "
                                 "waiting queue).")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")

FINDINGS = """\
What drives the differences (read with the tables):
- Every caching policy hits almost every history chunk once host + disk hold a few times the
  trace's live working set: the KV of the finished turns of conversations still in progress
  ("live KV" per load above, a few percent of the whole trace's footprint; the store also
  holds finished conversations' KV, which no policy can tell apart from a long think time).
  The policies differ only at capacities up to about twice the live KV.
- Where they differ, the cause is what is evicted while a conversation's next turn is in think
  time or waiting in the queue. Its chunks are then among the least recently used, so LRU
  evicts them just before they are needed; FIFO evicts by age and drops each chain's prefix
  first. The look-ahead window protects only requests that have ARRIVED and wait in the queue,
  so its gain grows with the queue: small at the default load (short queue), larger with the
  busier server, and larger with a larger window.
- Suffix-first eviction is worth the gap between lru's prefix and any-chunk hit rates (chunks
  kept whose prefix is gone); lookahead at window 0 (suffix-first LRU, same cascade) isolates
  it.
- Prefetch does not change the any-tier hit rate (host and disk both count as hits); it moves
  hits from disk to host (the host-share table)."""


@functools.cache
def start_provenance() -> dict:
  """`benchlib.provenance()` when this run started (`main` takes it first), so that a long run's
  record names the code it ran rather than a later commit. Copy it into a record (`**`)."""
  return benchlib.provenance(("kvjax", "jax", "jaxlib", "numpy", "tokenizers", "matplotlib",
                              "absl-py"))


def token_counter(kind: str):
  """(count_tokens, system_tokens, description)."""
  if kind == "smollm2":
    try:
      count, system = ss.smollm2_token_counter()
    except FileNotFoundError as e:
      raise app.UsageError(f"{e}; or pass --token_counts=chars4") from e
    return count, system, "SmolLM2 tokenizer, ChatML template per message + default system"
  return (lambda role, text: (len(text) + 3) // 4 + 5), 21, "characters / 4 + 5 per message"


def sim_inputs():
  """The simulation's trace and base config from the flags: (conversations, SimConfig,
  footprint bytes, how tokens were counted, system tokens, trace path, seconds to load)."""
  t0 = time.perf_counter()
  limit = _CONVS.value or (100 if _QUICK.value else None)
  path = pathlib.Path(_DATA.value) / TRACE
  count, system, counts_how = token_counter(_COUNTS.value)
  convs = ss.load_sharegpt(str(path), count, system_tokens=system, limit=limit)
  base = ss.SimConfig(
      chunk_tokens=_CHUNK.value, kv_bytes_per_token=_KV_BYTES.value, arrival_rate_per_s=_RATE.value,
      think_time_s=_THINK.value, think_time_dist=_THINK_DIST.value, num_slots=_SLOTS.value,
      prefill_s_per_token=_PREFILL.value, decode_s_per_token=_DECODE.value, window=_WINDOW.value,
      prefetch_bytes_per_s=_LINK.value or None, seed=_SEED.value)
  footprint = ss.footprint_bytes(convs, base.kv_bytes_per_token)
  return convs, base, footprint, counts_how, system, path, time.perf_counter() - t0


def sim_record(convs, base, footprint, counts_how, system, path) -> dict:
  """The provenance and trace fields both simulation records carry."""
  try:
    trace = os.path.relpath(path, REPO)
  except ValueError:
    trace = str(TRACE)
  return {
      **start_provenance(), "machine_at_end": machine(),
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "seeds": {"arrivals": f"{base.seed}/arrivals", "think": f"{base.seed}/think",
                "rng": "python random.Random(str seed)"},
      "trace": {"path": trace, "conversations": len(convs),
                "turns": sum(len(c.turns) for c in convs),
                "tokens": sum(c.total_tokens for c in convs), "token_counts": counts_how,
                "system_tokens": system, "footprint_bytes": footprint},
      "paper": {"source": "CachedAttention / AttentionStore, arXiv 2403.19708",
                "hit_rate": {"lookahead": 0.86, "lru": 0.58, "fifo": 0.48},
                "note": "as cited for this project; the paper's workload and capacities are "
                        "not reproduced here, see findings"}}


def run_sim() -> None:
  t0 = time.perf_counter()
  quick = _QUICK.value
  convs, base, footprint, counts_how, system, path, load_s = sim_inputs()
  sweep = [float(r) for r in _SWEEP.value]
  windows = [int(w) for w in _WINDOWS.value if int(w) != base.window]
  slot_levels = [_SLOTS.value] + ([_BUSY.value] if _BUSY.value else [])
  loads = []
  for slots in slot_levels:
    cfg = dataclasses.replace(base, num_slots=slots)
    schedule = ss.build_schedule(convs, cfg)
    summary = schedule.summary()
    summary["live_kv_ratio"] = summary["mean_live_kv_tokens"] * base.kv_bytes_per_token / footprint
    runs = []
    for disk_ratio in sweep:
      host_ratio = disk_ratio * _HOST.value / _DISK.value
      tiers = [TierSpec("host", max(1, int(host_ratio * footprint))),
               TierSpec("disk", max(1, int(disk_ratio * footprint)))]
      variants = [(p, p, cfg) for p in _POLICIES.value]
      if "lookahead" in _POLICIES.value:
        variants += [(f"lookahead_w{w}", "lookahead", dataclasses.replace(cfg, window=w))
                     for w in windows]
      for label, policy, c in variants:
        res = ss.simulate(convs, schedule, policy, tiers, c)
        runs.append({"label": label, "disk_ratio": disk_ratio, "host_ratio": host_ratio,
                     **res.to_dict()})
    loads.append({"slots": slots, "schedule": summary, "runs": runs})
  wall = time.perf_counter() - t0

  labels = list(dict.fromkeys(r["label"] for r in loads[0]["runs"]))
  print(f"bench_sessions --sim: {len(convs)} ShareGPT conversations, "
        f"{sum(c.total_tokens for c in convs):,} tokens ({counts_how}), "
        f"{sum(len(c.turns) for c in convs):,} turns; KV footprint {footprint / 1e9:.2f} GB at "
        f"{base.kv_bytes_per_token} B/token; chunks of {base.chunk_tokens} tokens; arrivals "
        f"{base.arrival_rate_per_s}/s, think {base.think_time_dist} mean {base.think_time_s} s; "
        f"window {base.window}; prefetch link "
        f"{'unlimited' if base.prefetch_bytes_per_s is None else base.prefetch_bytes_per_s}")
  for load in loads:
    s = load["schedule"]
    print(f"\n== {load['slots']} slots: utilization {s['utilization']:.2f}, mean wait "
          f"{s['mean_wait_s']:.1f} s (p90 {s['p90_wait_s']:.1f} s, {s['waited_fraction']:.0%} "
          f"waited), mean queue {s['mean_queue_len']:.1f} (max {s['max_queue_len']}); "
          f"{s['mean_active_conversations']:.0f} conversations in progress, live KV "
          f"{s['live_kv_ratio']:.3f} of the footprint ==")
    print(f"(lookahead: window {base.window}; lookahead_wN: window N)")
    for title, key in (("token hit rate (prefix from the first chunk; host + disk)",
                        "token_hit_rate"),
                       ("token hit rate, any chunk found", "token_hit_rate_any"),
                       ("turn hit rate (whole history found)", "turn_hit_rate"),
                       ("host-tier share of history tokens (hits served from host)", "host")):
      print(title)
      print(table(load["runs"], sweep, labels, key))
  print(f"\n{FINDINGS}\n\nsimulated in {wall:.1f} s (trace and token counts {load_s:.1f} s)")

  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  stem = "bench_sessions_sim_quick" if quick else "bench_sessions_sim"
  head = sim_record(convs, base, footprint, counts_how, system, path)
  record = {
      "benchmark": "bench_sessions", "mode": "sim", **head,
      "settings": {"quick": quick, "conversations": len(convs), "policies": _POLICIES.value,
                   "sweep_disk_ratios": sweep, "host_ratio": _HOST.value,
                   "disk_ratio": _DISK.value, "window_sweep": windows,
                   "slot_levels": slot_levels, "sim_config": dataclasses.asdict(base),
                   "service_time": "prefill_s_per_token x (history + prompt tokens) + "
                                   "decode_s_per_token x reply tokens; independent of hits",
                   "capacity": "ratio x footprint_bytes, host and disk exclusive"},
      "findings": FINDINGS, "wall_s": wall, "loads": loads}
  benchlib.write_json(out / f"{stem}.json", record)
  plot(loads, sweep, labels, out / f"{stem}.png", len(convs), base.window)
  print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")


GAP_FINDINGS = """\
How to read the gap sweep:
- Capacities are host + disk together, split host : disk as at the issue's defaults (1 : 5),
  given both as a ratio of the whole trace's KV footprint and as a multiple of the load's mean
  live KV (the finished turns' KV of conversations still in progress, time-averaged: what a
  cache must hold to serve every next turn). Below 1x no policy can serve every next turn;
  every policy reaches ~100% once the capacity is a few times it.
- The look-ahead window sees only requests that have arrived and wait; a conversation in think
  time is not in it. Its gain over LRU therefore needs a queue: none at 40 slots (no waiting),
  and it grows with the queue (fewer slots) and with the window (all: the whole queue).
- The host share is the fraction of history tokens served from the host (fast) tier: prefetch
  moves the window's chunks there before the request runs, which LRU and FIFO never do."""


def gap_window(w: str, schedule) -> int:
  """A --gap_windows entry as a window size: "all" covers any queue (every request)."""
  return len(schedule.requests) if w == "all" else int(w)


def run_gap() -> None:
  t0 = time.perf_counter()
  convs, base, footprint, counts_how, system, path, load_s = sim_inputs()
  host_share = _HOST.value / (_HOST.value + _DISK.value)  # host's part of host + disk
  windows = [w.strip() for w in _GAP_WINDOWS.value]
  for w in windows:
    if w != "all" and not (w.isdigit()):
      raise app.UsageError(f"--gap_windows entry {w!r}: an int >= 0 or all")
  variants = [("lru", "lru", None), ("fifo", "fifo", None)] + [
      (f"lookahead_w{w}", "lookahead", w) for w in windows]
  # Capacity points: (basis, value) -> total host + disk bytes (footprint: the --sweep disk
  # ratios with host at --host_ratio / --disk_ratio of it, the default among them).
  fp_points = sorted({float(r) for r in _SWEEP.value} | {_DISK.value})
  loads = []
  for slots in [int(x) for x in _GAP_SLOTS.value]:
    cfg = dataclasses.replace(base, num_slots=slots)
    schedule = ss.build_schedule(convs, cfg)
    live = schedule.mean_live_kv_tokens * base.kv_bytes_per_token
    summary = schedule.summary() | {"live_kv_bytes": live, "live_kv_ratio": live / footprint}
    points = [("footprint", r, r * (_HOST.value + _DISK.value) / _DISK.value * footprint)
              for r in fp_points]
    points += [("live", float(m), float(m) * live) for m in _GAP_LIVE.value]
    runs = []
    for basis, value, total in points:
      host = max(1, int(total * host_share))
      disk = max(1, int(total) - host)
      tiers = [TierSpec("host", host), TierSpec("disk", disk)]
      for label, policy, w in variants:
        c = cfg if w is None else dataclasses.replace(cfg, window=gap_window(w, schedule))
        res = ss.simulate(convs, schedule, policy, tiers, c)
        d = res.to_dict()
        runs.append({
            "label": label, "policy": policy, "window": w, "basis": basis, "value": value,
            "host_bytes": host, "disk_bytes": disk, "host_ratio": host / footprint,
            "disk_ratio": disk / footprint, "capacity_ratio": (host + disk) / footprint,
            "live_multiple": (host + disk) / live,
            **{k: d[k] for k in ("token_hit_rate", "token_hit_rate_any", "turn_hit_rate",
                                 "tier_hit_rate", "chunk_tokens", "hit_tokens",
                                 "hit_tokens_any", "hit_tokens_by_tier")},
            "placement": {k: d["placement"][k] for k in (
                "prefetches_issued", "prefetches_useful", "prefetches_wasted", "demotions",
                "drops", "rejected_saves")}})
      print(f"  {slots} slots, {basis} {value:g}: done ({time.perf_counter() - t0:.0f} s)",
            flush=True)
    loads.append({"slots": slots, "schedule": summary, "points": len(points), "runs": runs})
  wall = time.perf_counter() - t0
  gaps = session_gap.gap_summary(loads)

  print(f"bench_sessions --gap: {len(convs)} ShareGPT conversations, KV footprint "
        f"{footprint / 1e9:.2f} GB; arrivals {base.arrival_rate_per_s}/s, think "
        f"{base.think_time_dist} mean {base.think_time_s} s; host : disk = {_HOST.value} : "
        f"{_DISK.value}; prefetch link "
        f"{'unlimited' if base.prefetch_bytes_per_s is None else base.prefetch_bytes_per_s}")
  labels = [v[0] for v in variants]
  for load in loads:
    s = load["schedule"]
    print(f"\n== {load['slots']} slots: mean queue {s['mean_queue_len']:.1f} (max "
          f"{s['max_queue_len']}), mean wait {s['mean_wait_s']:.1f} s, live KV "
          f"{s['live_kv_ratio']:.4f} of the footprint ==")
    for title, key in (("prefix hit rate (host + disk)", "token_hit_rate"),
                       ("host-tier share of history tokens", "host")):
      print(title)
      print(session_gap.gap_table(load["runs"], labels, key))
  print("\nlargest gaps (prefix hit rate, points):")
  for name, g in gaps["largest"].items():
    print(f"  {name}: {100 * g['gap']:+.1f} at {g['slots']} slots, {g['basis']} {g['value']:g} "
          f"(capacity {g['capacity_ratio']:.4f} of the footprint, {g['live_multiple']:.2f}x live "
          f"KV), {g['lookahead_label']} {g['lookahead']:.3f} vs lru {g['lru']:.3f} / fifo "
          f"{g['fifo']:.3f}")
  print(f"\n{GAP_FINDINGS}\n\nsimulated in {wall:.1f} s (trace and token counts {load_s:.1f} s)")

  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  stem = "bench_sessions_sim_gap" + ("_quick" if _QUICK.value else "")
  record = {
      "benchmark": "bench_sessions", "mode": "gap",
      **sim_record(convs, base, footprint, counts_how, system, path),
      "settings": {"conversations": len(convs), "slot_levels": [int(x) for x in _GAP_SLOTS.value],
                   "footprint_points_disk_ratio": fp_points,
                   "live_multiples": [float(m) for m in _GAP_LIVE.value],
                   "windows": windows, "host_ratio": _HOST.value, "disk_ratio": _DISK.value,
                   "sim_config": dataclasses.asdict(base),
                   "window_all": "the window covers every request (the whole waiting queue)",
                   "capacity": "host + disk, exclusive, split host_ratio : disk_ratio; basis "
                               "footprint: disk = value x footprint, host = value x host_ratio "
                               "/ disk_ratio x footprint; basis live: host + disk = value x "
                               "the load's mean live KV"},
      "findings": GAP_FINDINGS, "gaps": gaps, "wall_s": wall, "loads": loads}
  benchlib.write_json(out / f"{stem}.json", record)
  plot_gap(loads, labels, out / f"{stem}.png", len(convs))
  print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")


def plot_gap(loads, labels, path, n_convs) -> None:
  plt = pyplot()
  if plt is None:
    return
  shown = [lab for lab in labels if lab in ("lru", "fifo", "lookahead_w16", "lookahead_wall")]
  fig, axes = plt.subplots(2, len(loads), figsize=(3.6 * len(loads), 6.4), squeeze=False,
                           sharey="row")
  for j, load in enumerate(loads):
    runs = [r for r in load["runs"] if r["basis"] == "live"]
    s = load["schedule"]
    for i, key in enumerate(("token_hit_rate", "host")):
      ax = axes[i][j]
      for lab in shown:
        rs = sorted((r for r in runs if r["label"] == lab), key=lambda r: r["live_multiple"])
        ys = [r["tier_hit_rate"]["host"] if key == "host" else r[key] for r in rs]
        ax.plot([r["live_multiple"] for r in rs], ys, marker="o", ms=3,
                label=lab.replace("lookahead_w", "lookahead w"))
      ax.set_xscale("log")
      xs = sorted({r["value"] for r in runs})
      ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
      ax.minorticks_off()
      ax.set_ylim(-0.02, 1.02)
      ax.grid(alpha=0.3)
      if i == 0:
        ax.set_title(f"{load['slots']} slots: queue {s['mean_queue_len']:.0f}, wait "
                     f"{s['mean_wait_s']:.0f} s\nlive KV {s['live_kv_ratio']:.3f} of footprint",
                     fontsize=8)
      else:
        ax.set_xlabel("host + disk / mean live KV")
      if j == 0:
        ax.set_ylabel("prefix hit rate (host + disk)" if i == 0 else "served from host")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"bench_sessions --gap: {n_convs} ShareGPT conversations, simulated placement "
               f"(host : disk = 1 : 5)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def cell(runs, ratio, label, key) -> float:
  r = next(r for r in runs if r["disk_ratio"] == ratio and r["label"] == label)
  return r["tier_hit_rate"]["host"] if key == "host" else r[key]


def table(runs, sweep, labels, key) -> str:
  head = f"{'disk':>6} {'host':>7} " + " ".join(f"{lab:>12}" for lab in labels)
  rows = [head]
  for ratio in sweep:
    host = next(r["host_ratio"] for r in runs if r["disk_ratio"] == ratio)
    rows.append(f"{ratio:>6g} {host:>7.3g} "
                + " ".join(f"{cell(runs, ratio, lab, key):>12.3f}" for lab in labels))
  return "\n".join(rows)


def plot(loads, sweep, labels, path, n_convs, window) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.5), squeeze=False)
  for ax, load in zip(axes[0], loads):
    for lab in labels:
      ys = [cell(load["runs"], r, lab, "token_hit_rate") for r in sweep]
      style = ":" if lab.startswith("lookahead_w") else "-"
      ax.plot(sweep, ys, style, marker="o",
              label=f"lookahead (window {window})" if lab == "lookahead" else lab)
    s = load["schedule"]
    ax.set_xscale("log")
    ax.set_xticks(sweep, [f"{r:g}" for r in sweep])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("disk capacity / trace KV footprint (host = disk / 5)")
    ax.set_ylabel("history-token hit rate (host + disk)")
    ax.set_title(f"{load['slots']} slots: mean queue {s['mean_queue_len']:.1f}, "
                 f"wait {s['mean_wait_s']:.1f} s, live KV {s['live_kv_ratio']:.3f}\n"
                 f"{n_convs} ShareGPT conversations (CachedAttention placement, simulated)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def run_server() -> None:
  quick = _SERVER_QUICK.value
  cfg = session_replay.ReplayConfig(
      conversations=6 if quick else _SERVER_CONVS.value, clients=2 if quick else
      _SERVER_CLIENTS.value, turns=3 if quick else _SERVER_TURNS.value,
      turn_chars=_SERVER_CHARS.value, max_tokens=16 if quick else _SERVER_MAX_TOKENS.value,
      min_turns=_SERVER_MIN_TURNS.value,
      seed=_SEED.value, server_flags=tuple(f"--{f}" for f in _SERVER_FLAGS.value),
      history_tokens=_SERVER_HIST.value, max_history_tokens=_SERVER_MAX_HIST.value,
      history_share=_SERVER_SHARE.value, max_prompt_tokens=_SERVER_MAX_PROMPT.value,
      host_bytes=_SERVER_HOST.value, disk_bytes=_SERVER_DISK.value,
      host_ratio=_SERVER_HOST_RATIO.value, disk_ratio=_SERVER_DISK_RATIO.value,
      kv_chunk_size=_SERVER_CHUNK.value, rounds=1 if quick else _SERVER_ROUNDS.value)
  got = session_replay.run_replay(cfg, pathlib.Path(_DATA.value), modes=tuple(_SERVER_MODES.value))
  session_replay.print_table(got["summary"])
  record = {**start_provenance(), "benchmark": "bench_sessions_server",
            "machine_at_end": machine(),
            "threads": {"cpu_count": os.cpu_count(), "clients": cfg.clients},
            "seeds": {"conversations": cfg.seed, "requests": 0},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **got}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  name = ("bench_sessions_server" + ("_quick" if quick else "") +
          (f"_{_SERVER_TAG.value}" if _SERVER_TAG.value else ""))
  benchlib.write_json(out / f"{name}.json", record)
  plot_server(got["summary"], out / f"{name}.png", cfg, got["conversations_used"])
  print(f"wrote {out / (name + '.json')} and .png")


def plot_server(summaries: dict, path: pathlib.Path, cfg, n_convs: int) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  modes = list(summaries)
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
  x = range(len(modes))
  ax.bar([i - 0.2 for i in x], [summaries[m]["ttft_ge2_p50_s"] for m in modes], 0.4,
         label="TTFT p50, turns >= 2")
  ax.bar([i + 0.2 for i in x], [summaries[m]["ttft_ge2_p99_s"] for m in modes], 0.4,
         label="TTFT p99, turns >= 2")
  ax.set_xticks(list(x), modes)
  ax.set_ylabel("seconds")
  ax.set_yscale("log")
  ax.legend(fontsize=8)
  bx.bar([i - 0.2 for i in x], [summaries[m].get("prefill_tokens_per_prefill_s_ge2") or 0
                                for m in modes], 0.4, label="per prefill wall second")
  bx.bar([i + 0.2 for i in x], [summaries[m]["prefill_tokens_per_s_ge2"] or 0 for m in modes],
         0.4, label="per server TTFT second")
  bx.set_xticks(list(x), modes)
  bx.set_ylabel("prompt tokens / s, turns >= 2")
  bx.set_yscale("log")
  bx.legend(fontsize=8)
  fig.suptitle(f"bench_sessions --server: {n_convs} ShareGPT conversations (up to "
               f"{cfg.turns} turns), {cfg.clients} clients, {os.cpu_count()}-core CPU, f32",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


class _Replay:
  """One engine of the `--llm_lookahead` comparison: a fresh `LLM` on its own disk tier, whose
  conversations advance one round (every conversation's next turn, in one batch: the requests
  beyond `--llm_max_num_seqs` wait in the queue, the look-ahead window's domain) per `round`
  call, each turn a session turn (`LLM.sessions`: its exact ids plus the new message). The device
  prefix cache is off, so every history hit comes from the host or disk tier."""

  def __init__(self, window: int, convs: list[list[str]], disk: pathlib.Path, *,
               placement: str = "write_through", eviction: str = "lru", store_on: bool = True):
    from kvjax import LLM, SamplingParams  # noqa: PLC0415
    from kvjax.storage import StoreConfig, TierConfig  # noqa: PLC0415

    kw = {"model": _LLM_MODEL.value} if _LLM_MODEL.value else {}
    probe = LLM(**kw, compile_on_init=False)
    cfg = probe.model_config
    self.dtype_bytes = np.dtype(probe.dtype).itemsize
    probe.close()
    self.c = c = _LLM_CHUNK.value
    self.chunk_bytes = cfg.n_layers * 2 * c * cfg.n_kv_heads * cfg.head_dim * self.dtype_bytes
    store = StoreConfig((TierConfig("host", capacity_bytes=_LLM_HOST.value * self.chunk_bytes),
                         TierConfig("disk", url=f"file://{disk}",
                                    link_bytes_per_s=_LLM_DISK_BW.value or None)),
                        placement=placement, eviction=eviction)
    self.label = f"{placement}:{eviction}:{window}" if store_on else "none"
    self.llm = LLM(**kw, kv_store=store if store_on else None, kv_chunk_size=c,
                   max_num_seqs=_LLM_SEQS.value,
                   enable_prefix_caching=False, kv_lookahead_window=window, session_ttl_s=None,
                   max_pinned_sessions=0, kv_merge_mode=_LLM_MERGE.value)
    self.params = SamplingParams(max_tokens=_LLM_MAX_TOKENS.value, temperature=0.0)
    self.window, self.convs = window, convs
    self.rows, self.history = [], [[] for _ in convs]
    self.busy_s = 0.0

  def round(self, t: int) -> None:
    llm = self.llm
    live = [i for i, cv in enumerate(self.convs) if t < len(cv)]
    turns, prompts = [], []
    for i in live:
      self.history[i].append({"role": "user", "content": self.convs[i][t]})
      turn = llm.sessions.begin(f"conv{i}")
      turns.append(turn)
      prompts.append(llm.sessions.prompt(turn, self.history[i]))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(pr.token_ids)} for pr in prompts],
                        [self.params] * len(prompts))
    self.busy_s += time.perf_counter() - t0
    for i, turn, pr, out in zip(live, turns, prompts, outs):
      llm.sessions.finish(turn, pr, out.token_ids, out.text)
      self.history[i].append({"role": "assistant", "content": out.text})
      m = out.metrics
      self.rows.append({"conversation": i, "turn": t + 1, "prompt_tokens": len(pr.token_ids),
                        "session_outcome": pr.outcome, "ttft_s": m.ttft_s,
                        "cached_tokens": out.num_cached_tokens,
                        "computed_tokens": m.num_computed_tokens,
                        "completion_tokens": len(out.token_ids),
                        "output_token_ids": list(out.token_ids),
                        "loaded_from_tiers": list(m.loaded_from_tiers)})
    llm.flush()

  def result(self) -> dict:
    st = self.llm.engine.stats()
    self.llm.close()
    c, rows = self.c, self.rows
    later = [r for r in rows if r["turn"] >= 2]
    tiers = [x for r in later for x in r["loaded_from_tiers"]]
    # History chunks: full chunks of the previous turn's prompt + reply (what a hit can reuse;
    # never the new prompt's last token).
    prev = {(r["conversation"], r["turn"]): r["prompt_tokens"] + r["completion_tokens"]
            for r in rows}
    hist_chunks = sum(min(r["prompt_tokens"] - 1, prev[(r["conversation"], r["turn"] - 1)]) // c
                      for r in later)
    ttfts = sorted(r["ttft_s"] for r in later)
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None
    return {
        "window": self.window, "label": self.label, "generate_wall_s": self.busy_s,
        "rows": rows,
        "summary": {
            "turns_ge2": len(later), "history_chunks_ge2": hist_chunks,
            "loaded_chunks_ge2": len(tiers), "host_loaded_chunks_ge2": tiers.count("host"),
            "disk_loaded_chunks_ge2": tiers.count("disk"),
            "host_hit_rate_of_history_chunks": tiers.count("host") / hist_chunks if hist_chunks
            else None,
            "any_hit_rate_of_history_chunks": len(tiers) / hist_chunks if hist_chunks else None,
            "ttft_ge2_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "ttft_ge2_p50_s": pct(0.5), "ttft_ge2_p90_s": pct(0.9),
            "prefetch": dataclasses.asdict(st.prefetch) if st.prefetch is not None else None,
            "tiers": {t.name: {"hits": t.hits, "evictions": t.evictions,
                               "promotions": t.promotions, "loaded_chunks": t.loaded_chunks,
                               "demotions_in": t.demotions_in, "demotions_out": t.demotions_out,
                               "demotion_drops": t.demotion_drops,
                               "written_bytes": t.written_bytes}
                      for t in st.tiers}},
        "settings": {"chunk_tokens": c, "chunk_bytes": self.chunk_bytes,
                     "host_chunks": _LLM_HOST.value, "disk_bytes_per_s": _LLM_DISK_BW.value,
                     "max_num_seqs": _LLM_SEQS.value, "max_tokens": _LLM_MAX_TOKENS.value,
                     "dtype_bytes": self.dtype_bytes}}


def advance_interleaved(reps: list, rounds: range) -> None:
  """Advances every replay through the conversation rounds, all replays round t before any
  round t + 1, their order rotated per round (A B C, B C A, ...: `benchlib.interleaved_rounds`),
  so a drift of the machine's load falls on every configuration alike."""
  orders = benchlib.interleaved_rounds(list(range(len(reps))), len(rounds))
  for t, order in zip(rounds, orders):
    for k in order:
      reps[k].round(t)


def run_llm() -> None:
  import tempfile  # noqa: PLC0415
  import shutil  # noqa: PLC0415
  convs = session_replay.load_conversations(pathlib.Path(_DATA.value) / TRACE, _LLM_CONVS.value,
                                            _LLM_TURNS.value, _LLM_CHARS.value, _SEED.value)
  at_start = machine()
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-bench-lookahead-"))
  try:
    # A first, discarded replay compiles every program shape (later LLMs load them from the
    # compilation cache), so neither measured run pays compilation.
    rounds = range(max(len(cv) for cv in convs))
    warm = _Replay(_LLM_WINDOW.value, convs, tmp / "warmup")
    for t in rounds:
      warm.round(t)
    warm = warm.result()
    # The two engines advance round by round in turn, which goes first alternating, so the
    # shared machine's load falls on both.
    reps = [_Replay(w, convs, tmp / f"disk-{k}") for k, w in enumerate((0, _LLM_WINDOW.value))]
    advance_interleaved(reps, rounds)
    runs = [rep.result() for rep in reps]
    same = all(a["output_token_ids"] == b["output_token_ids"]
               for a, b in zip(runs[0]["rows"], runs[1]["rows"]))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  print(f"bench_sessions --llm_lookahead: {len(convs)} ShareGPT conversations x up to "
        f"{_LLM_TURNS.value} turns, {_LLM_SEQS.value} running at once, host tier "
        f"{_LLM_HOST.value} chunks of {_LLM_CHUNK.value} tokens over disk "
        f"({_LLM_DISK_BW.value / 1e6:g} MB/s emulated), device prefix cache off")
  head = (f"{'window':>6} {'hist chunks':>11} {'host':>5} {'disk':>5} {'host rate':>9} "
          f"{'TTFT p50':>9} {'TTFT mean':>9} {'issued':>6} {'useful':>6} {'wasted':>6}")
  print(head)
  for r in runs:
    s, pf = r["summary"], r["summary"]["prefetch"]
    print(f"{r['window']:>6} {s['history_chunks_ge2']:>11} {s['host_loaded_chunks_ge2']:>5} "
          f"{s['disk_loaded_chunks_ge2']:>5} {s['host_hit_rate_of_history_chunks']:>9.3f} "
          f"{s['ttft_ge2_p50_s']:>9.3f} {s['ttft_ge2_mean_s']:>9.3f} {pf['issued']:>6} "
          f"{pf['useful']:>6} {pf['wasted']:>6}")
  base, la = runs[0]["summary"], runs[1]["summary"]
  ratio = la["ttft_ge2_p50_s"] / base["ttft_ge2_p50_s"] if base["ttft_ge2_p50_s"] else None
  print(f"TTFT p50 of turns >= 2, window {_LLM_WINDOW.value} / window 0: {ratio:.3f}; "
        f"greedy outputs identical across the two: {same}")
  write_llm_record("bench_sessions_llm_lookahead", at_start, len(convs), same, runs, plot_llm,
                   ttft_p50_ratio_window_over_0=ratio,
                   order="the two engines alternate round by round (both in one process), "
                         "the first of a round rotating (benchlib.interleaved_rounds)",
                   warmup_run={"window": warm["window"],
                               "generate_wall_s": warm["generate_wall_s"],
                               "note": "discarded: compiles every program shape"})


def write_llm_record(benchmark: str, at_start: dict, n_convs: int, same: bool, runs: list,
                     plot, **fields) -> None:
  """Writes <out>/<benchmark>[_host<N>].json (`start_provenance()`, machines, seeds, `fields`,
  runs) and its plot (`plot(runs, path, n_convs)`)."""
  record = {**start_provenance(), "benchmark": benchmark, "machine_at_run_start": at_start,
            "machine_at_end": machine(), "threads": {"cpu_count": os.cpu_count()},
            "seeds": {"conversations": _SEED.value, "sampling": "greedy"},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "conversations": n_convs, "merge_mode": _LLM_MERGE.value,
            "outputs_identical": same, **fields, "runs": runs}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  name = benchmark + ("" if _LLM_HOST.value == _LLM_HOST.default else f"_host{_LLM_HOST.value}")
  benchlib.write_json(out / f"{name}.json", record)
  plot(runs, out / f"{name}.png", n_convs)
  print(f"wrote {out / (name + '.json')} and .png")


def plot_llm(runs, path: pathlib.Path, n_convs: int) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
  labels = [f"window {r['window']}" for r in runs]
  host = [r["summary"]["host_loaded_chunks_ge2"] for r in runs]
  disk = [r["summary"]["disk_loaded_chunks_ge2"] for r in runs]
  a.bar(labels, host, label="from host")
  a.bar(labels, disk, bottom=host, label="from disk")
  a.set_ylabel("history chunks loaded, turns >= 2")
  a.legend(fontsize=8)
  for i, r in enumerate(runs):
    ys = sorted(x["ttft_s"] for x in r["rows"] if x["turn"] >= 2)
    b.plot([j / max(1, len(ys) - 1) for j in range(len(ys))], ys, marker=".",
           label=labels[i])
  b.set_xlabel("quantile")
  b.set_ylabel("TTFT, turns >= 2 (s)")
  b.legend(fontsize=8)
  fig.suptitle(f"bench_sessions --llm_lookahead: {n_convs} ShareGPT conversations, real engine, "
               f"{os.cpu_count()} CPU cores", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def run_llm_placement() -> None:
  import tempfile  # noqa: PLC0415
  import shutil  # noqa: PLC0415
  convs = session_replay.load_conversations(pathlib.Path(_DATA.value) / TRACE, _LLM_CONVS.value,
                                            _LLM_TURNS.value, _LLM_CHARS.value, _SEED.value)
  configs = []
  for spec in _LLM_CONFIGS.value:
    if spec == "none":
      configs.append(dict(window=0, store_on=False))
      continue
    try:
      placement, eviction, window = spec.split(":")
      configs.append(dict(window=int(window), placement=placement, eviction=eviction))
    except ValueError as e:
      raise app.UsageError(f"--llm_configs entry {spec!r}: want placement:eviction:window "
                           f"or none ({e})") from e
  at_start = machine()
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-bench-placement-"))
  rounds = range(max(len(cv) for cv in convs))
  runs = []
  try:
    warm = _Replay(_LLM_WINDOW.value, convs, tmp / "warmup")  # compiles every program shape
    for t in rounds:
      warm.round(t)
    warm = warm.result()
    reps = [_Replay(convs=convs, disk=tmp / f"disk-{k}", **cfg) for k, cfg in enumerate(configs)]
    advance_interleaved(reps, rounds)
    for rep in reps:
      runs.append(rep.result())
      print(f"  done {runs[-1]['label']}: {runs[-1]['generate_wall_s']:.0f} s", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  ref = runs[0]["rows"]
  same = all([a["output_token_ids"] for a in r["rows"]] == [a["output_token_ids"] for a in ref]
             for r in runs)
  print(f"bench_sessions --llm_placement: {len(convs)} ShareGPT conversations x up to "
        f"{_LLM_TURNS.value} turns, {_LLM_SEQS.value} running at once, host tier "
        f"{_LLM_HOST.value} chunks of {_LLM_CHUNK.value} tokens over disk "
        f"({_LLM_DISK_BW.value / 1e6:g} MB/s emulated), device prefix cache off")
  head = (f"{'config':>22} {'hist':>5} {'host':>5} {'disk':>5} {'host share':>10} "
          f"{'disk MB written':>15} {'demoted':>7} {'TTFT p50':>9} {'TTFT mean':>9}")
  print(head)
  for r in runs:
    s = r["summary"]
    disk = s["tiers"].get("disk", {})
    host = s["tiers"].get("host", {})
    r["summary"]["disk_written_bytes"] = disk.get("written_bytes", 0)
    share = s["host_hit_rate_of_history_chunks"] or 0.0
    print(f"{r['label']:>22} {s['history_chunks_ge2']:>5} {s['host_loaded_chunks_ge2']:>5} "
          f"{s['disk_loaded_chunks_ge2']:>5} {share:>10.3f} "
          f"{disk.get('written_bytes', 0) / 1e6:>15.2f} {host.get('demotions_out', 0):>7} "
          f"{s['ttft_ge2_p50_s']:>9.3f} {s['ttft_ge2_mean_s']:>9.3f}")
  print(f"greedy outputs identical across all {len(runs)} configurations: {same}")
  write_llm_record("bench_sessions_llm_placement", at_start, len(convs), same, runs,
                   plot_llm_placement, configs=list(_LLM_CONFIGS.value),
                   order="every configuration's fresh LLM in this process, advancing "
                         "conversation round by round in turn, the order rotated per round "
                         "(benchlib.interleaved_rounds)",
                   warmup_run={"label": warm["label"], "generate_wall_s": warm["generate_wall_s"],
                               "note": "discarded: compiles every program shape"})


def plot_llm_placement(runs, path: pathlib.Path, n_convs: int) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
  short = {"write_through": "WT", "write_back": "WB"}
  labels = [":".join(short.get(x, x) for x in r["label"].split(":")) for r in runs]
  host = [r["summary"]["host_loaded_chunks_ge2"] for r in runs]
  disk = [r["summary"]["disk_loaded_chunks_ge2"] for r in runs]
  a.bar(labels, host, label="from host")
  a.bar(labels, disk, bottom=host, label="from disk")
  a.set_ylabel("history chunks loaded, turns >= 2")
  a.legend(fontsize=8)
  b.bar(labels, [r["summary"]["tiers"].get("disk", {}).get("written_bytes", 0) / 1e6
                 for r in runs])
  b.set_ylabel("disk MB written")
  c.bar(labels, [r["summary"]["ttft_ge2_p50_s"] or 0 for r in runs])
  c.set_ylabel("TTFT p50, turns >= 2 (s)")
  c.set_title("runs in sequence on a shared machine: noisy", fontsize=8)
  for ax in (a, b, c):
    ax.tick_params(axis="x", labelsize=7)
  fig.suptitle(f"bench_sessions --llm_placement: {n_convs} ShareGPT conversations, real engine, "
               f"{os.cpu_count()} CPU cores", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


MODES = {"sim": (_SIM, run_sim), "gap": (_GAP, run_gap), "server": (_SERVER, run_server),
         "llm": (_LLM, run_llm),
         "llm_placement": (_LLM_PLACEMENT, run_llm_placement)}


def main(argv):
  del argv
  start_provenance()
  chosen = [run for flag, run in MODES.values() if flag.value]
  if not chosen:
    raise app.UsageError(f"no mode selected; pass one of: {', '.join('--' + m for m in MODES)}")
  for run in chosen:
    run()


if __name__ == "__main__":
  app.run(main)
