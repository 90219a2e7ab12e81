#!/usr/bin/env bash
# gpu_run33 call 4 (one H200; from a `git archive` of the commit in .snap/): the convergence pilot
# of call 3 again (its first evaluation had stopped at megatron-core 0.19.2's --full-validation
# bug, now worked around by compat.fix_full_validation), shortened to the device time left:
# stock+moe, seed 1234, 150 iterations under the 78 GiB cap, six evaluations of the fixed
# validation set. Not part of the protocol: it sizes it (evaluation cost, standard error).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log
timeout 330 python3 benchmarks/memory_bound.py converge --out $OUT/mb --cap-gib 78 --layers 24 --iters 150 --seeds 1234 --arms stock+moe --timeout-s 320 >> $OUT/run.log 2>&1; echo "converge rc=$?" | tee -a $OUT/run.log
grep -E "validation (spread|loss)|memory_bound: exit" $OUT/mb/converge/*.log | cut -c1-200
