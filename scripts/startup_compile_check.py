r"""Does a second start compile nothing? The server's start-up twice, then `LLM` with the server's
options, then `LLM()` with its own defaults, each a fresh process on one fresh cache root.

    python scripts/startup_compile_check.py                # SmolLM2-135M-Instruct
    python scripts/startup_compile_check.py --model=tiny   # seconds, for a quick look

Per start: wall seconds, the warm-up's seconds (`StartupEvent` "ready"), and JAX's persistent
compilation cache hits and misses (`jax.monitoring` events) with the seconds spent in XLA's
backend compile (loading a cached program counts there too, briefly). Writes
benchmarks/results/startup_compile.json (`benchlib.provenance()`).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

MODES = ("server", "server", "llm_same_options", "llm_defaults")


def child(mode: str, model: str) -> None:
  """One start in this process; prints one JSON line."""
  from jax import monitoring  # noqa: PLC0415
  events = collections.Counter()
  seconds = collections.defaultdict(float)
  monitoring.register_event_listener(lambda e, **_: events.update([e]))

  def on_duration(e, s, **_):
    seconds[e] += s

  monitoring.register_event_duration_secs_listener(on_duration)
  from kvjax import LLM  # noqa: PLC0415
  from kvjax.serve.server import ServerConfig, close_backend, load_backend  # noqa: PLC0415
  warm = {}

  def progress(event):
    if event.phase == "ready":
      warm["s"] = event.seconds

  t0 = time.perf_counter()
  config = ServerConfig.from_flat(model=model, port=0)
  if mode == "server":
    close_backend(*load_backend(config, startup_progress=progress))
  elif mode == "llm_same_options":
    LLM(model, startup_progress=progress, **config.llm_options()).close()
  else:
    LLM(model, startup_progress=progress).close()
  print(json.dumps({
      "mode": mode, "wall_s": round(time.perf_counter() - t0, 1),
      "warmup_s": round(warm.get("s", float("nan")), 1),
      "cache_hits": events["/jax/compilation_cache/cache_hits"],
      "cache_misses": events["/jax/compilation_cache/cache_misses"],
      "backend_compile_s": round(seconds["/jax/core/compile/backend_compile_duration"], 1)}))


def main() -> None:
  args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
  model = args.get("model", "SmolLM2-135M-Instruct")
  if "child" in args:
    child(args["child"], model)
    return
  prov = benchlib.provenance(("kvjax", "jax", "jaxlib", "flax", "numpy"))
  rows = []
  with tempfile.TemporaryDirectory(prefix="kvjax-startup-") as root:
    env = {**os.environ, "KVJAX_CACHE_DIR": root}
    for mode in MODES:
      out = subprocess.run([sys.executable, __file__, f"--child={mode}", f"--model={model}"],
                           env=env, capture_output=True, text=True, check=True).stdout
      rows.append(json.loads(out.strip().splitlines()[-1]))
      print(rows[-1], flush=True)
  result = {**prov, "model": model, "starts": rows}
  benchlib.write_json(benchlib.REPO / "benchmarks" / "results" / "startup_compile.json", result)


if __name__ == "__main__":
  main()
