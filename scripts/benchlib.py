"""Shared bits of the benchmark scripts: the run's provenance (machine, git SHA)."""

from __future__ import annotations

import os
import pathlib
import platform
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
