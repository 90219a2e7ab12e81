"""Exact integer min-max assignment of expert loads over the ranks that hold the expert.

Shapes: E experts (or any load items), P ranks, S source ranks.

The problem: expert e has ``load[e]`` pairs and may be computed on the ranks where
``admissible[e, r]`` (its owner and the replicas placed for this call). Find integers
``A[e, r] >= 0`` with ``A.sum(1) == load``, zero where not admissible, optionally at most
``edge_capacity[e, r]`` (save mode: a holder can only run backward on pairs it computed in
forward) and ``base_load[r] + A.sum(0)[r] <= rank_capacity[r]`` (budgets), minimising the peak
``max_r base_load[r] + A.sum(0)[r]``.

The exact solver: warm-started augmenting paths between ranks, fast when the starting
assignment is close to optimal (the controller's case). :func:`min_max_lists` runs it on per-item
host lists, :class:`HolderGraph` on flat entries built once per call (the controller's hot path,
the same results bit for bit), :func:`min_max_balance` is its tensor front. Its slow, obvious
reference (Dinic max-flow with a cut-driven search on the peak) is
``reference.reference_min_max_balance``; tests compare the two and both with brute force.

:func:`caps_cut` answers the feasibility question alone (do the rank capacities admit any
assignment?) with the first phase of :func:`min_max_lists`, and names a cut of ranks when not.

Everything is host integers and deterministic (fixed visiting orders: lower expert, lower rank).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_lrmoe.control._checks import long_tensor

__all__ = [
    "HolderGraph",
    "caps_cut",
    "interval_split_np",
    "min_max_balance",
    "min_max_lists",
]


def _balance_inputs(
    load: torch.Tensor, admissible: torch.Tensor, base_load: torch.Tensor | None
) -> tuple[list[int], list[list[int]], list[int]]:
    """Validates and converts to host ints: loads, admissible ranks per expert, base loads."""
    load_t = long_tensor(load, "load", 1)
    if admissible.dim() != 2 or admissible.shape[0] != load_t.numel():
        raise ValueError(
            f"admissible must be [E, P] with E = {load_t.numel()}, got {tuple(admissible.shape)}"
        )
    adm = admissible.to(torch.bool).cpu()
    num_ranks = adm.shape[1]
    if base_load is None:
        base = [0] * num_ranks
    else:
        base_t = long_tensor(base_load, "base_load", 1)
        if base_t.numel() != num_ranks:
            raise ValueError(f"base_load has {base_t.numel()} ranks, admissible has {num_ranks}")
        base = base_t.cpu().tolist()
    ranks = [torch.nonzero(row).flatten().tolist() for row in adm]
    for e, allowed in enumerate(ranks):
        if not allowed:
            raise ValueError(f"expert {e} has no admissible rank")
    return load_t.cpu().tolist(), ranks, base


def _capacity_inputs(
    rank_capacity: torch.Tensor | None,
    edge_capacity: torch.Tensor | None,
    num_experts: int,
    num_ranks: int,
) -> tuple[Optional[list[int]], Optional[list[list[int]]]]:
    caps = None
    if rank_capacity is not None:
        cap_t = long_tensor(rank_capacity, "rank_capacity", 1)
        if cap_t.numel() != num_ranks:
            raise ValueError(f"rank_capacity has {cap_t.numel()} ranks, expected {num_ranks}")
        caps = cap_t.cpu().tolist()
    edges = None
    if edge_capacity is not None:
        edge_t = long_tensor(edge_capacity, "edge_capacity", 2)
        if tuple(edge_t.shape) != (num_experts, num_ranks):
            raise ValueError(
                f"edge_capacity must be [{num_experts}, {num_ranks}], got {tuple(edge_t.shape)}"
            )
        edges = edge_t.cpu().tolist()
    return caps, edges


def _level(caps: Sequence[int], total: int) -> Optional[int]:
    """Smallest integer T with ``sum_g min(T, caps[g]) >= total`` (None if ``sum(caps) < total``).

    ``caps`` may contain None for "no cap".
    """
    bounded = sorted(c for c in caps if c is not None)
    free = len(caps) - len(bounded)
    if free == 0 and sum(bounded) < total:
        return None
    prefix, count = 0, len(caps)
    # T in (bounded[k-1], bounded[k]]: the k smallest caps are full, the rest hold T each.
    for k in range(len(bounded) + 1):
        rest = count - k
        if rest > 0:
            level = max(-(-(total - prefix) // rest), 0)
            if k == len(bounded) or level <= bounded[k]:
                return max(level, bounded[k - 1] if k else 0)
        if k < len(bounded):
            prefix += bounded[k]
    return None


def _rebalance(
    load: list[int],
    x: list[list[int]],
    holders: list[list[int]],
    at_rank: list[list[tuple[int, int]]],
    limit: list[int],
    edge_cap: Optional[list[list[int]]],
) -> Optional[list[int]]:
    """Moves load from ranks over ``limit`` to ranks under it (in place), Dinic style.

    The residual graph is implicit in the assignment: rank g -> item i while i has pairs on g
    (``x[i][j] > 0``), item i -> rank h while h has room for i (edge cap, or unbounded). Each
    phase levels the graph by a breadth-first search from the over ranks and pushes a blocking
    flow by depth-first searches that stop at ranks under their limit; ranks on a path keep their
    load (pairs of one item in, of another out).

    Returns None on success, else the ranks R the search reached: none of them is under its
    limit, some are over, and no pair on R can leave R in any assignment (every item with pairs
    on R has its other holders in R or its edges to them full), so every assignment puts at
    least ``sum(load[R])`` on R.
    """
    num_ranks, num_items = len(load), len(holders)
    while True:
        over = [g for g in range(num_ranks) if load[g] > limit[g]]
        if not over:
            return None
        rank_level = [-1] * num_ranks
        item_level = [-1] * num_items
        for g in over:
            rank_level[g] = 0
        queue = deque(over)
        reached = False
        while queue:
            g = queue.popleft()
            next_level = rank_level[g] + 1
            for i, j in at_rank[g]:
                if item_level[i] >= 0 or x[i][j] == 0:
                    continue
                item_level[i] = next_level
                room = edge_cap[i] if edge_cap is not None else None
                for k, h in enumerate(holders[i]):
                    if rank_level[h] >= 0 or (room is not None and x[i][k] >= room[k]):
                        continue
                    rank_level[h] = next_level + 1
                    if load[h] < limit[h]:
                        reached = True  # a target: paths end here
                    else:
                        queue.append(h)
        if not reached:
            return [g for g in range(num_ranks) if rank_level[g] >= 0]
        rank_arc = [0] * num_ranks
        item_arc = [0] * num_items

        def push(g: int, amount: int) -> int:
            """Pushes up to ``amount`` from rank g along the level graph; returns what moved."""
            if rank_level[g] > 0 and load[g] < limit[g]:
                moved = min(amount, limit[g] - load[g])
                load[g] += moved
                return moved
            arcs, item_next = at_rank[g], rank_level[g] + 1
            while rank_arc[g] < len(arcs):
                i, j = arcs[rank_arc[g]]
                row = x[i]
                if item_level[i] == item_next and row[j] > 0:
                    # Through item i: to its holders one level further, within edge room.
                    part = min(amount, row[j])
                    ranks = holders[i]
                    room = edge_cap[i] if edge_cap is not None else None
                    while item_arc[i] < len(ranks):
                        k = item_arc[i]
                        h = ranks[k]
                        space = part if room is None else min(part, room[k] - row[k])
                        if rank_level[h] == item_next + 1 and space > 0:
                            if load[h] < limit[h]:  # a target: what push(h) would do, inline
                                moved = min(space, limit[h] - load[h])
                                load[h] += moved
                            else:
                                moved = push(h, space)
                            if moved:
                                row[k] += moved
                                row[j] -= moved
                                return moved
                        item_arc[i] += 1
                rank_arc[g] += 1
            return 0

        for g in over:
            while load[g] > limit[g]:
                moved = push(g, load[g] - limit[g])
                if not moved:
                    break
                load[g] -= moved


def _component_bound(
    load: list[int], holders: list[list[int]], caps: list[Optional[int]]
) -> Optional[int]:
    """Lower bound on the peak: load never leaves a connected component of the holder graph
    (ranks linked by the items they share), so each component C needs
    ``sum_C min(T, cap) >= load(C)``; None if some component cannot fit under its caps."""
    parent = list(range(len(load)))

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for ranks in holders:
        first = root(ranks[0])
        for g in ranks[1:]:
            parent[root(g)] = first
    roots = [root(g) for g in range(len(load))]
    if all(c is None for c in caps):
        # Without caps each component needs ceil(load / size) (what _level gives, sooner).
        total, size = [0] * len(load), [0] * len(load)
        for g, r in enumerate(roots):
            total[r] += load[g]
            size[r] += 1
        return max((-(-t // n) for t, n in zip(total, size) if n), default=0)
    members: dict[int, list[int]] = {}
    for g, r in enumerate(roots):
        members.setdefault(r, []).append(g)
    bound = 0
    for group in members.values():
        level = _level([caps[g] for g in group], sum(load[g] for g in group))
        if level is None:
            return None
        bound = max(bound, level)
    return bound


def _start(
    base: list[int], holders: list[list[int]], initial: list[list[int]]
) -> tuple[list[int], list[list[int]], list[list[tuple[int, int]]]]:
    """Per-rank load, a copy of the assignment and each rank's (item, position) entries."""
    load = list(base)
    x = [list(row) for row in initial]
    at_rank: list[list[tuple[int, int]]] = [[] for _ in base]
    for i, (ranks, row) in enumerate(zip(holders, x)):
        for j, (g, amount) in enumerate(zip(ranks, row)):
            load[g] += amount
            at_rank[g].append((i, j))
    return load, x, at_rank


def caps_cut(
    base: list[int],
    holders: list[list[int]],
    initial: list[list[int]],
    rank_cap: list[int],
    edge_cap: Optional[list[list[int]]] = None,
) -> Optional[list[int]]:
    """Whether some assignment meets the rank caps (the first phase of :func:`min_max_lists`).

    Same inputs as :func:`min_max_lists`, with a cap on every rank. Feasibility does not depend
    on the starting assignment (the augmenting paths decide it exactly), only the time does.

    Returns:
        None when the caps admit an assignment (exactly when ``min_max_lists`` returns one),
        else ranks R that every assignment loads beyond ``sum(rank_cap[R])``: a violated cut.
    """
    for g, (b, c) in enumerate(zip(base, rank_cap)):
        if b > c:
            return [g]
    load, x, at_rank = _start(base, holders, initial)
    return _rebalance(load, x, holders, at_rank, list(rank_cap), edge_cap)


def min_max_lists(
    base: list[int],
    amounts: list[int],
    holders: list[list[int]],
    initial: list[list[int]],
    rank_cap: Optional[list[int]] = None,
    edge_cap: Optional[list[list[int]]] = None,
) -> Optional[tuple[list[list[int]], list[int]]]:
    """Exact min-max assignment by augmenting paths from a starting assignment (host lists).

    Items (flexible experts) ``i`` carry ``amounts[i]`` over the ranks ``holders[i]`` (ascending,
    distinct); ``initial[i][j]`` is the starting amount on ``holders[i][j]`` (summing to
    ``amounts[i]``, within ``edge_cap``). Rigid load (experts with one holder) goes in ``base``.

    Method: a probe at peak T gives every rank the limit ``min(T, rank_cap)``; while some rank is
    over its limit, Dinic phases on the residual graph implicit in the assignment (rank g -> item
    i with pairs on g -> rank h holding i, with edge room) move pairs from over ranks to ranks
    under their limit; ranks along a path keep their load. If no path is left, the ranks R the
    search reached hold only load that cannot leave R in any assignment (every item with pairs
    on R has its other holders in R or its edges there full), so the optimum T* satisfies
    ``sum_R min(T*, cap) >= load(R)``: a proven lower bound, and the next probe. The first probe
    is the same bound over each connected component of the holder graph (ranks linked by shared
    items), after the rank caps alone have been met (failing that, the instance is infeasible);
    every probe is a lower bound and the loop ends when one succeeds, so the result is optimal.
    Moves never lift a rank above its limit, so the assignment stays valid throughout; from a
    near-optimal start it takes two or three probes.

    Returns:
        ``(assignment per item per holder, load per rank)``, or None when the rank capacities
        cannot be met.
    """
    num_ranks = len(base)
    caps: list[Optional[int]] = list(rank_cap) if rank_cap is not None else [None] * num_ranks
    if any(c is not None and b > c for b, c in zip(base, caps)):
        return None
    load, x, at_rank = _start(base, holders, initial)
    if num_ranks == 0:
        return x, load
    if rank_cap is not None:
        unbounded = [c if c is not None else max(load) for c in caps]
        if _rebalance(load, x, holders, at_rank, unbounded, edge_cap) is not None:
            return None
    low = _component_bound(load, holders, caps)
    if low is None:
        return None
    high = max(load)
    while low < high:
        limit = [low if c is None else min(low, c) for c in caps]
        cut = _rebalance(load, x, holders, at_rank, limit, edge_cap)
        if cut is None:
            high = max(load)
        else:
            # No pairs can leave the cut R: the optimum T* has sum_R min(T*, cap) >= load(R).
            bound = _level([caps[g] for g in cut], sum(load[g] for g in cut))
            assert bound is not None and bound > low, "a failed probe must prove a bound"
            low = bound
    return x, load


# The edge room of an entry without an edge cap: larger than any load, so one code path serves
# both modes (``room - x`` never binds, ``x >= room`` never holds).
_NO_EDGE_CAP = 1 << 62


class HolderGraph:
    """The holder graph of one call, built once, for repeated exact solves (the fast path of
    :func:`min_max_lists` and :func:`caps_cut`, the same results bit for bit).

    Items and holders are flat entries: item i owns entries ``bounds[i]:bounds[i + 1]``, entry k
    is held on rank ``rank[k]`` (ascending within an item) with edge room ``room[k]``. What does
    not change between the solves of one call is built here once: each rank's entries, each
    entry's item, the connected components of the holder graph (for the first lower bound).
    The solves run the same Dinic phases as :func:`_rebalance`, visiting arcs in the same order,
    on flat lists (one index per entry instead of an item row and a position).

    Args:
        num_ranks: P.
        rank: ``[K]`` rank of every entry, items in order, each item's ranks ascending.
        bounds: ``[M + 1]`` first entry of every item, then K.
        room: ``[K]`` edge capacity of every entry (save mode: the forward pairs), or None.
    """

    def __init__(
        self,
        num_ranks: int,
        rank: Sequence[int],
        bounds: Sequence[int],
        room: Optional[Sequence[int]] = None,
    ) -> None:
        self.num_ranks = num_ranks
        self.rank = rank = list(rank)
        self.bounds = bounds = list(bounds)
        self.num_items = num_items = len(bounds) - 1
        self.item = item = []
        for i in range(num_items):
            item += [i] * (bounds[i + 1] - bounds[i])
        self.room = [_NO_EDGE_CAP] * len(rank) if room is None else list(room)
        self.at_rank: list[list[int]] = [[] for _ in range(num_ranks)]
        for k, g in enumerate(rank):
            self.at_rank[g].append(k)  # ascending k: the item order _start gives
        # Components of the holder graph (ranks linked by shared items), by breadth-first
        # search: the first probe's bound depends on this partition alone.
        self.singles: list[int] = []
        self.groups: list[list[int]] = []
        seen, done = [False] * num_items, [False] * num_ranks
        for g in range(num_ranks):
            if done[g]:
                continue
            done[g] = True
            group = [g]
            for u in group:
                for k in self.at_rank[u]:
                    i = item[k]
                    if not seen[i]:
                        seen[i] = True
                        for h in rank[bounds[i] : bounds[i + 1]]:
                            if not done[h]:
                                done[h] = True
                                group.append(h)
            if len(group) == 1:
                self.singles.append(g)
            else:
                self.groups.append(group)

    def _load(self, base: Sequence[int], x: list[int]) -> list[int]:
        load = list(base)
        for g, amount in zip(self.rank, x):
            load[g] += amount
        return load

    def _bound(self, load: list[int], caps: list[Optional[int]], capped: bool) -> Optional[int]:
        """:func:`_component_bound` from the components found at construction."""
        if not capped:
            bound = max((load[g] for g in self.singles), default=0)
            for group in self.groups:
                total = sum(load[g] for g in group)
                bound = max(bound, -(-total // len(group)))
            return bound
        bound = 0
        for g in self.singles:
            if caps[g] is not None and load[g] > caps[g]:
                return None
            bound = max(bound, load[g])
        for group in self.groups:
            level = _level([caps[g] for g in group], sum(load[g] for g in group))
            if level is None:
                return None
            bound = max(bound, level)
        return bound

    def min_max(
        self,
        base: Sequence[int],
        initial: Sequence[int],
        rank_cap: Optional[Sequence[Optional[int]]] = None,
    ) -> Optional[tuple[list[int], list[int]]]:
        """:func:`min_max_lists` on flat entries: ``(amount per entry, load per rank)``.

        Args:
            base: ``[P]`` rigid load per rank.
            initial: ``[K]`` starting amount per entry (each item's entries sum to its amount,
                within the edge room).
            rank_cap: ``[P]`` most load per rank (None entries: no cap), or None.

        Returns:
            The optimal assignment and loads (the same as :func:`min_max_lists`), or None when
            the rank capacities cannot be met.
        """
        num_ranks = self.num_ranks
        capped = rank_cap is not None
        caps: list[Optional[int]] = list(rank_cap) if capped else [None] * num_ranks
        if capped and any(c is not None and b > c for b, c in zip(base, caps)):
            return None
        x = list(initial)
        load = self._load(base, x)
        if num_ranks == 0:
            return x, load
        if capped:
            top = max(load)
            unbounded = [top if c is None else c for c in caps]
            if self._rebalance(load, x, unbounded) is not None:
                return None
        low = self._bound(load, caps, capped and any(c is not None for c in caps))
        if low is None:
            return None
        high = max(load)
        while low < high:
            if capped:
                limit = [low if c is None or low < c else c for c in caps]
            else:
                limit = [low] * num_ranks
            cut = self._rebalance(load, x, limit)
            if cut is None:
                high = max(load)
            else:
                bound = _level([caps[g] for g in cut], sum(load[g] for g in cut))
                assert bound is not None and bound > low, "a failed probe must prove a bound"
                low = bound
        return x, load

    def caps_cut(
        self, base: Sequence[int], initial: Sequence[int], rank_cap: Sequence[int]
    ) -> Optional[list[int]]:
        """:func:`caps_cut` on flat entries: None when the caps admit an assignment, else a
        violated cut of ranks (the same as :func:`caps_cut`)."""
        for g, (b, c) in enumerate(zip(base, rank_cap)):
            if b > c:
                return [g]
        x = list(initial)
        return self._rebalance(self._load(base, x), x, list(rank_cap))

    def _rebalance(self, load: list[int], x: list[int], limit: list[int]) -> Optional[list[int]]:
        """:func:`_rebalance` on flat entries (in place; the same phases, arcs and moves).

        Two shortcuts that do not change a move: ranks over their limit only lose load within a
        call (targets fill up to their limit at most, ranks along a path keep theirs), so each
        phase's over ranks are filtered from the last phase's; the breadth-first queue is a
        list read in order.
        """
        rank_of, item_of, bounds, room, at_rank = (
            self.rank,
            self.item,
            self.bounds,
            self.room,
            self.at_rank,
        )
        num_ranks, num_items = self.num_ranks, self.num_items
        over = [g for g in range(num_ranks) if load[g] > limit[g]]
        while over:
            rank_level = [-1] * num_ranks
            item_level = [-1] * num_items
            for g in over:
                rank_level[g] = 0
            queue = list(over)
            reached = False
            for g in queue:
                item_next = rank_level[g] + 1
                for k in at_rank[g]:
                    i = item_of[k]
                    if item_level[i] >= 0 or not x[k]:
                        continue
                    item_level[i] = item_next
                    for kk in range(bounds[i], bounds[i + 1]):
                        h = rank_of[kk]
                        if rank_level[h] >= 0 or x[kk] >= room[kk]:
                            continue
                        rank_level[h] = item_next + 1
                        if load[h] < limit[h]:
                            reached = True  # a target: paths end here
                        else:
                            queue.append(h)
            if not reached:
                return sorted(queue)
            rank_arc = [0] * num_ranks
            item_arc = bounds[:-1]

            def push(g: int, amount: int) -> int:
                """Pushes up to ``amount`` from non-target rank g along the level graph."""
                arcs = at_rank[g]
                item_next = rank_level[g] + 1
                hold_next = item_next + 1
                a, stop = rank_arc[g], len(arcs)
                while a < stop:
                    k = arcs[a]
                    i = item_of[k]
                    have = x[k]
                    if item_level[i] == item_next and have > 0:
                        part = amount if amount < have else have
                        kk, end = item_arc[i], bounds[i + 1]
                        while kk < end:
                            h = rank_of[kk]
                            if rank_level[h] == hold_next:
                                space = room[kk] - x[kk]
                                if space > part:
                                    space = part
                                if space > 0:
                                    if load[h] < limit[h]:  # a target
                                        moved = limit[h] - load[h]
                                        if moved > space:
                                            moved = space
                                        load[h] += moved
                                    else:
                                        moved = push(h, space)
                                    if moved:
                                        x[kk] += moved
                                        x[k] -= moved
                                        item_arc[i] = kk
                                        rank_arc[g] = a
                                        return moved
                            kk += 1
                        item_arc[i] = kk
                    a += 1
                rank_arc[g] = a
                return 0

            # ``push`` from each over rank (level 0) until it is within its limit or stuck,
            # inlined: a fresh push would restart at the arc and holder where the last path
            # left, which is where this loop continues.
            for g in over:
                amount = load[g] - limit[g]
                arcs = at_rank[g]
                a, stop = 0, len(arcs)
                while a < stop:
                    k = arcs[a]
                    i = item_of[k]
                    have = x[k]
                    if item_level[i] == 1 and have > 0:
                        part = amount if amount < have else have
                        kk, end = item_arc[i], bounds[i + 1]
                        moved = 0
                        while kk < end:
                            h = rank_of[kk]
                            if rank_level[h] == 2:
                                space = room[kk] - x[kk]
                                if space > part:
                                    space = part
                                if space > 0:
                                    if load[h] < limit[h]:  # a target
                                        moved = limit[h] - load[h]
                                        if moved > space:
                                            moved = space
                                        load[h] += moved
                                    else:
                                        moved = push(h, space)
                                    if moved:
                                        x[kk] += moved
                                        x[k] -= moved
                                        break
                            kk += 1
                        item_arc[i] = kk
                        if moved:
                            load[g] -= moved
                            amount -= moved
                            if not amount:
                                break
                            continue  # the same arc again
                    a += 1
            over = [g for g in over if load[g] > limit[g]]
        return None


def min_max_balance(
    load: torch.Tensor,
    admissible: torch.Tensor,
    base_load: torch.Tensor | None = None,
    *,
    rank_capacity: torch.Tensor | None = None,
    edge_capacity: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Exact min-max assignment: the tensor front of :func:`min_max_lists`.

    The same problem (the module docstring's), inputs and optimum as
    ``reference.reference_min_max_balance``, so that tests compare the production solver with its
    reference on ``[E, P]`` tensors; the controller itself calls :class:`HolderGraph` (or
    :func:`min_max_lists`) on host lists it already has. Experts with one admissible rank go
    straight into the base load; the others start from an even split over their ranks (filled in
    rank order within edge capacities) and are balanced by :func:`min_max_lists`. Typically
    10-100x faster than the max-flow reference.

    Returns:
        ``[E, P]`` int64 assignment on ``load``'s device, or None when the capacities admit none.

    Raises:
        ValueError: malformed shapes, negative values, an expert with no admissible rank, or an
            expert whose edge capacities sum below its load.
    """
    loads, ranks, base = _balance_inputs(load, admissible, base_load)
    num_experts, num_ranks = len(loads), len(base)
    caps, edges = _capacity_inputs(rank_capacity, edge_capacity, num_experts, num_ranks)
    assignment = [[0] * num_ranks for _ in range(num_experts)]
    rigid = list(base)
    items: list[int] = []
    holders: list[list[int]] = []
    initial: list[list[int]] = []
    item_edges: list[list[int]] = []
    for e, allowed in enumerate(ranks):
        if loads[e] == 0:
            continue
        room = [loads[e] if edges is None else edges[e][r] for r in allowed]
        if sum(room) < loads[e]:
            raise ValueError(f"expert {e}: edge capacities {sum(room)} below its load {loads[e]}")
        if len(allowed) == 1:
            rigid[allowed[0]] += loads[e]
            assignment[e][allowed[0]] = loads[e]
            continue
        share = [min(loads[e] // len(allowed), c) for c in room]
        left = loads[e] - sum(share)
        for j in range(len(share)):
            add = min(left, room[j] - share[j])
            share[j] += add
            left -= add
        items.append(e)
        holders.append(allowed)
        initial.append(share)
        item_edges.append(room)
    result = min_max_lists(
        rigid, [loads[e] for e in items], holders, initial, caps, item_edges if edges else None
    )
    if result is None:
        return None
    for e, allowed, row in zip(items, holders, result[0]):
        for r, amount in zip(allowed, row):
            assignment[e][r] = amount
    return torch.tensor(assignment, dtype=torch.int64, device=load.device).reshape(
        num_experts, num_ranks
    )


def interval_split_np(chunks: np.ndarray, parts: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Splits each group's source chunks into contiguous sub-chunks per holder.

    Group g's pairs are laid on a line in source order (``chunks[:, g]`` each). Its holders take
    consecutive ranges of that line: ``first[g]`` (the owner) first, then the other holders by
    ascending rank, holder h taking ``parts[g, h]`` pairs. The result counts the pairs of source
    s's chunk that land on holder h, so within every (source, group) chunk the holders' shares are
    contiguous, in holder order.

    Args:
        chunks: ``[S, G]`` int64 pairs per (source, group).
        parts: ``[G, H]`` int64 pairs per (group, holder), ``parts.sum(1) == chunks.sum(0)``.
        first: ``[G]`` int64 holder that takes the start of each group's line.

    Returns:
        ``[S, G, H]`` int64; sums over H give ``chunks``, over S give ``parts``.
    """
    num_groups = parts.shape[0]
    rows = np.arange(num_groups)
    cum = np.cumsum(parts, axis=1) - parts
    first_part = parts[rows, first]
    holder_lo = cum + first_part[:, None] * (np.arange(parts.shape[1])[None, :] < first[:, None])
    holder_lo[rows, first] = 0
    holder_hi = holder_lo + parts
    source_lo = np.cumsum(chunks, axis=0) - chunks
    source_hi = source_lo + chunks
    lo = np.maximum(source_lo[:, :, None], holder_lo[None, :, :])
    hi = np.minimum(source_hi[:, :, None], holder_hi[None, :, :])
    return np.maximum(hi - lo, 0)
