#!/usr/bin/env bash
# gpu_run30 call 3 (run as one command line): the weight gradient with empty groups skipped
# (skip_empty.patch) against the kernel before it (the patch reversed), A/B/A in three processes;
# then the CUDA wgrad tests on the new kernel.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
B="timeout 150 python3 benchmarks/wgrad_bench.py --fused-only --rows 32 128 512 --skew 0 1 2 --iters 30 --tiles 64,128,32,4,4,0,1 128,256,64,8,4,0,1"
$B --out $OUT/skip1.json > $OUT/skip1.log 2>&1; echo "skip1 rc=$?"
git apply -R benchmarks/results/gpu_run30/skip_empty.patch && echo reversed
$B --out $OUT/noskip.json > $OUT/noskip.log 2>&1; echo "noskip rc=$?"
git apply benchmarks/results/gpu_run30/skip_empty.patch && echo restored
$B --out $OUT/skip2.json > $OUT/skip2.log 2>&1; echo "skip2 rc=$?"
LRMOE_TEST_CUDA=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_triton_kernels.py -k "cuda_grouped_wgrad or cuda_realistic" > $OUT/cuda_wgrad_tests.log 2>&1; echo "cuda wgrad tests rc=$?"; tail -1 $OUT/cuda_wgrad_tests.log
