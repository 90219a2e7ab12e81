"""A cap on each process's GPU memory, so that one H200 behaves as a smaller GPU in comparisons.

``--memory-cap-gib X`` (``pretrain_lrmoe.py``; ``MEMORY_CAP_GIB`` in ``examples/`` and
``benchmarks/``) limits PyTorch's caching allocator on this process's GPU to ``X`` GiB with
``torch.cuda.set_per_process_memory_fraction``: an allocation beyond it raises the usual
out-of-memory error, as on a card of that size. What the allocator does not manage (the CUDA
context, NCCL's and cuBLAS's workspaces) is outside the cap, as it is outside the usable memory
of a real card, so a cap of 78 GiB stands for an 80 GB card (79.1 GiB in all, about 1 GiB of it
taken before the allocator's first byte) and 38 GiB for a 40 GB one.

That last assumption does not hold for a large model: on a real H100 80GB (gpu_run34 call 10)
the memory_bound proxy's process held 3.6 GiB outside the allocator (CUDA context, NCCL, cuBLAS
and Triton modules) when LRMoE's keep-0.5 ``recompute`` arm ran out of memory with 69.6 GiB
allocated and 6.0 GiB reserved: a run that fits an H200 under a 78 GiB cap (75.3 GiB peak) does
not fit the card it stands for. ``--gpu-memory-gib X`` (``GPU_MEMORY_GIB``) emulates the card
instead: the process holds ``total - X`` GiB of the device outside PyTorch's allocator, in one
driver allocation made at start (:func:`apply_gpu_memory`), so that everything it uses (the
allocator's pool, the context, NCCL's and cuBLAS's workspaces) counts against X, as on the real
card. X is the card's memory as torch reports it (``total_memory``: 79.18 GiB for an H100 80GB
HBM3). One process per GPU: several processes on one GPU would each hold their own share.

The cap is printed once per process in the log (:func:`describe`), so every result can say
under which cap it ran; the training log's ``--moe-layer-timing`` line adds the peak allocated
memory (``max allocated``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = [
    "GIB",
    "GpuMemory",
    "MemoryCap",
    "apply_gpu_memory",
    "apply_memory_cap",
    "describe",
    "describe_gpu_memory",
    "plan_gpu_memory",
    "plan_memory_cap",
]

GIB = 1 << 30


def _check_size(flag: str, gib: float, total_bytes: int, device: int, hint: str) -> None:
    """A positive finite size in GiB that the device can hold, or a ValueError naming ``flag``."""
    if not isinstance(gib, (int, float)) or not gib > 0 or gib == float("inf"):
        raise ValueError(f"{flag} ({gib!r}) must be a positive number of GiB, {hint}")
    if gib * GIB > total_bytes:
        raise ValueError(
            f"{flag} ({gib}) exceeds the memory of cuda:{device} ({total_bytes / GIB:.2f} GiB); "
            "give a smaller size or leave it out"
        )


def _local_device(flag: str, gib: float, device: Optional[int]) -> tuple[int, int]:
    """``device`` (default: ``LOCAL_RANK``, as torchrun sets it) and its memory in bytes."""
    import os

    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{flag} ({gib}) needs a CUDA device; leave it out on the CPU")
    if device is None:
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return device, torch.cuda.get_device_properties(device).total_memory


@dataclass(frozen=True)
class MemoryCap:
    """A cap as applied to one device.

    Attributes:
        cap_gib: The cap asked for, GiB.
        device: The CUDA device index it applies to.
        total_gib: The device's memory, GiB (``torch.cuda.get_device_properties``).
        fraction: ``cap_gib / total_gib``, what PyTorch's allocator is given.
    """

    cap_gib: float
    device: int
    total_gib: float
    fraction: float


def plan_memory_cap(cap_gib: float, total_bytes: int, device: int = 0) -> MemoryCap:
    """The fraction of a device of ``total_bytes`` that a cap of ``cap_gib`` GiB is.

    Raises:
        ValueError: The cap is not a positive finite number or exceeds the device's memory.
    """
    _check_size("--memory-cap-gib", cap_gib, total_bytes, device, "e.g. 78 for an 80 GB card")
    total_gib = total_bytes / GIB
    return MemoryCap(
        cap_gib=float(cap_gib), device=device, total_gib=total_gib, fraction=cap_gib / total_gib
    )


def describe(cap: Optional[MemoryCap]) -> str:
    """One log line: the cap and what it is of the device (``no cap`` without one)."""
    if cap is None:
        return "memory cap: none"
    return (
        f"memory cap: {cap.cap_gib:.1f} GiB on cuda:{cap.device} (fraction {cap.fraction:.4f} "
        f"of {cap.total_gib:.1f} GiB)"
    )


def apply_memory_cap(cap_gib: Optional[float], device: Optional[int] = None) -> Optional[MemoryCap]:
    """Cap the caching allocator of ``device`` (default: ``LOCAL_RANK``, as torchrun sets it).

    Does nothing and returns ``None`` when ``cap_gib`` is ``None``.

    Raises:
        ValueError: A cap without CUDA, or one that :func:`plan_memory_cap` refuses.
    """
    if cap_gib is None:
        return None
    import torch

    device, total = _local_device("--memory-cap-gib", cap_gib, device)
    cap = plan_memory_cap(cap_gib, total, device)
    torch.cuda.set_per_process_memory_fraction(cap.fraction, device)
    logger.info("%s", describe(cap))
    return cap


# -- a smaller card emulated whole: the rest of the device held outside the allocator ---------


@dataclass(frozen=True)
class GpuMemory:
    """A smaller card emulated on one device.

    Attributes:
        card_gib: The emulated card's memory, GiB.
        device: The CUDA device index.
        total_gib: The device's memory, GiB.
        held_bytes: What the process holds outside PyTorch's allocator, ``total - card``.
    """

    card_gib: float
    device: int
    total_gib: float
    held_bytes: int


# Driver allocations made by apply_gpu_memory, by device: held until the process ends.
_HELD: dict[int, int] = {}


def plan_gpu_memory(card_gib: float, total_bytes: int, device: int = 0) -> GpuMemory:
    """What emulating a card of ``card_gib`` GiB on a device of ``total_bytes`` holds back.

    Raises:
        ValueError: The size is not a positive finite number or exceeds the device's memory.
    """
    # A card given to two decimals may round above the very card it names (79.18 on an H100):
    # within 0.01 GiB of the device it is the device itself.
    if isinstance(card_gib, (int, float)) and 0 < card_gib * GIB - total_bytes <= 0.01 * GIB:
        card_gib = total_bytes / GIB
    _check_size(
        "--gpu-memory-gib", card_gib, total_bytes, device,
        "the emulated card's memory as torch reports it (79.18 for an H100 80GB)",
    )  # fmt: skip
    return GpuMemory(
        card_gib=float(card_gib),
        device=device,
        total_gib=total_bytes / GIB,
        held_bytes=total_bytes - int(card_gib * GIB),
    )


def describe_gpu_memory(card: Optional[GpuMemory]) -> str:
    """One log line: the emulated card and what is held back (``none`` without one)."""
    if card is None:
        return "gpu memory: the device's own"
    return (
        f"gpu memory: {card.card_gib:.2f} GiB card emulated on cuda:{card.device} "
        f"({card.total_gib:.2f} GiB; {card.held_bytes / GIB:.2f} GiB held outside PyTorch)"
    )


def _driver_alloc(nbytes: int, device: int) -> int:
    """``cuMemAlloc`` of ``nbytes`` in the device's primary context (PyTorch's), outside
    PyTorch's allocator and its statistics. Returns the device pointer."""
    import ctypes

    import torch

    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)  # the primary context exists and is current on this thread
    driver = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64(0)
    status = driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes))
    if status != 0:
        free, _ = torch.cuda.mem_get_info(device)
        raise ValueError(
            f"--gpu-memory-gib: could not hold {nbytes / GIB:.2f} GiB of cuda:{device} outside "
            f"PyTorch (CUDA driver error {status}; {free / GIB:.2f} GiB free): another process "
            "uses the GPU, or the card asked for is too small for what this process already holds"
        )
    return int(pointer.value)


def apply_gpu_memory(card_gib: Optional[float], device: Optional[int] = None) -> Optional[GpuMemory]:
    """Emulate a card of ``card_gib`` GiB on ``device`` (default: ``LOCAL_RANK``): hold the rest
    of the device outside PyTorch's allocator until the process ends.

    Does nothing and returns ``None`` when ``card_gib`` is ``None``.

    Raises:
        ValueError: No CUDA, a size :func:`plan_gpu_memory` refuses, or a device that cannot
            give the memory held back.
    """
    if card_gib is None:
        return None
    device, total = _local_device("--gpu-memory-gib", card_gib, device)
    card = plan_gpu_memory(card_gib, total, device)
    if device in _HELD:
        raise ValueError(f"--gpu-memory-gib: cuda:{device} already emulates a card in this process")
    if card.held_bytes > 0:
        _HELD[device] = _driver_alloc(card.held_bytes, device)
    logger.info("%s", describe_gpu_memory(card))
    return card
