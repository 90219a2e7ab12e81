#!/usr/bin/env bash
# gpu_run27 call 2: which commit changed keep 0.5's training losses (seed 1234) since section 15
# (cf05914: iteration-3 loss 8.142582; 4c7f663: 8.142597). Binary search over the first-parent
# commits touching megatron_lrmoe (.bisect/commits.txt (a copy: call2/commits.txt), from a bundle of main), each run the
# Qwen3 proxy at 16384 tokens per micro-batch from that commit's own package and launch scripts,
# 3 iterations (--exit-interval 3); a commit is "old" when its iteration-3 loss equals cf05914's.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
git clone -q .bisect/main.bundle /tmp/repo || exit 1
[ -f .data/pystdlib_bytes.bin ] || python3 examples/make_indexed_dataset.py --output-prefix .data/pystdlib_bytes --max-bytes 12000000 > /dev/null 2>&1
mapfile -t C < .bisect/commits.txt (a copy: call2/commits.txt)
loss3() {  # loss3 COMMIT -> prints iteration 1-3 losses
  local d=/tmp/ab_$1
  if [ ! -d $d ]; then mkdir -p $d && git -C /tmp/repo archive $1 megatron_lrmoe pretrain_lrmoe.py examples | tar -x -C $d; fi
  (cd $d && env GPUS_PER_NODE=1 NNODES=1 NUM_LAYERS=4 TP=1 PP=1 EP=1 SEQ_LENGTH=4096 MBS=4 GBS=4 \
     TRANSFORMER_IMPL=local TRAIN_ITERS=300 LR=5e-4 MIN_LR=5e-5 WARMUP_ITERS=20 EVAL_INTERVAL=50 \
     EVAL_ITERS=8 LOG_INTERVAL=1 DATA_PREFIX=$P/.data/pystdlib_bytes CUDA_VISIBLE_DEVICES=0 \
     MASTER_PORT=29650 KEEP_RATIO=0.5 DATA_CACHE=/tmp/lrmoe_data_cache_b SEED=1234 \
     timeout 100 bash examples/qwen3_30b_a3b/pretrain.sh --moe-layer-timing --exit-interval 3 > $OUT/run_$1.log 2>&1)
  grep -o "lm loss: [0-9.E+-]*" $OUT/run_$1.log | head -3 | tr '\n' ' '
}
old=8.142582E+00
lo=-1; hi=$((${#C[@]} - 1))   # C[lo] (or cf05914) is old, C[hi] (4c7f663) is new
# (the last commit's losses come from call 1)
while [ $((hi - lo)) -gt 1 ]; do
  mid=$(((lo + hi) / 2)); l=$(loss3 ${C[$mid]}); echo "$mid ${C[$mid]}: $l"
  if echo "$l" | grep -q "lm loss: $old \?$"; then lo=$mid; else
    if [ -z "$l" ]; then echo "no losses: see run_${C[$mid]}.log"; tail -20 $OUT/run_${C[$mid]}.log; exit 1; fi
    hi=$mid; fi
done
echo "first commit with other losses: ${C[$hi]} (after ${C[$lo]:-cf05914})"
cd /tmp/repo && git log -1 --format="%h %s" ${C[$hi]}
rm -f $OUT/run_*.log.keep; ls $OUT | head
