"""Pair permutation plan on one GPU: Triton (``pair_plan_triton``) against the torch reference.

    python benchmarks/pair_plan_bench.py [--calls 500]

For each shape (T tokens, E experts, K top-k; K distinct random experts per token) it checks
that the two plans are equal, then prints the host time to enqueue one plan (the loop is
not synced, so the GPU never limits it unless its work per call exceeds the host's) and the
CUDA-event time of one synced call. The Triton path's launches: two kernels and one cumsum.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms, host_us_per_call  # noqa: E402

SHAPES = [(4096, 128, 8), (16384, 128, 8), (8192, 160, 8), (8192, 256, 8), (65536, 512, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()

    import triton

    from megatron_lrmoe.dispatch.pair_plan_triton import pair_plan_triton
    from megatron_lrmoe.dispatch.permutation import _build_torch

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    for t, e, k in SHAPES:
        idx = torch.rand(t, e, device="cuda").topk(k, dim=1).indices
        routing_map = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, idx, True)
        s = t * k
        # The kernels themselves, also for maps above pair_plan_triton.MAX_KERNEL_MAP (where
        # PairPermutation.build takes the torch plan).
        fast, ref = pair_plan_triton(routing_map, s, k), _build_torch(routing_map, s, k)
        same = all(
            torch.equal(a, getattr(ref, n))
            for a, n in zip(fast, ("token_of_pair", "expert_of_pair", "slot_pair"))
        )
        row = f"T={t:6d} E={e:3d} K={k}  equal={same}"
        for name, fn in (
            ("triton", lambda: pair_plan_triton(routing_map, s, k)),
            ("torch", lambda: _build_torch(routing_map, s, k)),
        ):
            host = host_us_per_call(fn, args.calls)
            synced = 1e3 * cuda_median_ms(fn, 0, min(args.calls, 200))
            row += f"  {name}: host {host:7.1f} us, synced {synced:7.1f} us"
        print(row)


if __name__ == "__main__":
    main()
