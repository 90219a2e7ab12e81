#!/usr/bin/env bash
# gpu_run34 call 2: where the evaluation's time goes. Call 1: one evaluation of the fixed
# validation set (38 forward micro-batches of 32 sequences) did not finish within ~140 s under
# either allocator setting, with no allocator retries. Here the same 6-iteration run prints the
# training process's main-thread Python stack every 10 s (a daemon thread started by a
# sitecustomize on PYTHONPATH; a first try with faulthandler.dump_traceback_later crashed the
# process with SIGSEGV during start-up) and logs torch.compile recompilations
# (TORCH_LOGS=recompiles).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl || exit
mkdir -p /tmp/sc && cat > /tmp/sc/sitecustomize.py <<'PY'
import os, sys, threading, time, traceback
if sys.argv and sys.argv[0].endswith("pretrain_lrmoe.py"):
    main = threading.main_thread().ident
    def sample():
        while True:
            time.sleep(10)
            frame = sys._current_frames().get(main)
            if frame is not None:
                stack = "".join(traceback.format_stack(frame)[-14:])
                sys.stderr.write(f"STACK {time.strftime('%H:%M:%S')}\n{stack}ENDSTACK\n")
    threading.Thread(target=sample, daemon=True).start()
PY
export PYTHONPATH=/tmp/sc:$P/.site:$P
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
cat COMMIT | tee $OUT/run.log
timeout 150 python3 benchmarks/memory_bound.py converge --out /tmp/diag --cap-gib 78 --layers 24 --iters 6 --evaluations 2 --seeds 1234 --arms stock+moe --timeout-s 140 >> $OUT/run.log 2>&1; echo "diag rc=$?" | tee -a $OUT/run.log
cp /tmp/diag/converge/*.log $OUT/diag_stacks.log
grep -nE "Recompil|recompil|validation (spread|loss)|iteration +[0-9]+/ +6 \| cons" $OUT/diag_stacks.log | cut -c1-200 | head -40
