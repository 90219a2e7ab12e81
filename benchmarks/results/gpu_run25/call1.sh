#!/usr/bin/env bash
# gpu_run25 call 1: does the forward's one device-to-host sync (the counts, at EP 1 waited for
# after the op's forward is queued) cost GPU time in a stack of layers? A throwaway patch
# (nosync_experiment.patch, not committed) lets LRMOE_HACK_NOSYNC=1 skip that wait in the forward
# and build the plan in the backward; both variants run without statistics
# (LRMOE_HACK_NOSTATS=1: the statistics read the counts in the forward). model_bench, 8 layers,
# alternating variants. Run from the repository root after the install line; W = output folder.
W=${W:?}; mkdir -p $W
i=0
for spec in "128 16384 0" "128 16384 1" "16 4096 0" "16 4096 1" "128 16384 0" "128 16384 1" "16 4096 0" "16 4096 1"; do
  set -- $spec; i=$((i+1))
  f=$W/model_e$1_t$2_nosync$3_run$i
  LRMOE_HACK_NOSTATS=1 LRMOE_HACK_NOSYNC=$3 timeout 120 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $1 --tokens $2 --keep 1.0 0.5 --rounds 10 --out $f.json > $f.log 2>&1
  echo "== e$1 t$2 nosync=$3 run$i rc=$? $(date +%T)"; grep -E "keep (1|0.5):" $f.log | cut -c1-150
done
