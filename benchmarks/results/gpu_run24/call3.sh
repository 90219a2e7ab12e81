#!/usr/bin/env bash
# gpu_run24 call 3: a third seed (2024) of the Qwen3 proxy at 16384 tokens per micro-batch
# (4 layers of 128 experts, EP 1, four micro-batches per iteration, real text, fused
# accumulation, 300 iterations), keep 0.5 `sample` then keep 1.0 on the same GPU, as sections
# 15 (seed 1234) and 18 (seed 4321). Run from the repository root after the install line of
# ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W
A_KEEP=0.5 B_KEEP=1.0 A_ENV="SEED=2024" B_ENV="SEED=2024" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=270 bash benchmarks/train_compare.sh $W/train > $W/train_driver.log 2>&1; echo "train rc=$?"; tail -30 $W/train_driver.log
python3 benchmarks/report.py $W/train 2>&1 | tail -8
