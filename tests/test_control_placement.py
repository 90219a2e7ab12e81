"""Replica placement (control/placement.py): the threshold search + greedy against the exact
optimum (brute force over every placement, exact min-max assignment for each) on small cases.

Shapes: E experts, P ranks, L = E / P owned per rank.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_lrmoe.control import placement as placement_module
from megatron_lrmoe.control.placement import (
    _Excess,
    best_fit_greedy,
    place_replicas,
    threshold_greedy,
)
from megatron_lrmoe.control.reference import reference_min_max_balance, reference_optimal_peak


def _holds(num_experts: int, num_ranks: int, replicas: dict[int, tuple[int, ...]]):
    local = num_experts // num_ranks
    holds = torch.zeros(num_experts, num_ranks, dtype=torch.bool)
    holds[torch.arange(num_experts), torch.arange(num_experts) // local] = True
    for rank, experts in replicas.items():
        holds[list(experts), rank] = True
    return holds


def _greedy_peak(load: list[int], num_ranks: int, slots: int) -> tuple[int, int, object]:
    """Peak of the placement's own split and of the exact split over its replicas."""
    w = np.asarray(load, dtype=np.int64)
    placement = place_replicas(w, num_ranks, slots)
    num_experts = len(load)
    local = num_experts // num_ranks
    forward = np.zeros((num_experts, num_ranks), dtype=np.int64)
    forward[np.arange(num_experts), np.arange(num_experts) // local] = w
    replicas: dict[int, list[int]] = {}
    for e, g, amount in zip(
        placement.replica_expert, placement.replica_rank, placement.replica_pairs
    ):
        forward[e, g] += amount
        forward[e, e // local] -= amount
        replicas.setdefault(int(g), []).append(int(e))
    holds = _holds(num_experts, num_ranks, {g: tuple(es) for g, es in replicas.items()})
    exact = reference_min_max_balance(torch.tensor(load), holds)
    return int(forward.sum(0).max()), int(exact.sum(0).max()), placement


def test_placement_invariants_and_quality_against_brute_force() -> None:
    rng = random.Random(21)
    optimal = 0
    for case in range(162):
        num_ranks = rng.choice([2, 3, 4]) if case < 150 else 5
        local = rng.choice([1, 2]) if num_ranks < 4 else 1
        slots = rng.choice([1, 2]) if num_ranks * local <= 4 else 1
        num_experts = num_ranks * local
        load = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(num_experts)]
        greedy, exact_split, placement = _greedy_peak(load, num_ranks, slots)
        optimum = reference_optimal_peak(load, num_ranks, slots)
        fixed = max(sum(load[r * local : (r + 1) * local]) for r in range(num_ranks))
        # Invariants: slots, one replica per (expert, rank), never on the owner, positive moves,
        # the split within the threshold, never worse than fixed ownership.
        pairs = list(zip(placement.replica_expert.tolist(), placement.replica_rank.tolist()))
        assert len(set(pairs)) == len(pairs)
        assert all(g != e // local for e, g in pairs)
        counts = np.bincount(placement.replica_rank, minlength=num_ranks)
        assert (counts <= slots).all() and (placement.replica_pairs > 0).all()
        assert greedy <= placement.threshold or not pairs
        assert optimum <= exact_split <= greedy <= fixed
        optimal += greedy == optimum
    # The greedy alone is optimal in 141 of these 162 (up to 49 % above); with the local search
    # after it every one of this fixed set reaches the optimum.
    assert optimal == 162


def test_local_search_never_worse_than_the_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    cases = []
    for _ in range(120):
        num_ranks = int(rng.choice([2, 3, 4, 8, 16]))
        local = int(rng.choice([1, 2, 4]))
        slots = [int(s) for s in rng.integers(0, 3, num_ranks)]
        load = rng.zipf(1.5, num_ranks * local).clip(max=10**4) * rng.integers(1, 50)
        cases.append((load.astype(np.int64), num_ranks, slots))
    searched = [_own_peak(c[0], c[1], place_replicas(*c)) for c in cases]
    monkeypatch.setattr(placement_module, "IMPROVE_MAX_PAIRS", 0)
    greedy = [_own_peak(c[0], c[1], place_replicas(*c)) for c in cases]
    assert all(a <= b for a, b in zip(searched, greedy))
    assert sum(a < b for a, b in zip(searched, greedy)) >= 5


def _own_peak(load: np.ndarray, num_ranks: int, placement: object) -> int:
    local = load.size // num_ranks
    rank_load = load.reshape(num_ranks, local).sum(1)
    np.add.at(rank_load, placement.replica_rank, placement.replica_pairs)
    np.subtract.at(rank_load, placement.replica_expert // local, placement.replica_pairs)
    return int(rank_load.max())


def test_local_search_finds_the_chain() -> None:
    # Ranks own (e0, e1), (e2, e3), (e4, e5) with loads 100, 70, 10 and one slot each. The greedy
    # sends e0 to rank 2 and fills its slot; rank 1 then has nowhere to go (rank 0 is above
    # every threshold below 70), so the greedy ends at 70. The optimum 60 is a chain: rank 1
    # sheds e2 to rank 0, which sheds more of e0 to rank 2.
    load = np.array([60, 40, 40, 30, 5, 5], dtype=np.int64)
    placement = place_replicas(load, 3, 1)
    assert reference_optimal_peak(load.tolist(), 3, 1) == placement.threshold == 60
    assert list(zip(placement.replica_expert.tolist(), placement.replica_rank.tolist())) == [
        (0, 2),
        (2, 0),
    ]
    assert placement.replica_pairs.tolist() == [50, 10] and placement.changes == 1
    # Slots that shrink as T grows (the controller's memory budget): the search keeps to those
    # at the greedy's threshold, and every rank stays below it.
    shrinking = place_replicas(load, 3, lambda t: [1, 1, 1] if t < 65 else [0, 0, 1])
    assert shrinking.threshold == 70 and shrinking.replica_rank.tolist() == [2]


def test_excess_and_cut_against_every_rank_set() -> None:
    rng = random.Random(8)
    for _ in range(300):
        num_ranks = rng.choice([2, 3, 4, 5])
        num_experts = num_ranks * rng.choice([1, 2])
        local = num_experts // num_ranks
        load = [rng.choice([0, 1, 5, 20, 90]) for _ in range(num_experts)]
        replicas = sorted(
            {
                (e, g)
                for e, g in (
                    (rng.randrange(num_experts), rng.randrange(num_ranks)) for _ in range(4)
                )
                if g != e // local
            }
        )
        holders = [{e // local} | {g for f, g in replicas if f == e} for e in range(num_experts)]
        level = rng.randrange(sum(load) + 1)
        # By max-flow / min-cut: the pairs above `level` in the best assignment are the largest
        # load(R) - level |R| over rank sets R (load(R): experts held only inside R), and the
        # smallest maximising set is where the augmenting paths stop.
        gains = {}
        for mask in range(1, 1 << num_ranks):
            inside = frozenset(g for g in range(num_ranks) if mask >> g & 1)
            confined = sum(x for x, h in zip(load, holders) if h <= inside)
            gains[inside] = confined - level * len(inside)
        best = max(gains.values())
        state = _Excess(load, num_ranks, replicas)
        excess, cut = state.excess(level)
        assert excess == max(best, 0)
        if best > 0:
            assert set(cut) == frozenset.intersection(*(r for r, x in gains.items() if x == best))
        # The assignment: every expert's pairs over its holders, every rank's load consistent.
        rank_load = [0] * num_ranks
        for e in range(num_experts):
            row = state.split.get(e, {e // local: load[e]})
            assert set(row) <= holders[e] and sum(row.values()) == load[e]
            assert min(row.values()) >= 0
            for g, amount in row.items():
                rank_load[g] += amount
        assert rank_load == state.load
        assert sum(max(x - level, 0) for x in rank_load) == excess
        peak = _Excess(load, num_ranks, replicas).peak(0)
        assert peak == max(-(-(x + level * len(r)) // len(r)) for r, x in gains.items())


def test_hot_expert_spreads_over_every_rank() -> None:
    # One expert takes everything: with a slot on every other rank it is split P ways.
    load = np.array([800, 0, 0, 0, 0, 0, 0, 0], dtype=np.int64)
    placement = place_replicas(load, 8, 1)
    assert placement.threshold == 100
    assert sorted(placement.replica_rank.tolist()) == list(range(1, 8))
    assert placement.replica_pairs.tolist() == [100] * 7
    # Without slots nothing moves.
    none = place_replicas(load, 8, 0)
    assert none.replica_expert.size == 0 and none.threshold == 800


def test_balanced_load_needs_no_replicas() -> None:
    load = np.full(16, 50, dtype=np.int64)
    placement = place_replicas(load, 4, 2)
    assert placement.replica_expert.size == 0 and placement.threshold == 200
    empty = place_replicas(np.zeros(8, dtype=np.int64), 4, 2)
    assert empty.replica_expert.size == 0 and empty.threshold == 0


def test_threshold_greedy_hand_case() -> None:
    # Ranks own (e0, e1), (e2, e3), (e4, e5); rank 0 is over a threshold of 40 by 30.
    loads = [50, 20, 10, 5, 10, 10]
    rank_load = [70, 15, 20]
    hot = [[0, 1], [2, 3], [4, 5]]
    moves = threshold_greedy(loads, rank_load, hot, 40, [1, 1, 1])
    # Hottest expert e0 first, to the rank with the most slack (rank 1: 25), then rank 2 (20).
    assert moves == [(0, 1, 25), (0, 2, 5)]
    # One slot in all: only 25 of the 30 can move.
    assert threshold_greedy(loads, rank_load, hot, 40, [1, 0, 0]) is None
    # Below the mean no threshold is reachable.
    assert threshold_greedy(loads, rank_load, hot, 34, [9, 9, 9]) is None


def test_best_fit_greedy_hand_case(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks own one expert each. Over a threshold of 7: rank 0 by 8, rank 2 by 3; ranks 1, 3, 4
    # have slack 2, 7, 7 and one slot each.
    loads = [15, 5, 10, 0, 0]
    hot = [[0], [1], [2], [3], [4]]
    # Most slack first: rank 0 sends 7 to rank 3 and its last pair to rank 4, stranding 6 there;
    # rank 2's 3 pairs then fit nowhere.
    assert threshold_greedy(loads, loads, hot, 7, [1] * 5) is None
    # Best fit: the last pair goes to rank 1 (the least slack that takes it), rank 2's to rank 4.
    assert best_fit_greedy(loads, loads, hot, 7, [1] * 5) == [(0, 3, 7), (0, 1, 1), (2, 4, 3)]
    # The search tries both at every threshold: 7 is reached (6, the lower bound, by neither).
    monkeypatch.setattr(placement_module, "IMPROVE_MAX_PAIRS", 0)  # the greedy search alone
    placement = place_replicas(np.array(loads, dtype=np.int64), 5, 1)
    assert placement.threshold == 7 and placement.replica_rank.tolist() == [1, 3, 4]
    assert placement.greedy_runs == 3  # 6: both fail; 7: best fit succeeds
