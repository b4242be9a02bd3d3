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

No GPU was used; the kernel's layout for one (kvjax/kernels/rans_decode.py docstring) targets
the issue's 4 GB/s (a 32 Gbps link) and is not measured here. Writes <out>/bench_rans.json
(machine, versions, threads, git SHA, seed) and prints a table.
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
  print(f"wrote {out / 'bench_rans.json'}")


if __name__ == "__main__":
  app.run(main)
