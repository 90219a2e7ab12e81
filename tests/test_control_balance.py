"""Exact min-max assignment over replicas (control/balance.py): the fast solver against the
max-flow reference (control/reference.py) and both against brute force, with rank and edge
capacities; the interval split that turns per-holder amounts into per-source sub-chunks.

Shapes: E experts, P ranks, S sources.
"""

from __future__ import annotations

import itertools
import random
from typing import Optional

import numpy as np
import pytest
import torch

from megatron_lrmoe.control.balance import (
    HolderGraph,
    caps_cut,
    interval_split_np,
    min_max_balance,
    min_max_lists,
)
from megatron_lrmoe.control.reference import reference_min_max_balance


def _brute_force(
    load: list[int],
    admissible: list[list[bool]],
    base: list[int],
    rank_cap: Optional[list[int]] = None,
    edge_cap: Optional[list[list[int]]] = None,
) -> Optional[int]:
    """Minimum peak over every integer assignment, None if the capacities admit none."""
    num_ranks = len(base)
    options = []
    for e, amount in enumerate(load):
        allowed = [r for r in range(num_ranks) if admissible[e][r]]
        rows = []
        for split in itertools.product(range(amount + 1), repeat=len(allowed)):
            if sum(split) != amount:
                continue
            row = [0] * num_ranks
            for r, x in zip(allowed, split):
                row[r] = x
            if edge_cap is not None and any(row[r] > edge_cap[e][r] for r in range(num_ranks)):
                continue
            rows.append(row)
        options.append(rows)
    best = None
    for choice in itertools.product(*options):
        loads = [base[r] + sum(row[r] for row in choice) for r in range(num_ranks)]
        if rank_cap is not None and any(x > c for x, c in zip(loads, rank_cap)):
            continue
        peak = max(loads)
        best = peak if best is None else min(best, peak)
    return best


def _check(
    assignment: torch.Tensor,
    load: list[int],
    admissible: torch.Tensor,
    edge_cap: Optional[list[list[int]]] = None,
) -> None:
    assert assignment.dtype == torch.int64 and assignment.shape == admissible.shape
    assert assignment.sum(1).tolist() == load
    assert bool((assignment >= 0).all())
    assert not bool(assignment[~admissible].any())
    if edge_cap is not None:
        assert bool((assignment <= torch.tensor(edge_cap)).all())


def _peak(assignment: torch.Tensor, base: list[int]) -> int:
    return int((assignment.sum(0) + torch.tensor(base)).max())


def _random_case(rng: random.Random, num_experts: int, num_ranks: int, max_load: int):
    load = [rng.randint(0, max_load) for _ in range(num_experts)]
    admissible = []
    for _ in range(num_experts):
        row = [rng.random() < 0.5 for _ in range(num_ranks)]
        row[rng.randrange(num_ranks)] = True
        admissible.append(row)
    base = [rng.randint(0, max_load) for _ in range(num_ranks)]
    return load, admissible, base


@pytest.mark.parametrize("capacities", ["none", "rank", "edge", "both"])
def test_both_solvers_match_brute_force(capacities: str) -> None:
    rng = random.Random(11)
    feasible = infeasible = 0
    for _ in range(120):
        load, admissible, base = _random_case(rng, rng.randint(1, 3), rng.randint(1, 3), 4)
        rank_cap = edge_cap = None
        if capacities in ("rank", "both"):
            rank_cap = [b + rng.randint(0, 5) for b in base]
        if capacities in ("edge", "both"):
            edge_cap = [[rng.randint(0, 4) for _ in row] for row in admissible]
            for e, row in enumerate(admissible):
                # Keep each expert placeable so brute force and the solvers agree on the input.
                allowed = [r for r, ok in enumerate(row) if ok]
                while sum(edge_cap[e][r] for r in allowed) < load[e]:
                    edge_cap[e][rng.choice(allowed)] += 1
        best = _brute_force(load, admissible, base, rank_cap, edge_cap)
        adm = torch.tensor(admissible)
        kwargs = dict(
            rank_capacity=None if rank_cap is None else torch.tensor(rank_cap),
            edge_capacity=None if edge_cap is None else torch.tensor(edge_cap),
        )
        for solver in (reference_min_max_balance, min_max_balance):
            got = solver(torch.tensor(load), adm, torch.tensor(base), **kwargs)
            if best is None:
                assert got is None, solver.__name__
                continue
            _check(got, load, adm, edge_cap)
            assert _peak(got, base) == best, solver.__name__
            if rank_cap is not None:
                assert bool((got.sum(0) + torch.tensor(base) <= torch.tensor(rank_cap)).all())
        feasible += best is not None
        infeasible += best is None
    assert feasible > 30
    if rank_cap is not None:
        assert infeasible > 0  # the rank-capacity cases do exercise infeasibility


def test_fast_solver_matches_reference_on_larger_cases() -> None:
    rng = random.Random(12)
    for _ in range(40):
        num_experts, num_ranks = rng.randint(4, 40), rng.randint(2, 12)
        load = [rng.choice([0, 1, 5, 20, 300, 1000]) for _ in range(num_experts)]
        admissible = []
        for e in range(num_experts):
            row = [rng.random() < rng.choice([0.1, 0.3, 0.8]) for _ in range(num_ranks)]
            row[e % num_ranks] = True
            admissible.append(row)
        base = [rng.choice([0, 0, 10, 500]) for _ in range(num_ranks)]
        adm = torch.tensor(admissible)
        kwargs = {}
        if rng.random() < 0.5:
            total = sum(load) + sum(base)
            kwargs["rank_capacity"] = torch.tensor(
                [b + rng.randint(0, total // num_ranks + 50) for b in base]
            )
        ref = reference_min_max_balance(torch.tensor(load), adm, torch.tensor(base), **kwargs)
        fast = min_max_balance(torch.tensor(load), adm, torch.tensor(base), **kwargs)
        assert (ref is None) == (fast is None)
        if ref is not None:
            _check(fast, load, adm)
            assert _peak(fast, base) == _peak(ref, base)
            again = min_max_balance(torch.tensor(load), adm, torch.tensor(base), **kwargs)
            assert torch.equal(fast, again)  # deterministic


def test_min_max_lists_from_any_start() -> None:
    # One flexible item over three ranks, started all on the most loaded rank.
    result = min_max_lists([5, 0, 2], [9], [[0, 1, 2]], [[9, 0, 0]])
    assert result is not None
    rows, load = result
    assert sum(rows[0]) == 9 and max(load) == 6 and sum(load) == 16
    # A chain: item 0 on ranks {0, 1}, item 1 on {1, 2}; all load starts on rank 0; pairs must
    # travel 0 -> 1 -> 2 through rank 1 without rank 1 changing its load in between.
    rows, load = min_max_lists([0, 0, 0], [6, 3], [[0, 1], [1, 2]], [[6, 0], [3, 0]])
    assert load == [3, 3, 3]
    # Rank caps that cannot be met.
    assert min_max_lists([4, 0], [4], [[0, 1]], [[4, 0]], rank_cap=[5, 2]) is None
    assert min_max_lists([6, 0], [0], [[0, 1]], [[0, 0]], rank_cap=[5, 9]) is None
    # Edge caps bind the split.
    rows, load = min_max_lists([0, 0], [10], [[0, 1]], [[10, 0]], edge_cap=[[10, 3]])
    assert rows == [[7, 3]] and load == [7, 3]


def _graph_case(rng: random.Random, kind: str):
    """A random flat problem for :class:`HolderGraph` and its list form (``kind`` picks the
    shape: general, one hot item, all balanced, zero loads, no items, one rank)."""
    num_ranks = 1 if kind == "one rank" else rng.choice([2, 3, 5, 8, 16, 33, 64])
    num_items = 0 if kind == "no items" else rng.randint(1, min(12, 2 * num_ranks))
    holders = [
        sorted(rng.sample(range(num_ranks), rng.randint(1, num_ranks))) for _ in range(num_items)
    ]
    top = rng.choice([3, 40, 5000])
    amounts = [rng.randint(0, top) for _ in holders]
    base = [rng.randint(0, top) for _ in range(num_ranks)]
    if kind == "one hot item":
        amounts = [0] * num_items
        amounts[rng.randrange(num_items)] = 50 * top
    elif kind == "balanced":
        amounts, base = [top] * num_items, [top] * num_ranks
    elif kind == "zero loads":
        amounts, base = [0] * num_items, [0] * num_ranks
    edge = None
    if rng.random() < 0.5:
        # Edge caps at or above an item's share, summing to at least its amount.
        edge = []
        for amount, ranks in zip(amounts, holders):
            room = [rng.randint(0, amount) for _ in ranks]
            while sum(room) < amount:
                room[rng.randrange(len(ranks))] += max(1, amount - sum(room))
            edge.append(room)
    initial = []
    for e, (amount, ranks) in enumerate(zip(amounts, holders)):
        share, left = [0] * len(ranks), amount
        for j in sorted(range(len(ranks)), key=lambda _: rng.random()):
            put = left if edge is None else min(left, edge[e][j])
            put = rng.randint(0, put) if rng.random() < 0.5 else put
            share[j], left = put, left - put
        for j in range(len(ranks)):  # whatever is left goes where there is room
            put = left if edge is None else min(left, edge[e][j] - share[j])
            share[j], left = share[j] + put, left - put
        initial.append(share)
    return base, amounts, holders, initial, edge


@pytest.mark.parametrize(
    "seed, kind",
    list(enumerate(["general", "one hot item", "balanced", "zero loads", "no items", "one rank"])),
)
def test_holder_graph_matches_min_max_lists(seed: int, kind: str) -> None:
    """The flat solver makes the same moves as the list solver: same assignment, loads, cuts
    (150 random problems per kind, with and without rank and edge caps, caps of 0 included)."""
    rng = random.Random(100 + seed)
    outcomes = {"solved": 0, "infeasible": 0, "cut": 0}
    for _ in range(150):
        base, amounts, holders, initial, edge = _graph_case(rng, kind)
        num_ranks = len(base)
        rank = [g for ranks in holders for g in ranks]
        bounds = list(itertools.accumulate([0] + [len(ranks) for ranks in holders]))
        flat_edge = None if edge is None else [c for row in edge for c in row]
        graph = HolderGraph(num_ranks, rank, bounds, flat_edge)
        flat_initial = [a for row in initial for a in row]
        total = sum(base) + sum(amounts)
        cap_choice = rng.choice(["none", "tight", "loose", "zero", "some none"])
        caps = None
        if cap_choice == "zero":  # a budget of 0: only an instance without load fits
            caps = [0] * num_ranks
        elif cap_choice != "none":
            slack = total // num_ranks + (3 if cap_choice == "tight" else total)
            caps = [b + rng.randint(0, slack) for b in base]
            if cap_choice == "some none":
                caps = [None if rng.random() < 0.3 else c for c in caps]
        ref = min_max_lists(base, amounts, holders, initial, caps, edge)
        got = graph.min_max(base, flat_initial, caps)
        assert (ref is None) == (got is None)
        if ref is not None:
            assert got[0] == [a for row in ref[0] for a in row] and got[1] == ref[1]
        outcomes["solved" if ref is not None else "infeasible"] += 1
        if caps is not None and None not in caps:
            cut = caps_cut(base, holders, initial, caps, edge)
            assert graph.caps_cut(base, flat_initial, caps) == cut
            outcomes["cut"] += cut is not None
    assert outcomes["solved"] > 50
    if kind in ("general", "one hot item"):
        assert outcomes["infeasible"] > 5 and outcomes["cut"] > 5


def test_interval_split_contiguous_owner_first() -> None:
    # One expert, sources with 3, 4, 5 pairs; holders 0 (4 pairs), 1 (owner, 5), 2 (3).
    chunks = np.array([[3], [4], [5]])
    parts = np.array([[4, 5, 3]])
    got = interval_split_np(chunks, parts, np.array([1]))
    # Line order: owner 1 takes pairs [0, 5), holder 0 [5, 9), holder 2 [9, 12).
    assert got[:, 0, :].tolist() == [[0, 3, 0], [2, 2, 0], [2, 0, 3]]
    rng = np.random.default_rng(0)
    for _ in range(50):
        num_sources, num_groups, num_holders = rng.integers(1, 6, size=3)
        chunks = rng.integers(0, 20, size=(num_sources, num_groups))
        parts = np.zeros((num_groups, num_holders), dtype=np.int64)
        for g, total in enumerate(chunks.sum(0)):
            cuts = np.sort(rng.integers(0, total + 1, size=num_holders - 1))
            parts[g] = np.diff(np.r_[0, cuts, total])
        first = rng.integers(0, num_holders, size=num_groups)
        got = interval_split_np(chunks, parts, first)
        assert (got.sum(2) == chunks).all() and (got.sum(0) == parts).all() and (got >= 0).all()
        # Within a chunk the holders appear in line order (owner first, then by rank) as one
        # contiguous run each: a source never returns to a holder it has left.
        for g in range(num_groups):
            order = [first[g]] + [h for h in range(num_holders) if h != first[g]]
            order = [h for h in order if parts[g, h] > 0]
            position = {h: k for k, h in enumerate(order)}
            for s in range(num_sources):
                used = sorted(position[h] for h in order if got[s, g, h] > 0)
                assert not used or used == list(range(used[0], used[-1] + 1))
