"""Device check of the KV codec kernels (kvjax/kernels/kv_codec_gpu.py): compile, compare, time.

Run by scripts/device_check.sh on a GPU machine (H200 in mind; jax, absl, numpy only). For the
engine's two model shapes, bf16 chunks of C = 256 tokens (SmolLM2-135M: 30 layers, 3 kv heads,
head dim 64; LLaMA-3.1-8B: 32 layers, 8 kv heads, head dim 128) and every codec (raw, int8, int4,
cachegen level 1):
  1. encode: the Triton kernel (`kv_encode`, platform "cuda", compiled; interpreted with --cpu) against the jnp reference
     on the same device, field by field: codes identical but for at most one step at a rounding
     boundary (share of codes that differ <= 1e-3), scales within 1e-5 relative; int4 may
     instead match the reference's reconstruction error within 0.1% (its clipping search picks
     the least-error candidate; near-equal candidates can flip with the last bit of arithmetic);
  2. decode (dequant + RoPE + cache write): `kv_decode` against `kv_decode_reference` on the same
     device, bf16 cache: max |err| in bf16 ulps of the reference value (<= 1: f32 arithmetic that
     differs in its last bit, e.g. by FMA contraction, may round to the neighbouring bf16);
  3. time: --iters calls issued back to back, waited for once (median of 3 rounds), each on a
     batch of --chunks chunks stacked along the layer axis (one launch; a single chunk is a few
     microseconds of work, below the dispatch cost), Pallas
     and the jnp reference (XLA-fused) side by side. GB/s counts payload bytes read + bf16 KV
     bytes written (decode) or bf16 KV read + payload written (encode).
Each (model, codec) case is guarded: a failure is recorded and the rest go on; no new case starts
past --budget_s; the JSON is rewritten after every case. JSON to $OUT/device_check_codec.json (or benchmarks/results/; `_cpu` with
--cpu); a table is printed. `--cpu` runs tiny shapes in Pallas interpret mode.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/benchlib.py
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))  # the kvjax package
from benchlib import git_sha, machine  # noqa: E402

from kvjax.kernels import kv_codec as kc  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 SXM spec sheet, 4.8 TB/s

_CPU = flags.DEFINE_bool("cpu", False, "Tiny sizes in interpret mode (no accelerator needed).")
_ITERS = flags.DEFINE_integer("iters", None, "Timed calls per case (default 20; --cpu 1).")
_CHUNKS = flags.DEFINE_integer("chunks", None, "Chunks per timed call (default 8; --cpu 1).")
_BUDGET = flags.DEFINE_float("budget_s", 100.0, "Start no new case after this many seconds.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default $OUT, else benchmarks/results).")

MODELS = {"smollm2_135m": (30, 3, 64), "llama31_8b": (32, 8, 128)}  # layers, kv heads, head dim
CHUNK = 256
CODECS = (("raw", 0), ("int8", 0), ("int4", 0), ("cachegen", 1))


def synthetic_kv(key, shape):
  """bf16 KV with per-channel offsets and spreads (like real K) on the default device."""
  k1, k2, k3 = jax.random.split(key, 3)
  h = shape[-1]
  spread = jax.random.uniform(k2, (h,), minval=0.2, maxval=3.0)
  offset = jax.random.normal(k3, (h,)) * 2
  return (jax.random.normal(k1, shape) * spread + offset).astype(jnp.bfloat16)


def rope_tables(c, h, start=0):
  inv = 10000.0 ** (-np.arange(0, h, 2) / h)
  ang = np.arange(start, start + c)[:, None] * inv[None]
  ang = np.concatenate([ang, ang], axis=1)
  return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def median_s(fn, iters):
  """(seconds per call, first call seconds incl. compile): `iters` calls issued back to back
  (dispatch runs ahead of the device) and waited for once, median of 3 such rounds."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  rounds = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(iters):
      r = fn()
    jax.block_until_ready(r)
    rounds.append((time.perf_counter() - t0) / iters)
  return float(np.median(rounds)), first


def nbytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def compare_payloads(codec, want, got, x) -> dict:
  """Field by field: codes (max step difference, share that differs), scales (max relative
  error); int4 also the reconstruction error of each payload (its clipping search picks the
  least-error candidate, and near-equal candidates may flip with the arithmetic's last bit)."""
  out = {"fields": {}}
  for name, a, b in zip(want._fields, want, got):
    a32, b32 = jnp.asarray(a).astype(jnp.float32), jnp.asarray(b).astype(jnp.float32)
    if codec == "int4" and name == "q":
      a32 = kc._unpack_int4(a).astype(jnp.float32)  # pylint: disable=protected-access
      b32 = kc._unpack_int4(b).astype(jnp.float32)  # pylint: disable=protected-access
    diff = jnp.abs(a32 - b32)
    if jnp.issubdtype(a.dtype, jnp.integer):
      out["fields"][name] = dict(code_diff_max=int(jnp.max(diff)),
                                 code_diff_share=float(jnp.mean(diff > 0)))
    else:
      out["fields"][name] = dict(rel_err_max=float(jnp.max(diff / jnp.maximum(jnp.abs(a32),
                                                                              1e-30))),
                                 differ_share=float(jnp.mean(diff > 0)))
  codes_ok = all(f.get("code_diff_max", 0) <= 1 and f.get("code_diff_share", 0) <= 1e-3
                 for f in out["fields"].values())
  scales_ok = all(f.get("rel_err_max", 0) <= 1e-5 for f in out["fields"].values())
  out["exact_or_one_step"] = codes_ok and scales_ok
  xf = x.astype(jnp.float32)
  err = lambda p: float(jnp.sum(jnp.square(kc.dequantize_reference(p) - xf)))
  out["sq_err_reference"], out["sq_err_kernel"] = err(want), err(got)
  out["sq_err_ratio"] = out["sq_err_kernel"] / max(out["sq_err_reference"], 1e-30)
  # int4: accepted when its reconstruction is as good (the payload may differ where the search
  # met near-ties); the other codecs: codes equal but for one step at a rounding boundary.
  out["ok"] = out["exact_or_one_step"] or (codec == "int4" and out["sq_err_ratio"] <= 1.001)
  return out


def bf16_ulps(want, got) -> float:
  """max |got - want| in bf16 ulps of want (2**(exponent - 7); |want| taken >= 1e-30)."""
  w, g = want.astype(jnp.float32), got.astype(jnp.float32)
  ulp = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum(jnp.abs(w), 1e-30))) - 7)
  return float(jnp.max(jnp.abs(g - w) / ulp))


def run_case(model, codec, level, interpret, iters, chunks) -> dict:
  num_layers, k_, h_ = MODELS[model] if not interpret else (2, 3, 16)
  c = CHUNK if not interpret else 64
  rec = dict(model=model, codec=codec, level=level, layers=num_layers, kv_heads=k_, head_dim=h_,
             chunk=c, chunks_per_call=chunks)
  key = jax.random.PRNGKey(0)
  x = synthetic_kv(key, (num_layers, 2, c, k_, h_))
  cos, sin = rope_tables(c, h_, start=c)
  # 1. encode
  want = kc.encode_reference(x, codec, level)
  if codec != "raw":
    t0 = time.perf_counter()
    got, finite = kc.kv_encode(x, codec, level, interpret=interpret, platform="cuda")
    jax.block_until_ready(got)
    rec["encode_first_call_s"] = round(time.perf_counter() - t0, 3)
    rec["encode"] = dict(compare_payloads(codec, want, got, x), finite=bool(finite))
  # 2. decode into a bf16 cache: slot 1, positions [c, 2c)
  cache = jnp.zeros((num_layers, 2, 4 * c, k_, h_), jnp.bfloat16)
  ref_k, ref_v = kc.kv_decode_reference(want, cache, cache, 1, c, cos, sin)
  t0 = time.perf_counter()
  got_k, got_v = kc.kv_decode(want, jnp.copy(cache), jnp.copy(cache), 1, c, cos, sin,
                              interpret=interpret, platform="cuda")
  jax.block_until_ready(got_k)
  rec["decode_first_call_s"] = round(time.perf_counter() - t0, 3)
  ulps_k, ulps_v = bf16_ulps(ref_k, got_k), bf16_ulps(ref_v, got_v)
  rec["decode"] = dict(max_err_bf16_ulps_k=ulps_k, max_err_bf16_ulps_v=ulps_v,
                       ok=max(ulps_k, ulps_v) <= 1.0)
  del ref_k, ref_v, got_k, got_v
  # 3. timing on `chunks` chunks stacked along L (one launch each way)
  xb = jnp.concatenate([x] * chunks, axis=0)
  payload = kc.encode_reference(xb, codec, level)
  kv_bytes = nbytes(xb)
  pay_bytes = nbytes(payload)
  rec.update(kv_bytes_per_call=kv_bytes, payload_bytes_per_call=pay_bytes)
  big = [jnp.zeros((num_layers * chunks, 1, c, k_, h_), jnp.bfloat16) for _ in range(2)]
  timing = {}
  for name, use_pallas in (("pallas", True), ("jnp_reference", False)):
    state = {"k": big[0], "v": big[1]}

    def dec(u=use_pallas, st=state):
      st["k"], st["v"] = kc.kv_decode(payload, st["k"], st["v"], 0, 0, cos, sin,
                                      interpret=interpret, use_pallas=u, platform="cuda")
      return st["k"]

    d_s, _ = median_s(dec, iters)
    timing[f"decode_{name}_s"] = d_s
    timing[f"decode_{name}_GB_per_s"] = (pay_bytes + kv_bytes) / d_s / 1e9
    big = [state["k"], state["v"]]
    if codec != "raw":
      e_s, _ = median_s(lambda u=use_pallas: kc.kv_encode(
          xb, codec, level, interpret=interpret, use_pallas=u, platform="cuda")[0], iters)
      timing[f"encode_{name}_s"] = e_s
      timing[f"encode_{name}_GB_per_s"] = (pay_bytes + kv_bytes) / e_s / 1e9
  rec["timing"] = timing
  rec["ok"] = rec["decode"]["ok"] and rec.get("encode", {"ok": True})["ok"]
  return rec


def main(argv):
  del argv
  start = time.time()
  interpret = _CPU.value
  if not interpret and jax.default_backend() != "gpu":
    raise SystemExit(f"no GPU (backend {jax.default_backend()}); use --cpu for interpret mode")
  iters = _ITERS.value or (1 if interpret else 20)
  chunks = _CHUNKS.value or (1 if interpret else 8)
  cases, skipped = [], []
  out_dir = pathlib.Path(_OUT.value or os.environ.get("OUT") or REPO / "benchmarks" / "results")
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / ("device_check_codec_cpu.json" if interpret else "device_check_codec.json")
  result = dict(script="scripts/device_check_codec.py", git_sha=git_sha(), machine=machine(),
                jax=jax.__version__, backend=jax.default_backend(),
                devices=[str(d) for d in jax.devices()], interpret=interpret, iters=iters,
                chunks_per_call=chunks, cache_dtype="bfloat16", cases=cases, skipped=skipped)
  models = list(MODELS)[:1] if interpret else list(MODELS)
  for model in models:
    for codec, level in CODECS:
      if time.time() - start > _BUDGET.value:
        skipped.append(f"{model}/{codec}")
        continue
      t0 = time.time()
      try:
        rec = run_case(model, codec, level, interpret, iters, chunks)
      except Exception as e:  # pylint: disable=broad-except
        rec = dict(model=model, codec=codec, level=level, ok=False,
                   error=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-4000:])
        print(f"{model}/{codec} FAILED: {rec['error'][:400]}", flush=True)
      rec["wall_s"] = round(time.time() - t0, 1)
      cases.append(rec)
      # Written after every case: a sub-check stopped by its time limit keeps what it measured.
      result["wall_s"] = round(time.time() - start, 1)
      path.write_text(json.dumps(result, indent=1) + "\n")
      print(f"{model}/{codec} done in {rec['wall_s']} s ok={rec['ok']} "
            f"encode={json.dumps(rec.get('encode'))} decode={json.dumps(rec.get('decode'))} "
            f"timing={json.dumps(rec.get('timing'))}", flush=True)
  result["wall_s"] = round(time.time() - start, 1)
  path.write_text(json.dumps(result, indent=1) + "\n")

  print(f"kv codecs on {result['devices'][0]} (jax {jax.__version__}); interpret={interpret}; "
        f"{chunks} chunks of {CHUNK if not interpret else 64} tokens per timed call")
  print(f"  {'model':13s} {'codec':9s} {'enc err x':>10s} {'dec ulps':>8s} {'dec GB/s':>9s} "
        f"{'(jnp)':>8s} {'enc GB/s':>9s} {'(jnp)':>8s} ok")
  for r in cases:
    t = r.get("timing", {})
    enc = r.get("encode", {})
    fmt = lambda v: f"{v:9.1f}" if isinstance(v, float) else f"{'-':>9s}"
    print(f"  {r['model']:13s} {r['codec']:9s} "
          f"{format(enc['sq_err_ratio'], '.5f') if enc else '-':>10s} "
          f"{max(r.get('decode', {}).get('max_err_bf16_ulps_k', float('nan')), r.get('decode', {}).get('max_err_bf16_ulps_v', float('nan'))):8.2f} "
          f"{fmt(t.get('decode_pallas_GB_per_s'))} {fmt(t.get('decode_jnp_reference_GB_per_s'))[1:]} "
          f"{fmt(t.get('encode_pallas_GB_per_s'))} {fmt(t.get('encode_jnp_reference_GB_per_s'))[1:]} "
          f"{'OK' if r['ok'] else 'FAIL ' + r.get('error', '')[:80]}")
  if skipped:
    print(f"  skipped past the budget: {skipped}")
  print(f"wrote {path} in {result['wall_s']} s")
  if not all(r["ok"] for r in cases):
    raise SystemExit("codec device check FAILED")


if __name__ == "__main__":
  app.run(main)
