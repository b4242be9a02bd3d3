"""Size and speed of the interleaved rANS format (kvjax/storage/rans.py) on this machine.

Usage:
  python scripts/bench_rans.py [--out benchmarks/results] [--seed 0] [--reps 3]

Data: a chunk-shaped set of quantized Laplacian symbols, like CacheGen/transform-codec deltas
of SmolLM2-135M (30 layers x K/V = 60 models, 256 tokens, 3 heads x 64 channels = 192 streams
per model: 2.95 M symbols), each model with its own spread (0.5..8 steps, log-uniform: about
1.4..5.9 bits per symbol). Measured, best of --reps, one process:

  size     bytes of the encoding vs the order-0 entropy with one model per (layer, K/V), pcodec
           with the same models (`kvjax.storage.entropy`, what cachegen stores today) and zstd
           -1 / -19; also with 4x longer streams (T = 1024, S = 48: 4 tokens-chunks per lane) and
           scale_bits 14.
  speed    numpy encode (`rans.encode`), parse (`rans.parse`), numpy decode
           (`rans.decode_arrays`), pcodec's decode of the same symbols (MB/s of its own
           bytes), and the jit'd jnp decoder (`rans_decode_reference`, compiled
           once, arrays already on the device; also parse + transfer + decode), in MB/s of the
           encoding (compressed bytes; 1 MB = 1e6 bytes) and M symbols/s.
  pallas   `rans_decode` in interpret mode on a slice (2 models x 64 steps x 64 streams):
           byte-exact against numpy (interpret mode is a correctness check, not a speed).

  kvtc     (--kvtc, default on) real SmolLM2-135M KV: a held-out passage (--book, --offset,
           --tokens; chunks of 256, fresh sequence from position 0) coded by kvtc at every level
           (transform: the model's cached calibration, or --transform FILE); kvtc's `q` stored as
           "pco-bands" (pcodec, host-decoded) and "rans-bands" (this format, device-decoded):
           stored bytes per token of the whole payload (`storage.codecs.encode_payload`) for both,
           and, per chunk at --kvtc_level, decode throughput in MB/s of the coded `q`: host
           pcodec (`entropy.decode_components`), numpy rANS (`entropy.decode_rans_codes`), the
           jit'd jnp rANS reference (`kvtc_rans.decode_codes`, arrays on the device; and
           parse + pack + transfer + decode, what a load runs), byte-exact checked; the Pallas
           kernel in interpret mode on a slice of one chunk (2 layers x 16 tokens x 40 components).

No GPU was used; the kernel's layout for one (kvjax/kernels/rans_decode.py docstring) targets
the issue's 4 GB/s (a 32 Gbps link) and is not measured here. Writes <out>/bench_rans.json
(machine, versions, threads, git SHA, seed) and prints a table.

    PYTHONPATH=. nice -n 19 .venv/bin/python scripts/bench_rans.py
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from absl import app
from absl import flags
import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pcodec  # noqa: E402
import zstandard  # noqa: E402

import benchlib  # noqa: E402
from kvjax.kernels import rans_decode as rd  # noqa: E402
from kvjax.storage import entropy, rans  # noqa: E402

_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results"), "Output folder.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic symbols.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (best is reported).")
_LAYERS = flags.DEFINE_integer("layers", 30, "Layers (models = 2 x layers).")
_KVTC = flags.DEFINE_bool("kvtc", True, "Run the kvtc phase on real SmolLM2 KV.")
_DATA = flags.DEFINE_string("data_dir", None, "The shared data folder (default ../shared/data).")
_BOOK = flags.DEFINE_string("book", "pg11_alice_in_wonderland_carroll.txt", "Held-out book.")
_OFFSET = flags.DEFINE_integer("offset", 1000, "First token of the held-out passage.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens of the held-out passage (x 256).")
_TRANSFORM = flags.DEFINE_string("transform", None, "A kvtc transform .npz (default: the "
                                 "model's cached calibration, calibrated if missing).")
_KVTC_LEVEL = flags.DEFINE_integer("kvtc_level", 0, "kvtc level of the throughput phase.")
C = 256


def kvtc_phase(reps: int) -> dict:
  """Stored bytes and decode rates of kvtc's q as pco-bands and rans-bands (module docstring)."""
  from unittest import mock  # noqa: PLC0415
  from bench_codec_lib import MODEL  # noqa: PLC0415
  from kvjax.kernels import kvtc, kvtc_rans  # noqa: PLC0415
  from kvjax.models import kv_calibration as kc  # noqa: PLC0415
  from kvjax.models.llama import Llama  # noqa: PLC0415
  from kvjax.models.calibration_model import CalibrationModel  # noqa: PLC0415
  from kvjax.models.compilation_cache import default_cache_root  # noqa: PLC0415
  from kvjax.models.paged_runner import PagedModelRunner  # noqa: PLC0415
  from kvjax.models.runner_api import PagedRunnerConfig, SeqChunk  # noqa: PLC0415
  from kvjax.models.registry import load_model  # noqa: PLC0415
  from kvjax.storage import codecs  # noqa: PLC0415
  from kvjax.storage.types import KVLayout  # noqa: PLC0415

  params_dir = os.path.join(default_cache_root(), "params")
  lm = load_model(MODEL, cache_dir=params_dir)
  cfg = lm.config
  l_, k, h = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  model = Llama.from_params(cfg, lm.params)
  blocks = -(-max(_TOKENS.value, 1024) // 16)
  runner = PagedModelRunner(model, PagedRunnerConfig(
      num_blocks=blocks, block_size=16, max_num_seqs=1, max_num_batched_tokens=C,
      max_seq_len=blocks * 16, chunk_sizes=(C,)))
  table = list(range(blocks))
  if _TRANSFORM.value:
    t = kc.load_transform(_TRANSFORM.value, k, h)
    transform_source = pathlib.Path(_TRANSFORM.value).name
  else:
    t = kc.load_or_calibrate(CalibrationModel(model), lm.tokenizer, str(lm.fingerprint),
                             params_dir)
    transform_source = kc.cache_file_name(str(lm.fingerprint))
  dt = t.device_arrays()
  data_dir = pathlib.Path(_DATA.value or REPO.parent / "shared" / "data")
  book = lm.tokenizer.encode((data_dir / "books" / _BOOK.value).read_text(encoding="utf-8"))
  held = book[_OFFSET.value:_OFFSET.value + _TOKENS.value]
  held = held[:len(held) // C * C]
  layout = KVLayout(l_, C, k, h, "float32")
  levels = list(range(len(kvtc.KVTC_LEVEL_KL)))
  payloads = {level: [] for level in levels}
  runner.reset()
  for s0 in range(0, len(held), C):
    o = runner.step([SeqChunk(held[s0:s0 + C], s0, table)])
    kv = np.stack([np.asarray(o.k_pre_rope_LTKH, np.float32),
                   np.asarray(o.v_LTKH, np.float32)], axis=1)
    for level in levels:
      payloads[level].append(kvtc.kvtc_encode_host(kv, dt, level, start=s0))
  runner.close()
  tokens = len(held)
  size = {}
  for level in levels:
    row = {}
    for coding in ("pco-bands", "rans-bands"):
      with mock.patch.object(codecs, "KVTC_Q_CODING", coding):
        blobs = [codecs.encode_payload("kvtc", level, p, layout) for p in payloads[level]]
      assert {codecs.read_header(b).arrays[0].coding for b in blobs} == {coding}
      q_bytes = sum(codecs.read_header(b).arrays[0].nbytes for b in blobs)
      row[coding] = {"bytes_per_token": sum(map(len, blobs)) / tokens,
                     "q_bytes_per_token": q_bytes / tokens}
    row["rans_over_pco"] = (row["rans-bands"]["bytes_per_token"] /
                            row["pco-bands"]["bytes_per_token"] - 1.0)
    size[f"level_{level}"] = row

  level = _KVTC_LEVEL.value
  qs = [p["q"] for p in payloads[level]]
  pco = [entropy.encode_components(q) for q in qs]
  rb = [entropy.encode_components_rans(q) for q in qs]
  parsed = [entropy.parse_components_rans(b, q.shape) for b, q in zip(rb, qs)]
  use_pallas = jax.default_backend() != "cpu"
  t0 = time.perf_counter()
  got, ok = kvtc_rans.decode_codes(kvtc_rans.pack_bands(parsed[0].shape, *parsed[0][1:]),
                                   use_pallas=use_pallas)
  jax.block_until_ready(got)
  t_compile = time.perf_counter() - t0
  dev = [jax.device_put(kvtc_rans.pack_bands(p.shape, *p[1:])) for p in parsed]
  exact = bool(ok)
  for q, d in zip(qs, dev):
    g, ok = kvtc_rans.decode_codes(d, use_pallas=use_pallas)
    exact &= bool(ok) and bool(np.array_equal(np.asarray(g), q))
  for q, p in zip(qs, parsed):
    exact &= bool(np.array_equal(entropy.decode_rans_codes(p), q))
  assert exact, "rANS decoders are not byte-exact"

  def per_chunk(fn, blobs, r=reps):
    return sum(best_of(lambda i=i: fn(i), r)[0] for i in range(len(blobs))), sum(map(len, blobs))

  def load(i):
    p = entropy.parse_components_rans(rb[i], qs[i].shape)
    return jax.block_until_ready(kvtc_rans.decode_codes(kvtc_rans.pack_bands(p.shape, *p[1:]),
                                                        use_pallas=use_pallas))

  timings = {
      "pcodec_host": per_chunk(lambda i: entropy.decode_components(pco[i], qs[i].shape), pco),
      "rans_numpy_host": per_chunk(lambda i: entropy.decode_rans_codes(parsed[i]), rb, 1),
      "rans_jnp_device": per_chunk(lambda i: jax.block_until_ready(
          kvtc_rans.decode_codes(dev[i], use_pallas=use_pallas)), rb),
      "rans_parse_pack_transfer_jnp": per_chunk(load, rb),
  }
  speed = {name: {"s_per_chunk": secs / len(qs), "MB_per_s": nbytes / secs / 1e6}
           for name, (secs, nbytes) in timings.items()}
  speed["compile_and_first_s"] = t_compile

  small = np.ascontiguousarray(qs[0][:2, :, :16, :40])
  sp = entropy.parse_components_rans(entropy.encode_components_rans(small), small.shape)
  t0 = time.perf_counter()
  gp, okp = kvtc_rans.decode_codes(kvtc_rans.pack_bands(sp.shape, *sp[1:]), use_pallas=True,
                                   interpret=True)
  pallas = {"shape": list(small.shape), "s_including_compile": time.perf_counter() - t0,
            "byte_exact": bool(okp) and bool(np.array_equal(np.asarray(gp), small))}
  return {"model": MODEL, "transform": transform_source,
          "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": tokens,
                       "chunk": C},
          "rans_steps_per_stream": entropy.RANS_STEPS, "size": size,
          "throughput_level": level, "throughput": speed, "byte_exact": exact,
          "decoder": "pallas" if use_pallas else "jnp reference",
          "pallas_interpret": pallas}


def chunk_symbols(seed: int, models: int, steps: int, streams: int) -> np.ndarray:
  """uint8[M, T, S] quantized Laplacian symbols centred at 128, one spread per model."""
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.uniform(np.log(0.5), np.log(8.0), size=(models, 1, 1)))
  q = np.rint(rng.laplace(0.0, 1.0, size=(models, steps, streams)) * scale) + 128
  return np.clip(q, 0, 255).astype(np.uint8)


def best_of(fn, reps):
  times = []
  out = None
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return min(times), out


def sizes(symbols, **kw):
  data = rans.encode(symbols, **kw)
  bound = rans.empirical_entropy_bits(symbols) / 8
  return data, {"bytes": len(data), "bits_per_symbol": 8 * len(data) / symbols.size,
                "over_entropy": len(data) / bound - 1.0}


def plot(kv: dict, path: pathlib.Path) -> bool:
  """Bytes per token (pco-bands vs rans-bands per level) and q decode rates; False without
  matplotlib."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return False
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  levels = sorted(kv["size"])
  x = np.arange(len(levels))
  for i, coding in enumerate(("pco-bands", "rans-bands")):
    a.bar(x + (i - 0.5) * 0.4, [kv["size"][lv][coding]["bytes_per_token"] for lv in levels], 0.4,
          label=coding)
  a.set_xticks(x, [lv.replace("level_", "level ") for lv in levels])
  a.set_ylabel("stored bytes / token (kvtc payload)")
  a.set_title(f"kvtc on {kv['held_out']['tokens']} tokens of SmolLM2-135M KV")
  a.legend()
  names = [n for n, v in kv["throughput"].items() if isinstance(v, dict)]
  b.barh(names, [kv["throughput"][n]["MB_per_s"] for n in names])
  b.set_xscale("log")
  b.set_xlabel(f"MB/s of coded q, level {kv['throughput_level']} chunk (2-core CPU VM)")
  b.set_title("decode of one 256-token chunk's codes")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv):
  del argv
  reps = _REPS.value
  m_, t_, s_ = 2 * _LAYERS.value, 256, 192
  symbols = chunk_symbols(_SEED.value, m_, t_, s_)
  n_sym = symbols.size
  bound = rans.empirical_entropy_bits(symbols) / 8
  signed = (symbols.astype(np.int16) - 128).astype(np.int8)

  data, main_size = sizes(symbols)
  size = {
      "entropy_bound": {"bytes": bound, "bits_per_symbol": 8 * bound / n_sym},
      "rans_T256_S192_n12": main_size,
      "rans_T1024_S48_n12": sizes(symbols.reshape(m_, t_, 4, 48).transpose(0, 2, 1, 3)
                                  .reshape(m_, 4 * t_, 48))[1],
      "rans_T256_S192_n14": sizes(symbols, scale_bits=14)[1],
  }
  for name, blob in (("pcodec_per_model", entropy.encode_groups(signed, m_)),
                     ("zstd_1", zstandard.ZstdCompressor(level=1).compress(symbols.tobytes())),
                     ("zstd_19", zstandard.ZstdCompressor(level=19).compress(symbols.tobytes()))):
    size[name] = {"bytes": len(blob), "bits_per_symbol": 8 * len(blob) / n_sym,
                  "over_entropy": len(blob) / bound - 1.0}

  mb = len(data) / 1e6
  t_enc, _ = best_of(lambda: rans.encode(symbols), reps)
  t_parse, arrays = best_of(lambda: rans.parse(data), reps)
  t_np, decoded = best_of(lambda: rans.decode_arrays(arrays), reps)
  assert np.array_equal(decoded, symbols), "numpy decoder mismatch"

  static = dict(scale_bits=arrays.scale_bits, num_streams=arrays.num_streams,
                num_steps=arrays.num_steps)
  dev = [jax.device_put(a) for a in arrays[:5]]
  t0 = time.perf_counter()
  got, ok = rd.rans_decode_reference(*dev, **static)
  jax.block_until_ready(got)
  t_compile = time.perf_counter() - t0
  assert np.array_equal(np.asarray(got), symbols) and bool(ok), "jnp reference mismatch"

  def jnp_decode():
    return jax.block_until_ready(rd.rans_decode_reference(*dev, **static))

  def end_to_end():
    a = rans.parse(data)
    return jax.block_until_ready(rd.rans_decode_reference(*[jnp.asarray(x) for x in a[:5]],
                                                          **static))

  pco_blob = entropy.encode_groups(signed, m_)
  t_pco, _ = best_of(lambda: entropy.decode_groups(pco_blob, signed.shape), reps)
  t_jnp, _ = best_of(jnp_decode, reps)
  t_e2e, _ = best_of(end_to_end, reps)

  small = symbols[:2, :64, :64]
  small_arrays = rans.parse(rans.encode(small))
  t0 = time.perf_counter()
  got_p, ok_p = rd.rans_decode(**small_arrays._asdict(), interpret=True)
  t_interp = time.perf_counter() - t0
  pallas_exact = bool(np.array_equal(np.asarray(got_p), rans.decode_arrays(small_arrays))
                      and bool(ok_p))

  def rate(t):
    return {"s": t, "MB_per_s": mb / t, "Msymbols_per_s": n_sym / t / 1e6}

  speed = {"numpy_encode": rate(t_enc), "numpy_parse": rate(t_parse),
           "numpy_decode": rate(t_np), "jnp_reference_decode": rate(t_jnp),
           "parse_transfer_jnp_decode": rate(t_e2e), "jnp_compile_and_first_s": t_compile,
           "pcodec_decode_same_symbols": {"s": t_pco, "MB_per_s": len(pco_blob) / 1e6 / t_pco,
                                          "Msymbols_per_s": n_sym / t_pco / 1e6}}
  result = {
      "script": "scripts/bench_rans.py", "git_sha": benchlib.git_sha(),
      "machine": benchlib.machine(), "seed": _SEED.value, "reps": reps,
      "versions": {"jax": jax.__version__, "numpy": np.__version__,
                   "pcodec": getattr(pcodec, "__version__", "?"),
                   "zstandard": zstandard.__version__, "format_version": rans.VERSION},
      "threads": {"jax_backend": jax.default_backend(), "jax_devices": len(jax.devices()),
                  "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
                  "note": "numpy: one thread; XLA CPU: its default intra-op pool"},
      "data": {"models": m_, "steps": t_, "streams_per_model": s_, "symbols": n_sym,
               "lanes": rans.DEFAULT_LANES, "scale_bits": rans.DEFAULT_SCALE_BITS,
               "encoded_bytes": len(data)},
      "size": size, "speed": speed,
      "pallas_interpret": {"shape": list(small.shape), "byte_exact": pallas_exact,
                           "s_including_compile": t_interp},
  }
  if _KVTC.value:
    result["kvtc"] = kvtc_phase(reps)
  out = pathlib.Path(_OUT.value)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench_rans.json").write_text(json.dumps(result, indent=1) + "\n")

  print(f"{m_} models x {t_} steps x {s_} streams = {n_sym / 1e6:.2f} M symbols, "
        f"{jax.default_backend()} backend, {os.cpu_count()} cores")
  print(f"{'coder':24s} {'bytes':>10s} {'bits/sym':>9s} {'over H':>8s}")
  for name, v in size.items():
    over = f"{100 * v['over_entropy']:+.2f}%" if "over_entropy" in v else ""
    print(f"{name:24s} {v['bytes']:10.0f} {v['bits_per_symbol']:9.3f} {over:>8s}")
  print(f"{'step':28s} {'seconds':>9s} {'MB/s':>8s} {'Msym/s':>8s}")
  for name, v in speed.items():
    if isinstance(v, dict):
      print(f"{name:28s} {v['s']:9.4f} {v['MB_per_s']:8.1f} {v['Msymbols_per_s']:8.1f}")
  print(f"jnp compile + first decode {t_compile:.2f} s; Pallas interpret {list(small.shape)}: "
        f"byte-exact={pallas_exact} ({t_interp:.1f} s)")
  if _KVTC.value and plot(result["kvtc"], out / "bench_rans.png"):
    print(f"wrote {out / 'bench_rans.png'}")
  if _KVTC.value:
    kv = result["kvtc"]
    print(f"kvtc on {kv['held_out']['tokens']} tokens of {kv['held_out']['book']} "
          f"(transform {kv['transform']}): bytes per token of the stored payload")
    for name, row in kv["size"].items():
      print(f"  {name}: pco-bands {row['pco-bands']['bytes_per_token']:8.1f}  rans-bands "
            f"{row['rans-bands']['bytes_per_token']:8.1f}  ({100 * row['rans_over_pco']:+.2f}%)")
    print(f"kvtc level {kv['throughput_level']} q decode, MB/s of coded q (byte-exact: "
          f"{kv['byte_exact']}):")
    for name, v in kv["throughput"].items():
      if isinstance(v, dict):
        print(f"  {name:32s} {1e3 * v['s_per_chunk']:8.1f} ms/chunk {v['MB_per_s']:8.1f} MB/s")
    print(f"  compile + first decode {kv['throughput']['compile_and_first_s']:.2f} s; Pallas "
          f"interpret {kv['pallas_interpret']['shape']}: byte-exact="
          f"{kv['pallas_interpret']['byte_exact']}")
  print(f"wrote {out / 'bench_rans.json'}")


if __name__ == "__main__":
  app.run(main)
