"""Design measurements of kvtc (`kvjax/kernels/kvtc.py`): what inter-layer prediction and the
calibration text each save, in stored bytes per token at the same quantization steps.

On real SmolLM2-135M-Instruct KV (f32, K before RoPE): transforms are fitted
(`kvjax.models.loading.kv_calibration.fit_transform`, the sensitivities of the model's cached calibrated
transform) on

  flat-founding       the founding documents only, no prediction (kvtc version 1's transform)
  predict-founding    the founding documents only, with prediction
  predict-shipped     the whole shipped calibration text (founding documents + CC0 prose)

and each codes one held-out passage of book text (`--book`, `--offset`, `--tokens`, chunks of
256, fresh sequence from position 0) through `kvtc_encode_host` and `storage.format.codecs.
encode_payload` at every level. Printed and written to <out>/kvtc_design.json: stored bytes per
token and the sensitivity-weighted error (the KL the steps predict) per transform and level.

    PYTHONPATH=. nice -n 19 .venv/bin/python scripts/kvtc_design.py

These are version 1-4 design measurements: the transforms fitted here are plain (orthonormal)
PCAs stepped by a per-(layer, K/V) sensitivity. Version 5's cached transform is whitened by the
model's Fisher metric and its sensitivity is D everywhere, which would step these plain PCAs
uniformly; to repeat the version-4 figures pass `--sensitivity_from` a version-4 transform file
(calibration version 2). `--rel_l2` measures whatever transform the model has now.

Version-3 quantization modes (the predict-shipped transform only; `--work_cache F.npz` keeps its
fit and the held-out KV between runs, `--sensitivity_from` takes the sensitivities of a cached
transform instead of calibrating):

  --rounding_sweep                    bytes of q (entropy-coded) and predicted KL per
                                      (--kls, --roundings, --offsets): deadzone rounding offset
                                      and reconstruction offset (kvtc_rounding_sweep.json)
  --rounding_sweep --component_sweep  per-component step multipliers by sigma / step at
                                      KVTC_ROUNDING (kvtc_component_sweep.json)
  --rel_l2                            relative L2 error per level, max over chunks (the
                                      registry's rel_l2_error; kvtc_rel_l2.json); without
                                      --work_cache, of the model's calibrated transform
  --delta_sweep                       CacheGen's token deltas (arXiv 2310.07240, section 5.2)
                                      on kvtc's components: order-0 entropy of the codes q vs
                                      of q[t] - q[anchor] (anchor every --anchor_strides tokens)
                                      per band model, the same reconstruction; the model's
                                      calibrated transform (kvtc_delta_sweep.json)

    PYTHONPATH=.:scripts nice -n 19 .venv/bin/python scripts/kvtc_design.py --rounding_sweep \
        --work_cache kvtc_work.npz --kls 0.009,0.012,0.018 --roundings 0.5,0.42,0.35,0.28
"""

from __future__ import annotations

import functools
import os
import pathlib
import time

import numpy as np
from absl import app, flags

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent
_DATA = flags.DEFINE_string("data_dir", None, "The shared data folder (default ../shared/data).")
_BOOK = flags.DEFINE_string("book", "pg11_alice_in_wonderland_carroll.txt", "Held-out book.")
_OFFSET = flags.DEFINE_integer("offset", 1000, "First token of the held-out passage.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens of the held-out passage (x 256).")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results" / "kvtc_design"),
                           "Output folder.")
_SWEEP = flags.DEFINE_bool("rounding_sweep", False, "Instead: with the predict-shipped "
                            "transform only, sweep the deadzone rounding offset, the "
                            "reconstruction offset and the level KL (bytes vs predicted KL).")
_CACHE = flags.DEFINE_string("work_cache", None, "An .npz to keep the held-out KV and the "
                             "predict-shipped transform in between runs (development only).")
_COMPONENT = flags.DEFINE_bool("component_sweep", False, "With --rounding_sweep: instead of the "
                                "rounding grid, per-component step multipliers by the "
                                "component's spread relative to the step (at KVTC_ROUNDING).")
_ROUNDINGS = flags.DEFINE_list("roundings", ["0.5", "0.4", "0.33", "0.25"], "Rounding offsets.")
_OFFSETS = flags.DEFINE_list("offsets", ["0", "0.1", "0.2"], "Reconstruction offsets.")
_KLS = flags.DEFINE_list("kls", ["0.006", "0.009", "0.012", "0.016", "0.024"], "Level KLs.")
_REL_L2 = flags.DEFINE_bool("rel_l2", False, "Instead: the relative L2 error of every kvtc "
                            "level (max over chunks, as scripts/codec_error.py measures the other "
                            "codecs: the registry's rel_l2_error) on the held-out passage, with "
                            "the predict-shipped transform of --work_cache.")
_DELTA = flags.DEFINE_bool("delta_sweep", False, "Instead: order-0 entropy of kvtc's codes "
                           "with and without CacheGen's token deltas against anchors.")
_STRIDES = flags.DEFINE_list("anchor_strides", ["2", "4", "16"], "Anchor strides (tokens) of "
                             "--delta_sweep.")
_SENS_FROM = flags.DEFINE_string("sensitivity_from", None, "A cached transform (.npz) whose "
                                 "sensitivities to use instead of the model's calibration.")
C = 256


@functools.cache
def _provenance() -> dict:
  """`benchlib.provenance()` when the run started (`main` takes it first)."""
  return benchlib.provenance()


def main(_):
  _provenance()
  from bench_codec_lib import MODEL  # noqa: PLC0415  (scripts/)
  from kvjax.kernels import kvtc  # noqa: PLC0415
  from kvjax.models.loading import kv_calibration as kc  # noqa: PLC0415
  from kvjax.models.nn.llama import Llama  # noqa: PLC0415
  from kvjax.models.nn.calibration_model import CalibrationModel  # noqa: PLC0415
  from kvjax.models.runner.compilation_cache import default_cache_root  # noqa: PLC0415
  from kvjax.models.runner.paged_runner import PagedModelRunner  # noqa: PLC0415
  from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk  # noqa: PLC0415
  from kvjax.models.loading.registry import load_model  # noqa: PLC0415
  from kvjax.storage.format import codecs  # noqa: PLC0415
  from kvjax.storage.format.types import KVLayout  # noqa: PLC0415

  t0 = time.time()
  params_dir = os.path.join(default_cache_root(), "params")
  lm = load_model(MODEL, cache_dir=params_dir)
  cfg = lm.config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d = k * h
  model = Llama.from_params(cfg, lm.params)
  blocks = -(-max(_TOKENS.value, 1024) // 16)
  runner = PagedModelRunner(model, PagedRunnerConfig(
      num_blocks=blocks, block_size=16, max_num_seqs=1, max_num_batched_tokens=C,
      max_seq_len=blocks * 16, chunk_sizes=(C,)))
  table = list(range(blocks))
  if _SENS_FROM.value:  # a cached transform's sensitivities, without calibrating
    shipped = kc.load_transform(_SENS_FROM.value, k, h)
  else:
    shipped = kc.load_or_calibrate(CalibrationModel(model), lm.tokenizer, str(lm.fingerprint),
                                   params_dir)

  def kv_of(ids, passage):
    out = []
    for p0 in range(0, len(ids), passage):
      piece = ids[p0:p0 + passage]
      piece = piece[:len(piece) // C * C]
      runner.reset()
      for s in range(0, len(piece), C):
        o = runner.step([SeqChunk(piece[s:s + C], s, table)])
        out.append(np.stack([np.asarray(o.k_pre_rope_LTKH, np.float32).reshape(l_, -1, d),
                             np.asarray(o.v_LTKH, np.float32).reshape(l_, -1, d)], axis=1))
    return np.concatenate(out, axis=2)

  data_dir = pathlib.Path(_DATA.value or REPO.parent / "shared" / "data")
  book = lm.tokenizer.encode((data_dir / "books" / _BOOK.value).read_text(encoding="utf-8"))
  held = book[_OFFSET.value:_OFFSET.value + _TOKENS.value]
  if _DELTA.value:
    delta_sweep(kv_of, held, shipped, (l_, k, h), t0)
    return
  if _SWEEP.value or _REL_L2.value:
    (rel_l2 if _REL_L2.value else rounding_sweep)(kv_of, held, shipped, lm, (l_, k, h), t0)
    return
  founding = (REPO / "kvjax" / "data" / kc.CALIBRATION_FILES[0]).read_text(encoding="utf-8")
  cal_all = lm.tokenizer.encode(kc.calibration_text())[:kc.MAX_CALIBRATION_TOKENS]
  cal_founding = lm.tokenizer.encode(founding)[:kc.MAX_CALIBRATION_TOKENS]
  x_found = kv_of(cal_founding, kc.PASSAGE_TOKENS)
  x_all = kv_of(cal_all, kc.PASSAGE_TOKENS)
  x_held = kv_of(held, len(held))
  sens = shipped.sensitivity
  transforms = {
      "flat-founding": kc.fit_transform(x_found, sens, k, h, predict=False),
      "predict-founding": kc.fit_transform(x_found, sens, k, h),
      "predict-shipped": kc.fit_transform(x_all, sens, k, h),
  }
  layout = KVLayout(l_, C, k, h, "float32")
  results = {}
  for name, t in transforms.items():
    dt = t.device_arrays()
    results[name] = {}
    for level in range(len(kvtc.KVTC_LEVEL_KL)):
      nbytes, kl = 0, 0.0
      for s in range(0, x_held.shape[2], C):
        kv = x_held[:, :, s:s + C].reshape(l_, 2, C, k, h)
        arrays = kvtc.kvtc_encode_host(kv, dt, level, start=s)
        nbytes += len(codecs.encode_payload("kvtc", level, arrays, layout))
        rec = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), dt, k, h,
                                                   start=s))
        kl += float((((rec - kv) ** 2).reshape(l_, 2, -1).mean(-1) * sens).sum())
      n_chunks = x_held.shape[2] // C
      results[name][level] = {"bytes_per_token": nbytes / x_held.shape[2],
                              "predicted_kl": kl / n_chunks}
      print(f"{name:18s} level {level}: {nbytes / x_held.shape[2]:8.1f} B/token  "
            f"predicted KL {kl / n_chunks:.4f}", flush=True)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  benchlib.write_json(out / "kvtc_design.json", {
      **_provenance(), "benchmark": "kvtc_design", "model": MODEL, "dtype": "float32",
      "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": len(held)},
      "calibration_tokens": {"founding": len(cal_founding), "shipped": len(cal_all)},
      "chunk": C, "results": results, "elapsed_s": time.time() - t0,
      "note": "sensitivities of the model's calibrated transform; same steps for every transform"})


def rel_l2(kv_of, held, shipped, lm, dims, t0):
  """Per level: max over chunks of ||x̂ - x|| / ||x|| (whole chunk, K before RoPE and V) through
  the shipped encoder (`kvtc_encode_host`, position of each chunk) and decoder."""
  from kvjax.kernels import kvtc  # noqa: PLC0415
  l_, k, h = dims
  if _CACHE.value and os.path.isfile(_CACHE.value):  # the predict-shipped fit of a sweep
    with np.load(_CACHE.value) as f:
      t = kvtc.KVTCTransform(*(f[n] for n in ("mean", "basis", "variance")),
                             shipped.sensitivity, f["predictor"], k, h)
  else:  # the model's calibrated transform (what an installed kvtc uses)
    t = shipped
  x = kv_of(held, len(held))
  dt = t.device_arrays()
  out = {}
  for level in range(len(kvtc.KVTC_LEVEL_KL)):
    errs = []
    for s in range(0, x.shape[2], C):
      kv = x[:, :, s:s + C].reshape(l_, 2, C, k, h)
      arrays = kvtc.kvtc_encode_host(kv, dt, level, start=s)
      rec = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), dt, k, h,
                                                 start=s))
      errs.append(float(np.linalg.norm(rec - kv) / np.linalg.norm(kv)))
    out[level] = {"max": max(errs), "per_chunk": errs}
    print(f"kvtc level {level}: rel L2 max {max(errs):.4f} (chunks {np.round(errs, 4)})")
  pathlib.Path(_OUT.value).mkdir(parents=True, exist_ok=True)
  benchlib.write_json(pathlib.Path(_OUT.value) / "kvtc_rel_l2.json", {
      **_provenance(), "benchmark": "kvtc_design --rel_l2",
      "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": len(held)},
      "level_kl": list(kvtc.KVTC_LEVEL_KL), "results": out, "elapsed_s": time.time() - t0})


def _entropy_bits(sym: np.ndarray) -> float:
  """Order-0 entropy of `sym` (any ints), total bits."""
  _, counts = np.unique(sym, return_counts=True)
  p = counts / counts.sum()
  return float(-(counts * np.log2(p)).sum())


def delta_sweep(kv_of, held, t, dims, t0):
  """Per level: bits per token of kvtc's codes q (order-0 entropy, one model per layer, K/V and
  band of components, as rans-bands codes them) against CacheGen's token deltas on the same codes:
  within each group of S tokens the first is the anchor, kept as is, and the others are coded as
  q[t] - q[anchor] (CacheGen, arXiv 2310.07240, section 5.2, here in kvtc's transform domain: an
  integer difference of the codes, so the reconstruction, hence the quality, is the same)."""
  from kvjax.kernels import kvtc  # noqa: PLC0415
  from kvjax.storage.format.entropy import COMPONENT_BANDS  # noqa: PLC0415
  l_, k, h = dims
  d = k * h
  x = kv_of(held, len(held))
  dt = t.device_arrays()
  edges = [e for e in COMPONENT_BANDS if e < d] + [d]
  strides = [int(v) for v in _STRIDES.value]
  out = {}
  for level in range(len(kvtc.KVTC_LEVEL_KL)):
    q = np.concatenate([
        kvtc.kvtc_encode_host(x[:, :, s:s + C].reshape(l_, 2, C, k, h), dt, level, start=s)["q"]
        for s in range(0, x.shape[2], C)], axis=2).astype(np.int32)       # [L, 2, T, D]
    n_tok = q.shape[2]
    row = {}
    for name, stride in [("direct", 0)] + [(f"delta_{v}", v) for v in strides]:
      c = q
      if stride:
        anchor = q[:, :, (np.arange(n_tok) // stride) * stride]
        c = np.where((np.arange(n_tok) % stride == 0)[None, None, :, None], q, q - anchor)
      bits = sum(_entropy_bits(c[l, a, :, lo:hi]) for l in range(l_) for a in range(2)
                 for lo, hi in zip(edges[:-1], edges[1:]))
      row[name] = bits / 8 / n_tok
    out[level] = {"bytes_per_token": row,
                  "delta_vs_direct": {n: v / row["direct"] for n, v in row.items()}}
    print(f"kvtc level {level}: q entropy B/token " +
          "  ".join(f"{n} {v:,.0f} ({v / row['direct']:.3f}x)" for n, v in row.items()))
  pathlib.Path(_OUT.value).mkdir(parents=True, exist_ok=True)
  benchlib.write_json(pathlib.Path(_OUT.value) / "kvtc_delta_sweep.json", {
      **_provenance(), "benchmark": "kvtc_design --delta_sweep",
      "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": len(held)},
      "level_kl": list(kvtc.KVTC_LEVEL_KL), "anchor_strides": strides,
      "measure": "order-0 entropy per (layer, K/V, band of components) model, bytes per token",
      "results": out, "elapsed_s": time.time() - t0})


def rounding_sweep(kv_of, held, shipped, lm, dims, t0):
  """Bytes per token and predicted KL of the predict-shipped transform per (rounding offset,
  reconstruction offset, level KL): `kvtc.experiment_round_trip` at the steps of that KL, q
  coded by `storage.format.entropy.encode_components` (+ the payload's step and id bytes)."""
  import jax.numpy as jnp  # noqa: PLC0415
  from kvjax.kernels import kvtc  # noqa: PLC0415
  from kvjax.models.loading import kv_calibration as kc  # noqa: PLC0415
  from kvjax.storage.format import entropy  # noqa: PLC0415
  l_, k, h = dims
  sens = shipped.sensitivity
  cache = pathlib.Path(_CACHE.value) if _CACHE.value else None
  if cache is not None and cache.is_file():
    with np.load(cache) as f:
      x_held = f["x_held"]
      t = kvtc.KVTCTransform(*(f[n] for n in ("mean", "basis", "variance")), sens,
                             f["predictor"], k, h)
  else:
    cal_all = lm.tokenizer.encode(kc.calibration_text())[:kc.MAX_CALIBRATION_TOKENS]
    t = kc.fit_transform(kv_of(cal_all, kc.PASSAGE_TOKENS), sens, k, h)
    x_held = kv_of(held, len(held))
    if cache is not None:
      np.savez(cache, x_held=x_held, mean=t.mean, basis=t.basis, variance=t.variance,
               predictor=t.predictor)
  dt = t.device_arrays()
  rows = []
  sigma = np.sqrt(t.variance.astype(np.float64))                           # [L, 2, D]
  # (name, [(lo, hi, multiplier)] over sigma / step): the per-component rules tried.
  rules = {"uniform": [], "sigma/step<0.5 x2": [(0, 0.5, 2.0)], "<1 x1.3": [(0, 1, 1.3)],
           "<1 x0.8": [(0, 1, 0.8)], "1-4 x1.2": [(1, 4, 1.2)], ">4 x1.2": [(4, 1e9, 1.2)],
           ">4 x0.85": [(4, 1e9, 0.85)]}
  if _COMPONENT.value:
    for kl in (float(v) for v in _KLS.value):
      base = np.sqrt(12.0 * kl / (2 * l_ * sens.astype(np.float64)))[:, :, None]
      for name, rule in rules.items():
        mult = np.ones_like(sigma)
        for lo, hi, m in rule:
          mult[(sigma / base >= lo) & (sigma / base < hi)] = m
        step = jnp.asarray(base * mult, jnp.float32)                         # [L, 2, D]
        nbytes, err = 0, 0.0
        for s in range(0, x_held.shape[2], C):
          kv = jnp.asarray(x_held[:, :, s:s + C].reshape(l_, 2, C, k, h))
          q, rec = kvtc.experiment_round_trip(kv, dt, step, s, rounding=kvtc.KVTC_ROUNDING,
                                              offset=kvtc.KVTC_RECON_OFFSET)
          nbytes += len(entropy.encode_components(np.asarray(q)))
          e2 = np.square(np.asarray(rec) - np.asarray(kv)).reshape(l_, 2, -1).mean(-1)
          err += float((e2 * sens).sum())
        n = x_held.shape[2] // C
        row = {"level_kl": kl, "rule": name, "q_bytes_per_token": nbytes / x_held.shape[2],
               "predicted_kl": err / n}
        rows.append(row)
        print(f"kl {kl:.4f} {name:18s}: {row['q_bytes_per_token']:8.1f} B/token  predicted KL "
              f"{row['predicted_kl']:.5f}", flush=True)
  for kl in (float(v) for v in _KLS.value) if not _COMPONENT.value else ():
    step = jnp.asarray(np.sqrt(12.0 * kl / (2 * l_ * sens.astype(np.float64))), jnp.float32)
    for rounding in (float(v) for v in _ROUNDINGS.value):
      for offset in (float(v) for v in _OFFSETS.value):
        nbytes, err = 0, 0.0
        for s in range(0, x_held.shape[2], C):
          kv = jnp.asarray(x_held[:, :, s:s + C].reshape(l_, 2, C, k, h))
          q, rec = kvtc.experiment_round_trip(kv, dt, step, s, rounding=rounding, offset=offset)
          nbytes += len(entropy.encode_components(np.asarray(q))) + 4 * 2 * l_ + 16
          e2 = np.square(np.asarray(rec) - np.asarray(kv)).reshape(l_, 2, -1).mean(-1)
          err += float((e2 * sens).sum())
        n = x_held.shape[2] // C
        row = {"level_kl": kl, "rounding": rounding, "offset": offset,
               "q_bytes_per_token": nbytes / x_held.shape[2], "predicted_kl": err / n}
        rows.append(row)
        print(f"kl {kl:.4f} rounding {rounding:.2f} offset {offset:.2f}: "
              f"{row['q_bytes_per_token']:8.1f} B/token  predicted KL {row['predicted_kl']:.5f}",
              flush=True)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  name = "kvtc_component_sweep.json" if _COMPONENT.value else "kvtc_rounding_sweep.json"
  benchlib.write_json(out / name, {
      **_provenance(), "benchmark": "kvtc_design --rounding_sweep",
      "model": "SmolLM2-135M-Instruct", "dtype": "float32",
      "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": len(held)},
      "chunk": C, "transform": "predict-shipped (fit_transform on the shipped calibration text, "
      "sensitivities of the model's cached calibration)",
      "bytes": "entropy.encode_components(q) + step + transform id (no container header or "
               "index record)", "rows": rows, "elapsed_s": time.time() - t0})


if __name__ == "__main__":
  app.run(main)
