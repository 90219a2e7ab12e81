#!/usr/bin/env bash
# gpu_run31 call 2 (run as one command line): issue 8's target 1 on the current code, even routing,
# eight stacked layers: the backward at keep 0.75 / 0.5 / 0.25 against keep 1.0's, 128 experts at
# 16384 tokens (twice, for the run-to-run spread) and 4096 tokens, 16 experts at 16384 tokens.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
for run in e128_t16384_a e16_t16384 e128_t4096 e128_t16384_b; do
  e=${run#e}; e=${e%%_*}; t=${run#*_t}; t=${t%%_*}
  timeout 130 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens $t --keep 1.0 0.75 0.5 0.25 --out $OUT/model_$run.json > $OUT/model_$run.log 2>&1; echo "model $run rc=$?"; grep -E "^  (keep|floor)" $OUT/model_$run.log | cut -c1-120
done
