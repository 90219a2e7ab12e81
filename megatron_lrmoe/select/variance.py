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
"""

from __future__ import annotations

import torch

__all__ = ["added_variance", "added_variance_ratio"]


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
