#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining with pretrain_lrmoe.py (megatron-core 0.19), LRMoE on by default.
#
# Architecture (Qwen/Qwen3-30B-A3B config.json): 48 layers, all MoE; hidden 2048; 32 query heads,
# 4 KV heads, head dim 128, QK RMSNorm; RMSNorm eps 1e-6; RoPE base 1e6 on the full head;
# 128 routed experts, top-8, expert FFN 768, SwiGLU, softmax router with normalised top-k
# (norm_topk_prob), router aux-loss 1e-3; no biases; untied embeddings; vocabulary 151936.
#
# Default layout: 16 GPUs (NNODES=2 x 8), TP1 PP1 EP8 ETP1 -> DP16, expert-DP 2; sequence 4096,
# micro-batch 1, global batch 512 (2M tokens), bf16, distributed optimizer. H200 (141 GB) sized:
# 8 GPUs (NNODES=1) also fit at EP8 (expert-DP 1); on 80 GB GPUs use PP2.
#
# Run on every node (torchrun), from anywhere:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 DATA_PREFIX=/data/qwen_text_document \
#     TOKENIZER_MODEL=Qwen/Qwen3-30B-A3B bash examples/qwen3_30b_a3b/pretrain.sh [extra flags]
#
# Environment (default):
#   LRMOE (1)            1: --lrmoe with the flags below; 0: stock Megatron MoE layers
#   KEEP_RATIO (0.5) SELECTION (sample) SCOPE (local) ACTIVATION_MODE (save)   --lrmoe-* values
#   VARIANCE_TARGET ()   with KEEP_RATIO=auto: --lrmoe-variance-target (e.g. 0.1)
#   DATA_PREFIX ()       indexed dataset prefix; empty: --mock-data
#   TOKENIZER_MODEL ()   HF tokenizer (must match DATA_PREFIX); empty: NullTokenizer with EOD 256
#                        (byte-level data from examples/make_indexed_dataset.py, or mock data)
#   TRANSFORMER_IMPL (transformer_engine)   local: no TE/apex (adds the no-fusion flags)
#   LRMOE_GRAD_FUSION (on)   local only: --lrmoe-grad-accumulation-fusion (the experts add into
#                        main_grad themselves; with TE, Megatron's --gradient-accumulation-fusion decides)
#   GPUS_PER_NODE (8) NNODES (2) NODE_RANK (0) MASTER_ADDR (127.0.0.1) MASTER_PORT (6000)
#   NUM_LAYERS (48) TP (1) PP (1) EP (8) SEQ_LENGTH (4096) MBS (1) GBS (512)
#   TRAIN_ITERS (20000) LR (3e-4) MIN_LR (3e-5) WARMUP_ITERS (500) SEED (1234)
#   EVAL_INTERVAL (1000) EVAL_ITERS (10) LOG_INTERVAL (1) CKPT_DIR () DATA_CACHE (/tmp/lrmoe_data_cache)
#   MEMORY_CAP_GIB ()    cap each process's PyTorch allocator at this many GiB (--memory-cap-gib;
#                        what the process holds outside the allocator is not counted)
#   GPU_MEMORY_GIB ()    emulate a card of this many GiB whole (--gpu-memory-gib; 79.18 for an
#                        H100 80GB): the rest of the GPU is held outside PyTorch
#   PYTHON (python3)     DRY_RUN (0): 1 prints the pretrain_lrmoe.py arguments, one per line
#   CUDA_DEVICE_MAX_CONNECTIONS (1 when TP > 1, as Megatron requires before Blackwell)
#   ENTRY (pretrain_lrmoe.py)   the script torchrun runs; megatron_lrmoe/testing/cpu_pretrain.py
#                        runs it on CPU (tiny sizes as extra flags; tests/test_glm_proxy_cpu.py)
# Extra command-line arguments are appended (a later flag overrides an earlier one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

LRMOE=${LRMOE:-1}
KEEP_RATIO=${KEEP_RATIO:-0.5}
SELECTION=${SELECTION:-sample}
SCOPE=${SCOPE:-local}
ACTIVATION_MODE=${ACTIVATION_MODE:-save}
DATA_PREFIX=${DATA_PREFIX:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-}
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-transformer_engine}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_LAYERS=${NUM_LAYERS:-48}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-8}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MBS=${MBS:-1}
GBS=${GBS:-512}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
WARMUP_ITERS=${WARMUP_ITERS:-500}
SEED=${SEED:-1234}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-1}
CKPT_DIR=${CKPT_DIR:-}
DATA_CACHE=${DATA_CACHE:-/tmp/lrmoe_data_cache}
PYTHON=${PYTHON:-python3}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
    --group-query-attention --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --normalization RMSNorm --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
    --untie-embeddings-and-output-weights
    --max-position-embeddings 40960
    --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
)
MOE_ARGS=(
    --num-experts 128
    --moe-layer-freq 1
    --moe-ffn-hidden-size 768
    --moe-router-topk 8
    --moe-router-score-function softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi
VOCAB_SIZE=151936
source "$ROOT/examples/launch_common.sh"
