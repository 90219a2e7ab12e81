#!/usr/bin/env bash
# gpu_run29 call 4 (run as one command line): 8 stacked layers, 128 experts, 16384 tokens,
# routers skewed (CV 1), after bfae5c9 released each keep ratio's layers (section 26's reserved
# memory under skew).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh > $OUT/tree_hash.txt
timeout 200 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 16384 --keep 1.0 0.75 0.5 --skew 1 --out $OUT/model_e128_skew1.json > $OUT/model_e128_skew1.log 2>&1; echo rc=$?
