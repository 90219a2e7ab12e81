#!/usr/bin/env bash
# gpu_run27 call 4: keep 0.5 in training with the large weight-gradient tile at 512 rows per
# expert (LARGE_GROUP_ROWS 512 instead of 768, a copy of the package in ab_large/) against the
# committed code, the Qwen3 proxy at 16384 tokens per micro-batch, seed 1234, 40 iterations, the
# PyTorch profiler on steps 30-33, Megatron's per-bucket NaN check off (call 3: it syncs inside
# every MoE layer's backward); trace_summary.py compares the two traces.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export PYTHONUNBUFFERED=1
mkdir -p ab_large && cp -r megatron_lrmoe pretrain_lrmoe.py ab_large/ && \
  sed -i 's/^LARGE_GROUP_ROWS = 768$/LARGE_GROUP_ROWS = 512/' ab_large/megatron_lrmoe/experts/wgrad_triton.py && \
  grep -n "^LARGE_GROUP_ROWS" ab_large/megatron_lrmoe/experts/wgrad_triton.py
prof="--profile --use-pytorch-profiler --profile-step-start 30 --profile-step-end 33 --exit-interval 40 --no-check-for-nan-in-loss-and-grad"
A_KEEP=0.5 B_KEEP=0.5 A_ENV="SEED=1234" B_ENV="SEED=1234 ENTRY=ab_large/pretrain_lrmoe.py" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=150 \
  NAME_A=keep05_small NAME_B=keep05_large \
  A_FLAGS="$prof --tensorboard-dir /tmp/prof_small/tb" B_FLAGS="$prof --tensorboard-dir /tmp/prof_large/tb" \
  bash benchmarks/train_compare.sh $OUT/train > /dev/null 2>&1; echo "train rc=$?"
for f in $OUT/train/train_keep*.log; do
  moe=$(grep -o "moe layers: [0-9.]* ms" $f | awk '{print $3}' | sed -n 10,40p | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  echo "$(basename $f): MoE layers median (it 10-40) $moe ms/iter; $(grep -o 'lm loss: [0-9.E+-]*' $f | sed -n 3p) at 3, $(grep -o 'lm loss: [0-9.E+-]*' $f | sed -n 40p) at 40"
done | tee $OUT/train_medians.txt
python3 benchmarks/trace_summary.py /tmp/prof_small/torch_profile/rank-0.json.gz /tmp/prof_large/torch_profile/rank-0.json.gz \
  --names small large --top 12 --out $OUT/trace_summary.json 2>&1 | tee $OUT/trace_summary.txt
python3 - <<'PY'
import gzip, json
for k in ("small", "large"):
    ev = json.load(gzip.open(f"/tmp/prof_{k}/torch_profile/rank-0.json.gz", "rt"))["traceEvents"]
    w = [e for e in ev if e.get("cat") == "kernel" and e["name"] == "_wgrad_kernel"]
    print(k, "wgrad launches (us):", [round(e["dur"]) for e in w[:8]], "grids", sorted({str(e["args"].get("grid")) for e in w}))
PY
