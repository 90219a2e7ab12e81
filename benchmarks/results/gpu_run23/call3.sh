#!/usr/bin/env bash
# gpu_run23 call 3: the CUDA tests, the selection bench (exactness with adversarial scores,
# time) at 128 experts / 16384 tokens, host traces at 4096 tokens (128 and 16 experts), 8
# stacked layers at 16 experts / 8192 tokens new / old (old = ab_old/).
# Run from the repository root after the install line of ../shared/GPU.md; W = output folder.
W=${W:?}; mkdir -p $W; P=$PWD
LRMOE_TEST_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py tests/test_triton_kernels.py tests/test_pair_plan_kernels.py tests/test_ops.py tests/test_cuda_graphs.py tests/test_backward_graph.py > $W/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; tail -1 $W/cuda_tests.log
timeout 150 python3 benchmarks/select_bench.py --experts 128 --tokens 16384 --out $W/sel_e128_t16384.json > $W/sel_e128_t16384.log 2>&1; echo "select_bench rc=$?"; grep -E "FAIL|budget|failure" $W/sel_e128_t16384.log | cut -c1-200
for e in 128 16; do
  timeout 100 torchrun --nproc_per_node=1 benchmarks/host_trace.py --main-grad --experts $e --tokens 4096 --keep 0.5 --iters 10 --profiled 1 --gap-us 0 --rows 4 --kernel-rows 40 --trace-dir /tmp/tr --out /tmp/ht > $W/host_e${e}_t4096.log 2>&1; echo "host_trace $e rc=$?"; grep -E "_merge_rank|_tile_sort|radix|DeviceRadix" $W/host_e${e}_t4096.log | head -4
done
for tag in new old; do
  d=$P; [ $tag = old ] && d=$P/ab_old
  (cd $d && PYTHONPATH=$P/.site:$d timeout 100 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 16 --tokens 8192 --keep 1.0 0.5 --out $W/model16_$tag.json > $W/model16_$tag.log 2>&1); echo "model16 $tag rc=$?"; tail -3 $W/model16_$tag.log
done
