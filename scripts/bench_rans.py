"""Size and speed of the interleaved rANS format (kvjax/storage/format/rans.py), version 2 against 1.

Usage:
  python scripts/bench_rans.py [--out benchmarks/results] [--seed 0] [--rounds 3]

Version 1 runs one lane per stream of about 512 symbols (kvtc's bands); version 2 (what
encoders write) cuts streams into segments of at most `entropy.RANS_LANE_STEPS` symbols, each a
lane with its own state, and zstd-compresses the side data (tables, states, word counts). Both
are measured side by side in one run:

Data: a chunk-shaped set of quantized Laplacian symbols, like CacheGen/transform-codec deltas
of SmolLM2-135M (30 layers x K/V = 60 models, 256 tokens, 3 heads x 64 channels = 192 streams
per model: 2.95 M symbols), each model with its own spread (0.5..8 steps, log-uniform: about
1.4..5.9 bits per symbol).

  size     bytes of the encoding (version 1; version 2 with lanes of at most --lane_steps) vs
           the order-0 entropy with one model per (layer, K/V), pcodec with the same models
           (`kvjax.storage.format.entropy`) and zstd -1 / -19.
  speed    numpy encode, parse and decode (`rans.encode`, `rans.parse`, `rans.decode_arrays`)
           and the jit'd jnp decoder (`rans_decode_reference`, compiled once, arrays already on
           the device), each version, `--rounds` interleaved rounds (`benchlib`), seconds and
           MB/s of the encoding (1 MB = 1e6 bytes).
  pallas   `rans_decode` in interpret mode on a slice (2 models x 64 steps x 64 streams, both
           versions): byte-exact against numpy (interpret mode is a correctness check only).

  kvtc     (--kvtc, default on) real SmolLM2-135M KV: a held-out passage (--book, --offset,
           --tokens; chunks of 256, fresh sequence from position 0) coded by kvtc at every level
           (transform: the model's cached calibration, or --transform FILE); kvtc's `q` stored as
           "pco-bands" (pcodec, host-decoded) and "rans-bands" in rANS version 1 and 2: stored
           bytes per token of the whole payload (`storage.format.codecs.encode_payload`), lanes and
           steps per lane; per chunk at --kvtc_level, decode times of the coded `q` in
           interleaved rounds: host pcodec, numpy rANS (`entropy.decode_rans_codes`) and the
           jit'd jnp rANS reference (`kvtc_rans.decode_codes`, arrays on the device), each
           version, byte-exact checked; the Pallas kernel in interpret mode on a slice.

No GPU is used; every time is from the machine in the JSON's `machine` (its load averages before
and after included). Writes <out>/bench_rans.json (`scripts/benchlib.py` provenance, seed) and
<out>/bench_rans.png, and prints a table. Exits non-zero when a decoder is not byte-exact.

    PYTHONPATH=. nice -n 19 .venv/bin/python scripts/bench_rans.py
"""

from __future__ import annotations

import functools
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
import zstandard  # noqa: E402

import benchlib  # noqa: E402
from kvjax.kernels import rans_decode as rd  # noqa: E402
from kvjax.storage.format import entropy, rans  # noqa: E402

_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results"), "Output folder.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic symbols.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved timing rounds (median reported).")
_LANE_STEPS = flags.DEFINE_integer("lane_steps", entropy.RANS_LANE_STEPS,
                                   "Version 2's most steps per lane (synthetic phase).")
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


def timed(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def rounds_of(settings: dict, rounds: int) -> dict:
  """{name: benchlib.summarize(seconds)} of each callable, run in interleaved rounds."""
  got = {name: [] for name in settings}
  for order in benchlib.interleaved_rounds(list(settings), rounds):
    for name in order:
      got[name].append(timed(settings[name]))
  return {name: benchlib.summarize(v) for name, v in got.items()}


def lane_counts(parsed) -> dict:
  """Lanes and steps per lane of one chunk's `RansCodes`."""
  return {"lanes": sum(int((a.lengths > 0).sum()) for a in parsed.arrays),
          "lanes_per_band": [int((a.lengths > 0).sum()) for a in parsed.arrays],
          "steps_per_lane": [rans.steps_per_lane(a.num_steps, a.segments)
                             for a in parsed.arrays]}


def kvtc_phase(rounds: int) -> dict:
  """Stored bytes and decode times of kvtc's q as pco-bands and rans-bands v1/v2 (module
  docstring)."""
  from unittest import mock  # noqa: PLC0415
  from bench_codec_lib import MODEL  # noqa: PLC0415
  from kvjax.kernels import kvtc, kvtc_rans  # noqa: PLC0415
  from kvjax.models.loading import kv_calibration as kc  # noqa: PLC0415
  from kvjax.models.nn.llama import Llama  # noqa: PLC0415
  from kvjax.models.nn.calibration_model import CalibrationModel  # noqa: PLC0415
  from kvjax.models.runner.compilation_cache import default_cache_root  # noqa: PLC0415
  from kvjax.models.runner.paged_runner import PagedModelRunner  # noqa: PLC0415
  from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk  # noqa: PLC0415
  from kvjax.models.loading.registry import load_model  # noqa: PLC0415
  from kvjax.storage.format import codecs  # noqa: PLC0415
  from kvjax.storage.format.types import KVLayout  # noqa: PLC0415

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
  encoders = {"pco-bands": ("pco-bands", entropy.encode_components_rans),
              "rans_v1": ("rans-bands", functools.partial(entropy.encode_components_rans,
                                                          version=1)),
              "rans_v2": ("rans-bands", entropy.encode_components_rans)}
  size = {}
  for level in levels:
    row = {}
    for name, (coding, encoder) in encoders.items():
      with mock.patch.object(codecs, "KVTC_Q_CODING", coding), \
          mock.patch.object(entropy, "encode_components_rans", encoder):
        blobs = [codecs.encode_payload("kvtc", level, p, layout) for p in payloads[level]]
      assert {codecs.read_header(b).arrays[0].coding for b in blobs} == {coding}
      q_bytes = sum(codecs.read_header(b).arrays[0].nbytes for b in blobs)
      row[name] = {"bytes": sum(map(len, blobs)), "bytes_per_token": sum(map(len, blobs)) / tokens,
                   "q_bytes_per_token": q_bytes / tokens}
    row["v2_over_v1"] = row["rans_v2"]["bytes"] / row["rans_v1"]["bytes"] - 1.0
    row["v1_over_pco"] = row["rans_v1"]["bytes"] / row["pco-bands"]["bytes"] - 1.0
    row["v2_over_pco"] = row["rans_v2"]["bytes"] / row["pco-bands"]["bytes"] - 1.0
    size[f"level_{level}"] = row

  level = _KVTC_LEVEL.value
  qs = [p["q"] for p in payloads[level]]
  pco = [entropy.encode_components(q) for q in qs]
  coded = {"v1": [entropy.encode_components_rans(q, version=1) for q in qs],
           "v2": [entropy.encode_components_rans(q) for q in qs]}
  parsed = {v: [entropy.parse_components_rans(b, q.shape) for b, q in zip(blobs, qs)]
            for v, blobs in coded.items()}
  exact, compile_s, dev = True, {}, {}
  for v in coded:
    t0 = time.perf_counter()
    jax.block_until_ready(kvtc_rans.decode_codes(kvtc_rans.pack_bands(
        parsed[v][0].shape, *parsed[v][0][1:])))
    compile_s[v] = time.perf_counter() - t0
    dev[v] = [jax.device_put(kvtc_rans.pack_bands(p.shape, *p[1:])) for p in parsed[v]]
    for q, d, p in zip(qs, dev[v], parsed[v]):
      g, ok = kvtc_rans.decode_codes(d)
      exact &= bool(ok) and bool(np.array_equal(np.asarray(g), q))
      exact &= bool(np.array_equal(entropy.decode_rans_codes(p), q))
  if not exact:
    raise SystemExit("kvtc phase: rANS decoders are not byte-exact")

  def per_chunk(fn):  # all chunks, one after another
    return lambda: [fn(i) for i in range(len(qs))]

  settings = {"pcodec_host": per_chunk(lambda i: entropy.decode_components(pco[i], qs[i].shape))}
  for v in coded:
    settings[f"rans_{v}_numpy_host"] = per_chunk(
        lambda i, v=v: entropy.decode_rans_codes(parsed[v][i]))
    settings[f"rans_{v}_jnp"] = per_chunk(lambda i, v=v: kvtc_rans.decode_codes(dev[v][i]))
  timings = rounds_of(settings, rounds)
  coded_bytes = {"pcodec_host": sum(map(len, pco)), **{
      n: sum(map(len, coded[n.split("_")[1]])) for n in settings if n.startswith("rans_")}}
  speed = {n: {"s_per_chunk": timings[n]["median"] / len(qs),
               "MB_per_s": coded_bytes[n] / timings[n]["median"] / 1e6, "rounds_s": timings[n]}
           for n in settings}
  speed["jnp_v1_over_v2"] = (timings["rans_v1_jnp"]["median"] /
                             timings["rans_v2_jnp"]["median"])
  speed["numpy_v1_over_v2"] = (timings["rans_v1_numpy_host"]["median"] /
                               timings["rans_v2_numpy_host"]["median"])
  speed["jnp_compile_and_first_s"] = compile_s

  small = np.ascontiguousarray(qs[0][:2, :, :16, :40])
  pallas = {"shape": list(small.shape)}
  for v, kw in (("v1", dict(version=1)), ("v2", dict(lane_steps=8))):
    sp = entropy.parse_components_rans(entropy.encode_components_rans(small, **kw), small.shape)
    gp, okp = kvtc_rans.decode_codes(kvtc_rans.pack_bands(sp.shape, *sp[1:]), use_pallas=True,
                                     interpret=True)
    pallas[f"byte_exact_{v}"] = bool(okp) and bool(np.array_equal(np.asarray(gp), small))
  if not all(v for k_, v in pallas.items() if k_.startswith("byte_exact")):
    raise SystemExit(f"kvtc phase: Pallas interpret not byte-exact: {pallas}")
  return {"model": MODEL, "transform": transform_source,
          "held_out": {"book": _BOOK.value, "offset": _OFFSET.value, "tokens": tokens,
                       "chunk": C},
          "rans_steps_per_stream": entropy.RANS_STEPS,
          "rans_lane_steps": entropy.RANS_LANE_STEPS,
          "lanes": {v: lane_counts(parsed[v][0]) for v in parsed},
          "size": size, "throughput_level": level, "throughput": speed, "byte_exact": exact,
          "decoder": "jnp reference (CPU)", "pallas_interpret": pallas}


def chunk_symbols(seed: int, models: int, steps: int, streams: int) -> np.ndarray:
  """uint8[M, T, S] quantized Laplacian symbols centred at 128, one spread per model."""
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.uniform(np.log(0.5), np.log(8.0), size=(models, 1, 1)))
  q = np.rint(rng.laplace(0.0, 1.0, size=(models, steps, streams)) * scale) + 128
  return np.clip(q, 0, 255).astype(np.uint8)


def sizes(symbols, **kw):
  data = rans.encode(symbols, **kw)
  bound = rans.empirical_entropy_bits(symbols) / 8
  return data, {"bytes": len(data), "bits_per_symbol": 8 * len(data) / symbols.size,
                "over_entropy": len(data) / bound - 1.0}


def plot(kv: dict, path: pathlib.Path) -> bool:
  """Bytes per token (pco-bands, rans v1, rans v2 per level) and q decode times; False without
  matplotlib."""
  plt = benchlib.pyplot()
  if plt is None:
    return False
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  levels = sorted(kv["size"])
  x = np.arange(len(levels))
  names = ("pco-bands", "rans_v1", "rans_v2")
  for i, name in enumerate(names):
    a.bar(x + (i - 1) * 0.27, [kv["size"][lv][name]["bytes_per_token"] for lv in levels], 0.27,
          label=name)
  a.set_xticks(x, [lv.replace("level_", "level ") for lv in levels])
  a.set_ylabel("stored bytes / token (kvtc payload)")
  a.set_title(f"kvtc on {kv['held_out']['tokens']} tokens of SmolLM2-135M KV")
  a.legend()
  rows = [n for n, v in kv["throughput"].items() if isinstance(v, dict) and "s_per_chunk" in v]
  b.barh(rows, [1e3 * kv["throughput"][n]["s_per_chunk"] for n in rows])
  b.set_xscale("log")
  b.set_xlabel(f"ms per 256-token chunk, level {kv['throughput_level']} (loaded 2-core CPU)")
  b.set_title("decode of one chunk's codes (median of interleaved rounds)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def main(argv):
  del argv
  record = {**benchlib.provenance(("jax", "jaxlib", "numpy", "pcodec", "zstandard", "kvjax")),
            "script": "scripts/bench_rans.py"}
  rounds = _ROUNDS.value
  m_, t_, s_ = 2 * _LAYERS.value, 256, 192
  symbols = chunk_symbols(_SEED.value, m_, t_, s_)
  n_sym = symbols.size
  bound = rans.empirical_entropy_bits(symbols) / 8
  signed = (symbols.astype(np.int16) - 128).astype(np.int8)
  kw = {"v1": dict(version=1), "v2": dict(lane_steps=_LANE_STEPS.value)}
  data, size = {}, {"entropy_bound": {"bytes": bound, "bits_per_symbol": 8 * bound / n_sym}}
  for v, k in kw.items():
    data[v], size[f"rans_{v}"] = sizes(symbols, **k)
  for name, blob in (("pcodec_per_model", entropy.encode_groups(signed, m_)),
                     ("zstd_1", zstandard.ZstdCompressor(level=1).compress(symbols.tobytes())),
                     ("zstd_19", zstandard.ZstdCompressor(level=19).compress(symbols.tobytes()))):
    size[name] = {"bytes": len(blob), "bits_per_symbol": 8 * len(blob) / n_sym,
                  "over_entropy": len(blob) / bound - 1.0}
  size["v2_over_v1"] = len(data["v2"]) / len(data["v1"]) - 1.0

  arrays = {v: rans.parse(d) for v, d in data.items()}
  dev, compile_s = {}, {}
  for v, a in arrays.items():
    assert np.array_equal(rans.decode_arrays(a), symbols), f"numpy decoder mismatch ({v})"
    dev[v] = {k: jax.device_put(x) if isinstance(x, np.ndarray) else x
              for k, x in a._asdict().items()}
    t0 = time.perf_counter()
    got, ok = rd.rans_decode_reference(**dev[v])
    jax.block_until_ready(got)
    compile_s[v] = time.perf_counter() - t0
    if not (np.array_equal(np.asarray(got), symbols) and bool(ok)):
      raise SystemExit(f"jnp reference not byte-exact ({v})")
  settings = {}
  for v in kw:
    settings[f"{v}_numpy_encode"] = lambda v=v: rans.encode(symbols, **kw[v])
    settings[f"{v}_numpy_parse"] = lambda v=v: rans.parse(data[v])
    settings[f"{v}_numpy_decode"] = lambda v=v: rans.decode_arrays(arrays[v])
    settings[f"{v}_jnp_decode"] = lambda v=v: rd.rans_decode_reference(**dev[v])
  timings = rounds_of(settings, rounds)
  speed = {n: {"s": t["median"], "MB_per_s": len(data[n[:2]]) / t["median"] / 1e6,
               "Msymbols_per_s": n_sym / t["median"] / 1e6, "rounds_s": t}
           for n, t in timings.items()}
  speed["jnp_v1_over_v2"] = timings["v1_jnp_decode"]["median"] / timings["v2_jnp_decode"]["median"]
  speed["jnp_compile_and_first_s"] = compile_s

  small = symbols[:2, :64, :64]
  pallas = {"shape": list(small.shape)}
  for v, k in (("v1", dict(version=1)), ("v2", dict(lane_steps=16))):
    small_arrays = rans.parse(rans.encode(small, **k))
    got_p, ok_p = rd.rans_decode(**small_arrays._asdict(), interpret=True)
    pallas[f"byte_exact_{v}"] = bool(np.array_equal(np.asarray(got_p),
                                                    rans.decode_arrays(small_arrays))
                                     and bool(ok_p))
  if not (pallas["byte_exact_v1"] and pallas["byte_exact_v2"]):
    raise SystemExit(f"Pallas interpret not byte-exact: {pallas}")

  record.update({
      "seed": _SEED.value, "rounds": rounds,
      "format": {"before": 1, "after": rans.VERSION, "lane_steps": _LANE_STEPS.value},
      "threads": {"jax_backend": jax.default_backend(), "jax_devices": len(jax.devices()),
                  "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                  "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
                  "note": "numpy: one thread; XLA CPU: its default intra-op pool"},
      "data": {"models": m_, "steps": t_, "streams_per_model": s_, "symbols": n_sym,
               "lanes_per_block": rans.DEFAULT_LANES, "scale_bits": rans.DEFAULT_SCALE_BITS,
               "lanes": {v: int((a.lengths > 0).sum()) for v, a in arrays.items()},
               "steps_per_lane": {v: rans.steps_per_lane(a.num_steps, a.segments)
                                  for v, a in arrays.items()}},
      "size": size, "speed": speed, "pallas_interpret": pallas})
  if _KVTC.value:
    record["kvtc"] = kvtc_phase(rounds)
  out = pathlib.Path(_OUT.value)
  benchlib.write_json(out / "bench_rans.json", record)

  print(f"{m_} models x {t_} steps x {s_} streams = {n_sym / 1e6:.2f} M symbols, "
        f"{jax.default_backend()} backend, {os.cpu_count()} cores, load "
        f"{record['loadavg_before']}")
  print(f"{'coder':24s} {'bytes':>10s} {'bits/sym':>9s} {'over H':>8s}")
  for name, v in size.items():
    if isinstance(v, dict):
      over = f"{100 * v['over_entropy']:+.2f}%" if "over_entropy" in v else ""
      print(f"{name:24s} {v['bytes']:10.0f} {v['bits_per_symbol']:9.3f} {over:>8s}")
  print(f"version 2 over version 1: {100 * size['v2_over_v1']:+.2f}% bytes; lanes "
        f"{record['data']['lanes']}, steps per lane {record['data']['steps_per_lane']}")
  print(f"{'step (median of rounds)':28s} {'seconds':>9s} {'MB/s':>8s} {'Msym/s':>8s}")
  for name, v in speed.items():
    if isinstance(v, dict) and "s" in v:
      print(f"{name:28s} {v['s']:9.4f} {v['MB_per_s']:8.1f} {v['Msymbols_per_s']:8.1f}")
  print(f"jnp decode v1 / v2 time: {speed['jnp_v1_over_v2']:.2f}x; Pallas interpret "
        f"{list(small.shape)}: {pallas}")
  if _KVTC.value:
    kv = record["kvtc"]
    if plot(kv, out / "bench_rans.png"):
      print(f"wrote {out / 'bench_rans.png'}")
    print(f"kvtc on {kv['held_out']['tokens']} tokens of {kv['held_out']['book']} "
          f"(transform {kv['transform']}): bytes per token of the stored payload")
    for name, row in kv["size"].items():
      print(f"  {name}: pco-bands {row['pco-bands']['bytes_per_token']:8.1f}  rans v1 "
            f"{row['rans_v1']['bytes_per_token']:8.1f}  rans v2 "
            f"{row['rans_v2']['bytes_per_token']:8.1f}  (v2 over v1 "
            f"{100 * row['v2_over_v1']:+.2f}%)")
    print(f"  lanes per chunk: {kv['lanes']}")
    print(f"kvtc level {kv['throughput_level']} q decode per chunk (byte-exact: "
          f"{kv['byte_exact']}):")
    for name, v in kv["throughput"].items():
      if isinstance(v, dict) and "s_per_chunk" in v:
        print(f"  {name:24s} {1e3 * v['s_per_chunk']:8.1f} ms/chunk {v['MB_per_s']:8.1f} MB/s")
    print(f"  jnp v1 / v2 time {kv['throughput']['jnp_v1_over_v2']:.2f}x, numpy v1 / v2 "
          f"{kv['throughput']['numpy_v1_over_v2']:.2f}x; Pallas interpret "
          f"{kv['pallas_interpret']}")
  print(f"wrote {out / 'bench_rans.json'}")


if __name__ == "__main__":
  app.run(main)
