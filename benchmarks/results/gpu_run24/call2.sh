#!/usr/bin/env bash
# gpu_run24 call 2: the CUDA tests on the code with Megatron-FSDP's main_grad protocol (the layer
# graph's key now carries the accumulate flag), and layers stacked as in a model at 128 experts
# and at 16 experts, 16384 tokens, keep 1.0 / 0.75 / 0.5. Run from the repository root after
# the install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W
LRMOE_TEST_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $W/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -1 $W/cuda_tests.log
for e in 128 16; do
  timeout 150 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens 16384 --keep 1.0 0.75 0.5 --out $W/model_e${e}_t16384.json > $W/model_e${e}_t16384.log 2>&1; echo "model $e rc=$?"; tail -5 $W/model_e${e}_t16384.log
done
