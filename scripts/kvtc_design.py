"""Design measurements of kvtc (`kvjax/kernels/kvtc.py`): what inter-layer prediction and the
calibration text each save, in stored bytes per token at the same quantization steps.

On real SmolLM2-135M-Instruct KV (f32, K before RoPE): transforms are fitted
(`kvjax.models.kv_calibration.fit_transform`, the sensitivities of the model's cached calibrated
transform) on

  flat-founding       the founding documents only, no prediction (kvtc version 1's transform)
  predict-founding    the founding documents only, with prediction
  predict-shipped     the whole shipped calibration text (founding documents + CC0 prose)

and each codes one held-out passage of book text (`--book`, `--offset`, `--tokens`, chunks of
256, fresh sequence from position 0) through `kvtc_encode_host` and `storage.codecs.
encode_payload` at every level. Printed and written to <out>/kvtc_design.json: stored bytes per
token and the sensitivity-weighted error (the KL the steps predict) per transform and level.

    PYTHONPATH=. nice -n 19 .venv/bin/python scripts/kvtc_design.py
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
from absl import app, flags

from benchlib import git_sha, machine  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent
_DATA = flags.DEFINE_string("data_dir", None, "The shared data folder (default ../shared/data).")
_BOOK = flags.DEFINE_string("book", "pg11_alice_in_wonderland_carroll.txt", "Held-out book.")
_OFFSET = flags.DEFINE_integer("offset", 1000, "First token of the held-out passage.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens of the held-out passage (x 256).")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results" / "kvtc_design"),
                           "Output folder.")
C = 256


def main(_):
  from bench_codec_lib import MODEL  # noqa: PLC0415  (scripts/)
  from kvjax.kernels import kvtc  # noqa: PLC0415
  from kvjax.models import kv_calibration as kc  # noqa: PLC0415
  from kvjax.models.llama import Llama  # noqa: PLC0415
  from kvjax.models.registry import load_model  # noqa: PLC0415
  from kvjax.models.runner import ModelRunner, RunnerConfig, default_cache_root  # noqa: PLC0415
  from kvjax.storage import codecs  # noqa: PLC0415
  from kvjax.storage.types import KVLayout  # noqa: PLC0415

  t0 = time.time()
  params_dir = os.path.join(default_cache_root(), "params")
  lm = load_model(MODEL, cache_dir=params_dir)
  cfg = lm.config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  d = k * h
  runner = ModelRunner(Llama.from_params(cfg, lm.params),
                       RunnerConfig(num_slots=1, max_seq_len=max(_TOKENS.value, 1024),
                                    chunk_sizes=(C,)))
  shipped = kc.load_or_calibrate(runner, lm.tokenizer, str(lm.fingerprint), params_dir)

  def kv_of(ids, passage):
    out = []
    for p0 in range(0, len(ids), passage):
      piece = ids[p0:p0 + passage]
      piece = piece[:len(piece) // C * C]
      runner.reset()
      for s in range(0, len(piece), C):
        o = runner.prefill_chunk(piece[s:s + C], 0, s)
        out.append(np.stack([np.asarray(o.k_pre_rope_LTKH, np.float32).reshape(l_, -1, d),
                             np.asarray(o.v_LTKH, np.float32).reshape(l_, -1, d)], axis=1))
    return np.concatenate(out, axis=2)

  founding = (REPO / "kvjax" / "data" / kc.CALIBRATION_FILES[0]).read_text(encoding="utf-8")
  cal_all = lm.tokenizer.encode(kc.calibration_text())[:kc.MAX_CALIBRATION_TOKENS]
  cal_founding = lm.tokenizer.encode(founding)[:kc.MAX_CALIBRATION_TOKENS]
  data_dir = pathlib.Path(_DATA.value or REPO.parent / "shared" / "data")
  book = lm.tokenizer.encode((data_dir / "books" / _BOOK.value).read_text(encoding="utf-8"))
  held = book[_OFFSET.value:_OFFSET.value + _TOKENS.value]
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
        arrays = kvtc.kvtc_encode_host(kv, dt, level)
        nbytes += len(codecs.encode_payload("kvtc", level, arrays, layout))
        rec = np.asarray(kvtc.dequantize_reference(kvtc.payload_from_arrays(arrays), dt, k, h))
        kl += float((((rec - kv) ** 2).reshape(l_, 2, -1).mean(-1) * sens).sum())
      n_chunks = x_held.shape[2] // C
      results[name][level] = {"bytes_per_token": nbytes / x_held.shape[2],
                              "predicted_kl": kl / n_chunks}
      print(f"{name:18s} level {level}: {nbytes / x_held.shape[2]:8.1f} B/token  "
            f"predicted KL {kl / n_chunks:.4f}", flush=True)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  (out / "kvtc_design.json").write_text(json.dumps({
      "benchmark": "kvtc_design", "model": MODEL, "dtype": "float32", "machine": machine(),
      "git_sha": git_sha(), "held_out": {"book": _BOOK.value, "offset": _OFFSET.value,
                                         "tokens": len(held)},
      "calibration_tokens": {"founding": len(cal_founding), "shipped": len(cal_all)},
      "chunk": C, "results": results, "elapsed_s": time.time() - t0,
      "note": "sensitivities of the model's calibrated transform; same steps for every transform"},
      indent=1))


if __name__ == "__main__":
  app.run(main)
