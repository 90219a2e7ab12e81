#!/usr/bin/env bash
# Installs megatron-lrmoe with its test extras into a Python 3.12 venv and runs the CPU test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$py" -m pytest -q -p no:cacheprovider tests "$@"
