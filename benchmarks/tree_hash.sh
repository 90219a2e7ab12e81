#!/usr/bin/env bash
# The code a benchmark ran, as one hash: SHA-1 over the paths and contents of the package, the
# benchmark and example scripts, the entry point and setup.py (measured files under
# benchmarks/results/ left out). Device drivers print it into their results next to `git
# rev-parse HEAD`, which can name an older commit on a device that received the tree without
# fresh git metadata; run it here on a commit to match the two.
#
#   bash benchmarks/tree_hash.sh [ROOT]      (ROOT: the checkout, default: this script's)
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
find megatron_lrmoe benchmarks examples pretrain_lrmoe.py setup.py \
    -path benchmarks/results -prune -o -type f \
    \( -name '*.py' -o -name '*.sh' -o -name '*.c' \) -print |
  LC_ALL=C sort | while IFS= read -r f; do printf '%s\n' "$f"; cat "$f"; done |
  sha1sum | cut -c1-12
