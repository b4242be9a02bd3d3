"""Pieces of scripts/bench_codec.py: the codec path on the real model, per-token metrics, the
one-thread timing loop, passage selection and interval statistics.

The codec path is the one the engine takes (docs/design/codecs.md):

    prefill chunk ──k_pre_rope, v──> kv_L2CKH ──kv_encode_host──> payload ──encode_payload──> bytes
                                                                                              │
    pool blocks [start, start + C) <──insert_payload (dequantize, RoPE, write)── payload <──decode_payload

On CPU the jnp paths run (`use_pallas=False`); entropy coding is storage's pcodec/zstd.
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import numpy as np

MODEL = "SmolLM2-135M-Instruct"

# ---------------------------------------------------------------------------------------------
# Statistics and small helpers.


def mean_ci(xs, seed: int) -> dict:
  """Mean of per-passage values with a 95% t interval and a 95% bootstrap percentile interval.

  Args:
    xs: one value per passage.
    seed: seed of the 10,000 bootstrap resamples.

  Returns:
    {"mean", "n", "ci95_t": [lo, hi] or None, "ci95_bootstrap": [lo, hi] or None} (None for
    fewer than two values).
  """
  from scipy import stats  # noqa: PLC0415
  x = np.asarray(xs, np.float64)
  out = {"mean": float(x.mean()), "n": int(x.size), "ci95_t": None, "ci95_bootstrap": None}
  if x.size >= 2:
    half = float(stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    out["ci95_t"] = [out["mean"] - half, out["mean"] + half]
    rng = np.random.default_rng(seed)
    boots = x[rng.integers(0, x.size, (10000, x.size))].mean(axis=1)
    out["ci95_bootstrap"] = [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))]
  return out


def log_softmax(logits_TV: np.ndarray) -> np.ndarray:
  """f64[T, V] log-probabilities of f32[T, V] logits."""
  x = logits_TV.astype(np.float64)
  x -= x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_metrics(logits_ref_TV: np.ndarray, logits_TV: np.ndarray,
                  targets_T: np.ndarray) -> dict:
  """Teacher-forced metrics of logits against reference logits at the same positions.

  Args:
    logits_ref_TV: f32[T, V] reference (raw) logits.
    logits_TV: f32[T, V] logits to judge.
    targets_T: int[T] the token each position predicts.

  Returns:
    mean NLL of both (nats/token), `ppl_ratio` = exp(NLL - NLL_ref), `mean_kl` = mean over
    positions of KL(ref || this) (nats), `top1_agreement` (fraction of positions with the same
    argmax), `first_divergence` (first position whose argmax differs, or None) and the largest
    absolute logit difference.
  """
  lp_ref, lp = log_softmax(logits_ref_TV), log_softmax(logits_TV)
  rows = np.arange(len(targets_T))
  nll_ref, nll = -lp_ref[rows, targets_T], -lp[rows, targets_T]
  kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)
  top_ref, top = lp_ref.argmax(-1), lp.argmax(-1)
  diff = np.nonzero(top_ref != top)[0]
  return {"mean_nll": float(nll.mean()), "mean_nll_ref": float(nll_ref.mean()),
          "ppl_ratio": float(math.exp(nll.mean() - nll_ref.mean())),
          "mean_kl": float(kl.mean()), "top1_agreement": float((top_ref == top).mean()),
          "first_divergence": int(diff[0]) if diff.size else None,
          "max_abs_logit_diff": float(np.abs(logits_TV - logits_ref_TV).max())}


def passage_windows(book_lengths: dict[str, int], n: int, window: int) -> list[tuple[str, int]]:
  """`n` (book, offset) windows of `window` tokens, never overlapping within a book.

  Every book gets one window first (while n allows), then the rest go by D'Hondt on book length;
  a book's windows are spread evenly from its start to its end (one window: the middle).

  Args:
    book_lengths: tokens per book, in the order windows are returned.
    n: windows wanted.
    window: tokens per window.

  Raises:
    ValueError: if the books hold fewer than `n` non-overlapping windows.
  """
  caps = {b: length // window for b, length in book_lengths.items()}
  if sum(caps.values()) < n:
    raise ValueError(f"the books hold only {sum(caps.values())} windows of {window} tokens, "
                     f"{n} wanted")
  alloc = {b: 0 for b in book_lengths}
  for _ in range(n):
    open_books = [b for b in book_lengths if alloc[b] < caps[b]]
    pool = [b for b in open_books if alloc[b] == 0] or open_books
    alloc[max(pool, key=lambda b: book_lengths[b] / (alloc[b] + 1))] += 1
  out = []
  for b, k in alloc.items():
    span = book_lengths[b] - window
    if k == 1:
      out.append((b, span // 2))
    elif k > 1:
      out += [(b, int(o)) for o in np.linspace(0, span, k).round().astype(int)]
  return out


def loadavg() -> float:
  """1-minute load average."""
  return os.getloadavg()[0]


def pin_all_threads(cpus) -> None:
  """Pins every thread of this process to `cpus` (sched_setaffinity is per thread on Linux;
  threads created later inherit their creator's mask)."""
  for tid in os.listdir("/proc/self/task"):
    try:
      os.sched_setaffinity(int(tid), cpus)
    except OSError:  # a thread that just ended
      pass


def rope_cos_sin(inv_freq: np.ndarray, start: int, c: int) -> tuple[np.ndarray, np.ndarray]:
  """f32[C, H] RoPE cos and sin at positions start..start + C - 1 (HF rotate_half layout)."""
  angles = (start + np.arange(c, dtype=np.float32))[:, None] * inv_freq
  angles = np.concatenate([angles, angles], axis=-1)
  return np.cos(angles), np.sin(angles)


# ---------------------------------------------------------------------------------------------
# The model and the codec path.

#: The kvtc transform (`kvjax.kernels.kvtc.KVTCTransform`) of the model, set by `Bench` or the
#: throughput worker (`set_kvtc_transform`); kvtc encode/decode use it.
_KVTC = {"transform": None, "device": None}


def set_kvtc_transform(transform) -> None:
  """Sets the kvtc transform the codec helpers below use."""
  _KVTC["transform"] = transform
  _KVTC["device"] = transform.device_arrays()


def encode_host(kv_L2CKH, codec: str, level: int, start: int) -> dict:
  """A chunk's payload arrays on the host (jnp path): `kv_encode_host` or `kvtc_encode_host`
  (of the chunk at position `start`)."""
  from kvjax.kernels import kv_codec as kc  # noqa: PLC0415
  from kvjax.kernels import kvtc  # noqa: PLC0415
  if codec == "kvtc":
    return kvtc.kvtc_encode_host(kv_L2CKH, _KVTC["device"], level, start=start)
  return kc.kv_encode_host(kv_L2CKH, codec, level, use_pallas=False)


def device_entropy(arrays: dict) -> dict:
  """Arrays `decode_payload(defer_entropy=True)` left rANS-coded (kvtc's "rans-bands" `q`)
  decoded on the device, as the store client does for a landed chunk (`kvjax.kernels.kvtc_rans`;
  the jnp reference on CPU)."""
  import jax  # noqa: PLC0415
  from kvjax.kernels import kvtc_rans  # noqa: PLC0415
  from kvjax.storage.format import entropy  # noqa: PLC0415
  out = dict(arrays)
  for name, a in arrays.items():
    if isinstance(a, entropy.RansCodes):
      q, ok = kvtc_rans.decode_codes(kvtc_rans.pack_bands(a.shape, a.bands, a.offsets, a.arrays),
                                     use_pallas=jax.default_backend() != "cpu")
      if not bool(ok):
        raise RuntimeError(f"{name}: rANS codes did not decode")
      out[name] = q
  return out


def decode_arrays(arrays: dict, codec: str, k, v, slot, start, cos, sin):
  """Payload arrays -> `kv_decode` / `kvtc_decode` into (k, v) caches (jnp path)."""
  from kvjax.kernels import kv_codec as kc  # noqa: PLC0415
  from kvjax.kernels import kvtc  # noqa: PLC0415
  if codec == "kvtc":
    arrays = device_entropy(arrays)
    return kvtc.kvtc_decode(kvtc.payload_from_arrays(arrays), _KVTC["device"], k, v, slot, start,
                            cos, sin)
  return kc.kv_decode(kc.payload_from_arrays(codec, arrays), k, v, slot, start, cos, sin,
                      use_pallas=False)


class Bench:
  """The real model on a paged runner of two sequences plus the codec path from KV chunks to
  a sequence's pool blocks.

  Sequence ("slot") 0 holds the reference (plain prefill); sequence 1 receives decoded chunks.
  Each has a fixed block table of `max_seq_len` tokens.

  Args:
    max_seq_len: tokens per sequence.
    chunk_sizes: compiled prefill chunk sizes (ascending).
    chunk: stored chunk size C, tokens.
  """

  def __init__(self, max_seq_len: int, chunk_sizes: tuple[int, ...], chunk: int):
    from kvjax.models.nn.kv_cache import KV_LAYOUT_VERSION  # noqa: PLC0415
    from kvjax.models.nn.layers import rope_inv_freq  # noqa: PLC0415
    from kvjax.models.nn.calibration_model import CalibrationModel  # noqa: PLC0415
    from kvjax.models.runner.compilation_cache import (default_cache_root,  # noqa: PLC0415
                                                enable_persistent_compilation_cache)
    from kvjax.models.nn.llama import Llama  # noqa: PLC0415
    from kvjax.models.runner.paged_runner import PagedModelRunner  # noqa: PLC0415
    from kvjax.models.runner.runner_api import PagedRunnerConfig  # noqa: PLC0415
    from kvjax.models.loading.registry import load_model  # noqa: PLC0415
    from kvjax.storage.format import keys  # noqa: PLC0415
    from kvjax.storage.format.types import KVLayout  # noqa: PLC0415

    enable_persistent_compilation_cache()
    self.loaded = load_model(MODEL, cache_dir=os.path.join(default_cache_root(), "params"))
    cfg = self.loaded.config
    self.chunk = chunk
    model = Llama.from_params(cfg, self.loaded.params)
    b = 16
    per_seq = -(-max_seq_len // b)
    self.runner = PagedModelRunner(model, PagedRunnerConfig(
        num_blocks=2 * per_seq, block_size=b, max_num_seqs=2,
        max_num_batched_tokens=max(chunk_sizes), max_seq_len=max_seq_len,
        chunk_sizes=tuple(chunk_sizes)))
    #: Each sequence's block table ("slot" s: blocks [s * per_seq, (s + 1) * per_seq)).
    self.tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(2)]
    self.runner.warmup()
    self.inv_freq = rope_inv_freq(cfg)
    self.layout = KVLayout(cfg.n_layers, chunk, cfg.n_kv_heads, cfg.head_dim, "float32")
    self.namespace = keys.KeyNamespace(str(self.loaded.fingerprint), "float32", KV_LAYOUT_VERSION,
                                       chunk)
    self.tokenizer = self.loaded.tokenizer
    from kvjax.models.loading import kv_calibration  # noqa: PLC0415
    self.kvtc_transform = kv_calibration.load_or_calibrate(
        CalibrationModel(model), self.tokenizer, str(self.loaded.fingerprint),
        os.path.join(default_cache_root(), "params"))
    self.kvtc_cache_file = os.path.join(default_cache_root(), "params",
                                        kv_calibration.cache_file_name(
                                            str(self.loaded.fingerprint)))
    set_kvtc_transform(self.kvtc_transform)
    self.runner.set_kvtc_transform(self.kvtc_transform)

  def prefill_chunk(self, token_ids, slot: int, start: int, *, all_logits: bool = False):
    """One step of `token_ids` of sequence `slot` at `[start, start + n)`: `.logits` (f32[V]
    at the last token, or f32[n, V] for every token with `all_logits`), `.k_pre_rope_LTKH` and
    `.v_LTKH` ([L, n, K, H])."""
    import types  # noqa: PLC0415
    from kvjax.models.runner.runner_api import SeqChunk  # noqa: PLC0415
    seq = [SeqChunk(list(token_ids), start, self.tables[slot])]
    out = self.runner.step_all_logits(seq) if all_logits else self.runner.step(seq)
    return types.SimpleNamespace(logits=out.logits_SV if all_logits else out.logits_SV[0],
                                 k_pre_rope_LTKH=out.k_pre_rope_LTKH, v_LTKH=out.v_LTKH)

  def prefill_kv(self, ids, slot: int, progress=None):
    """Chunked prefill of `ids` (whole chunks) into `slot` from position 0.

    Returns:
      (chunks, seconds, cpu_seconds): device f32[L, 2, C, K, H] per chunk (K before RoPE, and
      V), and the wall time and process CPU time of each chunk's prefill.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    c = self.chunk
    chunks, times, cpu = [], [], []
    for start in range(0, len(ids) - c + 1, c):
      t0, c0 = time.perf_counter(), time.process_time()
      out = self.prefill_chunk(ids[start:start + c], slot, start)
      jax.block_until_ready(out.k_pre_rope_LTKH)
      times.append(time.perf_counter() - t0)
      cpu.append(time.process_time() - c0)
      chunks.append(jnp.stack([out.k_pre_rope_LTKH, out.v_LTKH], axis=1))
      if progress is not None:
        progress.update(1)
    return chunks, times, cpu

  def encode(self, kv_L2CKH, codec: str, level: int, start: int) -> bytes:
    """A chunk's stored bytes (chunk at position `start`): `kv_encode_host` (jnp path) then
    `encode_payload`."""
    from kvjax.storage.format import codecs  # noqa: PLC0415
    arrays = encode_host(kv_L2CKH, codec, level, start)
    return codecs.encode_payload(codec, level, arrays, self.layout)

  def decode_into(self, blobs, codec: str, level: int, slot: int) -> None:
    """Stored bytes of chunks 0..n-1 -> `decode_payload` -> the runner's `insert_payload`
    (dequantize, RoPE, block write) into sequence `slot` at [0, nC)."""
    from kvjax.storage.format import codecs  # noqa: PLC0415
    c, b = self.chunk, self.runner.block_size
    for i, blob in enumerate(blobs):
      arrays = codecs.decode_payload(codec, codecs.CURRENT_VERSION[codec], level, blob,
                                     self.layout, defer_entropy=True)
      if codec == "kvtc":
        arrays = device_entropy(arrays)
      self.runner.insert_payload(codec, arrays, self.tables[slot][i * c // b:(i + 1) * c // b],
                                 i * c)

  def record_json_bytes(self, chunk_hash, parent_hash, token_ids, encodings) -> int:
    """Bytes of the index record (`ChunkRecord.to_json`) listing `encodings`."""
    from kvjax.storage.format.types import ChunkRecord  # noqa: PLC0415
    return len(ChunkRecord(chunk_hash=chunk_hash, parent_hash=parent_hash,
                           token_ids=tuple(int(t) for t in token_ids),
                           namespace=self.namespace.root_hash(), layout=self.layout,
                           encodings=tuple(encodings)).to_json())

  def encoding(self, chunk_hash, codec: str, level: int, blob: bytes, kv=None):
    """The `Encoding` entry a ChunkStore `put` records (raw: the zarr3 values object)."""
    from kvjax.storage.backends import chunk_store
    from kvjax.storage.format import codecs  # noqa: PLC0415
    from kvjax.storage.format.types import Encoding  # noqa: PLC0415
    if codec == "raw":
      values = np.asarray(kv)
      checksum = chunk_store.values_checksum(values)
      return Encoding("raw", chunk_store.RAW_CODEC_VERSION, 0,
                      chunk_store.raw_object_key(chunk_hash, checksum), values.nbytes, checksum)
    checksum = hashlib.sha256(blob).hexdigest()
    return Encoding(codec, codecs.CURRENT_VERSION[codec], level,
                    chunk_store.encoded_object_key(chunk_hash, codec, level, checksum), len(blob),
                    checksum)

  def store_check(self, kv_L2CKH, token_ids, blobs: dict) -> dict:
    """Puts one chunk into a memory:// ChunkStore with every encoding and reads each back.

    Args:
      kv_L2CKH: the chunk's raw KV.
      token_ids: its C token ids (the first chunk of a sequence).
      blobs: {(label, codec, level): stored bytes} of the accounted encodings.

    Returns:
      The stored record's JSON size and, per label, whether the read succeeded and the stored
      object's size equals the accounted one (raw: the zarr3 values' bytes).
    """
    from kvjax.storage.backends import chunk_store
    from kvjax.storage.format import codecs, keys  # noqa: PLC0415
    from kvjax.storage.format.types import EncodedPayload  # noqa: PLC0415
    root = self.namespace.root_hash()
    h = keys.hash_chunk(root, token_ids)
    store = chunk_store.ChunkStore("memory://", name="bench")
    payloads = [EncodedPayload(codec, level, codecs.decode_payload(
        codec, codecs.CURRENT_VERSION[codec], level, blob, self.layout))
                for (_, codec, level), blob in blobs.items() if codec != "raw"]
    has_raw = any(key[1] == "raw" for key in blobs)
    if not store.put_sync(h, root, token_ids, root, np.asarray(kv_L2CKH) if has_raw else None,
                          layout=self.layout, payloads=payloads):
      raise RuntimeError("memory:// ChunkStore put failed")

    async def read_index():
      kvs = await store.kvstore()
      return (await kvs.read(chunk_store.index_key(h))).value

    out = {"record_json_bytes_all_encodings": len(chunk_store.run_sync(read_index())),
           "codecs": {}}
    for (label, codec, level), blob in blobs.items():
      hit = store.get_sync(h, token_ids, root, self.layout,
                           choose=chunk_store.choose_codec(codec, level))
      ok = hasattr(hit, "encoding")
      want = self.layout.nbytes if codec == "raw" else len(blob)
      out["codecs"][label] = {"read_ok": ok, "stored_nbytes": hit.encoding.nbytes if ok else None,
                              "nbytes_matches": ok and hit.encoding.nbytes == want}
    store.close()
    return out

  def greedy(self, first_logits, slot: int, position: int, max_new: int) -> list[int]:
    """Greedy tokens from `first_logits` (f32[V]), decode steps of sequence `slot` from
    `position`; stops at EOS, `max_new` tokens or the sequence's end."""
    from kvjax.models.runner.runner_api import SeqChunk  # noqa: PLC0415
    runner = self.runner
    eos = self.tokenizer.eos_id
    out = []
    tok = int(np.argmax(np.asarray(first_logits)))
    while True:
      out.append(tok)
      if tok == eos or len(out) >= max_new or position + 1 >= runner.max_seq_len:
        return out
      logits = runner.step([SeqChunk([tok], position, self.tables[slot])]).logits_SV
      tok = int(np.argmax(np.asarray(logits[0])))
      position += 1


# ---------------------------------------------------------------------------------------------
# One-thread timing (run inside the pinned worker process).


def time_codec(samples: dict[int, np.ndarray], codec: str, level: int, reps: int, layout,
               inv_freq: np.ndarray) -> dict:
  """Times encode and decode of real chunks, median of `reps` runs after one warm-up run.

      encode = kv_encode_host (jnp, device -> host)  + encode_payload (entropy/zstd, CRCs)
      decode = decode_payload (entropy/zstd, CRCs)   + kv_decode (dequantize, RoPE, cache write)

  Args:
    samples: {start position: f32[L, 2, C, K, H]} chunks (K before RoPE, and V).
    codec, level: the encoding.
    reps: timed repetitions per chunk.
    layout: their `KVLayout`.
    inv_freq: f32[H // 2] RoPE inverse frequencies.

  Returns:
    Per-chunk medians and totals: stored bytes, encode/decode bytes per wall second and per
    process CPU second (on a shared core the wall rate falls with other jobs' load; the CPU-time
    rate is what one unshared thread sustains), host shares and CPU/wall.
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from kvjax.storage.format import codecs  # noqa: PLC0415

  n_layers, _, c, n_kv, hd = next(iter(samples.values())).shape
  k_cache = jnp.zeros((n_layers, 1, c, n_kv, hd), jnp.float32)
  v_cache = jnp.zeros_like(k_cache)
  per_chunk = []
  wall_total = cpu_total = 0.0
  for start, kv in samples.items():
    cos, sin = rope_cos_sin(inv_freq, start, c)
    x = jax.block_until_ready(jax.device_put(kv))
    times = {"enc_device": [], "enc_host": [], "dec_host": [], "dec_device": [], "enc_cpu": [],
             "dec_cpu": []}
    blob = b""
    for rep in range(reps + 1):  # rep 0 compiles and warms up
      c0, t0 = time.process_time(), time.perf_counter()
      arrays = encode_host(x, codec, level, 0)  # decoded at position 0 below
      t1 = time.perf_counter()
      blob = codecs.encode_payload(codec, level, arrays, layout)
      t2, c2 = time.perf_counter(), time.process_time()
      dec = codecs.decode_payload(codec, codecs.CURRENT_VERSION[codec], level, blob, layout,
                                  defer_entropy=True)
      t3 = time.perf_counter()
      k_cache, v_cache = decode_arrays(dec, codec, k_cache, v_cache, 0, 0, cos, sin)
      jax.block_until_ready((k_cache, v_cache))
      t4, c4 = time.perf_counter(), time.process_time()
      if rep:
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, c2 - c0, c4 - c2)):
          times[key].append(dt)
        wall_total += t4 - t0
        cpu_total += c4 - c0
    per_chunk.append({"start": start, "stored_bytes": len(blob),
                      **{f"{k}_s": float(np.median(v)) for k, v in times.items()}})
  nbytes = sum(p["stored_bytes"] for p in per_chunk)
  enc_s = sum(p["enc_device_s"] + p["enc_host_s"] for p in per_chunk)
  dec_s = sum(p["dec_host_s"] + p["dec_device_s"] for p in per_chunk)
  return {"chunks": per_chunk, "stored_bytes": nbytes,
          "encode_bytes_per_s": nbytes / enc_s, "decode_bytes_per_s": nbytes / dec_s,
          "encode_bytes_per_cpu_s": nbytes / sum(p["enc_cpu_s"] for p in per_chunk),
          "decode_bytes_per_cpu_s": nbytes / sum(p["dec_cpu_s"] for p in per_chunk),
          "encode_s_per_chunk": enc_s / len(per_chunk),
          "decode_s_per_chunk": dec_s / len(per_chunk),
          "encode_host_share": sum(p["enc_host_s"] for p in per_chunk) / enc_s,
          "decode_host_share": sum(p["dec_host_s"] for p in per_chunk) / dec_s,
          "cpu_s_per_wall_s": cpu_total / wall_total if wall_total else None}
