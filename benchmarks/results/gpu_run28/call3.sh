#!/usr/bin/env bash
# gpu_run28 call 3: the GLM-4.5-Air proxy (shared expert, sigmoid router with expert bias, MTP,
# full recompute; target 6) on the current code, stock then LRMoE keep 0.5 `sample` on one H200,
# 40 iterations each (last run on a GPU: section 5, gpu_run5); then 8 stacked layers at 16
# experts (one GPU's share of EP 8) and 16384 tokens, routers even (--skew 0) and skewed (0.5).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TRAIN_ITERS=40 EVAL_INTERVAL=20 TIMEOUT_S=200 bash benchmarks/glm_compare.sh $OUT/glm > $OUT/glm_compare.log 2>&1; echo "glm rc=$?"
tail -12 $OUT/glm_compare.log
for skew in 0 0.5; do
  timeout 75 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 16 --tokens 16384 \
    --keep 1.0 0.75 0.5 --skew $skew --out $OUT/model_e16_skew$skew.json 2>&1 | grep -v -i warn | grep -v Evict | tail -5 | tee $OUT/model_e16_skew$skew.log
done
