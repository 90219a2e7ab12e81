"""The per-call plan: integer decisions made once per MoE layer call, before expert compute.

Shape legend: P EP ranks, E experts, L = E / P local experts per rank.
Everything here is host-side int64 and deterministic: every rank computes the same plan from the
same all-gathered counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.quota import quotas_np, split_np

if TYPE_CHECKING:
    from megatron_lrmoe.control.controller import ControlPlan


@dataclass(frozen=True)
class CallPlan:
    """What one layer call exchanges and keeps.

    Attributes:
        ep_rank: This rank's index in the EP group.
        ep_size: P.
        num_local_experts: L; rank r owns experts ``[r*L, (r+1)*L)``.
        global_counts: ``[P, E]`` pairs from source rank r to expert e (``N[r, e]``), host int64.
        quota: ``[E]`` pairs of expert e that survive backward, ``ceil(keep_ratio * N[e])``.
        source_quota: ``[P, E]`` the quota split over source ranks (scope "local"), else None.
            Invariants: ``source_quota <= global_counts`` and ``source_quota.sum(0) == quota``.
        layer_number: Megatron's layer number (keys the sampling stream).
        stream: The rest of the sampling stream's key: ``(training step, call within the step)``
            when the layer knows the step (``set_lrmoe_training_step``), else ``(call index,)``.
        control: The controller's full plan (replicas, assignments, memory) when the call was
            planned by :func:`megatron_lrmoe.control.controller.plan_call`, else None.
    """

    ep_rank: int
    ep_size: int
    num_local_experts: int
    global_counts: torch.Tensor
    quota: torch.Tensor
    source_quota: Optional[torch.Tensor]
    layer_number: int
    stream: tuple[int, ...]
    control: Optional["ControlPlan"] = None

    @classmethod
    def from_control(
        cls, control: "ControlPlan", layer_number: int, stream: tuple[int, ...]
    ) -> "CallPlan":
        """The call plan of a controller plan: its quotas and their split over sources.

        ``source_quota`` is the controller's (scope local) unless every pair is kept; budgets can
        trim even at keep ratio 1, so the op must test ``control.keeps_all``, not the config.
        """
        return cls(
            ep_rank=control.ep_rank,
            ep_size=control.ep_size,
            num_local_experts=control.num_local_experts,
            global_counts=control.counts,
            quota=control.quota,
            source_quota=None if control.keeps_all else control.source_quota,
            layer_number=layer_number,
            stream=tuple(int(x) for x in stream),
            control=control,
        )

    @classmethod
    def build(
        cls,
        global_counts: torch.Tensor,
        ep_rank: int,
        num_local_experts: int,
        lrmoe: LRMoEConfig,
        layer_number: int,
        stream: tuple[int, ...],
    ) -> "CallPlan":
        """Fix quotas (and their split over sources) from the global counts."""
        # numpy on the host: this runs between the forward's one sync and its first expert
        # kernel, where every microsecond of Python is GPU idle time (torch CPU ops cost ~10 us
        # each; the numpy versions are the same integers, tested against them).
        if global_counts.dtype != torch.int64 or global_counts.device.type != "cpu":
            global_counts = global_counts.to(torch.int64).cpu()  # the dispatcher's already are
        counts_np = global_counts.numpy()
        quota_np = quotas_np(counts_np.sum(0), float(lrmoe.keep_ratio))
        quota = torch.from_numpy(quota_np)
        source_quota = None
        if lrmoe.scope == "local" and not lrmoe.is_exact:
            source_quota = torch.from_numpy(split_np(counts_np, quota_np))
        plan = cls(
            ep_rank=ep_rank,
            ep_size=global_counts.shape[0],
            num_local_experts=num_local_experts,
            global_counts=global_counts,
            quota=quota,
            source_quota=source_quota,
            layer_number=layer_number,
            stream=tuple(int(x) for x in stream),
        )
        if lrmoe.debug_check_invariants:
            plan.check_invariants()
        return plan

    @cached_property
    def local_experts(self) -> slice:
        """Global ids of this rank's experts."""
        lo = self.ep_rank * self.num_local_experts
        return slice(lo, lo + self.num_local_experts)

    # The count views below come from numpy: every forward at EP > 1 reads them (the split
    # sizes of the all-to-alls, the reorder grid, the grouped GEMMs' groups), and a torch CPU
    # op costs several times a numpy one on these few integers (tests/test_planner.py compares
    # them with the torch expressions).

    @cached_property
    def _send_np(self) -> np.ndarray:
        """``[P, L]`` int64 view of this rank's row of the counts."""
        counts = self.global_counts.numpy()
        return counts[self.ep_rank].reshape(self.ep_size, self.num_local_experts)

    @cached_property
    def _recv_np(self) -> np.ndarray:
        """``[P, L]`` int64 (C-contiguous copy) of this rank's experts' columns."""
        return np.ascontiguousarray(self.global_counts.numpy()[:, self.local_experts])

    @cached_property
    def send_counts(self) -> torch.Tensor:
        """``[P, L]`` pairs this rank sends to (destination rank, its local expert)."""
        return torch.from_numpy(self._send_np)

    @cached_property
    def recv_counts(self) -> torch.Tensor:
        """``[P, L]`` pairs this rank's experts receive from each source rank."""
        return torch.from_numpy(self._recv_np)

    @cached_property
    def send_splits(self) -> list[int]:
        return self._send_np.sum(1).tolist()

    @cached_property
    def recv_splits(self) -> list[int]:
        return self._recv_np.sum(1).tolist()

    @cached_property
    def tokens_per_local_expert(self) -> torch.Tensor:
        """``[L]`` rows each local expert computes in forward."""
        return torch.from_numpy(self._recv_np.sum(0))

    @cached_property
    def quota_by_source(self) -> torch.Tensor:
        """``[P, E]`` (or ``[1, E]`` without a split over sources) quota of each source's pairs
        per expert: what a source selects among its own pairs (scope local)."""
        return self.source_quota if self.source_quota is not None else self.quota.unsqueeze(0)

    @cached_property
    def local_quota(self) -> torch.Tensor:
        """``[L]`` quota of this rank's experts."""
        return self.quota[self.local_experts].contiguous()

    def check_invariants(self) -> None:
        """Raise AssertionError if an integer invariant is violated (debug flag).

        Explicit raises, not ``assert``: the check must survive ``python -O``.
        """
        n = self.global_counts.sum(0)
        checks = [(bool((self.quota >= 0).all()) and bool((self.quota <= n).all()), "quota range")]
        if self.source_quota is not None:
            checks += [
                (bool((self.source_quota <= self.global_counts).all()), "source quota > N"),
                (bool((self.source_quota >= 0).all()), "negative source quota"),
                (torch.equal(self.source_quota.sum(0), self.quota), "source quota sum"),
            ]
        for ok, what in checks:
            if not ok:
                raise AssertionError(f"CallPlan invariant violated: {what}")
