"""Expert MLP (fc1 -> activation -> fc2) on rows grouped by expert, with an explicit backward.

Shape legend:
    N: rows (token-expert rows), grouped by expert, groups contiguous and in order.
    G: local experts (groups); a group may hold 0 rows.
    H: hidden width (model dim).
    F: expert FFN hidden width (activation output).
    F1: fc1 output width, ``2F`` when gated, else ``F``.

Weights are stacked per expert in Megatron's Linear layout ``[out, in]``:
``w1: [G, F1, H]`` and ``w2: [G, H, F]``.

Shape table (per expert ``g``, over its rows):

    =========  ===========  =====================================
    name       shape        definition
    =========  ===========  =====================================
    x          [N, H]       input rows
    h          [N, F1]      ``x @ w1[g]^T``
    a          [N, F]       ``act(h)`` (see ``activation.py``)
    z          [N, H]       ``a @ w2[g]^T``
    dz         [N, H]       gradient of z
    dw2        [G, H, F]    ``sum dz^T a``
    da         [N, F]       ``dz @ w2[g]``
    dh         [N, F1]      ``act_backward(da, h)``
    dw1        [G, F1, H]   ``sum dh^T x``
    dx         [N, H]       ``dh @ w1[g]``
    =========  ===========  =====================================

Routing probabilities are not applied inside the MLP functions: callers multiply ``z`` by them.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lrmoe.experts.activation import GluSpec, act_backward, act_forward
from megatron_lrmoe.experts.grouped_gemm import (
    Counts,
    GroupSizes,
    grouped_mm_nn,
    grouped_mm_nt,
    grouped_mm_tn,
)
from megatron_lrmoe.dispatch.rows import row_dot, scale_rows

__all__ = [
    "GroupedExpertMLP",
    "expert_mlp_backward",
    "expert_mlp_forward",
    "grouped_expert_mlp",
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


def expert_mlp_forward(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    save_h: bool,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs fc1, the activation and fc2 for every expert.

    With ``probs``, each row's activation is scaled by its routing weight before fc2, in
    Megatron's order and rounding (``(act(h) * p).to(dtype)``); the output is then the weighted
    expert output.

    Args:
        x: ``[N, H]`` input rows grouped by expert.
        w1: ``[G, F1, H]`` stacked fc1 weights.
        w2: ``[G, H, F]`` stacked fc2 weights.
        counts: Rows per expert (``G`` entries summing to ``N``).
        spec: Activation description.
        save_h: Return the fc1 output so a backward can skip recomputing it.

    Returns:
        ``(z, h)``: ``z`` is ``[N, H]``; ``h`` is ``[N, F1]`` when ``save_h`` else ``None``.
    """
    _check_shapes(x, w1, w2, spec, "expert_mlp_forward")
    groups = GroupSizes(counts)  # one offsets build shared by both products
    h = grouped_mm_nt(x, w1, groups)
    a = act_forward(h, spec)
    if probs is not None:
        a = scale_rows(a, probs)
    z = grouped_mm_nt(a, w2, groups)
    return z, (h if save_h else None)


def expert_mlp_backward(
    dz: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    need_dx: bool = True,
    wgrad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`expert_mlp_forward` given the gradient of ``z``.

    Recomputes ``h = x @ w1[g]^T`` when ``h`` is ``None`` and always recomputes ``a = act(h)``
    (elementwise, cheaper than keeping ``[N, F]`` alive between forward and backward).

    Args:
        dz: ``[N, H]`` gradient of the MLP output, same dtype as the weights.
        x: ``[N, H]`` input rows the forward used.
        h: ``[N, F1]`` saved fc1 output, or ``None`` to recompute it.
        w1: ``[G, F1, H]`` stacked fc1 weights.
        w2: ``[G, H, F]`` stacked fc2 weights.
        counts: Rows per expert (``G`` entries summing to ``N``).
        spec: Activation description.
        need_dx: Compute the input gradient (skip one grouped GEMM when ``False``).
        wgrad_dtype: dtype of ``dw1``/``dw2``; defaults to the weights' dtype. The GEMMs run in
            the operands' dtype and are cast afterwards (see ``grouped_mm_tn``).

    Returns:
        ``(dx, dw1, dw2)``: ``dx`` ``[N, H]`` or ``None``; ``dw1`` ``[G, F1, H]``; ``dw2``
        ``[G, H, F]``. Experts with no rows get zero weight gradients.
    """
    dx, dw1, dw2, _ = weighted_expert_mlp_backward(
        dz, x, h, w1, w2, counts, spec, None, need_dx=need_dx, wgrad_dtype=wgrad_dtype
    )
    return dx, dw1, dw2


def weighted_expert_mlp_backward(
    dz: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    probs: torch.Tensor | None,
    need_dx: bool = True,
    wgrad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`expert_mlp_forward` with ``probs`` (Megatron's order).

    ``dz`` is the gradient of the weighted output. With ``probs`` ``None`` this is
    :func:`expert_mlp_backward`. Otherwise, as Megatron's autograd of ``fc2((a * p).to(dtype))``:
    ``dW2 = dz^T (a p)``, ``d(a p) = dz W2``, ``d p = <d(a p), a>`` in fp32 and
    ``d a = d(a p) p``.

    Returns:
        ``(dx, dw1, dw2, dprobs)``; ``dprobs`` is ``[N]`` fp32, or ``None`` without ``probs``.
    """
    _check_shapes(x, w1, w2, spec, "expert_mlp_backward")
    if dz.shape != x.shape:
        raise ValueError(f"expert_mlp_backward: dz {tuple(dz.shape)} != x {tuple(x.shape)}")
    groups = GroupSizes(counts)
    if h is None:
        h = grouped_mm_nt(x, w1, groups)
    w1_dtype = wgrad_dtype if wgrad_dtype is not None else w1.dtype
    w2_dtype = wgrad_dtype if wgrad_dtype is not None else w2.dtype
    a = act_forward(h, spec)
    dprobs = None
    if probs is None:
        dw2 = grouped_mm_tn(dz, a, groups, out_dtype=w2_dtype)
        del a  # release [N, F] before the next [N, F1] temporaries
        da = grouped_mm_nn(dz, w2, groups)
    else:
        dw2 = grouped_mm_tn(dz, scale_rows(a, probs), groups, out_dtype=w2_dtype)
        d_ap = grouped_mm_nn(dz, w2, groups)
        dprobs = row_dot(d_ap, a, torch.float32)
        del a
        da = scale_rows(d_ap, probs)
        del d_ap
    dh = act_backward(da, h, spec)
    del da
    dw1 = grouped_mm_tn(dh, x, groups, out_dtype=w1_dtype)
    dx = grouped_mm_nn(dh, w1, groups) if need_dx else None
    return dx, dw1, dw2, dprobs


def _wide(dtype: torch.dtype) -> torch.dtype:
    # At least fp32 (fp64 stays fp64 so gradcheck in double precision is meaningful).
    return torch.promote_types(dtype, torch.float32)


def _apply_probs(t: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    # Megatron computes ``(a * p).to(a.dtype)`` with fp32 probs; do the product in fp32 too.
    cdt = _wide(t.dtype)
    return (t.to(cdt) * probs.to(cdt).unsqueeze(-1)).to(t.dtype)


class GroupedExpertMLP(torch.autograd.Function):
    """``y = probs[:, None] * expert_mlp(x)`` with the explicit grouped backward.

    ==========  ===========  ==============================================================
    role        name         shape / note
    ==========  ===========  ==============================================================
    input       x            [N, H] rows grouped by expert
    input       probs        [N] routing probability per row, or ``None`` (no scaling)
    input       w1           [G, F1, H] stacked fc1 weights
    input       w2           [G, H, F] stacked fc2 weights
    input       counts       rows per expert (list / CPU LongTensor / ``GroupSizes``)
    input       spec         ``GluSpec``
    input       save_h       optional bool (default ``True``): keep fc1's output for backward
    output      y            [N, H], dtype of x: ``(z.float() * probs[:, None]).to(z.dtype)``
    saved       x, w1, w2    when any of x, w1, w2 needs a gradient
    saved       h            [N, F1], same condition and ``save_h``; else recomputed
    saved       probs        [N], same condition (scales dy into dz)
    saved       z            [N, H], only when probs needs a gradient (dprobs = <dy, z>)
    recomputed  a            [N, F] = act(h): elementwise, cheaper to redo than to keep
    recomputed  h            only when ``save_h`` is ``False``: one grouped GEMM traded for
                             [N, F1] of activation memory
    grads       dx, dprobs,  [N, H], [N] (dtype of probs), [G, F1, H], [G, H, F]; ``None`` for
                dw1, dw2     inputs that do not need them
    ==========  ===========  ==============================================================

    Megatron multiplies the probabilities into the activation before fc2; we multiply after
    fc2. Both are equal in exact arithmetic because fc2 is linear per row; in bf16 they differ by
    rounding only. Rows with probability 0 still get a (zero) contribution to the weight grads.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        probs: torch.Tensor | None,
        w1: torch.Tensor,
        w2: torch.Tensor,
        counts: Counts,
        spec: GluSpec,
        save_h: bool = True,
    ) -> torch.Tensor:
        """Runs the experts and scales each row by its probability.

        Args:
            ctx: Autograd context.
            x: ``[N, H]`` rows grouped by expert.
            probs: ``[N]`` routing probabilities or ``None``.
            w1: ``[G, F1, H]`` fc1 weights.
            w2: ``[G, H, F]`` fc2 weights.
            counts: Rows per expert.
            spec: Activation description.
            save_h: Keep the fc1 output for backward instead of recomputing it.

        Returns:
            ``[N, H]`` output rows.
        """
        if probs is not None and probs.shape != x.shape[:1]:
            raise ValueError(
                f"GroupedExpertMLP: probs must be [N] = [{x.shape[0]}], got {tuple(probs.shape)}"
            )
        groups = GroupSizes(counts)
        need_mlp = ctx.needs_input_grad[0] or ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        need_dprobs = probs is not None and ctx.needs_input_grad[1]
        z, h = expert_mlp_forward(x, w1, w2, groups, spec, save_h=need_mlp and save_h)
        y = z if probs is None else _apply_probs(z, probs)
        ctx.groups = groups
        ctx.spec = spec
        ctx.need_mlp = need_mlp
        ctx.need_dprobs = need_dprobs
        ctx.probs_dtype = probs.dtype if probs is not None else None
        ctx.save_for_backward(
            x if need_mlp else None,
            h,
            w1 if need_mlp else None,
            w2 if need_mlp else None,
            probs if need_mlp else None,
            z if need_dprobs else None,
        )
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Returns ``(dx, dprobs, dw1, dw2, None, None, None)``.

        Args:
            ctx: Autograd context.
            dy: ``[N, H]`` gradient of the output.

        Returns:
            Gradients matching ``forward``'s inputs.
        """
        x, h, w1, w2, probs, z = ctx.saved_tensors
        dx = dprobs = dw1 = dw2 = None
        if ctx.need_dprobs:
            cdt = _wide(torch.promote_types(z.dtype, ctx.probs_dtype))
            dprobs = (dy.to(cdt) * z.to(cdt)).sum(dim=-1).to(ctx.probs_dtype)
        if ctx.need_mlp:
            dz = dy.to(x.dtype) if probs is None else _apply_probs(dy.to(x.dtype), probs)
            dx, dw1, dw2 = expert_mlp_backward(
                dz, x, h, w1, w2, ctx.groups, ctx.spec, need_dx=ctx.needs_input_grad[0]
            )
            if not ctx.needs_input_grad[2]:
                dw1 = None
            if not ctx.needs_input_grad[3]:
                dw2 = None
        return dx, dprobs, dw1, dw2, None, None, None


def grouped_expert_mlp(
    x: torch.Tensor,
    probs: torch.Tensor | None,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: Counts,
    spec: GluSpec,
    save_h: bool = True,
) -> torch.Tensor:
    """Typed wrapper around ``GroupedExpertMLP.apply`` (see its shape table).

    Args:
        x: ``[N, H]`` rows grouped by expert.
        probs: ``[N]`` routing probabilities or ``None``.
        w1: ``[G, F1, H]`` fc1 weights.
        w2: ``[G, H, F]`` fc2 weights.
        counts: Rows per expert.
        spec: Activation description.
        save_h: Keep the fc1 output for backward instead of recomputing it.

    Returns:
        ``[N, H]`` output rows, differentiable w.r.t. x, probs, w1 and w2.
    """
    return GroupedExpertMLP.apply(x, probs, w1, w2, counts, spec, save_h)
