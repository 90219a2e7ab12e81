"""The per-call plan objects: integer decisions made once per MoE layer call, before expert compute.

Shape legend: P EP ranks, E experts, L = E / P local experts per rank (rank r owns
``[r*L, (r+1)*L)``), ``N[r, e]`` pairs from source rank r to expert e, ``W[e] = sum_r N[r, e]``.
Everything here is host-side int64 and deterministic: every rank computes the same plan from the
same all-gathered counts. :class:`ControlPlan` is what the controller decides
(:func:`megatron_lrmoe.control.controller.plan_call`: quotas, replicas, forward and backward
loads, the per-source splits derived from them, :class:`MemoryPlan`); :class:`CallPlan` is what
the op consumes (the quotas and their split over sources, the count views of the exchanges),
built from a ``ControlPlan`` or, without the controller, from the counts alone. :class:`SaveSplit`
is the per-source split of save mode with replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.balance import interval_split_np
from megatron_lrmoe.control.quota import SourceSplit, quotas_np, split_np


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

# --------------------------------------------------------------------------------------------- #
# The controller's plan
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True, eq=False)
class MemoryPlan:
    """Planned bytes per GPU (``[P]`` int64 each) next to fixed ownership's (stock Megatron).

    Budgeted (``memory_budget_bytes``): ``replica_bytes + saved_bytes`` and the larger of
    ``backward_bytes`` (the kept pairs' working rows) and ``router_bytes`` (``lean``'s
    router-gradient rows of every computed pair, freed before the kept pairs' backward; 0 in
    the other modes). Reported: ``forward_buffer_bytes`` (received rows and returned outputs in
    forward) and the backward gradient exchange per rank. ``stock_*``: no replicas, every pair
    kept, save mode.
    """

    replica_bytes: torch.Tensor
    saved_bytes: torch.Tensor
    backward_bytes: torch.Tensor
    router_bytes: torch.Tensor
    forward_buffer_bytes: torch.Tensor
    exchange_sent_bytes: torch.Tensor
    exchange_recv_bytes: torch.Tensor
    stock_saved_bytes: torch.Tensor
    stock_backward_bytes: torch.Tensor
    stock_forward_buffer_bytes: torch.Tensor
    stock_exchange_sent_bytes: torch.Tensor
    stock_exchange_recv_bytes: torch.Tensor

    @property
    def budgeted_bytes(self) -> torch.Tensor:
        """``[P]`` what the memory budget limits: replicas + saved activations + the larger
        of the backward's working rows and lean's router-gradient rows."""
        return (
            self.replica_bytes
            + self.saved_bytes
            + torch.maximum(self.backward_bytes, self.router_bytes)
        )

    @property
    def total_bytes(self) -> torch.Tensor:
        """``[P]`` replicas + token buffers (forward and backward) + saved activations."""
        return self.budgeted_bytes + self.forward_buffer_bytes

    @property
    def stock_total_bytes(self) -> torch.Tensor:
        """``[P]`` the same sum under fixed ownership, every pair kept."""
        return self.stock_saved_bytes + self.stock_backward_bytes + self.stock_forward_buffer_bytes

    @property
    def exchange_bytes(self) -> torch.Tensor:
        """``[P]`` what the exchange budget limits: max(sent, received)."""
        return torch.maximum(self.exchange_sent_bytes, self.exchange_recv_bytes)

    def summary(self) -> dict[str, int]:
        """Peaks over ranks, for logging."""
        return {
            "replica_bytes": int(self.replica_bytes.max()),
            "saved_bytes": int(self.saved_bytes.max()),
            "backward_bytes": int(self.backward_bytes.max()),
            "router_bytes": int(self.router_bytes.max()),
            "forward_buffer_bytes": int(self.forward_buffer_bytes.max()),
            "budgeted_bytes": int(self.budgeted_bytes.max()),
            "total_bytes": int(self.total_bytes.max()),
            "stock_total_bytes": int(self.stock_total_bytes.max()),
            "exchange_bytes": int(self.exchange_bytes.max()),
            "stock_exchange_bytes": int(
                torch.maximum(self.stock_exchange_sent_bytes, self.stock_exchange_recv_bytes).max()
            ),
        }


@dataclass(frozen=True, eq=False)
class ControlPlan:
    """The controller's decisions for one MoE layer call (host int64 tensors, immutable).

    Attributes:
        ep_rank: This rank's index in the EP group.
        ep_size: P.
        num_local_experts: L.
        counts: ``[P, E]`` N, pairs from source r to expert e.
        uncapped_quota: ``[E]`` ``ceil(keep_ratio * W)``, the upper bound.
        quota: ``[E]`` pairs of expert e kept for backward, ``min(uncapped_quota, quota_cap)``.
        quota_cap: The common per-expert cap the budgets forced, or None when none bound.
        source_split: Kept pairs per (source, expert) chunk (scope local), else None; computed in
            full on first use. ``source_quota`` (property) is the full ``[P, E]`` tensor;
            ``source_quota_row`` / ``source_quota_columns`` give what one rank needs for less.
        holds: ``[E, P]`` bool, rank g holds expert e this call (owner always, replicas).
        forward_load: ``[E, P]`` A, pairs of e computed on g in forward.
        backward_load: ``[E, P]`` B, kept pairs of e whose backward runs on g.
        activation_mode: ``"save"``, ``"recompute"`` or ``"lean"``, resolved for this call.
        scope: ``"local"`` or ``"global"``.
        forward_rank_load: ``[P]`` pairs computed per rank in forward.
        backward_rank_load: ``[P]`` kept pairs per rank in backward.
        forward_peak: Planned peak per-rank forward load (exact optimum for the placement).
        backward_peak: Planned peak per-rank backward load (exact optimum for the placement,
            the quotas and the budgets).
        fixed_forward_peak: Peak forward load without replicas (fixed ownership).
        fixed_backward_peak: Peak backward load of the same quotas without replicas.
        threshold: The placement search's threshold (the greedy's peak bound).
        memory_budget_bytes, exchange_budget_bytes, max_replicas_per_rank: The limits planned to.
        trimmed_pairs: Pairs the budgets removed, ``sum(uncapped_quota - quota)``.
        binding_budgets: Budgets that trimmed the quotas (``"memory"``, ``"exchange"``).
        unmet_budgets: Budgets that even quota 0 does not meet this call (then quota is 0).
        planner_time_s: Wall time of :func:`plan_call`.
        memory: (property) Planned bytes per rank, or None without a cost model.
    """

    ep_rank: int
    ep_size: int
    num_local_experts: int
    counts: torch.Tensor
    uncapped_quota: torch.Tensor
    quota: torch.Tensor
    quota_cap: Optional[int]
    source_split: Optional[SourceSplit]
    holds: torch.Tensor
    forward_load: torch.Tensor
    backward_load: torch.Tensor
    activation_mode: str
    scope: str
    forward_rank_load: torch.Tensor
    backward_rank_load: torch.Tensor
    forward_peak: int
    backward_peak: int
    fixed_forward_peak: int
    fixed_backward_peak: int
    threshold: int
    memory_budget_bytes: Optional[int]
    exchange_budget_bytes: Optional[int]
    max_replicas_per_rank: int
    trimmed_pairs: int
    binding_budgets: tuple[str, ...]
    unmet_budgets: tuple[str, ...]
    planner_time_s: float
    # Save mode, replicated experts: (expert, holder, [P, groups] kept pairs) per forward
    # sub-chunk group with pairs; None otherwise (then backward splits follow the line rule).
    # Builds ``memory`` on first use (the per-rank byte arrays cost a dozen array ops).
    memory_builder: Optional[Callable[[], MemoryPlan]] = field(default=None, repr=False)

    @classmethod
    def of(cls, **fields: Any) -> "ControlPlan":
        """``ControlPlan(**fields)`` with every field given, without the frozen dataclass's
        per-field ``object.__setattr__`` (about 10 us of a plan here): ``__init__`` only stores
        the fields, so the instance is the same (tests/test_control_native.py checks it)."""
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        return plan

    @cached_property
    def save_groups(self) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Save mode with replicas, scope local: ``(expert, holder, [P, groups] kept pairs)`` of
        every forward sub-chunk group with pairs; None otherwise (backward splits then follow
        the line rule over ``backward_load``)."""
        if not isinstance(self.source_split, SaveSplit):
            return None
        return tuple(torch.from_numpy(a) for a in self.source_split.groups)

    @cached_property
    def source_quota(self) -> Optional[torch.Tensor]:
        """``[P, E]`` kept pairs per (source, expert) chunk (scope local), else None."""
        return None if self.source_split is None else torch.from_numpy(self.source_split.full())

    def source_quota_row(self, source: int) -> Optional[torch.Tensor]:
        """``[E]`` row ``source`` of :attr:`source_quota` (what that source keeps per expert)."""
        return (
            None if self.source_split is None else torch.from_numpy(self.source_split.row(source))
        )

    def source_quota_columns(self, experts: slice) -> Optional[torch.Tensor]:
        """``[P, len]`` columns of :attr:`source_quota` (what each source keeps of ``experts``)."""
        if self.source_split is None:
            return None
        return torch.from_numpy(self.source_split.columns(experts))

    @cached_property
    def memory(self) -> Optional[MemoryPlan]:
        """Planned bytes per rank next to fixed ownership's, or None without a cost model."""
        return None if self.memory_builder is None else self.memory_builder()

    # ----------------------------------------------------------------------------------------- #
    # Derived quantities

    @cached_property
    def owner(self) -> torch.Tensor:
        """``[E]`` owner rank of every expert."""
        return torch.arange(self.counts.shape[1]) // self.num_local_experts

    @cached_property
    def replicas_per_rank(self) -> torch.Tensor:
        """``[P]`` replicas (experts held but not owned) on each rank."""
        replicas = self.holds.clone()
        replicas[torch.arange(replicas.shape[0]), self.owner] = False
        return replicas.sum(0)

    @property
    def num_replicas(self) -> int:
        return int(self.replicas_per_rank.sum())

    @property
    def kept_pairs(self) -> int:
        return int(self.quota.sum())

    @property
    def keeps_all(self) -> bool:
        """True when every pair is kept: the op may take its exact (keep 1.0) path."""
        return bool(torch.equal(self.quota, self.counts.sum(0)))

    def summary(self) -> dict[str, Any]:
        """The quantities the layer logs per call."""
        out: dict[str, Any] = {
            "pairs": int(self.counts.sum()),
            "kept_pairs": self.kept_pairs,
            "quota_cap": self.quota_cap,
            "trimmed_pairs": self.trimmed_pairs,
            "binding_budgets": ",".join(self.binding_budgets),
            "unmet_budgets": ",".join(self.unmet_budgets),
            "replicas": self.num_replicas,
            "activation_mode": self.activation_mode,
            "forward_peak": self.forward_peak,
            "backward_peak": self.backward_peak,
            "fixed_forward_peak": self.fixed_forward_peak,
            "fixed_backward_peak": self.fixed_backward_peak,
            "planner_time_us": round(self.planner_time_s * 1e6, 1),
        }
        if self.memory is not None:
            out.update(self.memory.summary())
        return out

    # ----------------------------------------------------------------------------------------- #
    # Per-source splits (what the op sends where)

    def _np(self, t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    @cached_property
    def forward_assignment(self) -> torch.Tensor:
        """``[P(src), E, P(holder)]`` pairs of source r's chunk of e computed on each holder."""
        out = interval_split_np(
            self._np(self.counts), self._np(self.forward_load), self._np(self.owner)
        )
        return torch.from_numpy(out)

    def forward_send_counts(self, source: int) -> torch.Tensor:
        """``[E, P]`` pairs ``source`` sends to each holder, per expert."""
        return _split_row(self.counts, self.forward_load, self.owner, source)

    def forward_recv_counts(self, holder: int) -> torch.Tensor:
        """``[P, E]`` pairs ``holder`` computes, per source and expert."""
        return _split_column(self.counts, self.forward_load, self.owner, holder)

    @cached_property
    def backward_assignment(self) -> Optional[torch.Tensor]:
        """``[P(src), E, P(holder)]`` kept pairs of (source, expert) whose backward runs on each
        holder; None with scope global (the owner's selection decides the sources at run time;
        it then splits each holder's ``backward_load`` with the same rule)."""
        if self.source_quota is None:
            return None
        if self.save_groups is None:
            out = interval_split_np(
                self._np(self.source_quota), self._np(self.backward_load), self._np(self.owner)
            )
            return torch.from_numpy(out)
        num_sources, num_experts = self.source_quota.shape
        out = torch.zeros(num_sources, num_experts, num_sources, dtype=torch.int64)
        out[:, torch.arange(num_experts), self.owner] = self.source_quota
        group_expert, group_rank, group_kept = self.save_groups
        out[:, group_expert, self.owner[group_expert]] = 0
        out[:, group_expert, group_rank] = group_kept
        return out

    def backward_send_counts(self, source: int) -> Optional[torch.Tensor]:
        """``[E, P]`` kept pairs ``source`` sends to each holder (None with scope global)."""
        if self.source_quota is None:
            return None
        if self.save_groups is None:
            return _split_row(self.source_quota, self.backward_load, self.owner, source)
        num_experts, num_ranks = self.holds.shape
        out = torch.zeros(num_experts, num_ranks, dtype=torch.int64)
        out[torch.arange(num_experts), self.owner] = self.source_quota[source]
        group_expert, group_rank, group_kept = self.save_groups
        out[group_expert, self.owner[group_expert]] = 0
        out[group_expert, group_rank] = group_kept[source]
        return out

    def backward_recv_counts(self, holder: int) -> Optional[torch.Tensor]:
        """``[P, E]`` kept pairs whose backward runs on ``holder`` (None with scope global)."""
        if self.source_quota is None:
            return None
        if self.save_groups is None:
            return _split_column(self.source_quota, self.backward_load, self.owner, holder)
        out = torch.where(self.owner == holder, self.source_quota, 0)
        group_expert, group_rank, group_kept = self.save_groups
        out[:, group_expert] = 0
        mine = group_rank == holder
        out[:, group_expert[mine]] = group_kept[:, mine]
        return out

    # ----------------------------------------------------------------------------------------- #
    # Invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of controller.py's docstring is violated."""
        n, a, b = self.counts, self.forward_load, self.backward_load
        num_sources, num_experts = n.shape
        w = n.sum(0)
        experts = torch.arange(num_experts)
        q, q0 = self.quota, self.uncapped_quota
        assert bool((q >= 0).all()) and bool((q <= q0).all()) and bool((q0 <= w).all()), "quota"
        expected = q0 if self.quota_cap is None else q0.clamp(max=self.quota_cap)
        assert torch.equal(q, expected), "quota is not min(uncapped, cap)"
        if self.unmet_budgets:
            assert int(q.sum()) == 0, "an unmet budget must keep no pair"
        assert self.trimmed_pairs == int((q0 - q).sum()), "trimmed count"
        assert bool(self.holds[experts, self.owner].all()), "owner must hold its expert"
        replicas = self.replicas_per_rank
        assert _peak(replicas) <= self.max_replicas_per_rank, "replica slots"
        for name, load, total in (("forward", a, w), ("backward", b, q)):
            assert bool((load >= 0).all()), f"negative {name} load"
            assert torch.equal(load.sum(1), total), f"{name} load does not sum to its total"
            assert not bool(load[~self.holds].any()), f"{name} load on a rank without the expert"
        if self.activation_mode == "save":
            assert bool((b <= a).all()), "save mode: backward beyond the forward's saved pairs"
        assert torch.equal(self.forward_rank_load, a.sum(0)), "forward rank loads"
        assert torch.equal(self.backward_rank_load, b.sum(0)), "backward rank loads"
        assert _peak(a.sum(0)) <= self.forward_peak, "forward peak"
        assert _peak(b.sum(0)) <= self.backward_peak, "backward peak"
        assert self.forward_peak <= self.fixed_forward_peak, "replicas raised the forward peak"
        fwd = self.forward_assignment
        assert torch.equal(fwd.sum(2), n) and torch.equal(fwd.sum(0), a), "forward split"
        if self.source_quota is not None:
            s = self.source_quota
            assert bool((s >= 0).all()) and bool((s <= n).all()), "source quota range"
            assert torch.equal(s.sum(0), q), "source quota sums"
            bwd = self.backward_assignment
            assert torch.equal(bwd.sum(2), s) and torch.equal(bwd.sum(0), b), "backward split"
            if self.activation_mode == "save":
                assert bool((bwd <= fwd).all()), "save mode: kept pairs outside their sub-chunk"
            for r in range(num_sources):
                assert torch.equal(self.forward_send_counts(r), fwd[r]), "forward send rows"
                assert torch.equal(self.forward_recv_counts(r), fwd[:, :, r]), "forward recv"
                assert torch.equal(self.backward_send_counts(r), bwd[r]), "backward send rows"
                assert torch.equal(self.backward_recv_counts(r), bwd[:, :, r]), "backward recv"
        if self.memory is not None:
            if self.memory_budget_bytes is not None and "memory" not in self.unmet_budgets:
                peak = _peak(self.memory.budgeted_bytes)
                assert peak <= self.memory_budget_bytes, "memory budget exceeded"
            if self.exchange_budget_bytes is not None and "exchange" not in self.unmet_budgets:
                peak = _peak(self.memory.exchange_bytes)
                assert peak <= self.exchange_budget_bytes, "exchange budget exceeded"


def _peak(values: torch.Tensor) -> int:
    return int(values.max()) if values.numel() else 0


def _holder_bounds(parts: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, P]`` start and end of each holder's range on its expert's line (owner first)."""
    rows = torch.arange(parts.shape[0])
    cum = parts.cumsum(1) - parts
    first = parts[rows, owner]
    lo = cum + first[:, None] * (torch.arange(parts.shape[1])[None, :] < owner[:, None])
    lo[rows, owner] = 0
    return lo, lo + parts


def _split_row(
    chunks: torch.Tensor, parts: torch.Tensor, owner: torch.Tensor, source: int
) -> torch.Tensor:
    """Row ``source`` of :func:`interval_split_np` as ``[E, P]``."""
    lo_h, hi_h = _holder_bounds(parts, owner)
    lo_s = chunks[:source].sum(0)
    hi_s = lo_s + chunks[source]
    return (torch.minimum(hi_s[:, None], hi_h) - torch.maximum(lo_s[:, None], lo_h)).clamp(min=0)


def _split_column(
    chunks: torch.Tensor, parts: torch.Tensor, owner: torch.Tensor, holder: int
) -> torch.Tensor:
    """Holder ``holder``'s slice of :func:`interval_split_np` as ``[P(src), E]``."""
    lo_h, hi_h = _holder_bounds(parts, owner)
    lo_s = chunks.cumsum(0) - chunks
    hi_s = lo_s + chunks
    lo = torch.maximum(lo_s, lo_h[:, holder][None, :])
    hi = torch.minimum(hi_s, hi_h[:, holder][None, :])
    return (hi - lo).clamp(min=0)


class SaveSplit(SourceSplit):
    """Save mode with replicas: a replicated expert's kept pairs per source are its holders'
    ``B[e, g]``, each split over the sources in proportion to their pairs in that holder's
    forward sub-chunk (largest remainder); other experts keep the plain split. Lazy too."""

    def __init__(
        self,
        counts: np.ndarray,
        quota: np.ndarray,
        forward_load: np.ndarray,
        owner: np.ndarray,
        experts: np.ndarray,
        backward_load: np.ndarray,
    ) -> None:
        super().__init__(counts, quota)
        self.forward_load, self.owner, self.experts = forward_load, owner, experts
        self.backward_load = backward_load

    @cached_property
    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(expert, holder, [P, groups] kept pairs)`` per forward sub-chunk group."""
        group_expert, group_rank, fwd = _groups(
            self.counts, self.forward_load, self.owner, self.experts
        )
        kept = np.ascontiguousarray(split_np(fwd, self.backward_load[group_expert, group_rank]))
        return group_expert, group_rank, kept

    @cached_property
    def replicated(self) -> np.ndarray:
        """``[P, len(experts)]`` kept pairs per source of each replicated expert."""
        group_expert, _, kept = self.groups
        starts = np.flatnonzero(np.r_[True, group_expert[1:] != group_expert[:-1]])
        return np.add.reduceat(kept, starts, axis=1)

    def full(self) -> np.ndarray:
        if self._matrix is None:
            matrix = np.ascontiguousarray(split_np(self.counts, self.quota))
            matrix[:, self.experts] = self.replicated
            self._matrix = matrix
        return self._matrix

    def row(self, source: int) -> np.ndarray:
        out = super().row(source)
        out[self.experts] = self.replicated[source]
        return out

    def columns(self, experts: np.ndarray | slice) -> np.ndarray:
        out = super().columns(experts)
        ids = np.arange(self.counts.shape[1])[experts]
        where = np.searchsorted(self.experts, ids)
        hit = (where < self.experts.size) & (
            self.experts[np.minimum(where, self.experts.size - 1)] == ids
        )
        out[:, hit] = self.replicated[:, where[hit]]
        return out


def _groups(
    n: np.ndarray, forward_load: np.ndarray, owner: np.ndarray, experts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward sub-chunks of the replicated experts: ``(expert, holder, [P, groups] pairs)``.

    Groups are the (expert, holder) pairs with forward pairs, sorted by expert then holder.
    """
    parts = forward_load[experts]
    rows = np.arange(experts.size)
    first = owner[experts]
    cum = np.cumsum(parts, axis=1) - parts
    lo_h = cum + parts[rows, first][:, None] * (np.arange(parts.shape[1])[None, :] < first[:, None])
    lo_h[rows, first] = 0
    idx_e, idx_g = np.nonzero(parts)
    lo = lo_h[idx_e, idx_g]
    hi = lo + parts[idx_e, idx_g]
    chunks = n[:, experts[idx_e]]
    lo_s = np.cumsum(n[:, experts], axis=0)[:, idx_e] - chunks
    hi_s = lo_s + chunks
    pairs = np.maximum(np.minimum(hi_s, hi[None, :]) - np.maximum(lo_s, lo[None, :]), 0)
    return experts[idx_e], idx_g, pairs
