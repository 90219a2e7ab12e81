#!/usr/bin/env bash
# gpu_run27 call 5 (code 87f4aeb: the large tile from 512 rows): the CUDA tests of the weight
# gradient and the layer graphs, and 8 stacked layers at 128 experts and 16384 tokens (the random
# router of model_bench gives even groups, where the small tile was 3-4 % ahead at 512 rows).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
LRMOE_TEST_CUDA=1 python3 -m pytest -q -p no:cacheprovider -W ignore -k "cuda or gpu or captured or expert_graph" \
  tests/test_triton_kernels.py tests/test_backward_graph.py 2>&1 | tail -4 | tee $OUT/cuda_tests.log
torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 16384 --keep 1.0 0.5 \
  --out $OUT/model_e128.json 2>&1 | grep -v -i warn | tail -6 | tee $OUT/model_e128.log
