"""The planner's compiled twins (control/_native.c via control/native.py) against the Python
path, bit for bit: the placement greedies and threshold search, the holder graph's exact
min-max and cuts, the controller's placement / starting split / assignment / cuts, and whole
plans (P 2-64, Zipf 0-2.5, zero loads, one hot expert, budgets none / memory / exchange / both /
zero, save / recompute / auto, scopes local / global). Also the fallback: the config's switch
(``KernelOptions(native_planner=False)``) and a library that cannot be built both give the
Python planner, with one warning for the latter. Everything skips when no C compiler is
installed.

Shapes: P ranks, E experts, N[r, e] pairs from source r to expert e.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from pathlib import Path

import numpy as np
import pytest

from megatron_lrmoe import KernelOptions, LRMoEConfig
from megatron_lrmoe.control import native, placement
from megatron_lrmoe.control.budgets import BudgetSearch
from megatron_lrmoe.control.balance import HolderGraph
from megatron_lrmoe.control.controller import ControlPlan, plan_call
from megatron_lrmoe.control.quota import quotas_np
from megatron_lrmoe.control.slots import LinearSlots

from test_control_balance import _graph_case
from test_control_controller import COST, zipf_counts
from test_control_fast_paths import _budget_config, _same


def _has_compiler() -> bool:
    try:
        native.compiler()
    except RuntimeError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_compiler(), reason="no C compiler (cc, gcc, $CC)")


@pytest.fixture()
def lib():
    """The compiled library (built into the usual cache on first use)."""
    found = native.library()
    assert found is not None, "a C compiler exists, so the library must build"
    return found


def _python(monkeypatch: pytest.MonkeyPatch, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the Python path (no library for any caller, as without a C
    compiler), native again after."""
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return fn(*args, **kwargs)


def _counts(rng: random.Random, case: int) -> np.ndarray:
    """Zipf 0-2.5 loads at P 2-64 with 1-4 experts per rank; one case in four degenerate: no
    pairs, one hot expert, or every count equal."""
    num_ranks = rng.choice([2, 3, 4, 5, 8, 16, 32, 64])
    num_experts = num_ranks * rng.choice([1, 2, 4])
    exponent = rng.choice([0.0, 0.5, 1.0, 1.5, 2.5])
    counts = zipf_counts(num_ranks, num_experts, exponent, rng.choice([0, 9, 300, 4096]), case)
    shape = rng.choice(["random"] * 6 + ["zero", "one hot", "balanced"])
    if shape == "zero":
        counts[:] = 0
    elif shape == "one hot":
        counts[:] = 0
        counts[:, rng.randrange(num_experts)] = rng.choice([1, 100, 5000])
    elif shape == "balanced":
        counts[:] = rng.choice([1, 7, 300])
    return counts


# --------------------------------------------------------------------------------------------- #
# Placement


@pytest.mark.parametrize("best_fit", [False, True])
def test_greedy_runs_match_python(lib, best_fit: bool) -> None:
    python = placement.best_fit_greedy if best_fit else placement.threshold_greedy
    compiled = native.best_fit_greedy if best_fit else native.threshold_greedy
    rng = random.Random(21)
    outcomes = {True: 0, False: 0}
    for case in range(300):
        counts = _counts(rng, case)
        num_ranks, num_experts = counts.shape
        local = num_experts // num_ranks
        load = counts.sum(0)
        by_rank = load.reshape(num_ranks, local)
        rank_load = by_rank.sum(1).tolist()
        hot = np.argsort(-by_rank, axis=1, kind="stable") + np.arange(num_ranks)[:, None] * local
        low = -(-sum(rank_load) // num_ranks)
        for threshold in {low - 1, low, low + 3, (low + max(rank_load)) // 2, max(rank_load)}:
            slots = [rng.choice([0, 1, 2, 3]) for _ in range(num_ranks)]
            if rng.random() < 0.5:
                slots = [rng.choice([1, 2])] * num_ranks
            args = (load.tolist(), rank_load, hot.tolist(), threshold, slots)
            moves = python(*args)
            assert compiled(lib, *args) == moves
            outcomes[moves is None] += 1
    assert min(outcomes.values()) > 100  # both regimes covered


def test_place_replicas_matches_python(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole search (and the local search after it on small layers) with fixed slots, per
    rank slots and the controller's memory-budget rule (:class:`LinearSlots`)."""
    rng = random.Random(22)
    replicated = 0
    for case in range(600):
        load = _counts(rng, case).sum(0)
        num_ranks = int(rng.choice([d for d in (2, 3, 4, 5, 8, 16, 32, 64) if load.size % d == 0]))
        choice = rng.choice(["int", "list", "linear"])
        if choice == "int":
            slots = rng.choice([0, 1, 2, 3])
        elif choice == "list":
            slots = [rng.choice([0, 1, 2]) for _ in range(num_ranks)]
        else:
            room = np.array([rng.randint(-5, 60) for _ in range(num_ranks)], dtype=np.int64)
            limit = rng.choice([0, 1, 2, 3])
            slots = LinearSlots(1000 * room, rng.choice([0, 1, 3]), 1000, limit)
        tolerance = rng.choice([0.0, 1 / 512, 0.05])
        got = placement.place_replicas(load, num_ranks, slots, tolerance)
        args = (load, num_ranks, slots, tolerance)
        assert got == _python(monkeypatch, placement.place_replicas, *args)
        replicated += bool(got.moves)
    assert replicated > 200


def test_linear_slots_match_the_budget_formula() -> None:
    """The slots rule the native search evaluates (:class:`LinearSlots`, from
    ``Assignment.slot_rule``) is the memory budget's: what the budget leaves after the source rows
    and ``T`` pairs of saved activations, in whole replicas, at most the limit."""
    rng = random.Random(23)
    linear = 0
    for case in range(40):
        counts = _counts(rng, case)
        mode = rng.choice(["save", "recompute"])
        lrmoe = dataclasses.replace(_budget_config(rng, counts, mode), activation_mode=mode)
        w = counts.sum(0)
        call = BudgetSearch(counts, w, lrmoe, COST, mode, quotas_np(w, 0.5))
        rule = call.slot_rule()
        linear += isinstance(rule, LinearSlots)
        for threshold in (0, 1, 100, 5000, 10**6):
            expected = [lrmoe.max_replicas_per_rank] * counts.shape[0]
            if lrmoe.memory_budget_bytes is not None:
                left = (
                    lrmoe.memory_budget_bytes
                    - COST.source_saved_bytes(mode, keeps_all=lrmoe.is_exact) * counts.sum(1)
                    - COST.expert_saved_bytes(mode) * threshold
                )
                expected = [
                    min(max(int(x) // COST.replica_bytes, 0), lrmoe.max_replicas_per_rank)
                    for x in left
                ]
            assert call.slots(threshold) == expected
            if isinstance(rule, LinearSlots):
                assert rule(threshold) == expected
    assert linear > 20


# --------------------------------------------------------------------------------------------- #
# The exact assignment


@pytest.mark.parametrize(
    "seed, kind",
    list(enumerate(["general", "one hot item", "balanced", "zero loads", "no items", "one rank"])),
)
def test_holder_graph_matches_python(lib, seed: int, kind: str) -> None:
    rng = random.Random(200 + seed)
    outcomes = {"solved": 0, "infeasible": 0, "cut": 0}
    for _ in range(150):
        base, amounts, holders, initial, edge = _graph_case(rng, kind)
        num_ranks = len(base)
        rank = [g for ranks in holders for g in ranks]
        bounds = list(itertools.accumulate([0] + [len(ranks) for ranks in holders]))
        room = None if edge is None else [c for row in edge for c in row]
        graph = HolderGraph(num_ranks, rank, bounds, room)
        flat = [a for row in initial for a in row]
        total = sum(base) + sum(amounts)
        cap_choice = rng.choice(["none", "tight", "loose", "zero", "some none"])
        caps = None
        if cap_choice == "zero":
            caps = [0] * num_ranks
        elif cap_choice != "none":
            slack = total // num_ranks + (3 if cap_choice == "tight" else total)
            caps = [b + rng.randint(0, slack) for b in base]
            if cap_choice == "some none":
                caps = [None if rng.random() < 0.3 else c for c in caps]
        expected = graph.min_max(base, flat, caps)
        assert native.min_max(lib, num_ranks, rank, bounds, room, base, flat, caps) == expected
        outcomes["solved" if expected is not None else "infeasible"] += 1
        if caps is not None and None not in caps:
            cut = graph.caps_cut(base, flat, caps)
            assert native.caps_cut(lib, num_ranks, rank, bounds, room, base, flat, caps) == cut
            outcomes["cut"] += cut is not None
    assert outcomes["solved"] > 50
    if kind in ("general", "one hot item"):
        assert outcomes["infeasible"] > 5 and outcomes["cut"] > 5


# --------------------------------------------------------------------------------------------- #
# The controller's steps


def _call(counts: np.ndarray, lrmoe: LRMoEConfig, mode: str) -> BudgetSearch:
    w = counts.sum(0)
    call = BudgetSearch(counts, w, lrmoe, COST, mode, quotas_np(w, lrmoe.keep_ratio))
    call.place()
    return call


_PLACED = (
    "threshold",
    "forward_load",
    "holds",
    "rigid",
    "forward_rank_load",
    "replicas_per_rank",
    "fixed_rank_load",
)


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_controller_steps_match_python(lib, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Placement arrays and holders, the starting split, the backward assignment with and
    without rank caps, and the cuts of the caps, each native against Python on the same call."""
    rng = random.Random(24 if mode == "save" else 25)
    checked = {"replicas": 0, "capped": 0, "cut": 0}
    for case in range(150):
        counts = _counts(rng, case)
        lrmoe = LRMoEConfig(
            keep_ratio=rng.choice([0.3, 0.5, 1.0]),
            activation_mode=mode,
            max_replicas_per_rank=rng.choice([0, 1, 2]),
        )
        if rng.random() < 0.4:
            lrmoe = dataclasses.replace(_budget_config(rng, counts, mode), activation_mode=mode)
        fast = _call(counts, lrmoe, mode)
        slow = _python(monkeypatch, _call, counts, lrmoe, mode)
        assert fast.lib is not None and slow.lib is None
        for name in _PLACED:
            x, y = getattr(fast, name), getattr(slow, name)
            assert np.array_equal(x, y) and np.asarray(x).dtype == np.asarray(y).dtype, name
        for name in ("expert", "rank", "forward", "bounds", "experts"):
            assert np.array_equal(getattr(fast.holders, name), getattr(slow.holders, name)), name
        checked["replicas"] += len(fast.holders) > 0
        # The starting split (C) against Assignment.start (numpy).
        quota = fast.q0
        base, initial = slow.start(quota)
        got_base = np.empty(counts.shape[0], dtype=np.int64)
        got = np.empty(max(fast.holders.rank.size, 1), dtype=np.int64)
        items, expert, _, forward, _, bounds = fast._holder_args()
        lib.lrmoe_start(
            *counts.shape,
            native.address(quota),
            native.address(fast.w),
            native.address(fast.rigid),
            items,
            expert,
            forward,
            bounds,
            int(mode == "save"),
            native.address(got_base),
            native.address(got),
        )
        assert got_base.tolist() == base and got[: len(initial)].tolist() == initial
        # Uncapped twice: first the assignment made along with the placement, then its own call.
        for with_caps in (False, False, True):
            a = fast.backward(quota, with_caps)
            b = _python(monkeypatch, slow.backward, quota, with_caps)
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a.backward_load, b.backward_load)
                assert np.array_equal(a.rank_load, b.rank_load) and a.failed == b.failed
                assert a.rank_load.dtype == b.rank_load.dtype == np.int64
        caps = fast.rank_caps(quota)
        if caps is not None:
            checked["capped"] += 1
            for scale in (1.0, 0.5, 0.0):
                trial = (caps * scale).astype(np.int64).tolist()
                cut = _python(monkeypatch, slow.caps_cut, quota, trial)
                assert fast.caps_cut(quota, trial) == cut
                checked["cut"] += cut is not None
    assert checked["replicas"] > 40 and checked["capped"] > 20 and checked["cut"] > 20


# --------------------------------------------------------------------------------------------- #
# Whole plans


@pytest.mark.parametrize("seed", [0, 1])
def test_plans_match_python(lib, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = random.Random(30 + seed)
    seen = {"replicas": 0, "trimmed": 0, "unmet": 0}
    for case in range(250):
        counts = _counts(rng, 1000 * seed + case)
        mode = rng.choice(["save", "recompute", "auto"])
        budget = rng.choice(["none", "none", "memory", "exchange", "both", "zero"])
        if budget == "none":
            lrmoe = LRMoEConfig(
                keep_ratio=rng.choice([0.3, 0.5, 1.0]),
                activation_mode=mode,
                max_replicas_per_rank=rng.choice([0, 1, 2]),
                scope=rng.choice(["local", "global"]),
            )
        else:
            lrmoe = _budget_config(rng, counts, "save" if mode == "auto" else mode)
            lrmoe = dataclasses.replace(lrmoe, activation_mode=mode)
            if budget == "zero":
                lrmoe = dataclasses.replace(lrmoe, memory_budget_bytes=0)
        exact = rng.random() < 0.1
        got = plan_call(counts, 0, lrmoe, COST, exact_forward=exact, check=True)
        _same(got, _python(monkeypatch, plan_call, counts, 0, lrmoe, COST, exact_forward=exact))
        seen["replicas"] += got.num_replicas > 0
        seen["trimmed"] += got.trimmed_pairs > 0
        seen["unmet"] += bool(got.unmet_budgets)
    assert seen["replicas"] > 60 and seen["trimmed"] > 20 and seen["unmet"] > 3


def test_plan_constructor_shortcut_matches_init() -> None:
    """``ControlPlan.of`` (plan_call's constructor) makes the instance ``__init__`` makes."""
    plan = plan_call(zipf_counts(8, 32, 1.0, 4096, 2), 0, LRMoEConfig(max_replicas_per_rank=2))
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ControlPlan)}
    assert set(plan.__dict__) == set(fields)  # every field given, nothing else stored
    made = ControlPlan(**fields)
    assert ControlPlan.of(**fields).__dict__ == made.__dict__
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.quota = None


def test_negative_counts_rejected_on_both_paths(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = np.ones((4, 8), dtype=np.int64)
    counts[2, 5] = -1
    lrmoe = LRMoEConfig(keep_ratio=0.5)
    with pytest.raises(ValueError, match="non-negative"):
        plan_call(counts, 0, lrmoe)
    with pytest.raises(ValueError, match="non-negative"):
        _python(monkeypatch, plan_call, counts, 0, lrmoe)


# --------------------------------------------------------------------------------------------- #
# Fallback


def test_native_can_be_switched_off(lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KernelOptions(native_planner=False)`` plans without the library (same plans; never
    asked for, placement included), and the planner's parts take ``lib=None`` for the same."""
    asked = []
    monkeypatch.setattr(native, "library", lambda: asked.append(1) or lib)
    counts = zipf_counts(8, 32, 1.2, 4096, 0)
    lrmoe = LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=2)
    python = dataclasses.replace(lrmoe, kernels=KernelOptions(native_planner=False))
    slow = [plan_call(counts, 0, python, COST) for _ in range(2)]
    assert not asked
    fast = plan_call(counts, 0, lrmoe, COST)
    assert asked
    for plan in slow:
        _same(plan, fast)
    w = counts.sum(0)
    call = BudgetSearch(counts, w, lrmoe, COST, "save", quotas_np(w, 0.5), lib=None)
    call.place()
    assert call.lib is None and len(call.holders) > 0
    asked.clear()
    load = counts.sum(0)
    got = placement.place_replicas(load, 8, 2, 1 / 512, lib=None)
    assert not asked and got == placement.place_replicas(load, 8, 2, 1 / 512)


def test_build_failure_falls_back_with_one_warning(
    lib, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails (and an empty cache): one warning, then the Python planner, with
    the same plans; the library comes back once the build works again."""
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'simulated compiler failure' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("LRMOE_CACHE_DIR", str(tmp_path / "cache"))
    native.reset()
    counts = zipf_counts(16, 64, 1.0, 4096, 1)
    lrmoe = LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=2)
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            fallback = [plan_call(counts, 0, lrmoe, COST) for _ in range(3)]
            assert native.library() is None
        warnings = [r for r in caplog.records if r.name == native.__name__]
        assert len(warnings) == 1 and "simulated compiler failure" in warnings[0].getMessage()
        assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left
    finally:
        monkeypatch.undo()
        native.reset()
    assert native.library() is not None
    for plan in fallback:
        _same(plan, plan_call(counts, 0, lrmoe, COST))


def test_build_is_cached_by_source_and_compiler(
    lib, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A second build finds the cached file; another source gets another file."""
    monkeypatch.setenv("LRMOE_CACHE_DIR", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp
    changed = tmp_path / "_native.c"
    changed.write_text(native.SOURCE.read_text() + "\n/* another source */\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    assert native.build() != first
