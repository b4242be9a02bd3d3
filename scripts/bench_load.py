"""Loading a stored book prompt: cold, load_only and cake TTFT, plain and verified read rates.

    python scripts/bench_load.py [--quick] [--book PATH] [--tokens 7400] [--repeats 8]

One run, one local file store, default `LLM` settings (a plain store URL: one disk tier, no
host tier, so every repeat reads the store), only the public API (`kvjax.LLM`, `SamplingParams`,
`RequestOutput.metrics`):

  1. save: one `kv_merge_mode="compute_only"` request computes the prompt and saves its
     chunks (`llm.flush()` waits for them); untimed.
  2. plain read: every stored data file read sequentially (`open().read()`, page cache).
  3. verified loads: every chunk through `ChunkStore.get` (read + size + checksum + token ids +
     staging in host memory, no insertion), 1 and `kv_max_loads_in_flight` (2) at a time.
  4. cold (`compute_only`), warm `load_only` and `cake`, one `LLM` per mode, each warmed up by
     one untimed request, then `--repeats` interleaved rounds (`benchlib.interleaved_rounds`:
     cold load_only cake, load_only cake cold, cake cold load_only, ...): one request per mode
     per round, so a drift of the machine's load spreads over all three. Each request records
     this process's CPU share (`cpu_share`, `benchlib.CpuClock`); per mode the median, min, max
     and spread over the rounds (`summary`, `benchlib.summarize`).
  5. the suffix alone: a prompt of just the tokens after the stored prefix (attention over the
     suffix only: a lower bound of the suffix compute a warm request does; the API has no number
     for that part of a warm TTFT), `--cold_repeats` requests.
  6. emulated link (`kv_link_bytes_per_s`, default 100 MB/s), `load_only`, default loads in
     flight.

Targets (issue 10), printed met / not met and stored in the JSON:
  - cake median TTFT <= 1.05 x min(load_only median, cold median); no cake repeat above 1.25 x.
  - verified loads >= 4 GB/s (2 loads in flight, 2 cores).
  - link: load_only TTFT <= 1.1 x (stored bytes / link rate) + unlimited load_only TTFT.

Every repeat also keeps the engine's step records (`Engine.add_step_observer`: per step the
planned prefill pieces, loads issued, inserts and releases, the measured compute and the loads
that landed, with their link seconds) and a summary of them (meeting index, what compute took,
when loads landed, the planner's link estimate before the request), printed per repeat: what a
missed target is diagnosed from.

Writes `<out>.json` (`benchlib.provenance()`, settings, threads, seeds, every repeat) and
`<out>.png` (matplotlib, the `bench` extra).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_BOOK = flags.DEFINE_string(
    "book", "../shared/data/books/pg1952_the_yellow_wallpaper_gilman.txt",
    "Book text; a relative path is taken from the repository root.")
_TOKENS = flags.DEFINE_integer("tokens", 7400, "Prompt tokens (the book's first ones).")
_REPEATS = flags.DEFINE_integer(
    "repeats", 8, "Interleaved rounds: one cold, one load_only and one cake request each.")
_COLD_REPEATS = flags.DEFINE_integer(
    "cold_repeats", None, "Suffix-alone requests (default --repeats).")
_LINK_MB_S = flags.DEFINE_float("link_mb_s", 100.0, "Emulated link rate, MB/s (1e6 bytes/s).")
_LINK_REPEATS = flags.DEFINE_integer("link_repeats", 2, "Requests over the emulated link.")
_STORE = flags.DEFINE_string("store", None, "Store directory (default: a fresh temp dir, "
                             "removed at the end).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/bench_load",
                           "Output path without extension (relative: from the repo root).")
_SEED = flags.DEFINE_integer("seed", 0, "LLM seed.")
_QUICK = flags.DEFINE_bool("quick", False, "Short run: 2048 tokens, 3 rounds, 1 link run.")


def _runtime() -> dict[str, object]:
  """What `benchlib.machine()` does not say: the cores this process may use, the JAX backend
  and the thread settings."""
  import jax  # noqa: PLC0415
  return {"affinity": len(os.sched_getaffinity(0)), "jax_backend": jax.default_backend(),
          "threads": {k: os.environ.get(k) for k in ("XLA_FLAGS", "OMP_NUM_THREADS",
                                                       "TF_NUM_INTEROP_THREADS")}}


class _StepLog:
  """The engine's step records of one request (`Engine.add_step_observer`: plain data, public).

  Keeps, per step, what the scheduler planned (prefill pieces, loads issued, inserts, releases,
  the wait it allowed) and what the executor reported (measured compute, landed loads).
  """

  def __init__(self):
    self.records = []

  def __call__(self, record) -> None:
    self.records.append(record)

  def take(self, arrival_s: float) -> list[dict[str, object]]:
    """The records since the last call, times in seconds since `arrival_s`."""
    out = []
    for rec in self.records:
      plan, res = rec.plan, rec.result
      out.append({
          "t0": round(rec.started_s - arrival_s, 4), "t1": round(rec.ended_s - arrival_s, 4),
          "planner_ms": round(1e3 * rec.planner_s, 3),
          "prefills": [[c.start, c.num_tokens] for c in plan.prefills],
          "loads_issued": [x.index for x in plan.loads],
          "reads_at_once": max((x.max_in_flight for x in plan.loads), default=None),
          "inserts": [x.index for x in plan.inserts],
          "releases": [j for _, j in plan.releases],
          "wait_s": plan.wait_s,
          "compute": [[c.start, c.num_tokens, round(c.started_s - arrival_s, 4),
                       round(c.seconds, 4)] for c in res.compute],
          "landed": [[r.index, r.ok, r.nbytes, round(r.started_s - arrival_s, 4) if r.started_s
                      else None, round(r.done_s - arrival_s, 4) if r.done_s else None,
                      round(r.link_s, 5), r.reason] for r in res.loads]})
    self.records = []
    return out

  def clear(self) -> None:
    """Drops the records so far (warm-up requests)."""
    self.records = []


def _summary(steps: list[dict[str, object]]) -> dict[str, object]:
  """What compute took and when loads landed, from one request's step records."""
  compute = [c for s in steps for c in s["compute"]]
  landed = [x for s in steps for x in s["landed"] if x[1]]
  return {
      "steps": len(steps), "empty_steps": sum(1 for s in steps if not s["prefills"]
                                              and not s["inserts"]),
      "compute_s": round(sum(c[3] for c in compute), 4),
      "compute_tokens": sum(c[1] for c in compute),
      "first_compute_start_s": compute[0][2] if compute else None,
      "loads_issued": sum(len(s["loads_issued"]) for s in steps),
      "loads_landed": len(landed),
      "first_landing_s": min((x[4] for x in landed), default=None),
      "last_landing_s": max((x[4] for x in landed), default=None),
      "landed_bytes": sum(x[2] for x in landed),
      "link_gb_s_from_link_s": (round(sum(x[2] for x in landed) / sum(x[5] for x in landed) / 1e9,
                                      3) if landed and sum(x[5] for x in landed) > 0 else None),
      "reads_at_once": max((s["reads_at_once"] or 0 for s in steps), default=0) or None}


def _ttfts(llm, ids, params, n, log: _StepLog | None = None) -> list[dict[str, object]]:
  out = []
  for _ in range(n):
    before = llm.engine.stats()
    clock = benchlib.CpuClock()
    res = llm.generate({"prompt_token_ids": ids}, params)[0]
    cpu = clock.read()
    after = llm.engine.stats()
    m = res.metrics
    merge = m.merge
    row = {"ttft_s": m.ttft_s, "cpu_share": cpu["cpu_share"], "loaded_tokens": m.num_loaded_tokens,
           "computed_tokens": m.num_computed_tokens, "rejected": m.num_rejected_chunks,
           "tiers": sorted(set(m.loaded_from_tiers)),
           "meeting_index": None if merge is None else merge.meeting_index,
           "loaded_bytes": None if merge is None else merge.loaded_bytes,
           "lookup_s": m.lookup_s,
           "link_estimate_before_gb_s": before.link_bandwidth_bytes_per_s / 1e9,
           "link_estimate_after_gb_s": after.link_bandwidth_bytes_per_s / 1e9}
    if merge is not None:
      row["chunks_computed"] = list(merge.chunks_computed)
      row["chunks_loaded"] = list(merge.chunks_loaded)
      row["chunks_wasted"] = list(merge.chunks_wasted)
    if before.loader is not None:
      row["loader"] = {k: getattr(after.loader, k) - getattr(before.loader, k)
                       for k in ("started", "landed", "cancelled", "read_bytes", "link_busy_s")}
    if log is not None:
      row["step_records"] = log.take(m.arrival_s)
      row["summary"] = _summary(row["step_records"])
    out.append(row)
  return out


def _median(runs) -> float:
  return statistics.median(r["ttft_s"] for r in runs)


def _plain_read(files: list[str]) -> tuple[int, float]:
  best = float("inf")
  nbytes = 0
  for _ in range(3):  # page cache warm after the first pass
    t0 = time.perf_counter()
    nbytes = 0
    for f in files:
      with open(f, "rb") as fh:
        nbytes += len(fh.read())
    best = min(best, time.perf_counter() - t0)
  return nbytes, best


def _verified(store, records, in_flight: int) -> tuple[int, float]:
  from kvjax.storage import ChunkHit  # noqa: PLC0415
  from kvjax.storage.backends.chunk_store import run_sync  # noqa: PLC0415

  async def body():
    sem = asyncio.Semaphore(in_flight)

    async def one(r):
      async with sem:
        hit = await store.get(r.chunk_hash, r.token_ids, r.namespace, r.layout)
      if not isinstance(hit, ChunkHit):
        raise RuntimeError(f"stored chunk did not verify: {hit}")
      return hit.encoding.nbytes

    return sum(await asyncio.gather(*(one(r) for r in records)))

  best, nbytes = float("inf"), 0
  for _ in range(3):
    t0 = time.perf_counter()
    nbytes = run_sync(body())
    best = min(best, time.perf_counter() - t0)
  return nbytes, best


def _plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  names = ["cold", "suffix", "load_only", "cake", "link"]
  for i, name in enumerate(names):
    ys = [r["ttft_s"] for r in result["runs"][name]]
    a.bar(i, statistics.median(ys), color="C0" if name != "cake" else "C1", alpha=0.6)
    a.scatter([i] * len(ys), ys, color="k", s=10, zorder=3)
  a.set_xticks(range(len(names)), [n if n != "link" else f"load_only\n@{_LINK_MB_S.value:g} MB/s"
                                   for n in names])
  a.set_ylabel("TTFT, s (bar: median; dots: repeats)")
  a.set_title(f"{result['prompt']['tokens']}-token book prompt")
  rates = result["rates_gb_s"]
  b.bar(range(len(rates)), list(rates.values()), color="C2")
  b.axhline(4.0, color="r", ls="--", label="target: verified >= 4 GB/s")
  b.set_xticks(range(len(rates)), [k.replace("_", "\n") for k in rates], fontsize=8)
  b.set_ylabel("GB/s (1e9 bytes/s)")
  b.set_title("store reads, page cache")
  b.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  del argv
  import kvjax  # noqa: PLC0415
  from kvjax.storage.backends.chunk_store import ChunkStore  # noqa: PLC0415

  prov = benchlib.provenance(("kvjax", "jax", "jaxlib", "numpy", "tensorstore", "xxhash",
                               "matplotlib"))
  tokens = 2048 if _QUICK.value else _TOKENS.value
  repeats = 3 if _QUICK.value else _REPEATS.value
  link_repeats = 1 if _QUICK.value else _LINK_REPEATS.value
  book = pathlib.Path(_BOOK.value)
  book = book if book.is_absolute() else (REPO / book).resolve()
  text = book.read_text(encoding="utf-8")
  own_store = _STORE.value is None
  store_dir = tempfile.mkdtemp(prefix="kvjax-bench-load-") if own_store else _STORE.value
  params = kvjax.SamplingParams(max_tokens=1, temperature=0.0)
  runs: dict[str, list] = {}
  try:
    def make(mode, **kw):
      # No device prefix cache: every repeat reads the store (the prefix cache would serve the
      # repeats instead).
      llm = kvjax.LLM(kv_store=store_dir, kv_merge_mode=mode, seed=_SEED.value,
                      enable_prefix_caching=False, **kw)
      log = _StepLog()
      llm.engine.add_step_observer(log)
      return llm, log

    llms = {}
    llms["cold"] = make("compute_only")
    llm, log = llms["cold"]
    ids = llm.get_tokenizer().encode(text)[:tokens]
    if len(ids) < tokens:
      raise app.UsageError(f"{book} has {len(ids)} tokens, fewer than --tokens={tokens}")
    c = 256
    stored_tokens = c * ((len(ids) - 1) // c)
    _ttfts(llm, ids, params, 1)  # compiles, and saves the prompt's chunks
    llm.flush()
    log.clear()  # the tokenizer run and the saving run: no records wanted

    store = ChunkStore(store_dir)
    records = store.records_sync()
    files = [f for r in records for f in store.object_files(r)]
    plain_bytes, plain_s = _plain_read(files)
    v1_bytes, v1_s = _verified(store, records, 1)
    v2_bytes, v2_s = _verified(store, records, 2)
    store.close()

    for key, mode in (("load_only", "load_only"), ("cake", "cake")):
      llms[key] = make(mode)
      _ttfts(llms[key][0], ids, params, 1)  # compiles; its loads warm the page cache too
      llms[key][1].clear()
    order = benchlib.interleaved_rounds(list(llms), repeats)
    for mode in llms:
      runs[mode] = []
    for round_order in order:
      for mode in round_order:
        mode_llm, mode_log = llms[mode]
        runs[mode] += _ttfts(mode_llm, ids, params, 1, mode_log)
    for mode in ("load_only", "cake"):
      llms.pop(mode)[0].close()
    cold_repeats = _COLD_REPEATS.value or repeats
    runs["suffix"] = _ttfts(llm, ids[stored_tokens:], params, cold_repeats, log)
    llm.close()
    rate = _LINK_MB_S.value * 1e6
    llm, log = make("load_only", kv_link_bytes_per_s=rate)
    runs["link"] = _ttfts(llm, ids, params, link_repeats, log)
    llm.close()
  finally:
    if own_store:
      shutil.rmtree(store_dir, ignore_errors=True)

  med = {k: _median(v) for k, v in runs.items()}
  better = min(med["load_only"], med["cold"])
  cake_max = max(r["ttft_s"] for r in runs["cake"])
  verified_gb_s = v2_bytes / v2_s / 1e9
  link_bound = 1.1 * plain_bytes / rate + med["load_only"]
  targets = {
      "cake_median_le_1.05x_better": {"value": med["cake"], "bound": 1.05 * better,
                                      "met": med["cake"] <= 1.05 * better},
      "cake_max_le_1.25x_better": {"value": cake_max, "bound": 1.25 * better,
                                   "met": cake_max <= 1.25 * better},
      "verified_load_ge_4_gb_s": {"value": verified_gb_s, "bound": 4.0,
                                  "met": verified_gb_s >= 4.0},
      "link_load_only_le_1.1x_bytes_over_rate_plus_unlimited": {
          "value": med["link"], "bound": link_bound, "met": med["link"] <= link_bound},
  }
  result = {
      **prov, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "runtime": _runtime(),
      "seeds": {"llm_seed": _SEED.value, "sampling": "greedy"}, "quick": _QUICK.value,
      "settings": {"repeats": repeats, "link_repeats": link_repeats,
                   "link_bytes_per_s": rate, "kv_chunk_size": c,
                   "kv_max_loads_in_flight": "default", "store": "local file store, one tier"},
      "prompt": {"book": book.name, "tokens": len(ids), "stored_tokens": stored_tokens,
                 "suffix_tokens": len(ids) - stored_tokens},
      "store": {"chunks": len(records), "stored_bytes": plain_bytes, "files": len(files)},
      "rates_gb_s": {"plain_read": plain_bytes / plain_s / 1e9,
                     "verified_1_in_flight": v1_bytes / v1_s / 1e9,
                     "verified_2_in_flight": verified_gb_s},
      "order": order,
      "summary": {k: benchlib.summarize([r["ttft_s"] for r in v]) for k, v in runs.items()},
      "median_ttft_s": med, "runs": runs, "targets": targets,
  }
  out = pathlib.Path(_OUT.value)
  out = out if out.is_absolute() else REPO / out
  benchlib.write_json(out.with_suffix(".json"), result)
  _plot(result, out.with_suffix(".png"))

  print(f"{len(ids)}-token prompt ({stored_tokens} stored in {len(records)} chunks, "
        f"{plain_bytes / 1e6:.1f} MB), {repeats} interleaved rounds of cold, load_only, cake")
  print(f"{'run':<28}{'median TTFT s':>14}{'min':>8}{'max':>8}  loaded tokens")
  for k, v in runs.items():
    ys = [r["ttft_s"] for r in v]
    print(f"{k:<28}{med[k]:>14.3f}{min(ys):>8.3f}{max(ys):>8.3f}  "
          f"{[r['loaded_tokens'] for r in v]}")
  print("\nper repeat, from the step records (times in s since arrival; link est.: the planner's "
        "bandwidth estimate before the request, GB/s):")
  print(f"{'run':<10}{'rep':>4}{'TTFT':>7}{'meet':>6}{'computed':>9}{'compute s':>10}"
        f"{'loads':>7}{'landed':>7}{'1st land':>9}{'last land':>10}{'link est.':>10}"
        f"{'reads':>6}{'steps':>6}")
  for k in ("load_only", "cake", "link"):
    for i, r in enumerate(runs[k]):
      sm = r["summary"]
      f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
      print(f"{k:<10}{i:>4}{r['ttft_s']:>7.3f}{str(r['meeting_index']):>6}"
            f"{r['computed_tokens']:>9}{sm['compute_s']:>10.3f}{sm['loads_issued']:>7}"
            f"{sm['loads_landed']:>7}{f(sm['first_landing_s']):>9}{f(sm['last_landing_s']):>10}"
            f"{r['link_estimate_before_gb_s']:>10.3f}{str(sm['reads_at_once']):>6}"
            f"{sm['steps']:>6}")
  for k, v in result["rates_gb_s"].items():
    print(f"{k:<28}{v:>10.2f} GB/s")
  for k, t in targets.items():
    print(f"target {k}: {t['value']:.3f} vs {t['bound']:.3f}: "
          f"{'met' if t['met'] else 'NOT met'}")
  print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  app.run(main)
