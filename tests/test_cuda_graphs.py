"""``megatron_lrmoe/cuda_graphs.py`` on the host: which stream a capture runs and records on.

The captures themselves need CUDA (the graph tests in ``tests/test_layer.py`` and
``tests/test_select_kernels.py``); here torch's stream and graph types are stand-ins that record
what ``capture`` asks of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from megatron_lrmoe import cuda_graphs


def test_captures_record_on_one_side_stream_and_warm_up_on_the_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Captures record on one side stream per device (the allocator reuses a freed block only
    on the stream it was freed on, so graphs captured on different streams would not share
    their pool's memory); each eager warm-up runs on the current stream, so what it frees goes
    back to the cache the caller allocates from."""
    made: list[torch.device] = []
    active: list[object] = []
    recorded_on: list[object] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            made.append(device)

        def wait_stream(self, other: object) -> None:
            pass

    class Graph:
        def capture_begin(self, pool: object = None, capture_error_mode: str = "") -> None:
            recorded_on.append(active[-1] if active else current)

        def capture_end(self) -> None:
            pass

    @contextlib.contextmanager
    def on(stream: object) -> Iterator[None]:
        active.append(stream)
        try:
            yield
        finally:
            active.pop()

    current = Stream(torch.device("cuda", 0))
    made.clear()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(cuda_graphs, "_SIDE_STREAMS", {})
    launched_on: list[object] = []
    for device in (0, 0, 1, 0, 1):
        cuda_graphs.capture(
            lambda: launched_on.append(active[-1] if active else current),
            torch.device("cuda", device),
        )
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert len(set(map(id, recorded_on))) == 2 and current not in recorded_on
    # each capture: the eager run on the current stream, then the recorded one on the side
    assert launched_on[0::2] == [current] * 5
    assert [id(s) for s in launched_on[1::2]] == [id(s) for s in recorded_on]
