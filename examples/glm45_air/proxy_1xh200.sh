#!/usr/bin/env bash
# GLM-4.5-Air proxy for ONE H200: the real MoE layer shape (hidden 4096, 128 experts, top-8,
# expert FFN 1408, one shared expert, sigmoid router with expert bias, attention 96/8 heads with
# QKV bias) in 2 layers (1 dense + 1 MoE) plus the MTP layer (an MoE layer too), full activation
# recomputation. EP1, sequence 4096, micro-batch 1, global batch 4, bf16, --transformer-impl local.
#
# Sized from the parameter count (about 6 B parameters, 18 bytes each with Adam and fp32 main
# weights and grads: ~110 GB, plus recomputed activations) to fit 141 GB. NOT RUN yet: the
# session that wrote it had no device time left (docs/benchmarks.md). Two of these, one per GPU,
# compare stock and LRMoE side by side on a 2 x H200 host (as benchmarks/train_compare.sh does
# for Qwen3):
#   CUDA_VISIBLE_DEVICES=0 LRMOE=0 bash examples/glm45_air/proxy_1xh200.sh --moe-layer-timing &
#   CUDA_VISIBLE_DEVICES=1 MASTER_PORT=29514 KEEP_RATIO=0.5 \
#     bash examples/glm45_air/proxy_1xh200.sh --moe-layer-timing
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUS_PER_NODE=1 NNODES=1 NODE_RANK=0 NUM_LAYERS=${NUM_LAYERS:-2} TP=1 PP=1 EP=1
export SEQ_LENGTH=4096 MBS=1 GBS=${GBS:-4} TRANSFORMER_IMPL=local
export MASTER_PORT=${MASTER_PORT:-29513}
export TRAIN_ITERS=${TRAIN_ITERS:-100} LR=${LR:-5e-4} MIN_LR=${MIN_LR:-5e-5}
export WARMUP_ITERS=${WARMUP_ITERS:-20} EVAL_INTERVAL=${EVAL_INTERVAL:-50} EVAL_ITERS=${EVAL_ITERS:-4}
if [ -z "${DATA_PREFIX+x}" ] && [ -f "$ROOT/.data/pystdlib_bytes.bin" ]; then
    export DATA_PREFIX="$ROOT/.data/pystdlib_bytes"
fi
exec bash "$HERE/pretrain.sh" --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1 "$@"
