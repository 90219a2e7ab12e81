#!/usr/bin/env bash
# GLM-4.5-Air proxy: stock Megatron MoE against LRMoE keep 0.5 `sample` (issue 8, target 6).
# Both runs are examples/glm45_air/proxy_1xh200.sh on one H200 each: the real layer shapes
# (hidden 4096; attention 96 heads / 8 KV groups, head dim 128, QKV bias, RoPE on half of each
# head; 128 routed experts top-8, expert FFN 1408, one shared expert, sigmoid router with
# expert bias, vocabulary 151552 untied) in 1 dense + 1 MoE decoder layer + 1 MTP layer (MoE),
# full activation recomputation, EP 1, sequence 4096, micro-batch 1, global batch 4, bf16,
# --transformer-impl local (no TE, no apex), --moe-layer-timing; same data (byte-level Python
# standard library, examples/make_indexed_dataset.py), seed and schedule for both.
#
#   bash benchmarks/glm_compare.sh OUT_DIR
#
# 2 GPUs visible: stock on the first, LRMoE on the second, side by side, 100 iterations each.
# 1 GPU: stock, then LRMoE, 50 iterations each. Prints a summary and writes OUT_DIR/
# train_stock.log, train_keep<K>.log, summary.txt, summary.json, commit.txt (the commit and
# benchmarks/tree_hash.sh's hash of the code) (dataset.log when
# the dataset had to be written).
#
# Environment (default): GPUS (torch.cuda.device_count()), TRAIN_ITERS (100; 1 GPU: 50),
#   GBS (4), WARMUP_ITERS (20), EVAL_INTERVAL (TRAIN_ITERS / 2), EVAL_ITERS (4),
#   KEEP_RATIO (0.5), SELECTION (sample), SKIP_ITERS (10: iterations left out of the medians),
#   TIMEOUT_S (per run; 500 side by side, 250 one after the other), MASTER_PORT (29621; the
#   LRMoE run uses the next port), DATA_PREFIX
#   (.data/pystdlib_bytes, written if missing), DATA_MAX_BYTES (12000000), EXTRA_ARGS (flags
#   appended to both runs), RUNS ("stock lrmoe": on one GPU, the runs to make; a log left in
#   OUT_DIR by an earlier call, e.g. the other run's, is summarized with them), PYTHON
#   (python3), ENTRY (passed on to the launch script: the CPU test runs this script tiny with
#   ENTRY=megatron_lrmoe/testing/cpu_pretrain.py).
#
# Exit status 0 when both runs finished all iterations, else 1 (the summary is printed anyway).
#
# Expected duration on H200 (estimate, not measured). Calibration: the Qwen3 proxy of
# benchmarks/train_compare.sh (gpu_run2, same host and flags; 3.1 B parameters, 4 MoE layers of
# hidden 2048) ran LRMoE at 0.56 s/iteration, 0.13 s of it in MoE layers, ~20 s of start-up.
# Here, per micro-batch of 4096 tokens (H200: ~790 TFLOP/s bf16 matmul, ~4.3 TB/s):
#   output layer + fp32 cross-entropy, main and MTP: 2 x 6 x 4096 x 0.62 B = 30 TFLOP, ~65 ms
#   linear layers of attention and the dense MLP, forward twice (recompute) + backward:
#     8 x 4096 x (3 x 109 M + 134 M) = 15 TFLOP, ~30 ms
#   unfused attention (local impl.), 96 heads: 3 GiB bf16 score tensors read or written ~20
#     times per layer with recompute, 3 layers: ~70 ms
#   MoE layers, LRMoE: ~3.7 x the Qwen layer's expert FLOPs, ~20 ms per layer with the
#     recomputed forward, 2 layers: ~40 ms
#   MoE layers, stock SequentialMLP: a host-bound loop over 128 experts (Qwen shape in
#     gpu_run1: 57 ms forward + 66 ms backward per layer), + recomputed forward: ~190 ms per
#     layer, 2 layers: ~380 ms
#   the rest (norms, RoPE, routers, residuals, host): ~40 ms
# -> LRMoE ~0.25 s, stock ~0.6 s per micro-batch; x 4 micro-batches + the optimizer step
# (foreach AdamW over 6.2 B parameters, ~90 B of traffic each: ~0.15 s) -> LRMoE ~1.2 s/iter,
# stock ~2.5 s/iter. 100 iterations side by side: stock 250 s + ~45 s start-up (imports,
# 6.2 B-parameter init, first iteration with Triton compilation) + 3 evaluations of 16
# forward micro-batches (~10 s) = ~5 min, LRMoE ~3 min alongside: ~5 min wall in all, + ~0.5 min
# for the wheel install, the dataset and the GPU count (~6.5 min with stock 50 % slower than
# estimated). TIMEOUT_S stops a run after 500 s (stock at 4.4 s/iter would still make 100
# iterations) so that the command ends within 10 min, and the summary still reports what was
# logged. 1 GPU, 50 iterations each: ~3 + ~1.7 min.
#
# Memory (one 141 GB H200: 143,771 MiB = 140.4 GiB visible). Parameters counted from the flags
# (the same count at the tiny sizes of tests/test_glm_proxy_cpu.py, 272,576, is exactly what
# Megatron prints there):
#   attention per layer: QKV (96 + 2 x 8) x 128 x 4096 + bias 14,336 + proj 4096 x 12,288
#     = 109.07 M
#   dense layer: 109.07 M + SwiGLU 3 x 4096 x 10,944 = 243.55 M
#   MoE layer: 109.07 M + router 0.52 M + 128 experts x 3 x 4096 x 1408 (2,214.59 M) + shared
#     expert 17.30 M = 2,341.49 M; MTP layer: that + eh_proj 4096 x 8192 + norms = 2,375.06 M
#   embedding + untied output layer: 2 x 151,552 x 4096 = 1,241.51 M
#   total 6.2016 B parameters (experts 4.429 B, the rest 1.772 B)
# Bytes per parameter, bf16 with the distributed optimizer at DP 1: bf16 weight 2 + fp32 grad 4
# + fp32 main weight 4 + Adam m and v 8 = 18 -> 111.6 GB = 104.0 GiB (Megatron's
# theoretical_memory_usage for these flags: 103.4 GiB; the Qwen3 proxy allocated 18.4 B per
# parameter after iteration 1 in gpu_run2).
# Transient peaks on top of it:
#   optimizer step: torch's foreach AdamW (no TE / apex) allocates sqrt(v) for a whole parameter
#     group, the largest being the 4.43 B expert weights: 4 B each = 16.5 GiB -> 120.5 GiB
#   forward / backward with full recomputation: saved layer inputs 3 x 32 MiB; one layer at a
#     time is recomputed: attention probabilities, their gradient and the score gradient,
#     3 x 3 GiB, + Megatron's persistent 3 GiB score buffer; the fp32 softmax of the two
#     vocabulary cross-entropies (main + MTP), 2 x 2.3 GiB, until their backward
#     -> ~104 + 3 + 9 + 2-5 = ~118-121 GiB
# -> >= 15 GiB headroom at the worst point; expandable segments against fragmentation. Same
# arithmetic for the earlier 4-layer proxy without recomputation (docs/history/notebook.md: 119 GB
# after iteration 1, out of memory in iteration 2): 56 GiB weights, grads and main weights +
# 40 GiB Adam + ~50 GiB activations = ~147 GiB > 140 GiB, as observed.
set -u
out="${1:?usage: glm_compare.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
py="${PYTHON:-python3}"
gpus="${GPUS:-$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}"
if [ "$gpus" -ge 2 ]; then
  side=1 iters="${TRAIN_ITERS:-100}" limit="${TIMEOUT_S:-500}"
elif [ "$gpus" -eq 1 ]; then
  side=0 iters="${TRAIN_ITERS:-50}" limit="${TIMEOUT_S:-250}"
else
  echo "glm_compare.sh: no GPU visible (set GPUS=1 or 2 to run anyway, e.g. with ENTRY=...)" >&2
  exit 1
fi
for name in ${RUNS:-stock lrmoe}; do
  case "$name" in stock | lrmoe) ;; *)
    echo "glm_compare.sh: RUNS names '$name'; use stock and/or lrmoe (e.g. RUNS=stock)" >&2
    exit 1 ;;
  esac
done
keep="${KEEP_RATIO:-0.5}"
port="${MASTER_PORT:-29621}"
IFS=, read -ra devices <<<"${CUDA_VISIBLE_DEVICES:-0,1}"
[ "${#devices[@]}" -ge 2 ] || devices+=("${devices[0]}")
data="${DATA_PREFIX:-$PWD/.data/pystdlib_bytes}"
if [ ! -f "$data.bin" ]; then
  "$py" examples/make_indexed_dataset.py --output-prefix "$data" \
    --max-bytes "${DATA_MAX_BYTES:-12000000}" >"$out/dataset.log" 2>&1 ||
    { cat "$out/dataset.log"; exit 1; }
fi
git rev-parse HEAD >"$out/commit.txt" 2>/dev/null || echo unknown >"$out/commit.txt"
echo "tree $(bash benchmarks/tree_hash.sh)" >>"$out/commit.txt"  # what ran, whatever git says

run() {  # run NAME DEVICE PORT LRMOE
  local log="$out/train_$1.log" start=$SECONDS rc
  # shellcheck disable=SC2086  # EXTRA_ARGS: flags, split on purpose
  env CUDA_VISIBLE_DEVICES="$2" MASTER_PORT="$3" LRMOE="$4" KEEP_RATIO="$keep" \
    SELECTION="${SELECTION:-sample}" TRAIN_ITERS="$iters" GBS="${GBS:-4}" \
    WARMUP_ITERS="${WARMUP_ITERS:-20}" EVAL_INTERVAL="${EVAL_INTERVAL:-$((iters / 2))}" \
    EVAL_ITERS="${EVAL_ITERS:-4}" LOG_INTERVAL=1 DATA_PREFIX="$data" \
    DATA_CACHE="/tmp/lrmoe_glm_cache_$1" PYTHON="$py" \
    timeout -k 15 "$limit" bash examples/glm45_air/proxy_1xh200.sh --moe-layer-timing \
    ${EXTRA_ARGS:-} >"$log" 2>&1
  rc=$?
  echo "exit $rc ($1) wall $((SECONDS - start)) s" >>"$log"
}

echo "glm_compare: $gpus GPU(s), side by side: $side, $iters iterations, keep $keep, logs in $out"
if [ "$side" = 1 ]; then
  run stock "${devices[0]}" "$port" 0 &
  a=$!
  run "keep$keep" "${devices[1]}" $((port + 1)) 1 &
  b=$!
  wait "$a" "$b"
else
  runs=" ${RUNS:-stock lrmoe} "
  case "$runs" in *" stock "*) run stock "${devices[0]}" "$port" 0 ;; esac
  case "$runs" in *" lrmoe "*) run "keep$keep" "${devices[0]}" $((port + 1)) 1 ;; esac
fi

"$py" - "$out" "$iters" "${SKIP_ITERS:-10}" stock "keep$keep" <<'EOF'
"""Summary of the two logs: time per iteration, losses, MoE-layer time, memory, exit."""
import json
import re
import statistics
import sys
from pathlib import Path

out, target, skip, names = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
NUM = r"([-+\d.eE]+|nan|inf)"
ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples.*?per iteration \(ms\): "
                  rf"([\d.]+) \|.*?lm loss: {NUM} \|(?:.*?mtp_1 loss: {NUM} \|)?")
LRMOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| lrmoe kept: ([\d.]+) \| lrmoe dropped score: "
                   r"([\d.]+)")
MOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([\d.]+) ms/iter \| moe layers "
                 r"cumulative: ([\d.]+) s")
VAL = re.compile(rf"validation loss at iteration (\d+)( on validation set)? \| "
                 rf"lm loss value: {NUM}")
MEM = re.compile(r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)")
EXIT = re.compile(r"^exit (\d+) \(\S+\) wall (\d+) s", re.M)


def median(values):
    return statistics.median(values) if values else float("nan")


def summarise(name):
    text = (out / f"train_{name}.log").read_text(errors="replace")
    iters = {int(m[0]): (float(m[1]) / 1e3, float(m[2]), float(m[3] or "nan"))
             for m in ITER.findall(text)}
    moe = {int(m[0]): (float(m[1]), float(m[2])) for m in MOE.findall(text)}
    kept = [(float(m[1]), float(m[2])) for m in LRMOE.findall(text)]
    vals = [(int(m[0]), bool(m[1]), float(m[2])) for m in VAL.findall(text)]
    done = max(iters, default=0)
    last = sorted(iters)[-10:]
    exit_match = EXIT.search(text)
    return {
        "run": name,
        "iterations": done,
        "s_per_iter_median": median([v[0] for i, v in iters.items() if i > skip]),
        "first_loss": iters[min(iters)][1] if iters else float("nan"),
        "last_loss": iters[done][1] if iters else float("nan"),
        "last10_loss_mean": statistics.fmean(iters[i][1] for i in last) if last else float("nan"),
        "last_mtp_loss": iters[done][2] if iters else float("nan"),
        "val_loss": vals[-1][2] if vals else float("nan"),
        "val_iteration": vals[-1][0] if vals else None,
        "moe_ms_per_iter_median": median([v[0] for i, v in moe.items() if i > skip]),
        "moe_cumulative_s": moe[max(moe)][1] if moe else float("nan"),
        "max_allocated_gib": max((float(m[1]) for m in MEM.findall(text)), default=0.0) / 1024,
        "kept_mean": statistics.fmean(k for k, _ in kept) if kept else None,
        "dropped_score_mean": statistics.fmean(d for _, d in kept) if kept else None,
        "out_of_memory": "out of memory" in text.lower(),
        "exit": int(exit_match[1]) if exit_match else None,
        "wall_s": int(exit_match[2]) if exit_match else None,
    }


rows = [summarise(name) for name in names]
lines = [
    f"GLM-4.5-Air proxy, {target} iterations per run; medians over iterations > {skip}",
    "| run | iterations | s/iter | lm loss first / last / mean last 10 | mtp loss last "
    "| val loss (it) | MoE ms/iter, cumulative s | max alloc GiB | kept / dropped score "
    "| wall s | exit |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]
for r in rows:
    kept = "-"
    if r["kept_mean"] is not None:
        kept = f"{r['kept_mean']:.3f} / {r['dropped_score_mean']:.3f}"
    lines.append(
        f"| {r['run']} | {r['iterations']} | {r['s_per_iter_median']:.3f} | "
        f"{r['first_loss']:.4f} / {r['last_loss']:.4f} / {r['last10_loss_mean']:.4f} | "
        f"{r['last_mtp_loss']:.4f} | {r['val_loss']:.4f} ({r['val_iteration']}) | "
        f"{r['moe_ms_per_iter_median']:.1f}, {r['moe_cumulative_s']:.2f} | "
        f"{r['max_allocated_gib']:.1f} | {kept} | {r['wall_s']} | {r['exit']}"
        + (" OOM" if r["out_of_memory"] else "") + " |"
    )
stock, lrmoe = rows
ok = all(r["iterations"] >= target and r["exit"] == 0 for r in rows)
lines += [
    f"{lrmoe['run']} / stock: s/iter {lrmoe['s_per_iter_median'] / stock['s_per_iter_median']:.3f}"
    f", MoE ms/iter {lrmoe['moe_ms_per_iter_median'] / stock['moe_ms_per_iter_median']:.3f}"
    f", val loss {100 * (lrmoe['val_loss'] / stock['val_loss'] - 1):+.2f} %",
    f"both runs reached {target} iterations: " + ("yes" if ok else "NO"),
]
(out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
EOF
