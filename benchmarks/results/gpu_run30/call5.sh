#!/usr/bin/env bash
# gpu_run30 call 5 (run as one command line): call 2's two failures of the CPU suite on the GPU
# host after their fixes (the demo's quiet filters; Triton 3.6's interpreter), and the select
# kernels' interpreter tests under that host's Triton 3.6.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
bash benchmarks/tree_hash.sh; python3 -c "import triton, numpy; print('triton', triton.__version__, 'numpy', numpy.__version__)"
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_demo.py -k end_to_end tests/test_benchmarks_smoke.py -k "end_to_end or graphed_backward" > $OUT/fixed.log 2>&1; echo "fixed rc=$?"; tail -1 $OUT/fixed.log
TRITON_INTERPRET=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_select_kernels.py tests/test_pair_plan_kernels.py -k "test_interp_ and not merge_sort and not adversarial" > $OUT/interp_triton36.log 2>&1; echo "interp rc=$?"; tail -1 $OUT/interp_triton36.log
