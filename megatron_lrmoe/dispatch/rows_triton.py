"""Fused Triton kernels for dispatch's row operations: scaling, gathers, row dots, packing.

Shape legend:
    N: input rows (token-expert pairs).
    K: output rows of a gathered ``scale_rows`` (``len(index)``).
    H: row width (hidden size).

Why: the torch versions (``dispatch/rows.py``) widen whole bf16 tensors to fp32 temporaries and
spend one kernel per intermediate, so at Qwen3-30B-A3B sizes (N = 131072, H = 2048) they move
several times the bytes the math needs. Every kernel here reads each input once, writes each
output once and keeps the fp32 math in registers, rounding once into the output dtype, like the
torch paths do. The callers in ``dispatch/rows.py`` keep the torch path for fp64, for inputs that
need autograd, and for unusual shapes.

The switch, the lazy import of triton and the interpreter: ``megatron_lrmoe/triton_common.py``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lrmoe import triton_common as tc
from megatron_lrmoe.triton_common import (
    MAX_BLOCK,
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
    "gather_rows_triton",
    "gather_sum_from_args",
    "gather_sum_triton",
    "pack_pairs_triton",
    "row_dot_triton",
    "scale_rows_triton",
]


# Bound to ``triton.language`` by :func:`_kernels`; the kernel bodies resolve it at compile (or
# interpret) time, never at definition time (annotations are strings here).
tl: Any = None


# --------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; wrapped by triton.jit or the interpreter in _kernels()).
# Offsets are int64 because N * H reaches 2^31 at realistic sizes with strided or gathered rows.
# --------------------------------------------------------------------------------------------


def _scale_rows_kernel(
    out_ptr,
    rows_ptr,
    scale_ptr,
    index_ptr,
    n_out,
    width,
    rows_stride,
    out_stride,
    HAS_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_SCALE: tl.constexpr = True,
):
    """``out[i, :] = rows[index[i] (or i), :] * scale[i]`` on a ``BLOCK_M x BLOCK_H`` tile;
    without ``HAS_SCALE`` a copy (``scale`` unread)."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_m = offs_m < n_out
    mask = mask_m[:, None] & (offs_h < width)[None, :]
    if HAS_INDEX:
        src = tl.load(index_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        src = offs_m.to(tl.int64)
    x = tl.load(rows_ptr + src[:, None] * rows_stride + offs_h[None, :], mask=mask, other=0.0)
    dst = offs_m.to(tl.int64)[:, None] * out_stride + offs_h[None, :]
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
        # Products of two bf16/fp16 values are exact in fp32, so one rounding here equals
        # torch's same-dtype multiply as well as its promoted one.
        y = x.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + dst, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + dst, x, mask=mask)


def _row_dot_body(
    out_ptr, a_ptr, b_ptr, a_index_ptr, n_rows, width, a_stride, b_stride, slots_per_a,
    A_INDEX: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[i] = sum_j a[a_index[i] (or i), j] * b[i, j]`` in fp32 for ``BLOCK_M`` rows.

    With ``SLOTS`` the programs walk ``a``'s rows instead: entry ``s`` of the ``[n_rows]``
    slot table (``a_index_ptr``) names the row ``i`` of ``b`` (``-1``: none) that goes with row
    ``s // slots_per_a`` of ``a``, so each ``a`` row is read by one program, its slots in a row.
    """
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_rows
    if SLOTS:
        rows = tl.load(a_index_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
        mask_m = mask_m & (rows >= 0)
        a_rows = (offs_m // slots_per_a).to(tl.int64)
    elif A_INDEX:
        rows = offs_m.to(tl.int64)
        a_rows = tl.load(a_index_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
        a_rows = rows
    # Elementwise fp32 partial sums, reduced once at the end: fewer cross-thread reductions.
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, width, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = mask_m[:, None] & (offs_h < width)[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + offs_h[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + rows[:, None] * b_stride + offs_h[None, :], mask=mask, other=0.0)
        acc = acc + a.to(tl.float32) * b.to(tl.float32)
    dot = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, dot.to(out_ptr.dtype.element_ty), mask=mask_m)


def _row_dot_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    a_index_ptr,
    n_rows,
    width,
    a_stride,
    b_stride,
    slots_per_a,
    A_INDEX: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_row_dot_body` on the tensors given."""
    _row_dot_body(
        out_ptr, a_ptr, b_ptr, a_index_ptr, n_rows, width, a_stride, b_stride, slots_per_a,
        A_INDEX, SLOTS, BLOCK_M, BLOCK_H,
    )


def _gather_sum_body(
    out_ptr, rows_ptr, index_ptr, scale_ptr, row_of_ptr, n_out, width, slots, rows_stride,
    out_stride,
    HAS_SCALE: tl.constexpr, HAS_ROW_OF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``out[t] = sum_k scale[i] * rows[i]`` over ``i = index[t, k] >= 0``, k in order, fp32,
    for the row block ``program_id(0)`` and the column block ``program_id(1)``.

    With ``HAS_ROW_OF`` the slot holds a key ``j`` and the row is ``i = row_of[j]`` (``j < 0``
    reads nothing; ``row_of[j] < 0``: nothing to add)."""
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_m = offs_m < n_out
    mask_h = offs_h < width
    out_rows = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for k in range(0, slots):
        src = tl.load(index_ptr + out_rows * slots + k, mask=mask_m, other=-1).to(tl.int64)
        if HAS_ROW_OF:
            src = tl.load(row_of_ptr + src, mask=mask_m & (src >= 0), other=-1).to(tl.int64)
        valid = src >= 0
        mask = valid[:, None] & mask_h[None, :]
        x = tl.load(rows_ptr + src[:, None] * rows_stride + offs_h[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + src, mask=mask_m & valid, other=0.0).to(tl.float32)
            x = x * scale[:, None]
        acc = acc + x
    dst = out_rows[:, None] * out_stride + offs_h[None, :]
    store_mask = mask_m[:, None] & mask_h[None, :]
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


def _gather_sum_kernel(
    out_ptr,
    rows_ptr,
    index_ptr,
    scale_ptr,
    row_of_ptr,
    n_out,
    width,
    slots,
    rows_stride,
    out_stride,
    HAS_SCALE: tl.constexpr,
    HAS_ROW_OF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_gather_sum_body`."""
    _gather_sum_body(
        out_ptr, rows_ptr, index_ptr, scale_ptr, row_of_ptr, n_out, width, slots, rows_stride,
        out_stride, HAS_SCALE, HAS_ROW_OF, BLOCK_M, BLOCK_H,
    )


def _gather_sum_args_kernel(
    args_ptr,
    rows_ptr,
    n_out,
    width,
    slots,
    rows_stride,
    out_stride,
    OUT_TY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_gather_sum_body` through ``row_of`` (no scale) with the slot plan at
    ``args[ARG_SLOT_PLAN]``, ``row_of`` at ``args[ARG_ROW_OF]`` and ``out`` at
    ``args[ARG_OUT]``: per-call tensors of a replayed graph."""
    index_ptr = arg_ptr(args_ptr, 5, tl.int64)
    row_of_ptr = arg_ptr(args_ptr, 12, tl.int64)
    out_ptr = arg_ptr(args_ptr, 13, OUT_TY)
    _gather_sum_body(
        out_ptr, rows_ptr, index_ptr, rows_ptr, row_of_ptr, n_out, width, slots, rows_stride,
        out_stride, False, True, BLOCK_M, BLOCK_H,
    )


def _pack_pairs_body(
    pid_m, g_out_ptr, x_out_ptr, g_ptr, x_ptr, token_ptr, pairs_ptr, probs_ptr, weight_ptr,
    poison_ptr, row_of_ptr, n_out, width, g_stride, x_stride, g_out_stride, x_out_stride,
    HAS_X: tl.constexpr, HAS_POISON: tl.constexpr, HAS_ROW_OF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Row ``i`` of pair ``j = pairs[i]`` of token ``t = token[j]``: ``g_out[i] = g[t] *
    (p[j] * w[i] (+ poison))`` in fp32, rounded once; ``x_out[i] = x[t]`` (a copy); with
    ``HAS_ROW_OF`` also ``row_of[j] = i`` (stored by the first column block only). For the
    ``BLOCK_M`` rows of row block ``pid_m`` and the column block ``program_id(1)``."""
    pid_h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_m = offs_m < n_out
    mask = mask_m[:, None] & (offs_h < width)[None, :]
    pair = tl.load(pairs_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    tok = tl.load(token_ptr + pair, mask=mask_m, other=0).to(tl.int64)
    scale = tl.load(probs_ptr + pair, mask=mask_m, other=0.0).to(tl.float32) * tl.load(
        weight_ptr + offs_m, mask=mask_m, other=0.0
    ).to(tl.float32)
    if HAS_POISON:
        scale = scale + tl.load(poison_ptr).to(tl.float32)
    if HAS_ROW_OF:
        tl.store(row_of_ptr + pair, offs_m.to(tl.int64), mask=mask_m & (pid_h == 0))
    dst = offs_m.to(tl.int64)[:, None]
    g = tl.load(g_ptr + tok[:, None] * g_stride + offs_h[None, :], mask=mask, other=0.0)
    y = g.to(tl.float32) * scale[:, None]
    g_dst = g_out_ptr + dst * g_out_stride + offs_h[None, :]
    tl.store(g_dst, y.to(g_out_ptr.dtype.element_ty), mask=mask)
    if HAS_X:
        x = tl.load(x_ptr + tok[:, None] * x_stride + offs_h[None, :], mask=mask, other=0.0)
        tl.store(x_out_ptr + dst * x_out_stride + offs_h[None, :], x, mask=mask)


def _pack_pairs_kernel(
    g_out_ptr,
    x_out_ptr,
    g_ptr,
    x_ptr,
    token_ptr,
    pairs_ptr,
    probs_ptr,
    weight_ptr,
    poison_ptr,
    row_of_ptr,
    n_out,
    width,
    g_stride,
    x_stride,
    g_out_stride,
    x_out_stride,
    HAS_X: tl.constexpr,
    HAS_POISON: tl.constexpr,
    HAS_ROW_OF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """:func:`_pack_pairs_body` on the tensors given, a row block per program."""
    _pack_pairs_body(
        tl.program_id(0), g_out_ptr, x_out_ptr, g_ptr, x_ptr, token_ptr, pairs_ptr, probs_ptr,
        weight_ptr, poison_ptr, row_of_ptr, n_out, width, g_stride, x_stride, g_out_stride,
        x_out_stride, HAS_X, HAS_POISON, HAS_ROW_OF, BLOCK_M, BLOCK_H,
    )


def _row_of_args_kernel(row_of_ptr, pairs_ptr, args_ptr, BLOCK: tl.constexpr):
    """``row_of[pairs[i]] = i`` for the ``args[9]`` (``ARG_COUNT``) rows to pack, which only the
    device knows under a replayed graph: the programs stride over the blocks up to it. The
    caller fills ``row_of`` with ``-1`` first."""
    n = tl.load(args_ptr + 9)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        pair = tl.load(pairs_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.store(row_of_ptr + pair, offs.to(tl.int64), mask=mask)


def _row_dot_pack_args_kernel(
    args_ptr,
    row_of_ptr,
    weight_ptr,
    poison_ptr,
    n_walk,
    width,
    g_stride,
    z_stride,
    x_stride,
    slots_per_token,
    OUT_TY: tl.constexpr,
    G_TY: tl.constexpr,
    Z_TY: tl.constexpr,
    X_TY: tl.constexpr,
    P_TY: tl.constexpr,
    HAS_X: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The router gradient's row-dot and the packing in one token-major walk: each token's
    gradient row (and input row) is read once for its slots, not again per kept pair.

    For walk row ``s`` (token ``s // slots_per_token``, pair ``j = slots[s]``, ``-1``: none):
    ``d_probs[j] = <g[token], z[j]>`` as :func:`_row_dot_body` sums it (same column blocks,
    same fp32 order, so the same bits); where ``i = row_of[j] >= 0`` (a kept pair, from
    :func:`_row_of_args_kernel`), ``g_out[i] = g[token] * (probs[j] * weight[i] + poison)`` and
    (``HAS_X``) ``x_out[i] = x[token]`` as :func:`_pack_pairs_body` writes them. Tensors at the
    argument block's slots: ``g`` 0, ``x`` 1, ``probs`` 2, ``z`` 4, ``slots`` 5, ``d_probs`` 6,
    ``g_out`` 7, ``x_out`` 8 (``triton_common.ARG_*``)."""
    g_ptr = arg_ptr(args_ptr, 0, G_TY)
    x_ptr = arg_ptr(args_ptr, 1, X_TY)
    probs_ptr = arg_ptr(args_ptr, 2, P_TY)
    z_ptr = arg_ptr(args_ptr, 4, Z_TY)
    slots_ptr = arg_ptr(args_ptr, 5, tl.int64)
    out_ptr = arg_ptr(args_ptr, 6, OUT_TY)
    g_out_ptr = arg_ptr(args_ptr, 7, G_TY)
    x_out_ptr = arg_ptr(args_ptr, 8, X_TY)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_walk
    pairs = tl.load(slots_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
    mask_m = mask_m & (pairs >= 0)
    tokens = (offs_m // slots_per_token).to(tl.int64)
    row = tl.load(row_of_ptr + pairs, mask=mask_m, other=-1).to(tl.int64)
    kept = mask_m & (row >= 0)
    scale = tl.load(probs_ptr + pairs, mask=kept, other=0.0).to(tl.float32) * tl.load(
        weight_ptr + row, mask=kept, other=0.0
    ).to(tl.float32)
    scale = scale + tl.load(poison_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, width, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        in_row = (offs_h < width)[None, :]
        mask = mask_m[:, None] & in_row
        g = tl.load(g_ptr + tokens[:, None] * g_stride + offs_h[None, :], mask=mask, other=0.0)
        z = tl.load(z_ptr + pairs[:, None] * z_stride + offs_h[None, :], mask=mask, other=0.0)
        acc = acc + g.to(tl.float32) * z.to(tl.float32)
        to_pack = kept[:, None] & in_row
        dst = row[:, None] * width + offs_h[None, :]
        y = g.to(tl.float32) * scale[:, None]
        tl.store(g_out_ptr + dst, y.to(g_out_ptr.dtype.element_ty), mask=to_pack)
        if HAS_X:
            x = tl.load(
                x_ptr + tokens[:, None] * x_stride + offs_h[None, :], mask=to_pack, other=0.0
            )
            tl.store(x_out_ptr + dst, x, mask=to_pack)
    dot = tl.sum(acc, axis=1)
    tl.store(out_ptr + pairs, dot.to(out_ptr.dtype.element_ty), mask=mask_m)


# Device helpers called by the kernels above: plain functions until :func:`_kernels` replaces
# them by their triton.jit versions in this module's globals (before any kernel compiles);
# ``arg_ptr`` is triton_common.py's.
_HELPERS = ("arg_ptr", "_row_dot_body", "_pack_pairs_body", "_gather_sum_body")


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
            "scale_rows": _scale_rows_kernel,
            "row_dot": _row_dot_kernel,
            "gather_sum": _gather_sum_kernel,
            "gather_sum_args": _gather_sum_args_kernel,
            "pack_pairs": _pack_pairs_kernel,
            "row_of_args": _row_of_args_kernel,
            "row_dot_pack_args": _row_dot_pack_args_kernel,
        },
        "row kernels",
    )


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    """The kernels, after checking they can run on ``t``'s device."""
    return checked_kernels(_kernels(), t)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


# The row-dot's column block (its fp32 summation order, so its bits: the walk and the
# row-dot launched alone share it) and the walk's warps. The walk on 4 x 256 tiles and 4 warps
# was the fastest of 2-16 rows x 256-2048 columns on 4 or 8 warps at both shapes measured on an
# H200 (benchmarks/tile_bench.py --case walk, gpu_run21 calls 1, 2 and 4): 375-392 against
# 403-407 us for 4 x 512 on 8 warps at 128 experts, 16384 tokens and keep 0.5; 236 against 245
# at 16 experts, 8192 tokens and keep 0.75. The row-dot alone: 163 against 170 us.
_ROW_DOT_BLOCK_H = 256


_WALK_WARPS = 4


def _gather_sum_tile(width: int, override: int | None) -> tuple[int, int]:
    """The tile of the gather-sum, direct and from an argument block alike."""
    return reduction_tile(width, override, max_block_h=MAX_BLOCK, accumulators=2)


def scale_rows_triton(
    rows: torch.Tensor,
    scale: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
) -> torch.Tensor:
    """``out[i] = rows[index[i]] * scale[i]`` (``index=None``: ``rows[i]``), fp32 math, one kernel.

    Args:
        rows: ``[N, H]`` bf16/fp16/fp32.
        scale: ``[K]`` per *output* row (``K = N`` without ``index``).
        index: Optional ``[K]`` int32/int64 source rows, each in ``[0, N)`` (not checked: a
            device-side check would cost a sync; out-of-range reads are undefined).
        block_h: Column block override (a power of two), for tests and tuning.

    Returns:
        ``[K, H]`` contiguous, in ``rows.dtype``.
    """
    if rows.dim() != 2 or scale.dim() != 1:
        raise ValueError(f"scale_rows_triton: rows {tuple(rows.shape)}, scale {tuple(scale.shape)}")
    check_dtype("rows", rows)
    check_dtype("scale", scale)
    n_out = rows.shape[0] if index is None else index.shape[0]
    if index is not None and (index.dim() != 1 or index.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"scale_rows_triton: index must be 1-D int32/int64, got {index.dtype}")
    if scale.shape[0] != n_out:
        raise ValueError(f"scale_rows_triton: scale has {scale.shape[0]} rows, expected {n_out}")
    width = rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows = unit_cols(rows)
    scale = scale.contiguous()
    index = index.contiguous() if index is not None else None
    block_h = col_block(width, block_h)
    block_m = max(1, tc.TILE // block_h)
    grid = (cdiv(n_out, block_m), cdiv(width, block_h))
    with device_ctx(rows):
        _kernels_for(rows).scale_rows[grid](
            out,
            rows,
            scale,
            index if index is not None else scale,  # unread placeholder when HAS_INDEX is off
            n_out,
            width,
            rows.stride(0),
            out.stride(0),
            HAS_INDEX=index is not None,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return out


# The gather's tile: 32 rows x 256 columns on 4 warps, the fastest of 1-32 rows x 256-2048
# columns on 4 or 8 warps for the forward's [T, H] -> [S, H] gather at H = 2048 on an H200: 200
# us against torch index_select's 277 at 16384 tokens and 128 experts, 115 against 135 at 8192
# tokens and 16 experts (benchmarks/tile_bench.py --case gather, gpu_run21 call 2).
_GATHER_BLOCK_H = 256


_GATHER_WARPS = 4


def gather_rows_triton(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, index)`` for 2-D ``rows``: ``out[i] = rows[index[i]]``, a copy.

    Args:
        rows: ``[N, H]``, any row stride (unit column stride, else copied first).
        index: ``[K]`` int32/int64 rows in ``[0, N)`` (not range-checked: a device-side check
            would cost a sync; out-of-range reads are undefined).

    Returns:
        ``[K, H]`` contiguous, in ``rows.dtype``.
    """
    if rows.dim() != 2 or index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"gather_rows_triton: rows {tuple(rows.shape)}, index {index.dtype} "
            f"{tuple(index.shape)}"
        )
    check_dtype("rows", rows)
    n_out, width = index.shape[0], rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows, index = unit_cols(rows), index.contiguous()
    block_h = min(col_block(width, None), _GATHER_BLOCK_H)
    block_m = max(1, (2 * tc.TILE) // block_h)
    grid = (cdiv(n_out, block_m), cdiv(width, block_h))
    with device_ctx(rows):
        _kernels_for(rows).scale_rows[grid](
            out, rows, index, index, n_out, width, rows.stride(0), out.stride(0),
            HAS_INDEX=True, BLOCK_M=block_m, BLOCK_H=block_h, HAS_SCALE=False,
            num_warps=_GATHER_WARPS,
        )
    return out


def row_dot_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    a_index: torch.Tensor | None = None,
    *,
    slots: torch.Tensor | None = None,
    block_h: int | None = None,
) -> torch.Tensor:
    """``<a[a_index[i] (or i)], b[i]>`` for every row of ``b``, fp32 accumulation, one kernel.

    Args:
        a: ``[M, H]`` bf16/fp16/fp32 (``M = N`` without ``a_index``).
        b: ``[N, H]`` bf16/fp16/fp32 (may differ from ``a``'s dtype).
        out_dtype: Result dtype (the fp32 sum is rounded once into it).
        a_index: Optional ``[N]`` int32/int64 rows of ``a`` (not range-checked: that would cost a
            sync), so a gathered ``a`` is never materialised.
        slots: Instead of ``a_index``, ``[M, K]`` int64: ``slots[t, k]`` is a row of ``b`` that
            goes with row ``t`` of ``a``, or ``-1``; every row of ``b`` appears exactly once
            (e.g. each token's pairs). The kernel then reads each ``a`` row once, not once per
            ``b`` row scattered over the call (a token's gradient row for its K pairs).
        block_h: Column block override (a power of two), for tests and tuning.

    Returns:
        ``[N]`` in ``out_dtype``.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"row_dot_triton: a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a_index is None and slots is None and a.shape != b.shape:
        raise ValueError(f"row_dot_triton: a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a_index is not None and slots is not None:
        raise ValueError("row_dot_triton: give a_index or slots, not both")
    if a_index is not None and (
        a_index.shape != b.shape[:1] or a_index.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"row_dot_triton: a_index must be [{b.shape[0]}] int32/int64, got "
            f"{a_index.dtype} {tuple(a_index.shape)}"
        )
    if slots is not None and (
        slots.dim() != 2 or slots.shape[0] != a.shape[0] or slots.dtype != torch.int64
    ):
        raise ValueError(
            f"row_dot_triton: slots must be [{a.shape[0]}, K] int64, got "
            f"{slots.dtype} {tuple(slots.shape)}"
        )
    check_dtype("a", a)
    check_dtype("b", b)
    n_rows, width = b.shape
    out = torch.empty(n_rows, dtype=out_dtype, device=b.device)
    if n_rows == 0:
        return out
    a, b = unit_cols(a), unit_cols(b)
    block_h, block_m = reduction_tile(
        width, block_h, max_block_h=_ROW_DOT_BLOCK_H, accumulators=2
    )
    index = a_index if slots is None else slots.reshape(-1)
    n_walk = n_rows if slots is None else index.numel()
    with device_ctx(b):
        _kernels_for(b).row_dot[(cdiv(n_walk, block_m),)](
            out,
            a,
            b,
            index.contiguous() if index is not None else out,  # placeholder when unread
            n_walk,
            width,
            a.stride(0),
            b.stride(0),
            slots.shape[1] if slots is not None else 1,
            A_INDEX=a_index is not None,
            SLOTS=slots is not None,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return out


def row_dot_pack_from_args(
    args: torch.Tensor,
    pairs: torch.Tensor,
    weight: torch.Tensor,
    poison: torch.Tensor,
    row_of_pair: torch.Tensor,
    shape: tuple[int, int],
    slots_per_token: int,
    strides: tuple[int, int, int],
    dtypes: tuple[torch.dtype, ...],
    has_x: bool,
) -> None:
    """:func:`row_dot_triton` (with ``slots``) and :func:`pack_pairs_triton` (with ``poison``
    and ``row_of_pair``) in one walk over the tokens, every tensor read through the argument
    block (``_row_dot_pack_args_kernel``; the same bits as the two): ``d_probs`` for every pair
    and the ``K`` kept pairs (``args[ARG_COUNT]``, ``pairs[:K]`` in packed order,
    ``weight[:K]``) packed. ``row_of_pair`` (``[>= N + 1]`` int64) is filled with ``-1`` and
    then each kept pair's packed row, which the walk reads. ``shape`` is ``g``'s ``[T, H]``;
    ``strides`` the row strides of ``g``, ``z`` and ``x``; ``dtypes`` those of ``d_probs``,
    ``g``, ``z``, ``x`` and ``probs``. :func:`args_ready` must hold for every tensor of the
    block. ``T >= 1``."""
    n_tokens, width = shape
    n_walk = n_tokens * slots_per_token
    block_h, block_m = reduction_tile(width, None, max_block_h=_ROW_DOT_BLOCK_H, accumulators=4)
    kernels = _kernels_for(args)
    with device_ctx(args):
        row_of_pair.fill_(-1)
        grid = (max(1, min(cdiv(pairs.shape[0], tc.PAIR_BLOCK), tc.STRIDING_PROGRAMS)),)
        kernels.row_of_args[grid](row_of_pair, pairs, args, BLOCK=tc.PAIR_BLOCK, num_warps=4)
        kernels.row_dot_pack_args[(cdiv(n_walk, block_m),)](
            args, row_of_pair, weight, poison, n_walk, width, *strides, slots_per_token,
            OUT_TY=tl_dtype(dtypes[0]), G_TY=tl_dtype(dtypes[1]), Z_TY=tl_dtype(dtypes[2]),
            X_TY=tl_dtype(dtypes[3]), P_TY=tl_dtype(dtypes[4]), HAS_X=has_x,
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=_WALK_WARPS,
        )


def pack_pairs_triton(
    g: torch.Tensor,
    token_of_pair: torch.Tensor,
    pairs: torch.Tensor,
    probs: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor | None = None,
    poison: torch.Tensor | None = None,
    row_of_pair: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient rows of the pairs ``pairs`` and optionally their input rows, packed.

    ``g_out[i] = g[t] * (probs[j] * weight[i] (+ poison))`` and ``x_out[i] = x[t]`` for pair
    ``j = pairs[i]`` of token ``t = token_of_pair[j]``: the gathers, the fp32 scale and the
    packing in one kernel (``dispatch/rows.pack_pairs`` is the torch reference).

    Args:
        g: ``[T, H]`` token gradient rows, bf16/fp16/fp32.
        token_of_pair: ``[S]`` int32/int64 token of each pair.
        pairs: ``[K]`` int32/int64 pairs to pack, in output order (not range-checked).
        probs: ``[S]`` routing weight of each pair.
        weight: ``[K]`` fp32 multiplier of each packed row.
        x: Optional ``[T, H]`` token input rows to pack alongside (same dtype as ``g`` not
            required).
        poison: Optional 0-dim fp32 added to every row's scale (0, or NaN to poison).
        row_of_pair: Optional ``[>= S]`` int64 (the caller fills it, e.g. with ``-1``): the
            kernel also writes ``row_of_pair[pairs[i]] = i``, the inverse map that
            ``gather_sum_triton(..., row_of=...)`` reads. ``pairs`` must then be distinct.
        block_h: Column block override (a power of two), for tests and tuning.

    Returns:
        ``(g_out [K, H] in g's dtype, x_out [K, H] in x's dtype or None)``.
    """
    if g.dim() != 2 or pairs.dim() != 1 or weight.shape != pairs.shape:
        raise ValueError(
            f"pack_pairs_triton: g {tuple(g.shape)}, pairs {tuple(pairs.shape)}, weight "
            f"{tuple(weight.shape)}"
        )
    if x is not None and x.shape != g.shape:
        raise ValueError(f"pack_pairs_triton: x {tuple(x.shape)} differs from g {tuple(g.shape)}")
    if row_of_pair is not None and not (
        row_of_pair.dim() == 1 and row_of_pair.dtype == torch.int64 and row_of_pair.is_contiguous()
    ):
        raise ValueError(
            f"pack_pairs_triton: row_of_pair must be a contiguous 1-D int64 tensor, got "
            f"{row_of_pair.dtype} {tuple(row_of_pair.shape)}"
        )
    check_dtype("g", g)
    n_out, width = pairs.shape[0], g.shape[1]
    g_out = torch.empty((n_out, width), dtype=g.dtype, device=g.device)
    x_out = None if x is None else torch.empty((n_out, width), dtype=x.dtype, device=g.device)
    if g_out.numel() == 0:
        if row_of_pair is not None and n_out:  # zero-width rows: no program runs
            row_of_pair.index_copy_(0, pairs.long(), torch.arange(n_out, device=g.device))
        return g_out, x_out
    g = unit_cols(g)
    x = None if x is None else unit_cols(x)
    block_h = col_block(width, block_h)
    block_m = max(1, tc.TILE // block_h)
    grid = (cdiv(n_out, block_m), cdiv(width, block_h))
    with device_ctx(g):
        _kernels_for(g).pack_pairs[grid](
            g_out,
            x_out if x_out is not None else g_out,  # placeholders when HAS_X is off
            g,
            x if x is not None else g,
            token_of_pair.contiguous(),
            pairs.contiguous(),
            probs.contiguous(),
            weight.contiguous(),
            poison if poison is not None else weight,
            row_of_pair if row_of_pair is not None else pairs,  # placeholder when unwritten
            n_out,
            width,
            g.stride(0),
            x.stride(0) if x is not None else g.stride(0),
            g_out.stride(0),
            x_out.stride(0) if x_out is not None else g_out.stride(0),
            HAS_X=x is not None,
            HAS_POISON=poison is not None,
            HAS_ROW_OF=row_of_pair is not None,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return g_out, x_out


def gather_sum_triton(
    rows: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor | None = None,
    row_of: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k scale[i] * rows[i]`` for ``i = index[t, k] >= 0``, fp32, one kernel.

    Args:
        rows: ``[R, H]`` bf16/fp16/fp32.
        index: ``[T, K]`` int64 source rows, ``-1`` for an empty slot (not range-checked).
        scale: Optional ``[R]`` factor per *source* row.
        row_of: Optional 1-D int64: ``index`` then holds keys (e.g. pairs), and slot ``j =
            index[t, k]`` reads row ``i = row_of[j]``; ``j < 0`` (never looked up) or ``i < 0``
            adds nothing. Not range-checked.
        block_h: Column block override (a power of two), for tests and tuning.

    Returns:
        ``[T, H]`` in ``rows.dtype``; slots are added in ``k`` order, rounded once.
    """
    if rows.dim() != 2 or index.dim() != 2 or index.dtype != torch.int64:
        raise ValueError(
            f"gather_sum_triton: rows {tuple(rows.shape)}, index {index.dtype} "
            f"{tuple(index.shape)} (want [R, H] and [T, K] int64)"
        )
    if scale is not None and scale.shape != rows.shape[:1]:
        raise ValueError(f"gather_sum_triton: scale {tuple(scale.shape)} for {rows.shape[0]} rows")
    if row_of is not None and (row_of.dim() != 1 or row_of.dtype != torch.int64):
        raise ValueError(
            f"gather_sum_triton: row_of must be 1-D int64, got {row_of.dtype} "
            f"{tuple(row_of.shape)}"
        )
    check_dtype("rows", rows)
    n_out, slots = index.shape
    width = rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows = unit_cols(rows)
    index = index.contiguous()
    block_h, block_m = _gather_sum_tile(width, block_h)
    grid = (cdiv(n_out, block_m), cdiv(width, block_h))
    with device_ctx(rows):
        _kernels_for(rows).gather_sum[grid](
            out,
            rows,
            index,
            scale.contiguous() if scale is not None else out,  # placeholders when unread
            row_of.contiguous() if row_of is not None else index,
            n_out,
            width,
            slots,
            rows.stride(0),
            out.stride(0),
            HAS_SCALE=scale is not None,
            HAS_ROW_OF=row_of is not None,
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=NUM_WARPS,
        )
    return out


def gather_sum_from_args(
    args: torch.Tensor, rows: torch.Tensor, n_out: int, slots: int, out_dtype: torch.dtype
) -> None:
    """:func:`gather_sum_triton` (``row_of``, no scale) with per-call tensors read on the
    device: the slot plan (``[n_out, slots]`` int64, contiguous) at ``args[ARG_SLOT_PLAN]``,
    ``row_of`` (int64) at ``args[ARG_ROW_OF]`` and the contiguous ``[n_out, H]`` output (of
    ``out_dtype``) at ``args[ARG_OUT]``; ``rows`` ``[R, H]`` with unit column stride."""
    width = rows.shape[1]
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"gather_sum_from_args: rows {tuple(rows.shape)} need unit column stride")
    if n_out == 0 or width == 0:
        return
    block_h, block_m = _gather_sum_tile(width, None)
    grid = (cdiv(n_out, block_m), cdiv(width, block_h))
    with device_ctx(args):
        _kernels_for(args).gather_sum_args[grid](
            args, rows, n_out, width, slots, rows.stride(0), width, OUT_TY=tl_dtype(out_dtype),
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=NUM_WARPS,
        )
