"""Chunk store put/get throughput and lookup latency, against a plain file read of the same bytes.

For each backend (file, ocdbt+file; memory as a reference), KV dtype (bfloat16, float32) and
chunk size C (64, 256, 1024 tokens) of SmolLM2-135M's KV layout `[L=30, 2, C, K=3, H=64]`:

  put       N chunks stored with `asyncio.gather` (all in flight, bounded by the store's byte
            limiter), SHA-256 and commit-last record included.
  get seq   the N chunks read one at a time (`await store.get(...)` in a loop).
  get par   the N chunks read with `asyncio.gather` (many in flight, same byte limiter).
  plain     one file holding the same N chunks' bytes, in the same directory, read front to back
            with `os.preadv` into one reused 16 MiB buffer: the physical limit of this disk.

Each read runs cold, then warm:
  cold  every file under the directory is fsynced and dropped from the page cache
        (`posix_fadvise(POSIX_FADV_DONTNEED)`), and the store is a fresh handle (new ts.Context,
        so tensorstore's cache pool is empty). A VM's host may still cache the disk.
  warm  the same handle reads again (page cache, plus the store's 64 MiB cache pool).
Every get is a verified read (record checks + SHA-256 of the values), as in serving. Read
throughput is reported as a fraction of the plain read at the same temperature, measured in the
same run. The memory backend has no cold read.

Lookup latency: 1,000 index records (C=256 token ids each, written directly; `contains` reads only
the index) and one batched `contains` of the 1,000 present keys and of 1,000 absent keys, cold
and warm, per backend.

Values are random normal (seeded), not real KV: throughput does not depend on the values (the raw
codec, no compression); sizes would with zstd.

    .venv/bin/python scripts/bench_store.py            # default, about 2 minutes on 2 cores
    .venv/bin/python scripts/bench_store.py --quick    # seconds

Writes <out_dir>/bench_store.json (`benchlib.provenance()`, threads, seed, settings, results)
and <out_dir>/bench_store.png, and prints a table.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from absl import app, flags, logging

import benchlib  # scripts/benchlib.py
from benchlib import machine
import ml_dtypes
import numpy as np

from kvjax.storage.backends import chunk_store
from kvjax.storage.format import keys
from kvjax.storage.format.types import ChunkHit, ChunkRecord, Encoding, KVLayout

REPO = pathlib.Path(__file__).resolve().parent.parent

_OUT_DIR = flags.DEFINE_string("out_dir", str(REPO / "benchmarks" / "results"), "Output folder.")
_WORK_DIR = flags.DEFINE_string("work_dir", None, "Where the stores and the plain file go "
                                "(default: the system temp dir); removed afterwards.")
_BACKENDS = flags.DEFINE_list("backends", ["file", "ocdbt", "memory"], "Backends to measure.")
_CHUNK_SIZES = flags.DEFINE_list("chunk_sizes", ["64", "256", "1024"], "C, tokens per chunk.")
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "KV dtypes.")
_MIB = flags.DEFINE_integer("mib_per_config", 128, "Bytes of chunks per configuration, MiB "
                            "(at least 2 chunks).")
_LOOKUP_KEYS = flags.DEFINE_integer("lookup_keys", 1000, "Keys per batched `contains`.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random values and token ids.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny run: C=64, bfloat16, 4 MiB, 100 lookup keys.")

# SmolLM2-135M: 30 layers, 3 kv heads, head dim 64.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 30, 3, 64
_BLOCK = 16 << 20


#: Libraries whose versions the results record (`benchlib.provenance`).
PACKAGES = ("kvjax", "tensorstore", "numpy", "ml_dtypes", "absl-py")


# ---------------------------------------------------------------------------------------------
# Page cache and the plain file.


def drop_page_cache(directory: str) -> int:
  """fsyncs and drops from the page cache every file under `directory`; returns the count."""
  n = 0
  for dirpath, _, names in os.walk(directory):
    for name in names:
      fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n += 1
      finally:
        os.close(fd)
  return n


def write_plain(path: str, arrays: list[np.ndarray]) -> int:
  with open(path, "wb") as f:
    for a in arrays:
      f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    f.flush()
    os.fsync(f.fileno())
  return os.path.getsize(path)


def read_plain(path: str) -> tuple[int, float]:
  """Reads a file front to back in 16 MiB blocks into one buffer; returns (bytes, seconds)."""
  buf = bytearray(_BLOCK)
  fd = os.open(path, os.O_RDONLY)
  try:
    t0 = time.perf_counter()
    total = 0
    while n := os.preadv(fd, [buf], total):
      total += n
    return total, time.perf_counter() - t0
  finally:
    os.close(fd)


def sha256_mb_per_s(nbytes: int = 64 << 20) -> float:
  """Single-thread SHA-256 rate (every verified get hashes its values once)."""
  data = np.random.default_rng(0).integers(0, 256, size=nbytes, dtype=np.uint8)
  t0 = time.perf_counter()
  chunk_store.values_checksum(data)
  return nbytes / (time.perf_counter() - t0) / 1e6


# ---------------------------------------------------------------------------------------------
# Store phases.


def store_url(backend: str, directory: str, name: str) -> str:
  return {"file": f"file://{directory}", "ocdbt": f"ocdbt+file://{directory}",
          "memory": f"memory://{name}"}[backend]


def make_chunks(layout: KVLayout, n: int, rng: np.random.Generator):
  """n chunks of random normal values and their keys (a chain of one prompt)."""
  ns = keys.KeyNamespace("bench-store", layout.dtype, 1, layout.chunk_size)
  tokens = rng.integers(0, 49152, size=n * layout.chunk_size).tolist()
  hashes = keys.chunk_hashes(ns, tokens)
  dtype = ml_dtypes.bfloat16 if layout.dtype == "bfloat16" else np.dtype(layout.dtype)
  arrays = [rng.standard_normal(layout.shape, dtype=np.float32).astype(dtype) for _ in range(n)]
  c = layout.chunk_size
  token_chunks = [tokens[i * c:(i + 1) * c] for i in range(n)]
  parents = [ns.root_hash(), *hashes[:-1]]
  return ns.root_hash(), hashes, parents, token_chunks, arrays


async def put_all(store, namespace, hashes, parents, token_chunks, arrays) -> float:
  t0 = time.perf_counter()
  ok = await asyncio.gather(*(store.put(h, p, t, namespace, a)
                              for h, p, t, a in zip(hashes, parents, token_chunks, arrays)))
  dt = time.perf_counter() - t0
  if not all(ok):
    raise RuntimeError(f"{ok.count(False)} puts failed: {store.stats.snapshot()}")
  return dt


async def get_all(store, namespace, hashes, token_chunks, layout, parallel: bool) -> float:
  def check(r):
    if not isinstance(r, ChunkHit):
      raise RuntimeError(f"get missed: {r}")

  t0 = time.perf_counter()
  if parallel:
    for r in await asyncio.gather(*(store.get(h, t, namespace, layout)
                                    for h, t in zip(hashes, token_chunks))):
      check(r)
  else:
    for h, t in zip(hashes, token_chunks):
      check(await store.get(h, t, namespace, layout))
  return time.perf_counter() - t0


def bench_config(backend: str, layout: KVLayout, n: int, work: str, rng) -> dict:
  """One (backend, dtype, C): put, then plain and store reads, cold and warm."""
  directory = tempfile.mkdtemp(prefix=f"{backend}-", dir=work)
  store_dir = os.path.join(directory, "store")
  name = f"bench-{layout.dtype}-{layout.chunk_size}"
  namespace, hashes, parents, token_chunks, arrays = make_chunks(layout, n, rng)
  nbytes = n * layout.nbytes
  row = {"backend": backend, "dtype": layout.dtype, "chunk_tokens": layout.chunk_size,
         "chunk_bytes": layout.nbytes, "chunks": n, "bytes": nbytes}
  try:
    url = store_url(backend, store_dir, name)
    writer = chunk_store.ChunkStore(url)
    row["put_s"] = asyncio.run(put_all(writer, namespace, hashes, parents, token_chunks, arrays))
    local = backend != "memory"
    if local:
      plain = os.path.join(directory, "plain.bin")
      assert write_plain(plain, arrays) == nbytes
      writer.close()
    del arrays
    for mode, parallel in (("seq", False), ("par", True)):
      if local:
        drop_page_cache(directory)
        reader = chunk_store.ChunkStore(url)
        row[f"get_{mode}_cold_s"] = asyncio.run(
            get_all(reader, namespace, hashes, token_chunks, layout, parallel))
      else:
        reader = writer
        row[f"get_{mode}_cold_s"] = None
      row[f"get_{mode}_warm_s"] = asyncio.run(
          get_all(reader, namespace, hashes, token_chunks, layout, parallel))
      if local:
        reader.close()
    if local:
      drop_page_cache(directory)
      got, row["plain_cold_s"] = read_plain(plain)
      assert got == nbytes
      _, row["plain_warm_s"] = read_plain(plain)
    else:
      writer.close()
      row["plain_cold_s"] = row["plain_warm_s"] = None
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return row


async def _lookup(store, present, absent) -> dict:
  out = {}
  for label, hs in (("present", present), ("absent", absent)):
    t0 = time.perf_counter()
    found = await store.contains(hs)
    out[label] = time.perf_counter() - t0
    if found != [label == "present"] * len(hs):
      raise RuntimeError(f"contains({label}) returned {sum(found)} of {len(hs)} present")
  return out


def bench_lookup(backend: str, n_keys: int, work: str, rng) -> dict:
  """Batched `contains` of n present and n absent keys, cold (fresh handle) and warm."""
  directory = tempfile.mkdtemp(prefix=f"lookup-{backend}-", dir=work)
  c = 256
  ns = keys.KeyNamespace("bench-store-lookup", "bfloat16", 1, c)
  tokens = rng.integers(0, 49152, size=2 * n_keys * c).tolist()
  hashes = keys.chunk_hashes(ns, tokens)
  present, absent = hashes[:n_keys], hashes[n_keys:]
  layout = KVLayout(NUM_LAYERS, c, NUM_KV_HEADS, HEAD_DIM, "bfloat16")
  try:
    url = store_url(backend, os.path.join(directory, "store"), "lookup")
    writer = chunk_store.ChunkStore(url)

    async def write_records():
      root = await writer.kvstore()
      parent = ns.root_hash()
      writes = []
      for i, h in enumerate(present):
        ids = tuple(tokens[i * c:(i + 1) * c])
        obj = chunk_store.raw_object_key(h, "0" * 64)
        rec = ChunkRecord(h, parent, ids, ns.root_hash(), layout,
                          (Encoding("raw", 1, 0, obj, layout.nbytes, "0" * 64),))
        writes.append(root.write(chunk_store.index_key(h), rec.to_json()))
        parent = h
      await asyncio.gather(*writes)

    asyncio.run(write_records())
    row = {"backend": backend, "keys": n_keys}
    if backend != "memory":
      writer.close()
      drop_page_cache(directory)
      reader = chunk_store.ChunkStore(url)
      cold = asyncio.run(_lookup(reader, present, absent))
      row.update({f"cold_{k}_s": v for k, v in cold.items()})
    else:
      reader = writer
      row.update(cold_present_s=None, cold_absent_s=None)
    warm = [asyncio.run(_lookup(reader, present, absent)) for _ in range(3)]
    for k in ("present", "absent"):
      row[f"warm_{k}_s"] = statistics.median(w[k] for w in warm)
    reader.close()
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  return row


# ---------------------------------------------------------------------------------------------
# Report.


def _mbps(nbytes: int, s: float | None) -> float | None:
  return None if not s else nbytes / s / 1e6


def summarize(row: dict) -> dict:
  """Adds MB/s and fractions of the plain read at the same temperature."""
  b = row["bytes"]
  out = dict(row)
  out["put_mb_per_s"] = _mbps(b, row["put_s"])
  for temp in ("cold", "warm"):
    plain = _mbps(b, row[f"plain_{temp}_s"])
    out[f"plain_{temp}_mb_per_s"] = plain
    for mode in ("seq", "par"):
      mbps = _mbps(b, row[f"get_{mode}_{temp}_s"])
      out[f"get_{mode}_{temp}_mb_per_s"] = mbps
      out[f"get_{mode}_{temp}_frac_of_plain"] = mbps / plain if mbps and plain else None
  return out


def print_table(rows: list[dict], lookups: list[dict], threads: int, sha_mbps: float) -> None:
  def cell(mbps, frac):
    if mbps is None:
      return f"{'-':>12}"
    return f"{mbps:6.0f}" + (f" {frac:4.2f}x" if frac is not None else "      ")

  print(f"\nChunk store throughput, MB/s (x = fraction of the plain file read at the same "
        f"temperature), SmolLM2-135M KV layout [30, 2, C, 3, 64], random normal values, "
        f"{threads} CPU threads; SHA-256 (one per verified get) runs at {sha_mbps:.0f} MB/s "
        f"on one thread")
  head = (f"{'backend':<7} {'dtype':<8} {'C':>5} {'MB/chunk':>8} {'n':>4} {'put':>6} "
          f"{'seq cold':>12} {'par cold':>12} {'plain cold':>10} "
          f"{'seq warm':>12} {'par warm':>12} {'plain warm':>10}")
  print(head)
  print("-" * len(head))
  for r in rows:
    pc, pw = r["plain_cold_mb_per_s"], r["plain_warm_mb_per_s"]
    print(f"{r['backend']:<7} {r['dtype']:<8} {r['chunk_tokens']:>5} "
          f"{r['chunk_bytes'] / 1e6:>8.2f} {r['chunks']:>4} {r['put_mb_per_s']:>6.0f} "
          f"{cell(r['get_seq_cold_mb_per_s'], r['get_seq_cold_frac_of_plain'])} "
          f"{cell(r['get_par_cold_mb_per_s'], r['get_par_cold_frac_of_plain'])} "
          f"{(f'{pc:10.0f}' if pc else f'{chr(45):>10}')} "
          f"{cell(r['get_seq_warm_mb_per_s'], r['get_seq_warm_frac_of_plain'])} "
          f"{cell(r['get_par_warm_mb_per_s'], r['get_par_warm_frac_of_plain'])} "
          f"{(f'{pw:10.0f}' if pw else f'{chr(45):>10}')}")
  if lookups:
    n = lookups[0]["keys"]
    print(f"\nBatched contains() of {n} keys, ms per batch (us per key)")
    print(f"{'backend':<7} {'present cold':>20} {'absent cold':>20} {'present warm':>20} "
          f"{'absent warm':>20}")
    for r in lookups:
      cells = []
      for k in ("cold_present_s", "cold_absent_s", "warm_present_s", "warm_absent_s"):
        s = r[k]
        cells.append(f"{'-':>20}" if s is None else
                     f"{s * 1e3:9.1f} ({s / r['keys'] * 1e6:6.1f} us)")
      print(f"{r['backend']:<7} " + " ".join(cells))


def plot(rows: list[dict], path: pathlib.Path, threads: int) -> bool:
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
    return False
  dtypes = sorted({r["dtype"] for r in rows})
  fig, axes = plt.subplots(len(dtypes), 3, figsize=(14, 3.6 * len(dtypes)), squeeze=False)
  colors = {"file": "C0", "ocdbt": "C1", "memory": "C2"}
  for i, dt in enumerate(dtypes):
    sub = [r for r in rows if r["dtype"] == dt]
    for j, temp in enumerate(("cold", "warm")):
      ax = axes[i][j]
      for backend in sorted({r["backend"] for r in sub}):
        rs = sorted((r for r in sub if r["backend"] == backend), key=lambda r: r["chunk_tokens"])
        for mode, style in (("seq", "o-"), ("par", "s--")):
          ys = [r[f"get_{mode}_{temp}_frac_of_plain"] for r in rs]
          if any(y is not None for y in ys):
            ax.plot([r["chunk_tokens"] for r in rs], [np.nan if y is None else y for y in ys],
                    style, color=colors.get(backend), label=f"{backend} {mode}")
      ax.axhline(1.0, color="k", lw=0.8, ls=":")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("chunk size C (tokens)")
      ax.set_ylabel(f"{temp} get / plain read")
      ax.set_title(f"{dt}: {temp} read, fraction of plain file")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
    ax = axes[i][2]
    for backend in sorted({r["backend"] for r in sub}):
      rs = sorted((r for r in sub if r["backend"] == backend), key=lambda r: r["chunk_tokens"])
      ax.plot([r["chunk_tokens"] for r in rs], [r["put_mb_per_s"] for r in rs], "o-",
              color=colors.get(backend), label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size C (tokens)")
    ax.set_ylabel("put MB/s (all in flight)")
    ax.set_title(f"{dt}: put throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(f"kvjax chunk store, SmolLM2-135M KV layout, {threads} CPU threads")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  quick = _QUICK.value
  chunk_sizes = [64] if quick else [int(c) for c in _CHUNK_SIZES.value]
  dtypes = ["bfloat16"] if quick else list(_DTYPES.value)
  budget = (4 if quick else _MIB.value) << 20
  n_keys = 100 if quick else _LOOKUP_KEYS.value
  backends = list(_BACKENDS.value)
  unknown = set(backends) - {"file", "ocdbt", "memory"}
  if unknown:
    raise app.UsageError(f"unknown backends {sorted(unknown)}")
  threads = os.cpu_count() or 1
  rng = np.random.default_rng(_SEED.value)
  work = tempfile.mkdtemp(prefix="kvjax-bench-store-", dir=_WORK_DIR.value)
  t_start = time.perf_counter()
  prov = benchlib.provenance(PACKAGES)
  machine_at_start = prov["machine"]
  rows, lookups = [], []
  try:
    for backend in backends:
      for dtype in dtypes:
        for c in chunk_sizes:
          layout = KVLayout(NUM_LAYERS, c, NUM_KV_HEADS, HEAD_DIM, dtype)
          n = max(2, round(budget / layout.nbytes))
          row = summarize(bench_config(backend, layout, n, work, rng))
          rows.append(row)
          logging.warning("%s %s C=%d: put %.0f MB/s, warm par get %.0f MB/s", backend, dtype,
                          c, row["put_mb_per_s"], row["get_par_warm_mb_per_s"])
      lookups.append(bench_lookup(backend, n_keys, work, rng))
  finally:
    shutil.rmtree(work, ignore_errors=True)
  elapsed = time.perf_counter() - t_start

  sha_mbps = sha256_mb_per_s(4 << 20 if quick else 64 << 20)
  print_table(rows, lookups, threads, sha_mbps)
  load_start = machine_at_start["loadavg_1_5_15"][0]
  print(f"\ntotal {elapsed:.0f} s; load average (1 min) {load_start:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end, on {threads} cores")
  out_dir = pathlib.Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  record = {
      **prov, "benchmark": "bench_store", "machine_at_end": machine(),
      "threads": threads, "seeds": {"numpy": _SEED.value},
      "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "settings": {
          "quick": quick, "bytes_per_config": budget, "backends": backends,
          "chunk_sizes": chunk_sizes, "dtypes": dtypes, "lookup_keys": n_keys,
          "layout": {"num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS,
                     "head_dim": HEAD_DIM, "model": "SmolLM2-135M"},
          "values": "random normal (numpy default_rng), not real KV",
          "store": {"max_bytes_in_flight": 256 << 20, "codec": "raw, zstd off",
                    "context": chunk_store.default_context_spec()},
          "plain_read": f"os.preadv into one {_BLOCK >> 20} MiB buffer",
          "cold": "fsync + posix_fadvise(DONTNEED) on every file under the directory, fresh "
                  "store handle",
          "work_dir": _WORK_DIR.value or tempfile.gettempdir(),
      },
      "sha256_mb_per_s": sha_mbps, "elapsed_s": elapsed, "results": rows, "lookup": lookups,
  }
  benchlib.write_json(out_dir / "bench_store.json", record)
  wrote = plot(rows, out_dir / "bench_store.png", threads)
  print(f"wrote {out_dir / 'bench_store.json'}" + (" and bench_store.png" if wrote else ""))


if __name__ == "__main__":
  app.run(main)
