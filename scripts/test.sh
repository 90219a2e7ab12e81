#!/usr/bin/env bash
# Installs megatron-lrmoe with its test extras into a Python 3.12 venv (only when it is not up to
# date, see env.sh) and runs the CPU test suite: `bash scripts/test.sh` runs tests/ (pytest.ini's
# testpaths); arguments go to pytest, e.g. `bash scripts/test.sh tests/test_args.py -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$py" -m pytest -q -p no:cacheprovider "$@"
