#!/usr/bin/env bash
# gpu_run26 call 2 (code 1st commit after d058b72): CUDA tests; the weight-gradient kernel's
# quick tile set at 128-2048 rows per expert.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT
LRMOE_TEST_CUDA=1 timeout 260 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $W/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -3 $W/cuda_tests.log
timeout 250 python3 benchmarks/wgrad_bench.py --quick --rows 128 256 512 768 1024 1536 2048 --out $W/wgrad_quick.json > $W/wgrad_quick.log 2>&1; echo "wgrad rc=$?"; grep -E "^fc" $W/wgrad_quick.log | cut -c1-120
