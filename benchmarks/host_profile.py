"""Where the host (Python / launch) time of one LRMoE layer call goes: cProfile on the GPU.

    torchrun --nproc_per_node=1 benchmarks/host_profile.py --tokens 4096 --keep 1.0 0.5

The layer's GPU work is asynchronous, so on a GPU cProfile sees exactly the host side: Python,
kernel launches (Triton's launcher is Python), small host-to-device copies and any sync. Prints,
per keep ratio, the forward and backward host times per call and the functions with the most
own time and the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_distributed, moe_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--selection", default="sample")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rows", type=int, default=35)
    parser.add_argument(
        "--torch-profiler",
        action="store_true",
        help="also print torch.profiler's table by self CPU time (CUDA runtime calls included)",
    )
    args = parser.parse_args()

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    cfg = moe_config(ep)
    layer = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).cuda()
    x = torch.randn(args.tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    for keep in args.keep:
        layer.lrmoe_config = LRMoEConfig(keep_ratio=keep, selection=args.selection)
        for _ in range(5):
            out, _ = layer(x.detach().requires_grad_(True))
            out.backward(up)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        fwd = bwd = 0.0
        for _ in range(args.iters):
            inp = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            profiler.enable()
            out, _ = layer(inp)
            t1 = time.perf_counter()
            out.backward(up)
            profiler.disable()
            fwd += t1 - t0
            bwd += time.perf_counter() - t1
            torch.cuda.synchronize()
        if torch.distributed.get_rank() == 0:
            print(f"===== keep {keep} {args.selection}: host fwd {fwd / args.iters * 1e3:.2f} ms, "
                  f"bwd {bwd / args.iters * 1e3:.2f} ms per call (cProfile on)", flush=True)
            for key in ("tottime", "cumtime"):
                stream = io.StringIO()
                pstats.Stats(profiler, stream=stream).sort_stats(key).print_stats(args.rows)
                print(f"--- by {key}\n" + stream.getvalue(), flush=True)
        if args.torch_profiler:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    out, _ = layer(x.detach().requires_grad_(True))
                    out.backward(up)
                torch.cuda.synchronize()
            if torch.distributed.get_rank() == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
                print(f"--- torch.profiler, 5 calls, by self CPU time\n{table}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
