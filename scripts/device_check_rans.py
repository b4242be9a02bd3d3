"""Device check of kvtc's rANS decoding (`kvjax.kernels.kvtc_rans`): compile, compare, measure.

For a GPU session (H200 in mind): a SmolLM2-shaped chunk of kvtc codes (30 layers x K/V, 256
tokens, 192 components; Laplacian codes whose spread falls from --top to 0.05 over the
components, like real ones) is coded as "rans-bands" (`storage.entropy.encode_components_rans`),
then decoded by the Pallas kernel compiled for the device (interpret=False) and by the jnp
reference on the same device; both must equal the codes byte for byte. Measured: median time of
one chunk's decode (arrays already on the device) and of pack + transfer + decode, in
GB/s of coded bytes, against the 4 GB/s a 32 Gbps link delivers (issue 13). `--cpu` runs the same
code at a tiny size in Pallas interpret mode (proof that it runs). JSON to $OUT/ (or
benchmarks/results/) device_check_rans.json (device_check_rans_cpu.json with --cpu); a table is
printed.

    PYTHONPATH=. python scripts/device_check_rans.py [--cpu] [--iters 20]

The GPU machine may lack storage's libraries (pcodec, tensorstore, zstandard): then the codes
are coded beforehand where kvjax is installed, `--prepare` (writes `--codes`, a pickle of plain
numpy arrays: the codes, their per-band rANS arrays and the coded size), and the device run reads
them (`--codes`; only `kvjax.kernels` is imported). Its "load" then times pack + transfer +
decode, without the byte parsing (storage's, on the host).

    PYTHONPATH=. python scripts/device_check_rans.py --prepare   # on the CPU machine
    PYTHONPATH=. python scripts/device_check_rans.py             # on the GPU machine
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import pickle
import time
import types

import jax
import numpy as np
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/benchlib.py
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))  # the kvjax package
from benchlib import git_sha, machine  # noqa: E402

from kvjax.kernels import kvtc_rans  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
LINK_BYTES_PER_S = 4e9  # a 32 Gbps host -> device link

_CPU = flags.DEFINE_bool("cpu", False, "Tiny size in interpret mode (no accelerator needed).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed decodes (median reported).")
_TOP = flags.DEFINE_float("top", 40.0, "Spread (in steps) of the first component's codes.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic codes.")
_CODES = flags.DEFINE_string("codes", str(REPO / "benchmarks" / "device_inputs" /
                                          "kvtc_rans_codes.pkl"),
                             "Codes coded beforehand (--prepare writes it; read when it exists).")
_PREPARE = flags.DEFINE_bool("prepare", False, "Only code the chunk(s) into --codes and exit.")


def _codes(shape) -> np.ndarray:
  rng = np.random.default_rng(_SEED.value)
  spread = np.geomspace(_TOP.value, 0.05, shape[3])
  return np.clip(np.rint(rng.laplace(size=shape) * spread), -32767, 32767).astype(np.int16)


def _code(q: np.ndarray) -> dict:
  """Codes q as storage does ("rans-bands") and parses it back: plain arrays only."""
  from kvjax.storage import entropy  # pylint: disable=import-outside-toplevel
  blob = entropy.encode_components_rans(q)
  parsed = entropy.parse_components_rans(blob, q.shape)
  return {"q": q, "coded_bytes": len(blob), "bands": [tuple(b) for b in parsed.bands],
          "offsets": [np.asarray(o) for o in parsed.offsets],
          "arrays": [a._asdict() for a in parsed.arrays]}


def median_s(fn, iters: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(argv):
  del argv
  interpret = _CPU.value
  shape = (2, 2, 16, 40) if interpret else (30, 2, 256, 192)
  iters = 1 if interpret else _ITERS.value
  codes_path = pathlib.Path(_CODES.value)
  sizes = {"cpu": (2, 2, 16, 40), "gpu": (30, 2, 256, 192)}
  if _PREPARE.value:
    codes_path.parent.mkdir(parents=True, exist_ok=True)
    with open(codes_path, "wb") as f:
      pickle.dump({k: _code(_codes(v)) for k, v in sizes.items()}, f)
    print(f"wrote {codes_path}")
    return
  if codes_path.exists():
    with open(codes_path, "rb") as f:
      c = pickle.load(f)["cpu" if interpret else "gpu"]
    source = codes_path.name
  else:
    c, source = _code(_codes(shape)), "coded in this run"
  q, coded_bytes = c["q"], c["coded_bytes"]
  assert tuple(q.shape) == shape, (q.shape, shape)
  # Each band's `kvjax.storage.rans.RansArrays` fields, by name, as `pack_bands` reads them.
  band_arrays = [types.SimpleNamespace(**a) for a in c["arrays"]]
  packed = jax.device_put(kvtc_rans.pack_bands(q.shape, c["bands"], c["offsets"], band_arrays))
  rows = {}
  for name, use_pallas in (("pallas", True), ("jnp_reference", False)):
    t0 = time.perf_counter()
    got, ok = kvtc_rans.decode_codes(packed, use_pallas=use_pallas, interpret=interpret)
    exact = bool(ok) and bool(np.array_equal(np.asarray(got), q))
    compile_s = time.perf_counter() - t0
    dec = median_s(lambda u=use_pallas: kvtc_rans.decode_codes(packed, use_pallas=u,
                                                                 interpret=interpret), iters)

    def load(u=use_pallas):
      return kvtc_rans.decode_codes(
          kvtc_rans.pack_bands(q.shape, c["bands"], c["offsets"], band_arrays), use_pallas=u,
          interpret=interpret)

    e2e = median_s(load, iters)
    rows[name] = {"byte_exact": exact, "compile_and_first_s": compile_s, "decode_s": dec,
                  "decode_GB_per_s": coded_bytes / dec / 1e9, "load_s": e2e,
                  "load_GB_per_s": coded_bytes / e2e / 1e9,
                  "decode_over_link": coded_bytes / dec / LINK_BYTES_PER_S}
  result = {"script": "scripts/device_check_rans.py", "git_sha": git_sha(), "machine": machine(),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__, "interpret": interpret, "seed": _SEED.value,
            "shape": list(shape), "coded_bytes": coded_bytes, "iters": iters, "codes": source,
            "streams_per_band": [a.num_streams for a in band_arrays],
            "steps_per_stream": [a.num_steps for a in band_arrays], "results": rows}
  out = pathlib.Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
  out.mkdir(parents=True, exist_ok=True)
  name = "device_check_rans_cpu.json" if interpret else "device_check_rans.json"
  (out / name).write_text(json.dumps(result, indent=1) + "\n")
  print(f"{jax.default_backend()} {shape} coded {coded_bytes} bytes")
  for name, r in rows.items():
    print(f"  {name:14s} exact={r['byte_exact']} decode {1e3 * r['decode_s']:8.2f} ms "
          f"{r['decode_GB_per_s']:7.3f} GB/s (x{r['decode_over_link']:.3f} of 4 GB/s)  load "
          f"{1e3 * r['load_s']:8.2f} ms  compile {r['compile_and_first_s']:.1f} s")
  if not all(r["byte_exact"] for r in rows.values()):
    raise SystemExit("not byte-exact")


if __name__ == "__main__":
  app.run(main)
