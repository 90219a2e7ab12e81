#!/usr/bin/env bash
# gpu_run34 call 11: what fits a real 80 GB card. Call 10 (an H100 80GB, k0.5-recompute seed 4321,
# 78 GiB cap) ran out of memory in iteration 2 with 69.6 GiB allocated: the card's 79.2 GiB less
# 3.5 GiB outside PyTorch's allocator (CUDA context, NCCL, cuBLAS workspaces), which an H200 under a
# 78 GiB cap never charges. Here every arm of the time-to-target comparison and LRMoE's leaner ones,
# 10 iterations each under the same cap on whatever card comes, all with expandable segments
# (call 7: stock+moe's time with them within 0.6 % of the default allocator's).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
CAP=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print(min(78.0, round(t - 1, 1)))')
echo "cap $CAP GiB" | tee -a $OUT/run.log
timeout 540 python3 benchmarks/memory_bound.py search --out /tmp/mb --cap-gib $CAP --layers 24 --search-iters 10 --timeout-s 100 --arms stock+moe k0.5-recompute k0.25-recompute auto0.1-recompute-mem0.5 k0.5+moe k0.25+moe >> $OUT/run.log 2>&1; echo "search rc=$?" | tee -a $OUT/run.log
cp /tmp/mb/search.json $OUT/ ; tar czf $OUT/search_logs.tgz -C /tmp/mb .
grep -h "OutOfMemoryError" /tmp/mb/search/*.log 2>/dev/null | cut -c1-420
python3 -c "
import json; r=json.load(open('/tmp/mb/search.json'))
for a in r['arms']: print(a['arm']['name'], a['fits'], a['oom'], a['iterations'], a['max_allocated_gib'], a['iter_ms'], a['moe_ms'], a['first_iteration_s'])
print(r['picks'])"
