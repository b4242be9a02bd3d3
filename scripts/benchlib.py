"""Shared bits of the benchmark scripts: the run's provenance (machine, git SHA), the server
starter and the plotting import."""

from __future__ import annotations

import os
import pathlib
import platform
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def git_sha() -> str:
  """HEAD of the repository the scripts live in, or "unknown"."""
  try:
    return subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                   text=True, stderr=subprocess.DEVNULL).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


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
