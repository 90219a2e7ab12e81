"""The per-call controller (control/controller.py): invariants on random loads, determinism,
degenerate loads, budgets (trimming, water-filling, unmet budgets, start-up validation),
activation mode "auto", today's quotas when nothing binds, and the cost model.

Shapes: P ranks, E experts, N[r, e] pairs from source r to expert e.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.control.controller import (
    ControlPlan,
    check_budgets,
    minimum_memory_bytes,
    plan_call,
)
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.control.quota import (
    expert_quotas,
    quotas_np,
    split_np,
    split_quota_over_sources,
)
from megatron_lrmoe.control.reference import reference_min_max_balance

COST = CostModel(hidden_size=64, ffn_hidden_size=32, gated=True, activation_bytes=2)


def zipf_counts(num_ranks: int, num_experts: int, exponent: float, pairs: int, seed: int):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** exponent
    p = p[rng.permutation(num_experts)]
    return rng.multinomial(pairs, p / p.sum(), size=num_ranks).astype(np.int64)


def _same(a: ControlPlan, b: ControlPlan) -> None:
    for name in [f.name for f in dataclasses.fields(ControlPlan)] + ["memory", "source_quota"]:
        if name in ("planner_time_s", "memory_builder", "source_split"):
            continue
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        elif name == "memory" and x is not None:
            for g in dataclasses.fields(x):
                assert torch.equal(getattr(x, g.name), getattr(y, g.name)), g.name
        elif name == "save_groups" and x is not None:
            assert all(torch.equal(u, v) for u, v in zip(x, y))
        else:
            assert x == y, name


def _random_config(rng: random.Random, stock_memory: int) -> LRMoEConfig:
    memory = rng.choice([None, None, 0, stock_memory // 4, stock_memory // 2, stock_memory * 2])
    exchange = rng.choice([None, None, 0, 500, 5000, 50000])
    return LRMoEConfig(
        keep_ratio=rng.choice([0.0, 0.3, 0.5, 1.0]),
        scope=rng.choice(["local", "global"]),
        activation_mode=rng.choice(["save", "recompute", "auto"]),
        memory_budget_bytes=memory,
        exchange_budget_bytes=exchange,
        max_replicas_per_rank=rng.choice([0, 1, 2]),
    )


def test_invariants_and_determinism_on_random_loads() -> None:
    rng = random.Random(31)
    trimmed = unmet = replicated = 0
    for case in range(60):
        num_ranks = rng.choice([1, 2, 3, 4, 8])
        num_experts = num_ranks * rng.choice([1, 2, 4])
        counts = zipf_counts(
            num_ranks, num_experts, rng.choice([0.0, 0.8, 1.5, 3.0]), rng.choice([0, 7, 300]), case
        )
        stock = plan_call(counts, 0, LRMoEConfig(), COST).memory.stock_total_bytes.max()
        lrmoe = _random_config(rng, int(stock))
        rank = rng.randrange(num_ranks)
        plan = plan_call(counts, rank, lrmoe, COST, check=True)
        assert plan.ep_rank == rank and plan.activation_mode in ("save", "recompute")
        if lrmoe.activation_mode != "auto":
            assert plan.activation_mode == lrmoe.activation_mode
        assert (plan.source_quota is None) == (lrmoe.scope == "global")
        if plan.source_quota is not None:
            # What one rank reads of the split: its row and its experts' columns.
            fresh = plan_call(counts, rank, lrmoe, COST)  # nothing computed in full yet
            local = num_experts // num_ranks
            row, mine = fresh.source_quota_row(rank), slice(rank * local, (rank + 1) * local)
            assert torch.equal(row, plan.source_quota[rank])
            assert torch.equal(fresh.source_quota_columns(mine), plan.source_quota[:, mine])
        _same(plan, plan_call(counts.copy(), rank, lrmoe, COST))
        # The same plan on every rank, up to the rank's own index.
        other = plan_call(torch.from_numpy(counts), (rank + 1) % num_ranks, lrmoe, COST)
        assert torch.equal(other.quota, plan.quota) and torch.equal(other.holds, plan.holds)
        trimmed += plan.trimmed_pairs > 0
        unmet += bool(plan.unmet_budgets)
        replicated += plan.num_replicas > 0
    assert trimmed > 5 and unmet > 0 and replicated > 5  # the cases cover each regime


def test_nothing_binding_gives_todays_quotas_and_split() -> None:
    counts = zipf_counts(4, 16, 1.2, 500, 1)
    n = torch.from_numpy(counts)
    for keep in (0.0, 0.25, 0.5, 0.9, 1.0):
        for lrmoe in (
            LRMoEConfig(keep_ratio=keep),
            LRMoEConfig(keep_ratio=keep, memory_budget_bytes=10**12, exchange_budget_bytes=10**12),
        ):
            plan = plan_call(counts, 2, lrmoe, COST, check=True)
            quota = expert_quotas(n.sum(0), keep)
            assert torch.equal(plan.quota, quota) and torch.equal(plan.uncapped_quota, quota)
            assert plan.quota_cap is None and plan.trimmed_pairs == 0 and not plan.binding_budgets
            assert torch.equal(plan.source_quota, split_quota_over_sources(n, quota))
            # Fixed ownership: every expert on its owner only, forward and backward.
            owner = torch.arange(16) // 4
            assert torch.equal(plan.holds, torch.nn.functional.one_hot(owner, 4).bool())
            assert torch.equal(plan.forward_load.sum(1), n.sum(0))
            assert torch.equal(plan.backward_load[torch.arange(16), owner], quota)
            assert plan.forward_peak == plan.fixed_forward_peak
            # The call plan built from it matches today's CallPlan.build.
            call = CallPlan.from_control(plan, layer_number=3, stream=(5,))
            today = CallPlan.build(n, 2, 4, lrmoe, layer_number=3, stream=(5,))
            assert torch.equal(call.quota, today.quota)
            if today.source_quota is None:
                assert call.source_quota is None
            else:
                assert torch.equal(call.source_quota, today.source_quota)
            assert call.control is plan and call.send_splits == today.send_splits


def test_numpy_twins_match_the_validated_functions() -> None:
    rng = random.Random(32)
    for _ in range(200):
        n = np.array(
            [[rng.choice([0, 0, 1, 2, 3, 7, 50, 1000]) for _ in range(rng.randint(1, 9))]]
            * rng.randint(1, 6)
        )
        n = n * np.arange(1, n.shape[0] + 1)[:, None] % 997
        keep = rng.choice([0.0, 0.1, 0.3, 1 / 3, 0.5, 0.7, 1.0])
        w = n.sum(0)
        assert quotas_np(w, keep).tolist() == expert_quotas(torch.from_numpy(w), keep).tolist()
        quota = np.array([rng.randint(0, int(t)) for t in w], dtype=np.int64)
        want = split_quota_over_sources(torch.from_numpy(n), torch.from_numpy(quota))
        assert split_np(n, quota).tolist() == want.tolist()


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_degenerate_loads(mode: str) -> None:
    base = dict(keep_ratio=0.5, activation_mode=mode, max_replicas_per_rank=1)
    # One expert takes everything: replicas on every other rank share it evenly.
    counts = np.zeros((4, 8), dtype=np.int64)
    counts[:, 3] = 100
    plan = plan_call(counts, 0, LRMoEConfig(**base), COST, check=True)
    assert plan.fixed_forward_peak == 400 and plan.forward_peak == 100
    assert plan.holds[3].all() and plan.num_replicas == 3
    assert plan.backward_peak == 50 and plan.fixed_backward_peak == 200
    # Perfectly balanced: no replicas.
    plan = plan_call(np.full((4, 8), 10), 1, LRMoEConfig(**base), COST, check=True)
    assert plan.num_replicas == 0 and plan.forward_peak == 80
    # Ranks with no tokens, and no tokens at all.
    counts = zipf_counts(4, 8, 1.0, 200, 3)
    counts[1] = 0
    counts[3] = 0
    plan_call(counts, 3, LRMoEConfig(**base), COST, check=True)
    plan = plan_call(np.zeros((4, 8), dtype=np.int64), 0, LRMoEConfig(**base), COST, check=True)
    assert plan.kept_pairs == 0 and plan.forward_peak == 0 and plan.num_replicas == 0
    # One rank, no exchange: budgets of the exchange do not apply.
    plan = plan_call(
        np.array([[5, 7]]), 0, LRMoEConfig(**base, exchange_budget_bytes=0), COST, check=True
    )
    assert plan.kept_pairs == 3 + 4 and plan.num_replicas == 0


def test_budget_zero_keeps_nothing_and_never_raises() -> None:
    counts = zipf_counts(4, 8, 1.0, 300, 4)
    plan = plan_call(counts, 0, LRMoEConfig(keep_ratio=1.0, exchange_budget_bytes=0), COST)
    plan.check_invariants()
    assert plan.kept_pairs == 0 and plan.quota_cap == 0 and plan.binding_budgets == ("exchange",)
    assert plan.trimmed_pairs == int(counts.sum()) and not plan.keeps_all
    plan = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, memory_budget_bytes=0), COST)
    plan.check_invariants()
    assert plan.kept_pairs == 0 and plan.unmet_budgets == ("memory",)
    # Replicas are never placed into a budget that cannot hold them.
    plan = plan_call(
        counts, 0, LRMoEConfig(memory_budget_bytes=0, max_replicas_per_rank=3), COST, check=True
    )
    assert plan.num_replicas == 0


@pytest.mark.parametrize("mode", ["save", "recompute"])
@pytest.mark.parametrize("replicas", [0, 1])
def test_memory_budget_water_fills_the_largest_cap(mode: str, replicas: int) -> None:
    counts = zipf_counts(4, 8, 1.3, 400, 5)
    unbounded = LRMoEConfig(keep_ratio=0.8, activation_mode=mode, max_replicas_per_rank=replicas)
    free = plan_call(counts, 0, unbounded, COST)
    budget = int(free.memory.budgeted_bytes.max() * 0.9)
    lrmoe = dataclasses.replace(unbounded, memory_budget_bytes=budget)
    plan = plan_call(counts, 0, lrmoe, COST, check=True)
    assert plan.binding_budgets == ("memory",) and plan.trimmed_pairs > 0
    assert int(plan.memory.budgeted_bytes.max()) <= budget
    cap = plan.quota_cap
    assert torch.equal(plan.quota, plan.uncapped_quota.clamp(max=cap))
    # Hot experts are trimmed first: only experts above the cap lost pairs.
    trimmed = plan.quota < plan.uncapped_quota
    assert bool((plan.uncapped_quota[trimmed] > cap).all())
    # The cap is the largest that fits: with cap + 1 no backward assignment over the same
    # holders meets the per-rank room the budget leaves (checked by the max-flow reference).
    fixed = plan.memory.replica_bytes + plan.memory.saved_bytes
    room = torch.div(budget - fixed, COST.backward_bytes(mode), rounding_mode="floor")
    bigger = plan.uncapped_quota.clamp(max=cap + 1)
    edge = plan.forward_load if mode == "save" else None
    assert (
        reference_min_max_balance(
            bigger, plan.holds, rank_capacity=room.clamp(min=0), edge_capacity=edge
        )
        is None
    )


def test_exchange_budget_limits_sent_and_received_rows() -> None:
    counts = zipf_counts(4, 8, 1.0, 400, 6)
    for mode in ("save", "recompute"):
        budget = 40 * COST.exchange_bytes(mode)
        lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode=mode, exchange_budget_bytes=budget)
        plan = plan_call(counts, 0, lrmoe, COST, check=True)
        assert plan.binding_budgets == ("exchange",)
        assert int(plan.source_quota.sum(1).max()) <= 40
        assert int(plan.backward_rank_load.max()) <= 40
        assert int(plan.memory.exchange_bytes.max()) <= budget
        # With a memory budget that does not bind, only the exchange budget is named.
        both = dataclasses.replace(lrmoe, memory_budget_bytes=10**12)
        assert plan_call(counts, 0, both, COST, check=True).binding_budgets == ("exchange",)


def test_auto_mode_picks_the_first_mode_the_budget_does_not_trim() -> None:
    """auto: save, then recompute, then lean (not with replicas): the first mode whose plan the
    memory budget leaves untrimmed, else the one that keeps the most pairs."""
    counts = np.full((4, 8), 25, dtype=np.int64)  # 200 pairs per rank, balanced

    def full(mode: str) -> int:  # what a mode's untrimmed plan holds per rank
        lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode=mode, memory_budget_bytes=1 << 62)
        return int(plan_call(counts, 0, lrmoe, COST).memory.budgeted_bytes.max())

    assert full("lean") < full("recompute") < full("save")
    for budget, want in ((full("save"), "save"), (full("recompute"), "recompute"),
                         (full("lean"), "lean")):  # fmt: skip
        lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode="auto", memory_budget_bytes=budget)
        auto = plan_call(counts, 0, lrmoe, COST, check=True)
        assert auto.activation_mode == want and not auto.binding_budgets, (budget, want)
        assert auto.kept_pairs == 400
    # Under lean's full plan every mode is trimmed; lean keeps the most pairs.
    tight = LRMoEConfig(
        keep_ratio=0.5, activation_mode="auto", memory_budget_bytes=full("lean") - 1
    )
    auto = plan_call(counts, 0, tight, COST, check=True)
    assert auto.activation_mode == "lean" and auto.binding_budgets == ("memory",)
    # With replicas lean is not a candidate: recompute, trimmed.
    replicas = dataclasses.replace(tight, max_replicas_per_rank=1)
    assert plan_call(counts, 0, replicas, COST, check=True).activation_mode == "recompute"
    forced = plan_call(
        counts, 0, dataclasses.replace(tight, activation_mode="save"), COST, check=True
    )
    assert forced.kept_pairs < auto.kept_pairs
    # Without a budget auto keeps the faster save mode.
    plan = plan_call(counts, 0, LRMoEConfig(activation_mode="auto"), COST, check=True)
    assert plan.activation_mode == "save"



def test_lean_budget_holds_the_router_gradient_rows() -> None:
    """lean's exact router gradient holds every computed pair's gradient row and fc2 input
    gradient (H + F) before the kept pairs' backward (tests/test_costs.py measures them): the
    memory budget holds the larger of the two, and where the router rows alone overflow it no
    quota fits (``unmet_budgets``); auto then takes another mode."""
    counts = np.full((4, 8), 25, dtype=np.int64)  # 200 pairs computed per rank, balanced
    lean = LRMoEConfig(keep_ratio=0.2, activation_mode="lean")  # 40 kept per rank
    memory = plan_call(counts, 0, lean, COST, check=True).memory
    router = 200 * COST.router_bytes("lean")
    assert router == 200 * (64 + 32) * 2 and router > 40 * COST.backward_bytes("lean")
    assert torch.equal(memory.router_bytes, torch.full((4,), router))
    fixed = int(memory.saved_bytes.max())
    assert fixed == 200 * COST.expert_saved_bytes("lean")
    assert torch.equal(memory.budgeted_bytes, torch.full((4,), fixed + router))
    # Exactly the router rows' room: every pair of the quota is kept.
    fits = plan_call(counts, 0, dataclasses.replace(lean, memory_budget_bytes=fixed + router),
                     COST, check=True)  # fmt: skip
    assert fits.kept_pairs == 160 and not fits.binding_budgets and not fits.unmet_budgets
    # One byte less: the kept pairs would fit (their rows are smaller) but the router's do not.
    short = dataclasses.replace(lean, memory_budget_bytes=fixed + router - 1)
    plan = plan_call(counts, 0, short, COST, check=True)
    assert plan.kept_pairs == 0 and plan.unmet_budgets == ("memory",)
    # The start-up check counts them in lean's minimum; auto prefers recompute, which fits.
    assert minimum_memory_bytes(lean, COST, 200) == fixed + router
    with pytest.raises(ValueError, match=str(fixed + router)):
        check_budgets(short, COST, 200, "decoder.1.mlp", ep_size=4)
    auto = plan_call(counts, 0, dataclasses.replace(short, activation_mode="auto"), COST,
                     check=True)  # fmt: skip
    assert auto.activation_mode == "recompute" and auto.kept_pairs > 0
    assert not auto.unmet_budgets and int(auto.memory.budgeted_bytes.max()) <= fixed + router - 1
    # Keep 1.0 runs the exact path: no router rows.
    exact = plan_call(counts, 0, LRMoEConfig(activation_mode="lean"), COST)
    assert int(exact.memory.router_bytes.max()) == 0

def test_start_up_check_names_the_budget_and_its_minimum() -> None:
    need = minimum_memory_bytes(LRMoEConfig(keep_ratio=0.5), COST, 1024)
    assert need == 1024 * (COST.expert_saved_bytes("save") + COST.row_bytes)
    check_budgets(LRMoEConfig(keep_ratio=0.5, memory_budget_bytes=need), COST, 1024)
    with pytest.raises(ValueError) as info:
        check_budgets(
            LRMoEConfig(keep_ratio=0.5, memory_budget_bytes=need - 1), COST, 1024, "decoder.3.mlp"
        )
    text = str(info.value)
    assert "decoder.3.mlp" in text and "memory_budget_bytes" in text and str(need) in text
    assert "--lrmoe-memory-budget-bytes" in text and "--lrmoe-activation-mode lean" in text
    # A budget at the minimum is met at run time by a balanced call (quota 0 at worst).
    counts = np.full((4, 8), 1024 // 8, dtype=np.int64)
    plan = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, memory_budget_bytes=need), COST)
    plan.check_invariants()
    assert not plan.unmet_budgets
    with pytest.raises(ValueError, match="CostModel"):
        check_budgets(LRMoEConfig(memory_budget_bytes=10), None)
    with pytest.raises(ValueError, match="CostModel"):
        plan_call(counts, 0, LRMoEConfig(exchange_budget_bytes=10))
    check_budgets(LRMoEConfig(memory_budget_bytes=10), COST)  # token count unknown: no verdict


def test_save_mode_keeps_pairs_where_their_activations_are() -> None:
    counts = zipf_counts(4, 8, 1.5, 400, 7)
    lrmoe = LRMoEConfig(keep_ratio=0.5, activation_mode="save", max_replicas_per_rank=2)
    plan = plan_call(counts, 0, lrmoe, COST, check=True)
    assert plan.num_replicas > 0 and plan.save_groups is not None
    assert bool((plan.backward_load <= plan.forward_load).all())
    assert bool((plan.backward_assignment <= plan.forward_assignment).all())
    assert plan.backward_peak < plan.fixed_backward_peak
    # Recompute mode may move kept pairs to any forward holder: never a worse peak.
    other = plan_call(counts, 0, dataclasses.replace(lrmoe, activation_mode="recompute"), COST)
    assert other.backward_peak <= plan.backward_peak


def test_backward_peak_is_the_exact_optimum_for_the_placement() -> None:
    rng = random.Random(33)
    for case in range(20):
        counts = zipf_counts(4, 8, rng.choice([0.5, 1.0, 2.0]), 300, 40 + case)
        for mode in ("save", "recompute"):
            lrmoe = LRMoEConfig(
                keep_ratio=rng.choice([0.3, 0.6]),
                activation_mode=mode,
                max_replicas_per_rank=rng.choice([1, 2]),
            )
            plan = plan_call(counts, 0, lrmoe, COST, check=True)
            edge = plan.forward_load if mode == "save" else None
            ref = reference_min_max_balance(plan.quota, plan.holds, edge_capacity=edge)
            assert plan.backward_peak == int(ref.sum(0).max())
            exact = plan_call(counts, 0, lrmoe, COST, exact_forward=True, check=True)
            ref = reference_min_max_balance(exact.counts.sum(0), exact.holds)
            assert exact.forward_peak == int(ref.sum(0).max()) <= plan.forward_peak


def test_memory_accounting_against_fixed_ownership() -> None:
    counts = np.full((2, 4), 10, dtype=np.int64)
    plan = plan_call(counts, 0, LRMoEConfig(), COST)  # keep 1.0, save, no replicas
    mem = plan.memory
    rows = 40  # pairs per rank, computed and sent
    assert mem.replica_bytes.tolist() == [0, 0]
    assert mem.saved_bytes.tolist() == [rows * COST.expert_saved_bytes("save")] * 2
    assert mem.stock_saved_bytes.tolist() == [rows * COST.stock_saved_bytes] * 2
    assert mem.backward_bytes.tolist() == [rows * COST.backward_bytes("save", keeps_all=True)] * 2
    assert mem.stock_backward_bytes.tolist() == [rows * COST.stock_backward_bytes] * 2
    # Keep 1.0 (the exact path) holds less than stock: no activation intermediates saved.
    assert int(mem.total_bytes.max()) < int(mem.stock_total_bytes.max())
    assert mem.exchange_sent_bytes.tolist() == [rows * COST.row_bytes] * 2
    half = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, activation_mode="recompute"), COST)
    assert half.memory.saved_bytes.tolist() == [rows * COST.row_bytes] * 2  # z
    assert half.memory.backward_bytes.tolist() == [20 * COST.backward_bytes("recompute")] * 2
    assert half.summary()["kept_pairs"] == 40 and "planner_time_us" in half.summary()


def test_ep1_trimmed_save_plans_no_saved_token_rows() -> None:
    """At EP 1 the trimmed save path reads x from the layer input: the plan counts h per pair
    (and z at the source), the exact path x and h; the budget sees the difference."""
    counts = np.full((1, 4), 50, dtype=np.int64)
    rows = 200
    h, f1, a = COST.hidden_size, COST.fc1_width, COST.activation_bytes
    exact = plan_call(counts, 0, LRMoEConfig(), COST)
    assert exact.memory.saved_bytes.tolist() == [rows * (h + f1) * a]
    half = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5), COST)
    assert half.memory.saved_bytes.tolist() == [rows * (f1 + h) * a]  # h, and z at the source
    assert COST.expert_saved_bytes("save", local_tokens=True) == f1 * a
    # The same call at EP 2 saves x on the expert side too.
    two = plan_call(np.full((2, 4), 25, dtype=np.int64), 0, LRMoEConfig(keep_ratio=0.5), COST)
    assert two.memory.saved_bytes.tolist() == [100 * (2 * h + f1) * a] * 2
    # The start-up minimum and a budget between the two footprints: EP 1 keeps pairs.
    assert minimum_memory_bytes(LRMoEConfig(keep_ratio=0.5), COST, rows, ep_size=1) == (
        rows * (f1 + h) * a
    )
    assert minimum_memory_bytes(LRMoEConfig(keep_ratio=0.5), COST, rows) == rows * (2 * h + f1) * a
    budget = rows * (f1 + h) * a + 100 * COST.backward_bytes("save")
    lrmoe = LRMoEConfig(keep_ratio=0.5, memory_budget_bytes=budget)
    plan = plan_call(counts, 0, lrmoe, COST, check=True)
    assert plan.kept_pairs == 100 and not plan.binding_budgets  # counted with x: none kept
    least = dataclasses.replace(lrmoe, memory_budget_bytes=rows * (f1 + h) * a)
    check_budgets(least, COST, rows, ep_size=1)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        check_budgets(least, COST, rows, ep_size=2)


def test_cost_model_from_a_transformer_config() -> None:
    from megatron_lrmoe.testing import moe_transformer_config

    config = moe_transformer_config()
    cost = CostModel.from_config(config)
    assert cost.hidden_size == config.hidden_size
    assert cost.ffn_hidden_size == config.moe_ffn_hidden_size
    assert cost.gated == bool(config.gated_linear_unit)
    assert cost.fc1_width == cost.ffn_hidden_size * (2 if cost.gated else 1)
    h, f1, f = cost.hidden_size, cost.fc1_width, cost.ffn_hidden_size
    assert cost.replica_bytes == (f1 * h + h * f) * (cost.param_bytes + 4)
    with pytest.raises(ValueError, match="hidden_size"):
        CostModel(hidden_size=0, ffn_hidden_size=4)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        plan_call(np.ones((3, 4), dtype=np.int64), 0, LRMoEConfig())
    with pytest.raises(ValueError, match="ep_rank"):
        plan_call(np.ones((2, 4), dtype=np.int64), 2, LRMoEConfig())
    with pytest.raises(ValueError, match="non-negative"):
        plan_call(-np.ones((2, 4), dtype=np.int64), 0, LRMoEConfig())
    with pytest.raises(ValueError, match="integer"):
        plan_call(torch.ones(2, 4), 0, LRMoEConfig())
