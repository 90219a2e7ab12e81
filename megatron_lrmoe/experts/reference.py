"""Slow, obvious versions of the expert ops, for tests only.

Shape legend:
    N: rows grouped by expert; G: experts; H: hidden; F: FFN width; F1: ``2F`` if gated else F.

Everything here loops over groups in Python and uses plain, differentiable torch ops so that
autograd provides the reference gradients. ``reference_expert_mlp`` follows Megatron's order
(probabilities multiplied into the activation before fc2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron_lrmoe.experts.activation import GluSpec

__all__ = [
    "reference_activation",
    "reference_expert_mlp",
    "reference_grouped_mm_nn",
    "reference_grouped_mm_nt",
    "reference_grouped_mm_tn",
]


def _sizes(counts: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(counts, torch.Tensor):
        return [int(c) for c in counts.tolist()]
    return [int(c) for c in counts]


def _starts(sizes: list[int]) -> list[int]:
    starts, acc = [], 0
    for c in sizes:
        starts.append(acc)
        acc += c
    return starts


def reference_grouped_mm_nt(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``[N, K] x [G, M, K] -> [N, M]``: rows of group g times ``w[g]^T``."""
    sizes = _sizes(counts)
    parts = [
        x[s : s + c] @ w[g].t() for g, (s, c) in enumerate(zip(_starts(sizes), sizes, strict=True))
    ]
    return torch.cat(parts, dim=0) if parts else x.new_zeros((0, w.shape[1]))


def reference_grouped_mm_nn(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``[N, M] x [G, M, K] -> [N, K]``: rows of group g times ``w[g]``."""
    sizes = _sizes(counts)
    parts = [
        x[s : s + c] @ w[g] for g, (s, c) in enumerate(zip(_starts(sizes), sizes, strict=True))
    ]
    return torch.cat(parts, dim=0) if parts else x.new_zeros((0, w.shape[2]))


def reference_grouped_mm_tn(
    a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``[N, M] x [N, K] -> [G, M, K]``: per group ``sum_i a_i^T b_i`` (zeros when empty)."""
    sizes = _sizes(counts)
    outs = []
    for s, c in zip(_starts(sizes), sizes, strict=True):
        if c == 0:
            outs.append(a.new_zeros((a.shape[1], b.shape[1])))
        else:
            outs.append(a[s : s + c].t() @ b[s : s + c])
    if not outs:
        return a.new_zeros((0, a.shape[1], b.shape[1]))
    return torch.stack(outs, dim=0)


def reference_activation(h: torch.Tensor, spec: GluSpec) -> torch.Tensor:
    """Megatron's activation in plain torch ops: ``act(h)`` or ``act(gate) * up``."""
    act = F.silu if spec.kind == "silu" else F.gelu
    if spec.gated:
        gate, up = torch.chunk(h, 2, dim=-1)
        return act(gate) * up
    return act(h)


def reference_expert_mlp(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
    spec: GluSpec,
) -> torch.Tensor:
    """Expert MLP per group with a Python loop, differentiable through autograd.

    Args:
        x: ``[N, H]`` rows grouped by expert.
        probs: ``[N]`` routing probabilities or ``None``.
        w1: ``[G, F1, H]`` fc1 weights.
        w2: ``[G, H, F]`` fc2 weights.
        counts: Rows per expert.
        spec: Activation description.

    Returns:
        ``[N, H]``; each row is ``fc2((act(fc1(x)) * p).to(dtype))`` as in Megatron.
    """
    sizes = _sizes(counts)
    parts = []
    for g, (s, c) in enumerate(zip(_starts(sizes), sizes, strict=True)):
        if c == 0:
            continue
        h = x[s : s + c] @ w1[g].t()
        a = reference_activation(h, spec)
        if probs is not None:
            a = (a * probs[s : s + c].unsqueeze(-1)).to(a.dtype)
        parts.append(a @ w2[g].t())
    return torch.cat(parts, dim=0) if parts else x.new_zeros((0, w2.shape[1]))
