"""Host cost of single calls the backward makes on every layer call (GPU machine).

Times ``torch.cuda.is_current_stream_capturing()`` (called by each graph's eligibility check)
with the GPU idle and with a long GEMM queued, and the pieces of ``draw_uniforms`` (the
sampling uniforms): median microseconds of ``--iters`` calls each.

    python3 benchmarks/host_calls.py [--iters 200]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Callable

import torch


def _median_us(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    from megatron_lrmoe.select.scoring import draw_uniforms

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    capturing = torch.cuda.is_current_stream_capturing
    print(f"is_current_stream_capturing, GPU idle: {_median_us(capturing, args.iters):.1f} us")
    busy = []
    for _ in range(20):
        for _ in range(20):
            a @ a  # ~20 ms of GEMMs queued ahead of the call
        t0 = time.perf_counter()
        capturing()
        busy.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    print(f"is_current_stream_capturing, GEMMs queued: {statistics.median(busy):.1f} us")
    stream = torch.cuda.current_stream()
    print(f"torch.cuda.current_stream(): {_median_us(torch.cuda.current_stream, args.iters):.1f} us")
    print(f"stream.query() idle: {_median_us(stream.query, args.iters):.1f} us")
    key = (1234, 3, 17, 0)
    print(f"draw_uniforms(128): {_median_us(lambda: draw_uniforms(1234, key, 128), args.iters):.1f} us")
    digest = hashlib.sha256(b"x").digest()
    print(f"  sha256: {_median_us(lambda: hashlib.sha256(b'megatron_lrmoe:1,2,3').digest(), args.iters):.1f} us")
    print(f"  torch.Generator(): {_median_us(lambda: torch.Generator(device='cpu'), args.iters):.1f} us")
    gen = torch.Generator(device="cpu")
    seed = int.from_bytes(digest[:8], "little")
    print(f"  manual_seed: {_median_us(lambda: gen.manual_seed(seed), args.iters):.1f} us")
    rand = lambda: torch.rand(128, generator=gen, dtype=torch.float64)  # noqa: E731
    print(f"  torch.rand(128): {_median_us(rand, args.iters):.1f} us")
    pinned = lambda: torch.empty(512, dtype=torch.int64, pin_memory=True)  # noqa: E731
    print(f"torch.empty(512, pin_memory=True): {_median_us(pinned, args.iters):.1f} us")
    print(f"torch.empty(512) (host): {_median_us(lambda: torch.empty(512, dtype=torch.int64), args.iters):.1f} us")
    dev = lambda: torch.empty(512, device="cuda")  # noqa: E731
    print(f"torch.empty(512, device=cuda): {_median_us(dev, args.iters):.1f} us")


if __name__ == "__main__":
    main()
