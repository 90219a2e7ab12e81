#!/usr/bin/env bash
# gpu_run28 call 1: the README's CUDA test command on the current code, then the Qwen3 proxy
# training at 16384 tokens per micro-batch, seed 4321, keep 0.5 `sample` then keep 1.0, 300
# iterations each (the weight gradient's large tile from 512 rows per expert, section 25).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git log -1 --format='%H %s' > $OUT/commit.txt 2>/dev/null || true
LRMOE_TEST_CUDA=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -2 $OUT/cuda_tests.log
A_KEEP=0.5 B_KEEP=1.0 A_ENV="SEED=4321" B_ENV="SEED=4321" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=185 bash benchmarks/train_compare.sh $OUT/train > $OUT/train_compare.log 2>&1; echo "train rc=$?"
python3 benchmarks/report.py $OUT/train 2>&1 | tee $OUT/report.txt | tail -6
