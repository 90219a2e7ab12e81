#!/usr/bin/env bash
# The GPU evidence of the layer in one command: CUDA unit tests (the CUDA graphs' included),
# selection micro-benchmark, layer benchmark and layers stacked as in a model (model_bench.py,
# 4 layers of 128 experts at 16384 tokens) at EP=1 (and EP=2 when two GPUs are visible), bf16
# equivalence with stock.
#
#   bash benchmarks/gpu_suite.sh OUT_DIR [--quick]      (SKIP_SELECT_BENCH=1 skips that step)
#
# Needs: torch with CUDA, triton, pytest, megatron-core 0.19.2 importable (e.g. from a wheel,
# see ../shared/GPU.md), this checkout on PYTHONPATH. Every step runs even if an earlier one
# failed; each writes its log (and JSON) into OUT_DIR; the exit code is the number of failures.
set -u
out="${1:?usage: gpu_suite.sh OUT_DIR [--quick]}"
quick="${2:-}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
iters=15
tokens="4096 16384"
if [ "$quick" = "--quick" ]; then iters=3; tokens="4096"; fi
failures=0
step() {  # step NAME COMMAND...: run, tee the log, count a failure
  local name="$1"; shift
  echo "=== $name: $*" | tee "$out/$name.log"
  local t0=$SECONDS
  "$@" >>"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/$name.log"
  tail -n 40 "$out/$name.log"
  [ $rc -eq 0 ] || failures=$((failures + 1))
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$out/gpu.txt"
step cuda_tests env LRMOE_TEST_CUDA=1 python3 -m pytest -q -p no:cacheprovider -W ignore \
  -k "expert_graph or scoring_graph or front_graph or captured or cuda or gpu" \
  tests/test_layer.py tests/test_select_kernels.py tests/test_metrics.py \
  tests/test_triton_kernels.py tests/test_pair_plan_triton.py tests/test_ops.py \
  tests/test_cuda_graphs.py
if [ -f benchmarks/select_bench.py ] && [ -z "${SKIP_SELECT_BENCH:-}" ]; then
  step select_bench python3 benchmarks/select_bench.py --out "$out/select_bench.json"
fi
# shellcheck disable=SC2086
step layer_ep1 torchrun --nproc_per_node=1 benchmarks/layer_bench.py --tokens $tokens \
  --iters $iters --out "$out/layer_ep1.json"
model=(--layers 4 --experts 128 --tokens 16384)
if [ "$quick" = "--quick" ]; then model=(--layers 2 --experts 16 --tokens 4096 --rounds 3); fi
step model_ep1 torchrun --nproc_per_node=1 benchmarks/model_bench.py "${model[@]}" \
  --out "$out/model_ep1.json"
if [ "$gpus" -ge 2 ]; then
  step model_ep2 torchrun --nproc_per_node=2 benchmarks/model_bench.py "${model[@]}" \
    --out "$out/model_ep2.json"
  # shellcheck disable=SC2086
  step layer_ep2 torchrun --nproc_per_node=2 benchmarks/layer_bench.py --tokens $tokens \
    --iters $iters --no-profile --out "$out/layer_ep2.json"
  step equivalence_ep2 torchrun --nproc_per_node=2 benchmarks/gpu_equivalence.py \
    --out "$out/equivalence_ep2.json"
else
  step equivalence_ep1 torchrun --nproc_per_node=1 benchmarks/gpu_equivalence.py \
    --out "$out/equivalence_ep1.json"
fi
echo "gpu_suite: $failures failed step(s)"
exit $failures
