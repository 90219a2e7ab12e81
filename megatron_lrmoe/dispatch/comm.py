"""The only module that calls ``torch.distributed``: plain (non-autograd) exchanges.

Shape legend: rows are pairs; ``send_splits[r]`` rows go to EP rank ``r`` and ``recv_splits[r]``
come from it. Split sizes are host ints (NCCL and gloo both need them on the host).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """World size of ``group`` (1 when torch.distributed is not initialised)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_to_all_rows(
    rows: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """Exchange variable-size row blocks; rows for rank ``r`` are contiguous and in rank order.

    Args:
        rows: ``[sum(send_splits), ...]``.
        send_splits: Rows sent to each rank of ``group``.
        recv_splits: Rows received from each rank.
        group: The expert-parallel group.

    Returns:
        ``[sum(recv_splits), ...]``; ``rows`` itself when the group has one rank.
    """
    if group_size(group) == 1:
        return rows
    rows = rows.contiguous()
    out = rows.new_empty((int(sum(recv_splits)),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(
        out,
        rows,
        output_split_sizes=[int(s) for s in recv_splits],
        input_split_sizes=[int(s) for s in send_splits],
        group=group,
    )
    return out


def all_gather_counts(local_counts: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather a ``[E]`` int64 vector into ``[P, E]`` (row ``r`` from EP rank ``r``)."""
    p = group_size(group)
    if p == 1:
        return local_counts.reshape(1, -1)
    local_counts = local_counts.reshape(-1).contiguous()
    # Flat output: gloo's all_gather_into_tensor accepts only the concatenated 1-D layout.
    out = local_counts.new_empty(p * local_counts.numel())
    dist.all_gather_into_tensor(out, local_counts, group=group)
    return out.view(p, -1)


def all_reduce_max(values: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Elementwise maximum of ``values`` over ``group`` (``values`` itself for one rank)."""
    if group_size(group) == 1:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def all_reduce_sum(values: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Elementwise sum of ``values`` over ``group``, in place (stream-ordered under NCCL)."""
    if group_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values
