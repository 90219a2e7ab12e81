#!/usr/bin/env bash
# Installs megatron-lrmoe into a Python 3.12 venv and runs the main job (lrmoe-demo, CPU, 2 ranks).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/env.sh")"
cd "$root"
exec "$(dirname "$py")/lrmoe-demo" "$@"
