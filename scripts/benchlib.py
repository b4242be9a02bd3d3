"""Shared bits of the benchmark scripts: the run's provenance (`provenance`, `finish`), the
server starter and the plotting import.

Every results JSON under `benchmarks/results/` carries the top-level keys of `PROVENANCE_KEYS`
(checked by `tests/unit/scripts/results_provenance_unit_test.py`): a script calls
`provenance()` when it starts and `finish(record)` (or `write_json`) when it writes. A comparison
runs its settings in `interleaved_rounds`, reports `summarize` per setting with each run's
`CpuClock` share, and flags a figure that beats its own bound (`below_bound`). Standard
library only: the device machine runs these scripts without kvjax's dependencies.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def git_sha() -> str:
  """HEAD of the repository the scripts live in, or "unknown"."""
  try:
    return subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                   text=True, stderr=subprocess.DEVNULL).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def git_dirty() -> tuple[bool | None, str | None]:
  """(whether the work tree differs from HEAD, sha256 of `git diff HEAD` in hex), or (None, None)
  outside a git checkout. Untracked files count as dirty (their names join the hashed text)."""
  try:
    diff = subprocess.check_output(["git", "-C", str(REPO), "diff", "HEAD", "--binary"],
                                   stderr=subprocess.DEVNULL)
    untracked = subprocess.check_output(
        ["git", "-C", str(REPO), "ls-files", "--others", "--exclude-standard"],
        stderr=subprocess.DEVNULL)
  except (OSError, subprocess.CalledProcessError):
    return None, None
  text = diff + (b"\nuntracked:\n" + untracked if untracked else b"")
  return bool(text), hashlib.sha256(text).hexdigest()


#: Top-level keys of every results JSON (`provenance()` sets all but the last; `finish` that one).
PROVENANCE_KEYS = ("argv", "git_sha", "git_dirty", "git_diff_sha256", "machine",
                   "loadavg_before", "versions", "loadavg_after")

#: Libraries whose versions a results file records by default.
DEFAULT_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "kvjax")


def _portable(arg: str) -> str:
  """`arg` with this checkout's path cut to a repo-relative one, the shared data folder beside it
  to "../shared/" and a home folder to "~", so a
  results file names no folder of the machine that wrote it."""
  for root, short in ((str(REPO) + os.sep, ""), (str(REPO), "."),
                      (str(REPO.parent / "shared") + os.sep, "../shared/"),
                      (os.path.expanduser("~") + os.sep, "~/")):
    if root not in (os.sep, "~/") and root in arg:
      arg = arg.replace(root, short)
  return arg


def command_line() -> list[str]:
  """The run's command line: the interpreter (repo-relative, e.g. ".venv/bin/python", or its
  base name when it lives elsewhere) and `sys.argv` with paths in this checkout made
  repo-relative (`_portable`)."""
  exe = sys.executable or "python"
  exe = _portable(exe) if exe.startswith(str(REPO)) else os.path.basename(exe)
  return [exe, *(_portable(a) for a in sys.argv)]


def provenance(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict:
  """The run's provenance, taken when a script starts: `argv` (the command line, `sys.argv`
  with the interpreter), `git_sha`, `git_dirty` and `git_diff_sha256` (`git_dirty()`),
  `machine` (`machine()`), `loadavg_before` (1/5/15-minute load averages) and `versions`
  (`versions(*packages)`, plus the Python version). Merge it into the results record first, so
  the record's own keys follow."""
  dirty, diff_sha = git_dirty()
  return {"argv": command_line(), "git_sha": git_sha(), "git_dirty": dirty,
          "git_diff_sha256": diff_sha, "machine": machine(),
          "loadavg_before": list(os.getloadavg()),
          "versions": {**versions(*packages), "python": sys.version.split()[0]}}


def finish(record: dict) -> dict:
  """Sets `record["loadavg_after"]` (the load averages now) and returns `record`.

  Raises:
    KeyError: `record` lacks a key of `PROVENANCE_KEYS` (it was not built on `provenance()`).
  """
  record["loadavg_after"] = list(os.getloadavg())
  missing = [k for k in PROVENANCE_KEYS if k not in record]
  if missing:
    raise KeyError(f"results record lacks provenance keys {missing}: start it from "
                   "benchlib.provenance()")
  return record


def write_json(path: str | os.PathLike, record: dict) -> None:
  """`finish(record)`, then writes it as indented JSON to `path` (folders made as needed)."""
  finish(record)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")


def missing_provenance(root: str | os.PathLike,
                       skip: tuple[str, ...] = ("archive",)) -> dict:
  """The results files under `root` that lack provenance: {path relative to `root`: the keys
  of `PROVENANCE_KEYS` it lacks}, for every `*.json` found recursively outside the top-level
  folders named in `skip` (archived results). A file that is not a JSON object maps to
  `["<not a JSON object: ...>"]`. Empty when every file carries all keys."""
  root = pathlib.Path(root)
  out = {}
  for path in sorted(root.rglob("*.json")):
    rel = path.relative_to(root)
    if rel.parts[0] in skip:
      continue
    try:
      record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      out[str(rel)] = [f"<not a JSON object: {type(e).__name__}>"]
      continue
    if not isinstance(record, dict):
      out[str(rel)] = [f"<not a JSON object: {type(record).__name__}>"]
      continue
    missing = [k for k in PROVENANCE_KEYS if k not in record]
    if missing:
      out[str(rel)] = missing
  return out


def machine() -> dict:
  """Platform, CPU model, core count, Python version and load average of this machine."""
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "python": sys.version.split()[0], "loadavg_1_5_15": list(os.getloadavg())}


def versions(*packages: str) -> dict:
  """Installed versions of `packages` (None for one that is not installed)."""
  import importlib.metadata  # noqa: PLC0415
  out = {}
  for pkg in packages:
    try:
      out[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def pyplot():
  """matplotlib's pyplot with the file-only Agg backend, or None (with a message) when matplotlib
  is not installed: the JSON is written either way."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
    return None
  return plt


def start_server(flags: list[str], log_path: str, *, echo: bool = False):
  """Starts `python -m kvjax.serve --port=0 <flags>` from this checkout and waits until it is
  ready (compiled); its stderr goes to `log_path`.

  Returns:
    (process, url, served model name).

  Raises:
    RuntimeError: the server exited before it was ready (with its log's tail).
  """
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  cmd = [sys.executable, "-m", "kvjax.serve", "--port=0", *flags]
  log = open(log_path, "w")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
  url = model = None
  for line in proc.stdout:
    if echo:
      print("  server:", line.rstrip())
    if m := re.search(r"listening on (http://\S+)", line):
      url = m.group(1)
    if m := re.match(r"kvjax: ready: (\S+) at", line):
      model = m.group(1)
      break
  if url is None or model is None:
    proc.wait(60)
    log.close()
    raise RuntimeError("the server did not start:\n" + open(log_path, encoding="utf-8").read()[-3000:])
  return proc, url, model


def stop_server(proc) -> int:
  """Stops a server `start_server` started as Ctrl-C does (SIGINT: it drains, then exits) and
  waits up to 120 s for it; returns its exit status.

  Raises:
    subprocess.TimeoutExpired: it did not exit in time.
  """
  proc.send_signal(signal.SIGINT)
  return proc.wait(120)


def interleaved_rounds(settings: list[str], rounds: int = 3) -> list[list[str]]:
  """The order to run `settings` in over `rounds` rounds: round r is the list rotated by r
  (A B C, B C A, C A B, A B C, ...), so each setting runs at every position as often as the
  rounds allow and a drift of the machine's load spreads over all of them.

  Raises:
    ValueError: `rounds` < 1 or `settings` empty or with duplicates.
  """
  if rounds < 1 or not settings or len(set(settings)) != len(settings):
    raise ValueError(f"interleaved_rounds: need rounds >= 1 and distinct settings, got "
                     f"{rounds} rounds of {settings}")
  n = len(settings)
  return [[settings[(r + i) % n] for i in range(n)] for r in range(rounds)]


def summarize(values: list[float]) -> dict:
  """Median, min, max and spread ((max - min) / median) of one setting's per-round values,
  with the values themselves (`rounds`).

  Raises:
    ValueError: `values` is empty.
  """
  if not values:
    raise ValueError("summarize: no values")
  v = sorted(float(x) for x in values)
  n = len(v)
  median = v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
  return {"median": median, "min": v[0], "max": v[-1],
          "spread": (v[-1] - v[0]) / median if median else None, "rounds": list(values)}


def below_bound(measured: dict, bound: dict) -> bool:
  """Whether a measurement (`summarize` of a time) beats its own lower bound (`summarize` of the
  bound) by more than the rounds' spread: such a figure is a measurement error, never a
  headline. True when measured's median < bound's median * (1 - the larger spread)."""
  spread = max(measured.get("spread") or 0.0, bound.get("spread") or 0.0)
  return measured["median"] < bound["median"] * (1.0 - spread)


class CpuClock:
  """This process's CPU share over a span: CPU seconds (all threads, `time.process_time`) per
  wall second (`time.perf_counter`) since the clock was made. 2.0 means two cores were busy for
  us the whole time; a setting that got a smaller share than another ran on a busier machine."""

  def __init__(self):
    self.cpu0 = time.process_time()
    self.wall0 = time.perf_counter()

  def read(self) -> dict:
    """{"wall_s", "cpu_s", "cpu_share"} since the clock was made (`cpu_share` None at 0 s)."""
    wall = time.perf_counter() - self.wall0
    cpu = time.process_time() - self.cpu0
    return {"wall_s": wall, "cpu_s": cpu, "cpu_share": cpu / wall if wall > 0 else None}


def process_cpu_s(pid: int) -> float | None:
  """CPU seconds (user + system, all threads) another process has used so far, from
  /proc/<pid>/stat; None where /proc is missing (not Linux) or the process is gone. The CPU share
  a server got over a span: the difference of two readings over the wall seconds between."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return None
  # After the command name: state is field 3, utime 14 and stime 15 (1-based, proc(5)).
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_seconds(fn, iters: int, block=lambda out: out) -> float:
  """Median wall seconds of `iters` calls of `fn()` after one untimed call (compile, warm-up);
  `block(out)` waits for an asynchronous result (e.g. `jax.block_until_ready`) inside the timed
  span.

  Raises:
    ValueError: `iters` < 1.
  """
  if iters < 1:
    raise ValueError(f"median_seconds: iters must be >= 1, got {iters}")
  import statistics  # noqa: PLC0415
  import time  # noqa: PLC0415
  block(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    block(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
