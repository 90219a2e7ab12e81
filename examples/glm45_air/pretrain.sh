#!/usr/bin/env bash
# GLM-4.5-Air (106B-A12B) pretraining with pretrain_lrmoe.py (megatron-core 0.19), LRMoE on.
#
# Architecture (zai-org/GLM-4.5-Air config.json): 46 layers, the first dense (FFN 10944), 45 MoE;
# hidden 4096; 96 query heads, 8 KV heads, head dim 128, QKV bias, no QK norm; RMSNorm eps 1e-5;
# RoPE base 1e6 on half of each head (partial_rotary_factor 0.5); 128 routed experts, top-8,
# expert FFN 1408, one shared expert of FFN 1408; sigmoid router with expert-score correction
# bias, normalised top-k, routed_scaling_factor 1.0 (GLM-4.5 355B uses 2.5); sequence-level
# aux-loss 1e-3; SwiGLU; untied embeddings; vocabulary 151552; one MTP layer, loss scale 0.3.
# The router's expert bias is updated at Megatron's default rate (aux-loss-free balancing, as
# in pretraining; Megatron-Bridge's fine-tuning recipe sets the rate to 0).
#
# Default layout: 32 GPUs (NNODES=4 x 8), TP1 PP4 EP8 ETP1 -> DP8, expert-DP 1, layers per
# pipeline stage 11/12/12/11 (the MTP layer and the output layer sit on the last stage);
# sequence 4096, micro-batch 1, global batch 512, bf16, distributed optimizer.
#
# Run on every node (torchrun), from anywhere:
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=host0 DATA_PREFIX=/data/glm_text_document \
#     TOKENIZER_MODEL=zai-org/GLM-4.5-Air bash examples/glm45_air/pretrain.sh [extra flags]
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
#   GPUS_PER_NODE (8) NNODES (4) NODE_RANK (0) MASTER_ADDR (127.0.0.1) MASTER_PORT (6000)
#   NUM_LAYERS (46) TP (1) PP (4) EP (8) SEQ_LENGTH (4096) MBS (1) GBS (512)
#   PP_FIRST (11) PP_LAST (11)   decoder layers on the first / last pipeline stage (PP > 1)
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
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_LAYERS=${NUM_LAYERS:-46}
TP=${TP:-1}
PP=${PP:-4}
EP=${EP:-8}
PP_FIRST=${PP_FIRST:-11}
PP_LAST=${PP_LAST:-11}
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
    --hidden-size 4096
    --ffn-hidden-size 10944
    --num-attention-heads 96
    --group-query-attention --num-query-groups 8
    --kv-channels 128
    --add-qkv-bias
    --normalization RMSNorm --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope --rotary-base 1000000 --rotary-percent 0.5
    --untie-embeddings-and-output-weights
    --max-position-embeddings 131072
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
    --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
)
MOE_ARGS=(
    --num-experts 128
    --moe-layer-freq "([0]*1+[1]*$((NUM_LAYERS - 1)))"
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 1408 --moe-shared-expert-overlap
    --moe-router-topk 8
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-topk-scaling-factor 1.0
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3
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
if [ "$PP" -gt 1 ]; then
    PARALLEL_ARGS+=(--decoder-first-pipeline-num-layers "$PP_FIRST"
                    --decoder-last-pipeline-num-layers "$PP_LAST")
fi
VOCAB_SIZE=151552
source "$ROOT/examples/launch_common.sh"
