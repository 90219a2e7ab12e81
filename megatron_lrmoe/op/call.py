"""The op's per-call context: :class:`ExpertCall`, what the op needs besides tensors, and the
forward's row movements (send order <-> expert order, the reorder plans it caches).

Shape legend and row layouts: ``megatron_lrmoe/op/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.auto_keep import AutoKeepRatio
from megatron_lrmoe.control.plan import CallPlan, ControlPlan
from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import chunk_transpose_index, inverse_permutation
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.replicas import ReplicaLayout
from megatron_lrmoe.dispatch.rows import gather_rows
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.experts.grouped_gemm import GroupSizes
from megatron_lrmoe.experts.replica_weights import fold_replica_grads
from megatron_lrmoe.experts.wgrad_triton import MainGrads
from megatron_lrmoe.observe.stats import CallStats

__all__ = ["ExpertCall"]


@dataclass
class ExpertCall:
    """Everything the op needs besides tensors; one per layer call (not a tensor input).

    Attributes:
        plan_source: The integer plan of this call (host), or ``None`` until the layer sets
            it: at EP 1 without the controller the forward runs before the host has the counts
            (it needs none) and the layer fills the plan in behind it; read it as :attr:`plan`.
        lrmoe: The LRMoE configuration of this call (an ``"auto"`` layer's resolved to the
            call's keep ratio, ``LRMoEConfig.at_keep_ratio``).
        spec: Expert activation.
        group: The expert-parallel process group.
        perm: This rank's token <-> pair index plan.
        stats: Per-call statistics to fill, or ``None``.
        sample_stream: Returns the sampling stream's key for this call's backward (the layer
            counts backward calls); ``None`` keys every call alike.
        layout: The send-order index plans when the controller placed replicas this call, else
            ``None`` (send order is pair order).
        replica_weights: ``(w1 [n, F1, H], w2 [n, H, F])`` this rank's replicas (detached, in
            ``layout.replicas_of[rank]`` order) when ``layout`` is set.
        device_rows: ``[L]`` forward rows per local expert on the device, for a forward that
            runs before the plan exists (EP 1; the grouped GEMMs take device offsets).
        fuse_grad_accumulation: Add the expert weight gradients into the weights' ``main_grad``
            in the weight-gradient GEMMs (``LRMoEConfig.fuses_grad_accumulation``).
        auto_keep: The layer's keep ratio state when it runs ``keep_ratio="auto"``: the
            backward measures the call's added-variance curve into it (``op/keep_curve.py``).
    """

    plan_source: Optional[CallPlan]
    lrmoe: LRMoEConfig
    spec: GluSpec
    group: Optional[torch.distributed.ProcessGroup]
    perm: PairPermutation
    stats: Optional[CallStats]
    sample_stream: Optional[Callable[[], tuple[int, ...]]] = None
    layout: Optional[ReplicaLayout] = None
    replica_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    device_rows: Optional[torch.Tensor] = None
    fuse_grad_accumulation: bool = False
    auto_keep: Optional[AutoKeepRatio] = None
    _indices: dict = field(default_factory=dict)
    _groups: Optional[GroupSizes] = None

    @property
    def plan(self) -> CallPlan:
        """The call's integer plan (set by the layer before the backward can run)."""
        if self.plan_source is None:
            raise RuntimeError("ExpertCall.plan read before the layer set it")
        return self.plan_source

    @property
    def control(self) -> Optional[ControlPlan]:
        """The controller's plan, if the controller planned this call (a call whose plan comes
        later never is: the layer defers only without the controller)."""
        return self.plan_source.control if self.plan_source is not None else None

    def set_plan(self, plan: CallPlan) -> None:
        """Give a call whose forward ran from device rows its plan.

        The backward then groups rows by the plan's host counts again: with device counts the
        weight-gradient GEMMs would have to mask the whole ``[L, F1, H]`` output to zero the
        empty experts' slices instead of touching only those.
        """
        self.plan_source = plan
        self.device_rows = None
        self._groups = None

    @cached_property
    def ep_size(self) -> int:
        """P, the size of the expert-parallel group."""
        return comm.group_size(self.group)

    def reorder(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reorder ``rows`` laid out as an a-major ``counts[A, B]`` chunk grid to b-major.

        Index plans are cached per call: forward and a keep-all backward reuse the same two.
        The way back (``counts.t()``) is the inverse permutation of the way there, so where
        one is cached the other is its inverse (:func:`chunk_transpose_index` is the
        reference, ``tests/test_compaction.py`` compares them).
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

    @property
    def exact(self) -> bool:
        """Every pair is kept: the exact (keep 1) path. Budgets can trim even at keep ratio 1,
        so a controller plan decides when there is one."""
        control = self.control
        return control.keeps_all if control is not None else self.lrmoe.is_exact

    @property
    def activation_mode(self) -> str:
        """``"save"`` or ``"recompute"`` for this call (the controller resolves ``"auto"``)."""
        control = self.control
        return control.activation_mode if control is not None else self.lrmoe.activation_mode

    @property
    def groups(self) -> GroupSizes:
        """Rows per local expert (per instance, with replicas) in forward (offsets built once
        per call)."""
        if self._groups is None:
            if self.layout is not None:
                rows = self.layout.rows_per_instance
            elif self.device_rows is not None:
                rows = self.device_rows
            else:
                rows = self.plan.tokens_per_local_expert
            self._groups = GroupSizes(rows)
        return self._groups

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

    @cached_property
    def stock_rows(self) -> tuple[int, int]:
        """Pair rows this rank sends to experts and its experts receive in the forward (what
        stock's backward exchanges carry), for the statistics."""
        plan = self.plan
        return int(plan.send_counts.numpy().sum()), int(plan.recv_counts.numpy().sum())

    @property
    def recv_counts(self) -> torch.Tensor:
        """``[P, L]`` (``[P, I]`` with replicas) forward rows per (source, local instance)."""
        return self.plan.recv_counts if self.layout is None else self.layout.recv_counts

    @property
    def send_counts(self) -> torch.Tensor:
        """``[P, *]`` forward rows this rank sends per destination (and its experts)."""
        return self.plan.send_counts if self.layout is None else self.layout.send_totals

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Send-order rows of this rank -> expert-order rows of its experts (forward split)."""
        if self.ep_size == 1:  # send order is expert order; no plan needed
            return rows
        send, recv = self._splits()
        rows = comm.all_to_all_rows(rows, send, recv, self.group)
        return self.reorder(rows, self.recv_counts)

    def to_sources(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert-order rows of this rank's experts -> send-order rows of their sources."""
        if self.ep_size == 1:
            return rows
        send, recv = self._splits()
        rows = self.reorder(rows, self.recv_counts.t())
        return comm.all_to_all_rows(rows, recv, send, self.group)

    def _splits(self) -> tuple[list[int], list[int]]:
        source = self.plan if self.layout is None else self.layout
        return source.send_splits, source.recv_splits

    # -- experts (own weights, then replica weights) ------------------------------------------

    def weight_stacks(
        self, w1: torch.Tensor, w2: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The weight stacks of this rank's instances: its parameters, then its replicas."""
        if self.layout is None:
            return [(w1, w2)]
        return [(w1, w2), self.replica_weights]

    def stack_counts(self, rows_per_instance: GroupSizes | torch.Tensor) -> list:
        """Rows per instance split by weight stack (owned experts, replicas)."""
        if self.layout is None:
            return [rows_per_instance]
        sizes = GroupSizes(rows_per_instance).host_sizes()
        own = self.layout.num_owned
        return [sizes[:own], sizes[own:]]

    def fold_grads(
        self,
        dw1: list[Optional[torch.Tensor]],
        dw2: list[Optional[torch.Tensor]],
        into: Optional[MainGrads] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameters' gradients: own, plus (with replicas) every replica's, from its
        holder, added in a fixed order before autograd sees them.

        With ``into`` (the weights' ``main_grad``, which already holds the own gradient: fused
        accumulation) the replicas' gradients are added there instead, and ``into`` returned.
        """
        own1, own2 = (dw1[0], dw2[0]) if into is None else (into.fc1, into.fc2)
        if self.layout is None:
            return own1, own2
        return fold_replica_grads(own1, own2, dw1[1], dw2[1], self.layout, self.group)


def _grid_key(grid: np.ndarray) -> tuple:
    """What a chunk grid's reorder index depends on: its shape and its counts (the host
    grid's bytes in C order, so a transposed view keys as its transpose's copy)."""
    return grid.shape, grid.tobytes()
