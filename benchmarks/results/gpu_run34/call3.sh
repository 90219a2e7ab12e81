#!/usr/bin/env bash
# gpu_run34 call 3 and on: the protocol's runs with the full-validation sampler fixed (4980338):
# one arm and seed (ARM, default the baseline stock+moe; SEED, default 1234), 300 iterations,
# 4 evaluations of the fixed validation set (about 1200 sequences in micro-batches of 32) under
# the 78 GiB cap. The first call checks the evaluation's cost end to end on the GPU.
# Planned, one call each: stock+moe, k0.5-recompute, auto0.1-recompute-mem0.5 at seed 1234, then seeds
# 4321 and 2024 (ARM=k0.5-recompute SEED=4321 bash benchmarks/results/gpu_run34/call3.sh).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log
timeout 540 python3 benchmarks/memory_bound.py converge --out $OUT/mb --cap-gib 78 --layers 24 --iters 300 --evaluations 4 --seeds ${SEED:-1234} --arms ${ARM:-stock+moe} --timeout-s 530 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
grep -E "validation (spread|loss)|memory_bound: exit" $OUT/mb/converge/*.log | cut -c1-200
python3 benchmarks/train_logs.py $OUT/mb/converge/*.log | grep -E "eval_s|iter_ms|moe_ms|final|finished|alloc"
