#!/usr/bin/env bash
# gpu_run25 call 4 (code f707273): what the first calls cost per keep ratio from a cold and a
# warm private Triton cache (benchmarks/first_call.py; 4 layers of 128 experts at 16384 tokens,
# the training proxy's MoE layers), and the backward's kernels at 16 experts and 16384 tokens,
# keep 1.0 against keep 0.75 (host_trace.py; where keep 0.75 is furthest above what its GEMMs
# allow, section 21). Run from the repository root after the install line; W = output folder.
W=${W:?}; mkdir -p $W
timeout 330 python3 benchmarks/first_call.py --experts 128 --tokens 16384 --layers 4 --keep 1.0 0.5 0.25 --calls 5 --out $W/first_call.json > $W/first_call.log 2>&1; echo "first_call rc=$?"; grep -E "^keep" $W/first_call.log
timeout 100 torchrun --nproc_per_node=1 benchmarks/host_trace.py --main-grad --experts 16 --tokens 16384 --keep 1.0 0.75 --iters 10 --profiled 1 --gap-us 0 --rows 4 --kernel-rows 40 --trace-dir /tmp/tr --out /tmp/ht > $W/host_e16_t16384.log 2>&1; echo "host_trace rc=$?"; grep -E "=====|GPU busy" $W/host_e16_t16384.log
