"""Per-rank bodies of tests/test_replicas.py (module level so that spawn can pickle them).

Every rank builds the same seeded problem; the controller places replicas of hot experts
(``LRMoEConfig.max_replicas_per_rank``) and the layer computes them. Shape legend: T tokens per
rank, H hidden, E experts, L owned experts per rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import lrmoe_workers as w
from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
from megatron_lrmoe.testing import init_megatron_parallel, stock_moe_layer

REPLICAS = 2  # max_replicas_per_rank of every replica case


def _grads(layer) -> dict[str, torch.Tensor]:
    w1, w2 = layer.experts.weights()
    return {"router": layer.router.weight.grad, "fc1": w1.grad, "fc2": w2.grad}


def _stock_grads(stock) -> dict[str, torch.Tensor]:
    experts = stock.experts.local_experts
    return {
        "router": stock.router.weight.grad,
        "fc1": torch.stack([e.linear_fc1.weight.grad for e in experts]),
        "fc2": torch.stack([e.linear_fc2.weight.grad for e in experts]),
    }


def _diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: (a[k] - b[k]).abs().max().item() for k in a}


def _scales(a: dict) -> dict[str, float]:
    return {k: a[k].abs().max().item() for k in a}


def keep1_cases(rank: int, world: int, ep: int, cases: list[tuple[dict, Optional[str]]]) -> list:
    """Keep 1.0 with replicas against keep 1.0 without them and against stock ``MoELayer``."""
    pg = init_megatron_parallel(ep=ep)
    return [keep1_case(pg, ep, overrides, routing) for overrides, routing in cases]


def keep1_case(pg, ep: int, overrides: dict, routing: Optional[str]) -> dict[str, Any]:
    cfg = w._config(ep, **overrides)
    ep_rank = pg.ep.rank()
    stock = stock_moe_layer(cfg, pg)
    w._apply_routing(stock.router, routing, cfg.num_moe_experts, ep_rank, ep)
    runs: dict[str, dict] = {}
    x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
    a = w._run(stock, x, up)
    runs["stock"] = dict(a, **_stock_grads(stock))
    facts = {}
    for name, replicas in (("plain", 0), ("replicas", REPLICAS)):
        lrmoe = LRMoEConfig(keep_ratio=1.0, max_replicas_per_rank=replicas, debug_check_invariants=True)
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        w._copy_stock_into_lrmoe(stock, layer)
        w._apply_routing(layer.router, routing, cfg.num_moe_experts, ep_rank, ep)
        b = w._run(layer, x, up)
        runs[name] = dict(b, **_grads(layer))
        facts[name] = w._replica_facts(layer.last_call_stats)
        facts[name]["summary"] = layer.last_call_stats.control_summary
    keys = ("out", "dx", "router", "fc1", "fc2")
    pick = lambda d: {k: d[k] for k in keys}  # noqa: E731
    return {
        "case": (overrides, routing),
        "scales": _scales(pick(runs["stock"])),
        "vs_stock": _diffs(pick(runs["replicas"]), pick(runs["stock"])),
        "vs_plain": _diffs(pick(runs["replicas"]), pick(runs["plain"])),
        "plain_vs_stock": _diffs(pick(runs["plain"]), pick(runs["stock"])),
        "facts": facts["replicas"],
        "summary": facts["replicas"]["summary"],
    }


def dense_reference_cases(rank: int, world: int, ep: int, cases: list) -> list[dict[str, Any]]:
    """``lrmoe_workers.lrmoe_vs_dense_reference`` for replica cases (plus the weights' grads)."""
    pg = init_megatron_parallel(ep=ep)
    return [w.lrmoe_vs_dense_reference(pg, ep, *case) for case in cases]


def on_off_cases(rank: int, world: int, ep: int, cases: list[dict]) -> list[dict[str, Any]]:
    """The same call with replicas on and off (recompute mode selects the same pairs either
    way); gradients, outputs and kept masks of both."""
    pg = init_megatron_parallel(ep=ep)
    out = []
    for kwargs in cases:
        cfg = w._config(ep, moe_aux_loss_coeff=0.0)
        x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
        state = None
        runs = {}
        for replicas in (0, REPLICAS):
            lrmoe = LRMoEConfig(
                max_replicas_per_rank=replicas, debug_record_selection=True, **kwargs
            )
            layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
            if state is None:
                state = layer.state_dict()
            else:
                layer.load_state_dict(state)
            got = w._run(layer, x, up)
            stats = layer.last_call_stats
            runs[replicas] = dict(got, **_grads(layer), mask=stats.kept_mask, placed=stats.replicas_placed)
        keys = ("out", "dx", "router", "fc1", "fc2")
        out.append(
            {
                "case": kwargs,
                "scales": _scales({k: runs[0][k] for k in keys}),
                "diffs": _diffs({k: runs[REPLICAS][k] for k in keys}, {k: runs[0][k] for k in keys}),
                "same_mask": torch.equal(runs[0]["mask"], runs[REPLICAS]["mask"]),
                "placed": runs[REPLICAS]["placed"],
            }
        )
    return out
