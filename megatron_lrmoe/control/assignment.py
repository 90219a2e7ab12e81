"""The assignment of pairs to holders: replica placement, forward split, backward assignment.

Shape legend: P EP ranks, E experts, L = E / P experts owned per rank (rank r owns
``[r*L, (r+1)*L)``), ``N[r, e]`` pairs from source rank r to expert e, ``W[e] = sum_r N[r, e]``,
``A[e, g]`` / ``B[e, g]`` pairs of e computed on holder g in forward / backward, M replicated
experts (items), K holder entries (owner included).

:class:`Assignment` is one activation mode's planning state for ``controller.plan_call``:
:meth:`Assignment.place` chooses the replicas (placement.py's threshold search and greedy) and
the forward split ``A`` over them; :meth:`Assignment.backward` assigns a quota ``Q`` to the
forward holders by exact min-max (balance.py's :class:`HolderGraph`, from a proportional start)
under the per-rank caps the memory and exchange budgets leave, and says which budget a result
still breaks. The hot paths run in C where native.py's library loads (the same arrays bit for
bit); the ``reference_*`` methods are the slow, obvious versions the tests compare them with.
The search for the quota the budgets allow is budgets.py's.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Sequence

import numpy as np

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control import native, placement
from megatron_lrmoe.control.balance import HolderGraph, caps_cut, min_max_lists
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.placement import place_replicas
from megatron_lrmoe.control.plan import SaveSplit
from megatron_lrmoe.control.quota import SourceSplit
from megatron_lrmoe.control.slots import LinearSlots

__all__ = ["PLACEMENT_TOLERANCE", "Assignment", "Backward"]

# Bisection of the placement threshold stops within this fraction of T: a finer threshold lowers
# the forward peak by under 0.2 % and costs at least one more greedy run per halving.
PLACEMENT_TOLERANCE = 1.0 / 512
_NEVER = np.iinfo(np.int64).max  # a position no count of units left reaches


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
class Backward:
    """One backward assignment: the quotas, ``B``, the per-rank loads and the per-source split."""

    quota: np.ndarray
    backward_load: np.ndarray  # [E, P]
    rank_load: np.ndarray  # [P]
    source: Optional[SourceSplit]
    failed: str = ""  # the budget it breaks ("" when within budgets)
    # (max rank_load, max per-owner quota sum) where the native code computed them.
    peaks: Optional[tuple[int, int]] = None


# ``Assignment``'s default ``lib``: ask native.library() (plan_call passes what it asked once).
_LIBRARY = object()


class Assignment:
    """One mode's planning state: counts, placement, forward split, and the backward assignment
    of a quota under the budgets' rank caps (the search for the quota is :class:`BudgetSearch`'s,
    in budgets.py)."""

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
        self._uncapped: Optional[Backward] = None
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
            chosen = place_replicas(
                w, self.num_sources, self.slot_rule(), PLACEMENT_TOLERANCE, lib=self.lib
            )
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
        self._uncapped = Backward(
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

    # -- backward assignment under the budgets -----------------------------------------------

    def keeps_all(self, quota: np.ndarray) -> bool:
        return self.lrmoe.is_exact and bool(np.array_equal(quota, self.w))

    def fixed_memory(self, keeps_all: bool) -> np.ndarray:
        """``[P]`` budgeted bytes no quota changes: replicas, saved activations, source rows."""
        return self.cost.replica_bytes * self.replicas_per_rank + self.saved_memory(keeps_all)

    def router_memory(self, keeps_all: bool) -> np.ndarray:
        """``[P]`` lean's router-gradient rows of every computed pair (0 in other modes), live
        before the kept pairs' backward: the budget holds the larger of the two."""
        return self.cost.router_bytes(self.mode, keeps_all) * self.forward_rank_load

    def saved_memory(self, keeps_all: bool) -> np.ndarray:
        """``[P]`` saved activations: expert side per computed pair, source side per sent pair.
        A call that keeps every pair runs the exact path, which saves x and h in every mode; at
        EP 1 a trimmed call reads x from the layer input (``CostModel.expert_saved_bytes``)."""
        cost, mode = self.cost, self.mode
        if keeps_all:
            return cost.expert_saved_bytes("save") * self.forward_rank_load
        local_tokens = self.num_sources == 1
        return (
            cost.expert_saved_bytes(mode, local_tokens) * self.forward_rank_load
            + cost.source_saved_bytes(mode, keeps_all) * self.sent
        )

    def rank_caps(self, quota: np.ndarray) -> Optional[np.ndarray]:
        """``[P]`` most kept pairs per rank under the budgets (None: unbounded); may be < 0 (then
        no quota fits: also where lean's router rows alone overflow what the fixed terms leave).
        The quota only matters through ``keeps_all``: cached per case."""
        key = (self.memory_budget, self.exchange_budget, self.keeps_all(quota))
        if key not in self._caps:
            caps = None
            if self.memory_budget is not None:
                left = self.memory_budget - self.fixed_memory(key[2])
                caps = left // self.cost.backward_bytes(self.mode)
                caps = np.where(left >= self.router_memory(key[2]), caps, -1)
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

    def backward(self, quota: np.ndarray, with_caps: bool) -> Optional[Backward]:
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
            plan = Backward(quota, load.reshape(shape), self.per_owner(quota), None, None)
            return self._finish(plan)
        result = self.min_max(quota, None if caps is None else caps.tolist())
        if result is None:
            return None
        amounts, rank_load = result
        if len(holders):
            load[self.holder_flat] = amounts
        plan = Backward(quota, load.reshape(shape), np.array(rank_load, np.int64), None, None)
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
    ) -> Optional[Backward]:
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
        plan = Backward(quota, load, rank_load, None, None, peaks=peaks)
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

    def _finish(self, plan: Backward) -> Backward:
        if self.local_scope:
            self._source_quota(plan)
        plan.failed = self.broken_budget(plan)
        return plan

    def _source_quota(self, plan: Backward) -> None:
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

    def sent_rows(self, plan: Backward) -> np.ndarray:
        """``[P]`` kept rows each source sends (scope global: the most its owner may pick)."""
        if plan.source is not None:
            return plan.source.full().sum(1)
        return np.minimum(self.n, plan.quota[None, :]).sum(1)

    def broken_budget(self, plan: Backward) -> str:
        if self.memory_budget is not None:
            keeps_all = self.keeps_all(plan.quota)
            used = self.fixed_memory(keeps_all) + np.maximum(
                self.cost.backward_bytes(self.mode) * plan.rank_load,
                self.router_memory(keeps_all),
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
