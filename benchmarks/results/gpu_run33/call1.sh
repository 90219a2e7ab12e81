#!/usr/bin/env bash
# gpu_run33 call 1 (one H200; run from a `git archive` of the commit in .snap/, so that work in
# progress in the checkout does not travel into the measurement):
# 1. Eight stacked layers (16 experts, 16384 tokens: one GPU's share of EP 8) at keep 1.0 / 0.5 /
#    0.25, under Megatron's MoE-layer recompute and without: the MoE-layer time of LRMoE against
#    the stock arm that a memory-bound run falls back to.
# 2. memory_bound.py's search under a 78 GiB cap (an 80 GB card): 24 layers of the EP-8-share
#    proxy, 10 iterations per arm: which arms fit, their peak memory and time per iteration.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; bash benchmarks/tree_hash.sh | tee -a $OUT/run.log; nvidia-smi -L | tee -a $OUT/run.log
for r in moe none; do
  timeout 170 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 16 --tokens 16384 --keep 1.0 0.5 0.25 --recompute $r --out $OUT/model_recompute_$r.json >> $OUT/run.log 2>&1; echo "model recompute $r rc=$?" | tee -a $OUT/run.log
done
timeout 400 python3 benchmarks/memory_bound.py search --out /tmp/mb --cap-gib 78 --layers 24 --search-iters 10 --timeout-s 110 --arms stock stock+moe stock-mbs8 k0.5+moe k0.5-recompute k0.25+moe stock+full >> $OUT/run.log 2>&1; echo "search rc=$?" | tee -a $OUT/run.log
cp /tmp/mb/search.json $OUT/ ; tar czf $OUT/search_logs.tgz -C /tmp/mb .
grep -E "^  keep|recompute|rc=|\"fits\"" $OUT/run.log | cut -c1-300
