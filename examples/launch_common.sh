# Shared tail of the example launch scripts: training, data and LRMoE arguments, then torchrun.
# Sourced (not run) by examples/*/pretrain.sh after they set MODEL_ARGS, MOE_ARGS,
# PARALLEL_ARGS, VOCAB_SIZE and the environment defaults documented in those scripts.
# ENTRY (pretrain_lrmoe.py) is the script torchrun runs: megatron_lrmoe/testing/cpu_pretrain.py
# runs the same entry point on CPU/gloo (tests/test_glm_proxy_cpu.py).
TRAIN_ARGS=(
    --seq-length "$SEQ_LENGTH"
    --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
    --bf16
    --seed "$SEED"
    --transformer-impl "$TRANSFORMER_IMPL"
    --log-interval "$LOG_INTERVAL" --log-throughput
    --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
)
if [ "$TRANSFORMER_IMPL" = local ]; then
    # Kernels that need Transformer Engine or apex.
    TRAIN_ARGS+=(--no-rope-fusion --no-gradient-accumulation-fusion --no-masked-softmax-fusion
                 --no-persist-layer-norm)
else
    TRAIN_ARGS+=(--moe-grouped-gemm)
fi
if [ -n "$CKPT_DIR" ]; then
    TRAIN_ARGS+=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --ckpt-format torch_dist)
fi
if [ -n "$DATA_PREFIX" ]; then
    DATA_ARGS=(--data-path "$DATA_PREFIX" --split 98,2,0 --data-cache-path "$DATA_CACHE"
               --num-workers 2)
else
    DATA_ARGS=(--mock-data)
fi
if [ -n "$TOKENIZER_MODEL" ]; then
    DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
                --vocab-size "$VOCAB_SIZE")
else
    DATA_ARGS+=(--tokenizer-type NullTokenizer --null-tokenizer-eod-id 256 --vocab-size "$VOCAB_SIZE")
fi
if [ -n "${MEMORY_CAP_GIB:-}" ]; then
    # Each process's GPU memory capped (PyTorch's allocator), e.g. 78 for an 80 GB card.
    TRAIN_ARGS+=(--memory-cap-gib "$MEMORY_CAP_GIB")
fi
if [ -n "${GPU_MEMORY_GIB:-}" ]; then
    # A smaller card emulated whole, e.g. 79.18 for an H100 80GB (the rest held outside PyTorch).
    TRAIN_ARGS+=(--gpu-memory-gib "$GPU_MEMORY_GIB")
fi
LRMOE_ARGS=()
if [ "$LRMOE" = 1 ]; then
    LRMOE_ARGS=(--lrmoe --lrmoe-keep-ratio "$KEEP_RATIO" --lrmoe-selection "$SELECTION"
                --lrmoe-scope "$SCOPE" --lrmoe-activation-mode "$ACTIVATION_MODE")
    if [ -n "${VARIANCE_TARGET:-}" ]; then
        # With KEEP_RATIO=auto: the relative variance the pair sample may add (e.g. 0.1).
        LRMOE_ARGS+=(--lrmoe-variance-target "$VARIANCE_TARGET")
    fi
    if [ "$TRANSFORMER_IMPL" = local ]; then
        # Megatron's own layers need apex for --gradient-accumulation-fusion; the LRMoE experts
        # add their weight gradients into main_grad without it (LRMOE_GRAD_FUSION=off: DDP adds
        # their bf16 gradients, as for stock's SequentialMLP).
        LRMOE_ARGS+=(--lrmoe-grad-accumulation-fusion "${LRMOE_GRAD_FUSION:-on}")
    fi
fi

ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
      "${DATA_ARGS[@]}" "${LRMOE_ARGS[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%s\n' "${ARGS[@]}"
    exit 0
fi
if [ "${TP:-1}" -gt 1 ]; then
    # Megatron requires it with tensor parallelism before Blackwell (validate_args asserts it),
    # so that the GPU runs the tensor-parallel communication and GEMMs in the order queued.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
fi
cd "$ROOT"
exec "$PYTHON" -m torch.distributed.run \
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "${ENTRY:-pretrain_lrmoe.py}" "${ARGS[@]}"
