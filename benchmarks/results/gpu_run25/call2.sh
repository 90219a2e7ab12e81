#!/usr/bin/env bash
# gpu_run25 call 2: keep 0.25 `sample` against keep 1.0 in training: the Qwen3 proxy at 16384
# tokens per micro-batch (4 layers of 128 experts, EP 1, one micro-batch per iteration, real
# text, fused accumulation, 300 iterations), seed 1234 (section 15 ran keep 0.5 against keep 1.0
# with it), one run after the other on the same GPU. Run from the repository root after the
# install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W
A_KEEP=0.25 B_KEEP=1.0 A_ENV="SEED=1234" B_ENV="SEED=1234" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=270 bash benchmarks/train_compare.sh $W/train > $W/train_driver.log 2>&1; echo "train rc=$?"; grep -E "validation loss at iteration 300 \||exit" $W/train_driver.log
python3 benchmarks/report.py $W/train 2>&1 | tail -5
