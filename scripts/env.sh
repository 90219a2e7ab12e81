#!/usr/bin/env bash
# Finds or makes a Python 3.12 virtual environment in .venv (or $LRMOE_VENV) with megatron-lrmoe
# installed in editable mode (with its test extras); prints the venv's python on stdout. Run by
# demo.sh, test.sh and .ci/run.
#
# The install (pip install -e .[test]) runs only when the venv is not up to date: no venv yet, no
# stamp, a stamp from another setup.py, Python or checkout, or a venv whose megatron_lrmoe (or a
# dependency) does not resolve where it should. Otherwise the script costs one Python start-up.
# The stamp is written only after a successful install. pip's output goes to a log and is shown
# only when the install fails.
#
# Sourcing it (`source scripts/env.sh`) defines the lrmoe_env_* functions and runs nothing;
# tests/test_newcomer.py checks the up-to-date logic on a fake venv that way.

STAMP_NAME=".lrmoe-env-stamp"
EXTRAS="test"

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

# lrmoe_env_stamp ROOT PYTHON: what the stamp of an up-to-date venv holds (stdout).
lrmoe_env_stamp() {
  local root="$1" py="$2" hash version
  hash="$(sha256sum "$root/setup.py" | cut -d' ' -f1)" || return 1
  version="$("$py" -c 'import sys; print(sys.version.replace("\n", " "))' 2>/dev/null)" || return 1
  printf 'setup.py sha256 %s\nextras %s\npython %s\ncheckout %s\n' \
    "$hash" "$EXTRAS" "$version" "$(cd "$root" && pwd -P)"
}

# lrmoe_env_current ROOT VENV: exit status 0 when VENV needs no install for the checkout ROOT.
lrmoe_env_current() {
  local root="$1" venv="$2" py="$2/bin/python" want where
  [ -x "$py" ] && [ -f "$venv/$STAMP_NAME" ] || return 1
  want="$(lrmoe_env_stamp "$root" "$py")" || return 1
  [ "$(cat "$venv/$STAMP_NAME")" = "$want" ] || return 1
  # Where the venv itself (no PYTHONPATH, not from the current directory) finds the package:
  # find_spec locates without importing, so this stays a plain interpreter start.
  where="$(cd / && env -u PYTHONPATH "$py" -c '
import importlib.util, os, sys
for name in ("torch", "megatron.core", "pytest", "matplotlib", "pretrain_lrmoe"):
    if importlib.util.find_spec(name) is None:
        sys.exit(1)
spec = importlib.util.find_spec("megatron_lrmoe")
print(os.path.dirname(os.path.dirname(os.path.realpath(spec.origin))))
' 2>/dev/null)" || return 1
  [ "$where" = "$(cd "$root" && pwd -P)" ]
}

# lrmoe_env_explain_failure LOG VENV: after a failed install, says so plainly when the disk was
# full (pip's own last line is an OSError deep in its output) and what the venv and /tmp have.
lrmoe_env_explain_failure() {
  local log="$1" venv="$2"
  if grep -q "No space left on device" "$log"; then
    echo "env.sh: the disk filled up during the install; the venv needs about 5.6 GB free" \
      "(torch's CUDA wheels). Free space, or set LRMOE_VENV to a venv on a larger disk, and" \
      "run this again. Free space now:" >&2
    df -h "$venv" "${TMPDIR:-/tmp}" >&2 || true
  fi
}

# lrmoe_env_install ROOT VENV: pip install -e ROOT[test] into VENV quietly, then the stamp.
lrmoe_env_install() {
  local root="$1" venv="$2" py="$2/bin/python" log
  log="$(mktemp "${TMPDIR:-/tmp}/lrmoe-env.XXXXXX.log")"
  echo "env.sh: installing megatron-lrmoe and its dependencies into $venv" \
    "(a first install downloads torch's CUDA wheels: minutes)" >&2
  # --no-cache-dir: the venv takes about 5.6 GB (torch's CUDA wheels); pip's cache would hold the
  # downloaded wheels a second time.
  if ! { "$py" -m pip install --no-cache-dir --upgrade pip &&
         "$py" -m pip install --no-cache-dir -e "$root[$EXTRAS]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "env.sh: pip install failed (output above, also in $log)" >&2
    lrmoe_env_explain_failure "$log" "$venv"
    return 1
  fi
  rm -f "$log"
  lrmoe_env_stamp "$root" "$py" >"$venv/$STAMP_NAME"
}

lrmoe_env_main() {
  set -euo pipefail
  local root venv py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${LRMOE_VENV:-$root/.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python312)" || { echo "error: Python 3.12 not found (megatron-core 0.19 needs" \
      "it); install it (e.g. pyenv install 3.12) or set LRMOE_VENV to a 3.12 venv" >&2; exit 1; }
    "$py" -m venv "$venv" >&2
  fi
  if ! lrmoe_env_current "$root" "$venv"; then
    lrmoe_env_install "$root" "$venv"
  fi
  echo "$venv/bin/python"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  lrmoe_env_main
fi
