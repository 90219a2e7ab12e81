"""Host cost of our Triton launch wrappers with the launch itself stubbed out (CPU, no GPU).

    PYTHONPATH=<tree> python benchmarks/wrapper_cost.py [--calls 20000]

The trimmed backward is host-bound at 4096 tokens per GPU (docs/history/notebook.md section 11), and
part of each launch's host time is the Python wrapper around it: checks, shape reads, output
allocation, argument marshalling. This replaces the compiled kernels by no-ops and times the
wrappers on small host tensors, so what remains is the wrapper's own Python (and a CPU
``torch.empty``, about the cost of a CUDA one). Prints microseconds per call; compare two
versions of the code by running this file against each (``PYTHONPATH``), one after the other
on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import time
import types
from typing import Callable

import torch


class _NoLaunch:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _us_per_call(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(calls // 100, 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()

    from megatron_lrmoe.dispatch import rows_triton
    from megatron_lrmoe.experts import activation_triton
    from megatron_lrmoe.select import scores_triton

    stubs = types.SimpleNamespace(interpreted=True)  # "interpreted": host tensors are accepted
    for name in ("scale_rows", "row_dot", "gather_sum", "act_fwd", "act_bwd", "row_norms",
                 "pair_scores", "pack_pairs"):
        setattr(stubs, name, _NoLaunch())
    for module in (rows_triton, scores_triton, activation_triton):
        module._kernels = lambda: stubs

    bf16 = torch.bfloat16
    g, z = torch.randn(64, 256, dtype=bf16), torch.randn(128, 256, dtype=bf16)
    slots = torch.arange(128).view(64, 2)
    h, probs = torch.randn(128, 512, dtype=bf16), torch.rand(64)
    d, h_rows = torch.randn(64, 256, dtype=bf16), torch.arange(64)
    cases = {
        "torch.empty (for scale)": lambda: torch.empty(64, 256, dtype=bf16),
        "row_dot_triton (slots)": lambda: rows_triton.row_dot_triton(g, z, torch.float32, slots=slots),
        "gather_sum_triton": lambda: rows_triton.gather_sum_triton(z, slots),
        "row_norms_triton": lambda: scores_triton.row_norms_triton(g, g),
        "act_backward_triton (probs, store_act, h_rows)": lambda: activation_triton.act_backward_triton(
            d, h, True, "silu", probs, True, h_rows
        ),
    }
    print(f"{rows_triton.__file__}; torch {torch.__version__}; launches stubbed; us per call, "
          f"{args.calls} calls")
    for name, fn in cases.items():
        print(f"{name:48s} {_us_per_call(fn, args.calls):7.2f}")


if __name__ == "__main__":
    main()
