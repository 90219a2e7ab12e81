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

    def report(label: str, fn: Callable[[], object]) -> None:
        print(f"{label}: {_median_us(fn, args.iters):.1f} us")

    report("torch.cuda.current_stream()", torch.cuda.current_stream)
    report("stream.query() idle", stream.query)
    key = (1234, 3, 17, 0)
    report("draw_uniforms(128)", lambda: draw_uniforms(1234, key, 128))
    digest = hashlib.sha256(b"x").digest()
    report("  sha256", lambda: hashlib.sha256(b"megatron_lrmoe:1,2,3").digest())
    report("  torch.Generator()", lambda: torch.Generator(device="cpu"))
    gen = torch.Generator(device="cpu")
    seed = int.from_bytes(digest[:8], "little")
    report("  manual_seed", lambda: gen.manual_seed(seed))
    report("  torch.rand(128)", lambda: torch.rand(128, generator=gen, dtype=torch.float64))
    pinned = lambda: torch.empty(512, dtype=torch.int64, pin_memory=True)  # noqa: E731
    report("torch.empty(512, pin_memory=True)", pinned)
    report("torch.empty(512) (host)", lambda: torch.empty(512, dtype=torch.int64))
    report("torch.empty(512, device=cuda)", lambda: torch.empty(512, device="cuda"))


if __name__ == "__main__":
    main()
