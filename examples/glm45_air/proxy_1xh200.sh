#!/usr/bin/env bash
# GLM-4.5-Air proxy for ONE H200: the real MoE layer shape (hidden 4096, 128 experts, top-8,
# expert FFN 1408, one shared expert, sigmoid router with expert bias, attention 96/8 heads with
# QKV bias) in 2 layers (1 dense + 1 MoE) plus the MTP layer (an MoE layer too), full activation
# recomputation. EP1, sequence 4096, micro-batch 1, global batch 4, bf16, --transformer-impl local.
#
# Sized to fit 141 GB: 6.20 B parameters at 18 bytes each (bf16 weight, fp32 grad and main
# weight, Adam) = 104 GiB, + at most ~17 GiB of transients (benchmarks/glm_compare.sh's header
# has the arithmetic). Run on H200 by benchmarks/glm_compare.sh (docs/benchmarks.md sections 5
# and 26: 130.4 GiB allocated at most); it runs tiny on CPU in tests/test_glm_proxy_cpu.py.
# benchmarks/glm_compare.sh runs two of these side by side on a 2 x H200 host (stock on GPU 0,
# LRMoE keep 0.5 on GPU 1) and summarises them:
#   bash benchmarks/glm_compare.sh OUT_DIR
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
