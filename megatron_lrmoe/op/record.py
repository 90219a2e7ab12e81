"""The op's per-call statistics (``observe/stats.py``'s :class:`CallStats`), filled at the end
of each backward: rows and bytes of every exchange against stock's, kept rows per expert.

Host integers only, read through numpy: this runs in every backward of every layer.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from megatron_lrmoe.observe.stats import ExchangeStats, SpanTimer
from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.op.stages import KeptPlan


def _exchange_stats(
    send_counts: torch.Tensor, rank: int, row_bytes: int, stock_rows: int, stock_row_bytes: int
) -> ExchangeStats:
    """Row and byte counts of one exchange; ``send_counts`` is ``[P, ...]`` host rows per
    receiver. Through numpy: this runs in every backward, where a torch CPU op costs ~5 us."""
    per_rank = send_counts.numpy().reshape(send_counts.shape[0], -1).sum(1)
    return _rank_exchange(per_rank, rank, row_bytes, stock_rows, stock_row_bytes)


def _rank_exchange(
    per_rank: np.ndarray, rank: int, row_bytes: int, stock_rows: int, stock_row_bytes: int
) -> ExchangeStats:
    """:func:`_exchange_stats` from the rows sent to each rank (``[P]``)."""
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


def _record_exact(call: ExpertCall, g: torch.Tensor) -> None:
    stats, plan = call.stats, call.plan
    if call.lrmoe.debug_record_selection:
        stats.kept_weight = torch.ones(plan.send_counts.sum().item())
        stats.kept_mask = stats.kept_weight > 0
    _fill_exchanges(call, g, call.send_counts, call.recv_counts, g.shape[-1])
    stats.exchanges["probs_grad"] = _exchange_stats(
        call.recv_counts, plan.ep_rank, 4, call.stock_rows[1], 4
    )
    stats.backward_done = True


def _record_trimmed(
    call: ExpertCall, g: torch.Tensor, kept: KeptPlan, timer: Optional[SpanTimer]
) -> None:
    stats, plan, lrmoe = call.stats, call.plan, call.lrmoe
    hidden = g.shape[-1]
    # Kept rows' exchange: gradient rows (H), with their token rows in recompute mode (2H); in
    # lean mode the token rows alone (the experts hold the gradient rows).
    recompute_rows = call.activation_mode == "recompute" and plan.ep_size > 1
    send_per_rank = _fill_exchanges(
        call, g, kept.send_kept, kept.recv_kept, hidden * (2 if recompute_rows else 1)
    )
    # What the selection returned, not the plan (the same number when selection is exact).
    stats.kept_pairs_sent = kept.kept_index.numel()
    recv_rows = call.stock_rows[1]
    # Stock returns one routing-weight gradient per pair; the trimmed path computes them at
    # the source from z, lean at the experts from every pair's gradient row (sent first).
    if call.activation_mode == "lean" and plan.ep_size > 1:
        rank, row = plan.ep_rank, hidden * g.element_size()
        stats.exchanges["lean_grad"] = _exchange_stats(call.send_counts, rank, row, 0, 0)
        stats.exchanges["probs_grad"] = _exchange_stats(call.recv_counts, rank, 4, recv_rows, 4)
    else:
        stats.exchanges["probs_grad"] = ExchangeStats(0, 0, 0, 0, recv_rows, recv_rows * 4)
    if plan.ep_size > 1:
        rank = plan.ep_rank
        if lrmoe.scope == "global":
            stats.exchanges["scores"] = _exchange_stats(plan.send_counts, rank, 4, 0, 0)
            stats.exchanges["weights"] = _exchange_stats(plan.recv_counts, rank, 4, 0, 0)
        elif call.activation_mode in ("save", "lean"):
            stats.exchanges["positions"] = _rank_exchange(send_per_rank, rank, 8, 0, 0)
        if call.activation_mode == "lean":  # the kept rows' gradient scale, fp32
            stats.exchanges["scales"] = _rank_exchange(send_per_rank, rank, 4, 0, 0)
    stats.timer = timer
    stats.backward_done = True


def _record_replica_grads(call: ExpertCall) -> None:
    """The all-to-all that returns replica weight gradients to their owners (stock: none)."""
    layout, weights = call.layout, call.replica_weights
    if layout is None:
        return
    mine = layout.replicas_of[layout.ep_rank]
    row_bytes = sum(w[0].numel() * w.element_size() for w in weights) if mine else 0
    rows = len(mine)  # every replica's row goes to another rank (its owner)
    call.stats.exchanges["replica_grads"] = ExchangeStats(
        rows=rows,
        bytes=rows * row_bytes,
        remote_rows=rows,
        remote_bytes=rows * row_bytes,
        stock_rows=0,
        stock_bytes=0,
    )


def _fill_exchanges(
    call: ExpertCall,
    g: torch.Tensor,
    send_kept: torch.Tensor,
    recv_kept: torch.Tensor,
    grad_row_width: int,
) -> np.ndarray:
    """The gradient exchanges' statistics; returns the ``[P]`` rows sent to each rank (the
    kept positions, one per kept row, go the same way)."""
    stats, plan = call.stats, call.plan
    rank = plan.ep_rank
    elem = g.element_size()
    hidden = g.shape[-1]
    # Each count table read once (numpy: a torch CPU op costs ~5 us, and this runs in every
    # backward of every layer).
    send_per_rank = send_kept.numpy().reshape(send_kept.shape[0], -1).sum(1)
    recv = recv_kept.numpy()  # [P, L] / [P, I]
    per_instance = recv.sum(0)
    owned = plan.num_local_experts
    stats.kept_pairs_sent = int(send_per_rank.sum())
    stats.kept_per_local_expert = per_instance[:owned].tolist()
    stats.kept_per_replica = per_instance[owned:].tolist()
    stats.kept_rows = int(per_instance.sum())
    _record_replica_grads(call)
    stock_send, stock_recv = call.stock_rows
    stats.exchanges["grad"] = _rank_exchange(
        send_per_rank, rank, grad_row_width * elem, stock_send, hidden * elem
    )
    stats.exchanges["dgrad"] = _rank_exchange(
        recv.sum(1), rank, hidden * elem, stock_recv, hidden * elem
    )
    return send_per_rank
