"""LRMoE at keep ratio 1.0 against stock ``MoELayer`` on GPUs (NCCL, bf16).

    torchrun --nproc_per_node=2 benchmarks/gpu_equivalence.py --out eq.json
    torchrun --nproc_per_node=1 benchmarks/gpu_equivalence.py --experts 16 --fused --out eq.json

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

from benchmarks.common import (  # noqa: E402
    QWEN3_30B_A3B_MOE,
    attach_main_grad,
    expert_grads,
    init_distributed,
    moe_config,
    write_json,
)


def _grads(layer: Any, x: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(up.to(out.dtype))
    router = layer.router.weight
    if hasattr(router, "main_grad"):  # --fused: every gradient went into main_grad
        w1, w2 = layer.experts.weights()
        grads = (router.main_grad, w1.main_grad, w2.main_grad)
    else:
        grads = (router.grad, *expert_grads(layer))
    res = {"out": out.detach().float(), "dx": x.grad.float()}
    res["router"], res["fc1"], res["fc2"] = (g.float() for g in grads)
    for p in layer.parameters():
        p.grad = None
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--experts", type=int, default=QWEN3_30B_A3B_MOE["num_moe_experts"])
    parser.add_argument(
        "--fused",
        action="store_true",
        help="LRMoE with an fp32 main_grad on every parameter and the expert weight gradients "
        "added into it by the layer (--lrmoe-grad-accumulation-fusion on, as in training)",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_equivalence.json"))
    args = parser.parse_args()

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    # No GPU (a smoke run of this script): the CPU shim and gloo.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pg = init_distributed(ep, device)
    rank = torch.distributed.get_rank()
    layers = {}
    experts = dict(num_moe_experts=args.experts)
    for name, dtype in (("stock_fp32", torch.float32), ("stock_bf16", torch.bfloat16)):
        cfg = moe_config(ep, dtype=dtype, **experts)
        layers[name] = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(
            config=cfg, pg_collection=pg, layer_number=1
        ).to(device)
    cfg = moe_config(ep, dtype=torch.bfloat16, **experts)
    fusion = "on" if args.fused else "off"
    layers["lrmoe_bf16"] = get_lrmoe_moe_spec(
        LRMoEConfig(keep_ratio=1.0, grad_accumulation_fusion=fusion)
    )(config=cfg, pg_collection=pg, layer_number=1).to(device)
    # One set of bf16-representable weights for all three.
    ref = {k: v.to(torch.bfloat16) for k, v in layers["stock_bf16"].state_dict().items() if torch.is_tensor(v)}
    layers["stock_fp32"].load_state_dict({k: v.float() for k, v in ref.items()}, strict=False)
    layers["lrmoe_bf16"].load_state_dict(ref, strict=False)
    if args.fused:
        attach_main_grad(layers["lrmoe_bf16"])

    gen = torch.Generator(device=device).manual_seed(7 + rank)
    x = torch.randn(args.tokens, 1, QWEN3_30B_A3B_MOE["hidden_size"], device=device, generator=gen)
    x = x.to(torch.bfloat16)
    up = torch.randn(x.shape, device=device, generator=gen).to(torch.bfloat16)
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
        write_json(args.out, dict(ep=ep, tokens=args.tokens, experts=args.experts,
                                  fused=args.fused, factor=args.factor, ranks=gathered))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: LRMoE bf16 outside tolerance")


if __name__ == "__main__":
    main()
