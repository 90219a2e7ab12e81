#!/usr/bin/env bash
# gpu_run35 call 2 and on: the time-to-target protocol of gpu_run34 call 8 (one arm and seed: ARM,
# default stock+moe; SEED, default 4321; 300 iterations, 4 evaluations of the fixed validation
# set) on a real 80 GB card: an H100 80GB as it is (no cap), or a larger card emulating one whole
# (--gpu-gib 79.18: the rest of the device held outside PyTorch). gpu_run34 call 10 found the
# 78 GiB allocator cap of the earlier runs too loose (3.6 GiB live outside the allocator), and
# call 13 that k0.5-lean fits the real card (67.1 GiB) where k0.5-recompute does not. Every arm
# with expandable segments (call 7: stock+moe within 0.6 % of the default allocator's time).
#   ARM=k0.5-lean SEED=4321 bash benchmarks/results/gpu_run35/call2.sh
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
LIMIT=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print("--cap-gib 0" if t < 80 else "--gpu-gib 79.18")')
echo "memory: $LIMIT" | tee -a $OUT/run.log
timeout 540 python3 benchmarks/memory_bound.py converge --out $OUT/mb $LIMIT --layers 24 --iters 300 --evaluations 4 --seeds ${SEED:-4321} --arms ${ARM:-stock+moe} --timeout-s 540 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
grep -E "validation (spread|loss)|memory_bound: exit" $OUT/mb/converge/*.log | cut -c1-200
python3 benchmarks/train_logs.py $OUT/mb/converge/*.log --one --device "$(sed -n 2p $OUT/run.log)" > $OUT/summary.json 2>&1; echo "train_logs rc=$?"; head -c 1500 $OUT/summary.json
