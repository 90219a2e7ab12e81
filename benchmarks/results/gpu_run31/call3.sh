#!/usr/bin/env bash
# gpu_run31 call 3 (run as one command line): call 2 found the stacked forward at 128 experts and
# 4096 tokens at 1.40-1.50x keep 1.0's for keep < 1 (host-bound). model_bench runs each keep ratio's
# rounds one after the other, keep 1.0 first: alternate the order to tell the keep ratio from its
# place in the run; then host_trace.py's per-stage host times of one layer (keep 1.0 vs 0.5).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh
for run in "h1:0.5 1.0" "h2:1.0 0.5" "h3:0.5 1.0" "h4:1.0 0.5"; do
  tag=${run%%:*}; keeps=${run#*:}
  timeout 100 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 4096 --keep $keeps --out $OUT/model_$tag.json > $OUT/model_$tag.log 2>&1; echo "model $tag ($keeps) rc=$?"; grep -E "^  keep" $OUT/model_$tag.log | cut -c1-100
done
timeout 150 torchrun --nproc_per_node=1 benchmarks/host_trace.py --main-grad --experts 128 --tokens 4096 --keep 1.0 0.5 --iters 10 --profiled 1 --gap-us 0 --rows 4 --kernel-rows 20 --trace-dir /tmp/tr --out /tmp/ht > $OUT/host_e128_t4096.log 2>&1; echo "host_trace rc=$?"; grep -E "=====|host us per call" $OUT/host_e128_t4096.log | cut -c1-600
