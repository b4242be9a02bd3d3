#!/usr/bin/env bash
# The device check (docs/design/accelerators.md): on one H100/H200, within 6 minutes and in this
# order, (a) correctness: the engine's bf16 greedy tokens against the CPU f32 engine's, a warm
# store hit equal to cold, kvtc consistent-mode repeats identical; (b) the engine: TTFT cold/warm
# at 4K and 16K tokens, decode tokens/s at batch 1/32/64 against the HBM roofline, Cake against
# compute-only and load-only (local disk, host memory), a 32-client bench_serve --quick;
# (c) the kernels against ceilings measured in the same run (HBM copy, pinned host -> device
# copy): paged attention, kv decode int8/int4, rANS decode, host -> device copy. Each step runs
# under its own time limit (scripts/device_check_all.py, STEPS); the run ends by writing
# benchmarks/results/device_summary_<device>.json (or $OUT/...) and exits 1 naming every check
# that failed or was skipped.
#
# Usage (repository root):
#   bash scripts/device_check.sh --prepare            # on the CPU machine: benchmarks/device_inputs/
#   bash scripts/device_check.sh                      # on the GPU machine, device_inputs carried
#   bash scripts/device_check.sh --dry-run            # the same steps on the CPU, tiny shapes
#   bash scripts/device_check.sh --prepare --dry-run  # the dry run's reference (CPU, tiny model)
#   ... --only ceilings,attention                     # some steps only
# Env: PYTHON (default .venv/bin/python if present, else python3), OUT (results folder).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Leave GPU memory to the pools: allocate on demand instead of preallocating 75%.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
# The device image lacks some of kvjax's packages: --prepare downloaded their wheels; install
# them (no index, no dependencies) into a private folder on the path.
if [[ " $* " != *" --prepare "* && " $* " != *" --dry-run "* ]] \
    && compgen -G "benchmarks/device_inputs/wheels/*.whl" > /dev/null; then
  site="${TMPDIR:-/tmp}/kvjax-device-site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" benchmarks/device_inputs/wheels/*.whl || exit 3
  export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$PYTHON" scripts/device_check_all.py "$@"
