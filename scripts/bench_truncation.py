"""Truncation quality (CachedAttention, arXiv 2403.19708, section 3.4): perplexity of a
conversation's next reply after its oldest turns are dropped, with the kept turns' KV
re-rotated to their new positions vs recomputing the truncated prompt vs naive truncation, and
what the gap between re-rotated and recomputed KV is made of.

For each ShareGPT conversation (../shared/data/sharegpt/sharegpt_v3_multiturn_1000.json,
SmolLM2's chat template, its default system prompt) we take the last round whose history (every
message before the assistant's reply, generation prompt included) exceeds `--max_context`
tokens, truncate that history with the sessions' rule (`kvjax.sessions.truncate_prompt`,
`drop_oldest_turns`: keep the system prompt and the last user message, drop whole oldest turns
until it fits) and score the reply's first `--max_reply` tokens (mean negative log-likelihood,
perplexity = exp of it) on the same paged model runner (one fixed block table per variant). The truncated prompt is
`[system | kept turns | new part]`: `S` system tokens, `n_kept - S` kept-turn tokens, then the
last user message and the generation prompt (the new part, computed in every variant), then the
reply. Variants (what fills positions `[0, n_kept)`):

  full        the untruncated history (reference; not what a bounded context can do)
  recompute   the truncated prompt computed from scratch (the exact answer for that prompt)
  self        recompute's own K (before RoPE) and V written back with `insert_chunk` (RoPE at
              the same positions): the insert path's float32 rounding; should equal recompute
  rerotate    every kept token's KV taken from the full history's prefill (K before RoPE,
              computed with the dropped turns in context), inserted with RoPE at the NEW
              positions; the system prompt's KV (same positions, causal: exact) as is
  naive       as rerotate, but K keeps the rotation of its OLD positions (no re-rotation)
  roundtrip   as rerotate, with K rotated at its old positions and un-rotated again first (the
              paged layout's save path, `read_pre_rope`): the float32 rounding of that round
              trip; should equal rerotate
  head<N>     as rerotate, but the first N kept-turn tokens after the cut (the seam) are
              recomputed on top of the system prompt (N = 16, 64, 256)
  staged_b0   what `session_rerotate` does by default (`session_rerotate_boundary_chunks=0`):
              the truncated prompt's whole store chunks (`--chunk`) whose source KV is stored
              (the previous turn's full chunks; never the last prompt token) are re-rotated,
              the rest (the kept tail of the last partial chunk, then the new part) computed
  staged_b1   as staged_b0, but the truncated prompt's first chunk (system + the seam)
              computed (`session_rerotate_boundary_chunks=1`)
  blend_r<P>  staged_b1 plus selective recompute of P% of its re-rotated tokens chosen the way
              of CacheBlend (arXiv 2405.16444, sections 4.2-4.3): after the first chunk is
              computed, every re-rotated token runs layer 0 exactly (its layer-0 KV does not
              depend on context, so its input to layer 1 is exact) and layer 1's K/V is
              projected fresh; that fresh layer-1 KV is written for all of them (free: it is
              computed anyway), the tokens whose fresh layer-1 V deviates most from the
              re-rotated one (mean squared difference over heads and head dim, CacheBlend's
              reference choice; ties by position) are picked, and only those run layers
              1..L-1, each attending causally over the cache (re-rotated KV for the others) and
              writing its fresh KV before each layer's attention; then the kept tail and the
              rest are computed as in staged_b1 (P = 10, 20, 30, 50)
  rand_r<P>   ablation: as blend_r<P> with the same count picked uniformly at random (seeded by
              the conversation's index; P = 10, 20, 30)
  near_r<P>   ablation: as blend_r<P> with the re-rotated tokens nearest the seam picked
              (P = 10, 20, 30)
  blend_all   every re-rotated token through the selective path (soundness: should equal
              recompute up to float32 rounding)

Pooled perplexity = exp(mean NLL over all scored tokens of all conversations). Side by side:
pooled ppl minus recompute's with a 95% bootstrap interval (conversations resampled, seed 0),
mean |ppl - ppl_recompute| over conversations, the kept tokens each variant computes (its cost
over the re-rotated KV; recompute computes all of them; a selective variant counts each
selected token whole and each re-rotated token's layer-0 pass as 1/L), a TTFT estimate from
this run's measured prefill and insert rates, the gap by reply position, the conversations that
dominate it, the relative K/V deviation of the re-rotated KV from the recomputed one by distance
from the seam, and what the selective variants picked (count, distance from the seam, layer-1 V
deviation, the share of that deviation the top tokens hold) and how they compare with their base,
staged_b1, paired by conversation (same bootstrap).

    .venv/bin/python scripts/bench_truncation.py                     # 24 conversations, 1024
    .venv/bin/python scripts/bench_truncation.py --conversations=8 --max_context=2048
    .venv/bin/python scripts/bench_truncation.py --variants=recompute,staged_b1,blend_r20 \
        --conversations=4 --tag=dev                                  # a quick subset

Writes <out_dir>/bench_truncation.json (`benchlib.provenance()`, settings, per-conversation
rows) and bench_truncation.png.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import benchlib  # scripts/benchlib.py
from benchlib import pyplot
from kvjax import LLM
from kvjax import sessions as sess
from kvjax.kernels.attention import dense_attention_reference
from kvjax.models.nn import layers, llama
from kvjax.models.nn.kv_cache import PagedKVCache
from kvjax.models.runner.runner_api import SeqChunk

REPO = pathlib.Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", str(REPO.parent / "shared" / "data"), "the shared data folder")
flags.DEFINE_integer("conversations", 24, "conversations scored")
flags.DEFINE_integer("max_context", 1024, "prompt tokens kept at most (the truncation limit)")
flags.DEFINE_integer("max_history", 3072, "skip conversations whose history passes this")
flags.DEFINE_integer("max_reply", 128, "reply tokens scored at most")
flags.DEFINE_integer("min_reply", 16, "skip replies shorter than this")
flags.DEFINE_integer("chunk", 256, "store chunk size (kv_chunk_size) of the staged variants")
flags.DEFINE_integer("bootstrap", 2000, "bootstrap resamples of the conversations")
flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "where results go")
flags.DEFINE_string("tag", "", "suffix of the output files")
flags.DEFINE_list("variants", [], "variants scored (default: all); recompute is always scored")
flags.DEFINE_bool("replot", False, "only redraw <out_dir>/bench_truncation[_tag].png from its JSON")

PIECE = 256  # insertion pieces (one compiled insert size)
HEADS = (16, 64, 256)
BLEND_RATIOS = (10, 20, 30, 50)  # percent of the re-rotated tokens recomputed
ABLATION_RATIOS = (10, 20, 30)
BLEND = {**{f"blend_r{p}": ("dev", p) for p in BLEND_RATIOS},
         **{f"rand_r{p}": ("random", p) for p in ABLATION_RATIOS},
         **{f"near_r{p}": ("seam", p) for p in ABLATION_RATIOS}, "blend_all": ("dev", 100)}
ALL_VARIANTS = ("full", "recompute", "self", "rerotate", "naive", "roundtrip",
                *(f"head{n}" for n in HEADS), "staged_b0", "staged_b1", *BLEND)
VARIANTS = ALL_VARIANTS  # the scored ones (`--variants`), set in main
POS_BUCKETS = ((0, 8), (8, 32), (32, 128))
SEAM_BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 256), (256, 1 << 30))


def _conversations(path: pathlib.Path):
  for conv in json.loads(path.read_text()):
    msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
            for t in conv["conversations"]]
    if len(msgs) >= 4:
      yield conv["id"], msgs


def _table(runner, slot: int) -> list[int]:
  """Sequence `slot`'s fixed block table: blocks [slot * M, (slot + 1) * M), M blocks of a
  whole `max_seq_len` (the pool holds `max_num_seqs` of them)."""
  m = runner.max_blocks_per_seq
  return list(range(slot * m, (slot + 1) * m))


def _prefill(runner, ids, slot, start, all_logits=False):
  """Prefills `ids` at `start` in pieces; returns ([logits rows], [(k, v) pre-RoPE pieces])."""
  logits, kvs, m = [], [], runner.max_chunk_size
  table = _table(runner, slot)
  for a in range(0, len(ids), m):
    seq = [SeqChunk(ids[a:a + m], start + a, table)]
    out = runner.step_all_logits(seq) if all_logits else runner.step(seq)
    if all_logits:
      logits.append(np.asarray(out.logits_SV))
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
  table, b = _table(runner, slot), runner.block_size
  for a in range(0, t, PIECE):
    k, v = k_LTKH[:, a:a + PIECE], v_LTKH[:, a:a + PIECE]
    if k.shape[1] < PIECE:  # pad: the positions past the kept ones are overwritten next
      pad = ((0, 0), (0, PIECE - k.shape[1]), (0, 0), (0, 0))
      k, v = np.pad(k, pad), np.pad(v, pad)
    runner.insert_chunk(np.stack([k, v], axis=1),
                        table[(start + a) // b:(start + a + PIECE) // b], start + a)


def _score(runner, ids, kept_k, kept_v, computed, targets, slot, before_tail=None):
  """NLL of `targets` (the last tokens of `ids`) when positions p < n_kept with computed[p]
  False hold the given KV and every other position is computed in order; `before_tail()`, when
  given, runs after the computed runs inside the kept prefix and before the kept tail (the last
  computed run, which merges with the rest) is computed."""
  n_kept = kept_k.shape[1]
  if not computed.all():
    _insert(runner, kept_k, kept_v, slot, 0)
  # computed runs inside the kept prefix, in order; the run reaching n_kept merges with the rest
  first_tail = n_kept
  while first_tail > 0 and computed[first_tail - 1]:
    first_tail -= 1
  p = 0
  while p < first_tail:
    if not computed[p]:
      p += 1
      continue
    q = p
    while q < first_tail and computed[q]:
      q += 1
    _prefill(runner, list(ids[p:q]), slot, p)
    p = q
  if before_tail is not None:
    before_tail()
  logits, _ = _prefill(runner, list(ids[first_tail:]), slot, first_tail, all_logits=True)
  rows = np.concatenate(logits)[len(ids) - first_tail - len(targets) - 1:-1]
  return _nll(rows, targets)


def _bucket(n: int) -> int:
  """Padded token count of a selective pass: a power of two >= 16 (few compiles)."""
  return max(16, 1 << (n - 1).bit_length())


class _Blend:
  """Selective recompute over one sequence's pool blocks (CacheBlend, arXiv 2405.16444, sections
  4.2-4.3), for the `blend_*`, `rand_*` and `near_*` variants.

  `select` runs tokens at positions `pos` (whose re-rotated KV is in the cache) through layer 0
  exactly, writing their layer-0 KV, then projects their layer-1 K (before RoPE) and V from
  that exact input and writes them too; it returns the layer-1 input and the fresh layer-1 K/V.
  `recompute` runs a subset through layers 1..L-1 from that input: each layer writes the
  subset's K (after RoPE) and V at their positions, then attends causally over the cache (the
  other positions keep what they hold), as a ragged step does for contiguous tokens (here
  dense attention over the sequence's blocks gathered in position order).
  """

  def __init__(self, runner, inv_freq):
    cfg = runner.model_config
    self.runner, self.n_layers = runner, cfg.n_layers
    self.s_max = runner.max_blocks_per_seq * runner.block_size
    st = runner.state
    stacked = {n: jnp.asarray(st["layers"][n][...]) for n in llama.layer_param_names(cfg)}
    self.p0 = {n: v[:1] for n, v in stacked.items()}
    self.p1 = {n: v[1] for n, v in stacked.items()}
    self.rest = {n: v[1:] for n, v in stacked.items()}
    self.embed = jnp.asarray(st["embed"][...])

    def gather(pool, table):  # a sequence's blocks in position order: [L, S, K, H]
      l_, _, b_, k_, h_ = pool.k_LPBKH.shape
      return (pool.k_LPBKH[:, table].reshape(l_, -1, k_, h_),
              pool.v_LPBKH[:, table].reshape(l_, -1, k_, h_))

    def scatter(pool, table, k_LSKH, v_LSKH):
      shape = pool.k_LPBKH[:, table].shape
      return PagedKVCache(pool.k_LPBKH.at[:, table].set(k_LSKH.reshape(shape)),
                          pool.v_LPBKH.at[:, table].set(v_LSKH.reshape(shape)))

    def run_layers(params, pool, x_1TD, pos_T, write_T, table, l0):
      pos_1T = pos_T[None]
      k_seq, v_seq = gather(pool, table)
      kv_pos_1S = jnp.arange(k_seq.shape[1], dtype=jnp.int32)[None]

      def layer(carry, xs):
        x, kc, vc = carry
        p, i = xs
        q, _, k_rot, v = llama._attention_inputs(cfg, p, x, pos_1T, inv_freq)
        kc = kc.at[i, write_T].set(k_rot[0].astype(kc.dtype), mode="drop")
        vc = vc.at[i, write_T].set(v[0].astype(vc.dtype), mode="drop")
        # Causal over the sequence's positions: a query sees every position up to its own.
        attn = dense_attention_reference(q, kc[i][None], vc[i][None], pos_1T, kv_pos_1S)
        return (llama._attention_output_and_mlp(cfg, p, x, attn.astype(x.dtype)), kc, vc), None

      n = params["wq"].shape[0]
      (x, k_seq, v_seq), _ = jax.lax.scan(layer, (x_1TD, k_seq, v_seq),
                                          (params, l0 + jnp.arange(n, dtype=jnp.int32)))
      return x, scatter(pool, table, k_seq, v_seq)

    def select(p0, p1, embed, pool, tokens_T, pos_T, write_T, table):
      x = jnp.take(embed, tokens_T, axis=0)[None]
      x, pool = run_layers(p0, pool, x, pos_T, write_T, table, jnp.int32(0))
      _, k1, k1_rot, v1 = llama._attention_inputs(cfg, p1, x, pos_T[None], inv_freq)
      k_seq, v_seq = gather(pool, table)
      k_seq = k_seq.at[1, write_T].set(k1_rot[0].astype(k_seq.dtype), mode="drop")
      v_seq = v_seq.at[1, write_T].set(v1[0].astype(v_seq.dtype), mode="drop")
      return x, scatter(pool, table, k_seq, v_seq), k1[0], v1[0]

    self._select = jax.jit(select, donate_argnums=(3,))
    self._recompute = jax.jit(run_layers, donate_argnums=(1,))

  def _pad(self, pos: np.ndarray):
    t = _bucket(len(pos))
    pos_T = np.zeros(t, np.int32)
    pos_T[:len(pos)] = pos
    write_T = np.full(t, self.s_max, np.int32)  # past the cache: dropped
    write_T[:len(pos)] = pos
    return pos_T, write_T

  def select(self, tokens, pos: np.ndarray, slot: int):
    """Layer 0 and layer 1's K/V of `tokens` at positions `pos` (ascending). Returns (the
    [1, T', D] layer-1 input, padded; [n, K, H] fresh layer-1 K before RoPE; [n, K, H] V)."""
    r = self.runner
    pos_T, write_T = self._pad(pos)
    tok = np.zeros(len(pos_T), np.int32)
    tok[:len(pos)] = tokens
    x, r.pool, k1, v1 = self._select(self.p0, self.p1, self.embed, r.pool, tok, pos_T,
                                     write_T, np.asarray(_table(r, slot), np.int32))
    return x, np.asarray(k1)[:len(pos)], np.asarray(v1)[:len(pos)]

  def recompute(self, x_1TD, rows: np.ndarray, pos: np.ndarray, slot: int) -> None:
    """Runs `x_1TD[:, rows]` (tokens at positions `pos`, ascending) through layers 1..L-1."""
    if not len(rows):
      return
    r = self.runner
    pos_T, write_T = self._pad(pos)
    idx = np.zeros(len(pos_T), np.int32)
    idx[:len(rows)] = rows
    x = jnp.take(x_1TD, idx, axis=1)
    _, r.pool = self._recompute(self.rest, r.pool, x, pos_T, write_T,
                                np.asarray(_table(r, slot), np.int32), np.int32(1))


def _pick(kind: str, percent: int, dev: np.ndarray, seed: int) -> np.ndarray:
  """Rows (ascending) of the re-rotated tokens to recompute: round(percent% of them), the
  largest deviations first (ties: lower position first), uniformly at random, or the nearest
  the seam."""
  n = len(dev)
  k = int(round(n * percent / 100))
  if kind == "dev":
    order = np.lexsort((np.arange(n), -dev))  # last key is primary: -dev, then position
  elif kind == "random":
    order = np.random.default_rng(seed).permutation(n)
  else:
    order = np.arange(n)
  return np.sort(order[:k])


def _rel_dev(a_LTKH, b_LTKH):
  """Per token, mean over layers of ||a - b|| / ||b|| (over heads and head dim)."""
  num = np.linalg.norm((a_LTKH - b_LTKH).reshape(*a_LTKH.shape[:2], -1), axis=-1)
  den = np.linalg.norm(b_LTKH.reshape(*b_LTKH.shape[:2], -1), axis=-1) + 1e-12
  return num / den  # [L, T]


def _pooled(rows, v, idx=None):
  idx = range(len(rows)) if idx is None else idx
  s = sum(rows[i]["sum_nll"][v] for i in idx)
  n = sum(rows[i]["reply_tokens"] for i in idx)
  return math.exp(s / n)


def _plot(result: dict, path: pathlib.Path):
  """Draws a result (the JSON's dict) into `path`: ppl gap with CIs, gap against cost, KV
  deviation by seam distance. Returns pyplot, or None when matplotlib is missing."""
  plt = pyplot()
  if plt is None:
    return None
  variants = result["variants"]
  pooled, ci = result["pooled_ppl"], result["pooled_ppl_diff_ci95"]
  cost, seam = result["mean_computed_kept_tokens"], result["kv_rel_dev_by_seam_distance"]
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  shown = [v for v in variants if v not in ("full", "naive")]
  d = [pooled[v] - pooled["recompute"] for v in shown]
  err = np.array([[d[i] - ci[v][0], ci[v][1] - d[i]] for i, v in enumerate(shown)]).T
  axes[0].bar(shown, d, yerr=err, capsize=3)
  axes[0].axhline(0.02, color="r", ls=":", lw=1, label="target +-0.02")
  axes[0].axhline(-0.02, color="r", ls=":", lw=1)
  axes[0].set_ylabel("pooled ppl - recompute (95% CI)")
  axes[0].tick_params(axis="x", rotation=60)
  axes[0].legend()
  axes[0].set_title(f"full {pooled['full']:.3f}, recompute {pooled['recompute']:.3f}" +
                    (f", naive {pooled['naive']:.1f}" if "naive" in pooled else ""))
  markers = "osD^vPX*<>"
  for i, v in enumerate(v for v in shown if v not in ("recompute", "self")):
    axes[1].scatter([cost[v]], [pooled[v] - pooled["recompute"]], label=v,
                    color=plt.cm.tab20(i % 20), marker=markers[i % len(markers)])
  axes[1].axhline(0.0, color="k", lw=0.5)
  axes[1].axhline(0.02, color="r", ls=":", lw=1)
  axes[1].set_xlabel("kept tokens computed per conversation (mean)")
  axes[1].set_ylabel("pooled ppl - recompute")
  axes[1].set_title(f"cost (recompute computes {cost['recompute']:.0f})")
  axes[1].legend(fontsize=6, ncol=2)
  for kv_name, mark in (("k", "o-"), ("v", "x-")):
    bs = [b for b in seam[kv_name] if b["mean_rel_dev"] is not None]
    xs = [f"[{b['seam_distance'][0]},{min(b['seam_distance'][1], 9999)})" for b in bs]
    axes[2].plot(xs, [b["mean_rel_dev"] for b in bs], mark, label=kv_name.upper())
  axes[2].set_xlabel("kept-token distance from the cut")
  axes[2].set_ylabel("||re-rotated - recomputed|| / ||recomputed||")
  axes[2].legend()
  axes[2].set_title("KV deviation by distance from the seam")
  fig.suptitle(f"Truncation keeping the cache: {result['conversations_scored']} ShareGPT "
               f"conversations, context {result['settings']['max_context']} (SmolLM2-135M, f32, "
               "2-core CPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)  # drawn after every conversation: pyplot would keep each figure open
  return plt


def main(argv):
  del argv
  global VARIANTS
  if FLAGS.replot:
    out = pathlib.Path(FLAGS.out_dir) / ("bench_truncation"
                                        + (f"_{FLAGS.tag}" if FLAGS.tag else ""))
    _plot(json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".png"))
    return
  if FLAGS.variants:
    unknown = sorted(set(FLAGS.variants) - set(ALL_VARIANTS))
    if unknown:
      raise app.UsageError(f"unknown variants {unknown}; known: {', '.join(ALL_VARIANTS)}")
    VARIANTS = tuple(v for v in ALL_VARIANTS
                     if v in set(FLAGS.variants) | {"full", "recompute"})
  prov = benchlib.provenance()
  path = pathlib.Path(FLAGS.data_dir) / "sharegpt" / "sharegpt_v3_multiturn_1000.json"
  llm = LLM(max_num_seqs=4, max_model_len=FLAGS.max_history + FLAGS.max_reply + PIECE,
            compile_on_init=False)
  tok, runner = llm.get_tokenizer(), llm.engine.runner
  if runner.num_blocks < 4 * runner.max_blocks_per_seq:
    raise SystemExit(f"the pool holds {runner.num_blocks} blocks; 4 sequences of "
                     f"{runner.max_blocks_per_seq} are needed")
  inv_freq = jnp.asarray(layers.rope_inv_freq(llm.model_config))
  blend = _Blend(runner, inv_freq)
  n_layers = llm.model_config.n_layers
  c = FLAGS.chunk
  rows, t0 = [], time.perf_counter()
  timing = {"prefill_tokens": 0, "prefill_s": 0.0, "insert_tokens": 0, "insert_s": 0.0}
  per_pos = {v: [] for v in VARIANTS}  # per-token NLL minus recompute's, by reply position
  seam_dev = {"k": [[] for _ in SEAM_BUCKETS], "v": [[] for _ in SEAM_BUCKETS]}
  layer_dev = {"k": [], "v": []}
  sys_kv_max_abs = 0.0
  def report(final: bool) -> None:
    """Summarizes the rows so far and writes the JSON and plot (after every conversation, so
    an interrupted run leaves its rows; `complete` says whether all were scored); prints the
    tables when `final`."""
    say = print if final else (lambda *a, **k: None)
    elapsed = time.perf_counter() - t0
    n_tok = sum(r["reply_tokens"] for r in rows)
    pooled = {v: _pooled(rows, v) for v in VARIANTS}
    rng = np.random.default_rng(0)
    boots = [rng.integers(0, len(rows), len(rows)) for _ in range(FLAGS.bootstrap)]
    ci = {}
    for v in VARIANTS:
      d = np.array([_pooled(rows, v, b) - _pooled(rows, "recompute", b) for b in boots])
      ci[v] = [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))]
    mean_abs = {v: float(np.mean([abs(r[f"ppl_{v}"] - r["ppl_recompute"]) for r in rows]))
                for v in VARIANTS}
    cost = {v: (None if v == "full" else float(np.mean([r["computed_kept_tokens"][v] for r in rows])))
            for v in VARIANTS}
    # TTFT estimate: the kept tokens a variant computes at this run's prefill rate (the kept
    # prefix prefilled alone), the rest at its insert rate (K re-rotated and written from host
    # arrays; no store read or link), plus the new part (the same in every variant).
    s_per_tok = timing["prefill_s"] / max(timing["prefill_tokens"], 1)
    s_per_ins = timing["insert_s"] / max(timing["insert_tokens"], 1)
    mean_kept = float(np.mean([r["system_tokens"] + r["kept_turn_tokens"] for r in rows]))
    mean_new = float(np.mean([r["new_tokens"] for r in rows]))
    ttft = {v: (None if cost[v] is None else
                cost[v] * s_per_tok + (mean_kept - cost[v]) * s_per_ins + mean_new * s_per_tok)
            for v in VARIANTS}
    by_pos = {}
    for v in VARIANTS:
      by_pos[v] = []
      for lo, hi in POS_BUCKETS:
        d = [x for arr in per_pos[v] for x in arr[lo:hi]]
        by_pos[v].append({"positions": [lo, hi], "tokens": len(d),
                          "mean_dnll": float(np.mean(d)) if d else None})
    blended = [v for v in VARIANTS if v in BLEND]

    def ratio(a, b):
      return float(a / b) if b else None

    selection = {}
    for v in blended:
      n_sel = sum(r["blend"][v]["selected"] for r in rows)
      selection[v] = {
          "mean_selected": float(np.mean([r["blend"][v]["selected"] for r in rows])),
          "mean_seam_distance_selected": ratio(
              sum(r["blend"][v]["sum_seam_distance"] for r in rows), n_sel),
          "mean_v1_dev_selected": ratio(sum(r["blend"][v]["sum_v1_dev"] for r in rows), n_sel)}
    n_rr = sum(r["rerotated_tokens"] for r in rows)
    v1_sum = sum(r["v1_dev"]["sum"] for r in rows if r["v1_dev"] is not None)
    v1_top_share = {p: ratio(sum(r["v1_dev"]["top_sum"][str(p)] for r in rows
                                 if r["v1_dev"] is not None), v1_sum) for p in BLEND_RATIOS}
    # each selective variant against staged_b1 (its base), paired by conversation
    paired = {}
    if "staged_b1" in VARIANTS:
      for v in blended:
        d = np.array([_pooled(rows, v, b) - _pooled(rows, "staged_b1", b) for b in boots])
        paired[v] = {
            "diff": pooled[v] - pooled["staged_b1"],
            "ci95": [float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))],
            "conversations_better": sum(r["sum_nll"][v] < r["sum_nll"]["staged_b1"]
                                        for r in rows),
            "conversations_unchanged": sum(r["sum_nll"][v] == r["sum_nll"]["staged_b1"]
                                           for r in rows)}
    excess = sorted(((r["sum_nll"]["rerotate"] - r["sum_nll"]["recompute"], r["id"])
                     for r in rows), reverse=True) if "rerotate" in VARIANTS else []
    total_excess = sum(e for e, _ in excess)
    seam = {name: [{"seam_distance": [lo, hi], "tokens": len(d),
                    "mean_rel_dev": float(np.mean(d)) if d else None}
                   for (lo, hi), d in zip(SEAM_BUCKETS, seam_dev[name])] for name in seam_dev}
    layers_mean = {name: np.mean(layer_dev[name], 0).tolist() for name in layer_dev}
    say(f"\n{len(rows)} conversations, {n_tok} scored reply tokens, max_context "
          f"{FLAGS.max_context}, chunk {c}, {elapsed:.0f} s")
    say(f"{'variant':10s} {'pooled ppl':>10s} {'- recompute':>12s} {'95% CI':>18s} "
          f"{'mean |dppl|':>11s} {'computed':>9s} {'TTFT est':>9s}")
    for v in VARIANTS:
      cst = "" if cost[v] is None else f"{cost[v]:9.0f}"
      tt = "" if ttft[v] is None else f"{ttft[v] * 1e3:7.0f}ms"
      say(f"{v:10s} {pooled[v]:10.4f} {pooled[v] - pooled['recompute']:+12.4f} "
            f"[{ci[v][0]:+.4f}, {ci[v][1]:+.4f}] {mean_abs[v]:11.4f} {cst:>9s} {tt:>9s}")
    say("\nmean NLL difference vs recompute by reply position (nats/token):")
    say(f"{'variant':10s} " + " ".join(f"{f'[{lo},{hi})':>10s}" for lo, hi in POS_BUCKETS))
    for v in VARIANTS:
      say(f"{v:10s} " + " ".join(f"{b['mean_dnll']:+10.4f}" if b["mean_dnll"] is not None
                                    else f"{'':10s}" for b in by_pos[v]))
    if blended:
      say(f"\nselective recompute: {n_rr / len(rows):.1f} re-rotated tokens per conversation, "
          f"layer-1 V deviation mean {ratio(v1_sum, n_rr) or float('nan'):.3g}; share of its "
          "total in the top " + ", ".join(f"{p}%: {v1_top_share[p] or float('nan'):.3f}"
                                          for p in BLEND_RATIOS))
      say(f"{'variant':10s} {'selected':>9s} {'seam dist':>10s} {'V1 dev':>9s} "
          f"{'- staged_b1':>12s} {'95% CI':>18s} {'better':>7s} {'same':>5s}")
      for v in blended:
        b, q = selection[v], paired.get(v)
        pv = "" if q is None else (f"{q['diff']:+12.4f} [{q['ci95'][0]:+.4f}, "
                                   f"{q['ci95'][1]:+.4f}] {q['conversations_better']:7d} "
                                   f"{q['conversations_unchanged']:5d}")
        say(f"{v:10s} {b['mean_selected']:9.1f} "
            f"{b['mean_seam_distance_selected'] or float('nan'):10.1f} "
            f"{b['mean_v1_dev_selected'] or float('nan'):9.3g} {pv}")
    if excess:
      say(f"\nrerotate's excess NLL over recompute: {total_excess:.1f} nats; largest: " +
          ", ".join(f"{cid} {e:+.1f}" for e, cid in excess[:5]))
    say("relative deviation of the re-rotated KV from the recomputed KV by distance from the "
          "seam (mean over layers):")
    for name in ("k", "v"):
      say(f"  {name}: " + "  ".join(f"[{b['seam_distance'][0]},{b['seam_distance'][1]}) "
                                      f"{b['mean_rel_dev']:.4f}" for b in seam[name]
                                      if b["mean_rel_dev"] is not None))
    say(f"system prompt KV, re-rotated source vs recompute: max |diff| {sys_kv_max_abs:.2e}")
    out = pathlib.Path(FLAGS.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_truncation" + (f"_{FLAGS.tag}" if FLAGS.tag else "")
    result = {
        **prov, "backend": jax.default_backend(),
        "dtype": "float32", "threads": os.cpu_count(), "seed": 0, "elapsed_s": elapsed,
        "complete": final, "conversations_scored": len(rows),
        "settings": {k: FLAGS[k].value for k in ("conversations", "max_context", "max_history",
                                                  "max_reply", "min_reply", "chunk",
                                                  "bootstrap")},
        "data": "sharegpt/sharegpt_v3_multiturn_1000.json (first conversations in file order "
                "that qualify)",
        "variants": list(VARIANTS),
        "pooled_ppl": pooled,
        "pooled_ppl_diff_vs_recompute": {v: pooled[v] - pooled["recompute"] for v in VARIANTS},
        "pooled_ppl_diff_ci95": ci,
        "mean_abs_ppl_diff_vs_recompute": mean_abs,
        "mean_computed_kept_tokens": cost, "mean_kept_tokens": mean_kept,
        "mean_new_tokens": mean_new,
        "ttft_estimate_s": ttft,
        "rates": {"prefill_s_per_token": s_per_tok, "insert_s_per_kept_token": s_per_ins},
        "dnll_by_reply_position": by_pos,
        "rerotate_excess_nll": {"total": total_excess,
                                "by_conversation": [[cid, e] for e, cid in excess]},
        "selective_recompute": {
            "selection": selection,
            "paired_vs_staged_b1": paired,
            "mean_rerotated_tokens": n_rr / len(rows),
            "deviation": "mean over KV heads and head dim of (fresh - re-rotated V)^2 at "
                         "layer 1 (CacheBlend's reference choice); ties by position",
            "mean_v1_dev_rerotated": ratio(v1_sum, n_rr),
            "v1_dev_top_share": {str(p): x for p, x in v1_top_share.items()},
            "random_seed": "1000 + conversation index"},
        "kv_rel_dev_by_seam_distance": seam, "kv_rel_dev_by_layer": layers_mean,
        "system_kv_max_abs_diff": sys_kv_max_abs,
        "scored_tokens": n_tok, "rows": rows}
    benchlib.write_json(out / f"{name}.json", result)
    plt = _plot(result, out / f"{name}.png")
    say(f"wrote {out / name}.json" + (" and .png" if plt is not None else ""))

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
    s_len = sys_span.length
    users = [a for a, _, role in sess.message_segments(tok, tr.token_ids) if role == "user"]
    n_kept = users[-1]  # [0, n_kept): system + kept turns; the new part starts there
    ids = list(tr.token_ids) + list(reply)
    targets = list(reply)
    nll = {}
    # full: the whole history, then the reply; its KV is the "stored" KV of every old token.
    logits, kvs = _prefill(runner, list(hist) + list(reply), 0, 0, all_logits=True)
    nll["full"] = _nll(np.concatenate(logits)[len(hist) - 1:-1], targets)
    k_all = np.concatenate([k for k, _ in kvs], axis=1)
    v_all = np.concatenate([v for _, v in kvs], axis=1)
    # recompute: the truncated prompt from scratch.
    logits, kvs = _prefill(runner, ids, 1, 0, all_logits=True)
    nll["recompute"] = _nll(np.concatenate(logits)[len(tr.token_ids) - 1:-1], targets)
    k_rec = np.concatenate([k for k, _ in kvs], axis=1)[:, :n_kept]
    v_rec = np.concatenate([v for _, v in kvs], axis=1)[:, :n_kept]
    # The kept prefix [0, n_kept) maps to old positions: the system span in place, the kept
    # turns from kept.src_start.
    src = np.concatenate([np.arange(s_len), kept.src_start + np.arange(n_kept - s_len)])
    k_kept, v_kept = k_all[:, src], v_all[:, src]
    sys_kv_max_abs = max(sys_kv_max_abs, float(np.abs(k_kept[:, :s_len] - k_rec[:, :s_len]).max()),
                         float(np.abs(v_kept[:, :s_len] - v_rec[:, :s_len]).max()))
    none = np.zeros(n_kept, bool)
    if "self" in VARIANTS:
      nll["self"] = _score(runner, ids, k_rec, v_rec, none, targets, 2)
    if "rerotate" in VARIANTS:
      nll["rerotate"] = _score(runner, ids, k_kept, v_kept, none, targets, 2)
    if rows:  # rates for the TTFT estimate (the first conversation compiles)
      ta = time.perf_counter()
      _prefill(runner, list(tr.token_ids[:n_kept]), 3, 0)
      runner.block_until_ready()
      tb = time.perf_counter()
      _insert(runner, k_kept, v_kept, 3, 0)
      runner.block_until_ready()
      timing["prefill_s"] += tb - ta
      timing["insert_s"] += time.perf_counter() - tb
      timing["prefill_tokens"] += n_kept
      timing["insert_tokens"] += n_kept
    # naive: K keeps its old rotation: pre-rotate by (old - new) so RoPE(new) gives RoPE(old).
    delta = jnp.asarray(src - np.arange(n_kept), jnp.int32)[None, :]
    k_old = np.asarray(layers.apply_rope(jnp.asarray(k_kept), jnp.broadcast_to(
        delta, k_kept.shape[:2]), inv_freq))
    if "naive" in VARIANTS:
      nll["naive"] = _score(runner, ids, k_old, v_kept, none, targets, 3)
    old_pos = jnp.broadcast_to(jnp.asarray(src, jnp.int32)[None, :], k_kept.shape[:2])
    k_rt = np.asarray(layers.apply_rope(layers.apply_rope(jnp.asarray(k_kept), old_pos, inv_freq),
                                        old_pos, inv_freq, inverse=True))
    if "roundtrip" in VARIANTS:
      nll["roundtrip"] = _score(runner, ids, k_rt, v_kept, none, targets, 3)
    cost = {"full": None, "recompute": n_kept, "self": 0, "rerotate": 0, "naive": 0,
            "roundtrip": 0}
    for n in HEADS:
      m = none.copy()
      m[s_len:s_len + n] = True
      if f"head{n}" in VARIANTS:
        nll[f"head{n}"] = _score(runner, ids, k_kept, v_kept, m, targets, 2)
      cost[f"head{n}"] = int(m.sum())
    # staged, as `Engine.stage_rerotated`: the truncated prompt's chunk j is staged when all
    # its source positions lie in the previous turn's stored full chunks (that turn ends where
    # the new user message starts in the source) and it ends before the last prompt token.
    prev_stored = (len(hist) - (len(tr.token_ids) - n_kept)) // c * c
    n_chunks = (len(tr.token_ids) - 1) // c
    n_src = np.full(len(tr.token_ids), 1 << 40)
    n_src[:n_kept] = src
    n_src[n_kept:] = kept.src_start + np.arange(n_kept - s_len, len(tr.token_ids) - s_len)
    k_staged = 0
    while k_staged < n_chunks and (n_src[k_staged * c:(k_staged + 1) * c] < prev_stored).all():
      k_staged += 1
    for v, first in (("staged_b0", 0), ("staged_b1", 1)):
      m = np.ones(n_kept, bool)
      if k_staged > first:
        m[first * c:k_staged * c] = False
      if v in VARIANTS:
        nll[v] = _score(runner, ids, k_kept, v_kept, m, targets, 2)
      cost[v] = int(m.sum())
    # selective recompute on top of staged_b1: the re-rotated tokens are chunks [1, k_staged)
    rr = np.arange(c, max(k_staged, 1) * c)
    blend_rows, v1_dev = {}, None
    for v, (kind, percent) in BLEND.items():
      if v not in VARIANTS:
        continue
      picked = {}

      def blend_pass(kind=kind, percent=percent, picked=picked):
        if not len(rr):
          picked["rows"], picked["dev"] = np.zeros(0, np.int64), np.zeros(0)
          return
        x1, _, v1 = blend.select(ids[rr[0]:rr[-1] + 1], rr, 2)
        dev = np.mean((v1 - v_kept[1, rr]) ** 2, axis=(1, 2))
        rows_ = _pick(kind, percent, dev, 1000 + len(rows))
        blend.recompute(x1, rows_, rr[rows_], 2)
        picked["rows"], picked["dev"] = rows_, dev

      m = np.ones(n_kept, bool)
      if k_staged > 1:
        m[c:k_staged * c] = False
      nll[v] = _score(runner, ids, k_kept, v_kept, m, targets, 2, before_tail=blend_pass)
      sel, dev = picked["rows"], picked["dev"]
      top = np.sort(dev)[::-1]
      v1_dev = {"sum": float(dev.sum()),  # the same in every pass
                "top_sum": {str(p): float(top[:int(round(len(dev) * p / 100))].sum())
                            for p in BLEND_RATIOS}}
      cost[v] = float(m.sum() + len(sel) * (n_layers - 1) / n_layers + len(rr) / n_layers)
      blend_rows[v] = {"selected": int(len(sel)),
                       "sum_seam_distance": int((rr[sel] - s_len).sum()),
                       "sum_v1_dev": float(dev[sel].sum())}
    # deviation of the re-rotated (source) KV from the recomputed one, by distance from the seam
    for name, a, b in (("k", k_kept, k_rec), ("v", v_kept, v_rec)):
      if n_kept == s_len:  # every older turn dropped: nothing re-rotated
        continue
      dev = _rel_dev(a[:, s_len:], b[:, s_len:])  # [L, kept-turn tokens]
      layer_dev[name].append(dev.mean(1))
      for bi, (lo, hi) in enumerate(SEAM_BUCKETS):
        if dev.shape[1] > lo:
          seam_dev[name][bi].extend(dev[:, lo:hi].mean(0).tolist())
    for v in VARIANTS:
      per_pos[v].append(nll[v] - nll["recompute"])
    row = {"id": cid, "round": j, "history_tokens": len(hist),
           "truncated_tokens": len(tr.token_ids), "dropped_turns": tr.dropped_turns,
           "system_tokens": s_len, "kept_turn_tokens": n_kept - s_len,
           "shift": int(kept.src_start - kept.dst_start),
           "new_tokens": len(tr.token_ids) - n_kept, "reply_tokens": len(targets),
           "staged_chunks": k_staged, "computed_kept_tokens": cost,
           "rerotated_tokens": int(len(rr)), "blend": blend_rows, "v1_dev": v1_dev,
           **{f"ppl_{v}": float(math.exp(nll[v].mean())) for v in VARIANTS},
           "sum_nll": {v: float(nll[v].sum()) for v in VARIANTS}}
    rows.append(row)
    print(f"{len(rows):3d} {cid:>12s} hist {len(hist):5d} -> {len(tr.token_ids):5d} (kept "
          f"{row['kept_turn_tokens']} moved by {row['shift']}, staged {k_staged}) reply "
          f"{len(targets):3d} ppl " + " ".join(f"{v} {row['ppl_' + v]:.3f}" for v in VARIANTS),
          flush=True)
    report(final=False)
  report(final=True)
  llm.close()


if __name__ == "__main__":
  app.run(main)
