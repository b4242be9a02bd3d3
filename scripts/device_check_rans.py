"""Device check of kvtc's rANS decoding (`kvjax.kernels.kvtc_rans`): compile, compare, measure.

For a GPU session (H200 in mind): a SmolLM2-shaped chunk of kvtc codes (30 layers x K/V, 256
tokens, 192 components; Laplacian codes whose spread falls from --top to 0.05 over the
components, like real ones) is coded as "rans-bands" (`storage.format.entropy.encode_components_rans`,
rANS format version `rans.VERSION`), then decoded by the Pallas kernel compiled for the device
(interpret=False) and by the jnp reference on the same device; both must equal the codes byte
for byte. With --llama8b (default on a device), one chunk of a LLaMA-3.1-8B prompt (32 layers,
256 tokens, 8 heads x 128 = 1024 components; a 4K-token prompt is 16 of them) is checked the
same way. Measured: median time of one chunk's decode (arrays already on the device) and of
pack + transfer + decode, in GB/s of coded bytes, against --link_GB_per_s (4: an NVMe-class
link, 32 Gbps; the goal is 4x that). `--cpu` runs the same code at a tiny size in Pallas
interpret mode (proof that it runs). JSON (with `scripts/benchlib.py`'s provenance) to $OUT/
(or benchmarks/results/) device_check_rans.json (device_check_rans_cpu.json with --cpu); a
table is printed.

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
import benchlib  # noqa: E402

from kvjax.kernels import kvtc_rans  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {"cpu": (2, 2, 16, 40), "gpu": (30, 2, 256, 192), "llama8b": (32, 2, 256, 1024)}

_CPU = flags.DEFINE_bool("cpu", False, "Tiny size in interpret mode (no accelerator needed).")
_LINK = flags.DEFINE_float("link_GB_per_s", 4.0, "The storage link decode is judged against "
                           "(GB/s; 4: NVMe-class, 32 Gbps).")
_LLAMA8B = flags.DEFINE_bool("llama8b", True, "Also check one LLaMA-3.1-8B chunk (not with "
                             "--cpu).")
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
  from kvjax.storage.format import entropy, rans  # pylint: disable=import-outside-toplevel
  blob = entropy.encode_components_rans(q)
  parsed = entropy.parse_components_rans(blob, q.shape)
  return {"q": q, "coded_bytes": len(blob), "bands": [tuple(b) for b in parsed.bands],
          "offsets": [np.asarray(o) for o in parsed.offsets],
          "arrays": [a._asdict() for a in parsed.arrays], "format_version": rans.VERSION}


def median_s(fn, iters: int) -> float:
  """Median seconds of `iters` calls of `fn` on the device (`benchlib.median_seconds`)."""
  return benchlib.median_seconds(fn, iters, jax.block_until_ready)


def check(c: dict, interpret: bool, iters: int) -> dict:
  """Decodes one prepared chunk with the Pallas kernel and the jnp reference; its results."""
  q, coded_bytes = c["q"], c["coded_bytes"]
  link = _LINK.value * 1e9
  # Each band's `kvjax.storage.format.rans.RansArrays` fields, by name, as `pack_bands` reads them.
  band_arrays = [types.SimpleNamespace(**{"segments": 1, **a}) for a in c["arrays"]]
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
                  "decode_over_link": coded_bytes / dec / link}
  steps = [-(-a.num_steps // a.segments) for a in band_arrays]
  lanes = [int(np.count_nonzero(np.asarray(a.lengths))) for a in band_arrays]
  return {"shape": list(q.shape), "coded_bytes": coded_bytes,
          "format_version": c.get("format_version", 1),
          "streams_per_band": [a.num_streams for a in band_arrays],
          "steps_per_stream": [a.num_steps for a in band_arrays],
          "segments_per_stream": [a.segments for a in band_arrays],
          "lanes_per_band": lanes, "lanes": sum(lanes), "steps_per_lane": steps,
          "results": rows}


def main(argv):
  del argv
  record = {**benchlib.provenance(), "script": "scripts/device_check_rans.py"}
  interpret = _CPU.value
  iters = 1 if interpret else _ITERS.value
  names = ["cpu"] if interpret else ["gpu"] + (["llama8b"] if _LLAMA8B.value else [])
  codes_path = pathlib.Path(_CODES.value)
  if _PREPARE.value:
    codes_path.parent.mkdir(parents=True, exist_ok=True)
    with open(codes_path, "wb") as f:
      pickle.dump({k: _code(_codes(v)) for k, v in SHAPES.items()
                   if k != "llama8b" or _LLAMA8B.value}, f)
    print(f"wrote {codes_path}")
    return
  prepared = {}
  if codes_path.exists():
    with open(codes_path, "rb") as f:
      prepared = pickle.load(f)
  cases, sources = {}, {}
  for name in names:
    c = prepared.get(name)
    sources[name] = codes_path.name if c is not None else "coded in this run"
    c = c if c is not None else _code(_codes(SHAPES[name]))
    assert tuple(c["q"].shape) == SHAPES[name], (c["q"].shape, SHAPES[name])
    cases[name] = check(c, interpret, iters)
  main_case = cases[names[0]]
  record.update({
      "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
      "interpret": interpret, "seed": _SEED.value, "iters": iters, "codes": sources[names[0]],
      "link_GB_per_s": _LINK.value, **main_case,
      "chunks": {n: dict(v, codes=sources[n]) for n, v in cases.items() if n != names[0]}})
  out = pathlib.Path(os.environ.get("OUT") or REPO / "benchmarks" / "results")
  name = "device_check_rans_cpu.json" if interpret else "device_check_rans.json"
  benchlib.write_json(out / name, record)
  bad = []
  for case, v in cases.items():
    print(f"{jax.default_backend()} {case} {v['shape']} coded {v['coded_bytes']} bytes, rANS "
          f"v{v['format_version']}, {v['lanes']} lanes of {max(v['steps_per_lane'])} steps")
    for row, r in v["results"].items():
      print(f"  {row:14s} exact={r['byte_exact']} decode {1e3 * r['decode_s']:8.2f} ms "
            f"{r['decode_GB_per_s']:7.3f} GB/s (x{r['decode_over_link']:.3f} of "
            f"{_LINK.value:g} GB/s)  load {1e3 * r['load_s']:8.2f} ms  compile "
            f"{r['compile_and_first_s']:.1f} s")
      if not r["byte_exact"]:
        bad.append(f"{case}/{row}")
  if bad:
    raise SystemExit(f"not byte-exact: {', '.join(bad)}")


if __name__ == "__main__":
  app.run(main)
