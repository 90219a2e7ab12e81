#!/usr/bin/env bash
# gpu_run35 call 3 (call1.sh cut to the device time left, on an H100): routing traces recorded in
# real training (the Qwen3 proxy of train_compare.sh, 16384 tokens per micro-batch, 60
# iterations, --moe-layer-timing) at keep 1.0, then the Qwen3 GEMM table, then keep 0.5; each
# step's output packed as it finishes.
# Call 4: MBS=2 GEMM=0 T=110 (an H100 ran out of memory in iteration 2 at 16384 tokens per
# micro-batch: 73.1 GiB allocated of 79.18; two micro-batches of 8192 tokens instead).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
W=/tmp/run35; rm -rf $W; mkdir -p $W/logs  # a warm machine keeps /tmp (call 5)
qwen() {
  TRAIN_ITERS=60 MBS=${MBS:-4} GBS=4 TIMEOUT_S=$2 A_KEEP=$1 B_KEEP=none A_FLAGS="--lrmoe-trace-dir $W/trace_qwen3_keep$1" \
    bash benchmarks/train_compare.sh $W/logs; echo "qwen3 keep $1: $(tail -1 $W/logs/train_keep$1.log)" | tee -a $OUT/run.log
  tar czf $OUT/trace_qwen3_keep$1.tgz -C $W trace_qwen3_keep$1 logs/train_keep$1.log
}
qwen 1.0 ${T:-150}
[ "${GEMM:-1}" = 1 ] && timeout 70 python3 benchmarks/gemm_table.py --out $OUT/gemm_table_qwen3.json > $W/logs/gemm_qwen3.log 2>&1; echo "gemm qwen3 rc=$?" | tee -a $OUT/run.log
qwen 0.5 ${T:-150}
