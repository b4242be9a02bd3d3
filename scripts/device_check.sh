#!/usr/bin/env bash
# Device check: compiles kvjax's Pallas GPU kernels on the accelerator (interpret=False), checks
# each against its jnp reference and measures what it achieves. Three guarded sub-checks, each
# with its own time limit (a failure or timeout in one is reported, the rest still run):
#
#   1. paged attention (scripts/device_check.py): the Triton kernel vs the reference on mixed
#      decode + prefill batches, then decode attention's achieved HBM bandwidth (GB/s of KV read)
#      on a LLaMA-3.1-8B-shaped pool (32 q / 8 kv heads, head dim 128, bf16) at 4K-32K context,
#      batch 1/8/32, and a small block-size sweep;
#   2. KV codecs (scripts/device_check_codec.py): kv_encode / kv_decode Triton kernels
#      (kvjax/kernels/kv_codec_gpu.py) for raw, int8, int4, cachegen at SmolLM2-135M and
#      LLaMA-3.1-8B chunk shapes (bf16, 256 tokens) vs the jnp reference, and GB/s;
#   3. rANS (scripts/device_check_rans.py): kvtc's entropy decoder (Triton kernel
#      kvjax/kernels/rans_decode_gpu.py) byte-exact on a SmolLM2-shaped chunk, GB/s of coded
#      bytes. The GPU machine lacks storage's libraries, so the codes are coded beforehand on the
#      CPU machine: `bash scripts/device_check.sh --prepare` writes
#      benchmarks/device_inputs/kvtc_rans_codes.pkl (git-ignored: carry it to the device run).
#
# Needs only jax, absl and numpy (the H200 machine has jax 0.11 with jax-cuda13; no gguf,
# pcodec, zstandard, fastapi or uvicorn: nothing here imports them). JSON per sub-check goes to
# $OUT (else benchmarks/results/), plus device_check_summary.json; tables are printed.
#
# Usage (repo root): bash scripts/device_check.sh [--cpu | --prepare]
#   --cpu   tiny sizes in Pallas interpret mode, to prove the scripts run without a GPU.
# Env: PYTHON (default .venv/bin/python if present, else python3), OUT (folder for the JSON),
#      DEVICE_CHECK_TIMEOUT_S (the whole run's budget, default 330 s, 600 s with --cpu: split
#      30% attention, 50% codecs, 20% rANS; each sub-script also stops starting new cases
#      before its limit),
#      DEVICE_CHECK_ONLY (comma-separated sub-checks to run: paged_attention, kv_codec, rans;
#      default all; the ones chosen share the whole budget in the same proportions), e.g.
#        DEVICE_CHECK_ONLY=kv_codec DEVICE_CHECK_TIMEOUT_S=200 bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Leave GPU memory to the pools: allocate on demand instead of preallocating 75%.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
"$PYTHON" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
if [[ "${1:-}" == "--prepare" ]]; then
  exec "$PYTHON" scripts/device_check_rans.py --prepare
fi
CPU_FLAG=()
if [[ " $* " == *" --cpu "* ]]; then CPU_FLAG=(--cpu); fi
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
# --cpu interprets every kernel on a (shared, small) CPU: a longer default budget.
default_total=330
if [[ ${#CPU_FLAG[@]} -gt 0 ]]; then default_total=600; fi
total="${DEVICE_CHECK_TIMEOUT_S:-$default_total}"
ONLY="${DEVICE_CHECK_ONLY:-paged_attention,kv_codec,rans}"
for name in ${ONLY//,/ }; do
  case "$name" in paged_attention|kv_codec|rans) ;;
    *) echo "DEVICE_CHECK_ONLY: unknown sub-check '$name' (paged_attention, kv_codec, rans)" >&2
       exit 2 ;;
  esac
done
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
# Shares of the budget (percent) of the sub-checks that run, scaled to the whole budget.
share_sum=0
wanted paged_attention && share_sum=$(( share_sum + 30 ))
wanted kv_codec && share_sum=$(( share_sum + 50 ))
wanted rans && share_sum=$(( share_sum + 20 ))
t_att=$(( total * 30 / share_sum )); t_codec=$(( total * 50 / share_sum ))
t_rans=$(( total * 20 / share_sum ))
summary=()
run_check() {  # name, limit_s, command...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc=0
  echo "=== $name (limit ${limit} s) ==="
  timeout --kill-after=10 "$limit" "$@" || rc=$?
  local verdict=ok
  if (( rc == 124 || rc == 137 )); then verdict=timeout; elif (( rc != 0 )); then verdict=failed; fi
  echo "=== $name: $verdict (rc $rc) in $(( SECONDS - t0 )) s ==="
  summary+=("{\"check\": \"$name\", \"rc\": $rc, \"verdict\": \"$verdict\", \"wall_s\": $(( SECONDS - t0 ))}")
}
if wanted paged_attention; then
  run_check paged_attention "$t_att" "$PYTHON" scripts/device_check.py "${CPU_FLAG[@]}" \
    --budget_s $(( t_att * 60 / 100 ))
fi
if wanted kv_codec; then  # a case takes up to ~30 s: none starts in the last 25% of the limit
  run_check kv_codec "$t_codec" "$PYTHON" scripts/device_check_codec.py "${CPU_FLAG[@]}" \
    --budget_s $(( t_codec * 75 / 100 ))
fi
if wanted rans; then
  run_check rans "$t_rans" "$PYTHON" scripts/device_check_rans.py "${CPU_FLAG[@]}"
fi
name=device_check_summary.json
if [[ ${#CPU_FLAG[@]} -gt 0 ]]; then name=device_check_summary_cpu.json; fi
( IFS=,; echo "[${summary[*]}]" ) > "$OUT_DIR/$name"
echo "summary ($OUT_DIR/$name):"
status=0
for s in "${summary[@]}"; do echo "  $s"; [[ "$s" == *'"verdict": "ok"'* ]] || status=1; done
exit "$status"
