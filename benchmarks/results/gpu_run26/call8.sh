#!/usr/bin/env bash
# gpu_run26 call 8: 8 stacked layers at 16384 tokens, new (the large-group wgrad tile with 4
# stages) / old (0e61a25: 3 stages, ab_old/), alternating; CUDA wgrad tests.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=$OUT
LRMOE_TEST_CUDA=1 timeout 100 python3 -m pytest -q -p no:cacheprovider -W ignore -k "grouped_wgrad" tests/test_triton_kernels.py 2>&1 | tail -1
for run in e128_new e128_old e128_new2 e128_old2 e16_new e16_old; do
  e=${run%%_*}; e=${e#e}; tag=${run#*_}
  d=$P; [ ${tag%2} = old ] && d=$P/ab_old
  (cd $d && PYTHONPATH=$P/.site:$d timeout 100 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens 16384 --keep 1.0 0.75 0.5 --out $W/model_s4_$run.json > $W/model_s4_$run.log 2>&1); echo "model $run rc=$?"; tail -4 $W/model_s4_$run.log | cut -c1-150
done
