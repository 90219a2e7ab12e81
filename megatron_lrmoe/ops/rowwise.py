"""Row-wise products in fp32 without an fp32 copy of a whole ``[N, H]`` tensor.

Shape legend: N rows, H hidden. Chunking bounds the fp32 temporaries to ``CHUNK_ROWS x H``; at
Qwen3-30B-A3B sizes (N = 131072 pairs, H = 2048) a whole fp32 copy would be 1 GiB.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 16384


def scale_rows(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``rows * scale[:, None]`` computed in fp32 (at least) and returned in ``rows.dtype``.

    This is Megatron's rounding for the routing weight: the product in the probs' precision,
    then a cast back to the activation dtype.
    """
    wide = torch.promote_types(rows.dtype, scale.dtype)
    out = torch.empty_like(rows)
    for lo in range(0, rows.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        out[lo:hi] = (rows[lo:hi].to(wide) * scale[lo:hi].to(wide).unsqueeze(-1)).to(rows.dtype)
    return out


def row_dot(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``<a[i], b[i]>`` for every row, accumulated in fp32, returned as ``out_dtype``."""
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    for lo in range(0, a.shape[0], CHUNK_ROWS):
        hi = lo + CHUNK_ROWS
        out[lo:hi] = (a[lo:hi].float() * b[lo:hi].float()).sum(-1)
    return out.to(out_dtype)
