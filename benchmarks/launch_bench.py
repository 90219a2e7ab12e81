"""Host cost of one kernel launch: a torch op, a Triton ``kernel[grid](...)``, our launcher.

    python3 benchmarks/launch_bench.py [--calls 2000]

The trimmed backward is host-bound (docs/history/notebook.md section 4), so what a launch costs on
the host decides how many kernels it can afford. Tiny tensors, so the GPU never limits the loop;
the queue is drained before each timed loop. Prints microseconds of host time per launch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import host_us_per_call  # noqa: E402


def _per_call(fn: Callable[[], object], calls: int) -> float:
    return host_us_per_call(fn, calls, warmup=20)




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    import triton

    from megatron_lrmoe.dispatch import rows_triton as tk
    from megatron_lrmoe.dispatch import rows

    rows_t = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(32, device="cuda")
    index = torch.arange(32, device="cuda")
    out = torch.empty(32, 256, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1024, device="cuda")
    b = torch.empty_like(a)
    kernels = tk._kernels()
    grid = (4, 1)

    def raw_jit() -> object:
        return kernels.scale_rows[grid](out, rows_t, scale, index, 32, 256, 256, 256,
                                        HAS_INDEX=True, BLOCK_M=8, BLOCK_H=256, num_warps=8)

    results = {
        "torch.mul(out=)": _per_call(lambda: torch.mul(a, 2.0, out=b), args.calls),
        "torch index_select": _per_call(lambda: rows_t.index_select(0, index), args.calls),
        "torch.empty": _per_call(lambda: torch.empty(32, 256, device="cuda"), args.calls),
        "triton kernel[grid](...)": _per_call(raw_jit, args.calls),
        "scale_rows_triton (our wrapper)": _per_call(
            lambda: tk.scale_rows_triton(rows_t, scale, index), args.calls),
        "rows.scale_rows (dispatching)": _per_call(
            lambda: rows.scale_rows(rows_t, scale, index=index), args.calls),
    }
    fast = getattr(tk, "launch", None)
    if fast is not None:
        results["tk.launch (cached handle)"] = _per_call(
            lambda: fast(kernels.scale_rows, grid, (out, rows_t, scale, index, 32, 256, 256, 256),
                         dict(HAS_INDEX=True, BLOCK_M=8, BLOCK_H=256), num_warps=8), args.calls)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for name, us in results.items():
        print(f"{name:36s} {us:8.2f} us/launch (host)")


if __name__ == "__main__":
    main()
