#!/usr/bin/env bash
# gpu_run29 call 3: call 2's stock GLM-4.5-Air proxy run stopped at its 285-s timeout at
# iteration 94 (2.33 s/iter); stock again alone, 100 iterations, summarized with call 2's
# LRMoE keep 0.5 log (the losses are deterministic: its first 94 must equal call 2's).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p $OUT/glm && cp benchmarks/results/gpu_run29/call2/glm/train_keep0.5.log $OUT/glm/
RUNS=stock TRAIN_ITERS=100 EVAL_INTERVAL=50 TIMEOUT_S=380 bash benchmarks/glm_compare.sh $OUT/glm > $OUT/glm_compare.log 2>&1; echo "glm rc=$?"
tail -8 $OUT/glm_compare.log
