#!/usr/bin/env bash
# gpu_run30 call 2 (run as one command line): the CPU-suite failures of call 1 on the GPU host,
# with tracebacks, and the first part of the suite's durations.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh; nproc; python3 -c "import matplotlib" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -x tests/test_demo.py -k end_to_end > $OUT/demo.log 2>&1; echo "demo rc=$?"; tail -3 $OUT/demo.log
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_benchmarks_smoke.py -k graphed_backward > $OUT/host_path.log 2>&1; echo "host_path rc=$?"; tail -3 $OUT/host_path.log
timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=25 tests/test_args.py tests/test_backward_graph.py tests/test_benchmarks_smoke.py -k "not graphed_backward" > $OUT/first_files.log 2>&1; echo "first files rc=$?"; tail -30 $OUT/first_files.log
