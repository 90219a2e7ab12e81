"""One call's row movements: :class:`RowRoute`, built once from the call's plan and frozen.

Rows travel between three orders (``megatron_lrmoe/op/__init__.py`` draws them): pair order
(Megatron's), send order (pair order unless replicas were placed: then grouped by destination
instance) and expert order on the receiver (its local instances' rows, each grouped by source).
An exchange sends rows grouped by destination, and the receiver gets them source-major: a chunk
grid ``counts[P, L]`` of rows per (source, local instance), which one reorder turns
expert-major. The way back reorders first (the grid's transpose) and sends second.

Everything here reads the plan and moves rows; nothing writes the plan. The reorder's index
plans are cached per route (forward and a keep-all backward reuse the same two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import chunk_transpose_index, inverse_permutation
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.replicas import ReplicaLayout
from megatron_lrmoe.dispatch.rows import gather_rows

if TYPE_CHECKING:  # the plan is control/'s, a floor above: its type only
    from megatron_lrmoe.control.plan import CallPlan

__all__ = ["RowRoute"]


@dataclass(frozen=True, eq=False)
class RowRoute:
    """Where one call's rows go: the forward exchange's splits and grid, the send-order plan.

    Attributes:
        group: The expert-parallel process group (``None``: one rank).
        perm: This rank's token <-> pair index plan.
        layout: The send-order index plans when replicas were placed this call, else ``None``
            (send order is pair order).
        send_splits: Forward rows this rank sends per destination rank.
        recv_splits: Forward rows this rank receives per source rank.
        recv_counts: ``[P, L]`` (``[P, I]`` with replicas) forward rows per (source, local
            instance), or ``None`` for a forward that runs before the plan exists (one rank
            only: its exchanges move nothing).
    """

    group: Optional[torch.distributed.ProcessGroup]
    perm: PairPermutation
    layout: Optional[ReplicaLayout]
    send_splits: list[int]
    recv_splits: list[int]
    recv_counts: Optional[torch.Tensor]
    _indices: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        perm: PairPermutation,
        plan: Optional["CallPlan"],
        layout: Optional[ReplicaLayout],
        group: Optional[torch.distributed.ProcessGroup],
    ) -> "RowRoute":
        """The route of a call from its ``plan`` (``None`` where the forward runs ahead of the
        plan, which only one rank may); with ``layout`` the splits and grid are the layout's."""
        source = layout if layout is not None else plan
        if source is None:
            if comm.group_size(group) != 1:
                raise ValueError(
                    "RowRoute.build: a call without a plan exchanges nothing, so it must run "
                    f"on one rank, not {comm.group_size(group)}; plan the call first "
                    "(CallPlan.build) and pass it"
                )
            return cls(group, perm, None, [perm.num_pairs], [perm.num_pairs], None)
        return cls(
            group, perm, layout, source.send_splits, source.recv_splits, source.recv_counts
        )

    @cached_property
    def ep_size(self) -> int:
        """P, the size of the expert-parallel group."""
        return comm.group_size(self.group)

    # -- send order (pair order unless replicas were placed) ----------------------------------

    @property
    def token_of_send(self) -> torch.Tensor:
        """``[S]`` token of each send-order row."""
        return self.perm.token_of_pair if self.layout is None else self.layout.token_of_send

    @property
    def slot_send(self) -> torch.Tensor:
        """``[T, K]`` send-order row of each token slot (``-1`` if empty)."""
        return self.perm.slot_pair if self.layout is None else self.layout.slot_send

    def to_send_order(self, values: torch.Tensor) -> torch.Tensor:
        """Pair-order values -> send order."""
        return values if self.layout is None else values.index_select(0, self.layout.send_perm)

    def to_pair_order(self, values: torch.Tensor) -> torch.Tensor:
        """Send-order values -> pair order."""
        if self.layout is None:
            return values
        return values.index_select(0, self.layout.pair_to_send)

    # -- exchanges ------------------------------------------------------------------------------

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Send-order rows of this rank -> expert-order rows of its experts (forward split)."""
        return self.exchange(rows, self.send_splits, self.recv_splits, self.recv_counts)

    def to_sources(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert-order rows of this rank's experts -> send-order rows of their sources."""
        return self.exchange_back(rows, self.send_splits, self.recv_splits, self.recv_counts)

    def exchange(
        self,
        rows: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        recv_grid: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Rows grouped by destination -> the receiver's rows in expert order.

        ``recv_grid``: ``[P, L]`` rows this rank receives per (source, local instance), whose
        row sums are ``recv_splits``. One rank moves nothing.
        """
        if self.ep_size == 1:
            return rows
        rows = comm.all_to_all_rows(rows, send_splits, recv_splits, self.group)
        return self.reorder(rows, recv_grid)

    def exchange_back(
        self,
        rows: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        recv_grid: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The inverse of :meth:`exchange` with the same arguments: expert-order rows go back
        to their senders, in the order the senders sent them."""
        if self.ep_size == 1:
            return rows
        rows = self.reorder(rows, recv_grid.t())
        return comm.all_to_all_rows(rows, recv_splits, send_splits, self.group)

    def reorder(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reorder ``rows`` laid out as an a-major ``counts[A, B]`` chunk grid to b-major.

        Index plans are cached per route. The way back (``counts.t()``) is the inverse
        permutation of the way there, so where one is cached the other is its inverse
        (:func:`chunk_transpose_index` is the reference, ``tests/test_compaction.py`` compares
        them).
        """
        if counts.shape[0] == 1 or counts.shape[1] == 1:
            return rows
        grid = counts.numpy()  # the keys in numpy (the transpose's too: no torch op)
        key = _grid_key(grid)
        index = self._indices.get(key)
        if index is None:
            there = self._indices.get(_grid_key(grid.T))
            if there is None:
                index = chunk_transpose_index(counts, rows.device)
            else:
                index = inverse_permutation(there)
            self._indices[key] = index
        return gather_rows(rows, index)


def _grid_key(grid: np.ndarray) -> tuple:
    """What a chunk grid's reorder index depends on: its shape and its counts (the host
    grid's bytes in C order, so a transposed view keys as its transpose's copy)."""
    return grid.shape, grid.tobytes()
