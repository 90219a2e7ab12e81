"""Index plans that pack, reorder and scatter rows; no communication.

Shape legend: A x B chunk grids (e.g. P source ranks x L local experts); rows of chunk (a, b)
are contiguous. "a-major" means all chunks of a=0 first, then a=1, ...
"""

from __future__ import annotations

import numpy as np
import torch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without stalling the host.

    A copy from pageable host memory waits for the device stream to drain (the host blocks until
    the copy runs); from pinned memory it is queued like a kernel. Planning tensors are tiny, so
    pinning them costs microseconds and keeps the CPU ahead of the GPU.
    """
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCounts:
    """A small device tensor on its way to the host: the copy is queued, not waited for.

    The copy goes into pinned memory behind everything queued so far; :meth:`wait` blocks only
    until the copy itself is done, not until work queued after it is (a plain ``.cpu()`` would
    also wait at once, before the caller could queue anything else).
    """

    def __init__(self, t: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if t.device.type == "cpu":
            self._host = t
            return
        self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._host.copy_(t, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """``[n] -> [n]``: start offset of each chunk."""
    return torch.cumsum(counts, 0) - counts


def chunk_transpose_index(counts: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Gather index that reorders rows from a-major to b-major chunk order.

    Args:
        counts: ``[A, B]`` int64 on the host, rows per chunk in the a-major source layout.
        device: Where the index is needed.

    Returns:
        ``idx`` of length ``counts.sum()`` with ``b_major = a_major[idx]``. Rows keep their order
        inside a chunk. Invariant: ``idx`` is a permutation.
    """
    # The chunk offsets in numpy: this runs for the count grids of every layer call (forward
    # and backward), where a torch CPU op on a tiny tensor costs several times a numpy one.
    c = _host_int64(counts)
    total = int(c.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    counts_t = np.ascontiguousarray(c.T).reshape(-1)  # b-major chunk sizes
    src_start = exclusive_cumsum_np(c.reshape(-1)).reshape(c.shape)  # a-major offsets
    # Per chunk in b-major order: shift = where its rows live in the a-major layout minus where
    # they land; repeated per row it turns the row numbers into the index.
    shift = src_start.T.reshape(-1) - exclusive_cumsum_np(counts_t)
    per_row_shift = repeat_per_row(shift, counts_t, total, device)
    return per_row_shift.add_(torch.arange(total, device=device))


def repeat_per_row(
    values: np.ndarray, counts: np.ndarray, total: int, device: torch.device | str
) -> torch.Tensor:
    """``[total]`` int64 on ``device``: host ``values[k]`` repeated ``counts[k]`` times
    (``total = counts.sum()``): one host-to-device copy of both, one ``repeat_interleave``."""
    value, count = host_to_device(torch.from_numpy(np.stack([values, counts])), device).unbind(0)
    return torch.repeat_interleave(value, count, output_size=total)


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[index[i]] = i`` for a permutation ``index``: e.g. the
    :func:`chunk_transpose_index` of a grid's transpose from the grid's own (two device ops,
    no host copy)."""
    positions = torch.arange(index.numel(), dtype=index.dtype, device=index.device)
    # index_copy_, not scatter_: deterministic on CUDA under torch.use_deterministic_algorithms.
    return torch.empty_like(index).index_copy_(0, index, positions)


def exclusive_cumsum_np(counts: np.ndarray) -> np.ndarray:
    """:func:`exclusive_cumsum` of a host ``[n]`` int64 array."""
    return np.cumsum(counts) - counts


def _host_int64(counts: torch.Tensor) -> np.ndarray:
    """The values of host ``counts`` as int64 numpy (a view where they are int64 already)."""
    if counts.dtype != torch.int64:
        counts = counts.to(torch.int64)
    # NOTE: device-to-host sync if counts are on a device; callers pass host plans.
    return (counts if counts.device.type == "cpu" else counts.cpu()).numpy()


def chunk_gather_index(
    starts: torch.Tensor, sizes: torch.Tensor, device: torch.device | str
) -> torch.Tensor:
    """Gather index that lays chunks of a source layout out one after another.

    Args:
        starts: ``[C]`` int64 on the host, where each chunk starts in the source layout.
        sizes: ``[C]`` int64 on the host, rows per chunk; the chunks must not overlap.
        device: Where the index is needed.

    Returns:
        ``idx`` of length ``sizes.sum()`` with ``out = src[idx]`` holding chunk 0's rows, then
        chunk 1's, ...; rows keep their order inside a chunk. When the chunks tile the source,
        ``idx`` is a permutation. :func:`chunk_transpose_index` is the grid special case.
    """
    starts = starts.to(torch.int64).reshape(-1).cpu()
    sizes = sizes.to(torch.int64).reshape(-1).cpu()
    total = int(sizes.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    shift_and_count = host_to_device(torch.stack([starts - exclusive_cumsum(sizes), sizes]), device)
    per_row_shift = torch.repeat_interleave(
        shift_and_count[0], shift_and_count[1], output_size=total
    )
    return torch.arange(total, device=device) + per_row_shift


def row_chunk_ids(counts: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``[n] -> [sum]``: chunk id of every row, for chunks laid out in order."""
    counts = counts.to(torch.int64).reshape(-1).cpu()
    total = int(counts.sum())
    ids = torch.arange(counts.numel(), device=device)
    return torch.repeat_interleave(ids, host_to_device(counts, device), output_size=total)


def kept_position_shift(global_counts: np.ndarray, rank: int, num_local: int) -> np.ndarray:
    """``[E]`` per expert: where source ``rank``'s rows of that expert start in its owner's
    expert-order rows, minus where they start in the source's send order.

    Expert ``e = d * L + l`` is the ``l``-th local expert of rank ``d``; a rank's send order is
    expert-major (``global_counts[rank]`` rows per expert), an owner's expert order is
    ``[local expert][source rank]`` (the chunk grid ``global_counts[:, d*L:(d+1)*L]``, b-major).
    A kept pair at send position ``i`` of expert ``e`` is then row ``i + shift[e]`` of the rows
    its owner saved: the source names the row and the owner adds nothing.

    Args:
        global_counts: ``[P, E]`` int64 forward pairs per (source rank, expert), the plan's.
        rank: The source rank.
        num_local: L, experts per rank.
    """
    p = global_counts.shape[0]
    # [owner d, local expert l * P + source r]: each owner's expert-order chunk sizes.
    by_owner = global_counts.reshape(p, p, num_local).transpose(1, 2, 0).reshape(p, -1)
    chunk_start = (np.cumsum(by_owner, axis=1) - by_owner).reshape(p, num_local, p)
    send_start = exclusive_cumsum_np(global_counts[rank])
    return chunk_start[:, :, rank].reshape(-1) - send_start
