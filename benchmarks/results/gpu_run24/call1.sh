#!/usr/bin/env bash
# gpu_run24 call 1: the CUDA tests on main (the merge sort's product-table test was not GPU-run),
# the sort alone with the two-row MERGE_TILES at two segment sets, the layer's backward trace at
# 128 experts / 16384 tokens, and the expert backward's tail with a second stream
# (benchmarks/overlap_bench.py). Run from the repository root after the install line of
# ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W; P=$PWD
LRMOE_TEST_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $W/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -1 $W/cuda_tests.log; grep -E "merge_sort_product|FAIL" $W/cuda_tests.log | head
timeout 200 python3 benchmarks/overlap_bench.py --experts 128 16 --tokens 4096 16384 --keep 1.0 0.5 --out $W/overlap.json > $W/overlap.log 2>&1; echo "overlap rc=$?"; grep -v Warn $W/overlap.log | tail -12
for spec in "128 16384 1.2" "16 4096 1.2"; do
  set -- $spec
  timeout 100 python3 benchmarks/select_bench.py --sort-only --experts $1 --tokens $2 --zipf $3 --out $W/sort_e$1_t$2.json > $W/sort_e$1_t$2.log 2>&1
  echo "== sort $spec rc=$?"; grep -E "^sort|picks|merge_tile" $W/sort_e$1_t$2.log | cut -c1-140 | head -8
done
timeout 120 torchrun --nproc_per_node=1 benchmarks/host_trace.py --main-grad --experts 128 --tokens 16384 --keep 1.0 0.5 --iters 10 --profiled 1 --gap-us 0 --rows 4 --kernel-rows 40 --trace-dir /tmp/tr --out /tmp/ht > $W/host_e128_t16384.log 2>&1; echo "host_trace rc=$?"; grep -E "_merge_rank|_tile_sort|RadixSort" $W/host_e128_t16384.log | head -4
