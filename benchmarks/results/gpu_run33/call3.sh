#!/usr/bin/env bash
# gpu_run33 call 3 (one H200; from a `git archive` of the commit in .snap/):
# 1. The CUDA tests on this commit (the Triton kernels now live beside their stages).
# 2. A convergence pilot (not part of the protocol): the baseline stock+moe, seed 1234, 300
#    iterations under the 78 GiB cap with the fixed validation set: its loss curve, the
#    evaluations' cost and the validation set's standard error, to size the protocol's runs.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; bash benchmarks/tree_hash.sh | tee -a $OUT/run.log
LRMOE_TEST_CUDA=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?" | tee -a $OUT/run.log; tail -2 $OUT/cuda_tests.log
timeout 380 python3 benchmarks/memory_bound.py converge --out /tmp/mb --cap-gib 78 --layers 24 --iters 300 --seeds 1234 --arms stock+moe --timeout-s 370 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
cp /tmp/mb/converge/*.log $OUT/pilot_stock_moe_seed1234.log
python3 benchmarks/train_logs.py /tmp/mb/converge/*.log | head -30
grep -E "validation (spread|loss)" /tmp/mb/converge/*.log | cut -c1-200
