"""The device check, step by step: what `bash scripts/device_check.sh` runs (docs/design/accelerators.md).

In the issue's order, each step a subprocess with its own time limit (a step that fails or runs
out of time is reported; the rest still run):

  (a) correctness   engine_correctness: scripts/device_check_engine.py --part correctness
                    (greedy against the CPU f32 reference, warm store hit equal to cold, kvtc
                    consistent-mode repeats identical);
  (b) the engine    engine_speed: scripts/device_check_engine.py --part engine (TTFT cold/warm
                    at 4K and 16K, decode tokens/s at batch 1/32/64, Cake against compute-only
                    and load-only with loads from local disk and from host memory);
                    bench_serve: scripts/bench_serve.py --quick --clients 32 on the same model;
  (c) the kernels   ceilings: scripts/device_check_ceilings.py (HBM copy, host -> device copy,
                    pinned and pageable); attention: scripts/device_check.py; kv_codec:
                    scripts/device_check_codec.py (int8, int4 at LLaMA-3.1-8B shapes); rans:
                    scripts/device_check_rans.py.

Then it reads each step's JSON and writes `benchmarks/results/device_summary_<device>.json`
(`--out`): `argv`, `git_sha`, `git_dirty`, `device` ("h100", "h200", "cpu", ...), the rest of
`benchlib.provenance()`, and `checks`, one entry per check (`CHECKS`) with `value`, `unit`,
`ceiling` and `fraction` where a ceiling applies (a ceiling measured in this run: the HBM copy,
the pinned host -> device copy; for `rans_decode` the storage link rate it is judged against,
so its fraction is "times the link"), `ok`, and `error` or `skipped` when it has no value. Exits
1 naming every check that failed or was skipped.

`--dry_run` runs every step on the CPU at tiny shapes (Pallas in interpret mode, a 2-layer model
of SmolLM2's vocabulary): a device run then never finds a typo. Speed is not judged then
(`speed_judged: false`). `--only` runs some steps (their checks only). `--prepare` (on the CPU
machine, with kvjax's full install and a package index) writes `benchmarks/device_inputs/`
(git-ignored; carry it to the device): the engine's f32 reference, SmolLM2's tokenizer, the
rANS check's codes, the bench_serve data slice and the wheels of the packages the device image
lacks.

Standard library only (and scripts/benchlib.py): the steps import jax, this process does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # scripts/benchlib.py
import benchlib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
INPUTS = REPO / "benchmarks" / "device_inputs"
#: The dry run's engine cache (converted weights, its kvtc transform, compiled programs):
#: `--prepare --dry-run` fills it (the kvtc calibration is a minute on two CPU cores).
DRY_RUN_CACHE = REPO / "build" / "device_check_dry_run_cache"  # git-ignored, not carried
#: The storage link rans_decode is judged against when device_check_rans.py states none: 32 Gbps
#: (scripts/device_check_rans.py's LINK_BYTES_PER_S).
DEFAULT_LINK_BYTES_PER_S = 4e9
#: Cake must be at least this fraction of the better of compute-only and load-only's speed
#: (better TTFT / Cake's TTFT): Cake's plan is never worse than either, up to its overhead.
CAKE_MIN_FRACTION = 0.9
#: Packages the device image lacks that kvjax's engine, server and bench_serve import, carried
#: as wheels (KINDS.md lists what the image has).
DEVICE_WHEELS = ("gguf", "zstandard", "pcodec", "fastapi", "starlette", "uvicorn", "pydantic",
                 "pydantic-core", "annotated-types", "typing-inspection", "cbor2", "pyzmq",
                 "openai", "distro", "jiter", "sniffio", "opentelemetry-api",
                 "importlib-metadata")


@dataclasses.dataclass(frozen=True)
class Step:
  """One subprocess of the check: its name, part ("a" | "b" | "c"), time limit on a device
  and in a dry run (seconds)."""
  name: str
  part: str
  limit_s: int
  dry_limit_s: int


STEPS = (Step("engine_correctness", "a", 100, 150), Step("engine_speed", "b", 110, 150),
         Step("bench_serve", "b", 50, 120), Step("ceilings", "c", 15, 60),
         Step("attention", "c", 30, 90), Step("kv_codec", "c", 40, 90), Step("rans", "c", 15, 60))

#: The checks of the summary, in order, and the step each comes from.
CHECKS = {
    "engine_greedy_match": "engine_correctness", "engine_warm_equals_cold": "engine_correctness",
    "kvtc_consistent_repeats": "engine_correctness",
    "ttft_cold_4k": "engine_speed", "ttft_warm_4k": "engine_speed",
    "ttft_cold_16k": "engine_speed", "ttft_warm_16k": "engine_speed",
    "decode_tps_b1": "engine_speed", "decode_tps_b32": "engine_speed",
    "decode_tps_b64": "engine_speed", "cake_vs_better": "engine_speed",
    "cake_vs_better_host": "engine_speed", "bench_serve_quick": "bench_serve",
    "hbm_copy": "ceilings", "h2d_copy": "ceilings",
    "attention_b32_4k": "attention", "attention_b1_32k": "attention",
    "kv_decode_int8": "kv_codec", "kv_decode_int4": "kv_codec", "rans_decode": "rans",
}


def _phase_name(row: dict) -> str:
  """bench_serve's phase row as "workload/phase", "/round<r>" added after round 0."""
  suffix = f"/round{row['round']}" if row.get("round") else ""
  return f"{row['workload']}/{row['phase']}{suffix}"


def step_commands(step: str, py: str, out: pathlib.Path, work: pathlib.Path, dry: bool,
                  limit_s: int) -> list[list[str]]:
  """The command lines of a step (run in order, in the repository root)."""
  s = "scripts/"
  eng = [py, s + "device_check_engine.py", "--out", str(out), "--work_dir", str(work)] + (
      ["--dry_run", "--cache_dir", str(DRY_RUN_CACHE)] if dry else [])
  cpu = ["--cpu"] if dry else []
  if step == "engine_correctness":
    return [eng + ["--part", "correctness"]]
  if step == "engine_speed":
    return [eng + ["--part", "engine"]]
  if step == "bench_serve":
    data = INPUTS / "data"
    return [eng + ["--part", "model"],
            [py, s + "bench_serve.py", "--quick", "--clients=32", f"--model={work / 'model'}",
             f"--data_dir={data if data.is_dir() else REPO.parent / 'shared' / 'data'}",
             f"--out_dir={out}",
             # The engine steps' cache: the server loads their compiled programs.
             f"--server_flag=cache_dir={DRY_RUN_CACHE if dry else work / 'cache'}"]
            + (["--kv_chunk_size=32"] if dry else [])]
  if step == "ceilings":
    return [[py, s + "device_check_ceilings.py", "--out", str(out)] + (
        ["--dry_run"] if dry else [])]
  if step == "attention":
    sizes = (["--contexts=64", "--batches=1,2", "--iters=1"] if dry else
             ["--contexts=4096,32768", "--batches=1,32"])
    return [[py, s + "device_check.py", *cpu, *sizes, "--nosweep", f"--out={out}",
             f"--budget_s={int(limit_s * 0.75)}"]]
  if step == "kv_codec":
    model = "smollm2_135m" if dry else "llama31_8b"
    return [[py, s + "device_check_codec.py", *cpu, f"--cases={model}/int8,{model}/int4",
             f"--out={out}", f"--budget_s={int(limit_s * 0.7)}"]]
  if step == "rans":
    return [[py, s + "device_check_rans.py", *cpu]]
  raise ValueError(f"unknown step {step!r}")


def run_step(step: Step, cmds: list[list[str]], limit_s: int, env: dict, log) -> dict:
  """Runs a step's commands under one time limit; returns {rc, verdict, wall_s}."""
  t0 = time.monotonic()
  rc, verdict = 0, "ok"
  for cmd in cmds:
    left = limit_s - (time.monotonic() - t0)
    if left <= 1:
      rc, verdict = 124, "timeout"
      break
    print(f"=== {step.name}: {' '.join(cmd[1:])} (limit {left:.0f} s)", flush=True)
    try:
      p = subprocess.run(cmd, cwd=REPO, env=env, timeout=left, stdout=log,
                         stderr=subprocess.STDOUT, check=False)
      rc = p.returncode
    except subprocess.TimeoutExpired:
      rc, verdict = 124, "timeout"
      break
    if rc != 0:
      verdict = "failed"
      break
  wall = round(time.monotonic() - t0, 1)
  print(f"=== {step.name}: {verdict} (rc {rc}) in {wall} s", flush=True)
  return {"rc": rc, "verdict": verdict, "wall_s": wall}


# ------------------------------------------------------------------------------ the summary
def _load(path: pathlib.Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _entry(value, unit, ok, *, ceiling=None, ceiling_what=None, setting=None, **extra) -> dict:
  e = {"value": value, "unit": unit, "ceiling": ceiling}
  if ceiling_what:
    e["ceiling_what"] = ceiling_what
  e["fraction"] = (value / ceiling if isinstance(value, (int, float)) and ceiling else None)
  e["ok"] = bool(ok)
  if setting is not None:
    e["setting"] = setting
  e.update(extra)
  return e


def extract_checks(out: pathlib.Path, dry: bool) -> dict:
  """Each check's entry from the steps' JSON files in `out` (a check whose file or row is
  missing has none: the caller marks it skipped)."""
  sfx = "_cpu" if dry else ""
  checks: dict = {}
  judged = not dry
  ceil = _load(out / f"device_check_ceilings{sfx}.json")
  hbm = ceil["hbm_copy"]["bytes_per_s"] if ceil else None
  if ceil:
    checks["hbm_copy"] = _entry(hbm, "bytes/s", hbm > 0, setting=ceil["hbm_copy"]["how"])
    pinned = ceil["h2d_pinned"].get("bytes_per_s")
    checks["h2d_copy"] = _entry(
        ceil["h2d_copy"]["bytes_per_s"], "bytes/s", ceil["h2d_copy"]["bytes_per_s"] > 0,
        ceiling=pinned, ceiling_what="pinned host -> device copy, this run",
        setting={"bytes": ceil["h2d_copy"]["bytes"]},
        **({} if pinned else {"pinned_error": ceil["h2d_pinned"].get("error")}))
  hbm_what = "HBM copy (bytes read + written), this run"
  corr = _load(out / f"device_check_engine_correctness{sfx}.json")
  if corr:
    r = corr["results"]
    g = r.get("engine_greedy_match", {})
    if "prompts" in g:
      checks["engine_greedy_match"] = _entry(
          g["prompts_matched"], "prompts", g["ok"], ceiling=g["prompts"],
          ceiling_what="prompts compared", max_logprob_abs_err=g["max_logprob_abs_err"],
          tie_margin_nats=g["tie_margin_nats"], dtype=g.get("dtype"),
          tokens_compared=sum(x["tokens_compared"] for x in g.get("per_prompt", [])))
    else:
      checks["engine_greedy_match"] = _failed(g)
    w = r.get("engine_warm_equals_cold", {})
    checks["engine_warm_equals_cold"] = (_entry(
        int(w["tokens_equal"]), "equal (1) or not (0)", w["ok"],
        loaded_tokens=w["loaded_tokens"], setting={"prompt_tokens": w["prompt_tokens"]})
        if "tokens_equal" in w else _failed(w))
    k = r.get("kvtc_consistent_repeats", {})
    checks["kvtc_consistent_repeats"] = (_entry(
        k["distinct_outputs"], "distinct outputs", k["ok"], setting={"runs": k["runs"]},
        loaded_tokens=k["loaded_tokens"]) if "distinct_outputs" in k else _failed(k))
  eng = _load(out / f"device_check_engine_engine{sfx}.json")
  if eng:
    r = eng["results"]
    lengths = eng["settings"]["ttft_lengths"]
    for name, n in zip(("4k", "16k"), lengths):
      t = r.get(f"ttft_{n // 1024}k" if n % 1024 == 0 else f"ttft_{n}", {})
      for phase in ("cold", "warm"):
        checks[f"ttft_{phase}_{name}"] = (_entry(
            t[f"{phase}_ttft_s"], "s", t["ok"], setting={"tokens": n},
            **({"loaded_tokens": t["warm_loaded_tokens"]} if phase == "warm" else {}))
            if f"{phase}_ttft_s" in t else _failed(t))
    dec = r.get("decode", {})
    for name, b in zip(("b1", "b32", "b64"), eng["settings"]["decode_batches"]):
      d = dec.get(f"b{b}", {})
      if "tokens_per_s" in d:
        roof = b / (d["step_bytes"] / hbm) if hbm else None
        checks[f"decode_tps_{name}"] = _entry(
            d["tokens_per_s"], "tokens/s", d["ok"], ceiling=roof,
            ceiling_what="HBM roofline: batch / ((bf16 weights + KV read) bytes / HBM copy "
                         "bandwidth of this run)", setting={"batch": b,
                                                            "mean_context": d["mean_context"]})
      else:
        checks[f"decode_tps_{name}"] = _failed(d or dec)
    for name, where in (("cake_vs_better", "cake_disk"), ("cake_vs_better_host", "cake_host")):
      c = r.get(where, {})
      if "cake_s" in c:
        frac = c["better_s"] / c["cake_s"]
        e = _entry(c["cake_s"], "s (warm TTFT, Cake)", c["ok"] and (
            not judged or frac >= CAKE_MIN_FRACTION), ceiling=c["better_s"],
            ceiling_what="the better of compute-only and load-only (warm TTFT, s)",
            setting={"tokens": c["tokens"], "store": c["store"]},
            compute_only_s=c["ttft_s"]["compute_only"]["median"],
            load_only_s=c["ttft_s"]["load_only"]["median"], min_fraction=CAKE_MIN_FRACTION)
        e["fraction"] = frac  # better / Cake: > 1 when Cake beats both
        checks[name] = e
      else:
        checks[name] = _failed(c)
  serve = _load(out / "bench_serve.json")
  if serve and serve.get("summary"):
    rows = serve["summary"]
    errors = sum(s["errors"] for s in rows)
    checks["bench_serve_quick"] = _entry(
        min(s["output_tokens_per_s"] for s in rows), "output tokens/s (slowest phase)",
        errors == 0 and all(s["requests"] > 0 for s in rows),
        setting={"clients": serve["threads"]["clients"], "quick": True}, errors=errors,
        phases={_phase_name(s): {k: s[k] for k in (
            "requests", "ttft_p50_s", "output_tokens_per_s", "cached_fraction")} for s in rows})
  att = _load(out / f"device_check{sfx}.json")
  if att:
    correct = all(c["ok"] for c in att["correctness"]) and bool(att["correctness"])
    bw = att["bandwidth"]
    if bw:
      batches = sorted({x["batch"] for x in bw})
      contexts = sorted({x["context"] for x in bw})
      for name, (b, ctx) in (("attention_b32_4k", (batches[-1], contexts[0])),
                             ("attention_b1_32k", (batches[0], contexts[-1]))):
        row = next((x for x in bw if x["batch"] == b and x["context"] == ctx), None)
        if row:
          checks[name] = _entry(row["bytes_per_s"], "bytes/s (KV read)", correct, ceiling=hbm,
                                ceiling_what=hbm_what, setting={"batch": b, "context": ctx},
                                correctness_cases=len(att["correctness"]))
  cod = _load(out / f"device_check_codec{sfx}.json")
  if cod:
    for codec in ("int8", "int4"):
      case = next((c for c in cod["cases"] if c["codec"] == codec), None)
      if case is None:
        continue
      t = case.get("timing", {})
      if "decode_pallas_total_GB_per_s" in t:
        checks[f"kv_decode_{codec}"] = _entry(
            t["decode_pallas_total_GB_per_s"] * 1e9, "bytes/s (payload read + KV written)",
            case["ok"], ceiling=hbm, ceiling_what=hbm_what,
            setting={"model": case["model"], "chunk": case["chunk"],
                     "chunks_per_call": case["chunks_per_call"]})
      else:
        checks[f"kv_decode_{codec}"] = _failed(case)
  rans = _load(out / f"device_check_rans{sfx}.json")
  if rans:
    pal = rans["results"]["pallas"]
    link = rans.get("link_GB_per_s")
    link_bps = link * 1e9 if link else DEFAULT_LINK_BYTES_PER_S
    value = pal["decode_GB_per_s"] * 1e9
    checks["rans_decode"] = _entry(
        value, "bytes/s (coded bytes decoded)",
        pal["byte_exact"] and (not judged or value >= link_bps), ceiling=link_bps,
        ceiling_what=("the storage link rate device_check_rans.py states" if link else
                      "a 32 Gbps storage link (4e9 bytes/s): fraction = times the link"),
        setting={"shape": rans["shape"], "coded_bytes": rans["coded_bytes"]},
        byte_exact=pal["byte_exact"])
  if judged:
    flag_above_ceiling(checks)
  return checks


#: Checks whose ceiling is a physical bound measured in the same run (HBM copy, pinned copy,
#: the HBM roofline): a value above it by more than `ABOVE_CEILING_TOLERANCE` is a measurement
#: error, not a result (Cake's and rANS's fractions are speed-ups over a baseline, not bounds).
BOUNDED_CHECKS = ("h2d_copy", "decode_tps_b1", "decode_tps_b32", "decode_tps_b64",
                  "attention_b32_4k", "attention_b1_32k", "kv_decode_int8", "kv_decode_int4")
ABOVE_CEILING_TOLERANCE = 0.05


def flag_above_ceiling(checks: dict) -> None:
  """Marks each of `BOUNDED_CHECKS` whose fraction exceeds 1 + `ABOVE_CEILING_TOLERANCE` not ok,
  with an `error` saying so (a device run only: on the CPU dry run the ceilings mean nothing)."""
  for name in BOUNDED_CHECKS:
    e = checks.get(name)
    if e and e.get("fraction") is not None and e["fraction"] > 1 + ABOVE_CEILING_TOLERANCE:
      e["ok"] = False
      e["error"] = (f"{e['fraction']:.2f}x its own ceiling ({e.get('ceiling_what', 'ceiling')}):"
                    " a measurement error, not a result")


def _failed(r: dict) -> dict:
  return {"value": None, "ceiling": None, "fraction": None, "ok": False,
          "error": (r or {}).get("error", "no result")}


def device_name(kind: str, backend: str) -> str:
  """"h100", "h200", "cpu", ... from the device kind (`jax.devices()[0].device_kind`)."""
  if backend == "cpu":
    return "cpu"
  m = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]?)\b", kind)
  return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_")


def probe_device(py: str, env: dict) -> tuple[str, str]:
  """(device kind, backend) from a short jax subprocess; ("unknown", "unknown") if it fails."""
  try:
    text = subprocess.run([py, "-c", "import jax; d = jax.devices()[0]; print(d.device_kind); "
                           "print(jax.default_backend())"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=True).stdout
    kind, backend = text.strip().splitlines()[-2:]
    return kind, backend
  except (subprocess.SubprocessError, OSError, ValueError):
    return "unknown", "unknown"


def summarize(record: dict, checks: dict, steps: dict, wanted: list[str]) -> tuple[dict, list]:
  """The summary's `checks` in `CHECKS` order (the wanted steps' checks only) and the names of
  the failed or skipped ones."""
  out, bad = {}, []
  for name, step in CHECKS.items():
    if step not in wanted:
      continue
    e = checks.get(name)
    if e is None:
      verdict = steps.get(step, {}).get("verdict", "not run")
      e = {"value": None, "ceiling": None, "fraction": None, "ok": False,
           "skipped": f"step {step}: {verdict}" if verdict != "ok" else "no result"}
    out[name] = e
    if not e["ok"]:
      bad.append(name + (f" (skipped: {e['skipped']})" if "skipped" in e else " (failed)"))
  return out, bad


# ------------------------------------------------------------------------------ --prepare
def prepare(py: str, env: dict, dry: bool) -> int:
  """Writes benchmarks/device_inputs/ on the CPU machine (see the module docstring)."""
  INPUTS.mkdir(parents=True, exist_ok=True)
  rc = 0
  cmds = [[py, "scripts/device_check_engine.py", "--part", "reference"] + (
      ["--dry_run", "--reference", str(INPUTS / "engine_reference_cpu.json"), "--cache_dir",
       str(DRY_RUN_CACHE)] if dry else []),
          [py, "scripts/device_check_rans.py", "--prepare"]]
  for cmd in cmds:
    print("===", " ".join(cmd[1:]), flush=True)
    rc |= subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
  data = INPUTS / "data"
  src = REPO.parent / "shared" / "data"
  for rel in ("longchat/topics_10.jsonl", "sharegpt/sharegpt_v3_multiturn_1000.json"):
    if (src / rel).is_file():
      (data / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src / rel, data / rel)
    else:
      print(f"missing {src / rel}: bench_serve on the device will have no data")
      rc |= 1
  if not dry:
    rc |= download_wheels(INPUTS / "wheels")
  return rc


def download_wheels(dest: pathlib.Path) -> int:
  """`pip download` of `DEVICE_WHEELS` at this environment's versions, for CPython 3.12 on
  manylinux x86_64 (the device image)."""
  import importlib.metadata  # noqa: PLC0415
  dest.mkdir(parents=True, exist_ok=True)
  pins = []
  for name in DEVICE_WHEELS:
    try:
      pins.append(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      pins.append(name)
  plats = [a for n in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                       "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_24_x86_64",
                       "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")
           for a in ("--platform", n)]
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest), *pins]
  print("===", " ".join(cmd[3:]), flush=True)
  return subprocess.run(cmd, check=False).returncode


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--dry_run", "--dry-run", action="store_true",
                 help="every step on the CPU at tiny shapes")
  p.add_argument("--prepare", action="store_true",
                 help="write benchmarks/device_inputs/ (on the CPU machine)")
  p.add_argument("--only", default=None,
                 help=f"comma-separated steps (default all): {', '.join(s.name for s in STEPS)}")
  p.add_argument("--out", default=None,
                 help="folder of the summary and the steps' JSON (default $OUT, else "
                      "benchmarks/results)")
  p.add_argument("--limit_scale", type=float, default=1.0,
                 help="multiplies every step's time limit")
  args = p.parse_args(argv)
  py = sys.executable
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
         "PYTHONUNBUFFERED": "1"}
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.prepare:
    return prepare(py, env, args.dry_run)
  names = [s.name for s in STEPS]
  wanted = names if not args.only else [x.strip() for x in args.only.split(",") if x.strip()]
  unknown = sorted(set(wanted) - set(names))
  if unknown:
    p.error(f"--only: unknown steps {unknown}; steps: {names}")
  dry = args.dry_run
  out = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "results")
  out.mkdir(parents=True, exist_ok=True)
  record = benchlib.provenance()
  kind, backend = probe_device(py, env)
  print(f"device: {kind} (jax backend {backend}); jax {record['versions'].get('jax')}, "
        f"jaxlib {record['versions'].get('jaxlib')}", flush=True)
  if not dry and backend == "cpu":
    print("no accelerator (jax backend cpu): use --dry-run", file=sys.stderr)
    return 2
  device = device_name(kind, backend)
  env["OUT"] = str(out)  # device_check_rans.py writes there
  work = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"kvjax-devcheck-{os.getpid()}"
  log_path = out / f"device_check_log{'_cpu' if dry else ''}.txt"
  steps: dict = {}
  t0 = time.monotonic()
  with open(log_path, "w", encoding="utf-8") as log:
    for step in STEPS:
      if step.name not in wanted:
        continue
      limit = int((step.dry_limit_s if dry else step.limit_s) * args.limit_scale)
      cmds = step_commands(step.name, py, out, work, dry, limit)
      if step.part == "a" and dry:
        cmds = [c + ["--reference", str(INPUTS / "engine_reference_cpu.json")] for c in cmds]
      steps[step.name] = {"part": step.part, "limit_s": limit,
                          **run_step(step, cmds, limit, env, log)}
  shutil.rmtree(work, ignore_errors=True)
  checks, bad = summarize(record, extract_checks(out, dry), steps, wanted)
  record.update({"device": device, "device_kind": kind, "backend": backend, "dry_run": dry,
                 "speed_judged": not dry,
                 "model": "engine checks: SmolLM2-135M-shaped, deterministic random weights "
                          "(scripts/device_check_engine.py); kernel checks: LLaMA-3.1-8B "
                          "shapes" + (" (dry run: tiny shapes)" if dry else ""),
                 "steps": steps, "wall_s": round(time.monotonic() - t0, 1), "checks": checks,
                 "failed_or_skipped": bad})
  path = out / f"device_summary_{device}.json"
  benchlib.write_json(path, record)
  print(f"\n{'check':26s} {'value':>12s} {'ceiling':>12s} {'fraction':>8s}  ok")
  for name, e in checks.items():
    f = lambda v: f"{v:12.4g}" if isinstance(v, (int, float)) else f"{'-':>12s}"  # noqa: E731
    frac = e.get("fraction")
    print(f"{name:26s} {f(e['value'])} {f(e['ceiling'])} "
          f"{(f'{frac:8.3f}' if isinstance(frac, (int, float)) else '       -')}  "
          f"{'ok' if e['ok'] else 'FAIL ' + str(e.get('skipped') or e.get('error', ''))[:80]}")
  print(f"wrote {path} in {record['wall_s']} s; log {log_path}")
  if bad:
    print("FAILED or SKIPPED: " + "; ".join(bad), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
