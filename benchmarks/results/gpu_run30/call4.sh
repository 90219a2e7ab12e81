#!/usr/bin/env bash
# gpu_run30 call 4 (run as one command line): layers in a stack under strong skew (some experts get
# no rows), the weight gradient skipping empty groups against the kernel before it (A/B/A).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
M="timeout 125 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 4 --experts 128 --tokens 4096 --keep 1.0 0.5 0.25 --skew 2"
$M --out $OUT/skip1.json > $OUT/skip1.log 2>&1; echo "skip1 rc=$?"
git apply -R benchmarks/results/gpu_run30/skip_empty.patch && echo reversed
$M --out $OUT/noskip.json > $OUT/noskip.log 2>&1; echo "noskip rc=$?"
git apply benchmarks/results/gpu_run30/skip_empty.patch && echo restored
$M --out $OUT/skip2.json > $OUT/skip2.log 2>&1; echo "skip2 rc=$?"
