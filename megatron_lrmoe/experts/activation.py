"""Expert activation (plain or gated) with an analytic backward.

Shape legend:
    N: rows (token-expert rows).
    F: expert FFN hidden width (activation output).
    F1: fc1 output width, ``2F`` when gated, else ``F``.

Gated layout follows Megatron's ``glu`` with ``glu_linear_offset == 0`` and no interleaving:
``h = [gate | up]`` split in halves along the last dim, ``a = act(gate) * up``.

All math runs in fp32 (fp64 for fp64 inputs, so ``gradcheck`` works) and results are cast
back to ``h``'s dtype, so bf16 inputs get one rounding per output instead of one per
intermediate.

On CUDA (with ``triton`` importable and ``KernelOptions.triton`` on) bf16/fp16/fp32 inputs go
through one fused Triton kernel per call (``activation_triton.py``): the torch code below
materialises several fp32 ``[N, F1]`` temporaries, one kernel each, while the fused kernel reads
``h`` (and ``d_a``) once and writes the result once. Same formulas, fp32 in registers, one
rounding, so results agree with the torch path to within one ulp of the output dtype (beyond
that only where fp32 itself cancels, e.g. GELU's far negative tail). The torch path stays for
CPU, fp64, inputs that need autograd (the kernels have no graph), and as the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_lrmoe import triton_common
from megatron_lrmoe.config import ActivationKind, expert_activation
from megatron_lrmoe.experts import activation_triton

__all__ = [
    "ActivationKind",
    "GluSpec",
    "act_backward",
    "act_forward",
    "activation_spec_from_config",
]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclass(frozen=True)
class GluSpec:
    """Describes the expert activation.

    Attributes:
        gated: ``True`` for GLU-style ``act(gate) * up`` (fc1 is twice as wide).
        kind: ``"silu"`` or ``"gelu"`` (exact erf GELU, ``torch.nn.functional.gelu``'s default).
    """

    gated: bool
    kind: ActivationKind

    def __post_init__(self) -> None:
        """Rejects unsupported kinds early, at construction."""
        if self.kind not in ("silu", "gelu"):
            raise ValueError(f"GluSpec.kind must be 'silu' or 'gelu', got {self.kind!r}")

    @property
    def fc1_multiplier(self) -> int:
        """Ratio ``F1 / F``: 2 when gated, else 1."""
        return 2 if self.gated else 1


def _act_and_grad(g: torch.Tensor, kind: ActivationKind) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(act(g), act'(g))`` for fp32/fp64 ``g``."""
    if kind == "silu":
        s = torch.sigmoid(g)
        y = g * s
        # d/dg [g * s(g)] = s + g * s * (1 - s) = s * (1 + g * (1 - s))
        dy = s * (1.0 + g * (1.0 - s))
        return y, dy
    # Exact GELU: g * Phi(g); derivative Phi(g) + g * phi(g).
    cdf = 0.5 * (1.0 + torch.erf(g * _INV_SQRT2))
    pdf = torch.exp(-0.5 * g * g) * _INV_SQRT_2PI
    return g * cdf, cdf + g * pdf


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for fp32/bf16/fp16; keep fp64 so double-precision checks stay meaningful.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _act(g: torch.Tensor, kind: ActivationKind) -> torch.Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g)


def _check_width(h: torch.Tensor, spec: GluSpec) -> None:
    if h.dim() < 1:
        raise ValueError("activation input must have at least one dim")
    if spec.gated and h.shape[-1] % 2 != 0:
        raise ValueError(f"gated activation needs an even fc1 width, got {h.shape[-1]}")


def _use_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the fused Triton kernels take these inputs (see the module docstring)."""
    return (
        triton_common.use_triton(*tensors)
        and all(t.dtype in triton_common.KERNEL_DTYPES for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )


def act_forward(
    h: torch.Tensor, spec: GluSpec, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Applies the activation, optionally times a per-row routing weight.

    Args:
        h: ``[N, F1]`` fc1 output.
        spec: Activation description.
        probs: Optional ``[N]`` routing weight of each row, multiplied in the fp32 math before
            the one rounding (Megatron applies it to the activation before fc2).

    Returns:
        ``[N, F]`` in ``h``'s dtype.
    """
    _check_width(h, spec)
    if _use_kernels(h, *(() if probs is None else (probs,))):
        return activation_triton.act_forward_triton(h, spec.gated, spec.kind, probs)
    return _act_fp(h, spec, probs).to(h.dtype)


def _act_fp(h: torch.Tensor, spec: GluSpec, probs: torch.Tensor | None) -> torch.Tensor:
    """The activation (times ``probs``) in the compute dtype, unrounded."""
    hf = h.to(_compute_dtype(h.dtype))
    if spec.gated:
        gate, up = hf.chunk(2, dim=-1)
        a = _act(gate, spec.kind) * up
    else:
        a = _act(hf, spec.kind)
    if probs is not None:
        a = a * _per_row(probs, a)
    return a


def _per_row(probs: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[M]`` row factors (``M`` rows of ``like``'s leading dims) as a broadcastable column."""
    return probs.to(like.dtype).reshape(like.shape[:-1]).unsqueeze(-1)


def act_backward(
    d: torch.Tensor,
    h: torch.Tensor,
    spec: GluSpec,
    probs: torch.Tensor | None = None,
    store_act: bool = False,
    h_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradient of :func:`act_forward` w.r.t. ``h``, computed analytically (no autograd).

    Without ``probs``, ``d`` is the gradient of ``a = act(h)``. With ``probs`` it is the gradient
    of ``a * p`` (fc2's input in Megatron's order); ``dh`` is then taken through ``d * p`` and the
    routing weight's gradient ``<d, a>`` is returned too (fp32 math on the unrounded ``a``).

    Args:
        d: ``[N, F]`` gradient of the activation output (see above).
        h: ``[N, F1]`` the fc1 output the forward used.
        spec: Activation description.
        probs: Optional ``[N]`` routing weight of each row.
        store_act: Also return fc2's input recomputed from ``h`` (``a``, or ``a * p``) in
            ``h``'s dtype, so the caller's fc2 weight gradient needs no second pass over ``h``.
        h_rows: Optional ``[N]`` int64 rows of a larger saved ``h`` (``[R, F1]``) that go with
            the rows of ``d``: the result is that of ``h.index_select(0, h_rows)``, which the
            fused kernel never materialises (the trimmed backward's kept rows).

    Returns:
        ``(dh [N, F1] in h's dtype, act [N, F] or None, dprobs [N] fp32 or None)``.

    Raises:
        ValueError: If ``d``'s shape does not match ``h`` under ``spec``.
    """
    _check_width(h, spec)
    if h_rows is not None and _use_kernels(d, h, *(() if probs is None else (probs,))):
        return activation_triton.act_backward_triton(
            d, h, spec.gated, spec.kind, probs, store_act, h_rows=h_rows
        )
    if h_rows is not None:
        h = h.index_select(0, h_rows)
    f = h.shape[-1] // spec.fc1_multiplier
    if d.shape[:-1] != h.shape[:-1] or d.shape[-1] != f:
        raise ValueError(
            f"act_backward: d {tuple(d.shape)} does not match h {tuple(h.shape)} "
            f"(gated={spec.gated})"
        )
    if _use_kernels(d, h, *(() if probs is None else (probs,))):
        return activation_triton.act_backward_triton(
            d, h, spec.gated, spec.kind, probs, store_act
        )
    cdt = _compute_dtype(h.dtype)
    df = d.to(cdt)
    dprobs = None
    if probs is not None:
        dprobs = (df * _act_fp(h, spec, None)).sum(-1).reshape(-1).to(torch.float32)
        df = df * _per_row(probs, df)
    act = _act_fp(h, spec, probs).to(h.dtype) if store_act else None
    if not spec.gated:
        _, dact = _act_and_grad(h.to(cdt), spec.kind)
        return (df * dact).to(h.dtype), act, dprobs
    gate, up = h.to(cdt).chunk(2, dim=-1)
    a, dact = _act_and_grad(gate, spec.kind)
    # Write both halves straight into an h-dtype buffer: no fp32 [N, F1] concatenation.
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    dh[..., :f].copy_(df * up * dact)
    dh[..., f:].copy_(df * a)
    return dh, act, dprobs


def activation_spec_from_config(config: Any) -> GluSpec:
    """Reads the expert activation from a Megatron ``TransformerConfig``.

    What is supported, and the errors, are those of ``megatron_lrmoe.config.expert_activation``.

    Args:
        config: A ``megatron.core.transformer.TransformerConfig`` (or any object with the same
            attributes; missing optional ones count as their Megatron defaults).

    Returns:
        The matching :class:`GluSpec`.

    Raises:
        ValueError: Naming the unsupported setting and how to change it.
    """
    gated, kind = expert_activation(config)
    return GluSpec(gated=gated, kind=kind)
