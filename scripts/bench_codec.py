"""Size, speed and quality of every KV codec and level on real SmolLM2-135M-Instruct KV.

For raw, int8, int4 and CacheGen levels 0-3 (arXiv 2310.07240, section 5), on f32 KV that the
real model computes from real text (../shared/data), this measures:

  size        stored bytes per token: the whole object `storage.format.codecs.encode_payload` writes
              (values, scales, anchors, header) plus the JSON of a real index record
              (`ChunkRecord` with the chunk's key, token ids and its `Encoding`), averaged over
              every prefix chunk of the quality passages; ratios vs raw stored the same way (f32,
              and with bf16 values: half the values' bytes) and vs int8. One chunk is also put
              into a `memory://` ChunkStore with all encodings side by side and read back per
              codec, as a check of the accounting.
  speed       on ONE pinned thread, in compressed (stored) bytes per second:
                encode = `kv_encode_host` (jnp path, device -> host) + `encode_payload`
                decode = `decode_payload` (entropy decode, CRCs) + `kv_decode` into a cache slot
                         (kvtc: its rANS-coded `q` is only parsed on the host and decoded on
                         the device, `kvtc_rans.decode_codes`, as a load does)
              measured in a child process pinned to one core (XLA single-thread flags, BLAS/OMP
              threads 1) while this process runs a prefill loop on the other core (its threads
              pinned there); per wall second, and per CPU second of the worker (what one
              unshared thread sustains; the wall rate drops when other jobs share the core). The
              prefill's own per-chunk time (2 threads, nothing else of ours running) is measured
              over positions 0..N, so each codec's *balance bandwidth* (chunk bytes / chunk
              compute time: the link speed at which loading a chunk takes as long as computing
              it, Cake arXiv 2410.03065 section 4) is known and decode speed is reported as a
              multiple of it; also against the per-chunk times of an earlier, quieter
              bench_prefill.json run (`--reference_prefill`).
  quality     teacher-forced on book passages: a prefix of P tokens is prefilled, its KV chunks
              (K before RoPE, and V) are encoded, turned into stored bytes, decoded from those
              bytes and written with `kv_decode` (dequantize, RoPE at the positions, cache write)
              into a fresh slot; then the next H held tokens are prefilled after it with all
              logits. Per codec: perplexity ratio vs the raw codec path, mean KL(raw || codec)
              per token, top-1 agreement and the first teacher-forced position where the argmax
              differs from raw; 95% t intervals (and bootstrap) over passages.
  LongChat    topics_10 (the CacheGen/Cake evaluation prompts) in the Vicuna wrapper: the
              prompt's full chunks (of prompt[:-1]) are computed once, raw, then per codec
              decoded into a fresh slot; the tail is prefilled, then greedy decoding; correct if
              `topics[0]` appears in the output (case-insensitive).
  greedy      (`--phases greedy`, scripts/bench_codec_greedy.py) greedy agreement with raw over
              `--greedy_tokens` (64) tokens on `--greedy_prompts` (200) ShareGPT chats per
              codec level, through real store loads: raw's cold answer is the reference, each
              level's answer is generated after every stored chunk of the prompt was loaded
              from a store of that encoding (checked per prompt); exact-match rate, tokens
              before the first divergence, its position, token agreement, 95% intervals.

    .venv/bin/python scripts/bench_codec.py --quick      # a few minutes
    .venv/bin/python scripts/bench_codec.py --phases main  # 20-40 minutes on 2 cores
    .venv/bin/python scripts/bench_codec.py --phases greedy  # about an hour on 2 busy cores

Writes <out>/bench_codec.json (benchlib.provenance(), threads, seeds, settings, results),
<out>/bench_codec.png (bytes per token vs perplexity ratio and vs KL) and prints two tables;
the greedy phase writes <out>/bench_codec_greedy.json (after every level, "complete" once all
are done) and .png and prints its table, and exits non-zero when a level's stored chunks were
not all loaded. The CPU is shared with other jobs: the load average is recorded per phase and
throughput can be affected by it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags, logging

from bench_codec_lib import (MODEL, Bench, loadavg, mean_ci, passage_windows,  # scripts/
                             pin_all_threads, time_codec, token_metrics)
import benchlib  # scripts/benchlib.py
from benchlib import machine

REPO = pathlib.Path(__file__).resolve().parent.parent
BOOKS = ("pg1952_the_yellow_wallpaper_gilman.txt", "pg41_legend_of_sleepy_hollow_irving.txt",
         "pg43_jekyll_and_hyde_stevenson.txt", "pg11_alice_in_wonderland_carroll.txt",
         "pg46_a_christmas_carol_dickens.txt")
SWEEP_BOOK = "pg46_a_christmas_carol_dickens.txt"
VICUNA = ("A chat between a curious user and an artificial intelligence assistant. The assistant "
          "gives helpful, detailed, and polite answers to the user's questions. USER: {} "
          "ASSISTANT:")
#: (label, codec, level) of every codec level measured.
ALL_CODECS = (("raw", "raw", 0), ("int8", "int8", 0), ("int4", "int4", 0),
              ("cachegen-0", "cachegen", 0), ("cachegen-1", "cachegen", 1),
              ("cachegen-2", "cachegen", 2), ("cachegen-3", "cachegen", 3),
              ("kvtc-0", "kvtc", 0), ("kvtc-1", "kvtc", 1), ("kvtc-2", "kvtc", 2),
              ("kvtc-3", "kvtc", 3), ("kvtc-4", "kvtc", 4))
#: Environment of the one-thread throughput worker (set before it imports JAX).
ONE_THREAD_ENV = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
                  "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "JAX_PLATFORMS": "cpu"}

_QUICK = flags.DEFINE_bool("quick", False, "A run of a few minutes: 3 passages of 1K + 64 "
                           "tokens, a 2K compute sweep, 2 throughput chunks, no LongChat.")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results"), "Output folder.")
_DATA = flags.DEFINE_string("data_dir", None, "The shared data folder (default: ../shared/data "
                            "of the checkout, or of its parent).")
_CODECS = flags.DEFINE_list("codecs", [c[0] for c in ALL_CODECS], "Codec levels to measure.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Stored chunk size C, tokens.")
_PASSAGES = flags.DEFINE_integer("passages", None, "Quality passages (default 20; quick 3).")
_PREFIX = flags.DEFINE_integer("prefix_tokens", None, "Codec prefix P per passage, a multiple "
                               "of --chunk (default 4096; quick 1024).")
_HELD = flags.DEFINE_integer("held_tokens", None, "Held tokens H scored after the prefix "
                             "(default 256; quick 64).")
_SWEEP = flags.DEFINE_integer("sweep_tokens", None, "Compute-rate sweep length, a multiple of "
                              "--chunk (default 8192; quick 2048).")
_TP_CHUNKS = flags.DEFINE_integer("tp_chunks", None, "Chunks timed for throughput (default 4; "
                                  "quick 2), spread over the sweep.")
_TP_REPS = flags.DEFINE_integer("tp_reps", None, "Timed repetitions per chunk (median; default "
                                "5; quick 2).")
_LONGCHAT = flags.DEFINE_integer("longchat_samples", None, "topics_10 samples (default 5; quick "
                                 "0).")
_MAX_NEW = flags.DEFINE_integer("longchat_max_new_tokens", 32, "Greedy tokens per LongChat "
                                "answer.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the bootstrap intervals (nothing else is "
                             "random: passages are at fixed offsets, decoding is greedy).")
_WORKER = flags.DEFINE_enum("worker", "", ["", "throughput"], "Internal: run the one-thread "
                            "throughput worker.")
_WORKER_IN = flags.DEFINE_string("worker_in", None, "Internal: worker input (.npz).")
_WORKER_KVTC = flags.DEFINE_string("worker_kvtc", None, "Internal: the kvtc transform (.npz).")
_WORKER_OUT = flags.DEFINE_string("worker_out", None, "Internal: worker output (.json).")
_WORKER_CPU = flags.DEFINE_integer("worker_cpu", None, "Internal: the core the worker pins "
                                   "itself to.")
_REFERENCE = flags.DEFINE_string(
    "reference_prefill", None,
    "bench_prefill.json whose per-chunk kvjax times (chunk 256) give a second, reference balance "
    "bandwidth ('' for none). Default: benchmarks/results/bench_prefill.json, else the archived "
    "one (benchmarks/results/archive/); the file used is named in the results.")

_PHASES = flags.DEFINE_list(
    "phases", ["main", "greedy"],
    "Phases to run: main (compute sweep, throughput, sizes and teacher-forced quality, LongChat; "
    "writes bench_codec.json) and greedy (greedy agreement with raw through real store loads, "
    "scripts/bench_codec_greedy.py; writes bench_codec_greedy.json).")
_G_PROMPTS = flags.DEFINE_integer("greedy_prompts", None, "Greedy phase: ShareGPT prompts per "
                                  "codec level (default 200; quick 8).")
_G_TOKENS = flags.DEFINE_integer("greedy_tokens", None, "Greedy phase: greedy tokens per answer "
                                 "(default 64; quick 16).")
_G_MAX_PROMPT = flags.DEFINE_integer("greedy_max_prompt_tokens", 544, "Greedy phase: longest "
                                     "prompt, tokens.")
_G_MAX_TAIL = flags.DEFINE_integer("greedy_max_tail", 64, "Greedy phase: a prompt's tokens after "
                                   "its stored chunks (computed, not loaded), at most.")
_G_SEQS = flags.DEFINE_integer("greedy_max_num_seqs", 32, "Greedy phase: sequences at once (the "
                               "KV pool holds this many prompts plus answers: 0.9 GB at 32).")
_G_WORK = flags.DEFINE_string("greedy_work_dir", None, "Greedy phase: folder of its temporary "
                              "stores (default: a new temporary folder; deleted after).")

#: Where --reference_prefill looks by default, newest first.
_REFERENCE_DEFAULTS = (REPO / "benchmarks" / "results" / "bench_prefill.json",
                       REPO / "benchmarks" / "results" / "archive" / "bench_prefill.json")


def _setting(flag, full, quick):
  return flag.value if flag.value is not None else (quick if _QUICK.value else full)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sizes of one run (tokens, counts)."""

  codecs: tuple[tuple[str, str, int], ...]
  chunk: int
  passages: int
  prefix_tokens: int
  held_tokens: int
  sweep_tokens: int
  tp_chunks: int
  tp_reps: int
  longchat_samples: int
  longchat_max_new_tokens: int
  seed: int

  @classmethod
  def from_flags(cls) -> "Settings":
    by_label = {c[0]: c for c in ALL_CODECS}
    unknown = [c for c in _CODECS.value if c not in by_label]
    if unknown:
      raise app.UsageError(f"unknown --codecs {unknown}; known: {list(by_label)}")
    s = cls(codecs=tuple(by_label[c] for c in _CODECS.value), chunk=_CHUNK.value,
            passages=_setting(_PASSAGES, 20, 3), prefix_tokens=_setting(_PREFIX, 4096, 1024),
            held_tokens=_setting(_HELD, 256, 64), sweep_tokens=_setting(_SWEEP, 8192, 2048),
            tp_chunks=_setting(_TP_CHUNKS, 4, 2), tp_reps=_setting(_TP_REPS, 5, 2),
            longchat_samples=_setting(_LONGCHAT, 5, 0),
            longchat_max_new_tokens=_MAX_NEW.value, seed=_SEED.value)
    c = s.chunk
    if c < 1 or s.prefix_tokens < c or s.prefix_tokens % c or s.sweep_tokens < c or (
        s.sweep_tokens % c):
      raise app.UsageError(f"--prefix_tokens and --sweep_tokens must be positive multiples of "
                           f"--chunk={c}")
    if not 1 <= s.held_tokens <= 512 or s.passages < 1 or s.tp_chunks < 1 or s.tp_reps < 1:
      raise app.UsageError("need 1 <= held_tokens <= 512, passages, tp_chunks, tp_reps >= 1")
    if s.prefix_tokens + s.held_tokens + 1 > 8192:
      raise app.UsageError("prefix + held tokens must fit SmolLM2's 8192-token context")
    if "raw" not in _CODECS.value:
      raise app.UsageError("--codecs must include raw (the quality baseline)")
    return s


# ---------------------------------------------------------------------------------------------
# Provenance.


#: Libraries whose versions the results record (`benchlib.provenance`).
VERSION_PACKAGES = ("kvjax", "jax", "jaxlib", "flax", "numpy", "pcodec", "zstandard",
                    "tensorstore", "scipy")


def data_dir() -> pathlib.Path:
  if _DATA.value:
    return pathlib.Path(_DATA.value)
  for root in (REPO.parent, REPO.parent.parent):  # main checkout, or a worktree under wt/
    if (root / "shared" / "data" / "books").is_dir():
      return root / "shared" / "data"
  raise SystemExit("../shared/data not found; pass --data_dir")


# ---------------------------------------------------------------------------------------------
# Phase 1: compute rate per chunk position.


def compute_sweep(bench: Bench, ids, s: Settings, progress):
  """Per-chunk prefill seconds over positions 0..sweep_tokens - C (2 threads), and sample chunks
  (host f32) spread over the sweep for the throughput worker."""
  bench.runner.reset()
  load0 = loadavg()
  chunks, times, cpu = bench.prefill_kv(ids[:s.sweep_tokens], 0, progress)
  picks = sorted(set(np.linspace(0, len(chunks) - 1, s.tp_chunks).round().astype(int).tolist()))
  samples = {int(i): np.asarray(chunks[i]) for i in picks}
  return {"book": SWEEP_BOOK, "tokens": s.sweep_tokens, "chunk": s.chunk,
          "starts": [i * s.chunk for i in range(len(times))], "seconds": times,
          "cpu_seconds": cpu,
          "loadavg_1min_before": load0, "loadavg_1min_after": loadavg()}, samples


# ---------------------------------------------------------------------------------------------
# Phase 2: one-thread throughput (child process) while the model computes on the other core.


def throughput(bench: Bench, samples: dict, sweep_ids, s: Settings, progress) -> dict:
  """Runs the worker on core A while a prefill loop runs here on core B; returns both reports."""
  import jax  # noqa: PLC0415
  cpus = sorted(os.sched_getaffinity(0))
  pinned = len(cpus) >= 2
  worker_cpu, model_cpu = (cpus[0], cpus[1]) if pinned else (None, None)
  tmp = tempfile.mkdtemp(prefix="bench_codec_")
  npz, out_json = os.path.join(tmp, "chunks.npz"), os.path.join(tmp, "out.json")
  np.savez(npz, **{f"chunk_{start}": kv for start, kv in samples.items()})
  env = {**os.environ, **ONE_THREAD_ENV}
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker=throughput",
         f"--worker_in={npz}", f"--worker_out={out_json}", f"--chunk={s.chunk}",
         f"--worker_kvtc={bench.kvtc_cache_file}",
         f"--tp_reps={s.tp_reps}", f"--codecs={','.join(c[0] for c in s.codecs)}"]
  if pinned:
    cmd.append(f"--worker_cpu={worker_cpu}")

  stop = threading.Event()
  first_done = threading.Event()
  loop = {"chunks": 0, "seconds": [], "t_start": None, "t_end": None, "error": None}

  def prefill_loop():
    c = s.chunk
    n = min(len(sweep_ids), 8 * c) // c  # positions 0..7C: the loop's chunks cost ~0.7-1.5 s
    i = 0
    try:
      loop["t_start"] = time.perf_counter()
      while not stop.is_set():
        t0 = time.perf_counter()
        out = bench.prefill_chunk(sweep_ids[i * c:(i + 1) * c], 1, i * c)
        jax.block_until_ready(out.logits)
        loop["seconds"].append(time.perf_counter() - t0)
        loop["chunks"] += 1
        first_done.set()
        i = (i + 1) % n
    except Exception as e:  # noqa: BLE001
      loop["error"] = repr(e)
      first_done.set()
    loop["t_end"] = time.perf_counter()

  original = os.sched_getaffinity(0)
  if pinned:
    pin_all_threads({model_cpu})
  thread = threading.Thread(target=prefill_loop, name="bench-prefill-loop", daemon=True)
  thread.start()
  first_done.wait()
  load0 = loadavg()
  t_worker0 = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  t_worker1 = time.perf_counter()
  stop.set()
  thread.join()
  if pinned:
    pin_all_threads(original)
  progress.update(1)
  if proc.returncode != 0:
    raise RuntimeError(f"throughput worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
  with open(out_json, encoding="utf-8") as f:
    report = json.load(f)
  shutil.rmtree(tmp, ignore_errors=True)
  during = loop["seconds"]
  return {
      "worker": report,
      "pinning": {"worker_cpu": worker_cpu, "model_cpu": model_cpu, "pinned": pinned,
                  "available_cpus": cpus, "worker_env": ONE_THREAD_ENV,
                  "how": "worker: XLA/BLAS one-thread env, and sched_setaffinity of all its threads "
                         "to one core before it imports JAX; this process: sched_setaffinity of "
                         "every thread to the other core while the worker runs"},
      "background_prefill": {
          "ran_during_timing": bool(loop["error"] is None and loop["t_start"] is not None
                                    and loop["t_start"] <= t_worker0 and loop["t_end"] >= t_worker1),
          "chunks_completed": loop["chunks"], "error": loop["error"],
          "mean_chunk_s": float(np.mean(during)) if during else None,
          "worker_wall_s": t_worker1 - t_worker0, "chunk_tokens": s.chunk,
          "positions": f"0..{7 * s.chunk} cycling, slot 1, one core"},
      "loadavg_1min_before": load0, "loadavg_1min_after": loadavg()}


def worker_main() -> None:
  """The one-thread worker process: pins itself, times every codec level, writes JSON."""
  if _WORKER_CPU.value is not None:
    pin_all_threads({_WORKER_CPU.value})
  import jax  # noqa: PLC0415
  from kvjax.models.nn.config import smollm2_135m  # noqa: PLC0415
  from kvjax.models.nn.layers import rope_inv_freq  # noqa: PLC0415
  from kvjax.models.runner.compilation_cache import enable_persistent_compilation_cache  # noqa: PLC0415
  from kvjax.storage.format.types import KVLayout  # noqa: PLC0415

  enable_persistent_compilation_cache()
  by_label = {c[0]: c for c in ALL_CODECS}
  data = np.load(_WORKER_IN.value)
  samples = {int(k.split("_")[1]): data[k] for k in data.files}
  n_layers, _, c, n_kv, hd = next(iter(samples.values())).shape
  layout = KVLayout(n_layers, c, n_kv, hd, "float32")
  cfg = smollm2_135m()
  inv_freq = rope_inv_freq(cfg)
  from bench_codec_lib import set_kvtc_transform  # noqa: PLC0415
  from kvjax.models.loading.kv_calibration import load_transform  # noqa: PLC0415
  set_kvtc_transform(load_transform(_WORKER_KVTC.value, cfg.n_kv_heads, cfg.head_dim))
  results = {label: time_codec(samples, by_label[label][1], by_label[label][2], _TP_REPS.value,
                               layout, inv_freq) for label in _CODECS.value}
  report = {"results": results, "reps": _TP_REPS.value,
            "affinity": sorted(os.sched_getaffinity(0)),
            "env": {k: os.environ.get(k) for k in ONE_THREAD_ENV},
            "threads_in_process": len(os.listdir("/proc/self/task")),
            "jax_devices": [str(d) for d in jax.devices()]}
  with open(_WORKER_OUT.value, "w", encoding="utf-8") as f:
    json.dump(report, f)


# ---------------------------------------------------------------------------------------------
# Phase 3: sizes and teacher-forced quality on book passages.


def quality(bench: Bench, books: dict, s: Settings, progress) -> tuple[dict, dict, dict]:
  """Sizes and teacher-forced quality per codec level; returns (sizes, quality, passages)."""
  from kvjax.storage.format import codecs, keys  # noqa: PLC0415
  c, p, h = s.chunk, s.prefix_tokens, s.held_tokens
  windows = passage_windows({b: len(ids) for b, ids in books.items()}, s.passages, p + h + 1)
  sizes = {label: {"chunks": 0, "tokens": 0, "object_bytes": 0, "record_bytes": 0,
                   "header_bytes": 0, "array_bytes": {}, "chunk_bytes_per_token": []}
           for label, _, _ in s.codecs}
  all_record_bytes = []
  per = {label: [] for label, _, _ in s.codecs}
  passages, check = [], None
  load0 = loadavg()
  for book, offset in windows:
    window = books[book][offset:offset + p + h + 1]
    prefix, held = window[:p], window[p:p + h]
    targets = np.asarray(window[p + 1:p + h + 1])
    bench.runner.reset()
    chunks, prefill_s, _ = bench.prefill_kv(prefix, 0)
    ref = np.asarray(bench.prefill_chunk(held, 0, p, all_logits=True).logits)
    hashes = keys.chunk_hashes(bench.namespace, prefix)
    parents = [bench.namespace.root_hash()] + hashes[:-1]
    encodings = [[] for _ in chunks]
    raw_logits = None
    first_blobs = {}
    row = {"book": book, "offset_tokens": offset, "prefix_prefill_s": prefill_s, "codecs": {}}
    for label, codec, level in s.codecs:
      blobs = [bench.encode(kv, codec, level, i * c) for i, kv in enumerate(chunks)]
      st = sizes[label]
      for i, blob in enumerate(blobs):
        enc = bench.encoding(hashes[i], codec, level, blob, chunks[i] if codec == "raw" else None)
        encodings[i].append(enc)
        rec = bench.record_json_bytes(hashes[i], parents[i], prefix[i * c:(i + 1) * c], [enc])
        header = codecs.read_header(blob)
        st["chunks"] += 1
        st["tokens"] += c
        st["object_bytes"] += len(blob)
        st["record_bytes"] += rec
        st["header_bytes"] += header.data_offset
        for e in header.arrays:
          st["array_bytes"][e.name] = st["array_bytes"].get(e.name, 0) + e.nbytes
        st["chunk_bytes_per_token"].append((len(blob) + rec) / c)
      first_blobs[(label, codec, level)] = blobs[0]
      bench.decode_into(blobs, codec, level, 1)
      logits = np.asarray(bench.prefill_chunk(held, 1, p, all_logits=True).logits)
      if codec == "raw":
        raw_logits = logits
        row["raw_path_vs_prefill"] = token_metrics(ref, logits, targets)
      m = token_metrics(raw_logits, logits, targets)
      m["ppl_raw_path"] = float(math.exp(m["mean_nll_ref"]))
      row["codecs"][label] = m
      per[label].append(m)
      progress.update(1)
    for i, encs in enumerate(encodings):
      all_record_bytes.append(bench.record_json_bytes(hashes[i], parents[i],
                                                      prefix[i * c:(i + 1) * c], encs))
    if check is None:
      check = bench.store_check(chunks[0], tuple(prefix[:c]), first_blobs)
      check["record_json_bytes_all_encodings_accounted"] = all_record_bytes[0]
    passages.append(row)

  # Raw as stored (values + header + record) in f32, and the same with bf16 values.
  values_per_token = bench.layout.nbytes / c
  raw = sizes["raw"]
  raw_f32_per_token = (raw["object_bytes"] + raw["record_bytes"]) / raw["tokens"]
  raw_bf16_per_token = raw_f32_per_token - values_per_token / 2
  out_sizes = {}
  for label, _, _ in s.codecs:
    st = sizes[label]
    bpt = (st["object_bytes"] + st["record_bytes"]) / st["tokens"]
    out_sizes[label] = {
        "bytes_per_token": bpt, "object_bytes_per_token": st["object_bytes"] / st["tokens"],
        "record_json_bytes_per_chunk": st["record_bytes"] / st["chunks"],
        "header_bytes_per_chunk": st["header_bytes"] / st["chunks"],
        "array_bytes_per_token": {k: v / st["tokens"] for k, v in st["array_bytes"].items()},
        "bytes_per_chunk": bpt * c, "chunks": st["chunks"],
        "bytes_per_token_min": min(st["chunk_bytes_per_token"]),
        "bytes_per_token_max": max(st["chunk_bytes_per_token"]),
        "ratio_vs_raw_f32": raw_f32_per_token / bpt,
        "ratio_vs_raw_bf16": raw_bf16_per_token / bpt}
  if "int8" in out_sizes:
    for v in out_sizes.values():
      v["ratio_vs_int8"] = out_sizes["int8"]["bytes_per_token"] / v["bytes_per_token"]
  out_sizes["_all_encodings_record_json_bytes_per_chunk"] = float(np.mean(all_record_bytes))
  out_sizes["_raw_bytes_per_token"] = {"f32_stored": raw_f32_per_token,
                                       "bf16_stored": raw_bf16_per_token,
                                       "f32_values_only": values_per_token}
  out_sizes["_store_check"] = check

  out_quality = {}
  for label, _, _ in s.codecs:
    ms = per[label]
    firsts = [m["first_divergence"] for m in ms]
    diverged = [f for f in firsts if f is not None]
    out_quality[label] = {
        "ppl_ratio": mean_ci([m["ppl_ratio"] for m in ms], s.seed),
        "ppl_ratio_pooled": float(math.exp(np.mean([m["mean_nll"] - m["mean_nll_ref"]
                                                    for m in ms]))),
        "kl_per_token": mean_ci([m["mean_kl"] for m in ms], s.seed),
        "top1_agreement": mean_ci([m["top1_agreement"] for m in ms], s.seed),
        "first_divergence": {
            "per_passage": firsts, "passages_diverged": len(diverged), "passages": len(ms),
            "median_censored_at_H": float(np.median([h if f is None else f for f in firsts])),
            "min": min(diverged) if diverged else None,
            "mean_of_diverged": float(np.mean(diverged)) if diverged else None},
        "ppl_raw_path_mean": float(np.mean([m["ppl_raw_path"] for m in ms]))}
  out_quality["_settings"] = {"passages": len(windows), "prefix_tokens": p, "held_tokens": h,
                              "scored_tokens_per_passage": h,
                              "loadavg_1min_before": load0, "loadavg_1min_after": loadavg()}
  return out_sizes, out_quality, passages


# ---------------------------------------------------------------------------------------------
# Phase 4: LongChat topics_10.


def longchat(bench: Bench, path: pathlib.Path, s: Settings, progress) -> dict:
  """Accuracy on the first `longchat_samples` topics_10 prompts, raw prefill and per codec."""
  c = s.chunk
  rows = []
  load0 = loadavg()
  with open(path, encoding="utf-8") as f:
    samples = [json.loads(line) for line in f][:s.longchat_samples]
  tok = bench.tokenizer
  for sample in samples:
    ids = tok.encode(VICUNA.format(sample["prompt"]), add_special_tokens=False)
    topic = sample["topics"][0]
    if len(ids) + s.longchat_max_new_tokens > bench.runner.max_seq_len:
      rows.append({"test_id": sample["test_id"], "tokens": len(ids), "skipped": "too long"})
      progress.update(1 + len(s.codecs))
      continue
    m = (len(ids) - 1) // c  # stored chunks never cover the last prompt token
    prefix, tail = ids[:m * c], ids[m * c:]
    bench.runner.reset()
    chunks, prefill_s, _ = bench.prefill_kv(prefix, 0)
    t0 = time.perf_counter()
    first = bench.prefill_chunk(tail, 0, m * c).logits
    gen = bench.greedy(first, 0, len(ids), s.longchat_max_new_tokens)
    text = tok.decode(gen, skip_special_tokens=True)
    row = {"test_id": sample["test_id"], "tokens": len(ids), "stored_chunks": m, "topic": topic,
           "prefix_prefill_s": prefill_s, "raw_prefill": {
               "text": text, "correct": topic.lower() in text.lower(),
               "tail_and_decode_s": time.perf_counter() - t0}, "codecs": {}}
    progress.update(1)
    raw_gen = None
    for label, codec, level in s.codecs:
      blobs = [bench.encode(kv, codec, level, i * c) for i, kv in enumerate(chunks)]
      bench.decode_into(blobs, codec, level, 1)
      first = bench.prefill_chunk(tail, 1, m * c).logits
      gen_c = bench.greedy(first, 1, len(ids), s.longchat_max_new_tokens)
      text_c = tok.decode(gen_c, skip_special_tokens=True)
      if codec == "raw":
        raw_gen = gen_c
      row["codecs"][label] = {"text": text_c, "correct": topic.lower() in text_c.lower(),
                              "same_tokens_as_raw_path": gen_c == raw_gen}
      progress.update(1)
    row["raw_path_same_tokens_as_prefill"] = raw_gen == gen
    rows.append(row)
  done = [r for r in rows if "skipped" not in r]
  acc = {"raw_prefill": {"correct": sum(r["raw_prefill"]["correct"] for r in done),
                         "n": len(done)}}
  for label, _, _ in s.codecs:
    acc[label] = {"correct": sum(r["codecs"][label]["correct"] for r in done), "n": len(done),
                  "same_tokens_as_raw_path": sum(r["codecs"][label]["same_tokens_as_raw_path"]
                                                 for r in done)}
  for v in acc.values():
    v["accuracy"] = v["correct"] / v["n"] if v["n"] else None
  return {"file": path.name, "wrapper": VICUNA, "max_new_tokens": s.longchat_max_new_tokens,
          "rule": "correct if topics[0] appears in the output, case-insensitive",
          "accuracy": acc, "samples": rows, "loadavg_1min_before": load0,
          "loadavg_1min_after": loadavg()}


# ---------------------------------------------------------------------------------------------
# Targets, table, plot.


def reference_prefill(s: Settings) -> dict | None:
  """Per-chunk kvjax prefill seconds at chunk size C from an earlier bench_prefill.json."""
  path = _REFERENCE.value
  if path is None:
    path = next((str(p) for p in _REFERENCE_DEFAULTS if p.is_file()), "")
  if not path or not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    d = json.load(f)
  secs = d.get("results", {}).get(str(s.chunk), {}).get("kvjax_s")
  if not secs:
    return None
  return {"file": os.path.relpath(path, REPO), "git_sha": d.get("git_sha"),
          "created_utc": d.get("created_utc"),
          "loadavg_1_5_15": d.get("machine", {}).get("loadavg_1_5_15"), "seconds": secs}


def balance_and_targets(s: Settings, sizes: dict, tp: dict, sweep: dict,
                        ref: dict | None) -> dict:
  """Balance bandwidth (chunk bytes / chunk compute s) per codec and the decode target.

  Measured: this run's sweep (wall, 2 threads, shared machine) against the worker's wall decode
  rate (one pinned core, shared). Reference: the earlier bench_prefill.json times against the
  worker's CPU-time decode rate (what one unshared thread sustains).
  """
  secs = sweep["seconds"]
  out = {"compute_s_per_chunk": {"first": secs[0], "last": secs[-1], "min": min(secs),
                                 "first_start": 0, "last_start": sweep["starts"][-1]},
         "reference_compute": ref, "codecs": {}}
  for label, _, _ in s.codecs:
    chunk_bytes = sizes[label]["bytes_per_chunk"]
    w = tp["worker"]["results"][label]
    dec, dec_cpu = w["decode_bytes_per_s"], w["decode_bytes_per_cpu_s"]
    row = {"chunk_bytes": chunk_bytes,
           "balance_bytes_per_s_first": chunk_bytes / secs[0],
           "balance_bytes_per_s_last": chunk_bytes / secs[-1],
           "balance_bytes_per_s_max": chunk_bytes / min(secs),
           "decode_over_balance_first": dec * secs[0] / chunk_bytes,
           "decode_over_balance_last": dec * secs[-1] / chunk_bytes,
           "decode_over_balance_worst": dec * min(secs) / chunk_bytes}
    row["decode_target_2x_met_everywhere"] = row["decode_over_balance_worst"] >= 2.0
    if ref is not None:
      r = ref["seconds"]
      row.update({"ref_balance_bytes_per_s_first": chunk_bytes / r[0],
                  "ref_balance_bytes_per_s_last": chunk_bytes / r[-1],
                  "ref_decode_cpu_over_balance_first": dec_cpu * r[0] / chunk_bytes,
                  "ref_decode_cpu_over_balance_last": dec_cpu * r[-1] / chunk_bytes,
                  "ref_decode_cpu_over_balance_worst": dec_cpu * min(r) / chunk_bytes})
      row["ref_decode_target_2x_met_everywhere"] = row["ref_decode_cpu_over_balance_worst"] >= 2
    out["codecs"][label] = row
  return out


def cachegen_targets(s: Settings, sizes: dict, qual: dict) -> dict:
  out = {}
  for label, codec, _ in s.codecs:
    if codec != "cachegen" or "int8" not in sizes:
      continue
    ppl = qual[label]["ppl_ratio"]
    out[label] = {"ratio_vs_int8": sizes[label]["ratio_vs_int8"],
                  "size_target_4x_vs_int8_met": sizes[label]["ratio_vs_int8"] >= 4.0,
                  "ppl_ratio": ppl["mean"],
                  "ppl_target_within_1pct_met": ppl["mean"] <= 1.01,
                  "ppl_target_within_1pct_met_ci_upper": (ppl["ci95_t"] is not None
                                                          and ppl["ci95_t"][1] <= 1.01)}
  return out


def _ci(d: dict, fmt: str) -> str:
  if d["ci95_t"] is None:
    return format(d["mean"], fmt)
  return f"{format(d['mean'], fmt)} [{format(d['ci95_t'][0], fmt)},{format(d['ci95_t'][1], fmt)}]"


def print_table(s: Settings, sizes, qual, tp, bal, lc) -> None:
  h = s.held_tokens
  print(f"\nSmolLM2-135M-Instruct f32 KV, chunks of {s.chunk} tokens; quality over "
        f"{qual['_settings']['passages']} book passages ({s.prefix_tokens} codec-prefix tokens, "
        f"{h} scored each)")
  head = (f"{'codec':11s}{'B/token':>9s}{'x f32':>7s}{'x bf16':>7s}{'x int8':>7s}"
          f"{'ppl ratio [95% CI]':>28s}{'KL/token [95% CI]':>30s}{'top1':>7s}{'1st div':>9s}")
  if lc:
    head += f"{'LongChat':>10s}"
  print(head)
  for label, _, _ in s.codecs:
    z, q = sizes[label], qual[label]
    fd = q["first_divergence"]
    line = (f"{label:11s}{z['bytes_per_token']:9.0f}{z['ratio_vs_raw_f32']:7.2f}"
            f"{z['ratio_vs_raw_bf16']:7.2f}{z.get('ratio_vs_int8', float('nan')):7.2f}"
            f"{_ci(q['ppl_ratio'], '.4f'):>28s}{_ci(q['kl_per_token'], '.4f'):>30s}"
            f"{q['top1_agreement']['mean']:7.3f}"
            f"{fd['median_censored_at_H']:8.0f}{'' if fd['passages_diverged'] else '+':1s}")
    if lc:
      a = lc["accuracy"][label]
      line += f"{a['correct']:>7d}/{a['n']:<2d}"
    print(line)
  print(f"B/token: encode_payload object + index record JSON; x: raw bytes / codec bytes, raw "
        f"stored the same way in f32 or with bf16 values (half the values' bytes). ppl ratio, KL(raw || codec) and top-1 agreement vs the raw codec "
        f"path, 95% t intervals over passages; 1st div: median first teacher-forced position "
        f"whose argmax differs from raw ('+': none diverged within {h}).")
  if lc:
    a = lc["accuracy"]["raw_prefill"]
    print(f"LongChat topics_10 (correct/n): plain prefill without any codec path "
          f"{a['correct']}/{a['n']}.")

  cs = bal["compute_s_per_chunk"]
  ref = bal["reference_compute"]
  print(f"\nThroughput on 1 pinned thread while a prefill runs on the other core "
        f"(MB = 1e6 stored bytes); compute per chunk this run: {cs['first']:.2f} s at position 0, "
        f"{cs['last']:.2f} s at {cs['last_start']}"
        + (f"; reference ({ref['file']}): {ref['seconds'][0]:.2f} s / {ref['seconds'][-1]:.2f} s"
           if ref else ""))
  print(f"{'codec':11s}{'KB/chunk':>9s}{'enc MB/s':>9s}{'dec MB/s':>9s}{'dec MB/cpu-s':>13s}"
        f"{'bal@0 MB/s':>11s}{'bal@last':>9s}{'dec/bal@0':>10s}{'@last':>7s}{'ref@0':>7s}"
        f"{'ref@last':>9s}")
  for label, _, _ in s.codecs:
    w = tp["worker"]["results"][label]
    b = bal["codecs"][label]
    print(f"{label:11s}{b['chunk_bytes'] / 1e3:9.0f}{w['encode_bytes_per_s'] / 1e6:9.1f}"
          f"{w['decode_bytes_per_s'] / 1e6:9.1f}{w['decode_bytes_per_cpu_s'] / 1e6:13.1f}"
          f"{b['balance_bytes_per_s_first'] / 1e6:11.2f}{b['balance_bytes_per_s_last'] / 1e6:9.2f}"
          f"{b['decode_over_balance_first']:10.1f}{b['decode_over_balance_last']:7.1f}"
          f"{b.get('ref_decode_cpu_over_balance_first', float('nan')):7.1f}"
          f"{b.get('ref_decode_cpu_over_balance_last', float('nan')):9.1f}")
  print("bal: balance bandwidth = chunk bytes / chunk compute time (link speed at which loading "
        "a chunk takes as long as computing it); dec/bal: wall decode rate over it, this run; "
        "ref: CPU-time decode rate over the reference balance. Target: dec/bal >= 2.")


def plot(path: pathlib.Path, s: Settings, sizes, qual) -> bool:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib import ticker  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
    return False
  fig, (ax, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.8))
  colors = {"raw": "k", "int8": "C0", "int4": "C1"}
  for i, (label, codec, _) in enumerate(s.codecs):
    x = sizes[label]["bytes_per_token"]
    color = colors.get(codec, "C2")
    for axis, key in ((ax, "ppl_ratio"), (ax_kl, "kl_per_token")):
      q = qual[label][key]
      if key == "kl_per_token" and codec == "raw":
        continue  # KL of raw against itself is 0: nothing to draw on a log axis
      err = None
      if q["ci95_t"] is not None:
        lo = max(q["ci95_t"][0], q["mean"] * 1e-3) if key == "kl_per_token" else q["ci95_t"][0]
        err = [[q["mean"] - lo], [q["ci95_t"][1] - q["mean"]]]
      axis.errorbar([x], [q["mean"]], yerr=err, fmt="o", capsize=3, color=color)
      axis.annotate(label, (x, q["mean"]), textcoords="offset points", fontsize=8,
                    xytext=(6, -13) if codec == "int8" else (5, 5 if i % 2 else -11))
  ax.axhline(1.01, color="C3", ls="--", lw=0.8, label="perplexity +1% (target)")
  for axis in (ax, ax_kl):
    if "int8" in sizes:
      axis.axvline(sizes["int8"]["bytes_per_token"] / 4, color="C3", ls=":", lw=0.8,
                   label="int8 bytes / 4 (target)")
    axis.set_xscale("log")
    axis.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    axis.xaxis.set_minor_formatter(ticker.NullFormatter())
    axis.set_xticks([t for t in (2000, 3000, 5000, 7000, 10000, 20000, 46000)
                     if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]])
    axis.set_xlabel("stored bytes per token (object + index record)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
  ax.set_ylabel("perplexity ratio vs raw (mean, 95% t CI)")
  ax_kl.set_yscale("log")
  ax_kl.set_ylabel("KL(raw || codec) per token, nats (mean, 95% t CI)")
  fig.suptitle(f"KV codecs on SmolLM2-135M-Instruct f32 KV: {qual['_settings']['passages']} "
               f"book passages, {s.prefix_tokens}-token codec prefix, {s.held_tokens} tokens "
               f"scored", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


# ---------------------------------------------------------------------------------------------


#: The order the greedy phase measures levels in: raw (the reference) first, then each codec's
#: default level, so an interrupted run still has the levels a server stores by default.
GREEDY_ORDER = ("raw", "int8", "kvtc-1", "cachegen-1", "int4", "kvtc-0", "kvtc-2", "kvtc-3",
                "kvtc-4", "cachegen-0", "cachegen-2", "cachegen-3")


def greedy_phase(s: Settings) -> list[str]:
  """Greedy agreement with raw through real store loads (scripts/bench_codec_greedy.py);
  writes <out>/bench_codec_greedy.json after every level. Returns the levels that failed (a
  load that did not happen)."""
  import jax  # noqa: PLC0415
  from kvjax import LLM  # noqa: PLC0415
  from kvjax.models.loading.registry import load_model  # noqa: PLC0415
  from kvjax.models.runner.compilation_cache import default_cache_root  # noqa: PLC0415
  import bench_codec_greedy as greedy  # noqa: PLC0415  scripts/

  n_prompts = _setting(_G_PROMPTS, 200, 8)
  n_tokens = _setting(_G_TOKENS, 64, 16)
  max_prompt = _G_MAX_PROMPT.value
  prov = benchlib.provenance(VERSION_PACKAGES)
  t_start = time.perf_counter()
  tok = load_model(MODEL, cache_dir=os.path.join(default_cache_root(), "params")).tokenizer
  with open(data_dir() / "sharegpt" / "sharegpt_v3_multiturn_1000.json", encoding="utf-8") as f:
    conversations = json.load(f)
  prompts = greedy.sharegpt_prompts(conversations, tok.encode_chat, n_prompts,
                                    max_tokens=max_prompt, max_tail=_G_MAX_TAIL.value,
                                    chunk=s.chunk, seed=s.seed)
  rank = {label: i for i, label in enumerate(GREEDY_ORDER)}
  levels = [greedy.Level(*c) for c in sorted(s.codecs, key=lambda c: rank[c[0]])]

  def make_llm(codec: str, level: int, url: str):
    return LLM(MODEL, dtype="float32", kv_store=url, kv_codec=codec, kv_codec_levels=(level,),
               kv_merge_mode="load_only", kv_codec_consistent=False, kv_chunk_size=s.chunk,
               max_model_len=max_prompt + n_tokens, max_num_seqs=_G_SEQS.value,
               compile_on_init=False)

  out_path = pathlib.Path(_OUT.value) / "bench_codec_greedy.json"
  out_path.parent.mkdir(parents=True, exist_ok=True)
  settings = {"prompts": n_prompts, "tokens": n_tokens, "chunk": s.chunk,
              "max_prompt_tokens": max_prompt, "max_tail": _G_MAX_TAIL.value, "seed": s.seed,
              "max_num_seqs": _G_SEQS.value,
              "codecs": [lv.label for lv in levels]}

  def write(result: dict) -> None:
    record = {**prov, "benchmark": "bench_codec greedy agreement",
              "model": f"{MODEL} (GGUF Q4_1 -> f32)", "dtype": "float32",
              "backend": jax.default_backend(), "quick": _QUICK.value, "settings": settings,
              "method": greedy.METHOD,
              "prompts": [{k: p[k] for k in ("id", "user_turn", "tokens")} for p in prompts],
              "elapsed_s": time.perf_counter() - t_start, **result}
    benchlib.write_json(out_path, record)

  def on_level(result: dict) -> None:
    write(result)
    label = next(reversed(result["levels"]))
    r = result["levels"][label]
    print(f"{label}: exact {r['summary']['exact_match']['count']}/{n_prompts}, "
          f"{len(r['load_failures'])} load failures, {sum(r['seconds'].values()):.0f} s, "
          f"load average {loadavg():.1f}", flush=True)

  work = _G_WORK.value or tempfile.mkdtemp(prefix="bench_codec_greedy_")
  try:
    result = greedy.run_phase(make_llm, levels, prompts, n_tokens, work, s.seed, on_level)
  finally:
    if not _G_WORK.value:
      shutil.rmtree(work, ignore_errors=True)
  write(result)
  print(greedy.table(result, [c[0] for c in s.codecs], n_tokens))
  wrote = greedy.plot(out_path.with_suffix(".png"), result, [c[0] for c in s.codecs],
                      n_tokens)
  print(f"\ntotal {time.perf_counter() - t_start:.0f} s; load average (1 min) "
        f"{prov['machine']['loadavg_1_5_15'][0]:.1f} at start, {loadavg():.1f} at end; wrote "
        f"{out_path}" + (" and its .png" if wrote else ""))
  return result["failed"]


def main(argv):
  del argv
  if _WORKER.value == "throughput":
    worker_main()
    return
  logging.set_verbosity(logging.WARNING)
  s = Settings.from_flags()
  unknown = sorted(set(_PHASES.value) - {"main", "greedy"})
  if unknown or not _PHASES.value:
    raise app.UsageError(f"--phases takes main and/or greedy, got {_PHASES.value}")
  if "main" in _PHASES.value:
    main_phases(s)
  if "greedy" in _PHASES.value:
    failed = greedy_phase(s)
    if failed:
      print(f"greedy phase: stored chunks were not all loaded for {failed}; their figures are "
            "not codec figures", file=sys.stderr)
      sys.exit(1)


def main_phases(s: Settings) -> None:
  """The compute sweep, throughput, sizes and quality, LongChat: bench_codec.json."""
  from tqdm import tqdm  # noqa: PLC0415
  import jax  # noqa: PLC0415

  t_start = time.perf_counter()
  prov = benchlib.provenance(VERSION_PACKAGES)
  machine_start = prov["machine"]
  data = data_dir()
  lc_samples = s.longchat_samples
  max_seq_len = max(s.sweep_tokens, s.prefix_tokens + s.held_tokens + 1,
                    8192 if lc_samples else 0)
  chunk_sizes = tuple(sorted({s.held_tokens, s.chunk}))
  bench = Bench(max_seq_len, chunk_sizes, s.chunk)
  books = {}
  for name in BOOKS:
    with open(data / "books" / name, encoding="utf-8") as f:
      books[name] = bench.tokenizer.encode(f.read(), add_special_tokens=False)
  sweep_ids = books[SWEEP_BOOK]
  n_codecs = len(s.codecs)
  total = (s.sweep_tokens // s.chunk + 1 + s.passages * n_codecs
           + lc_samples * (1 + n_codecs))
  with tqdm(total=total, desc="bench_codec", unit="step", dynamic_ncols=True) as progress:
    progress.set_postfix_str("compute sweep")
    sweep, samples = compute_sweep(bench, sweep_ids, s, progress)
    progress.set_postfix_str("throughput (1 thread)")
    tp = throughput(bench, samples, sweep_ids, s, progress)
    progress.set_postfix_str("size + quality")
    sizes, qual, passages = quality(bench, books, s, progress)
    lc = None
    if lc_samples:
      progress.set_postfix_str("LongChat topics_10")
      lc = longchat(bench, data / "longchat" / "topics_10.jsonl", s, progress)
  bal = balance_and_targets(s, sizes, tp, sweep, reference_prefill(s))
  targets = {"cachegen_size_and_quality": cachegen_targets(s, sizes, qual),
             "decode_vs_balance": {k: {kk: vv for kk, vv in v.items()
                                       if "over_balance" in kk or "target" in kk}
                                   for k, v in bal["codecs"].items()}}

  out_dir = pathlib.Path(_OUT.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  record = {
      **prov,
      "benchmark": "bench_codec", "model": f"{MODEL} (GGUF Q4_1 -> f32)", "dtype": "float32",
      "quick": _QUICK.value, "settings": dataclasses.asdict(s), "machine_end": machine(),
      "backend": jax.default_backend(),
      "threads": {"model_phases": f"default XLA CPU threads over {os.cpu_count()} cores "
                                  "(sweep, quality, LongChat)",
                  "throughput": tp["pinning"]},
      "seeds": {"bootstrap": s.seed, "note": "passages at fixed offsets; "
                                      "greedy decoding; no other randomness"},
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "encode_path": "kv_encode(use_pallas=False) jnp reference on CPU, then "
                     "storage.format.codecs.encode_payload",
      "decode_path": "storage.format.codecs.decode_payload(defer_entropy=True), then kv_decode("
                     "use_pallas=False); kvtc: rANS codes decoded by the jit'd jnp reference "
                     "(kvtc_rans.decode_codes), then kvtc_decode",
      "note": ("2-core VM shared with other jobs: throughput and compute times may be affected "
               "by their load (see loadavg per phase)."),
      "compute_sweep": sweep, "sizes": sizes, "throughput": tp, "balance": bal,
      "quality": qual, "passages": passages, "longchat": lc, "targets": targets,
      "elapsed_s": time.perf_counter() - t_start}
  benchlib.write_json(out_dir / "bench_codec.json", record)
  print_table(s, sizes, qual, tp, bal, lc)
  wrote = plot(out_dir / "bench_codec.png", s, sizes, qual)
  print(f"\ntotal {record['elapsed_s']:.0f} s; load average (1 min) "
        f"{machine_start['loadavg_1_5_15'][0]:.1f} at start, {loadavg():.1f} at end; wrote "
        f"{out_dir / 'bench_codec.json'}" + (" and bench_codec.png" if wrote else ""))


if __name__ == "__main__":
  app.run(main)
