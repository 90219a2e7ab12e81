"""Replica weights of other ranks' experts: fetched from their owners, gradients sent back.

Shape legend: P EP ranks, L owned experts per rank, n replicas on this rank this call, H hidden,
F expert ffn width, F1 fc1 width; D = F1*H + H*F, one expert's weights (or gradients) as one row.

Replica weights are not parameters: they are detached copies held by the layer (never in
``state_dict``, DDP buffers, the optimizer or checkpoints), fetched by one all-to-all of
flattened expert weights from the owners and reused while the owners' weights cannot have
changed. Their gradients go back to the owners by one all-to-all and are added into the owner's
gradient of the projection inside the op's backward, so autograd, Megatron's DDP hooks and the
optimizer see one gradient per projection, as without replicas.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import host_to_device
from megatron_lrmoe.dispatch.replicas import ReplicaLayout

__all__ = ["ReplicaWeightCache", "fold_replica_grads"]


def _flat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[n, F1, H]`` and ``[n, H, F]`` -> ``[n, D]`` (one row per expert)."""
    n = a.shape[0]
    flat = [t.reshape(n, math.prod(t.shape[1:])) for t in (a, b)]
    return torch.cat(flat, dim=1)


def _split_rows(
    rows: torch.Tensor, like1: torch.Tensor, like2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, D]`` -> contiguous ``[n, F1, H]`` and ``[n, H, F]`` shaped like the stacks."""
    n, cut = rows.shape[0], math.prod(like1.shape[1:])
    a = rows[:, :cut].reshape((n,) + tuple(like1.shape[1:])).contiguous()
    b = rows[:, cut:].reshape((n,) + tuple(like2.shape[1:])).contiguous()
    return a, b


def exchange_expert_rows(
    w1: torch.Tensor,
    w2: torch.Tensor,
    wanted: tuple[tuple[int, ...], ...],
    rank: int,
    num_owned: int,
    group: Optional[torch.distributed.ProcessGroup],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank g receives the weights of the experts ``wanted[g]`` (ascending) from their
    owners; one all-to-all of ``[*, D]`` rows.

    Args:
        w1: ``[L, F1, H]`` this rank's fc1 weights (the parameter; read only).
        w2: ``[L, H, F]`` this rank's fc2 weights.
        wanted: Per rank, the experts it needs (ascending, none of its own); the same tuple
            on every rank.
        rank: This rank.
        num_owned: L.
        group: The expert-parallel group.

    Returns:
        ``(w1 [len(wanted[rank]), F1, H], w2 [..., H, F])`` in ``wanted[rank]`` order.
    """
    lo = rank * num_owned
    mine, send_splits = [], []
    for experts in wanted:  # destination-major, each destination's experts ascending
        ids = [e - lo for e in experts if lo <= e < lo + num_owned]
        mine += ids
        send_splits.append(len(ids))
    # Ascending expert ids are owner-major: rows from each owner arrive in the wanted order.
    recv_splits = [
        sum(1 for e in wanted[rank] if o * num_owned <= e < (o + 1) * num_owned)
        for o in range(len(wanted))
    ]
    with torch.no_grad():
        index = host_to_device(torch.tensor(mine, dtype=torch.int64), w1.device)
        rows = _flat_rows(w1.detach().index_select(0, index), w2.detach().index_select(0, index))
        rows = comm.all_to_all_rows(rows, send_splits, recv_splits, group)
    return _split_rows(rows, w1, w2)


class ReplicaWeightCache:
    """One layer's replica weights, refreshed only when the owners' weights may have changed.

    The owners' weights change only at optimizer steps (and checkpoint loads), so the cache is
    keyed by the training step the layer was told (``LRMoELayer.set_training_step``): within a
    step, a replica fetched for one micro-batch is reused by the next ones (and by recomputed
    forwards of activation checkpointing), and only experts newly placed on a rank are
    fetched. A call with ``step=None`` (step unknown, or no gradients: evaluation, which may
    run after the optimizer step but before the next step is announced) fetches every replica
    and leaves the cache alone. Entries not held in a call are dropped, so the memory held is at
    most that call's replicas. The cached state (which rank holds which experts) is a function
    of the plans and steps, identical on every rank, so all ranks agree on whether an exchange
    runs (it is a collective).
    """

    def __init__(self) -> None:
        self._step: Optional[int] = None
        self._held: Optional[tuple[tuple[int, ...], ...]] = None
        self._w1: Optional[torch.Tensor] = None
        self._w2: Optional[torch.Tensor] = None
        self.last_fetched = 0

    def clear(self) -> None:
        """Forget every cached replica (e.g. after the owners' weights were loaded)."""
        self._step, self._held, self._w1, self._w2 = None, None, None, None

    def weights(
        self,
        layout: ReplicaLayout,
        w1: torch.Tensor,
        w2: torch.Tensor,
        group: Optional[torch.distributed.ProcessGroup],
        step: Optional[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's replica weights for ``layout``'s call, in ``layout.replicas_of[rank]`` order.

        Args:
            layout: The call's layout (``replicas_of`` names every rank's replicas).
            w1: ``[L, F1, H]`` this rank's fc1 parameter (sent to the ranks that need it).
            w2: ``[L, H, F]`` this rank's fc2 parameter.
            group: The expert-parallel group.
            step: The training step the weights belong to, or None to fetch everything
                without touching the cache.

        Returns:
            ``(w1 [n, F1, H], w2 [n, H, F])`` detached replica weights.
        """
        rank, needed = layout.ep_rank, layout.replicas_of
        usable = step is not None and step == self._step and self._held is not None
        held = self._held if usable else tuple(() for _ in needed)
        wanted = tuple(
            tuple(e for e in want if e not in have) for want, have in zip(needed, held)
        )
        self.last_fetched = sum(len(x) for x in wanted)
        fetched = None
        if self.last_fetched:
            fetched = exchange_expert_rows(w1, w2, wanted, rank, layout.num_owned, group)
        mine = needed[rank]
        if usable and mine == held[rank]:
            rep1, rep2 = self._w1, self._w2
        elif not held[rank]:
            rep1, rep2 = fetched if fetched is not None else _empty_pair(w1, w2)
        else:
            rep1, rep2 = self._assemble(mine, held[rank], wanted[rank], fetched, w1, w2)
        if step is not None:
            self._step, self._held, self._w1, self._w2 = step, needed, rep1, rep2
        return rep1, rep2

    def _assemble(
        self,
        mine: tuple[int, ...],
        have: tuple[int, ...],
        new: tuple[int, ...],
        fetched: Optional[tuple[torch.Tensor, torch.Tensor]],
        w1: torch.Tensor,
        w2: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack this call's replicas from the cached ones (``have``) and the newly fetched
        ones (``new``, rows of ``fetched``); one copy of this call's replicas."""
        parts1, parts2 = [], []
        for e in mine:
            if e in have:
                i = have.index(e)
                parts1.append(self._w1[i])
                parts2.append(self._w2[i])
            else:
                i = new.index(e)
                parts1.append(fetched[0][i])
                parts2.append(fetched[1][i])
        if not parts1:
            return _empty_pair(w1, w2)
        return torch.stack(parts1), torch.stack(parts2)


def _empty_pair(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w1.detach()[:0].clone(), w2.detach()[:0].clone()


def fold_replica_grads(
    dw1: torch.Tensor,
    dw2: torch.Tensor,
    dw1_replicas: torch.Tensor,
    dw2_replicas: torch.Tensor,
    layout: ReplicaLayout,
    group: Optional[torch.distributed.ProcessGroup],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send replica gradients to their owners and add them into the owners' gradients.

    Deterministic: for each owned expert the sum is its own gradient first, then the replicas'
    by holder rank, accumulated in fp32 (at least) and rounded once into the gradient's dtype.

    Args:
        dw1: ``[L, F1, H]`` this rank's own fc1 gradient (modified in place and returned).
        dw2: ``[L, H, F]`` this rank's own fc2 gradient (likewise).
        dw1_replicas: ``[n, F1, H]`` gradient of this rank's replicas (``replicas_of[rank]``
            order).
        dw2_replicas: ``[n, H, F]``.
        layout: The call's layout.
        group: The expert-parallel group.

    Returns:
        ``(dw1, dw2)`` holding every holder's contribution.
    """
    rank, num_owned, replicas_of = layout.ep_rank, layout.num_owned, layout.replicas_of
    num_ranks = len(replicas_of)
    # This rank's replicas are ascending, hence owner-major: the send blocks are contiguous.
    send_splits = [
        sum(1 for e in replicas_of[rank] if e // num_owned == o) for o in range(num_ranks)
    ]
    # Per holder (by rank), the local ids of this rank's experts it held, ascending.
    from_holder = [
        [e - rank * num_owned for e in replicas_of[h] if e // num_owned == rank]
        for h in range(num_ranks)
    ]
    recv_splits = [len(ids) for ids in from_holder]
    rows = _flat_rows(dw1_replicas, dw2_replicas)
    rows = comm.all_to_all_rows(rows, send_splits, recv_splits, group)
    if rows.shape[0] == 0:
        return dw1, dw2
    touched = sorted({i for ids in from_holder for i in ids})
    position = {i: k for k, i in enumerate(touched)}
    index = host_to_device(torch.tensor(touched, dtype=torch.int64), dw1.device)
    wide = torch.promote_types(dw1.dtype, torch.float32)
    acc = _flat_rows(dw1.index_select(0, index), dw2.index_select(0, index)).to(wide)
    start = 0
    for ids in from_holder:  # holders by rank; each holds an expert at most once
        if not ids:
            continue
        where = host_to_device(torch.tensor([position[i] for i in ids]), dw1.device)
        acc.index_add_(0, where, rows[start : start + len(ids)].to(wide))
        start += len(ids)
    sum1, sum2 = _split_rows(acc, dw1, dw2)
    dw1.index_copy_(0, index, sum1.to(dw1.dtype))
    dw2.index_copy_(0, index, sum2.to(dw2.dtype))
    return dw1, dw2
