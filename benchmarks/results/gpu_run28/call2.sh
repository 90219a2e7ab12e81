#!/usr/bin/env bash
# gpu_run28 call 2: keep 0.5 `sample` training at seeds 4321 (call 1's run stopped at its timeout,
# iteration 288, before the last validation) and 2024, 300 iterations each, the Qwen3 proxy at
# 16384 tokens per micro-batch (keep 1.0 is deterministic across these versions: call 1 and
# sections 18 / 22 have its losses); then 8 stacked layers with skewed routing (model_bench --skew).
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
A_KEEP=0.5 B_KEEP=0.5 A_ENV="SEED=4321" B_ENV="SEED=2024" NAME_A=keep0.5_s4321 NAME_B=keep0.5_s2024 TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=215 bash benchmarks/train_compare.sh $OUT/train > $OUT/train_compare.log 2>&1; echo "train rc=$?"
python3 benchmarks/report.py $OUT/train 2>&1 | tee $OUT/report.txt | tail -4
timeout 130 torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 128 --tokens 16384 --keep 1.0 0.75 0.5 \
  --skew 1 --out $OUT/model_e128_skew1.json 2>&1 | grep -v -i warn | tail -6 | tee $OUT/model_e128_skew1.log
