#!/usr/bin/env bash
# gpu_run27 call 3. (1) The fused weight gradient under skewed group sizes: call 1 found keep
# 0.5's _wgrad_kernel 20-25 % slower in training than in the uniform kernel bench, keep 1.0's
# not. Tiles: the small and large tiles config_for picks, the large one persistent, two others.
# (2) Megatron's per-bucket NaN check of the gradients (--check-for-nan-in-loss-and-grad, on by
# default; with --overlap-grad-reduce each bucket's norm is read on the host inside the
# backward, call 1's trace: a 4.5 ms cudaStreamSynchronize in every MoE layer's backward):
# 40 iterations each at keep 1.0 and 0.5, with the check (default) and without.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export PYTHONUNBUFFERED=1
python3 benchmarks/wgrad_bench.py --fused-only --rows 512 1024 --skew 0 1 2 --order drawn descending \
  --tiles 64,128,32,4,4,0,1 128,256,64,8,4,0,1 128,256,64,8,4,1,1 128,128,32,4,4,0,1 128,128,64,8,3,0,1 \
  --out $OUT/wgrad_skew.json 2>&1 | grep -v Warning > $OUT/wgrad_skew.log; echo "wgrad rc=$?"
grep -E "^fc|picks" $OUT/wgrad_skew.log | grep -v picks
for k in 1.0 0.5; do
  A_KEEP=$k B_KEEP=$k A_ENV="SEED=1234" B_ENV="SEED=1234" TRAIN_ITERS=300 GBS=4 MBS=4 TIMEOUT_S=120 \
    NAME_A=keep${k}_check NAME_B=keep${k}_nocheck A_FLAGS="--exit-interval 40" \
    B_FLAGS="--exit-interval 40 --no-check-for-nan-in-loss-and-grad" \
    bash benchmarks/train_compare.sh $OUT/train > /dev/null 2>&1; echo "train $k rc=$?"
done
for f in $OUT/train/train_keep*.log; do
  moe=$(grep -o "moe layers: [0-9.]* ms" $f | awk '{print $3}' | sed -n 10,40p | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  it=$(grep -o "elapsed time per iteration (ms): [0-9.]*" $f | awk '{print $6}' | sed -n 10,40p | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  l=$(grep -o "lm loss: [0-9.E+-]*" $f | sed -n 40p)
  echo "$(basename $f): iterations 10-40 median ms/iter $it, MoE layers $moe ms/iter; iteration 40 $l"
done | tee $OUT/train_medians.txt
