"""Tests for megatron_lrmoe.control.quota and the exact balance reference (control/reference.py):
quotas, their split over sources, the min-max assignment over replicas against brute force.

Shapes: E experts, P ranks.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_lrmoe.control.quota import expert_quotas, split_np, split_quota_over_sources
from megatron_lrmoe.control.reference import reference_min_max_balance

# --------------------------------------------------------------------------------------------- #
# Quotas
# --------------------------------------------------------------------------------------------- #


def test_expert_quotas_hand_cases() -> None:
    n = torch.tensor([10, 0, 7, 30, 1])
    assert expert_quotas(n, 0.3).tolist() == [3, 0, 3, 9, 1]
    assert expert_quotas(n, 1.0).tolist() == n.tolist()
    assert expert_quotas(n, 0.0).tolist() == [0] * 5
    assert expert_quotas(n, 0.5).tolist() == [5, 0, 4, 15, 1]
    # Float noise in the ratio itself never adds a pair.
    assert expert_quotas(torch.tensor([10]), 1 - 0.7).tolist() == [3]
    assert expert_quotas(torch.tensor([10]), 0.1 + 0.2).tolist() == [3]
    assert expert_quotas(torch.tensor([30]), 0.1).tolist() == [3]
    assert expert_quotas(torch.zeros(0, dtype=torch.int64), 0.5).shape == (0,)
    assert expert_quotas(n, 0.5).dtype == torch.int64


def test_expert_quotas_match_exact_decimal_arithmetic() -> None:
    n = torch.arange(0, 2001)
    for digits in range(0, 101):
        ratio = digits / 100
        expected = [math.ceil(Fraction(digits, 100) * int(v)) for v in n]
        assert expert_quotas(n, ratio).tolist() == expected, ratio


def test_expert_quotas_validate() -> None:
    for bad in (-0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            expert_quotas(torch.tensor([3]), bad)
    with pytest.raises(ValueError):
        expert_quotas(torch.tensor([3, -1]), 0.5)
    with pytest.raises(ValueError):
        expert_quotas(torch.tensor([3.0]), 0.5)


# --------------------------------------------------------------------------------------------- #
# Split over sources
# --------------------------------------------------------------------------------------------- #


def _reference_split(n: list[list[int]], quota: list[int]) -> list[list[int]]:
    """Largest remainder with Fractions, expert by expert, ties to the lower source rank."""
    num_sources = len(n)
    out = [[0] * len(quota) for _ in range(num_sources)]
    for e, q in enumerate(quota):
        total = sum(n[r][e] for r in range(num_sources))
        if total == 0:
            continue
        shares = [Fraction(q * n[r][e], total) for r in range(num_sources)]
        for r in range(num_sources):
            out[r][e] = math.floor(shares[r])
        left = q - sum(out[r][e] for r in range(num_sources))
        ranked = sorted(range(num_sources), key=lambda r: (-(shares[r] - math.floor(shares[r])), r))
        for r in ranked[:left]:
            out[r][e] += 1
    return out


def test_split_hand_cases() -> None:
    n = torch.tensor([[3, 0, 5, 0], [3, 2, 5, 0], [4, 1, 0, 0]])
    quota = torch.tensor([5, 1, 9, 0])
    # Expert 0: shares 1.5, 1.5, 2 -> the tie goes to rank 0. Expert 1: 0, 2/3, 1/3.
    assert split_quota_over_sources(n, quota).tolist() == [
        [2, 0, 5, 0],
        [1, 1, 4, 0],
        [2, 0, 0, 0],
    ]
    # Many equal remainders across many sources: the lowest ranks win every tie.
    ones = torch.ones(64, 3, dtype=torch.int64)
    split = split_quota_over_sources(ones, torch.tensor([10, 0, 63]))
    assert split[:, 0].tolist() == [1] * 10 + [0] * 54
    assert split[:, 2].tolist() == [1] * 63 + [0]
    full = split_quota_over_sources(n, n.sum(0))
    assert torch.equal(full, n)
    assert split_quota_over_sources(n, torch.zeros(4, dtype=torch.int64)).sum() == 0


def test_split_invariants_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(300):
        num_sources, num_experts = rng.randint(1, 8), rng.randint(1, 12)
        n = [
            [rng.choice([0, 0, 1, 2, 3, 7, 50, 1000]) for _ in range(num_experts)]
            for _ in range(num_sources)
        ]
        totals = [sum(n[r][e] for r in range(num_sources)) for e in range(num_experts)]
        quota = [rng.randint(0, t) for t in totals]
        got = split_quota_over_sources(torch.tensor(n), torch.tensor(quota))
        assert got.dtype == torch.int64 and got.shape == (num_sources, num_experts)
        assert got.sum(0).tolist() == quota
        assert bool((got >= 0).all()) and bool((got <= torch.tensor(n)).all())
        for e in range(num_experts):
            for r in range(num_sources):
                if totals[e]:
                    assert abs(Fraction(quota[e] * n[r][e], totals[e]) - int(got[r, e])) < 1
        assert got.tolist() == _reference_split(n, quota)


def test_split_validates() -> None:
    with pytest.raises(ValueError, match="expert 1"):
        split_quota_over_sources(torch.tensor([[1, 2], [1, 0]]), torch.tensor([2, 3]))
    with pytest.raises(ValueError):
        split_quota_over_sources(torch.tensor([[1, 2]]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError):
        split_quota_over_sources(torch.tensor([[1, -2]]), torch.tensor([1, 0]))


def test_split_np_one_source_equals_the_reference() -> None:
    """One source (EP 1) takes split_np's shortcut (the quota is the source's share): the same
    int64 [1, E] as the validated split, zero-pair experts and quota 0 / all included."""
    rng = random.Random(5)
    for _ in range(100):
        n = np.array([[rng.choice([0, 0, 1, 2, 7, 50, 1000]) for _ in range(rng.randint(1, 40))]])
        quota = np.array([rng.randint(0, int(t)) for t in n[0]], dtype=np.int64)
        got = split_np(n, quota)
        want = split_quota_over_sources(torch.from_numpy(n), torch.from_numpy(quota))
        assert got.dtype == np.int64 and got.shape == n.shape
        assert got.tolist() == want.tolist()
        got[0, 0] += 1  # a copy, not a view of the quota
        assert quota.tolist() == want[0].tolist()


def test_call_plan_count_views_match_torch() -> None:
    """CallPlan's send / receive counts, split sizes and rows per local expert (numpy views)
    equal the torch expressions over the counts, for every rank, with zero rows and columns;
    send_counts shares the counts' memory (a view), recv_counts is its own copy."""
    from megatron_lrmoe.config import LRMoEConfig
    from megatron_lrmoe.control.plan import CallPlan

    rng = np.random.default_rng(2)
    for p, nle in ((1, 4), (2, 16), (3, 2), (4, 5)):
        counts = torch.from_numpy(rng.integers(0, 9, (p, p * nle)))
        counts[:, 0] = 0
        counts[-1] = 0
        for rank in range(p):
            plan = CallPlan.build(counts, rank, nle, LRMoEConfig(keep_ratio=0.5), 1, ())
            local = slice(rank * nle, (rank + 1) * nle)
            send = counts[rank].reshape(p, nle)
            recv = counts[:, local].contiguous()
            assert plan.send_counts.dtype == plan.recv_counts.dtype == torch.int64
            assert torch.equal(plan.send_counts, send) and torch.equal(plan.recv_counts, recv)
            assert plan.send_splits == send.sum(1).tolist()
            assert plan.recv_splits == recv.sum(1).tolist()
            assert torch.equal(plan.tokens_per_local_expert, recv.sum(0))
            assert plan.recv_counts.is_contiguous()
            assert plan.send_counts.data_ptr() == plan.global_counts[rank].data_ptr()


# --------------------------------------------------------------------------------------------- #
# Replica balancing
# --------------------------------------------------------------------------------------------- #


def _peak(assignment: torch.Tensor, base: list[int]) -> int:
    return max(b + int(a) for b, a in zip(base, assignment.sum(0).tolist())) if base else 0


def _check_assignment(assignment: torch.Tensor, load: list[int], admissible: torch.Tensor) -> None:
    assert assignment.dtype == torch.int64 and assignment.shape == admissible.shape
    assert assignment.sum(1).tolist() == load
    assert bool((assignment >= 0).all())
    assert bool((assignment[~admissible] == 0).all())


def _brute_force_peak(load: list[int], admissible: list[list[bool]], base: list[int]) -> int:
    """Minimum peak over every integer assignment (tiny cases only)."""
    num_ranks = len(base)
    options = []
    for e, amount in enumerate(load):
        allowed = [r for r in range(num_ranks) if admissible[e][r]]
        rows = []
        for split in itertools.product(range(amount + 1), repeat=len(allowed)):
            if sum(split) == amount:
                row = [0] * num_ranks
                for r, x in zip(allowed, split):
                    row[r] = x
                rows.append(row)
        options.append(rows)
    best = None
    for choice in itertools.product(*options):
        peak = max(base[r] + sum(row[r] for row in choice) for r in range(num_ranks))
        best = peak if best is None else min(best, peak)
    return best


def _cut_bound_peak(load: list[int], admissible: list[list[bool]], base: list[int]) -> int:
    """Optimum peak by max-flow/min-cut duality, enumerating rank subsets (P <= 10 or so).

    For every non-empty set R of ranks, the experts confined to R must fit in it:
    ``T >= (load confined to R + base over R) / |R|``; the largest bound is attained.
    """
    num_ranks = len(base)
    best = 0
    for mask in range(1, 1 << num_ranks):
        ranks = [r for r in range(num_ranks) if mask >> r & 1]
        confined = sum(
            amount
            for e, amount in enumerate(load)
            if all(mask >> r & 1 for r in range(num_ranks) if admissible[e][r])
        )
        best = max(best, -(-(confined + sum(base[r] for r in ranks)) // len(ranks)))
    return best


def _random_admissible(rng: random.Random, num_experts: int, num_ranks: int, p: float):
    rows = []
    for _ in range(num_experts):
        row = [rng.random() < p for _ in range(num_ranks)]
        row[rng.randrange(num_ranks)] = True  # the owner
        rows.append(row)
    return rows


def test_balance_matches_brute_force_on_tiny_cases() -> None:
    rng = random.Random(1)
    for _ in range(150):
        num_experts, num_ranks = rng.randint(1, 3), rng.randint(1, 3)
        load = [rng.randint(0, 4) for _ in range(num_experts)]
        admissible = _random_admissible(rng, num_experts, num_ranks, 0.5)
        base = [rng.randint(0, 3) for _ in range(num_ranks)]
        adm = torch.tensor(admissible)
        best = _brute_force_peak(load, admissible, base)
        assert _cut_bound_peak(load, admissible, base) == best  # the oracle used below
        exact = reference_min_max_balance(torch.tensor(load), adm, torch.tensor(base))
        _check_assignment(exact, load, adm)
        assert _peak(exact, base) == best


def test_balance_is_optimal_on_random_larger_cases() -> None:
    rng = random.Random(2)
    for _ in range(40):
        num_experts, num_ranks = rng.randint(4, 48), rng.randint(2, 8)
        load = [rng.choice([0, 1, 5, 20, 300, 1000]) for _ in range(num_experts)]
        admissible = _random_admissible(rng, num_experts, num_ranks, rng.choice([0.1, 0.3, 0.8]))
        base = [rng.choice([0, 0, 10, 500]) for _ in range(num_ranks)]
        adm = torch.tensor(admissible)
        exact = reference_min_max_balance(torch.tensor(load), adm, torch.tensor(base))
        _check_assignment(exact, load, adm)
        assert _peak(exact, base) == _cut_bound_peak(load, admissible, base)
        # Deterministic: the same inputs give the same assignment.
        again = reference_min_max_balance(torch.tensor(load), adm, torch.tensor(base))
        assert torch.equal(exact, again)


def test_balance_on_simple_cases() -> None:
    # Every expert everywhere: the ranks end within one unit of each other.
    rng = random.Random(3)
    for _ in range(30):
        num_experts, num_ranks = rng.randint(1, 20), rng.randint(1, 6)
        load = torch.tensor([rng.randint(0, 50) for _ in range(num_experts)])
        adm = torch.ones(num_experts, num_ranks, dtype=torch.bool)
        exact = reference_min_max_balance(load, adm)
        assert _peak(exact, [0] * num_ranks) == -(-int(load.sum()) // num_ranks)
    # No choice at all (each expert on its owner only): the owner placement.
    load = torch.tensor([4, 0, 7, 2])
    owner = torch.eye(4, dtype=torch.bool)
    assert torch.equal(reference_min_max_balance(load, owner), torch.diag(load))
    # The flexible expert leaves the rank the rigid one needs (spread evenly, it would end at 3).
    adm = torch.tensor([[True, True], [True, False]])
    assert reference_min_max_balance(torch.tensor([2, 2]), adm).tolist() == [[0, 2], [2, 0]]


def test_balance_with_base_load_and_edge_cases() -> None:
    load = torch.tensor([6])
    adm = torch.tensor([[True, True, True]])
    # Levels the totals at 3: the unique optimum.
    assert reference_min_max_balance(load, adm, torch.tensor([2, 0, 1])).tolist() == [[1, 3, 2]]
    # A base load above everything else sets the peak; the rest only has to stay below it.
    assert _peak(reference_min_max_balance(load, adm, torch.tensor([5, 0, 1])), [5, 0, 1]) == 5
    nothing = reference_min_max_balance(torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool))
    assert nothing.sum() == 0
    empty = reference_min_max_balance(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.bool)
    )
    assert empty.shape == (0, 3)
    with pytest.raises(ValueError, match="expert 1"):
        reference_min_max_balance(
            torch.tensor([1, 1]), torch.tensor([[True, False], [False, False]])
        )
    with pytest.raises(ValueError):
        reference_min_max_balance(torch.tensor([1]), torch.tensor([[True]]), torch.tensor([1, 2]))
