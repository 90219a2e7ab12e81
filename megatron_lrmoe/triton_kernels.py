"""Fused Triton kernels for the row-wise scaling, row dot products and expert activation.

Shape legend:
    N: input rows (token-expert pairs).
    K: output rows of a gathered ``scale_rows`` (``len(index)``).
    H: row width of the row-wise ops (hidden size).
    F: activation output width; F1: fc1 width, ``2F`` when gated (``h = [gate | up]``) else ``F``.

Why: the torch versions (``dispatch/rows.py``, ``activation.py``) widen whole bf16 tensors to fp32
temporaries and spend one kernel per intermediate, so at Qwen3-30B-A3B sizes (N = 131072,
H = 2048, F = 768) they move several times the bytes the math needs. Every kernel here reads
each input once, writes each output once and keeps the fp32 math in registers, rounding once
into the output dtype, like the torch paths do.

Selection: :func:`use_triton` is true when every tensor is on CUDA, ``triton`` imports, and the
environment variable ``LRMOE_TRITON`` is not ``"0"``. The callers in ``dispatch/rows.py`` and
``activation.py`` also keep the torch path for fp64, for inputs that need autograd, and for
unusual shapes, so their semantics do not change.

Triton is imported lazily (first launch or first :func:`triton_available` call), so importing
``megatron_lrmoe.experts`` works where triton is missing or broken. The kernel bodies below are
plain functions until then; they reference the module global ``tl``, which is bound on import.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported: triton's own helpers such as
``tl.zeros`` are wrapped at import time) the launchers (``*_triton``) accept CPU tensors and run
the kernel bodies in Triton's numpy interpreter; the tests do that in a subprocess. It is slow,
and the interpreter rounds fp32 -> bf16 by truncation instead of to nearest, so its bf16
results may differ from the GPU ones by one ulp.
"""

from __future__ import annotations

import contextlib
import functools
import os
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "ARG_COUNT",
    "ARG_D_PROBS",
    "ARG_G",
    "ARG_G_OUT",
    "ARG_H",
    "ARG_H_ROWS",
    "ARG_OUT",
    "ARG_ROW_OF",
    "ARG_PROBS",
    "ARG_SLOTS",
    "ARG_SLOT_PLAN",
    "ARG_TOKEN",
    "ARG_X",
    "ARG_X_OUT",
    "ARG_Z",
    "TRITON_ENV",
    "act_backward_from_args",
    "act_backward_triton",
    "act_forward_triton",
    "gather_sum_from_args",
    "gather_rows_triton",
    "gather_sum_triton",
    "args_ready",
    "pack_pairs_triton",
    "pair_blocks",
    "pair_scores_from_args",
    "pair_scores_triton",
    "row_dot_triton",
    "row_norms_from_args",
    "row_norms_triton",
    "scale_rows_triton",
    "triton_available",
    "use_triton",
]

TRITON_ENV = "LRMOE_TRITON"

# Dtypes the kernels load and store; their math is fp32, so fp64 stays on the torch paths.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Elements per program tile: 4096 bf16 elements are 8 KiB per input, 16 per thread at 8 warps,
# large enough to hide memory latency on H100/H200 without spilling in the backward kernel.
_TILE = 4096
_NUM_WARPS = 8
_MIN_BLOCK, _MAX_BLOCK = 16, 1024

_ACT_KINDS = {"silu": 0, "gelu": 1}

# Bound to ``triton.language`` by ``triton_available()``; the kernel bodies resolve it at
# compile (or interpret) time, never at definition time (annotations are strings here).
tl: Any = None


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``triton`` imports here (cached; any import error counts as unavailable)."""
    global tl
    try:
        import triton  # noqa: F401
        import triton.language as language
    except Exception:  # a broken install can raise anything, not only ImportError
        return False
    tl = language
    _interpreter_takes_scalar_bounds()
    return True


def _interpreter_takes_scalar_bounds() -> None:
    """Let Triton 3.6's interpreter (torch 2.11's Triton) use a kernel argument as a loop bound.

    Its ``tensor.__index__`` is ``int(array)`` of a one-element 1-d array, which NumPy 2.5
    rejects ("only 0-dimensional arrays can be converted to Python scalars"), so every
    ``range(0, n, BLOCK)`` over a runtime ``n`` failed: 320 of our 441 interpreter tests.
    Triton 3.8's interpreter takes the element itself; this gives older ones the same
    ``__index__``. Only the interpreter (``TRITON_INTERPRET=1``) is touched, never compiled
    kernels, and nothing where the interpreter is laid out differently.
    """
    try:
        from triton.runtime import interpreter
    except Exception:  # no interpreter in this Triton
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "lrmoe_scalar_index", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patch_lang_tensor.lrmoe_scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _scalar_index(self: Any) -> int:
    """``__index__`` of an interpreted scalar: its one element, whatever the array's rank."""
    return int(self.handle.data.item())


def use_triton(*tensors: torch.Tensor) -> bool:
    """The fast-path switch: all ``tensors`` on CUDA, triton available, ``LRMOE_TRITON != "0"``.

    The environment is read on every call so tests and users can flip it at run time.
    """
    if os.environ.get(TRITON_ENV, "1") == "0":
        return False
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    return triton_available()


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
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_h[None, :])


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
    index_ptr = _arg_ptr(args_ptr, 5, tl.int64)
    row_of_ptr = _arg_ptr(args_ptr, 12, tl.int64)
    out_ptr = _arg_ptr(args_ptr, 13, OUT_TY)
    _gather_sum_body(
        out_ptr, rows_ptr, index_ptr, rows_ptr, row_of_ptr, n_out, width, slots, rows_stride,
        out_stride, False, True, BLOCK_M, BLOCK_H,
    )


def _arg_ptr(args_ptr, index, TY: tl.constexpr):
    """Pointer ``index`` of an argument block (int64 addresses, each 16-byte aligned: the
    launcher checks), typed ``TY``: kernels replayed from a CUDA graph read the addresses of
    tensors that change from call to call from such a block."""
    # The hint goes on the pointer: the alignment of an integer does not survive its cast to a
    # pointer, and without it the loads and stores are not vectorised (one element each).
    ptr = tl.load(args_ptr + index).to(tl.pointer_type(TY))
    return tl.multiple_of(ptr, 16)


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
    g_ptr = _arg_ptr(args_ptr, 0, G_TY)
    x_ptr = _arg_ptr(args_ptr, 1, X_TY)
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
    probs_ptr = _arg_ptr(args_ptr, 2, P_TY)
    token_ptr = _arg_ptr(args_ptr, 3, T_TY)
    _pair_scores_body(
        scores_ptr, partial_ptr, probs_ptr, token_ptr, norms_ptr, top_ptr, n_pairs, n_tokens,
        n_blocks, BLOCK,
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
    tl.store(g_out_ptr + dst * g_out_stride + offs_h[None, :], y.to(g_out_ptr.dtype.element_ty), mask=mask)
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
    ``g_out`` 7, ``x_out`` 8 (``triton_kernels.ARG_*``)."""
    g_ptr = _arg_ptr(args_ptr, 0, G_TY)
    x_ptr = _arg_ptr(args_ptr, 1, X_TY)
    probs_ptr = _arg_ptr(args_ptr, 2, P_TY)
    z_ptr = _arg_ptr(args_ptr, 4, Z_TY)
    slots_ptr = _arg_ptr(args_ptr, 5, tl.int64)
    out_ptr = _arg_ptr(args_ptr, 6, OUT_TY)
    g_out_ptr = _arg_ptr(args_ptr, 7, G_TY)
    x_out_ptr = _arg_ptr(args_ptr, 8, X_TY)
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
    h_ptr = _arg_ptr(args_ptr, 10, H_TY)
    h_rows_ptr = _arg_ptr(args_ptr, 11, tl.int64)
    n_rows = tl.load(args_ptr + 9)
    for pid in range(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        _act_bwd_body(
            pid, dh_ptr, act_ptr, dh_ptr, d_ptr, h_ptr, dh_ptr, h_rows_ptr, n_rows, width,
            h_stride, d_stride, dh_stride, act_stride, GATED, KIND, False, True, True,
            BLOCK_M, BLOCK_F,
        )


# Device helpers called by the kernels above: plain functions until :func:`_kernels` replaces
# them by their triton.jit versions in this module's globals (before any kernel compiles).
_HELPERS = (
    "_arg_ptr", "_row_dot_body", "_row_norms_body", "_pair_scores_body", "_pack_pairs_body",
    "_act_bwd_body", "_gather_sum_body",
)


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    """The kernel bodies wrapped by ``triton.jit`` (built once, on first launch).

    Under ``TRITON_INTERPRET=1`` (read by triton when it is imported and when ``jit`` wraps)
    these are interpreter functions that run on host tensors; ``interpreted`` says so.
    """
    if not triton_available():
        raise RuntimeError("megatron_lrmoe Triton kernels need an importable `triton` package")
    import triton
    from triton.runtime.jit import JITFunction

    module = globals()
    for name in _HELPERS:
        module[name] = triton.jit(module[name])
    kernels = SimpleNamespace(
        scale_rows=triton.jit(_scale_rows_kernel),
        row_dot=triton.jit(_row_dot_kernel),
        gather_sum=triton.jit(_gather_sum_kernel),
        gather_sum_args=triton.jit(_gather_sum_args_kernel),
        act_fwd=triton.jit(_act_fwd_kernel),
        act_bwd=triton.jit(_act_bwd_kernel),
        act_bwd_args=triton.jit(_act_bwd_args_kernel),
        row_norms=triton.jit(_row_norms_kernel),
        pair_scores=triton.jit(_pair_scores_kernel),
        row_norms_args=triton.jit(_row_norms_args_kernel),
        pair_scores_args=triton.jit(_pair_scores_args_kernel),
        pack_pairs=triton.jit(_pack_pairs_kernel),
        row_of_args=triton.jit(_row_of_args_kernel),
        row_dot_pack_args=triton.jit(_row_dot_pack_args_kernel),
    )
    kernels.interpreted = not isinstance(kernels.scale_rows, JITFunction)
    return kernels


def _kernels_for(t: torch.Tensor) -> SimpleNamespace:
    """The kernels, after checking they can run on ``t``'s device."""
    kernels = _kernels()
    if not t.is_cuda and not kernels.interpreted:
        raise ValueError(
            "Triton kernels got host tensors; they need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before triton is first imported (the interpreter runs them on the host)"
        )
    return kernels


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def _col_block(width: int, override: int | None) -> int:
    """Power-of-two column block with the least padding, the larger one on ties.

    E.g. F = 768 gets 256 (no masked-off lanes) where the next power of two (1024) would idle a
    quarter of every tile; H = 2048 gets 1024.
    """
    if override is not None:
        if override < 1 or override & (override - 1):
            raise ValueError(f"block width must be a power of two, got {override}")
        return override
    best, best_pad = _MAX_BLOCK, None
    b = _MAX_BLOCK
    while b >= _MIN_BLOCK:
        pad = _cdiv(max(width, 1), b) * b
        if best_pad is None or pad < best_pad:
            best, best_pad = b, pad
        b //= 2
    return best


# The row-dot's column block (its fp32 summation order, so its bits: the walk and the
# row-dot launched alone share it) and the walk's warps. The walk on 4 x 256 tiles and 4 warps
# was the fastest of 2-16 rows x 256-2048 columns on 4 or 8 warps at both shapes measured on an
# H200 (benchmarks/tile_bench.py --case walk, gpu_run21 calls 1, 2 and 4): 375-392 against
# 403-407 us for 4 x 512 on 8 warps at 128 experts, 16384 tokens and keep 0.5; 236 against 245
# at 16 experts, 8192 tokens and keep 0.75. The row-dot alone: 163 against 170 us.
_ROW_DOT_BLOCK_H = 256
_WALK_WARPS = 4


def _reduction_tile(
    width: int, override: int | None, max_block_h: int, accumulators: int
) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_M)`` of a kernel that loops over the columns and reduces each row: a
    column block of at most ``max_block_h`` (unless overridden) and rows so that its fp32
    accumulators (``accumulators`` tiles' worth of ``_TILE``) stay in registers."""
    block_h = (
        _col_block(width, override)
        if override is not None
        else min(_col_block(width, None), max_block_h)
    )
    return block_h, max(1, (_TILE // accumulators) // block_h)


def _gather_sum_tile(width: int, override: int | None) -> tuple[int, int]:
    """The tile of the gather-sum, direct and from an argument block alike."""
    return _reduction_tile(width, override, max_block_h=_MAX_BLOCK, accumulators=2)


def _act_bwd_tile(width: int, override: int | None) -> tuple[int, int]:
    """The tile of the activation backward, direct and from an argument block alike."""
    return _reduction_tile(width, override, max_block_h=256, accumulators=2)


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) with unit column stride: the kernels take any row stride, but coalesced
    loads need contiguous rows, so only a column-strided input is copied."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


_NULL_CTX = contextlib.nullcontext()


def _device_ctx(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: pin it to the tensors' device when it differs.

    Entering ``torch.cuda.device`` costs about 10 us of host time per launch, the price of a
    whole kernel launch, so it is skipped in the usual case (the tensors are on the current
    device).
    """
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return _NULL_CTX
    return torch.cuda.device(t.device)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} not supported by the Triton kernels")


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
    _check_dtype("rows", rows)
    _check_dtype("scale", scale)
    n_out = rows.shape[0] if index is None else index.shape[0]
    if index is not None and (index.dim() != 1 or index.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"scale_rows_triton: index must be 1-D int32/int64, got {index.dtype}")
    if scale.shape[0] != n_out:
        raise ValueError(f"scale_rows_triton: scale has {scale.shape[0]} rows, expected {n_out}")
    width = rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows = _unit_cols(rows)
    scale = scale.contiguous()
    index = index.contiguous() if index is not None else None
    block_h = _col_block(width, block_h)
    block_m = max(1, _TILE // block_h)
    grid = (_cdiv(n_out, block_m), _cdiv(width, block_h))
    with _device_ctx(rows):
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
            num_warps=_NUM_WARPS,
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
    _check_dtype("rows", rows)
    n_out, width = index.shape[0], rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows, index = _unit_cols(rows), index.contiguous()
    block_h = min(_col_block(width, None), _GATHER_BLOCK_H)
    block_m = max(1, (2 * _TILE) // block_h)
    grid = (_cdiv(n_out, block_m), _cdiv(width, block_h))
    with _device_ctx(rows):
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
    _check_dtype("a", a)
    _check_dtype("b", b)
    n_rows, width = b.shape
    out = torch.empty(n_rows, dtype=out_dtype, device=b.device)
    if n_rows == 0:
        return out
    a, b = _unit_cols(a), _unit_cols(b)
    block_h, block_m = _reduction_tile(
        width, block_h, max_block_h=_ROW_DOT_BLOCK_H, accumulators=2
    )
    index = a_index if slots is None else slots.reshape(-1)
    n_walk = n_rows if slots is None else index.numel()
    with _device_ctx(b):
        _kernels_for(b).row_dot[(_cdiv(n_walk, block_m),)](
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
            num_warps=_NUM_WARPS,
        )
    return out


# Pairs per program of the pair-scoring kernel.
_PAIR_BLOCK = 1024


def row_norms_triton(g: torch.Tensor, x: torch.Tensor, *, block_h: int | None = None) -> torch.Tensor:
    """``[2, T]`` fp32: the L2 norm of every row of ``g`` (row 0) and of ``x`` (row 1), one pass.

    Args:
        g: ``[T, H]`` bf16/fp16/fp32.
        x: ``[T, H]`` bf16/fp16/fp32.
        block_h: Column block override (a power of two), for tests and tuning.
    """
    if g.dim() != 2 or g.shape != x.shape:
        raise ValueError(f"row_norms_triton: g {tuple(g.shape)} and x {tuple(x.shape)}")
    _check_dtype("g", g)
    _check_dtype("x", x)
    n_rows, width = g.shape
    out = torch.empty((2, n_rows), dtype=torch.float32, device=g.device)
    if n_rows == 0:
        return out
    g, x = _unit_cols(g), _unit_cols(x)
    block_h, block_m = _reduction_tile(width, block_h, max_block_h=256, accumulators=4)
    with _device_ctx(g):
        _kernels_for(g).row_norms[(_cdiv(n_rows, block_m),)](
            out,
            g,
            x,
            n_rows,
            width,
            g.stride(0),
            x.stride(0),
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            num_warps=_NUM_WARPS,
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
    with _device_ctx(probs):
        _kernels_for(probs).pair_scores[(blocks,)](
            scores, partial, probs.contiguous(), token.contiguous(), norms.contiguous(),
            top.contiguous(), n, norms.shape[1], blocks, BLOCK=_PAIR_BLOCK, num_warps=4,
        )
    return scores, partial


# Slots of the int64 argument block that the ``*_args`` kernels read tensor addresses (and, in
# ``ARG_COUNT``, a row count) from; the kernels name them by number.
ARG_G, ARG_X, ARG_PROBS, ARG_TOKEN = range(4)  # gradient and input rows, routing weights, tokens
ARG_Z, ARG_SLOT_PLAN, ARG_D_PROBS = 4, 5, 6  # the router gradient's row-dot: inputs, output
ARG_G_OUT, ARG_X_OUT, ARG_COUNT = 7, 8, 9  # packing: dense outputs, the rows they get
# The expert graph (experts/backward_graph.py): the saved fc1 output and the kept rows of it
# (the activation backward), the map to packed rows and the output (the return's gather-sum;
# it reads the slot plan at ARG_SLOT_PLAN).
ARG_H, ARG_H_ROWS, ARG_ROW_OF, ARG_OUT = 10, 11, 12, 13
ARG_SLOTS = 16  # 128 bytes, so what follows the block in one buffer stays 64-byte aligned


def args_ready(*tensors: torch.Tensor) -> bool:
    """Whether the ``*_args`` kernels may read ``tensors`` through an argument block: base
    addresses and row strides on 16 bytes (the kernels assume it), rows of unit column stride."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        if t.dim() == 2 and (t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16):
            return False
    return True


def _tl_dtype(dtype: torch.dtype) -> Any:
    """The ``triton.language`` dtype of a torch dtype (``tl`` is bound by then)."""
    return {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
        torch.int32: tl.int32,
        torch.int64: tl.int64,
    }[dtype]


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
    block_h, block_m = _reduction_tile(width, None, max_block_h=256, accumulators=4)
    with _device_ctx(out):
        kernels.row_norms_args[(_cdiv(n_rows, block_m),)](
            out, args, n_rows, width, strides[0], strides[1],
            G_TY=_tl_dtype(dtypes[0]), X_TY=_tl_dtype(dtypes[1]),
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=_NUM_WARPS,
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
    with _device_ctx(scores):
        kernels.pair_scores_args[(blocks,)](
            scores, partial, args, norms, top, n, norms.shape[1], blocks,
            P_TY=_tl_dtype(dtypes[0]), T_TY=_tl_dtype(dtypes[1]), BLOCK=_PAIR_BLOCK, num_warps=4,
        )


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
    block_h, block_m = _reduction_tile(width, None, max_block_h=_ROW_DOT_BLOCK_H, accumulators=4)
    kernels = _kernels_for(args)
    with _device_ctx(args):
        row_of_pair.fill_(-1)
        grid = (max(1, min(_cdiv(pairs.shape[0], _PAIR_BLOCK), _STRIDING_PROGRAMS)),)
        kernels.row_of_args[grid](row_of_pair, pairs, args, BLOCK=_PAIR_BLOCK, num_warps=4)
        kernels.row_dot_pack_args[(_cdiv(n_walk, block_m),)](
            args, row_of_pair, weight, poison, n_walk, width, *strides, slots_per_token,
            OUT_TY=_tl_dtype(dtypes[0]), G_TY=_tl_dtype(dtypes[1]), Z_TY=_tl_dtype(dtypes[2]),
            X_TY=_tl_dtype(dtypes[3]), P_TY=_tl_dtype(dtypes[4]), HAS_X=has_x,
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=_WALK_WARPS,
        )


# Programs per column block of the striding packing kernel: a few per multiprocessor of an
# H100 / H200 (132), enough to keep their memory pipes busy.
_STRIDING_PROGRAMS = 1024


def pair_blocks(n: int) -> int:
    """Blocks of pairs of :func:`pair_scores_triton` (the width of its ``partial``)."""
    return max(1, _cdiv(n, _PAIR_BLOCK))


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
    _check_dtype("g", g)
    n_out, width = pairs.shape[0], g.shape[1]
    g_out = torch.empty((n_out, width), dtype=g.dtype, device=g.device)
    x_out = None if x is None else torch.empty((n_out, width), dtype=x.dtype, device=g.device)
    if g_out.numel() == 0:
        if row_of_pair is not None and n_out:  # zero-width rows: no program runs
            row_of_pair.index_copy_(0, pairs.long(), torch.arange(n_out, device=g.device))
        return g_out, x_out
    g = _unit_cols(g)
    x = None if x is None else _unit_cols(x)
    block_h = _col_block(width, block_h)
    block_m = max(1, _TILE // block_h)
    grid = (_cdiv(n_out, block_m), _cdiv(width, block_h))
    with _device_ctx(g):
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
            num_warps=_NUM_WARPS,
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
    _check_dtype("rows", rows)
    n_out, slots = index.shape
    width = rows.shape[1]
    out = torch.empty((n_out, width), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    rows = _unit_cols(rows)
    index = index.contiguous()
    block_h, block_m = _gather_sum_tile(width, block_h)
    grid = (_cdiv(n_out, block_m), _cdiv(width, block_h))
    with _device_ctx(rows):
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
            num_warps=_NUM_WARPS,
        )
    return out


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    # [..., W] -> [M, W]; a view when possible, and unit column stride for the kernels.
    return _unit_cols(x.reshape(-1, x.shape[-1]))


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
    _check_dtype("h", h)
    code = _kind_code(kind)
    if h.dim() < 1 or (gated and h.shape[-1] % 2):
        raise ValueError(f"act_forward_triton: bad fc1 shape {tuple(h.shape)} (gated={gated})")
    width = h.shape[-1] // 2 if gated else h.shape[-1]
    out = torch.empty(h.shape[:-1] + (width,), dtype=h.dtype, device=h.device)
    if out.numel() == 0:
        return out
    h2, out2 = _as_rows(h), out.view(-1, width)
    _check_probs(probs, h2.shape[0], "act_forward_triton")
    block_f = _col_block(width, block_f)
    block_m = max(1, _TILE // block_f)
    grid = (_cdiv(h2.shape[0], block_m), _cdiv(width, block_f))
    with _device_ctx(h):
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
            num_warps=_NUM_WARPS,
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
    _check_dtype("h", h)
    _check_dtype("d", d)
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
    h2 = _unit_cols(h) if len(h_shape) == 2 else _as_rows(h)
    d2 = _unit_cols(d) if len(d_shape) == 2 else _as_rows(d)
    act2 = act if act is not None else dh
    block_f, block_m = _act_bwd_tile(width, block_f)
    with _device_ctx(h):
        _kernels_for(h).act_bwd[(_cdiv(rows, block_m),)](
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
            num_warps=_NUM_WARPS,
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
    for the most rows there can be; at most :data:`_STRIDING_PROGRAMS` programs stride over the
    row blocks up to ``M``, and rows from ``M`` on are not touched."""
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
    grid = (max(1, min(_cdiv(n_max, block_m), _STRIDING_PROGRAMS)),)
    with _device_ctx(args):
        _kernels_for(args).act_bwd_args[grid](
            args, dh, act, d, width, h_stride, d.stride(0), dh.stride(0),
            act.stride(0), H_TY=_tl_dtype(h_dtype), GATED=bool(gated), KIND=_kind_code(kind),
            BLOCK_M=block_m, BLOCK_F=block_f, num_warps=_NUM_WARPS,
        )


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
    grid = (_cdiv(n_out, block_m), _cdiv(width, block_h))
    with _device_ctx(args):
        _kernels_for(args).gather_sum_args[grid](
            args, rows, n_out, width, slots, rows.stride(0), width, OUT_TY=_tl_dtype(out_dtype),
            BLOCK_M=block_m, BLOCK_H=block_h, num_warps=_NUM_WARPS,
        )


def _lead_view(t: torch.Tensor | None, lead: tuple[int, ...] | None) -> torch.Tensor | None:
    """``t`` (``[M, W]``) viewed as ``[*lead, W]`` (``lead`` None: as it is)."""
    return t if t is None or lead is None else t.view(*lead, t.shape[-1])
