"""Per-expert quotas and their split over source ranks.

Shapes: E experts, P source ranks. ``N[r, e]`` pairs from source r to expert e, ``W[e] = sum_r N``.

The torch functions are the public, validated API; the ``*_np`` twins are what the controller
calls on its hot path (numpy on host int64, no validation, the same results: tests compare them).
Everything is exact integer arithmetic and deterministic, so every rank computes the same quotas.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from megatron_lrmoe.control._checks import long_tensor

__all__ = [
    "SourceSplit",
    "expert_quotas",
    "largest_cap",
    "quotas_np",
    "reference_largest_cap",
    "split_np",
    "split_quota_over_sources",
    "water_fill_np",
]

# A product keep_ratio * N within this much above an integer counts as that integer: float64 keeps
# about 16 digits, so noise in a ratio such as 0.1 + 0.2 or 1 - 0.7 never adds a pair.
_ABS_TOL = 1e-9
_REL_TOL = 1e-12
_NO_UNIT = np.iinfo(np.int64).max  # a threshold no key reaches


def _check_keep_ratio(keep_ratio: float) -> float:
    keep_ratio = float(keep_ratio)
    if not (math.isfinite(keep_ratio) and 0.0 <= keep_ratio <= 1.0):
        raise ValueError(f"keep_ratio must be in [0, 1], got {keep_ratio}")
    return keep_ratio


def expert_quotas(tokens_per_expert: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Per-expert quota ``Q[e] = ceil(keep_ratio * N[e])``, immune to float noise.

    Invariants: ``0 <= Q <= N``; ``keep_ratio == 1`` gives ``N``; ``keep_ratio == 0`` gives 0;
    ``Q`` is non-decreasing in ``keep_ratio`` and in ``N``. The product is formed in float64 and a
    value at most ``1e-9 + 1e-12 * product`` above an integer counts as that integer, so
    ``0.3 * 10`` gives 3 and ``(1 - 0.7) * 10`` gives 3, not 4.

    Args:
        tokens_per_expert: ``[E]`` int pairs routed to each expert, ``N[e] >= 0``.
        keep_ratio: fraction of each expert's pairs kept for backward, in ``[0, 1]``.

    Returns:
        ``[E]`` int64 quotas on the input's device.

    Raises:
        ValueError: negative counts or a keep ratio outside ``[0, 1]``.
    """
    n = long_tensor(tokens_per_expert, "tokens_per_expert", 1)
    keep_ratio = _check_keep_ratio(keep_ratio)
    ideal = n.to(torch.float64) * keep_ratio
    quota = torch.ceil(ideal - (_ABS_TOL + _REL_TOL * ideal)).to(torch.int64)
    return torch.minimum(quota.clamp_min(0), n)


def quotas_np(tokens_per_expert: np.ndarray, keep_ratio: float) -> np.ndarray:
    """:func:`expert_quotas` on a host int64 array (no validation; the controller's hot path)."""
    if keep_ratio >= 1.0:
        return tokens_per_expert.copy()
    ideal = tokens_per_expert * float(keep_ratio)
    quota = np.ceil(ideal - (_ABS_TOL + _REL_TOL * ideal)).astype(np.int64)
    return np.minimum(np.maximum(quota, 0), tokens_per_expert)


def water_fill_np(uncapped: np.ndarray, cap: int | None) -> np.ndarray:
    """Quotas under a common per-expert cap: ``min(uncapped, cap)`` (hot experts trimmed first)."""
    return uncapped.copy() if cap is None else np.minimum(uncapped, cap)


def largest_cap(uncapped: np.ndarray, outside: np.ndarray, room: int) -> Optional[int]:
    """Largest common cap c >= 0 with ``sum_e max(0, min(uncapped[e], c) - outside[e]) <= room``.

    The left side is what a rank set R must hold of the quotas ``min(uncapped, c)`` when each
    expert's holders outside R can take at most ``outside[e]`` (the controller's budget cuts).
    It is piecewise linear and non-decreasing in c, with slope changes at ``outside[e]`` (+1) and
    ``uncapped[e]`` (-1): one sort of those points finds the segment where it crosses ``room``.

    Returns:
        The cap, None when no cap is too large, -1 when even c = 0 is (``room < 0``).
    """
    active = uncapped > outside
    start, end = outside[active], uncapped[active]
    if int((end - start).sum()) <= room:
        return None
    if room < 0:
        return -1
    if start.size <= _FEW_SEGMENTS:
        return _largest_cap_walk(start.tolist(), end.tolist(), room)
    points = np.concatenate([start, end])
    steps = np.concatenate([np.ones(start.size, np.int64), np.full(end.size, -1, np.int64)])
    order = np.argsort(points, kind="stable")
    points = points[order]
    slope = np.cumsum(steps[order])  # on [points[k], points[k + 1]]
    value = np.concatenate([[0], np.cumsum(slope[:-1] * np.diff(points))])  # at points[k]
    k = int(np.searchsorted(value, room, side="right")) - 1
    return int(points[k] + (room - value[k]) // slope[k])


# Up to this many experts with pairs a cut must hold (typical: a cut of a few ranks), the
# breakpoints are walked in Python: a few dozen host ints cost less than a dozen array calls.
_FEW_SEGMENTS = 48


def _largest_cap_walk(start: list[int], end: list[int], room: int) -> int:
    """:func:`largest_cap`'s crossing by a walk over the sorted breakpoints (``0 <= room <
    sum(end - start)``): the held amount grows with slope ``#{e: start[e] < c <= end[e]}``."""
    events = sorted([(x, 1) for x in start] + [(x, -1) for x in end])
    value, slope, before = 0, 0, events[0][0]
    for point, step in events:
        reached = value + slope * (point - before)
        if reached > room:  # crosses room on [before, point): slope > 0 there
            return before + (room - value) // slope
        value, before = reached, point
        slope += step
    raise AssertionError("sum(end - start) > room: the walk crosses room")


def reference_largest_cap(uncapped: np.ndarray, outside: np.ndarray, room: int) -> Optional[int]:
    """The slow, obvious :func:`largest_cap`: every cap from 0 to ``max(uncapped)`` in turn."""

    def held(cap: int) -> int:
        return int(np.maximum(np.minimum(uncapped, cap) - outside, 0).sum())

    top = int(uncapped.max(initial=0))
    if held(top) <= room:
        return None
    return next(c for c in range(top, -2, -1) if c < 0 or held(c) <= room)


def split_quota_over_sources(
    tokens_per_source_expert: torch.Tensor, quota: torch.Tensor
) -> torch.Tensor:
    """Apportions each expert's quota over source ranks in proportion to their pairs.

    Largest-remainder (Hamilton) apportionment with exact integers: source r first gets
    ``floor(Q[e] * N[r, e] / N[e])``; the units left over go one each to the sources with the
    largest remainders ``Q[e] * N[r, e] mod N[e]``, ties to the lower source rank.

    Invariants: ``0 <= S[r, e] <= N[r, e]``; ``S.sum(0) == Q``; ``|S[r, e] - Q[e] N[r, e] / N[e]|
    < 1``; deterministic.

    Args:
        tokens_per_source_expert: ``[P, E]`` int pairs ``N[r, e]`` from source r to expert e.
        quota: ``[E]`` int quotas, ``0 <= Q[e] <= sum_r N[r, e]``.

    Returns:
        ``[P, E]`` int64 per-source quotas ``S``.

    Raises:
        ValueError: malformed shapes, negative counts, or a quota above its expert's pairs.
    """
    n = long_tensor(tokens_per_source_expert, "tokens_per_source_expert", 2)
    q = long_tensor(quota, "quota", 1).to(n.device)
    num_sources, num_experts = n.shape
    if q.numel() != num_experts:
        raise ValueError(f"quota has {q.numel()} experts, counts have {num_experts}")
    total = n.sum(0)
    bad = torch.nonzero(q > total).flatten()
    if bad.numel():
        e = int(bad[0])
        raise ValueError(f"expert {e}: quota {int(q[e])} exceeds its {int(total[e])} pairs")
    if bool((total >= (1 << 31)).any()):
        raise ValueError("an expert with 2**31 pairs or more would overflow Q * N in int64")
    numer = q.unsqueeze(0) * n  # < 2**62 since q, n <= total < 2**31
    denom = total.clamp_min(1).unsqueeze(0)  # an expert without pairs has quota 0: any divisor
    base = torch.div(numer, denom, rounding_mode="floor")
    remainder = numer - base * denom  # shares one denominator per expert: exact comparison
    leftover = q - base.sum(0)  # in [0, P); at most the number of positive remainders
    # Rank the sources of every expert by (remainder descending, source ascending) with one flat
    # stable sort on the exact key (expert, 2**31 - 1 - remainder): remainders are below N[e] <
    # 2**31. A flat sort is several times faster on CPU than a sort along dim 0.
    key = torch.arange(num_experts, device=n.device).unsqueeze(1) * (1 << 31) + (
        (1 << 31) - 1 - remainder.t()
    )
    order = torch.argsort(key.reshape(-1), stable=True)
    flat_position = torch.empty_like(order)
    flat_position[order] = torch.arange(order.numel(), device=n.device)
    position = (flat_position.view(num_experts, num_sources) % max(num_sources, 1)).t()
    return base + (position < leftover.unsqueeze(0)).to(torch.int64)


def split_np(counts: np.ndarray, quota: np.ndarray) -> np.ndarray:
    """:func:`split_quota_over_sources` on host int64 arrays, columns = groups (no validation).

    ``counts`` is ``[P, G]`` (sources x groups, a group being an expert or an (expert, holder)
    sub-chunk), ``quota`` ``[G]`` with ``quota <= counts.sum(0)``. Works group-major: sources are
    ranked by the unique key ``remainder * P + (P - 1 - source)`` (larger first: remainder
    descending, then the lower source), so one sort per group row and a threshold on the
    ``leftover``-th largest key replace the stable arg-sort.
    """
    num_sources = counts.shape[0]
    if num_sources == 1:  # one source holds every pair: its share is the whole quota
        return quota[None, :].astype(np.result_type(quota, counts))
    by_group = counts.T
    total = by_group.sum(1)
    base, key = np.divmod(quota[:, None] * by_group, np.maximum(total, 1)[:, None])
    leftover = quota - base.sum(1)
    if leftover.any():
        key *= num_sources
        key += num_sources - 1 - np.arange(num_sources)
        ranked = np.sort(key, axis=1)
        threshold = ranked[
            np.arange(key.shape[0]), np.minimum(num_sources - leftover, num_sources - 1)
        ]
        threshold[leftover == 0] = _NO_UNIT
        base += key >= threshold[:, None]
    return base.T


class SourceSplit:
    """The split of quotas over sources (:func:`split_np`), computed in full only when asked.

    A rank's op needs one row (what it sends) and its own experts' columns (what it receives);
    both cost a fraction of the full ``[P, E]`` split, which stays available (and cached).

    Args:
        counts: ``[P, E]`` int64 pairs per (source, expert).
        quota: ``[E]`` int64 quotas.
        matrix: The full split if already known (e.g. the controller's save-mode re-split).
    """

    def __init__(
        self, counts: np.ndarray, quota: np.ndarray, matrix: np.ndarray | None = None
    ) -> None:
        self.counts, self.quota, self._matrix = counts, quota, matrix

    def full(self) -> np.ndarray:
        """``[P, E]`` int64, C-contiguous."""
        if self._matrix is None:
            self._matrix = np.ascontiguousarray(split_np(self.counts, self.quota))
        return self._matrix

    def row(self, source: int) -> np.ndarray:
        """``[E]`` the split's row ``source`` (ranks it in each column without sorting)."""
        if self._matrix is not None:
            return self._matrix[source].copy()
        num_sources = self.counts.shape[0]
        base, key = np.divmod(
            self.quota[None, :] * self.counts, np.maximum(self.counts.sum(0), 1)[None, :]
        )
        leftover = self.quota - base.sum(0)
        key *= num_sources
        key += (num_sources - 1 - np.arange(num_sources))[:, None]
        ahead = np.count_nonzero(key > key[source][None, :], axis=0)
        return base[source] + (ahead < leftover)

    def columns(self, experts: np.ndarray | slice) -> np.ndarray:
        """``[P, len(experts)]`` the split's columns ``experts``."""
        if self._matrix is not None:
            return self._matrix[:, experts].copy()
        return np.ascontiguousarray(split_np(self.counts[:, experts], self.quota[experts]))
