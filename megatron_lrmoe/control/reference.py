"""The slow, obvious references of the control stage's algorithms, one per algorithm.

Shapes: E experts, P ranks, L = E / P experts owned per rank (rank r owns ``[r*L, (r+1)*L)``).

The production modules (``placement.py``, ``balance.py``) hold the fast algorithms the controller
runs; each reference here solves the same problem in the plainest way, and a test compares the
two (the production modules never import this one):

* :func:`reference_threshold_greedy` and :func:`reference_best_fit_greedy`: the two greedies of
  the placement search (``placement.threshold_greedy``, ``placement.best_fit_greedy``), run
  without their shortcuts (every over rank to the end, targets by a heap or a scan). The same
  moves, or None at the same thresholds: ``tests/test_control_fast_paths.py``
  (``test_threshold_greedy_matches_reference``, and whole placements and plans with both greedies
  swapped for these).
* :func:`reference_improve`: the placement's local search (``placement._improve``), every change
  tried and scored from scratch by the rank-set formula. The same peak and replicas:
  ``tests/test_control_fast_paths.py`` (``test_improve_matches_reference``,
  ``test_place_replicas_same_with_the_reference_search``).
* :func:`reference_optimal_peak`: the optimum ``placement.place_replicas`` approximates, by brute
  force over every placement (tiny cases). ``tests/test_control_placement.py`` checks that the
  placement reaches it; ``benchmarks/replica_bench.py`` and ``benchmarks/planner_bench.py`` report
  the gap to it.
* :func:`reference_min_max_balance`: the exact min-max assignment of expert loads over their
  holders (``balance.min_max_balance`` / ``balance.min_max_lists`` / ``balance.HolderGraph``) by
  Dinic max-flow and a cut-driven search on the peak. Against brute force in
  ``tests/test_planner.py`` and ``tests/test_control_balance.py``, against the fast solver in
  ``tests/test_control_balance.py``; ``tests/test_control_placement.py`` and
  ``tests/test_control_controller.py`` use it to check that plans carry the optimal assignment.

Everything is host integers and deterministic (the same tie-breaks as the fast versions).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Optional, Sequence

import torch

from megatron_lrmoe.control.balance import _balance_inputs, _capacity_inputs, _level
from megatron_lrmoe.control.placement import IMPROVE_MAX_ROUNDS

__all__ = [
    "reference_best_fit_greedy",
    "reference_improve",
    "reference_min_max_balance",
    "reference_optimal_peak",
    "reference_threshold_greedy",
]

# --------------------------------------------------------------------------------------------- #
# Replica placement (placement.py)
# --------------------------------------------------------------------------------------------- #


def reference_threshold_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """The slow, obvious ``placement.threshold_greedy`` (runs every over rank to the end; tests
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


def reference_best_fit_greedy(
    expert_load: Sequence[int],
    rank_load: Sequence[int],
    experts_hot_first: Sequence[Sequence[int]],
    threshold: int,
    slots: Sequence[int],
) -> Optional[list[tuple[int, int, int]]]:
    """The slow, obvious ``placement.best_fit_greedy`` (every target chosen by a scan over the
    ranks, every over rank run to the end; tests compare the two)."""
    num_ranks = len(rank_load)
    slack = [max(threshold - x, 0) for x in rank_load]
    free = list(slots)
    over = sorted(
        (g for g in range(num_ranks) if rank_load[g] > threshold),
        key=lambda g: (threshold - rank_load[g], g),
    )
    if not over:
        return []
    if sum(rank_load[g] - threshold for g in over) > sum(
        slack[g] for g in range(num_ranks) if free[g] > 0
    ):
        return None
    moves: list[tuple[int, int, int]] = []
    for r in over:
        need = rank_load[r] - threshold
        for e in experts_hot_first[r]:
            if need == 0:
                break
            left = expert_load[e]
            used: set[int] = set()  # targets of this expert: not eligible for it again
            while need > 0 and left > 0:
                targets = [
                    g
                    for g in range(num_ranks)
                    if slack[g] > 0 and free[g] > 0 and g not in used
                ]
                if not targets:
                    break
                want = min(need, left)
                fits = [g for g in targets if slack[g] >= want]
                if fits:
                    g = min(fits, key=lambda h: (slack[h], h))
                else:
                    g = min(targets, key=lambda h: (-slack[h], h))
                amount = min(want, slack[g])
                moves.append((e, g, amount))
                slack[g] -= amount
                free[g] -= 1
                need -= amount
                left -= amount
                used.add(g)
            if need > 0 and not any(
                slack[g] > 0 and free[g] > 0 for g in range(num_ranks)
            ):
                return None
        if need > 0:
            return None
    return moves


def reference_improve(
    loads: Sequence[int],
    num_ranks: int,
    slots: Sequence[int],
    moves: Sequence[tuple[int, int, int]],
    low: int,
    stop: int,
) -> tuple[int, list[tuple[int, int]]]:
    """The slow, obvious ``placement._improve``: every change tried, each scored from scratch by
    the rank-set formula (the excess above T is the largest ``load(R) - T |R|``, at least 0, over
    every rank set R; the peak the smallest T where it is 0). Tests compare the two."""
    local = len(loads) // num_ranks

    def excess(chosen: set[tuple[int, int]], level: int) -> int:
        holders = [{e // local} | {g for f, g in chosen if f == e} for e in range(len(loads))]
        worst = 0
        for mask in range(1, 1 << num_ranks):
            inside = {g for g in range(num_ranks) if mask >> g & 1}
            confined = sum(x for x, h in zip(loads, holders) if h <= inside)
            worst = max(worst, confined - level * len(inside))
        return worst

    def peak_of(chosen: set[tuple[int, int]]) -> int:
        holders = [{e // local} | {g for f, g in chosen if f == e} for e in range(len(loads))]
        level = low
        for mask in range(1, 1 << num_ranks):
            inside = {g for g in range(num_ranks) if mask >> g & 1}
            confined = sum(x for x, h in zip(loads, holders) if h <= inside)
            level = max(level, -(-confined // len(inside)))
        return level

    hot_first = sorted(range(len(loads)), key=lambda e: (-loads[e], e))
    fixed = [sum(loads[g * local : (g + 1) * local]) for g in range(num_ranks)]
    coolest = sorted(range(num_ranks), key=lambda g: (fixed[g], g))
    held = {(e, g) for e, g, _ in moves}
    peak = peak_of(held)
    for _ in range(IMPROVE_MAX_ROUNDS):
        if peak <= stop:
            break
        current = excess(held, peak - 1)
        full = [sum(h == g for _, h in held) >= slots[g] for g in range(num_ranks)]
        candidates = [
            (e, g) for e in hot_first for g in coolest if e // local != g and (e, g) not in held
        ]
        changes = [(held | {(e, g)}, None) for e, g in candidates if not full[g]] + [
            ((held - {(drop, g)}) | {(e, g)}, drop)
            for e, g in candidates
            if full[g]
            for drop in sorted(f for f, h in held if h == g)
        ]
        for trial, drop in changes:
            score = excess(trial, peak - 1)
            if score < current and (drop is None or not excess(trial, peak)):
                held = trial
                break
        else:
            break
        if not score:
            peak = peak_of(held)
    return peak, sorted(held)


def reference_optimal_peak(load: Sequence[int], num_ranks: int, slots: int) -> int:
    """The exact optimum that ``placement.place_replicas`` approximates, by brute force (tiny
    cases).

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


# --------------------------------------------------------------------------------------------- #
# Exact min-max assignment over replicas (balance.py)
# --------------------------------------------------------------------------------------------- #


class _MaxFlow:
    """Dinic's max-flow on host ints; capacities may be raised between calls (flow is kept)."""

    def __init__(self, num_nodes: int) -> None:
        self.head = [-1] * num_nodes
        self.to: list[int] = []
        self.cap: list[int] = []  # residual capacity; edge i ^ 1 is the reverse of edge i
        self.next: list[int] = []

    def add_edge(self, u: int, v: int, capacity: int) -> int:
        """Adds u -> v and returns the index of the forward edge."""
        for a, b, c in ((u, v, capacity), (v, u, 0)):
            self.to.append(b)
            self.cap.append(c)
            self.next.append(self.head[a])
            self.head[a] = len(self.to) - 1
        return len(self.to) - 2

    def levels(self, source: int) -> list[int]:
        """BFS distance from ``source`` in the residual graph (-1: unreachable)."""
        level = [-1] * len(self.head)
        level[source] = 0
        queue = deque([source])
        while queue:
            u = queue.popleft()
            e = self.head[u]
            while e != -1:
                v = self.to[e]
                if self.cap[e] > 0 and level[v] < 0:
                    level[v] = level[u] + 1
                    queue.append(v)
                e = self.next[e]
        return level

    def augment(self, source: int, sink: int) -> int:
        """Pushes as much extra flow as the residual graph allows; returns the amount."""
        to, cap, nxt = self.to, self.cap, self.next
        pushed = 0
        while True:
            level = self.levels(source)
            if level[sink] < 0:
                return pushed
            arc = list(self.head)  # current arc of every node (Dinic's pointer)
            path: list[int] = []
            u = source
            while True:
                if u == sink:
                    flow = min(cap[e] for e in path)
                    for e in path:
                        cap[e] -= flow
                        cap[e ^ 1] += flow
                    pushed += flow
                    path.clear()
                    u = source
                    continue
                e = arc[u]
                while e != -1 and not (cap[e] > 0 and level[to[e]] == level[u] + 1):
                    e = nxt[e]
                arc[u] = e
                if e != -1:
                    path.append(e)
                    u = to[e]
                elif u == source:
                    break  # blocking flow found for this level graph
                else:
                    # Dead end: retreat and retire the arc that led here.
                    back = path.pop()
                    u = to[back ^ 1]
                    arc[u] = nxt[arc[u]]


def reference_min_max_balance(
    load: torch.Tensor,
    admissible: torch.Tensor,
    base_load: torch.Tensor | None = None,
    *,
    rank_capacity: torch.Tensor | None = None,
    edge_capacity: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Exact min-max integer assignment of each expert's load over the ranks holding a copy.

    Minimises ``max_r (base_load[r] + sum_e A[e, r])`` subject to ``A.sum(1) == load``,
    ``A >= 0``, ``A[e, r] == 0`` where ``admissible[e, r]`` is False, and optionally
    ``A[e, r] <= edge_capacity[e, r]`` and ``base_load[r] + sum_e A[e, r] <= rank_capacity[r]``.

    Method: a search on the peak T with a max-flow feasibility check (source -> expert e with
    capacity ``load[e]``, expert -> admissible rank with capacity ``min(load[e], edge cap)``,
    rank r -> sink with capacity ``min(T, rank cap) - base_load[r]``). T starts at a lower bound;
    while the flow falls short, the minimum cut (the ranks R reachable from the source in the
    residual graph) proves that any feasible T must lift the sink capacities of R by the deficit,
    so T rises to the smallest value that does; if even unbounded T cannot (R all at their rank
    caps, or R empty because edge caps are full) there is no feasible assignment. Every T tried
    is a lower bound, so the first feasible one is the optimum. Without capacities there are at
    most P + 1 max-flow calls. Cost: Dinic in plain Python; at E = 512, P = 64 about 5-10 ms with a
    few replicas per expert and about 0.1 s when every rank may hold every expert (one CPU core).
    This is the slow, obvious reference; ``balance.min_max_balance`` is the fast exact solver.

    Args:
        load: ``[E]`` int kept pairs per expert.
        admissible: ``[E, P]`` bool; True where rank r holds expert e (owner or replica).
        base_load: ``[P]`` int load already on each rank (default 0).
        rank_capacity: ``[P]`` int most load rank r may carry, base included (default none).
        edge_capacity: ``[E, P]`` int most load of expert e rank r may take (default none).

    Returns:
        ``[E, P]`` int64 assignment on ``load``'s device, deterministic for given inputs; None
        when the capacities admit no assignment (never None without capacities).

    Raises:
        ValueError: malformed shapes, negative values, or an expert with no admissible rank.
    """
    loads, ranks, base = _balance_inputs(load, admissible, base_load)
    num_experts, num_ranks = len(loads), len(base)
    caps, edges = _capacity_inputs(rank_capacity, edge_capacity, num_experts, num_ranks)
    cap_of = caps if caps is not None else [None] * num_ranks
    if any(c is not None and b > c for b, c in zip(base, cap_of)):
        return None
    total = sum(loads)
    peak = max(max(base, default=0), -(-(total + sum(base)) // max(num_ranks, 1)))

    def sink_capacity(r: int, level: int) -> int:
        top = level if cap_of[r] is None else min(level, cap_of[r])
        return top - base[r]

    source, sink = num_experts + num_ranks, num_experts + num_ranks + 1
    graph = _MaxFlow(num_experts + num_ranks + 2)
    middle: list[tuple[int, int, int]] = []  # (expert, rank, forward edge)
    for e, allowed in enumerate(ranks):
        if loads[e] == 0:
            continue
        graph.add_edge(source, e, loads[e])
        for r in allowed:
            width = loads[e] if edges is None else min(loads[e], edges[e][r])
            middle.append((e, r, graph.add_edge(e, num_experts + r, width)))
    to_sink = [
        graph.add_edge(num_experts + r, sink, sink_capacity(r, peak)) for r in range(num_ranks)
    ]

    flow = 0
    while True:
        flow += graph.augment(source, sink)
        if flow == total:
            break
        reachable = graph.levels(source)
        cut = [r for r in range(num_ranks) if reachable[num_experts + r] >= 0]
        # Any feasible peak must give the cut's ranks the missing flow on top of what they hold.
        held = sum(sink_capacity(r, peak) + base[r] for r in cut)
        new_peak = _level([cap_of[r] for r in cut], held + total - flow) if cut else None
        if new_peak is None:
            return None
        assert new_peak > peak, "the cut bound must raise the peak"
        for r, edge in enumerate(to_sink):
            graph.cap[edge] += sink_capacity(r, new_peak) - sink_capacity(r, peak)
        peak = new_peak

    assignment = [[0] * num_ranks for _ in range(num_experts)]
    for e, r, edge in middle:
        width = loads[e] if edges is None else min(loads[e], edges[e][r])
        assignment[e][r] = width - graph.cap[edge]
    return torch.tensor(assignment, dtype=torch.int64, device=load.device).reshape(
        num_experts, num_ranks
    )
