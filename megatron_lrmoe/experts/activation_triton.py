"""Fused Triton kernels of the expert activation (plain or gated), forward and backward.

Shape legend:
    N: rows (token-expert rows).
    F: activation output width; F1: fc1 width, ``2F`` when gated (``h = [gate | up]``) else ``F``.

Why: the torch versions (``experts/activation.py``) materialise several fp32 ``[N, F1]``
temporaries, one kernel each; these read ``h`` (and ``d_a``) once, keep the fp32 math in
registers and round once into the output dtype. The callers in ``experts/activation.py`` keep the
torch path for fp64 and for inputs that need autograd.

The switch, the lazy import of triton and the interpreter: ``megatron_lrmoe/triton_common.py``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lrmoe import triton_common as tc
from megatron_lrmoe.triton_common import (
    KERNEL_DTYPES,
    NUM_WARPS,
    arg_ptr,
    cdiv,
    check_dtype,
    col_block,
    device_ctx,
    reduction_tile,
    tl_dtype,
    unit_cols,
    checked_kernels,
    jit_kernels,
)

__all__ = [
    "act_backward_from_args",
    "act_backward_triton",
    "act_forward_triton",
]


# Bound to ``triton.language`` by :func:`_kernels`; the kernel bodies resolve it at compile (or
# interpret) time, never at definition time (annotations are strings here).
tl: Any = None


# --------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; wrapped by triton.jit or the interpreter in _kernels()).
# Offsets are int64 because N * H reaches 2^31 at realistic sizes with strided or gathered rows.
# --------------------------------------------------------------------------------------------


_ACT_KINDS = {"silu": 0, "gelu": 1}


def _act_fwd_kernel(
    out_ptr,
    h_ptr,
    p_ptr,
    n_rows,
    width,
    h_stride,
    out_stride,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """``a = act(gate) * up`` (gated) or ``act(h)`` on a tile, times ``p[row]`` with probs."""
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    mask_m = offs_m < n_rows
    mask = mask_m[:, None] & (offs_f < width)[None, :]
    rows = offs_m.to(tl.int64)
    src = rows[:, None] * h_stride + offs_f[None, :]
    g = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
    # Same formulas (and association) as torch's silu / exact-erf gelu kernels.
    if KIND == 0:
        a = g / (1.0 + tl.exp(-g))
    else:
        a = g * (0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476)))
    if GATED:
        up = tl.load(h_ptr + src + width, mask=mask, other=0.0).to(tl.float32)
        a = a * up
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        a = a * p[:, None]
    dst = rows[:, None] * out_stride + offs_f[None, :]
    tl.store(out_ptr + dst, a.to(out_ptr.dtype.element_ty), mask=mask)


def _act_bwd_body(
    pid, dh_ptr, act_ptr, dprobs_ptr, d_ptr, h_ptr, p_ptr, h_rows_ptr, n_rows, width, h_stride,
    d_stride, dh_stride, act_stride,
    GATED: tl.constexpr, KIND: tl.constexpr, HAS_PROBS: tl.constexpr, STORE_ACT: tl.constexpr,
    H_INDEXED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Activation backward for the ``BLOCK_M`` rows of row block ``pid``, looping over F.

    ``d`` is the gradient of the activation output, or with probs of ``act * p`` (Megatron's
    order: the routing weight scales the activation before fc2). Writes ``dh`` (with probs:
    of ``d * p``), optionally ``act`` (times ``p`` with probs: fc2's input, for its weight
    gradient) and with probs ``dprobs = <d, act>`` in fp32. With ``H_INDEXED`` row ``i`` reads
    ``h`` row ``h_rows[i]`` (the kept rows of a larger saved ``h``, no gathered copy).
    """
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    rows = offs_m.to(tl.int64)
    if H_INDEXED:
        h_rows = tl.load(h_rows_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    else:
        h_rows = rows
    if HAS_PROBS:
        p = tl.load(p_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    for f0 in range(0, width, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask = mask_m[:, None] & (offs_f < width)[None, :]
        src = h_rows[:, None] * h_stride + offs_f[None, :]
        dst = rows[:, None] * dh_stride + offs_f[None, :]
        g = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + rows[:, None] * d_stride + offs_f[None, :], mask=mask, other=0.0)
        d = d.to(tl.float32)
        # Mirrors activation._act_and_grad term by term so the roundings line up with torch.
        if KIND == 0:
            s = 1.0 / (1.0 + tl.exp(-g))
            act = g * s
            dact = s * (1.0 + g * (1.0 - s))
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            pdf = tl.exp(-0.5 * g * g) * 0.3989422804014327
            act = g * cdf
            dact = cdf + g * pdf
        if GATED:
            up = tl.load(h_ptr + src + width, mask=mask, other=0.0).to(tl.float32)
            out = act * up
        else:
            out = act
        if HAS_PROBS:
            dot = dot + d * out
            d = d * p[:, None]
        if GATED:
            tl.store(dh_ptr + dst, (d * up * dact).to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_ptr + dst + width, (d * act).to(dh_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dh_ptr + dst, (d * dact).to(dh_ptr.dtype.element_ty), mask=mask)
        if STORE_ACT:
            if HAS_PROBS:
                out = out * p[:, None]
            a_dst = rows[:, None] * act_stride + offs_f[None, :]
            tl.store(act_ptr + a_dst, out.to(act_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(dprobs_ptr + rows, tl.sum(dot, axis=1), mask=mask_m)


def _act_bwd_kernel(
    dh_ptr,
    act_ptr,
    dprobs_ptr,
    d_ptr,
    h_ptr,
    p_ptr,
    h_rows_ptr,
    n_rows,
    width,
    h_stride,
    d_stride,
    dh_stride,
    act_stride,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    STORE_ACT: tl.constexpr,
    H_INDEXED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """:func:`_act_bwd_body`, one program per row block."""
    _act_bwd_body(
        tl.program_id(0), dh_ptr, act_ptr, dprobs_ptr, d_ptr, h_ptr, p_ptr, h_rows_ptr, n_rows,
        width, h_stride, d_stride, dh_stride, act_stride, GATED, KIND, HAS_PROBS, STORE_ACT,
        H_INDEXED, BLOCK_M, BLOCK_F,
    )


def _act_bwd_args_kernel(
    args_ptr,
    dh_ptr,
    act_ptr,
    d_ptr,
    width,
    h_stride,
    d_stride,
    dh_stride,
    act_stride,
    H_TY: tl.constexpr,
    GATED: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """:func:`_act_bwd_body` (``act`` stored, no routing weights, ``h`` indexed by ``h_rows``)
    with ``h`` at ``args[ARG_H]``, ``h_rows`` at ``args[ARG_H_ROWS]`` and the row count in
    ``args[ARG_COUNT]``, which only the device knows when a graph replays this launch: the
    programs stride over the row blocks up to it."""
    h_ptr = arg_ptr(args_ptr, 10, H_TY)
    h_rows_ptr = arg_ptr(args_ptr, 11, tl.int64)
    n_rows = tl.load(args_ptr + 9)
    for pid in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        _act_bwd_body(
            pid, dh_ptr, act_ptr, dh_ptr, d_ptr, h_ptr, dh_ptr, h_rows_ptr, n_rows, width,
            h_stride, d_stride, dh_stride, act_stride, GATED, KIND, False, True, True,
            BLOCK_M, BLOCK_F,
        )


# Device helpers called by the kernels above: plain functions until :func:`_kernels` replaces
# them by their triton.jit versions in this module's globals (before any kernel compiles);
# ``arg_ptr`` is triton_common.py's.
_HELPERS = ("arg_ptr", "_act_bwd_body")


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    """The kernel bodies wrapped by ``triton.jit`` (built once, on first launch).

    Under ``TRITON_INTERPRET=1`` (read by triton when it is imported and when ``jit`` wraps)
    these are interpreter functions that run on host tensors; ``interpreted`` says so.
    """
    return jit_kernels(
        globals(),
        _HELPERS,
        {
            "act_fwd": _act_fwd_kernel,
            "act_bwd": _act_bwd_kernel,
            "act_bwd_args": _act_bwd_args_kernel,
        },
        "activation kernels",
    )


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    """The kernels, after checking they can run on ``t``'s device."""
    return checked_kernels(_kernels(), t)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _act_bwd_tile(width: int, override: int | None) -> tuple[int, int]:
    """The tile of the activation backward, direct and from an argument block alike."""
    return reduction_tile(width, override, max_block_h=256, accumulators=2)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    # [..., W] -> [M, W]; a view when possible, and unit column stride for the kernels.
    return unit_cols(x.reshape(-1, x.shape[-1]))


def _kind_code(kind: str) -> int:
    if kind not in _ACT_KINDS:
        raise ValueError(f"activation kind must be one of {sorted(_ACT_KINDS)}, got {kind!r}")
    return _ACT_KINDS[kind]


def act_forward_triton(
    h: torch.Tensor,
    gated: bool,
    kind: str,
    probs: torch.Tensor | None = None,
    *,
    block_f: int | None = None,
) -> torch.Tensor:
    """Fused activation forward: ``act(gate) * up`` (gated, ``h = [gate | up]``) or ``act(h)``.

    Args:
        h: ``[..., F1]`` bf16/fp16/fp32 fc1 output (``F1`` even when gated).
        gated: GLU-style input.
        kind: ``"silu"`` or ``"gelu"`` (exact erf form).
        probs: Optional per-row factor (``[M]`` for ``M`` rows of ``h``), applied in fp32 before
            the single rounding: Megatron's routing weight before fc2.
        block_f: Column block override (a power of two), for tests and tuning.

    Returns:
        ``[..., F]`` contiguous, in ``h``'s dtype.
    """
    check_dtype("h", h)
    code = _kind_code(kind)
    if h.dim() < 1 or (gated and h.shape[-1] % 2):
        raise ValueError(f"act_forward_triton: bad fc1 shape {tuple(h.shape)} (gated={gated})")
    width = h.shape[-1] // 2 if gated else h.shape[-1]
    out = torch.empty(h.shape[:-1] + (width,), dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    h2, out2 = _as_rows(h), out.view(-1, width)
    _check_probs(probs, h2.shape[0], "act_forward_triton")
    block_f = col_block(width, block_f)
    block_m = max(1, tc.TILE // block_f)
    grid = (cdiv(h2.shape[0], block_m), cdiv(width, block_f))
    with device_ctx(h):
        _kernels_for(h).act_fwd[grid](
            out2,
            h2,
            probs.contiguous() if probs is not None else out2,  # placeholder when unread
            h2.shape[0],
            width,
            h2.stride(0),
            out2.stride(0),
            GATED=bool(gated),
            KIND=code,
            HAS_PROBS=probs is not None,
            BLOCK_M=block_m,
            BLOCK_F=block_f,
            num_warps=NUM_WARPS,
        )
    return out


def _check_probs(probs: torch.Tensor | None, rows: int, what: str) -> None:
    if probs is not None and (probs.shape != (rows,) or probs.dtype not in KERNEL_DTYPES):
        raise ValueError(f"{what}: probs must be [{rows}] float, got {probs.dtype} "
                         f"{tuple(probs.shape)}")


def act_backward_triton(
    d: torch.Tensor,
    h: torch.Tensor,
    gated: bool,
    kind: str,
    probs: torch.Tensor | None = None,
    store_act: bool = False,
    h_rows: torch.Tensor | None = None,
    *,
    block_f: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fused analytic activation backward, optionally through Megatron's routing weight.

    Without ``probs``, ``d`` is the gradient of ``a = act(h)`` and ``dh = d * act'(h)``. With
    ``probs`` it is the gradient of ``a * p`` (the fc2 input); then ``dh`` is taken through
    ``d * p`` and ``dprobs = <d, a>``. ``store_act`` also returns fc2's input (``a``, or
    ``a * p``) recomputed from ``h``, for fc2's weight gradient, so ``h`` is read only once.

    Args:
        d: ``[..., F]`` bf16/fp16/fp32 gradient of the activation output (see above).
        h: ``[..., F1]`` bf16/fp16/fp32 fc1 output the forward used.
        gated: GLU-style input.
        kind: ``"silu"`` or ``"gelu"`` (exact erf form).
        probs: Optional per-row routing weight ``[M]``.
        store_act: Also return the recomputed activation output.
        h_rows: Optional ``[M]`` int64: row ``i`` of ``d`` goes with row ``h_rows[i]`` of a
            2-D ``h`` (``h.index_select(0, h_rows)`` without the gathered copy).
        block_f: Column block override (a power of two), for tests and tuning.

    Returns:
        ``(dh [..., F1] in h's dtype, act [..., F] in h's dtype or None, dprobs [M] fp32 or
        None)``; with ``h_rows``, ``dh`` is ``[M, F1]``.
    """
    # This runs in every backward of every layer, where it is on the host's critical path:
    # each shape is read once, and 2-D inputs (the usual case) are not reshaped.
    check_dtype("h", h)
    check_dtype("d", d)
    code = _kind_code(kind)
    h_shape, d_shape = h.shape, d.shape
    if not h_shape or (gated and h_shape[-1] % 2):
        raise ValueError(f"act_backward_triton: bad fc1 shape {tuple(h_shape)} (gated={gated})")
    width1 = h_shape[-1]
    width = width1 // 2 if gated else width1
    lead = h_shape[:-1]
    if h_rows is not None:
        if len(h_shape) != 2 or h_rows.dim() != 1 or h_rows.dtype != torch.int64:
            raise ValueError(
                f"act_backward_triton: h_rows needs a 2-D h and a 1-D int64 index, got h "
                f"{tuple(h_shape)} and h_rows {tuple(h_rows.shape)} {h_rows.dtype}"
            )
        lead = h_rows.shape
    if len(d_shape) != len(lead) + 1 or d_shape[:-1] != lead or d_shape[-1] != width:
        raise ValueError(
            f"act_backward_triton: d {tuple(d_shape)} does not match h {tuple(h_shape)}"
            + ("" if h_rows is None else f" indexed by {tuple(h_rows.shape)} rows")
        )
    rows = d.numel() // width if width else 0
    dtype, device = h.dtype, h.device
    dh = torch.empty((rows, width1), dtype=dtype, device=device)
    act = torch.empty((rows, width), dtype=dtype, device=device) if store_act else None
    _check_probs(probs, rows, "act_backward_triton")
    dprobs = torch.empty(rows, dtype=torch.float32, device=device) if probs is not None else None
    out_lead = tuple(lead) if len(lead) != 1 else None  # reshape the results back to it
    if rows == 0 or width1 == 0:
        if dprobs is not None:
            dprobs.zero_()
        return _lead_view(dh, out_lead), _lead_view(act, out_lead), dprobs
    h2 = unit_cols(h) if len(h_shape) == 2 else _as_rows(h)
    d2 = unit_cols(d) if len(d_shape) == 2 else _as_rows(d)
    act2 = act if act is not None else dh
    block_f, block_m = _act_bwd_tile(width, block_f)
    with device_ctx(h):
        _kernels_for(h).act_bwd[(cdiv(rows, block_m),)](
            dh,
            act2,
            dprobs if dprobs is not None else dh,  # placeholders when unread
            d2,
            h2,
            probs.contiguous() if probs is not None else dh,
            h_rows.contiguous() if h_rows is not None else dh,
            rows,
            width,
            h2.stride(0),
            d2.stride(0),
            width1,
            width if act is not None else width1,
            GATED=bool(gated),
            KIND=code,
            HAS_PROBS=probs is not None,
            STORE_ACT=bool(store_act),
            H_INDEXED=h_rows is not None,
            BLOCK_M=block_m,
            BLOCK_F=block_f,
            num_warps=NUM_WARPS,
        )
    return _lead_view(dh, out_lead), _lead_view(act, out_lead), dprobs


def act_backward_from_args(
    args: torch.Tensor,
    d: torch.Tensor,
    dh: torch.Tensor,
    act: torch.Tensor,
    h_stride: int,
    h_dtype: torch.dtype,
    gated: bool,
    kind: str,
) -> None:
    """:func:`act_backward_triton` (``store_act``, no routing weights, ``h`` indexed by
    ``h_rows``) for tensors and a row count known only on the device: ``h`` (2-D, row stride
    ``h_stride``, ``h_dtype``) at ``args[ARG_H]``, ``h_rows`` (int64, contiguous) at
    ``args[ARG_H_ROWS]``, the rows ``M`` in ``args[ARG_COUNT]``. ``d`` ``[N, F]`` and the
    outputs ``dh`` ``[N, F1]``, ``act`` ``[N, F]`` (unit column strides, ``h_dtype``) have room
    for the most rows there can be; at most ``triton_common.STRIDING_PROGRAMS`` programs
    stride over the row blocks up to ``M``, and rows from ``M`` on are not touched."""
    width1 = dh.shape[1]
    width = width1 // 2 if gated else width1
    n_max = d.shape[0]
    if (
        d.shape != (n_max, width) or act.shape != d.shape or dh.shape[0] != n_max
        or not all(t.stride(-1) == 1 for t in (d, dh, act))
    ):
        raise ValueError(
            f"act_backward_from_args: d {tuple(d.shape)}, dh {tuple(dh.shape)}, act "
            f"{tuple(act.shape)} (gated={gated}) do not match"
        )
    if n_max == 0 or width == 0:
        return
    block_f, block_m = _act_bwd_tile(width, None)
    grid = (max(1, min(cdiv(n_max, block_m), tc.STRIDING_PROGRAMS)),)
    with device_ctx(args):
        _kernels_for(args).act_bwd_args[grid](
            args, dh, act, d, width, h_stride, d.stride(0), dh.stride(0),
            act.stride(0), H_TY=tl_dtype(h_dtype), GATED=bool(gated), KIND=_kind_code(kind),
            BLOCK_M=block_m, BLOCK_F=block_f, num_warps=NUM_WARPS,
        )


def _lead_view(t: torch.Tensor | None, lead: tuple[int, ...] | None) -> torch.Tensor | None:
    """``t`` (``[M, W]``) viewed as ``[*lead, W]`` (``lead`` None: as it is)."""
    return t if t is None or lead is None else t.view(*lead, t.shape[-1])
