"""A cap on each process's GPU memory, so that one H200 behaves as a smaller GPU in comparisons.

``--memory-cap-gib X`` (``pretrain_lrmoe.py``; ``MEMORY_CAP_GIB`` in ``examples/`` and
``benchmarks/``) limits PyTorch's caching allocator on this process's GPU to ``X`` GiB with
``torch.cuda.set_per_process_memory_fraction``: an allocation beyond it raises the usual
out-of-memory error, as on a card of that size. What the allocator does not manage (the CUDA
context, NCCL's and cuBLAS's workspaces) is outside the cap, as it is outside the usable memory
of a real card, so a cap of 78 GiB stands for an 80 GB card (79.1 GiB in all, about 1 GiB of it
taken before the allocator's first byte) and 38 GiB for a 40 GB one.

The cap is printed once per process in the log (:func:`describe`), so every result can say
under which cap it ran; the training log's ``--moe-layer-timing`` line adds the peak allocated
memory (``max allocated``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["GIB", "MemoryCap", "apply_memory_cap", "describe", "plan_memory_cap"]

GIB = 1 << 30


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
    if not isinstance(cap_gib, (int, float)) or not cap_gib > 0 or cap_gib == float("inf"):
        raise ValueError(
            f"--memory-cap-gib ({cap_gib!r}) must be a positive number of GiB, e.g. 78 for an "
            "80 GB card"
        )
    total_gib = total_bytes / GIB
    if cap_gib > total_gib:
        raise ValueError(
            f"--memory-cap-gib ({cap_gib}) exceeds the memory of cuda:{device} "
            f"({total_gib:.1f} GiB); give a smaller cap or leave it out"
        )
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
    import os

    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"--memory-cap-gib ({cap_gib}) needs a CUDA device; leave it out on the CPU"
        )
    if device is None:
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = plan_memory_cap(cap_gib, total, device)
    torch.cuda.set_per_process_memory_fraction(cap.fraction, device)
    logger.info("%s", describe(cap))
    return cap
