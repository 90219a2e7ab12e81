"""Measure the replay's grouped-GEMM table (GPU; a small CPU run checks the script itself).

    python benchmarks/gemm_table.py --out gemm_table.json [--groups 128] [--hidden 2048]
        [--ffn 768] [--rows 64 128 ... 32768] [--iters 20]
    python -m megatron_lrmoe.replay ... --gemm-table gemm_table.json

For every rows-per-expert point, ``--groups`` experts of exactly that many rows, bf16, through the
package's grouped GEMMs (torch's ``grouped_mm`` on an H100/H200): per projection (fc1
``[F1, H]``, fc2 ``[H, F]``) the forward (``grouped_mm_nt``), the input gradient
(``grouped_mm_nn``) and the weight gradient (``grouped_mm_tn``), each the median of CUDA-event
times after warm-up. The table's time per projection is the mean of the three (the replay prices
forward as one and backward as two of them); the three columns are kept in the JSON too
(``detail``). ``--cpu`` runs the same code on the CPU in fp32 with ``perf_counter`` timings
(tests run it with tiny shapes; its numbers describe the CPU, not a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms, write_json  # noqa: E402
from megatron_lrmoe.experts.grouped_gemm import (  # noqa: E402
    GroupSizes,
    grouped_mm_nn,
    grouped_mm_nt,
    grouped_mm_tn,
)
from megatron_lrmoe.replay.cost import GemmTable  # noqa: E402

DEFAULT_ROWS = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def _cpu_median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure(
    rows_grid: list[int],
    groups: int,
    hidden: int,
    ffn: int,
    gated: bool = True,
    device: str = "cuda",
    iters: int = 20,
    warmup: int = 3,
) -> dict:
    """The table's JSON: per grid point and projection the forward, dgrad and wgrad times."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    timer = (
        (lambda fn: cuda_median_ms(fn, warmup, iters))
        if dev.type == "cuda"
        else (lambda fn: _cpu_median_ms(fn, warmup, iters))
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    fc1_width = 2 * ffn if gated else ffn
    shapes = {"fc1": (fc1_width, hidden), "fc2": (hidden, ffn)}  # [out, in] per expert
    weights = {
        name: torch.randn(groups, out, inp, generator=gen, device=dev, dtype=dtype) * inp**-0.5
        for name, (out, inp) in shapes.items()
    }
    detail: dict[str, dict[str, list[float]]] = {
        name: {"fwd": [], "dgrad": [], "wgrad": []} for name in shapes
    }
    for rows in rows_grid:
        sizes = GroupSizes([rows] * groups)
        for name, (out, inp) in shapes.items():
            w = weights[name]
            x = torch.randn(rows * groups, inp, generator=gen, device=dev, dtype=dtype)
            g = torch.randn(rows * groups, out, generator=gen, device=dev, dtype=dtype)
            detail[name]["fwd"].append(timer(lambda: grouped_mm_nt(x, w, sizes)))
            detail[name]["dgrad"].append(timer(lambda: grouped_mm_nn(g, w, sizes)))
            detail[name]["wgrad"].append(timer(lambda: grouped_mm_tn(g, x, sizes)))
            del x, g
    mean = {
        name: [statistics.mean(t) for t in zip(*cols.values())] for name, cols in detail.items()
    }
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (fp32)"
    table = GemmTable(
        rows_per_expert=tuple(rows_grid),
        fc1_ms=tuple(mean["fc1"]),
        fc2_ms=tuple(mean["fc2"]),
        groups=groups,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        gated=gated,
        source=f"benchmarks/gemm_table.py on {name}, {dtype}, torch {torch.__version__}",
    )
    return {**table.to_json(), "detail": detail}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gemm_table.json")
    p.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--no-gated", action="store_true", help="fc1 is [F, H], not [2F, H]")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit(
            "gemm_table.py: no CUDA device; the table is a GPU measurement (--cpu only checks "
            "the script)"
        )
    payload = measure(
        sorted(args.rows),
        args.groups,
        args.hidden,
        args.ffn,
        gated=not args.no_gated,
        device="cpu" if args.cpu else "cuda",
        iters=args.iters,
        warmup=args.warmup,
    )
    write_json(args.out, payload)
    print(f"wrote {args.out}: fc1 {payload['fc1_ms']} ms, fc2 {payload['fc2_ms']} ms")


if __name__ == "__main__":
    main()
