"""The variance that a trimmed backward adds to an expert's weight gradient, from the LRM scores.

Shape legend: N pairs (rows) in one selection, G segments (experts, or (source, expert) chunks).

An expert's weight gradient is a sum of one rank-one contribution per pair, ``G = sum_i G_i``,
and a pair's LRM score is exactly ``s_i = ||G_i||^2`` (``scoring.lrm_scores``). ``sample`` keeps
pair i with probability ``pi_i`` and weights it by ``1 / pi_i``, so ``G_hat = sum_kept G_i / pi_i``
is unbiased; treating the inclusions as independent, its added variance is

    E ||G_hat - G||^2 = sum_i (1 / pi_i - 1) * s_i            (pairs with pi_i = 1 add nothing)

For comparison, ``sum_i s_i`` is the scale of the gradient's own mini-batch noise: were the
contributions independent draws, the variance of their sum would be of that size. The ratio of
the two, :func:`added_variance_ratio`, is the "relative added variance" a variance target is
stated in (issue 38). The systematic sampling that ``select_sample`` runs draws pairs jointly,
not independently; the cross terms ``(pi_ij / (pi_i pi_j) - 1) <G_i, G_j>`` that this formula
leaves out vanish when the contributions are uncorrelated (tests/test_variance.py checks the
formula against many draws of the real sampler within 10 %).

``topk`` has no variance but a bias: the dropped pairs' contributions, whose share of the score
mass is the ``dropped score`` statistic.

:func:`added_variance_curve` answers the question ``keep_ratio="auto"`` asks after every
backward: what would the sample have added had each segment kept a fraction ``f`` of its pairs,
for every ``f`` of a grid at once. With a segment's scores sorted in decreasing order,
``w_j = sqrt(s_j)`` and a quota ``q`` (real-valued: ``f`` times the segment's pairs), capped
sqrt-proportional sampling keeps the top ``c`` pairs with probability 1 and the rest with
``pi_j = (q - c) w_j / R_c``, where ``R_c = sum_{j >= c} w_j`` and ``c`` is the smallest rank with
``(q - c) w_c <= R_c``. Its added variance is then ``R_c^2 / (q - c) - T_c`` with
``T_c = sum_{j >= c} s_j``: one sort, two suffix sums and a search per segment, no probability
vector. :func:`added_variance_curve_reference` is the slow, obvious version (capping by
iteration, the sum over pairs) the tests compare it with.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "added_variance",
    "added_variance_curve",
    "added_variance_curve_reference",
    "added_variance_ratio",
]


def added_variance(
    scores: torch.Tensor, inclusion: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``[G]`` float64 ``sum_i (1 / pi_i - 1) * s_i`` per segment.

    Args:
        scores: ``[N]`` LRM scores (finite, non-negative).
        inclusion: ``[N]`` inclusion probabilities (``scoring.inclusion_probabilities``); pairs
            with probability 0 must have score 0 (they are never kept and contribute nothing).
        counts: ``[G]`` rows per segment, summing to N.

    Raises:
        ValueError: Mismatched shapes, counts not adding up to N, or a positive score with
            inclusion probability 0 (its gradient could never be estimated).
    """
    if scores.shape != inclusion.shape or scores.dim() != 1:
        raise ValueError(
            f"added_variance: scores {tuple(scores.shape)} and inclusion "
            f"{tuple(inclusion.shape)} must be the same [N] shape"
        )
    s = scores.to(torch.float64)
    pi = inclusion.to(device=s.device, dtype=torch.float64)
    if bool(((pi <= 0) & (s > 0)).any()):  # NOTE: device-to-host sync (a check, debug-sized use)
        raise ValueError(
            "added_variance: a pair of positive score has inclusion probability 0; pass the "
            "probabilities select_sample keeps pairs with (scoring.inclusion_probabilities)"
        )
    per_pair = torch.where(pi > 0, (1.0 / pi.clamp(min=1e-300) - 1.0) * s, torch.zeros_like(s))
    return _per_segment(per_pair, counts)


def added_variance_ratio(
    scores: torch.Tensor, inclusion: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([G] per segment, scalar over all)`` ratios of the added variance to ``sum_i s_i``.

    A segment (or a call) whose scores are all 0 has ratio 0.
    """
    added = added_variance(scores, inclusion, counts)
    total = _per_segment(scores.to(torch.float64), counts)
    per_segment = torch.where(total > 0, added / total.clamp(min=1e-300), torch.zeros_like(total))
    overall_total = total.sum()
    overall = torch.where(
        overall_total > 0, added.sum() / overall_total.clamp(min=1e-300), overall_total * 0
    )
    return per_segment, overall


def _per_segment(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    counts = counts.to(device=values.device, dtype=torch.int64)
    if counts.dim() != 1:
        raise ValueError(f"counts must be a [G] tensor, got shape {tuple(counts.shape)}")
    total = int(counts.sum())  # NOTE: device-to-host sync when counts live on the device
    if total != values.numel():
        raise ValueError(f"segment counts add up to {total}, but there are {values.numel()} rows")
    ids = torch.repeat_interleave(torch.arange(counts.numel(), device=values.device), counts)
    out = torch.zeros(counts.numel(), dtype=values.dtype, device=values.device)
    return out.index_add_(0, ids, values)


def added_variance_curve(
    scores: torch.Tensor, counts: torch.Tensor, fractions: Sequence[float]
) -> torch.Tensor:
    """``[C]`` float64: the variance capped sqrt-proportional sampling would add to the weight
    gradients, summed over the segments, had each segment kept ``f * counts[g]`` pairs (a real
    number), for each of the C ``fractions``. No device-to-host sync.

    Args:
        scores: ``[N]`` LRM scores, finite and non-negative (float64 is best: the sums span
            many magnitudes).
        counts: ``[G]`` rows per segment, contiguous and in order, summing to N; on the scores'
            device (a host tensor is copied there, which on CUDA waits for the stream).
        fractions: C kept fractions, each in ``(0, 1]``.

    Raises:
        ValueError: A fraction outside ``(0, 1]`` or mismatched shapes.
    """
    if scores.dim() != 1:
        raise ValueError(f"added_variance_curve: scores must be [N], got {tuple(scores.shape)}")
    bad = [f for f in fractions if not 0.0 < float(f) <= 1.0]
    if bad or not fractions:
        raise ValueError(f"added_variance_curve: fractions must be in (0, 1], got {list(fractions)}")
    device = scores.device
    counts = counts.to(device=device, dtype=torch.int64)
    num_rows, num_segments = scores.numel(), counts.numel()
    if num_rows == 0:
        return torch.zeros(len(fractions), dtype=torch.float64, device=device)
    s = scores.to(torch.float64)
    seg = torch.repeat_interleave(torch.arange(num_segments, device=device), counts, output_size=num_rows)
    # Decreasing score within each segment: segments are contiguous, so a stable sort of the
    # scores followed by a stable sort of their segments keeps every row in its block.
    order = torch.argsort(s, descending=True, stable=True)
    order = order.index_select(0, torch.argsort(seg.index_select(0, order), stable=True))
    s = s.index_select(0, order)
    w = s.sqrt()
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_rows, device=device) - start.index_select(0, seg)
    # Suffix sums within segments, from a whole-array one: R_j = sum over rows j.. of its segment.
    r_all, t_all = _suffix_sum(w), _suffix_sum(s)
    end = start + counts  # one past each segment's last row
    r_end = torch.cat((r_all, r_all.new_zeros(1))).index_select(0, end)
    t_end = torch.cat((t_all, t_all.new_zeros(1))).index_select(0, end)
    suffix_w = (r_all - r_end.index_select(0, seg)).clamp(min=0)
    suffix_s = (t_all - t_end.index_select(0, seg)).clamp(min=0)
    counts_f = counts.to(torch.float64)
    quota = torch.stack([counts_f * float(f) for f in fractions])  # [C, G], no host copy
    room = quota.index_select(1, seg) - rank.to(torch.float64)  # [C, N]: q - c at row c
    # The first row of each segment that needs no cap; rows at or past the quota always pass.
    passes = room * w <= suffix_w * (1.0 + 1e-12)
    candidate = torch.where(passes, rank, counts.index_select(0, seg)).expand(len(fractions), -1)
    first = counts.unsqueeze(0).expand(len(fractions), -1).clone()
    first.scatter_reduce_(1, seg.expand(len(fractions), -1), candidate, "amin")
    uncapped = (first < counts) & (quota < counts.to(torch.float64))  # else: every pair kept
    row = (start.unsqueeze(0) + first).clamp(max=max(num_rows - 1, 0))
    r_c, t_c = suffix_w[row], suffix_s[row]
    left = (quota - first.to(torch.float64)).clamp(min=1e-300)
    added = torch.where(uncapped, (r_c * r_c / left - t_c).clamp(min=0), torch.zeros_like(r_c))
    return added.sum(1)


def added_variance_curve_reference(
    scores: torch.Tensor, counts: torch.Tensor, fractions: Sequence[float]
) -> torch.Tensor:
    """:func:`added_variance_curve` the slow way: per segment and fraction, cap by iteration
    (probabilities ``q' w_j / sum w`` over the uncapped rows, rows above 1 fixed at 1, repeat),
    then ``sum_j (1 / pi_j - 1) s_j`` over the pairs of positive probability."""
    s = scores.to(torch.float64).cpu().tolist()
    out = []
    for f in fractions:
        total, begin = 0.0, 0
        for n in counts.cpu().tolist():
            seg_s = s[begin : begin + n]
            begin += n
            quota = float(f) * n
            if n == 0 or quota >= n:
                continue
            w = [v**0.5 for v in seg_s]
            capped: set[int] = set()
            while True:
                rest = sum(w[j] for j in range(n) if j not in capped)
                share = quota - len(capped)
                new = {j for j in range(n) if j not in capped and rest > 0 and share * w[j] > rest}
                if not new:
                    break
                capped |= new
            for j in range(n):
                if j in capped or w[j] == 0:
                    continue
                pi = share * w[j] / rest
                total += (1.0 / pi - 1.0) * seg_s[j]
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def _suffix_sum(values: torch.Tensor) -> torch.Tensor:
    """``out[j] = sum(values[j:])``."""
    return values.flip(0).cumsum(0).flip(0)
