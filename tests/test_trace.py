"""Routing traces (megatron_lrmoe/observe/trace.py) and their recorder (training/trace.py), CPU.

Round trips through the on-disk format (chunked, compressed, versioned), the checks a reader
makes, and the recorder's listener on stand-in layers. The recorder on real layers over gloo is
in tests/test_replay.py (the replay at P = 2 against the layer's own statistics).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_lrmoe.observe.stats import CallStats
from megatron_lrmoe.observe.trace import (
    TRACE_VERSION,
    TraceWriter,
    read_trace,
    rank_directory,
    write_trace,
)
from megatron_lrmoe.training.trace import TraceRecorder


def _counts(calls: int, p: int, e: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=(calls, p, e)).astype(np.int64)


def test_round_trip_over_chunks(tmp_path) -> None:
    counts = _counts(7, 4, 8)
    writer = TraceWriter(tmp_path, 3, 4, 8, meta={"topk": 2}, chunk_calls=3)
    for i, c in enumerate(counts):
        writer.append(layer=1 + i % 2, call=i // 2, step=10 + i // 2, counts=torch.from_numpy(c))
    writer.close()
    assert sorted(p.name for p in rank_directory(tmp_path, 3).iterdir()) == [
        "chunk000000.npz",
        "chunk000001.npz",
        "chunk000002.npz",
        "meta.json",
    ]
    trace = read_trace(tmp_path)
    assert trace.meta["rank"] == 3 and trace.meta["topk"] == 2
    assert trace.meta["version"] == TRACE_VERSION and trace.ep_size == 4
    assert trace.counts.dtype == np.int32 and np.array_equal(trace.counts, counts)
    assert trace.layer.tolist() == [1, 2, 1, 2, 1, 2, 1]
    assert trace.call.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert trace.step.tolist() == [10, 10, 11, 11, 12, 12, 13]
    passes = list(trace.passes())
    assert [k for k, _, _ in passes] == [0, 1, 2, 3]
    k, layers, c = passes[1]
    assert layers.tolist() == [1, 2] and np.array_equal(c, counts[2:4])
    assert trace.layers == [1, 2]


def test_passes_sort_layers_and_write_trace_checks(tmp_path) -> None:
    counts = _counts(4, 2, 4)
    write_trace(tmp_path, counts, layers=[2, 1, 1, 2], calls=[0, 0, 1, 1])
    (_, layers0, c0), (_, layers1, c1) = read_trace(tmp_path, rank=0).passes()
    assert layers0.tolist() == [1, 2] and np.array_equal(c0, counts[[1, 0]])
    assert layers1.tolist() == [1, 2] and np.array_equal(c1, counts[[2, 3]])
    with pytest.raises(ValueError, match="4 calls of counts but 3 layers"):
        write_trace(tmp_path / "b", counts, layers=[1, 2, 3], calls=[0, 0, 1, 1])


def test_reader_refusals(tmp_path) -> None:
    with pytest.raises(ValueError, match="no routing trace"):
        read_trace(tmp_path)
    path = write_trace(tmp_path, _counts(1, 2, 4), [1], [0])
    with pytest.raises(ValueError, match="already holds a routing trace"):
        TraceWriter(tmp_path, 0, 2, 4)
    with pytest.raises(ValueError, match="no trace of rank 5"):
        read_trace(tmp_path, rank=5)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "version": TRACE_VERSION + 1}))
    with pytest.raises(ValueError, match="this reader knows up to"):
        read_trace(tmp_path)
    (path / "meta.json").write_text(json.dumps({**meta, "num_experts": 8}))
    with pytest.raises(ValueError, match="meta.json says"):
        read_trace(tmp_path)
    writer = TraceWriter(tmp_path / "w", 0, 2, 4)
    with pytest.raises(ValueError, match=r"records \[P, E\] = \[2, 4\]"):
        writer.append(1, 0, -1, np.zeros((2, 8)))


def test_empty_trace_reads_as_zero_calls(tmp_path) -> None:
    TraceWriter(tmp_path, 0, 2, 4).close()
    trace = read_trace(tmp_path)
    assert trace.counts.shape == (0, 2, 4) and list(trace.passes()) == []


class _Layer:
    """Stands in for an LRMoELayer: what the recorder reads of one."""

    def __init__(self, number: int, ep_size: int = 2, experts: int = 4) -> None:
        self.layer_number = number
        self.token_dispatcher = SimpleNamespace(ep_size=ep_size, ep_rank=0)
        self.config = SimpleNamespace(
            num_moe_experts=experts,
            moe_router_topk=2,
            hidden_size=16,
            moe_ffn_hidden_size=8,
            ffn_hidden_size=32,
            gated_linear_unit=True,
            bf16=True,
            params_dtype=torch.bfloat16,
        )
        self.listeners: dict[int, object] = {}

    def add_stats_listener(self, fn):
        self.listeners[id(fn)] = fn
        listeners = self.listeners
        return SimpleNamespace(remove=lambda: listeners.pop(id(fn), None))

    def call(self, index: int, counts: np.ndarray) -> None:
        stats = CallStats(
            layer_number=self.layer_number,
            call_index=index,
            total_pairs=int(counts.sum()),
            pairs_sent=0,
            quota_per_expert=[],
            tokens_per_expert=[],
            global_counts=torch.from_numpy(counts),
        )
        for fn in list(self.listeners.values()):
            fn(self.layer_number, stats)


def test_recorder_on_stand_in_layers(tmp_path) -> None:
    layers = [_Layer(1), _Layer(2)]
    recorder = TraceRecorder(layers, tmp_path, rank=0, every=2, chunk_calls=2)
    counts = _counts(4, 2, 4)
    for k in range(4):
        recorder.set_step(100 + k)
        for layer in layers:
            layer.call(k, counts[k] + layer.layer_number)
    recorder.close()
    recorder.close()  # idempotent
    assert all(not layer.listeners for layer in layers)
    trace = read_trace(tmp_path)
    assert trace.meta["hidden_size"] == 16 and trace.meta["ffn_hidden_size"] == 8
    assert trace.meta["gated"] is True and trace.meta["activation_bytes"] == 2
    assert trace.meta["layers"] == [1, 2] and trace.meta["every"] == 2
    assert trace.call.tolist() == [0, 0, 2, 2] and trace.step.tolist() == [100, 100, 102, 102]
    assert np.array_equal(trace.counts[1], counts[0] + 2)
    assert np.array_equal(trace.counts[2], counts[2] + 1)


def test_recorder_refuses_mixed_layers(tmp_path) -> None:
    with pytest.raises(ValueError, match="different"):
        TraceRecorder([_Layer(1), _Layer(2, ep_size=4)], tmp_path, rank=0)
    with pytest.raises(ValueError, match="no LRMoE layers"):
        TraceRecorder([], tmp_path, rank=0)


@pytest.mark.parametrize("compress", [False, True])
def test_background_writer_double_buffers(tmp_path, compress: bool) -> None:
    """Chunks written by the background thread while the other buffer fills: every call once,
    in order, whatever the chunk boundaries."""
    counts = _counts(11, 2, 4, seed=5)
    writer = TraceWriter(tmp_path, 0, 2, 4, chunk_calls=3, compress=compress, background=True)
    for i, c in enumerate(counts):
        writer.append(layer=1, call=i, step=-1, counts=c)
    writer.close()
    writer.close()
    assert writer.calls_written == 11
    trace = read_trace(tmp_path)
    assert np.array_equal(trace.counts, counts) and trace.call.tolist() == list(range(11))
