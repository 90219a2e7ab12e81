"""Grouped weight gradient accumulated in fp32: ``out[g] += a_g^T @ b_g`` in one Triton kernel.

Why: Megatron's DDP keeps an fp32 ``main_grad`` per parameter and, unless the layer accumulates
into it itself (``gradient_accumulation_fusion``, TE's and apex's linear layers), adds the
parameter's bf16 ``.grad`` into it after every backward. For the experts of a Qwen3-30B-A3B layer
(128 x 3 x 2048 x 768 weights) that add reads 1.2 GB of bf16 gradient and reads and writes
2.4 GB of fp32, on top of the grouped GEMMs writing the 1.2 GB bf16 gradient, at every keep
ratio. Accumulating in the GEMM's epilogue moves only the fp32 read and write, and skips the
rounding of each micro-batch's gradient to bf16 (the same numerics as TE's fused path).

Shape legend: R rows (pairs) grouped by expert, ``offs[g]`` the end row of group ``g``
(``cumsum`` of the group sizes, as ``torch.nn.functional.grouped_mm`` takes it); ``a`` is
``[R, M]``, ``b`` is ``[R, N]``, ``out`` is ``[G, M, N]``.

A ``[BLOCK_M, BLOCK_N]`` tile of one group is computed by looping over the group's rows in
``BLOCK_K`` steps (:func:`_wgrad_tile`); empty groups leave ``out[g]`` untouched, not read
nor written (``accumulate``: a layer's ``main_grad`` slice of an expert without rows costs no
memory traffic), or zero it. Added into an fp32 ``out`` (``main_grad``), the tiles
:func:`config_for` picks use fire-and-forget atomics (``WgradConfig.atomic_epilogue``): a
load-add-store epilogue waits for ``out``'s read after the main loop, which no tile shape, TMA
load or register prefetch hid on an H200 (docs/history/notebook.md sections 10-11, 24). The grid has
one program per tile, or (``programs_per_sm``) is persistent: a few programs per SM stride over
all tiles.
:func:`grouped_wgrad_reference` is the slow twin (one fp32 matmul per group).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from megatron_lrmoe.experts.grouped_gemm import Counts, GroupSizes
from megatron_lrmoe.triton_common import cdiv, device_ctx, jit_kernels, use_triton

tl: Any = None  # bound to triton.language on first use (see triton_common.py)

__all__ = [
    "MainGrads",
    "WgradConfig",
    "accumulate_grouped_wgrad",
    "config_for",
    "grouped_wgrad_reference",
    "grouped_wgrad_triton",
]


@dataclass(frozen=True)
class WgradConfig:
    """Tile shape and launch parameters of the kernel.

    The defaults (128 x 128 x 32, 4 warps, 4 stages, load-add-store epilogue) were the fastest
    tile with the load-add-store epilogue at 128-1024 rows per expert; :func:`config_for` picks
    :data:`SMALL_GROUP_CONFIG` or :data:`LARGE_GROUP_CONFIG` (``benchmarks/wgrad_bench.py``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 4
    # 0: one program per tile; n > 0: a persistent grid of n programs per SM striding over
    # the tiles (_wgrad_persistent_kernel).
    programs_per_sm: int = 0
    # Accumulating into an fp32 ``out``: add the tile with fire-and-forget atomics (the add
    # happens in L2; the program does not wait for ``out``'s read) instead of load, add, store.
    # Each element gets one add per launch, so the result is the same, deterministic, except
    # that the GPU's fp32 atomic add flushes subnormal operands and results (below 1.2e-38 in
    # magnitude) to zero.
    atomic_epilogue: bool = False


DEFAULT_CONFIG = WgradConfig()
# The tiles config_for picks, both with the atomic epilogue (benchmarks/wgrad_bench.py on an
# H200, gpu_run26; ms, this tile against the load-add-store tiles used before it, fc1 / fc2):
# below LARGE_GROUP_ROWS rows per group a 64 x 128 tile (256 rows: 1.208 / 0.611 against
# 1.288 / 0.674 for DEFAULT_CONFIG); from there 128 x 256 x 64 on 8 warps, one program per tile
# (1024 rows: 1.963 / 1.053 against 2.174 / 1.090; 2048 rows: 3.427 / 1.693 against
# 3.759 / 1.950 for the persistent large tile used from 1536 rows before), with 4 stages
# (call 7, two runs: 1024 rows 1.887 / 0.935 and 1.860 / 0.918 against 3 stages' 2.003 / 1.085
# and 1.971 / 1.082; 2048 rows 3.136 / 1.623 and 3.281 / 1.647 against 3.276 / 1.675 and
# 3.413 / 1.665). Holding the fp32 tile of `main_grad` for the load-add-store epilogue left its
# read exposed after the main loop (sections 10-11 of docs/history/notebook.md); with atomics the
# program moves on and L2 does the add.
# The large tile from 512 rows per group (768 before): with evenly sized groups the 64 x 128
# tile is 3-4 % ahead at 512 rows, but a trained router's groups are not even, and there the
# small tile loses 21-27 % on fc1 and the large one 10-11 % (wgrad_bench --skew, gpu_run27
# call 3: fc1 at 512 rows and group sizes of CV 1 / 2, 1.608 / 1.691 ms against 1.526 / 1.539).
# In training (Qwen3 proxy, keep 0.5, 16384 tokens; call 4) the weight gradients took 8.65
# against 10.09 ms per iteration over four layers, the same losses.
SMALL_GROUP_CONFIG = WgradConfig(
    block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=4, atomic_epilogue=True
)
LARGE_GROUP_CONFIG = WgradConfig(
    block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, atomic_epilogue=True
)
LARGE_GROUP_ROWS = 512


def config_for(rows: int, groups: int) -> WgradConfig:
    """The tile for ``rows`` rows over ``groups`` groups (host integers: no sync)."""
    return LARGE_GROUP_CONFIG if rows >= LARGE_GROUP_ROWS * max(groups, 1) else SMALL_GROUP_CONFIG


def _wgrad_tile(
    out_ptr,
    a_ptr,
    b_ptr,
    offs_ptr,
    g,
    pm,
    pn,
    M,
    N,
    stride_a,
    stride_b,
    ACCUMULATE: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tile ``(pm, pn)`` of group ``g``: the loop over the group's rows, then the epilogue."""
    end = tl.load(offs_ptr + g).to(tl.int64)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(start, end, BLOCK_K):
        rows = k + rk
        mask_k = rows < end
        # a^T tile [BLOCK_M, BLOCK_K]: column r of it is row r of a (contiguous along M).
        a = tl.load(
            a_ptr + rows[None, :] * stride_a + rm[:, None],
            mask=mask_k[None, :] & mask_m[:, None],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rows[:, None] * stride_b + rn[None, :],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        if UPCAST:  # Triton's interpreter multiplies bf16 tiles wrongly; fp32 there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    dst = g.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        # An empty group adds nothing: its tile of ``out`` is neither read nor written.
        if end > start:
            if ATOMIC:  # into fp32 (the host checks): the add happens in L2
                tl.atomic_add(out_ptr + dst, acc, mask=mask, sem="relaxed")
            else:
                acc += tl.load(out_ptr + dst, mask=mask, other=0.0)
                tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _wgrad_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    offs_ptr,
    M,
    N,
    stride_a,
    stride_b,
    ACCUMULATE: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per tile: grid ``(tiles per group, groups)``."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    _wgrad_tile(
        out_ptr, a_ptr, b_ptr, offs_ptr, tl.program_id(1), pid // tiles_n, pid % tiles_n,
        M, N, stride_a, stride_b, ACCUMULATE, ATOMIC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


def _wgrad_persistent_kernel(
    out_ptr,
    a_ptr,
    b_ptr,
    offs_ptr,
    G,
    M,
    N,
    stride_a,
    stride_b,
    ACCUMULATE: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    """``NUM_PROGRAMS`` programs stride over all tiles, a group's tiles next to each other (the
    programs working at one time share the group's rows in L2)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), G * per_group, NUM_PROGRAMS):
        g = tile // per_group
        t = tile % per_group
        _wgrad_tile(
            out_ptr, a_ptr, b_ptr, offs_ptr, g, t // tiles_n, t % tiles_n,
            M, N, stride_a, stride_b, ACCUMULATE, ATOMIC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """``(kernel, persistent kernel, interpreted)``, jitted once on first launch (the kernels
    call the jitted ``_wgrad_tile``)."""
    jitted = jit_kernels(
        globals(),
        ("_wgrad_tile",),
        {"kernel": _wgrad_kernel, "persistent": _wgrad_persistent_kernel},
        "grouped weight gradient",
    )
    return jitted.kernel, jitted.persistent, jitted.interpreted


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 on the host, where the interpreter runs)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(a: torch.Tensor, b: torch.Tensor, num_groups: int, out: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped wgrad: a {tuple(a.shape)} and b {tuple(b.shape)} need [R, *]")
    if out.dim() != 3 or out.shape[1:] != (a.shape[1], b.shape[1]):
        raise ValueError(
            f"grouped wgrad: out {tuple(out.shape)} must be [G, {a.shape[1]}, {b.shape[1]}]"
        )
    if num_groups != out.shape[0]:
        raise ValueError(f"grouped wgrad: {num_groups} groups for out {tuple(out.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"grouped wgrad: operand dtypes differ ({a.dtype}, {b.dtype})")


def grouped_wgrad_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    *,
    accumulate: bool = True,
    config: WgradConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``out[g] (+)= a_g^T @ b_g`` with fp32 accumulation, one launch, no host sync.

    Args:
        a: ``[R, M]`` rows grouped by ``offs`` (unit column stride).
        b: ``[R, N]`` rows grouped the same way, ``a``'s dtype.
        offs: ``[G]`` int32/int64 on ``a``'s device: end row of each group (non-decreasing,
            ``offs[-1] == R``; not checked, that would need a sync).
        out: ``[G, M, N]`` contiguous (e.g. a parameter's fp32 ``main_grad``), written in place.
        accumulate: Add to ``out`` (else overwrite it).
        config: Tile shape.

    Returns:
        ``out``.
    """
    if offs.dim() != 1:
        raise ValueError(f"grouped wgrad: offs must be [G], got {tuple(offs.shape)}")
    _check(a, b, offs.numel(), out)
    if not out.is_contiguous():
        raise ValueError("grouped wgrad: out must be contiguous")
    if a.stride(1) != 1:
        a = a.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    groups, m, n = out.shape
    if groups == 0 or m == 0 or n == 0:
        return out
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    kernel, persistent, interpreted = _kernel()
    if not out.is_cuda and not interpreted:
        raise ValueError(
            "grouped wgrad: host tensors need TRITON_INTERPRET=1 set before triton is imported"
        )
    tiles_and_launch = dict(
        ACCUMULATE=accumulate,
        ATOMIC=config.atomic_epilogue and accumulate and out.dtype == torch.float32,
        UPCAST=interpreted,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    with device_ctx(out):
        if config.programs_per_sm <= 0:
            kernel[(tiles, groups)](
                out, a, b, offs, m, n, a.stride(0), b.stride(0), **tiles_and_launch
            )
        else:
            programs = min(tiles * groups, config.programs_per_sm * _num_sms(out.device))
            persistent[(programs,)](
                out, a, b, offs, groups, m, n, a.stride(0), b.stride(0),
                NUM_PROGRAMS=programs,
                **tiles_and_launch,
            )  # fmt: skip
    return out


_TRITON_DTYPES = (torch.bfloat16, torch.float16)


class MainGrads(NamedTuple):
    """Where the expert weight gradients go when the GEMMs write them (fused accumulation).

    Megatron's protocol for fused layers, as its own and TE's linear layers follow it: the
    gradient is added to the weight's ``main_grad`` (DDP's grad buffer), or written over it
    where the weight has ``overwrite_main_grad`` set (Megatron-FSDP, whose buffer is fetched
    per backward through ``get_main_grad`` and holds whatever was there before).
    """

    fc1: torch.Tensor  # [G, F1, H]: the fc1 weight's main_grad
    fc2: torch.Tensor  # [G, H, F]: the fc2 weight's
    accumulate: bool = True  # add to what is there; False: overwrite it
    fixed: bool = True  # the same buffers every call, so a captured graph may write them


def accumulate_grouped_wgrad(
    a: torch.Tensor, b: torch.Tensor, counts: Counts, out: torch.Tensor, accumulate: bool = True
) -> torch.Tensor:
    """``out[g] += a_g^T @ b_g`` (``accumulate``, else ``out[g] = ...``) for rows grouped by
    ``counts``, summed in fp32.

    The Triton kernel on CUDA for bf16/fp16 operands (``KernelOptions.triton`` on); otherwise
    :func:`grouped_wgrad_reference` (fp32 operands included: the kernel's fp32 dot would run in
    TF32).

    Args:
        a: ``[R, M]`` rows grouped by expert (e.g. the fc1 output gradient).
        b: ``[R, N]`` rows grouped the same way (e.g. the fc1 input).
        counts: Rows per group, ``G`` entries summing to ``R``.
        out: ``[G, M, N]`` contiguous accumulator, typically a parameter's ``main_grad``.
        accumulate: Add to ``out``; ``False`` overwrites it (never reads it: groups without
            rows get zeros).

    Returns:
        ``out``.
    """
    groups = counts if isinstance(counts, GroupSizes) else GroupSizes(counts)
    _check(a, b, groups.num_groups, out)
    if use_triton(a, b, out) and a.dtype in _TRITON_DTYPES and out.is_contiguous():
        config = config_for(a.shape[0], groups.num_groups)
        offs = groups.offsets(a.device)
        return grouped_wgrad_triton(a, b, offs, out, accumulate=accumulate, config=config)
    return grouped_wgrad_reference(a, b, groups.host_sizes(), out, accumulate=accumulate)


def grouped_wgrad_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    sizes: list[int],
    out: torch.Tensor,
    *,
    accumulate: bool = True,
) -> torch.Tensor:
    """The slow twin of :func:`grouped_wgrad_triton`: one fp32 matmul per group (an empty
    group leaves ``out[g]`` untouched when accumulating, as the kernel does)."""
    start = 0
    for g, size in enumerate(sizes):
        if accumulate and size == 0:
            continue
        part = a[start : start + size].float().t() @ b[start : start + size].float()
        if accumulate:
            out[g] += part.to(out.dtype)
        else:
            out[g] = part.to(out.dtype)
        start += size
    return out
