#!/usr/bin/env bash
# Qwen3-30B-A3B proxy (4 layers, the real MoE layer shape) on one H200 per run, EP=1: LRMoE keep
# 1.0 and keep 0.5 `sample` side by side (one GPU each, same data, seed and schedule), real text
# (the byte-level Python standard library dataset of examples/make_indexed_dataset.py),
# --moe-layer-timing on, so each log has Megatron's iteration lines, the LRMoE line and the
# cumulative MoE-layer time.
#
#   bash benchmarks/train_compare.sh OUT_DIR       (TRAIN_ITERS, GBS, MBS, TIMEOUT_S override)
#
# MBS=4 (with GBS=4) gives 16384 tokens per micro-batch, where the trimmed backward pays in the
# layer benchmark; the default MBS=1 is 4096 tokens per micro-batch.
#
# Runs A and B default to keep 1.0 and keep 0.5; A_KEEP / B_KEEP change the keep ratios and
# A_FLAGS / B_FLAGS add flags to one run and A_ENV / B_ENV environment variables (VAR=value
# words; logs: train_<name>.log with NAME_A / NAME_B, default keep<ratio>). B_KEEP=none runs A
# alone (the keep-1.0 path is deterministic: a run of the same seed and schedule from an earlier
# commit gives the same losses, so its log can stand in for B's). Runs share the machine's
# Triton cache, so the second finds the kernels the first compiled (its first iteration is that
# much shorter); COLD_CACHE=1 gives each run an empty cache of its own, so that each pays its
# own compilation (benchmarks/first_call.py measures it alone). The cost of LRMoE's
# statistics and metrics at log interval 1:
#   A_KEEP=0.5 B_KEEP=0.5 B_FLAGS=--no-lrmoe-record-stats NAME_A=stats NAME_B=nostats \
#     bash benchmarks/train_compare.sh OUT
# The front graph against the stages launched around the replayed scoring and selection:
#   A_KEEP=0.5 B_KEEP=0.5 B_FLAGS=--no-lrmoe-front-graphs NAME_A=front NAME_B=eagerfront \
#     bash benchmarks/train_compare.sh OUT
# Two versions of the code (run B's entry script in a folder of this checkout that holds the
# other commit's package: Python puts the script's folder first on the path):
#   mkdir ab_old && git archive REV megatron_lrmoe pretrain_lrmoe.py | tar -x -C ab_old
#   A_KEEP=0.5 B_KEEP=0.5 B_ENV=ENTRY=ab_old/pretrain_lrmoe.py NAME_A=new NAME_B=old \
#     bash benchmarks/train_compare.sh OUT
#
# With two visible GPUs runs A and B go concurrently on GPU 0 and 1; with one they run one after
# the other on GPU 0 (TIMEOUT_S then bounds each run). Needs megatron-core 0.19.2 importable and
# this checkout on PYTHONPATH. Logs: OUT_DIR/train_keep1.0.log, _keep0.5.log (default names).
set -u
out="${1:?usage: train_compare.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
iters=${TRAIN_ITERS:-300}
limit=${TIMEOUT_S:-420}
if [ ! -f .data/pystdlib_bytes.bin ]; then
  python3 examples/make_indexed_dataset.py --output-prefix .data/pystdlib_bytes \
    --max-bytes 12000000 >"$out/dataset.log" 2>&1 || { cat "$out/dataset.log"; exit 1; }
fi
common=(GPUS_PER_NODE=1 NNODES=1 NUM_LAYERS=4 TP=1 PP=1 EP=1 SEQ_LENGTH=4096 MBS="${MBS:-1}"
        GBS="${GBS:-4}" TRANSFORMER_IMPL=local TRAIN_ITERS="$iters" LR=5e-4 MIN_LR=5e-5
        WARMUP_ITERS=20 EVAL_INTERVAL=50 EVAL_ITERS=8 LOG_INTERVAL=1
        DATA_PREFIX="$PWD/.data/pystdlib_bytes")
if [ "${COLD_CACHE:-0}" = 1 ]; then
  cache_root=$(mktemp -d /tmp/lrmoe_triton_XXXXXX)
  trap 'rm -rf "$cache_root"' EXIT
fi
run() {  # run GPU PORT KEEP LOG ENV_WORDS [FLAGS...]
  local gpu=$1 port=$2 keep=$3 log=$4 extra=$5
  shift 5
  local cache=()
  if [ -n "${cache_root:-}" ]; then  # an empty Triton cache of this run's own
    cache=(TRITON_CACHE_DIR="$cache_root/$(basename "$log" .log)")
  fi
  # shellcheck disable=SC2086  # the VAR=value words are meant to split
  env "${common[@]}" "${cache[@]}" $extra CUDA_VISIBLE_DEVICES="$gpu" MASTER_PORT="$port" KEEP_RATIO="$keep" \
    DATA_CACHE="/tmp/lrmoe_data_cache_$gpu" \
    timeout "$limit" bash examples/qwen3_30b_a3b/pretrain.sh --moe-layer-timing "$@" \
    >"$log" 2>&1
  echo "exit $? ($keep)" >>"$log"
}
a_keep=${A_KEEP:-1.0}
b_keep=${B_KEEP:-0.5}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$b_keep" = none ]; then
  # shellcheck disable=SC2086  # the flags are meant to split
  run 0 29611 "$a_keep" "$out/train_${NAME_A:-keep$a_keep}.log" "${A_ENV:-}" ${A_FLAGS:-}
elif [ "${gpus:-0}" -ge 2 ]; then
  # shellcheck disable=SC2086  # the flags are meant to split
  run 0 29611 "$a_keep" "$out/train_${NAME_A:-keep$a_keep}.log" "${A_ENV:-}" ${A_FLAGS:-} &
  a=$!
  # shellcheck disable=SC2086
  run 1 29612 "$b_keep" "$out/train_${NAME_B:-keep$b_keep}.log" "${B_ENV:-}" ${B_FLAGS:-} &
  b=$!
  wait $a $b
else
  echo "one GPU visible: run A, then run B, on GPU 0"
  # shellcheck disable=SC2086
  run 0 29611 "$a_keep" "$out/train_${NAME_A:-keep$a_keep}.log" "${A_ENV:-}" ${A_FLAGS:-}
  # shellcheck disable=SC2086
  run 0 29612 "$b_keep" "$out/train_${NAME_B:-keep$b_keep}.log" "${B_ENV:-}" ${B_FLAGS:-}
fi
for f in "$out"/train_*.log; do
  echo "== $f"; grep -E "iteration +(1|50|100|150|200|250|300)/|validation loss at|moe layers:|exit" "$f" | tail -n 30
done
