"""One MoE layer, stock Megatron-Core vs LRMoE, forward / backward / memory / backward bytes.

Run (one process per GPU; EP = number of processes):

    torchrun --nproc_per_node=2 benchmarks/layer_bench.py --tokens 4096 16384 --out bench.json

Variants: stock ``MoELayer`` as installed (alltoall dispatcher + ``SequentialMLP`` local experts:
no Transformer Engine on our GPU machine), and ``LRMoELayer`` at each keep ratio x activation
mode x selection policy. All variants run inside one process on the same inputs and weights.
Timings are CUDA events, median of ``--iters`` after ``--warmup`` iterations; backward bytes are
the sizes of the backward exchanges (all ranks' rows counted once per sender).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import CudaTimer, init_distributed, moe_config, write_json  # noqa: E402


def _variants(keeps: list[float], modes: list[str], selections: list[str], scopes: list[str]):
    from megatron_lrmoe import LRMoEConfig

    out = []
    for keep in keeps:
        for mode in modes:
            if keep >= 1.0:
                out.append(LRMoEConfig(keep_ratio=1.0, activation_mode=mode))
                continue
            for sel in selections:
                for scope in scopes:
                    out.append(
                        LRMoEConfig(keep_ratio=keep, selection=sel, activation_mode=mode, scope=scope)
                    )
    return out


def _stock_backward_bytes(layer: Any, hidden: int, elem: int) -> int:
    d = layer.token_dispatcher
    sent = int(sum(d.input_splits))
    recv = int(sum(d.output_splits))
    # grad of the combine (tokens -> experts), grad of the dispatch (experts -> tokens), probs.
    return sent * hidden * elem + recv * hidden * elem + recv * 4


def _measure(layer: Any, x: torch.Tensor, upstream: torch.Tensor, warmup: int, iters: int):
    timer = CudaTimer()
    peak = 0
    for it in range(warmup + iters):
        inp = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if it < warmup:
            out, _ = layer(inp)
            out.backward(upstream)
        else:
            out, _ = timer.time("fwd", lambda: layer(inp))
            timer.time("bwd", lambda: out.backward(upstream))
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        del out, inp
        for p in layer.parameters():
            p.grad = None
    return timer.median("fwd"), timer.median("bwd"), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per GPU")
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25])
    parser.add_argument("--modes", nargs="+", default=["save", "recompute"])
    parser.add_argument("--selections", nargs="+", default=["sample", "topk"])
    parser.add_argument("--scopes", nargs="+", default=["local"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock layer")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "layer_bench.json"))
    args = parser.parse_args()

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    rank = torch.distributed.get_rank()
    cfg = moe_config(ep)
    stock = None
    if not args.no_stock:
        stock = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(
            config=cfg, pg_collection=pg, layer_number=1
        ).cuda()
    lr = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).cuda()
    if stock is not None:
        lr.load_state_dict(stock.state_dict(), strict=False)
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        upstream = torch.randn_like(x)
        if stock is not None:
            fwd, bwd, peak = _measure(stock, x, upstream, args.warmup, args.iters)
            rows.append(dict(
                tokens=tokens, variant="stock MoELayer (SequentialMLP)", fwd_ms=fwd, bwd_ms=bwd,
                total_ms=fwd + bwd, peak_mem_gb=peak / 2**30,
                bwd_bytes=_stock_backward_bytes(stock, cfg.hidden_size, 2),
            ))
        for variant in _variants(args.keep, args.modes, args.selections, args.scopes):
            lr.lrmoe_config = variant
            fwd, bwd, peak = _measure(lr, x, upstream, args.warmup, args.iters)
            stats = lr.last_call_stats
            timings = stats.timings_ms
            rows.append(dict(
                tokens=tokens,
                variant=f"LRMoE keep={variant.keep_ratio} {variant.activation_mode} "
                f"{variant.selection if variant.keep_ratio < 1 else ''} "
                f"{variant.scope if variant.keep_ratio < 1 else ''}".strip(),
                config=dataclasses.asdict(variant),
                fwd_ms=fwd, bwd_ms=bwd, total_ms=fwd + bwd, peak_mem_gb=peak / 2**30,
                bwd_bytes=stats.backward_bytes, stock_bwd_bytes=stats.stock_backward_bytes,
                overhead_ms=sum(timings.get(k, 0.0) for k in ("scoring", "selection", "packing")),
                timings_ms=timings, kept_ratio=stats.kept_ratio,
            ))
        if rank == 0:
            for r in rows:
                if r["tokens"] == tokens:
                    print(
                        f"{tokens:6d} {r['variant']:42s} fwd {r['fwd_ms']:7.2f} bwd {r['bwd_ms']:7.2f}"
                        f" total {r['total_ms']:7.2f} ms  peak {r['peak_mem_gb']:6.2f} GB"
                        f"  bwd bytes {r['bwd_bytes'] / 2**20:8.1f} MiB"
                        f"  overhead {r.get('overhead_ms', 0.0):.3f} ms",
                        flush=True,
                    )
    if rank == 0:
        write_json(args.out, dict(ep=ep, device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
