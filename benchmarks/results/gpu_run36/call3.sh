#!/usr/bin/env bash
# gpu_run36 call 3: call 1's Qwen3 traces (STAGES=qwen3) and call 2's profile in one device call,
# each into its own folder under $OUT (4 files each).
#   bash benchmarks/results/gpu_run36/call3.sh      (from the repository root, .snap and .whl carried)
ROOT_OUT=$OUT; mkdir -p $ROOT_OUT/trace $ROOT_OUT/profile
OUT=$ROOT_OUT/trace STAGES=qwen3 bash benchmarks/results/gpu_run36/call1.sh
OUT=$ROOT_OUT/profile bash benchmarks/results/gpu_run36/call2.sh
