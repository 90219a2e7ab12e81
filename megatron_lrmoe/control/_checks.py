"""Input checks shared by the integer planning modules (host int64, never negative)."""

from __future__ import annotations

import torch


def long_tensor(t: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    """``t`` as int64 after checking its rank, integer dtype and sign.

    Raises:
        ValueError: wrong number of dimensions, a non-integer dtype, or a negative entry.
    """
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    t = t.to(torch.int64)
    if bool((t < 0).any()):
        raise ValueError(f"{name} must be non-negative")
    return t
