"""Relative L2 error and size of each KV codec and level on real SmolLM2-135M-Instruct KV.

Computes the KV of one real passage (a public-domain book from ../shared/data, f32, chunked
prefill at the chunk size) with `PagedModelRunner.step`, which returns K before RoPE and V per
chunk: exactly what the store saves. Each chunk `[L, 2, C, K, H]` goes through `kv_encode` (the
jnp reference path by default, or the Pallas kernels in interpret mode) and back through the
dequantization, and the script prints, per codec and level:

  - relative L2 error ||x̂ - x|| / ||x|| of K, of V, and of the chunk (max over chunks),
  - bits per value: the payload's plain size (int8/int4: what storage stores before zstd; for
    cachegen the codes as plain int8), an entropy estimate of cachegen's codes with a probability
    model per (layer, K/V, head, channel) fit to the chunk itself (CacheGen, arXiv 2310.07240,
    section 5.2; it leaves out the cost of the model, so the real coder lands above it), and the
    zstd size of the whole payload (a practical upper bound; storage's coder should beat it).

    .venv/bin/python scripts/codec_error.py
    .venv/bin/python scripts/codec_error.py --num_tokens 1024 --chunk 256 --interpret

Writes benchmarks/results/codec_error.json (`benchlib.provenance()`, inputs, constants, results).
"""

from __future__ import annotations

import os
import pathlib
import time

import numpy as np
from absl import app, flags

import benchlib  # scripts/benchlib.py

REPO = pathlib.Path(__file__).resolve().parent.parent
_BOOK_NAME = "pg43_jekyll_and_hyde_stevenson.txt"

_BOOK = flags.DEFINE_string("book", None, f"Text file the passage is taken from (default: "
                            f"{_BOOK_NAME} under ../shared/data/books).")
_OFFSET = flags.DEFINE_integer("offset_tokens", 0, "First token of the passage in the book.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 1024, "Passage length, tokens.")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Chunk size C, tokens.")
_INT4_GROUP = flags.DEFINE_integer("int4_group_tokens", None, "int4 group G (default: "
                                   "kvjax.codecs.int4_group_tokens(chunk)).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Encode with the Pallas kernels in interpret "
                               "mode instead of the jnp reference (slow on CPU).")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks" / "results" / "codec_error.json"),
                           "JSON output path ('' for none).")


def find_book() -> str:
  if _BOOK.value:
    return _BOOK.value
  for root in (REPO.parent, REPO.parent.parent):  # main checkout, or a worktree under wt/
    path = root / "shared" / "data" / "books" / _BOOK_NAME
    if path.is_file():
      return str(path)
  raise SystemExit(f"{_BOOK_NAME} not found under ../shared/data/books; pass --book")


def real_kv_chunks(book: str) -> tuple[list[np.ndarray], dict]:
  """f32 KV chunks [L, 2, C, K, H] (K before RoPE) of the passage, from chunked prefill."""
  from kvjax.models.nn.llama import Llama  # noqa: PLC0415
  from kvjax.models.runner.compilation_cache import default_cache_root  # noqa: PLC0415
  from kvjax.models.runner.paged_runner import PagedModelRunner  # noqa: PLC0415
  from kvjax.models.runner.runner_api import PagedRunnerConfig, SeqChunk  # noqa: PLC0415
  from kvjax.models.loading.registry import load_model  # noqa: PLC0415

  loaded = load_model("SmolLM2-135M-Instruct",
                      cache_dir=os.path.join(default_cache_root(), "params"))
  with open(book, encoding="utf-8") as f:
    ids = loaded.tokenizer.encode(f.read(), add_special_tokens=False)
  ids = ids[_OFFSET.value:_OFFSET.value + _NUM_TOKENS.value]
  c = _CHUNK.value
  if len(ids) < c or _NUM_TOKENS.value % c:
    raise SystemExit(f"need num_tokens a multiple of chunk={c} and a book that long; got "
                     f"{len(ids)} tokens")
  blocks = -(-len(ids) // 16)
  runner = PagedModelRunner(Llama.from_params(loaded.config, loaded.params), PagedRunnerConfig(
      num_blocks=blocks, block_size=16, max_num_seqs=1, max_num_batched_tokens=c,
      max_seq_len=blocks * 16, chunk_sizes=(c,)))
  table = list(range(blocks))
  chunks = []
  for start in range(0, len(ids) - c + 1, c):
    out = runner.step([SeqChunk(ids[start:start + c], start, table)])
    chunks.append(np.stack([np.asarray(out.k_pre_rope_LTKH), np.asarray(out.v_LTKH)], axis=1))
  info = {"book": os.path.basename(book), "tokens": len(ids), "offset_tokens": _OFFSET.value,
          "chunk": c, "shape_L2CKH": list(chunks[0].shape),
          "raw_decode_vs_prefill_cache_max_abs": raw_decode_check(runner, table, chunks,
                                                                   loaded.config)}
  return chunks, info


def raw_decode_check(runner, table, chunks, cfg) -> float:
  """Max |difference| between the prefill's own pool blocks and `kv_decode` of the raw chunks at
  the same positions (K rotated by the codec path, V copied): the RoPE and layout contract."""
  import jax.numpy as jnp  # noqa: PLC0415
  from kvjax.kernels import kv_codec as kc  # noqa: PLC0415
  from kvjax.kernels import kv_payloads as kp  # noqa: PLC0415
  from kvjax.models.nn.layers import rope_inv_freq  # noqa: PLC0415

  inv_freq = rope_inv_freq(cfg)
  k_pool, v_pool = (np.asarray(x) for x in runner.read_blocks(table))  # [L, S, K, H]
  k_cache, v_cache = k_pool[:, None], v_pool[:, None]  # one "slot" of the codec kernel's cache
  k, v = jnp.zeros_like(k_cache), jnp.zeros_like(v_cache)
  c = chunks[0].shape[2]
  for i, kv in enumerate(chunks):
    angles = (i * c + np.arange(c, dtype=np.float32))[:, None] * inv_freq
    angles = np.concatenate([angles, angles], axis=-1)
    k, v = kc.kv_decode(kp.RawPayload(kv), k, v, 0, i * c, np.cos(angles), np.sin(angles),
                        use_pallas=False)
  n = len(chunks) * c
  return float(max(np.abs(np.asarray(k)[:, 0, :n] - k_cache[:, 0, :n]).max(),
                   np.abs(np.asarray(v)[:, 0, :n] - v_cache[:, 0, :n]).max()))


def entropy_bits(codes: np.ndarray) -> float:
  """Bits to code int8 codes [L, 2, n, K, H] with one empirical model per (L, 2, K, H) channel
  fit over the n tokens (the model's own cost is not counted)."""
  l_, _, n, k, h = codes.shape
  rows = np.moveaxis(codes, 2, -1).reshape(-1, n).astype(np.int64) + 128
  counts = np.zeros((rows.shape[0], 256), np.int64)
  np.add.at(counts, (np.repeat(np.arange(rows.shape[0]), n), rows.ravel()), 1)
  p = counts / n
  with np.errstate(divide="ignore", invalid="ignore"):
    return float(-np.nansum(np.where(counts > 0, counts * np.log2(p), 0.0)))


def sizes_bits(codec: str, arrays: dict[str, np.ndarray]) -> dict[str, float]:
  """Total bits of a payload: plain, entropy estimate (cachegen) and zstd (level 3)."""
  import zstandard  # noqa: PLC0415
  plain = sum(a.nbytes for a in arrays.values()) * 8
  zstd = sum(len(zstandard.ZstdCompressor(level=3).compress(np.ascontiguousarray(a).tobytes()))
             for a in arrays.values()) * 8
  out = {"plain": plain, "zstd": zstd}
  if codec == "cachegen":
    side = (arrays["anchor_scale"].nbytes + arrays["delta_step"].nbytes) * 8
    out["entropy"] = entropy_bits(arrays["delta_q"]) + entropy_bits(arrays["anchor_q"]) + side
  return out


def rel(x_hat, x) -> float:
  return float(np.linalg.norm(x_hat - x) / np.linalg.norm(x))


def main(argv):
  del argv
  from kvjax import codecs  # noqa: PLC0415
  from kvjax.kernels import kv_codec as kc  # noqa: PLC0415
  from kvjax.kernels import kv_codec_ref as kref  # noqa: PLC0415

  prov = benchlib.provenance()
  t0 = time.perf_counter()
  chunks, info = real_kv_chunks(find_book())
  print(f"SmolLM2-135M-Instruct f32 KV: {info['tokens']} tokens of {info['book']} "
        f"(from token {info['offset_tokens']}), {len(chunks)} chunks of {info['chunk']}, "
        f"chunk shape {info['shape_L2CKH']} ({time.perf_counter() - t0:.1f} s); raw kv_decode "
        f"vs the prefill's cache: max |diff| {info['raw_decode_vs_prefill_cache_max_abs']:.2e}")
  results = []
  for codec, levels in codecs.CODEC_LEVELS.items():
    for level in levels:
      errs = {"K": [], "V": [], "KV": []}
      bits = {}
      for kv in chunks:
        arrays = kc.kv_encode_host(kv, codec, level, interpret=_INTERPRET.value,
                                   use_pallas=_INTERPRET.value,
                                   group_tokens=_INT4_GROUP.value if codec == "int4" else None)
        x_hat = np.asarray(kref.dequantize_reference(kc.payload_from_arrays(codec, arrays)))
        errs["K"].append(rel(x_hat[:, 0], kv[:, 0]))
        errs["V"].append(rel(x_hat[:, 1], kv[:, 1]))
        errs["KV"].append(rel(x_hat, kv))
        for name, b in sizes_bits(codec, arrays).items():
          bits[name] = bits.get(name, 0.0) + b
      n_values = sum(kv.size for kv in chunks)
      results.append({"codec": codec, "level": level,
                      **{f"rel_err_{k}_max": max(v) for k, v in errs.items()},
                      **{f"rel_err_{k}_mean": float(np.mean(v)) for k, v in errs.items()},
                      **{f"bits_per_value_{k}": v / n_values for k, v in bits.items()}})
  print(f"\n{'codec':9s}{'lvl':>4s}{'err K':>9s}{'err V':>9s}{'err KV':>9s}{'mean KV':>9s}"
        f"{'bits plain':>11s}{'entropy':>9s}{'zstd':>7s}   (errors: max over chunks)")
  for r in results:
    ent = r.get("bits_per_value_entropy")
    print(f"{r['codec']:9s}{r['level']:4d}{r['rel_err_K_max']:9.4f}{r['rel_err_V_max']:9.4f}"
          f"{r['rel_err_KV_max']:9.4f}{r['rel_err_KV_mean']:9.4f}"
          f"{r['bits_per_value_plain']:11.2f}{'' if ent is None else f'{ent:.2f}':>9s}"
          f"{r['bits_per_value_zstd']:7.2f}")
  print("\nbits: per stored value (raw f32 = 32, bf16 = 16); cachegen 'entropy' = per-channel "
        "empirical entropy of anchor_q + delta_q plus f32 scales, model cost excluded")
  if _OUT.value:
    record = {**prov, "script": "codec_error", "info": info,
              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "interpret": _INTERPRET.value, "int4_group_tokens": _INT4_GROUP.value,
              "constants": {"CACHEGEN_LEVEL_BINS": kref.CACHEGEN_LEVEL_BINS,
                            "CACHEGEN_STEPS_PER_RMS": kref.CACHEGEN_STEPS_PER_RMS,
                            "CACHEGEN_ANCHOR_STRIDE": codecs.CACHEGEN_ANCHOR_STRIDE,
                            "INT4_GROUP_TOKENS": codecs.INT4_GROUP_TOKENS},
              "results": results}
    benchlib.write_json(_OUT.value, record)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
