#!/usr/bin/env bash
# gpu_run34 call 13 (call12.sh cut to fit 685 s of device time left): what fits a real 80 GB card, with activation_mode "lean" (a774ec6: the
# activation, F per pair, kept instead of recompute's expert output z, H per pair). Call 10 (an
# H100 80GB, k0.5-recompute seed 4321, 78 GiB cap) ran out of memory in iteration 2 with 69.6 GiB
# allocated, 6.0 reserved and 3.6 GiB outside PyTorch's allocator. Here 10 iterations per arm on
# an H100 80GB as it is (no cap), or on a larger card emulating one whole (--gpu-memory-gib
# 79.18: the rest held outside PyTorch); all with expandable segments (call 7: stock+moe's time
# with them within 0.6 % of the default allocator's). First the CUDA tests of lean and of the
# emulation.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
LRMOE_TEST_CUDA=1 timeout 80 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_memory_bound.py tests/test_layer.py -k "gpu_memory or cuda_lean" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?" | tee -a $OUT/run.log; tail -3 $OUT/cuda_tests.log | tee -a $OUT/run.log
LIMIT=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print("--cap-gib 0" if t < 80 else "--gpu-gib 79.18")')
echo "memory: $LIMIT" | tee -a $OUT/run.log
timeout 300 python3 benchmarks/memory_bound.py search --out /tmp/mb $LIMIT --layers 24 --search-iters 10 --timeout-s 100 --arms k0.5-lean stock+moe k0.5-recompute >> $OUT/run.log 2>&1; echo "search rc=$?" | tee -a $OUT/run.log
cp /tmp/mb/search.json $OUT/ ; tar czf $OUT/search_logs.tgz -C /tmp/mb search
python3 -c "
import json; r=json.load(open('/tmp/mb/search.json'))
for a in r['arms']: print(a['arm']['name'], a['fits'], a['oom'], a['iterations'], a['max_allocated_gib'], a['iter_ms'], a['moe_ms'], a['first_iteration_s'], a.get('oom_memory'))
print(r['picks'])"
