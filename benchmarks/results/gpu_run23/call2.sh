#!/usr/bin/env bash
# gpu_run23 call 2: CUDA selection tests, the merge sort's tiles on seven segment sets, the
# layer's backward trace at 16384 tokens, 8 stacked layers new / old / new (old = ab_old/).
# Run from the repository root after the install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W; P=$PWD
LRMOE_TEST_CUDA=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore -k "cuda or gpu or captured" tests/test_select_kernels.py > $W/cuda_sel_tests.log 2>&1; tail -1 $W/cuda_sel_tests.log
for spec in "128 16384 1.2" "128 16384 0.3" "128 4096 1.2" "16 4096 1.2" "16 16384 0.5" "16 16384 1.5" "8 32768 1.0"; do
  set -- $spec
  timeout 100 python3 benchmarks/select_bench.py --sort-only --experts $1 --tokens $2 --zipf $3 --out $W/sort_e$1_t$2_z$3.json > $W/sort_e$1_t$2_z$3.log 2>&1
  echo "== $spec rc=$?"; grep "^sort" $W/sort_e$1_t$2_z$3.log | sed 's/sort N=//' | cut -c1-120
done
timeout 120 torchrun --nproc_per_node=1 benchmarks/host_trace.py --main-grad --experts 128 --tokens 16384 --keep 1.0 0.5 --iters 10 --profiled 1 --gap-us 0 --rows 4 --kernel-rows 40 --trace-dir /tmp/tr --out /tmp/ht > $W/host_e128_t16384.log 2>&1; echo "host_trace rc=$?"
for tag in new old new2; do
  d=$P; [ $tag = old ] && d=$P/ab_old
  (cd $d && PYTHONPATH=$P/.site:$d timeout 100 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 16384 --keep 1.0 0.5 --out $W/model_$tag.json > $W/model_$tag.log 2>&1); echo "model $tag rc=$?"; tail -4 $W/model_$tag.log
done
