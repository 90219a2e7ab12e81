"""Replica placement (control/placement.py): the threshold search + greedy against the exact
optimum (brute force over every placement, exact min-max assignment for each) on small cases.

Shapes: E experts, P ranks, L = E / P owned per rank.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron_lrmoe.control.balance import balance_over_replicas
from megatron_lrmoe.control.placement import (
    place_replicas,
    reference_optimal_peak,
    threshold_greedy,
)


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
    exact = balance_over_replicas(torch.tensor(load), holds)
    return int(forward.sum(0).max()), int(exact.sum(0).max()), placement


def test_placement_invariants_and_quality_against_brute_force() -> None:
    rng = random.Random(21)
    ratios = []
    for _ in range(150):
        num_ranks = rng.choice([2, 3, 4])
        local = rng.choice([1, 2]) if num_ranks < 4 else 1
        slots = rng.choice([1, 2]) if num_ranks * local <= 4 else 1
        num_experts = num_ranks * local
        load = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(num_experts)]
        greedy, exact_split, placement = _greedy_peak(load, num_ranks, slots)
        optimum = reference_optimal_peak(load, num_ranks, slots)
        fixed = max(sum(load[r * local : (r + 1) * local]) for r in range(num_ranks))
        # Invariants: slots, one replica per (expert, rank), never on the owner, positive moves,
        # the greedy's split within its threshold, never worse than fixed ownership.
        pairs = list(zip(placement.replica_expert.tolist(), placement.replica_rank.tolist()))
        assert len(set(pairs)) == len(pairs)
        assert all(g != e // local for e, g in pairs)
        counts = np.bincount(placement.replica_rank, minlength=num_ranks)
        assert (counts <= slots).all() and (placement.replica_pairs > 0).all()
        assert greedy <= placement.threshold or not pairs
        assert optimum <= exact_split <= greedy <= fixed
        ratios.append(greedy / max(optimum, 1))
    # A heuristic: often optimal, never far off on these small cases.
    assert max(ratios) <= 1.5
    assert sum(r == 1.0 for r in ratios) >= len(ratios) // 2


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
