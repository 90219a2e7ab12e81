#!/usr/bin/env bash
# gpu_run27 call 1: where keep 0.5's MoE time goes in training. Qwen3 proxy, 16384 tokens per
# micro-batch, seed 1234, keep 1.0 then keep 0.5 `sample`, 40 iterations each with Megatron's
# PyTorch profiler on steps 30-33; benchmarks/trace_summary.py reads the two traces.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
prof="--profile --use-pytorch-profiler --profile-step-start 30 --profile-step-end 33"
A_KEEP=1.0 B_KEEP=0.5 A_ENV="SEED=1234" B_ENV="SEED=1234" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=150 \
  A_FLAGS="$prof --exit-interval 36 --tensorboard-dir /tmp/prof_keep1/tb" \
  B_FLAGS="$prof --exit-interval 36 --tensorboard-dir /tmp/prof_keep05/tb" \
  bash benchmarks/train_compare.sh $OUT/train > $OUT/train_compare.log 2>&1; echo "train rc=$?"
ls -la /tmp/prof_keep1/torch_profile /tmp/prof_keep05/torch_profile
for f in $OUT/train/train_keep*.log; do echo "== $f"; grep -E "iteration +(3|20|29|34|35|36)/" $f | cut -c1-250; grep -E "Error|error" $f | head -5; done
python3 benchmarks/trace_summary.py /tmp/prof_keep1/torch_profile/rank-0.json.gz /tmp/prof_keep05/torch_profile/rank-0.json.gz \
  --names keep1 keep05 --top 60 --out $OUT/trace_summary.json 2>&1 | tee $OUT/trace_summary.txt
for k in keep1 keep05; do s=$(stat -c %s /tmp/prof_$k/torch_profile/rank-0.json.gz); [ "$s" -lt 15000000 ] && cp /tmp/prof_$k/torch_profile/rank-0.json.gz $OUT/trace_$k.json.gz; done
true
