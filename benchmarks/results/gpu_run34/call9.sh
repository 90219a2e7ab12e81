#!/usr/bin/env bash
# gpu_run34 call 9: the CUDA tests on the package after 2026-12-07's refactors (RowRoute and the
# frozen ExpertCall, the renamed kernel modules and public capture names), which never ran on a GPU.
# The tree in .snap/ is a `git archive` of the commit in .snap/COMMIT, tests included.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
LRMOE_TEST_CUDA=1 timeout 420 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_triton.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py tests/test_scoring.py tests/test_options.py tests/test_expert_call.py tests/test_compaction.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?" | tee -a $OUT/run.log; tail -15 $OUT/cuda_tests.log
