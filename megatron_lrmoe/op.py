"""The fused expert op: dispatch all-to-all -> grouped experts -> combine all-to-all, whose
backward is LRMoE's: score, select within quota, compact, exchange only the survivors.

Shape legend: P EP ranks, L local experts, E = P*L experts, H hidden, F1 fc1 width (2F gated),
S pairs this rank sends (rows of the permuted tokens, destination-rank-major, i.e. sorted by
global expert id), R pairs this rank's experts receive, K kept pairs.

Row layouts:
* source side ("send order"): the stock permutation output, sorted by global expert then token.
* expert side, "recv order": rank-major ``[source rank][local expert]`` as the all-to-all
  delivers it; "expert order": ``[local expert][source rank]``, what the grouped GEMM needs.
Within every (rank, expert) chunk rows keep token order, which is the canonical tie-break order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import (
    chunk_transpose_index,
    exclusive_cumsum,
    host_to_device,
    row_chunk_ids,
    scatter_rows,
)
from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.experts.mlp import expert_mlp_forward, weighted_expert_mlp_backward
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.dispatch.rows import row_dot, scale_rows
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.select.scoring import (
    Selection,
    draw_uniforms,
    lrm_scores,
    nonfinite_poison,
    row_sq_norms,
    sanitize,
    select,
)
from megatron_lrmoe.observe.stats import CallStats, ExchangeStats, SpanTimer


@dataclass
class ExpertCall:
    """Everything the op needs besides tensors; one per layer call (not a tensor input)."""

    plan: CallPlan
    lrmoe: LRMoEConfig
    spec: GluSpec
    group: Optional[torch.distributed.ProcessGroup]
    stats: Optional[CallStats]
    _indices: dict = field(default_factory=dict)

    def reorder(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reorder ``rows`` laid out as an a-major ``counts[A, B]`` chunk grid to b-major.

        Index plans are cached per call: forward and a keep-all backward reuse the same two.
        """
        if counts.shape[0] == 1 or counts.shape[1] == 1:
            return rows
        key = (tuple(counts.shape), counts.numpy().tobytes())
        index = self._indices.get(key)
        if index is None:
            index = self._indices[key] = chunk_transpose_index(counts, rows.device)
        return rows.index_select(0, index)


def _exchange_stats(
    send_counts: torch.Tensor, rank: int, row_bytes: int, stock_rows: int, stock_row_bytes: int
) -> ExchangeStats:
    """Row and byte counts of one exchange; ``send_counts`` is ``[P, ...]`` rows per receiver."""
    per_rank = send_counts.reshape(send_counts.shape[0], -1).sum(1)
    rows = int(per_rank.sum())
    remote = rows - int(per_rank[rank])
    return ExchangeStats(
        rows=rows,
        bytes=rows * row_bytes,
        remote_rows=remote,
        remote_bytes=remote * row_bytes,
        stock_rows=stock_rows,
        stock_bytes=stock_rows * stock_row_bytes,
    )


class LRMoEExpertsFunction(torch.autograd.Function):
    """Dispatch, expert MLP and combine of one MoE layer call, with a quota-limited backward.

    Forward (exact, every pair):
        | name      | shape    | notes                                                  |
        |-----------|----------|--------------------------------------------------------|
        | tokens    | [S, H]   | permuted token rows (input)                            |
        | probs     | [S]      | routing weight of each pair (input)                    |
        | w1        | [L,F1,H] | expert fc1 weights (input; saved as is, no copy)       |
        | w2        | [L,H,F]  | expert fc2 weights (input; saved as is, no copy)       |
        | z         | [S, H]   | expert output before the routing weight, back at source |
        | out       | [S, H]   | ``probs * z`` (output)                                 |
    Keep ratio < 1 saves ``z`` and ``probs`` at the source (exact router gradient for every
    pair, dropped or not: ``d probs = <g, z>``) and ``||x||^2`` per pair for scoring. Keep ratio
    1 instead sends the probs to the experts, which scale the activation before fc2 as Megatron
    does and return ``d probs`` in backward: nothing ``[S, H]`` is saved at the source. Expert
    side: the received rows ``x`` and the fc1 output ``h`` ("save" mode), or nothing there and
    the source's ``tokens`` ("recompute" mode: they are re-sent for kept pairs only).

    Backward (keep ratio < 1; at 1 steps 2-3 send every unscaled row and step 4 also returns
    ``d probs`` by one more small all-to-all):
        1. ``d probs = <g, z>`` for all S pairs.
        2. score ``p^2 ||g||^2 ||x||^2``; select quota pairs (scope local: per (this source,
           expert) quota; scope global: scores go to the expert owner, which selects and sends
           back the weights).
        3. pack kept rows ``p * w * g`` (+ ``x`` in recompute mode) by (receiver, expert);
           all-to-all of those rows only.
        4. grouped dgrad / wgrad on the survivors; all-to-all of their ``dx`` back.
        5. scatter ``dx`` into the send order (dropped rows get zero).
    """

    @staticmethod
    def forward(
        ctx,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        call: ExpertCall,
        w1: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        plan, lrmoe = call.plan, call.lrmoe
        x_recv = comm.all_to_all_rows(tokens, plan.send_splits, plan.recv_splits, call.group)
        x = call.reorder(x_recv, plan.recv_counts)
        save_h = lrmoe.activation_mode == "save"
        exact = lrmoe.is_exact
        # Keep ratio 1: Megatron's layout, the routing weight goes to the experts and scales the
        # activation before fc2; nothing [S, H] is kept at the source. Keep ratio < 1: the source
        # applies it and keeps z, so d probs of dropped pairs needs no expert backward.
        probs_e = None
        if exact:
            probs_recv = comm.all_to_all_rows(probs, plan.send_splits, plan.recv_splits, call.group)
            probs_e = call.reorder(probs_recv, plan.recv_counts)
        z, h = expert_mlp_forward(
            x, w1, w2, plan.tokens_per_local_expert, call.spec, save_h=save_h, probs=probs_e
        )
        z = call.reorder(z, plan.recv_counts.t())
        z = comm.all_to_all_rows(z, plan.recv_splits, plan.send_splits, call.group)
        out = z if exact else scale_rows(z, probs)

        x_sq = None if exact else row_sq_norms(tokens)
        ctx.call = call
        ctx.save_for_backward(
            None if exact else z,
            probs,
            probs_e,
            x_sq,
            x if save_h else None,
            h,
            tokens if not save_h else None,
            w1,
            w2,
        )
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        call: ExpertCall = ctx.call
        plan, lrmoe, group = call.plan, call.lrmoe, call.group
        z, probs, probs_e, x_sq, x_saved, h_saved, tokens, w1, w2 = ctx.saved_tensors
        g = grad_out.contiguous()
        device = g.device
        num_sent = g.shape[0]
        stats = call.stats
        timer = SpanTimer(device) if stats is not None else None

        # 1. Router gradient, exact for every pair (keep ratio 1: from the experts, step 4).
        exact = lrmoe.is_exact
        d_probs = None if exact else row_dot(g, z, probs.dtype)

        # 2. Selection.
        poison = None
        if exact:
            kept_index = None
            row_scale = None  # the experts apply the routing weight (Megatron's order)
            send_kept, recv_kept = plan.send_counts, plan.recv_counts
            kept_positions = None  # expert side keeps every row
            if stats is not None and lrmoe.debug_record_selection:
                stats.kept_weight = torch.ones(num_sent)
                stats.kept_mask = stats.kept_weight > 0
        else:
            if timer:
                timer.start("scoring")
            scores = lrm_scores(probs, row_sq_norms(g), x_sq)
            poison = nonfinite_poison(scores)
            scores = sanitize(scores)
            if timer:
                timer.stop("scoring")
                timer.start("selection")
            if lrmoe.scope == "local" or plan.ep_size == 1:
                sel, send_kept, recv_kept, kept_positions = _select_local(call, scores)
            else:
                sel, send_kept, recv_kept, kept_positions = _select_global(call, scores)
            kept_index = sel.kept_index
            row_scale = probs.float()[kept_index] * sel.weight
            if timer:
                timer.stop("selection")
            if stats is not None:
                stats.score_total = scores.sum()
                stats.score_kept = scores[kept_index].sum()
                if lrmoe.debug_record_selection:
                    stats.kept_weight = sel.dense_weight(num_sent).cpu()
                    stats.kept_mask = stats.kept_weight > 0

        # 3. Pack and exchange the kept gradient rows (and token rows in recompute mode).
        if timer:
            timer.start("packing")
        g_kept = g if row_scale is None else scale_rows(g, row_scale, index=kept_index)
        recompute = lrmoe.activation_mode == "recompute"
        if recompute:
            x_kept = tokens if kept_index is None else tokens.index_select(0, kept_index)
            payload = torch.cat([g_kept, x_kept.to(g.dtype)], dim=-1)
        else:
            payload = g_kept
        if timer:
            timer.stop("packing")
        send_splits = send_kept.sum(1).tolist()
        recv_splits = recv_kept.sum(1).tolist()
        payload = comm.all_to_all_rows(payload, send_splits, recv_splits, group)
        payload = call.reorder(payload, recv_kept)
        hidden = g.shape[-1]
        kept_per_expert = recv_kept.sum(0)
        if recompute:
            dz, x_k, h_k = payload[:, :hidden].contiguous(), payload[:, hidden:].contiguous(), None
        elif kept_positions is None:
            dz, x_k, h_k = payload, x_saved, h_saved
        else:
            dz = payload
            x_k = x_saved.index_select(0, kept_positions)
            h_k = h_saved.index_select(0, kept_positions)

        # 4. Expert backward on survivors only, then dx goes home.
        dx_k, dw1, dw2, d_probs_e = weighted_expert_mlp_backward(
            dz, x_k, h_k, w1, w2, kept_per_expert, call.spec, probs_e,
            need_dx=ctx.needs_input_grad[0],
        )
        if d_probs_e is not None:
            d_probs_e = call.reorder(d_probs_e, recv_kept.t())
            d_probs_e = comm.all_to_all_rows(d_probs_e, recv_splits, send_splits, group)
            d_probs = d_probs_e.to(probs.dtype)
        d_tokens = None
        if ctx.needs_input_grad[0]:
            dx_k = call.reorder(dx_k, recv_kept.t())
            dx_k = comm.all_to_all_rows(dx_k, recv_splits, send_splits, group)
            d_tokens = dx_k if kept_index is None else scatter_rows(dx_k, kept_index, num_sent)

        if poison is not None:
            # Non-finite scores must reach Megatron's NaN check, never hide in a selection.
            dw1 = dw1 + poison.to(dw1.dtype)
            dw2 = dw2 + poison.to(dw2.dtype)
            d_probs = d_probs + poison.to(d_probs.dtype)

        if stats is not None:
            _fill_backward_stats(stats, call, g, payload, send_kept, recv_kept, timer)
        return d_tokens, d_probs, None, dw1, dw2


def _uniforms(call: ExpertCall, n: int, device: torch.device) -> torch.Tensor:
    plan = call.plan
    return draw_uniforms(call.lrmoe.seed, (plan.layer_number, *plan.stream), n, device)


def _select_local(call: ExpertCall, scores: torch.Tensor):
    """Scope local: this source selects among its own pairs with its share of each quota."""
    plan, lrmoe = call.plan, call.lrmoe
    device = scores.device
    counts = plan.global_counts[plan.ep_rank]  # [E] segments = experts, in send order
    quota_src = plan.source_quota if plan.source_quota is not None else plan.quota.unsqueeze(0)
    quota = quota_src[plan.ep_rank]
    uniforms = None
    if lrmoe.selection == "sample":
        num_experts = counts.numel()
        uniforms = _uniforms(call, plan.ep_size * num_experts, device)
        uniforms = uniforms[plan.ep_rank * num_experts : (plan.ep_rank + 1) * num_experts]
    sel = select(lrmoe.selection, scores, counts, quota, uniforms)
    p, nle = plan.ep_size, plan.num_local_experts
    send_kept = quota.reshape(p, nle)
    recv_kept = quota_src[:, plan.local_experts].contiguous()
    kept_positions = None
    if lrmoe.activation_mode == "save":
        # The expert side holds every received row; tell it which ones survived, as the
        # position of each kept row inside its (source, expert) chunk.
        seg = row_chunk_ids(quota, device)
        within = sel.kept_index - host_to_device(exclusive_cumsum(counts), device)[seg]
        within = comm.all_to_all_rows(
            within, send_kept.sum(1).tolist(), recv_kept.sum(1).tolist(), call.group
        )
        # Chunk start of (source r, local expert l) in the expert-order layout.
        chunk_start = exclusive_cumsum(plan.recv_counts.t().reshape(-1)).reshape(nle, p).t()
        chunk_of_row = row_chunk_ids(recv_kept.reshape(-1), device)
        positions = host_to_device(chunk_start.reshape(-1), device)[chunk_of_row] + within
        kept_positions = call.reorder(positions, recv_kept)
    return sel, send_kept, recv_kept, kept_positions


def _select_global(call: ExpertCall, scores: torch.Tensor):
    """Scope global: each expert's owner selects among the pairs of all sources."""
    plan, lrmoe, group = call.plan, call.lrmoe, call.group
    device = scores.device
    p, nle = plan.ep_size, plan.num_local_experts
    recv_scores = comm.all_to_all_rows(scores, plan.send_splits, plan.recv_splits, group)
    recv_scores = call.reorder(recv_scores, plan.recv_counts)
    uniforms = None
    if lrmoe.selection == "sample":
        uniforms = _uniforms(call, plan.quota.numel(), device)[plan.local_experts]
    owner_sel = select(
        lrmoe.selection, recv_scores, plan.tokens_per_local_expert, plan.local_quota, uniforms
    )
    weight_expert_order = owner_sel.dense_weight(recv_scores.shape[0])
    weight_recv_order = call.reorder(weight_expert_order, plan.recv_counts.t())
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
    kept_index = torch.nonzero(kept_src).squeeze(1)
    sel = Selection(
        kept_index=kept_index,
        weight=weight_src[kept_index].float(),
        kept_per_segment=send_kept.reshape(-1),
    )
    kept_positions = owner_sel.kept_index if lrmoe.activation_mode == "save" else None
    return sel, send_kept, recv_kept, kept_positions


def _fill_backward_stats(
    stats: CallStats,
    call: ExpertCall,
    g: torch.Tensor,
    payload: torch.Tensor,
    send_kept: torch.Tensor,
    recv_kept: torch.Tensor,
    timer: Optional[SpanTimer],
) -> None:
    plan = call.plan
    rank = plan.ep_rank
    elem = g.element_size()
    hidden = g.shape[-1]
    stock_rows = int(plan.send_counts.sum())
    stats.kept_pairs_sent = int(send_kept.sum())
    stats.kept_per_local_expert = recv_kept.sum(0).tolist()
    stats.exchanges["grad"] = _exchange_stats(
        send_kept, rank, payload.shape[-1] * elem, stock_rows, hidden * elem
    )
    stats.exchanges["dgrad"] = _exchange_stats(
        recv_kept, rank, hidden * elem, int(plan.recv_counts.sum()), hidden * elem
    )
    # Stock sends one routing-weight gradient per pair back. LRMoE does too at keep ratio 1;
    # below it the source computes them from z.
    recv_rows = int(plan.recv_counts.sum())
    if call.lrmoe.is_exact:
        stats.exchanges["probs_grad"] = _exchange_stats(
            plan.recv_counts, rank, 4, recv_rows, 4
        )
    else:
        stats.exchanges["probs_grad"] = ExchangeStats(0, 0, 0, 0, recv_rows, recv_rows * 4)
    if not call.lrmoe.is_exact and plan.ep_size > 1:
        if call.lrmoe.scope == "global":
            stats.exchanges["scores"] = _exchange_stats(plan.send_counts, rank, 4, 0, 0)
            stats.exchanges["weights"] = _exchange_stats(plan.recv_counts, rank, 4, 0, 0)
        elif call.lrmoe.activation_mode == "save":
            stats.exchanges["positions"] = _exchange_stats(send_kept, rank, 8, 0, 0)
    stats.timer = timer
    stats.backward_done = True
