"""Replicas of hot experts under skewed routing: stock MoE layer vs LRMoE with and without replicas.

Run (one process per GPU; EP = number of processes, at least 2):

    torchrun --nproc_per_node=2 benchmarks/replica_bench.py                 # H200: NCCL, bf16
    torchrun --nproc_per_node=2 benchmarks/replica_bench.py --device cpu \\
        --hidden 64 --ffn 32 --experts 16 --topk 2 --tokens 256 --iters 2 --warmup 1 \
        --hot-experts 2                                 # smoke run: gloo + CPU shim, fp32

The defaults (16384 tokens per GPU, 3 scenarios x 5 variants x (3 warm-up + 10) steps) are sized
to take a few minutes on two H200 (not yet measured there; the CPU run above takes ~10 s).

Layer: one Qwen3-30B-A3B MoE layer (benchmarks/common.py; ``--hidden/--ffn/--experts/--topk``
shrink it). Every variant runs on the same weights and the same per-rank inputs, round-robin
(iteration i of every variant before iteration i+1 of any):

    stock     Megatron-Core ``MoELayer`` (local spec: alltoall dispatcher + SequentialMLP)
    LRMoE     keep ``--keep`` (``--selection``, ``--activation-mode``), without and with
              ``--replicas`` replicas per rank (``LRMoEConfig.max_replicas_per_rank``), and
              keep 1.0 without and with replicas

Routing scenarios. The layers stay stock; only the router's logits get a fixed per-expert bias
(the router's ``gating`` output plus a constant vector, the same on every rank and for every
variant), calibrated once on the benchmark's own tokens so that the pairs routed to each expert
follow a target share:

    zipf-<s>   expert popularity ``~ rank^-s`` over a seeded permutation of the experts
               (``--zipf``, several exponents allowed)
    hot-rank   the experts of EP rank 0 receive ``--hot-share`` of all pairs: its first
               ``--hot-experts`` experts carry it, every other expert gets the same cold share

A token picks an expert at most once, so no expert can receive more than 1/top-k of the pairs;
targets above that are capped and the excess spread over the others (water-filling). The
measured shares are reported next to the targets (per-rank shares, top expert share).

Per scenario and variant (fwd/bwd/memory: medians over ``--iters`` after ``--warmup`` on each
rank, then the maximum over ranks; row counts: maximum over ranks and iterations):

    fwd_ms, bwd_ms      CUDA events around the forward and the backward (perf_counter on CPU)
    peak_mib            peak allocated during forward + backward minus before (GPU only)
    fwd_rows            rows (pairs) the rank's experts and replicas computed in forward (stock:
                        rows entering its SequentialMLP, counted by a forward pre-hook)
    kept_rows           kept pairs whose expert backward ran on the rank (stock: every pair)
    plan_*              the controller's plan of the call (``ControlPlan``): replicas, planned
                        forward/backward peak per rank, fixed ownership's peak, and its memory
                        plan per GPU (replica weights + token buffers + saved activations +
                        backward working rows) next to fixed ownership at keep 1.0 (stock).
                        Variants that the layer plans without the controller (no replicas, no
                        budgets) get the same plan from ``plan_call`` on the call's counts,
                        marked ``plan_source="plan_call(counts)"``.
    fwd/kept_rows_vs_plan   max |measured - planned| rows per rank (0: the plan was kept)

Replica weights are fetched from their owners on every call (as in a training step of one
micro-batch; inside fwd_ms); ``--replica-cache`` fetches them once for the run instead (the
layer's per-step cache, as with many micro-batches per step).

Peak-load optimum for the replica limit: at EP 2 exactly, in closed form (min-cut duality, see
``optimal_peak_two_ranks``); at larger EP by the repo's brute force
(``control.reference.reference_optimal_peak``) when the placements to try are few
(``--brute-force-limit``), else only the lower bound ``max(ceil(total/P), max_e ceil(W[e]/P))``
that ignores the replica limit (``peak_opt_kind`` says which).

Goals of the issue, checked per LRMoE variant with replicas, never assumed:
    memory: planned bytes per GPU / fixed ownership's <= ``--mem-goal`` (0.40)
    peak:   measured forward peak per GPU / optimum <= ``--peak-goal`` (1.05); against the lower
            bound a PASS is proof, a MISS is marked "vs lower bound" (the optimum may be higher).

Output: JSON to ``--out`` (default ``$OUT/replica_bench.json``) and a table on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import statistics
import sys
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    QWEN3_30B_A3B_MOE,
    init_distributed,
    moe_config,
    write_json,
)

# Placeholder of a metric a rank does not have, below any real value (all-reduce MAX keeps it
# only when no rank has the metric).
_MISSING = -1.0e30


# --------------------------------------------------------------------------------------------- #
# Routing targets and the router bias (host / device math, no layers)
# --------------------------------------------------------------------------------------------- #


def cap_shares(shares: np.ndarray, cap: float) -> np.ndarray:
    """``shares`` (summing to 1) with no entry above ``cap``: capped entries sit at ``cap`` and
    the others are scaled up proportionally to keep the sum (water-filling).

    Args:
        shares: ``[E]`` non-negative target shares.
        cap: The largest share one expert can have (1 / top-k: a token picks an expert once).

    Returns:
        ``[E]`` float64 shares summing to 1.
    """
    p = np.asarray(shares, dtype=np.float64)
    p = p / p.sum()
    if cap * p.size < 1.0 - 1e-12:
        raise ValueError(f"cap ({cap}) times experts ({p.size}) is below 1: no routing fits it")
    fixed = np.zeros(p.size, dtype=bool)
    while True:
        rest = p[~fixed].sum()
        q = np.where(fixed, cap, p * (1.0 - cap * fixed.sum()) / rest if rest > 0 else 0.0)
        over = (q > cap * (1 + 1e-12)) & ~fixed
        if not over.any():
            return q
        fixed |= over


def zipf_shares(num_experts: int, exponent: float, topk: int, seed: int) -> np.ndarray:
    """``[E]`` Zipf popularity ``(i + 1)^-s`` over a seeded permutation of the experts, capped
    at 1/top-k."""
    popularity = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** exponent
    perm = np.random.default_rng(seed).permutation(num_experts)
    shares = np.empty(num_experts)
    shares[perm] = popularity
    return cap_shares(shares, 1.0 / topk)


def hot_rank_shares(
    num_experts: int, ep: int, share: float, hot_experts: int, topk: int
) -> np.ndarray:
    """``[E]`` shares where EP rank 0's experts receive ``share`` of all pairs.

    Every expert outside rank 0's first ``hot_experts`` gets the same cold share
    ``(1 - share) / (E - L)``; the hot ones split what rank 0 has left. Capped at 1/top-k.
    """
    local = num_experts // ep
    hot = min(max(1, hot_experts), local)
    cold = (1.0 - share) / (num_experts - local)
    left = share - (local - hot) * cold
    if not 0.0 < share < 1.0 or left < 0:
        raise ValueError(
            f"--hot-share ({share}) must be in (0, 1) and at least the cold share of rank 0's "
            f"{local - hot} other experts ({(local - hot) * cold:.3f}); raise --hot-experts"
        )
    shares = np.full(num_experts, cold)
    shares[:hot] = left / hot
    return cap_shares(shares, 1.0 / topk)


def routed_counts(logits: torch.Tensor, bias: torch.Tensor, topk: int, group: Any) -> torch.Tensor:
    """``[E]`` int64 pairs per expert over the EP group when ``logits + bias`` pick the top-k."""
    picked = torch.topk(logits + bias, topk, dim=-1).indices
    counts = torch.bincount(picked.reshape(-1), minlength=logits.shape[-1]).to(torch.int64)
    torch.distributed.all_reduce(counts, group=group)
    return counts


def calibrate_bias(
    logits: torch.Tensor, shares: np.ndarray, topk: int, group: Any, iters: int
) -> tuple[torch.Tensor, float]:
    """Per-expert logit bias whose top-k routing of ``logits`` follows ``shares``.

    Multiplicative-weights style: raise the bias of experts below their target count and lower
    it above, in log space, with a shrinking step; keeps the bias with the smallest error. Every
    rank computes the same bias from the same all-reduced counts (broadcast from rank 0 anyway).

    Args:
        logits: ``[T, E]`` fp32 router logits of this rank's tokens (unbiased).
        shares: ``[E]`` target share of the pairs per expert.
        topk: Experts per token.
        group: The EP process group.
        iters: Calibration steps.

    Returns:
        ``([E] bias, max |measured share - target share|)`` of the best step.
    """
    want = torch.as_tensor(shares, dtype=torch.float64, device=logits.device)
    total = torch.tensor([logits.shape[0] * topk], dtype=torch.int64, device=logits.device)
    torch.distributed.all_reduce(total, group=group)
    want = want * float(total.item())
    scale = logits.float().std().reshape(1)
    torch.distributed.all_reduce(scale, group=group)
    scale = float(scale.item()) / torch.distributed.get_world_size(group)
    bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    best_bias, best_err = bias.clone(), math.inf
    for step in range(iters):
        counts = routed_counts(logits, bias, topk, group).to(torch.float64)
        err = float((counts - want).abs().max()) / float(total.item())
        if err < best_err:
            best_bias, best_err = bias.clone(), err
        rate = 0.5 * scale / (1.0 + step / 40.0)
        bias = bias + (rate * (torch.log1p(want) - torch.log1p(counts))).to(bias.dtype)
    src = torch.distributed.get_global_rank(group, 0)
    torch.distributed.broadcast(best_bias, src=src, group=group)
    return best_bias, best_err


def bias_router(router: Any, holder: dict) -> None:
    """Make ``router`` add ``holder["bias"]`` (an ``[E]`` tensor) to its gating logits.

    An instance attribute shadows the class's ``gating``; the router's routing, aux loss and
    backward are untouched (the bias is a constant).
    """
    original = router.gating

    def gating(inp: torch.Tensor) -> torch.Tensor:
        logits = original(inp)
        bias = holder.get("bias")
        return logits if bias is None else logits + bias.to(logits.dtype)

    router.gating = gating


# --------------------------------------------------------------------------------------------- #
# Peak-load optimum for a replica limit
# --------------------------------------------------------------------------------------------- #


def lower_bound_peak(load: np.ndarray, num_ranks: int) -> int:
    """``max(ceil(total / P), max_e ceil(W[e] / P))``: no placement beats it (any replica limit)."""
    load = np.asarray(load, dtype=np.int64)
    return int(max(-(-load.sum() // num_ranks), (-(-load // num_ranks)).max(initial=0)))


def optimal_peak_two_ranks(load: np.ndarray, slots: int) -> int:
    """Exact smallest peak per-rank load at EP 2 with at most ``slots`` replicas per rank.

    By the min-cut duality of ``reference_optimal_peak``, a placement's optimal peak is the
    largest of ``ceil(total / 2)`` and, per rank, the load of its experts the other rank does not
    replicate. Each rank's term depends only on which of its experts the other rank copies, so
    copying the ``slots`` heaviest is optimal for both at once.
    """
    load = np.asarray(load, dtype=np.int64)
    if load.size % 2:
        raise ValueError(f"experts ({load.size}) must split evenly over 2 ranks")
    total = int(load.sum())
    peak = -(-total // 2)
    for own in np.split(load, 2):
        kept = np.sort(own)[::-1][min(slots, own.size) :]
        peak = max(peak, int(kept.sum()))
    return int(peak)


def peak_optimum(load: np.ndarray, num_ranks: int, slots: int, limit: int) -> tuple[int, str]:
    """The optimum peak for ``slots`` replicas per rank where it is cheap, else the lower bound.

    Returns:
        ``(peak, kind)``, kind one of ``"exact (EP 2 closed form)"``, ``"exact (brute force)"``,
        ``"lower bound"``.
    """
    from megatron_lrmoe.control.reference import reference_optimal_peak

    if num_ranks == 2:
        return optimal_peak_two_ranks(load, slots), "exact (EP 2 closed form)"
    others = load.size - load.size // num_ranks
    per_rank = sum(math.comb(others, k) for k in range(slots + 1))
    if per_rank**num_ranks <= limit:
        return reference_optimal_peak(load.tolist(), num_ranks, slots), "exact (brute force)"
    return lower_bound_peak(load, num_ranks), "lower bound"


# --------------------------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------------------------- #


@dataclasses.dataclass
class Variant:
    name: str
    lrmoe: Any  # LRMoEConfig, or None for the stock layer
    samples: dict = dataclasses.field(default_factory=dict)
    control: Any = None  # the last call's ControlPlan (None: planned without the controller)

    def add(self, key: str, value: Optional[float]) -> None:
        if value is not None:
            self.samples.setdefault(key, []).append(float(value))

    def median(self, key: str) -> Optional[float]:
        vals = self.samples.get(key)
        return statistics.median(vals) if vals else None

    def maximum(self, key: str) -> Optional[float]:
        vals = self.samples.get(key)
        return max(vals) if vals else None


def _variants(keep: float, selection: str, mode: str, replicas: int) -> list[Variant]:
    from megatron_lrmoe import LRMoEConfig

    def cfg(k: float, r: int) -> Any:
        return LRMoEConfig(
            keep_ratio=k, selection=selection, activation_mode=mode, max_replicas_per_rank=r
        )

    label = f"keep {keep} {selection} {mode}"
    return [
        Variant("stock MoELayer", None),
        Variant(f"LRMoE {label}", cfg(keep, 0)),
        Variant(f"LRMoE {label} R={replicas}", cfg(keep, replicas)),
        Variant("LRMoE keep 1.0", cfg(1.0, 0)),
        Variant(f"LRMoE keep 1.0 R={replicas}", cfg(1.0, replicas)),
    ]


def _step(
    layer: Any, x: torch.Tensor, up: torch.Tensor, v: Variant, probe: dict, cuda: bool
) -> torch.Tensor:
    """One forward + backward; records times, memory, rows and the plan on ``v``."""
    from megatron_lrmoe.observe.stats import elapsed_ms, timestamp

    inp = x.detach().requires_grad_(True)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = timestamp(cuda)
    out, _ = layer(inp)
    mid = timestamp(cuda)
    out.backward(up)
    stop = timestamp(cuda)
    v.add("fwd_ms", elapsed_ms(start, mid))
    v.add("bwd_ms", elapsed_ms(mid, stop))
    if cuda:
        torch.cuda.synchronize()
        v.add("peak_mib", (torch.cuda.max_memory_allocated() - base) / 2**20)
    stats = getattr(layer, "last_call_stats", None)
    if v.lrmoe is None:
        v.add("fwd_rows", probe["rows"])
        v.add("kept_rows", probe["rows"])  # stock keeps every pair
    else:
        assert stats is not None and stats.backward_done, "LRMoE stats missing after backward"
        v.add("fwd_rows", stats.forward_rows)
        v.add("kept_rows", stats.kept_rows)
        v.add("replicas_fetched", stats.replicas_fetched)
        v.control = stats.control
    result = out.detach()
    del out, inp
    for p in layer.parameters():
        p.grad = None
    return result


def _offline_plan(counts: torch.Tensor, rank: int, lrmoe: Any, cost: Any) -> Any:
    from megatron_lrmoe.control.controller import plan_call

    return plan_call(counts, rank, lrmoe, cost)


def _max_over_ranks(values: dict[str, Optional[float]], device: torch.device) -> dict:
    """All-reduce MAX of every value (None where no rank has it); keys must match on all ranks."""
    keys = sorted(values)
    t = torch.tensor(
        [_MISSING if values[k] is None else float(values[k]) for k in keys],
        dtype=torch.float64,
        device=device,
    )
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {k: (None if x <= _MISSING / 2 else x) for k, x in zip(keys, t.tolist())}


def _goal(value: Optional[float], limit: float, proof: bool = True) -> str:
    if value is None:
        return "n/a"
    if value <= limit:
        return "PASS"
    return "MISS" if proof else "MISS (vs lower bound)"


def _mib(x: Optional[float]) -> Optional[float]:
    return None if x is None else x / 2**20


def run_scenario(
    name: str,
    shares: np.ndarray,
    params: dict,
    ctx: dict,
    args: argparse.Namespace,
) -> dict:
    """Calibrate the bias for ``shares``, measure every variant, return the scenario's rows."""
    from megatron_lrmoe import LRMoEConfig

    stock, lr, holder, variants = ctx["stock"], ctx["lr"], ctx["holder"], ctx["variants"]
    x, up, cuda, device = ctx["x"], ctx["up"], ctx["cuda"], ctx["device"]
    ep, rank, group, cost = ctx["ep"], ctx["rank"], lr.ep_group, ctx["cost"]
    holder["bias"] = None
    with torch.no_grad():
        logits = stock.router.gating(x).reshape(-1, shares.size).float()
    bias, calib_err = calibrate_bias(logits, shares, args.topk, group, args.calib_iters)
    holder["bias"] = bias
    del logits

    def layer_for(v: Variant) -> Any:
        if v.lrmoe is None:
            return stock
        lr.lrmoe_config = v.lrmoe
        return lr

    for v in variants:
        v.samples, v.control = {}, None
    reference = None
    diffs: dict[str, Optional[float]] = {}
    for v in variants:
        for i in range(args.warmup):
            out = _step(layer_for(v), x, up, Variant("warmup", v.lrmoe), ctx["probe"], cuda)
            if i == 0 and v.lrmoe is None:
                reference = out
            elif i == 0 and reference is not None:
                diffs[v.name] = float((out - reference).abs().max() / reference.abs().max())
    for _ in range(args.iters):
        for v in variants:
            torch.distributed.barrier()
            _step(layer_for(v), x, up, v, ctx["probe"], cuda)

    # Loads of this scenario: identical for every variant (same router, bias, tokens).
    lr.lrmoe_config = LRMoEConfig(keep_ratio=1.0)
    _step(lr, x, up, Variant("counts", lr.lrmoe_config), ctx["probe"], cuda)
    counts = lr.token_dispatcher.global_counts.clone()  # [P, E] host int64, same on all ranks
    load = counts.sum(0).numpy()
    total = int(load.sum())
    rank_share = (load.reshape(ep, -1).sum(1) / total).tolist()
    lower = lower_bound_peak(load, ep)
    opt, opt_kind = peak_optimum(load, ep, args.replicas, args.brute_force_limit)
    fixed_peak = int(load.reshape(ep, -1).sum(1).max())

    rows = []
    for v in variants:
        lrmoe = v.lrmoe if v.lrmoe is not None else LRMoEConfig(keep_ratio=1.0)
        control, source = v.control, "layer"
        if control is None:
            control, source = _offline_plan(counts, rank, lrmoe, cost), "plan_call(counts)"
        fwd_plan = int(control.forward_rank_load[rank])
        kept_plan = int(control.backward_rank_load[rank])
        per_rank = {
            "fwd_ms": v.median("fwd_ms"),
            "bwd_ms": v.median("bwd_ms"),
            "peak_mib": v.median("peak_mib"),
            "fwd_rows_max": v.maximum("fwd_rows"),
            "kept_rows_max": v.maximum("kept_rows"),
            "replicas_fetched": v.maximum("replicas_fetched"),
            "fwd_rows_vs_plan": max(abs(r - fwd_plan) for r in v.samples["fwd_rows"]),
            "kept_rows_vs_plan": max(abs(r - kept_plan) for r in v.samples["kept_rows"]),
            "fwd_rel_diff_vs_stock": diffs.get(v.name),
        }
        row: dict[str, Any] = {"scenario": name, "variant": v.name}
        row["config"] = None if v.lrmoe is None else dataclasses.asdict(v.lrmoe)
        row.update(_max_over_ranks(per_rank, device))
        row["total_ms"] = row["fwd_ms"] + row["bwd_ms"]
        mem = control.memory
        row.update(
            plan_source=source,
            replicas=control.num_replicas if v.lrmoe is not None else 0,
            replicas_per_rank=control.replicas_per_rank.tolist() if v.lrmoe is not None else None,
            plan_forward_peak=control.forward_peak if v.lrmoe is not None else fixed_peak,
            plan_backward_peak=control.backward_peak if v.lrmoe is not None else fixed_peak,
            plan_fixed_forward_peak=control.fixed_forward_peak,
            plan_forward_rank_load=control.forward_rank_load.tolist(),
            plan_backward_rank_load=control.backward_rank_load.tolist(),
        )
        stock_total = int(mem.stock_total_bytes.max())
        if v.lrmoe is None:
            row["mem_plan"] = {"total_bytes": stock_total, "stock_total_bytes": stock_total}
            row["mem_ratio_vs_fixed"] = 1.0
        else:
            row["mem_plan"] = {
                "replica_bytes": int(mem.replica_bytes.max()),
                "saved_bytes": int(mem.saved_bytes.max()),
                "backward_bytes": int(mem.backward_bytes.max()),
                "forward_buffer_bytes": int(mem.forward_buffer_bytes.max()),
                "budgeted_bytes": int(mem.budgeted_bytes.max()),
                "total_bytes": int(mem.total_bytes.max()),
                "stock_total_bytes": stock_total,
                "total_bytes_per_rank": mem.total_bytes.tolist(),
                "stock_total_bytes_per_rank": mem.stock_total_bytes.tolist(),
            }
            row["mem_ratio_vs_fixed"] = int(mem.total_bytes.max()) / max(1, stock_total)
        uses_replicas = v.lrmoe is not None and v.lrmoe.max_replicas_per_rank > 0
        row["peak_vs_opt"] = row["fwd_rows_max"] / max(1, opt) if uses_replicas else None
        if uses_replicas:
            exact = opt_kind != "lower bound"
            row["goals"] = {
                "memory": _goal(row["mem_ratio_vs_fixed"], args.mem_goal),
                "peak": _goal(row["peak_vs_opt"], args.peak_goal, proof=exact),
            }
        rows.append(row)
    stock_peak = rows[0]["peak_mib"]
    for row in rows:
        row["measured_mem_vs_stock"] = (
            None if stock_peak is None or row["peak_mib"] is None else row["peak_mib"] / stock_peak
        )
    return {
        "scenario": name,
        "params": params,
        "target_shares": shares.tolist(),
        "target_top_share": float(shares.max()),
        "target_rank_share": shares.reshape(ep, -1).sum(1).tolist(),
        "calibration_max_abs_err": calib_err,
        "total_pairs": total,
        "expert_pairs": load.tolist(),
        "rank_share": rank_share,
        "top_expert_share": float(load.max() / total),
        "fixed_peak": fixed_peak,
        "lower_bound_peak": lower,
        "optimum_peak": opt,
        "optimum_kind": opt_kind,
        "replicas_per_rank_limit": args.replicas,
        "rows": rows,
    }


def print_scenario(block: dict) -> None:
    shares = ", ".join(f"{s:.3f}" for s in block["rank_share"])
    print(
        f"\n== {block['scenario']} {block['params']}: {block['total_pairs']} pairs; rank shares "
        f"[{shares}] (target {block['target_rank_share'][0]:.3f} on rank 0); top expert "
        f"{block['top_expert_share']:.4f} (target {block['target_top_share']:.4f}); fixed peak "
        f"{block['fixed_peak']}, optimum at R={block['replicas_per_rank_limit']} "
        f"{block['optimum_peak']} ({block['optimum_kind']}), lower bound "
        f"{block['lower_bound_peak']}",
        flush=True,
    )
    diffs = [r["fwd_rel_diff_vs_stock"] for r in block["rows"]]
    worst = max(d for d in diffs if d is not None)
    print(f"LRMoE forward vs stock (same weights and tokens): max relative difference {worst:.2e}")
    head = (
        f"{'variant':38s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd rows':>9s} {'plan fwd':>9s} "
        f"{'kept rows':>9s} {'repl':>4s} {'peak/opt':>8s} {'plan MiB':>9s} {'fixed MiB':>9s} "
        f"{'mem/fixed':>9s} {'peak MiB':>9s}  goals"
    )
    print(head)
    for r in block["rows"]:
        pv = "-" if r["peak_vs_opt"] is None else f"{r['peak_vs_opt']:.3f}"
        pm = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        goals = r.get("goals")
        g = "" if not goals else f"memory {goals['memory']}, peak {goals['peak']}"
        print(
            f"{r['variant']:38s} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['fwd_rows_max']:9.0f} "
            f"{r['plan_forward_peak']:9d} {r['kept_rows_max']:9.0f} {r['replicas']:4d} {pv:>8s} "
            f"{_mib(r['mem_plan']['total_bytes']):9.1f} "
            f"{_mib(r['mem_plan']['stock_total_bytes']):9.1f} {r['mem_ratio_vs_fixed']:9.3f} "
            f"{pm:>9s}  {g}",
            flush=True,
        )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    q = QWEN3_30B_A3B_MOE
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    parser.add_argument("--hidden", type=int, default=q["hidden_size"])
    parser.add_argument("--ffn", type=int, default=q["moe_ffn_hidden_size"], help="expert FFN")
    parser.add_argument("--experts", type=int, default=q["num_moe_experts"])
    parser.add_argument("--topk", type=int, default=q["moe_router_topk"])
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--selection", choices=("sample", "topk"), default="sample")
    parser.add_argument("--activation-mode", choices=("save", "recompute", "auto"), default="save")
    parser.add_argument("--replicas", type=int, default=2, help="max_replicas_per_rank")
    parser.add_argument(
        "--scenarios", nargs="+", choices=("zipf", "hot-rank"), default=["zipf", "hot-rank"]
    )
    parser.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.5], help="exponents")
    parser.add_argument("--hot-share", type=float, default=0.7)
    parser.add_argument("--hot-experts", type=int, default=8, help="rank 0 experts carrying it")
    parser.add_argument(
        "--replica-cache",
        action="store_true",
        help="fetch replica weights once for the whole run (one training step: weights never\n"
        "change here) instead of on every call (a step of one micro-batch, the default)",
    )
    parser.add_argument("--calib-iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--brute-force-limit", type=int, default=20000, help="placements")
    parser.add_argument("--mem-goal", type=float, default=0.40)
    parser.add_argument("--peak-goal", type=float, default=1.05)
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "replica_bench.json")
    )
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 1:
        parser.error(f"--iters ({args.iters}) and --warmup ({args.warmup}) must be >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    ep = int(os.environ.get("WORLD_SIZE", "1"))
    if ep < 2:
        raise ValueError(
            f"replica_bench needs EP >= 2 processes (WORLD_SIZE={ep}): replicas live on other "
            "ranks; run it with torchrun --nproc_per_node=2 or more"
        )
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the cores
    pg = init_distributed(ep, args.device)

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.control.costs import CostModel

    rank = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = moe_config(
        ep,
        dtype,
        hidden_size=args.hidden,
        moe_ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        # Attention heads only have to divide the hidden size (the layer has no attention).
        num_attention_heads=math.gcd(args.hidden, QWEN3_30B_A3B_MOE["num_attention_heads"]),
    )
    stock = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(
        config=cfg, pg_collection=pg, layer_number=1
    ).to(device)
    lr = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).to(device)
    lr.load_state_dict(stock.state_dict(), strict=False)
    if args.replica_cache:
        lr.set_training_step(0)
    holder: dict = {"bias": None}
    bias_router(stock.router, holder)
    bias_router(lr.router, holder)
    probe = {"rows": None}

    def count_rows(module: Any, inputs: tuple) -> None:
        probe["rows"] = int(inputs[0].shape[0])

    stock.experts.register_forward_pre_hook(count_rows)
    gen = torch.Generator(device=device).manual_seed(args.seed + 100 + rank)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype, generator=gen)
    up = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    ctx = dict(
        stock=stock, lr=lr, holder=holder, x=x, up=up, cuda=cuda, device=device, ep=ep,
        rank=rank, cost=CostModel.from_config(cfg), probe=probe,
        variants=_variants(args.keep, args.selection, args.activation_mode, args.replicas),
    )  # fmt: skip
    scenarios = []
    if "zipf" in args.scenarios:
        for s in args.zipf:
            shares = zipf_shares(args.experts, s, args.topk, args.seed)
            scenarios.append((f"zipf-{s:g}", shares, {"exponent": s}))
    if "hot-rank" in args.scenarios:
        shares = hot_rank_shares(args.experts, ep, args.hot_share, args.hot_experts, args.topk)
        params = {"hot_share": args.hot_share, "hot_experts": args.hot_experts}
        scenarios.append(("hot-rank", shares, params))
    blocks = []
    for name, shares, params in scenarios:
        block = run_scenario(name, shares, params, ctx, args)
        blocks.append(block)
        if rank == 0:
            print_scenario(block)
    payload = dict(
        ep=ep,
        device=torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
        dtype=str(dtype).replace("torch.", ""),
        torch=torch.__version__,
        command=" ".join(sys.argv),
        args=vars(args),
        scenarios=blocks,
    )
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(args.out, payload)
        print(f"\nwrote {args.out}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return payload


if __name__ == "__main__":
    main()
