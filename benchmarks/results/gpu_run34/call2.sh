#!/usr/bin/env bash
# gpu_run34 call 2: where the evaluation's time goes. Call 1: one evaluation of the fixed
# validation set (38 forward micro-batches of 32 sequences) did not finish within ~140 s under
# either allocator setting, with no allocator retries. Here the same 6-iteration run dumps every
# thread's Python stack every 15 s (faulthandler, from a sitecustomize on PYTHONPATH) and logs
# torch.compile recompilations (TORCH_LOGS=recompiles).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl || exit
mkdir -p /tmp/sc && printf 'import faulthandler, sys\nfaulthandler.dump_traceback_later(15, repeat=True, file=sys.stderr)\n' > /tmp/sc/sitecustomize.py
export PYTHONPATH=/tmp/sc:$P/.site:$P
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
cat COMMIT | tee $OUT/run.log
timeout 200 python3 benchmarks/memory_bound.py converge --out /tmp/diag --cap-gib 78 --layers 24 --iters 6 --evaluations 2 --seeds 1234 --arms stock+moe --timeout-s 190 >> $OUT/run.log 2>&1; echo "diag rc=$?" | tee -a $OUT/run.log
cp /tmp/diag/converge/*.log $OUT/diag_stacks.log
grep -nE "Recompil|recompil|validation (spread|loss)|iteration +[0-9]+/ +6 \| cons" $OUT/diag_stacks.log | cut -c1-200 | head -40
