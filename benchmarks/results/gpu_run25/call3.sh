#!/usr/bin/env bash
# gpu_run25 call 3: keep 0.25 `sample` at two more seeds (4321, 2024), same proxy and schedule
# as call 2 (16384 tokens per micro-batch, 4 layers of 128 experts, EP 1, 300 iterations), run A
# alone: keep 1.0 at these seeds ran in gpu_run20 (section 18) and gpu_run24 call 3 (section 22),
# and call 2 shows the keep-1.0 path gives the same losses as then (seed 1234, section 15).
# Run from the repository root after the install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W
for seed in 4321 2024; do
  A_KEEP=0.25 B_KEEP=none A_ENV="SEED=$seed" NAME_A=keep0.25_seed$seed TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=270 bash benchmarks/train_compare.sh $W/train > $W/train_driver_$seed.log 2>&1; echo "train $seed rc=$?"; grep -E "validation loss at iteration 300 \||exit" $W/train/train_keep0.25_seed$seed.log
done
python3 benchmarks/report.py $W/train 2>&1 | tail -4
