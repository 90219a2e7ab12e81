"""``megatron_lrmoe/cuda_graphs.py`` on the host: which stream a capture runs and records on.

The captures themselves need CUDA (the graph tests in ``tests/test_layer.py`` and
``tests/test_select_kernels.py``); here torch's stream and graph types are stand-ins that record
what ``capture`` asks of them.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_lrmoe import cuda_graphs


def test_every_capture_runs_on_one_side_stream_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures share one side stream per device: the allocator keeps what an eager run frees
    for that stream only, so a stream per capture would keep a set per stream reserved."""
    made: list[torch.device] = []
    used: list[object] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            made.append(device)

        def wait_stream(self, other: object) -> None:
            pass

    class Graph:
        def capture_begin(self, pool: object = None, capture_error_mode: str = "") -> None:
            pass

        def capture_end(self) -> None:
            pass

    def on(stream: object) -> contextlib.AbstractContextManager:
        used.append(stream)
        return contextlib.nullcontext()

    current = Stream(torch.device("cuda", 0))
    made.clear()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(cuda_graphs, "_SIDE_STREAMS", {})
    runs: list[int] = []
    for device in (0, 0, 1, 0, 1):
        cuda_graphs.capture(lambda: runs.append(1), torch.device("cuda", device))
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert len(set(map(id, used))) == 2 and current not in used
    assert len(runs) == 10  # each capture: the eager run, then the recorded one
