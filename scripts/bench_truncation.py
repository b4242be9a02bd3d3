"""Truncation quality (CachedAttention, arXiv 2403.19708, section 3.4): perplexity of a
conversation's next reply after its oldest turns are dropped, with the kept turns' KV
re-rotated to their new positions vs recomputing the truncated prompt vs naive truncation.

For each ShareGPT conversation (../shared/data/sharegpt/sharegpt_v3_multiturn_1000.json,
SmolLM2's chat template, its default system prompt) we take the last round whose history (every
message before the assistant's reply, generation prompt included) exceeds `--max_context`
tokens, truncate that history with the sessions' rule (`kvjax.engine.sessions.truncate_prompt`,
`drop_oldest_turns`: keep the system prompt and the last user message, drop whole oldest turns
until it fits) and score the reply's first `--max_reply` tokens (mean negative log-likelihood,
perplexity = exp of it) four ways, on the same slotted model runner:

  full       the untruncated history (reference; not what a bounded context can do)
  recompute  the truncated prompt computed from scratch (the exact answer for that prompt)
  rerotate   the kept turns' KV taken from the full history's prefill (K before RoPE, computed
             with the dropped turns in context), inserted with RoPE at the NEW positions
             (`ModelRunner.insert_chunk`: what a session with `session_rerotate` does with the
             stored chunks); the system prompt's KV (same positions) as is; the new user message,
             the generation prompt and the reply computed on top
  naive      as rerotate, but K keeps the rotation of its OLD positions (no re-rotation: K is
             rotated by old - new before the insert)

Pooled perplexity = exp(mean NLL over all scored tokens of all conversations); the table also
gives the mean over conversations of |ppl(variant) - ppl(recompute)|. The paper's target is a
difference below 0.02 against recompute.

    .venv/bin/python scripts/bench_truncation.py                     # 24 conversations, 1024
    .venv/bin/python scripts/bench_truncation.py --conversations=8 --max_context=2048

Writes <out_dir>/bench_truncation.json (machine, versions, git SHA, settings, per-conversation
rows) and bench_truncation.png.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import pathlib
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchlib import git_sha, machine  # scripts/benchlib.py
from kvjax import LLM
from kvjax.engine import sessions as sess
from kvjax.models import layers

REPO = pathlib.Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", str(REPO.parent / "shared" / "data"), "the shared data folder")
flags.DEFINE_integer("conversations", 24, "conversations scored")
flags.DEFINE_integer("max_context", 1024, "prompt tokens kept at most (the truncation limit)")
flags.DEFINE_integer("max_history", 3072, "skip conversations whose history passes this")
flags.DEFINE_integer("max_reply", 128, "reply tokens scored at most")
flags.DEFINE_integer("min_reply", 16, "skip replies shorter than this")
flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "where results go")
flags.DEFINE_string("tag", "", "suffix of the output files")

PIECE = 256  # insertion pieces (one compiled insert size)
VARIANTS = ("full", "recompute", "rerotate", "naive")


def _conversations(path: pathlib.Path):
  for conv in json.loads(path.read_text()):
    msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in conv["conversations"]]
    if len(msgs) >= 4:
      yield conv["id"], msgs


def _prefill(runner, ids, slot, start, all_logits=False):
  """Prefills `ids` at `start` in pieces; returns ([logits rows], [(k, v) pre-RoPE pieces])."""
  logits, kvs, m = [], [], runner.max_chunk_size
  for a in range(0, len(ids), m):
    out = runner.prefill_chunk(ids[a:a + m], slot, start + a, all_logits=all_logits)
    if all_logits:
      logits.append(np.asarray(out.logits))
    kvs.append((np.asarray(out.k_pre_rope_LTKH), np.asarray(out.v_LTKH)))
  return logits, kvs


def _nll(logits_TV: np.ndarray, targets: list[int]) -> np.ndarray:
  """NLL of `targets[i]` under row i."""
  x = logits_TV.astype(np.float64)
  lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
  return lse - x[np.arange(len(targets)), targets]


def _insert(runner, k_LTKH, v_LTKH, slot, start):
  """Writes pre-RoPE K and V at `[start, start + T)` (RoPE at those positions) in pieces."""
  t = k_LTKH.shape[1]
  for a in range(0, t, PIECE):
    k, v = k_LTKH[:, a:a + PIECE], v_LTKH[:, a:a + PIECE]
    if k.shape[1] < PIECE:  # pad: the positions past the kept ones are overwritten next
      pad = ((0, 0), (0, PIECE - k.shape[1]), (0, 0), (0, 0))
      k, v = np.pad(k, pad), np.pad(v, pad)
    runner.insert_chunk(np.stack([k, v], axis=1), slot, start + a)


def _score_on_kept(runner, kept_k, kept_v, rest_ids, targets, slot, n_kept):
  _insert(runner, kept_k, kept_v, slot, 0)
  logits, _ = _prefill(runner, rest_ids, slot, n_kept, all_logits=True)
  rows = np.concatenate(logits)[len(rest_ids) - len(targets) - 1:-1]
  return _nll(rows, targets)


def main(argv):
  del argv
  path = pathlib.Path(FLAGS.data_dir) / "sharegpt" / "sharegpt_v3_multiturn_1000.json"
  llm = LLM(kv_cache_layout="slotted", max_num_seqs=4,
            max_model_len=FLAGS.max_history + FLAGS.max_reply + PIECE, compile_on_init=False)
  tok, runner = llm.get_tokenizer(), llm.engine.runner
  inv_freq = jnp.asarray(layers.rope_inv_freq(llm.model_config))
  rows, t0 = [], time.perf_counter()
  for cid, msgs in _conversations(path):
    if len(rows) >= FLAGS.conversations:
      break
    pick = None
    for j in range(len(msgs) - 1, 0, -1):  # the last assistant reply with a long history
      if msgs[j]["role"] != "assistant":
        continue
      hist = tok.encode_chat(msgs[:j], add_generation_prompt=True)
      full = tok.encode_chat(msgs[:j + 1], add_generation_prompt=False)
      if full[:len(hist)] != hist or len(full) - len(hist) < FLAGS.min_reply:
        continue
      if FLAGS.max_context < len(hist) <= FLAGS.max_history:
        pick = (j, hist, full[len(hist):len(hist) + FLAGS.max_reply])
        break
    if pick is None:
      continue
    j, hist, reply = pick
    tr = sess.truncate_prompt(tok, hist, FLAGS.max_context)
    if tr.dropped_turns == 0 or len(tr.spans) != 2:
      continue  # a plain cut (one huge message): not a turn truncation
    sys_span, kept = tr.spans
    # The new part (the last user message + generation prompt) is computed in every variant;
    # the kept KV is everything before it: the system prompt and the kept older turns.
    users = [a for a, _, role in sess.message_segments(tok, tr.token_ids) if role == "user"]
    n_kept = users[-1]
    rest = list(tr.token_ids[n_kept:]) + list(reply)
    targets = list(reply)
    nll = {}
    # full: the whole history, then the reply; its KV is the "stored" KV of every old token.
    logits, kvs = _prefill(runner, list(hist) + list(reply), 0, 0, all_logits=True)
    nll["full"] = _nll(np.concatenate(logits)[len(hist) - 1:-1], targets)
    k_all = np.concatenate([k for k, _ in kvs], axis=1)
    v_all = np.concatenate([v for _, v in kvs], axis=1)
    # recompute: the truncated prompt from scratch.
    logits, _ = _prefill(runner, list(tr.token_ids) + list(reply), 1, 0, all_logits=True)
    nll["recompute"] = _nll(np.concatenate(logits)[len(tr.token_ids) - 1:-1], targets)
    # The kept prefix [0, n_kept) of the truncated prompt maps to old positions: the system
    # span in place, the kept turns from kept.src_start.
    src = np.concatenate([np.arange(sys_span.length),
                          kept.src_start + np.arange(n_kept - sys_span.length)])
    k_kept, v_kept = k_all[:, src], v_all[:, src]
    nll["rerotate"] = _score_on_kept(runner, k_kept, v_kept, rest, targets, 2, n_kept)
    # naive: K keeps its old rotation: pre-rotate by (old - new) so that RoPE(new) on insert
    # gives RoPE(old).
    delta = jnp.asarray(src - np.arange(n_kept), jnp.int32)[None, :]
    k_old = np.asarray(layers.apply_rope(jnp.asarray(k_kept), jnp.broadcast_to(
        delta, k_kept.shape[:2]), inv_freq))
    nll["naive"] = _score_on_kept(runner, k_old, v_kept, rest, targets, 3, n_kept)
    row = {"id": cid, "round": j, "history_tokens": len(hist),
           "truncated_tokens": len(tr.token_ids), "dropped_turns": tr.dropped_turns,
           "kept_turn_tokens": n_kept - sys_span.length, "shift": int(kept.src_start - kept.dst_start),
           "new_tokens": len(tr.token_ids) - n_kept, "reply_tokens": len(targets),
           **{f"nll_{v}": float(nll[v].mean()) for v in VARIANTS},
           **{f"ppl_{v}": float(math.exp(nll[v].mean())) for v in VARIANTS},
           "sum_nll": {v: float(nll[v].sum()) for v in VARIANTS}}
    rows.append(row)
    print(f"{len(rows):3d} {cid:>12s} hist {len(hist):5d} -> {len(tr.token_ids):5d} (kept "
          f"{row['kept_turn_tokens']} turn tokens moved by {row['shift']}) reply "
          f"{len(targets):3d}  ppl " + "  ".join(f"{v} {row['ppl_' + v]:.4f}" for v in VARIANTS),
          flush=True)
  n_tok = sum(r["reply_tokens"] for r in rows)
  pooled = {v: math.exp(sum(r["sum_nll"][v] for r in rows) / n_tok) for v in VARIANTS}
  mean_abs = {v: float(np.mean([abs(r[f"ppl_{v}"] - r["ppl_recompute"]) for r in rows]))
              for v in VARIANTS}
  print(f"\n{len(rows)} conversations, {n_tok} scored reply tokens, max_context "
        f"{FLAGS.max_context}, {time.perf_counter() - t0:.0f} s")
  print(f"{'variant':10s} {'pooled ppl':>10s} {'- recompute':>12s} {'mean |dppl|':>12s}")
  for v in VARIANTS:
    print(f"{v:10s} {pooled[v]:10.4f} {pooled[v] - pooled['recompute']:+12.4f} "
          f"{mean_abs[v]:12.4f}")
  out = pathlib.Path(FLAGS.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  name = "bench_truncation" + (f"_{FLAGS.tag}" if FLAGS.tag else "")
  result = {
      "machine": machine(), "git_sha": git_sha(), "jax": jax.__version__,
      "kvjax": importlib.metadata.version("kvjax"), "backend": jax.default_backend(),
      "dtype": "float32", "threads": os.cpu_count(), "seed": 0,
      "settings": {k: FLAGS[k].value for k in ("conversations", "max_context", "max_history",
                                                "max_reply", "min_reply")},
      "data": "sharegpt/sharegpt_v3_multiturn_1000.json (first conversations in file order "
              "that qualify)",
      "pooled_ppl": pooled, "mean_abs_ppl_diff_vs_recompute": mean_abs,
      "scored_tokens": n_tok, "rows": rows}
  (out / f"{name}.json").write_text(json.dumps(result, indent=1))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  base = np.array([r["ppl_recompute"] for r in rows])
  for v, mark in (("rerotate", "o"), ("naive", "x"), ("full", ".")):
    axes[0].scatter(base, [r[f"ppl_{v}"] for r in rows], marker=mark, label=v)
  lim = [min(base.min(), 1), base.max() * 1.1]
  axes[0].plot(lim, lim, "k:", lw=1)
  axes[0].set_xlabel("ppl, recompute the truncated prompt")
  axes[0].set_ylabel("ppl")
  axes[0].set_xscale("log")
  axes[0].set_yscale("log")
  axes[0].legend()
  axes[0].set_title("per conversation")
  axes[1].bar(VARIANTS, [pooled[v] for v in VARIANTS])
  for i, v in enumerate(VARIANTS):
    axes[1].text(i, pooled[v], f"{pooled[v]:.3f}", ha="center", va="bottom")
  axes[1].set_ylabel("pooled perplexity of the next reply")
  axes[1].set_title(f"{len(rows)} ShareGPT conversations, context {FLAGS.max_context}")
  fig.suptitle("Truncation keeping the cache (SmolLM2-135M, f32, 2-core CPU)")
  fig.tight_layout()
  fig.savefig(out / f"{name}.png", dpi=120)
  print(f"wrote {out / name}.json and .png")
  llm.close()


if __name__ == "__main__":
  app.run(main)
