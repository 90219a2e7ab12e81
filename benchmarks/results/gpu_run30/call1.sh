#!/usr/bin/env bash
# gpu_run30 call 1 (run as one command line): the README's CUDA test command, then the CPU suite
# on the GPU host with b099ab0's harness (CPU ranks forked from a preloaded forkserver, GPUs hidden).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git rev-parse HEAD; bash benchmarks/tree_hash.sh
LRMOE_TEST_CUDA=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -2 $OUT/cuda_tests.log
timeout 380 python3 -m pytest -q -p no:cacheprovider --durations=20 tests > $OUT/cpu_tests_on_gpu_host.log 2>&1; echo "cpu suite rc=$?"; tail -4 $OUT/cpu_tests_on_gpu_host.log
