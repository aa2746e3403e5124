#!/usr/bin/env bash
# Set up megatron-rl from nothing: a Python 3.12 virtual environment in .venv with the package
# and its test dependencies at the tested versions (constraints.txt). Idempotent: a second run
# only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then echo python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python3.12"; return; fi
  fi
  echo "setup.sh: Python 3.12 not found (megatron-core 0.19 needs >= 3.12); set PYTHON=/path/to/python3.12" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python)
  $PY -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# The exact tested versions (constraints.txt) inside setup.py's ranges; reinstalled when either file
# is newer than the stamp, or when their content changed (a checkout that keeps old mtimes).
STAMP=.venv/.megatron-rl-installed
WANT=$(cat setup.py constraints.txt | cksum)
if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
  echo "$WANT" > "$STAMP"
fi
.venv/bin/python -W ignore -c "import logging; logging.disable(logging.WARNING); import megatron.core, torch, transformers; print(f'megatron-rl env ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}')"
