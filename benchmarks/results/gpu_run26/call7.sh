#!/usr/bin/env bash
# gpu_run26 call 7: which instructions Triton 3.6 emits for the atomic epilogue (cuobjdump -sass
# of the compiled kernels), and a few more tiles against the two config_for picks, twice.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T="64,128,32,4,4,0,1 128,256,64,8,3,0,1 128,256,64,8,4,0,1 128,256,128,8,2,0,1 256,128,64,8,3,0,1 128,128,64,8,3,0,1 128,128,64,4,4,0,1 64,256,32,4,4,0,1 64,128,64,4,4,0,1 128,256,64,8,3,0,0"
for r in 1 2; do
  timeout 250 python3 benchmarks/wgrad_bench.py --rows 512 1024 2048 --tiles $T $([ $r = 1 ] && echo --sass) --out $OUT/wgrad_tiles_$r.json > $OUT/wgrad_tiles_$r.log 2>&1; echo "run $r rc=$?"
done
grep -E "sass" $OUT/wgrad_tiles_1.log | cut -c1-300
