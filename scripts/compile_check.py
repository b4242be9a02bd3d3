"""Compiles every program the paged engine builds for TPU chips and lowers it for CUDA, with no
accelerator: XLA's real TPU compiler (libtpu) runs on this machine against TPU topology devices.

    pip install 'jax[tpu]==<the installed jax>'        # adds libtpu (about 680 MB)
    python scripts/compile_check.py [--quick] [--out benchmarks/results/compile_check.json]

Per target (`jax.experimental.topologies.get_topology_desc`: v5e, v6e, v5p) and tensor-parallel
size (1, 4, 8 where the model's heads allow, via `kvjax.models.runner.sharding`), an abstract
`PagedModelRunner` (random weights as ShapeDtypeStructs; no weights needed) lists its programs
(`PagedModelRunner.aot_programs`): the step at several token buckets, the raw chunk insert, per
codec (kvtc included) the payload insert and the encode of every level, the pre-RoPE read, the
layer-group programs of layer-wise loading; plus the rANS decode (`kvtc_rans`) and the kvtc
inverse transform. Each is traced inside the target's abstract mesh (so Pallas TPU kernels
lower for that chip's kind), compiled, and reported: compile OK or the error, seconds, argument /
temp / output bytes against the chip's HBM (`memory_analysis`), and XLA's cost model
(`cost_analysis`: flops, bytes accessed, optimal seconds). The cost figures are the COMPILER'S
ESTIMATES, not measurements; nothing here runs on a TPU or GPU. XLA counts a while loop's body
once: the step's `lax.scan` over layers is one layer's work plus what lies outside the loop
(embedding, logits), not L layers'. CUDA: every program `LLM()` builds on one GPU
(`cuda_programs`: layer-wise and kvtc programs included) built for platform "cuda" (Pallas GPU
kernels, Triton) and lowered for CUDA (lowering only: no GPU compiler here;
tests/integration/scripts/compile_check_cuda_test.py does the same at tiny shapes).

Writes JSON (machine, versions, git SHA, every row) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import benchlib  # noqa: E402

from kvjax.models.nn import config as model_configs  # noqa: E402
from kvjax.models.nn.llama import Llama  # noqa: E402
from kvjax.models.runner.paged_runner import PagedModelRunner  # noqa: E402
from kvjax.models.runner.runner_api import PagedRunnerConfig  # noqa: E402
from kvjax.models.runner.sharding import TensorParallel, check_tensor_parallel_size  # noqa: E402

GIB = 1 << 30
#: HBM per chip, bytes (Google Cloud TPU system architecture pages).
HBM_BYTES = {"v5e": 16 * GIB, "v6e": 32 * GIB, "v5p": 95 * GIB}
#: Topology names with 8 chips (TP 1 and 4 use the first devices of the same topology).
TOPOLOGIES = {"v5e": "v5e:2x4", "v6e": "v6e:2x4", "v5p": "v5p:2x2x2"}
MODELS = {"SmolLM2-135M": model_configs.smollm2_135m, "Llama-3.1-8B": model_configs.llama3_8b,
          "Qwen3-8B": model_configs.qwen3_8b}  # Qwen3: the q/k RMSNorm, head_dim 128


def abstract_model(cfg) -> Llama:
  """The model with ShapeDtypeStruct weights (bf16), nothing allocated."""
  return nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                      param_dtype=jnp.bfloat16))


def runner_config(cfg, args, max_model_len: int) -> PagedRunnerConfig:
  """The engine's defaults, with a pool that holds `max_num_seqs` x `max_model_len` tokens."""
  max_len = min(max_model_len, cfg.max_seq_len)
  blocks = args.max_num_seqs * -(-max_len // args.block_size)
  return PagedRunnerConfig(num_blocks=blocks, block_size=args.block_size,
                           max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_seq_len=max_len)


def stats(compiled) -> dict:
  out = {}
  ma = compiled.memory_analysis()
  if ma is not None:
    for k in ("argument", "output", "temp", "alias", "generated_code"):
      out[f"{k}_bytes"] = int(getattr(ma, f"{k}_size_in_bytes"))
    # Live at once: arguments + outputs not aliased to (donated) arguments + temporaries.
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"])
  ca = compiled.cost_analysis()
  if isinstance(ca, list):
    ca = ca[0] if ca else {}
  if ca:
    opt = float(ca.get("optimal_seconds", -1.0))
    out["estimate"] = {"flops": float(ca.get("flops", 0.0)),
                       "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
                       # XLA reports a negative time when its model cannot bound the program
                       # (a while loop over layers): no estimate then.
                       "optimal_seconds": opt if opt >= 0 else None}
  return out


def first_line(e: BaseException) -> str:
  msg = str(e).strip().splitlines()
  for line in msg:  # the size of a VMEM/SMEM overflow first
    if "exceeded" in line or "Ran out of memory" in line:
      return f"{type(e).__name__}: {line.strip()[:300]}"
  for line in msg:
    if "rror" in line or "ailed" in line or "nsupported" in line:
      return f"{type(e).__name__}: {line.strip()[:300]}"
  return f"{type(e).__name__}: {(msg[0] if msg else '')[:300]}"


def compile_tpu(name, fn, fargs, mesh, chip, per_device_hbm) -> dict:
  row = {"program": name}
  t0 = time.perf_counter()
  try:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      lowered = fn.lower(*fargs)
    compiled = lowered.compile()
    row.update(ok=True, seconds=round(time.perf_counter() - t0, 2), **stats(compiled))
    if "peak_bytes" in row:
      row["fits_hbm"] = row["peak_bytes"] <= per_device_hbm
  except Exception as e:  # noqa: BLE001 (every failure is a row of the table)
    row.update(ok=False, seconds=round(time.perf_counter() - t0, 2), error=first_line(e))
  return row


def strip_sharding(tree):
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def lower_cuda(name, fn, fargs) -> dict:
  """Lowers for CUDA (StableHLO with the Pallas GPU kernels as custom calls); what `jax.export`
  with platforms=["cuda"] serializes, minus its refusal of custom calls that carry no
  compatibility guarantee (every Pallas kernel), so the lowering itself is what is checked."""
  row = {"program": name}
  t0 = time.perf_counter()
  try:
    text = fn.trace(*strip_sharding(fargs)).lower(lowering_platforms=("cuda",)).as_text()
    row.update(ok=True, seconds=round(time.perf_counter() - t0, 2), mlir_chars=len(text),
               triton_calls=text.count("__gpu$xla.gpu.triton"),
               mosaic_gpu_calls=text.count("mosaic_gpu"))
  except Exception as e:  # noqa: BLE001
    row.update(ok=False, seconds=round(time.perf_counter() - t0, 2), error=first_line(e))
  return row


def extra_programs(cfg, chunk: int, device, platform: str):
  """The rANS decode of a kvtc chunk's codes (`kvtc_rans`, Pallas kernel) and the kvtc decode
  (inverse transform + RoPE + write, jnp): not runner programs (the store client and the runner's
  kvtc insert call them), at the model's chunk shape. Band shapes come from encoding random codes of
  that shape with the storage room's rANS coder (they depend on the data only through the
  word counts, padded to a size bucket)."""
  from kvjax.kernels import kvtc, kvtc_rans  # noqa: PLC0415
  from kvjax.storage.format import entropy  # noqa: PLC0415
  sh = None if device is None else jax.sharding.SingleDeviceSharding(device)

  def sds(x):
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sh)

  l_, k_, h_ = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d = k_ * h_
  out = []
  rng = np.random.default_rng(0)
  spread = np.geomspace(20.0, 0.05, d)
  q = np.clip(np.rint(rng.laplace(size=(l_, 2, chunk, d)) * spread), -32767, 32767
              ).astype(np.int16)
  p = entropy.parse_components_rans(entropy.encode_components_rans(q), q.shape)
  packed = kvtc_rans.pack_bands(p.shape, p.bands, p.offsets, p.arrays)
  static = tuple(tuple(int(getattr(b, n)) for n in kvtc_rans._STATIC) for b in packed.bands)
  arrays = tuple(tuple(sds(getattr(b, n)) for n in kvtc_rans._ARRAYS) for b in packed.bands)
  capacity = kvtc_rans.word_capacity(packed.bands)
  words = jax.ShapeDtypeStruct((capacity,), jnp.uint16, sharding=sh)
  fn = jax.jit(lambda w, a: kvtc_rans._decode_jit(
      w, a, shape=packed.shape, static=static, use_pallas=True, interpret=False,
      platform=platform))
  out.append((f"rans_decode[kvtc codes {l_}x2x{chunk}x{d}]", fn, (words, arrays)))

  f32 = np.float32
  payload = kvtc.KVTCPayload(jax.ShapeDtypeStruct((l_, 2, chunk, d), jnp.int16, sharding=sh),
                             jax.ShapeDtypeStruct((l_, 2), f32, sharding=sh),
                             jax.ShapeDtypeStruct((16,), jnp.uint8, sharding=sh))
  levels = len(kvtc.CODEC_LEVELS[kvtc.CODEC_KVTC])
  t = kvtc.KVTCDeviceTransform(
      *(jax.ShapeDtypeStruct(s_, f32, sharding=sh) for s_ in (
          (l_, 2, d), (l_, 2, d, d), (l_, 2, d, d), (levels, l_, 2),
          (l_, 2, kvtc.PREDICT_FEATURES * d, d))),
      jax.ShapeDtypeStruct((16,), jnp.uint8, sharding=sh))
  cache = jax.ShapeDtypeStruct((l_, 1, chunk, k_, h_), jnp.bfloat16, sharding=sh)
  i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh)
  cs = jax.ShapeDtypeStruct((chunk, h_), f32, sharding=sh)
  fn = jax.jit(lambda *a: kvtc._decode_jit(*a, k=k_, h=h_))
  out.append((f"kvtc_decode[C={chunk}]", fn, (payload, t, cache, cache, i32, i32, cs, cs)))
  return out


def cuda_programs(cfg, model, rc: PagedRunnerConfig, *, chunk: int, buckets, codecs, groups,
                  extras: bool = True) -> list[tuple[str, object, tuple]]:
  """Every program `LLM()` builds on one CUDA device, as `(name, jitted function, abstract
  arguments)`: an abstract `PagedModelRunner` for platform "cuda" on the host's CPU device
  (nothing allocated) lists the step per bucket, the raw insert and pre-RoPE read, per codec
  (kvtc included) the payload insert and level encoder, with `groups` the layer-wise programs
  (begin, each group size, finish, the layer insert); `extras` adds the store client's rANS
  decode of kvtc codes and the kvtc decode (`extra_programs`). `lower_cuda` lowers each."""
  runner = PagedModelRunner(model, rc, None, device=jax.devices("cpu")[0], abstract=True,
                            platform="cuda")
  progs = runner.aot_programs(chunk_tokens=chunk, buckets=buckets, codecs=codecs, groups=groups)
  if extras:
    progs += extra_programs(cfg, chunk, None, "cuda")
  return progs


def jobs(args) -> list[tuple[str, str, int, int, tuple[int, ...], bool]]:
  """(model, chip, TP, max_model_len, buckets, every program?) in the order they run: the full
  program set on `full_chips` first, then the step and inserts elsewhere, then a long-context
  step (the model's own max_model_len: the block table's SMEM windows), then CUDA."""
  out = []
  for chip in sorted(args.chips, key=lambda c: c not in args.full_chips):
    for model_name in args.models:
      for tp_size in args.tp:
        out.append((model_name, chip, tp_size, args.max_model_len, tuple(args.buckets),
                    tp_size == 1 and chip in args.full_chips))
  if args.long_context and "Llama-3.1-8B" in args.models and "v6e" in args.chips:
    out.append(("Llama-3.1-8B", "v6e", 4, MODELS["Llama-3.1-8B"]().max_seq_len,
                (min(args.buckets),), False))
  if args.cuda:
    for model_name in args.models:
      out.append((model_name, "cuda", 1, args.max_model_len, tuple(args.buckets), True))
  return out


def selected(progs, prefixes):
  """The programs whose names start with one of `prefixes` (None: all)."""
  return [p for p in progs if prefixes is None or p[0].startswith(tuple(prefixes))]


def run(args, on_row) -> None:
  from jax.experimental import topologies  # noqa: PLC0415
  for model_name, chip, tp_size, max_len, buckets, full in jobs(args):
    cfg = MODELS[model_name]()
    model = abstract_model(cfg)
    rc = runner_config(cfg, args, max_len)
    common = dict(model=model_name, max_model_len=rc.max_seq_len, num_blocks=rc.num_blocks)
    if chip == "cuda":
      progs = cuda_programs(cfg, model, rc, chunk=args.chunk, buckets=buckets, codecs=args.codecs,
                            groups=args.groups, extras=args.extras)
      for name, fn, fargs in selected(progs, args.programs):
        on_row(dict(lower_cuda(name, fn, fargs), target="cuda (lowering only)", chip="cuda",
                    tp=1, platform="cuda", **common))
      continue
    topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[chip], platform="tpu")
    try:
      check_tensor_parallel_size(cfg, tp_size, len(topo.devices))
    except ValueError as e:
      print(f"skip {model_name} {chip} TP={tp_size}: {e}")
      continue
    tp = None if tp_size == 1 else TensorParallel.build(cfg, tp_size, topo.devices)
    runner = PagedModelRunner(model, rc, tp, device=topo.devices[0], abstract=True)
    mesh = jax.sharding.Mesh(np.asarray(runner.devices), ("tp",))
    progs = runner.aot_programs(chunk_tokens=args.chunk, buckets=buckets, codecs=args.codecs,
                                groups=args.groups if full else None)
    if not full:  # the step and the inserts only (the rest is per device, as at TP 1)
      progs = [p for p in progs if p[0].startswith(("step", "insert_raw", "insert_payload"))]
      if max_len != args.max_model_len:
        progs = [p for p in progs if p[0].startswith("step")]
    if full and args.extras:
      progs += extra_programs(cfg, args.chunk, topo.devices[0], "tpu")
    for name, fn, fargs in selected(progs, args.programs):
      m = mesh if not name.startswith(("rans", "kvtc")) else jax.sharding.Mesh(
          np.asarray(topo.devices[:1]), ("tp",))
      on_row(dict(compile_tpu(name, fn, fargs, m, chip, HBM_BYTES[chip]),
                  target=f"{chip} ({TOPOLOGIES[chip]})", chip=chip, tp=tp_size, platform="tpu",
                  hbm_bytes=HBM_BYTES[chip], **common))


# ---------------------------------------------------------------------------------------------
# The pool's memory at the engine's default size (`--pool_memory`).

def pool_memory(args, on_row) -> None:
  """The model's (`--pool_model`, default SmolLM2) step at the largest bucket and a raw chunk
  insert on one v6e chip (v6e:2x2's first device) at the engine's default pool size on that chip
  (`pool_memory.fit_num_blocks`: the step compiled at two pool sizes, fitted under the chip's
  HBM), or at `--pool_blocks`;
  argument / temp / output bytes per program (XLA's `memory_analysis`)."""
  from jax.experimental import topologies  # noqa: PLC0415
  from kvjax.models.runner import pool_memory as pm  # noqa: PLC0415
  from kvjax.models.nn.kv_cache import paged_block_nbytes  # noqa: PLC0415
  cfg = MODELS[args.pool_model]()
  model = abstract_model(cfg)
  topo = topologies.get_topology_desc(topology_name="v6e:2x2", platform="tpu")
  dev = topo.devices[0]
  # The engine's defaults (`LLM`): 4 sequences, max_num_batched_tokens = the largest chunk.
  rc = PagedRunnerConfig(num_blocks=1, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=512)
  t0 = time.perf_counter()
  if args.pool_blocks:
    blocks, how = args.pool_blocks, "--pool_blocks"
  else:
    blocks = pm.fit_num_blocks(model, rc, None, device=dev, device_bytes=HBM_BYTES["v6e"])
    how = (f"engine default on v6e (fit_num_blocks: step compiled at {pm.PROBE_NUM_BLOCKS} "
           f"blocks, {pm.DEFAULT_ACCELERATOR_MEMORY_MARGIN:.0%} margin)")
  fit_s = round(time.perf_counter() - t0, 1)
  runner = PagedModelRunner(model, dataclasses.replace(rc, num_blocks=blocks), None, device=dev,
                            abstract=True)
  mesh = jax.sharding.Mesh(np.asarray(runner.devices), ("tp",))
  pool_bytes = int(np.prod(runner.pool.k_LPBF.shape)) * 2 * jnp.dtype(jnp.bfloat16).itemsize
  common = dict(model=args.pool_model, chip="v6e", tp=1, platform="tpu", hbm_bytes=HBM_BYTES["v6e"],
                target="v6e (v6e:2x2, one device)", num_blocks=blocks, pool_sizing=how,
                fit_seconds=fit_s, pool_bytes=pool_bytes,
                pool_shape=list(runner.pool.k_LPBF.shape),
                pool_logical_bytes=blocks * paged_block_nbytes(cfg, 16, jnp.bfloat16))
  for name, fn, fargs in runner.aot_programs(chunk_tokens=256, buckets=(runner.buckets[-1],),
                                             codecs=("raw",)):
    if name.startswith(("step", "insert_raw", "read_pre_rope")):
      on_row(dict(compile_tpu(name, fn, fargs, mesh, "v6e", HBM_BYTES["v6e"]), **common))


# ---------------------------------------------------------------------------------------------
# Paper figures (`--paper`): decode and prefill time, HBM roofline, Cake's B*. ESTIMATES.

#: HBM bandwidth per chip, bytes/s, and peak bf16 FLOP/s (Google Cloud TPU system architecture
#: pages: v5e 819 GB/s, 197 TFLOP/s; v5p 2,765 GB/s, 459 TFLOP/s; v6e 1,640 GB/s, 918 TFLOP/s).
HBM_BANDWIDTH = {"v5e": 819e9, "v6e": 1640e9, "v5p": 2765e9}
PEAK_BF16_FLOPS = {"v5e": 197e12, "v6e": 918e12, "v5p": 459e12}
MODELS_PAPER = {"Llama-3.1-8B": model_configs.llama3_8b,
                "Llama-3.1-70B": model_configs.llama3_70b}
#: (model, chip, topology, TP) of the paper table.
PAPER_TARGETS = (("Llama-3.1-8B", "v6e", "v6e:2x2", 1), ("Llama-3.1-70B", "v5p", "v5p:2x2x2", 8))


def _step_estimate(cfg, chip, topo_name, tp_size, t, n_layers, vocab):
  """XLA's cost estimate (per device) of the step at bucket `t` for `cfg` cut to `n_layers`
  layers and `vocab` tokens (a one-layer step has no loop, so XLA counts all of it)."""
  from jax.experimental import topologies  # noqa: PLC0415
  c = dataclasses.replace(cfg, n_layers=n_layers, vocab_size=vocab)
  topo = topologies.get_topology_desc(topology_name=topo_name, platform="tpu")
  tp = None if tp_size == 1 else TensorParallel.build(c, tp_size, topo.devices)
  rc = PagedRunnerConfig(num_blocks=256, block_size=16, max_num_seqs=8,
                         max_num_batched_tokens=max(t, 8), max_seq_len=8192)
  runner = PagedModelRunner(abstract_model(c), rc, tp, device=topo.devices[0], abstract=True)
  mesh = jax.sharding.Mesh(np.asarray(runner.devices), ("tp",))
  (name, fn, fargs), = [p for p in runner.aot_programs(buckets=(t,), codecs=())
                        if p[0] == f"step[T={t}]"]
  row = compile_tpu(name, fn, fargs, mesh, chip, HBM_BYTES[chip])
  if not row["ok"]:
    raise RuntimeError(f"{cfg.name} {name} on {topo_name}: {row['error']}")
  return row["estimate"]


def paper_figures(args, on_row) -> None:
  """Per (model, chip, TP) of `PAPER_TARGETS`: XLA's estimated decode step and prefill time, the
  HBM roofline of decode, and Cake's balance bandwidth B* = (KV bytes of a 1K-token chunk) /
  (estimated seconds to compute it), the link bandwidth at which loading a chunk costs what
  computing it does (Cake, arXiv 2410.03065). Every time here is a COMPILER ESTIMATE.

  XLA counts a loop body once, so the full model's figure is assembled from one-layer steps:
  `est(1 layer, real vocab) + (L - 1) * est(1 layer, 256-token vocab)` (the second is one decoder
  layer with a negligible embedding and head). The paged attention kernel is a custom call
  whose cost XLA does not model: decode's KV reads are added to the roofline analytically
  (`--decode_context` tokens per sequence), not to XLA's estimate."""
  b_ctx, batch = args.decode_context, args.decode_batch
  for model_name, chip, topo_name, tp_size in PAPER_TARGETS:
    if model_name not in args.paper_models:
      continue
    cfg = MODELS_PAPER[model_name]()
    l_ = cfg.n_layers
    t0 = time.perf_counter()
    est = {}
    for what, t in (("decode", batch), ("prefill", 1024)):
      full = _step_estimate(cfg, chip, topo_name, tp_size, t, 1, cfg.vocab_size)
      layer = _step_estimate(cfg, chip, topo_name, tp_size, t, 1, 256)
      est[what] = {k: (full[k] or 0.0) + (l_ - 1) * (layer[k] or 0.0)
                   for k in ("flops", "bytes_accessed", "optimal_seconds")}
    bw, peak = HBM_BANDWIDTH[chip], PEAK_BF16_FLOPS[chip]
    weights = cfg.num_params() * 2 / tp_size  # bf16, per device
    kv_token = 2 * l_ * cfg.n_kv_heads * cfg.head_dim * 2  # bytes of one token's KV, bf16
    kv_decode = batch * b_ctx * kv_token / tp_size
    chunk_bytes = 1024 * kv_token  # a stored 1K-token chunk, whole model
    for e in est.values():  # XLA gives no optimal seconds for a program with loops (the
      # tile metadata's searchsorted, the kernel windows): its flops and bytes at the chip's
      # peak rates instead, the same roofline its cost model applies.
      e["seconds_source"] = "XLA optimal_seconds" if e["optimal_seconds"] else (
          "max(XLA flops / peak bf16, XLA bytes / HBM bandwidth)")
      if not e["optimal_seconds"]:
        e["optimal_seconds"] = max(e["flops"] / PEAK_BF16_FLOPS[chip],
                                   e["bytes_accessed"] / HBM_BANDWIDTH[chip])
    prefill_s = est["prefill"]["optimal_seconds"]
    row = dict(
        program="paper figures", ok=True, model=model_name, chip=chip, tp=tp_size,
        target=f"{chip} ({topo_name}{', first device' if tp_size == 1 else ''})",
        platform="tpu", seconds=round(time.perf_counter() - t0, 1),
        hbm_bytes=HBM_BYTES[chip], hbm_bandwidth_bytes_per_s=bw, peak_bf16_flops=peak,
        decode_batch=batch, decode_context=b_ctx,
        estimate_label="compiler estimate (XLA cost analysis, libtpu), not a measurement",
        decode_step_est_s=est["decode"]["optimal_seconds"],
        decode_step_est_bytes=est["decode"]["bytes_accessed"],
        decode_step_est_flops=est["decode"]["flops"],
        decode_est_source=est["decode"]["seconds_source"],
        prefill_est_source=est["prefill"]["seconds_source"],
        decode_hbm_roofline_s=(weights + kv_decode) / bw,
        decode_hbm_roofline_weights_only_s=weights / bw,
        prefill_est_s_per_1k=prefill_s,
        prefill_est_flops_per_1k=est["prefill"]["flops"],
        prefill_compute_roofline_s_per_1k=est["prefill"]["flops"] / peak,
        chunk_1k_kv_bytes=chunk_bytes,
        cake_b_star_bytes_per_s=chunk_bytes / prefill_s if prefill_s else None)
    on_row(row)


def print_paper(r) -> None:
  g = 1e9
  print(f"{r['model']:<14} {r['chip']} TP{r['tp']}: decode step (batch {r['decode_batch']}) est "
        f"{r['decode_step_est_s'] * 1e3:.2f} ms, HBM roofline "
        f"{r['decode_hbm_roofline_s'] * 1e3:.2f} ms (weights + KV at {r['decode_context']} "
        f"tokens); prefill est "
        f"{r['prefill_est_s_per_1k'] * 1e3:.1f} ms / 1K tokens; B* "
        f"{r['cake_b_star_bytes_per_s'] / g:.2f} GB/s  [compiler estimates]", flush=True)


def paper_markdown(rows) -> str:
  lines = ["| model | target | TP | decode step (batch, context), est. ms | decode HBM roofline "
           "ms (weights + KV) | prefill est. ms / 1K tokens | 1K-token chunk MiB | Cake B* "
           "GB/s | estimate from |", "|" + "---|" * 9]
  for r in rows:
    src = ("XLA optimal seconds" if r["prefill_est_source"].startswith("XLA optimal")
           else "XLA flops and bytes at peak rates")
    lines.append(
        f"| {r['model']} | {r['target']} | {r['tp']} | {r['decode_step_est_s'] * 1e3:.2f} "
        f"({r['decode_batch']}, {r['decode_context']}) | "
        f"{r['decode_hbm_roofline_s'] * 1e3:.2f} | {r['prefill_est_s_per_1k'] * 1e3:.1f} | "
        f"{r['chunk_1k_kv_bytes'] / 2**20:.0f} | {r['cake_b_star_bytes_per_s'] / 1e9:.2f} | "
        f"{src} |")
  return ("All figures are compiler estimates (XLA cost analysis via libtpu, deviceless AOT), "
          "not measurements.\n\n" + "\n".join(lines))


def fmt_gib(x):
  return "" if x is None else f"{x / GIB:.2f}"


def print_row(r):
  est = r.get("estimate", {})
  status = "OK" if r["ok"] else "FAIL"
  mem = (f"args {fmt_gib(r.get('argument_bytes'))} temp {fmt_gib(r.get('temp_bytes'))} "
         f"out {fmt_gib(r.get('output_bytes'))} "
         f"peak {fmt_gib(r.get('peak_bytes'))} GiB" if "peak_bytes" in r else "")
  opt = est.get("optimal_seconds")
  e = (f"est {est['flops'] / 1e9:.1f} GFLOP {est['bytes_accessed'] / GIB:.2f} GiB "
       f"{'-' if opt is None else f'{opt * 1e3:.3f}'} ms" if est else "")
  print(f"{r['model']:<13} {r['chip']:<4} TP{r['tp']:<2} {r['program']:<36} {status:<4} "
        f"{r['seconds']:>6.1f}s {mem} {e} {r.get('error', '')}", flush=True)


def markdown(rows) -> str:
  """The rows as a markdown table (benchmarks/README.md): one line per program and target."""
  lines = ["| model | target | TP | program | compile | peak GiB (HBM) | est. GFLOP | "
           "est. GiB accessed | est. optimal ms |", "|" + "---|" * 9]
  for r in rows:
    est = r.get("estimate", {})
    opt = est.get("optimal_seconds")
    peak = (f"{r['peak_bytes'] / GIB:.2f} ({r['hbm_bytes'] / GIB:.0f})"
            if "peak_bytes" in r else "")
    status = "OK" if r["ok"] else "FAIL: " + r["error"].split(":")[0]
    lines.append(
        f"| {r['model']} | {r['chip']} | {r['tp']} | {r['program']} | {status} | {peak} | "
        f"{est['flops'] / 1e9:.1f} | {est['bytes_accessed'] / GIB:.2f} | "
        f"{'' if opt is None else f'{opt * 1e3:.2f}'} |" if est else
        f"| {r['model']} | {r['chip']} | {r['tp']} | {r['program']} | {status} | {peak} | | | |")
  return "\n".join(lines)


def summary(rows) -> str:
  """Per model, target and TP: programs OK, the largest step's peak against HBM and its
  estimate, and what failed (markdown)."""
  groups: dict = {}
  for r in rows:
    groups.setdefault((r["model"], r["chip"], r["tp"], r.get("max_model_len")), []).append(r)
  lines = ["| model | target | TP | max_model_len | programs OK | largest step: peak GiB / HBM "
           "| its est. GFLOP, GiB accessed (one layer) | failed |", "|" + "---|" * 8]
  for (model, chip, tp, max_len), rs in groups.items():
    steps = [r for r in rs if r["program"].startswith("step") and r["ok"]]
    step = max(steps, key=lambda r: int(r["program"].split("=")[1][:-1]), default=None)
    peak = (f"{step['peak_bytes'] / GIB:.2f} / {step['hbm_bytes'] / GIB:.0f}"
            if step and "peak_bytes" in step else "")
    est = step.get("estimate") if step else None
    e = f"{est['flops'] / 1e9:.0f}, {est['bytes_accessed'] / GIB:.2f}" if est else ""
    failed = ", ".join(sorted({r["program"].split("[")[0] for r in rs if not r["ok"]}))
    lines.append(f"| {model} | {chip} | {tp} | {max_len} | {sum(r['ok'] for r in rs)}/{len(rs)} "
                 f"| {peak} | {e} | {failed} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="SmolLM2 on v5e, TP 1, a few programs")
  p.add_argument("--out", default="benchmarks/results/compile_check.json")
  p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  p.add_argument("--chips", nargs="*", default=["v5e", "v6e", "v5p"], choices=list(HBM_BYTES),
                 help="TPU chips to compile for; none (a bare --chips): the CUDA lowerings only")
  p.add_argument("--tp", nargs="+", type=int, default=[1, 4, 8])
  p.add_argument("--buckets", nargs="+", type=int, default=[8, 512])
  p.add_argument("--codecs", nargs="+", default=["raw", "int8", "int4", "cachegen", "kvtc"])
  p.add_argument("--chunk", type=int, default=256, help="stored chunk tokens C")
  p.add_argument("--groups", type=int, default=4, help="layer groups of the layer-wise step")
  p.add_argument("--block_size", type=int, default=16)
  p.add_argument("--max_num_seqs", type=int, default=2)
  p.add_argument("--max_model_len", type=int, default=32768)
  p.add_argument("--max_num_batched_tokens", type=int, default=512)
  p.add_argument("--no_cuda", dest="cuda", action="store_false")
  p.add_argument("--no_long_context", dest="long_context", action="store_false",
                 help="skip LLaMA-3.1-8B's step at its own max_model_len (v6e, TP 4)")
  p.add_argument("--programs", nargs="+", metavar="PREFIX",
                 help="only the programs whose names start with one of these (e.g. rans_decode)")
  p.add_argument("--no_extras", dest="extras", action="store_false",
                 help="skip the rANS decode and kvtc decode programs")
  p.add_argument("--full_chips", nargs="+", default=["v6e"], choices=list(HBM_BYTES),
                 help="chips that get every program at TP 1; the others (and TP > 1) get the "
                      "step and the inserts")
  p.add_argument("--markdown", metavar="JSON", help="print a result file's table as markdown "
                 "and exit")
  p.add_argument("--pool_memory", action="store_true",
                 help="only SmolLM2's step and insert on one v6e chip at the engine's default "
                      "pool size (or --pool_blocks): argument / temp / output bytes")
  p.add_argument("--pool_blocks", type=int, default=0, help="pool size of --pool_memory")
  p.add_argument("--pool_model", default="SmolLM2-135M", choices=list(MODELS),
                 help="the model of --pool_memory")
  p.add_argument("--paper", action="store_true",
                 help="only the paper figures: LLaMA-3.1-8B on v6e and 70B on v5p TP 8, "
                      "estimated decode / prefill time, HBM roofline, Cake's B*")
  p.add_argument("--paper_models", nargs="+", default=list(MODELS_PAPER),
                 choices=list(MODELS_PAPER))
  p.add_argument("--decode_batch", type=int, default=8, help="decodes per step (--paper)")
  p.add_argument("--decode_context", type=int, default=4096,
                 help="tokens of context per decode in the roofline (--paper)")
  args = p.parse_args(argv)
  if args.markdown:
    data = json.loads(pathlib.Path(args.markdown).read_text())
    rows = data["rows"]
    if data.get("mode") == "paper":
      print(paper_markdown(rows))
    else:
      print(summary(rows) + "\n\n" + markdown(rows))
    return 0
  if args.quick:
    args.models, args.chips, args.tp = ["SmolLM2-135M"], ["v5e"], [1]
    args.buckets, args.codecs, args.groups = [8, 512], ["int8", "int4"], None
    args.full_chips = ["v5e"]
  t0 = time.perf_counter()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  result = dict(
      **benchlib.provenance(("jax", "jaxlib", "libtpu", "flax", "numpy", "kvjax")),
      what="compile check: XLA TPU compiles (libtpu, deviceless AOT) and CUDA lowerings of "
           "every program the paged engine builds; cost figures are the compiler's ESTIMATES (a "
           "while loop's body, the scan over layers, counted once)",
      args=vars(args), complete=False, rows=[])

  mode = "paper" if args.paper else "pool_memory" if args.pool_memory else "programs"
  result["mode"] = mode

  def on_row(row):  # the JSON is rewritten after every program: a cut-short run keeps its rows
    result["rows"].append(row)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    benchlib.write_json(out, result)
    (print_paper if mode == "paper" else print_row)(row)

  {"paper": paper_figures, "pool_memory": pool_memory, "programs": run}[mode](args, on_row)
  result["complete"] = True
  result["total_seconds"] = round(time.perf_counter() - t0, 1)
  benchlib.write_json(out, result)
  rows = result["rows"]
  print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} programs OK; wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
