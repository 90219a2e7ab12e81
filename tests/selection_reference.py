"""First-principles references for which pairs an LRMoE layer keeps, and the per-rank workers
that run real layers through the public API only (module level, so ``spawn`` can pickle them).

Shape legend: T tokens per rank, H hidden, E experts, L local experts, P EP ranks, S pairs a
rank sends (Megatron's permuted order: sorted by global expert, tokens ascending within one).

Nothing here reads LRMoE's scoring, selection or planning code: the references recompute every
pair's score as the squared Frobenius norm of an explicitly materialised outer product, the
quotas and their largest-remainder split with Python integers, top-k by sorting, and the capped
PPS inclusion probabilities with a float64 fixed-point iteration. The workers only build layers
with ``get_lrmoe_moe_spec``, run them, and read ``last_call_stats`` and the expert weights.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Optional, Sequence

import torch

# --------------------------------------------------------------------------------------------- #
# Expert weights and gradients through whichever public accessor the experts module offers.
# --------------------------------------------------------------------------------------------- #


def expert_weights(layer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per local expert ``(fc1 [F1, H], fc2 [H, F])`` in SequentialMLP orientation.

    Uses ``layer.experts.expert_weights()`` when the module has it, else the SequentialMLP-style
    ``local_experts[i].linear_fc{1,2}.weight`` parameters.
    """
    experts = layer.experts
    if hasattr(experts, "expert_weights"):
        return [(fc1, fc2) for fc1, fc2 in experts.expert_weights()]
    return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, or the matching window of its base parameter's ``.grad`` when ``t`` is a view."""
    if t.grad is not None:
        return t.grad
    base = t._base
    if base is None or base.grad is None:
        raise AssertionError("an expert weight has no gradient (did backward run?)")
    grad = base.grad
    offset = t.storage_offset() - base.storage_offset()
    return torch.as_strided(grad, t.size(), t.stride(), grad.storage_offset() + offset)


def expert_grads(layer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gradients matching :func:`expert_weights` (detached clones)."""
    return [
        (_grad_of(fc1).detach().clone(), _grad_of(fc2).detach().clone())
        for fc1, fc2 in expert_weights(layer)
    ]


def flat_expert_grads(layer: Any) -> torch.Tensor:
    """Every local expert's fc1 and fc2 gradient, flattened into one float64 vector."""
    return torch.cat([t.reshape(-1) for pair in expert_grads(layer) for t in pair]).double()


# --------------------------------------------------------------------------------------------- #
# Pure references (no torch.distributed, no LRMoE code).
# --------------------------------------------------------------------------------------------- #


def pairs_in_send_order(routing_map: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(experts, tokens)`` of a rank's pairs in Megatron's permuted order (expert, then token)."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)
    return experts.tolist(), tokens.tolist()


def explicit_scores(
    x: torch.Tensor, grad_out: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
) -> torch.Tensor:
    """``[S]`` float64 ``||(p g_t) x_t^T||_F^2`` of every pair, from the materialised outer product.

    Args:
        x: ``[T, H]`` the layer input (fc1's input for every pair of the token).
        grad_out: ``[T, H]`` dL/d output of the layer.
        probs: ``[T, E]`` routing weights (router output).
        routing_map: ``[T, E]`` bool.
    """
    experts, tokens = pairs_in_send_order(routing_map)
    if not experts:
        return torch.zeros(0, dtype=torch.float64)
    e = torch.tensor(experts)
    t = torch.tensor(tokens)
    u = probs[t, e].double().unsqueeze(1) * grad_out[t].double()  # [S, H]: p * g
    outer = u.unsqueeze(2) * x[t].double().unsqueeze(1)  # [S, H, H]: the rank-one wgrad term
    return outer.square().sum(dim=(1, 2))


def reference_quotas(pairs_per_expert: Sequence[int], keep_ratio: float) -> list[int]:
    """``Q[e] = ceil(keep_ratio * N[e])`` in exact decimal arithmetic (0.3 * 10 is 3)."""
    ratio = Fraction(str(keep_ratio))
    return [min(n, math.ceil(ratio * n)) for n in pairs_per_expert]


def reference_hamilton(counts: Sequence[Sequence[int]], quota: Sequence[int]) -> list[list[int]]:
    """Largest-remainder split of ``quota[e]`` over sources ``r`` in proportion to ``counts[r][e]``.

    ``floor(Q N[r,e] / N[e])`` first, then one unit each to the largest remainders, ties to the
    lower source rank.
    """
    sources, experts = len(counts), len(quota)
    share = [[0] * experts for _ in range(sources)]
    for e in range(experts):
        total = sum(counts[r][e] for r in range(sources))
        if total == 0:
            continue
        parts = [divmod(quota[e] * counts[r][e], total) for r in range(sources)]
        for r, (base, _) in enumerate(parts):
            share[r][e] = base
        left = quota[e] - sum(base for base, _ in parts)
        for r in sorted(range(sources), key=lambda r: (-parts[r][1], r))[:left]:
            share[r][e] += 1
    return share


def reference_topk(scores: Sequence[float], quota: int) -> set[int]:
    """Positions of the ``quota`` highest scores, ties to the lower position."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return set(order[:quota])


def topk_boundary_gap(scores: Sequence[float], quota: int) -> float:
    """Relative gap between the last kept and the first dropped score (inf if none is dropped)."""
    if quota == 0 or quota >= len(scores):
        return math.inf
    ranked = sorted(scores, reverse=True)
    return (ranked[quota - 1] - ranked[quota]) / max(ranked[quota - 1], 1e-300)


def reference_capped_pps(scores: Sequence[float], quota: int) -> list[float]:
    """Real-valued capped PPS: ``pi_i = min(1, c sqrt(s_i))`` with ``sum pi = quota`` (float64).

    Iterates to the fixed point: cap every row whose share reaches 1, rescale the rest, repeat.
    Needs at least ``quota`` positive scores (the tests build such problems).
    """
    w = [math.sqrt(s) for s in scores]
    if quota == 0:
        return [0.0] * len(w)
    if sum(1 for v in w if v > 0) < quota:
        raise ValueError("fewer positive scores than quota: not a case these tests build")
    capped: set[int] = set()
    while True:
        free = [i for i in range(len(w)) if i not in capped]
        scale = (quota - len(capped)) / sum(w[i] for i in free)
        newly = {i for i in free if scale * w[i] >= 1.0}
        if not newly:
            break
        capped |= newly
    return [1.0 if i in capped else scale * w[i] for i in range(len(w))]


# --------------------------------------------------------------------------------------------- #
# Per-rank workers.
# --------------------------------------------------------------------------------------------- #


def build_layer(pg: Any, ep: int, lrmoe_kwargs: dict, **config_overrides: Any) -> Any:
    """An ``LRMoELayer`` from the public spec builder, on the tiny test config."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import moe_transformer_config

    overrides = dict(moe_aux_loss_coeff=0.0)
    overrides.update(config_overrides)
    cfg = moe_transformer_config(expert_model_parallel_size=ep, **overrides)
    return get_lrmoe_moe_spec(LRMoEConfig(**lrmoe_kwargs))(
        config=cfg, pg_collection=pg, layer_number=1
    )


def layer_inputs(
    rank: int, tokens: int, hidden: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, 1, H]`` with skewed routing, and a heavy-tailed upstream gradient ``[T, 1, H]``.

    The upstream rows get log-normal scales so that LRM scores spread over orders of magnitude:
    ``sample`` then caps some pairs at probability 1 and leaves others below it.
    """
    from megatron_lrmoe.testing import skewed_routing_inputs

    x = skewed_routing_inputs(tokens, hidden, seed=seed, rank=rank)
    gen = torch.Generator().manual_seed(seed * 7919 + 31 * rank + 5)
    upstream = torch.randn(tokens, 1, hidden, generator=gen)
    upstream = upstream * torch.exp(1.5 * torch.randn(tokens, 1, 1, generator=gen))
    return x, upstream


class RouterCapture:
    """Records the router's ``(probs, routing_map)`` output of every call (a forward hook)."""

    def __init__(self, layer: Any) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handle = layer.router.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: tuple, output: Any) -> None:
        probs, routing_map = output
        self.calls.append((probs.detach().clone(), routing_map.detach().clone()))

    def remove(self) -> None:
        self._handle.remove()


def run_once(layer: Any, x: torch.Tensor, upstream: torch.Tensor) -> dict[str, Any]:
    """Forward, then backward of the loss ``sum(out * upstream)`` (so dL/d out = upstream)."""
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "dx": x.grad.detach().clone()}


def selection_case(pg: Any, ep: int, rank: int, case: dict) -> dict[str, Any]:
    """Run one layer call; return what the reference needs and what the layer reported."""
    lrmoe = dict(case["lrmoe"], debug_record_selection=True)
    layer = build_layer(pg, ep, lrmoe)
    x, upstream = layer_inputs(rank, case["tokens"], layer.config.hidden_size, case["seed"])
    capture = RouterCapture(layer)
    run_once(layer, x, upstream)
    capture.remove()
    (probs, routing_map), = capture.calls
    stats = layer.last_call_stats
    return {
        "case": case,
        "x": x.reshape(-1, x.shape[-1]).clone(),
        "grad_out": upstream.reshape(-1, upstream.shape[-1]).clone(),
        "probs": probs,
        "routing_map": routing_map,
        "kept_weight": stats.kept_weight.clone(),
        "kept_mask": stats.kept_mask.clone(),
        "quota_per_expert": list(stats.quota_per_expert),
        "tokens_per_expert": list(stats.tokens_per_expert),
        "pairs_sent": stats.pairs_sent,
        "kept_pairs_sent": stats.kept_pairs_sent,
        "kept_per_local_expert": list(stats.kept_per_local_expert),
        "kept_ratio": stats.kept_ratio,
        "num_local_experts": layer.num_local_experts,
    }


def selection_cases(rank: int, world: int, cases: list[dict]) -> list[dict[str, Any]]:
    """:func:`selection_case` for every case, EP = world size."""
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    return [selection_case(pg, world, rank, case) for case in cases]


def sampled_gradient_blocks(
    rank: int, world: int, tokens: int, draws: int, block: int, keep_ratio: float
) -> dict[str, Any]:
    """Exact gradients (keep 1.0) and sums of ``sample`` gradients over blocks of seeds.

    One layer, one input; the sampling seed changes per draw (``LRMoEConfig.seed``). Returns the
    exact expert-weight and input gradients, the per-block sums of the sampled ones (so the
    caller can form means over 1, 4, 16 ... blocks), and the largest relative deviation of the
    router gradient from the exact one over all draws (it must stay exact for every pair).
    """
    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    layer = build_layer(pg, world, dict(keep_ratio=1.0))
    x, upstream = layer_inputs(rank, tokens, layer.config.hidden_size, seed=11)

    def grads(lrmoe: LRMoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer.lrmoe_config = lrmoe
        layer.zero_grad(set_to_none=True)
        res = run_once(layer, x, upstream)
        router = layer.router.weight.grad.detach().double().clone()
        return flat_expert_grads(layer), res["dx"].double().reshape(-1), router

    w_exact, dx_exact, router_exact = grads(LRMoEConfig(keep_ratio=1.0))
    base = LRMoEConfig(keep_ratio=keep_ratio, selection="sample")
    w_sums, dx_sums = [], []
    router_dev = 0.0
    router_scale = float(router_exact.abs().max())
    for start in range(0, draws, block):
        w_acc = torch.zeros_like(w_exact)
        dx_acc = torch.zeros_like(dx_exact)
        for seed in range(start, start + block):
            w, dx, router = grads(dataclasses.replace(base, seed=seed))
            w_acc += w
            dx_acc += dx
            router_dev = max(router_dev, float((router - router_exact).abs().max()) / router_scale)
        w_sums.append(w_acc)
        dx_sums.append(dx_acc)
    return {
        "w_exact": w_exact,
        "dx_exact": dx_exact,
        "w_block_sums": torch.stack(w_sums),
        "dx_block_sums": torch.stack(dx_sums),
        "router_rel_dev": router_dev,
    }
