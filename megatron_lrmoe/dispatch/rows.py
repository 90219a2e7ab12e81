"""Row-wise products in fp32 without an fp32 copy of a whole ``[N, H]`` tensor.

Shape legend: N input rows, K output rows of a gathered :func:`scale_rows` (``len(index)``),
H hidden; for :func:`gather_sum` T output rows (tokens) with up to K slots each.

On CUDA (with ``triton`` importable and ``KernelOptions.triton`` on) both ops run one fused Triton
kernel from ``rows_triton.py``: one read of each input, one write of the output, fp32 math
in registers. Elsewhere, and for cases those kernels do not take (fp64, inputs that need
autograd, unusual shapes), the chunked torch code below runs; it is also the reference the
kernels are tested against. Chunking bounds its fp32 temporaries to ``CHUNK_ROWS x H``; at
Qwen3-30B-A3B sizes (N = 131072 pairs, H = 2048) a whole fp32 copy would be 1 GiB.
"""

from __future__ import annotations

import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.dispatch import rows_triton

CHUNK_ROWS = 16384

_INDEX_DTYPES = (torch.int32, torch.int64)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    # The kernels have no backward; keep torch's differentiable path when a graph is recorded.
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _scale_rows_triton_ok(
    rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None
) -> bool:
    extra = () if index is None else (index,)
    if not triton_common.use_triton(rows, scale, *extra):
        return False
    n_out = rows.shape[0] if index is None else index.shape[0]
    return (
        rows.dim() == 2
        and rows.dtype in triton_common.KERNEL_DTYPES
        and scale.dtype in triton_common.KERNEL_DTYPES
        # Anything else (e.g. a broadcast [1] scale) keeps the torch path's semantics.
        and scale.shape == (n_out,)
        and (index is None or (index.dim() == 1 and index.dtype in _INDEX_DTYPES))
        and not _needs_autograd(rows, scale)
    )


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, index)`` (the reference, and the path off CUDA): ``[N, H] ->
    [K, H]``. On CUDA one Triton copy kernel (``rows_triton.gather_rows_triton``), about
    1.2-1.4x faster than ``index_select`` at the forward's pair gather on an H200. Like the
    other fast paths it does not range-check ``index``."""
    if (
        triton_common.use_triton(rows, index)
        and rows.dim() == 2
        and rows.dtype in triton_common.KERNEL_DTYPES
        and index.dim() == 1
        and index.dtype in _INDEX_DTYPES
        and not _needs_autograd(rows)
    ):
        return rows_triton.gather_rows_triton(rows, index)
    return rows.index_select(0, index)


def scale_rows(
    rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """``rows * scale[:, None]`` computed in fp32 (at least) and returned in ``rows.dtype``.

    This is Megatron's rounding for the routing weight: the product in the probs' precision,
    then a cast back to the activation dtype.

    Args:
        rows: ``[N, H]``.
        scale: ``[K]``, one factor per *output* row (``K = N`` without ``index``).
        index: Optional ``[K]`` int32/int64 source rows in ``[0, N)``: ``out[i] =
            rows[index[i]] * scale[i]``, the gather fused into the scaling (no ``[K, H]``
            ``index_select`` copy on the Triton path). The Triton path does not range-check
            ``index`` (that would need a host sync); the torch path raises on a bad index.

    Returns:
        ``[K, H]`` in ``rows.dtype``.
    """
    if _scale_rows_triton_ok(rows, scale, index):
        return rows_triton.scale_rows_triton(rows, scale, index)
    return _scale_rows_torch(rows, scale, index)


def _scale_rows_torch(
    rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None
) -> torch.Tensor:
    wide = torch.promote_types(rows.dtype, scale.dtype)
    if index is None:
        out = torch.empty_like(rows)
        for lo in range(0, rows.shape[0], CHUNK_ROWS):
            hi = lo + CHUNK_ROWS
            out[lo:hi] = (rows[lo:hi].to(wide) * scale[lo:hi].to(wide).unsqueeze(-1)).to(rows.dtype)
        return out
    out = rows.new_empty((index.shape[0],) + tuple(rows.shape[1:]))
    for lo in range(0, index.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        src = rows.index_select(0, index[lo:hi])
        out[lo:hi] = (src.to(wide) * scale[lo:hi].to(wide).unsqueeze(-1)).to(rows.dtype)
    return out


def pack_pairs(
    g: torch.Tensor,
    token_of_pair: torch.Tensor,
    pairs: torch.Tensor,
    probs: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor | None = None,
    poison: torch.Tensor | None = None,
    row_of_pair: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack the gradient rows (and optionally the input rows) of the pairs ``pairs``.

    Row ``i`` belongs to pair ``j = pairs[i]`` of token ``t = token_of_pair[j]``: ``g_out[i] =
    g[t] * (probs[j] * weight[i] (+ poison))`` with the scale in fp32 and one rounding into
    ``g``'s dtype (:func:`scale_rows`'s rounding), and ``x_out[i] = x[t]``. On CUDA this is one
    Triton kernel (``rows_triton.pack_pairs_triton``): the pair -> token lookup, both
    gathers and the scale never materialise an index or an ``[S, H]`` tensor. The torch code
    below is the reference.

    Args:
        g: ``[T, H]`` token gradient rows.
        token_of_pair: ``[S]`` int64 token of each pair.
        pairs: ``[K]`` int64 pairs to pack, in output order.
        probs: ``[S]`` routing weight of each pair.
        weight: ``[K]`` fp32 gradient multiplier of each packed row.
        x: Optional ``[T, H]`` input rows to pack alongside.
        poison: Optional 0-dim fp32 added to every scale (0, or NaN so that a non-finite score
            reaches the weight gradients).
        row_of_pair: Optional contiguous ``[S + 1]`` int64, filled with ``-1`` by the caller:
            also written ``row_of_pair[pairs[i]] = i`` (the packed row of each packed pair; the
            trailing entry stays ``-1``), the map with which :func:`gather_sum` (``row_of``)
            adds rows that come back in packed order into their tokens. ``pairs`` must then be
            distinct.

    Returns:
        ``(g_out [K, H], x_out [K, H] or None)``.
    """
    extra = tuple(t for t in (x, poison, row_of_pair) if t is not None)
    if (
        triton_common.use_triton(g, token_of_pair, pairs, probs, weight, *extra)
        and g.dim() == 2
        and g.dtype in triton_common.KERNEL_DTYPES
        and (x is None or (x.shape == g.shape and x.dtype in triton_common.KERNEL_DTYPES))
        and weight.dtype == torch.float32
        and probs.dtype.is_floating_point
        and pairs.dtype in _INDEX_DTYPES
        and token_of_pair.dtype in _INDEX_DTYPES
        and not _needs_autograd(g, probs, *(() if x is None else (x,)))
    ):
        return rows_triton.pack_pairs_triton(
            g, token_of_pair, pairs, probs, weight, x=x, poison=poison, row_of_pair=row_of_pair
        )
    if row_of_pair is not None:
        row_of_pair.index_copy_(0, pairs.long(), torch.arange(pairs.numel(), device=pairs.device))
    tok = token_of_pair.index_select(0, pairs)
    scale = probs.float().index_select(0, pairs) * weight
    if poison is not None:
        scale = scale + poison
    g_out = _scale_rows_torch(g, scale, tok)
    x_out = None if x is None else x.index_select(0, tok)
    return g_out, x_out


def row_dot(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    a_index: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``<a[a_index[i] (or i)], b[i]>`` for every row of ``b``, accumulated in fp32.

    Args:
        a: ``[M, H]`` (``M = N`` without ``a_index``).
        b: ``[N, H]``.
        out_dtype: Result dtype.
        a_index: Optional ``[N]`` int64 rows of ``a``: the gather is fused on the Triton path
            (e.g. the token gradient row of every pair, without a ``[N, H]`` copy).
        slots: Instead of ``a_index``, the same pairing seen from ``a``: ``[M, K]`` int64,
            ``slots[t, k]`` a row of ``b`` paired with row ``t`` of ``a`` (``-1``: none), every
            row of ``b`` exactly once. The Triton path then reads each ``a`` row once (a
            token's gradient row for all its pairs) instead of once per pair.

    Returns:
        ``[N]`` in ``out_dtype``.
    """
    if a_index is not None and slots is not None:
        raise ValueError("row_dot: give a_index or slots, not both")
    index = a_index if slots is None else slots
    if (
        triton_common.use_triton(a, b, *(() if index is None else (index,)))
        and a.dim() == 2
        and b.dim() == 2
        and (a.shape == b.shape if index is None else a.shape[1] == b.shape[1])
        and a.dtype in triton_common.KERNEL_DTYPES
        and b.dtype in triton_common.KERNEL_DTYPES
        and out_dtype.is_floating_point
        and not _needs_autograd(a, b)
    ):
        return rows_triton.row_dot_triton(a, b, out_dtype, a_index, slots=slots)
    if slots is not None:
        a_index = slots_to_rows(slots, b.shape[0])
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    out = torch.empty(b.shape[0], dtype=wide, device=b.device)
    for lo in range(0, b.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        a_rows = a[lo:hi] if a_index is None else a.index_select(0, a_index[lo:hi])
        out[lo:hi] = (a_rows.to(wide) * b[lo:hi].to(wide)).sum(-1)
    return out.to(out_dtype)


def slots_to_rows(slots: torch.Tensor, n: int) -> torch.Tensor:
    """``[M, K]`` slot table (row of an ``[n]``-row operand per slot, ``-1`` empty) -> ``[n]``
    row of ``slots`` holding each (the inverse pairing; every row must appear exactly once)."""
    flat = slots.reshape(-1)
    owner = torch.arange(slots.shape[0], device=slots.device).repeat_interleave(slots.shape[1])
    used = flat >= 0
    rows = torch.full((n,), -1, dtype=torch.int64, device=slots.device)
    rows[flat[used]] = owner[used]
    return rows


def gather_sum(
    rows: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor | None = None,
    row_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k scale[i] * rows[i]`` over the slots ``i = index[t, k] >= 0``.

    The token side of a permutation: every token adds up the rows of its pairs (the combine's
    unpermute, and the input gradient of the dispatch's permute), as a gather instead of an
    atomic scatter-add. Slots are added in ``k`` order in fp32 (fp64 for fp64 rows) and rounded
    once, so the result does not depend on thread scheduling.

    Args:
        rows: ``[R, H]`` pair rows.
        index: ``[T, K]`` int64 row of each slot, ``-1`` for an empty one.
        scale: Optional ``[R]`` factor per row (e.g. the routing weight of each pair).
        row_of: Optional 1-D int64 map from what ``index`` holds to rows: slot ``j = index[t,
            k]`` then adds row ``row_of[j]`` (``j = -1``, an empty slot, or ``row_of[j] = -1``,
            e.g. a dropped pair: nothing). With ``index = PairPermutation.slot_pair`` and the
            ``row_of_pair`` that :func:`pack_pairs` wrote, this is ``gather_sum(rows,
            perm.slot_rows(pairs))`` without building that ``[T, K]`` plan.

    Returns:
        ``[T, H]`` in ``rows.dtype``.
    """
    extra = tuple(t for t in (scale, row_of) if t is not None)
    if (
        triton_common.use_triton(rows, index, *extra)
        and rows.dim() == 2
        and rows.dtype in triton_common.KERNEL_DTYPES
        and index.dim() == 2
        and index.dtype == torch.int64
        and (scale is None or scale.shape == rows.shape[:1])
        and (row_of is None or (row_of.dim() == 1 and row_of.dtype == torch.int64))
    ):
        return rows_triton.gather_sum_triton(rows, index, scale, row_of)
    if row_of is not None:
        index = torch.where(index < 0, -1, row_of[index.clamp(min=0)])
    wide = torch.promote_types(rows.dtype, torch.float32)
    num_out, slots = index.shape
    out = rows.new_empty((num_out, rows.shape[1]))
    # A zero row stands in for empty slots.
    padded = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
    safe = torch.where(index < 0, rows.shape[0], index)
    scale_padded = (
        None if scale is None else torch.cat([scale.to(wide), scale.new_zeros(1, dtype=wide)])
    )
    for lo in range(0, num_out, CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        acc = torch.zeros((safe[lo:hi].shape[0], rows.shape[1]), dtype=wide, device=rows.device)
        for k in range(slots):
            src = safe[lo:hi, k]
            x = padded.index_select(0, src).to(wide)
            if scale_padded is not None:
                x = x * scale_padded.index_select(0, src).unsqueeze(-1)
            acc += x
        out[lo:hi] = acc.to(rows.dtype)
    return out
