#!/usr/bin/env bash
# gpu_run24 call 4: a second seed (4321) of the Qwen3 proxy at 4096 tokens per micro-batch
# (4 layers of 128 experts, EP 1, four micro-batches per iteration, real text, fused
# accumulation, 300 iterations), keep 0.5 `sample` then keep 1.0 on the same GPU, as section
# 12 (seed 1234). Run from the repository root after the install line of ../shared/GPU.md;
# W = output folder.
W=${W:?}; mkdir -p $W
A_KEEP=0.5 B_KEEP=1.0 A_ENV="SEED=4321" B_ENV="SEED=4321" TRAIN_ITERS=300 GBS=4 MBS=1 TIMEOUT_S=260 bash benchmarks/train_compare.sh $W/train > $W/train_driver.log 2>&1; echo "train rc=$?"; grep -E "exit|validation loss at iteration 300 \|" $W/train_driver.log | tail -6
python3 benchmarks/report.py $W/train 2>&1 | tail -8
