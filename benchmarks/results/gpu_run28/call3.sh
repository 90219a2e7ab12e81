#!/usr/bin/env bash
# gpu_run28 call 3: 8 stacked layers at 16384 tokens with the routers skewed (model_bench --skew):
# 128 experts at skew 0 and 0.5 (call 2 ran skew 1), 16 experts (one GPU's share of EP 8) at
# skew 0, 0.5 and 1; keep 1.0, 0.75, 0.5 in each process.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
for run in "128 0" "128 0.5" "16 0" "16 0.5" "16 1"; do
  set -- $run
  timeout 110 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $1 --tokens 16384 \
    --keep 1.0 0.75 0.5 --skew $2 --out $OUT/model_e$1_skew$2.json 2>&1 | grep -v -i warn | grep -v Evict | tail -5 | tee $OUT/model_e$1_skew$2.log
done
