"""Device check of the KV codec kernels (kvjax/kernels/kv_codec_gpu.py): compile, compare, time.

Run by scripts/device_check.sh on a GPU machine (H200 in mind; jax, absl, numpy only; its
kv_codec step runs int8 and int4 at LLaMA-3.1-8B shapes, alone with `--only kv_codec`). For the engine's two model shapes (SmolLM2-135M: 30 layers, 3 kv
heads, head dim 64; LLaMA-3.1-8B: 32 layers, 8 kv heads, head dim 128), bf16 chunks of C = 256
tokens, and every codec (int4 and int8 first, then cachegen level 1, raw), one case each:

  0. probes (once): does the Triton lowering divide f32 exactly, and does it (and XLA on the
     GPU) contract `a * b + c` into a fused multiply-add? (the arithmetic that moves codes);
  1. encode: the Triton kernel (`kv_encode`, platform "cuda") on a batch of --chunks chunks
     stacked along the kv-head axis (every codec is per layer and head, so each chunk of the
     batch is encoded as on its own), against the jnp reference run *on the CPU* on the first
     chunk (what any machine computes) and against the same reference compiled by XLA for the
     GPU on the whole batch. Per payload field: elements not bit-identical, max |difference|
     (codes in steps); decoded values' max |error| against the reference payload's.
     int4 and int8 must be bit-identical to the CPU reference (kvjax/kernels/exact_quant.py);
     cachegen sums in another order, so a code at a rounding boundary may move one step
     (<= 1e-3 of the codes) and scales by float32 rounding (<= 1e-5 relative);
  2. decode (dequant + RoPE + cache write, bf16 cache): the kernel on the batch against
     `kv_decode_reference` on the CPU on the first chunk, same payload (the kernel's): elements
     not bit-identical and max error in bf16 ulps (of the larger of the two values), K and V.
     V of raw/int8/int4 must be bit-identical (one rounding per value); K (RoPE) and cachegen's
     V at most 1 ulp (a fused multiply-add rounds once where the CPU rounds twice);
  3. time: --iters calls back to back, waited for once, median of --rounds rounds after the
     warm-up call, the kernel and the jnp reference (XLA, same GPU) side by side. GB/s of KV:
     bf16 KV bytes produced (decode) or consumed (encode) per second; also of all bytes moved
     (KV + payload). Compile seconds: first call minus a timed call, per program.

The JSON ($OUT/device_check_codec.json, else benchmarks/results/; `_cpu` with --cpu) is
rewritten after every case, so a run stopped by its time limit keeps what finished; no case
starts past --budget_s. `--cpu` runs tiny shapes in Pallas interpret mode (proof that it runs).
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
import benchlib  # noqa: E402

from kvjax.kernels import kv_codec as kc  # noqa: E402
from kvjax.kernels import kv_codec_ref as kref  # noqa: E402
from kvjax.kernels import kv_payloads as kp  # noqa: E402
from kvjax.kernels import kv_codec_gpu  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 SXM spec sheet, 4.8 TB/s

_CPU = flags.DEFINE_bool("cpu", False, "Tiny sizes in interpret mode (no accelerator needed).")
_ITERS = flags.DEFINE_integer("iters", None, "Timed calls per round (default 5; --cpu 1).")
_ROUNDS = flags.DEFINE_integer("rounds", None,
                               "Timed rounds, median reported (default 5; --cpu 1).")
_BUDGET = flags.DEFINE_float("budget_s", 170.0, "Start no new case after this many seconds.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default $OUT, else benchmarks/results).")
_ONLY = flags.DEFINE_list("cases", None, "Only these model/codec cases, e.g. smollm2_135m/int4.")

# name: (layers, kv heads, head dim, chunks per timed call). ~1.5 GB of bf16 KV per call: the
# first H200 run, at 94 and 134 MB per call, measured about 1 ms per call for the kernels and
# XLA alike, barely growing with the size (likely the host's per-call work, not HBM).
MODELS = {"smollm2_135m": (30, 3, 64, 256), "llama31_8b": (32, 8, 128, 48)}
CPU_MODEL = (2, 3, 16, 2)
INT4_BATCH_DIVISOR = 16
CHUNK, CPU_CHUNK = 256, 64
# Most informative first: int4 and int8 (exact arithmetic: kvjax/kernels/exact_quant.py), then
# cachegen, raw.
CODECS = (("int4", 0), ("int8", 0), ("cachegen", 1), ("raw", 0))


def synthetic_kv(key, shape):
  """bf16 KV with per-channel offsets and spreads (like real K)."""
  k1, k2, k3 = jax.random.split(key, 3)
  h = shape[-1]
  spread = jax.random.uniform(k2, (h,), minval=0.2, maxval=3.0)
  offset = jax.random.normal(k3, (h,)) * 2
  return (jax.random.normal(k1, shape) * spread + offset).astype(jnp.bfloat16)


def rope_tables(c, h, start=0):
  inv = 10000.0 ** (-np.arange(0, h, 2) / h)
  ang = np.arange(start, start + c)[:, None] * inv[None]
  ang = np.concatenate([ang, ang], axis=1)
  return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def nbytes(tree) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def timed(fn, iters, rounds):
  """(seconds per call, first call seconds): the first call (compile + run) alone, then `rounds`
  rounds of `iters` calls issued back to back and waited for once; the median round."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  per = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    r = None
    for _ in range(iters):
      r = fn()
    jax.block_until_ready(r)
    per.append((time.perf_counter() - t0) / iters)
  return float(np.median(per)), first


def first_chunk(x, k_):
  """The first chunk of a batch stacked along the kv-head axis: axis 3 of [L, 2, n, K, H]
  arrays, axis 2 of per-channel [L, 2, K, H] ones."""
  return x[:, :, :, :k_] if x.ndim == 5 else x[:, :, :k_]


def _codes(codec, name, a):
  a = np.asarray(a)
  if codec == "int4" and name == "q":  # nibbles, as codes
    return np.stack([a & 15, a >> 4], axis=-1).astype(np.int32)
  return a


def compare_payloads(codec, want, got) -> dict:
  """Field by field: elements not bit-identical, and the largest difference (codes: steps;
  floats: max |diff| and max relative)."""
  out = {}
  for name, a, b in zip(want._fields, want, got):
    a, b = _codes(codec, name, a), _codes(codec, name, b)
    rec = dict(size=int(a.size), mismatch=int(np.count_nonzero(
        a.view(np.uint8).reshape(a.shape + (-1,)) != b.view(np.uint8).reshape(b.shape + (-1,)))
        if a.dtype == b.dtype and a.shape == b.shape else -1))
    if rec["mismatch"] < 0:
      rec["error"] = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    elif np.issubdtype(a.dtype, np.integer):
      rec["max_step_diff"] = int(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64))))
    else:
      a32, b32 = a.astype(np.float32), b.astype(np.float32)
      d = np.abs(a32 - b32)
      rec["max_abs_diff"] = float(np.max(d))
      rec["max_rel_diff"] = float(np.max(d / np.maximum(np.abs(a32), 1e-30)))
    out[name] = rec
  return out


def compare_on_device(codec, want, got) -> dict:
  """`compare_payloads` of two device payloads, counted on the device (GB-sized batches)."""
  out = {}
  for name, a, b in zip(want._fields, want, got):
    if codec == "int4" and name == "q":
      a, b = (jnp.stack([x & 15, x >> 4], axis=-1).astype(jnp.int32) for x in (a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
      out[name] = dict(size=int(a.size), mismatch=-1,
                       error=f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
      continue
    udt = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    same = jax.lax.bitcast_convert_type(a, udt) == jax.lax.bitcast_convert_type(b, udt)
    rec = dict(size=int(a.size), mismatch=int(jnp.sum(~same)))
    if jnp.issubdtype(a.dtype, jnp.integer):
      rec["max_step_diff"] = int(jnp.max(jnp.abs(a.astype(jnp.int32) - b.astype(jnp.int32))))
    else:
      d = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
      rec["max_abs_diff"] = float(jnp.max(d))
      rec["max_rel_diff"] = float(jnp.max(d / jnp.maximum(jnp.abs(a.astype(jnp.float32)),
                                                          1e-30)))
    out[name] = rec
  return out


def payload_ok(codec, fields) -> bool:
  if codec in ("int4", "int8", "raw"):  # kvjax/kernels/exact_quant.py: the same bytes anywhere
    return all(f["mismatch"] == 0 for f in fields.values())
  ok = True
  for f in fields.values():
    if f["mismatch"] < 0:
      return False
    if "max_step_diff" in f:
      ok &= f["max_step_diff"] <= 1 and f["mismatch"] <= max(1, f["size"] // 1000)
    else:
      ok &= f["max_rel_diff"] <= 1e-5
  return ok


def compare_kv(want, got) -> dict:
  """bf16 (or any float) arrays: elements not bit-identical, max |err|, max err in ulps of the
  dtype at the larger magnitude (values under 2**-20 of the largest count as that)."""
  w, g = np.asarray(want).astype(np.float32), np.asarray(got).astype(np.float32)
  mant = {np.dtype(jnp.bfloat16): 7, np.dtype(np.float16): 10, np.dtype(np.float32): 23}[
      np.dtype(np.asarray(want).dtype)]
  d = np.abs(w - g)
  floor = max(float(np.max(np.abs(w))), 1e-30) * 2 ** -20
  mag = np.maximum(np.maximum(np.abs(w), np.abs(g)), floor)
  ulp = np.exp2(np.floor(np.log2(mag)) - mant)
  same = (np.asarray(want).view(np.uint16 if mant < 23 else np.uint32)
          == np.asarray(got).view(np.uint16 if mant < 23 else np.uint32))
  return dict(size=int(w.size), mismatch=int(np.count_nonzero(~same)),
              max_abs_err=float(np.max(d)), max_ulps=float(np.max(d / ulp)),
              finite=bool(np.all(np.isfinite(g))))


def probes(interpret) -> dict:
  """What the Triton lowering (and XLA on this device) does with f32 division and a * b + c."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  out = {}
  n = 1 << 16 if not interpret else 1 << 10
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.uniform(-100, 100, n).astype(np.float32))
  b = jnp.asarray(rng.uniform(0.01, 10, n).astype(np.float32))
  exact = (np.asarray(a, np.float64) / np.asarray(b, np.float64)).astype(np.float32)

  def div_kernel(a_ref, b_ref, o_ref):
    o_ref[...] = a_ref[...] / b_ref[...]

  blk = pl.BlockSpec((1024,), lambda i: (i,))
  tri = pl.pallas_call(div_kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                       grid=(n // 1024,), in_specs=[blk, blk], out_specs=blk,
                       compiler_params=kv_codec_gpu.triton_params(), interpret=interpret)(a, b)
  xla = jax.jit(lambda a, b: a / b)(a, b)
  out["div_triton_not_ieee"] = int(np.count_nonzero(np.asarray(tri) != exact))
  out["div_xla_not_ieee"] = int(np.count_nonzero(np.asarray(xla) != exact))
  out["div_values"] = n
  # a * b + c with a = b = 1 + 2**-12, c = -(1 + 2**-11): a * b rounds to 1 + 2**-11 (the 2**-24
  # tail is a tie to even), so the sum is 0 unless fused (then 2**-24).
  v = jnp.full((128,), 1 + 2 ** -12, jnp.float32)
  c = jnp.full((128,), -(1 + 2 ** -11), jnp.float32)

  def fma_kernel(a_ref, b_ref, c_ref, o_ref):
    o_ref[...] = a_ref[...] * b_ref[...] + c_ref[...]

  tri = pl.pallas_call(fma_kernel, out_shape=jax.ShapeDtypeStruct((128,), jnp.float32),
                       compiler_params=kv_codec_gpu.triton_params(), interpret=interpret)(v, v, c)
  xla = jax.jit(lambda a, b, c: a * b + c)(v, v, c)
  out["fma_triton_contracts"] = bool(np.asarray(tri)[0] != 0)
  out["fma_xla_contracts"] = bool(np.asarray(xla)[0] != 0)
  return out


def run_case(model, codec, level, interpret, iters, rounds) -> dict:
  num_layers, k_, h_, chunks = MODELS[model] if not interpret else CPU_MODEL
  c = CHUNK if not interpret else CPU_CHUNK
  if codec == "int4" and not interpret:
    # int4's clipping search holds every candidate's codes at once in XLA's GPU reference:
    # ~1.5 GB of KV asked for 43-46 GiB on the H200 (out of memory), so int4 times 1/16 of it.
    chunks = max(1, chunks // INT4_BATCH_DIVISOR)
  cpu = jax.devices("cpu")[0]
  rec = dict(model=model, codec=codec, level=level, layers=num_layers, kv_heads=k_, head_dim=h_,
             chunk=c, chunks_per_call=chunks, kv_dtype="bfloat16", compile_s={}, timing={})
  x = synthetic_kv(jax.random.PRNGKey(0), (num_layers, 2, c, k_ * chunks, h_))
  x_cpu = jax.device_put(first_chunk(x, k_), cpu)
  cos, sin = rope_tables(c, h_, start=c)
  kv_bytes = nbytes(x)

  def enc(use_pallas):
    return kc.kv_encode(x, codec, level, interpret=interpret, use_pallas=use_pallas,
                        platform="cuda")[0]

  # 1. encode (raw: the payload is the chunk)
  if codec != "raw":
    e_s, first = timed(lambda: enc(True), iters, rounds)
    rec["compile_s"]["encode_pallas"] = round(first - e_s, 3)
    rec["timing"]["encode_pallas_s"] = e_s
    got = enc(True)
    with jax.default_device(cpu):
      want_cpu = kref.encode_reference(x_cpu, codec, level)
    enc_rec = dict(vs_cpu_reference=compare_payloads(
        codec, want_cpu, [first_chunk(a, k_) for a in got]))
    e_s, first = timed(lambda: enc(False), iters, rounds)
    rec["compile_s"]["encode_jnp"] = round(first - e_s, 3)
    rec["timing"]["encode_jnp_reference_s"] = e_s
    enc_rec["vs_gpu_reference"] = compare_on_device(codec, enc(False), got)
    # Decoded values of the kernel's payload against the CPU reference payload's.
    with jax.default_device(cpu):
      mine = kc.payload_from_arrays(codec, {n: np.asarray(first_chunk(a, k_))
                                            for n, a in zip(got._fields, got)})
      dq_got = np.asarray(kref.dequantize_reference(mine))
      dq_want = np.asarray(kref.dequantize_reference(want_cpu))
    xf = np.asarray(x_cpu, np.float32)
    rel = lambda dq: float(np.linalg.norm(dq - xf) / np.linalg.norm(xf))
    enc_rec.update(decoded_max_abs_diff=float(np.max(np.abs(dq_got - dq_want))),
                   rel_l2_err_kernel=rel(dq_got), rel_l2_err_cpu_reference=rel(dq_want))
    enc_rec["ok"] = payload_ok(codec, enc_rec["vs_cpu_reference"])
    rec["encode"] = enc_rec
    payload = got
  else:
    payload = kp.RawPayload(x)
  rec["payload_bytes_per_call"] = nbytes(payload)
  rec["kv_bytes_per_call"] = kv_bytes
  # 2. decode into a bf16 cache holding exactly the batch (slot 0, positions [0, C))
  shape = (num_layers, 1, c, k_ * chunks, h_)
  state = {True: [jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)],
           False: [jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)]}

  def dec(use_pallas):
    st = state[use_pallas]
    st[0], st[1] = kc.kv_decode(payload, st[0], st[1], 0, 0, cos, sin, interpret=interpret,
                                use_pallas=use_pallas, platform="cuda")
    return st[0]

  d_s, first = timed(lambda: dec(True), iters, rounds)
  rec["compile_s"]["decode_pallas"] = round(first - d_s, 3)
  rec["timing"]["decode_pallas_s"] = d_s
  got_k = np.asarray(first_chunk(state[True][0][:, 0], k_))
  got_v = np.asarray(first_chunk(state[True][1][:, 0], k_))
  with jax.default_device(cpu):
    p1 = kc.payload_from_arrays(codec, {n: np.asarray(first_chunk(a, k_))
                                        for n, a in zip(payload._fields, payload)})
    c1 = jnp.zeros((num_layers, 1, c, k_, h_), jnp.bfloat16)
    ref_k, ref_v = kref.kv_decode_reference(p1, c1, c1, 0, 0, jnp.asarray(cos), jnp.asarray(sin))
  dk, dv = compare_kv(ref_k[:, 0], got_k), compare_kv(ref_v[:, 0], got_v)
  exact_v = codec in ("raw", "int8", "int4")
  rec["decode"] = dict(k=dk, v=dv, ok=bool(dk["max_ulps"] <= 1.0 and dk["finite"] and dv["finite"]
                                          and (dv["mismatch"] == 0 if exact_v
                                               else dv["max_ulps"] <= 1.0)))
  d_s, first = timed(lambda: dec(False), iters, rounds)
  rec["compile_s"]["decode_jnp"] = round(first - d_s, 3)
  rec["timing"]["decode_jnp_reference_s"] = d_s
  # 3. bandwidth
  t = rec["timing"]
  for key in list(t):
    if key.endswith("_s"):
      t[key[:-2] + "_kv_GB_per_s"] = kv_bytes / t[key] / 1e9
      t[key[:-2] + "_total_GB_per_s"] = (kv_bytes + rec["payload_bytes_per_call"]) / t[key] / 1e9
  rec["ok"] = rec["decode"]["ok"] and rec.get("encode", {"ok": True})["ok"]
  return rec


def _fmt(v, spec="9.1f"):
  return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(result):
  print(f"kv codecs on {result['devices'][0]} (jax {result['jax']}); interpret="
        f"{result['interpret']}; probes: {json.dumps(result.get('probes'))}")
  print(f"  {'model':13s} {'codec':9s} {'enc mism':>9s} {'dec K ulps':>10s} {'V mism':>7s} "
        f"{'dec GB/s':>9s} {'(jnp)':>8s} {'enc GB/s':>9s} {'(jnp)':>8s} {'compile s':>9s} ok")
  for r in result["cases"]:
    t = r.get("timing", {})
    enc = r.get("encode", {}).get("vs_cpu_reference")
    mism = sum(f["mismatch"] for f in enc.values()) if enc else None
    dec = r.get("decode", {})
    comp = sum(r.get("compile_s", {}).values()) if r.get("compile_s") else None
    print(f"  {r['model']:13s} {r['codec']:9s} {_fmt(mism, '9d'):>9s} "
          f"{_fmt(dec.get('k', {}).get('max_ulps'), '10.2f'):>10s} "
          f"{_fmt(dec.get('v', {}).get('mismatch'), '7d'):>7s} "
          f"{_fmt(t.get('decode_pallas_kv_GB_per_s')):>9s} "
          f"{_fmt(t.get('decode_jnp_reference_kv_GB_per_s'), '8.1f'):>8s} "
          f"{_fmt(t.get('encode_pallas_kv_GB_per_s')):>9s} "
          f"{_fmt(t.get('encode_jnp_reference_kv_GB_per_s'), '8.1f'):>8s} "
          f"{_fmt(comp, '9.1f'):>9s} {'OK' if r['ok'] else 'FAIL ' + r.get('error', '')[:100]}")
  if result["skipped"]:
    print(f"  skipped past the budget: {result['skipped']}")


def main(argv):
  del argv
  start = time.time()
  interpret = _CPU.value
  if not interpret and jax.default_backend() != "gpu":
    raise SystemExit(f"no GPU (backend {jax.default_backend()}); use --cpu for interpret mode")
  iters = _ITERS.value or (1 if interpret else 5)
  rounds = _ROUNDS.value or (1 if interpret else 5)
  cases, skipped = [], []
  out_dir = pathlib.Path(_OUT.value or os.environ.get("OUT") or REPO / "benchmarks" / "results")
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / ("device_check_codec_cpu.json" if interpret else "device_check_codec.json")
  result = dict(**benchlib.provenance(), script="scripts/device_check_codec.py",
                jax=jax.__version__, backend=jax.default_backend(),
                devices=[str(d) for d in jax.devices()], interpret=interpret, iters=iters,
                rounds=rounds, cache_dtype="bfloat16", cases=cases, skipped=skipped)

  def write():
    result["wall_s"] = round(time.time() - start, 1)
    benchlib.write_json(path, result)

  try:
    result["probes"] = probes(interpret)
  except Exception as e:  # pylint: disable=broad-except
    result["probes"] = {"error": f"{type(e).__name__}: {e}"[:1000]}
  print(f"probes: {json.dumps(result['probes'])}", flush=True)
  write()
  order = [(m, codec, level) for codec, level in CODECS for m in MODELS]
  if interpret:
    order = [(m, codec, level) for m, codec, level in order if m == "smollm2_135m"]
  if _ONLY.value:
    order = [o for o in order if f"{o[0]}/{o[1]}" in _ONLY.value]
  for model, codec, level in order:
    if time.time() - start > _BUDGET.value:
      skipped.append(f"{model}/{codec}")
      write()
      continue
    t0 = time.time()
    try:
      rec = run_case(model, codec, level, interpret, iters, rounds)
    except Exception as e:  # pylint: disable=broad-except
      rec = dict(model=model, codec=codec, level=level, ok=False,
                 error=f"{type(e).__name__}: {e}"[:2000],
                 traceback=traceback.format_exc()[-4000:])
      print(f"{model}/{codec} FAILED: {rec['error'][:400]}", flush=True)
    rec["wall_s"] = round(time.time() - t0, 1)
    cases.append(rec)
    write()  # after every case: a run stopped by its time limit keeps what it measured
    print(f"{model}/{codec} done in {rec['wall_s']} s ok={rec['ok']} "
          f"encode={json.dumps(rec.get('encode'))} decode={json.dumps(rec.get('decode'))} "
          f"compile_s={json.dumps(rec.get('compile_s'))} timing={json.dumps(rec.get('timing'))}",
          flush=True)
  write()
  print_table(result)
  print(f"wrote {path} in {result['wall_s']} s")
  if not all(r["ok"] for r in cases):
    raise SystemExit("codec device check FAILED")


if __name__ == "__main__":
  app.run(main)
