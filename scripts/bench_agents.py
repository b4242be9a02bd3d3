"""Agent sessions over `python -m kvjax.serve` with real tiers: cached share per turn against
the share a perfect cache could serve.

The workload (issue 39 part 4) is shaped by the published agent traces (coding agents: a
median of 43 turns per session, over 95% of input tokens readable from cache):

  - one long system prompt plus tool definitions, shared by every session (one tenant, one
    `cache_salt`);
  - per session 20-60 turns (`--min_turns`, `--max_turns`); each turn the model is made to
    call a tool (`tool_choice: "required"`: a forced call, decoded under a grammar), the agent
    appends the assistant's `tool_calls` message as the response gave it and a `tool` message
    with a synthetic tool result of 200-8000 tokens (log-uniform), times `--scale` so the
    2-core CPU and SmolLM2's 8K context can run it; a session whose next prompt would pass the
    context ends there, as an agent compacts its context and starts over;
  - think times between turns: mostly short, with a share of long pauses (`--pause_share`)
    while the other sessions keep the server busy, so the device pool and the small host tier
    evict the paused session's KV (demotion to the disk tier);
  - every turn is a session turn (`session_id`), sent with the openai client, streamed.

Theoretical cached tokens of a turn (what a perfect cache could serve, `theoretical_cached`):
turn 1 of a session: the longest common token prefix of its prompt with the first prompt of
any session started before it (the shared system prompt and tools; computed by tokenizing the
messages with the server's own rendering, `kvjax.serve.completions.prompt_ids_for_chat`);
turn k > 1: every token of turn k-1 whose KV exists, i.e. its prompt and its output but the
last sampled token (prompt_tokens + completion_tokens - 1 of turn k-1), never more than this
prompt's tokens - 1. The achieved share is usage's `prompt_tokens_details.cached_tokens` over
`prompt_tokens`; both shares sum over all turns.

Where a turn's missed tokens (theoretical - cached) come from (`attribute_miss`): the session's
outcome (`not_extended`: the history did not extend the session's exact ids, template drift;
`first` after turn 1: the session was dropped), chunks rejected on load, a lossy codec's
whole-chunk reuse (`kv_codec_consistent`, on by default for kvtc: a turn reuses only whole
stored chunks, so up to `kv_chunk_size` - 1 tokens of the last turn are computed again, on the
device too, so that an answer never depends on where its KV came from), a first turn short of
the shared prefix by less than a chunk, otherwise the store or device did not have them
(evicted or not yet saved: not separable per turn from the outside; the run's /metrics counters
of evictions, demotions and saver drops say which happened). Salt misses cannot happen here
(one salt) and are reported as zero by construction.

One server per codec (`--codecs`, default raw and kvtc), each on a fresh store: a host tier of
`--host_bytes` over a disk tier in a temporary folder (write-through by default, `--placement`),
the device pool at `--kv_cache_memory_bytes`. Stored bytes are the disk tier's files after
`POST /admin/flush_kv` (with write-through every saved chunk reaches the disk).

    .venv/bin/python scripts/bench_agents.py --quick      # 3 sessions, few turns, minutes
    .venv/bin/python scripts/bench_agents.py              # 8 sessions, 20-60 turns

Writes <out_dir>/<out_name>.json (default benchmarks/results/bench_agents.json:
`benchlib.provenance()`, settings, per-turn rows, summaries, /metrics counters) and the .png
beside it, and prints a table. Exits non-zero when a
request failed (named in the JSON and on stderr).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent

#: Published ranges the workload is shaped by (issue 39): turns per session, tool-result tokens.
TURNS_RANGE = (20, 60)
TOOL_RESULT_TOKENS = (200, 8000)

#: Words the synthetic text is drawn from: common English words, about one token each.
WORDS = ("the file function value error test line module return import class data path list "
         "output input result check build config server request token cache session store "
         "string number index count update change fix call name type field object array "
         "default option version report status read write open close load save start stop "
         "run step time size limit block chunk layer model prompt reply text code case").split()

TOOL_NAMES = ("read_file", "grep", "run_tests", "list_dir", "edit_file", "run_shell")


# ------------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class TurnPlan:
  """One agent turn after the first: the tool result the agent sends back (about
  `result_words` words) after thinking `think_s` seconds."""
  result_words: int
  think_s: float
  pause: bool


@dataclasses.dataclass(frozen=True)
class SessionPlan:
  """One agent session: its id, its first user message, its turns after the first, and the
  seconds after the benchmark's start at which it begins."""
  session_id: str
  task: str
  turns: tuple[TurnPlan, ...]
  start_s: float


def words(rng: random.Random, n: int) -> str:
  """`n` words drawn from WORDS, in lines of 12."""
  ws = [rng.choice(WORDS) for _ in range(n)]
  return "\n".join(" ".join(ws[i:i + 12]) for i in range(0, n, 12))


def tools() -> list[dict]:
  """The agent's tools: each takes one `target` from a short enum, so a forced call is short."""
  return [{"type": "function", "function": {
      "name": name, "description": f"{name.replace('_', ' ')} on one target of the repository.",
      "parameters": {"type": "object", "properties": {
          "target": {"type": "string", "enum": ["src", "tests", "docs", "config"]}},
          "required": ["target"], "additionalProperties": False}}} for name in TOOL_NAMES]


def system_prompt(rng: random.Random, n_words: int) -> str:
  """The long shared system prompt: the agent's instructions, `n_words` words of them."""
  return ("You are a coding agent working in a repository. Call one tool per turn.\n"
          + words(rng, n_words))


def make_sessions(seed: int, sessions: int, *, turns_range: tuple[int, int], scale: float,
                  think_s: float, pause_s: float, pause_share: float,
                  stagger_s: float) -> list[SessionPlan]:
  """Deterministic agent sessions (the same `seed` gives the same plans).

  Args:
    seed: seeds every draw.
    sessions: how many.
    turns_range: (min, max) turns per session, drawn uniformly, both included.
    scale: tool results are TOOL_RESULT_TOKENS (log-uniform) times this many words (at least 1).
    think_s: mean think time of a short pause, seconds (exponential).
    pause_s: a long pause, seconds (taken with probability `pause_share` per turn).
    pause_share: share of turns preceded by a long pause, in [0, 1].
    stagger_s: session i starts at i * stagger_s seconds.

  Raises:
    ValueError: a range or share out of bounds.
  """
  lo, hi = turns_range
  if sessions < 1 or not 1 <= lo <= hi or scale <= 0 or not 0 <= pause_share <= 1:
    raise ValueError(f"make_sessions: need sessions >= 1, 1 <= min turns <= max turns, scale > 0 "
                     f"and pause_share in [0, 1]; got {sessions}, {turns_range}, {scale}, "
                     f"{pause_share}")
  rng = random.Random(seed)
  out = []
  for i in range(sessions):
    n = rng.randint(lo, hi)
    turns = []
    for _ in range(n - 1):
      size = math.exp(rng.uniform(*(math.log(t) for t in TOOL_RESULT_TOKENS)))
      pause = rng.random() < pause_share
      turns.append(TurnPlan(max(1, round(size * scale)),
                            pause_s if pause else rng.expovariate(1 / think_s) if think_s > 0
                            else 0.0, pause))
    out.append(SessionPlan(f"agent-{seed}-{i}", f"Task {i}: fix the failing check in module {i}.",
                           tuple(turns), i * stagger_s))
  return out


# ------------------------------------------------------------------------------- arithmetic
def common_prefix(a: list[int], b: list[int]) -> int:
  """Length of the longest common prefix of two token id lists."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def first_turn_theoretical(first_prompts: list[list[int]]) -> list[int]:
  """Per session (in start order), the tokens of its first prompt a perfect cache holds: the
  longest common prefix with any earlier session's first prompt (0 for the first session),
  never more than its prompt's tokens - 1 (the last prompt token is always computed)."""
  out = []
  for i, ids in enumerate(first_prompts):
    best = max((common_prefix(ids, first_prompts[j]) for j in range(i)), default=0)
    out.append(min(best, len(ids) - 1))
  return out


def theoretical_cached(prev_prompt_tokens: int, prev_completion_tokens: int,
                       prompt_tokens: int) -> int:
  """A later turn's tokens a perfect cache holds: the last turn's prompt and output but its last
  sampled token (whose KV was never computed), at most this prompt's tokens - 1."""
  return max(0, min(prev_prompt_tokens + prev_completion_tokens - 1, prompt_tokens - 1))


def attribute_miss(row: dict) -> str | None:
  """Where a turn's missed tokens (theoretical - cached > 0) came from, or None without a miss:
  "template_drift" (the session did not extend: `not_extended`), "session_dropped" (a later turn
  that was a session's first), "rejected" (chunks rejected on load), "lossy_chunk_alignment" (a
  lossy codec under `kv_codec_consistent`: the cache served all of `whole_chunk_theoretical`,
  see `annotate`), "first_turn_partial" (a first turn short of the shared prefix by less than a
  stored chunk: the prefix ends inside a block or chunk, or a concurrent first turn was still
  computing it), "evicted_unsaved_or_in_flight" (otherwise: evicted, not yet saved, or a
  concurrent turn still computing it), or "request_error"."""
  if row.get("error"):
    return "request_error"
  if row["theoretical_cached"] - row["cached_tokens"] <= 0:
    return None
  if row["turn"] > 1 and row.get("session_outcome") == "not_extended":
    return "template_drift"
  if row["turn"] > 1 and row.get("session_outcome") == "first":
    return "session_dropped"
  if row.get("rejected_chunks"):
    return "rejected"
  whole = row.get("whole_chunk_theoretical")
  if whole is not None and row["cached_tokens"] >= whole:
    return "lossy_chunk_alignment"
  if row["turn"] == 1 and row["theoretical_cached"] - row["cached_tokens"] < row["block_tokens"]:
    return "first_turn_partial"
  return "evicted_unsaved_or_in_flight"


def annotate(rows: list[dict], codec: str, chunk_tokens: int) -> list[dict]:
  """Sorts one run's rows by (session, turn) and sets per row `codec`, `prev_prompt_tokens`
  (the session's previous turn's prompt, None on turn 1), `whole_chunk_theoretical` and
  `miss_cause` (`attribute_miss`); returns `rows`.

  `whole_chunk_theoretical` (None for the raw codec): a lossy codec runs `kv_codec_consistent`
  (the server's default for lossy codecs with a store), whose device blocks and stored chunks
  hold the codec's KV, made once a chunk of `chunk_tokens` is complete in a prefill; so a turn
  can reuse only the whole chunks of what earlier prefills computed: the theory cut to the
  previous turn's prompt (a chunk completed by decoding is not reused) and down to a multiple of
  `chunk_tokens`.
  """
  rows.sort(key=lambda r: (r["session"], r["turn"]))
  prev = {}
  for r in rows:
    r["codec"] = codec
    p = prev.get(r["session"])
    r["prev_prompt_tokens"] = p["prompt_tokens"] if p is not None and r["turn"] > 1 else None
    if codec == "raw":
      r["whole_chunk_theoretical"] = None
    else:
      reach = r["theoretical_cached"]
      if r["prev_prompt_tokens"] is not None:
        reach = min(reach, r["prev_prompt_tokens"])
      r["whole_chunk_theoretical"] = reach // chunk_tokens * chunk_tokens
    r["miss_cause"] = attribute_miss(r)
    prev[r["session"]] = r
  return rows


def percentile(values: list[float], q: float) -> float | None:
  """The q-th percentile (linear, as numpy's default) of `values`, or None when empty."""
  if not values:
    return None
  v = sorted(values)
  k = (len(v) - 1) * q / 100
  f = math.floor(k)
  c = min(f + 1, len(v) - 1)
  return v[f] + (v[c] - v[f]) * (k - f)


def summarize_rows(rows: list[dict]) -> dict:
  """Token-weighted cached and theoretical shares, the gap in points, TTFT p50/p99 and the
  missed tokens by cause, over `rows` (the per-turn rows of one server run)."""
  ok = [r for r in rows if not r.get("error")]
  prompt = sum(r["prompt_tokens"] for r in ok)
  cached = sum(r["cached_tokens"] for r in ok)
  theory = sum(r["theoretical_cached"] for r in ok)
  causes: dict[str, int] = {}
  for r in rows:
    cause = r.get("miss_cause", attribute_miss(r))
    if cause:
      causes[cause] = causes.get(cause, 0) + max(0, r["theoretical_cached"] - r["cached_tokens"])
  whole = sum(r.get("whole_chunk_theoretical") or 0 for r in ok)
  lossy = any(r.get("whole_chunk_theoretical") is not None for r in ok)
  ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
  later = [r for r in ok if r["turn"] > 1]
  return {
      "turns": len(rows), "errors": len(rows) - len(ok), "prompt_tokens": prompt,
      "cached_tokens": cached, "theoretical_cached_tokens": theory,
      "cached_share": cached / prompt if prompt else 0.0,
      "theoretical_share": theory / prompt if prompt else 0.0,
      "gap_points": 100 * (theory - cached) / prompt if prompt else 0.0,
      "whole_chunk_theoretical_share": whole / prompt if prompt and lossy else None,
      "gap_to_whole_chunks_points": 100 * (whole - cached) / prompt if prompt and lossy
                                    else None,
      "over_theoretical_tokens": sum(max(0, r["cached_tokens"] - r["theoretical_cached"])
                                     for r in ok),
      "missed_tokens_by_cause": causes,
      "later_turns_exact": sum(r["cached_tokens"] == r["theoretical_cached"] for r in later),
      "later_turns": len(later),
      "session_outcomes": {o: sum(r.get("session_outcome") == o for r in ok)
                           for o in sorted({r.get("session_outcome") for r in ok} - {None})},
      "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
  }


# ------------------------------------------------------------------------------- client
def first_prompt_ids(system: str, tool_defs: list[dict], plans: list[SessionPlan]) -> list:
  """Token ids of each session's first prompt as the server renders it (SmolLM2's tokenizer;
  `kvjax.serve.completions.prompt_ids_for_chat`)."""
  from kvjax.serve import completions, protocol  # noqa: PLC0415
  from kvjax.testing import tokenizers  # noqa: PLC0415
  tok = tokenizers.smollm2_tokenizer()
  out = []
  for p in plans:
    req = protocol.ChatCompletionRequest(model="m", messages=first_messages(system, p),
                                         tools=tool_defs)
    out.append(completions.prompt_ids_for_chat(req, tok))
  return out


def first_messages(system: str, plan: SessionPlan) -> list[dict]:
  return [{"role": "system", "content": system}, {"role": "user", "content": plan.task}]


async def one_turn(client, model, messages, tool_defs, *, session_id, salt, max_tokens) -> dict:
  """Sends one streamed session turn; returns its row fields and the assistant message to
  append to the history (content and tool_calls as the stream gave them)."""
  row = {"ttft_s": None, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
         "session_outcome": None, "session_reason": None, "rejected_chunks": 0,
         "tokens_device_cached": 0, "loaded_from_tiers": {}, "finish_reason": None,
         "error": None}
  text, calls = [], {}
  t0 = time.perf_counter()
  try:
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=tool_defs, tool_choice="required",
        parallel_tool_calls=False, max_tokens=max_tokens, temperature=0, seed=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": session_id, "cache_salt": salt})
    async for chunk in stream:
      if row["ttft_s"] is None:
        row["ttft_s"] = time.perf_counter() - t0
      for choice in chunk.choices:
        if choice.delta.content:
          text.append(choice.delta.content)
        for tc in choice.delta.tool_calls or ():
          c = calls.setdefault(tc.index, {"id": "", "type": "function",
                                          "function": {"name": "", "arguments": ""}})
          c["id"] += tc.id or ""
          if tc.function:
            c["function"]["name"] += tc.function.name or ""
            c["function"]["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
          row["finish_reason"] = choice.finish_reason
      if chunk.usage is not None:
        row["prompt_tokens"] = chunk.usage.prompt_tokens
        row["completion_tokens"] = chunk.usage.completion_tokens
        details = chunk.usage.prompt_tokens_details
        row["cached_tokens"] = details.cached_tokens if details else 0
      ext = (chunk.model_extra or {}).get("kvjax")
      if ext:
        session = ext.get("session") or {}
        row["session_outcome"] = session.get("outcome")
        row["session_reason"] = session.get("reason")
        row["rejected_chunks"] = ext.get("rejected_chunks") or 0
        row["tokens_device_cached"] = ext.get("tokens_device_cached") or 0
        row["loaded_from_tiers"] = ext.get("loaded_from_tiers") or {}
  except Exception as e:  # noqa: BLE001 - counted, the session ends, the run goes on
    row["error"] = f"{type(e).__name__}: {e}"[:300]
  message = {"role": "assistant", "content": "".join(text) or None}
  if calls:
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
  return row, message


async def run_session(client, model, plan: SessionPlan, system: str, tool_defs, *, salt,
                      max_tokens, max_context, block_tokens, first_theory, rng, rows, t_start):
  await asyncio.sleep(max(0.0, t_start + plan.start_s - time.perf_counter()))
  messages = first_messages(system, plan)
  prev, last_message = None, {}  # the previous turn's row and reply (set at turn 1)
  for k in range(len(plan.turns) + 1):
    if k:
      turn = plan.turns[k - 1]
      await asyncio.sleep(turn.think_s)  # the agent thinks; the tool runs
      call_ids = [c["id"] for c in last_message.get("tool_calls", ())]
      result = words(rng, turn.result_words)
      if call_ids:
        messages += [{"role": "tool", "tool_call_id": call_ids[0], "content": result}]
      else:
        messages += [{"role": "user", "content": result}]
    sent_s = time.perf_counter() - t_start
    row, last_message = await one_turn(client, model, messages, tool_defs,
                                       session_id=plan.session_id, salt=salt,
                                       max_tokens=max_tokens)
    row.update(session=plan.session_id, turn=k + 1, block_tokens=block_tokens,
               pause_before=bool(k and plan.turns[k - 1].pause),
               sent_s=sent_s, finished_s=time.perf_counter() - t_start)
    if k == 0:
      row["theoretical_cached"] = first_theory
    else:
      row["theoretical_cached"] = theoretical_cached(prev["prompt_tokens"],
                                                     prev["completion_tokens"],
                                                     row["prompt_tokens"])
    rows.append(row)
    if row["error"]:
      return "error"
    messages.append(last_message)
    prev = row
    if k < len(plan.turns):
      nxt = plan.turns[k]
      # An agent near its context limit compacts and starts over: the session ends here.
      if row["prompt_tokens"] + row["completion_tokens"] + 2 * nxt.result_words + 32 + \
          max_tokens > max_context:
        return "context_full"
  return "done"


async def run_workload(url, model, plans, system, tool_defs, first_theory, *, salt, max_tokens,
                       max_context, block_tokens, seed):
  import openai  # noqa: PLC0415
  rows: list[dict] = []
  t0 = time.perf_counter()
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=3600) as client:
    ends = await asyncio.gather(*(
        run_session(client, model, p, system, tool_defs, salt=salt, max_tokens=max_tokens,
                    max_context=max_context, block_tokens=block_tokens, first_theory=ft,
                    rng=random.Random(f"{seed}-{p.session_id}"), rows=rows, t_start=t0)
        for p, ft in zip(plans, first_theory)))
  return rows, dict(zip((p.session_id for p in plans), ends)), time.perf_counter() - t0


# ------------------------------------------------------------------------------- server
#: /metrics families kept in the results (counters of where tokens came from and tier work).
METRIC_FAMILIES = ("kvjax_prompt_tokens", "kvjax_prefix_cache_hit_tokens_by_tier",
                   "kvjax_store_evictions", "kvjax_store_demotions",
                   "kvjax_store_demotion_drops", "kvjax_store_rejected_chunks",
                   "kvjax_kv_saver", "kvjax_kv_cache_evictions", "kvjax_num_preemptions",
                   "kvjax_session_turns", "kvjax_sessions_dropped", "kvjax_store_tier_hits",
                   "kvjax_kv_prefetch", "kvjax_store_warnings")


def metric_counters(text: str) -> dict:
  """{family: {labels as "k=v,k=v": value}} of METRIC_FAMILIES from a /metrics page."""
  from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
  out: dict = {}
  for fam in text_string_to_metric_families(text):
    if fam.name in METRIC_FAMILIES:
      for s in fam.samples:
        if s.name.endswith("_created"):
          continue
        key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        out.setdefault(fam.name, {})[key] = s.value
  return out


def folder_bytes(path: str) -> int:
  return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def start_server(work: str, codec: str, args) -> tuple:
  disk = os.path.join(work, f"disk-{codec}")
  tiers = [{"kind": "host", "capacity_bytes": args.host_bytes}, {"kind": "disk", "url": disk}]
  flags = [f"--model={args.model}", f"--kv_tiers={json.dumps(tiers)}", f"--kv_codec={codec}",
           f"--kv_chunk_size={args.kv_chunk_size}", f"--max_model_len={args.max_model_len}",
           f"--kv_cache_memory_bytes={args.kv_cache_memory_bytes}",
           f"--kv_placement={args.placement}", "--enable_admin",
           *[f"--{f}" for f in args.server_flag]]
  proc, url, model = benchlib.start_server(flags, os.path.join(work, f"server-{codec}.log"))
  return proc, url, model, disk


def run_codec(codec: str, args, plans, system, tool_defs, first_theory) -> dict:
  import httpx  # noqa: PLC0415
  work = tempfile.mkdtemp(prefix=f"kvjax-bench-agents-{codec}-")
  proc = None
  try:
    proc, url, model, disk = start_server(work, codec, args)
    print(f"[{codec}] server ready at {url}", flush=True)
    rows, ends, wall = asyncio.run(run_workload(
        url, model, plans, system, tool_defs, first_theory, salt=f"bench-agents-{args.seed}",
        max_tokens=args.max_tokens, max_context=args.max_model_len,
        block_tokens=args.kv_chunk_size, seed=args.seed))
    flush = httpx.post(url + "/admin/flush_kv", timeout=3600).status_code
    metrics = metric_counters(httpx.get(url + "/metrics").text)
    stored = folder_bytes(disk)
  finally:
    if proc is not None:
      benchlib.stop_server(proc)
    shutil.rmtree(work, ignore_errors=True)
  annotate(rows, codec, args.kv_chunk_size)
  return {"codec": codec, "model": model, "wall_s": wall, "flush_status": flush,
          "session_ends": ends, "disk_tier_bytes": stored, "metrics": metrics,
          "summary": summarize_rows(rows), "rows": rows}


# ------------------------------------------------------------------------------- report
def print_table(runs: list[dict]) -> None:
  head = (f"{'codec':6} {'turns':>5} {'err':>3} {'prompt tok':>10} {'cached':>7} {'theory':>7} "
          f"{'gap pts':>7} {'TTFT p50':>9} {'p99':>7} {'disk bytes':>12}  misses by cause")
  print("\n" + head + "\n" + "-" * len(head))
  for run in runs:
    s = run["summary"]
    print(f"{run['codec']:6} {s['turns']:5d} {s['errors']:3d} {s['prompt_tokens']:10d} "
          f"{100 * s['cached_share']:6.1f}% {100 * s['theoretical_share']:6.1f}% "
          f"{s['gap_points']:7.2f} {s['ttft_p50_s'] or 0:8.2f}s {s['ttft_p99_s'] or 0:6.2f}s "
          f"{run['disk_tier_bytes']:12d}  {s['missed_tokens_by_cause']}")


def plot(runs: list[dict], path: pathlib.Path, title: str) -> bool:
  plt = benchlib.pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
  for ax, run in zip(axes[0], runs):
    turns = sorted({r["turn"] for r in run["rows"]})
    for key, label in (("theoretical_cached", "theoretical"), ("cached_tokens", "achieved")):
      share = []
      for t in turns:
        rs = [r for r in run["rows"] if r["turn"] == t and not r["error"]]
        p = sum(r["prompt_tokens"] for r in rs)
        share.append(100 * sum(r[key] for r in rs) / p if p else 0)
      ax.plot(turns, share, marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("cached share of prompt tokens, %")
    ax.set_title(f"{run['codec']}: gap {run['summary']['gap_points']:.2f} points", fontsize=9)
    ax.legend()
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


#: Libraries whose versions the results record (`benchlib.provenance`).
PACKAGES = ("kvjax", "jax", "jaxlib", "flax", "numpy", "openai", "tensorstore", "llguidance")


def parse_args(argv=None):
  import argparse  # noqa: PLC0415
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="3 sessions of 3-5 turns, scale 0.02, 2K context, small pool and tiers")
  p.add_argument("--sessions", type=int, default=8)
  p.add_argument("--min_turns", type=int, default=TURNS_RANGE[0])
  p.add_argument("--max_turns", type=int, default=TURNS_RANGE[1])
  p.add_argument("--scale", type=float, default=0.05,
                 help="tool results are 200-8000 tokens times this (words)")
  p.add_argument("--system_words", type=int, default=1200,
                 help="words of the shared system prompt (tools come on top)")
  p.add_argument("--think_s", type=float, default=0.5, help="mean short think time, seconds")
  p.add_argument("--pause_s", type=float, default=20.0, help="a long pause, seconds")
  p.add_argument("--pause_share", type=float, default=0.15)
  p.add_argument("--stagger_s", type=float, default=2.0)
  p.add_argument("--max_tokens", type=int, default=64,
                 help="output tokens per turn at most (a forced call needs about 30)")
  p.add_argument("--model", default="SmolLM2-135M-Instruct")
  p.add_argument("--max_model_len", type=int, default=8192)
  p.add_argument("--kv_chunk_size", type=int, default=256)
  p.add_argument("--kv_cache_memory_bytes", type=int, default=768 * 2**20)
  p.add_argument("--host_bytes", type=int, default=256 * 2**20, help="host tier capacity")
  p.add_argument("--placement", default="write_through",
                 help="the tiers' placement (--kv_placement): write_through (the server's "
                 "default for tiers; every save reaches the disk, so the disk tier's bytes are "
                 "all stored bytes) or write_back (the host tier's victims are demoted to disk)")
  p.add_argument("--codecs", default="raw,kvtc")
  p.add_argument("--server_flag", action="append", default=[],
                 help="an extra server flag, e.g. kv_lookahead_window=0 (repeatable)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out_dir", default=str(REPO / "benchmarks" / "results"))
  p.add_argument("--out_name", default="bench_agents", help="<out_dir>/<out_name>.json, .png")
  p.add_argument("--rescore", default=None,
                 help="a results JSON of this script: recompute its rows' theory, causes and "
                 "summaries with this version (no server) and write them to <out_name>.json, "
                 "the measurement's own provenance kept under `measured_with`")
  args = p.parse_args(argv)
  if args.quick:
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
    for k, v in {"sessions": 3, "min_turns": 3, "max_turns": 5, "scale": 0.02,
                 "system_words": 400, "pause_s": 6.0, "pause_share": 0.25, "stagger_s": 1.0,
                 "max_tokens": 48, "max_model_len": 2048,
                 "kv_cache_memory_bytes": 96 * 2**20, "host_bytes": 32 * 2**20}.items():
      if f"--{k}" not in given:
        setattr(args, k, v)
  return args


def rescore(args) -> int:
  """`--rescore`: the measured rows of an earlier run, annotated and summarized again."""
  measured = json.loads(pathlib.Path(args.rescore).read_text(encoding="utf-8"))
  record = {**benchlib.provenance(PACKAGES),
            **{k: v for k, v in measured.items() if k not in benchlib.PROVENANCE_KEYS},
            "rescored_from": os.path.relpath(os.path.abspath(args.rescore), REPO),
            "measured_with": {k: measured.get(k) for k in benchlib.PROVENANCE_KEYS}}
  chunk = measured["settings"]["kv_chunk_size"]
  for run in record["runs"]:
    for r in run["rows"]:
      if "finished_s" not in r:  # up to faffc7b `sent_s` held the finish time
        r["finished_s"] = r.pop("sent_s")
    annotate(run["rows"], run["codec"], chunk)
    run["summary"] = summarize_rows(run["rows"])
  print_table(record["runs"])
  out_dir = pathlib.Path(args.out_dir)
  benchlib.write_json(out_dir / f"{args.out_name}.json", record)
  plot(record["runs"], out_dir / f"{args.out_name}.png", f"bench_agents (rescored): "
       f"{record['runs'][0]['model']}, {measured['settings']['sessions']} sessions")
  return 0


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.rescore:
    return rescore(args)
  prov = benchlib.provenance(PACKAGES)
  sys_rng = random.Random(f"system-{args.seed}")
  system = system_prompt(sys_rng, args.system_words)
  tool_defs = tools()
  plans = make_sessions(args.seed, args.sessions, turns_range=(args.min_turns, args.max_turns),
                        scale=args.scale, think_s=args.think_s, pause_s=args.pause_s,
                        pause_share=args.pause_share, stagger_s=args.stagger_s)
  first_ids = first_prompt_ids(system, tool_defs, plans)
  first_theory = first_turn_theoretical(first_ids)
  runs = []
  for codec in args.codecs.split(","):
    run = run_codec(codec, args, plans, system, tool_defs, first_theory)
    # The first prompt's tokens as rendered here must be the server's: else turn 1's theory is off.
    served = {r["session"]: r["prompt_tokens"] for r in run["rows"] if r["turn"] == 1}
    run["first_prompt_tokens_match"] = all(
        served.get(p.session_id) in (None, len(ids)) for p, ids in zip(plans, first_ids))
    runs.append(run)
    print_table(runs[-1:])
  print_table(runs)
  if len(runs) > 1 and runs[0]["disk_tier_bytes"]:
    for run in runs[1:]:
      ratio = runs[0]["disk_tier_bytes"] / max(1, run["disk_tier_bytes"])
      print(f"{run['codec']} stores {ratio:.1f}x fewer disk bytes than {runs[0]['codec']}")
  out_dir = pathlib.Path(args.out_dir)
  record = {
      **prov, "benchmark": "bench_agents",
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir", "out_name")},
      "workload": {"system_prompt_words": args.system_words, "tools": [t["function"]["name"]
                                                                       for t in tool_defs],
                   "sessions": [{"id": p.session_id, "turns": len(p.turns) + 1,
                                 "result_words": [t.result_words for t in p.turns],
                                 "pauses": sum(t.pause for t in p.turns)} for p in plans],
                   "first_prompt_tokens": [len(i) for i in first_ids],
                   "first_turn_theoretical": first_theory,
                   "shapes": {"turns_range_published": TURNS_RANGE,
                              "tool_result_tokens_published": TOOL_RESULT_TOKENS}},
      "definitions": {
          "cached_share": "sum cached_tokens / sum prompt_tokens over the turns (usage)",
          "theoretical_share": "sum theoretical_cached / sum prompt_tokens; turn 1: common "
                               "prefix with an earlier session's first prompt; turn k > 1: "
                               "turn k-1's prompt + completion tokens - 1",
          "ttft": "client: request sent to the first streamed event (loaded 2-core machine)",
          "disk_tier_bytes": "bytes of the disk tier's files after /admin/flush_kv",
          "salt_misses": "none by construction: one cache_salt for every session"},
      "runs": runs,
  }
  json_path, png_path = out_dir / f"{args.out_name}.json", out_dir / f"{args.out_name}.png"
  benchlib.write_json(json_path, record)
  title = (f"bench_agents: {runs[0]['model']}, {args.sessions} sessions, {os.cpu_count()} CPU "
           f"cores" + (" (quick)" if args.quick else ""))
  wrote = plot(runs, png_path, title)
  print(f"wrote {json_path}" + (f" and {png_path.name}" if wrote else ""))
  failed = [f"{r['codec']}/{r['session']}/turn {r['turn']}: {r['error']}"
            for run in runs for r in run["rows"] if r["error"]]
  if failed:
    print("failed turns:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
