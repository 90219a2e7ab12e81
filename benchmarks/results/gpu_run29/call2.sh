#!/usr/bin/env bash
# gpu_run29 call 2: the GLM-4.5-Air proxy (issue 8 target 6: >= 100 iterations) on the current
# code, stock then LRMoE keep 0.5 `sample` on one H200, 100 iterations each.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh > $OUT/tree_hash.txt 2>&1; cat $OUT/tree_hash.txt
TRAIN_ITERS=100 EVAL_INTERVAL=50 TIMEOUT_S=285 bash benchmarks/glm_compare.sh $OUT/glm > $OUT/glm_compare.log 2>&1; echo "glm rc=$?"
tail -8 $OUT/glm_compare.log
