"""Fused Triton kernels of the LRM scores: per-token row norms and per-pair scores.

Shape legend:
    T: tokens; N: token-expert pairs; H: row width (hidden size).

Why: the torch reference (``select/scoring.py``: ``token_norms``, ``pair_scores``) widens the
token rows to fp32 and spends a kernel per step; here each input is read once, the fp32 math
stays in registers. The ``*_from_args`` forms read their tensors' addresses from an argument
block, for the front's CUDA graph (``graphs/front.py``).

The switch, the lazy import of triton and the interpreter: ``megatron_lrmoe/triton_common.py``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lrmoe import triton_common as tc
from megatron_lrmoe.triton_common import (
    NUM_WARPS,
    arg_ptr,
    cdiv,
    check_dtype,
    device_ctx,
    reduction_tile,
    tl_dtype,
    unit_cols,
    checked_kernels,
    jit_kernels,
)

__all__ = [
    "pair_blocks",
    "pair_scores_from_args",
    "pair_scores_triton",
    "row_norms_from_args",
    "row_norms_triton",
]


# Bound to ``triton.language`` by :func:`_kernels`; the kernel bodies resolve it at compile (or
# interpret) time, never at definition time (annotations are strings here).
tl: Any = None


# --------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; wrapped by triton.jit or the interpreter in _kernels()).
# Offsets are int64 because N * H reaches 2^31 at realistic sizes with strided or gathered rows.
# --------------------------------------------------------------------------------------------


def _row_norms_body(
    out_ptr, g_ptr, x_ptr, n_rows, width, g_stride, x_stride,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[0, t] = ||g[t]||``, ``out[1, t] = ||x[t]||`` (fp32 sums of squares) for ``BLOCK_M``
    rows of both matrices in one pass."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    rows = offs_m.to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    acc_x = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, width, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = mask_m[:, None] & (offs_h < width)[None, :]
        g = tl.load(g_ptr + rows[:, None] * g_stride + offs_h[None, :], mask=mask, other=0.0)
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_h[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        x = x.to(tl.float32)
        acc_g = acc_g + g * g
        acc_x = acc_x + x * x
    tl.store(out_ptr + offs_m, tl.sqrt(tl.sum(acc_g, axis=1)), mask=mask_m)
    tl.store(out_ptr + n_rows + offs_m, tl.sqrt(tl.sum(acc_x, axis=1)), mask=mask_m)


def _row_norms_kernel(
    out_ptr,
    g_ptr,
    x_ptr,
    n_rows,
    width,
    g_stride,
    x_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_row_norms_body` on ``g`` and ``x``."""
    _row_norms_body(out_ptr, g_ptr, x_ptr, n_rows, width, g_stride, x_stride, BLOCK_M, BLOCK_H)


def _row_norms_args_kernel(
    out_ptr,
    args_ptr,
    n_rows,
    width,
    g_stride,
    x_stride,
    G_TY: tl.constexpr,
    X_TY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_row_norms_body` on ``g`` and ``x`` at the addresses ``args[0]``, ``args[1]``."""
    g_ptr = arg_ptr(args_ptr, 0, G_TY)
    x_ptr = arg_ptr(args_ptr, 1, X_TY)
    _row_norms_body(out_ptr, g_ptr, x_ptr, n_rows, width, g_stride, x_stride, BLOCK_M, BLOCK_H)


def _pair_scores_body(
    scores_ptr,
    partial_ptr,
    probs_ptr,
    token_ptr,
    norms_ptr,
    top_ptr,
    n_pairs,
    n_tokens,
    n_blocks,
    BLOCK: tl.constexpr,
):
    """``score[i] = p[i]^2 * (|g_t| / max|g|)^2 * (|x_t| / max|x|)^2`` for pair ``i`` of token
    ``t``; per block ``partial[0] = sum(score * 0)`` (NaN iff a score is not finite) and
    ``partial[1] = sum`` of the finite scores."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_pairs
    g_top = tl.load(top_ptr).to(tl.float32)
    x_top = tl.load(top_ptr + 1).to(tl.float32)
    g_top = tl.where(g_top > 0.0, g_top, 1.0)
    x_top = tl.where(x_top > 0.0, x_top, 1.0)
    tok = tl.load(token_ptr + offs, mask=mask, other=0).to(tl.int64)
    # div_rn: IEEE round-to-nearest like torch's division (Triton's fp32 ``/`` is approximate).
    gn = tl.div_rn(tl.load(norms_ptr + tok, mask=mask, other=0.0), g_top)
    xn = tl.div_rn(tl.load(norms_ptr + n_tokens + tok, mask=mask, other=0.0), x_top)
    p = tl.load(probs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    score = (p * p) * (gn * gn) * (xn * xn)
    tl.store(scores_ptr + offs, score, mask=mask)
    finite = (score == score) & (tl.abs(score) < float("inf"))
    poison = tl.sum(tl.where(mask, score * 0.0, 0.0), axis=0)
    clean = tl.sum(tl.where(mask & finite, score, 0.0), axis=0)
    tl.store(partial_ptr + pid, poison)
    tl.store(partial_ptr + n_blocks + pid, clean)


def _pair_scores_kernel(
    scores_ptr,
    partial_ptr,
    probs_ptr,
    token_ptr,
    norms_ptr,
    top_ptr,
    n_pairs,
    n_tokens,
    n_blocks,
    BLOCK: tl.constexpr,
):
    """:func:`_pair_scores_body` on ``probs`` and ``token``."""
    _pair_scores_body(
        scores_ptr, partial_ptr, probs_ptr, token_ptr, norms_ptr, top_ptr, n_pairs, n_tokens,
        n_blocks, BLOCK,
    )


def _pair_scores_args_kernel(
    scores_ptr,
    partial_ptr,
    args_ptr,
    norms_ptr,
    top_ptr,
    n_pairs,
    n_tokens,
    n_blocks,
    P_TY: tl.constexpr,
    T_TY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`_pair_scores_body` on ``probs`` and ``token`` at the addresses ``args[2]``,
    ``args[3]``."""
    probs_ptr = arg_ptr(args_ptr, 2, P_TY)
    token_ptr = arg_ptr(args_ptr, 3, T_TY)
    _pair_scores_body(
        scores_ptr, partial_ptr, probs_ptr, token_ptr, norms_ptr, top_ptr, n_pairs, n_tokens,
        n_blocks, BLOCK,
    )


# Device helpers called by the kernels above: plain functions until :func:`_kernels` replaces
# them by their triton.jit versions in this module's globals (before any kernel compiles);
# ``arg_ptr`` is triton_common.py's.
_HELPERS = ("arg_ptr", "_row_norms_body", "_pair_scores_body")


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
            "row_norms": _row_norms_kernel,
            "pair_scores": _pair_scores_kernel,
            "row_norms_args": _row_norms_args_kernel,
            "pair_scores_args": _pair_scores_args_kernel,
        },
        "scoring kernels",
    )


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    """The kernels, after checking they can run on ``t``'s device."""
    return checked_kernels(_kernels(), t)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def row_norms_triton(
    g: torch.Tensor, x: torch.Tensor, *, block_h: int | None = None
) -> torch.Tensor:
    """``[2, T]`` fp32: the L2 norm of every row of ``g`` (row 0) and of ``x`` (row 1), one pass.

    Args:
        g: ``[T, H]`` bf16/fp16/fp32.
        x: ``[T, H]`` bf16/fp16/fp32.
        block_h: Column block override (a power of two), for tests and tuning.
    """
    if g.dim() != 2 or g.shape != x.shape:
        raise ValueError(f"row_norms_triton: g {tuple(g.shape)} and x {tuple(x.shape)}")
    check_dtype("g", g)
    check_dtype("x", x)
    n_rows, width = g.shape
    out = torch.empty((2, n_rows), dtype=torch.float32, device=g.device)
    if n_rows == 0:
        return out
    g, x = unit_cols(g), unit_cols(x)
    block_h, block_m = reduction_tile(width, block_h, max_block_h=256, accumulators=4)
    with device_ctx(g):
        _kernels_for(g).row_norms[(cdiv(n_rows, block_m),)](
            out,
            g,
            x,
            n_rows,
            width,
            g.stride(0),
            x.stride(0),
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return out


def pair_scores_triton(
    probs: torch.Tensor, token: torch.Tensor, norms: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """LRM scores of all pairs from per-token norms, with per-block poison and score sums.

    Args:
        probs: ``[N]`` routing weight of each pair (any float dtype).
        token: ``[N]`` int32/int64 token of each pair.
        norms: ``[2, T]`` fp32 token norms (``row_norms_triton``).
        top: ``[2]`` fp32 largest norm of ``g`` and of ``x`` (a value <= 0 counts as 1).

    Returns:
        ``scores [N]`` fp32 and ``partial [2, B]`` fp32: per block of pairs, ``sum(score * 0)``
        (NaN iff one is not finite) and the sum of its finite scores.
    """
    if probs.dim() != 1 or token.shape != probs.shape or norms.dim() != 2 or norms.shape[0] != 2:
        raise ValueError(
            f"pair_scores_triton: probs {tuple(probs.shape)}, token {tuple(token.shape)}, "
            f"norms {tuple(norms.shape)}"
        )
    if norms.dtype != torch.float32 or top.dtype != torch.float32 or top.numel() != 2:
        raise ValueError("pair_scores_triton: norms and top must be fp32, top of 2 values")
    n = probs.shape[0]
    blocks = pair_blocks(n)
    scores = torch.empty(n, dtype=torch.float32, device=probs.device)
    if n == 0:
        return scores, torch.zeros((2, blocks), dtype=torch.float32, device=probs.device)
    partial = torch.empty((2, blocks), dtype=torch.float32, device=probs.device)
    with device_ctx(probs):
        _kernels_for(probs).pair_scores[(blocks,)](
            scores, partial, probs.contiguous(), token.contiguous(), norms.contiguous(),
            top.contiguous(), n, norms.shape[1], blocks, BLOCK=tc.PAIR_BLOCK, num_warps=4,
        )
    return scores, partial


def row_norms_from_args(
    out: torch.Tensor,
    args: torch.Tensor,
    shape: tuple[int, int],
    strides: tuple[int, int],
    dtypes: tuple[torch.dtype, torch.dtype],
) -> None:
    """:func:`row_norms_triton` into ``out [2, T]`` with ``g`` and ``x`` (``shape`` ``[T, H]``,
    row ``strides``, ``dtypes``) read at the addresses ``args[ARG_G]``, ``args[ARG_X]`` (a
    device int64 block; :func:`args_ready` must hold for both): the same kernel body, launchable
    inside a CUDA graph that is replayed on other tensors. ``T >= 1``."""
    n_rows, width = shape
    kernels = _kernels_for(out)
    block_h, block_m = reduction_tile(width, None, max_block_h=256, accumulators=4)
    with device_ctx(out):
        kernels.row_norms_args[(cdiv(n_rows, block_m),)](
            out, args, n_rows, width, strides[0], strides[1],
            G_TY=tl_dtype(dtypes[0]), X_TY=tl_dtype(dtypes[1]),
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=NUM_WARPS,
        )


def pair_scores_from_args(
    scores: torch.Tensor,
    partial: torch.Tensor,
    args: torch.Tensor,
    norms: torch.Tensor,
    top: torch.Tensor,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> None:
    """:func:`pair_scores_triton` into ``scores [N]`` and ``partial [2, B]`` with ``probs`` and
    ``token`` (``[N]``, contiguous, of ``dtypes``) read at ``args[ARG_PROBS]``,
    ``args[ARG_TOKEN]``, as :func:`row_norms_from_args`. ``N >= 1``."""
    n = scores.shape[0]
    blocks = partial.shape[1]
    kernels = _kernels_for(scores)
    with device_ctx(scores):
        kernels.pair_scores_args[(blocks,)](
            scores, partial, args, norms, top, n, norms.shape[1], blocks,
            P_TY=tl_dtype(dtypes[0]), T_TY=tl_dtype(dtypes[1]), BLOCK=tc.PAIR_BLOCK, num_warps=4,
        )


def pair_blocks(n: int) -> int:
    """Blocks of pairs of :func:`pair_scores_triton` (the width of its ``partial``)."""
    return max(1, cdiv(n, tc.PAIR_BLOCK))
