"""The trimmed backward's named stages, each consuming a small frozen plan:
:func:`select_kept` (scoring and selection -> :class:`KeptPlan`) -> :func:`pack_kept` ->
:func:`exchange_kept` -> expert backward on the survivors (``experts/mlp.py``, called by
``trimmed.py``) -> :func:`return_dx`; and :func:`replayed_front`, the first two (with the
router gradient) as one replayed CUDA graph.

Device-to-host syncs: none with scope ``local`` (every count is a host integer of the forward
plan); scope ``global`` needs one (the owners' kept counts, in :func:`_select_global`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import numpy as np
import torch

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import (
    exclusive_cumsum,
    host_to_device,
    kept_position_shift,
    repeat_per_row,
    row_chunk_ids,
)
from megatron_lrmoe.dispatch.replicas import KeptLayout
from megatron_lrmoe.dispatch.rows import gather_rows, gather_sum, pack_pairs, scale_rows
from megatron_lrmoe.graphs.front import (
    FrontBuffers,
    front_graphs_wanted,
    front_triton,
    replayed_score_and_select,
)
from megatron_lrmoe.observe.stats import SpanTimer
from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.select.contract import PairScores, Selection
from megatron_lrmoe.select.scoring import draw_uniforms, pair_scores, select, token_norms
from megatron_lrmoe.triton_common import use_triton

__all__ = [
    "KeptPlan",
    "exchange_kept",
    "exchange_lean_kept",
    "pack_kept",
    "replayed_front",
    "return_dx",
    "select_kept",
]


@dataclass(frozen=True)
class KeptPlan:
    """What survives this call's backward, from :func:`select_kept`.

    Attributes:
        kept_index: ``[Ks]`` int64 kept pairs of this rank, ascending send-order positions.
        weight: ``[Ks]`` fp32 gradient multiplier of each (1, or 1/inclusion probability).
        send_kept: ``[P, L]`` host int64 kept rows this rank sends to (rank, local expert).
        recv_kept: ``[P, L]`` host int64 kept rows its experts receive from (source, expert).
        kept_positions: ``[Kr]`` int64 row of each received kept pair in the forward's
            expert-order rows (``save`` mode, where the expert side kept them), else ``None``.
        poison: 0-dim fp32, NaN when a score was not finite (added to the gradients).
        send_pairs: With replicas, ``[Ks]`` kept pairs (pair-order positions) in exchange
            order, ``(destination, instance)``-major; ``None`` when that is ``kept_index``.
        send_weight: Their multipliers, in the same order (``None`` likewise).

    With replicas ``send_kept`` is ``[P, 1]`` (rows per destination) and ``recv_kept``
    ``[P, I]`` (per source and local instance).
    """

    kept_index: torch.Tensor
    weight: torch.Tensor
    send_kept: torch.Tensor
    recv_kept: torch.Tensor
    kept_positions: Optional[torch.Tensor]
    poison: torch.Tensor
    send_pairs: Optional[torch.Tensor] = None
    send_weight: Optional[torch.Tensor] = None

    @cached_property
    def send_splits(self) -> list[int]:
        """Kept rows this rank sends to each rank (host ints, computed once)."""
        return self.send_kept.numpy().sum(1).tolist()

    @cached_property
    def recv_splits(self) -> list[int]:
        """Kept rows this rank's experts receive from each rank."""
        return self.recv_kept.numpy().sum(1).tolist()

    @cached_property
    def rows_per_instance(self) -> torch.Tensor:
        """``[L]`` (``[I]`` with replicas) kept rows each local expert (instance) runs."""
        return self.recv_kept.sum(0)

    @property
    def exchange_pairs(self) -> torch.Tensor:
        """``[Ks]`` the kept pairs in the order their rows are exchanged."""
        return self.kept_index if self.send_pairs is None else self.send_pairs

    @property
    def exchange_weight(self) -> torch.Tensor:
        """``[Ks]`` their gradient multipliers, in the same order."""
        return self.weight if self.send_weight is None else self.send_weight


# --------------------------------------------------------------------------------------------- #
# Stage 1: score and select.
# --------------------------------------------------------------------------------------------- #


def _uniforms(call: ExpertCall, key: tuple[int, ...], n: int) -> torch.Tensor:
    """``[n]`` host uniforms of this call, the same on every rank and every rerun."""
    return draw_uniforms(call.lrmoe.seed, (call.plan.layer_number, *key), n)


def select_kept(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    key: tuple[int, ...],
    timer: Optional[SpanTimer],
) -> KeptPlan:
    """Stage 1: score every pair of this rank and select the survivors.

    Score ``p^2 ||g_t||^2 ||x_t||^2``: both norms are token properties, taken once per token
    (:func:`token_norms`), each relative to its largest value in the call (in the EP group for
    scope global, where sources compete), so the fp32 scores cannot overflow and need no sync
    (:func:`pair_scores`). Where this source selects among its own pairs (scope local or EP 1,
    no replicas) scoring and selection are one step (:func:`replayed_score_and_select`: on CUDA
    one replayed graph), and its time is the ``selection`` span.
    """
    lrmoe, token_of_pair, stats = call.lrmoe, call.perm.token_of_pair, call.stats
    kept_total = None
    if call.layout is None and (lrmoe.scope == "local" or call.plan.ep_size == 1):
        if timer:
            timer.start("selection")
        counts, quota, uniforms = _local_segments(call, key)
        scored, sel, kept_total = replayed_score_and_select(
            lrmoe.selection, g, hidden, probs, token_of_pair, counts, quota, uniforms,
            kept_total=stats is not None, owned=False,
        )
        kept = _local_plan(call, sel, quota, scored.poison)
        if timer:
            timer.stop("selection")
    else:
        if timer:
            timer.start("scoring")
        norms = token_norms(g, hidden)  # [2, T]
        top = norms.amax(dim=1) if norms.shape[1] else norms.new_zeros(2)
        if lrmoe.scope == "global":
            top = comm.all_reduce_max(top, call.group)
        scored = pair_scores(probs, token_of_pair, norms, top)
        if timer:
            timer.stop("scoring")
            timer.start("selection")
        if call.layout is not None:
            kept = _select_with_replicas(call, scored.scores, scored.poison, key)
        else:
            kept = _select_global(call, scored.scores, scored.poison, key)
        if timer:
            timer.stop("selection")
    if stats is not None:
        _record_selection(call, scored, kept, kept_total)
    return kept


def _record_selection(
    call: ExpertCall, scored: PairScores, kept: KeptPlan, kept_total: Optional[torch.Tensor]
) -> None:
    """The selection's statistics: the score total, the kept scores' (``kept_total`` when the
    selection summed them already), the variance the sample adds (``CallStats.
    score_added_variance``) and, when asked, the dense kept weights."""
    stats = call.stats
    kept_scores = torch.nan_to_num(
        scored.scores.index_select(0, kept.kept_index), nan=0.0, posinf=0.0, neginf=0.0
    )
    if kept_total is None:
        kept_total = kept_scores.sum()
    # sum_i (1/pi_i - 1) s_i estimated from the kept pairs alone: each kept pair's term weighted
    # by its 1/pi (select/variance.py has the exact sum over every pair, for tests).
    weight = kept.weight.to(kept_scores.dtype)
    added = torch.dot(weight * (weight - 1.0), kept_scores)
    # One copy of all three: a replayed graph's sums are overwritten by its next replay, and
    # these are read when the metrics are reported.
    totals = torch.stack((scored.total.to(added.dtype), kept_total.to(added.dtype), added))
    stats.score_total, stats.score_kept, stats.score_added_variance = totals
    if call.lrmoe.debug_record_selection:
        dense = torch.zeros(scored.scores.numel(), dtype=torch.float32, device=totals.device)
        stats.kept_weight = dense.index_copy_(0, kept.kept_index, kept.weight).cpu()
        stats.kept_mask = stats.kept_weight > 0


def replayed_front(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    z: torch.Tensor,
    key: tuple[int, ...],
    timer: Optional[SpanTimer],
) -> Optional[tuple[torch.Tensor, KeptPlan, torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    """The router gradient, :func:`select_kept` and :func:`pack_kept` as one replayed CUDA
    graph (``graphs/front.py``, ``front_triton``), where a source selects among its own pairs
    (scope local or EP 1, no replicas) on CUDA; ``None`` elsewhere and where the graph cannot
    run (its first sighting of a shape, graphs off, inputs it cannot read in place), and the
    caller runs the stages one by one: the same kernels, so the same bits.

    Returns ``(d_probs, kept, g_kept, x_kept, row_of_pair)`` as the stages give them; its time
    is the ``front`` span (row-dot, scoring, selection and packing together). At EP 1 with fused
    accumulation :func:`_graphed_backward` replays this front and the expert half as one graph.
    """
    lrmoe = call.lrmoe
    local = call.layout is None and (lrmoe.scope == "local" or call.plan.ep_size == 1)
    # Nothing is prepared where no graph can run (switched off, inside a capture, not CUDA).
    if not (local and use_triton(g, hidden, probs, z) and front_graphs_wanted(g.device)):
        return None
    counts, quota, uniforms = _local_segments(call, key)
    num_kept, width = int(quota.numpy().sum()), g.shape[1]
    g_kept = g.new_empty((num_kept, width))
    x_kept = hidden.new_empty((num_kept, width)) if _packs_inputs(call) else None
    buffers = FrontBuffers(
        z=z,
        slots=call.route.slot_send,
        d_probs=torch.empty(probs.shape, dtype=probs.dtype, device=probs.device),
        g_kept=g_kept,
        x_kept=x_kept,
    )
    if timer:
        timer.start("front")
    front = front_triton(
        lrmoe.selection, g, hidden, probs, call.perm.token_of_pair, counts, quota, uniforms,
        buffers, kept_total=call.stats is not None, owned=False,
    )
    if front is None:
        if timer:
            timer.cancel("front")
        return None
    scored, sel, kept_total = front.scored
    kept = _local_plan(call, sel, quota, scored.poison)
    if timer:
        timer.stop("front")
    if call.stats is not None:
        _record_selection(call, scored, kept, kept_total)
    return buffers.d_probs, kept, buffers.g_kept, buffers.x_kept, front.row_of_pair


def _local_segments(
    call: ExpertCall, key: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Scope local: this source selects among its own pairs with its share of each quota.

    Returns ``(counts, quota, uniforms)`` of its segments (one per expert, in send order): host
    tensors, and the call's host uniforms for ``sample`` (else ``None``).
    """
    plan, lrmoe = call.plan, call.lrmoe
    counts = plan.global_counts[plan.ep_rank]  # [E] segments = experts, in send order
    quota = plan.quota_by_source[plan.ep_rank]
    uniforms = None
    if lrmoe.selection == "sample":
        num_experts = counts.numel()
        uniforms = _uniforms(call, key, plan.ep_size * num_experts)
        # Host uniforms: the fused selection puts them into its one host-to-device copy.
        if plan.ep_size > 1:
            uniforms = uniforms[plan.ep_rank * num_experts : (plan.ep_rank + 1) * num_experts]
    return counts, quota, uniforms


def _local_plan(
    call: ExpertCall,
    sel: Selection,
    quota: torch.Tensor,
    poison: torch.Tensor,
) -> KeptPlan:
    """The :class:`KeptPlan` of a scope-local selection (:func:`_local_segments`)."""
    plan = call.plan
    device = sel.kept_index.device
    p, nle = plan.ep_size, plan.num_local_experts
    send_kept = quota.reshape(p, nle)
    kept_positions = None
    if p == 1:
        recv_kept = plan.quota_by_source[:, plan.local_experts].contiguous()
        if _expert_holds_rows(call):
            # Send order is expert order: the kept pairs are the kept expert-side rows.
            kept_positions = sel.kept_index
        return KeptPlan(sel.kept_index, sel.weight, send_kept, recv_kept, kept_positions, poison)
    # Host integers in numpy (a torch CPU op costs ~5 us; this runs in every backward).
    recv_np = np.ascontiguousarray(plan.quota_by_source.numpy()[:, plan.local_experts])
    recv_kept = torch.from_numpy(recv_np)
    if _expert_holds_rows(call):
        # The expert side holds every received row; the source tells it which ones survived,
        # as their rows there: each kept send position plus its expert's shift (one host
        # table, one copy, one expansion; the owner only reorders what arrives).
        quota_np = quota.numpy()
        shift = kept_position_shift(
            np.asarray(plan.global_counts.numpy(), dtype=np.int64), plan.ep_rank, nle
        )
        positions = sel.kept_index + repeat_per_row(
            shift, quota_np, sel.kept_index.numel(), device
        )
        kept_positions = call.route.exchange(
            positions, quota_np.reshape(p, nle).sum(1).tolist(), recv_np.sum(1).tolist(), recv_kept
        )
    return KeptPlan(sel.kept_index, sel.weight, send_kept, recv_kept, kept_positions, poison)


# Tag of the sampling stream of the per-holder sub-chunks (save mode with replicas), so that it
# never coincides with the per-(source, expert) stream of the same call.
REPLICA_SUBCHUNK_STREAM = -1


def _select_with_replicas(
    call: ExpertCall, scores: torch.Tensor, poison: torch.Tensor, key: tuple[int, ...]
) -> KeptPlan:
    """Scope local with replicas placed: the kept pairs go to the holders the plan chose.

    ``save``: a holder can only run backward on pairs whose activations it saved, so this
    source selects per forward sub-chunk (expert, holder) exactly the plan's
    ``backward_send_counts`` (at most the sub-chunk's pairs; their sum per expert is its quota
    share). ``recompute``: the selection per (source, expert) chunk is the one without
    replicas (same quotas, same uniforms, same pairs); the kept pairs of each expert are then
    split over its holders by the line rule. Either way the kept pairs, listed in pair order,
    come per expert in line-order holder sub-chunks, and one chunk gather puts them in
    ``(destination, instance)`` order for the exchange.
    """
    plan, lrmoe, layout = call.plan, call.lrmoe, call.layout
    control = plan.control
    rank, num_ranks = plan.ep_rank, plan.ep_size
    device = scores.device
    save = call.activation_mode == "save"
    if save:
        counts, quota, segment_start = layout.selection_segments(control)
    else:
        counts, quota = plan.global_counts[rank], plan.source_quota[rank]
    uniforms = None
    if lrmoe.selection == "sample":
        if save:
            stream = (*key, REPLICA_SUBCHUNK_STREAM, rank)
            uniforms = _uniforms(call, stream, counts.numel())
        else:
            num_experts = counts.numel()
            uniforms = _uniforms(call, key, num_ranks * num_experts)
            uniforms = uniforms[rank * num_experts : (rank + 1) * num_experts]
    sel: Selection = select(lrmoe.selection, scores, counts, quota, uniforms, owned=False)
    kept_layout: KeptLayout = layout.kept_layout(
        control.backward_send_counts(rank), control.backward_recv_counts(rank)
    )
    send_index = kept_layout.send_index
    kept_positions = None
    if save:
        # Position of each kept row inside its forward sub-chunk, which is the holder's
        # (source, instance) chunk of saved rows; it travels with the gradient rows.
        seg = row_chunk_ids(quota, device)
        within = sel.kept_index - host_to_device(segment_start, device)[seg]
        within = comm.all_to_all_rows(
            within.index_select(0, send_index),
            kept_layout.send_totals.reshape(-1).tolist(),
            kept_layout.recv_counts.sum(1).tolist(),
            call.group,
        )
        forward_counts = layout.recv_counts  # [P, I]
        num_instances = forward_counts.shape[1]
        chunk_start = (
            exclusive_cumsum(forward_counts.t().reshape(-1)).reshape(num_instances, num_ranks).t()
        )
        chunk_of_row = row_chunk_ids(kept_layout.recv_counts.reshape(-1), device)
        positions = host_to_device(chunk_start.reshape(-1), device)[chunk_of_row] + within
        kept_positions = call.route.reorder(positions, kept_layout.recv_counts)
    return KeptPlan(
        kept_index=sel.kept_index,
        weight=sel.weight,
        send_kept=kept_layout.send_totals,
        recv_kept=kept_layout.recv_counts,
        kept_positions=kept_positions,
        poison=poison,
        send_pairs=sel.kept_index.index_select(0, send_index),
        send_weight=sel.weight.index_select(0, send_index),
    )


def _select_global(
    call: ExpertCall, scores: torch.Tensor, poison: torch.Tensor, key: tuple[int, ...]
) -> KeptPlan:
    """Scope global: each expert's owner selects among the pairs of all sources."""
    plan, lrmoe, group = call.plan, call.lrmoe, call.group
    device = scores.device
    p, nle = plan.ep_size, plan.num_local_experts
    recv_scores = call.route.to_experts(scores)
    uniforms = None
    if lrmoe.selection == "sample":
        uniforms = _uniforms(call, key, plan.quota.numel())[plan.local_experts]
    owner_sel = select(
        lrmoe.selection,
        recv_scores,
        plan.tokens_per_local_expert,
        plan.local_quota,
        uniforms,
        owned=False,
    )
    weight_expert_order = owner_sel.dense_weight(recv_scores.shape[0])
    weight_recv_order = call.route.reorder(weight_expert_order, plan.recv_counts.t())
    weight_src = comm.all_to_all_rows(weight_recv_order, plan.recv_splits, plan.send_splits, group)
    kept_src = weight_src > 0
    # Kept counts per chunk on both sides; one host copy for both.
    src_chunks = row_chunk_ids(plan.send_counts.reshape(-1), device)
    recv_chunks = row_chunk_ids(plan.recv_counts.reshape(-1), device)
    kept_recv_order = weight_recv_order > 0
    counts = torch.zeros(2, p * nle, dtype=torch.int64, device=device)
    counts[0].index_add_(0, src_chunks, kept_src.to(torch.int64))
    counts[1].index_add_(0, recv_chunks, kept_recv_order.to(torch.int64))
    counts = counts.cpu()  # NOTE: device-to-host sync: split sizes of the compacted exchange
    send_kept = counts[0].reshape(p, nle)
    recv_kept = counts[1].reshape(p, nle)
    # The kept count is a host integer now: no second sync for the compaction.
    kept_index = torch.nonzero_static(kept_src, size=int(send_kept.sum())).squeeze(1)
    kept_positions = owner_sel.kept_index if _expert_holds_rows(call) else None
    return KeptPlan(
        kept_index, weight_src[kept_index].float(), send_kept, recv_kept, kept_positions, poison
    )


# --------------------------------------------------------------------------------------------- #
# Stages 2, 3 and 5: pack, exchange, return.
# --------------------------------------------------------------------------------------------- #


def new_row_of_pair(call: ExpertCall, device: torch.device) -> torch.Tensor:
    """``[S + 1]`` int64 all ``-1``: :func:`pack_kept` writes each kept pair's packed row into
    it, the trailing entry stays ``-1`` (no pair), and :func:`return_dx` reads it."""
    return torch.full((call.perm.num_pairs + 1,), -1, dtype=torch.int64, device=device)


def pack_kept(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    kept: KeptPlan,
    row_of_pair: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stage 2: the kept pairs' gradient rows ``p * w * g_t`` (and their fc1 input rows ``x_t``
    when the expert side does not hold them: at EP 1, where the expert side is this rank, and in
    ``recompute`` mode), packed densely in exchange order, (receiver rank, expert)-major (with
    replicas: (receiver rank, instance)-major, ``KeptPlan.send_pairs``). One fused kernel
    (:func:`pack_pairs`); nothing ``[S, H]``. The poison rides in the rows' scale. With
    ``row_of_pair`` (:func:`new_row_of_pair`) the kernel also records each kept pair's packed
    row, which is the row its ``dx`` comes back in (:func:`return_dx`).
    """
    return pack_pairs(
        g,
        call.perm.token_of_pair,
        kept.exchange_pairs,
        probs,
        kept.exchange_weight,
        x=hidden if _packs_inputs(call) else None,
        poison=kept.poison,
        row_of_pair=row_of_pair,
    )


def _expert_holds_rows(call: ExpertCall) -> bool:
    """Whether the expert side holds a row of every pair it computed when the kept ones are
    chosen, so that the source sends their positions (``KeptPlan.kept_positions``): the saved
    inputs in ``save`` mode; in ``lean`` mode every pair's gradient row, received for the
    router gradient (``lean_gradient_rows``)."""
    return call.activation_mode == "save" or (
        call.activation_mode == "lean" and call.plan.ep_size > 1
    )


def _packs_inputs(call: ExpertCall) -> bool:
    """Whether the kept rows' inputs go with their gradient rows (the expert side does not
    hold them: EP 1, where it reads them from the tokens, and ``recompute`` and ``lean``
    modes)."""
    return call.plan.ep_size == 1 or call.activation_mode in ("recompute", "lean")


def exchange_kept(
    call: ExpertCall, kept: KeptPlan, g_kept: torch.Tensor, x_kept: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stage 3: all-to-all of the kept rows only, into expert order on the receiver."""
    route, send, recv = call.route, kept.send_splits, kept.recv_splits
    dz = route.exchange(g_kept, send, recv, kept.recv_kept)
    x_in = None if x_kept is None else route.exchange(x_kept, send, recv, kept.recv_kept)
    return dz, x_in


def exchange_lean_kept(
    call: ExpertCall,
    kept: KeptPlan,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    g_rows: torch.Tensor,
    row_of_pair: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 2 and 3 in ``lean`` mode at EP > 1, where the experts already hold every pair's
    gradient row (``g_rows``, expert order, from the router gradient): the source packs and
    sends the kept pairs' token rows and their gradient scale ``p * w`` (+ poison) only, and
    the expert side gathers and scales its own gradient rows at the kept positions (the rows
    :func:`pack_kept` would have sent, to the bit). Returns ``(dz, x_in)`` in expert order;
    fills ``row_of_pair`` as :func:`pack_kept` does."""
    pairs = kept.exchange_pairs
    x_kept = gather_rows(hidden, call.perm.token_of_pair.index_select(0, pairs))
    scale = probs.float().index_select(0, pairs) * kept.exchange_weight + kept.poison
    if row_of_pair is not None:
        row_of_pair[pairs] = torch.arange(pairs.numel(), device=pairs.device)
    route, send, recv = call.route, kept.send_splits, kept.recv_splits
    x_in = route.exchange(x_kept, send, recv, kept.recv_kept)
    scale_in = route.exchange(scale.unsqueeze(1), send, recv, kept.recv_kept).squeeze(1)
    return scale_rows(g_rows, scale_in, kept.kept_positions), x_in


def _kept_inputs(ctx, kept: KeptPlan, x_in: Optional[torch.Tensor]) -> torch.Tensor:
    """The kept rows' fc1 input, in expert order (fc1's weight gradient needs them dense).

    The input rows came packed with the gradients (``x_in``) at EP 1 and in ``recompute`` mode;
    otherwise (``save`` at EP > 1) the expert side gathers them from the rows it saved. The
    kept rows of the saved fc1 output are not gathered: the activation backward reads them in
    place (``h_rows``).
    """
    return x_in if x_in is not None else gather_rows(ctx.x, kept.kept_positions)


def return_dx(
    call: ExpertCall, kept: KeptPlan, dx_k: torch.Tensor, row_of_pair: torch.Tensor
) -> torch.Tensor:
    """Stage 5: kept rows' ``dx`` go home; each token adds up its kept pairs' rows.

    The return exchange inverts :func:`exchange_kept` (expert order -> receive order -> the
    senders), so ``dx_k`` arrives in the order :func:`pack_kept` packed the gradient rows,
    ``kept.exchange_pairs``. ``row_of_pair`` (filled by :func:`pack_kept`) maps every pair to
    that row or ``-1``, so the gather-sum walks the slot plan ``perm.slot_pair`` through it: no
    ``[T, K]`` index is built (``PairPermutation.slot_rows`` is the reference).
    """
    dx_k = call.route.exchange_back(dx_k, kept.send_splits, kept.recv_splits, kept.recv_kept)
    return gather_sum(dx_k, call.perm.slot_pair, row_of=row_of_pair)
