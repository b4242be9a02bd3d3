"""Device check of the paged attention kernels: compile, compare, measure HBM bandwidth.

Run by scripts/device_check.sh on a GPU machine (H200 in mind; jax, absl, numpy only: this
imports `kvjax.kernels.paged_attention` and nothing heavier). Steps:
  1. correctness: the GPU Pallas kernel compiled (interpret=False) against the jnp reference on
     mixed decode + prefill batches over NaN-filled pools and shuffled block tables, f32 and bf16,
     GQA G = 4 (LLaMA) and G = 3 (SmolLM2);
  2. bandwidth: decode attention (q_len 1) of a LLaMA-3.1-8B-shaped random pool (32 q heads, 8 kv
     heads, head dim 128, bf16, 16-token blocks) at 4K-32K context and batch 1/8/32; achieved
     bandwidth = bytes of K and V read (batch * context * K * H * 2 * 2 bytes) / median time;
  3. a small sweep of block sizes at one shape, so a later session can retune the defaults.
Every step stops early past --budget_s (default 240 s), so the whole run stays under 5 minutes.
JSON goes to $OUT/device_check.json if $OUT is set, else benchmarks/results/; a table is printed.
`--cpu` runs the same code at tiny sizes in Pallas interpret mode (proof that it runs).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/benchlib.py
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))  # the kvjax package
import benchlib  # noqa: E402

from kvjax.kernels import paged_attention as pa  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 SXM spec sheet, 4.8 TB/s

_CPU = flags.DEFINE_bool("cpu", False, "Tiny sizes in interpret mode (no accelerator needed).")
_CONTEXTS = flags.DEFINE_list("contexts", None, "Decode context lengths (default 4096,8192,"
                              "16384,32768; --cpu 64,128).")
_BATCHES = flags.DEFINE_list("batches", None, "Decode batch sizes (default 1,8,32; --cpu 1,2).")
_ITERS = flags.DEFINE_integer("iters", None, "Timed calls per shape (default 20; --cpu 2).")
_BUDGET = flags.DEFINE_float("budget_s", 240.0, "Stop starting new measurements after this.")
_SWEEP = flags.DEFINE_bool("sweep", True, "Sweep kv step, warps and splits at one shape.")
_OUT = flags.DEFINE_string("out", None, "Output folder (default $OUT, else benchmarks/results).")

BLOCK = 16
LLAMA_HEADS = (32, 8, 128)   # N, K, H of LLaMA-3.1-8B
SMOLLM_HEADS = (9, 3, 64)    # SmolLM2-135M


def random_batch(key, seqs, heads, dtype, *, block=BLOCK, nan_pool=True):
  """A ragged batch `[(q_len, context), ...]` over a shuffled, NaN-padded pool `[P, B, K * H]`
  (the engine's folded layout on a GPU; device arrays)."""
  n_, k_, h_ = heads
  q_lens = np.array([q for q, _ in seqs], np.int32)
  ctx = np.array([c for _, c in seqs], np.int32)
  need = -(-ctx // block)
  num_blocks = int(need.sum()) + 4
  rng = np.random.default_rng(0)
  perm = rng.permutation(num_blocks).astype(np.int32)
  bt = np.zeros((len(seqs), int(need.max())), np.int32)
  valid = np.zeros((num_blocks, block), bool)
  c = 0
  for s, nb in enumerate(need):
    bt[s, :nb] = perm[c:c + nb]
    c += nb
    for p in range(0, ctx[s], block):
      valid[bt[s, p // block], : min(block, ctx[s] - p)] = True
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  kq, kk, kv = jax.random.split(key, 3)
  shape = (num_blocks, block, k_, h_)
  k_pool = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
  v_pool = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
  if nan_pool:
    mask = jnp.asarray(valid)[:, :, None, None]
    k_pool, v_pool = (jnp.where(mask, x, jnp.nan).astype(dtype) for x in (k_pool, v_pool))
  # The engine's pool on a GPU: heads folded into the last axis, [P, B, K * H] (`PoolLayout`).
  k_pool, v_pool = (x.reshape(num_blocks, block, k_ * h_) for x in (k_pool, v_pool))
  q = jax.random.normal(kq, (int(qsl[-1]), n_, h_), jnp.float32).astype(dtype)
  return (q, k_pool, v_pool, jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(qsl),
          jnp.int32(len(seqs)))


def check_correctness(interpret: bool, deadline: float) -> list[dict]:
  """GPU kernel vs reference on mixed batches; returns one record per case."""
  key = jax.random.PRNGKey(0)
  mixed = [(1, 1), (1, 15), (1, 16), (1, 17), (37, 37), (5, 300), (1, 1000), (64, 700)]
  if interpret:
    mixed = [(1, 1), (1, 17), (9, 40), (3, 33)]
  out = []
  for heads in (LLAMA_HEADS, SMOLLM_HEADS):
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)):
      if time.time() > deadline:
        break
      args = random_batch(key, mixed, heads, dtype)
      t0 = time.time()
      got = jax.block_until_ready(pa.paged_attention_gpu(*args, interpret=interpret))
      compile_s = time.time() - t0
      with jax.default_matmul_precision("highest"):  # no TF32 in the f32 reference
        want = pa.paged_attention_reference(*args)
      err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
      finite = bool(jnp.isfinite(got.astype(jnp.float32)).all())
      out.append(dict(heads=list(heads), dtype=jnp.dtype(dtype).name, seqs=mixed,
                      max_abs_err=err, tol=tol, finite=finite, ok=finite and err <= tol,
                      first_call_s=round(compile_s, 3)))
  return out


def time_decode(args, iters: int, **kw) -> tuple[float, float]:
  """(median seconds per call, first-call seconds incl. compile) of the GPU kernel."""
  f = jax.jit(lambda *a: pa.paged_attention_gpu(*a, **kw))
  t0 = time.time()
  jax.block_until_ready(f(*args))
  first = time.time() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), first


def auto_splits(batch: int, context: int, num_kv_heads: int, sms: int = 132) -> int:
  """kv splits so the grid has about 2 programs per SM, each with at least 512 tokens."""
  want = max(1, (2 * sms) // (batch * num_kv_heads))
  return int(min(want, max(1, context // 512), 32))


def measure(args, batch, context, heads, iters, interpret, **kw) -> dict:
  _, k_, h_ = heads
  kv_bytes = batch * context * k_ * h_ * 2 * args[1].dtype.itemsize
  med_s, first_s = time_decode(args, iters, interpret=interpret, **kw)
  return dict(batch=batch, context=context, kv_bytes=kv_bytes, median_s=med_s,
              first_call_s=round(first_s, 3), bytes_per_s=kv_bytes / med_s,
              frac_h200_peak=kv_bytes / med_s / H200_HBM_BYTES_PER_S, **kw)


def main(argv):
  del argv
  start = time.time()
  deadline = start + _BUDGET.value
  interpret = _CPU.value
  if not interpret and jax.default_backend() != "gpu":
    raise SystemExit(f"no GPU (backend {jax.default_backend()}); use --cpu for interpret mode")
  contexts = [int(x) for x in (_CONTEXTS.value or
                               (["64", "128"] if interpret else ["4096", "8192", "16384",
                                                                  "32768"]))]
  batches = [int(x) for x in (_BATCHES.value or (["1", "2"] if interpret else ["1", "8", "32"]))]
  iters = _ITERS.value or (2 if interpret else 20)
  heads = (8, 2, 32) if interpret else LLAMA_HEADS
  result = dict(**benchlib.provenance(), script="scripts/device_check.py",
                jax=jax.__version__, backend=jax.default_backend(),
                devices=[str(d) for d in jax.devices()], interpret=interpret,
                block_size=BLOCK, heads=list(heads), dtype="bfloat16")

  result["correctness"] = check_correctness(interpret, deadline)
  bandwidth, skipped = [], []
  key = jax.random.PRNGKey(1)
  for context in contexts:
    for batch in batches:
      if time.time() > deadline:
        skipped.append(dict(batch=batch, context=context))
        continue
      args = random_batch(key, [(1, context)] * batch, heads, jnp.bfloat16, nan_pool=False)
      bandwidth.append(measure(args, batch, context, heads, iters, interpret,
                               num_kv_splits=auto_splits(batch, context, heads[1])))
      del args
  result["bandwidth"], result["skipped"] = bandwidth, skipped

  sweep = []
  if _SWEEP.value:
    batch, context = batches[min(1, len(batches) - 1)], contexts[-1]
    args = random_batch(key, [(1, context)] * batch, heads, jnp.bfloat16, nan_pool=False)
    base = auto_splits(batch, context, heads[1])
    for kv_tokens in (64, 128):
      for warps in (4, 8):
        for splits in sorted({max(1, base // 2), base, base * 2}):
          if time.time() > deadline:
            break
          sweep.append(measure(args, batch, context, heads, iters, interpret,
                               kv_tokens_per_step=kv_tokens, num_warps=warps,
                               num_kv_splits=splits))
  result["sweep"] = sweep
  result["wall_s"] = round(time.time() - start, 1)

  out_dir = pathlib.Path(_OUT.value or os.environ.get("OUT") or REPO / "benchmarks" / "results")
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / ("device_check_cpu.json" if interpret else "device_check.json")
  benchlib.write_json(path, result)

  print(f"jax {jax.__version__} on {result['devices'][0]}; interpret={interpret}")
  print("correctness (GPU kernel vs reference):")
  for c in result["correctness"]:
    print(f"  heads {c['heads']} {c['dtype']:8s} max|err| {c['max_abs_err']:.2e} (tol "
          f"{c['tol']:.0e}) finite={c['finite']} {'OK' if c['ok'] else 'FAIL'}")
  print(f"decode attention, heads {list(heads)}, bf16, block {BLOCK}:")
  print(f"  {'batch':>5} {'context':>7} {'splits':>6} {'KV MB':>8} {'us':>9} {'GB/s':>8} "
        f"{'of peak':>7}")
  for r in bandwidth + sweep:
    print(f"  {r['batch']:5d} {r['context']:7d} {r['num_kv_splits']:6d} "
          f"{r['kv_bytes'] / 1e6:8.1f} {r['median_s'] * 1e6:9.1f} {r['bytes_per_s'] / 1e9:8.1f} "
          f"{r['frac_h200_peak']:7.1%}" + (f"  kv_step {r['kv_tokens_per_step']} warps "
                                          f"{r['num_warps']}" if "num_warps" in r else ""))
  if skipped:
    print(f"  skipped past the budget: {skipped}")
  print(f"wrote {path} in {result['wall_s']} s")
  if not all(c["ok"] for c in result["correctness"]):
    raise SystemExit("correctness check FAILED")


if __name__ == "__main__":
  app.run(main)
