#!/usr/bin/env bash
# gpu_run27 call 3: the fused weight gradient under skewed group sizes (call 1 found keep 0.5's
# _wgrad_kernel 20-25 % slower in training than in the uniform kernel bench, keep 1.0's not).
# Tiles: the small and large tiles config_for picks, the large one persistent, two others.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export PYTHONUNBUFFERED=1
python3 benchmarks/wgrad_bench.py --fused-only --rows 512 1024 --skew 0 1 2 --order drawn descending \
  --tiles 64,128,32,4,4,0,1 128,256,64,8,4,0,1 128,256,64,8,4,1,1 128,128,32,4,4,0,1 128,128,64,8,3,0,1 \
  --out $OUT/wgrad_skew.json 2>&1 | grep -v Warning | tee $OUT/wgrad_skew.log
