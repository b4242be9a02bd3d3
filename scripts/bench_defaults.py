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
that arrive with the cold one; d: every turn >= 2). Each cell is the best (lowest) of `--reps`
repetitions on the same engine (default 1). The defaults run first and again last, and the
verdict compares the mean of the two with the best other setting (the load of a shared machine
drifts over a run). The sizes (`sizes()`; `--quick` halves most). Besides, per cell, the engine steps taken, so two settings
that planned the same steps are seen to differ only by the machine's noise (a shared 2-core VM).

    .venv/bin/python scripts/bench_defaults.py --quick   # a few minutes
    .venv/bin/python scripts/bench_defaults.py           # about 15 minutes on 2 CPU cores

Writes <out_dir>/bench_defaults[_quick].json (machine, versions, threads, git SHA, seeds,
sizes, every cell, the defaults' ratio to the best setting per workload and metric) and a plot of
the same name, and prints the table.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

from benchlib import git_sha, machine, pyplot, versions  # scripts/benchlib.py
import session_replay  # scripts/session_replay.py: the ShareGPT loader

REPO = pathlib.Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
TRACE = "sharegpt/sharegpt_v3_multiturn_1000.json"

_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model.")
_QUICK = flags.DEFINE_bool("quick", False, "Smaller workloads and one repetition.")
_BOOK = flags.DEFINE_string("book", str(DATA / "books" / "pg11_alice_in_wonderland_carroll.txt"),
                            "Text the prompts are cut from.")
_WORKLOADS = flags.DEFINE_list("workloads", ["a", "b", "c", "d", "e"], "Workloads to run.")
_SETTINGS = flags.DEFINE_list("settings", [], "Setting names to run (default: all).")
_REPS = flags.DEFINE_integer("reps", 1, "Repetitions per cell (the best is kept).")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the ShareGPT conversation sample.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")
_LINK = flags.DEFINE_float("link_mb_s", 20.0, "e: the disk tier's emulated read link, MB/s.")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the output files' names.")

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
AGAIN = "defaults (again, last)"


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


def summary(wall: float, ttfts: list[float], steps: int, **extra) -> dict:
  return {"wall_s": wall, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
          "n_short": len(ttfts), "steps": steps, **extra}


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
    steps = []
    llm.engine.add_step_observer(lambda rec: steps.append(1))
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
    return summary(wall, [o.metrics.ttft_s for o in outs], len(steps),
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
    return summary(wall, [o.metrics.ttft_s for o in outs[n_hits:]], len(steps),
                   hit_ttft_s=max(o.metrics.ttft_s for o in hit_outs),
                   hit_cached_tokens=min(o.num_cached_tokens for o in hit_outs))

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
    return summary(wall, [done[r].metrics.ttft_s for r in short], len(steps),
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
    ttfts, wall = [], 0.0
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
      for i, turn, p, o in zip(live, turns, prompts, outs):
        llm.sessions.finish(turn, p, o.token_ids, o.text)
        history[i].append({"role": "assistant", "content": o.text})
        if t >= 1:
          ttfts.append(o.metrics.ttft_s)
      llm.flush()
    return summary(wall, ttfts, len(steps), turns=sum(len(cv) for cv in convs))


def best(runs: list[dict]) -> dict:
  """The lowest of each timing over the repetitions (the machine's noise only adds)."""
  out = dict(runs[0])
  for k, v in runs[0].items():
    if k.endswith("_s") and all(r.get(k) is not None for r in runs):
      out[k] = min(r[k] for r in runs)
  out["reps"] = runs
  return out


def main(argv):
  del argv
  from kvjax import LLM  # noqa: PLC0415
  sz = sizes()
  names = _SETTINGS.value or list(SETTINGS)
  if names[0] == "defaults" and len(names) > 1:
    names.append(AGAIN)  # the defaults first and last: the machine's drift shows
  work = [w for w in "abcde" if w in _WORKLOADS.value]
  at_start = machine()
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-bench-defaults-"))
  cells: dict[str, dict[str, dict]] = {w: {} for w in work}
  t_all = time.perf_counter()
  try:
    probe = LLM(_MODEL.value, dtype="float32", compile_on_init=False)
    text = Text(probe.get_tokenizer())
    probe.close()
    for name in names:
      options, store_only = SETTINGS[name.replace(AGAIN, "defaults")]
      bench = Bench(name, options, sz, tmp / name.replace("=", "_"))
      groups = {None: [w for w in work if w in ("a", "c")], "host": [w for w in work
                                                                     if w in ("b", "d")],
                "slow": [w for w in work if w == "e"]}
      for store, ws in groups.items():
        if store_only:
          ws = [w for w in ws if w in STORE_WORKLOADS]
        if not ws:
          continue
        llm = bench.make(store)
        try:
          for w in ws:
            runs = [getattr(bench, f"run_{w}")(llm, text) for _ in range(sz["reps"])]
            cells[w][name] = best(runs)
            c = cells[w][name]
            print(f"  {w} {name:34s} wall {c['wall_s']:7.2f} s  TTFT p50 {c['ttft_p50_s']:6.2f}"
                  f"  p99 {c['ttft_p99_s']:6.2f}  steps {c['steps']}", flush=True)
        finally:
          llm.close()
          shutil.rmtree(tmp / name.replace("=", "_"), ignore_errors=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  total = time.perf_counter() - t_all

  metrics = ("wall_s", "ttft_p50_s", "ttft_p99_s")
  verdict = {}
  for w, row in cells.items():
    if "defaults" not in row:
      continue
    # The defaults' figure: the mean of their first and last measurement when both exist
    # (the other settings ran in between, under the machine's load of the moment).
    runs = [row[n] for n in ("defaults", AGAIN) if n in row]
    verdict[w] = {}
    for m in metrics:
      others = {n: c[m] for n, c in row.items()
                if n not in ("defaults", AGAIN) and c[m] is not None}
      if not others or any(r[m] is None for r in runs):
        continue
      d = statistics.fmean(r[m] for r in runs)
      win = min(others, key=others.get)
      verdict[w][m] = {"defaults": d, "defaults_first_last": [r[m] for r in runs],
                       "best_other": win, "best_other_value": others[win],
                       "ratio_defaults_over_best": d / others[win] if others[win] else None}
  print(f"\nbench_defaults{' --quick' if _QUICK.value else ''}: {_MODEL.value} f32, "
        f"{at_start['cpu']} x {at_start['cpu_count']}, {total / 60:.1f} min; best of "
        f"{sz['reps']} rep(s) per cell")
  for w, row in cells.items():
    print(f"\n{w}: {'setting':34s} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'steps':>6}")
    for n, c in row.items():
      print(f"   {n:34s} {c['wall_s']:8.2f} {c['ttft_p50_s']:9.3f} {c['ttft_p99_s']:9.3f} "
            f"{c['steps']:6d}")
    for m, v in verdict.get(w, {}).items():
      r = v["ratio_defaults_over_best"]
      print(f"   defaults (mean of first and last) / best ({v['best_other']}) {m}: {r:.3f}"
            f"{'  (> 1.10)' if r is not None and r > 1.10 else ''}")

  record = {"benchmark": "bench_defaults", "machine": at_start, "machine_at_end": machine(),
            "threads": {"cpu_count": os.cpu_count(),
                        "xla_flags": os.environ.get("XLA_FLAGS", "")},
            "versions": versions("kvjax", "jax", "tokenizers", "matplotlib", "absl-py"),
            "git_sha": git_sha(), "seeds": {"sharegpt_sample": _SEED.value,
                                             "sampling": "greedy"},
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "model": _MODEL.value, "dtype": "float32", "quick": _QUICK.value, "sizes": sz,
            "settings": {n: SETTINGS[n.replace(AGAIN, "defaults")][0] for n in names},
            "link_mb_s": _LINK.value,
            "max_num_seqs": MAX_SEQS, "total_s": total, "cells": cells, "verdict": verdict}
  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  stem = "bench_defaults" + ("_quick" if _QUICK.value else "") + (f"_{_TAG.value}" if _TAG.value
                                                                  else "")
  (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
  plot(cells, out / f"{stem}.png")
  print(f"wrote {out / stem}.json and .png")


def plot(cells: dict, path: pathlib.Path) -> None:
  plt = pyplot()
  if plt is None:
    return
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


if __name__ == "__main__":
  sys.path.insert(0, str(REPO))
  app.run(main)
