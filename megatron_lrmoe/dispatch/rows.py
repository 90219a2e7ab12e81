"""Row-wise products in fp32 without an fp32 copy of a whole ``[N, H]`` tensor.

Shape legend: N input rows, K output rows of a gathered :func:`scale_rows` (``len(index)``),
H hidden.

On CUDA (with ``triton`` importable and ``LRMOE_TRITON != "0"``) both ops run one fused Triton
kernel from ``triton_kernels.py``: one read of each input, one write of the output, fp32 math
in registers. Elsewhere, and for cases those kernels do not take (fp64, inputs that need
autograd, unusual shapes), the chunked torch code below runs; it is also the reference the
kernels are tested against. Chunking bounds its fp32 temporaries to ``CHUNK_ROWS x H``; at
Qwen3-30B-A3B sizes (N = 131072 pairs, H = 2048) a whole fp32 copy would be 1 GiB.
"""

from __future__ import annotations

import torch

from megatron_lrmoe import triton_kernels

CHUNK_ROWS = 16384

_INDEX_DTYPES = (torch.int32, torch.int64)


def _needs_autograd(*tensors: torch.Tensor) -> bool:
    # The kernels have no backward; keep torch's differentiable path when a graph is recorded.
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _scale_rows_triton_ok(
    rows: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None
) -> bool:
    extra = () if index is None else (index,)
    if not triton_kernels.use_triton(rows, scale, *extra):
        return False
    n_out = rows.shape[0] if index is None else index.shape[0]
    return (
        rows.dim() == 2
        and rows.dtype in triton_kernels.KERNEL_DTYPES
        and scale.dtype in triton_kernels.KERNEL_DTYPES
        # Anything else (e.g. a broadcast [1] scale) keeps the torch path's semantics.
        and scale.shape == (n_out,)
        and (index is None or (index.dim() == 1 and index.dtype in _INDEX_DTYPES))
        and not _needs_autograd(rows, scale)
    )


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
        return triton_kernels.scale_rows_triton(rows, scale, index)
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


def row_dot(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``<a[i], b[i]>`` for every row, accumulated in fp32, returned as ``out_dtype``.

    Args:
        a, b: ``[N, H]``.
        out_dtype: Result dtype.

    Returns:
        ``[N]`` in ``out_dtype``.
    """
    if (
        triton_kernels.use_triton(a, b)
        and a.dim() == 2
        and a.shape == b.shape
        and a.dtype in triton_kernels.KERNEL_DTYPES
        and b.dtype in triton_kernels.KERNEL_DTYPES
        and out_dtype.is_floating_point
        and not _needs_autograd(a, b)
    ):
        return triton_kernels.row_dot_triton(a, b, out_dtype)
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    for lo in range(0, a.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        out[lo:hi] = (a[lo:hi].float() * b[lo:hi].float()).sum(-1)
    return out.to(out_dtype)
