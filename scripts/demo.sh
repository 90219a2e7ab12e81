#!/usr/bin/env bash
# Installs megatron-lrmoe into a Python 3.12 venv (only when it is not up to date, see env.sh) and
# runs the main job: lrmoe-demo, CPU, 2 ranks. Arguments go to lrmoe-demo (--help lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$(dirname "$py")/lrmoe-demo" "$@"
