"""Per-rank bodies of the multi-process layer tests (module level so that spawn can pickle them).

Every rank builds the same seeded problem, runs its shard through a real megatron-core layer and
returns what the test compares. Shape legend: T tokens per rank, H hidden, E experts, L local.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lrmoe import KernelOptions, LRMoEConfig, get_lrmoe_moe_spec
from megatron_lrmoe.experts.grouped_gemm import grouped_mm_backend
from megatron_lrmoe.testing import (
    init_megatron_parallel,
    moe_transformer_config,
    skewed_routing_inputs,
    stock_moe_layer,
)

TOKENS = 24


def _forced_routing(name: str, num_experts: int, ep_rank: int, ep: int):
    """A ``TopKRouter.routing`` replacement that forces a degenerate routing map.

    Probabilities stay differentiable functions of the router logits (softmax restricted to the
    forced experts), so the router gradient is still exercised.
    """
    local = num_experts // ep

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        logits = logits.view(-1, num_experts)
        t = logits.shape[0]
        routing_map = torch.zeros(t, num_experts, dtype=torch.bool, device=logits.device)
        if name == "one_expert":  # every token of every rank to expert 0; the rest get nothing
            routing_map[:, 0] = True
        elif name == "stay_home":  # each rank routes only to its own experts: sends nothing away
            routing_map[:, ep_rank * local] = True
            routing_map[: t // 2, ep_rank * local + local - 1] = True
        elif (
            name == "first_rank_only"
        ):  # only rank 0's experts receive: other ranks receive nothing
            routing_map[:, 0] = True
            routing_map[::3, local - 1] = True
        elif name == "hot_expert0":  # every token takes expert 0, the router picks the rest
            raised = torch.full_like(logits[:, :1], float(logits.detach().max()) + 1.0)
            logits = torch.cat([raised, logits[:, 1:]], dim=1)
            top = torch.topk(logits, k=self.topk, dim=-1).indices
            routing_map.scatter_(1, top, True)
        elif name == "idle_last_rank":  # the last rank routes no token; the others flood expert 0
            if ep_rank != ep - 1:
                routing_map[:, 0] = True
                routing_map[::2, 1] = True
        else:
            raise ValueError(name)
        scores = torch.softmax(logits.float(), dim=-1) * routing_map
        # A token routed nowhere has no pairs and routing weights 0 (not 0 / 0).
        probs = scores / scores.sum(-1, keepdim=True).clamp(min=1e-30)
        return probs, routing_map

    return routing


def _apply_routing(router, name: Optional[str], num_experts: int, ep_rank: int, ep: int) -> None:
    import types

    if name is not None:
        router.routing = types.MethodType(_forced_routing(name, num_experts, ep_rank, ep), router)


def _config(ep: int, **overrides: Any):
    return moe_transformer_config(expert_model_parallel_size=ep, **overrides)


def _copy_stock_into_lrmoe(stock, lr) -> None:
    """Give the LRMoE layer the stock layer's weights (experts through the checkpoint hooks)."""
    missing, unexpected = lr.load_state_dict(stock.state_dict(), strict=False)
    bad = [k for k in missing + unexpected if "_extra_state" not in k]
    assert not bad, f"state dict keys do not line up: {bad}"


def _inputs(rank: int, hidden: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    x = skewed_routing_inputs(TOKENS, hidden, seed=seed, rank=rank)
    gen = torch.Generator().manual_seed(1000 + rank)
    upstream = torch.randn(x.shape, generator=gen)
    return x, upstream


def _run(layer, x: torch.Tensor, upstream: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "dx": x.grad.detach()}


def stock_vs_lrmoe_keep1_cases(
    rank: int, world: int, ep: int, cases: list[dict]
) -> list[dict[str, float]]:
    """``stock_vs_lrmoe_keep1`` for several config overrides."""
    pg = init_megatron_parallel(ep=ep)
    return [stock_vs_lrmoe_keep1(pg, ep, overrides) for overrides in cases]


def _attention_parallel(pg, ep: int, tp: int, cp: int) -> dict[str, Any]:
    """Config overrides for attention tensor (sequence-parallel) / context parallelism with
    expert TP 1, after checking the groups: each TP or CP rank routes its own tokens and the EP
    group spans those ranks."""
    assert pg.tp.size() == tp and pg.cp.size() == cp and pg.ep.size() == ep
    assert pg.expt_tp.size() == 1
    overrides: dict[str, Any] = dict(expert_tensor_parallel_size=1)
    if tp > 1:
        overrides.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if cp > 1:
        overrides.update(context_parallel_size=cp)
    return overrides


def stock_vs_lrmoe_keep1_parallel_cases(
    rank: int, world: int, ep: int, cases: list[dict], tp: int = 1, cp: int = 1
) -> list[dict[str, float]]:
    """``stock_vs_lrmoe_keep1`` with attention tensor or context parallelism
    (:func:`_attention_parallel`)."""
    pg = init_megatron_parallel(ep=ep, tp=tp, cp=cp)
    extra = _attention_parallel(pg, ep, tp, cp)
    return [stock_vs_lrmoe_keep1(pg, ep, dict(extra, **c)) for c in cases]


def stock_vs_lrmoe_keep1(pg, ep: int, overrides: dict) -> dict[str, float]:
    """Max abs differences (and scales) between the stock MoELayer and LRMoE at keep 1.0."""
    cfg = _config(ep, **overrides)
    stock = stock_moe_layer(cfg, pg)
    lr = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=1.0))(
        config=cfg, pg_collection=pg, layer_number=1
    )
    _copy_stock_into_lrmoe(stock, lr)
    x, up = _inputs(torch.distributed.get_rank(), cfg.hidden_size)
    a = _run(stock, x, up)
    b = _run(lr, x, up)
    diffs = {
        "out": (a["out"] - b["out"]).abs().max().item(),
        "dx": (a["dx"] - b["dx"]).abs().max().item(),
        "router": (stock.router.weight.grad - lr.router.weight.grad).abs().max().item(),
        "scale_out": a["out"].abs().max().item(),
        "scale_dx": a["dx"].abs().max().item(),
        "scale_router": stock.router.weight.grad.abs().max().item(),
        "scale_fc1": max(
            e.linear_fc1.weight.grad.abs().max().item() for e in stock.experts.local_experts
        ),
        "scale_fc2": max(
            e.linear_fc2.weight.grad.abs().max().item() for e in stock.experts.local_experts
        ),
    }
    lr_fc1_grad, lr_fc2_grad = (w.grad for w in lr.experts.weights())
    for i, expert in enumerate(stock.experts.local_experts):
        diffs["fc1"] = max(
            diffs.get("fc1", 0.0),
            (expert.linear_fc1.weight.grad - lr_fc1_grad[i]).abs().max().item(),
        )
        diffs["fc2"] = max(
            diffs.get("fc2", 0.0),
            (expert.linear_fc2.weight.grad - lr_fc2_grad[i]).abs().max().item(),
        )
    if stock.use_shared_expert:
        for (n, p), (_, q) in zip(
            stock.shared_experts.named_parameters(), lr.shared_experts.named_parameters()
        ):
            diffs["shared"] = max(diffs.get("shared", 0.0), (p.grad - q.grad).abs().max().item())
    return diffs


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies row i of the gradient by ``weight[i]``."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return g * weight.to(g.dtype).unsqueeze(-1), None


def _dense_reference(
    router_state: dict,
    cfg,
    w1_full: torch.Tensor,
    w2_full: torch.Tensor,
    xs: list[torch.Tensor],
    ups: list[torch.Tensor],
    pair_weights: list[torch.Tensor],
    pg,
    routing: Optional[str] = None,
) -> dict[str, Any]:
    """Every pair computed densely, gradient of pair i scaled by its weight (0 = dropped).

    The routing weight multiplies the expert output outside the gradient scaling, so the router
    gradient stays exact, as LRMoE promises.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_lrmoe.experts.activation import activation_spec_from_config
    from megatron_lrmoe.experts.reference import reference_activation

    spec = activation_spec_from_config(cfg)
    w1 = w1_full.clone().requires_grad_(True)
    w2 = w2_full.clone().requires_grad_(True)
    result: dict[str, Any] = {"dx": [], "router": [], "out": []}
    for src, (x, up, pw) in enumerate(zip(xs, ups, pair_weights)):
        router = TopKRouter(config=cfg, pg_collection=pg)
        router.load_state_dict(router_state)
        _apply_routing(router, routing, cfg.num_moe_experts, src, len(xs))
        x = x.clone().requires_grad_(True)
        flat = x.reshape(-1, x.shape[-1])
        probs, routing_map = router(flat)
        expert_ids, token_ids = routing_map.t().nonzero(as_tuple=True)  # the permuted order
        # Tied to x and probs by zero terms, so a rank that routes no pair still has gradients.
        out = flat * 0.0 + probs.sum() * 0.0
        for i, (e, t) in enumerate(zip(expert_ids.tolist(), token_ids.tolist())):
            h = flat[t] @ w1[e].t()
            z = reference_activation(h.unsqueeze(0), spec) @ w2[e].t()
            z = _ScaleGrad.apply(z, pw[i : i + 1])
            out[t] = out[t] + (probs[t, e] * z[0]).to(out.dtype)
        out = out.view_as(x)
        (out * up).sum().backward()
        result["dx"].append(x.grad.detach())
        result["router"].append(router.weight.grad.detach())
        result["out"].append(out.detach())
    result["w1"] = w1.grad.detach()
    result["w2"] = w2.grad.detach()
    return result


def lrmoe_vs_dense_reference_cases(
    rank: int,
    world: int,
    ep: int,
    cases: list[tuple[dict, dict, Optional[str]]],
    tp: int = 1,
    cp: int = 1,
) -> list[dict[str, Any]]:
    """``lrmoe_vs_dense_reference`` for several (lrmoe kwargs, config overrides, routing) cases;
    with ``tp`` or ``cp`` above 1, attention is tensor / context parallel
    (:func:`_attention_parallel`)."""
    pg = init_megatron_parallel(ep=ep, tp=tp, cp=cp)
    if tp > 1 or cp > 1:
        extra = _attention_parallel(pg, ep, tp, cp)
        cases = [(lrmoe, dict(extra, **overrides), routing) for lrmoe, overrides, routing in cases]
    return [lrmoe_vs_dense_reference(pg, ep, *case) for case in cases]


def lrmoe_vs_dense_reference(
    pg, ep: int, lrmoe_kwargs: dict, overrides: dict, routing: Optional[str] = None
) -> dict[str, Any]:
    """LRMoE at keep < 1 against the dense masked reference with the same selection."""
    cfg = _config(ep, **overrides)
    lrmoe = LRMoEConfig(debug_record_selection=True, **lrmoe_kwargs)
    lr = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
    ep_rank = pg.ep.rank() if ep > 1 else 0
    _apply_routing(lr.router, routing, cfg.num_moe_experts, ep_rank, ep)
    x, up = _inputs(torch.distributed.get_rank(), cfg.hidden_size)
    got = _run(lr, x, up)
    stats = lr.last_call_stats
    group = pg.ep
    # Everything the reference needs, from every rank of the EP group.
    xs = _all_gather_list(x, group)
    ups = _all_gather_list(up, group)
    weights = _all_gather_list(stats.kept_weight, group)
    w1_local, w2_local = (w.detach() for w in lr.experts.weights())
    w1_full = torch.cat(_all_gather_list(w1_local, group))
    w2_full = torch.cat(_all_gather_list(w2_local, group))
    fc1_grad, fc2_grad = (w.grad for w in lr.experts.weights())
    ref = _dense_reference(
        lr.router.state_dict(), cfg, w1_full, w2_full, xs, ups, weights, pg, routing
    )
    src = pg.ep.rank() if ep > 1 else 0
    L = lr.num_local_experts
    sl = slice(src * L, (src + 1) * L)
    scale = lambda t: t.abs().max().item()  # noqa: E731
    return {
        "case": (lrmoe_kwargs, overrides, routing),
        "scales": {
            "out": scale(ref["out"][src]),
            "dx": scale(ref["dx"][src]),
            "router": scale(ref["router"][src]),
            "fc1": scale(ref["w1"]),
            "fc2": scale(ref["w2"]),
        },
        "w1_grad": fc1_grad.clone(),
        "global_counts": lr.token_dispatcher.global_counts.clone(),
        "out": (got["out"] - ref["out"][src]).abs().max().item(),
        "dx": (got["dx"] - ref["dx"][src]).abs().max().item(),
        "router": (lr.router.weight.grad - ref["router"][src]).abs().max().item(),
        "fc1": (fc1_grad - ref["w1"][sl]).abs().max().item(),
        "fc2": (fc2_grad - ref["w2"][sl]).abs().max().item(),
        "kept": int((stats.kept_weight > 0).sum()),
        "pairs": stats.pairs_sent,
        "quota": stats.quota_per_expert,
        "kept_mask": stats.kept_mask,
        "kept_per_local_expert": stats.kept_per_local_expert,
        "grad_rows": stats.exchanges["grad"].rows,
        "dgrad_rows": stats.exchanges["dgrad"].rows,
        "exchange_rows": {name: (e.rows, e.bytes) for name, e in stats.exchanges.items()},
        "tokens_per_expert": stats.tokens_per_expert,
        "control": stats.control_summary,
        "replicas": _replica_facts(stats),
    }


def _replica_facts(stats: Any) -> dict[str, Any]:
    """What the call did with replicas, next to what its controller planned (this rank)."""
    control = stats.control
    facts = {
        "placed": stats.replicas_placed,
        "experts": stats.replica_experts,
        "fetched": stats.replicas_fetched,
        "forward_rows": stats.forward_rows,
        "forward_per_replica": stats.forward_per_replica,
        "kept_rows": stats.kept_rows,
        "kept_per_local_expert": stats.kept_per_local_expert,
        "kept_per_replica": stats.kept_per_replica,
        "planned_forward_peak": stats.planned_forward_peak,
        "planned_backward_peak": stats.planned_backward_peak,
        "replica_grad_rows": getattr(stats.exchanges.get("replica_grads"), "rows", 0),
    }
    if control is not None:
        facts["holds"] = control.holds.clone()
        facts["forward_load"] = control.forward_load.clone()
        facts["backward_load"] = control.backward_load.clone()
        facts["activation_mode"] = control.activation_mode
    return facts


def _all_gather_list(t: torch.Tensor, group: Optional[Any]) -> list[torch.Tensor]:
    """Every rank's ``t`` (shapes may differ across ranks), in rank order."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return [t]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, t, group=group)
    return out


def sample_mean_gradient(rank: int, world: int, n: int, scope: str) -> dict[str, torch.Tensor]:
    """Expert weight gradients: full backward, mean/std over ``n`` sampling seeds at keep 0.5,
    and top-k at keep 0.5."""
    import dataclasses

    pg = init_megatron_parallel(ep=world)
    cfg = _config(world, moe_aux_loss_coeff=0.0)
    lr = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1)
    x, up = _inputs(torch.distributed.get_rank(), cfg.hidden_size)

    def grads(lrmoe: LRMoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
        lr.lrmoe_config = lrmoe
        lr.zero_grad(set_to_none=True)
        _run(lr, x, up)
        return tuple(w.grad.clone() for w in lr.experts.weights())

    w1_full, w2_full = grads(LRMoEConfig(keep_ratio=1.0))
    base = LRMoEConfig(keep_ratio=0.5, selection="sample", scope=scope)
    draws = [grads(dataclasses.replace(base, seed=s)) for s in range(n)]
    w1s = torch.stack([d[0] for d in draws]).double()
    w2s = torch.stack([d[1] for d in draws]).double()
    w1_topk, _ = grads(LRMoEConfig(keep_ratio=0.5, selection="topk", scope=scope))
    return {
        "w1_full": w1_full.double(),
        "w2_full": w2_full.double(),
        "w1_sample_mean": w1s.mean(0),
        "w1_sample_std": w1s.std(0),
        "w2_sample_mean": w2s.mean(0),
        "w2_sample_std": w2s.std(0),
        "w1_topk": w1_topk.double(),
    }


def controller_cases(rank: int, world: int, ep: int) -> list[dict[str, Any]]:
    """LRMoE layers planned by the controller (budgets, ``auto``), each checked against the dense
    masked reference with the same selection, plus what the controller decided.

    Sizes: TOKENS tokens per rank, fp32, ``H`` hidden, top-k ``K``: stock's backward gradient
    exchange is ``TOKENS * K * H * 4`` bytes per rank, so a budget of a fraction of it binds.
    """
    pg = init_megatron_parallel(ep=ep)
    cfg = _config(ep)
    stock_exchange = TOKENS * cfg.moe_router_topk * cfg.hidden_size * 4
    cases = [
        # A budget that never binds: the same plan as no budget.
        dict(keep_ratio=0.5, exchange_budget_bytes=10 * stock_exchange),
        # A binding exchange budget at keep ratio 1: hot experts trimmed, the trimmed path runs.
        dict(keep_ratio=1.0, exchange_budget_bytes=stock_exchange // 3),
        # auto: the controller chooses save or recompute.
        dict(keep_ratio=0.5, activation_mode="auto", selection="topk"),
        # A memory budget no quota meets: nothing kept, the call still runs.
        dict(keep_ratio=0.5, memory_budget_bytes=1),
    ]
    return [lrmoe_vs_dense_reference(pg, ep, kw, dict(moe_aux_loss_coeff=0.0)) for kw in cases]


def cuda_partial_routing_rerun(rank: int, world: int, bf16: bool) -> dict[str, Any]:
    """EP 1 on the GPU with a partial routing map ("stay_home": fewer than topk pairs per
    token; Megatron's own dispatcher cannot take one): the first call reruns its forward on the
    rebuilt pair plan, the second waits for the counts and builds the plan once. Returns the
    largest difference between the two calls' results (same inputs, weights and math), and
    the dispatcher's full-routing flag after each call and after a call with a full map."""
    pg = init_megatron_parallel(ep=1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = _config(1, moe_aux_loss_coeff=0.0, bf16=bf16, params_dtype=dtype)
    # The test config initialises on the CPU (Megatron's router moves its own weight later).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def layer():
        return get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=1.0))(
            config=cfg, pg_collection=pg, layer_number=1
        ).to(device)

    lr = layer()
    _apply_routing(lr.router, "stay_home", cfg.num_moe_experts, 0, 1)
    x, up = (t.to(device, dtype) for t in _inputs(0, cfg.hidden_size))
    runs, flags = [], []
    for _ in range(2):
        for p in lr.parameters():
            p.grad = None
        got = _run(lr, x, up)
        got["router"] = lr.router.weight.grad.clone()
        got["fc1"], got["fc2"] = (w.grad.clone() for w in lr.experts.weights())
        runs.append(got)
        flags.append(lr.token_dispatcher.expect_full_routing)
    full = layer()
    _run(full, x, up)
    flags.append(full.token_dispatcher.expect_full_routing)
    diff = max((runs[0][k] - runs[1][k]).abs().max().item() for k in runs[0])
    return {
        "diff": diff,
        "flags": flags,
        "device": str(device),
        "backend": grouped_mm_backend(x, lr.experts.weights()[0]),
        "deferred": lr._gemms_take_device_offsets(x),
    }


def cuda_scoring_graph_matches_eager(rank: int, world: int) -> dict[str, Any]:
    """EP 1, bf16 on the GPU, keep 0.5 ``sample``: four calls of one shape in three modes,
    fresh layers with the same weights: ``front`` (the default: the router gradient's row-dot,
    the scoring, the selection and the packing replayed as one graph, captured on the second
    call), ``scored`` (``KernelOptions(front_graphs=False)``: the scoring inside the selection
    graph, the row-dot and packing launched eagerly) and ``eager``
    (``KernelOptions(score_graphs=False)``: the scoring launched before the replayed
    selection). Returns the largest difference of each
    graph mode from ``eager`` over outputs and the input, router and expert weight gradients,
    and the scoring graphs each mode left, with and without a front."""
    from megatron_lrmoe.graphs import front as front_graph
    from megatron_lrmoe.select import select_triton

    pg = init_megatron_parallel(ep=1)
    cfg = _config(1, moe_aux_loss_coeff=0.0, bf16=True, params_dtype=torch.bfloat16)
    device = torch.device("cuda")
    modes = {
        "front": KernelOptions(),
        "scored": KernelOptions(front_graphs=False),
        "eager": KernelOptions(score_graphs=False),
    }
    runs: dict[str, list[dict[str, torch.Tensor]]] = {}
    graphs = {}
    for mode, kernels in modes.items():
        select_triton.GRAPHS = select_triton._GraphCache()
        torch.manual_seed(5)
        lr = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=0.5, kernels=kernels))(
            config=cfg, pg_collection=pg, layer_number=1
        ).to(device)
        runs[mode] = []
        for call in range(4):
            x, up = (t.to(device, torch.bfloat16) for t in _inputs(0, cfg.hidden_size, 7 + call))
            for p in lr.parameters():
                p.grad = None
            got = _run(lr, x, up)
            got["router"] = lr.router.weight.grad.clone()
            got["fc1"], got["fc2"] = (w.grad.clone() for w in lr.experts.weights())
            runs[mode].append(got)
        captured = [
            v
            for v in select_triton.GRAPHS.graphs.values()
            if isinstance(v, front_graph._CapturedScored)
        ]
        graphs[mode] = {
            "front": sum(v.has_front for v in captured),
            "scored": sum(not v.has_front for v in captured),
        }
    diff = {
        mode: max(
            (a[k].float() - b[k].float()).abs().max().item()
            for a, b in zip(runs[mode], runs["eager"])
            for k in a
        )
        for mode in ("front", "scored")
    }
    return {"diff": diff, "graphs": graphs, "device": str(device)}


def cuda_expert_graph_matches_eager(rank: int, world: int) -> dict[str, Any]:
    """EP 1, bf16 on the GPU, keep 0.5, weight gradients fused into ``main_grad``: two layers
    (different weights, so two graphs sharing the buffers and the memory pool) run forward and
    backward on four inputs (the kept count changes), per case (``save`` with ``sample``,
    ``recompute`` with ``topk`` and ``overwrite_main_grad``: ``main_grad`` starting as NaN is
    written over, never read), with the whole trimmed backward replayed as one graph per
    layer (captured on the layer's second sighting once its shape has a shared set) and with
    ``KernelOptions(expert_graphs=False)``. Returns per case the largest
    difference of outputs, input and router gradients and ``main_grad`` (after every call) and
    the expert graphs each mode left."""
    from megatron_lrmoe.graphs import backward as bg

    pg = init_megatron_parallel(ep=1)
    cfg = _config(1, moe_aux_loss_coeff=0.0, bf16=True, params_dtype=torch.bfloat16)
    device = torch.device("cuda")
    cases = {
        "save_sample": dict(activation_mode="save", selection="sample"),
        "recompute_topk_overwrite": dict(activation_mode="recompute", selection="topk"),
    }
    result: dict[str, Any] = {"device": str(device), "diff": {}, "graphs": {}}
    for case, overrides in cases.items():
        runs: dict[str, list[torch.Tensor]] = {}
        modes = {"graph": KernelOptions(), "eager": KernelOptions(expert_graphs=False)}
        for mode, kernels in modes.items():
            bg.reset()
            lrmoe = LRMoEConfig(
                keep_ratio=0.5, grad_accumulation_fusion="on", kernels=kernels, **overrides
            )
            layers = []
            for number in (1, 2):
                torch.manual_seed(5 + number)
                layer = get_lrmoe_moe_spec(lrmoe)(
                    config=cfg, pg_collection=pg, layer_number=number
                ).to(device)
                overwrite = case.endswith("overwrite")
                for p in layer.experts.weights():
                    fill = float("nan") if overwrite else 0.0
                    p.main_grad = torch.full(p.shape, fill, dtype=torch.float32, device=device)
                    p.overwrite_main_grad = overwrite
                layers.append(layer)
            runs[mode] = []
            for call in range(4):
                for number, layer in enumerate(layers):
                    x, up = (
                        t.to(device, torch.bfloat16)
                        for t in _inputs(0, cfg.hidden_size, 7 + call + 10 * number)
                    )
                    got = _run(layer, x, up)
                    runs[mode] += [got["out"], got["dx"], layer.router.weight.grad.clone()]
                    runs[mode] += [p.main_grad.clone() for p in layer.experts.weights()]
                    layer.router.weight.grad = None
            result["graphs"].setdefault(case, {})[mode] = len(bg._GRAPHS.graphs)
        result["diff"][case] = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(runs["graph"], runs["eager"])
        )
    return result


def cuda_lean_matches_recompute(rank: int, world: int) -> dict[str, Any]:
    """EP 1, bf16 on the GPU, keep 0.5, weight gradients fused into ``main_grad``: the same
    layer (same weights, layer number and sampling stream) on four inputs in ``recompute`` and
    in ``lean`` mode. Returns whether the kept pairs were the same, the largest relative
    differences (outputs, input, router and weight gradients) and the memory each mode held
    between its forward and its backward, over the allocations before the forward."""
    pg = init_megatron_parallel(ep=1)
    cfg = _config(  # F < H, as in fine-grained MoE models (lean keeps F per pair, z is H)
        1, moe_aux_loss_coeff=0.0, bf16=True, params_dtype=torch.bfloat16, hidden_size=128,
        moe_ffn_hidden_size=64, num_attention_heads=4,
    )  # fmt: skip
    device = torch.device("cuda")
    inputs = [
        tuple(t.to(device, torch.bfloat16) for t in _inputs(0, cfg.hidden_size, 7 + call))
        for call in range(4)
    ]
    runs: dict[str, list[dict[str, torch.Tensor]]] = {}
    held: dict[str, int] = {}
    for mode in ("recompute", "lean"):
        torch.manual_seed(5)
        lrmoe = LRMoEConfig(
            keep_ratio=0.5, activation_mode=mode, grad_accumulation_fusion="on",
            debug_record_selection=True,
        )  # fmt: skip
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1).to(device)
        for p in layer.experts.weights():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
        runs[mode] = _run_calls(layer, inputs, main_grad=True)
        x = inputs[0][0].clone().requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out, _ = layer(x)
        held[mode] = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        out.float().sum().backward()
    same = _same_kept_and_diffs(runs["lean"], runs["recompute"])
    return {"device": str(device), "held": held, **same}


def _run_calls(lr, inputs, main_grad: bool) -> list[dict[str, torch.Tensor]]:
    """Forward and backward of ``lr`` on each ``(x, upstream)`` of ``inputs``: outputs, input
    and router gradients, the expert weight gradients (``main_grad`` after the call, or
    ``.grad``) and the kept mask of each call."""
    runs = []
    for x, up in inputs:
        for p in lr.parameters():
            p.grad = None
        got = _run(lr, x, up)
        got["router"] = lr.router.weight.grad.clone()
        grads = (w.main_grad if main_grad else w.grad for w in lr.experts.weights())
        got["fc1"], got["fc2"] = (t.clone() for t in grads)
        got["kept"] = lr.last_call_stats.kept_mask.clone()
        runs.append(got)
    return runs


def _same_kept_and_diffs(
    runs: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """Whether every call kept the same pairs, and the largest relative difference of outputs
    and gradients from ``ref``, call by call."""
    pairs = list(zip(runs, ref))
    return {
        "same_kept": all(torch.equal(a["kept"], b["kept"]) for a, b in pairs),
        "diff": {
            k: max(
                ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item()
                for a, b in pairs
            )
            for k in ("out", "dx", "router", "fc1", "fc2")
        },
    }


def interp_front_matches_stages(rank: int, world: int, selection: str) -> dict[str, Any]:
    """EP ``world`` (scope local) on the host, fp32, under ``TRITON_INTERPRET=1`` (set by the
    test before the spawn):
    the layer's backward through ``op.stages.replayed_front`` (the op told Triton may run, the
    CUDA graph replaced by re-running its launches, so its kernels run in the interpreter) against
    the same four keep-0.5 calls with ``KernelOptions(front_graphs=False)`` (the stages one by
    one, on the torch paths). Returns the largest differences of outputs and gradients,
    whether the kept pairs were the same, and the fronts captured."""
    from megatron_lrmoe.select import select_triton
    from megatron_lrmoe.testing.host_graphs import graphs_on_host

    graphs_on_host()
    pg = init_megatron_parallel(ep=world)
    cfg = _config(world, moe_aux_loss_coeff=0.0)
    inputs = [_inputs(rank, cfg.hidden_size, 7 + call) for call in range(4)]
    runs: dict[str, list[dict[str, torch.Tensor]]] = {}
    fronts = {}
    for mode in ("front", "stages"):
        kernels = KernelOptions(front_graphs=mode == "front")
        select_triton.GRAPHS = select_triton._GraphCache()
        torch.manual_seed(5)
        lrmoe = LRMoEConfig(
            keep_ratio=0.5, selection=selection, debug_record_selection=True, kernels=kernels
        )
        lr = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        runs[mode] = _run_calls(lr, inputs, main_grad=False)
        fronts[mode] = sum(
            getattr(v, "has_front", False) for v in select_triton.GRAPHS.graphs.values()
        )
    return {**_same_kept_and_diffs(runs["front"], runs["stages"]), "fronts": fronts}


def interp_graphed_backward_matches_stages(
    rank: int, world: int, selection: str, activation_mode: str
) -> dict[str, Any]:
    """EP 1 on the host, fp32, under ``TRITON_INTERPRET=1`` (set by the test before the spawn),
    weight gradients fused into ``main_grad``: the layer's backward through
    ``op.trimmed._graphed_backward`` (the whole trimmed backward as one graph per layer; the op
    told the graph may run, the CUDA graph replaced by re-running its launches, so its kernels
    run in the interpreter) against the same four keep-0.5 calls with
    ``KernelOptions(expert_graphs=False, front_graphs=False)`` (the stages one by one, on the
    torch paths). Every call has the
    same input, so the same kept count: on the host the room for rows must be exactly the kept
    ones (host group sizes add up to the rows), which headroom 0 gives. Returns the largest
    relative differences of outputs and gradients, whether the kept pairs were the same, and
    the layer graphs each mode left."""
    from megatron_lrmoe.graphs import backward as bg
    from megatron_lrmoe.select import select_triton
    from megatron_lrmoe.testing.host_graphs import layer_graphs_on_host

    layer_graphs_on_host()
    pg = init_megatron_parallel(ep=world)
    cfg = _config(world, moe_aux_loss_coeff=0.0)
    inputs = [_inputs(rank, cfg.hidden_size)] * 4
    runs: dict[str, list[dict[str, torch.Tensor]]] = {}
    graphs = {}
    for mode in ("graph", "stages"):
        on = mode == "graph"
        select_triton.GRAPHS = select_triton._GraphCache()
        bg.reset()
        torch.manual_seed(5)
        lrmoe = LRMoEConfig(
            keep_ratio=0.5, selection=selection, activation_mode=activation_mode,
            grad_accumulation_fusion="on", debug_record_selection=True,
            kernels=KernelOptions(expert_graphs=on, front_graphs=on),
        )
        lr = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        for p in lr.experts.weights():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        runs[mode] = _run_calls(lr, inputs, main_grad=True)
        graphs[mode] = len(bg._GRAPHS.graphs)
    return {**_same_kept_and_diffs(runs["graph"], runs["stages"]), "graphs": graphs}


# The fused accumulation's cases: keep 1.0, keep 0.5 in either activation mode.
_FUSED_CASES = (
    {},
    {"keep_ratio": 0.5, "activation_mode": "save"},
    {"keep_ratio": 0.5, "activation_mode": "recompute"},
)


def fused_accumulation_under_saved_tensor_hooks(rank: int, world: int) -> list[dict[str, Any]]:
    """``grad_accumulation_fusion="on"`` with saved-tensor hooks in force (what activation
    offloading and non-reentrant checkpointing install): the layer must still find the weights'
    ``main_grad`` (``ctx.saved_tensors`` gives back new tensor objects under hooks) and add into
    it. Per keep ratio and mode, against the unfused layer with the same weights and inputs."""
    pg = init_megatron_parallel(ep=world)
    out = []
    for keep in _FUSED_CASES:
        cfg = _config(world)
        x, upstream = _inputs(rank, cfg.hidden_size)
        runs = {}
        for fusion in ("off", "on"):
            torch.manual_seed(11)
            layer = get_lrmoe_moe_spec(LRMoEConfig(grad_accumulation_fusion=fusion, **keep))(
                config=cfg, pg_collection=pg, layer_number=1
            )
            weights = layer.experts.weights()
            gen = torch.Generator().manual_seed(5)
            starts = [torch.randn(p.shape, generator=gen) for p in weights]
            for p, s in zip(weights, starts):
                p.main_grad = s.clone()
            hooked = [0]

            def pack(t: torch.Tensor, hooked=hooked) -> torch.Tensor:
                hooked[0] += 1
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                r = _run(layer, x, upstream)
            r["grads"] = [p.grad for p in weights]
            r["added"] = [p.main_grad - s for p, s in zip(weights, starts)]
            r["hooked"] = hooked[0]
            runs[fusion] = r
        off, on = runs["off"], runs["on"]
        out.append({
            "case": keep,
            "hooks_ran": on["hooked"] > 0,
            "same_outputs": torch.equal(off["out"], on["out"]) and torch.equal(off["dx"], on["dx"]),
            "unfused_left_main_grad": all(not a.any() for a in off["added"]),
            "fused_grads_empty": all(g is None for g in on["grads"]),
            # main_grad starts at N(0, 1): adding to it rounds at ~6e-8 of its size.
            "fused_added_grad": [
                torch.allclose(a, g, rtol=1e-5, atol=1e-6)
                for a, g in zip(on["added"], off["grads"])
            ],
        })
    return out


def _attach_main_grad(weights, protocol: str, gen: torch.Generator) -> list[Any]:
    """Give ``weights`` what a data-parallel wrapper gives them, per ``protocol``: ``ddp``
    (``main_grad`` N(0, 1), added to), ``overwrite`` (``main_grad`` NaN with
    ``overwrite_main_grad``: written over, never read), ``fsdp`` (Megatron-FSDP: no
    ``main_grad`` until ``get_main_grad()`` hands out a NaN buffer, ``overwrite_main_grad``),
    ``fsdp_add`` (``get_main_grad()`` hands out an N(0, 1) buffer, no overwrite) or ``mixed``
    (one weight asks for overwrite, the other not). Returns each weight's starting buffer."""
    starts = []
    for i, p in enumerate(weights):
        nan = protocol in ("overwrite", "fsdp") or (protocol == "mixed" and i == 0)
        start = torch.randn(p.shape, generator=gen)
        start = torch.full_like(start, float("nan")) if nan else start
        starts.append(start)
        p.grad_added_to_main_grad = False
        if protocol.startswith("fsdp"):
            p.__fsdp_param__ = True
            p.get_main_grad = lambda start=start: start.clone()
        else:
            p.main_grad = start.clone()
        p.overwrite_main_grad = nan
    return starts


def fused_accumulation_protocols(rank: int, world: int) -> list[dict[str, Any]]:
    """``grad_accumulation_fusion="on"`` under the data-parallel wrappers' protocols
    (:func:`_attach_main_grad`), per keep ratio and mode, against the unfused layer with the
    same weights and inputs: what each weight's gradient buffer holds after the backward (the
    start plus the gradient, or the gradient alone where it is written over) and what autograd
    got. Keep 0 too: no kept rows, so a buffer written over must come out zero."""
    pg = init_megatron_parallel(ep=world)
    out = []
    for keep in (*_FUSED_CASES, {"keep_ratio": 0.0}):
        cfg = _config(world)
        x, upstream = _inputs(rank, cfg.hidden_size)
        torch.manual_seed(11)
        ref_layer = get_lrmoe_moe_spec(LRMoEConfig(grad_accumulation_fusion="off", **keep))(
            config=cfg, pg_collection=pg, layer_number=1
        )
        ref = _run(ref_layer, x, upstream)
        ref_grads = [p.grad for p in ref_layer.experts.weights()]
        for protocol in ("ddp", "overwrite", "fsdp", "fsdp_add", "mixed"):
            torch.manual_seed(11)
            layer = get_lrmoe_moe_spec(LRMoEConfig(grad_accumulation_fusion="on", **keep))(
                config=cfg, pg_collection=pg, layer_number=1
            )
            weights = layer.experts.weights()
            starts = _attach_main_grad(weights, protocol, torch.Generator().manual_seed(5))
            r = _run(layer, x, upstream)
            written = protocol in ("overwrite", "fsdp")
            buffers = [getattr(p, "main_grad", None) for p in weights]
            untouched = True
            if protocol == "mixed":  # unfused: autograd gets the gradients, buffers untouched
                got = [p.grad for p in weights]
                untouched = all(
                    torch.equal(b, s) if not s.isnan().any() else bool(b.isnan().all())
                    for b, s in zip(buffers, starts)
                )
            else:  # autograd gets Megatron's placeholders (grad_added_to_main_grad)
                got = [b if written else b - s for b, s in zip(buffers, starts)]
            out.append({
                "case": keep,
                "protocol": protocol,
                "same_outputs": torch.equal(ref["out"], r["out"]) and torch.equal(ref["dx"], r["dx"]),
                "flags": [p.grad_added_to_main_grad for p in weights],
                "unfused_left_buffers": untouched,
                # main_grad starts at N(0, 1) where added to: adding rounds at ~6e-8 of it.
                "grad_matches": [
                    g is not None and bool(torch.allclose(g, e, rtol=1e-5, atol=1e-6))
                    for g, e in zip(got, ref_grads)
                ],
            })
    return out


def forward_host_facts(rank: int, world: int) -> dict[str, Any]:
    """The forward's host shortcuts next to their slow obvious forms, at EP = ``world``.

    ``decided``: the layer's "both forward GEMMs take device offsets" answer (memoised per
    input in ``grouped_gemm``) as the grouped GEMM switch (``KernelOptions.grouped_mm``, made
    active as a layer call does) and the operands' dtypes change, the
    layer's own weights cast last; a stale memo would repeat an earlier answer. ``stats`` /
    ``metadata``: the call's statistics and stock's split metadata (host numpy sums) against
    torch sums over the call's all-gathered counts, the form they replaced.
    """
    from megatron_lrmoe.control.quota import expert_quotas
    from megatron_lrmoe.options import using_kernels

    pg = init_megatron_parallel(ep=world)
    cfg = _config(world, moe_aux_loss_coeff=0.0)
    lr = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=0.5))(
        config=cfg, pg_collection=pg, layer_number=1
    )
    x, up = _inputs(rank, cfg.hidden_size)
    hidden = x.view(-1, cfg.hidden_size)
    weights = lr.experts.weights()
    take = lr._gemms_take_device_offsets
    decided: dict[str, Any] = {"auto": take(hidden)}
    with using_kernels(KernelOptions(grouped_mm=False)):
        decided["loop"] = take(hidden)
    try:
        KernelOptions(grouped_mm="loop")  # the old environment value: not a switch
    except ValueError:
        decided["bogus"] = "ValueError"
    decided["unset"] = take(hidden)
    for dtype in (torch.float64, torch.bfloat16):
        cast = tuple(w.detach().to(dtype) for w in weights)
        decided[str(dtype)] = take(hidden.to(dtype), cast)
        decided[f"weights {dtype}"] = take(hidden, cast)  # tokens stay fp32

    _run(lr, x, up)
    stats = lr.last_call_stats
    d = lr.token_dispatcher
    counts = d.global_counts.clone()
    ep_rank = d.ep_rank
    L = lr.num_local_experts
    local = counts[:, ep_rank * L : (ep_rank + 1) * L]
    facts = {
        "stats": [
            stats.total_pairs, stats.pairs_sent, stats.tokens_per_expert,
            stats.quota_per_expert, stats.forward_rows,
        ],
        "stats_want": [
            int(counts.sum()), int(counts[ep_rank].sum()), counts.sum(0).tolist(),
            expert_quotas(counts.sum(0), 0.5).tolist(), int(local.sum()),
        ],
        "metadata": [
            d.num_out_tokens, d.input_splits.tolist(), d.output_splits.tolist(),
            d.output_splits_tp.tolist(), d.num_global_tokens_per_local_expert.tolist(),
            str(d.num_global_tokens_per_local_expert.dtype),
        ],
        "metadata_want": [
            int(counts[ep_rank].sum()), counts[ep_rank].reshape(world, L).sum(1).tolist(),
            local.sum(1).tolist(), [int(local.sum())], local.tolist(), str(torch.int64),
        ],
    }  # fmt: skip
    lr.to(torch.float64)  # the layer's own weights change dtype: asked again, not served stale
    decided["layer float64"] = take(hidden.double())
    return {"decided": decided, **facts}


def kernel_options_in_a_layer_call(rank: int, world: int) -> dict[str, Any]:
    """EP ``world``, keep 0.5 planned by the controller (``activation_mode="auto"``), a layer
    whose ``LRMoEConfig.kernels`` switches four fast paths off, called inside an outer
    ``using_kernels`` with other options: the options each grouped GEMM's backend rule and the
    pair plan saw (forward, backward, and a second call), whether the planner asked for the
    compiled library, and the active options afterwards (the outer ones, then the defaults)."""
    from megatron_lrmoe.control import native
    from megatron_lrmoe.dispatch import pair_plan_triton
    from megatron_lrmoe.experts import grouped_gemm as gg
    from megatron_lrmoe.options import active_kernels, using_kernels

    pg = init_megatron_parallel(ep=world)
    cfg = _config(world, moe_aux_loss_coeff=0.0)
    kernels = KernelOptions(
        triton=False, grouped_mm=False, expert_graphs=False, native_planner=False
    )
    lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode="auto", kernels=kernels)
    lr = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
    seen: dict[str, set] = {"gemm": set(), "pair_plan": set()}
    asked = []
    backend_for, use_pair_plan = gg.grouped_mm_backend_for, pair_plan_triton.use_pair_plan_triton

    def gemm(*args: Any, **kwargs: Any) -> Any:
        seen["gemm"].add(active_kernels())
        return backend_for(*args, **kwargs)

    def pair_plan(*args: Any, **kwargs: Any) -> Any:
        seen["pair_plan"].add(active_kernels())
        return use_pair_plan(*args, **kwargs)

    gg.grouped_mm_backend_for = gemm
    pair_plan_triton.use_pair_plan_triton = pair_plan
    library = native.library
    native.library = lambda: asked.append(1) or library()
    outer = KernelOptions(select_graphs=False)
    try:
        with using_kernels(outer):
            for seed in (7, 8):
                x, up = _inputs(rank, cfg.hidden_size, seed)
                _run(lr, x, up)
            inside_after = active_kernels()
    finally:
        gg.grouped_mm_backend_for = backend_for
        pair_plan_triton.use_pair_plan_triton = use_pair_plan
        native.library = library
    stats = lr.last_call_stats
    return {
        "gemm": sorted(k.switched_off for k in seen["gemm"]),
        "pair_plan": sorted(k.switched_off for k in seen["pair_plan"]),
        "want": kernels.switched_off,
        "library_asked": len(asked),
        "planned": stats is not None and stats.control_summary is not None,
        "outer_restored": inside_after == outer,
        "default_restored": active_kernels() == KernelOptions(),
    }
