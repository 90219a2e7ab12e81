"""The per-call controller: all-gathered pair counts and budgets in, a frozen plan out.

Shape legend: P EP ranks, E experts, L = E / P experts owned per rank (rank r owns
``[r*L, (r+1)*L)``), ``N[r, e]`` pairs from source rank r to expert e, ``W[e] = sum_r N[r, e]``.

Pipeline of :func:`plan_call` (host integers only, before any expert compute):
1. Quotas: ``Q0 = ceil(keep_ratio * W)`` (control/quota.py), the upper bound.
2. Placement (``max_replicas_per_rank > 0``): threshold search + greedy (control/placement.py)
   chooses replicas of hot experts, within the replica slots the memory budget leaves, and its
   moves give the forward split ``A[e, g]`` (pairs of e computed on g); with
   ``exact_forward=True`` the exact min-max split over the same holders replaces it.
3. Backward: the exact min-max assignment ``B[e, g]`` of the quotas over the forward holders
   (control/balance.py). In ``save`` mode a holder can only run backward on pairs whose
   activations it saved, so ``B <= A``; in ``recompute`` mode any holder will do.
4. Budgets (water-filling): if the plan with ``Q0`` exceeds the memory or exchange budget, the
   largest common per-expert cap ``c`` with ``Q = min(Q0, c)`` that fits is found by bisection
   (hot experts lose pairs first); the holders' budgets enter the assignment as per-rank caps. If
   even quota 0 does not fit, the plan keeps no pair and names the budget in ``unmet_budgets``;
   it never raises at run time. Trials of the search only ask whether the caps admit an
   assignment (augmenting paths, cuts of ranks that prove they do not); under the memory budget
   alone the answer is monotone in ``c``, and a cut-guided search finds the same ``c`` in a few
   trials.
5. ``activation_mode="auto"``: save unless recompute keeps more pairs under the memory budget.

Per-source splits (what the op exchanges) follow one rule everywhere: an expert's pairs are laid
on a line in source-rank order and its holders take consecutive ranges, the owner first, then the
replicas by rank (``interval_split_np``), so each (source, expert) chunk splits into contiguous
sub-chunks per holder. Backward, scope local: recompute mode selects ``source_quota[r, e]``
(largest remainder, as without replicas) per (source, expert) chunk and sends the kept rows to the
holders by the same rule over ``B``; save mode selects per forward sub-chunk (source, expert,
holder), the holder's ``B[e, g]`` split over its sources in proportion to their pairs there.

Invariants (``ControlPlan.check_invariants``): ``0 <= Q <= Q0 <= W``; ``Q == min(Q0, cap)``;
owners always hold their experts; replicas per rank within ``max_replicas_per_rank``;
``A.sum(1) == W``, ``B.sum(1) == Q``, both zero where a rank does not hold the expert, ``B <= A``
in save mode; per-source splits sum to the counts and quotas; per-rank loads at most the planned
peaks; budgets respected unless named in ``unmet_budgets``. Deterministic: the same counts and
config give the same plan on every rank (ties: lower expert id, lower rank).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control import native, placement
from megatron_lrmoe.control.balance import HolderGraph, caps_cut, min_max_lists
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.placement import place_replicas
from megatron_lrmoe.control.plan import ControlPlan, MemoryPlan, SaveSplit
from megatron_lrmoe.control.quota import (
    _ABS_TOL,
    _REL_TOL,
    SourceSplit,
    largest_cap,
    quotas_np,
    split_np,
    water_fill_np,
)
from megatron_lrmoe.control.slots import LinearSlots

__all__ = [
    "ControlPlan",
    "MemoryPlan",
    "check_budgets",
    "minimum_memory_bytes",
    "plan_call",
]

logger = logging.getLogger(__name__)

# Bisection of the placement threshold stops within this fraction of T: a finer threshold lowers
# the forward peak by under 0.2 % and costs at least one more greedy run per halving.
PLACEMENT_TOLERANCE = 1.0 / 512
_NEVER = np.iinfo(np.int64).max  # a position no count of units left reaches


# --------------------------------------------------------------------------------------------- #
# Start-up validation
# --------------------------------------------------------------------------------------------- #


def _modes(lrmoe: LRMoEConfig) -> tuple[str, ...]:
    return ("save", "recompute") if lrmoe.activation_mode == "auto" else (lrmoe.activation_mode,)


def minimum_memory_bytes(lrmoe: LRMoEConfig, cost: CostModel, pairs_per_rank: int) -> int:
    """Least per-GPU memory a call needs at quota 0 without replicas, with every rank computing
    the mean ``pairs_per_rank`` rows (the best any placement can do).

    It is what no quota can remove: saved activations (save mode) and source-side rows (z, and
    the token rows in recompute mode). With ``activation_mode="auto"`` the cheaper mode counts.
    """
    return min(
        pairs_per_rank
        * (cost.expert_saved_bytes(mode) + cost.source_saved_bytes(mode, keeps_all=False))
        for mode in _modes(lrmoe)
    )


def check_budgets(
    lrmoe: LRMoEConfig,
    cost: Optional[CostModel],
    pairs_per_rank: Optional[int] = None,
    layer_name: str = "LRMoELayer",
) -> None:
    """Start-up check of the budgets against the layer's shapes (call at layer construction).

    Args:
        lrmoe: The layer's config.
        cost: The layer's :class:`CostModel` (``CostModel.from_config(transformer_config)``);
            required when a budget is set.
        pairs_per_rank: Pairs each rank routes per call, tokens per rank times top-k (e.g.
            ``seq_length * micro_batch_size / tp`` (sequence parallel) ``* moe_router_topk``), if
            known; without it only what the shapes alone decide is checked.
        layer_name: Named in error messages.

    Raises:
        ValueError: A budget no quota can meet, naming the budget, the minimum and the fix.
    """
    budgets = lrmoe.memory_budget_bytes is not None or lrmoe.exchange_budget_bytes is not None
    if budgets and cost is None:
        raise ValueError(f"{layer_name}: LRMoE budgets need a CostModel of the layer's shapes")
    memory = lrmoe.memory_budget_bytes
    if memory is None or cost is None or pairs_per_rank is None:
        return
    need = minimum_memory_bytes(lrmoe, cost, pairs_per_rank)
    if memory < need:
        fix = f"set --lrmoe-memory-budget-bytes to at least {need}"
        if lrmoe.activation_mode == "save":
            cheaper = minimum_memory_bytes(
                LRMoEConfig(activation_mode="recompute"), cost, pairs_per_rank
            )
            if cheaper < need:
                fix += f" (or {cheaper} with --lrmoe-activation-mode recompute or auto)"
        raise ValueError(
            f"{layer_name}: memory_budget_bytes ({memory}) cannot be met at any quota: a call "
            f"with {pairs_per_rank} pairs per rank holds at least {need} bytes per GPU at quota 0 "
            f"without replicas (activation_mode={lrmoe.activation_mode!r}); {fix}"
        )
    if lrmoe.max_replicas_per_rank > 0 and memory < need + cost.replica_bytes:
        logger.warning(
            "%s: max_replicas_per_rank=%d can never be used: one replica needs %d bytes on top of "
            "the %d bytes of quota 0, and memory_budget_bytes is %d",
            layer_name,
            lrmoe.max_replicas_per_rank,
            cost.replica_bytes,
            need,
            memory,
        )


# --------------------------------------------------------------------------------------------- #
# The controller
# --------------------------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=64)
def _layout(num_sources: int, num_experts: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Per-shape constants, shared by every call of that shape (read-only arrays): L, the
    ``[E]`` owner of every expert, the flat index ``e * P + owner[e]`` of every (expert, owner)
    entry of an ``[E, P]`` matrix, and the first expert of every rank."""
    local = num_experts // num_sources
    owner = np.arange(num_experts) // local
    diagonal = np.arange(num_experts) * num_sources + owner
    owned_starts = np.arange(0, num_experts, max(local, 1))
    for array in (owner, diagonal, owned_starts):
        array.setflags(write=False)
    return local, owner, diagonal, owned_starts


class _Holders:
    """Forward holders of the replicated experts (the flexible items of both assignments).

    Item i is expert ``experts[i]``; its holders are the flat entries ``bounds[i]:bounds[i + 1]``
    (ascending rank, owner included): ``expert[k]`` held on ``rank[k]`` computing ``forward[k]``
    pairs (A). Flat arrays let the controller fill ``[E, P]`` loads with one indexed write; the
    per-item lists are what :func:`min_max_lists` walks.
    """

    def __init__(
        self,
        expert: np.ndarray,
        rank: np.ndarray,
        forward: np.ndarray,
        bounds: np.ndarray,
        experts: Optional[np.ndarray] = None,
    ) -> None:
        self.expert, self.rank, self.forward, self.bounds = expert, rank, forward, bounds
        self.heads = bounds[:-1]  # [M] first entry of each item
        # ``experts``: ``expert[heads]`` when the caller has it already (native placement).
        self.experts = expert[self.heads] if experts is None else experts
        self.size = int(self.experts.size)

    @staticmethod
    @functools.cache
    def empty() -> "_Holders":
        """No replicated expert (shared: never modified)."""
        none = np.zeros(0, dtype=np.int64)
        return _Holders(none, none, none, np.zeros(1, dtype=np.int64))

    def __len__(self) -> int:
        return self.size

    def lists(self, flat: np.ndarray) -> list[list[int]]:
        """A flat ``[K]`` array cut into one list per item."""
        values, bounds = flat.tolist(), self.bounds.tolist()
        return [values[i:j] for i, j in zip(bounds[:-1], bounds[1:])]

    @cached_property
    def ranks(self) -> list[list[int]]:
        return self.lists(self.rank)

    @cached_property
    def forward_lists(self) -> list[list[int]]:
        return self.lists(self.forward)

    @cached_property
    def item(self) -> np.ndarray:
        """``[K]`` item of every entry."""
        return np.searchsorted(self.experts, self.expert)  # both ascending

    # Host-int copies for the holder graph (pre-filled when the holders are built in Python).
    @cached_property
    def rank_list(self) -> list[int]:
        return self.rank.tolist()

    @cached_property
    def bounds_list(self) -> list[int]:
        return self.bounds.tolist()

    @cached_property
    def forward_list(self) -> list[int]:
        return self.forward.tolist()

    @staticmethod
    def of_moves(
        moves: Sequence[tuple[int, int, int]], expert_load: np.ndarray, local: int
    ) -> "_Holders":
        """The holders of a placement's moves ``(expert, rank, pairs)`` (sorted by (expert,
        rank), every expert's replicas together): each replicated expert gains an owner entry
        with the pairs the moves left there, in rank order. Built on host ints (a few dozen
        entries: about the cost of the dozen small numpy calls it replaces), so the holder graph
        gets its lists without converting arrays back.
        """
        expert: list[int] = []
        rank: list[int] = []
        forward: list[int] = []
        bounds = [0]
        i, count = 0, len(moves)
        while i < count:
            e = moves[i][0]
            owner = e // local
            j, sent = i, 0
            while j < count and moves[j][0] == e:
                sent += moves[j][2]
                j += 1
            home = int(expert_load[e]) - sent
            for _, g, amount in moves[i:j]:
                if owner is not None and g > owner:
                    expert.append(e)
                    rank.append(owner)
                    forward.append(home)
                    owner = None
                expert.append(e)
                rank.append(g)
                forward.append(amount)
            if owner is not None:
                expert.append(e)
                rank.append(owner)
                forward.append(home)
            bounds.append(len(rank))
            i = j
        columns = np.array([expert, rank, forward], dtype=np.int64)
        holders = _Holders(columns[0], columns[1], columns[2], np.array(bounds, dtype=np.int64))
        holders.__dict__.update(rank_list=rank, bounds_list=bounds, forward_list=forward)
        return holders


def _holders_from(expert: np.ndarray, rank: np.ndarray, forward: np.ndarray) -> _Holders:
    """Holders from entries sorted by (expert, rank), each expert with two or more."""
    if not expert.size:
        return _Holders.empty()
    starts = (expert[1:] != expert[:-1]).nonzero()[0] + 1
    return _Holders(expert, rank, forward, np.concatenate(([0], starts, [expert.size])))


@dataclass
class _Backward:
    quota: np.ndarray
    backward_load: np.ndarray  # [E, P]
    rank_load: np.ndarray  # [P]
    source: Optional[SourceSplit]
    failed: str = ""  # the budget it breaks ("" when within budgets)
    # (max rank_load, max per-owner quota sum) where the native code computed them.
    peaks: Optional[tuple[int, int]] = None


# ``_Call``'s default ``lib``: ask native.library() (plan_call passes what it asked once).
_LIBRARY = object()


class _Call:
    """One mode's planning state (counts, placement, forward split, budgets)."""

    def __init__(
        self,
        n: np.ndarray,
        w: np.ndarray,
        lrmoe: LRMoEConfig,
        cost: Optional[CostModel],
        mode: str,
        q0: np.ndarray,
        exact_forward: bool = False,
        lib: Any = _LIBRARY,
    ) -> None:
        self.n, self.w, self.lrmoe, self.cost, self.mode, self.q0 = n, w, lrmoe, cost, mode, q0
        self.exact_forward = exact_forward
        self.num_sources, self.num_experts = n.shape
        self.local, self.owner, self.diagonal, self.owned_starts = _layout(*n.shape)
        self.memory_budget = lrmoe.memory_budget_bytes if cost is not None else None
        self.exchange_budget = (
            lrmoe.exchange_budget_bytes if cost is not None and self.num_sources > 1 else None
        )
        self.local_scope = lrmoe.scope == "local"
        # Rank sets R proven overloaded by an earlier cap trial, by R's mask: what every expert's
        # holders outside R can take ([E]) and the mask ([P]) (see ``cut_of``).
        self.cuts: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self._caps: dict[tuple, Optional[np.ndarray]] = {}
        self._slot_room: Optional[np.ndarray] = None
        # The compiled twins of the hot loops (native.py), or None: the Python paths.
        self.lib = native.library() if lib is _LIBRARY else lib
        # The uncapped quotas' assignment when the native placement made it along (used once).
        self._uncapped: Optional[_Backward] = None
        self._holder_addresses: Optional[tuple[int, ...]] = None
        # (forward peak, fixed-ownership peak) where the native placement computed them.
        self.peaks: Optional[tuple[int, int]] = None

    @cached_property
    def sent(self) -> np.ndarray:
        """``[P]`` pairs each source sends (budgets and the memory plan only)."""
        return self.n.sum(1)

    # -- placement and forward split ----------------------------------------------------------

    def slots(self, threshold: int) -> list[int]:
        """Replica slots per rank at placement threshold T under the memory budget.

        A rank whose forward load is T holds its saved activations and source-side rows whatever
        the quota; replicas may use what is left, and the quotas get what the replicas leave (the
        budget check after the assignment trims them). Replicas come first because the forward
        is exact and its peak sets the step time, and in save mode they also spread a hot rank's
        saved activations; a policy that reserved the untrimmed backward first placed no replica
        at all under tight budgets, leaving skewed loads at fixed ownership's forward peak
        (several times the balanced one) to keep a few per cent more pairs.
        """
        rule = self.slot_rule()
        return [rule] * self.num_sources if isinstance(rule, int) else rule(threshold)

    def slot_rule(self) -> int | LinearSlots:
        """:meth:`slots` as the placement takes them: ``max_replicas_per_rank`` on every rank
        without a memory budget, else the budget's rule (a function of T that native code can
        evaluate too)."""
        limit = self.lrmoe.max_replicas_per_rank
        if self.memory_budget is None or self.cost is None:
            return limit
        cost, mode = self.cost, self.mode
        if self._slot_room is None:  # what the source rows leave, the same for every T
            per_source = cost.source_saved_bytes(mode, keeps_all=self.lrmoe.is_exact)
            self._slot_room = self.memory_budget - per_source * self.sent
        per_pair = cost.expert_saved_bytes(mode)
        return LinearSlots(self._slot_room, per_pair, cost.replica_bytes, limit)

    def place(self) -> None:
        """Replicas, the exact forward split over them, and pruning of idle replicas.

        With the native library (native.py) the search, the holders and the forward matrices
        come from one C call (:meth:`_place_native`), except where the placement's local search
        or the exact forward split (Python only) follow the greedy.
        """
        search = self.lrmoe.max_replicas_per_rank > 0 and self.num_sources > 1
        lib = self.lib
        if (
            lib is not None
            and not self.exact_forward
            and not (
                search and self.num_sources * self.num_experts <= placement.IMPROVE_MAX_PAIRS
            )
            and self._place_native(lib, search)
        ):
            return
        w = self.w
        self.fixed_rank_load = self.per_owner(w)
        self.threshold = int(self.fixed_rank_load.max(initial=0))
        self.holders = _Holders.empty()
        if search:
            # Without a memory budget the slots do not depend on the threshold.
            chosen = place_replicas(w, self.num_sources, self.slot_rule(), PLACEMENT_TOLERANCE)
            self.threshold = chosen.threshold
            if chosen.moves:
                self.holders = _Holders.of_moves(chosen.moves, w, self.local)
                if self.exact_forward:
                    self.holders = self._exact_split(self.holders)
        # [E, P] matrices filled through flat indices (e * P + g): one 1-D write each.
        forward = np.zeros(self.num_experts * self.num_sources, dtype=np.int64)
        forward[self.diagonal] = w
        holds = np.zeros(forward.size, dtype=bool)
        holds[self.diagonal] = True
        holders = self.holders
        self.rigid = np.ones(self.num_experts, dtype=bool)  # experts with one holder
        if len(holders):
            # Replica entries always carry pairs; an owner entry may be empty (still a holder).
            self.holder_flat = holders.expert * self.num_sources + holders.rank
            forward[self.holder_flat] = holders.forward
            holds[self.holder_flat] = True  # owners: already True
            self.rigid[holders.experts] = False
            self.forward_rank_load = self.per_owner(w * self.rigid) + np.bincount(
                holders.rank, holders.forward, minlength=self.num_sources
            ).astype(np.int64)  # float64 sums of int64 pairs below 2**53: exact
            replica = holders.rank != self.owner[holders.expert]
            self.replicas_per_rank = np.bincount(holders.rank[replica], minlength=self.num_sources)
        else:
            self.forward_rank_load = self.fixed_rank_load
            self.replicas_per_rank = np.zeros(self.num_sources, dtype=np.int64)
        self.forward_load = forward.reshape(self.num_experts, self.num_sources)
        self.holds = holds.reshape(self.num_experts, self.num_sources)

    def _place_native(self, lib: Any, search: bool) -> bool:
        """:meth:`place` (without local search or exact split) in one C call: the threshold
        search, the holders of its moves (:meth:`_Holders.of_moves`) and the forward matrices,
        the same arrays bit for bit. False (nothing done) for slots C does not evaluate."""
        num_ranks, num_experts = self.num_sources, self.num_experts
        rule = native.slot_rule(self.slot_rule(), num_ranks) if search else None
        if search and rule is None:
            return False
        placed = native.place_call(
            lib,
            num_ranks,
            num_experts,
            self.w_address,
            rule,
            PLACEMENT_TOLERANCE,
            self.q0,
            self.mode == "save",
        )
        self.threshold = placed.threshold
        self.peaks = placed.peaks
        if placed.holders is not None:
            expert, rank, forward, flat, bounds, experts = placed.holders
            self.holders = _Holders(expert, rank, forward, bounds, experts)
            self.holder_flat = flat
            self._holder_addresses = placed.holder_addresses
        else:
            self.holders = _Holders.empty()
        self.forward_load = placed.forward_load
        self._uncapped = _Backward(
            self.q0,
            placed.backward_load,
            placed.backward_rank_load,
            None,
            peaks=placed.backward_peaks,
        )
        self.holds = placed.holds
        self.rigid = placed.rigid
        self._rigid_address = placed.rigid_address
        self.forward_rank_load = placed.forward_rank_load
        self.replicas_per_rank = placed.replicas_per_rank
        self.fixed_rank_load = placed.fixed_rank_load
        return True

    @cached_property
    def w_address(self) -> int:
        """Address of ``w`` for the native calls (taken once per call)."""
        return native.address(self.w)

    @cached_property
    def _rigid_address(self) -> int:
        return native.address(self.rigid)

    def per_owner(self, values: np.ndarray) -> np.ndarray:
        """``[P]`` sums of an ``[E]`` vector over each rank's owned experts (exact int64)."""
        if not self.local:
            return np.zeros(self.num_sources, dtype=np.int64)
        return np.add.reduceat(values, self.owned_starts)  # faster than a sum over [P, L]

    def reference_holders(self, placement: Any) -> _Holders:
        """The slow, obvious :meth:`_Holders.of_moves`: the placement's replica arrays with an
        owner entry per replicated expert, sorted by (expert, rank) with numpy."""
        w, owner = self.w, self.owner
        replica_expert = placement.replica_expert
        first = (replica_expert[1:] != replica_expert[:-1]).nonzero()[0] + 1
        first = np.concatenate(([0], first))
        experts = replica_expert[first]
        kept_home = w[experts] - np.add.reduceat(placement.replica_pairs, first)
        expert = np.concatenate([replica_expert, experts])
        rank = np.concatenate([placement.replica_rank, owner[experts]])
        forward = np.concatenate([placement.replica_pairs, kept_home])
        order = np.lexsort((rank, expert))
        return _holders_from(expert[order], rank[order], forward[order])

    def _exact_split(self, holders: _Holders) -> _Holders:
        """The exact min-max forward split over the greedy's holders, with the replicas it
        leaves idle dropped."""
        w, owner, experts = self.w, self.owner, holders.experts
        rigid = np.ones(self.num_experts, dtype=bool)
        rigid[experts] = False
        base = self.per_owner(w * rigid)
        result = min_max_lists(
            base.tolist(), w[experts].tolist(), holders.ranks, holders.forward_lists
        )
        assert result is not None  # no capacities: always feasible
        amounts = np.fromiter(itertools.chain.from_iterable(result[0]), np.int64, holders.rank.size)
        keep = (amounts > 0) | (holders.rank == owner[holders.expert])
        alone = np.add.reduceat(keep.astype(np.int64), holders.bounds[:-1]) == 1  # owner only
        keep &= ~np.repeat(alone, holders.bounds[1:] - holders.heads)
        return _holders_from(holders.expert[keep], holders.rank[keep], amounts[keep])

    # -- backward, budgets -------------------------------------------------------------------

    def keeps_all(self, quota: np.ndarray) -> bool:
        return self.lrmoe.is_exact and bool(np.array_equal(quota, self.w))

    def fixed_memory(self, keeps_all: bool) -> np.ndarray:
        """``[P]`` budgeted bytes no quota changes: replicas, saved activations, source rows."""
        return self.cost.replica_bytes * self.replicas_per_rank + self.saved_memory(keeps_all)

    def saved_memory(self, keeps_all: bool) -> np.ndarray:
        """``[P]`` saved activations: expert side per computed pair, source side per sent pair."""
        cost, mode = self.cost, self.mode
        return (
            cost.expert_saved_bytes(mode) * self.forward_rank_load
            + cost.source_saved_bytes(mode, keeps_all) * self.sent
        )

    def rank_caps(self, quota: np.ndarray) -> Optional[np.ndarray]:
        """``[P]`` most kept pairs per rank under the budgets (None: unbounded); may be < 0 (then
        no quota fits). The quota only matters through ``keeps_all``: cached per case."""
        key = (self.memory_budget, self.exchange_budget, self.keeps_all(quota))
        if key not in self._caps:
            caps = None
            if self.memory_budget is not None:
                left = self.memory_budget - self.fixed_memory(key[2])
                caps = left // self.cost.backward_bytes(self.mode)
            if self.exchange_budget is not None:
                room = self.exchange_budget // self.cost.exchange_bytes(self.mode)
                caps = np.full(self.num_sources, room) if caps is None else np.minimum(caps, room)
            self._caps[key] = caps
        return self._caps[key]

    def _rules_out(self, quota: np.ndarray, caps: np.ndarray) -> bool:
        """Cheap necessary conditions for ``caps`` (most failing steps of the cap search stop
        here): pairs of experts with one holder cannot move, and all pairs must fit somewhere."""
        if bool((self.per_owner(quota * self.rigid) > caps).any()):
            return True
        return int(quota.sum()) > int(caps.sum())

    @cached_property
    def graph(self) -> HolderGraph:
        """The holder graph of the replicated experts (save mode: edge room ``A``), built once
        for every assignment and feasibility trial of this call."""
        holders = self.holders
        return HolderGraph(
            self.num_sources,
            holders.rank_list,
            holders.bounds_list,
            holders.forward_list if self.mode == "save" else None,
        )

    @cached_property
    def _start_constants(self) -> tuple[np.ndarray, np.ndarray]:
        """What :meth:`start` needs that only the placement decides, per entry ``[K]``: the
        divisor ``max(W, 1)`` and the order in which the item's holders take the units left
        (ascending rank; save mode skips holders without forward pairs, never first)."""
        holders = self.holders
        divisor = np.maximum(self.w[holders.expert], 1)
        position = np.arange(holders.rank.size) - holders.heads[holders.item]
        if self.mode == "save":
            # floor(Q A / W) < A exactly when A > 0 and Q < W; at Q == W no unit is left. Only
            # an owner entry can lack forward pairs: the holders after it move up one place.
            can = holders.forward > 0
            if not can.all():
                taken = np.cumsum(can)
                position = taken - (taken - can)[holders.heads][holders.item] - 1
                position[~can] = _NEVER
        return divisor, position

    def start(self, quota: np.ndarray) -> tuple[list[int], list[int]]:
        """:meth:`reference_start` with the starting split flat (one entry per holder, as
        :attr:`graph` numbers them), computed with array operations."""
        holders = self.holders
        base = self.per_owner(quota * self.rigid).tolist()
        if not len(holders):
            return base, []
        divisor, position = self._start_constants
        share = quota[holders.expert] * holders.forward // divisor
        left = quota[holders.experts] - np.add.reduceat(share, holders.heads)
        share += position < left[holders.item]
        return base, share.tolist()

    def reference_start(self, quota: np.ndarray) -> tuple[list[int], list[list[int]]]:
        """Rigid load per rank and the replicated experts' starting split of ``quota``.

        Each holder starts with its proportional share ``floor(Q A / W)`` of the forward pairs;
        the units left go one each to the first holders (ascending rank) that can take one (save
        mode: ``B <= A``). The exact solver then only corrects a near-optimal start.
        """
        base = self.per_owner(quota * self.rigid).tolist()
        save = self.mode == "save"
        initial = []
        for q, total, forward in zip(
            quota[self.holders.experts].tolist(),
            self.w[self.holders.experts].tolist(),
            self.holders.forward_lists,
        ):
            share = [q * a // total for a in forward] if total else [0] * len(forward)
            left = q - sum(share)
            for j, a in enumerate(forward):
                if left == 0:
                    break
                if not save or share[j] < a:
                    share[j] += 1
                    left -= 1
            initial.append(share)
        return base, initial

    def backward(self, quota: np.ndarray, with_caps: bool) -> Optional[_Backward]:
        """Exact min-max backward assignment of ``quota`` (rank caps from the budgets if asked).

        Returns None when the caps admit no assignment, else the plan with ``failed`` naming a
        budget the result still breaks (only possible without caps or on the source side).
        With the native library the assignment is one C call; that of the uncapped quotas
        ``q0`` without caps, the first every plan asks for, came with the placement.
        """
        holders = self.holders
        caps = self.rank_caps(quota) if with_caps else None
        if caps is not None and self._rules_out(quota, caps):
            return None
        if self.lib is not None:
            first = self._uncapped
            if caps is None and first is not None and quota is first.quota:
                self._uncapped = None
                return self._finish(first)
            return self._backward_native(self.lib, quota, caps)
        load = np.zeros(self.num_experts * self.num_sources, dtype=np.int64)
        load[self.diagonal] = quota
        shape = (self.num_experts, self.num_sources)
        if caps is None and not len(holders):
            # Fixed ownership, nothing to balance: every kept pair on its owner.
            plan = _Backward(quota, load.reshape(shape), self.per_owner(quota), None, None)
            return self._finish(plan)
        result = self.min_max(quota, None if caps is None else caps.tolist())
        if result is None:
            return None
        amounts, rank_load = result
        if len(holders):
            load[self.holder_flat] = amounts
        plan = _Backward(quota, load.reshape(shape), np.array(rank_load, np.int64), None, None)
        return self._finish(plan)

    def _holder_args(self) -> tuple[int, int, int, int, int, int]:
        """The holder arrays as C arguments: ``(M, expert, rank, forward, flat, bounds)``."""
        if self._holder_addresses is None:
            holders = self.holders
            if not len(holders):
                # No entry is read; bounds[0] = 0 is.
                self._holder_addresses = (0, 0, 0, 0, 0, native.address(holders.bounds))
            else:
                arrays = (holders.expert, holders.rank, holders.forward, self.holder_flat)
                addresses = (native.address(a) for a in (*arrays, holders.bounds))
                self._holder_addresses = (len(holders), *addresses)
        return self._holder_addresses

    def _backward_native(
        self, lib: Any, quota: np.ndarray, caps: Optional[np.ndarray]
    ) -> Optional[_Backward]:
        """:meth:`backward`'s assignment in one C call (``lrmoe_backward``: :meth:`start`, the
        holder graph's exact min-max, the ``[E, P]`` fill), the same plan bit for bit."""
        quota = np.ascontiguousarray(quota, dtype=np.int64)
        caps_array = None if caps is None else np.ascontiguousarray(caps, dtype=np.int64)
        result = native.backward(
            lib,
            self.num_sources,
            self.num_experts,
            quota,
            self.w_address,
            self._rigid_address,
            self._holder_args(),
            self.mode == "save",
            caps_array,
        )
        if result is None:
            return None
        load, rank_load, peaks = result
        plan = _Backward(quota, load, rank_load, None, None, peaks=peaks)
        return self._finish(plan)

    def min_max(
        self, quota: np.ndarray, caps: Optional[list[int]]
    ) -> Optional[tuple[list[int], list[int]]]:
        """Exact min-max assignment of ``quota`` from :meth:`start` on :attr:`graph`: the
        amount per holder entry and the load per rank, None when ``caps`` admit none."""
        base, initial = self.start(quota)
        return self.graph.min_max(base, initial, caps)

    def reference_min_max(
        self, quota: np.ndarray, caps: Optional[list[int]]
    ) -> Optional[tuple[list[int], list[int]]]:
        """The slow, obvious :meth:`min_max`: :meth:`reference_start` and
        :func:`min_max_lists` on per-item lists."""
        holders = self.holders
        base, initial = self.reference_start(quota)
        result = min_max_lists(
            base,
            quota[holders.experts].tolist(),
            holders.ranks,
            initial,
            caps,
            holders.forward_lists if self.mode == "save" else None,
        )
        if result is None:
            return None
        return list(itertools.chain.from_iterable(result[0])), result[1]

    def caps_cut(self, quota: np.ndarray, caps: list[int]) -> Optional[list[int]]:
        """Ranks of a violated cut when ``caps`` admit no assignment of ``quota``, else None
        (:meth:`start` on :attr:`graph`; in C with the native library)."""
        if self.lib is not None:
            return self._caps_cut_native(self.lib, quota, caps)
        base, initial = self.start(quota)
        return self.graph.caps_cut(base, initial, caps)

    def _caps_cut_native(self, lib: Any, quota: np.ndarray, caps: list[int]) -> Optional[list[int]]:
        """:meth:`caps_cut` in one C call (``lrmoe_start_caps_cut``)."""
        quota = np.ascontiguousarray(quota, dtype=np.int64)
        caps_array = np.array(caps, dtype=np.int64)
        return native.start_caps_cut(
            lib,
            self.num_sources,
            self.num_experts,
            quota,
            self.w_address,
            self._rigid_address,
            self._holder_args(),
            self.mode == "save",
            caps_array,
        )

    def reference_caps_cut(self, quota: np.ndarray, caps: list[int]) -> Optional[list[int]]:
        """The slow, obvious :meth:`caps_cut`: :func:`caps_cut` on per-item lists."""
        holders = self.holders
        base, initial = self.reference_start(quota)
        edges = holders.forward_lists if self.mode == "save" else None
        return caps_cut(base, holders.ranks, initial, caps, edges)

    def _finish(self, plan: _Backward) -> _Backward:
        if self.local_scope:
            self._source_quota(plan)
        plan.failed = self.broken_budget(plan)
        return plan

    def _source_quota(self, plan: _Backward) -> None:
        """Per-source kept pairs; save mode re-splits replicated experts per forward holder.

        Without that re-split the largest-remainder split is left to be computed on first use
        (``SourceSplit``): a rank's op needs only its own row and columns.
        """
        n, quota = self.n, plan.quota
        if self.mode == "save" and len(self.holders):
            plan.source = SaveSplit(
                n, quota, self.forward_load, self.owner, self.holders.experts, plan.backward_load
            )
        else:
            plan.source = SourceSplit(n, quota)

    def sent_rows(self, plan: _Backward) -> np.ndarray:
        """``[P]`` kept rows each source sends (scope global: the most its owner may pick)."""
        if plan.source is not None:
            return plan.source.full().sum(1)
        return np.minimum(self.n, plan.quota[None, :]).sum(1)

    def broken_budget(self, plan: _Backward) -> str:
        if self.memory_budget is not None:
            used = (
                self.fixed_memory(self.keeps_all(plan.quota))
                + self.cost.backward_bytes(self.mode) * plan.rank_load
            )
            if int(used.max(initial=0)) > self.memory_budget:
                return "memory"
        if self.exchange_budget is not None:
            rows = np.maximum(self.sent_rows(plan), plan.rank_load)
            if int(rows.max(initial=0)) * self.cost.exchange_bytes(self.mode) > (
                self.exchange_budget
            ):
                return "exchange"
        return ""

    def reference_fits(self, quota: np.ndarray) -> bool:
        """The slow, obvious :meth:`fits`: the whole capped plan, then its budget check."""
        trial = self.backward(quota, with_caps=True)
        return trial is not None and not trial.failed

    def fits(self, quota: np.ndarray) -> bool:
        """Whether ``backward(quota, with_caps=True)`` meets the budgets (:meth:`reference_fits`),
        decided without the min-max part of the assignment where the budgets allow.

        Within the rank caps the memory budget holds by construction, so (unless the exchange
        budget's source side depends on the assignment: save mode with replicas, scope local)
        the answer is whether the caps admit an assignment (:meth:`cut_of`) and the source side
        of the exchange budget, which does not depend on the assignment.
        """
        if self.fits_is_reference():
            return self.reference_fits(quota)
        if self.cut_of(quota) is not None:
            return False
        if self.exchange_budget is not None:
            sent = (
                np.ascontiguousarray(split_np(self.n, quota)).sum(1)
                if self.local_scope
                else np.minimum(self.n, quota[None, :]).sum(1)
            )
            if int(sent.max(initial=0)) * self.cost.exchange_bytes(self.mode) > (
                self.exchange_budget
            ):
                return False
        return True

    def fits_is_reference(self) -> bool:
        """True when :meth:`fits` needs the whole plan: the exchange budget's source side
        depends on the assignment (save mode with replicas, scope local)."""
        return (
            self.exchange_budget is not None
            and self.mode == "save"
            and len(self.holders) > 0
            and self.local_scope
        )

    def cut_of(self, quota: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """None when the rank caps admit an assignment of ``quota``, else a violated cut.

        A cut is a rank set R with what each expert's holders outside R can take,
        ``(outside_R [E], R's mask [P])`` (save mode: their forward pairs; recompute:
        unbounded unless every holder is in R): every assignment puts at least
        ``sum_e max(0, Q[e] - outside_R[e])`` on R, so more than ``sum(caps[R])`` proves that
        none fits. The cheap checks are single-rank and all-rank cuts; then the cuts found so
        far; then the augmenting paths (:func:`caps_cut`), whose cut is kept for later trials.
        """
        caps = self.rank_caps(quota)
        excess = self.per_owner(quota * self.rigid) - caps
        if int(excess.max(initial=0)) > 0:
            return self._cut([int(excess.argmax())])
        if int(quota.sum()) > int(caps.sum()):
            return self._cut(list(range(self.num_sources)))
        for outside, inside in self.cuts.values():
            if int(np.maximum(quota - outside, 0).sum()) > int(caps[inside].sum()):
                return outside, inside
        holders = self.holders
        if not len(holders) or not quota.any():
            return None  # nothing can move, or nothing to place: the checks above decided
        ranks = self.caps_cut(quota, caps.tolist())
        return None if ranks is None else self._cut(ranks)

    def _cut(self, ranks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The cut of rank set ``ranks`` (see :meth:`cut_of`), kept for later trials."""
        inside = np.zeros(self.num_sources, dtype=bool)
        inside[ranks] = True
        key = inside.tobytes()
        if key not in self.cuts:
            self.cuts[key] = (self.outside(inside), inside)
        return self.cuts[key]

    def outside(self, inside: np.ndarray) -> np.ndarray:
        """``[E]`` what each expert's holders outside the rank set ``inside`` (``[P]`` mask) can
        take (:meth:`reference_outside`) from the holder entries: an expert with one holder
        all its pairs unless its owner is inside; a replicated one, in save mode, the forward
        pairs of its holders outside, in recompute mode all its pairs if any holder is
        outside."""
        outside = np.where(inside[self.owner], 0, self.w)
        holders = self.holders
        if len(holders):
            out = ~inside[holders.rank]
            if self.mode == "save":
                taken = np.add.reduceat(holders.forward * out, holders.heads)
            else:
                reach = np.logical_or.reduceat(out, holders.heads)
                taken = np.where(reach, self.w[holders.experts], 0)
            outside[holders.experts] = taken
        return outside

    def reference_outside(self, inside: np.ndarray) -> np.ndarray:
        """The slow, obvious :meth:`outside` from the ``[E, P]`` forward split and holders."""
        if self.mode == "save":
            return self.w - self.forward_load[:, inside].sum(1)
        return np.where((self.holds & ~inside[None, :]).any(1), self.w, 0)

    def solve(self) -> tuple[_Backward, Optional[int], tuple[str, ...], tuple[str, ...]]:
        """Quotas under the budgets: ``(plan, cap, binding budgets, unmet budgets)``.

        The cap is the bisection's (:meth:`bisect_cap`): the largest common cap whose capped
        plan meets the budgets, between 0 (known to fit) and the largest quota (known not to).
        Trials ask :meth:`fits`; only the answer gets the whole plan.
        """
        q0 = self.q0
        # A plan within the budgets meets the rank caps, so caps that no assignment meets prove
        # that both plans below break a budget: skip them (the source side of the exchange
        # budget does not depend on the assignment unless ``fits`` asks the full plan).
        budgets = self.memory_budget is not None or self.exchange_budget is not None
        if not budgets or self.fits_is_reference() or self.fits(q0):
            plan = self.backward(q0, with_caps=False)
            if not plan.failed:
                return plan, None, (), ()
            plan = self.backward(q0, with_caps=True)
            if plan is not None and not plan.failed:
                return plan, None, (), ()  # the caps only moved pairs between holders
        if not self.fits(np.zeros_like(q0)):
            # Quota 0 sends nothing, so only the memory budget can stay broken: the saved
            # activations and replicas alone exceed it. Keep no pair, report, never raise.
            return self.backward(np.zeros_like(q0), with_caps=False), 0, ("memory",), ("memory",)
        cap = self.memory_cap() if self.exchange_budget is None else self.bisect_cap()
        plan = self.backward(water_fill_np(q0, cap), with_caps=True)
        return plan, cap, self.binding(cap + 1), ()

    def bisect_cap(self) -> int:
        """The largest common cap that fits, by bisection: lo always fits, hi never."""
        lo, hi = 0, int(self.q0.max(initial=0))
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(water_fill_np(self.q0, mid)):
                lo = mid
            else:
                hi = mid
        return lo

    def memory_cap(self) -> int:
        """:meth:`bisect_cap` under the memory budget alone, in a few trials.

        Here the rank caps are the same for every cap tried (only ``keeps_all`` changes them, at
        the top cap, known not to fit) and what a cut R must hold only grows with the cap, so
        the caps that fit are exactly those below some threshold: the bisection's answer is the
        largest cap that fits, whatever the order of trials. Each trial takes the largest cap
        that no cut found so far rules out (:func:`largest_cap`); a cap that fits is then the
        answer, one that does not yields a new cut. The first cuts are the cheap ones the top cap
        broke and the single rank it overloads most (every single-rank cut measured at once).
        After eight trials the rest bisects (each trial at most halves the bracket), so a run of
        weak cuts cannot take long.
        """
        q0 = self.q0
        lo, hi = 0, int(q0.max(initial=0))
        caps = self.rank_caps(np.zeros_like(q0))
        # The most overloaded single rank at the top cap often binds.
        excess = self.single_rank_load(q0) - caps
        if int(excess.max(initial=0)) > 0:
            self._cut([int(excess.argmax())])
        bounds: dict[bytes, int] = {}
        trials = 0
        while True:
            for key, (outside, inside) in self.cuts.items():
                if key not in bounds:
                    bound = largest_cap(q0, outside, int(caps[inside].sum()))
                    bounds[key] = hi if bound is None else bound
            top = min(hi - 1, *bounds.values())
            if top <= lo:
                return lo
            cap = top if trials < 8 else min(top, (lo + hi) // 2)
            trials += 1
            if self.cut_of(water_fill_np(q0, cap)) is None:
                lo = cap
            else:
                hi = cap

    def single_rank_load(self, quota: np.ndarray) -> np.ndarray:
        """``[P]`` what every assignment of ``quota`` puts on each rank g alone, the cut
        ``R = {g}`` (:meth:`reference_single_rank_load`) from the holder entries: an expert with
        one holder keeps its quota there; a replicated one keeps ``max(0, Q - (W - A[e, g]))``
        on a holder in save mode (its other holders take at most their forward pairs), nothing
        in recompute mode (they take any amount)."""
        load = self.per_owner(quota * self.rigid)
        holders = self.holders
        if self.mode == "save" and len(holders):
            stuck = quota[holders.expert] - self.w[holders.expert] + holders.forward
            np.add.at(load, holders.rank, np.maximum(stuck, 0))
        return load

    def reference_single_rank_load(self, quota: np.ndarray) -> np.ndarray:
        """The slow, obvious :meth:`single_rank_load`: the ``outside`` of :meth:`_cut` for every
        single rank at once, ``[E, P]``."""
        if self.mode == "save":
            outside = self.w[:, None] - self.forward_load
        else:  # only a rank that holds an expert alone must keep its pairs
            alone = self.holds & (self.holds.sum(1) == 1)[:, None]
            outside = np.where(alone, 0, self.w[:, None])
        return np.maximum(quota[:, None] - outside, 0).sum(0)

    def binding(self, cap: int) -> tuple[str, ...]:
        """The budgets that each alone rule out the quota cap ``cap``."""
        budgets = {"memory": self.memory_budget, "exchange": self.exchange_budget}
        names = [name for name, value in budgets.items() if value is not None]
        if len(names) == 1:
            return tuple(names)
        quota = water_fill_np(self.q0, cap)
        found = []
        for name in names:
            self.memory_budget = budgets["memory"] if name == "memory" else None
            self.exchange_budget = budgets["exchange"] if name == "exchange" else None
            trial = self.backward(quota, with_caps=True)
            if trial is None or trial.failed:
                found.append(name)
        self.memory_budget, self.exchange_budget = budgets["memory"], budgets["exchange"]
        return tuple(found) or tuple(names)


def _memory_plan(call: _Call, plan: _Backward) -> MemoryPlan:
    cost, mode, sent = call.cost, call.mode, call.sent
    own = call.fixed_rank_load
    replicas = cost.replica_bytes * call.replicas_per_rank
    saved = call.saved_memory(call.keeps_all(plan.quota))
    multi = call.num_sources > 1
    exchange = cost.exchange_bytes(mode) if multi else 0
    row = cost.row_bytes if multi else 0
    arrays = [
        replicas,
        saved,
        cost.backward_bytes(mode, call.keeps_all(plan.quota)) * plan.rank_load,
        cost.forward_buffer_bytes * call.forward_rank_load,
        exchange * call.sent_rows(plan),
        exchange * plan.rank_load,
        cost.stock_saved_bytes * own,
        cost.stock_backward_bytes * own,
        cost.forward_buffer_bytes * own,
        row * sent,
        row * own,
    ]
    return MemoryPlan(*(torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays))


def _as_counts(counts: Any, signs: bool = True) -> np.ndarray:
    """``counts`` as a C-contiguous host int64 ``[P, E]`` array, validated (the signs only
    when ``signs``: the native pass over the counts checks them on its way)."""
    if isinstance(counts, torch.Tensor):
        if counts.dtype == torch.int64 and counts.device.type == "cpu":
            counts = counts.numpy()  # shares memory (integer tensors carry no gradient)
        elif counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"counts must be an integer tensor, got {counts.dtype}")
        else:
            # NOTE: device-to-host sync if the counts live on the GPU (pass host counts).
            counts = counts.detach().to("cpu", torch.int64).numpy()
    n = np.ascontiguousarray(np.asarray(counts, dtype=np.int64))
    if n.ndim != 2 or n.shape[0] == 0:
        raise ValueError(f"counts must be [P, E] with P >= 1, got shape {tuple(n.shape)}")
    if n.shape[1] % n.shape[0]:
        raise ValueError(
            f"counts has {n.shape[1]} experts, not divisible by its {n.shape[0]} ranks"
        )
    if signs and n.size and n.min() < 0:
        raise ValueError("counts must be non-negative")
    return n


def _totals(n: np.ndarray, keep_ratio: float, lib: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(W, Q0)``: pairs per expert and the uncapped quotas (:func:`quotas_np`), in one C pass
    with the native library (which also checks the counts' signs, see :func:`_as_counts`)."""
    if lib is None:
        w = n.sum(0)
        return w, quotas_np(w, keep_ratio)
    out = native.counts(lib, n, keep_ratio, _ABS_TOL, _REL_TOL)
    if out is None:
        raise ValueError("counts must be non-negative")
    return out[0], out[1]


def plan_call(
    counts: Any,
    ep_rank: int,
    lrmoe: LRMoEConfig,
    cost: Optional[CostModel] = None,
    *,
    check: Optional[bool] = None,
    exact_forward: bool = False,
) -> ControlPlan:
    """Plan one MoE layer call from the all-gathered pair counts (see the module docstring).

    Args:
        counts: ``[P, E]`` host int pairs from source rank r to expert e (a torch tensor or numpy
            array; every rank passes the same counts).
        ep_rank: This rank's index in the EP group.
        lrmoe: keep ratio (upper bound), budgets, replica limit, activation mode, scope.
        cost: Bytes per pair and per replica (:meth:`CostModel.from_config`); needed for budgets
            and for the memory accounting (``ControlPlan.memory`` is None without it).
        check: Run ``check_invariants`` (default: ``lrmoe.debug_check_invariants``).
        exact_forward: Replace the placement greedy's forward split by the exact min-max split
            over the same replicas (drops replicas it leaves idle). Off by default: on Zipf
            loads it lowers the forward peak by well under 1 % and costs milliseconds at EP 64
            (benchmarks/planner_bench.py measures both).

    Returns:
        The frozen plan; identical on every rank for the same counts and config.

    Raises:
        ValueError: malformed counts, an ``ep_rank`` outside ``[0, P)``, or budgets without a
            cost model.
    """
    start = time.perf_counter()
    lib = native.library()
    n = _as_counts(counts, signs=lib is None)
    num_sources = n.shape[0]
    if not 0 <= int(ep_rank) < num_sources:
        raise ValueError(f"ep_rank ({ep_rank}) must be in [0, {num_sources})")
    budgets = lrmoe.memory_budget_bytes is not None or lrmoe.exchange_budget_bytes is not None
    if budgets and cost is None:
        raise ValueError("LRMoE budgets need a CostModel (CostModel.from_config(config))")
    w, q0 = _totals(n, float(lrmoe.keep_ratio), lib)
    # Modes in order of preference (auto: save, then recompute); the first that no budget trims
    # wins at once, else the one that keeps the most pairs (then the lower forward peak).
    best: Optional[tuple[tuple, _Call, _Backward, Optional[int], tuple, tuple]] = None
    modes = _modes(lrmoe)
    for mode in modes:
        call = _Call(n, w, lrmoe, cost, mode, q0, exact_forward, lib)
        call.place()
        plan, cap, binding, unmet = call.solve()
        rank = (
            (bool(unmet), -int(plan.quota.sum()), int(call.forward_rank_load.max(initial=0)))
            if len(modes) > 1
            else ()
        )
        if best is None or rank < best[0]:
            best = (rank, call, plan, cap, binding, unmet)
        if not binding:
            break
    _, call, plan, cap, binding, unmet = best
    forward_peak, fixed_forward_peak = call.peaks or (
        int(call.forward_rank_load.max(initial=0)),
        int(call.fixed_rank_load.max(initial=0)),
    )
    backward_peak, fixed_backward_peak = plan.peaks or (
        int(plan.rank_load.max(initial=0)),
        int(call.per_owner(plan.quota).max(initial=0)),
    )
    result = ControlPlan.of(
        ep_rank=int(ep_rank),
        ep_size=num_sources,
        num_local_experts=call.local,
        counts=torch.from_numpy(n),
        uncapped_quota=torch.from_numpy(q0),
        quota=torch.from_numpy(plan.quota),
        quota_cap=cap,
        source_split=plan.source,
        holds=torch.from_numpy(call.holds),
        forward_load=torch.from_numpy(call.forward_load),
        backward_load=torch.from_numpy(plan.backward_load),
        activation_mode=call.mode,
        scope=lrmoe.scope,
        forward_rank_load=torch.from_numpy(call.forward_rank_load),
        backward_rank_load=torch.from_numpy(plan.rank_load),
        forward_peak=forward_peak,
        backward_peak=backward_peak,
        fixed_forward_peak=fixed_forward_peak,
        fixed_backward_peak=fixed_backward_peak,
        threshold=call.threshold,
        memory_budget_bytes=lrmoe.memory_budget_bytes,
        exchange_budget_bytes=lrmoe.exchange_budget_bytes,
        max_replicas_per_rank=lrmoe.max_replicas_per_rank,
        trimmed_pairs=0 if plan.quota is q0 else int((q0 - plan.quota).sum()),
        binding_budgets=binding,
        unmet_budgets=unmet,
        planner_time_s=time.perf_counter() - start,
        memory_builder=None if cost is None else functools.partial(_memory_plan, call, plan),
    )
    if check if check is not None else lrmoe.debug_check_invariants:
        result.check_invariants()
    return result
