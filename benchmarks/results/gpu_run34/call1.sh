#!/usr/bin/env bash
# gpu_run34 call 1 (one H200; from a `git archive` of the commit in .snap/):
# 1. The CUDA tests on this commit (3342fe4's jit_kernels and 8a2b5ca's added-variance statistic
#    never ran on a GPU).
# 2. Why one evaluation of the fixed validation set took about a minute in gpu_run33's pilot
#    (44 forward micro-batches, ~1.3 s each, against ~0.3 s for a training forward): the baseline
#    stock+moe, 6 iterations, 2 evaluations under the 78 GiB cap, once with PyTorch's default
#    caching allocator and once with expandable segments (allocator retries under the cap are the
#    suspect); the per-evaluation seconds come from the log's time stamps.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log
LRMOE_TEST_CUDA=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?" | tee -a $OUT/run.log; tail -2 $OUT/cuda_tests.log
for conf in default expandable; do
  if [ $conf = expandable ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fi
  timeout 175 python3 benchmarks/memory_bound.py converge --out /tmp/diag_$conf --cap-gib 78 --layers 24 --iters 6 --evaluations 2 --seeds 1234 --arms stock+moe --timeout-s 165 >> $OUT/run.log 2>&1; echo "diag $conf rc=$?" | tee -a $OUT/run.log
  cp /tmp/diag_$conf/converge/*.log $OUT/diag_$conf.log
  grep -E "validation (spread|loss)|moe layers:|memory_bound: exit" $OUT/diag_$conf.log | cut -c1-220
  python3 benchmarks/train_logs.py $OUT/diag_$conf.log | grep -E "eval_s|steady|iter_ms"
done
