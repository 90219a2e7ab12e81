"""LRMoE at keep ratio 1.0 against stock ``MoELayer`` on GPUs (NCCL, bf16).

    torchrun --nproc_per_node=2 benchmarks/gpu_equivalence.py --out eq.json

bf16 results of two different kernel orders cannot agree bit for bit, so the tolerance is
measured, not guessed: both bf16 layers are compared with an fp32 run of the stock layer on the
same (bf16-representable) weights and inputs. LRMoE passes when, for every quantity, its error
against fp32 is at most ``--factor`` (default 2) times stock bf16's own error against fp32, plus
one bf16 ulp of the quantity's scale.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import QWEN3_30B_A3B_MOE, init_distributed, moe_config, write_json  # noqa


def _grads(layer: Any, x: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(up.to(out.dtype))
    res = {"out": out.detach().float(), "dx": x.grad.float(), "router": layer.router.weight.grad.float()}
    if hasattr(layer.experts, "weights"):  # LRGroupedMLP: one [L, ...] parameter per projection
        res["fc1"], res["fc2"] = (w.grad.float() for w in layer.experts.weights())
    else:  # SequentialMLP: one parameter per expert
        res["fc1"] = torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts]).float()
        res["fc2"] = torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts]).float()
    for p in layer.parameters():
        p.grad = None
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_equivalence.json"))
    args = parser.parse_args()

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    rank = torch.distributed.get_rank()
    layers = {}
    for name, dtype in (("stock_fp32", torch.float32), ("stock_bf16", torch.bfloat16)):
        cfg = moe_config(ep, dtype=dtype)
        layers[name] = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(
            config=cfg, pg_collection=pg, layer_number=1
        ).cuda()
    cfg = moe_config(ep, dtype=torch.bfloat16)
    layers["lrmoe_bf16"] = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=1.0))(
        config=cfg, pg_collection=pg, layer_number=1
    ).cuda()
    # One set of bf16-representable weights for all three.
    ref = {k: v.to(torch.bfloat16) for k, v in layers["stock_bf16"].state_dict().items() if torch.is_tensor(v)}
    layers["stock_fp32"].load_state_dict({k: v.float() for k, v in ref.items()}, strict=False)
    layers["lrmoe_bf16"].load_state_dict(ref, strict=False)

    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(args.tokens, 1, QWEN3_30B_A3B_MOE["hidden_size"], device="cuda", generator=gen)
    x = x.to(torch.bfloat16)
    up = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    res = {
        "stock_fp32": _grads(layers["stock_fp32"], x.float(), up.float()),
        "stock_bf16": _grads(layers["stock_bf16"], x, up),
        "lrmoe_bf16": _grads(layers["lrmoe_bf16"], x, up),
    }
    report = {}
    ok = True
    for key in res["stock_fp32"]:
        truth = res["stock_fp32"][key]
        scale = truth.abs().max().item()
        ulp = scale * 2.0**-8
        stock_err = (res["stock_bf16"][key] - truth).abs().max().item()
        lr_err = (res["lrmoe_bf16"][key] - truth).abs().max().item()
        lr_vs_stock = (res["lrmoe_bf16"][key] - res["stock_bf16"][key]).abs().max().item()
        passed = lr_err <= args.factor * stock_err + ulp
        ok &= passed
        report[key] = dict(scale=scale, stock_bf16_vs_fp32=stock_err, lrmoe_bf16_vs_fp32=lr_err,
                           lrmoe_vs_stock_bf16=lr_vs_stock, passed=passed)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, report)
    if rank == 0:
        for r, rep in enumerate(gathered):
            for key, v in rep.items():
                print(f"rank {r} {key:6s} scale {v['scale']:.3e}  stock-bf16 err {v['stock_bf16_vs_fp32']:.3e}"
                      f"  lrmoe-bf16 err {v['lrmoe_bf16_vs_fp32']:.3e}  |lrmoe-stock| "
                      f"{v['lrmoe_vs_stock_bf16']:.3e}  {'PASS' if v['passed'] else 'FAIL'}", flush=True)
        write_json(args.out, dict(ep=ep, tokens=args.tokens, factor=args.factor, ranks=gathered))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: LRMoE bf16 outside tolerance")


if __name__ == "__main__":
    main()
