"""The expert backward's tail with fc1's weight gradient on a second stream (GPU), side by side:

    python benchmarks/overlap_bench.py [--experts 128 16] [--tokens 4096 16384] [--keep 1.0 0.5]

After the activation backward the tail runs three products that read what is already there:
fc2's weight gradient (``g``, ``act``), fc1's (``dh``, ``x``), both added into the fp32
``main_grad`` in the GEMM's epilogue (Triton), and fc1's input gradient ``dx = dh @ w1``
(torch's CUTLASS grouped GEMM). The weight gradients' epilogues move fp32 ``main_grad`` (memory
bound, docs/history/notebook.md section 11); the input gradient is compute bound. Variants:

* ``serial``: dw2, dw1, dx on one stream (the order of ``expert_backward``);
* ``dw1_side``: dw2 then dx on the current stream, dw1 on a second stream of lower priority;
* ``dx_side``: dw2 then dw1 on the current stream, dx on a second stream;
* ``dw1_side_same_prio``: as ``dw1_side`` with both streams at the default priority.

Rows per expert from a multinomial (as routing gives), ``tokens * 8 * keep`` rows in all, the
Qwen3-30B-A3B expert shape. Medians of CUDA-event times of the whole tail started on an idle
device, after warm-up; every variant's results are checked against ``serial``'s (the same
kernels, so the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms  # noqa: E402
from megatron_lrmoe.experts.grouped_gemm import GroupSizes, grouped_mm_nn  # noqa: E402
from megatron_lrmoe.experts.wgrad_triton import accumulate_grouped_wgrad  # noqa: E402

H, F = 2048, 768


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--experts", type=int, nargs="+", default=[128, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "overlap_bench.json")
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lo_prio, hi_prio = torch.cuda.Stream.priority_range()  # (0, -k): larger is lower
    results = []
    for experts in args.experts:
        w1 = torch.randn(experts, 2 * F, H, device=dev, dtype=torch.bfloat16) * 0.02
        acc1 = torch.zeros(experts, 2 * F, H, device=dev, dtype=torch.float32)
        acc2 = torch.zeros(experts, H, F, device=dev, dtype=torch.float32)
        for tokens in args.tokens:
            for keep in args.keep:
                rows = int(tokens * args.topk * keep)
                probs = torch.full((experts,), 1.0 / experts)
                sizes = torch.distributions.Multinomial(rows, probs).sample().long()
                groups = GroupSizes(sizes)
                g = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
                act = torch.randn(rows, F, device=dev, dtype=torch.bfloat16)
                dh = torch.randn(rows, 2 * F, device=dev, dtype=torch.bfloat16)
                x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
                dx = torch.empty(rows, H, device=dev, dtype=torch.bfloat16)

                def dw2() -> None:
                    accumulate_grouped_wgrad(g, act, groups, acc2)

                def dw1() -> None:
                    accumulate_grouped_wgrad(dh, x, groups, acc1)

                def dgrad() -> None:
                    grouped_mm_nn(dh, w1, groups, out=dx)

                def serial() -> None:
                    dw2()
                    dw1()
                    dgrad()

                def forked(side_work, main_work, priority: int):
                    side = torch.cuda.Stream(dev, priority=priority)

                    def run() -> None:
                        main = torch.cuda.current_stream(dev)
                        side.wait_stream(main)
                        with torch.cuda.stream(side):
                            for fn in side_work:
                                fn()
                        for fn in main_work:
                            fn()
                        main.wait_stream(side)

                    return run

                variants = {
                    "serial": serial,
                    "dw1_side": forked([dw1], [dw2, dgrad], lo_prio),
                    "dx_side": forked([dgrad], [dw2, dw1], 0),
                    "dw1_side_same_prio": forked([dw1], [dw2, dgrad], 0),
                }
                row = {"experts": experts, "tokens": tokens, "keep": keep, "rows": rows,
                       "parts_ms": {"dw2": cuda_median_ms(dw2, args.warmup, args.iters),
                                    "dw1": cuda_median_ms(dw1, args.warmup, args.iters),
                                    "dx": cuda_median_ms(dgrad, args.warmup, args.iters)}}
                # Same bits: every variant from zeroed accumulators against serial's.
                ref = None
                for name, fn in variants.items():
                    acc1.zero_()
                    acc2.zero_()
                    fn()
                    torch.cuda.synchronize()
                    out = (acc1.clone(), acc2.clone(), dx.clone())
                    if ref is None:
                        ref = out
                    elif not all(torch.equal(a, b) for a, b in zip(out, ref)):
                        raise SystemExit(f"{name}: results differ from serial's")
                del ref, out
                row["ms"] = {}
                for _ in range(2):  # two rounds, alternating variants
                    for name, fn in variants.items():
                        ms = cuda_median_ms(fn, args.warmup, args.iters)
                        row["ms"].setdefault(name, []).append(ms)
                results.append(row)
                parts = row["parts_ms"]
                print(f"E={experts} tokens={tokens} keep={keep} rows={rows}: parts dw2 "
                      f"{parts['dw2']:.3f} dw1 {parts['dw1']:.3f} dx {parts['dx']:.3f} (sum "
                      f"{sum(parts.values()):.3f}) | " + ", ".join(
                          f"{k} {'/'.join(f'{v:.3f}' for v in vs)}" for k, vs in row["ms"].items()),
                      flush=True)
                del g, act, dh, x, dx
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
