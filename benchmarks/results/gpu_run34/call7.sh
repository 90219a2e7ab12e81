#!/usr/bin/env bash
# gpu_run34 call 7: allocator parity for the timing columns. stock+moe with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the setting k0.5-recompute needed under the cap,
# call 5), 40 iterations and one evaluation, seed 1234: its ms/iter and MoE ms/iter against
# call 3's (default allocator) say whether the allocator moves the per-iteration figures.
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat COMMIT | tee $OUT/run.log
timeout 300 python3 benchmarks/memory_bound.py converge --out $OUT/mb --cap-gib 78 --layers 24 --iters 40 --evaluations 1 --seeds 1234 --arms stock+moe --timeout-s 290 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
python3 benchmarks/train_logs.py $OUT/mb/converge/*.log | grep -E "iter_ms|moe_ms|finished|alloc|max_alloc"
