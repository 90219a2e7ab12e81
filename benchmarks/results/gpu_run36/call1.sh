#!/usr/bin/env bash
# gpu_run36 call 1 (issue 37): gpu_run35's call1.sh, which found no machine, with every result
# packed as soon as it exists (a call stopped at its limit still returns what is under $OUT) and
# each stage's wall time in run.log.
# 1. The CUDA test of lean after its review mend (348590c).
# 2. The replay's GEMM table (benchmarks/gemm_table.py: forward, dgrad, wgrad) at the
#    Qwen3-30B-A3B expert shape (64-32768 rows per expert) and at GLM-4.5-Air's (to 8192).
# 3. Routing traces recorded in real training on real text, with the same runs' MoE-layer times
#    (--moe-layer-timing): the Qwen3 proxy of benchmarks/train_compare.sh (4 layers, 128 experts,
#    16384 tokens per micro-batch; two of 8192 on a card under 100 GiB) at keep 1.0 and 0.5, 100
#    iterations each, and the GLM-4.5-Air proxy of benchmarks/glm_compare.sh (keep 0.5, 30
#    iterations; about 130 GiB: H200 only).
#   bash benchmarks/results/gpu_run36/call1.sh      (from the repository root, .snap and .whl carried)
#   STAGES="qwen3" bash ...  (a subset of: cuda gemm qwen3 glm; default all four)
cd .snap || exit
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site ../.whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cat COMMIT | tee $OUT/run.log; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/run.log
W=/tmp/run36; rm -rf $W; mkdir -p $W/logs  # a warm machine keeps /tmp
T0=$(date +%s); stage() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/run.log; }
on() { case " ${STAGES:-cuda gemm qwen3 glm} " in *" $1 "*) return 0;; esac; return 1; }
pack() { tar czf $OUT/logs.tgz -C $W logs $(cd $W && ls -d glm 2>/dev/null); }
if on cuda; then
LRMOE_TEST_CUDA=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_layer.py -k "cuda_lean" > $W/logs/cuda_tests.log 2>&1
stage "cuda tests rc=$? $(tail -1 $W/logs/cuda_tests.log)"
fi
if on gemm; then
timeout 120 python3 benchmarks/gemm_table.py --out $OUT/gemm_table_qwen3.json > $W/logs/gemm_qwen3.log 2>&1; stage "gemm qwen3 rc=$?"
timeout 90 python3 benchmarks/gemm_table.py --hidden 4096 --ffn 1408 --rows 64 128 256 512 1024 2048 4096 8192 --out $OUT/gemm_table_glm45air.json > $W/logs/gemm_glm.log 2>&1; stage "gemm glm rc=$?"
fi
pack
BIG=$(python3 -c 'import torch; print(1 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 0)')
MBS=$([ "$BIG" = 1 ] && echo 4 || echo 2); stage "qwen3 micro-batch: $MBS x 4096 tokens"
on qwen3 && for K in 1.0 0.5; do
  TRAIN_ITERS=100 MBS=$MBS GBS=4 TIMEOUT_S=150 A_KEEP=$K B_KEEP=none A_FLAGS="--lrmoe-trace-dir $W/trace_qwen3_keep$K" \
    bash benchmarks/train_compare.sh $W/logs; stage "qwen3 keep $K: $(tail -1 $W/logs/train_keep$K.log | cut -c1-160)"
  tar czf $OUT/traces_qwen3.tgz -C $W $(cd $W && ls -d trace_qwen3_* 2>/dev/null); pack
done
python3 benchmarks/train_logs.py $W/logs/train_keep*.log > $OUT/train_logs.json 2>&1; stage "train_logs rc=$?"
if ! on glm; then
  stage "glm: not asked for"
elif [ "$BIG" = 1 ]; then
  RUNS=lrmoe TRAIN_ITERS=30 EVAL_INTERVAL=30 TIMEOUT_S=150 EXTRA_ARGS="--lrmoe-trace-dir $W/trace_glm45air_keep0.5" \
    bash benchmarks/glm_compare.sh $W/glm > $W/logs/glm_compare.out 2>&1; stage "glm rc=$?"
  tar czf $OUT/trace_glm45air.tgz -C $W $(cd $W && ls -d trace_glm* 2>/dev/null); pack
else
  stage "glm: skipped (card under 100 GiB; the proxy needs about 130)"
fi
du -sh $W/trace_* | tee -a $OUT/run.log
