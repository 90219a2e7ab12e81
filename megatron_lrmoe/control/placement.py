"""Replica placement for one layer call: a peak-load threshold search with a greedy inside.

Shapes: E experts, P ranks, L = E / P experts owned per rank (rank r owns ``[r*L, (r+1)*L)``).

Problem: expert e receives ``W[e]`` pairs this call. Each rank may host up to ``slots[r]`` replicas
(copies of experts it does not own, one per expert); pairs of an expert may be computed by any
rank holding it. Choose the replicas so that the peak per-rank load is as low as possible.

Method (the quota-driven threshold search of UltraEP, arXiv 2606.04101, redesigned here): for a
threshold T, ranks above T are overloaded by ``load - T``, ranks below have slack ``T - load``.
:func:`threshold_greedy` walks the overloaded ranks (largest excess first) and, for each, its
experts hottest first, moving pairs to the rank with the most slack that has a free slot and does
not hold that expert yet, as much as the excess, the expert and the slack allow; one replica per
move. T is feasible when every excess is moved; a run gives up as soon as the excess left exceeds
the slack left on ranks with a free slot (:func:`reference_threshold_greedy` is the same greedy
without that shortcut). :func:`place_replicas` searches the smallest feasible T: it starts at the
lower bound ``max(ceil(total / P), max_e ceil(W[e] / P))``, gallops up in doubling steps and
bisects back (every T it returns was verified, so the search is correct even where the greedy is
not monotone in T). The greedy's own split of pairs is only a starting point:
the controller then computes the exact min-max assignment over the chosen replicas.

Deterministic: ties go to the lower rank, then the lower expert id. Everything is host integers.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

__all__ = [
    "Placement",
    "place_replicas",
    "reference_optimal_peak",
    "reference_threshold_greedy",
    "threshold_greedy",
]

Slots = Union[int, Sequence[int], Callable[[int], Sequence[int]]]


@dataclass(frozen=True)
class Placement:
    """Replicas chosen for one call and the greedy's split of pairs.

    Attributes:
        threshold: The smallest T (within the search's tolerance) at which the greedy succeeded;
            the greedy's peak load is at most T.
        replica_expert: ``[M]`` int64 expert of each replica, sorted by (expert, rank).
        replica_rank: ``[M]`` int64 rank hosting it (never the expert's owner).
        replica_pairs: ``[M]`` int64 pairs the greedy moved to it (all positive).
        greedy_runs: How many thresholds were tried (planner cost diagnostics).
    """

    threshold: int
    replica_expert: np.ndarray
    replica_rank: np.ndarray
    replica_pairs: np.ndarray
    greedy_runs: int


def threshold_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """Moves pairs off the ranks above ``threshold`` into replicas on ranks below it.

    The same moves as :func:`reference_threshold_greedy`, sooner when it fails: the search runs
    the greedy four to six times per call, and a failing run rarely fails before its last over
    rank. This one stops as soon as the pairs still to move exceed the slack left on ranks with a
    free slot (slack on a rank without slots is stranded: no later move can use it).

    Args:
        expert_load: ``[E]`` pairs per expert.
        rank_load: ``[P]`` pairs per rank with no replicas (its owned experts' loads).
        experts_hot_first: Per rank, its owned experts by load descending (ties: lower id).
        threshold: The peak load T to reach.
        slots: ``[P]`` replicas each rank may host.

    Returns:
        Moves ``(expert, rank, pairs)`` in the order made (at most one per (expert, rank)), or
        None when some rank cannot be brought down to T.
    """
    order = _RankOrder(rank_load)
    return _greedy(expert_load, rank_load, experts_hot_first, threshold, slots, order)


class _RankOrder:
    """Ranks by load, both ways (ties to the lower rank), built once per search: every greedy
    run takes the ranks above T from the front of one and those below T from the other."""

    def __init__(self, rank_load: Sequence[int]) -> None:
        load = np.asarray(rank_load, dtype=np.int64)
        descending = np.argsort(-load, kind="stable")
        ascending = np.argsort(load, kind="stable")
        self.descending: list[int] = descending.tolist()
        self.descending_key: list[int] = (-load[descending]).tolist()  # non-decreasing
        self.ascending: list[int] = ascending.tolist()
        self.ascending_load: list[int] = load[ascending].tolist()


def _greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
    order: _RankOrder,
) -> Optional[list[tuple[int, int, int]]]:
    """:func:`threshold_greedy` with the rank orders precomputed."""
    over = order.descending[: bisect.bisect_left(order.descending_key, -threshold)]
    if not over:
        return []
    free = list(slots)
    under = bisect.bisect_left(order.ascending_load, threshold)
    # Max-heap on slack (-slack, rank): the ranks below T by (load, rank) ascending are already
    # in heap order. A rank leaves it when it takes a move and comes back after the current
    # expert, so every entry is current (no stale entries to skip).
    heap = [
        (x - threshold, g)
        for x, g in zip(order.ascending_load[:under], order.ascending[:under])
        if free[g] > 0
    ]
    # Slack on ranks with a free slot minus the pairs still to move: each move lowers both
    # alike, except that a rank's last slot strands the slack it leaves.
    margin = threshold * len(over) - sum([rank_load[g] for g in over]) - sum([s for s, _ in heap])
    if margin < 0:
        return None
    pop, push = heapq.heappop, heapq.heappush
    moves: list[tuple[int, int, int]] = []
    for r in over:
        need = rank_load[r] - threshold
        for e in experts_hot_first[r]:
            left = expert_load[e]
            used: list[tuple[int, int]] = []  # (slack, rank) of this expert's targets
            while left and heap:
                room, g = pop(heap)
                room = -room
                amount = need if need < left else left
                if room < amount:
                    amount = room
                moves.append((e, g, amount))
                room -= amount
                free[g] -= 1
                need -= amount
                left -= amount
                if not free[g]:
                    margin -= room
                    if margin < 0:
                        return None
                elif room:
                    used.append((-room, g))  # eligible again after this expert
                if not need:
                    break
            for entry in used:
                push(heap, entry)
            if not need:
                break
            if not heap:
                return None
        if need:
            return None
    return moves


def reference_threshold_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """The slow, obvious :func:`threshold_greedy` (runs every over rank to the end; tests
    compare the two)."""
    num_ranks = len(rank_load)
    slack = [max(threshold - x, 0) for x in rank_load]
    free = list(slots)
    over = sorted(
        (g for g in range(num_ranks) if rank_load[g] > threshold),
        key=lambda g: (threshold - rank_load[g], g),
    )
    if not over:
        return []
    if sum(rank_load[g] - threshold for g in over) > sum(slack):
        return None
    # Max-heap on slack (ties: lower rank); one live entry per rank, stale ones are skipped.
    heap = [(-slack[g], g) for g in range(num_ranks) if slack[g] > 0 and free[g] > 0]
    heapq.heapify(heap)
    moves: list[tuple[int, int, int]] = []
    for r in over:
        need = rank_load[r] - threshold
        for e in experts_hot_first[r]:
            if need == 0:
                break
            left = expert_load[e]
            used: list[int] = []  # targets of this expert: not eligible for it again
            while need > 0 and left > 0:
                while heap and (-heap[0][0] != slack[heap[0][1]] or free[heap[0][1]] == 0):
                    heapq.heappop(heap)
                if not heap:
                    break
                _, g = heapq.heappop(heap)
                amount = min(need, left, slack[g])
                moves.append((e, g, amount))
                slack[g] -= amount
                free[g] -= 1
                need -= amount
                left -= amount
                used.append(g)
            for g in used:
                if slack[g] > 0 and free[g] > 0:
                    heapq.heappush(heap, (-slack[g], g))
            if not heap and need > 0:
                return None
        if need > 0:
            return None
    return moves


def _slots_at(slots: Slots, threshold: int, num_ranks: int) -> list[int]:
    if callable(slots):
        return [int(s) for s in slots(threshold)]
    if isinstance(slots, int):
        return [slots] * num_ranks
    return [int(s) for s in slots]


def place_replicas(
    expert_load: np.ndarray,
    num_ranks: int,
    slots: Slots,
    tolerance: float = 0.0,
) -> Placement:
    """Threshold search + greedy: replicas for this call's loads (see the module docstring).

    Args:
        expert_load: ``[E]`` int64 pairs per expert, E divisible by ``num_ranks``.
        num_ranks: P.
        slots: Replicas per rank: an int for every rank, a ``[P]`` sequence, or a function of the
            threshold T returning one (the controller's memory budget makes slots depend on T).
        tolerance: Stop bisecting once the bracket is within ``max(1, tolerance * T)``; 0 finds
            the smallest T the greedy reaches to the unit.

    Returns:
        The placement; no replicas when none lower the peak.
    """
    num_experts = int(expert_load.shape[0])
    local = num_experts // max(num_ranks, 1)
    empty = np.zeros(0, dtype=np.int64)
    by_rank = expert_load.reshape(max(num_ranks, 1), local)
    rank_load = by_rank.sum(1).tolist()
    top = max(rank_load, default=0)
    total = sum(rank_load)
    low = max(-(-total // max(num_ranks, 1)), int((-(-expert_load // num_ranks)).max(initial=0)))
    if num_ranks <= 1 or top <= low:
        return Placement(top, empty, empty, empty, 0)
    loads = expert_load.tolist()
    # Owned experts hottest first (stable: ties to the lower id), as global ids.
    order = np.argsort(-by_rank, axis=1, kind="stable") + np.arange(num_ranks)[:, None] * local
    hot_first = order.tolist()
    rank_order = _RankOrder(rank_load)
    runs = 0

    def attempt(threshold: int) -> Optional[list[tuple[int, int, int]]]:
        nonlocal runs
        runs += 1
        room = _slots_at(slots, threshold, num_ranks)
        if not any(room):
            return None
        return _greedy(loads, rank_load, hot_first, threshold, room, rank_order)

    best_t, best = top, []
    moves = attempt(low)
    if moves is not None:
        best_t, best = low, moves
    else:
        # Gallop up from the lower bound, then bisect the last bracket.
        bad, step = low, max(1, int(tolerance * low), low >> 10)
        while True:
            trial = bad + step
            if trial >= top:
                break
            moves = attempt(trial)
            if moves is not None:
                best_t, best = trial, moves
                break
            bad, step = trial, step * 2
        while best_t - bad > max(1, int(tolerance * best_t)):
            trial = (bad + best_t) // 2
            moves = attempt(trial)
            if moves is None:
                bad = trial
            else:
                best_t, best = trial, moves
    if not best:
        return Placement(top, empty, empty, empty, runs)
    arr = np.fromiter(itertools.chain.from_iterable(best), np.int64, 3 * len(best)).reshape(-1, 3)
    order = np.lexsort((arr[:, 1], arr[:, 0]))
    arr = arr[order]
    return Placement(best_t, arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy(), runs)


def reference_optimal_peak(load: Sequence[int], num_ranks: int, slots: int) -> int:
    """The exact optimum that :func:`place_replicas` approximates, by brute force (tiny cases).

    Every placement of at most ``slots`` replicas per rank (rank r owns experts
    ``[r*L, (r+1)*L)``); for each, the exact min-max peak of assigning every expert's load over
    its holders, by min-cut duality: the largest, over rank sets R, of ``ceil(load of the experts
    held only inside R / |R|)``. The slow, obvious reference the tests and the planner benchmark
    compare the placement with.

    Args:
        load: ``[E]`` pairs per expert.
        num_ranks: P; ``E`` must be a multiple of it.
        slots: Replicas one rank may hold.

    Returns:
        The smallest achievable peak per-rank load.
    """
    import itertools

    num_experts = len(load)
    local = num_experts // num_ranks
    choices = []
    for rank in range(num_ranks):
        others = [e for e in range(num_experts) if e // local != rank]
        options: list[tuple[int, ...]] = [()]
        for k in range(1, slots + 1):
            options += list(itertools.combinations(others, k))
        choices.append(options)
    best: Optional[int] = None
    for pick in itertools.product(*choices):
        holders = [{e // local} for e in range(num_experts)]
        for rank, experts in enumerate(pick):
            for e in experts:
                holders[e].add(rank)
        peak = 0
        for mask in range(1, 1 << num_ranks):
            inside = {r for r in range(num_ranks) if mask >> r & 1}
            confined = sum(x for x, h in zip(load, holders) if h <= inside)
            peak = max(peak, -(-confined // len(inside)))
        best = peak if best is None else min(best, peak)
    return int(best or 0)
