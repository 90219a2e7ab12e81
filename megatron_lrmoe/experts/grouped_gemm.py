"""Grouped matrix products over rows that are contiguous per group (expert), without padding.

Shape legend:
    N: rows in total (token-expert rows), sum of the group sizes.
    G: groups (local experts); a group may hold 0 rows.
    K, M: feature widths of the operands (see each function).

Rows of group ``g`` are the contiguous slice ``[offs[g-1], offs[g])`` of every row-indexed
operand, with ``offs = cumsum(counts)``. ``counts`` may be a list of ints, a LongTensor (on the
CPU, preferably), or a :class:`GroupSizes` built once and reused by several products.

Backends (see :func:`grouped_mm_backend`):
    ``"torch_grouped_mm"``: one ``torch.nn.functional.grouped_mm`` call. Used when it exists,
        both operands share dtype and device, the device/dtype pair has a kernel that never
        copies the offsets back to the host, and every feature width is a multiple of
        16 bytes (the kernel's stride rule). Supported pairs: CPU with float32, bfloat16 or
        float16; CUDA with bfloat16 on compute capability 9.x or 10.x (the CUTLASS kernel of
        torch 2.10/2.11). Anything else in torch's CUDA path (float32, float16, other GPUs)
        runs ``_grouped_mm_fallback``, which reads ``offs`` back to the host and loops; our own
        loop does the same work without that device-to-host sync, so we use it instead.
    ``"loop"``: one ``torch.mm`` per non-empty group, driven by host-side group sizes.

Switch: ``grouped_mm`` of the active kernel options (``options.active_kernels()``: the running
layer's ``LRMoEConfig.kernels``, ``--no-lrmoe-grouped-mm``): on (default) picks as above; off
forces the per-group loop everywhere (for debugging or to compare backends).

The functions are meant for explicit forward/backward code (inside ``torch.autograd.Function``
methods). They stay differentiable if called with grad enabled (grouped_mm has a derivative and
the loop then avoids ``out=``), but nothing here relies on that.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, Union

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lrmoe.dispatch.compaction import host_to_device
from megatron_lrmoe.options import active_kernels

__all__ = [
    "Counts",
    "GroupSizes",
    "GroupedMMBackend",
    "decide_backend",
    "grouped_mm_backend",
    "grouped_mm_backend_for",
    "grouped_mm_nn",
    "grouped_mm_nt",
    "grouped_mm_tn",
]

GroupedMMBackend = Literal["torch_grouped_mm", "loop"]

# The grouped GEMM kernels (CUTLASS/TMA on CUDA) need every non-unit stride to be a multiple of
# 16 bytes; torch checks the same rule on the CPU.
_ALIGN_BYTES = 16

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupSizes:
    """Rows per group, kept on the host when possible, with device offsets built lazily.

    Building this once and passing it to several grouped products avoids rebuilding the
    ``int32`` offsets (one small host-to-device copy each) per product.

    Attributes:
        sizes: Host-side rows per group, or ``None`` when the counts live on an accelerator
            (then reading them costs a device-to-host sync, done only by the loop backend).
        num_groups: Number of groups ``G``.
    """

    def __init__(self, counts: Counts) -> None:
        """Wraps ``counts``.

        Args:
            counts: Rows per group: a list/tuple of ints, a 1-D integer tensor, or a
                ``GroupSizes`` (its state is shared).

        Raises:
            ValueError: If ``counts`` is not 1-D, not integer, or holds negative values.
        """
        self._device_counts: torch.Tensor | None = None
        self._offs_cache: dict[torch.device, torch.Tensor] = {}
        if isinstance(counts, GroupSizes):
            self.sizes: list[int] | None = counts.sizes
            self._device_counts = counts._device_counts
            self._offs_cache = counts._offs_cache
            self.num_groups: int = counts.num_groups
            return
        if isinstance(counts, torch.Tensor):
            if counts.dim() != 1:
                raise ValueError(f"counts must be 1-D, got shape {tuple(counts.shape)}")
            if counts.dtype.is_floating_point or counts.dtype.is_complex:
                raise ValueError(f"counts must be an integer tensor, got {counts.dtype}")
            self.num_groups = counts.numel()
            if counts.device.type == "cpu":
                self.sizes = counts.tolist()
            else:
                # Keep device counts on the device: the grouped_mm path builds offsets there
                # without a sync; only the loop needs host sizes (see ``host_sizes``).
                self.sizes = None
                self._device_counts = counts
        else:
            self.sizes = [int(c) for c in counts]
            self.num_groups = len(self.sizes)
        if self.sizes is not None and self.sizes and min(self.sizes) < 0:
            raise ValueError(f"counts must be non-negative, got {self.sizes}")

    def host_sizes(self) -> list[int]:
        """Returns the sizes on the host (syncs once if the counts live on a device)."""
        if self.sizes is None:
            assert self._device_counts is not None
            self.sizes = [int(c) for c in self._device_counts.tolist()]
        return self.sizes

    def total(self) -> int | None:
        """Returns ``sum(counts)`` when known on the host, else ``None`` (no sync)."""
        return None if self.sizes is None else sum(self.sizes)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """Returns ``cumsum(counts)`` as contiguous ``int32`` on ``device`` (cached per device).

        From host sizes this is one asynchronous host-to-device copy (through pinned memory);
        from device counts it is a device-side cumsum; neither waits for the device.
        """
        cached = self._offs_cache.get(device)
        if cached is not None:
            return cached
        if self.sizes is not None:
            # Written by numpy straight into (pinned) host memory, then one queued copy: a torch
            # CPU op costs ~5 us of host time each, and this runs for every grouped product.
            host = torch.empty(
                len(self.sizes), dtype=torch.int32, pin_memory=device.type == "cuda"
            )
            np.cumsum(np.asarray(self.sizes, dtype=np.int64), out=host.numpy(), dtype=np.int32)
            offs = host if device.type == "cpu" else host.to(device, non_blocking=True)
        else:
            assert self._device_counts is not None
            offs = torch.cumsum(self._device_counts.to(device), 0, dtype=torch.int32)
        self._offs_cache[device] = offs
        return offs

    def zero_empty_groups(self, out: torch.Tensor) -> None:
        """Zero ``out[g]`` for every empty group ``g`` (``out`` is ``[G, ...]``), no sync.

        With host sizes only the empty slices are written; with device counts a broadcast mask
        covers the whole tensor (deciding which slices are empty would need a sync).
        """
        if self.sizes is not None:
            empty = [g for g, c in enumerate(self.sizes) if c == 0]
            if empty:
                index = host_to_device(torch.tensor(empty, dtype=torch.int64), out.device)
                out.index_fill_(0, index, 0)
            return
        assert self._device_counts is not None
        mask = self._device_counts.to(out.device) == 0
        out.masked_fill_(mask.view((-1,) + (1,) * (out.dim() - 1)), 0)


Counts = Union[torch.Tensor, Sequence[int], GroupSizes]


def _as_group_sizes(counts: Counts) -> GroupSizes:
    return counts if isinstance(counts, GroupSizes) else GroupSizes(counts)


@functools.lru_cache(maxsize=None)
def _cuda_has_fast_grouped_mm(device_index: int) -> bool:
    # torch's CUDA grouped_mm takes its sync-free CUTLASS path only on sm90/sm100-class parts
    # (``_scaled_mm_allowed_device(sm90_only, sm100_only)``); elsewhere it falls back to a loop
    # that copies ``offs`` to the host. ROCm builds route to the same fallback by default.
    if torch.version.hip is not None:
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    return major in (9, 10)


def _device_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cpu":
        return dtype in _CPU_DTYPES
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return dtype == torch.bfloat16 and _cuda_has_fast_grouped_mm(index)
    return False


def _width_aligned(width: int, dtype: torch.dtype) -> bool:
    return (width * dtype.itemsize) % _ALIGN_BYTES == 0


def decide_backend(
    grouped_mm: bool,
    x_dtype: torch.dtype,
    x_device: torch.device,
    w_dtype: torch.dtype,
    w_device: torch.device,
    widths: tuple[int, ...],
) -> GroupedMMBackend:
    """:func:`grouped_mm_backend`'s rule on what it reads of the operands (the reference).

    Args:
        grouped_mm: The switch (``KernelOptions.grouped_mm``); off always gives ``"loop"``.
        x_dtype, x_device: The row operand's.
        w_dtype, w_device: The other operand's.
        widths: Every feature width of both operands (all dims but the row / group dim).
    """
    if not grouped_mm:
        return "loop"
    if x_dtype != w_dtype or x_device != w_device:
        return "loop"
    if not _device_dtype_supported(x_device, x_dtype):
        return "loop"
    if not all(_width_aligned(int(d), x_dtype) for d in widths):
        return "loop"
    return "torch_grouped_mm"


# The decision per distinct input: every grouped product asks (four to eight per layer call and
# pass), and the rule costs several microseconds of host time against well under one for the
# lookup. Keyed on everything the rule reads, the switch included, so a changed switch, dtype,
# device or width is a new key, never a stale answer. Few distinct keys exist in a process (one
# per weight stack shape, dtype and device), the bound only guards against a pathological one.
_cached_backend = functools.lru_cache(maxsize=1024)(decide_backend)


def grouped_mm_backend(x: torch.Tensor, w: torch.Tensor) -> GroupedMMBackend:
    """Says which backend the grouped products take for these operands.

    The rule is shape/dtype/device based (never data dependent), so every product of one
    expert MLP step picks predictably: ``x`` is the row operand ``[N, *]`` and ``w`` the other
    operand, either a stacked weight ``[G, *, *]`` or, for the weight-gradient form, a second
    row operand ``[N, *]``. All feature widths (every dim but the row/group dim) must be a
    multiple of 16 bytes; the active kernel options' ``grouped_mm`` off gives ``"loop"``. The
    rule's answer is memoised per distinct input (:func:`decide_backend`, the uncached
    reference).

    Args:
        x: Row operand ``[N, K]``.
        w: Stacked weights ``[G, M, K]`` / ``[G, K, M]``, or a row operand ``[N, M]``.

    Returns:
        ``"torch_grouped_mm"`` or ``"loop"``.
    """
    return grouped_mm_backend_for(x.dtype, x.device, x.shape[-1], w)


def grouped_mm_backend_for(
    dtype: torch.dtype, device: torch.device, width: int, w: torch.Tensor
) -> GroupedMMBackend:
    """:func:`grouped_mm_backend` for a row operand described by its dtype, device and width
    (``[N, width]``), e.g. one not computed yet, without allocating it."""
    if not hasattr(F, "grouped_mm"):  # outside the memo: tests may take it away
        return "loop"
    shape = w.shape
    widths = (width, shape[-1], shape[-2]) if len(shape) == 3 else (width, shape[-1])
    grouped_mm = active_kernels().grouped_mm
    return _cached_backend(grouped_mm, dtype, device, w.dtype, w.device, widths)


def _layout_ok(t: torch.Tensor) -> bool:
    # Mirrors torch's grouped_mm stride check on the last two dims: one of them has stride 1
    # and the other a stride >= its partner size that is a multiple of 16 bytes. CUDA also needs
    # a 16-byte aligned base pointer for TMA loads (views may start mid-row).
    align = _ALIGN_BYTES // t.element_size()
    s_row, s_col = t.stride(-2), t.stride(-1)
    rows, cols = t.shape[-2], t.shape[-1]
    if s_col == 1 and s_row >= max(1, cols):
        ok = s_row % align == 0
    elif s_row == 1 and s_col >= max(1, rows):
        ok = s_col % align == 0
    else:
        ok = False
    if ok and t.device.type == "cuda":
        ok = t.data_ptr() % _ALIGN_BYTES == 0
    return ok


def _row_major(t: torch.Tensor) -> torch.Tensor:
    # Copy only when the existing strides would be rejected by the kernel.
    return t if _layout_ok(t) else t.contiguous()


def _right_operand(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[G, M, K]`` for the right operand of ``x_g @ w[g]``: ``w`` itself, but on the CPU
    in half precision a column-major copy. There a row-major right operand takes a slow path
    (torch 2.14 on a 2-core AVX2 EPYC: 8.5 s for ``[2048, 2048] @ 16 x [2048, 768]`` in bf16,
    0.3 s column-major, which costs one 60 ms copy): the bf16 input gradients of the CPU tests
    and benchmarks. CUDA is unchanged."""
    if w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16):
        wt = w.transpose(-2, -1)
        return w if wt.is_contiguous() else wt.contiguous().transpose(-2, -1)
    return w


def _weight_t(w: torch.Tensor) -> torch.Tensor:
    # ``w`` is ``[G, M, K]``; the kernel wants ``[G, K, M]``, which the transposed view provides
    # without a copy when ``w`` is contiguous (column-major per group is accepted).
    wt = w.transpose(-2, -1)
    return wt if _layout_ok(wt) else w.contiguous().transpose(-2, -1)


def _check_dtypes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{what}: operand dtypes differ ({a.dtype} vs {b.dtype}); cast first")
    if a.device != b.device:
        raise ValueError(f"{what}: operands live on different devices ({a.device}, {b.device})")


def _check_rows(n: int, groups: GroupSizes, num_groups: int | None, what: str) -> None:
    if num_groups is not None and groups.num_groups != num_groups:
        raise ValueError(f"{what}: {groups.num_groups} group sizes for {num_groups} groups")
    total = groups.total()
    if total is not None and total != n:
        # Rows past offs[-1] would be left uninitialised by the kernel; refuse instead.
        raise ValueError(f"{what}: group sizes sum to {total} but there are {n} rows")


def _check_out(
    out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, what: str
) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(
            f"{what}: out is {tuple(out.shape)} {out.dtype}, expected {shape} {dtype}"
        )


def _spans(groups: GroupSizes) -> list[tuple[int, int, int]]:
    """(group, start, end) for every non-empty group, from host sizes."""
    spans = []
    start = 0
    for g, c in enumerate(groups.host_sizes()):
        if c > 0:
            spans.append((g, start, start + c))
        start += c
    return spans


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    # ``out=`` avoids a temporary but is not differentiable; keep autograd working if a caller
    # runs the loop with grad enabled on inputs that require grad.
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out.copy_(a @ b)
    elif out.dtype == a.dtype and out.is_contiguous():
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def grouped_mm_nt(
    x: torch.Tensor, w: torch.Tensor, counts: Counts, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-group ``x_g @ w[g]^T`` (forward of a stacked ``[out, in]`` Linear).

    Args:
        x: ``[N, K]`` rows grouped by expert.
        w: ``[G, M, K]`` stacked weights.
        counts: Rows per group, ``G`` entries summing to ``N``.
        out: Optional ``[N, M]`` tensor to write into (e.g. a row range of a larger buffer when
            the rows' groups use two weight stacks); the loop writes in place, torch's
            grouped_mm (which has no ``out=``) is copied in.

    Returns:
        ``[N, M]`` in ``x``'s dtype (``out`` when given).

    Raises:
        ValueError: On shape, dtype, device or group-size mismatches.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"grouped_mm_nt expects x [N, K], w [G, M, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    _check_dtypes(x, w, "grouped_mm_nt")
    groups = _as_group_sizes(counts)
    _check_rows(x.shape[0], groups, w.shape[0], "grouped_mm_nt")
    n, m = x.shape[0], w.shape[1]
    _check_out(out, (n, m), x.dtype, "grouped_mm_nt")
    if n == 0:
        # Kernels may hang or misbehave on zero total rows; the answer is known.
        return x.new_empty((0, m)) if out is None else out
    if grouped_mm_backend(x, w) == "torch_grouped_mm":
        result = F.grouped_mm(_row_major(x), _weight_t(w), offs=groups.offsets(x.device))
        return result if out is None else out.copy_(result)
    out = x.new_empty((n, m)) if out is None else out
    for g, s, e in _spans(groups):
        _mm_into(out[s:e], x[s:e], w[g].t())
    return out


def grouped_mm_nn(
    x: torch.Tensor, w: torch.Tensor, counts: Counts, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-group ``x_g @ w[g]`` (input gradient of a stacked ``[out, in]`` Linear).

    Args:
        x: ``[N, M]`` rows grouped by expert (e.g. the output gradient).
        w: ``[G, M, K]`` stacked weights.
        counts: Rows per group, ``G`` entries summing to ``N``.
        out: Optional ``[N, K]`` tensor to write into (see :func:`grouped_mm_nt`).

    Returns:
        ``[N, K]`` in ``x``'s dtype (``out`` when given).

    Raises:
        ValueError: On shape, dtype, device or group-size mismatches.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"grouped_mm_nn expects x [N, M], w [G, M, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    _check_dtypes(x, w, "grouped_mm_nn")
    groups = _as_group_sizes(counts)
    _check_rows(x.shape[0], groups, w.shape[0], "grouped_mm_nn")
    n, k = x.shape[0], w.shape[2]
    _check_out(out, (n, k), x.dtype, "grouped_mm_nn")
    if n == 0:
        return x.new_empty((0, k)) if out is None else out
    if grouped_mm_backend(x, w) == "torch_grouped_mm":
        w = _row_major(_right_operand(w))
        result = F.grouped_mm(_row_major(x), w, offs=groups.offsets(x.device))
        return result if out is None else out.copy_(result)
    out = x.new_empty((n, k)) if out is None else out
    w = _right_operand(w)
    for g, s, e in _spans(groups):
        _mm_into(out[s:e], x[s:e], w[g])
    return out


def grouped_mm_tn(
    a: torch.Tensor,
    b: torch.Tensor,
    counts: Counts,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-group ``a_g^T @ b_g`` (weight gradient), zeros for empty groups.

    Both backends compute in the operands' dtype (fp32 accumulation inside the GEMM) and then
    cast to ``out_dtype``, so the result does not depend on the backend. torch's grouped_mm
    cannot emit fp32 from bf16 inputs yet, hence the cast rather than a wider output.

    Args:
        a: ``[N, M]`` rows grouped by expert (e.g. the output gradient).
        b: ``[N, K]`` rows grouped the same way (e.g. the layer input).
        counts: Rows per group; ``G = len(counts)`` entries summing to ``N``.
        out_dtype: Result dtype; defaults to the operands' dtype.

    Returns:
        ``[G, M, K]``; group ``g`` is ``sum_i a_i^T b_i`` over its rows.

    Raises:
        ValueError: On shape, dtype, device or group-size mismatches.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(
            f"grouped_mm_tn expects a [N, M], b [N, K]; got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    _check_dtypes(a, b, "grouped_mm_tn")
    groups = _as_group_sizes(counts)
    _check_rows(a.shape[0], groups, None, "grouped_mm_tn")
    n, m, k, g_count = a.shape[0], a.shape[1], b.shape[1], groups.num_groups
    dtype = out_dtype if out_dtype is not None else a.dtype
    if n == 0 or g_count == 0:
        return torch.zeros((g_count, m, k), dtype=dtype, device=a.device)
    if grouped_mm_backend(a, b) == "torch_grouped_mm":
        # ``a.t()`` of a row-major ``[N, M]`` is column-major ``[M, N]`` with stride M, which the
        # kernel accepts as is when M is aligned (already required by the backend choice).
        out = F.grouped_mm(_row_major(a).t(), _row_major(b), offs=groups.offsets(a.device))
        # Some kernels (reported on sm100) leave empty groups' outputs unwritten; zero them
        # rather than trusting every kernel version.
        groups.zero_empty_groups(out)
        return out if out.dtype == dtype else out.to(dtype)
    out = torch.zeros((g_count, m, k), dtype=dtype, device=a.device)
    for g, s, e in _spans(groups):
        _mm_into(out[g], a[s:e].t(), b[s:e])
    return out
