#!/usr/bin/env bash
# gpu_run24 call 5: the CUDA tests on the session's final code (the layer-graph test now also
# runs a layer whose main_grad is written over). Run from the repository root after the
# install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W
LRMOE_TEST_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore -rA -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $W/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -1 $W/cuda_tests.log; grep -E "expert_graph_matches_eager|FAILED" $W/cuda_tests.log | head
