"""The controller's cost model (control/costs.py) against what the layers really save.

The memory plan and the memory budget rest on bytes per pair that ``CostModel`` states from the
shapes alone. Here both layers run a forward under a saved-tensor hook that records every tensor
autograd keeps for backward (unique storages, parameters and the layer input excluded), and the
bytes per pair are compared with the model: stock ``MoELayer`` (``SequentialMLP``), LRMoE at keep
1.0 and keep 0.5 in ``save`` and ``recompute`` mode, at EP 1 and EP 2.

Shapes: T tokens per rank, H hidden, F expert FFN (F1 = 2F gated), E experts, K top-k. H is large
next to E so that the router's per-token tensors (logits, probs: E values per token) stay a few
percent of the per-pair rows.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lrmoe.testing import run_distributed

H, F, E, K, T = 256, 128, 8, 2, 96
TIMEOUT_S = 300


def _saved_bytes(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves in one forward of ``layer`` on ``x``."""
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    out.sum().backward()  # the graph must be complete and usable
    return sum(seen.values())


def costs_worker(rank: int, world: int) -> dict:
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.control.costs import CostModel
    from megatron_lrmoe.testing import init_megatron_parallel
    from megatron_lrmoe.testing.models import moe_transformer_config, stock_moe_layer

    pg = init_megatron_parallel(ep=world)
    cfg = moe_transformer_config(
        hidden_size=H, moe_ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K,
        num_attention_heads=4,
    )
    stock = stock_moe_layer(cfg, pg)
    lrmoe = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1)
    lrmoe.load_state_dict(stock.state_dict(), strict=False)
    x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(rank + 7), requires_grad=True)
    pairs = T * K  # every token routes to K experts; each rank computes about as many
    result = {"stock": _saved_bytes(stock, x) / pairs}
    variants = {
        "keep1": LRMoEConfig(),
        "save": LRMoEConfig(keep_ratio=0.5),
        "recompute": LRMoEConfig(keep_ratio=0.5, activation_mode="recompute"),
        "recompute_keep1": LRMoEConfig(activation_mode="recompute"),  # the exact path
    }
    variants["lean"] = LRMoEConfig(keep_ratio=0.5, activation_mode="lean")
    # lean's router gradient: the gradient rows and fc2's input gradient of every computed pair,
    # measured where both are live (the one fc2 input-gradient GEMM of the trimmed backward).
    from megatron_lrmoe.op import trimmed

    router_rows: list[int] = []
    real_mm = trimmed.grouped_mm_nn

    def spy_mm(rows: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = real_mm(rows, *args, **kwargs)
        router_rows.append(rows.numel() * rows.element_size() + out.numel() * out.element_size())
        return out

    trimmed.grouped_mm_nn = spy_mm
    try:
        for name, config in variants.items():
            lrmoe.lrmoe_config = config
            stats = []
            handle = lrmoe.add_stats_listener(lambda _n, s: stats.append(s))
            saved = _saved_bytes(lrmoe, x)
            handle.remove()
            computed = stats[-1].forward_rows  # pairs this rank's experts computed
            result[name] = (saved, computed)
    finally:
        trimmed.grouped_mm_nn = real_mm
    result["router_rows"] = router_rows  # lean's call alone runs that GEMM
    cost = CostModel.from_config(cfg)
    result["model"] = {
        "stock": cost.stock_saved_bytes,
        "expert_save": cost.expert_saved_bytes("save"),
        "expert_save_local": cost.expert_saved_bytes("save", local_tokens=True),
        "source_trim": cost.source_saved_bytes("save", keeps_all=False),
        "source_recompute": cost.source_saved_bytes("recompute", keeps_all=False),
        "expert_lean": cost.expert_saved_bytes("lean"),
        "source_lean": cost.source_saved_bytes("lean", keeps_all=False),
        "router_lean": cost.router_bytes("lean"),
        "router_other": [cost.router_bytes(m) for m in ("save", "recompute")]
        + [cost.router_bytes("lean", keeps_all=True)],
        "row": cost.row_bytes,
    }
    result["pairs"] = pairs
    return result


@pytest.mark.parametrize("ep", [1, 2])
def test_cost_model_matches_saved_bytes(ep: int) -> None:
    for rank, res in enumerate(run_distributed(costs_worker, ep, timeout=TIMEOUT_S)):
        model, pairs = res["model"], res["pairs"]
        where = f"EP {ep} rank {rank}"
        # Stock: the model's rows per pair, plus the router's per-token tensors (logits, probs,
        # indices; E values per token), which the model leaves out.
        assert model["stock"] <= res["stock"] <= 1.2 * model["stock"], (where, res)
        saved, computed = res["keep1"]
        assert 1.0 <= saved / (model["expert_save"] * computed) <= 1.05, (where, "keep1", res)
        saved, computed = res["save"]
        # At EP 1 the trimmed path reads x from the layer input: the plan's local_tokens term.
        expert = model["expert_save_local"] if ep == 1 else model["expert_save"]
        planned = expert * computed + model["source_trim"] * pairs
        assert 1.0 <= saved / planned <= 1.05, (where, "save", res)
        saved, _ = res["recompute"]
        assert 1.0 <= saved / (model["source_recompute"] * pairs) <= 1.05, (where, "recompute", res)
        # Keep 1.0 runs the exact path in every mode: x and h, as the plan counts it.
        saved, computed = res["recompute_keep1"]
        assert 1.0 <= saved / (model["expert_save"] * computed) <= 1.05, (where, "keep1 rc", res)
        # lean: the activation (F per computed pair) instead of recompute's z per sent pair;
        # beyond the rows, what recompute saves beyond z (the router's per-token tensors) give
        # or take one int64 index per pair (which of the layer's cached plans a mode saves).
        saved, computed = res["lean"]
        assert model["source_lean"] == 0
        extra = res["recompute"][0] - model["source_recompute"] * pairs
        rows = model["expert_lean"] * computed
        assert rows <= saved <= rows + extra + 8 * pairs, (where, "lean", res)
        # lean's router-gradient rows, live before the kept pairs' backward: exactly the model's
        # bytes per computed pair (the budget holds them, control/costs.py), and only in lean.
        assert res["router_rows"] == [model["router_lean"] * computed], (where, "router", res)
        assert model["router_other"] == [0, 0, 0]
        # The reference the memory goal is measured against is stock's larger footprint.
        assert res["stock"] > res["keep1"][0] / pairs
