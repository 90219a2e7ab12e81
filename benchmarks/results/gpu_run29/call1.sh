#!/usr/bin/env bash
# gpu_run29 call 1: the weight gradient's epilogue as TMA bulk reductions (WgradConfig.tma_epilogue)
# against the fire-and-forget atomics, Qwen3 expert shapes, 256 / 512 / 1024 rows per expert;
# then the CUDA tests of the weight-gradient kernels.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh > $OUT/tree_hash.txt 2>&1; cat $OUT/tree_hash.txt
TILES="64,128,32,4,4,0,1 128,256,64,8,4,0,1
 64,128,32,4,4,0,0,1 64,128,32,4,4,0,0,2 64,128,32,4,4,0,0,4
 128,256,64,8,4,0,0,1 128,256,64,8,4,0,0,2 128,256,64,8,4,0,0,4
 128,256,64,8,4,1,0,4 128,256,64,8,3,1,0,2 128,256,64,8,3,1,0,4 128,256,64,8,2,1,0,1
 64,128,32,4,4,1,0,1 64,128,32,4,4,2,0,1 64,128,32,4,4,2,0,2 64,128,32,4,4,3,0,4
 64,256,32,4,4,1,0,2 64,256,32,4,4,2,0,4 128,128,64,8,3,1,0,2"
timeout 330 python3 benchmarks/wgrad_bench.py --rows 256 512 1024 --iters 15 --tiles $TILES --sass --out $OUT/wgrad_tma.json > $OUT/wgrad_tma.log 2>&1; echo "wgrad bench rc=$?"
grep -v "^    " $OUT/wgrad_tma.log | tail -12
LRMOE_TEST_CUDA=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore -k "wgrad" tests/test_triton_kernels.py > $OUT/wgrad_tests.log 2>&1; echo "wgrad tests rc=$?"; tail -15 $OUT/wgrad_tests.log
