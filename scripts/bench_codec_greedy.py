"""Greedy agreement of every KV codec level with raw, through real store loads: bench_codec's
`--phases greedy` (scripts/bench_codec.py).

Perplexity and KL score a codec on teacher-forced text; this scores what a user reads, the
greedy continuation. The prompts are real chats: ShareGPT conversations (../shared/data)
cut at the first user turn whose templated prompt has at least `min_tokens` tokens (earlier
turns, both sides, included), at most `max_tokens`, no two with the same first stored chunk
(so no prompt is served from another's device prefix), `n` of them drawn with a fixed seed.

Per codec level, one `LLM` on a fresh file store that holds that encoding only:

    LLM(kv_store=<fresh dir>, kv_codec=codec, kv_codec_levels=(level,),
        kv_merge_mode="load_only", kv_codec_consistent=False)
    generate(prompts)        cold: computes every prompt exactly, saves each full chunk of
                             prompt[:-1] encoded at `level` (raw: this run, n greedy tokens,
                             is the reference; a codec: 1 token, which must equal the
                             reference's first)
    flush()                  every save written
    reset_prefix_cache()     nothing left on the device
    generate(prompts)        warm: every stored chunk loaded and decoded through the codec
                             (checked per prompt: loaded tokens = stored chunks x C, none
                             from the device prefix cache, every chunk at `level`), the tail
                             computed, n greedy tokens

`kv_codec_consistent=False` makes each stored chunk the codec of exactly computed KV (the
teacher-forced phase's codec path; the consistent mode would instead compute each chunk from
the lossy chunks before it), and "load_only" loads every stored chunk (Cake's meeting point
would otherwise vary with timing). raw's warm run against the reference checks the harness:
a lossless load gives the cold answer.

Per level, against the reference (a sequence that ended before n tokens is padded with an
end marker, so two answers that stop at the same token agree there):
  exact match            all n tokens equal (rate, Wilson 95% interval)
  prefix fraction        tokens equal before the first divergence / n (mean, 95% t interval)
  first divergence       position of the first differing token, over the diverged prompts
  token agreement        positions with equal tokens / n (mean, 95% t interval)
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Callable, Sequence

import numpy as np

from bench_codec_lib import loadavg, mean_ci  # scripts/

#: Padding of a sequence that ended (EOS) before the compared length; no token id.
END = -1


# ---------------------------------------------------------------------------------------------
# Prompts.


def sharegpt_prompts(conversations: Sequence[dict], encode_chat: Callable[[list], list[int]],
                     n: int, *, max_tokens: int, max_tail: int, chunk: int,
                     seed: int) -> list[dict]:
  """`n` chat prompts from ShareGPT conversations, each cut at a user turn.

  A conversation gives the prompt up to (and with the generation prompt after) its first user
  turn whose templated prompt has L tokens with C < L <= `max_tokens` and a tail (the tokens
  after the last full chunk of prompt[:-1], which are computed, not loaded) of at most
  `max_tail` tokens: (L - 1) mod C < `max_tail`; so the stored chunks are nearly the whole
  prompt, as in a chat's next turn. It gives none when no turn does before one passes
  `max_tokens`. A prompt whose first C tokens equal an earlier one's is dropped (the store and
  the device prefix cache would share them). The survivors, in file order, are shuffled with
  `seed` and the first `n` kept.

  Args:
    conversations: ShareGPT records (`{"id", "conversations": [{"from", "value"}, ...]}`).
    encode_chat: the model's `encode_chat(messages)` (templated token ids).
    n: prompts wanted.
    max_tokens: longest prompt, tokens.
    max_tail: tail tokens computed after the stored chunks, at most, in [1, C].
    chunk: stored chunk size C, tokens.
    seed: seed of the draw.

  Returns:
    [{"id": conversation id, "user_turn": index of the user turn (0 = first), "tokens":
    prompt length, "ids": token ids}].

  Raises:
    ValueError: bounds that hold no stored chunk, or fewer than `n` prompts in the data.
  """
  if not (1 <= max_tail <= chunk and max_tokens > chunk):
    raise ValueError(f"need 1 <= max_tail ({max_tail}) <= chunk ({chunk}) < max_tokens "
                     f"({max_tokens}): a prompt needs a full chunk before its last token")
  out, firsts = [], set()
  for conv in conversations:
    messages, user_turn = [], -1
    for turn in conv["conversations"]:
      role = "user" if turn["from"] == "human" else "assistant"
      messages.append({"role": role, "content": turn["value"]})
      if role != "user":
        continue
      user_turn += 1
      ids = list(encode_chat(messages))
      if len(ids) > max_tokens:
        break
      if len(ids) <= chunk or (len(ids) - 1) % chunk >= max_tail:
        continue
      first = tuple(ids[:chunk])
      if first not in firsts:
        firsts.add(first)
        out.append({"id": conv["id"], "user_turn": user_turn, "tokens": len(ids), "ids": ids})
      break
  if len(out) < n:
    raise ValueError(f"only {len(out)} ShareGPT prompts of {chunk + 1}-{max_tokens} tokens "
                     f"with tails of at most {max_tail} and distinct first chunks, {n} wanted")
  random.Random(seed).shuffle(out)
  return out[:n]


# ---------------------------------------------------------------------------------------------
# Agreement of one answer with the reference.


def agreement(ref_ids: Sequence[int], ids: Sequence[int], n: int) -> dict:
  """How far greedy tokens agree with the reference's, over `n` positions.

  Args:
    ref_ids: the reference's generated ids (at most n; fewer when it ended).
    ids: the judged generated ids (at most n).
    n: positions compared; a sequence shorter than n is padded with `END`.

  Returns:
    {"exact": all n equal, "first_divergence": first differing position or None,
    "prefix_fraction": positions before it / n (1.0 when none), "token_agreement": equal
    positions / n}.

  Raises:
    ValueError: a sequence longer than n, or n < 1.
  """
  if n < 1 or len(ref_ids) > n or len(ids) > n:
    raise ValueError(f"need n >= 1 and at most n tokens each: n={n}, {len(ref_ids)} and "
                     f"{len(ids)} tokens")
  a = np.full(n, END, np.int64)
  b = np.full(n, END, np.int64)
  a[:len(ref_ids)] = ref_ids
  b[:len(ids)] = ids
  equal = a == b
  diff = np.nonzero(~equal)[0]
  first = int(diff[0]) if diff.size else None
  return {"exact": first is None, "first_divergence": first,
          "prefix_fraction": (n if first is None else first) / n,
          "token_agreement": float(equal.mean())}


def wilson(k: int, n: int, z: float = 1.959963984540054) -> list[float] | None:
  """95% Wilson score interval of a proportion k/n (None for n = 0)."""
  if n == 0:
    return None
  p = k / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  return [max(0.0, centre - half), min(1.0, centre + half)]


def summarize(rows: Sequence[dict], n: int, seed: int) -> dict:
  """Per-level statistics of `agreement` rows (one per prompt).

  Returns:
    {"prompts", "exact_match": {"count", "rate", "ci95_wilson"}, "prefix_fraction",
    "token_agreement" (`mean_ci`: mean, t and bootstrap 95% intervals), "first_divergence":
    {"diverged", "mean", "ci95_t", "median", "min"} over the diverged prompts (None where none
    diverged)}.
  """
  k = sum(r["exact"] for r in rows)
  firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
  fd: dict[str, Any] = {"diverged": len(firsts), "mean": None, "ci95_t": None, "median": None,
                        "min": None}
  if firsts:
    m = mean_ci(firsts, seed)
    fd.update(mean=m["mean"], ci95_t=m["ci95_t"], median=float(np.median(firsts)),
              min=min(firsts))
  return {"prompts": len(rows), "tokens": n,
          "exact_match": {"count": k, "rate": k / len(rows) if rows else None,
                          "ci95_wilson": wilson(k, len(rows))},
          "prefix_fraction": mean_ci([r["prefix_fraction"] for r in rows], seed),
          "token_agreement": mean_ci([r["token_agreement"] for r in rows], seed),
          "first_divergence": fd}


# ---------------------------------------------------------------------------------------------
# One codec level through a real store.


@dataclasses.dataclass(frozen=True)
class Level:
  """One codec level of the phase: its label ("cachegen-1"), codec and level."""

  label: str
  codec: str
  level: int

  @property
  def encoding(self) -> str:
    """"codec/level", as a merge trace names a loaded chunk's encoding."""
    return f"{self.codec}/{self.level}"


def load_check(out, chunk: int, encoding: str) -> str | None:
  """Why a warm `RequestOutput` did not load its whole stored prefix through `encoding`
  ("codec/level"), or None when it did: every full chunk of prompt[:-1] loaded from the
  store (none from the device prefix cache, none rejected), each at that encoding."""
  m = out.metrics
  want = (len(out.prompt_token_ids) - 1) // chunk * chunk
  if m.num_loaded_tokens != want:
    return f"loaded {m.num_loaded_tokens} of {want} stored tokens"
  if m.num_device_cached_tokens:
    return f"{m.num_device_cached_tokens} tokens from the device prefix cache"
  if m.num_rejected_chunks:
    return f"{m.num_rejected_chunks} stored chunks rejected"
  levels = sorted({str(v) for v in m.merge.levels.values()}) if m.merge is not None else []
  if want and levels != [encoding]:
    return f"loaded encodings {levels}, not {encoding}"
  return None


def transcode_store(raw_url: str, url: str, llm, lv: Level) -> dict:
  """Writes `lv`'s store at `url` from the raw chunks at `raw_url`: each chunk encoded by
  `llm`'s own runner (`encode_levels`, what its saver calls before a put) and put with the
  raw record's keys, token ids and namespace (`ChunkStore.put`, as the saver does).

  Returns:
    {"chunks": raw records read, "published": chunks written, "stored_bytes": bytes of the
    written objects (the records' `Encoding.nbytes`)}.

  Raises:
    RuntimeError: a raw chunk that does not read back, or an encoding with NaN/inf.
  """
  import jax  # noqa: PLC0415
  from kvjax.storage.backends.chunk_store import ChunkStore, choose_codec  # noqa: PLC0415
  from kvjax.storage.format.types import ChunkMiss, EncodedPayload  # noqa: PLC0415
  layout, chunk = llm.kv_store.layout, llm.kv_store.chunk_size
  runner = llm.engine.runner
  src, dst = ChunkStore(raw_url, name="greedy-raw"), ChunkStore(url, name=f"greedy-{lv.label}")
  try:
    records = src.records_sync()
    by_hash = {r.chunk_hash: r for r in records}

    def index(r) -> int:  # a chunk's place in its prompt: its parent chain's length
      i = 0
      while r.parent_hash != r.namespace:
        r, i = by_hash[r.parent_hash], i + 1
      return i

    published = 0
    for r in records:
      hit = src.get_sync(r.chunk_hash, r.token_ids, r.namespace, layout,
                         choose=choose_codec("raw", 0))
      if isinstance(hit, ChunkMiss):
        raise RuntimeError(f"raw chunk {r.chunk_hash} did not read back: {hit.reason}")
      [(codec, level, arrays, finite)] = runner.encode_levels(hit.kv, lv.codec, (lv.level,),
                                                              index(r) * chunk)
      arrays, finite = jax.device_get((arrays, finite))
      if not bool(finite):
        raise RuntimeError(f"{lv.label}: chunk {r.chunk_hash} encodes to NaN/inf")
      published += dst.put_sync(r.chunk_hash, r.parent_hash, r.token_ids, r.namespace,
                                layout=layout, payloads=[EncodedPayload(codec, level, {
                                    k: np.asarray(v) for k, v in arrays.items()})])
    stored = sum(e.nbytes for r in dst.records_sync() for e in r.encodings)
  finally:
    src.close()
    dst.close()
  return {"chunks": len(records), "published": published, "stored_bytes": stored}


def run_level(make_llm: Callable[[str, int, str], Any], lv: Level, prompts: Sequence[dict],
              n: int, raw_url: str, url: str | None,
              reference: Sequence[Sequence[int]] | None) -> tuple[dict, list]:
  """One codec level (module doc).

  Raw (`reference` None): cold run of n greedy tokens on the store at `raw_url` (its ids are
  the reference), flush, drop the device prefix cache, warm run. A codec level: the store at
  `url` written from the raw chunks (`transcode_store`), then a warm run on a new `LLM`.

  Args:
    make_llm: `(codec, level, store url) -> LLM` storing that encoding only, in "load_only"
      merge mode, without the consistent mode.
    lv: the level.
    prompts: `sharegpt_prompts` records.
    n: greedy tokens per answer.
    raw_url: the raw store (written by raw's cold run).
    url: this level's fresh store (None for raw).
    reference: the raw cold run's generated ids per prompt; None for raw itself.

  Returns:
    (record, reference ids). The record has per-prompt agreement rows, the load failures,
    the store's accounting and wall seconds.
  """
  from kvjax import SamplingParams  # noqa: PLC0415
  greedy = SamplingParams(max_tokens=n, temperature=0.0)
  batch = [{"prompt_token_ids": list(p["ids"])} for p in prompts]
  t0, load0 = time.perf_counter(), loadavg()
  llm = make_llm(lv.codec, lv.level, raw_url if reference is None else url)
  chunk = llm.kv_store.chunk_size
  store: dict[str, Any] = {}
  try:
    t1 = time.perf_counter()
    if reference is None:
      reference = [list(o.token_ids) for o in llm.generate(batch, greedy)]
      llm.flush()
      store["saver"] = dataclasses.asdict(llm.engine.stats().saver)
      llm.reset_prefix_cache()
    else:
      store.update(transcode_store(raw_url, url, llm, lv))
    t2 = time.perf_counter()
    warm = llm.generate(batch, greedy)
    t3 = time.perf_counter()
  finally:
    llm.close()
  failures = []
  for p, o in zip(prompts, warm):
    why = load_check(o, chunk, lv.encoding)
    if why is not None:
      failures.append({"id": p["id"], "why": why})
  warm_ids = [list(o.token_ids) for o in warm]
  rows = [agreement(r, w, n) for r, w in zip(reference, warm_ids)]
  record = {
      "label": lv.label, "codec": lv.codec, "level": lv.level,
      "stored_chunks": sum((len(p["ids"]) - 1) // chunk for p in prompts),
      "loaded_tokens": sum(o.metrics.num_loaded_tokens for o in warm),
      "computed_tokens": sum(o.metrics.num_computed_tokens for o in warm),
      "load_failures": failures, "store": store,
      "per_prompt": {"first_divergence": [r["first_divergence"] for r in rows],
                     "token_agreement": [r["token_agreement"] for r in rows],
                     "answer_tokens": [len(w) for w in warm_ids]},
      "rows": rows,
      "seconds": {"build": t1 - t0, "write": t2 - t1, "warm": t3 - t2},
      "loadavg_1min_before": load0, "loadavg_1min_after": loadavg()}
  return record, reference


def run_phase(make_llm: Callable[[str, int, str], Any], levels: Sequence[Level],
              prompts: Sequence[dict], n: int, work_dir: str, seed: int,
              on_level: Callable[[dict], None] = lambda _: None) -> dict:
  """Every level, raw first (the reference), each codec level's store under `work_dir`
  (deleted once it is measured; the raw store at the end).

  Args:
    on_level: called with the result so far after each level (the script writes its JSON).

  Returns:
    {"reference": raw cold ids per prompt, "levels": {label: run_level's record, with
    "summary" (`summarize`) in place of its rows}, "failed": labels with load failures,
    "complete": True}.

  Raises:
    ValueError: `levels` does not start with raw.
  """
  import os  # noqa: PLC0415
  import shutil  # noqa: PLC0415
  if not levels or levels[0].codec != "raw":
    raise ValueError(f"the greedy phase needs raw first (the reference), got "
                     f"{[lv.label for lv in levels]}")
  raw_dir = os.path.join(work_dir, "raw")
  raw_url = "file://" + raw_dir
  reference = None
  out: dict[str, Any] = {"levels": {}, "failed": [], "complete": False, "reference": None}
  try:
    for lv in levels:
      level_dir = os.path.join(work_dir, lv.label)
      record, reference = run_level(make_llm, lv, prompts, n, raw_url,
                                    None if lv.codec == "raw" else "file://" + level_dir,
                                    reference)
      if lv.codec != "raw":
        shutil.rmtree(level_dir, ignore_errors=True)
      record["summary"] = summarize(record.pop("rows"), n, seed)
      if record["load_failures"]:
        out["failed"].append(lv.label)
      out["levels"][lv.label] = record
      out["reference"] = reference
      on_level(out)
  finally:
    shutil.rmtree(raw_dir, ignore_errors=True)
  out["complete"] = True
  return out


#: How the phase measures, as the results JSON states it.
METHOD = (
    "Per codec level, a fresh file store holding that encoding only; LLM(kv_codec=codec, "
    "kv_codec_levels=(level,), kv_merge_mode='load_only', kv_codec_consistent=False). raw: "
    "cold generate (computes, saves every full chunk of prompt[:-1]; its tokens are the "
    "reference), flush, reset_prefix_cache, warm generate (loads). A codec level: its store "
    "written from the raw store's chunks, each encoded by that level's LLM runner "
    "(encode_levels, as its saver does) and put under the raw record's keys, then a warm "
    "generate on that LLM (every stored chunk loaded and decoded through the codec, checked "
    "per prompt; the tail computed). Greedy decoding, stopping at EOS; a sequence that ended "
    "is padded with an end marker for the comparison. exact_match: all tokens equal (Wilson "
    "95% interval); prefix_fraction: tokens before the first divergence / tokens; "
    "first_divergence: over the diverged prompts; token_agreement: equal positions / tokens "
    "(95% t intervals).")


def _pct(d: dict) -> str:
  if d["ci95_t"] is None:
    return f"{100 * d['mean']:.1f}"
  return f"{100 * d['mean']:.1f} [{100 * d['ci95_t'][0]:.1f},{100 * d['ci95_t'][1]:.1f}]"


def table(result: dict, order: Sequence[str], n: int) -> str:
  """The per-level table (percentages with 95% intervals)."""
  levels = result["levels"]
  p = next(iter(levels.values()))["summary"]["prompts"] if levels else 0
  lines = [f"\nGreedy agreement with raw's cold output: {p} ShareGPT prompts, {n} greedy "
           "tokens, every stored chunk loaded through the codec",
           f"{'codec':11s}{'exact match % [95%]':>22s}{'prefix % [95%]':>22s}"
           f"{'1st div (n)':>14s}{'tokens equal % [95%]':>24s}{'loads':>9s}"]
  for label in order:
    if label not in levels:
      lines.append(f"{label:11s}  not measured")
      continue
    r = levels[label]
    sm = r["summary"]
    em = sm["exact_match"]
    ci = em["ci95_wilson"]
    exact = f"{100 * em['rate']:.1f} [{100 * ci[0]:.1f},{100 * ci[1]:.1f}]"
    fd = sm["first_divergence"]
    first = f"{fd['mean']:.1f} ({fd['diverged']})" if fd["diverged"] else "- (0)"
    ok = sm["prompts"] - len(r["load_failures"])
    lines.append(f"{label:11s}{exact:>22s}{_pct(sm['prefix_fraction']):>22s}{first:>14s}"
                 f"{_pct(sm['token_agreement']):>24s}{ok:>5d}/{sm['prompts']:<3d}")
  lines.append(f"exact match: all {n} tokens equal (Wilson interval); prefix: tokens equal before "
               "the first divergence; 1st div: mean position of the first differing token over "
               f"the prompts that diverged (their count); tokens equal: positions equal of {n}; "
               "loads: prompts whose every stored chunk was loaded through the codec.")
  return "\n".join(lines)


def plot(path, result: dict, order: Sequence[str], n: int) -> bool:
  """Exact-match rate and prefix fraction per level with 95% intervals; False without
  matplotlib."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
    return False
  labels = [label for label in order if label in result["levels"]]
  sums = [result["levels"][label]["summary"] for label in labels]
  x = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(10, 4.2))
  for off, key, name in ((-0.2, "exact_match", f"all {n} tokens equal"),
                         (0.2, "prefix_fraction", "tokens before the first divergence")):
    if key == "exact_match":
      mean = [s[key]["rate"] for s in sums]
      lo = [s[key]["ci95_wilson"][0] for s in sums]
      hi = [s[key]["ci95_wilson"][1] for s in sums]
    else:
      mean = [s[key]["mean"] for s in sums]
      lo = [(s[key]["ci95_t"] or [s[key]["mean"]] * 2)[0] for s in sums]
      hi = [(s[key]["ci95_t"] or [s[key]["mean"]] * 2)[1] for s in sums]
    err = [[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]]
    ax.bar(x + off, mean, 0.4, yerr=err, capsize=3, label=name)
  ax.set_xticks(x)
  ax.set_xticklabels(labels, rotation=30)
  ax.set_ylim(0, 1.05)
  ax.set_ylabel("fraction of prompts / of tokens (95% CI)")
  p = sums[0]["prompts"] if sums else 0
  ax.set_title(f"Greedy agreement with raw, SmolLM2-135M-Instruct f32: {p} ShareGPT prompts, "
               f"{n} tokens, stored chunks loaded through the codec", fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True
