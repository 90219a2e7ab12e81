"""Expert MLP (fc1 -> activation [x routing weight] -> fc2) on rows grouped by expert.

Shape legend:
    N: rows (token-expert pairs), grouped by expert, groups contiguous and in order.
    G: local experts (groups); a group may hold 0 rows.
    H: hidden width (model dim).
    F: expert FFN hidden width (activation output).
    F1: fc1 output width, ``2F`` when gated, else ``F``.

Weights are stacked per expert in Megatron's Linear layout ``[out, in]``:
``w1: [G, F1, H]`` and ``w2: [G, H, F]`` (the experts module's parameters themselves).

Shape table (per expert ``g``, over its rows; ``p`` the optional routing weight):

    =========  ===========  ===============================================================
    name       shape        definition
    =========  ===========  ===============================================================
    x          [N, H]       input rows
    h          [N, F1]      ``x @ w1[g]^T``
    a          [N, F]       ``act(h)``, times ``p`` when given (Megatron's order: the
                            routing weight scales the activation before fc2), one rounding
    z          [N, H]       ``a @ w2[g]^T``
    dz         [N, H]       gradient of z
    da         [N, F]       ``dz @ w2[g]``
    dw2        [G, H, F]    ``sum dz^T a`` (``a`` recomputed from ``h``, fused with dh)
    dh         [N, F1]      activation backward of ``da`` (through ``p`` when given)
    dp         [N]          ``<da, act(h)>`` in fp32, only with ``p``
    dw1        [G, F1, H]   ``sum dh^T x``
    dx         [N, H]       ``dh @ w1[g]``
    =========  ===========  ===============================================================

Rows may also be grouped over several weight stacks (:func:`expert_forward_parts`,
:func:`expert_backward_parts`): the layer's own experts (its parameters) and the replicas of
other ranks' experts it holds for one call, each stack over its own contiguous row range, one
grouped GEMM per stack and projection, no concatenated weights.

Nothing here is autograd: the op in ``megatron_lrmoe/op.py`` calls these from its own
``forward`` / ``backward``. ``reference.py`` holds the slow autograd versions they are tested
against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from megatron_lrmoe.experts.activation import GluSpec, act_backward, act_forward
from megatron_lrmoe.experts.grouped_gemm import (
    Counts,
    GroupSizes,
    grouped_mm_nn,
    grouped_mm_nt,
    grouped_mm_tn,
)
from megatron_lrmoe.experts.wgrad_triton import MainGrads, accumulate_grouped_wgrad

__all__ = [
    "expert_backward",
    "expert_backward_parts",
    "expert_forward",
    "expert_forward_parts",
]


def _check_shapes(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, spec: GluSpec, what: str
) -> None:
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"{what}: expected x [N, H], w1 [G, F1, H], w2 [G, H, F]; got {tuple(x.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    g, f1, h = w1.shape
    f = w2.shape[2]
    if x.shape[1] != h or w2.shape[0] != g or w2.shape[1] != h or f1 != f * spec.fc1_multiplier:
        raise ValueError(
            f"{what}: inconsistent shapes x {tuple(x.shape)}, w1 {tuple(w1.shape)}, "
            f"w2 {tuple(w2.shape)} for gated={spec.gated} (need F1 = "
            f"{spec.fc1_multiplier} * F)"
        )


def expert_forward(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    probs: torch.Tensor | None = None,
    keep_act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs fc1, the activation (times ``probs``) and fc2 for every expert.

    Args:
        x: ``[N, H]`` input rows grouped by expert.
        w1: ``[G, F1, H]`` stacked fc1 weights.
        w2: ``[G, H, F]`` stacked fc2 weights.
        counts: Rows per expert (``G`` entries summing to ``N``), ideally a ``GroupSizes``.
        spec: Activation description.
        probs: Optional ``[N]`` routing weight of each row, applied before fc2.
        keep_act: Return the activation (fc2's input) instead of fc1's output.

    Returns:
        ``(z [N, H], h [N, F1])``: the output and fc1's output (the caller decides whether to
        keep ``h`` for backward); with ``keep_act``, ``(z, a [N, F])``.
    """
    _check_shapes(x, w1, w2, spec, "expert_forward")
    groups = GroupSizes(counts)  # one offsets build shared by both products
    h = grouped_mm_nt(x, w1, groups)
    a = act_forward(h, spec, probs)
    z = grouped_mm_nt(a, w2, groups)
    return z, (a if keep_act else h)


def expert_backward(
    dz: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    probs: torch.Tensor | None = None,
    need_dx: bool = True,
    h_rows: torch.Tensor | None = None,
    wgrad_into: MainGrads | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`expert_forward` given the gradient of ``z``.

    ``h`` is recomputed from ``x`` when ``None`` (recompute mode: one grouped GEMM on the rows
    at hand instead of keeping ``[N, F1]`` from forward). The activation output is recomputed
    inside the fused activation backward, never kept between forward and backward.

    Args:
        dz: ``[N, H]`` gradient of the MLP output, in the weights' dtype.
        x: ``[N, H]`` input rows the forward used.
        h: ``[N, F1]`` saved fc1 output, or ``None`` to recompute it.
        w1: ``[G, F1, H]`` stacked fc1 weights.
        w2: ``[G, H, F]`` stacked fc2 weights.
        counts: Rows per expert (``G`` entries summing to ``N``).
        spec: Activation description.
        probs: The ``[N]`` routing weights the forward applied, or ``None``.
        need_dx: Compute the input gradient (skip one grouped GEMM when ``False``).
        h_rows: Optional ``[N]`` int64: ``h`` is a larger saved ``[R, F1]`` and row ``i`` of
            the rows at hand is its row ``h_rows[i]`` (read in place by the activation
            backward, never gathered).
        wgrad_into: Optional :class:`MainGrads` (the weights' ``main_grad``): the weight
            gradients are added into them (or written over them, ``accumulate=False``) in
            fp32, in the GEMMs (:func:`accumulate_grouped_wgrad`), and ``dw1``, ``dw2`` come
            back ``None``.

    Returns:
        ``(dx [N, H] or None, dw1 [G, F1, H], dw2 [G, H, F], dprobs [N] fp32 or None)``;
        weight gradients in the weights' dtype, zero for experts without rows (``None`` with
        ``wgrad_into``).
    """
    _check_shapes(x, w1, w2, spec, "expert_backward")
    if dz.shape != x.shape:
        raise ValueError(f"expert_backward: dz {tuple(dz.shape)} != x {tuple(x.shape)}")
    groups = GroupSizes(counts)
    if h is None:
        if h_rows is not None:
            raise ValueError("expert_backward: h_rows given without a saved h")
        h = grouped_mm_nt(x, w1, groups)
    da = grouped_mm_nn(dz, w2, groups)
    dh, a, dprobs = act_backward(da, h, spec, probs, store_act=True, h_rows=h_rows)
    del da
    dw2 = _wgrad(dz, a, groups, w2.dtype, wgrad_into, "fc2")
    del a
    dw1 = _wgrad(dh, x, groups, w1.dtype, wgrad_into, "fc1")
    dx = grouped_mm_nn(dh, w1, groups) if need_dx else None
    return dx, dw1, dw2, dprobs


Weights = Sequence[tuple[torch.Tensor, torch.Tensor]]


def _part_rows(groups: list[GroupSizes], n: int, what: str) -> list[tuple[int, int]]:
    """``(start, end)`` row range of each weight stack's groups."""
    spans, start = [], 0
    for g in groups:
        end = start + sum(g.host_sizes())
        spans.append((start, end))
        start = end
    if start != n:
        raise ValueError(f"{what}: group sizes sum to {start} but there are {n} rows")
    return spans


def _parts_mm(
    fn, rows: torch.Tensor, stacks: list[torch.Tensor], groups, spans, width: int
) -> torch.Tensor:
    """One grouped product per weight stack, each into its row range of one output."""
    out = rows.new_empty((rows.shape[0], width))
    for w, g, (lo, hi) in zip(stacks, groups, spans):
        fn(rows[lo:hi], w, g, out=out[lo:hi])
    return out


def _parts_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    weights: list[torch.Tensor],
    groups: list[GroupSizes],
    spans: list[tuple[int, int]],
    into: MainGrads | None,
    proj: Literal["fc1", "fc2"],
) -> list[torch.Tensor | None]:
    """Weight gradient of every stack; the first one's into ``into``'s ``proj`` when given."""
    return [
        _wgrad(a[lo:hi], b[lo:hi], g, w.dtype, into if i == 0 else None, proj)
        for i, (w, g, (lo, hi)) in enumerate(zip(weights, groups, spans))
    ]


def _wgrad(
    a: torch.Tensor, b: torch.Tensor, groups: GroupSizes, dtype: torch.dtype,
    into: MainGrads | None, proj: Literal["fc1", "fc2"],
) -> torch.Tensor | None:
    """Per-group ``a_g^T b_g`` in ``dtype``, or (``into`` given) added into (written over)
    ``into``'s buffer of projection ``proj``: None."""
    if into is None:
        return grouped_mm_tn(a, b, groups, out_dtype=dtype)
    accumulate_grouped_wgrad(a, b, groups, getattr(into, proj), into.accumulate)
    return None


def expert_forward_parts(
    x: torch.Tensor,
    weights: Weights,
    counts: Sequence[Counts],
    spec: GluSpec,
    probs: torch.Tensor | None = None,
    keep_act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_forward` over rows whose groups use several weight stacks.

    Args:
        x: ``[N, H]`` rows grouped by expert; stack ``i``'s groups follow stack ``i-1``'s.
        weights: ``(w1 [G_i, F1, H], w2 [G_i, H, F])`` per stack.
        counts: Rows per group of each stack.
        spec: Activation description.
        probs: Optional ``[N]`` routing weight of each row.
        keep_act: As in :func:`expert_forward`.

    Returns:
        ``(z [N, H], h [N, F1])`` (``a [N, F]`` with ``keep_act``); one stack is exactly
        :func:`expert_forward`.
    """
    if len(weights) == 1:
        w1, w2 = weights[0]
        return expert_forward(x, w1, w2, counts[0], spec, probs, keep_act)
    for w1, w2 in weights:
        _check_shapes(x, w1, w2, spec, "expert_forward_parts")
    groups = [GroupSizes(c) for c in counts]
    spans = _part_rows(groups, x.shape[0], "expert_forward_parts")
    w1s, w2s = [w[0] for w in weights], [w[1] for w in weights]
    h = _parts_mm(grouped_mm_nt, x, w1s, groups, spans, w1s[0].shape[1])
    a = act_forward(h, spec, probs)
    z = _parts_mm(grouped_mm_nt, a, w2s, groups, spans, x.shape[1])
    return z, (a if keep_act else h)


def expert_backward_parts(
    dz: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None,
    weights: Weights,
    counts: Sequence[Counts],
    spec: GluSpec,
    probs: torch.Tensor | None = None,
    need_dx: bool = True,
    h_rows: torch.Tensor | None = None,
    wgrad_into: MainGrads | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """:func:`expert_backward` over rows whose groups use several weight stacks.

    ``h_rows`` and ``wgrad_into`` as in :func:`expert_backward` (rows of a larger saved ``h``;
    accumulators of the first stack's weight gradients, the parameters' own, which then come
    back as ``None`` in the lists).

    Returns:
        ``(dx [N, H] or None, [dw1 per stack], [dw2 per stack], dprobs [N] or None)``; one
        stack is exactly :func:`expert_backward`.
    """
    if len(weights) == 1:
        dx, dw1, dw2, dprobs = expert_backward(
            dz, x, h, weights[0][0], weights[0][1], counts[0], spec, probs, need_dx, h_rows,
            wgrad_into,
        )
        return dx, [dw1], [dw2], dprobs
    for w1, w2 in weights:
        _check_shapes(x, w1, w2, spec, "expert_backward_parts")
    if dz.shape != x.shape:
        raise ValueError(f"expert_backward_parts: dz {tuple(dz.shape)} != x {tuple(x.shape)}")
    groups = [GroupSizes(c) for c in counts]
    spans = _part_rows(groups, x.shape[0], "expert_backward_parts")
    w1s, w2s = [w[0] for w in weights], [w[1] for w in weights]
    if h is None:
        if h_rows is not None:
            raise ValueError("expert_backward_parts: h_rows given without a saved h")
        h = _parts_mm(grouped_mm_nt, x, w1s, groups, spans, w1s[0].shape[1])
    da = _parts_mm(grouped_mm_nn, dz, w2s, groups, spans, w2s[0].shape[2])
    dh, a, dprobs = act_backward(da, h, spec, probs, store_act=True, h_rows=h_rows)
    del da
    dw2 = _parts_wgrad(dz, a, w2s, groups, spans, wgrad_into, "fc2")
    del a
    dw1 = _parts_wgrad(dh, x, w1s, groups, spans, wgrad_into, "fc1")
    dx = _parts_mm(grouped_mm_nn, dh, w1s, groups, spans, x.shape[1]) if need_dx else None
    return dx, dw1, dw2, dprobs
