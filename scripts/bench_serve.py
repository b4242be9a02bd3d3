"""Concurrent clients against `python -m kvjax.serve`: TTFT and throughput, cold store vs warm.

Two real workloads from ../shared/data (see its README):
  longchat  LongChat topic records (the prompts CacheGen and Cake evaluate on), each asked several
            questions: the same long document, then "What is the <k>-th topic ...?". A document
            is cut to --doc_chars characters (cut at the end of a turn) so it fits the context.
  sharegpt  ShareGPT multi-turn conversations replayed turn by turn: turn k sends the real
            earlier turns plus the next user message, so turn k's prompt extends turn k-1's.
Each workload runs twice on one server: "cold" on an empty store, then, once its saves are
written (POST /admin/flush_kv), "warm". "Warm" is served from the device prefix cache where
blocks are still resident, from the store otherwise. N clients (the openai client, streaming) pull tasks from a
queue; a document's questions and a conversation's turns are one task, sent in order.

Rounds (`--rounds`, default 3; 1 with --quick unless given): the whole cold/warm pair of every
workload again, under a new `cache_salt` per round (round r's stored KV and prefix blocks are
keyed apart from every other round's, so each round's cold phase is cold on the same server);
the workloads' order rotates per round (`benchlib.interleaved_rounds`). Cold precedes warm
within a round by construction. Per phase: the server's CPU share (its CPU seconds from /proc
over the phase's wall seconds); per workload and phase, `benchlib.summarize` over the rounds of
TTFT p50/p99 and output tokens/s, and the paired warm / cold TTFT p50 ratio per round.

TTFT is measured by the client (request sent to the first streamed event, which the server sends
with the first token) and also reported by the server (`kvjax.ttft_s`, submission to the first
token). Output tokens/s is all completion tokens over the phase's wall time. Device KV memory
per server (`kvjax_kv_cache_bytes` on /metrics): reserved, and the peak held by requests (paged:
most pool blocks held at once).

    .venv/bin/python scripts/bench_serve.py --quick          # short run, real SmolLM2
    .venv/bin/python scripts/bench_serve.py --clients=8 --docs=4 --questions=4 --conversations=8
    .venv/bin/python scripts/bench_serve.py --url=http://host:8000   # an already running server

Writes <out_dir>/bench_serve.json (`benchlib.provenance()`, seeds, threads, settings,
per-request rows, summaries) and bench_serve.png, and prints a table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import openai
from absl import app, flags, logging

import benchlib  # scripts/benchlib.py
from benchlib import machine

REPO = pathlib.Path(__file__).resolve().parent.parent
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
            "tenth"]

_DATA = flags.DEFINE_string("data_dir", str(REPO.parent / "shared" / "data"),
                            "The shared real-workload data (longchat/, sharegpt/).")
_URL = flags.DEFINE_string("url", None, "A running server; default: start one (below).")
_MODEL = flags.DEFINE_string("model", "SmolLM2-135M-Instruct", "Model of the started server.")
_SERVER_FLAGS = flags.DEFINE_multi_string("server_flag", [],
                                          "An extra flag of the started server, repeatable, "
                                          "e.g. --server_flag=kv_link_bytes_per_s=1e8.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", None, "Running requests of the started "
                                     "server (default: the server's, 64).")
_KV_CHUNK = flags.DEFINE_integer("kv_chunk_size", 256, "Stored chunk size of the started server.")
_WORKLOADS = flags.DEFINE_list("workloads", ["longchat", "sharegpt"], "Workloads to run.")
_CLIENTS = flags.DEFINE_integer("clients", 4, "Concurrent clients.")
_DOCS = flags.DEFINE_integer("docs", 4, "LongChat documents.")
_QUESTIONS = flags.DEFINE_integer("questions", 3, "Questions per document.")
_DOC_CHARS = flags.DEFINE_integer("doc_chars", 6000, "Characters kept of each document.")
_CONVS = flags.DEFINE_integer("conversations", 4, "ShareGPT conversations.")
_TURNS = flags.DEFINE_integer("turns", 3, "Turns replayed per conversation, at most.")
_TURN_CHARS = flags.DEFINE_integer("turn_chars", 1200, "Characters kept of each turn.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "Output tokens per request.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the choice of documents and conversations.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of every workload's cold and warm phase, each "
                                "under its own cache_salt (--quick: 1 unless given).")
_QUICK = flags.DEFINE_bool("quick", False, "Short run: 2 docs x 2 questions of 4000 chars, "
                           "2 conversations x 3 turns, 8 output tokens, 2 clients.")
_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")


# ------------------------------------------------------------------------------- workloads
def longchat_tasks(rng: random.Random, docs: int, questions: int, doc_chars: int) -> list:
  """Per document, `questions` chat requests sharing the document as their prefix."""
  path = pathlib.Path(_DATA.value) / "longchat" / "topics_10.jsonl"
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
  tasks = []
  for row in rng.sample(rows, docs):
    record = row["prompt"][:row["prompt"].find("Now the record ends.")]
    cut = record.rfind("\n USER:", 0, doc_chars)
    record = record[:cut if cut > 0 else doc_chars]
    tasks.append([[{"role": "user", "content": f"{record}\nNow the record ends. What is the "
                    f"{ORDINALS[q]} topic we discussed? Only give me the topic name."}]
                  for q in range(questions)])
  return tasks


def sharegpt_tasks(rng: random.Random, convs: int, turns: int, turn_chars: int) -> list:
  """Per conversation, its first `turns` user turns, each with the real earlier turns."""
  path = pathlib.Path(_DATA.value) / "sharegpt" / "sharegpt_v3_multiturn_1000.json"
  data = json.loads(path.read_text(encoding="utf-8"))
  tasks = []
  for conv in rng.sample(data, convs):
    msgs = [{"role": "user" if m["from"] == "human" else "assistant",
             "content": m["value"][:turn_chars]} for m in conv["conversations"]]
    tasks.append([msgs[:2 * k + 1] for k in range(min(turns, (len(msgs) + 1) // 2))])
  return tasks


# ------------------------------------------------------------------------------- clients
@dataclasses.dataclass
class Row:
  workload: str
  phase: str
  round: int
  task: int
  step: int
  ttft_s: float | None = None
  server_ttft_s: float | None = None
  e2e_s: float | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0
  completion_tokens: int = 0
  error: str | None = None


async def one_request(client, model, messages, max_tokens, row: Row, salt: str) -> None:
  t0 = time.perf_counter()
  try:
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, seed=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"cache_salt": salt})
    async for chunk in stream:
      if row.ttft_s is None:
        row.ttft_s = time.perf_counter() - t0
      if chunk.usage is not None:
        row.prompt_tokens = chunk.usage.prompt_tokens
        row.completion_tokens = chunk.usage.completion_tokens
        details = chunk.usage.prompt_tokens_details
        row.cached_tokens = details.cached_tokens if details else 0
      ext = (chunk.model_extra or {}).get("kvjax")
      if ext:
        row.server_ttft_s = ext.get("ttft_s")
  except Exception as e:  # noqa: BLE001 - counted, the run goes on
    row.error = f"{type(e).__name__}: {e}"[:200]
  row.e2e_s = time.perf_counter() - t0


async def run_phase(url, model, workload, phase, tasks, clients, max_tokens, round_index):
  """Runs every task with `clients` workers under round `round_index`'s cache salt; returns
  (rows, wall seconds)."""
  queue: asyncio.Queue = asyncio.Queue()
  for i, t in enumerate(tasks):
    queue.put_nowait((i, t))
  rows: list[Row] = []

  async def worker(client):
    while not queue.empty():
      i, task = queue.get_nowait()
      for step, messages in enumerate(task):
        row = Row(workload, phase, round_index, i, step)
        rows.append(row)
        await one_request(client, model, messages, max_tokens, row,
                          f"bench-serve-round-{round_index}")

  t0 = time.perf_counter()
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=3600) as client:
    await asyncio.gather(*(worker(client) for _ in range(clients)))
  return rows, time.perf_counter() - t0


def summarize(rows: list[Row], wall_s: float) -> dict:
  ok = [r for r in rows if r.error is None]
  ttft = np.array([r.ttft_s for r in ok]) if ok else np.array([np.nan])
  server = np.array([r.server_ttft_s for r in ok if r.server_ttft_s is not None] or [np.nan])
  prompt = sum(r.prompt_tokens for r in ok)
  return {
      "requests": len(rows), "errors": len(rows) - len(ok), "wall_s": wall_s,
      "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
      "ttft_p99_s": float(np.percentile(ttft, 99)),
      "server_ttft_p50_s": float(np.percentile(server, 50)),
      "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s,
      "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
      "cached_fraction": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
  }


# ------------------------------------------------------------------------------- server
def start_server(store_dir: str) -> tuple[subprocess.Popen, str, str]:
  """Starts `python -m kvjax.serve` on a free port; returns (process, url, model name)."""
  flags = [f"--model={_MODEL.value}", f"--kv_store=file://{store_dir}",
           f"--kv_chunk_size={_KV_CHUNK.value}",
           *([f"--max_num_seqs={_MAX_NUM_SEQS.value}"] if _MAX_NUM_SEQS.value else []),
           "--enable_admin",
           *[f"--{f}" for f in _SERVER_FLAGS.value]]
  return benchlib.start_server(flags, os.path.join(store_dir, "..", "server.log"),
                               echo=True)


def kv_cache_bytes(metrics_text: str) -> dict:
  """`kvjax_kv_cache_bytes` by state (reserved, peak_used) from a /metrics page."""
  from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
  for fam in text_string_to_metric_families(metrics_text):
    if fam.name == "kvjax_kv_cache_bytes":
      return {s.labels["state"]: int(s.value) for s in fam.samples}
  return {}


#: Libraries whose versions the results record (`benchlib.provenance`).
PACKAGES = ("kvjax", "jax", "jaxlib", "flax", "numpy", "fastapi", "uvicorn", "openai",
            "tensorstore")


#: Per-phase figures summarized over the rounds (`benchlib.summarize`).
ROUND_METRICS = ("ttft_p50_s", "ttft_p99_s", "server_ttft_p50_s", "output_tokens_per_s",
                 "cached_fraction", "server_cpu_share")


def over_rounds(phases: dict) -> dict:
  """Per (workload, phase): `benchlib.summarize` over the rounds of each of ROUND_METRICS, and
  per workload the paired warm / cold TTFT p50 ratio of each round, summarized.

  Args:
    phases: {(workload, phase, round): summarize() of that phase}.
  """
  out: dict = {}
  for wl, phase in dict.fromkeys((k[0], k[1]) for k in phases):
    rows = [v for k, v in phases.items() if k[:2] == (wl, phase)]
    out[f"{wl}/{phase}"] = {
        m: benchlib.summarize([r[m] for r in rows])
        for m in ROUND_METRICS if all(r.get(m) is not None for r in rows)}
  for wl in dict.fromkeys(k[0] for k in phases):
    ratios = [phases[(wl, "warm", r)]["ttft_p50_s"] / phases[(wl, "cold", r)]["ttft_p50_s"]
              for (w, p, r) in phases if w == wl and p == "cold" and (wl, "warm", r) in phases]
    if ratios:
      out[f"{wl}/warm_over_cold_ttft_p50"] = benchlib.summarize(ratios)
  return out


def spread(summary: dict) -> str:
  return "-" if summary["spread"] is None else f"{summary['spread']:.0%}"


def print_table(phases: dict, rounds: dict) -> None:
  head = (f"{'workload':9} {'phase':5} {'round':>5} {'req':>4} {'err':>3} {'TTFT p50':>9} "
          f"{'p90':>7} {'p99':>7} {'srv p50':>8} {'out tok/s':>9} {'cached':>7} {'srv CPU':>7}")
  print("\n" + head + "\n" + "-" * len(head))
  for (wl, phase, r), s in phases.items():
    cpu = "-" if s.get("server_cpu_share") is None else f"{s['server_cpu_share']:.2f}"
    print(f"{wl:9} {phase:5} {r:5d} {s['requests']:4d} {s['errors']:3d} {s['ttft_p50_s']:8.2f}s "
          f"{s['ttft_p90_s']:6.2f}s {s['ttft_p99_s']:6.2f}s {s['server_ttft_p50_s']:7.2f}s "
          f"{s['output_tokens_per_s']:9.2f} {100 * s['cached_fraction']:6.1f}% {cpu:>7}")
  print("\nover the rounds: median [min, max] (spread)")
  for key, metrics in rounds.items():
    if "median" in metrics:  # a ratio: one summary
      metrics = {"": metrics}
    for m, v in metrics.items():
      print(f"  {key} {m}: {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}] "
            f"({spread(v)})")


def plot(phases: dict, path: pathlib.Path, title: str) -> bool:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  keys = list(phases)
  x = np.arange(len(keys))
  fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(keys)), 4))
  for j, (q, name) in enumerate([("ttft_p50_s", "p50"), ("ttft_p90_s", "p90"),
                                 ("ttft_p99_s", "p99")]):
    ax.bar(x + (j - 1) * 0.25, [phases[k][q] for k in keys], 0.25, label=f"TTFT {name}")
  ax.set_xticks(x, [f"{wl}\n{phase}\nround {r}" for wl, phase, r in keys], fontsize=7)
  ax.set_ylabel("seconds")
  ax.set_title(title, fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  quick = _QUICK.value
  docs, questions, doc_chars = (2, 2, 4000) if quick else (_DOCS.value, _QUESTIONS.value,
                                                           _DOC_CHARS.value)
  convs, turns = (2, 3) if quick else (_CONVS.value, _TURNS.value)
  max_tokens = 8 if quick else _MAX_TOKENS.value
  clients = 2 if quick and not _CLIENTS.present else _CLIENTS.value  # --quick --clients=32
  rounds = 1 if quick and not _ROUNDS.present else _ROUNDS.value
  if rounds < 1:
    raise app.UsageError(f"--rounds must be >= 1, got {rounds}")
  rng = random.Random(_SEED.value)
  workloads = {"longchat": lambda: longchat_tasks(rng, docs, questions, doc_chars),
               "sharegpt": lambda: sharegpt_tasks(rng, convs, turns, _TURN_CHARS.value)}
  unknown = set(_WORKLOADS.value) - set(workloads)
  if unknown:
    raise app.UsageError(f"unknown workloads {sorted(unknown)}")
  tasks = {wl: workloads[wl]() for wl in _WORKLOADS.value}
  work = tempfile.mkdtemp(prefix="kvjax-bench-serve-")
  prov = benchlib.provenance(PACKAGES)
  rows, phases = [], {}
  proc, url = None, _URL.value
  try:
    if url is None:
      store = os.path.join(work, "kv")
      os.makedirs(store)
      proc, url, model = start_server(store)
    else:
      model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    order = benchlib.interleaved_rounds(list(tasks), rounds)
    for round_index, round_order in enumerate(order):
      for wl in round_order:
        for phase in ("cold", "warm"):
          cpu0 = None if proc is None else benchlib.process_cpu_s(proc.pid)
          got, wall = asyncio.run(run_phase(url, model, wl, phase, tasks[wl], clients,
                                            max_tokens, round_index))
          cpu1 = None if proc is None else benchlib.process_cpu_s(proc.pid)
          rows += got
          key = (wl, phase, round_index)
          phases[key] = summarize(got, wall)
          phases[key]["server_cpu_share"] = (
              None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / wall)
          print(f"round {round_index} {wl} {phase}: {phases[key]}", flush=True)
          r = httpx.post(url + "/admin/flush_kv", timeout=3600)
          if r.status_code != 200:
            print(f"  (no /admin/flush_kv: {r.status_code}; warm may miss unsaved chunks)")
    metrics = httpx.get(url + "/metrics").text
    kv_memory = kv_cache_bytes(metrics)
  finally:
    if proc is not None:
      benchlib.stop_server(proc)
    shutil.rmtree(work, ignore_errors=True)
  summary_rounds = over_rounds(phases)
  print_table(phases, summary_rounds)
  print(f"device KV reserved {kv_memory.get('reserved', 0) / 2**20:.0f} MiB, "
        f"peak held by requests {kv_memory.get('peak_used', 0) / 2**20:.0f} MiB")
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  errors = sum(1 for r in rows if r.error is not None)
  record = {
      **prov, "benchmark": "bench_serve", "machine_at_end": machine(),
      "threads": {"cpu_count": os.cpu_count(), "clients": clients,
                  "server_max_num_seqs": _MAX_NUM_SEQS.value or "server default"},
      "seeds": {"workload": _SEED.value, "requests": 0},
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "settings": {"quick": quick, "url": _URL.value, "model": model,
                   "server_flags": _SERVER_FLAGS.value,
                   "kv_chunk_size": _KV_CHUNK.value, "rounds": rounds,
                   "docs": docs, "questions": questions, "doc_chars": doc_chars,
                   "conversations": convs, "turns": turns, "turn_chars": _TURN_CHARS.value,
                   "max_tokens": max_tokens, "temperature": 0,
                   "ttft": "client: request sent to first SSE event (sent with the first token)"},
      "order": order,
      "summary": [{"workload": k[0], "phase": k[1], "round": k[2], **s}
                  for k, s in phases.items()],
      "over_rounds": summary_rounds,
      "errors": errors,
      "requests": [dataclasses.asdict(r) for r in rows],
      "kv_cache_bytes": kv_memory,
      "server_metrics": metrics,
  }
  benchlib.write_json(out_dir / "bench_serve.json", record)
  title = (f"bench_serve: {model}, {clients} clients, {rounds} rounds, {os.cpu_count()} CPU "
           f"cores" + (" (quick)" if quick else ""))
  wrote = plot(phases, out_dir / "bench_serve.png", title)
  print(f"wrote {out_dir / 'bench_serve.json'}" + (" and bench_serve.png" if wrote else ""))
  if errors:
    print(f"{errors} requests failed (their `error` in the JSON)", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
