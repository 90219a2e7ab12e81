"""Distributed workers of tests/test_auto_keep.py (module level, for the spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
from megatron_lrmoe.testing import (
    init_megatron_parallel,
    moe_transformer_config,
    skewed_routing_inputs,
    stock_moe_layer,
)

TOKENS = 64


def _inputs(rank: int, hidden: int, call: int, concentrated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and the gradient reaching the layer. ``concentrated``: one token in sixteen
    carries a gradient a thousand times the others' (nearly all score mass in few pairs, so few
    pairs carry the gradient); else every gradient row has the same norm."""
    x = skewed_routing_inputs(TOKENS, hidden, seed=11 + call, rank=rank)
    gen = torch.Generator().manual_seed(100 * call + rank)
    up = torch.randn(x.shape, generator=gen)
    up = up / up.norm(dim=1, keepdim=True)
    if concentrated:
        up[::16] *= 1000.0
    return x, up


def _step(layer, x: torch.Tensor, up: torch.Tensor) -> None:
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * up).sum().backward()


def auto_keep_schedule(rank: int, world: int, ep: int, lrmoe_kwargs: dict, phases: list) -> dict[str, Any]:
    """An ``"auto"`` layer through ``phases`` (``[(calls, concentrated), ...]``): the keep ratio
    each call ran with (from its quotas), the state's level after each call, and the kept pairs."""
    pg = init_megatron_parallel(ep=ep)
    cfg = moe_transformer_config(expert_model_parallel_size=ep, moe_aux_loss_coeff=0.0)
    layer = get_lrmoe_moe_spec(LRMoEConfig(**lrmoe_kwargs))(
        config=cfg, pg_collection=pg, layer_number=1
    )
    rank_in = torch.distributed.get_rank()
    planned, levels, kept, total = [], [], [], []
    call = 0
    for calls, concentrated in phases:
        for _ in range(calls):
            _step(layer, *_inputs(rank_in, cfg.hidden_size, call, concentrated))
            stats = layer.last_call_stats
            planned.append(layer.auto_keep.planned)
            kept.append(sum(stats.quota_per_expert))
            total.append(sum(stats.tokens_per_expert))
            levels.append(layer.auto_keep.level)
            call += 1
    return {"planned": planned, "levels": levels, "kept": kept, "total": total}


def auto_at_one_equals_keep1(rank: int, world: int, ep: int) -> dict[str, float]:
    """An ``"auto"`` layer whose target no keep ratio below 1 meets against a keep 1.0 layer
    with the same weights, over three calls: the largest differences of output, input gradient
    and router and expert gradients (0 when the measurement leaves the exact route alone), and
    the keep ratios the auto layer planned."""
    pg = init_megatron_parallel(ep=ep)
    cfg = moe_transformer_config(expert_model_parallel_size=ep, moe_aux_loss_coeff=0.0)
    layers = {
        name: get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        for name, lrmoe in (
            ("keep1", LRMoEConfig(keep_ratio=1.0)),
            ("auto", LRMoEConfig(keep_ratio="auto", variance_target=1e-30)),
        )
    }
    layers["auto"].load_state_dict(layers["keep1"].state_dict())
    diffs = {key: 0.0 for key in ("out", "dx", "router", "fc1", "fc2")}
    planned = []
    for call in range(3):
        x, up = _inputs(torch.distributed.get_rank(), cfg.hidden_size, call, call == 1)
        got = {}
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, _ = layer(xi)
            (out * up).sum().backward()
            got[name] = (out.detach(), xi.grad, layer.router.weight.grad, *(
                w.grad for w in layer.experts.weights()
            ))
        for key, a, b in zip(diffs, got["keep1"], got["auto"]):
            diffs[key] = max(diffs[key], (a - b).abs().max().item())
        planned.append(layers["auto"].auto_keep.planned)
    return {**diffs, "planned": planned}


def auto_under_budgets(rank: int, world: int, ep: int) -> list[dict[str, Any]]:
    """``"auto"`` with a memory budget no quota meets, and with an exchange budget of a third of
    stock's, beside keep 1.0 with the same exchange budget: kept pairs and quotas per call."""
    pg = init_megatron_parallel(ep=ep)
    cfg = moe_transformer_config(expert_model_parallel_size=ep, moe_aux_loss_coeff=0.0)
    stock_exchange = TOKENS * cfg.moe_router_topk * cfg.hidden_size * 4
    cases = [
        dict(keep_ratio="auto", variance_target=0.1, memory_budget_bytes=1),
        dict(keep_ratio="auto", variance_target=1e-30, exchange_budget_bytes=stock_exchange // 3),
        dict(keep_ratio=1.0, exchange_budget_bytes=stock_exchange // 3),
    ]
    out, first = [], None
    for kwargs in cases:
        layer = get_lrmoe_moe_spec(LRMoEConfig(**kwargs))(
            config=cfg, pg_collection=pg, layer_number=1
        )
        if first is None:
            first = layer.state_dict()
        layer.load_state_dict(first)  # the same weights, so the same routing, in every case
        quota, kept = [], []
        for call in range(3):
            _step(layer, *_inputs(torch.distributed.get_rank(), cfg.hidden_size, call, True))
            stats = layer.last_call_stats
            quota.append(sum(stats.quota_per_expert))
            kept.append(stats.kept_pairs_sent)
        out.append({"case": kwargs, "quota": quota, "kept": kept})
    return out
