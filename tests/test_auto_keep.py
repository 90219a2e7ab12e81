"""``keep_ratio="auto"``: the added-variance curve, the keep ratio state, and the layer under it.

* ``added_variance_curve`` against its slow reference (capping by iteration) and against the
  real sampler's inclusion probabilities (``added_variance``, which tests/test_variance.py checks
  against many draws of the sampler);
* :class:`AutoKeepRatio`: the first measurement, the moving average, steps in both directions,
  measurements that tell nothing;
* real layers at EP 2 over gloo: the keep ratio follows a step change of the gradients in the
  right direction on both ranks alike; a target no ratio below 1 meets stays on the exact route,
  bit for bit keep 1.0's; budgets still bind under auto;
* the config and the flag.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

import auto_keep_workers as w
from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.control.auto_keep import KEEP_GRID, SMOOTHING, AutoKeepRatio
from megatron_lrmoe.select.scoring import inclusion_probabilities
from megatron_lrmoe.select.variance import (
    added_variance,
    added_variance_curve,
    added_variance_curve_reference,
)
from megatron_lrmoe.testing import run_distributed
from megatron_lrmoe.training.args import add_lrmoe_args, lrmoe_config_from_args


# ------------------------------------------------------------------------------------------- #
# The curve
# ------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("seed", range(6))
def test_curve_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
    n = int(counts.sum())
    # Heavy-tailed scores with exact zeros: capping, ties at zero and empty segments all occur.
    scores = torch.rand(n, generator=gen, dtype=torch.float64) ** 6
    scores *= torch.randint(0, 2, (n,), generator=gen)
    fractions = [j / 16 for j in range(1, 17)] + [0.01, 0.333]
    got = added_variance_curve(scores, counts, fractions)
    want = added_variance_curve_reference(scores, counts, fractions)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12 * float(scores.sum()) + 1e-300)


@pytest.mark.parametrize("quota", [1, 5, 17, 40, 63])
def test_curve_at_integer_quota_is_the_samplers_variance(quota: int) -> None:
    """Where ``f * n`` is an integer the curve is the variance of the sampler that runs: its
    fixed-point inclusion probabilities match the real-valued ones to about 1e-9."""
    gen = torch.Generator().manual_seed(quota)
    counts = torch.tensor([64, 64, 64])
    scores = torch.rand(192, generator=gen, dtype=torch.float64) ** 4
    fraction = quota / 64
    pi = inclusion_probabilities(scores.float(), counts, torch.full((3,), quota))
    want = added_variance(scores.float(), pi, counts).sum()
    got = added_variance_curve(scores.float().double(), counts, [fraction])[0]
    assert float(got) == pytest.approx(float(want), rel=1e-6, abs=1e-12)


def test_curve_decreases_with_the_fraction_and_vanishes_at_one() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(500, generator=gen, dtype=torch.float64) ** 3
    counts = torch.tensor([100, 250, 150])
    curve = added_variance_curve(scores, counts, [j / 16 for j in range(1, 17)])
    assert bool((curve[1:] <= curve[:-1] * (1 + 1e-12)).all())
    assert float(curve[-1]) == 0.0
    # Equal scores: a segment keeping f of n pairs adds (1/f - 1) of its mass.
    flat = added_variance_curve(torch.ones(64, dtype=torch.float64), torch.tensor([64]), [0.25])
    assert float(flat) == pytest.approx(3 * 64)


def test_curve_errors() -> None:
    with pytest.raises(ValueError, match=r"fractions must be in \(0, 1\]"):
        added_variance_curve(torch.ones(4), torch.tensor([4]), [0.0])
    with pytest.raises(ValueError, match="scores must be"):
        added_variance_curve(torch.ones(2, 2), torch.tensor([4]), [0.5])


# ------------------------------------------------------------------------------------------- #
# The keep ratio state
# ------------------------------------------------------------------------------------------- #


def _flat_curve(total: float) -> list[float]:
    """Equal scores: ``(1/k - 1) * total`` at every grid ratio k."""
    return [(1.0 / k - 1.0) * total for k in KEEP_GRID]


class _Ready:
    def __init__(self, added: list[float], total: float) -> None:
        self.value = (added, total)

    def result(self) -> tuple[list[float], float]:
        return self.value


def test_auto_state_first_call_exact_then_the_measured_ratio() -> None:
    auto = AutoKeepRatio(0.5)
    assert auto.keep_ratio() == 1.0  # nothing measured yet: the exact route
    auto.push(_Ready(_flat_curve(10.0), 10.0), 1.0)
    # Equal scores: 1/k - 1 <= 0.5 first at k = 11/16 (0.6875 gives 0.4545).
    assert auto.keep_ratio() == 11 / 16
    assert auto.last_ratio == 0.0  # that call ran at keep 1.0


def test_auto_state_follows_a_step_change_both_ways() -> None:
    auto = AutoKeepRatio(0.1)
    flat, sharp = _flat_curve(1.0), [0.0] * len(KEEP_GRID)  # sharp: 1/16 already adds nothing
    ratios = []
    for curve in [flat] * 3 + [sharp] * 6 + [flat] * 6:
        auto.push(_Ready(curve, 1.0), auto.planned)
        ratios.append(auto.keep_ratio())
    assert ratios[:3] == [15 / 16] * 3  # 1/k - 1 <= 0.1 first at k = 15/16
    down, up = ratios[3:9], ratios[9:]
    assert all(b <= a for a, b in zip(down, down[1:])) and down[-1] < 0.2
    assert all(b >= a for a, b in zip(up, up[1:])) and up[-1] == 15 / 16
    # Half the gap closes per call: after the first step down, level = 15/16 - (15/16 - 1/16) / 2.
    assert down[0] == min(k for k in KEEP_GRID if k >= 15 / 16 - SMOOTHING * 14 / 16 - 1e-9)


def test_auto_state_ignores_calls_that_tell_nothing() -> None:
    auto = AutoKeepRatio(0.1)
    auto.observe(_flat_curve(1.0), 1.0)
    level = auto.level
    auto.observe([0.0] * len(KEEP_GRID), 0.0)  # no score mass (no pairs, zero gradients)
    auto.observe([math.nan] * len(KEEP_GRID), math.nan)  # non-finite scores: a skipped step
    auto.observe(_flat_curve(1.0)[:-1] + [math.inf], 1.0)
    assert auto.level == level and auto.observed == 1
    with pytest.raises(ValueError, match="values for a grid of 15"):
        auto.observe([0.0], 1.0)
    with pytest.raises(ValueError, match="must be a number > 0"):
        AutoKeepRatio(0.0)


def test_auto_state_never_plans_below_the_need() -> None:
    """The planned ratio rounds the moving average up to the grid, never down."""
    auto = AutoKeepRatio(0.3)
    for total in (1.0, 2.0, 3.0):
        auto.observe(_flat_curve(total), total)
        assert auto.keep_ratio() >= auto.level - 1e-12
    assert auto.keep_ratio() in KEEP_GRID + (1.0,)


# ------------------------------------------------------------------------------------------- #
# Real layers, EP 2 over gloo
# ------------------------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def schedule() -> list[dict]:
    phases = [(4, False), (6, True), (6, False)]
    return run_distributed(
        w.auto_keep_schedule, 2, 2, dict(keep_ratio="auto", variance_target=0.1), phases,
        timeout=300,
    )


def test_layer_keep_ratio_follows_the_gradients(schedule: list[dict]) -> None:
    a, b = schedule
    assert a["planned"] == b["planned"] and a["kept"] == b["kept"]  # one plan per EP group
    planned = a["planned"]
    assert planned[0] == 1.0  # first call: nothing measured, the exact route
    flat, sharp, flat_again = planned[1:4], planned[4:10], planned[10:]
    # Equal gradient norms: the scores differ only through routing weights and inputs, so
    # nearly every pair is needed for an added variance of 0.1.
    assert min(flat) >= 0.75
    # A thousandfold gradient on one token in sixteen carries nearly all of the score mass:
    # the ratio falls call by call, and rises again when the gradients even out.
    assert all(y <= x for x, y in zip(sharp, sharp[1:])) and sharp[-1] <= 0.375
    assert all(y >= x for x, y in zip(flat_again, flat_again[1:])) and flat_again[-1] >= 0.75
    # The calls kept what they planned: ceil(k * N) per expert.
    for k, kept, total in zip(planned, a["kept"], a["total"]):
        assert k * total <= kept <= k * total + 8  # 8 experts: at most one extra pair each


def test_layer_auto_at_one_is_keep1_bit_for_bit() -> None:
    for got in run_distributed(w.auto_at_one_equals_keep1, 2, 2, timeout=300):
        assert got.pop("planned") == [1.0, 1.0, 1.0]
        assert got == {key: 0.0 for key in got}, got


def test_layer_budgets_bind_under_auto() -> None:
    unmet, auto_xchg, fixed_xchg = run_distributed(w.auto_under_budgets, 2, 2, timeout=300)[0]
    assert unmet["quota"] == [0, 0, 0] and unmet["kept"] == [0, 0, 0]
    # A target that wants every pair, under a third of stock's exchange: the budget's quotas,
    # exactly as keep 1.0 under the same budget.
    assert auto_xchg["quota"] == fixed_xchg["quota"]
    assert all(q < 2 * w.TOKENS * 2 for q in auto_xchg["quota"])


# ------------------------------------------------------------------------------------------- #
# Config and flag
# ------------------------------------------------------------------------------------------- #


def test_config_auto_rules() -> None:
    auto = LRMoEConfig(keep_ratio="auto", variance_target=0.1)
    assert auto.is_auto and not auto.is_exact
    at = auto.at_keep_ratio(0.5)
    assert at.keep_ratio == 0.5 and at.variance_target is None and not at.is_auto
    with pytest.raises(ValueError, match=r"variance_target \(None\) must be a number > 0"):
        LRMoEConfig(keep_ratio="auto")
    with pytest.raises(ValueError, match="applies only to keep_ratio='auto'"):
        LRMoEConfig(keep_ratio=0.5, variance_target=0.1)
    with pytest.raises(ValueError, match="needs selection='sample'"):
        LRMoEConfig(keep_ratio="auto", variance_target=0.1, selection="topk")
    with pytest.raises(ValueError, match="finite number or 'auto'"):
        LRMoEConfig(keep_ratio="half")


def test_flags() -> None:
    parser = add_lrmoe_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lrmoe", "--lrmoe-keep-ratio", "auto", "--lrmoe-variance-target", "0.2"])
    config = lrmoe_config_from_args(args)
    assert config.keep_ratio == "auto" and config.variance_target == 0.2
    args = parser.parse_args(["--lrmoe", "--lrmoe-keep-ratio", "auto"])
    with pytest.raises(ValueError, match="^--lrmoe-variance-target: "):
        lrmoe_config_from_args(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--lrmoe-keep-ratio", "most"])
