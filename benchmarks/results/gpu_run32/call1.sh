#!/usr/bin/env bash
# gpu_run32 call 1 (run as one command line): where the stacked backward's time goes at every keep
# ratio, measured: model_bench.py --profile splits each phase's GPU busy time into the op's and the
# rest (Megatron's router, its auxiliary loss, the residual stream), and trace_summary.py lists the
# kernels of keep 1.0 against keep 0.5 and 0.25. 8 layers; 16 and 128 experts at 16384 tokens,
# 16 experts at 4096 (host-bound: the busy time against the time shows the host's share).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh | tee $OUT/run.log
for run in e16_t16384 e128_t16384 e16_t4096; do
  e=${run#e}; e=${e%%_*}; t=${run#*_t}
  timeout 170 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens $t --keep 1.0 0.75 0.5 0.25 --profile /tmp/prof_$run --out $OUT/model_$run.json >> $OUT/run.log 2>&1; echo "model $run rc=$?" | tee -a $OUT/run.log
  for k in 0.5 0.25; do
    timeout 60 python3 benchmarks/trace_summary.py /tmp/prof_$run/trace_k1_rank0.json /tmp/prof_$run/trace_k${k}_rank0.json --names keep1 keep$k --top 30 >> $OUT/kernels_$run.txt 2>&1
  done
done
grep -E "^  (keep|floor)|rc=" $OUT/run.log | cut -c1-260
