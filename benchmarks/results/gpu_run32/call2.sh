#!/usr/bin/env bash
# gpu_run32 call 2 (run as one command line): call 1 again with the op's backward by kind of kernel
# in the tooling (trace_summary.KINDS, model_bench's op_bwd_by_kind_ms), and `topk` at 16 experts.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh | tee $OUT/run.log
for run in e16_t16384 e128_t16384 e16_t4096 e16_t16384_topk; do
  e=${run#e}; e=${e%%_*}; t=${run#*_t}; t=${t%%_*}; sel=sample; [ "${run##*_}" = topk ] && sel=topk
  timeout 170 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts $e --tokens $t --keep 1.0 0.75 0.5 0.25 --selection $sel --profile /tmp/prof_$run --out $OUT/model_$run.json >> $OUT/run.log 2>&1; echo "model $run rc=$?" | tee -a $OUT/run.log
done
grep -E "^  (keep|floor)|^    op bwd|rc=" $OUT/run.log | cut -c1-300
