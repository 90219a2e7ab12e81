#!/usr/bin/env bash
# Finds or makes a Python 3.12 virtual environment in .venv (or $LRMOE_VENV) with megatron-lrmoe
# installed in editable mode; prints the venv's python. Sourced by demo.sh, test.sh and .ci/run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${LRMOE_VENV:-$root/.venv}"
find_python312() {
  local c
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 \
           /usr/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,12)' \
        >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  return 1
}
if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python312)" || { echo "error: Python 3.12 not found (megatron-core 0.19 needs it);" \
    "install it (e.g. pyenv install 3.12) or set LRMOE_VENV to a 3.12 venv" >&2; exit 1; }
  "$py" -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -e "$root[test]" >&2
echo "$venv/bin/python"
