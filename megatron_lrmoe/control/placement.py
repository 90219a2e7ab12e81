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
the slack left on ranks with a free slot. :func:`best_fit_greedy` walks the same way but sends
each move to the rank with the least slack that takes all it could carry (else the most slack): it
strands less slack on ranks whose last slot a move does not fill, so it usually reaches a lower T,
though not always. T is feasible when either greedy succeeds (best fit first).
:func:`place_replicas` searches the smallest feasible T: it starts at the lower bound
``max(ceil(total / P), max_e ceil(W[e] / P))``, gallops up in doubling steps and bisects back
(every T it returns was verified, so the search is correct even where the greedy is not monotone
in T). The greedy's own split of pairs is only a starting point: the controller then computes the
exact min-max assignment over the chosen replicas.

The greedy never gives a replica to a rank at or above T, so it misses chains (rank A sheds to B
while B sheds to C) and, on small layers, can end well above the optimum. On layers with
``E * P <= IMPROVE_MAX_PAIRS`` a local search (:func:`_improve`) then adds or exchanges one
replica at a time, each change accepted only when it lowers the exact peak, or the pairs that
keep it from the next lower peak (a max-flow, :class:`_Excess`), within the slots at the
greedy's threshold. Its result, with its exact min-max split, replaces the greedy's only where
that peak is below the greedy split's, so the placement never gets worse.

The slow, obvious twins of the two greedies and of the local search, and the brute-force optimum
the placement is measured against, are in ``reference.py`` (tests compare them).

Deterministic: ties go to the lower rank, then the lower expert id. Everything is host integers.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from megatron_lrmoe.control import native
from megatron_lrmoe.control.slots import Slots

__all__ = [
    "Placement",
    "best_fit_greedy",
    "place_replicas",
    "threshold_greedy",
]


@dataclass(frozen=True)
class Placement:
    """Replicas chosen for one call and the greedy's split of pairs.

    Attributes:
        threshold: The peak load of this split: the smallest T (within the search's tolerance)
            at which the greedy succeeded, or the lower exact peak the local search reached.
        moves: ``(expert, rank, pairs)`` of every replica, sorted by (expert, rank); the rank
            is never the expert's owner, the pairs (all positive) are the greedy's split, or
            after a local search that paid the exact min-max split over its replicas. Host
            ints: the controller reads them in Python (a few dozen entries).
        greedy_runs: How many greedy runs the search made, both kinds (planner cost
            diagnostics).
        changes: Replicas the local search after the greedy added or dropped (0: the greedy's
            placement as it was).
        replica_expert, replica_rank, replica_pairs: (properties) ``[M]`` int64 columns of
            ``moves``.
    """

    threshold: int
    moves: tuple[tuple[int, int, int], ...]
    greedy_runs: int
    changes: int = 0

    def _column(self, j: int) -> np.ndarray:
        return np.array([move[j] for move in self.moves], dtype=np.int64)

    @property
    def replica_expert(self) -> np.ndarray:
        return self._column(0)

    @property
    def replica_rank(self) -> np.ndarray:
        return self._column(1)

    @property
    def replica_pairs(self) -> np.ndarray:
        return self._column(2)


def threshold_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """Moves pairs off the ranks above ``threshold`` into replicas on ranks below it.

    The same moves as ``reference.reference_threshold_greedy``, sooner when it fails: the search
    runs the greedy four to six times per call, and a failing run rarely fails before its last
    over rank. This one stops as soon as the pairs still to move exceed the slack left on ranks
    with a free slot (slack on a rank without slots is stranded: no later move can use it).

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
    run takes the ranks above T from the front of one and those below T from the other.

    A rank below T enters the greedy's heap as the single integer ``load << bits | rank``
    (``2**bits >= P``): the least load (the most slack below any T) first, ties to the lower
    rank, whatever T is; an integer compares faster than a tuple, and a move of ``a`` pairs to
    the rank adds ``a << bits`` to its key.
    """

    def __init__(self, rank_load: Sequence[int]) -> None:
        # Host ints and two list sorts: for P up to a few hundred cheaper than numpy's calls.
        self.num_ranks = num_ranks = len(rank_load)
        self.total = sum(rank_load)
        self.bits = bits = max(num_ranks - 1, 1).bit_length()
        # Bisecting ``T << bits`` in ``ascending_key`` finds the first rank with load >= T;
        # bisecting ``-T << bits`` in ``descending_key`` (keys of (-load, rank)) the first with
        # load <= T. Keys are distinct: any sort is stable.
        self.ascending_key: list[int] = sorted([x << bits | g for g, x in enumerate(rank_load)])
        self.descending_key: list[int] = sorted(
            [(-x << bits) | g for g, x in enumerate(rank_load)]
        )
        mask = (1 << bits) - 1
        self.descending: list[int] = [key & mask for key in self.descending_key]


def _greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
    order: _RankOrder,
) -> Optional[list[tuple[int, int, int]]]:
    """:func:`threshold_greedy` with the rank orders precomputed."""
    over = order.descending[: bisect.bisect_left(order.descending_key, -threshold << order.bits)]
    if not over:
        return []
    free = list(slots)
    under = bisect.bisect_left(order.ascending_key, threshold << order.bits)
    bits = order.bits
    mask = (1 << bits) - 1
    # Min-heap of load << bits | rank (see _RankOrder): the most slack first, ties to the lower
    # rank; the ranks below T in that order are already a heap. A rank leaves it when it takes
    # a move and comes back after the current expert, so every entry is current.
    # Slack on ranks with a free slot minus the pairs still to move: each move lowers both
    # alike, except that a rank's last slot strands the slack it leaves. Over all ranks, slack
    # minus excess is P * T - total.
    margin = order.num_ranks * threshold - order.total
    if 0 in free:
        heap = []
        for key in order.ascending_key[:under]:
            if free[key & mask]:
                heap.append(key)
            else:
                margin -= threshold - (key >> bits)  # stranded: no slot to use it
    else:
        heap = order.ascending_key[:under]
    if margin < 0:
        return None
    pop, push = heapq.heappop, heapq.heappush
    moves: list[tuple[int, int, int]] = []
    for r in over:
        need = rank_load[r] - threshold
        for e in experts_hot_first[r]:
            left = expert_load[e]
            used: list[int] = []  # heap keys of this expert's targets
            while left and heap:
                key = pop(heap)
                g = key & mask
                room = threshold - (key >> bits)
                amount = need if need < left else left
                if room < amount:
                    amount = room
                moves.append((e, g, amount))
                free[g] -= 1
                need -= amount
                left -= amount
                if not free[g]:
                    margin -= room - amount
                    if margin < 0:
                        return None
                elif room > amount:
                    used.append(key + (amount << bits))  # eligible again after this expert
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


def best_fit_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """:func:`threshold_greedy` with best-fit targets: the same walk over the ranks above
    ``threshold`` and their experts, but each move goes to the rank with the least slack that
    takes all the pairs it could carry (``min(excess left, expert's pairs left)``), else (none
    does) to the rank with the most slack; ties to the lower rank.

    Why: the greedy fails when the slack it strands exceeds the margin ``P * T - total`` (a rank
    whose last slot takes a move that does not fill it strands the rest). Most-slack-first puts
    the small end of an excess or an expert on the emptiest rank and strands much of it; best
    fit puts it where it fills a gap. On Zipf loads at EP 64 it succeeds up to 250 pairs below
    the most-slack greedy, but not always: :func:`place_replicas` tries this one first and the
    most-slack greedy where it fails. ``reference.reference_best_fit_greedy`` is the slow twin.

    Args and returns: as :func:`threshold_greedy`.
    """
    order = _RankOrder(rank_load)
    return _best_fit(expert_load, rank_load, experts_hot_first, threshold, slots, order)


def _best_fit(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
    order: _RankOrder,
) -> Optional[list[tuple[int, int, int]]]:
    """:func:`best_fit_greedy` with the rank orders precomputed."""
    over = order.descending[: bisect.bisect_left(order.descending_key, -threshold << order.bits)]
    if not over:
        return []
    free = list(slots)
    bits = order.bits
    mask = (1 << bits) - 1
    # Ranks below T as slack << bits | rank, ascending (least slack first, ties to the lower
    # rank): ``T << bits`` plus the (-load, rank) keys of ``descending_key`` past the ranks at or
    # above T. The list stays sorted; a target leaves it for the current expert's moves.
    shift = threshold << bits
    first = bisect.bisect_left(order.descending_key, (1 - threshold) << bits)  # load < T
    margin = order.num_ranks * threshold - order.total  # as in _greedy
    if 0 in free:
        avail = []
        for key in order.descending_key[first:]:
            if free[key & mask]:
                avail.append(shift + key)
            else:
                margin -= (shift + key) >> bits  # stranded: no slot to use it
    else:
        avail = [shift + key for key in order.descending_key[first:]]
    if margin < 0:
        return None
    find, insort = bisect.bisect_left, bisect.insort
    moves: list[tuple[int, int, int]] = []
    for r in over:
        need = rank_load[r] - threshold
        for e in experts_hot_first[r]:
            left = expert_load[e]
            used: list[int] = []  # keys of this expert's targets
            while left and avail:
                want = need if need < left else left
                i = find(avail, want << bits)  # least slack >= want, lowest rank
                if i == len(avail):  # none takes it all: the most slack, lowest rank
                    i = find(avail, avail[-1] >> bits << bits)
                key = avail.pop(i)
                g = key & mask
                room = key >> bits
                amount = want if want < room else room
                moves.append((e, g, amount))
                free[g] -= 1
                need -= amount
                left -= amount
                if not free[g]:
                    margin -= room - amount
                    if margin < 0:
                        return None
                elif room > amount:
                    used.append(key - (amount << bits))  # eligible again after this expert
                if not need:
                    break
            for entry in used:
                insort(avail, entry)
            if not need:
                break
            if not avail:
                return None
        if need:
            return None
    return moves


# The local search after the greedy runs only when E * P is at most this. Its neighbourhood (one
# replica added or exchanged) grows as E * P and its max-flows, in Python, as P: at EP 16 with 16
# experts it already costs about 1 ms a call (4x the plan) for a forward peak about 1 % lower,
# and at EP 64 the greedy is within 1 % of the lower bound (docs/control.md, "Cost and quality").
IMPROVE_MAX_PAIRS = 128
# At most this many accepted changes per call (each lowers (peak, excess); a guard).
IMPROVE_MAX_ROUNDS = 32


# ``place_replicas``' default ``lib``: ask native.library() (the controller passes its own).
_LIBRARY = object()


class _Excess:
    """The pairs above a level T that no assignment over a replica set avoids (a max-flow).

    Holds one assignment of every replicated expert's pairs over its holders (owner first, the
    replicas ascending) and moves pairs along augmenting paths (rank -> expert with pairs there
    -> another holder of it) from ranks above T to ranks below it. When no path is left, the
    ranks the search reached form the cut R that maximises ``load(R) - T |R|`` over rank sets
    (load(R): experts held only inside R), the smallest such set; what is still above T is
    ``max(0, that maximum)``, the same for every assignment. Visiting orders are fixed (lower
    rank, lower expert), so everything is a pure function of the inputs.
    """

    def __init__(
        self,
        loads: Sequence[int],
        num_ranks: int,
        replicas: Sequence[tuple[int, int]],
        start: Sequence[tuple[int, int, int]] = (),
    ):
        """Every expert's pairs on its owner, then ``start``'s moves ``(expert, rank, pairs)``
        to the replicas among them (a warm start: the greedy's split needs few paths)."""
        self.loads = loads
        self.local = len(loads) // num_ranks
        self.load = [sum(loads[g * self.local : (g + 1) * self.local]) for g in range(num_ranks)]
        self.split: dict[int, dict[int, int]] = {}  # replicated expert -> {holder: pairs}
        for e, g in replicas:
            self.add(e, g)
        for e, g, amount in start:
            if g in self.split.get(e, ()):
                self.split[e][g] += amount
                self.split[e][e // self.local] -= amount
                self.load[g] += amount
                self.load[e // self.local] -= amount

    def copy(self) -> "_Excess":
        new = object.__new__(_Excess)
        new.loads, new.local, new.load = self.loads, self.local, list(self.load)
        new.split = {e: dict(row) for e, row in self.split.items()}
        return new

    def add(self, expert: int, rank: int) -> None:
        """Makes ``rank`` a holder of ``expert`` (with no pairs yet)."""
        if expert not in self.split:
            self.split[expert] = {expert // self.local: self.loads[expert]}
        self.split[expert][rank] = 0

    def remove(self, expert: int, rank: int) -> None:
        """Drops the replica of ``expert`` on ``rank``; its pairs go back to the owner."""
        row = self.split[expert]
        owner = expert // self.local
        amount = row.pop(rank)
        row[owner] += amount
        self.load[rank] -= amount
        self.load[owner] += amount
        if len(row) == 1:
            del self.split[expert]

    def excess(self, level: int) -> tuple[int, list[int]]:
        """Moves pairs until no augmenting path is left.

        Returns:
            The pairs still above ``level`` (0: the replica set reaches a peak of ``level``) and
            the cut R (ascending ranks; empty when nothing is above).
        """
        load, split = self.load, self.split
        num_ranks = len(load)
        at_rank: list[list[int]] = [[] for _ in range(num_ranks)]
        for e in sorted(split):
            for g in split[e]:
                at_rank[g].append(e)
        while True:
            over = [g for g in range(num_ranks) if load[g] > level]
            if not over:
                return 0, []
            # Breadth first from every rank above the level; parent[h] = (rank, expert) it came
            # from (None for a start).
            parent: dict[int, Optional[tuple[int, int]]] = {g: None for g in over}
            queue = deque(over)
            sink = -1
            while queue and sink < 0:
                g = queue.popleft()
                for e in at_rank[g]:
                    if split[e][g] == 0:
                        continue
                    for h in sorted(split[e]):
                        if h in parent:
                            continue
                        parent[h] = (g, e)
                        if load[h] < level:
                            sink = h
                            break
                        queue.append(h)
                    if sink >= 0:
                        break
            if sink < 0:
                cut = sorted(parent)
                return sum(load[g] - level for g in over), cut
            path = []  # (from rank, expert, to rank), sink first
            start = sink
            while (step := parent[start]) is not None:
                path.append((step[0], step[1], start))
                start = step[0]
            room = level - load[sink]
            amount = min(load[start] - level, room, *(split[e][g] for g, e, _ in path))
            for g, e, h in path:
                split[e][g] -= amount
                split[e][h] += amount
            load[start] -= amount  # ranks inside the path keep their load
            load[sink] += amount

    def feeders(self, level: int) -> list[bool]:
        """``[P]`` whether each rank is below ``level`` or can pass pairs on to one that is (an
        expert with pairs on it has another holder that is a feeder)."""
        load, split = self.load, self.split
        num_ranks = len(load)
        at_rank: list[list[int]] = [[] for _ in range(num_ranks)]
        for e, row in split.items():
            for g in row:
                at_rank[g].append(e)
        useful = [x < level for x in load]
        queue = deque(g for g in range(num_ranks) if useful[g])
        while queue:
            h = queue.popleft()
            for e in at_rank[h]:
                for g, amount in split[e].items():
                    if amount and not useful[g]:
                        useful[g] = True
                        queue.append(g)
        return useful

    def peak(self, low: int) -> int:
        """The exact min-max peak of this replica set (at least ``low``, a lower bound)."""
        level = low
        while True:
            excess, cut = self.excess(level)
            if not excess:
                return level
            # Nothing leaves the cut: every assignment puts sum(load[cut]) on it.
            confined = sum(self.load[g] for g in cut)
            level = max(level + 1, -(-confined // len(cut)))


def _improve(
    loads: Sequence[int],
    num_ranks: int,
    slots: Sequence[int],
    moves: Sequence[tuple[int, int, int]],
    low: int,
    stop: int,
) -> tuple[int, list[tuple[int, int]]]:
    """Local search from the greedy's moves ``(expert, rank, pairs)`` (its replicas; its split
    only warm-starts the flows): the first single change that pays, while one does.

    The objective, lowest first: the exact peak K of the replica set, then the pairs that stay
    above K - 1 (how far the set is from the next lower peak; without it no single change helps
    when several ranks share the peak). A round tries, in this order, adding a replica of expert
    e on rank g where g has a free slot (experts hottest first, then ranks by fixed-ownership
    load, lowest first; ties to the lower id), then exchanging one of g's replicas for e where g
    is full (the same order, dropped replica ascending; the peak must not rise), and takes the
    first change that lowers the excess above K - 1. It stops when none does, once the peak is
    at most ``stop`` (``low``, the lower bound, plus the caller's tolerance), or after
    :data:`IMPROVE_MAX_ROUNDS` changes. This finds the chains the greedy
    misses (rank A sheds to B while B sheds to C): the greedy never gives a replica to a rank at
    or above its threshold.

    Only changes that give an expert held only inside the cut R of :meth:`_Excess.excess` at
    ``K - 1`` a holder outside R are tried: every other change leaves ``load(R) - (K - 1) |R|``
    where it is, so it cannot lower the excess (``reference.reference_improve`` tries them all).

    Returns:
        The peak reached and the replicas ``(expert, rank)``, sorted.
    """
    local = len(loads) // num_ranks
    hot_first = sorted((e for e in range(len(loads)) if loads[e]), key=lambda e: (-loads[e], e))
    fixed = [sum(loads[g * local : (g + 1) * local]) for g in range(num_ranks)]
    coolest = sorted(range(num_ranks), key=lambda g: (fixed[g], g))
    replicas = sorted((e, g) for e, g, _ in moves)
    state = _Excess(loads, num_ranks, replicas, moves)
    held = set(replicas)
    peak = state.peak(low)
    for _ in range(IMPROVE_MAX_ROUNDS):
        if peak <= stop:
            break
        excess, cut = state.excess(peak - 1)
        inside = set(cut)
        confined = [
            e for e in hot_first if all(g in inside for g in state.split.get(e, (e // local,)))
        ]
        # Adding a replica of a confined expert on rank g lowers the excess exactly when g can
        # pass pairs on to a rank below the level (its pairs can then leave the cut through g),
        # so adds need no trial flow; exchanges do (the dropped pairs go back to their owner).
        useful = state.feeders(peak - 1)
        full = [sum(h == g for _, h in held) >= slots[g] for g in range(num_ranks)]
        found = None
        target = next((g for g in coolest if useful[g] and not full[g]), None)
        if confined and target is not None:
            trial = state.copy()
            trial.add(confined[0], target)
            found = (trial.excess(peak - 1)[0], trial, (confined[0], target), None)
        for e, g in itertools.product(confined if found is None else (), coolest):
            if g in inside or not full[g]:
                continue
            for drop in sorted(f for f, h in held if h == g):
                trial = state.copy()
                trial.remove(drop, g)
                trial.add(e, g)
                score = trial.excess(peak - 1)[0]
                if score < excess and not trial.excess(peak)[0]:
                    found = (score, trial, (e, g), drop)
                    break
            if found:
                break
        if found is None:
            break
        score, state, move, drop = found
        held.discard((drop, move[1]))
        held.add(move)
        if not score:
            peak = state.peak(low)
    return peak, sorted(held)


def _slots_at(slots: Slots, threshold: int, num_ranks: int) -> list[int]:
    if callable(slots):
        room = slots(threshold)
        # The controller's slots come as a list of host ints already.
        return room if type(room) is list else [int(s) for s in room]
    if isinstance(slots, int):
        return [slots] * num_ranks
    return [int(s) for s in slots]


def place_replicas(
    expert_load: np.ndarray,
    num_ranks: int,
    slots: Slots,
    tolerance: float = 0.0,
    *,
    lib: Any = _LIBRARY,
) -> Placement:
    """Threshold search + greedy: replicas for this call's loads (see the module docstring).

    Args:
        expert_load: ``[E]`` int64 pairs per expert, E divisible by ``num_ranks``.
        num_ranks: P.
        slots: Replicas per rank: an int for every rank, a ``[P]`` sequence, or a function of the
            threshold T returning one (the controller's memory budget makes slots depend on T).
        tolerance: Stop bisecting once the bracket is within ``max(1, tolerance * T)``; 0 finds
            the smallest T the greedy reaches to the unit. The local search after the greedy
            stops within ``tolerance`` of the lower bound.
        lib: The compiled library for the threshold search (native.py), ``None`` for the
            Python search (same result); by default :func:`native.library`'s answer.

    Returns:
        The placement; no replicas when none lower the peak.
    """
    num_experts = int(expert_load.shape[0])
    local = num_experts // max(num_ranks, 1)
    by_rank = expert_load.reshape(max(num_ranks, 1), local)
    rank_array = by_rank.sum(1)
    rank_load = rank_array.tolist()
    top = max(rank_load, default=0)
    total = sum(rank_load)
    hottest = int(expert_load.max(initial=0))
    low = max(-(-total // max(num_ranks, 1)), -(-hottest // max(num_ranks, 1)))
    if num_ranks <= 1 or top <= low:
        return Placement(top, (), 0)
    if lib is _LIBRARY:
        lib = native.library()
    rule = None if lib is None else native.slot_rule(slots, num_ranks)
    if rule is not None:  # the same search in C (native.py)
        best_t, best, runs = native.place_search(lib, expert_load, num_ranks, rule, tolerance)
    else:
        loads = expert_load.tolist()
        best_t, best, runs = _search(loads, rank_load, by_rank, low, top, slots, tolerance)
    changes = 0
    if num_ranks * num_experts <= IMPROVE_MAX_PAIRS:
        loads = expert_load.tolist()
        stop = low + int(tolerance * low)
        best_t, best, changes = _polish(loads, num_ranks, rank_load, best_t, best, slots, low, stop)
    if not best:
        return Placement(top, (), runs)
    # At most one move per (expert, rank): sorting the tuples sorts by (expert, rank).
    return Placement(best_t, tuple(sorted(best)), runs, changes)


def _search(
    loads: list[int],
    rank_load: list[int],
    by_rank: np.ndarray,
    low: int,
    top: int,
    slots: Slots,
    tolerance: float,
) -> tuple[int, list[tuple[int, int, int]], int]:
    """:func:`place_replicas`'s threshold search (``top > low``): ``(best T, its moves in the
    order made, greedy runs)``, ``(top, [], runs)`` when no T below ``top`` succeeds."""
    num_ranks, local = by_rank.shape
    # Owned experts hottest first (stable: ties to the lower id), as global ids.
    order = np.argsort(-by_rank, axis=1, kind="stable")
    order += np.arange(0, num_ranks * local, local)[:, None]
    hot_first = order.tolist()
    rank_order = _RankOrder(rank_load)
    runs = 0

    def attempt(threshold: int) -> Optional[list[tuple[int, int, int]]]:
        nonlocal runs
        runs += 1
        room = _slots_at(slots, threshold, num_ranks)
        if not any(room):
            return None
        # Best fit first; the most-slack greedy where it fails (T is feasible when either
        # succeeds; the pair fails at fewer T than either alone).
        moves = _best_fit(loads, rank_load, hot_first, threshold, room, rank_order)
        if moves is None:
            runs += 1
            moves = _greedy(loads, rank_load, hot_first, threshold, room, rank_order)
        return moves

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
    return best_t, best, runs


def _polish(
    loads: list[int],
    num_ranks: int,
    rank_load: list[int],
    threshold: int,
    moves: list[tuple[int, int, int]],
    slots: Slots,
    low: int,
    stop: int,
) -> tuple[int, list[tuple[int, int, int]], int]:
    """The local search (:func:`_improve`) from the greedy's replicas, within the slots at the
    greedy's threshold; kept only where its exact split's peak is below the greedy's own split.
    Nothing to do where the greedy's split is within ``stop`` (the lower bound ``low`` plus the
    search's tolerance).

    Every rank stays at or below the greedy's threshold, so slots that shrink as T grows (the
    controller's memory budget) still hold.

    Returns:
        ``(peak bound, moves (expert, rank, pairs), changes made)``: the inputs when the search
        gains nothing.
    """
    load = list(rank_load)
    local = len(loads) // num_ranks
    for e, g, amount in moves:
        load[e // local] -= amount
        load[g] += amount
    greedy_peak = max(load)
    room = _slots_at(slots, threshold, num_ranks)
    if greedy_peak <= stop or not any(room):
        return threshold, moves, 0
    peak, replicas = _improve(loads, num_ranks, room, moves, low, stop)
    if peak >= greedy_peak:
        return threshold, moves, 0
    # The split from the greedy's (not the search's last state): the same whichever search ran.
    split = _Excess(loads, num_ranks, replicas, moves)
    split.excess(peak)
    result = [
        (e, g, amount)
        for e, row in sorted(split.split.items())
        for g, amount in sorted(row.items())
        if g != e // local and amount > 0
    ]
    return peak, result, len(set(replicas) ^ {(e, g) for e, g, _ in moves})
