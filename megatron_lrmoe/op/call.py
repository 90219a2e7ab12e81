"""The op's per-call context: :class:`ExpertCall`, what the op needs besides tensors.

Its rows move through :class:`~megatron_lrmoe.dispatch.route.RowRoute` (``call.route``), built
from the call's plan before the forward. The call is frozen; the one thing the layer adds after
launching the forward goes in once, through :meth:`ExpertCall.complete`: the statistics, and the
plan itself where the forward ran ahead of it.

Shape legend and row layouts: ``megatron_lrmoe/op/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional

import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.auto_keep import AutoKeepRatio
from megatron_lrmoe.control.plan import CallPlan, ControlPlan
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.replicas import ReplicaLayout
from megatron_lrmoe.dispatch.route import RowRoute
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.experts.grouped_gemm import GroupSizes
from megatron_lrmoe.experts.replica_weights import fold_replica_grads
from megatron_lrmoe.experts.wgrad_triton import MainGrads
from megatron_lrmoe.observe.stats import CallStats

__all__ = ["ExpertCall"]


@dataclass
class _AfterForward:
    """What the layer hands the call once, behind its forward (the backward reads it)."""

    plan: Optional[CallPlan] = None
    stats: Optional[CallStats] = None
    done: bool = False


@dataclass(frozen=True, eq=False)
class ExpertCall:
    """Everything the op needs besides tensors; one per layer call (not a tensor input).

    Attributes:
        planned: The integer plan of this call (host), or ``None`` where the forward runs
            ahead of it: at EP 1 without the controller the forward needs no host integer, and
            the layer builds the plan behind it and hands it over in :meth:`complete`. Read
            the plan as :attr:`plan`.
        lrmoe: The LRMoE configuration of this call (an ``"auto"`` layer's resolved to the
            call's keep ratio, ``LRMoEConfig.at_keep_ratio``).
        spec: Expert activation.
        route: The call's row movements (exchanges, send order), from the plan.
        sample_stream: Returns the sampling stream's key for this call's backward (the layer
            counts backward calls); ``None`` keys every call alike.
        replica_weights: ``(w1 [n, F1, H], w2 [n, H, F])`` this rank's replicas (detached, in
            ``layout.replicas_of[rank]`` order) when replicas were placed.
        device_rows: ``[L]`` forward rows per local expert on the device, for a forward that
            runs ahead of the plan (the grouped GEMMs take device offsets).
        fuse_grad_accumulation: Add the expert weight gradients into the weights' ``main_grad``
            in the weight-gradient GEMMs (``LRMoEConfig.fuses_grad_accumulation``).
        auto_keep: The layer's keep ratio state when it runs ``keep_ratio="auto"``: the
            backward measures the call's added-variance curve into it (``op/keep_curve.py``).
    """

    planned: Optional[CallPlan]
    lrmoe: LRMoEConfig
    spec: GluSpec
    route: RowRoute
    sample_stream: Optional[Callable[[], tuple[int, ...]]] = None
    replica_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    device_rows: Optional[torch.Tensor] = None
    fuse_grad_accumulation: bool = False
    auto_keep: Optional[AutoKeepRatio] = None
    _after: _AfterForward = field(default_factory=_AfterForward, repr=False)

    def __post_init__(self) -> None:
        if (self.planned is None) == (self.device_rows is None):
            raise ValueError(
                "ExpertCall: give either the call's plan (planned) or, for a forward that runs "
                "ahead of it, the device rows per local expert (device_rows), not "
                f"{'both' if self.planned is not None else 'neither'}"
            )

    def complete(self, stats: Optional[CallStats], plan: Optional[CallPlan] = None) -> None:
        """The layer's part behind the forward, once per call: the call's statistics
        (``None`` without ``record_stats``) and, where the forward ran ahead of the plan, the
        plan (the backward then groups rows by its host counts: with device counts the
        weight-gradient GEMMs would have to mask the whole ``[L, F1, H]`` output to zero the
        empty experts' slices instead of touching only those)."""
        after = self._after
        if after.done:
            raise RuntimeError("ExpertCall.complete: called twice for one call")
        if (plan is None) != (self.planned is not None):
            raise ValueError(
                "ExpertCall.complete: pass the plan exactly when the forward ran ahead of it "
                f"(this call was {'planned' if self.planned is not None else 'not planned'} "
                "before its forward)"
            )
        after.plan, after.stats, after.done = plan, stats, True

    @property
    def plan(self) -> CallPlan:
        """The call's integer plan (given before the forward, or by :meth:`complete`)."""
        plan = self.planned if self.planned is not None else self._after.plan
        if plan is None:
            raise RuntimeError("ExpertCall.plan read before the layer completed the call")
        return plan

    @property
    def stats(self) -> Optional[CallStats]:
        """Per-call statistics to fill, or ``None`` (given by :meth:`complete`)."""
        return self._after.stats

    @property
    def control(self) -> Optional[ControlPlan]:
        """The controller's plan, if the controller planned this call (a call whose plan comes
        later never is: the layer defers only without the controller)."""
        return self.planned.control if self.planned is not None else None

    @property
    def group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The expert-parallel process group."""
        return self.route.group

    @property
    def perm(self) -> PairPermutation:
        """This rank's token <-> pair index plan."""
        return self.route.perm

    @property
    def layout(self) -> Optional[ReplicaLayout]:
        """The send-order index plans when the controller placed replicas, else ``None``."""
        return self.route.layout

    @property
    def ep_size(self) -> int:
        """P, the size of the expert-parallel group."""
        return self.route.ep_size

    @property
    def exact(self) -> bool:
        """Every pair is kept: the exact (keep 1) path. Budgets can trim even at keep ratio 1,
        so a controller plan decides when there is one."""
        control = self.control
        return control.keeps_all if control is not None else self.lrmoe.is_exact

    @property
    def activation_mode(self) -> str:
        """``"save"``, ``"recompute"`` or ``"lean"`` for this call (the controller resolves
        ``"auto"``)."""
        control = self.control
        return control.activation_mode if control is not None else self.lrmoe.activation_mode

    @property
    def forward_groups(self) -> GroupSizes:
        """Rows per local instance in the forward: :attr:`groups`, or the device rows where the
        forward runs ahead of the plan."""
        if self.device_rows is not None:
            return GroupSizes(self.device_rows)
        return self.groups

    @cached_property
    def groups(self) -> GroupSizes:
        """Rows per local instance (with replicas: owned experts, then replicas) from the
        plan's host counts (offsets built once per call)."""
        layout = self.layout
        return GroupSizes(
            layout.rows_per_instance if layout is not None else self.plan.tokens_per_local_expert
        )

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
