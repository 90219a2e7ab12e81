#!/usr/bin/env bash
# GLM-4.5-Air proxy for one 2 x H200 host: the real MoE layer shape (hidden 4096, 128 experts,
# top-8, expert FFN 1408, one shared expert, sigmoid router with expert bias, attention 96/8
# heads with QKV bias) in 3 layers (1 dense + 2 MoE) plus the MTP layer, full activation
# recomputation. TP1 EP2 DP2, sequence 4096, micro-batch 1, global batch 8, bf16,
# --transformer-impl local (no TE, no apex).
#
# Measured on 2 x H200 (docs/benchmarks.md): with 4 layers and no recomputation, iteration 1 ran
# (stock and LRMoE, same loss) and iteration 2 ran out of memory on one GPU for both (119 GB peak
# after iteration 1, then Adam's state). The 3-layer, recomputed default below has not been run.
#
# Runs examples/glm45_air/pretrain.sh with these overrides; every variable of that script still
# applies (LRMOE, KEEP_RATIO, SELECTION, TRAIN_ITERS, ...). Data: the byte-level indexed dataset
# .data/pystdlib_bytes (python examples/make_indexed_dataset.py --output-prefix
# .data/pystdlib_bytes) when it exists, else mock data. Examples:
#   LRMOE=0 bash examples/glm45_air/proxy_2xh200.sh                    # stock Megatron MoE
#   KEEP_RATIO=1.0 bash examples/glm45_air/proxy_2xh200.sh             # LRMoE, full backward
#   KEEP_RATIO=0.5 SELECTION=topk bash examples/glm45_air/proxy_2xh200.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

# NVLink multicast must stay off on that host.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPUS_PER_NODE=2 NNODES=1 NODE_RANK=0 NUM_LAYERS=${NUM_LAYERS:-3} TP=1 PP=1 EP=2
export SEQ_LENGTH=4096 MBS=1 GBS=8 TRANSFORMER_IMPL=local
export MASTER_PORT=${MASTER_PORT:-29512}
export TRAIN_ITERS=${TRAIN_ITERS:-200} LR=${LR:-5e-4} MIN_LR=${MIN_LR:-5e-5}
export WARMUP_ITERS=${WARMUP_ITERS:-20} EVAL_INTERVAL=${EVAL_INTERVAL:-50} EVAL_ITERS=${EVAL_ITERS:-4}
if [ -z "${DATA_PREFIX+x}" ] && [ -f "$ROOT/.data/pystdlib_bytes.bin" ]; then
    export DATA_PREFIX="$ROOT/.data/pystdlib_bytes"
fi
exec bash "$HERE/pretrain.sh" --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1 "$@"
