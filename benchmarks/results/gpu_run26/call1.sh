#!/usr/bin/env bash
# gpu_run26 call 1: the weight-gradient kernel with the fire-and-forget atomic epilogue against
# load-add-store, every tile and grid (wgrad_bench), and the wgrad CUDA tests.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv | tee $OUT/gpu.txt
git rev-parse HEAD > $OUT/commit.txt 2>/dev/null || true
LRMOE_TEST_CUDA=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore -k "grouped_wgrad" tests/test_triton_kernels.py 2>&1 | tail -5 | tee $OUT/cuda_tests.log
timeout 330 python3 benchmarks/wgrad_bench.py --rows 512 1024 2048 --out $OUT/wgrad_atomic.json 2>&1 | tee $OUT/wgrad_atomic.log
