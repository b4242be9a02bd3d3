"""Serving defaults against every scheduling knob's alternatives, on five workloads, in one run.

Real SmolLM2-135M-Instruct, f32, offline (`LLM`), greedy. A default that loses to another
setting on a common workload is a bug: each workload runs under the defaults and under each
non-default value of the scheduling knobs below, each setting on its own fresh `LLM` (compiled at
construction, then one untimed warm-up request), one after another in this process.

Workloads (prompts cut from real text: ../shared/data/books and ShareGPT):
  a  many short prompts at once: many prompts of 40 tokens in one `generate` call,
     no store (`LLM(kv_store=None, max_num_seqs=64)`, the case that once admitted one request
     per step);
  b  one long store hit among many short prompts: a long history (1,536 tokens) saved to a
     host tier (over a disk tier) (the device prefix cache emptied, so the store serves it), then that history
     plus 32 new tokens first, and many short prompts of 40 tokens, in one call;
  c  a cold long prompt among running decodes: short requests decode; then a cold prompt of
     1,536 tokens arrives with short prompts (engine
     API, one step at a time);
  d  session turns: ShareGPT conversations (`scripts/session_replay.py`'s loader)
     replayed as chat sessions (`LLM.sessions`), each round's turns in one batch, with a host
     tier store (device prefix cache on, the defaults);
  e  store hits under an emulated slow link: two histories of 1,536 tokens
     saved to a disk tier read at `--link_mb_s` MB/s (the only tier), then each history plus
     32 new tokens and a few short prompts in one call.

Settings: the defaults; `prefill_order="fcfs"`; `short_first_token_steps=False`;
`long_prefill_token_threshold=128`; and, on the store workloads (b, d, e) only,
`kv_merge_mode` "load_only" and "compute_only", `kv_lookahead_window=0` and
`kv_layerwise_groups=6`. Figures of merit per workload: wall time of the whole workload and
TTFT p50 / p99 of its short requests (a: all; b, e: the short prompts; c: the short prompts
that arrive with the cold one; d: every turn >= 2). At --quick sizes d's prompts stay under one
store chunk (256 tokens): every reuse is a device prefix-cache hit, no Cake merge runs, and
the kv_merge_mode settings plan the same steps as the defaults there.

Drift. The machine's load drifts over a run by 1.5-2x (a shared 2-core VM), more than most
differences between settings, and one cell per setting measured one after another compares
moments, not settings (b of the first --quick run: settings that took the same 17 steps
ranged from 6.3 to 16.1 s; the defaults and kv_merge_mode=load_only plan the very same steps
there, every stored chunk loaded, none computed).
So the settings run in rounds (`--reps`, default 3): each round runs every setting once, on a
fresh `LLM`, in an order rotated by one per round (each setting meets every position in the
round), and a cell is the MEDIAN of its rounds. The verdict per workload and metric takes the
best other setting by median and the median over rounds of the PAIRED ratio defaults / that
setting (the two ran minutes apart in the same round, under nearly the same load); a loss is
flagged when both that ratio and the ratio of the medians exceed 1.10. Each step's
plan is fingerprinted (loads, inserts, prefill pieces, decodes; request ids by first
appearance), and the store workloads record what the hits computed and loaded (chunks, from
`metrics.merge`): a setting whose rounds planned the same steps as the defaults' cannot differ
but by the machine's noise, and the verdict says so ("same plans") instead of flagging it.

    .venv/bin/python scripts/bench_defaults.py --quick   # about 50 minutes (3 rounds of ~16)
    .venv/bin/python scripts/bench_defaults.py --quick --workloads b \
        --settings defaults,kv_merge_mode=load_only,kv_merge_mode=compute_only  # one question

`--rejudge=<file>` recomputes a results file's verdict from its recorded cells (no runs).

Writes <out_dir>/bench_defaults[_quick].json (`benchlib.provenance()`, threads, seeds, sizes,
every cell with its median, min, max and spread over the rounds and each run's CPU share, the
defaults' ratio to the best setting per workload and metric) and a plot of
the same name, and prints the table.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from absl import app, flags

import benchlib  # scripts/benchlib.py
from benchlib import pyplot
import session_replay  # scripts/session_replay.py: the ShareGPT loader
from defaults_verdict import (is_loss, judge, median_cell,  # scripts/defaults_verdict.py
                              workloads_summary)

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
TRACE = "sharegpt/sharegpt_v3_multiturn_1000.json"

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model.")
_QUICK = flags.DEFINE_bool("quick", False, "Smaller workloads.")
_BOOK = flags.DEFINE_string("book", str(DATA / "books" / "pg11_alice_in_wonderland_carroll.txt"),
                            "Text the prompts are cut from.")
_WORKLOADS = flags.DEFINE_list("workloads", ["a", "b", "c", "d", "e"], "Workloads to run.")
_SETTINGS = flags.DEFINE_list("settings", [], "Setting names to run (default: all).")
_REPS = flags.DEFINE_integer("reps", 3, "Rounds: every setting once per round, in an order "
                             "rotated by one per round; a cell is the median of its rounds.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the ShareGPT conversation sample.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")
_LINK = flags.DEFINE_float("link_mb_s", 20.0, "e: the disk tier's emulated read link, MB/s.")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the output files' names.")
_REJUDGE = flags.DEFINE_string(
    "rejudge", None, "A results file this script wrote: recompute its verdict and `workloads` "
    "summary from its recorded cells (no model runs) and rewrite it and its plot; the original "
    "run's provenance stays, this call's goes under `rejudged_by`.")


SHORT = 40       # tokens of a short prompt
NEW = 32         # new tokens after a stored history
MAX_SEQS = 64    # LLM(max_num_seqs=64), as the user case
CHUNK = 256      # LLM's default kv_chunk_size

# name -> (LLM options, store workloads only)
SETTINGS = {
    "defaults": ({}, False),
    "prefill_order=fcfs": ({"prefill_order": "fcfs"}, False),
    "short_first_token_steps=False": ({"short_first_token_steps": False}, False),
    "long_prefill_token_threshold=128": ({"long_prefill_token_threshold": 128}, False),
    "kv_merge_mode=load_only": ({"kv_merge_mode": "load_only"}, True),
    "kv_merge_mode=compute_only": ({"kv_merge_mode": "compute_only"}, True),
    "kv_lookahead_window=0": ({"kv_lookahead_window": 0}, True),
    "kv_layerwise_groups=6": ({"kv_layerwise_groups": 6}, True),
}
STORE_WORKLOADS = ("b", "d", "e")


def sizes() -> dict:
  q = _QUICK.value
  return {"a_prompts": 32 if q else 64, "a_max_tokens": 16 if q else 32,
          "b_prompts": 16 if q else 32, "hit_tokens": 1024 if q else 1536,
          "c_decoders": 4 if q else 8, "c_decoder_max_tokens": 16 if q else 32,
          "c_prompts": 8 if q else 16, "cold_tokens": 1024 if q else 1536,
          "d_convs": 4 if q else 8, "d_turns": 3, "d_turn_chars": 1200, "d_max_tokens": 16,
          "c_max_tokens": 16, "e_hits": 2, "e_prompts": 8 if q else 16, "max_tokens": 16,
          "reps": _REPS.value}


class Text:
  """Token ids of the book, handed out in disjoint passages (no two prompts share a prefix)."""

  def __init__(self, tok):
    self.ids = tok.encode(pathlib.Path(_BOOK.value).read_text(encoding="utf-8"))
    self.at = 500

  def take(self, n: int) -> list[int]:
    if self.at + n > len(self.ids):
      self.at = 500
    out = self.ids[self.at:self.at + n]
    self.at += n + 7
    return out


def pct(xs: list[float], q: float) -> float | None:
  if not xs:
    return None
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(wall: float, ttfts: list[float], steps: list, **extra) -> dict:
  """One run's figures; `steps` are the step plans `Bench.observe` recorded."""
  plan = hashlib.sha1(json.dumps(steps).encode()).hexdigest()[:12]
  return {"wall_s": wall, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
          "n_short": len(ttfts), "steps": len(steps), "plan": plan, **extra}


def merge_counts(outs) -> dict:
  """Store chunks the outputs' Cake merges computed and loaded (`metrics.merge`), summed."""
  merges = [o.metrics.merge for o in outs if o.metrics.merge is not None]
  return {"merge_chunks_computed": sum(len(m.chunks_computed) for m in merges),
          "merge_chunks_loaded": sum(len(m.chunks_loaded) for m in merges),
          "merge_chunks_wasted": sum(len(m.chunks_wasted) for m in merges)}


class Bench:
  """One setting's engines: one without a store (a, c), one over a host tier (b, d), one over a
  slow disk tier (e); each built when first needed, closed after its workloads."""

  def __init__(self, name: str, options: dict, sz: dict, tmp: pathlib.Path):
    self.name, self.options, self.sz, self.tmp = name, options, sz, tmp

  def make(self, store: str | None):
    from kvjax import LLM, SamplingParams  # noqa: PLC0415
    from kvjax.storage import StoreConfig, TierConfig  # noqa: PLC0415
    kw = dict(self.options)
    if store == "host":
      kw["kv_store"] = StoreConfig((TierConfig("host", capacity_bytes=2 << 30),
                                    TierConfig("disk", url=f"file://{self.tmp / 'host_disk'}")))
    elif store == "slow":
      kw["kv_store"] = StoreConfig((TierConfig("disk", url=f"file://{self.tmp / 'disk'}",
                                               link_bytes_per_s=_LINK.value * 1e6),))
    llm = LLM(_MODEL.value, dtype="float32", max_num_seqs=MAX_SEQS,
              kv_cache_memory_bytes=768 << 20, session_ttl_s=None, **kw)
    # One untimed request: first-call costs (threads, buffers) stay out of every cell.
    llm.generate({"prompt_token_ids": list(range(100, 140))},
                 SamplingParams(max_tokens=2, temperature=0.0))
    llm.reset_prefix_cache()
    return llm

  def observe(self, llm) -> list:
    """Records each step's plan as plain data (timings left out; request ids renamed by first
    appearance), so two runs that planned the same steps have equal lists."""
    steps, ids = [], {}

    def record(rec) -> None:
      p = rec.plan
      rid = lambda r: ids.setdefault(r, len(ids))  # noqa: E731
      steps.append(([(rid(x.request_id), x.index) for x in p.loads],
                    [(rid(x.request_id), x.index) for x in p.inserts],
                    [(rid(x.request_id), x.start, x.num_tokens) for x in p.prefills],
                    len(p.decodes)))

    llm.engine.add_step_observer(record)
    return steps

  # ------------------------------------------------------------------ workloads
  def run_a(self, llm, text) -> dict:
    from kvjax import SamplingParams  # noqa: PLC0415
    sz = self.sz
    prompts = [{"prompt_token_ids": text.take(SHORT)} for _ in range(sz["a_prompts"])]
    params = SamplingParams(max_tokens=sz["a_max_tokens"], ignore_eos=True, temperature=0.0)
    steps = self.observe(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    a0 = min(o.metrics.arrival_s for o in outs)
    firsts = [o.metrics.first_token_s - a0 for o in outs]
    return summary(wall, [o.metrics.ttft_s for o in outs], steps,
                   last_first_token_s=max(firsts),
                   first_finish_s=min(o.metrics.finished_s - a0 for o in outs))

  def hits_among_short(self, llm, text, n_hits: int, n_short: int) -> dict:
    from kvjax import SamplingParams  # noqa: PLC0415
    sz = self.sz
    hists = [text.take(sz["hit_tokens"]) for _ in range(n_hits)]
    llm.generate([{"prompt_token_ids": h} for h in hists],
                 SamplingParams(max_tokens=1, temperature=0.0))
    llm.flush()
    llm.reset_prefix_cache()  # the store serves the histories, not the device
    hits = [h + text.take(NEW) for h in hists]
    short = [text.take(SHORT) for _ in range(n_short)]
    params = SamplingParams(max_tokens=sz["max_tokens"], ignore_eos=True, temperature=0.0)
    steps = self.observe(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in hits + short], params)
    wall = time.perf_counter() - t0
    hit_outs = outs[:n_hits]
    return summary(wall, [o.metrics.ttft_s for o in outs[n_hits:]], steps,
                   hit_ttft_s=max(o.metrics.ttft_s for o in hit_outs),
                   hit_cached_tokens=min(o.num_cached_tokens for o in hit_outs),
                   **merge_counts(hit_outs))

  def run_b(self, llm, text) -> dict:
    return self.hits_among_short(llm, text, 1, self.sz["b_prompts"])

  def run_e(self, llm, text) -> dict:
    return self.hits_among_short(llm, text, self.sz["e_hits"], self.sz["e_prompts"])

  def run_c(self, llm, text) -> dict:
    from kvjax import SamplingParams  # noqa: PLC0415
    sz = self.sz
    engine = llm.engine
    steps = self.observe(llm)
    dec = SamplingParams(max_tokens=sz["c_decoder_max_tokens"], ignore_eos=True, temperature=0.0)
    params = SamplingParams(max_tokens=sz["c_max_tokens"], ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    decoders = {engine.add_request(text.take(64), dec) for _ in range(sz["c_decoders"])}
    started, done, last, gaps = set(), {}, {}, []
    while len(started) < len(decoders):  # every decoder has its first token
      for o in engine.step():
        started.add(o.request_id)
        last[o.request_id] = time.perf_counter()
    cold = engine.add_request(text.take(sz["cold_tokens"]), params)
    short = [engine.add_request(text.take(SHORT), params) for _ in range(sz["c_prompts"])]
    while engine.has_unfinished_requests():
      for o in engine.step():
        now = time.perf_counter()
        if o.request_id in decoders and o.request_id in last:
          gaps.append(now - last[o.request_id])
        last[o.request_id] = now
        if o.finished:
          done[o.request_id] = o
    wall = time.perf_counter() - t0
    return summary(wall, [done[r].metrics.ttft_s for r in short], steps,
                   cold_ttft_s=done[cold].metrics.ttft_s,
                   decoder_gap_max_s=max(gaps) if gaps else None)

  def run_d(self, llm, text) -> dict:
    from kvjax import SamplingParams  # noqa: PLC0415
    sz = self.sz
    convs = session_replay.load_conversations(DATA / TRACE, sz["d_convs"], sz["d_turns"],
                                              sz["d_turn_chars"], _SEED.value)
    params = SamplingParams(max_tokens=sz["d_max_tokens"], temperature=0.0)
    steps = self.observe(llm)
    history = [[] for _ in convs]
    ttfts, wall, all_outs = [], 0.0, []
    salt = f"{time.perf_counter_ns()}"  # a fresh session namespace per repetition
    for t in range(max(len(cv) for cv in convs)):
      live = [i for i, cv in enumerate(convs) if t < len(cv)]
      turns, prompts = [], []
      for i in live:
        history[i].append({"role": "user", "content": convs[i][t]})
        turn = llm.sessions.begin(f"{salt}-conv{i}")
        turns.append(turn)
        prompts.append(llm.sessions.prompt(turn, history[i]))
      t0 = time.perf_counter()
      outs = llm.generate([{"prompt_token_ids": list(p.token_ids)} for p in prompts],
                          [params] * len(prompts))
      wall += time.perf_counter() - t0
      all_outs += outs
      for i, turn, p, o in zip(live, turns, prompts, outs):
        llm.sessions.finish(turn, p, o.token_ids, o.text)
        history[i].append({"role": "assistant", "content": o.text})
        if t >= 1:
          ttfts.append(o.metrics.ttft_s)
      llm.flush()
    return summary(wall, ttfts, steps, turns=sum(len(cv) for cv in convs),
                   store_loaded_tokens=sum(o.metrics.num_loaded_tokens
                                           - o.metrics.num_device_cached_tokens
                                           for o in all_outs),
                   device_cached_tokens=sum(o.metrics.num_device_cached_tokens
                                            for o in all_outs),
                   **merge_counts(all_outs))


def print_verdict(cells: dict, verdict: dict, workloads: dict) -> None:
  for w, row in cells.items():
    print(f"\n{w}: {'setting':34s} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'steps':>6}"
          "  same plans as defaults")
    for n, c in row.items():
      same = ("-" if n == "defaults" or "defaults" not in row else
              c["plans_per_round"] == row["defaults"]["plans_per_round"])
      print(f"   {n:34s} {c['wall_s']:8.2f} {c['ttft_p50_s']:9.3f} {c['ttft_p99_s']:9.3f} "
            f"{c['steps']:6d}  {same}")
    for m, v in verdict.get(w, {}).items():
      flag = ""
      if is_loss(v):
        flag = "  (> 1.10, same plans: the machine's noise)" if v["same_plans"] else "  (> 1.10)"
      print(f"   defaults / best ({v['best_other']}) {m}: median of paired ratios "
            f"{v['ratio_defaults_over_best']:.3f}, ratio of medians {v['ratio_of_medians']:.3f}"
            f"{flag}")
    if w in workloads:
      s = workloads[w]
      print(f"   => {s['status']}: defaults / best {s['defaults_over_best']:.3f} "
            f"({s['best_setting']}, {s['metric']})")
      for m, t in s["trade_off"].items():
        costs = ", ".join(f"{k} x{r:.2f}" for k, r in t["winner_over_defaults"].items())
        print(f"      {m}: {t['best_setting']} costs {costs or 'nothing measured'}")


def rejudge(path: pathlib.Path) -> None:
  """Recomputes a results file's verdict and `workloads` from its cells; rewrites it and its
  plot (the measurements and the run's provenance unchanged)."""
  record = json.loads(path.read_text(encoding="utf-8"))
  cells = record["cells"]
  metrics = ("wall_s", "ttft_p50_s", "ttft_p99_s")
  verdict = {w: {m: v for m in metrics if (v := judge(row, m)) is not None}
             for w, row in cells.items() if "defaults" in row}
  workloads = workloads_summary(cells, verdict)
  print_verdict(cells, verdict, workloads)
  record["verdict"], record["workloads"] = verdict, workloads
  record["rejudged_by"] = benchlib.provenance(("kvjax",))
  path.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")
  plot(cells, path.with_suffix(".png"))
  print(f"rewrote {path}")


def main(argv):
  del argv
  if _REJUDGE.value:
    rejudge(pathlib.Path(_REJUDGE.value))
    return
  from kvjax import LLM  # noqa: PLC0415
  sz = sizes()
  names = _SETTINGS.value or list(SETTINGS)
  unknown = [n for n in names if n not in SETTINGS]
  if unknown:
    raise app.UsageError(f"unknown settings {unknown}; known: {list(SETTINGS)}")
  work = [w for w in "abcde" if w in _WORKLOADS.value]
  prov = benchlib.provenance(("kvjax", "jax", "jaxlib", "numpy", "tokenizers", "matplotlib",
                               "absl-py"))
  at_start = prov["machine"]
  order = benchlib.interleaved_rounds(names, sz["reps"])
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-bench-defaults-"))
  runs: dict[str, dict[str, list[dict]]] = {w: {n: [] for n in names} for w in work}
  t_all = time.perf_counter()
  try:
    probe = LLM(_MODEL.value, dtype="float32", compile_on_init=False)
    text = Text(probe.get_tokenizer())
    probe.close()
    for r, round_names in enumerate(order):
      for name in round_names:  # rotated: each setting meets every position
        options, store_only = SETTINGS[name]
        folder = tmp / f"{name.replace('=', '_')}_{r}"
        bench = Bench(name, options, sz, folder)
        groups = {None: [w for w in work if w in ("a", "c")],
                  "host": [w for w in work if w in ("b", "d")],
                  "slow": [w for w in work if w == "e"]}
        for store, ws in groups.items():
          if store_only:
            ws = [w for w in ws if w in STORE_WORKLOADS]
          if not ws:
            continue
          llm = bench.make(store)
          try:
            for w in ws:
              clock = benchlib.CpuClock()
              c = getattr(bench, f"run_{w}")(llm, text)
              c["cpu_share"] = clock.read()["cpu_share"]  # this process's CPU s per wall s
              runs[w][name].append(c)
              print(f"  round {r} {w} {name:34s} wall {c['wall_s']:7.2f} s  TTFT p50 "
                    f"{c['ttft_p50_s']:6.2f}  p99 {c['ttft_p99_s']:6.2f}  steps {c['steps']}"
                    f"  plan {c['plan']}", flush=True)
          finally:
            llm.close()
            shutil.rmtree(folder, ignore_errors=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  total = time.perf_counter() - t_all
  cells = {w: {n: median_cell(rs) for n, rs in row.items() if rs} for w, row in runs.items()}

  metrics = ("wall_s", "ttft_p50_s", "ttft_p99_s")
  verdict = {w: {m: v for m in metrics if (v := judge(row, m)) is not None}
             for w, row in cells.items() if "defaults" in row}
  workloads = workloads_summary(cells, verdict)
  print(f"\nbench_defaults{' --quick' if _QUICK.value else ''}: {_MODEL.value} f32, "
        f"{at_start['cpu']} x {at_start['cpu_count']}, {total / 60:.1f} min; median of "
        f"{sz['reps']} round(s) per cell")
  print_verdict(cells, verdict, workloads)

  record = {**prov, "benchmark": "bench_defaults", "machine_at_end": benchlib.machine(),
            "threads": {"cpu_count": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", "")},
            "seeds": {"sharegpt_sample": _SEED.value,
                                             "sampling": "greedy"},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": _MODEL.value, "dtype": "float32", "quick": _QUICK.value, "sizes": sz,
            "settings": {n: SETTINGS[n][0] for n in names}, "rounds": sz["reps"],
            "setting_order": "rotated by one per round (benchlib.interleaved_rounds)",
            "round_orders": order,
            "link_mb_s": _LINK.value,
            "max_num_seqs": MAX_SEQS, "total_s": total, "cells": cells, "verdict": verdict,
            "workloads": workloads}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  stem = "bench_defaults" + ("_quick" if _QUICK.value else "") + (f"_{_TAG.value}" if _TAG.value
                                                                  else "")
  benchlib.write_json(out / f"{stem}.json", record)
  wrote = plot(cells, out / f"{stem}.png")
  print(f"wrote {out / stem}.json" + (" and .png" if wrote else ""))


def plot(cells: dict, path: pathlib.Path) -> bool:
  """Bars of each setting's medians over the defaults'; False when matplotlib is missing."""
  plt = pyplot()
  if plt is None:
    return False
  metrics = (("wall_s", "wall"), ("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"))
  fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 4.2), squeeze=False)
  for ax, (w, row) in zip(axes[0], cells.items()):
    names = list(row)
    if "defaults" not in row:
      continue
    for k, (m, label) in enumerate(metrics):
      d = row["defaults"][m] or 1.0
      ys = [(row[n][m] or 0.0) / d for n in names]
      ax.bar([i + 0.27 * (k - 1) for i in range(len(names))], ys, width=0.27, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1 / 1.1, color="r", lw=0.6, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("=", "=\n") for n in names], rotation=90, fontsize=6)
    ax.set_title(f"workload {w}", fontsize=9)
    ax.set_ylabel("/ defaults (below the red line: defaults > 1.1x)", fontsize=7)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


if __name__ == "__main__":
  sys.path.insert(0, str(REPO))
  app.run(main)
