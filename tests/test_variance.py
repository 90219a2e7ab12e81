"""The added-variance formula of ``megatron_lrmoe/select/variance.py`` against many draws of the
real sampler (``scoring.select_sample``) on fixed inputs: rank-one contributions ``p g x^T`` of
random token rows, scores their exact squared norms."""

from __future__ import annotations

import pytest
import torch

from megatron_lrmoe.select.scoring import inclusion_probabilities, select_sample
from megatron_lrmoe.select.variance import added_variance, added_variance_ratio


def _contributions(counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, H, D]`` rank-one contributions of skewed size, and their scores ``||G_i||^2``."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(counts)
    g = torch.randn(n, 12, generator=gen, dtype=torch.float64)
    x = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    p = torch.rand(n, generator=gen, dtype=torch.float64) ** 2  # routing weights, skewed
    contrib = p[:, None, None] * g[:, :, None] * x[:, None, :]
    return contrib, contrib.pow(2).sum((1, 2))


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75])
def test_formula_matches_the_sampler_within_ten_percent(keep: float) -> None:
    counts = [40, 25, 60]
    contrib, scores = _contributions(counts)
    counts_t = torch.tensor(counts)
    quota = torch.tensor([max(1, int(keep * c)) for c in counts])
    pi = inclusion_probabilities(scores, counts_t, quota)
    predicted = added_variance(scores, pi, counts_t)
    starts = torch.cumsum(torch.tensor([0] + counts[:-1]), 0)
    exact = torch.stack([contrib[s : s + c].sum(0) for s, c in zip(starts.tolist(), counts)])
    gen = torch.Generator().manual_seed(1)
    draws = 6000
    squared = torch.zeros(len(counts), dtype=torch.float64)
    for _ in range(draws):
        sel = select_sample(scores, counts_t, quota, torch.rand(len(counts), generator=gen,
                                                                 dtype=torch.float64))
        w = sel.dense_weight(scores.numel()).to(torch.float64)
        weighted = w[:, None, None] * contrib
        estimate = torch.stack(
            [weighted[s : s + c].sum(0) for s, c in zip(starts.tolist(), counts)]
        )
        squared += (estimate - exact).pow(2).sum((1, 2))
    empirical = squared / draws
    assert torch.all(predicted > 0)
    assert torch.allclose(empirical, predicted, rtol=0.10), (empirical, predicted)


def test_nothing_is_added_where_every_pair_is_kept_and_ratio_is_relative() -> None:
    scores = torch.tensor([1.0, 4.0, 0.0, 9.0])
    counts = torch.tensor([2, 2])
    assert added_variance(scores, torch.ones(4), counts).tolist() == [0.0, 0.0]
    pi = torch.tensor([0.5, 1.0, 1.0, 0.25])
    # (1/0.5 - 1) * 1 = 1 in segment 0; (1/0.25 - 1) * 9 = 27 in segment 1 (the zero score adds 0).
    assert added_variance(scores, pi, counts).tolist() == [1.0, 27.0]
    per_segment, overall = added_variance_ratio(scores, pi, counts)
    assert per_segment.tolist() == pytest.approx([1.0 / 5.0, 27.0 / 9.0])
    assert float(overall) == pytest.approx(28.0 / 14.0)
    zero = added_variance_ratio(torch.zeros(2), torch.ones(2), torch.tensor([2]))
    assert zero[0].tolist() == [0.0] and float(zero[1]) == 0.0


def test_bad_input_names_the_problem() -> None:
    with pytest.raises(ValueError, match="inclusion probability 0"):
        added_variance(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="same \\[N\\] shape"):
        added_variance(torch.ones(3), torch.ones(2), torch.tensor([3]))
    with pytest.raises(ValueError, match="add up to 2, but there are 3 rows"):
        added_variance(torch.ones(3), torch.ones(3), torch.tensor([2]))


def test_the_kept_pairs_estimate_is_unbiased() -> None:
    """What the backward records (``op/stages._record_selection``): ``sum_kept w (w - 1) s``
    over the kept pairs, whose mean over draws is the exact ``sum (1/pi - 1) s``."""
    counts = [30, 50]
    _, scores = _contributions(counts, seed=3)
    counts_t, quota = torch.tensor(counts), torch.tensor([10, 20])
    exact = added_variance(scores, inclusion_probabilities(scores, counts_t, quota), counts_t)
    gen = torch.Generator().manual_seed(2)
    draws, total = 4000, 0.0
    for _ in range(draws):
        sel = select_sample(scores, counts_t, quota, torch.rand(2, generator=gen,
                                                                 dtype=torch.float64))
        w = sel.weight.to(torch.float64)
        total += float(torch.dot(w * (w - 1.0), scores[sel.kept_index]))
    assert total / draws == pytest.approx(float(exact.sum()), rel=0.03)
