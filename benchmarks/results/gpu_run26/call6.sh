#!/usr/bin/env bash
# gpu_run26 call 6: Qwen3 proxy training, keep 1.0, 16384 tokens per micro-batch, 100
# iterations: new (atomic-epilogue tiles) against old (d058b72 from ab_old/, the same launch
# script), one after the other on the one GPU.
P=$PWD; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl && export PYTHONPATH=$P/.site:$P || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
A_KEEP=1.0 B_KEEP=1.0 B_ENV=ENTRY=ab_old/pretrain_lrmoe.py NAME_A=new NAME_B=old TRAIN_ITERS=100 GBS=4 MBS=4 TIMEOUT_S=200 bash benchmarks/train_compare.sh $OUT/train > $OUT/train_compare.log 2>&1; echo "train rc=$?"
python3 benchmarks/report.py $OUT/train 2>&1 | tee $OUT/report.txt | tail -20
for f in new old; do grep -E "iteration +(1|2|50|100)/" $OUT/train/train_$f.log | grep "lm loss" | sed 's/.*iteration \+\([0-9]*\)\/.*lm loss: \([^ ]*\).*grad norm: \([^ ]*\).*/\1 \2 \3/' | sed "s/^/$f /"; done
