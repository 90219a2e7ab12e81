#!/usr/bin/env bash
# gpu_run26 call 3: 8 stacked layers at 16384 tokens, new (atomic-epilogue tiles) / old
# (d058b72: the load-add-store tiles, from a git archive copy in ab_old/) / new again.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT
for run in e128_new e128_old e128_new2 e16_new e16_old; do
  e=${run%%_*}; e=${e#e}; tag=${run#*_}
  d=$P; [ $tag = old ] && d=$P/ab_old
  (cd $d && PYTHONPATH=$P/.site:$d timeout 110 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens 16384 --keep 1.0 0.75 0.5 --out $W/model_$run.json > $W/model_$run.log 2>&1); echo "model $run rc=$?"; tail -4 $W/model_$run.log | cut -c1-160
done
