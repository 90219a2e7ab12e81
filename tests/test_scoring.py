"""Tests for megatron_lrmoe.select.scoring: LRM scores, top-k and unbiased sampled selection.

Shapes: N rows (token-expert pairs), G segments, H hidden, R independent draws.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_lrmoe.select import scoring
from megatron_lrmoe.select.contract import Selection
from megatron_lrmoe.select.scoring import (
    PROB_BITS,
    draw_uniforms,
    inclusion_probabilities,
    lrm_scores,
    nonfinite_poison,
    row_sq_norms,
    sanitize,
    select,
    select_sample,
    select_topk,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ONE = 1 << PROB_BITS
# draw_uniforms(1234, (5, 6), 3) as computed once; every rank, rerun and process must reproduce it.
PINNED_UNIFORMS = [0.8504211780443552, 0.12675127727779034, 0.9774806668737848]


# --------------------------------------------------------------------------------------------- #
# Helpers and plain-Python references
# --------------------------------------------------------------------------------------------- #


def _flatten(segments: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.tensor([s for seg in segments for s in seg], dtype=torch.float32)
    counts = torch.tensor([len(seg) for seg in segments], dtype=torch.int64)
    return scores, counts


def _reference_topk(segments: list[list[float]], quota: list[int]) -> list[int]:
    kept, offset = [], 0
    for seg, q in zip(segments, quota):
        ranked = sorted(range(len(seg)), key=lambda i: (-seg[i], i))
        kept += [offset + i for i in ranked[:q]]
        offset += len(seg)
    return sorted(kept)


def _reference_pi(scores: list[float], q: int) -> list[float]:
    """Capped PPS by the textbook iteration: cap everything that reaches 1, renormalise, repeat."""
    w = [math.sqrt(max(s, 0.0)) for s in scores]
    pi = [0.0] * len(w)
    capped: set[int] = set()
    while True:
        rest = [i for i in range(len(w)) if i not in capped]
        left = q - len(capped)
        total = sum(w[i] for i in rest)
        if left == 0:
            break
        if total == 0.0:
            # Fewer positive rows than quota: zero rows fill it in canonical order.
            capped.update(rest[:left])
            break
        over = [i for i in rest if left * w[i] / total >= 1.0]
        if not over:
            for i in rest:
                pi[i] = left * w[i] / total
            break
        capped.update(over)
    for i in capped:
        pi[i] = 1.0
    return pi


def _random_segments(rng: random.Random, max_segments: int = 8) -> list[list[float]]:
    segments = []
    for _ in range(rng.randint(1, max_segments)):
        n = rng.choice([0, 1, 2, 3, 5, 8, 13])
        kind = rng.random()
        if kind < 0.25:  # many ties
            seg = [float(rng.randint(0, 3)) for _ in range(n)]
        elif kind < 0.5:  # wide dynamic range
            seg = [10.0 ** rng.uniform(-6, 6) for _ in range(n)]
        else:
            seg = [rng.random() for _ in range(n)]
        segments.append(seg)
    return segments


def _segment_of_rows(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _replicate(segments: list[list[float]], quota: list[int], copies: int):
    """The same segments ``copies`` times over: one call then makes ``copies`` independent draws."""
    scores, counts = _flatten(segments)
    return scores.repeat(copies), counts.repeat(copies), torch.tensor(quota).repeat(copies)


NASTY_CASES = {
    "one_huge": ([[1.0, 2.0, 1e30, 3.0, 0.5, 4.0]], [3]),
    "all_equal": ([[2.0] * 9], [4]),
    "many_zeros": ([[0.0, 0.0, 5.0, 0.0, 0.0, 1.0, 0.0, 0.0]], [4]),
    "quota_eq_count": ([[1.0, 9.0, 4.0]], [3]),
    "quota_one": ([[1.0, 4.0, 9.0, 16.0, 0.0]], [1]),
    "one_row": ([[7.0]], [1]),
    "empty_segment": ([[], [1.0, 2.0, 3.0], []], [0, 2, 0]),
    "mixed": ([[3.0, 0.0, 1e-8, 2.0, 2.0], [0.1, 100.0], [], [5.0]], [2, 1, 0, 0]),
    "tiny_and_large": ([[1e-12, 1.0, 1e6, 1e-3, 2.0, 1e-20, 3.0]], [3]),
}


# --------------------------------------------------------------------------------------------- #
# Scores
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_score_is_squared_frobenius_norm_of_outer_product(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    n, h_out, h_in = 12, 48, 80
    probs = torch.rand(n, generator=gen).to(dtype)
    grad = torch.randn(n, h_out, generator=gen).to(dtype)
    x = (3 * torch.randn(n, h_in, generator=gen)).to(dtype)

    score = lrm_scores(probs, row_sq_norms(grad), row_sq_norms(x))

    assert score.dtype == torch.float32 and score.shape == (n,)
    for i in range(n):
        # The pair's weight-gradient contribution, built explicitly from the same input values.
        outer = torch.outer(probs[i].double() * grad[i].double(), x[i].double())
        expected = outer.square().sum()
        assert math.isclose(float(score[i]), float(expected), rel_tol=2e-6)


def test_row_sq_norms_accumulates_in_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8192, generator=gen).to(torch.bfloat16)
    got = row_sq_norms(x)
    expected = x.double().square().sum(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    # A bf16 accumulation would be off by far more than that (8 bits of mantissa).
    assert row_sq_norms(torch.zeros(0, 5)).shape == (0,)
    with pytest.raises(ValueError):
        row_sq_norms(torch.ones(3))


def test_lrm_scores_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError):
        lrm_scores(torch.ones(3), torch.ones(3), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nonfinite_poison_is_nan_iff_a_score_is_not_finite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    finite = torch.tensor([0.0, 1.0, big, big, big], dtype=dtype)  # the sum overflows, no alarm
    poison = nonfinite_poison(finite)
    assert poison.dim() == 0 and poison.dtype == torch.float32 and float(poison) == 0.0
    assert float(nonfinite_poison(torch.zeros(0, dtype=dtype))) == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        scores = finite.clone()
        scores[2] = bad
        assert math.isnan(float(nonfinite_poison(scores)))


def test_sanitize_maps_nonfinite_and_negative_to_zero() -> None:
    scores = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), -2.0, 3.0])
    assert sanitize(scores).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 3.0]


# --------------------------------------------------------------------------------------------- #
# Top-k
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("device", DEVICES)
def test_topk_matches_brute_force(device: str) -> None:
    rng = random.Random(2)
    for _ in range(150):
        segments = _random_segments(rng)
        quota = [rng.randint(0, len(seg)) for seg in segments]
        scores, counts = _flatten(segments)
        sel = select_topk(scores.to(device), counts, torch.tensor(quota))
        assert sel.kept_index.tolist() == _reference_topk(segments, quota)
        assert sel.weight.tolist() == [1.0] * sum(quota)
        assert sel.kept_per_segment.tolist() == quota


def test_topk_ties_go_to_lower_position_and_edge_quotas() -> None:
    scores = torch.tensor([5.0, 5.0, 5.0, 5.0, 1.0, 2.0, 2.0, 9.0])
    counts = torch.tensor([4, 0, 4])
    assert select_topk(scores, counts, torch.tensor([2, 0, 2])).kept_index.tolist() == [0, 1, 5, 7]
    assert select_topk(scores, counts, torch.tensor([0, 0, 0])).kept_index.tolist() == []
    everything = select_topk(scores, counts, torch.tensor([4, 0, 4]))
    assert everything.kept_index.tolist() == list(range(8))
    empty = select_topk(torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0).long())
    assert empty.kept_index.numel() == 0 and empty.kept_per_segment.numel() == 0


def test_topk_separates_adjacent_fp32_values() -> None:
    one = torch.tensor(1.0)
    above = torch.nextafter(one, torch.tensor(2.0))
    tiny = torch.tensor(torch.finfo(torch.float32).smallest_normal)
    scores = torch.stack([one, above, one, torch.tensor(0.0), tiny, torch.tensor(0.0)])
    sel = select_topk(scores, torch.tensor([3, 3]), torch.tensor([1, 1]))
    assert sel.kept_index.tolist() == [1, 4]


def test_topk_treats_nonfinite_scores_as_zero_and_keeps_quota() -> None:
    scores = torch.tensor([float("nan"), 1.0, float("inf"), 0.5, -1.0])
    sel = select_topk(scores, torch.tensor([5]), torch.tensor([3]))
    # nan, inf and -1 all count as 0: the two positive scores, then the first zero (position 0).
    assert sel.kept_index.tolist() == [0, 1, 3]


def test_selection_validates_segments() -> None:
    scores = torch.ones(6)
    with pytest.raises(ValueError, match="segment 1"):
        select_topk(scores, torch.tensor([2, 2, 2]), torch.tensor([1, 3, 0]))
    with pytest.raises(ValueError, match="segment 0"):
        select_topk(scores, torch.tensor([2, 2, 2]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="add up"):
        select_topk(scores, torch.tensor([2, 2, 1]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError):
        select_topk(scores, torch.tensor([3, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError):
        select_sample(scores, torch.tensor([3, 3]), torch.tensor([1, 1]), torch.zeros(3))


# --------------------------------------------------------------------------------------------- #
# Inclusion probabilities
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("device", DEVICES)
def test_inclusion_probabilities_match_iterative_capping(device: str) -> None:
    rng = random.Random(3)
    cases = [(segs, q) for segs, q in NASTY_CASES.values()]
    for _ in range(120):
        segments = _random_segments(rng)
        cases.append((segments, [rng.randint(0, len(seg)) for seg in segments]))
    for segments, quota in cases:
        scores, counts = _flatten(segments)
        pi = inclusion_probabilities(scores.to(device), counts, torch.tensor(quota)).cpu()
        assert pi.dtype == torch.float64
        assert bool(((pi >= 0) & (pi <= 1)).all())
        offset = 0
        for seg, q in zip(segments, quota):
            got = pi[offset : offset + len(seg)]
            offset += len(seg)
            # Sums are exact: multiples of 2**-32 added in float64.
            assert float(got.sum()) == q
            expected = _reference_pi([float(torch.tensor(s, dtype=torch.float32)) for s in seg], q)
            # Fixed point: 2**-32 per unit, a unit or two of repair, weights to 2**-32 relative.
            torch.testing.assert_close(
                got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=2e-9
            )
            # Positive scores keep a positive probability when quota > 0 (unbiasedness).
            for s, p in zip(seg, got.tolist()):
                if s > 0 and q > 0:
                    assert p > 0


def test_inclusion_probabilities_are_proportional_to_sqrt_score_among_uncapped() -> None:
    gen = torch.Generator().manual_seed(4)
    scores = torch.rand(200, generator=gen) ** 4 * 1e3
    scores[7] = 1e12  # capped
    scores[50] = 1e11  # capped
    counts, quota = torch.tensor([120, 80]), torch.tensor([30, 10])
    pi = inclusion_probabilities(scores, counts, quota)
    assert pi[7] == 1.0 and pi[50] == 1.0
    for lo, hi in ((0, 120), (120, 200)):
        p, s = pi[lo:hi], scores[lo:hi].double()
        uncapped = (p < 1) & (p > 1e-4)
        ratio = p[uncapped] / s[uncapped].sqrt()
        assert uncapped.sum() > 20
        torch.testing.assert_close(ratio, ratio.mean().expand_as(ratio), rtol=1e-6, atol=0)


def test_inclusion_probabilities_are_within_a_few_units_on_long_segments() -> None:
    # Each probability is its ideal value up to flooring, one unit of repair and the weight
    # rounding: a handful of units of 2**-32, however long the segment.
    gen = torch.Generator().manual_seed(8)
    scores = torch.rand(3000, generator=gen) ** 2
    counts, quota = torch.tensor([1000, 2000]), torch.tensor([300, 1900])
    pi = inclusion_probabilities(scores, counts, quota)
    values = scores.tolist()
    expected = _reference_pi(values[:1000], 300) + _reference_pi(values[1000:], 1900)
    error = (pi - torch.tensor(expected, dtype=torch.float64)).abs().max()
    assert float(error) <= 4 / ONE


def test_inclusion_probabilities_fill_quota_with_zero_rows_in_canonical_order() -> None:
    scores = torch.tensor([0.0, 4.0, 0.0, 0.0, 1.0, 0.0])
    pi = inclusion_probabilities(scores, torch.tensor([6]), torch.tensor([4]))
    assert pi.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]


# --------------------------------------------------------------------------------------------- #
# Sampling
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(NASTY_CASES))
def test_sample_keeps_exactly_quota_and_matches_probabilities(device: str, case: str) -> None:
    segments, quota = NASTY_CASES[case]
    copies = 2500
    scores, counts, quotas = _replicate(segments, quota, copies)
    uniforms = torch.rand(
        counts.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    sel = select_sample(scores.to(device), counts, quotas, uniforms.to(device))
    kept = sel.kept_index.cpu()
    weight = sel.weight.cpu()

    # Exactly quota per segment in every one of the draws, strictly ascending positions.
    assert bool((kept[1:] > kept[:-1]).all())
    per_segment = torch.bincount(_segment_of_rows(counts)[kept], minlength=counts.numel())
    assert torch.equal(per_segment, quotas)
    assert torch.equal(sel.kept_per_segment.cpu(), quotas)

    # Weights are 1 / pi, and exactly 1 for rows that are always kept.
    pi_all = inclusion_probabilities(scores, counts, quotas)
    pi_kept = pi_all[kept]
    torch.testing.assert_close(weight.double(), 1.0 / pi_kept, rtol=1e-6, atol=0)
    assert bool((weight[pi_kept == 1.0] == 1.0).all())

    # Empirical inclusion frequency over the independent draws: binomial, 5 sigma (+1/R for
    # the discreteness of the frequency).
    n = scores.numel() // copies
    freq = torch.bincount(kept % n, minlength=n).double() / copies
    pi = pi_all[:n]
    bound = 5 * torch.sqrt(pi * (1 - pi) / copies) + 1.0 / copies
    assert bool(((freq - pi).abs() <= bound).all()), (freq, pi)

    # Horvitz-Thompson estimate of sum(value) is unbiased: the mean over the draws is within 5
    # standard errors of the truth (standard error estimated from the draws themselves). Values
    # model gradient contributions: norm sqrt(score), any sign; a segment with quota 0 keeps
    # nothing by definition, so it has nothing to estimate.
    z = torch.randn(n, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    values = (
        z
        * scores[:n].double().sqrt()
        * (quotas[: len(quota)] > 0)[_segment_of_rows(counts[: len(quota)])]
    )
    draw = kept // n
    estimates = torch.zeros(copies, dtype=torch.float64).index_add_(
        0, draw, weight.double() * values[kept % n]
    )
    truth = float(values.sum())
    stderr = float(estimates.std()) / math.sqrt(copies)
    assert abs(float(estimates.mean()) - truth) <= 5 * stderr + 1e-9 * (1 + abs(truth))


@pytest.mark.parametrize("device", DEVICES)
def test_sample_keeps_exactly_quota_on_random_cases(device: str) -> None:
    rng = random.Random(9)
    for trial in range(100):
        segments = _random_segments(rng)
        quota = [rng.randint(0, len(seg)) for seg in segments]
        scores, counts, quotas = _replicate(segments, quota, 40)
        uniforms = draw_uniforms(trial, (), counts.numel(), device)
        sel = select_sample(scores.to(device), counts, quotas, uniforms)
        kept = sel.kept_index.cpu()
        assert bool((kept[1:] > kept[:-1]).all())
        per_segment = torch.bincount(_segment_of_rows(counts)[kept], minlength=counts.numel())
        assert torch.equal(per_segment, quotas)
        pi = inclusion_probabilities(scores, counts, quotas)[kept]
        torch.testing.assert_close(sel.weight.cpu().double(), 1.0 / pi, rtol=1e-6, atol=0)


def test_sample_is_exactly_unbiased_over_all_uniforms() -> None:
    """Enumerates every distinct outcome of the systematic draw: exact expectations."""
    scores = torch.tensor([0.3, 5.0, 1e-4, 2.0, 0.0, 7.5, 0.9, 3.3, 1e6])
    counts, quota = torch.tensor([9]), torch.tensor([4])
    pi = inclusion_probabilities(scores, counts, quota)
    units = (pi * ONE).round().long()
    # The selection only changes where the offset crosses a running sum (mod 2**32).
    breaks = sorted({0} | {int(v) % ONE for v in torch.cumsum(units, 0).tolist()}) + [ONE]
    # Any values at all, except that a zero score means a zero contribution (row 4).
    values = torch.tensor([1.0, -2.0, 3.0, 0.5, 0.0, -1.0, 2.5, 0.25, 10.0], dtype=torch.float64)
    expected_estimate = 0.0
    expected_kept = torch.zeros(9, dtype=torch.float64)
    for lo, hi in zip(breaks[:-1], breaks[1:]):
        if hi == lo:
            continue
        u = torch.tensor([lo / ONE], dtype=torch.float64)  # exact: lo is an integer below 2**32
        sel = select_sample(scores, counts, quota, u)
        mass = (hi - lo) / ONE
        expected_estimate += mass * float((sel.weight.double() * values[sel.kept_index]).sum())
        expected_kept[sel.kept_index] += mass
    # Exact up to the fp32 rounding of the stored weights (2**-24 relative each).
    assert abs(expected_estimate - float(values.sum())) <= 2**-23 * float(values.abs().sum())
    torch.testing.assert_close(expected_kept, pi, rtol=0, atol=1e-12)


def test_sample_is_deterministic_and_depends_on_uniforms() -> None:
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(300, generator=gen) ** 3
    counts = torch.tensor([100, 0, 150, 50])
    quota = torch.tensor([37, 0, 40, 49])
    u = draw_uniforms(11, (3, 4), 4)
    first = select_sample(scores, counts, quota, u)
    second = select_sample(scores.clone(), counts.clone(), quota.clone(), u.clone())
    assert torch.equal(first.kept_index, second.kept_index)
    assert torch.equal(first.weight, second.weight)
    other = select_sample(scores, counts, quota, draw_uniforms(11, (3, 5), 4))
    assert not torch.equal(first.kept_index, other.kept_index)


def test_sample_with_uniforms_at_the_edges_still_keeps_quota() -> None:
    scores, counts = _flatten([[1.0, 2.0, 3.0, 4.0], [0.5] * 5])
    quota = torch.tensor([2, 3])
    for edge in (0.0, 1.0 - 2.0**-53, 1.0, -0.5, 2.0):
        u = torch.tensor([edge, edge], dtype=torch.float64)
        sel = select_sample(scores, counts, quota, u)
        assert torch.bincount(_segment_of_rows(counts)[sel.kept_index], minlength=2).tolist() == [
            2,
            3,
        ]


def test_draw_uniforms_is_stable_and_stream_dependent() -> None:
    a = draw_uniforms(1234, (5, 6), 1000)
    assert a.dtype == torch.float64 and a.shape == (1000,)
    assert bool(((a >= 0) & (a < 1)).all())
    assert torch.equal(a, draw_uniforms(1234, (5, 6), 1000))
    assert not torch.equal(a, draw_uniforms(1234, (5, 7), 1000))
    assert not torch.equal(a, draw_uniforms(1234, (6, 5), 1000))
    assert not torch.equal(a, draw_uniforms(1235, (5, 6), 1000))
    assert not torch.equal(a[:3], draw_uniforms(1234, (5, 6, 0), 3))
    # A prefix is the same draw: asking for fewer values does not change the first ones.
    assert torch.equal(a[:10], draw_uniforms(1234, (5, 6), 10))
    # Pinned values: a rerun, another process or another rank must see exactly these (they
    # depend only on SHA-256 and PyTorch's CPU generator, never on Python's hash()).
    assert draw_uniforms(1234, (5, 6), 3).tolist() == PINNED_UNIFORMS


# --------------------------------------------------------------------------------------------- #
# Dispatch and helpers
# --------------------------------------------------------------------------------------------- #


def test_select_dispatches_and_validates_policy() -> None:
    scores, counts = _flatten([[1.0, 3.0, 2.0], [4.0, 0.0]])
    quota = torch.tensor([1, 1])
    assert select("topk", scores, counts, quota).kept_index.tolist() == [1, 3]
    u = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert torch.equal(
        select("sample", scores, counts, quota, u).kept_index,
        select_sample(scores, counts, quota, u).kept_index,
    )
    with pytest.raises(ValueError, match="uniforms"):
        select("sample", scores, counts, quota)
    with pytest.raises(ValueError, match="policy"):
        select("random", scores, counts, quota)


def test_selection_dense_helpers() -> None:
    sel = Selection(torch.tensor([1, 4]), torch.tensor([2.0, 1.5]), torch.tensor([1, 1]))
    assert sel.num_kept == 2
    assert sel.kept_mask(6).tolist() == [False, True, False, False, True, False]
    assert sel.dense_weight(6).tolist() == [0.0, 2.0, 0.0, 0.0, 1.5, 0.0]


def test_counts_of_other_integer_dtypes_and_fp64_scores_are_accepted() -> None:
    scores = torch.tensor([1.0, 5.0, 2.0, 3.0], dtype=torch.float64)
    sel = select_topk(scores, torch.tensor([2, 2], dtype=torch.int32), torch.tensor([1, 1]))
    assert sel.kept_index.tolist() == [1, 3]
    with pytest.raises(ValueError):
        select_topk(scores, torch.tensor([2.0, 2.0]), torch.tensor([1, 1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_to_host_sync_with_host_counts() -> None:
    scores = torch.rand(1000, device="cuda")
    counts = torch.tensor([400, 0, 600])
    quota = torch.tensor([100, 0, 300])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_topk(scores, counts, quota)
        u = draw_uniforms(0, (1,), 3, "cuda")
        sel = select_sample(scores, counts, quota, u)
        select_sample(scores, counts, quota, draw_uniforms(0, (1,), 3))  # CPU uniforms
        inclusion_probabilities(scores, counts, quota)
        lrm_scores(scores, scores, scores)
        row_sq_norms(torch.ones(4, 8, device="cuda", dtype=torch.bfloat16))
        nonfinite_poison(scores)
        sel.dense_weight(1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_score_and_select_is_the_steps(policy: str) -> None:
    """Off CUDA ``score_and_select`` is norms -> maxima -> pair scores -> selection, and its
    kept total is the kept rows' finite score sum (a non-finite gradient row included)."""
    gen = torch.Generator().manual_seed(21)
    t, h, k = 40, 16, 3
    g, x = torch.randn(t, h, generator=gen), torch.randn(t, h, generator=gen)
    g[7, 2] = float("inf")
    probs = torch.rand(t * k, generator=gen)
    token = torch.randint(0, t, (t * k,), generator=gen)
    counts = torch.tensor([50, 0, 70])
    quota = torch.tensor([20, 0, 33])
    uniforms = torch.rand(3, generator=gen, dtype=torch.float64)
    scored, sel, kept_total = scoring.score_and_select(
        policy, g, x, probs, token, counts, quota, uniforms, kept_total=True
    )
    norms = scoring.token_norms(g, x)
    ref = scoring.pair_scores(probs, token, norms, norms.amax(1))
    ref_sel = scoring.select(policy, ref.scores, counts, quota, uniforms)
    assert torch.equal(scored.scores.isnan(), ref.scores.isnan())
    assert torch.equal(scored.scores.nan_to_num(), ref.scores.nan_to_num())
    assert torch.equal(sel.kept_index, ref_sel.kept_index)
    assert torch.equal(sel.weight, ref_sel.weight)
    assert math.isnan(float(scored.poison))
    kept = ref.scores[ref_sel.kept_index].nan_to_num(0.0, 0.0, 0.0)
    assert torch.equal(kept_total, kept.sum())
    assert scoring.score_and_select(policy, g, x, probs, token, counts, quota, uniforms)[2] is None
