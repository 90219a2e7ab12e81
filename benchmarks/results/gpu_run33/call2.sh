#!/usr/bin/env bash
# gpu_run33 call 2 (one H200; from a `git archive` of the commit in .snap/): memory_bound.py's
# search under a 78 GiB cap (an 80 GB card), 24 layers of the EP-8-share proxy, 10 iterations per
# arm (call 1's search stopped at Megatron's warm-up check: warm-up 30 > 10 iterations).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; bash benchmarks/tree_hash.sh | tee -a $OUT/run.log
timeout 560 python3 benchmarks/memory_bound.py search --out /tmp/mb --cap-gib 78 --layers 24 --search-iters 10 --timeout-s 100 --arms stock stock+moe k0.5+moe k0.25+moe stock-mbs8 stock+full k0.5-recompute stock-mbs8+moe >> $OUT/run.log 2>&1; echo "search rc=$?" | tee -a $OUT/run.log
cp /tmp/mb/search.json $OUT/ ; tar czf $OUT/search_logs.tgz -C /tmp/mb .
python3 -c "
import json; r=json.load(open('/tmp/mb/search.json'))
for a in r['arms']: print(a['arm']['name'], a['fits'], a['oom'], a['iterations'], a['max_allocated_gib'], a['iter_ms'], a['moe_ms'], a['first_iteration_s'])
print(r['picks'])"
