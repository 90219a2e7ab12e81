"""What the torch reference (``scoring.py``) and the fused kernels (``select_triton.py``) share.

Shapes: N rows (token-expert pairs), G segments (contiguous row runs sharing a quota), K kept rows.

The result types of scoring and selection, and the input checks both paths run, so that both
reject the same inputs with the same messages. Kept apart so that ``select_triton.py`` does not
import ``scoring.py``, which calls into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "MAX_ROWS",
    "POLICIES",
    "PairScores",
    "Scored",
    "Selection",
    "check_policy",
    "check_scores",
    "check_uniforms",
    "checked_segments",
    "host_segments",
]

# Keeps every int64 product and prefix sum below 2**63: N * 2**32, quota * 2**32 and
# quota * (weight <= 2**32) all stay under 2**63 when N < 2**31.
MAX_ROWS = 1 << 31
POLICIES = ("topk", "sample")


class PairScores(NamedTuple):
    """Scores of one call's pairs (``scoring.pair_scores``)."""

    scores: torch.Tensor  # [N] fp32
    poison: torch.Tensor  # 0-dim fp32: 0, or NaN when a score is not finite
    total: torch.Tensor  # 0-dim fp32: sum of the finite scores (statistics)


@dataclass(frozen=True)
class Selection:
    """Rows kept for the backward and the gradient multiplier of each.

    Attributes:
        kept_index: ``[K]`` int64 positions of the kept rows, strictly ascending.
        weight: ``[K]`` float32 gradient multiplier of each kept row: 1 for ``topk`` and for rows
            kept with probability 1, ``1 / inclusion_probability`` for sampled rows.
        kept_per_segment: ``[G]`` int64 number of kept rows per segment (always equal to quota).
    """

    kept_index: torch.Tensor
    weight: torch.Tensor
    kept_per_segment: torch.Tensor

    @property
    def num_kept(self) -> int:
        """Number of kept rows K (a host int: the shape is known without a sync)."""
        return self.kept_index.numel()

    def kept_mask(self, n: int) -> torch.Tensor:
        """``[n]`` bool mask, True at kept rows.

        Args:
            n: number of rows N of the selection's input.

        Returns:
            ``[n]`` bool tensor on the selection's device.
        """
        mask = torch.zeros(n, dtype=torch.bool, device=self.kept_index.device)
        return mask.index_fill_(0, self.kept_index, True)

    def dense_weight(self, n: int) -> torch.Tensor:
        """``[n]`` float32 weights: the kept rows' weight, 0 for dropped rows.

        Args:
            n: number of rows N of the selection's input.

        Returns:
            ``[n]`` float32 tensor on the selection's device.
        """
        dense = torch.zeros(n, dtype=torch.float32, device=self.kept_index.device)
        return dense.index_copy_(0, self.kept_index, self.weight)


class Scored(NamedTuple):
    """What ``scoring.score_and_select`` returns."""

    scores: PairScores
    selection: Selection
    kept_total: torch.Tensor | None  # 0-dim fp32 sum of the kept rows' finite scores, if asked


def host_segments(
    counts: torch.Tensor, quota: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks ``counts`` / ``quota`` against ``n`` rows; returns both as host int64 tensors.

    Shared by the torch path and the Triton path (``select/select_triton.py``), so both reject the
    same inputs with the same messages. What the planner hands the backward (host int64 ``[G]``
    tensors) takes one combined test, since this runs in every backward before the first GEMM;
    anything else, and anything that test rejects, goes through :func:`checked_segments`, whose
    checks name what is wrong.
    """
    planned = (
        counts.dtype == torch.int64
        and quota.dtype == torch.int64
        and counts.device.type == "cpu"
        and quota.device.type == "cpu"
        and counts.dim() == 1
        and quota.shape == counts.shape
        and n < MAX_ROWS
    )
    if planned:
        c, q = counts.numpy(), quota.numpy()
        # A negative count fails the quota test too (0 <= quota <= count).
        if int(c.sum()) == n and not bool(((q < 0) | (q > c)).any()):
            return counts, quota
    return checked_segments(counts, quota, n)


def checked_segments(
    counts: torch.Tensor, quota: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`host_segments` check by check, each failure with its own message."""
    if counts.dim() != 1 or quota.shape != counts.shape:
        raise ValueError(
            "counts and quota must be [G] tensors of one shape, got "
            f"{tuple(counts.shape)} and {tuple(quota.shape)}"
        )
    for name, t in (("counts", counts), ("quota", quota)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if n >= MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS - 1} rows are supported, got {n}")
    if counts.device.type == "cpu" and quota.device.type == "cpu":
        # The usual case (the planner's host tensors): numpy checks cost ~1 us each where
        # torch CPU ops cost ~5 us, and this runs in the backward before the first GEMM.
        counts_h = counts if counts.dtype == torch.int64 else counts.to(torch.int64)
        quota_h = quota if quota.dtype == torch.int64 else quota.to(torch.int64)
        c, q = counts_h.numpy(), quota_h.numpy()
        if c.size and c.min() < 0:
            g = int((c < 0).argmax())
            raise ValueError(f"segment {g}: count {int(c[g])} is negative")
        bad = (q < 0) | (q > c)
        if bad.any():
            g = int(bad.argmax())
            raise ValueError(f"segment {g}: quota {int(q[g])} is outside [0, count={int(c[g])}]")
        total = int(c.sum())
        if total != n:
            raise ValueError(f"segment counts add up to {total}, but there are {n} rows")
        return counts_h, quota_h
    else:
        # NOTE: device-to-host sync: validating the segments and sizing the kept-row outputs need
        # the values on the host; pass CPU counts/quota (as the planner produces them) to avoid it.
        where = counts.device if counts.device.type != "cpu" else quota.device
        host = torch.stack([counts.to(where, torch.int64), quota.to(where, torch.int64)]).cpu()
    counts_h, quota_h = host[0], host[1]
    bad = torch.nonzero(counts_h < 0).flatten()
    if bad.numel():
        g = int(bad[0])
        raise ValueError(f"segment {g}: count {int(counts_h[g])} is negative")
    bad = torch.nonzero((quota_h < 0) | (quota_h > counts_h)).flatten()
    if bad.numel():
        g = int(bad[0])
        raise ValueError(
            f"segment {g}: quota {int(quota_h[g])} is outside [0, count={int(counts_h[g])}]"
        )
    total = int(counts_h.sum())
    if total != n:
        raise ValueError(f"segment counts add up to {total}, but there are {n} rows")
    return counts_h, quota_h


def check_policy(policy: str, uniforms: torch.Tensor | None) -> bool:
    """Rejects an unknown policy and ``"sample"`` without uniforms; returns whether it samples.
    Shared by ``scoring.select`` and the fused paths (``select/select_triton.py``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown selection policy {policy!r}; expected one of {POLICIES}")
    if policy == "sample" and uniforms is None:
        raise ValueError("policy 'sample' needs uniforms (see draw_uniforms)")
    return policy == "sample"


def check_uniforms(uniforms: torch.Tensor, num_segments: int) -> None:
    """Rejects ``uniforms`` that are not a floating ``[G]`` tensor."""
    if uniforms.shape != (num_segments,) or not uniforms.is_floating_point():
        raise ValueError(
            f"uniforms must be a [G] = [{num_segments}] floating tensor, got "
            f"{uniforms.dtype} {tuple(uniforms.shape)}"
        )


def check_scores(scores: torch.Tensor) -> torch.Tensor:
    """Rejects ``scores`` that are not a floating ``[N]`` tensor; returns them detached, fp32."""
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(
            f"scores must be a [N] floating tensor, got {scores.dtype} {tuple(scores.shape)}"
        )
    # Scores are fp32 by contract (lrm_scores); ordering and probabilities work at fp32 resolution
    # so that the sort key and the weights agree.
    return scores.detach().to(torch.float32)
