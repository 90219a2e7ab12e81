#!/usr/bin/env bash
# gpu_run36 call 2 (issue 37): why LRMoE gains less in training than in stacked layers under
# Megatron's MoE-layer recompute (gpu_run33: keep 0.5's MoE time 0.971x stock+moe's in the
# 24-layer proxy's search, 0.820x in model_bench's stacked layers at the same shapes). The
# 24-layer proxy of benchmarks/memory_bound.py, one arm at a time (ARMS, default "stock+moe
# k0.5+moe"), 14 iterations on an 80 GB card (an H100 as it is, a larger card emulating one),
# Megatron's PyTorch profiler on steps 10-12; benchmarks/trace_summary.py puts the traces side
# by side (per step: GPU busy and idle, the MoE function's forward and backward, kernels).
#   bash benchmarks/results/gpu_run36/call2.sh      (from the repository root, .snap and .whl carried)
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
LIMIT=$(python3 -c 'import torch; t = torch.cuda.get_device_properties(0).total_memory / 2**30; print("--cap-gib 0" if t < 80 else "--gpu-gib 79.18")')
W=/tmp/run36p; rm -rf $W; mkdir -p $W
traces=(); names=()
for ARM in ${ARMS:-stock+moe k0.5+moe}; do
  S=${ARM//+/_with_}
  prof="--profile --use-pytorch-profiler --profile-step-start 10 --profile-step-end 12 --tensorboard-dir $W/prof_$S/tb"
  timeout 240 python3 benchmarks/memory_bound.py search --out $W/mb_$S $LIMIT --layers 24 --arms $ARM --search-iters 14 \
    --megatron-args "$prof" --timeout-s 230 > $W/search_$S.out 2>&1; echo "$ARM rc=$? $(tail -1 $W/search_$S.out | cut -c1-300)" | tee -a $OUT/run.log
  traces+=("$W/prof_$S/torch_profile/rank-0.json.gz"); names+=("$S")
done
ls -la $W/prof_*/torch_profile | tee -a $OUT/run.log
tar czf $OUT/logs.tgz -C $W $(cd $W && ls -d mb_* search_*.out)
timeout 200 python3 benchmarks/trace_summary.py "${traces[@]}" --names "${names[@]}" --top 60 --out $OUT/trace_summary.json > $OUT/trace_summary.txt 2>&1
echo "trace_summary rc=$?" | tee -a $OUT/run.log; head -c 6000 $OUT/trace_summary.txt
