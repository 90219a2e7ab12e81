"""Kernel-level profile of one LRMoE layer call (torch.profiler), to find where time goes.

    torchrun --nproc_per_node=2 benchmarks/profile_layer.py --tokens 16384 --keep 1.0 0.5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_distributed, moe_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--selection", default="sample")
    parser.add_argument("--scope", default="local")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    rank = torch.distributed.get_rank()
    cfg = moe_config(ep)
    lr = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).cuda()
    x = torch.randn(args.tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    for keep in args.keep:
        lr.lrmoe_config = LRMoEConfig(keep_ratio=keep, selection=args.selection, scope=args.scope)
        for _ in range(3):
            out, _ = lr(x.detach().requires_grad_(True))
            out.backward(up)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                out, _ = lr(x.detach().requires_grad_(True))
                out.backward(up)
            torch.cuda.synchronize()
        if rank == 0:
            print(f"===== keep {keep} {args.selection} {args.scope}: by CUDA time (3 calls)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
            print(f"===== keep {keep}: by CPU time")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
