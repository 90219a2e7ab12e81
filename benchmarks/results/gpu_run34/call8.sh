#!/usr/bin/env bash
# gpu_run34 call 8 and on: as call3.sh, with the GPU named in run.log (a session may get an H100,
# whose whole memory, about 79 GiB, is the cap there: 78 GiB, or 1 GiB below the card's total).
# The protocol's runs with the full-validation sampler fixed (4980338):
# one arm and seed (ARM, default the baseline stock+moe; SEED, default 1234), 300 iterations,
# 4 evaluations of the fixed validation set (about 1200 sequences in micro-batches of 32) under
# the 78 GiB cap. The first call checks the evaluation's cost end to end on the GPU.
# Planned, one call each: stock+moe, k0.5-recompute, auto0.1-recompute-mem0.5 at seed 1234, then seeds
# 4321 and 2024 (ARM=k0.5-recompute SEED=4321 bash benchmarks/results/gpu_run34/call3.sh).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# LRMoE's arms with expandable segments as in calls 5-6 (call 4: the default allocator's
# fragmentation ran out of memory); stock's with the default allocator as in call 3 (call 7).
case ${ARM:-stock+moe} in stock*) ;; *) export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ;; esac
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
CAP=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print(min(78.0, round(t - 1, 1)))')
echo "cap $CAP GiB" | tee -a $OUT/run.log
timeout 530 python3 benchmarks/memory_bound.py converge --out $OUT/mb --cap-gib $CAP --layers 24 --iters 300 --evaluations 4 --seeds ${SEED:-1234} --arms ${ARM:-stock+moe} --timeout-s 530 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
grep -E "validation (spread|loss)|memory_bound: exit" $OUT/mb/converge/*.log | cut -c1-200
python3 benchmarks/train_logs.py $OUT/mb/converge/*.log | grep -E "eval_s|iter_ms|moe_ms|final|finished|alloc"
