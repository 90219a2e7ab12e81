#!/usr/bin/env bash
# gpu_run35 call 1 (issue 37, an H200 asked for): what the replay still lacked from the GPU.
# 1. The CUDA test of lean after its review mend (348590c: the forward's activation kept, not
#    recomputed; call 13 ran the code before it).
# 2. The replay's GEMM table measured by benchmarks/gemm_table.py (forward, dgrad, wgrad; up to
#    32768 rows per expert) at the Qwen3-30B-A3B expert shape, and at GLM-4.5-Air's (to 8192).
# 3. Routing traces recorded on the GPU in real training on real text, with the MoE-layer times of
#    the same runs (--moe-layer-timing): the Qwen3 proxy of benchmarks/train_compare.sh (4 layers,
#    128 experts, 16384 tokens per micro-batch) at keep 1.0 and keep 0.5, 100 iterations each,
#    and the GLM-4.5-Air proxy of benchmarks/glm_compare.sh (1 MoE + 1 MTP layer, keep 0.5, 30
#    iterations; about 130 GiB: H200 only).
# Everything under $OUT (8 files at most come back: the traces and logs travel as tarballs).
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
W=/tmp/run35; rm -rf $W; mkdir -p $W/logs  # a warm machine keeps /tmp (call 5)
LRMOE_TEST_CUDA=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_layer.py -k "cuda_lean" > $W/logs/cuda_tests.log 2>&1; echo "cuda tests rc=$?" | tee -a $OUT/run.log; tail -2 $W/logs/cuda_tests.log | tee -a $OUT/run.log
timeout 120 python3 benchmarks/gemm_table.py --out $OUT/gemm_table_qwen3.json > $W/logs/gemm_qwen3.log 2>&1; echo "gemm qwen3 rc=$?" | tee -a $OUT/run.log
BIG=$(python3 -c 'import torch; print(1 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 0)')
timeout 90 python3 benchmarks/gemm_table.py --hidden 4096 --ffn 1408 --rows 64 128 256 512 1024 2048 4096 8192 --out $OUT/gemm_table_glm45air.json > $W/logs/gemm_glm.log 2>&1; echo "gemm glm rc=$?" | tee -a $OUT/run.log
# An H100 80GB runs out of memory at 16384 tokens per micro-batch (call 4): two of 8192 there.
MBS=$([ "$BIG" = 1 ] && echo 4 || echo 2); echo "qwen3 micro-batch: $MBS x 4096 tokens" | tee -a $OUT/run.log
for K in 1.0 0.5; do
  TRAIN_ITERS=100 MBS=$MBS GBS=4 TIMEOUT_S=150 A_KEEP=$K B_KEEP=none A_FLAGS="--lrmoe-trace-dir $W/trace_qwen3_keep$K" \
    bash benchmarks/train_compare.sh $W/logs; echo "qwen3 keep $K: $(tail -1 $W/logs/train_keep$K.log)" | tee -a $OUT/run.log
done
if [ "$BIG" = 1 ]; then
  RUNS=lrmoe TRAIN_ITERS=30 EVAL_INTERVAL=30 TIMEOUT_S=150 EXTRA_ARGS="--lrmoe-trace-dir $W/trace_glm45air_keep0.5" \
    bash benchmarks/glm_compare.sh $W/glm > $W/logs/glm_compare.out 2>&1; echo "glm rc=$?" | tee -a $OUT/run.log
else
  echo "glm: skipped (card under 100 GiB; the proxy needs about 130)" | tee -a $OUT/run.log
fi
python3 benchmarks/train_logs.py $W/logs/train_keep*.log > $OUT/train_logs.json 2>&1; echo "train_logs rc=$?" | tee -a $OUT/run.log
tar czf $OUT/traces.tgz -C $W $(cd $W && ls -d trace_* 2>/dev/null)
tar czf $OUT/logs.tgz -C $W logs $(cd $W && ls -d glm 2>/dev/null)
du -sh $W/trace_* | tee -a $OUT/run.log
