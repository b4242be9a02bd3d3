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

Per turn: client TTFT (request sent to the first streamed event), the server's `kvjax.ttft_s`,
prompt / cached / completion tokens. For turns >= 2, the tokens shared with the previous turn are
its prompt + its completion; all but the last sampled one have KV, so "reusable" = that - 1.
Prefill throughput = prompt tokens of turns >= 2 / the sum of their server TTFTs (seconds from
submission to the first token, which is prefill plus queueing: a lower bound on the rate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import signal
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
  model: str = "SmolLM2-135M-Instruct"
  server_flags: tuple[str, ...] = ()


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
      i, users = queue.get_nowait()
      messages, prev = [], None
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


def summarize(rows: list[TurnRow], wall_s: float) -> dict:
  ok = [r for r in rows if r.error is None]
  later = [r for r in ok if r.turn >= 2]
  ttft = np.array([r.ttft_s for r in later] or [np.nan])
  server = [r.server_ttft_s for r in later if r.server_ttft_s is not None]
  reusable = [r for r in later if r.reusable_tokens is not None]
  sum_reusable = sum(r.reusable_tokens for r in reusable)
  sum_cached = sum(min(r.cached_tokens, r.reusable_tokens) for r in reusable)
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
      "session_outcomes": {o: sum(r.session_outcome == o for r in ok)
                           for o in sorted({r.session_outcome for r in ok} - {None})},
  }


def run_replay(cfg: ReplayConfig, data_dir: pathlib.Path,
               modes=("session", "prefix", "recompute")) -> dict:
  """Replays on one fresh server per mode; returns settings, summaries and per-turn rows."""
  convs = load_conversations(data_dir / "sharegpt" / "sharegpt_v3_multiturn_1000.json",
                             cfg.conversations, cfg.turns, cfg.turn_chars, cfg.seed,
                             cfg.min_turns)
  work = tempfile.mkdtemp(prefix="kvjax-bench-sessions-")
  summaries, rows = {}, []
  for mode in modes:
    if mode == "recompute":
      flags = ["--no_enable_prefix_caching", "--kv_store=none"]
    else:
      store = os.path.join(work, f"kv-{mode}")
      os.makedirs(store)
      flags = [f"--kv_store=file://{store}"]
    proc, url, model = benchlib.start_server([f"--model={cfg.model}", *flags, *cfg.server_flags],
                                             os.path.join(work, f"server-{mode}.log"))
    try:
      got, wall = asyncio.run(_replay(url, model, mode, convs, cfg))
    finally:
      proc.send_signal(signal.SIGINT)
      proc.wait(120)
    rows += got
    summaries[mode] = summarize(got, wall)
    print(f"{mode}: {summaries[mode]}", flush=True)
  rec = summaries.get("recompute")
  for mode, s in summaries.items():
    if rec and mode != "recompute":
      s["ttft_ge2_p50_vs_recompute"] = s["ttft_ge2_p50_s"] / rec["ttft_ge2_p50_s"]
      if s["prefill_tokens_per_s_ge2"] and rec["prefill_tokens_per_s_ge2"]:
        s["prefill_rate_vs_recompute"] = (s["prefill_tokens_per_s_ge2"]
                                          / rec["prefill_tokens_per_s_ge2"])
  return {"settings": dataclasses.asdict(cfg), "conversations_used": len(convs),
          "summary": summaries, "turns": [dataclasses.asdict(r) for r in rows]}


def print_table(summaries: dict) -> None:
  head = (f"{'mode':10} {'turns':>5} {'err':>3} {'TTFT>=2 p50':>11} {'p99':>7} {'vs recomp':>9} "
          f"{'cached/reusable':>15} {'all reused':>10} {'prefill tok/s':>13}")
  print("\n" + head + "\n" + "-" * len(head))
  for mode, s in summaries.items():
    ratio = s.get("ttft_ge2_p50_vs_recompute")
    cr, every = s["cached_of_reusable"], s["turns_reusing_every_token"]
    print(f"{mode:10} {s['turns']:5d} {s['errors']:3d} {s['ttft_ge2_p50_s']:10.2f}s "
          f"{s['ttft_ge2_p99_s']:6.2f}s {'' if ratio is None else f'{ratio:.3f}':>9} "
          f"{'' if cr is None else f'{100 * cr:.1f}%':>15} "
          f"{'' if every is None else f'{100 * every:.0f}%':>10} "
          f"{s['prefill_tokens_per_s_ge2'] or 0:13.0f}")
