"""The per-call controller: all-gathered pair counts and budgets in, a frozen plan out.

Shape legend: P EP ranks, E experts, L = E / P experts owned per rank (rank r owns
``[r*L, (r+1)*L)``), ``N[r, e]`` pairs from source rank r to expert e, ``W[e] = sum_r N[r, e]``.

Pipeline of :func:`plan_call` (host integers only, before any expert compute):
1. Quotas: ``Q0 = ceil(keep_ratio * W)`` (control/quota.py), the upper bound.
2. Placement (``max_replicas_per_rank > 0``): threshold search + greedy (control/placement.py)
   chooses replicas of hot experts, within the replica slots the memory budget leaves, and its
   moves give the forward split ``A[e, g]`` (pairs of e computed on g); with
   ``exact_forward=True`` the exact min-max split over the same holders replaces it
   (``Assignment.place``, control/assignment.py).
3. Backward: the exact min-max assignment ``B[e, g]`` of the quotas over the forward holders
   (``Assignment.backward`` over control/balance.py's holder graph). In ``save`` mode a holder
   can only run backward on pairs whose activations it saved, so ``B <= A``; in ``recompute``
   mode any holder will do.
4. Budgets (water-filling): if the plan with ``Q0`` exceeds the memory or exchange budget, the
   largest common per-expert cap ``c`` with ``Q = min(Q0, c)`` that fits is found by bisection
   (hot experts lose pairs first); the holders' budgets enter the assignment as per-rank caps. If
   even quota 0 does not fit, the plan keeps no pair and names the budget in ``unmet_budgets``;
   it never raises at run time. Trials of the search only ask whether the caps admit an
   assignment (augmenting paths, cuts of ranks that prove they do not); under the memory budget
   alone the answer is monotone in ``c``, and a cut-guided search finds the same ``c`` in a few
   trials (``BudgetSearch.solve``, control/budgets.py).
5. ``activation_mode="auto"``: save unless the memory budget trims it; then recompute, then lean
   (without replicas and exchange budget), the first the budget does not trim, else the one
   that keeps the most pairs.

Per-source splits (what the op exchanges) follow one rule everywhere: an expert's pairs are laid
on a line in source-rank order and its holders take consecutive ranges, the owner first, then the
replicas by rank (``interval_split_np``), so each (source, expert) chunk splits into contiguous
sub-chunks per holder. Backward, scope local: recompute mode selects ``source_quota[r, e]``
(largest remainder, as without replicas) per (source, expert) chunk and sends the kept rows to the
holders by the same rule over ``B``; save mode selects per forward sub-chunk (source, expert,
holder), the holder's ``B[e, g]`` split over its sources in proportion to their pairs there.

Invariants (``ControlPlan.check_invariants``): ``0 <= Q <= Q0 <= W``; ``Q == min(Q0, cap)``;
owners always hold their experts; replicas per rank within ``max_replicas_per_rank``;
``A.sum(1) == W``, ``B.sum(1) == Q``, both zero where a rank does not hold the expert, ``B <= A``
in save mode; per-source splits sum to the counts and quotas; per-rank loads at most the planned
peaks; budgets respected unless named in ``unmet_budgets``. Deterministic: the same counts and
config give the same plan on every rank (ties: lower expert id, lower rank).

This module holds the entry points: :func:`check_budgets` (at layer construction) and
:func:`plan_call` (per call: it validates the counts, plans each activation mode with a
:class:`BudgetSearch`, keeps the best and freezes it). The plan objects (:class:`ControlPlan`,
:class:`MemoryPlan`) are control/plan.py's; the compiled twins of the hot loops and their argument
blocks are control/native.py's.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Optional

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control import native
from megatron_lrmoe.control.assignment import Backward
from megatron_lrmoe.control.budgets import BudgetSearch
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.plan import ControlPlan, MemoryPlan
from megatron_lrmoe.control.quota import _ABS_TOL, _REL_TOL, quotas_np

__all__ = [
    "ControlPlan",
    "MemoryPlan",
    "check_budgets",
    "minimum_memory_bytes",
    "plan_call",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- #
# Start-up validation
# --------------------------------------------------------------------------------------------- #


def _modes(lrmoe: LRMoEConfig) -> tuple[str, ...]:
    """The modes a call may take, in order of preference: ``auto`` tries ``save``, then
    ``recompute``, then ``lean`` where lean may run (no replicas, no exchange budget)."""
    if lrmoe.activation_mode != "auto":
        return (lrmoe.activation_mode,)
    if not lrmoe.lean_conflicts():
        return ("save", "recompute", "lean")
    return ("save", "recompute")


def minimum_memory_bytes(
    lrmoe: LRMoEConfig, cost: CostModel, pairs_per_rank: int, ep_size: Optional[int] = None
) -> int:
    """Least per-GPU memory a call needs at quota 0 without replicas, with every rank computing
    the mean ``pairs_per_rank`` rows (the best any placement can do).

    It is what no quota can remove: saved activations (save mode; without x at ``ep_size`` 1,
    where the trimmed path reads it from the layer input), source-side rows (z, and the token
    rows in recompute mode) and lean's router-gradient rows. With ``activation_mode="auto"``
    the cheaper mode counts. An unknown ``ep_size`` counts as EP > 1 (the larger).
    """
    local_tokens = ep_size == 1
    return min(
        pairs_per_rank
        * (
            cost.expert_saved_bytes(mode, local_tokens)
            + cost.source_saved_bytes(mode, keeps_all=False)
            + cost.router_bytes(mode)
        )
        for mode in _modes(lrmoe)
    )


def check_budgets(
    lrmoe: LRMoEConfig,
    cost: Optional[CostModel],
    pairs_per_rank: Optional[int] = None,
    layer_name: str = "LRMoELayer",
    ep_size: Optional[int] = None,
) -> None:
    """Start-up check of the budgets against the layer's shapes (call at layer construction).

    Args:
        lrmoe: The layer's config.
        cost: The layer's :class:`CostModel` (``CostModel.from_config(transformer_config)``);
            required when a budget is set.
        pairs_per_rank: Pairs each rank routes per call, tokens per rank times top-k (e.g.
            ``seq_length * micro_batch_size / tp`` (sequence parallel) ``* moe_router_topk``), if
            known; without it only what the shapes alone decide is checked.
        layer_name: Named in error messages.
        ep_size: The expert-parallel size, if known (EP 1 saves less: :func:`minimum_memory_bytes`).

    Raises:
        ValueError: A budget no quota can meet, naming the budget, the minimum and the fix.
    """
    budgets = lrmoe.memory_budget_bytes is not None or lrmoe.exchange_budget_bytes is not None
    if budgets and cost is None:
        raise ValueError(f"{layer_name}: LRMoE budgets need a CostModel of the layer's shapes")
    memory = lrmoe.memory_budget_bytes
    if memory is None or cost is None or pairs_per_rank is None:
        return
    need = minimum_memory_bytes(lrmoe, cost, pairs_per_rank, ep_size)
    if memory < need:
        fix = f"set --lrmoe-memory-budget-bytes to at least {need}"
        if lrmoe.activation_mode != "lean":
            mode = "recompute" if lrmoe.lean_conflicts() else "lean"
            cheaper = minimum_memory_bytes(
                LRMoEConfig(activation_mode=mode), cost, pairs_per_rank, ep_size
            )
            if cheaper < need:
                fix += f" (or {cheaper} with --lrmoe-activation-mode {mode})"
        raise ValueError(
            f"{layer_name}: memory_budget_bytes ({memory}) cannot be met at any quota: a call "
            f"with {pairs_per_rank} pairs per rank holds at least {need} bytes per GPU at quota 0 "
            f"without replicas (activation_mode={lrmoe.activation_mode!r}); {fix}"
        )
    if lrmoe.max_replicas_per_rank > 0 and memory < need + cost.replica_bytes:
        logger.warning(
            "%s: max_replicas_per_rank=%d can never be used: one replica needs %d bytes on top of "
            "the %d bytes of quota 0, and memory_budget_bytes is %d",
            layer_name,
            lrmoe.max_replicas_per_rank,
            cost.replica_bytes,
            need,
            memory,
        )


# --------------------------------------------------------------------------------------------- #
# The per-call plan
# --------------------------------------------------------------------------------------------- #


def _memory_plan(call: BudgetSearch, plan: Backward) -> MemoryPlan:
    cost, mode, sent = call.cost, call.mode, call.sent
    own = call.fixed_rank_load
    replicas = cost.replica_bytes * call.replicas_per_rank
    keeps_all = call.keeps_all(plan.quota)
    multi = call.num_sources > 1
    exchange = cost.exchange_bytes(mode) if multi else 0
    row = cost.row_bytes if multi else 0
    arrays = [
        replicas,
        call.saved_memory(keeps_all),
        cost.backward_bytes(mode, keeps_all) * plan.rank_load,
        call.router_memory(keeps_all),
        cost.forward_buffer_bytes * call.forward_rank_load,
        exchange * call.sent_rows(plan),
        exchange * plan.rank_load,
        cost.stock_saved_bytes * own,
        cost.stock_backward_bytes * own,
        cost.forward_buffer_bytes * own,
        row * sent,
        row * own,
    ]
    return MemoryPlan(*(torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays))


def _as_counts(counts: Any, signs: bool = True) -> np.ndarray:
    """``counts`` as a C-contiguous host int64 ``[P, E]`` array, validated (the signs only
    when ``signs``: the native pass over the counts checks them on its way)."""
    if isinstance(counts, torch.Tensor):
        if counts.dtype == torch.int64 and counts.device.type == "cpu":
            counts = counts.numpy()  # shares memory (integer tensors carry no gradient)
        elif counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"counts must be an integer tensor, got {counts.dtype}")
        else:
            # NOTE: device-to-host sync if the counts live on the GPU (pass host counts).
            counts = counts.detach().to("cpu", torch.int64).numpy()
    n = np.ascontiguousarray(np.asarray(counts, dtype=np.int64))
    if n.ndim != 2 or n.shape[0] == 0:
        raise ValueError(f"counts must be [P, E] with P >= 1, got shape {tuple(n.shape)}")
    if n.shape[1] % n.shape[0]:
        raise ValueError(
            f"counts has {n.shape[1]} experts, not divisible by its {n.shape[0]} ranks"
        )
    if signs and n.size and n.min() < 0:
        raise ValueError("counts must be non-negative")
    return n


def _totals(n: np.ndarray, keep_ratio: float, lib: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(W, Q0)``: pairs per expert and the uncapped quotas (:func:`quotas_np`), in one C pass
    with the native library (which also checks the counts' signs, see :func:`_as_counts`)."""
    if lib is None:
        w = n.sum(0)
        return w, quotas_np(w, keep_ratio)
    out = native.counts(lib, n, keep_ratio, _ABS_TOL, _REL_TOL)
    if out is None:
        raise ValueError("counts must be non-negative")
    return out[0], out[1]


def plan_call(
    counts: Any,
    ep_rank: int,
    lrmoe: LRMoEConfig,
    cost: Optional[CostModel] = None,
    *,
    check: Optional[bool] = None,
    exact_forward: bool = False,
) -> ControlPlan:
    """Plan one MoE layer call from the all-gathered pair counts (see the module docstring).

    Args:
        counts: ``[P, E]`` host int pairs from source rank r to expert e (a torch tensor or numpy
            array; every rank passes the same counts).
        ep_rank: This rank's index in the EP group.
        lrmoe: keep ratio (upper bound), budgets, replica limit, activation mode, scope, and
            whether to plan with the compiled planner (``kernels.native_planner``).
        cost: Bytes per pair and per replica (:meth:`CostModel.from_config`); needed for budgets
            and for the memory accounting (``ControlPlan.memory`` is None without it).
        check: Run ``check_invariants`` (default: ``lrmoe.debug_check_invariants``).
        exact_forward: Replace the placement greedy's forward split by the exact min-max split
            over the same replicas (drops replicas it leaves idle). Off by default: on Zipf
            loads it lowers the forward peak by well under 1 % and costs milliseconds at EP 64
            (benchmarks/planner_bench.py measures both).

    Returns:
        The frozen plan; identical on every rank for the same counts and config.

    Raises:
        ValueError: malformed counts, an ``ep_rank`` outside ``[0, P)``, or budgets without a
            cost model.
    """
    start = time.perf_counter()
    # The compiled twins of the hot loops unless the config switches them off (same plans).
    lib = native.library() if lrmoe.kernels.native_planner else None
    n = _as_counts(counts, signs=lib is None)
    num_sources = n.shape[0]
    if not 0 <= int(ep_rank) < num_sources:
        raise ValueError(f"ep_rank ({ep_rank}) must be in [0, {num_sources})")
    budgets = lrmoe.memory_budget_bytes is not None or lrmoe.exchange_budget_bytes is not None
    if budgets and cost is None:
        raise ValueError("LRMoE budgets need a CostModel (CostModel.from_config(config))")
    w, q0 = _totals(n, float(lrmoe.keep_ratio), lib)
    # Modes in order of preference (auto: save, recompute, lean); the first that no budget trims
    # wins at once, else the one that keeps the most pairs (then the lower forward peak).
    best: Optional[tuple[tuple, BudgetSearch, Backward, Optional[int], tuple, tuple]] = None
    modes = _modes(lrmoe)
    for mode in modes:
        call = BudgetSearch(n, w, lrmoe, cost, mode, q0, exact_forward, lib)
        call.place()
        plan, cap, binding, unmet = call.solve()
        rank = (
            (bool(unmet), -int(plan.quota.sum()), int(call.forward_rank_load.max(initial=0)))
            if len(modes) > 1
            else ()
        )
        if best is None or rank < best[0]:
            best = (rank, call, plan, cap, binding, unmet)
        if not binding:
            break
    _, call, plan, cap, binding, unmet = best
    forward_peak, fixed_forward_peak = call.peaks or (
        int(call.forward_rank_load.max(initial=0)),
        int(call.fixed_rank_load.max(initial=0)),
    )
    backward_peak, fixed_backward_peak = plan.peaks or (
        int(plan.rank_load.max(initial=0)),
        int(call.per_owner(plan.quota).max(initial=0)),
    )
    result = ControlPlan.of(
        ep_rank=int(ep_rank),
        ep_size=num_sources,
        num_local_experts=call.local,
        counts=torch.from_numpy(n),
        uncapped_quota=torch.from_numpy(q0),
        quota=torch.from_numpy(plan.quota),
        quota_cap=cap,
        source_split=plan.source,
        holds=torch.from_numpy(call.holds),
        forward_load=torch.from_numpy(call.forward_load),
        backward_load=torch.from_numpy(plan.backward_load),
        activation_mode=call.mode,
        scope=lrmoe.scope,
        forward_rank_load=torch.from_numpy(call.forward_rank_load),
        backward_rank_load=torch.from_numpy(plan.rank_load),
        forward_peak=forward_peak,
        backward_peak=backward_peak,
        fixed_forward_peak=fixed_forward_peak,
        fixed_backward_peak=fixed_backward_peak,
        threshold=call.threshold,
        memory_budget_bytes=lrmoe.memory_budget_bytes,
        exchange_budget_bytes=lrmoe.exchange_budget_bytes,
        max_replicas_per_rank=lrmoe.max_replicas_per_rank,
        trimmed_pairs=0 if plan.quota is q0 else int((q0 - plan.quota).sum()),
        binding_budgets=binding,
        unmet_budgets=unmet,
        planner_time_s=time.perf_counter() - start,
        memory_builder=None if cost is None else functools.partial(_memory_plan, call, plan),
    )
    if check if check is not None else lrmoe.debug_check_invariants:
        result.check_invariants()
    return result
