#!/usr/bin/env bash
# gpu_run31 call 5 (run as one command line): what the previous layers' op contexts held through a
# dispatcher's kept probs (dd249d9 drops them at combine_postprocess): eight stacked layers,
# memory allocated after the rounds and the peak above it, with the fix / without (git apply -R) /
# with, 128 experts and 16384 tokens, keep 1.0 and 0.5.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
M="timeout 120 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 16384 --keep 1.0 0.5"
$M --out $OUT/drop1.json > $OUT/drop1.log 2>&1; echo "drop1 rc=$?"; grep -E "^  keep" $OUT/drop1.log | cut -c1-330
git apply -R benchmarks/results/gpu_run31/drop_probs.patch && echo reversed
$M --out $OUT/keep.json > $OUT/keep.log 2>&1; echo "keep rc=$?"; grep -E "^  keep" $OUT/keep.log | cut -c1-330
git apply benchmarks/results/gpu_run31/drop_probs.patch && echo restored
$M --out $OUT/drop2.json > $OUT/drop2.log 2>&1; echo "drop2 rc=$?"; grep -E "^  keep" $OUT/drop2.log | cut -c1-330
