"""Capturing and caching the CUDA graphs the backward replays (the selection alone in
``select/select_triton.py``, the selection's front in ``graphs/front.py``; at EP 1 the front and
the expert half together, one graph per layer, in ``graphs/backward.py``).

A graph replaces the host's per-kernel launch work by one launch; what it reads and writes
must stay at the addresses it was captured with, so every user keeps those buffers on the
object that holds the graph, or makes their addresses part of the graph's key (a layer graph's
weights and ``main_grad``, which the caller holds whenever it replays).
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, TypeVar

import torch

__all__ = ["GraphCache", "capture"]

Entry = TypeVar("Entry")


def capture(
    launch: Callable[[], None], device: torch.device, pool: tuple | None = None
) -> torch.cuda.CUDAGraph:
    """Runs ``launch`` once eagerly and returns a graph of the same launches.

    The eager run (it does this call's work and warms the allocator's and Triton's caches) runs
    on the current stream, so what it frees goes back to the cache the caller allocates from (on
    the side stream it stayed reserved for that stream: 982 MiB at 4 layers of 128 experts and
    16384 tokens, docs/history/notebook.md section 18). The recording happens on a side stream ordered
    after it, which the current stream then waits for; no synchronisation (capture only
    records). ``pool`` is a memory pool shared with other graphs that are never replayed
    concurrently (``torch.cuda.graph_pool_handle()``), else the graph gets its own.

    The side stream is one per device (:func:`_side_stream`), the same for every capture. The
    caching allocator hands a freed block only to allocations on the stream it was freed on, in
    a graph's pool as outside it: with a new stream per capture (torch hands out 32 in turn),
    graphs sharing a pool could not reuse each other's memory. Measured on an H200
    (``benchmarks/graph_memory.py``, 16 layers): the layer graphs' pool held 247 MiB with one
    side stream against 3937 MiB with a stream per capture, and the process reserved 8324
    against 15706 MiB.
    """
    launch()
    current = torch.cuda.current_stream(device)
    side = _side_stream(torch.device(device))
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        # thread_local: other threads' CUDA calls (checkpoint writers, NCCL watchdogs) do not
        # invalidate this capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            launch()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream :func:`capture` records on, one per device."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


class GraphCache(Generic[Entry]):
    """Captured graphs by key, least recently used first out.

    A key is captured the second time it is seen (a one-off shape, e.g. a last, shorter
    micro-batch, never pays for a capture); at most ``capacity`` entries are kept.
    """

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.graphs: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        self.seen: collections.Counter[tuple] = collections.Counter()

    def lookup(self, key: tuple) -> tuple[Entry | None, bool]:
        """``(entry, capture_now)``: the captured entry of ``key`` if there is one, else
        whether this sighting should capture it (the second one)."""
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            return entry, False
        if len(self.seen) >= 1024:  # many one-off shapes (varying lengths): start over
            self.seen.clear()
        self.seen[key] += 1
        return None, self.seen[key] >= 2

    def add(self, key: tuple, entry: Entry) -> None:
        self.graphs[key] = entry
        if len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)

    def clear(self) -> None:
        """Drops every entry and sighting."""
        self.graphs.clear()
        self.seen.clear()
