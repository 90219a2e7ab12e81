"""The measurement behind ``keep_ratio="auto"``: one backward's added-variance curve.

Both routes call :func:`observe_keep_curve` at the start of their backward when the layer runs
``"auto"`` (``ExpertCall.auto_keep``), the exact route included: a layer whose target asks for
every pair still measures what a smaller keep ratio would add, so it can come back down. The
scores are this source's pairs' ``p^2 ||g_t||^2 ||x_t||^2`` in float64 (unscaled, so that the
EP group's ranks add up in one unit), its segments its pairs of each expert, as scope ``local``
selects them (under scope ``global``, which selects among all sources of an expert at once, the
estimate is an upper bound). The curve over ``control.auto_keep.KEEP_GRID`` and the scores' total
are summed over the EP group (one all-reduce of 16 float64 values) and copied to the host
without waiting (pinned memory, an event); the layer reads them when it plans its next call.

Cost per call (auto layers only): the token norms (one fused pass in the trimmed route), one
sort of the pairs' scores, a ``[15, S]`` pass, the all-reduce; no device-to-host sync.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_lrmoe.control.auto_keep import KEEP_GRID
from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import HostCounts, host_to_device
from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.select.variance import added_variance_curve

__all__ = ["DeviceCurve", "observe_keep_curve", "row_norms"]


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """``[T]`` L2 norm of every row, fp32 accumulation (``scoring.token_norms``' reference, for
    one matrix: the exact route keeps only the input's norms from its forward)."""
    return torch.linalg.vector_norm(rows, ord=2, dim=-1, dtype=torch.float32)


def observe_keep_curve(call: ExpertCall, probs: torch.Tensor, norms: torch.Tensor) -> None:
    """Measure this call's curve and queue it on ``call.auto_keep`` (a no-op without it).

    Args:
        probs: ``[S]`` routing weight of each pair, pair order.
        norms: ``[2, T]`` norms of the gradient rows reaching the layer (row 0) and of its input
            rows (row 1), as ``scoring.token_norms`` gives them.
    """
    auto = call.auto_keep
    if auto is None:
        return
    token = call.perm.token_of_pair
    sq = norms.to(torch.float64).square()
    p = probs.detach().to(torch.float64)
    scores = p * p * sq[0].index_select(0, token) * sq[1].index_select(0, token)
    finite = torch.isfinite(scores).all()
    scores = torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0)
    plan = call.plan
    # This source's pairs per expert (pair order), queued to the device without a stall.
    counts = host_to_device(plan.global_counts[plan.ep_rank], scores.device)
    curve = added_variance_curve(scores, counts, KEEP_GRID)
    values = torch.cat((curve, scores.sum().view(1)))
    values = torch.where(finite, values, torch.full_like(values, float("nan")))
    auto.push(DeviceCurve(comm.all_reduce_sum(values, call.group)), float(call.lrmoe.keep_ratio))


class DeviceCurve:
    """A curve on its way to the host (``control.auto_keep.PendingCurve``): its copy is queued
    behind the backward's work and read when the layer plans its next call (normally done
    long before)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._copy = HostCounts(values)

    def result(self) -> tuple[Sequence[float], float]:
        values = self._copy.wait().tolist()
        return values[:-1], values[-1]
