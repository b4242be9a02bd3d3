"""Cake on the real engine: TTFT of compute-only, load-only and kvjax (the Cake merge).

The proof of kvjax's core idea (docs/design/cake.md; Cake, arXiv 2410.03065, Tables 3
and 4, section 5.8). Everything runs through one `LLM` engine per codec: the real
SmolLM2-135M-Instruct in f32 on the CPU, a real LongChat prompt truncated to each sequence length,
its chunks stored in advance in a file store (run once with the store, flushed), and the store's
link emulated by the store's own `LinkLimiter`.

    .venv/bin/python scripts/bench_cake.py --quick            # 2K/4K, 100%, raw, 3 rounds
    .venv/bin/python scripts/bench_cake.py                    # the full plan (about an hour)
    .venv/bin/python scripts/bench_cake.py --lengths 2048,4096 --shares 100 --ratios 1/2,1,2
    .venv/bin/python scripts/bench_cake.py --quick --restoring 1,4 [--busy]  # 4 at once

How each number is made:
  * Modes. One engine; each run's long request carries its merge mode
    (`Engine.add_request(..., merge_mode=...)`: "compute_only", "load_only", "cake"), and the
    script re-arms the link in place with `LinkLimiter.reset(rate)` (a trace is re-armed at the
    request's arrival, so it lines up with the request). Building a fresh `LLM` per bandwidth
    would cost a model load and a compile per cell. The cost model is the engine's own and stays
    warm across runs (a server that has been running).
  * Timing: the engine's step records, nothing wrapped. `Engine.add_step_observer` gets one
    `StepRecord` per step: the scheduler's plan (`SchedulerOutput`), the executor's `StepResult`
    and the loop's own timing. Prefill calls are `StepResult.compute` (`ComputeTiming`: start,
    tokens, measured seconds with the device work, request id), insertions `StepResult.inserts`
    (`InsertTiming`; the bench sets `Engine.timed_inserts` so they include the device work),
    landings `StepResult.loads` (`LoadReport`: start, landing, bytes, ok), planner time
    `StepRecord.planner_s`; the lookup is `RequestMetrics.lookup_s`. The engine clock is
    `time.perf_counter`, so all of them share the request's arrival as time origin. Each
    `LLM`'s last `Engine.stats()` (loop, loader, saver accounting) is in the JSON's
    `engine_stats`.
  * Warm-up. `LLM(...)` compiles every prefill size, the decode step, the insert and the encode
    at construction (`compile_on_init`; `warmup.compile_s` is that construction, model load
    included); then the store run (the longest prompt computed once and saved, then flushed),
    and one load-only run on an unlimited link (the insert/decode path) run before anything is
    timed.
  * Compute share. A step's token budget is 512. At share s the long request gets s * 512
    tokens of each step: before every step the script submits real ShareGPT prompts whose
    lengths add up to exactly (1 - s) * 512 tokens (pieces of compiled sizes, each request under
    one store chunk so nothing of theirs is stored or hit, `max_tokens=1`). The scheduler runs
    ordinary prefills first and they finish within their step, so each step spends
    (1 - s) * 512 tokens on them and the Cake side gets the rest (Cake section 4, adaptive mode).
  * B*. Per (codec, length, share): B* = stored bytes of the prefix / compute-only prefix time,
    both from this run (the compute-only run at that share). The sweep sets the link at
    B* x ratio.
  * Order: interleaved rounds. Per block, one compute-only run fixes B*; then the block's
    settings (compute-only, and load-only and kvjax at each bandwidth) run in --rounds rounds,
    each round the previous one's order rotated by one (`benchlib.interleaved_rounds`: A B C,
    B C A, C A B), so a drift of the machine's load spreads over every setting. The engine's
    cost model is warm and learns the link as loads land; a run sees the link the run before it
    used until its own loads land (a server whose link changes).
  * Fair comparison. Per cell and setting the JSON has the median, min, max and spread
    ((max - min) / median) over the rounds (`summary`, `benchlib.summarize`); TTFTs in the
    table are those medians. Each round's compute-only and load-only runs give that round's
    ideal bound, summarized the same way. Each run records `cpu_cores`: this process's CPU
    seconds per wall second (its CPU share; 2.0 is both cores) and the load average. A cell
    whose kvjax median beats its bound's median by more than the larger spread
    (`benchlib.below_bound`) is `invalid`: a measurement error (the settings got different
    shares of the machine), left out of the targets, the summary line and the plot title.
  * Loader depth. The default (--max_loads_in_flight unset: LLM's kv_max_loads_in_flight=None):
    the scheduler queues each merge's loads ahead by the link's bandwidth-delay product over a
    step and the store client starts the next the moment one lands, so a multi-second CPU step
    no longer idles the link. (Before the one-loop engine, loads started only between steps and
    this bench ran with 8 in flight.)
  * Several restoring (--restoring 1,4). Each grid block runs once per N: every run submits
    N long prompts together (LongChat rows --prompt_index ..+N-1 cut to the cell's length, all
    stored in advance), in the run's merge mode, sharing the link and the budget (the scheduler
    plans them jointly: docs/design/cake.md). B* stays one prompt's (the block's first
    compute-only run is of one prompt). A cell's `ttft_*_s` are the means over the N, each
    run's per-request TTFTs in `ttft_per_request_reps_s`; its bound is the matching N = 1
    cell's (a request sharing the machine cannot beat its bound alone, so neither can the
    mean), so N = 1 runs first; without one the cell has no bound and no validity check. The
    per-run details (`runs`, `ideal`, `compute_slowdown`) are the first request's.
  * Busy machine (--busy): a competing CPU load (one busy-looping python process, this
    script's child) runs during each grid block's settings; cells say `busy`.
  * Censoring. A load-only run that passes --load_only_cap x the compute-only TTFT is stopped:
    its TTFT is reported as a lower bound (`ttft_load_only_s` null, `ttft_load_only_min_s`),
    which never changes the better baseline (compute-only is already faster there). This is
    what lets slow links fit in the time; --load_only_cap 0 measures every load-only run fully.
  * Ideal bound. `kvjax.scheduler.cake.ideal_merge_s`: C(m) is when the compute-only run had
    the first m chunks (the engine's per-call prefill times; a call spanning several chunks is
    split in proportion to the cost model's prediction), L(k) is when the load-only run had the
    last k chunks landed (loader arrival times). Lookup, suffix compute and first-token sampling
    are measured on their own and added: ideal = lookup + min_m max(C(m), L(N - m)) + suffix +
    first token.
  * Compute slowdown under loads: each prefill call of the long request is divided by a least
    squares fit t = a + b n + c n m to the compute-only run's calls; calls during which a load
    was in flight are compared with calls during which none was.
  * Planner overhead: `StepRecord.planner_s`, seconds in `Scheduler.schedule` plus
    `Scheduler.update` (all `CakeMerge` calls happen inside them) per engine step of the kvjax
    runs (Cake section 5.8).
  * Fluctuation: random link traces (kv_link_trace format, written to --out) and a random
    compute-share trace (changed between steps), each mode once (not in rounds, never a
    headline). Adaptive burst: one long request with a stored
    prefix plus 22 ShareGPT requests of 32-448 tokens arriving together; time until all finish.

Writes <out>/<--name>.json (default cake.json; `{"cells": [...], ...}`), <out>/<--name>.png (speedup heatmap in the shape
of Cake's Table 3, and kvjax/ideal) and prints the tables.

What changed with the one-loop engine (the JSON keys are otherwise those of earlier results):
the script used to wrap about a dozen engine, runner, store and `CakeMerge` methods to time
them; it now only reads the step records. `planner_overhead` has `planner_ms_mean/p50/p99/max`
(schedule plus update) in place of the separate `schedule_ms_*` and `cakemerge_ms_*`; each run's
`steps` are (t0, t1, planner_s); `settings.max_loads_in_flight` is null (derived) by default;
`warmup.compile_s` is the `LLM(...)` construction; `engine_stats` is new. `--report` reads files
of either shape.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app, flags, logging

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's kvjax, not another one an editable install names
# ../shared/data from the project root (a worktree one level deeper finds it one further up).
DATA = next((d for d in (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data")
             if d.is_dir()), REPO.parent / "shared" / "data")
MODES = ("compute_only", "load_only", "cake")

_QUICK = flags.DEFINE_bool("quick", False, "2K and 4K, share 100%, raw, B* x {1/4, 1, 4}; grid "
                           "only; 44 runs at 3 rounds.")
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096", "6144", "8188"],
                             "Sequence lengths (tokens) at share 100%. 8K is 8188 so prompt plus "
                             "output stays inside the 8192-token context.")
_SHARES = flags.DEFINE_list("shares", ["100", "87.5", "50", "12.5"],
                            "Compute shares of the step budget, percent.")
_RATIOS = flags.DEFINE_list("ratios", ["1", "2", "1/2", "4", "1/4", "8", "1/8"],
                            "Bandwidths as B/B*, at share 100% (run in this order).")
_SUB_LENGTHS = flags.DEFINE_list("sub_lengths", ["2048", "4096"],
                                 "Lengths for shares below 100%.")
_SUB_RATIOS = flags.DEFINE_list("sub_ratios", ["1", "4", "1/4"],
                                "Bandwidth ratios for shares below 100%.")
_CODECS = flags.DEFINE_list("codecs", ["raw", "int8", "int4", "cachegen"],
                            "Codecs (LLM(kv_codec=...)); non-raw ones near balance only.")
_CODEC_LENGTHS = flags.DEFINE_list("codec_lengths", ["4096"], "Lengths for non-raw codecs.")
_CODEC_RATIOS = flags.DEFINE_list("codec_ratios", ["1", "2", "1/2"],
                                  "Bandwidth ratios for non-raw codecs (share 100%).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every block's settings "
                               "(medians and spreads over them); at least 3 for a headline.")
_LOAD_ONLY_CAP = flags.DEFINE_float("load_only_cap", 1.5, "Stop a load-only run after this many "
                                    "compute-only TTFTs (reported as a lower bound); 0: never.")
_EXPERIMENTS = flags.DEFINE_list("experiments", ["grid", "codecs", "fluctuation", "burst"],
                                 "Which parts to run.")
_FLUCT_LENGTH = flags.DEFINE_integer("fluct_length", 4096, "Sequence length of the "
                                     "fluctuation experiment.")
_FLUCT_SEEDS = flags.DEFINE_integer("fluct_seeds", 2, "Random traces in the fluctuation "
                                    "experiment.")
_BURST_LENGTH = flags.DEFINE_integer("burst_length", 4096, "Long request of the burst.")
_BURST_SHORTS = flags.DEFINE_integer("burst_shorts", 22, "Short requests of the burst.")
_BURST_MAX_TOKENS = flags.DEFINE_integer("burst_max_tokens", 8, "Output tokens per burst request.")
_BUDGET = flags.DEFINE_integer("budget", 512, "Token budget per engine step.")
_CHUNK = flags.DEFINE_integer("chunk_size", 256, "Tokens per stored chunk.")
_IN_FLIGHT = flags.DEFINE_integer(
    "max_loads_in_flight", None, "LLM(kv_max_loads_in_flight): loads issued ahead per request "
    "(and its reads at once). Default None: the engine derives them from the link's "
    "bandwidth-delay product and the store client refills them as they land.")
_PROMPT_FILE = flags.DEFINE_string(
    "prompt_file", str(DATA / "longchat" / "topics_15.jsonl"),
    "LongChat JSONL with the long prompt (topics_10 prompts are only 5.3-5.7K SmolLM2 tokens; "
    "topics_15 has 8.2-8.3K, enough for 8K).")
_PROMPT_INDEX = flags.DEFINE_integer("prompt_index", 0, "Which prompt of --prompt_file.")
_SHAREGPT = flags.DEFINE_string("sharegpt", str(DATA / "sharegpt" /
                                                "sharegpt_v3_multiturn_1000.json"),
                                "ShareGPT JSON for competing and burst prompts.")
_STORE_DIR = flags.DEFINE_string("store_dir", None, "Where the file stores go (default: a "
                                 "temporary folder, removed at the end).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the traces, the burst lengths and the engine.")
_DEADLINE = flags.DEFINE_float("deadline_s", 0, "Start no new block after this many seconds "
                               "(0: none); what ran is written.")
_REPORT = flags.DEFINE_string("report", None, "Only re-evaluate and print an existing cake.json "
                               "(tables, targets, plot next to it); runs nothing.")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results"), "Output folder.")
_RESTORING = flags.DEFINE_list(
    "restoring", ["1"], "Grid blocks for each N: N long prompts (LongChat rows --prompt_index "
    "..+N-1, cut to the cell's length, each stored) arrive together in every run and share the "
    "link and the budget; a cell's TTFTs are the mean over the N (per-request beside).")
_BUSY = flags.DEFINE_bool("busy", False, "A competing CPU load (one busy-looping process) runs "
                          "during every grid block's settings.")
_LAYER_SPLIT = flags.DEFINE_list(
    "layer_split", ["off"], "Cake settings per grid cell: 'off' (token-only, the default "
    "kv_layer_split) and optionally 'auto': the LLM is then built with kv_layer_split='auto', "
    "its token-only runs ask add_request(layer_split=False), and the split runs join the rounds "
    "as setting cake_split (N = 1 blocks only: jointly planned merges never split).")
_NAME = flags.DEFINE_string("name", "cake", "Stem of the output files (<out>/<name>.json, .png).")


def fraction(text: str) -> float:
  num, _, den = text.partition("/")
  return float(num) / float(den or 1)


# ----------------------------------------------------------------------------- the step stream
@dataclasses.dataclass
class Recorder:
  """What the engine's step records said during one run (perf_counter seconds, the engine clock).

  `observe` is registered with `Engine.add_step_observer`: after every step it gets the step's
  `StepRecord` (the scheduler's plan, the executor's `StepResult`, the loop's timing) and keeps
  the plain numbers below. Nothing of the engine is wrapped or replaced.
  """

  prefills: list = dataclasses.field(default_factory=list)   # (rid, start, n, t0, t1)
  inserts: list = dataclasses.field(default_factory=list)    # (rid, index, t0, t1)
  landings: list = dataclasses.field(default_factory=list)   # (rid, index, start, done, nbytes, ok)
  steps: list = dataclasses.field(default_factory=list)      # (t0, t1, planner_s)

  def clear(self) -> None:
    for f in dataclasses.fields(self):
      getattr(self, f.name).clear()

  def observe(self, record) -> None:
    """One `kvjax.engine.core.StepRecord`."""
    res = record.result
    for c in res.compute:  # ComputeTiming: measured wall seconds of one prefill chunk
      self.prefills.append((c.request_id, c.start, c.num_tokens, c.started_s,
                            c.started_s + c.seconds))
    for i in res.inserts:  # InsertTiming (device work included: Engine.timed_inserts)
      self.inserts.append((i.request_id, i.index, i.started_s, i.started_s + i.seconds))
    for r in res.loads:    # LoadReport; a released load that never started has no times
      if r.started_s > 0:
        self.landings.append((r.request_id, r.index, r.started_s, r.done_s, r.nbytes, r.ok))
    self.steps.append((record.started_s, record.ended_s, record.planner_s))


#: Cost of a prefill call when no call was measured to fit one (in proportion to tokens).
_LINEAR_COST = (0.0, 1.0, 0.0)


# ----------------------------------------------------------------------------- prompts
def long_prompt(tok, n_max: int, index: int | None = None) -> tuple[list[int], str]:
  """Token ids of the LongChat prompt (row `index`, default --prompt_index; at least `n_max`
  of them) and where it came from."""
  index = _PROMPT_INDEX.value if index is None else index
  with open(_PROMPT_FILE.value, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  if index >= len(rows):
    raise app.UsageError(f"{_PROMPT_FILE.value} has {len(rows)} prompts; row {index} needed "
                         "(--restoring takes one row per request)")
  ids = tok.encode(rows[index]["prompt"], add_special_tokens=False)
  if len(ids) < n_max:
    raise app.UsageError(f"{_PROMPT_FILE.value}[{index}] has {len(ids)} tokens; "
                         f"{n_max} needed (use topics_15.jsonl for 8K)")
  return ids, f"{os.path.basename(_PROMPT_FILE.value)}[{index}]"


def start_busy():
  """--busy: a competing CPU load, one python process spinning (this script's child)."""
  import subprocess  # noqa: PLC0415
  return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def stop_busy(proc) -> None:
  """Ends the process `start_busy` started (None: nothing to end)."""
  if proc is not None:
    proc.kill()
    proc.wait()


class TokenPool:
  """Consecutive slices of real ShareGPT text (human turns), for competing and burst prompts."""

  def __init__(self, tok, path: str, max_tokens: int = 200_000):
    with open(path, encoding="utf-8") as f:
      convs = json.load(f)
    ids: list[int] = []
    for c in convs:
      for turn in c["conversations"]:
        if turn["from"] == "human":
          ids += tok.encode(turn["value"], add_special_tokens=False)
      if len(ids) >= max_tokens:
        break
    self.ids = ids
    self.pos = 0

  def take(self, n: int) -> list[int]:
    if self.pos + n > len(self.ids):
      self.pos = 0
    out = self.ids[self.pos:self.pos + n]
    self.pos += n
    return out


def competitor_sizes(tokens: int, chunk: int, sizes: tuple[int, ...]) -> list[int]:
  """Prompt lengths adding up to `tokens`, each below one store chunk (never stored, never a
  hit) and made of few compiled sizes: binary pieces of at most chunk/2, first-fit packed."""
  cap = max(s for s in sizes if s <= chunk // 2)
  pieces, rem = [], tokens
  while rem > 0:
    p = max((s for s in sizes if s <= min(rem, cap)), default=rem)
    pieces.append(p)
    rem -= p
  bins: list[int] = []
  for p in sorted(pieces, reverse=True):
    for i, b in enumerate(bins):
      if b + p < chunk:
        bins[i] += p
        break
    else:
      bins.append(p)
  return bins


# ----------------------------------------------------------------------------- one engine
@dataclasses.dataclass
class Run:
  """One timed request through the engine (times relative to its arrival, seconds)."""

  mode: str
  seq_len: int
  ttft_s: float | None
  censored: bool
  lookup_s: float
  first_token_id: int | None
  merge: dict | None
  num_loaded_tokens: int
  num_computed_tokens: int
  prefills: list      # (start, n, t0, t1) of the long request
  landings: list      # (index, start, done, nbytes, ok) of the long request
  inserts: list       # (t0, t1) of every insert (the long request's: only it loads)
  steps: list         # (t0, t1, planner_s) of every engine step
  other_prefills: list  # (start, n, t0, t1) of competing requests
  wall_s: float
  cpu_cores: float      # this process's CPU share: CPU s per wall s (2.0: both cores ours)
  loadavg_1m: float
  ttft_per_request_s: list = dataclasses.field(default_factory=list)  # every long request's
  first_tokens: list = dataclasses.field(default_factory=list)        # their first token ids
  meeting_points: list = dataclasses.field(default_factory=list)      # their merges' meetings

  @property
  def ttft_mean_s(self) -> float | None:
    """The mean TTFT over the long requests (None when one has none: censored); `ttft_s` for
    a run that lists none (one long request)."""
    v = self.ttft_per_request_s
    if not v:
      return self.ttft_s
    return None if None in v else sum(v) / len(v)

  def summary(self) -> dict:
    return {"mode": self.mode, "ttft_s": self.ttft_s, "censored": self.censored,
            "lookup_s": self.lookup_s, "first_token_id": self.first_token_id,
            "num_loaded_tokens": self.num_loaded_tokens,
            "num_computed_tokens": self.num_computed_tokens, "merge": self.merge,
            "insert_s": sum(t1 - t0 for t0, t1 in self.inserts), "num_steps": len(self.steps),
            "wall_s": self.wall_s, "cpu_cores": self.cpu_cores, "loadavg_1m": self.loadavg_1m,
            "ttft_per_request_s": self.ttft_per_request_s, "first_tokens": self.first_tokens,
            "meeting_points": self.meeting_points,
            "prefill_calls": [[s, n, round(a, 4), round(b, 4)] for s, n, a, b in self.prefills],
            "landings": [[j, round(a, 4), round(b, 4), nb] for j, a, b, nb, _ in self.landings]}


class Bench:
  """One LLM (one codec, one store) with its link, step recorder and competing-prompt pool."""

  def __init__(self, codec: str, store_root: pathlib.Path, pool: TokenPool,
               layer_split: str = "off"):  # the LLM's kv_layer_split
    from kvjax import LLM  # noqa: PLC0415
    self.codec = codec
    self.store_url = f"file://{store_root / codec}"
    kw: dict[str, Any] = {}
    if codec != "raw":
      kw = {"kv_codec": codec, "kv_codec_levels": [0]}
    self.competitors_max = 3
    t0 = time.perf_counter()  # LLM(...) loads the model and compiles everything (compile_on_init)
    self.llm = LLM(kv_store=self.store_url, kv_chunk_size=_CHUNK.value,
                   max_num_batched_tokens=_BUDGET.value, max_num_seqs=1 + self.competitors_max,
                   kv_max_loads_in_flight=_IN_FLIGHT.value, seed=_SEED.value,
                   enable_prefix_caching=False,  # no device prefix cache: every request
                   kv_layer_split=layer_split,   # reads the store
                   **kw)
    self.init_s = time.perf_counter() - t0
    self.engine = self.llm.engine
    self.engine.timed_inserts = True  # InsertTiming includes the device work
    self.tok = self.llm.get_tokenizer()
    (self.limiter,) = self.llm.kv_store.store.limiters.values()
    self.rec = Recorder()
    self.engine.add_step_observer(self.rec.observe)
    self.pool = pool
    self.chunk_sizes = tuple(self.engine.runner.chunk_sizes)
    self._rid = 0

  def rid(self, tag: str) -> str:
    self._rid += 1
    return f"{tag}-{self._rid}"

  def quiesce(self) -> None:
    """Waits for saves, for cancelled loads to drain, and collects garbage (off the clock)."""
    self.llm.flush()
    t0 = time.perf_counter()
    while self.llm.kv_store.loads_in_flight() and time.perf_counter() - t0 < 30:
      time.sleep(0.05)
    gc.collect()

  def prefix_bytes(self, ids: list[int]) -> tuple[int, list[int]]:
    """Stored bytes of the prefix chunks (one lookup; this codec's level-0 encodings)."""
    lk = self.llm.kv_store.lookup(ids, None)
    per = []
    for hit, rec in zip(lk.hits, lk.records or [None] * len(lk.hits)):
      if not hit:
        raise RuntimeError(f"{self.codec}: a prefix chunk of the {len(ids)}-token prompt is not "
                           "stored; the store run failed")
      if rec is None:
        per.append(self.llm.kv_store.layout.nbytes)
      else:
        per.append(min(e.nbytes for e in rec.encodings if e.codec == self.codec))
    return sum(per), per

  def run(self, mode: str, ids: list[int], *, share_at: Callable[[float], float] = lambda t: 1.0,
          link: tuple | None = None, cap_s: float | None = None, max_tokens: int = 1,
          more: list[list[int]] = (), layer_split: bool = False) -> Run:
    """Runs one long request in `mode` to its first token, competing prompts holding the share.

    Args:
      more: other long requests (their prompts) that arrive with it in the same mode and share
        the link and the budget (`--restoring`); the run ends when every one has its first
        token, and `ttft_per_request_s` has each (the first's detail is the run's).
      link: None (unlimited), ("rate", bytes/s) or ("trace", steps).
      share_at: compute share in (0, 1] at a time since arrival.
      cap_s: abort after this many seconds (the run is then `censored`).
      layer_split: the long requests may split a chunk along layers (an LLM built with
        kv_layer_split="auto"; `Engine.add_request(layer_split=...)`).
    """
    from kvjax import SamplingParams  # noqa: PLC0415
    eng, rec = self.engine, self.rec
    self.quiesce()
    rec.clear()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    if link is None:
      self.limiter.reset()
    elif link[0] == "rate":
      self.limiter.reset(link[1])
    else:
      self.limiter.reset(trace=link[1])
    load1 = os.getloadavg()[0]
    clock = benchlib.CpuClock()
    t_arr = time.perf_counter()
    rid = eng.add_request(ids, greedy, request_id=self.rid(mode), merge_mode=mode,
                          layer_split=layer_split)
    add_s = time.perf_counter() - t_arr  # the lookup, for a run aborted before its metrics
    longs = [rid] + [eng.add_request(x, greedy, request_id=self.rid(mode), merge_mode=mode,
                                     layer_split=layer_split) for x in more]
    done: dict[str, Any] = {}
    live: set[str] = set()
    result, censored = None, False
    while len(done) < len(longs):
      el = time.perf_counter() - t_arr
      if cap_s is not None and el > cap_s:
        for x in longs:
          if x not in done:
            eng.abort_request(x)
        censored = True
        break
      if not live:
        tokens = int(round((1.0 - share_at(el)) * _BUDGET.value))
        for n in competitor_sizes(tokens, _CHUNK.value, self.chunk_sizes) if tokens else []:
          live.add(eng.add_request(self.pool.take(n), one, request_id=self.rid("other")))
      outs = eng.step()
      for o in outs:
        if o.finished:
          live.discard(o.request_id)
          if o.request_id in longs:
            done[o.request_id] = o
    result = done.get(rid)
    for other in live:
      eng.abort_request(other)
    share_of_cpu = clock.read()
    wall = time.perf_counter() - t_arr
    if result is not None:  # the engine's own arrival (same clock), so TTFT and times agree
      t_arr = result.metrics.arrival_s
    mine = [(s, n, a - t_arr, b - t_arr) for r, s, n, a, b in rec.prefills if r == rid]
    others = [(s, n, a - t_arr, b - t_arr) for r, s, n, a, b in rec.prefills if r != rid]
    lands = [(j, a - t_arr, b - t_arr, nb, ok) for r, j, a, b, nb, ok in rec.landings if r == rid]
    m = result.metrics if result is not None else None
    return Run(
        mode=mode, seq_len=len(ids), ttft_s=m.ttft_s if m else None, censored=censored,
        lookup_s=m.lookup_s if m else add_s,
        first_token_id=result.token_ids[0] if result is not None else None,
        merge=dataclasses.asdict(m.merge) if m is not None and m.merge is not None else None,
        num_loaded_tokens=m.num_loaded_tokens if m else 0,
        num_computed_tokens=m.num_computed_tokens if m else 0,
        prefills=mine, landings=lands,
        inserts=[(a - t_arr, b - t_arr) for _, _, a, b in rec.inserts],
        steps=[(a - t_arr, b - t_arr, p) for a, b, p in rec.steps],
        other_prefills=others, wall_s=wall, cpu_cores=share_of_cpu["cpu_share"], loadavg_1m=load1,
        ttft_per_request_s=[done[x].metrics.ttft_s if x in done else None for x in longs],
        first_tokens=[done[x].token_ids[0] if x in done else None for x in longs],
        meeting_points=[done[x].metrics.merge.meeting_index
                        if x in done and done[x].metrics.merge is not None else None
                        for x in longs])

  def store(self, ids: list[int]) -> float:
    """Computes the prompt once with the store and flushes (Cake's setup); returns seconds."""
    from kvjax import SamplingParams  # noqa: PLC0415
    t0 = time.perf_counter()
    self.llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))
    self.llm.flush()
    return time.perf_counter() - t0

  def warm(self, ids: list[int], short: list[int]) -> dict:
    """Stores `ids`, then runs one load-only request on an unlimited link (the insert/decode
    path). `LLM(...)` compiled every chunk size, decode, insert and encode already: `compile_s`
    is its construction (model load included)."""
    t0 = time.perf_counter()
    store_s = self.store(ids)
    self.run("load_only", short)
    return {"compile_s": self.init_s, "store_s": store_s,
            "warm_s": self.init_s + time.perf_counter() - t0}

  def close(self) -> dict:
    """Closes the LLM; returns its last `Engine.stats()` snapshot (loop, loader, saver), plain."""
    stats = dataclasses.asdict(self.engine.stats())
    self.llm.close()
    return stats


# ----------------------------------------------------------------------------- analysis
def _fit(calls) -> tuple[float, float, float] | None:
  """Least squares t = a + b n + c n m (m: mean position) over (start, n, t0, t1) calls; with
  fewer than 3 calls, seconds per token (b alone); None without calls."""
  import numpy as np  # noqa: PLC0415
  if not calls:
    return None
  if len(calls) < 3:
    return 0.0, sum(t1 - t0 for _, _, t0, t1 in calls) / sum(n for _, n, _, _ in calls), 0.0
  x = np.array([[1.0, n, n * (s + (n - 1) / 2)] for s, n, _, _ in calls])
  y = np.array([t1 - t0 for _, _, t0, t1 in calls])
  coef, *_ = np.linalg.lstsq(x, y, rcond=None)
  return tuple(float(c) for c in coef)


def _pred(coef, s, n) -> float:
  a, b, c = coef
  return max(1e-9, a + b * n + c * n * (s + (n - 1) / 2))


def done_at(run: Run, pos: int, coef) -> float:
  """When positions [0, pos) were all computed (seconds since arrival), splitting a call that
  spans `pos` in proportion to the predicted cost of its part."""
  for s, n, t0, t1 in run.prefills:
    if s < pos <= s + n:
      if pos == s + n:
        return t1
      return t0 + (t1 - t0) * _pred(coef, s, pos - s) / _pred(coef, s, n)
  raise ValueError(f"no prefill call ends the range [0, {pos})")


def cell_analysis(co: Run, lo: Run, kv: Run, n_chunks: int, chunk: int, coef) -> dict:
  """C(m), L(k), the ideal bound and its parts, for one cell."""
  from kvjax.scheduler import ideal_merge_s  # noqa: PLC0415
  n, p = co.seq_len, n_chunks * chunk
  c_of = [0.0] + [done_at(co, (m + 1) * chunk, coef) - co.lookup_s for m in range(n_chunks)]
  t_prefix = done_at(co, p, coef)
  t_all = done_at(co, n, coef)
  suffix_s = t_all - t_prefix
  first_s = co.ttft_s - t_all
  land = {j: b for j, _, b, _, ok in lo.landings if ok}
  l_of = [0.0]
  for k in range(1, n_chunks + 1):
    top = range(n_chunks - k, n_chunks)
    l_of.append(max(land[j] for j in top) - lo.lookup_s if all(j in land for j in top)
                else math.inf)
  merge_s, best_m = ideal_merge_s(c_of, l_of)
  ideal = kv.lookup_s + merge_s + suffix_s + first_s
  return {"ideal_s": ideal, "ideal_m": best_m, "ideal_merge_s": merge_s, "suffix_s": suffix_s,
          "first_token_s": first_s, "c_of_m_s": [round(x, 4) for x in c_of],
          "l_of_k_s": [round(x, 4) if math.isfinite(x) else None for x in l_of],
          "compute_prefix_s": c_of[-1]}


def slowdown(kv_runs: list[Run], coef) -> dict:
  """Prefill calls of the long request with and without loads in flight, over a compute-only fit."""
  with_l, without = [], []
  for r in kv_runs:
    spans = [(a, b) for _, a, b, _, _ in r.landings]
    for s, n, t0, t1 in r.prefills:
      ratio = (t1 - t0) / _pred(coef, s, n)
      busy = any(a < t1 and b > t0 for a, b in spans)
      (with_l if busy else without).append(ratio)
  med = lambda v: statistics.median(v) if v else None  # noqa: E731
  return {"calls_with_loads": len(with_l), "calls_without_loads": len(without),
          "median_time_over_fit_with_loads": med(with_l),
          "median_time_over_fit_without_loads": med(without)}


def _summary_of(values: list[float | None]) -> dict | None:
  """`benchlib.summarize` of the rounds' values, None when a run has none (censored)."""
  return benchlib.summarize(values) if values and None not in values else None


def cell_key(c: dict) -> str:
  n_req = c.get("restoring", 1)
  return (f"{c['codec']}/{c['share']:g}%/{c['seq_len']}/x{c['ratio_text']}"
          + (f"/N{n_req}" if n_req > 1 else "") + ("/busy" if c.get("busy") else ""))


# ----------------------------------------------------------------------------- experiments
def grid_block(bench: Bench, prompts: list[list[int]], n: int, share: float, ratios: list[str],
               rounds: int, bar, restoring: int = 1, alone: list[dict] = (),
               split: bool = False
               ) -> tuple[list[dict], list[Run], list[list[str]]]:
  """One (codec, length, share, N) block: a compute-only run of one prompt that fixes B*, then
  the settings (compute-only; load-only and kvjax per ratio) in `rounds` interleaved rounds,
  each run with `restoring` long prompts (the first `restoring` of `prompts`, cut to `n`)
  arriving together.

  With N > 1 a cell's TTFTs are the means over the N; its bound is the matching N = 1 cell's
  (in `alone`, run before it: sharing the machine cannot make a request beat its bound alone,
  so the mean cannot beat it either), or None (no check) when that cell did not run.

  `split` (--layer_split auto; the bench's LLM has `kv_layer_split="auto"`): Cake runs that
  may split a chunk along layers join the rounds as setting `cake_split@ratio` (the `cake`
  runs ask for token-only), on the same warm engine, and the cell gains their figures
  (`ttft_kvjax_split_s`, `split_over_token_only`: token-only median / split median, above 1
  when the split is faster, and each run's layer splits).

  Returns:
    (one cell per ratio, every kvjax run, the order the settings ran in per round).
  """
  ids = prompts[0][:n]
  more = [x[:n] for x in prompts[1:restoring]]
  chunk = _CHUNK.value
  n_chunks = (n - 1) // chunk
  share_at = lambda t: share / 100  # noqa: E731
  pbytes, per_chunk = bench.prefix_bytes(ids)
  bar.set_description(f"{bench.codec} {n} {share:g}% compute-only for B*")
  calib = bench.run("compute_only", ids, share_at=share_at)
  bar.update(1)
  coef0 = _fit(calib.prefills + calib.other_prefills) or _LINEAR_COST
  b_star = pbytes / (done_at(calib, n_chunks * chunk, coef0) - calib.lookup_s)
  modes = ("load_only", "cake") + (("cake_split",) if split else ())
  settings = ["compute_only"] + [f"{mode}@{r}" for r in ratios for mode in modes]
  order = benchlib.interleaved_rounds(settings, rounds)
  runs: dict[str, list[Run]] = {name: [] for name in settings}
  for k, names in enumerate(order):
    for name in names:
      mode, _, rtext = name.partition("@")
      bar.set_description(f"{bench.codec} {n} {share:g}% round {k + 1}/{rounds} {name}")
      if mode == "compute_only":
        runs[name].append(bench.run(mode, ids, share_at=share_at, more=more))
      elif mode == "cake_split":
        co_ttft = statistics.median(max(x.ttft_per_request_s or [x.ttft_s])
                                    for x in runs["compute_only"] or [calib])
        runs[name].append(bench.run("cake", ids, share_at=share_at,
                                    link=("rate", fraction(rtext) * b_star),
                                    cap_s=3 * co_ttft + 10, more=more, layer_split=True))
      else:
        co_ttft = statistics.median(max(x.ttft_per_request_s or [x.ttft_s])
                                    for x in runs["compute_only"] or [calib])
        if mode == "load_only":
          cap = _LOAD_ONLY_CAP.value * co_ttft if _LOAD_ONLY_CAP.value > 0 else None
        else:
          cap = 3 * co_ttft + 10
        runs[name].append(bench.run(mode, ids, share_at=share_at,
                                    link=("rate", fraction(rtext) * b_star), cap_s=cap,
                                    more=more))
      bar.update(1)
  co_runs = runs["compute_only"]
  co_sum = benchlib.summarize([x.ttft_mean_s for x in co_runs])
  cells, kv_all = [], []
  for rtext in ratios:
    r = fraction(rtext)
    bw = r * b_star
    lo_runs, kv_runs = runs[f"load_only@{rtext}"], runs[f"cake@{rtext}"]
    kv_all += kv_runs
    # Each round's bound from that round's compute-only and load-only runs (C(m) fitted to that
    # compute-only run's calls): the bound saw the machine that round's kvjax run saw.
    anas = [cell_analysis(co, lo, kv, n_chunks, chunk,
                          _fit(co.prefills + co.other_prefills) or _LINEAR_COST)
            for co, lo, kv in zip(co_runs, lo_runs, kv_runs)]
    ideal_sum = benchlib.summarize([a["ideal_s"] for a in anas])
    if restoring > 1:  # the matching N = 1 cell's bound (see the docstring), else none
      one = next((c for c in alone if c.get("restoring", 1) == 1 and c["codec"] == bench.codec
                  and c["share"] == share and c["seq_len"] == n and c["ratio_text"] == rtext
                  and c.get("busy") == _BUSY.value), None)
      ideal_sum = one["summary"]["ideal"] if one is not None else None
    lo_sum = _summary_of([x.ttft_mean_s for x in lo_runs])
    kv_sum = _summary_of([x.ttft_mean_s for x in kv_runs])
    # The round whose bound is the median one stands for the cell's details.
    mid = sorted(range(len(anas)), key=lambda i: anas[i]["ideal_s"])[(len(anas) - 1) // 2]
    co, lo, kv = co_runs[mid], lo_runs[mid], kv_runs[mid]
    co_t = co_sum["median"]
    lo_t = lo_sum["median"] if lo_sum else None
    kv_t = kv_sum["median"] if kv_sum else None
    lo_min = None if lo_t is not None else max(x.wall_s for x in lo_runs)
    best = min(co_t, lo_t) if lo_t is not None else co_t  # a censored load-only is slower
    invalid = (kv_sum is not None and ideal_sum is not None
               and benchlib.below_bound(kv_sum, ideal_sum))
    ideal_t = ideal_sum["median"] if ideal_sum is not None else None
    cell = {
        "seq_len": n, "share": share, "codec": bench.codec, "ratio_text": rtext,
        "restoring": restoring, "busy": _BUSY.value,
        "bandwidth_bytes_per_s": bw, "bandwidth_ratio": r, "b_star_bytes_per_s": b_star,
        "b_star_run": {"ttft_s": calib.ttft_s, "cpu_cores": round(calib.cpu_cores, 3)},
        "prefix_chunks": n_chunks, "prefix_bytes": pbytes, "chunk_bytes": per_chunk[0],
        "cake_tokens_per_step": int(round(share / 100 * _BUDGET.value)),
        "reps": rounds, "rounds": rounds,
        "summary": {"compute_only": co_sum, "load_only": lo_sum, "kvjax": kv_sum,
                    "ideal": ideal_sum},
        "invalid": invalid,
        "ttft_compute_only_s": co_t, "ttft_load_only_s": lo_t,
        "ttft_load_only_min_s": lo_min,
        "ttft_load_only_projected_s": (lo.lookup_s + pbytes / bw + anas[mid]["suffix_s"]
                                       + anas[mid]["first_token_s"]),
        "ttft_kvjax_s": kv_t, "ttft_ideal_s": ideal_t,
        "ttft_compute_only_reps_s": [x.ttft_mean_s for x in co_runs],
        "ttft_load_only_reps_s": [x.ttft_mean_s for x in lo_runs],
        "ttft_kvjax_reps_s": [x.ttft_mean_s for x in kv_runs],
        "ttft_ideal_reps_s": (ideal_sum["rounds"] if ideal_sum is not None else None),
        "ttft_per_request_reps_s": {"compute_only": [x.ttft_per_request_s for x in co_runs],
                                    "load_only": [x.ttft_per_request_s for x in lo_runs],
                                    "cake": [x.ttft_per_request_s for x in kv_runs]},
        "meeting_index_first_request_reps": [(x.merge or {}).get("meeting_index")
                                             for x in kv_runs],
        "meeting_points_reps": [x.meeting_points for x in kv_runs],
        "cpu_cores": {"compute_only": [round(x.cpu_cores, 3) for x in co_runs],
                      "load_only": [round(x.cpu_cores, 3) for x in lo_runs],
                      "cake": [round(x.cpu_cores, 3) for x in kv_runs]},
        "loadavg_1m": {"compute_only": [x.loadavg_1m for x in co_runs],
                       "load_only": [x.loadavg_1m for x in lo_runs],
                       "cake": [x.loadavg_1m for x in kv_runs]},
        "speedup_vs_best": best / kv_t if kv_t else None,
        "speedup_vs_compute_only": co_t / kv_t if kv_t else None,
        "speedup_vs_load_only": (lo_t / kv_t) if (kv_t and lo_t) else None,
        "speedup_vs_load_only_min": (lo_min / kv_t) if (kv_t and lo_min) else None,
        "kvjax_over_ideal": kv_t / ideal_t if kv_t and ideal_t else None,
        "first_tokens_agree": all(
            len({(x.first_tokens or [x.first_token_id])[i] for x in co_runs + lo_runs + kv_runs
                 if (x.first_tokens or [x.first_token_id])[i] is not None}) <= 1
            for i in range(restoring)),
        "ideal": anas[mid], "ideal_round": mid,
        "runs": {"compute_only": co.summary(), "load_only": lo.summary(),
                 "cake": kv.summary()},
        "compute_slowdown": slowdown(kv_runs, _fit(co.prefills + co.other_prefills)
                                     or _LINEAR_COST),
    }
    if split:
      sp_runs = runs[f"cake_split@{rtext}"]
      sp_sum = _summary_of([x.ttft_mean_s for x in sp_runs])
      sp_t = sp_sum["median"] if sp_sum else None
      cell["summary"]["kvjax_split"] = sp_sum
      cell.update({
          "ttft_kvjax_split_s": sp_t,
          "ttft_kvjax_split_reps_s": [x.ttft_mean_s for x in sp_runs],
          "split_over_token_only": kv_t / sp_t if kv_t and sp_t else None,
          "speedup_vs_best_split": best / sp_t if sp_t else None,
          "layer_splits_first_request_reps": [(x.merge or {}).get("layer_splits")
                                              for x in sp_runs],
          "meeting_index_split_reps": [(x.merge or {}).get("meeting_index") for x in sp_runs],
          "split_invalid": (sp_sum is not None and ideal_sum is not None
                            and benchlib.below_bound(sp_sum, ideal_sum)),
      })
      cell["cpu_cores"]["cake_split"] = [round(x.cpu_cores, 3) for x in sp_runs]
      cell["runs"]["cake_split"] = sp_runs[mid].summary()
      cell["first_tokens_agree"] = cell["first_tokens_agree"] and all(
          len({(x.first_tokens or [x.first_token_id])[i] for x in co_runs + sp_runs
               if (x.first_tokens or [x.first_token_id])[i] is not None}) <= 1
          for i in range(restoring))
    cells.append(cell)
  return cells, kv_all, order


def fluctuation(bench: Bench, ids_full: list[int], b_ref: float, out: pathlib.Path,
                rng: random.Random, bar) -> list[dict]:
  """Random link traces and random compute-share traces (Cake section 6, fluctuating
  resources): compute-only, load-only and kvjax under the same traces, and the ideal bound."""
  from kvjax.storage.backends.link import load_trace  # noqa: PLC0415
  n = _FLUCT_LENGTH.value
  ids = ids_full[:n]
  n_chunks = (n - 1) // _CHUNK.value
  results = []
  for k in range(_FLUCT_SEEDS.value):
    t, lines = 0.0, ["# t_s bytes_per_s  (B_ref = %.0f bytes/s, seed %d)" % (b_ref, k)]
    while t < 600:
      lines.append(f"{t:.3f} {b_ref * 2 ** rng.uniform(-2, 2):.1f}")
      t += rng.uniform(0.5, 2.0)
    path = out / f"cake_fluct_link_{k}.txt"
    path.write_text("\n".join(lines) + "\n")
    steps = load_trace(path)
    starts, shares, t = [], [], 0.0
    while t < 600:
      starts.append(t)
      shares.append(rng.choice([0.125, 0.5, 0.875, 1.0]))
      t += rng.uniform(1.0, 3.0)

    def share_at(el, starts=starts, shares=shares):
      import bisect  # noqa: PLC0415
      return shares[bisect.bisect_right(starts, el) - 1]
    runs = {}
    for mode in MODES:
      bar.set_description(f"fluctuation {k} {mode}")
      cap = None if mode == "compute_only" else 3 * runs["compute_only"].ttft_s + 10
      runs[mode] = bench.run(mode, ids, share_at=share_at, link=("trace", steps), cap_s=cap)
      bar.update(1)
    co, lo, kv = runs["compute_only"], runs["load_only"], runs["cake"]
    coef = _fit(co.prefills + co.other_prefills) or _LINEAR_COST
    ana = cell_analysis(co, lo, kv, n_chunks, _CHUNK.value, coef)
    best = min(co.ttft_s, lo.ttft_s) if lo.ttft_s else co.ttft_s
    results.append({
        "seed": k, "seq_len": n, "link_trace_file": path.name, "b_ref_bytes_per_s": b_ref,
        "share_trace": list(zip(starts[:40], shares[:40])),
        "ttft_compute_only_s": co.ttft_s, "ttft_load_only_s": lo.ttft_s,
        "ttft_kvjax_s": kv.ttft_s, "ttft_ideal_s": ana["ideal_s"],
        "speedup_vs_best": best / kv.ttft_s if kv.ttft_s else None,
        "kvjax_over_ideal": kv.ttft_s / ana["ideal_s"] if kv.ttft_s else None,
        "ideal": ana, "runs": {m: r.summary() for m, r in runs.items()}})
  return results


def burst(bench: Bench, ids_full: list[int], b_ref: float, rng: random.Random, bar) -> dict:
  """One long request with a stored prefix plus short requests arriving together.

  Variants: "fcfs_recompute" (the default scheduling of vLLM-style chunked prefill: the long
  prompt is an ordinary prefill, its store not used, first come first served, so the short ones
  queue behind it; kvjax has no non-adaptive Cake mode), and the adaptive scheduler with the
  long request's merge in compute-only, load-only and Cake mode (short prefills first, the merge's
  compute side takes what is left of each step).
  """
  from kvjax import SamplingParams  # noqa: PLC0415
  n = _BURST_LENGTH.value
  ids = ids_full[:n]
  lens = [rng.randint(32, 448) for _ in range(_BURST_SHORTS.value)]
  shorts = [bench.pool.take(k) for k in lens]
  params = SamplingParams(max_tokens=_BURST_MAX_TOKENS.value, temperature=0.0)
  eng = bench.engine
  out = {"seq_len": n, "short_lengths": lens, "max_tokens": _BURST_MAX_TOKENS.value,
         "bandwidth_bytes_per_s": b_ref, "variants": {}}
  for variant, mode in (("fcfs_recompute", "compute_only"), ("adaptive_compute_only",
                                                             "compute_only"),
                        ("adaptive_load_only", "load_only"), ("adaptive_kvjax", "cake")):
    bar.set_description(f"burst {variant}")
    bench.quiesce()
    bench.rec.clear()
    bench.limiter.reset(b_ref)
    salt = f"burst-{variant}-{time.time_ns()}"
    t0 = time.perf_counter()
    long_id = eng.add_request(ids, params, request_id=bench.rid("long"), merge_mode=mode,
                              cache_salt=salt if variant == "fcfs_recompute" else None)
    rids = [long_id] + [eng.add_request(s, params, request_id=bench.rid("short"), cache_salt=salt)
                        for s in shorts]
    ttft, fin = {}, {}
    while len(fin) < len(rids):
      for o in eng.step():
        if o.metrics.ttft_s is not None:
          ttft.setdefault(o.request_id, o.metrics.ttft_s)
        if o.finished:
          fin[o.request_id] = time.perf_counter() - t0
    short_ttft = [ttft[r] for r in rids[1:]]
    out["variants"][variant] = {
        "all_finished_s": max(fin.values()), "long_ttft_s": ttft[long_id],
        "long_finished_s": fin[long_id], "short_ttft_mean_s": statistics.mean(short_ttft),
        "short_ttft_p90_s": sorted(short_ttft)[int(0.9 * (len(short_ttft) - 1))],
        "mean_ttft_all_s": statistics.mean(list(ttft.values())),
        "short_finished_mean_s": statistics.mean(fin[r] for r in rids[1:])}
    bar.update(1)
  return out


def planner_overhead(kv_runs: list[Run]) -> dict:
  """Planner seconds per engine step of the kvjax runs: `StepRecord.planner_s`, the time in
  `Scheduler.schedule` plus `Scheduler.update` (every `CakeMerge` call happens inside them)."""
  planner = [p for r in kv_runs for _, _, p in r.steps]
  walls = [b - a for r in kv_runs for a, b, _ in r.steps]
  if not planner:
    return {}
  q = lambda v, f: sorted(v)[int(f * (len(v) - 1))]  # noqa: E731
  return {"steps": len(planner), "planner_ms_mean": 1e3 * statistics.mean(planner),
          "planner_ms_p50": 1e3 * q(planner, 0.5), "planner_ms_p99": 1e3 * q(planner, 0.99),
          "planner_ms_max": 1e3 * max(planner),
          "step_ms_mean": 1e3 * statistics.mean(walls),
          "planner_fraction_of_step_time": sum(planner) / sum(walls)}


# ----------------------------------------------------------------------------- report
def fmt_s(x) -> str:
  return "-" if x is None else f"{x:.2f}"


def print_cells(cells: list[dict]) -> None:
  print(f"{'codec':<8} {'share':>5} {'seq':>5} {'B/B*':>5} {'B/B*f':>5} {'B MB/s':>6} "
        f"{'compute':>7} "
        f"{'load':>8} {'kvjax':>7} {'ideal':>7} {'speedup':>7} {'kv/ideal':>8} {'meet':>6} "
        f"{'waste':>5} {'reps':>4} {'cpu':>9}")  # reps: rounds
  for c in cells:
    lo = fmt_s(c["ttft_load_only_s"]) if c["ttft_load_only_s"] is not None else (
        ">" + fmt_s(c["ttft_load_only_min_s"]))
    mg = c["runs"]["cake"]["merge"] or {}
    meet = f"{mg.get('meeting_index', '-')}/{c['prefix_chunks']}"
    sp = c["speedup_vs_best"]
    kvi = c["kvjax_over_ideal"]
    bf = c.get("bandwidth_ratio_vs_fastest_compute_only")
    tag = c["codec"] + (f"/N{c['restoring']}" if c.get("restoring", 1) > 1 else "") + (
        "/busy" if c.get("busy") else "")
    print(f"{tag:<8} {c['share']:>5g} {c['seq_len']:>5} {c['ratio_text']:>5} "
          f"{('-' if bf is None else f'{bf:.2f}'):>5} "
          f"{c['bandwidth_bytes_per_s'] / 1e6:>6.2f} {fmt_s(c['ttft_compute_only_s']):>7} "
          f"{lo:>8} {fmt_s(c['ttft_kvjax_s']):>7} {fmt_s(c['ttft_ideal_s']):>7} "
          f"{('-' if sp is None else f'{sp:.2f}x'):>7} "
          f"{('-' if kvi is None else f'{kvi:.3f}'):>8} {meet:>6} "
          f"{len(mg.get('chunks_wasted', [])):>5} {c['reps']:>4} {cpu_text(c):>9}"
          + (" INVALID" if c["invalid"] else "")
          + (f"  split {fmt_s(c['ttft_kvjax_split_s'])} s, token-only/split "
             f"{c['split_over_token_only']:.3f}, k {c['layer_splits_first_request_reps']}"
             if c.get("split_over_token_only") is not None else ""))


def cpu_text(c: dict) -> str:
  cpu = c["cpu_cores"]["compute_only"] + c["cpu_cores"]["cake"]
  return f"{min(cpu):.2f}/{max(cpu):.2f}" + ("*" if min(cpu) >= 0.8 * max(cpu) else " ")


def check_targets(cells: list[dict]) -> dict:
  """The three targets over the cells that are not `invalid`; each miss is listed with its
  numbers."""
  cells = [c for c in cells if not c["invalid"]]
  t1 = [c for c in cells if c["speedup_vs_best"] is not None]
  miss1 = [c for c in t1 if c["speedup_vs_best"] < 0.97]
  # The ideal bound of an N > 1 cell is one request's alone (a validity check, not a target).
  t2 = [c for c in cells if c["seq_len"] >= 4096 and c["kvjax_over_ideal"] is not None
        and c.get("restoring", 1) == 1]
  miss2 = [c for c in t2 if c["kvjax_over_ideal"] > 1.10]
  t3 = [c for c in cells if c["seq_len"] >= 4096 and c["bandwidth_ratio"] == 1
        and c["ttft_kvjax_s"] is not None]
  miss3 = [c for c in t3 if c["ttft_compute_only_s"] / c["ttft_kvjax_s"] < 1.7 or (
      c["ttft_load_only_s"] is not None and c["ttft_load_only_s"] / c["ttft_kvjax_s"] < 1.7)]
  key = cell_key
  return {
      "kvjax_ge_0.97x_best": {"cells": len(t1), "met": len(t1) - len(miss1),
                              "misses": {key(c): round(c["speedup_vs_best"], 3) for c in miss1}},
      "within_10pct_of_ideal_n_ge_4k": {
          "cells": len(t2), "met": len(t2) - len(miss2),
          "misses": {key(c): round(c["kvjax_over_ideal"], 3) for c in miss2}},
      "ge_1.7x_both_at_balance_n_ge_4k": {
          "cells": len(t3), "met": len(t3) - len(miss3),
          "misses": {key(c): [round(c["ttft_compute_only_s"] / c["ttft_kvjax_s"], 3),
                              round((c["ttft_load_only_s"] or math.nan) / c["ttft_kvjax_s"], 3)]
                     for c in miss3}}}


def mark_invalid(cell: dict) -> None:
  """Sets `cell["invalid"]`: kvjax's median beats its ideal bound's by more than the rounds'
  spread (`benchlib.below_bound`). A cell from a file written before rounds (no `summary`) is
  judged on its single values, spread 0."""
  if "summary" not in cell:
    kv, ideal = cell["ttft_kvjax_s"], cell["ttft_ideal_s"]
    cell["invalid"] = kv is not None and benchlib.below_bound({"median": kv}, {"median": ideal})
  elif "invalid" not in cell:
    kv, ideal = cell["summary"]["kvjax"], cell["summary"]["ideal"]
    cell["invalid"] = kv is not None and ideal is not None and benchlib.below_bound(kv, ideal)


def headline(cells: list[dict]) -> dict | None:
  """The best speedup over the better baseline among the valid cells at balance (B = B*, share
  100%) measured in at least 3 rounds with steady CPU shares (`steady`); None when there is
  none. An invalid cell is never one."""
  ok = [c for c in cells if c["bandwidth_ratio"] == 1 and c["share"] == 100
        and c.get("restoring", 1) == 1 and not c.get("busy") and not c["invalid"]
        and c["speedup_vs_best"] is not None and c.get("rounds", 1) >= 3
        and steady(c)]
  if not ok:
    return None
  c = max(ok, key=lambda c: c["speedup_vs_best"])
  kv = c["summary"]["kvjax"]
  return {"cell": cell_key(c), "speedup_vs_best": c["speedup_vs_best"],
          "ttft_kvjax_s": c["ttft_kvjax_s"], "ttft_ideal_s": c["ttft_ideal_s"],
          "kvjax_spread": kv["spread"], "rounds": c["rounds"]}


def headline_text(h: dict | None) -> str:
  if h is None:
    return "no headline: no valid balance cell with steady CPU measured in >= 3 rounds"
  return (f"{h['cell']}: kvjax {h['speedup_vs_best']:.2f}x the better baseline (median of "
          f"{h['rounds']} rounds, spread {100 * h['kvjax_spread']:.0f}%)")


def plot(cells: list[dict], path: pathlib.Path, title: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  cells = [c for c in cells if c.get("restoring", 1) == 1 and not c.get("busy")] or cells
  raw = [c for c in cells if c["codec"] == "raw"] or cells
  shares = sorted({c["share"] for c in raw}, reverse=True)
  fig, axes = plt.subplots(2, len(shares), figsize=(3.8 * len(shares), 6.6), squeeze=False)
  for col, share in enumerate(shares):
    mine = [c for c in raw if c["share"] == share]
    lens = sorted({c["seq_len"] for c in mine})
    ratios = sorted({c["ratio_text"] for c in mine}, key=fraction)
    for row, (key, title, cmap, lim) in enumerate((
        ("speedup_vs_best", "kvjax speedup vs better baseline", "viridis", None),
        ("kvjax_over_ideal", "kvjax / ideal", "magma_r", (1.0, 1.4)))):
      grid = [[next((c[key] for c in mine if c["seq_len"] == n and c["ratio_text"] == r),
                    None) for r in ratios] for n in lens]
      vals = [[math.nan if v is None else v for v in line] for line in grid]
      ax = axes[row][col]
      im = ax.imshow(vals, cmap=cmap, aspect="auto", origin="lower",
                     vmin=lim[0] if lim else None, vmax=lim[1] if lim else None)
      for i, line in enumerate(grid):
        for j, v in enumerate(line):
          dark = row == 0 or (v is not None and v > 1.3)
          bad = next((c["invalid"] for c in mine if c["seq_len"] == lens[i]
                      and c["ratio_text"] == ratios[j]), False)
          text = "-" if v is None else f"{v:.2f}" + ("\ninvalid" if bad else "")
          ax.text(j, i, text, ha="center", va="center", fontsize=7,
                  color="r" if bad else ("w" if dark else "k"))
      ax.set_xticks(range(len(ratios)), ratios)
      ax.set_yticks(range(len(lens)), lens)
      ax.set_xlabel("B / B*")
      ax.set_ylabel("sequence length")
      ax.set_title(f"{title}\ncompute share {share:g}%", fontsize=9)
      fig.colorbar(im, ax=ax, fraction=0.046)
  fig.suptitle(f"SmolLM2-135M f32, real engine (raw KV); {title}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------- main
def plan(quick: bool) -> dict:
  if quick:
    return {"lengths": [2048, 4096], "shares": [100.0], "ratios": ["1", "4", "1/4"],
            "sub_lengths": [], "sub_ratios": [], "codecs": ["raw"], "codec_lengths": [],
            "codec_ratios": [], "rounds": _ROUNDS.value, "experiments": ["grid"],
            "restoring": restoring_list()}
  return {"lengths": [int(x) for x in _LENGTHS.value],
          "shares": [float(x) for x in _SHARES.value], "ratios": list(_RATIOS.value),
          "sub_lengths": [int(x) for x in _SUB_LENGTHS.value],
          "sub_ratios": list(_SUB_RATIOS.value), "codecs": list(_CODECS.value),
          "codec_lengths": [int(x) for x in _CODEC_LENGTHS.value],
          "codec_ratios": list(_CODEC_RATIOS.value), "rounds": _ROUNDS.value,
          "experiments": list(_EXPERIMENTS.value), "restoring": restoring_list()}


def restoring_list() -> list[int]:
  """--restoring as ints, N = 1 first (an N > 1 cell's bound is its N = 1 cell's)."""
  out = sorted({int(x) for x in _RESTORING.value})
  if not out or out[0] < 1:
    raise app.UsageError(f"--restoring={_RESTORING.value}: each N must be >= 1")
  return out


def tasks_of(p: dict) -> list[tuple]:
  """Run order: raw blocks at share 100% (short first), the fluctuation and burst experiments,
  raw blocks at lower shares, then the codec blocks, each grid block once per N of
  --restoring (N = 1 first). A block is ("block", codec, length, share, ratios, N);
  --deadline_s drops what is left when it passes."""
  grid = "grid" in p["experiments"]
  ns = p.get("restoring", [1])
  out: list[tuple] = []
  if grid and 100.0 in p["shares"]:
    out += [("block", "raw", n, 100.0, p["ratios"], k) for k in ns for n in sorted(p["lengths"])]
  out += [(e,) for e in ("fluctuation", "burst") if e in p["experiments"]]
  if grid:
    out += [("block", "raw", n, share, p["sub_ratios"], k) for k in ns for share in p["shares"]
            if share != 100 for n in sorted(p["sub_lengths"])]
  if "codecs" in p["experiments"]:
    out += [("block", codec, n, 100.0, p["codec_ratios"], 1) for codec in p["codecs"]
            if codec != "raw" for n in p["codec_lengths"]]
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from tqdm import tqdm  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import kvjax  # noqa: PLC0415

  if _REPORT.value:
    path = pathlib.Path(_REPORT.value)
    report(json.loads(path.read_text()), None)
    return 0
  if _ROUNDS.value < 1:
    raise app.UsageError(f"--rounds must be >= 1, got {_ROUNDS.value}")
  prov = benchlib.provenance(("jax", "jaxlib", "flax", "numpy", "kvjax"))
  bad = set(_LAYER_SPLIT.value) - {"off", "auto"}
  if bad or "off" not in _LAYER_SPLIT.value:
    raise app.UsageError(f"--layer_split={_LAYER_SPLIT.value}: 'off' (the token-only baseline) "
                         "and optionally 'auto'")
  use_split = "auto" in _LAYER_SPLIT.value
  t_start = time.perf_counter()
  p = plan(_QUICK.value)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  store_root = pathlib.Path(_STORE_DIR.value or tempfile.mkdtemp(prefix="kvjax-bench-cake-"))
  rng = random.Random(_SEED.value)
  tasks = tasks_of(p)
  blocks = [t[1:] for t in tasks if t[0] == "block"]
  max_len = max([n for _, n, _, _, _ in blocks]
                + ([_FLUCT_LENGTH.value] if "fluctuation" in p["experiments"] else [])
                + ([_BURST_LENGTH.value] if "burst" in p["experiments"] else []))
  # Runs: the B* compute-only run, then per round compute-only and load-only + kvjax per ratio.
  def runs_in(codec, n, share, r, k):
    del codec, n, share
    return 1 + p["rounds"] * (1 + (2 + (use_split and k == 1)) * len(r))
  total = sum(runs_in(*b) for b in blocks)
  total += 3 * _FLUCT_SEEDS.value * ("fluctuation" in p["experiments"])
  total += 4 * ("burst" in p["experiments"])
  record: dict[str, Any] = {
      **prov, "benchmark": "bench_cake", "model": "SmolLM2-135M-Instruct (GGUF Q4_1 -> f32)",
      "dtype": "float32", "threads": os.cpu_count(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""), "backend": jax.default_backend(),
      "kvjax_version": kvjax.__version__, "round_orders": {},
      "seeds": {"seed": _SEED.value}, "quick": _QUICK.value, "plan": p,
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "settings": {"budget_tokens": _BUDGET.value, "chunk_tokens": _CHUNK.value,
                   "max_loads_in_flight": _IN_FLIGHT.value,
                   "load_only_cap": _LOAD_ONLY_CAP.value,
                   "link": "one LLM per codec; link re-armed in place per run with "
                           "LinkLimiter.reset (rate, or trace from the request's arrival)",
                   "share": "competing ShareGPT prompts take exactly (1 - share) of each step's "
                            "token budget as ordinary prefills (served first)",
                   "restoring": p["restoring"], "busy": _BUSY.value,
                   "layer_split": list(_LAYER_SPLIT.value),
                   "busy_load": "one busy-looping python process during every grid block"
                                if _BUSY.value else None},
      "cells": [], "skipped": []}

  from kvjax.models.loading.gguf_loader import find_smollm2_gguf  # noqa: PLC0415
  from kvjax.models.loading.tokenizer import Tokenizer  # noqa: PLC0415
  tok = Tokenizer.from_gguf(find_smollm2_gguf())
  ids_full, source = long_prompt(tok, max_len)
  prompts = [ids_full] + [long_prompt(tok, max_len, _PROMPT_INDEX.value + i)[0]
                          for i in range(1, max(p["restoring"]))]
  pool = TokenPool(tok, _SHAREGPT.value)
  record["prompt"] = {"source": source, "tokens_available": len(ids_full)}
  all_kv: list[Run] = []
  benches: dict[str, Bench] = {}
  bar = tqdm(total=total, unit="run", dynamic_ncols=True)

  def get_bench(codec: str) -> Bench | None:
    if codec in benches:
      return benches[codec]
    for other in list(benches):  # one LLM at a time (memory, and the 2 cores)
      record.setdefault("engine_stats", {})[other] = benches.pop(other).close()
    gc.collect()
    bar.set_description(f"{codec}: load, compile, store, warm up")
    try:
      b = Bench(codec, store_root, pool, layer_split="auto" if use_split else "off")
    except (TypeError, ValueError) as e:
      msg = f"codec {codec!r} skipped: this LLM does not take kv_codec={codec!r} ({e})"
      print(msg)
      record["skipped"].append(msg)
      return None
    longest = max([n for c, n, _, _, _ in blocks if c == codec] + [min(2048, max_len)])
    if codec == "raw":
      longest = max_len
    record.setdefault("warmup", {})[codec] = b.warm(ids_full[:longest], ids_full[:1024])
    for other in prompts[1:]:  # the --restoring prompts, stored too
      b.store(other[:longest])
    benches[codec] = b
    return b

  def b_ref_for(bench: Bench, n: int) -> float:
    """B* of raw at share 100% for length n: from the grid, else from one compute-only run."""
    got = next((c["b_star_bytes_per_s"] for c in record["cells"] if c["codec"] == "raw"
                and c["share"] == 100 and c["seq_len"] == n), None)
    if got is not None:
      return got
    ids = ids_full[:n]
    co = bench.run("compute_only", ids)
    coef = _fit(co.prefills) or _LINEAR_COST
    nc = (len(ids) - 1) // _CHUNK.value
    return bench.prefix_bytes(ids)[0] / (done_at(co, nc * _CHUNK.value, coef) - co.lookup_s)

  try:
    for task in tasks:
      name = "/".join(f"{x:g}%" if isinstance(x, float) else str(x) for x in task[1:4]) or task[0]
      if _DEADLINE.value and time.perf_counter() - t_start > _DEADLINE.value:
        record["skipped"].append(f"{name}: past --deadline_s")
        continue
      if task[0] == "block":
        _, codec, n, share, ratios, k = task
        name += f"/N{k}" if k > 1 else ""
        bench = get_bench(codec)
        if bench is None:
          continue
        busy = start_busy() if _BUSY.value else None
        try:
          cells, kv_runs, order = grid_block(bench, prompts, n, share, ratios, p["rounds"], bar,
                                             restoring=k, alone=record["cells"],
                                             split=use_split and k == 1)
        finally:
          stop_busy(busy)
        record["round_orders"][name] = order
        record["cells"] += cells
        all_kv += kv_runs
      elif task[0] == "fluctuation":
        bench = get_bench("raw")
        b_ref = b_ref_for(bench, _FLUCT_LENGTH.value)
        record["fluctuation"] = fluctuation(bench, ids_full, b_ref, out, rng, bar)
      else:
        bench = get_bench("raw")
        record["burst"] = burst(bench, ids_full, b_ref_for(bench, _BURST_LENGTH.value), rng, bar)
      benchlib.write_json(out / f"{_NAME.value}.json", record)  # what ran so far
  finally:
    bar.close()
    for codec, b in benches.items():
      record.setdefault("engine_stats", {})[codec] = b.close()
    if _STORE_DIR.value is None:
      shutil.rmtree(store_root, ignore_errors=True)

  record["planner_overhead"] = planner_overhead(all_kv)
  record["wall_s"] = time.perf_counter() - t_start
  report(record, out)
  if record["skipped"]:
    print(f"bench_cake: {len(record['skipped'])} part(s) skipped (above); exit status 1")
    return 1
  return 0


def report(record: dict, out: pathlib.Path | None) -> None:
  """Evaluates the targets and the headline, prints the tables, and writes cake.json and
  cake.png into `out` (nothing with `out` None: --report on an existing file)."""
  cells = record["cells"]
  for c in cells:
    c["cpu_steady"] = steady(c)
    mark_invalid(c)
    # B* is fixed from the block's first compute-only run, before the sweep; with other jobs on
    # the machine the fastest compute-only run can differ: the ratio against that one too.
    c["bandwidth_ratio_vs_fastest_compute_only"] = c["bandwidth_bytes_per_s"] / (
        c["prefix_bytes"] / c["ideal"]["compute_prefix_s"])
  record["targets"] = check_targets(cells)
  record["targets_steady_cells"] = check_targets([c for c in cells if c["cpu_steady"]])
  record["invalid_cells"] = {cell_key(c): {"ttft_kvjax_s": c["ttft_kvjax_s"],
                                           "ttft_ideal_s": c["ttft_ideal_s"],
                                           "kvjax_over_ideal": c["kvjax_over_ideal"]}
                             for c in cells if c["invalid"]}
  record["headline"] = headline(cells)
  record["groups"] = groups(cells)
  if out is not None:
    benchlib.write_json(out / f"{_NAME.value}.json", record)
  s = record["settings"]
  load_start = record.get("loadavg_before", record["machine"]["loadavg_1_5_15"])
  load_end = record.get("loadavg_after", record.get("loadavg_end_1_5_15", [math.nan]))
  print(f"\nCake on the real engine: SmolLM2-135M f32, {record['threads']} CPU threads, prompt "
        f"{record['prompt']['source']}, chunk {s['chunk_tokens']} tokens, budget "
        f"{s['budget_tokens']} tokens/step, {s['max_loads_in_flight'] or 'derived'} loads in "
        f"flight; load average at start {load_start[0]:.1f}, at end "
        f"{load_end[0]:.1f}")
  print("TTFT seconds; load '>x': stopped at x s (lower bound); speedup: vs the better "
        "baseline; meet: first loaded chunk / prefix chunks; cpu: min/max CPU cores this process "
        "got over the compute-only and kvjax runs (* steady: min/max >= 0.8); B/B*f: the link "
        "against the fastest compute-only run\n")
  print_cells(cells)
  slow = [c["compute_slowdown"] for c in cells]
  w = [s["median_time_over_fit_with_loads"] for s in slow if s["median_time_over_fit_with_loads"]]
  wo = [s["median_time_over_fit_without_loads"] for s in slow
        if s["median_time_over_fit_without_loads"]]
  if w and wo:
    print(f"\ncompute while loads run: median call time / compute-only fit "
          f"{statistics.median(w):.3f} with loads in flight, {statistics.median(wo):.3f} without")
  po = record.get("planner_overhead")
  if po and "planner_ms_mean" in po:
    print(f"planner per step (kvjax runs, {po['steps']} steps): schedule() + update() mean "
          f"{po['planner_ms_mean']:.2f} ms, p99 {po['planner_ms_p99']:.2f} ms, max "
          f"{po['planner_ms_max']:.2f} ms; {100 * po['planner_fraction_of_step_time']:.3f}% "
          f"of step time (mean step {po['step_ms_mean']:.0f} ms)")
  elif po:  # a result file written before the step records (schedule and merge timed apart)
    print(f"planner per step (kvjax runs, {po['steps']} steps): schedule() mean "
          f"{po['schedule_ms_mean']:.2f} ms, p99 {po['schedule_ms_p99']:.2f} ms, max "
          f"{po['schedule_ms_max']:.2f} ms; all CakeMerge calls mean "
          f"{po['cakemerge_ms_mean']:.2f} ms; {100 * po['planner_fraction_of_step_time']:.3f}% "
          f"of step time (mean step {po['step_ms_mean']:.0f} ms)")
  for f in record.get("fluctuation", []):
    print(f"fluctuation seed {f['seed']} ({f['seq_len']} tokens): compute "
          f"{fmt_s(f['ttft_compute_only_s'])} s, load {fmt_s(f['ttft_load_only_s'])} s, kvjax "
          f"{fmt_s(f['ttft_kvjax_s'])} s, ideal {fmt_s(f['ttft_ideal_s'])} s")
  if "burst" in record:
    print(f"burst: 1 x {record['burst']['seq_len']} + {len(record['burst']['short_lengths'])} "
          "short requests arriving together")
    for v, r in record["burst"]["variants"].items():
      print(f"  {v:<22} all finished {r['all_finished_s']:7.2f} s, long TTFT "
            f"{r['long_ttft_s']:6.2f} s, short TTFT mean {r['short_ttft_mean_s']:6.2f} s, mean "
            f"TTFT of all {r['mean_ttft_all_s']:6.2f} s")
  for title, key in (("targets, valid cells", "targets"),
                     ("targets, valid cells with steady CPU", "targets_steady_cells")):
    print(f"\n{title}:")
    for name, t in record[key].items():
      print(f"  {name}: {t['met']}/{t['cells']} met" + (f"; misses {t['misses']}"
                                                       if t["misses"] else ""))
  for msg in record["skipped"]:
    print(f"skipped: {msg}")
  for key, v in record["invalid_cells"].items():
    print(f"invalid (faster than its own bound by more than the rounds' spread): {key}: kvjax "
          f"{fmt_s(v['ttft_kvjax_s'])} s against a bound of {fmt_s(v['ttft_ideal_s'])} s")
  print("\nworst cell per (N, machine), valid cells: kvjax (token-only) against the better "
        "baseline; layer split against token-only (median ratio, N = 1 only):")
  for name, g in record["groups"].items():
    print(f"  {name}: worst {g['worst_speedup_vs_best']} at {g['worst_cell']}"
          + (f"; split / token-only per cell {g['split_over_token_only']}"
             if g["split_over_token_only"] else ""))
  print(f"\nheadline: {headline_text(record['headline'])}")
  if out is None:
    return
  plotted = False
  if cells:
    try:
      plot(cells, out / f"{_NAME.value}.png", headline_text(record["headline"]))
      plotted = True
    except ImportError:
      print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
  print(f"wrote {out / (_NAME.value + '.json')}" + (" and its .png" if plotted else "")
        + (f" in {record['wall_s'] / 60:.1f} min" if "wall_s" in record else ""))


def groups(cells: list[dict]) -> dict:
  """Per (N restoring, quiet or busy) over the valid cells: the worst speedup over the better
  baseline (the issue's goal: >= 1.0 in every group) and, where the layer split ran, each cell's
  token-only / split median ratio (> 1: the split is faster)."""
  out: dict[str, dict] = {}
  for c in cells:
    if c["invalid"] or c["speedup_vs_best"] is None:
      continue
    name = f"N{c.get('restoring', 1)}/{'busy' if c.get('busy') else 'quiet'}"
    g = out.setdefault(name, {"cells": 0, "worst_speedup_vs_best": math.inf,
                              "worst_cell": None, "split_over_token_only": {}})
    g["cells"] += 1
    if c["speedup_vs_best"] < g["worst_speedup_vs_best"]:
      g["worst_speedup_vs_best"] = round(c["speedup_vs_best"], 3)
      g["worst_cell"] = cell_key(c)
    if c.get("split_over_token_only") is not None:
      g["split_over_token_only"][cell_key(c)] = round(c["split_over_token_only"], 3)
  return out


def steady(cell: dict) -> bool:
  """Whether the compute-only and kvjax runs of a cell got similar CPU (other jobs share it)."""
  cpu = cell["cpu_cores"]["compute_only"] + cell["cpu_cores"]["cake"]
  return min(cpu) >= 0.8 * max(cpu)


if __name__ == "__main__":
  app.run(main)
