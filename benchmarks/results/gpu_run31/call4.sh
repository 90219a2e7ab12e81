#!/usr/bin/env bash
# gpu_run31 call 4 (run as one command line): call 2's 16384-token stacks with the keep ratios in
# reverse order (call 3 found the variant that runs second 2-7 % slower in the host-bound forward).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
for e in 128 16; do
  timeout 130 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens 16384 --keep 0.25 0.5 0.75 1.0 --out $OUT/model_e${e}_rev.json > $OUT/model_e${e}_rev.log 2>&1; echo "model e$e reversed rc=$?"; grep -E "^  (keep|floor)" $OUT/model_e${e}_rev.log | cut -c1-100
done
