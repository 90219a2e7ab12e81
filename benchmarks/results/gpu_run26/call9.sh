#!/usr/bin/env bash
# gpu_run26 call 9 (the final wgrad tiles): Qwen3 proxy training, 16384 tokens per micro-batch,
# seed 1234, keep 0.5 `sample` then keep 1.0, 300 iterations each (a fresh machine: run A
# compiles the Triton kernels, run B finds them).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
A_KEEP=0.5 B_KEEP=1.0 A_ENV="SEED=1234" B_ENV="SEED=1234" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=190 bash benchmarks/train_compare.sh $OUT/train > $OUT/train_compare.log 2>&1; echo "train rc=$?"
python3 benchmarks/report.py $OUT/train 2>&1 | tee $OUT/report.txt | tail -6
