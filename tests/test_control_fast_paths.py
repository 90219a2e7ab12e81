"""The controller's fast paths against their slow, obvious references, bit for bit, on many
random loads: the placement greedies (most slack and best fit, early exit), the local search,
the flat holders, the starting split and the exact assignment on the flat holder graph, the
single-rank cuts, the budget search (feasibility without the min-max part, cuts, the cut-guided
search under a memory budget) and the whole plan.

Shapes: P ranks, E experts, N[r, e] pairs from source r to expert e.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.control import native, placement
from megatron_lrmoe.control.assignment import PLACEMENT_TOLERANCE
from megatron_lrmoe.control.budgets import BudgetSearch
from megatron_lrmoe.control.controller import ControlPlan, plan_call
from megatron_lrmoe.control.quota import (
    largest_cap,
    quotas_np,
    reference_largest_cap,
    water_fill_np,
)
from megatron_lrmoe.control.reference import (
    reference_best_fit_greedy,
    reference_improve,
    reference_threshold_greedy,
)

from test_control_controller import COST, zipf_counts


@pytest.fixture(autouse=True)
def _python_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Python fast paths against their references (the compiled twins have their own
    comparison with these, tests/test_control_native.py): no compiled library for any caller,
    as where no C compiler is installed (``plan_call`` with ``kernels.native_planner`` off
    does not ask for it either)."""
    monkeypatch.setattr(native, "library", lambda: None)


def _random_counts(rng: random.Random, case: int) -> np.ndarray:
    num_ranks = rng.choice([2, 3, 4, 8, 16, 32])
    num_experts = num_ranks * rng.choice([1, 2, 4])
    exponent = rng.choice([0.0, 0.5, 1.0, 1.5, 3.0])
    return zipf_counts(num_ranks, num_experts, exponent, rng.choice([0, 9, 300, 4096]), case)


def _degenerate_counts(rng: random.Random, case: int) -> np.ndarray:
    """Random loads, or (one case in two) one hot expert, all experts balanced, or no pairs."""
    counts = _random_counts(rng, case)
    shape = rng.choice(["random", "random", "random", "one hot", "balanced", "zero"])
    if shape == "one hot":
        counts[:] = 0
        counts[:, rng.randrange(counts.shape[1])] = rng.choice([1, 100, 5000])
    elif shape == "balanced":
        counts[:] = rng.choice([1, 7, 300])
    elif shape == "zero":
        counts[:] = 0
    return counts


def _call(counts: np.ndarray, lrmoe: LRMoEConfig, mode: str) -> BudgetSearch:
    w = counts.sum(0)
    call = BudgetSearch(counts, w, lrmoe, COST, mode, quotas_np(w, lrmoe.keep_ratio))
    call.place()
    return call


def _degenerate_call(
    rng: random.Random, case: int, mode: str, replicas: list[int]
) -> tuple[np.ndarray, BudgetSearch]:
    """Degenerate counts and a placed controller call at a random keep ratio and replica limit."""
    counts = _degenerate_counts(rng, case)
    lrmoe = LRMoEConfig(
        keep_ratio=rng.choice([0.3, 0.5, 1.0]),
        activation_mode=mode,
        max_replicas_per_rank=rng.choice(replicas),
    )
    return counts, _call(counts, lrmoe, mode)


def _same(a: ControlPlan, b: ControlPlan) -> None:
    for f in dataclasses.fields(ControlPlan):
        if f.name in ("planner_time_s", "memory_builder", "source_split"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name
    for name in ("source_quota", "forward_assignment", "backward_assignment"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
    if a.memory is not None:
        for g in dataclasses.fields(a.memory):
            assert torch.equal(getattr(a.memory, g.name), getattr(b.memory, g.name)), g.name


def _reference_greedies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both greedies of the placement search replaced by their slow references."""
    monkeypatch.setattr(placement, "_greedy", lambda *a: reference_threshold_greedy(*a[:5]))
    monkeypatch.setattr(placement, "_best_fit", lambda *a: reference_best_fit_greedy(*a[:5]))


@pytest.mark.parametrize("best_fit", [False, True])
def test_threshold_greedy_matches_reference(best_fit: bool) -> None:
    fast, slow = (
        (placement.best_fit_greedy, reference_best_fit_greedy)
        if best_fit
        else (placement.threshold_greedy, reference_threshold_greedy)
    )
    rng = random.Random(5)
    outcomes = {True: 0, False: 0}
    for case in range(400):
        counts = _random_counts(rng, case)
        num_ranks, num_experts = counts.shape
        local = num_experts // num_ranks
        load = counts.sum(0)
        if rng.random() < 0.1:
            load[:] = 0
            load[rng.randrange(num_experts)] = 1000  # one expert takes everything
        by_rank = load.reshape(num_ranks, local)
        rank_load = by_rank.sum(1).tolist()
        hot = np.argsort(-by_rank, axis=1, kind="stable") + np.arange(num_ranks)[:, None] * local
        low = -(-sum(rank_load) // num_ranks)
        for threshold in {low - 1, low, low + 3, (low + max(rank_load)) // 2, max(rank_load)}:
            if rng.random() < 0.5:
                slots = [rng.choice([0, 1, 2, 3]) for _ in range(num_ranks)]
            else:
                slots = [rng.choice([1, 2])] * num_ranks
            args = (load.tolist(), rank_load, hot.tolist(), threshold, slots)
            moves = fast(*args)
            assert moves == slow(*args)
            outcomes[moves is None] += 1
    assert min(outcomes.values()) > 100  # both regimes covered


def test_place_replicas_same_with_the_reference_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(6)
    cases = []
    for case in range(150):
        counts = _random_counts(rng, case)
        slots = rng.choice([1, 2, 3, list(range(counts.shape[0]))])
        cases.append((counts.sum(0), counts.shape[0], slots, rng.choice([0.0, 1 / 512, 0.05])))
    fast = [placement.place_replicas(*c) for c in cases]
    _reference_greedies(monkeypatch)
    replicated = 0
    for c, got in zip(cases, fast):
        ref = placement.place_replicas(*c)
        assert got.threshold == ref.threshold and got.greedy_runs == ref.greedy_runs
        for name in ("replica_expert", "replica_rank", "replica_pairs"):
            assert np.array_equal(getattr(got, name), getattr(ref, name)), name
        replicated += got.replica_expert.size > 0
    assert replicated > 50


def test_improve_matches_reference() -> None:
    rng = random.Random(3)
    changed = 0
    for case in range(150):
        num_ranks = rng.choice([2, 3, 4, 5])
        num_experts = num_ranks * (rng.choice([1, 2]) if num_ranks < 5 else 1)
        if rng.random() < 0.5:
            load = [rng.choice([0, 1, 3, 10, 40, 200]) for _ in range(num_experts)]
        else:
            exponent = rng.choice([0.5, 1.0, 1.5, 3.0])
            counts = zipf_counts(num_ranks, num_experts, exponent, rng.choice([9, 300]), case)
            load = counts.sum(0).tolist()
        if rng.random() < 0.3:
            slots = [rng.choice([0, 1, 2]) for _ in range(num_ranks)]
        else:
            slots = [rng.choice([1, 2])] * num_ranks
        low = max(-(-sum(load) // num_ranks), max(-(-x // num_ranks) for x in load))
        greedy = placement.place_replicas(np.array(load, dtype=np.int64), num_ranks, slots)
        start = list(
            zip(
                greedy.replica_expert.tolist(),
                greedy.replica_rank.tolist(),
                greedy.replica_pairs.tolist(),
            )
        )
        for moves in (start, []):
            replicas = sorted((e, g) for e, g, _ in moves)
            args = (load, num_ranks, slots, moves, low, low + rng.choice([0, 0, 1, 5]))
            got = placement._improve(*args)
            assert got == reference_improve(*args)
            changed += got[1] != replicas
    assert changed > 60


def test_place_replicas_same_with_the_reference_search(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(9)
    cases = []
    for case in range(100):
        num_ranks = rng.choice([2, 3, 4, 5])
        exponent = rng.choice([0.5, 1.0, 1.5, 3.0])
        counts = zipf_counts(num_ranks, num_ranks * rng.choice([1, 2]), exponent, 300, case)
        slots = rng.choice([1, 1, 2, [0, 1, 2, 1, 1][:num_ranks]])
        cases.append((counts.sum(0), num_ranks, slots))
    fast = [placement.place_replicas(*c) for c in cases]
    monkeypatch.setattr(placement, "_improve", reference_improve)
    improved = 0
    for c, got in zip(cases, fast):
        ref = placement.place_replicas(*c)
        assert got.threshold == ref.threshold and got.changes == ref.changes
        for name in ("replica_expert", "replica_rank", "replica_pairs"):
            assert np.array_equal(getattr(got, name), getattr(ref, name)), name
        improved += got.changes > 0
    assert improved >= 10


def test_largest_cap_matches_reference() -> None:
    rng = np.random.default_rng(7)
    bounded = 0
    for case in range(2000):
        num = int(rng.integers(1, 12)) if case % 4 else int(rng.integers(40, 120))
        uncapped = rng.integers(0, 30, num)
        if rng.random() < 0.7:
            outside = rng.integers(0, 35, num)
        else:  # recompute mode's cuts: nothing or everything can leave
            outside = np.where(rng.random(num) < 0.5, 0, uncapped + 1)
        room = int(rng.integers(-3, 60))
        cap = largest_cap(uncapped, outside, room)
        assert cap == reference_largest_cap(uncapped, outside, room)
        bounded += cap is not None and cap >= 0
    assert bounded > 500


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_holders_match_the_placement(mode: str) -> None:
    rng = random.Random(8)
    checked = 0
    for case in range(120):
        counts = _random_counts(rng, case)
        lrmoe = LRMoEConfig(keep_ratio=rng.choice([0.3, 0.5, 1.0]), max_replicas_per_rank=2)
        call = _call(counts, lrmoe, mode)
        holders = call.holders
        if not len(holders):
            continue
        checked += 1
        # Flat holders: the owner plus the replicas of every replicated expert, ascending rank,
        # the forward split summing to the expert's pairs; exactly the replicas the plan holds.
        owner = call.owner
        for e, ranks, forward in zip(holders.experts, holders.ranks, holders.forward_lists):
            assert ranks == sorted(ranks) and owner[e] in ranks and len(ranks) > 1
            assert sum(forward) == call.w[e]
            assert all(a > 0 for g, a in zip(ranks, forward) if g != owner[e])
        held = np.argwhere(call.holds)
        replicas = sorted(map(tuple, held[held[:, 1] != owner[held[:, 0]]].tolist()))
        flat = zip(holders.expert.tolist(), holders.rank.tolist())
        assert replicas == sorted((e, g) for e, g in flat if g != owner[e])
        # Built in Python from the moves: the same entries as the numpy reference, and the
        # host lists the holder graph reads match the arrays.
        tolerance = PLACEMENT_TOLERANCE
        placement_ = placement.place_replicas(call.w, counts.shape[0], 2, tolerance)
        reference = call.reference_holders(placement_)
        for name in ("expert", "rank", "forward", "bounds", "experts", "item"):
            assert np.array_equal(getattr(holders, name), getattr(reference, name)), name
        assert holders.rank_list == reference.rank.tolist()
        assert holders.bounds_list == reference.bounds.tolist()
        assert holders.forward_list == reference.forward.tolist()
    assert checked > 40


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_start_and_assignment_match_the_list_references(mode: str) -> None:
    """The flat starting split (array operations) and the exact assignment on the holder graph
    against the per-item list versions, for uncapped and capped quotas, with and without rank
    caps (caps of 0 included): the same entries, loads and cuts."""
    rng = random.Random(12)
    compared = {"assignment": 0, "infeasible": 0, "cut": 0}
    empty_owner = 0
    for case in range(150):
        counts, call = _degenerate_call(rng, case, mode, [1, 2, 3])
        num_ranks = counts.shape[0]
        empty_owner += bool((call.holders.forward == 0).any())  # the start skips it in save
        for quota in (call.q0, water_fill_np(call.q0, int(call.q0.max(initial=0)) // 3)):
            base, initial = call.start(quota)
            ref_base, ref_initial = call.reference_start(quota)
            assert base == ref_base and initial == [a for row in ref_initial for a in row]
            even = -(-int(quota.sum()) // num_ranks)
            tight = [even + rng.randint(0, 5) for _ in range(num_ranks)]
            for caps in (None, [0] * num_ranks, tight):
                got = call.min_max(quota, caps)
                assert got == call.reference_min_max(quota, caps)
                compared["assignment" if got is not None else "infeasible"] += 1
                if caps is not None:
                    cut = call.caps_cut(quota, caps)
                    assert cut == call.reference_caps_cut(quota, caps)
                    compared["cut"] += cut is not None
    assert min(compared.values()) > 50
    assert empty_owner > 0


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_single_rank_load_matches_the_dense_cuts(mode: str) -> None:
    rng = random.Random(13)
    loaded = 0
    for case in range(150):
        counts, call = _degenerate_call(rng, case, mode, [0, 1, 2])
        num_ranks, num_experts = counts.shape
        owned = call.w.reshape(num_ranks, num_experts // num_ranks).sum(1)
        assert np.array_equal(call.per_owner(call.w), owned)
        for cap in (0, 1, int(call.q0.max(initial=0)) // 2, None):
            quota = water_fill_np(call.q0, cap)
            got = call.single_rank_load(quota)
            assert np.array_equal(got, call.reference_single_rank_load(quota))
            loaded += bool(got.any())
        # What the holders outside a rank set can take (the budget search's cuts), for the
        # empty set, every rank, one rank and random sets.
        masks = [np.zeros(num_ranks, bool), np.ones(num_ranks, bool), np.arange(num_ranks) == 0]
        masks += [np.array([rng.random() < 0.4 for _ in range(num_ranks)]) for _ in range(3)]
        for inside in masks:
            assert np.array_equal(call.outside(inside), call.reference_outside(inside))
    assert loaded > 200


def _budget_config(rng: random.Random, counts: np.ndarray, mode: str) -> LRMoEConfig:
    free = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=2), COST)
    peak = int(free.memory.budgeted_bytes.max())
    exchange = int(counts.sum(1).max()) * COST.row_bytes
    budgets = rng.choice(["memory", "memory", "exchange", "both"])
    return LRMoEConfig(
        keep_ratio=rng.choice([0.3, 0.5, 1.0]),
        scope=rng.choice(["local", "local", "global"]),
        activation_mode=mode,
        max_replicas_per_rank=rng.choice([1, 2]),
        memory_budget_bytes=(
            None if budgets == "exchange" else int(peak * rng.choice([0.5, 0.8, 0.9, 1.0]))
        ),
        exchange_budget_bytes=(
            None if budgets == "memory" else int(exchange * rng.choice([0.1, 0.3, 0.6]))
        ),
    )


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_fits_matches_the_whole_capped_plan(mode: str) -> None:
    rng = random.Random(9)
    answers = {True: 0, False: 0}
    for case in range(80):
        counts = _random_counts(rng, 100 + case)
        call = _call(counts, _budget_config(rng, counts, mode), mode)
        top = int(call.q0.max(initial=0))
        for cap in sorted({0, 1, top // 3, top // 2, top - 1, top, rng.randrange(top + 1)}):
            quota = water_fill_np(call.q0, cap)
            fits = call.fits(quota)  # also collects cuts that later trials test first
            assert fits == call.reference_fits(quota)
            answers[fits] += 1
    assert min(answers.values()) > 50


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_memory_cap_search_matches_bisection(mode: str) -> None:
    rng = random.Random(10)
    searched = 0
    for case in range(120):
        num_ranks = rng.choice([2, 4, 8, 16, 32])
        exponent = rng.choice([0.0, 0.5, 1.0, 1.5])
        counts = zipf_counts(num_ranks, num_ranks * rng.choice([1, 2, 4]), exponent, 4096, case)
        lrmoe = LRMoEConfig(
            keep_ratio=rng.choice([0.3, 0.5, 1.0]),
            activation_mode=mode,
            max_replicas_per_rank=rng.choice([1, 2]),
        )
        free = plan_call(counts, 0, lrmoe, COST).memory.budgeted_bytes.max()
        lrmoe = dataclasses.replace(
            lrmoe, memory_budget_bytes=int(free * rng.uniform(0.7, 0.97))
        )
        call = _call(counts, lrmoe, mode)
        if call.fits(call.q0) or not call.fits(np.zeros_like(call.q0)):
            continue  # the search runs only between a cap that fits and one that does not
        searched += 1
        assert call.memory_cap() == _call(counts, lrmoe, mode).bisect_cap()
    assert searched > 40


def test_plans_match_the_reference_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    cases = []
    for case in range(160):
        counts = _random_counts(rng, 300 + case) if case < 120 else _degenerate_counts(rng, case)
        mode = rng.choice(["save", "recompute", "auto"])
        if rng.random() < 0.7:
            lrmoe = _budget_config(rng, counts, "save" if mode == "auto" else mode)
            lrmoe = dataclasses.replace(lrmoe, activation_mode=mode)
            if case >= 140:  # a budget of 0: nothing fits, the plan keeps no pair
                lrmoe = dataclasses.replace(lrmoe, memory_budget_bytes=0)
        else:
            lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode=mode, max_replicas_per_rank=2)
        cases.append((counts, lrmoe, rng.random() < 0.2))
    fast = [plan_call(c, 0, lrmoe, COST, exact_forward=x) for c, lrmoe, x in cases]
    _reference_greedies(monkeypatch)
    monkeypatch.setattr(BudgetSearch, "fits", BudgetSearch.reference_fits)
    monkeypatch.setattr(BudgetSearch, "memory_cap", BudgetSearch.bisect_cap)
    monkeypatch.setattr(BudgetSearch, "min_max", BudgetSearch.reference_min_max)
    monkeypatch.setattr(BudgetSearch, "caps_cut", BudgetSearch.reference_caps_cut)
    monkeypatch.setattr(BudgetSearch, "single_rank_load", BudgetSearch.reference_single_rank_load)
    trimmed = 0
    for (counts, lrmoe, exact), got in zip(cases, fast):
        _same(got, plan_call(counts, 0, lrmoe, COST, exact_forward=exact))
        trimmed += got.trimmed_pairs > 0
    assert trimmed > 30
