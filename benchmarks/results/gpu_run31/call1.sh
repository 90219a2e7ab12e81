#!/usr/bin/env bash
# gpu_run31 call 1 (run as one command line): the README's CUDA test command on this session's
# head (init_megatron_parallel now passes expert TP 1 explicitly; CUDA ranks use it too), then this
# session's new CPU tests on the GPU host's torch 2.11 / Triton 3.6 (config and argument rules,
# the TP 2 layer tests, the saved-tensor test).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git rev-parse HEAD; bash benchmarks/tree_hash.sh
LRMOE_TEST_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -2 $OUT/cuda_tests.log
timeout 300 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_config.py tests/test_args.py "tests/test_layer.py::test_keep1_equals_stock_with_attention_tensor_parallel" "tests/test_layer.py::test_keep_below_one_with_attention_tensor_parallel" "tests/test_layer_robustness.py::test_experts_never_save_the_activation_output" > $OUT/new_cpu_tests.log 2>&1; echo "new cpu tests rc=$?"; tail -2 $OUT/new_cpu_tests.log
