"""Real-server replay of ShareGPT conversations, turn by turn, for `bench_sessions.py --server`.

Each client takes one conversation at a time and plays it the way a chat client does: turn k
sends the conversation's first k user messages with the model's OWN earlier replies in between
(not ShareGPT's, so the history is exactly what the server generated), streaming, and waits for
the reply before the next turn. Modes, each on a fresh server and an empty store, in one process
one after the other (so they meet the same machine):

  session    paged KV, device prefix cache on, a file store, `session_id` per conversation: the
             server builds turn k's prompt from turn k-1's exact token ids plus the new part
  prefix     the same server, no `session_id`: hits by prefix only (re-tokenized history)
  recompute  no store (`--kv_store=none`), device prefix cache off: every turn computes its
             whole prompt

History-dominant replay (`ReplayConfig.history_tokens` > 0; `pick_history_dominant`): ShareGPT's
user messages are short (median ~20 tokens) and its replies long (median ~240), so with the
model's own short replies a replayed history stays small. Instead each conversation's first real
rounds (ShareGPT's user and assistant messages, as the client's history) up to the first round
that brings the templated history to `history_tokens` are sent with the next user message as
turn 1 (cold in every mode); turns 2.. continue live with the model's own replies. A conversation
is chosen by rule: that history lies in [history_tokens, max_history_tokens], and each replayed
turn k >= 2 keeps history (turn k-1's prompt + a `max_tokens` reply) >= `history_share` of its
prompt and the prompt <= `max_prompt_tokens`; its replay stops before the first turn that fails,
and it needs at least `min_turns` turns. (Token counts use SmolLM2's tokenizer and ChatML.)

Per turn: client TTFT (request sent to the first streamed event), the server's `kvjax.ttft_s`
and `kvjax.prefill_s` (the engine's prefill wall time: the request's first scheduled step to its
first token, queueing before admission excluded), prompt / cached / completion tokens, the tier
of each loaded chunk. For turns >= 2, the tokens shared with the previous turn are its prompt +
its completion; all but the last sampled one have KV, so "reusable" = that - 1; of those, the
store holds only full chunks (`kv_chunk_size`), so a turn served from the store computes its last
partial chunk (`cached_of_reusable_chunks`: the share of reusable full-chunk tokens served). Prefill
throughput = prompt tokens of turns >= 2 (computed plus loaded) / the sum of their prefill wall
times (`prefill_tokens_per_prefill_s_ge2`), and / the sum of their server TTFTs
(`prefill_tokens_per_s_ge2`: prefill plus queueing, a lower bound on the rate). Per mode,
`ge2_by_turn1_overlap` (`turn1_overlap_split`, from the engine timestamps) splits turns >= 2 by
whether their prefill overlapped another conversation's turn-1 (cold) prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import shutil
import tempfile
import time

import numpy as np

import benchlib  # scripts/benchlib.py


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """What the replay sends (all counts per run)."""

  conversations: int = 50
  clients: int = 8
  turns: int = 4
  turn_chars: int = 600
  max_tokens: int = 48
  min_turns: int = 2
  seed: int = 0
  rounds: int = 1
  model: str = "SmolLM2-135M-Instruct"
  server_flags: tuple[str, ...] = ()
  history_tokens: int = 0  # > 0: the history-dominant replay (`pick_history_dominant`)
  max_history_tokens: int = 4096
  history_share: float = 0.88
  max_prompt_tokens: int = 4608
  host_bytes: int = 0  # > 0: the store is a host tier of this capacity over a disk tier
  disk_bytes: int = 0  # the disk tier's capacity (0: its default)
  host_ratio: float = 0.0  # > 0: host_bytes = this x the replay's KV footprint (history mode)
  disk_ratio: float = 0.0  # > 0: disk_bytes = this x the footprint
  kv_bytes_per_token: int = 46080  # SmolLM2-135M, float32 KV (the CPU default): 30 x 2 x 3 x 64 x 4
  kv_chunk_size: int = 256  # tokens per stored chunk (the servers' --kv_chunk_size)


@dataclasses.dataclass
class TurnRow:
  mode: str
  conversation: int
  turn: int
  ttft_s: float | None = None
  server_ttft_s: float | None = None
  e2e_s: float | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0
  completion_tokens: int = 0
  reusable_tokens: int | None = None  # previous turn's prompt + completion - 1 (turn >= 2)
  session_outcome: str | None = None
  error: str | None = None
  prefill_s: float | None = None  # the engine's prefill wall time (kvjax.prefill_s)
  tokens_device_cached: int = 0
  loaded_from_tiers: dict | None = None  # {tier: chunks} of store loads
  # The engine's clock (kvjax.engine_metrics): arrival, first scheduled step, first token, so
  # what a turn shared its prefill steps with can be read afterwards.
  engine_arrival_s: float | None = None
  engine_scheduled_s: float | None = None
  engine_first_token_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Conversation:
  """What a client replays: `history` (role/content messages sent before the first replayed
  user message; empty for the plain replay) and the user messages of its turns."""

  users: tuple[str, ...]
  history: tuple[dict, ...] = ()
  history_tokens: int = 0  # templated tokens of `history` (system prompt included)
  source_index: int = -1  # its index in the ShareGPT file


def pick_history_dominant(data: list, count, system_tokens: int, cfg: "ReplayConfig"
                          ) -> list[Conversation]:
  """The conversations the history-dominant rule admits (module docstring), in file order.

  Args:
    data: the ShareGPT records (`conversations`: alternating human / gpt messages).
    count: `count(role, content)`: a message's templated tokens (ChatML).
    system_tokens: the default system prompt's tokens.
    cfg: `history_tokens`, `max_history_tokens`, `history_share`, `max_prompt_tokens`,
      `max_tokens`, `turns`, `min_turns`.
  """
  reply = count("assistant", "") + cfg.max_tokens  # a reply's tokens at most (template + body)
  head = count("assistant", "") - count("user", "") + 1  # generation prompt, approx. upper
  out = []
  for idx, conv in enumerate(data):
    msgs = conv["conversations"]
    roles = [m["from"] for m in msgs]
    if not msgs or any(r != ("human" if i % 2 == 0 else "gpt") for i, r in enumerate(roles)):
      continue  # only strictly alternating conversations starting with the user
    if any(not m["value"].strip() for m in msgs):
      continue
    hist, n, j = [], system_tokens, 0
    while j + 1 < len(msgs) and n < cfg.history_tokens:
      hist += [{"role": "user", "content": msgs[j]["value"]},
               {"role": "assistant", "content": msgs[j + 1]["value"]}]
      n += count("user", msgs[j]["value"]) + count("assistant", msgs[j + 1]["value"])
      j += 2
    if not cfg.history_tokens <= n <= cfg.max_history_tokens:
      continue
    users = [m["value"] for m in msgs[j::2]][:cfg.turns]
    if not users:
      continue
    prompt = n + count("user", users[0]) + head
    kept = 1
    for u in users[1:]:
      history = prompt + reply
      new = count("user", u) + head
      if history / (history + new) < cfg.history_share or history + new > cfg.max_prompt_tokens:
        break
      prompt, kept = history + new, kept + 1
    if kept >= max(2, cfg.min_turns) and prompt <= cfg.max_prompt_tokens:
      out.append(Conversation(tuple(users[:kept]), tuple(hist), n, idx))
  return out


def load_conversations(path: pathlib.Path, n: int, turns: int, turn_chars: int,
                       seed: int, min_turns: int = 2) -> list[list[str]]:
  """User messages of `n` ShareGPT conversations with at least `min_turns` (>= 2) non-empty user
  turns (their first `turns`)."""
  data = json.loads(path.read_text(encoding="utf-8"))
  convs = []
  for conv in data:
    users = [m["value"][:turn_chars] for m in conv["conversations"] if m["from"] == "human"]
    users = [u for u in users if u.strip()]
    if len(users) >= max(2, min_turns):
      convs.append(users[:turns])
  random.Random(seed).shuffle(convs)
  return convs[:n]


async def _turn(client, model, messages, max_tokens, row: TurnRow, session_id) -> str:
  t0 = time.perf_counter()
  text = []
  extra = {"session_id": session_id} if session_id else {}
  try:
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, seed=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
      if row.ttft_s is None:
        row.ttft_s = time.perf_counter() - t0
      if chunk.choices and chunk.choices[0].delta.content:
        text.append(chunk.choices[0].delta.content)
      if chunk.usage is not None:
        row.prompt_tokens = chunk.usage.prompt_tokens
        row.completion_tokens = chunk.usage.completion_tokens
        details = chunk.usage.prompt_tokens_details
        row.cached_tokens = details.cached_tokens if details else 0
      ext = (chunk.model_extra or {}).get("kvjax")
      if ext:
        row.server_ttft_s = ext.get("ttft_s")
        row.prefill_s = ext.get("prefill_s")
        row.tokens_device_cached = ext.get("tokens_device_cached") or 0
        row.loaded_from_tiers = ext.get("loaded_from_tiers")
        em = ext.get("engine_metrics") or {}
        row.engine_arrival_s = em.get("arrival_s")
        row.engine_scheduled_s = em.get("scheduled_s")
        row.engine_first_token_s = em.get("first_token_s")
        if ext.get("session"):
          row.session_outcome = ext["session"].get("outcome")
  except Exception as e:  # noqa: BLE001 - counted, the run goes on
    row.error = f"{type(e).__name__}: {e}"[:200]
  row.e2e_s = time.perf_counter() - t0
  return "".join(text)


async def _replay(url, model, mode, convs, cfg: ReplayConfig) -> tuple[list[TurnRow], float]:
  import openai  # noqa: PLC0415 - only the server mode needs it
  queue: asyncio.Queue = asyncio.Queue()
  for i, c in enumerate(convs):
    queue.put_nowait((i, c))
  rows: list[TurnRow] = []

  async def worker(client):
    while not queue.empty():
      i, conv = queue.get_nowait()
      if not isinstance(conv, Conversation):
        conv = Conversation(tuple(conv))
      users, messages, prev = conv.users, list(conv.history), None
      for k, user in enumerate(users):
        messages = messages + [{"role": "user", "content": user}]
        row = TurnRow(mode, i, k + 1)
        if prev is not None and prev.error is None:
          row.reusable_tokens = prev.prompt_tokens + prev.completion_tokens - 1
        rows.append(row)
        reply = await _turn(client, model, messages, cfg.max_tokens, row,
                            f"conv-{i}" if mode == "session" else None)
        if row.error is not None:
          break
        messages = messages + [{"role": "assistant", "content": reply}]
        prev = row

  t0 = time.perf_counter()
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=3600) as client:
    await asyncio.gather(*(worker(client) for _ in range(cfg.clients)))
  return rows, time.perf_counter() - t0


def summarize(rows: list[TurnRow], wall_s: float, chunk_tokens: int | None = None) -> dict:
  """The replay's figures (module docstring). With `chunk_tokens` (the store's chunk size), also
  the reusable tokens in full chunks (what the store can hold: a turn's last partial chunk is
  computed) and the share of them served (`cached_of_reusable_chunks`; device hits count too)."""
  ok = [r for r in rows if r.error is None]
  later = [r for r in ok if r.turn >= 2]
  ttft = np.array([r.ttft_s for r in later] or [np.nan])
  server = [r.server_ttft_s for r in later if r.server_ttft_s is not None]
  reusable = [r for r in later if r.reusable_tokens is not None]
  sum_reusable = sum(r.reusable_tokens for r in reusable)
  sum_cached = sum(min(r.cached_tokens, r.reusable_tokens) for r in reusable)
  timed = [r for r in later if r.prefill_s is not None]
  prefill = [r.prefill_s for r in timed]
  tiers: dict[str, int] = {}
  for r in later:
    for t, k in (r.loaded_from_tiers or {}).items():
      tiers[t] = tiers.get(t, 0) + k
  chunked = {}
  if chunk_tokens:
    full = [(r.reusable_tokens // chunk_tokens) * chunk_tokens for r in reusable]
    got = sum(min(r.cached_tokens, f) for r, f in zip(reusable, full))
    chunked = {"reusable_chunk_tokens_ge2": sum(full),
               "cached_of_reusable_chunks": got / sum(full) if sum(full) else None,
               "turns_reusing_every_chunk": (sum(r.cached_tokens >= f for r, f in
                                                 zip(reusable, full)) / len(reusable)
                                             if reusable else None)}
  return {
      "turns": len(rows), "errors": len(rows) - len(ok), "turns_ge2": len(later),
      "wall_s": wall_s,
      "ttft_turn1_p50_s": float(np.median([r.ttft_s for r in ok if r.turn == 1] or [np.nan])),
      "ttft_ge2_p50_s": float(np.percentile(ttft, 50)),
      "ttft_ge2_p99_s": float(np.percentile(ttft, 99)),
      "server_ttft_ge2_p50_s": float(np.median(server)) if server else None,
      "prompt_tokens_ge2": sum(r.prompt_tokens for r in later),
      "cached_tokens_ge2": sum(r.cached_tokens for r in later),
      "reusable_tokens_ge2": sum_reusable,
      "cached_of_reusable": sum_cached / sum_reusable if sum_reusable else None,
      "turns_reusing_every_token": (sum(r.cached_tokens >= r.reusable_tokens for r in reusable)
                                    / len(reusable) if reusable else None),
      "prefill_tokens_per_s_ge2": (sum(r.prompt_tokens for r in later) / sum(server)
                                   if server else None),
      "prefill_wall_ge2_p50_s": float(np.median(prefill)) if prefill else None,
      "prefill_wall_ge2_sum_s": sum(prefill) if prefill else None,
      "prefill_tokens_per_prefill_s_ge2": (
          sum(r.prompt_tokens for r in timed) / sum(prefill) if prefill else None),
      "history_share_ge2": (sum(r.reusable_tokens for r in reusable)
                            / sum(r.prompt_tokens for r in reusable) if reusable else None),
      "prompt_tokens_ge2_p50": float(np.median([r.prompt_tokens for r in later] or [np.nan])),
      "device_cached_tokens_ge2": sum(r.tokens_device_cached for r in later),
      "loaded_chunks_ge2_by_tier": tiers, **chunked,
      "session_outcomes": {o: sum(r.session_outcome == o for r in ok)
                           for o in sorted({r.session_outcome for r in ok} - {None})},
  }


def turn1_overlap_split(rows: list[TurnRow]) -> dict:
  """Turns >= 2 of one mode split by whether their prefill (engine clock: first scheduled step
  to first token) overlapped any turn 1's prefill (a cold prompt of another conversation).

  Returns {"overlapping": ..., "other": ...}, each with the turns, their prefill wall p50 and
  sum, prompt tokens per prefill-wall second and the mean seconds of overlap; turns without the
  engine timestamps are left out.
  """
  def timed(r):
    return (r.error is None and r.prefill_s is not None and r.engine_scheduled_s is not None
            and r.engine_first_token_s is not None)

  cold = [(r.engine_scheduled_s, r.engine_first_token_s) for r in rows
          if r.turn == 1 and timed(r)]
  groups: dict[str, list[tuple[TurnRow, float]]] = {"overlapping": [], "other": []}
  for r in rows:
    if r.turn < 2 or not timed(r):
      continue
    lo, hi = r.engine_scheduled_s, r.engine_first_token_s
    # Seconds of r's prefill during which some turn-1 prefill ran (the union of overlaps).
    spans = sorted((max(lo, a), min(hi, b)) for a, b in cold if min(hi, b) > max(lo, a))
    covered, end = 0.0, lo
    for a, b in spans:
      covered += max(0.0, b - max(a, end))
      end = max(end, b)
    groups["overlapping" if spans else "other"].append((r, covered))
  out = {}
  for name, got in groups.items():
    walls = [r.prefill_s for r, _ in got]
    out[name] = {
        "turns": len(got),
        "prefill_wall_p50_s": float(np.median(walls)) if walls else None,
        "prefill_wall_sum_s": sum(walls),
        "prefill_tokens_per_prefill_s": (sum(r.prompt_tokens for r, _ in got) / sum(walls)
                                         if walls and sum(walls) else None),
        "turn1_overlap_mean_s": float(np.mean([c for _, c in got])) if got else None}
  return out


def saver_outcomes(metrics_text: str) -> dict[str, float]:
  """`kvjax_kv_saver_total` by outcome (saved, already stored, dropped, failed, ...) from a
  `/metrics` page: a run whose turns missed stored KV can tell a dropped save from others."""
  from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
  out = {}
  for fam in text_string_to_metric_families(metrics_text):
    if fam.name == "kvjax_kv_saver":
      for sample in fam.samples:
        if sample.name == "kvjax_kv_saver_total":
          out[sample.labels["outcome"]] = sample.value
  return out


def _scrape_saver(url: str) -> dict[str, float] | None:
  try:
    import httpx  # noqa: PLC0415
    return saver_outcomes(httpx.get(f"{url}/metrics", timeout=30).text)
  except Exception as e:  # noqa: BLE001 - a figure for the record; the run's rows stand
    print(f"could not read the saver counters: {e!r}", flush=True)
    return None


#: The per-mode figures taken as the median over rounds (`_median_summary`).
ROUND_FIGURES = ("wall_s", "ttft_turn1_p50_s", "ttft_ge2_p50_s", "ttft_ge2_p99_s",
                 "server_ttft_ge2_p50_s", "prefill_tokens_per_s_ge2", "prefill_wall_ge2_p50_s",
                 "prefill_tokens_per_prefill_s_ge2", "server_cpu_share")


def _replay_once(cfg: ReplayConfig, convs: list, mode: str, work: str) -> tuple[list, dict]:
  """One replay of `convs` in `mode` on a fresh server (and a fresh store under `work`): its
  per-turn rows and its summary (with the server's CPU share over the replay)."""
  os.makedirs(work, exist_ok=True)
  store = None
  if mode == "recompute":
    flags = ["--no_enable_prefix_caching", "--kv_store=none"]
  else:
    store = os.path.join(work, f"kv-{mode}")
    os.makedirs(store)
    flags = [f"--kv_store=file://{store}"]
    if cfg.host_bytes:
      disk = {"kind": "disk", "url": f"file://{store}"}
      if cfg.disk_bytes:
        disk["capacity_bytes"] = cfg.disk_bytes
      flags = ["--kv_tiers=" + json.dumps([{"kind": "host", "capacity_bytes": cfg.host_bytes},
                                           disk])]
  proc, url, model = benchlib.start_server(
      [f"--model={cfg.model}", f"--kv_chunk_size={cfg.kv_chunk_size}", *flags,
       *cfg.server_flags], os.path.join(work, f"server-{mode}.log"))
  saver = None
  try:
    cpu0 = benchlib.process_cpu_s(proc.pid)
    got, wall = asyncio.run(_replay(url, model, mode, convs, cfg))
    cpu1 = benchlib.process_cpu_s(proc.pid)
    if store is not None:
      saver = _scrape_saver(url)
  finally:
    benchlib.stop_server(proc)
    if store is not None:
      shutil.rmtree(store, ignore_errors=True)  # the disk tier: up to GBs per mode
  s = summarize(got, wall, cfg.kv_chunk_size)
  s["ge2_by_turn1_overlap"] = turn1_overlap_split(got)
  s["server_cpu_share"] = (cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else None
  if saver is not None:
    s["saver"] = saver
  return got, s


def _median_summary(per_round: list[dict]) -> dict:
  """A mode's summary over its rounds: the median round's record (by TTFT p50 of turns >= 2),
  each of `ROUND_FIGURES` replaced by its median over rounds, and `rounds`: each figure's
  `benchlib.summarize` (median, min, max, spread, the values)."""
  ranked = sorted(per_round, key=lambda s: s["ttft_ge2_p50_s"] or 0.0)
  out = dict(ranked[(len(ranked) - 1) // 2])
  out["rounds"] = {}
  for k in ROUND_FIGURES:
    vals = [s.get(k) for s in per_round]
    if all(v is not None for v in vals):
      out["rounds"][k] = benchlib.summarize(vals)
      out[k] = out["rounds"][k]["median"]
  return out


def run_replay(cfg: ReplayConfig, data_dir: pathlib.Path,
               modes=("session", "prefix", "recompute")) -> dict:
  """Replays on one fresh server per mode and round (`cfg.rounds` interleaved rounds, the
  modes' order rotated per round: `benchlib.interleaved_rounds`); returns settings, summaries
  (the median over rounds, with each round's figures) and per-turn rows."""
  path = data_dir / "sharegpt" / "sharegpt_v3_multiturn_1000.json"
  chosen = None
  if cfg.history_tokens:
    from kvjax.testing import session_sim  # noqa: PLC0415 - SmolLM2's tokenizer as a counter
    count, system = session_sim.smollm2_token_counter()
    chosen = pick_history_dominant(json.loads(path.read_text(encoding="utf-8")), count, system,
                                   cfg)
    convs = list(chosen)
    random.Random(cfg.seed).shuffle(convs)
    convs = convs[:cfg.conversations]
    # The replay's KV footprint (every token of every replayed conversation, replies at
    # max_tokens): the capacity ratios' base, as in CachedAttention's cache-capacity ratio.
    reply = count("assistant", "") + cfg.max_tokens
    footprint_tokens = sum(c.history_tokens + sum(count("user", u) + reply for u in c.users)
                           for c in convs)
    footprint = footprint_tokens * cfg.kv_bytes_per_token
    if cfg.host_ratio:
      cfg = dataclasses.replace(cfg, host_bytes=int(cfg.host_ratio * footprint),
                                disk_bytes=int(cfg.disk_ratio * footprint) or cfg.disk_bytes)
  else:
    convs = load_conversations(path, cfg.conversations, cfg.turns, cfg.turn_chars, cfg.seed,
                               cfg.min_turns)
  work = tempfile.mkdtemp(prefix="kvjax-bench-sessions-")
  per_round, rows = {m: [] for m in modes}, []
  orders = benchlib.interleaved_rounds(list(modes), cfg.rounds)
  for r, order in enumerate(orders):
    for mode in order:  # each mode on a fresh server (and store), every round
      got, s = _replay_once(cfg, convs, mode, os.path.join(work, f"r{r}"))
      rows += got
      per_round[mode].append(s)
      print(f"round {r} {mode}: {s}", flush=True)
  summaries = {m: _median_summary(ss) for m, ss in per_round.items()}
  print(f"server logs: {work}", flush=True)
  rec = summaries.get("recompute")
  for mode, s in summaries.items():
    if rec and mode != "recompute":
      s["ttft_ge2_p50_vs_recompute"] = s["ttft_ge2_p50_s"] / rec["ttft_ge2_p50_s"]
      s["ttft_ge2_p99_vs_recompute"] = s["ttft_ge2_p99_s"] / rec["ttft_ge2_p99_s"]
      if s["prefill_tokens_per_s_ge2"] and rec["prefill_tokens_per_s_ge2"]:
        s["prefill_rate_vs_recompute"] = (s["prefill_tokens_per_s_ge2"]
                                          / rec["prefill_tokens_per_s_ge2"])
      if s["prefill_tokens_per_prefill_s_ge2"] and rec["prefill_tokens_per_prefill_s_ge2"]:
        s["prefill_wall_rate_vs_recompute"] = (s["prefill_tokens_per_prefill_s_ge2"]
                                               / rec["prefill_tokens_per_prefill_s_ge2"])
  out = {"settings": dataclasses.asdict(cfg), "conversations_used": len(convs),
         "summary": summaries, "turns": [dataclasses.asdict(r) for r in rows]}
  if chosen is not None:
    out["selection"] = {
        "rule": "history-dominant (scripts/session_replay.py docstring)",
        "footprint_tokens": footprint_tokens, "footprint_bytes": footprint,
        "admitted": len(chosen), "used": len(convs),
        "source_indices": [c.source_index for c in convs],
        "history_tokens": [c.history_tokens for c in convs],
        "replayed_turns": [len(c.users) for c in convs]}
  return out


def print_table(summaries: dict) -> None:
  head = (f"{'mode':10} {'turns':>5} {'err':>3} {'TTFT>=2 p50':>11} {'p99':>7} {'vs recomp':>9} "
          f"{'cached/reusable':>15} {'all reused':>10} {'tok/s TTFT':>10} {'tok/s prefill':>13} "
          f"{'prefill p50':>11} {'chunks reused':>13}  tiers")
  print("\n" + head + "\n" + "-" * len(head))
  for mode, s in summaries.items():
    ratio = s.get("ttft_ge2_p50_vs_recompute")
    cr, every = s["cached_of_reusable"], s["turns_reusing_every_token"]
    pw = s.get("prefill_wall_ge2_p50_s")
    cc = s.get("cached_of_reusable_chunks")
    print(f"{mode:10} {s['turns']:5d} {s['errors']:3d} {s['ttft_ge2_p50_s']:10.2f}s "
          f"{s['ttft_ge2_p99_s']:6.2f}s {'' if ratio is None else f'{ratio:.3f}':>9} "
          f"{'' if cr is None else f'{100 * cr:.1f}%':>15} "
          f"{'' if every is None else f'{100 * every:.0f}%':>10} "
          f"{s['prefill_tokens_per_s_ge2'] or 0:10.0f} "
          f"{s.get('prefill_tokens_per_prefill_s_ge2') or 0:13.0f} "
          f"{'' if pw is None else f'{pw:.3f}s':>11} "
          f"{'' if cc is None else f'{100 * cc:.1f}%':>13}  {s['loaded_chunks_ge2_by_tier']}")
  rec = summaries.get("recompute")
  for mode, s in summaries.items():
    if rec and mode != "recompute":
      print(f"{mode} vs recompute: TTFT p50 of turns >= 2 "
            f"{100 * (1 - s['ttft_ge2_p50_vs_recompute']):.1f}% lower (target >= 87%); prefill "
            f"throughput per prefill wall second {s.get('prefill_wall_rate_vs_recompute') or 0:.2f}x"
            f" (target >= 7.8x), per TTFT second {s.get('prefill_rate_vs_recompute') or 0:.2f}x")
