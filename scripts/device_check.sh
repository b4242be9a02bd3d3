#!/usr/bin/env bash
# Device check: compiles kvjax's Pallas kernels on the accelerator (interpret=False), checks them
# against their jnp references and measures what they achieve. Later issues extend this script.
#
# Today (issue 11): the paged attention GPU kernel (Triton lowering) vs the reference on mixed
# decode + prefill batches, then decode attention's achieved HBM bandwidth (bytes of KV read /
# time) for a LLaMA-3.1-8B-shaped random pool (32 q heads, 8 kv heads, head dim 128, bf16) at
# 4K-32K context, batch 1/8/32, and a small block-size sweep (scripts/device_check.py).
# Issue 13: kvtc's rANS entropy decoder (Pallas, compiled) byte-exact against the jnp reference
# on a SmolLM2-shaped chunk, GB/s of coded bytes against a 4 GB/s link
# (scripts/device_check_rans.py). The GPU machine lacks storage's libraries, so the codes are
# coded beforehand on the CPU machine: `bash scripts/device_check.sh --prepare` writes
# benchmarks/device_inputs/kvtc_rans_codes.pkl (git-ignored: pass it in the device run's carry).
#
# Needs only jax, absl and numpy (the H200 machine has jax 0.11; no gguf, pcodec, zstandard,
# fastapi or uvicorn: nothing here imports them). Time-boxed to 5 minutes (DEVICE_CHECK_TIMEOUT_S);
# the Python side also stops starting measurements after --budget_s (240 s).
#
# Usage (repo root): bash scripts/device_check.sh [--cpu | --prepare] [device_check.py flags]
#   --cpu   tiny sizes in Pallas interpret mode, to prove the script runs without a GPU.
# Env: PYTHON (default .venv/bin/python if present, else python3), OUT (folder for the JSON;
#      default benchmarks/results), DEVICE_CHECK_TIMEOUT_S (default 300),
#      DEVICE_CHECK_RANS_TIMEOUT_S (default 120).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Leave GPU memory to the pools: allocate on demand instead of preallocating 75%.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
"$PYTHON" -c "import jax; print('jax', jax.__version__, jax.devices())"
if [[ "${1:-}" == "--prepare" ]]; then
  exec "$PYTHON" scripts/device_check_rans.py --prepare
fi
CPU_FLAG=()
if [[ " $* " == *" --cpu "* ]]; then CPU_FLAG=(--cpu); fi
status=0
timeout "${DEVICE_CHECK_TIMEOUT_S:-300}" "$PYTHON" scripts/device_check.py "$@" || status=$?
timeout "${DEVICE_CHECK_RANS_TIMEOUT_S:-120}" "$PYTHON" scripts/device_check_rans.py \
  "${CPU_FLAG[@]}" || status=$?
exit "$status"
