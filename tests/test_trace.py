"""Routing traces (megatron_lrmoe/observe/trace.py) and their recorder (training/trace.py), CPU.

Round trips through the on-disk format (chunked, compressed, versioned), the checks a reader
makes, the recorder's listener on stand-in layers, and a run's trace read as one model: pipeline
stages merged in layer order, EP groups chosen or put side by side, the refusals when the
stages disagree. The recorder on real layers over gloo is in tests/test_replay.py (the replay at
P = 2 against the layer's own statistics; two pipeline stages against the unsplit model).
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
        self.layer_number = self.global_layer_number = number
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


# --- a run's trace: pipeline stages and EP groups ----------------------------------------------
def _stage(
    directory,
    rank: int,
    stage: int,
    layers: list[int],
    calls: list[int],
    counts: np.ndarray,
    stages: int = 2,
    ep_ranks: list[int] | None = None,
    steps: list[int] | None = None,
    **meta,
) -> None:
    """One recording rank's directory, as TraceRecorder writes it: every layer per call."""
    rows = [(k, layer) for k in calls for layer in layers]
    meta = dict(
        topk=2, layers=layers, every=1, pipeline_rank=stage, pipeline_size=stages,
        ep_ranks=ep_ranks if ep_ranks is not None else [rank, rank + 1], **meta
    )  # fmt: skip
    write_trace(
        directory, counts[: len(rows)], layers=[layer for _, layer in rows],
        calls=[k for k, _ in rows], rank=rank, meta=meta,
        steps=None if steps is None else [steps[calls.index(k)] for k, _ in rows],
    )  # fmt: skip


def test_pipeline_stages_merge_in_layer_order(tmp_path) -> None:
    """Stage 0 (layers 1, 2, rank 0) and stage 1 (layers 3, 4, rank 2), written in reverse
    layer order: one pass of four layers per call, sorted by (call, layer)."""
    a, b = _counts(6, 2, 4, seed=1), _counts(6, 2, 4, seed=2)
    _stage(tmp_path, 2, 1, [4, 3], [0, 1, 2], b, steps=[10, 11, 12])
    _stage(tmp_path, 0, 0, [2, 1], [0, 1, 2], a, steps=[10, 11, 12])
    trace = read_trace(tmp_path)
    assert trace.layers == [1, 2, 3, 4] and trace.ep_size == 2 and trace.num_experts == 4
    assert trace.layer.tolist() == [1, 2, 3, 4] * 3
    assert trace.call.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert trace.step.tolist() == [10] * 4 + [11] * 4 + [12] * 4
    assert trace.meta["layers"] == [1, 2, 3, 4] and trace.meta["ep_group"] == 0
    assert trace.meta["stages"] == [
        {"pipeline_rank": 0, "ranks": [0], "layers": [1, 2]},
        {"pipeline_rank": 1, "ranks": [2], "layers": [3, 4]},
    ]
    stage0, stage1 = read_trace(tmp_path, rank=0), read_trace(tmp_path, rank=2)
    merged = list(trace.passes())
    for (k, layers, c), (_, l0, c0), (_, l1, c1) in zip(merged, stage0.passes(), stage1.passes()):
        assert layers.tolist() == [*l0.tolist(), *l1.tolist()]
        assert np.array_equal(c, np.concatenate([c0, c1]))
    # calls k of stage 0 were written layer 2 then 1: a[2k + 1] is layer 1's counts
    assert np.array_equal(merged[1][2][0], a[3]) and np.array_equal(merged[1][2][3], b[2])


def test_ep_groups_one_or_side_by_side(tmp_path) -> None:
    """Two EP groups of two ranks per stage (DP 4 at EP 2, PP 2; world 8): ep_group picks
    one group of every stage, paired by rank order; 'all' puts the groups' sources side by
    side. A group recorded on every rank (all_ranks=True) reads from its lowest rank."""
    c = {r: _counts(2, 2, 4, seed=r) for r in range(8)}
    for rank, stage, ep in ((0, 0, [0, 1]), (2, 0, [2, 3]), (4, 1, [4, 5]), (6, 1, [6, 7])):
        _stage(tmp_path, rank, stage, [1 + stage], [0, 1], c[rank], ep_ranks=ep)
    _stage(tmp_path, 5, 1, [2], [0, 1], c[5], ep_ranks=[4, 5])  # rank 4's group, again
    group0, group1 = read_trace(tmp_path), read_trace(tmp_path, ep_group=1)
    assert [s["ranks"] for s in group0.meta["stages"]] == [[0], [4]]
    assert [s["ranks"] for s in group1.meta["stages"]] == [[2], [6]]
    assert np.array_equal(group1.counts, np.stack([c[2][0], c[6][0], c[2][1], c[6][1]]))
    both = read_trace(tmp_path, ep_group="all")
    assert both.ep_size == 4 and both.counts.shape == (4, 4, 4)
    assert both.meta["ep_group"] == "all" and both.meta["ep_groups_read"] == 2
    assert [s["ranks"] for s in both.meta["stages"]] == [[0, 2], [4, 6]]
    assert np.array_equal(both.counts, np.concatenate([group0.counts, group1.counts], axis=1))
    with pytest.raises(ValueError, match=r"ep_group \(2\) out of range: .* 2 EP group"):
        read_trace(tmp_path, ep_group=2)
    with pytest.raises(ValueError, match="must be an index or 'all'"):
        read_trace(tmp_path, ep_group="first")



def test_stages_pair_their_ep_groups_by_data_coords(tmp_path) -> None:
    """A rank order other than Megatron's default (e.g. ``--use-tp-pp-dp-mapping``) can list
    stage 1's groups in another order than stage 0's: with ``data_coords`` (the recording rank's
    tensor-, context- and data-parallel ranks) the reader pairs the groups that saw the same
    micro-batches, not the ones of the same rank order. A group recorded on all its ranks
    reads from its EP rank 0, whatever its global rank."""
    c = {r: _counts(2, 2, 4, seed=r) for r in range(8)}
    layout = (  # rank, stage, EP group's ranks, data-parallel rank
        (0, 0, [0, 1], 0), (2, 0, [2, 3], 1), (6, 1, [6, 7], 0), (5, 1, [5, 4], 1),
    )
    for rank, stage, ep, dp in layout:
        _stage(tmp_path, rank, stage, [1 + stage], [0, 1], c[rank], ep_ranks=ep,
               data_coords=[0, 0, dp], ep_rank=0)  # fmt: skip
    _stage(tmp_path, 4, 1, [2], [0, 1], c[4], ep_ranks=[5, 4], data_coords=[0, 0, 2], ep_rank=1)
    group0, group1 = read_trace(tmp_path), read_trace(tmp_path, ep_group=1)
    assert [s["ranks"] for s in group0.meta["stages"]] == [[0], [6]]  # rank order: [0], [5]
    assert [s["ranks"] for s in group1.meta["stages"]] == [[2], [5]]  # EP rank 0, not rank 4
    assert np.array_equal(group0.counts, np.stack([c[0][0], c[6][0], c[0][1], c[6][1]]))
    # Stages whose groups sit at different data positions saw different micro-batches.
    other = tmp_path / "other"
    for rank, stage, ep, dp in layout:
        _stage(other, rank, stage, [1 + stage], [0, 1], c[rank], ep_ranks=ep,
               data_coords=[0, 0, dp + (rank == 5)])  # fmt: skip
    with pytest.raises(ValueError, match=r"different data positions \{0: \[\[0, 0, 0\], \[0, 0, "
                       r"1\]\], 1: \[\[0, 0, 0\], \[0, 0, 2\]\]\}.*rank="):
        read_trace(other)
    assert read_trace(other, rank=5).meta["data_coords"] == [0, 0, 2]

def test_traces_without_pipeline_keys_read_as_before(tmp_path) -> None:
    """Rank directories without pipeline keys: one stage, each directory an EP group; the
    default reads the lowest rank, as it is, in the order its calls ran."""
    counts = _counts(3, 2, 4)
    write_trace(tmp_path, counts, layers=[2, 1, 2], calls=[0, 0, 1], rank=4)
    write_trace(tmp_path, _counts(3, 2, 4, seed=9), layers=[2, 1, 2], calls=[0, 0, 1], rank=6)
    trace = read_trace(tmp_path)
    assert trace.meta["rank"] == 4 and "stages" not in trace.meta
    assert trace.layer.tolist() == [2, 1, 2] and np.array_equal(trace.counts, counts)
    assert read_trace(tmp_path, ep_group=1).meta["rank"] == 6
    with pytest.raises(ValueError, match="incomplete passes"):
        read_trace(tmp_path, ep_group="all")
    common = read_trace(tmp_path, ep_group="all", common_calls=True)
    assert common.counts.shape == (2, 4, 4) and common.layer.tolist() == [1, 2]


def test_merge_refusals_name_the_value_and_the_fix(tmp_path) -> None:
    c = _counts(8, 2, 4)

    def run(name: str, *stages: dict) -> str:
        for s in stages:
            _stage(tmp_path / name, **{"counts": c, **s})
        return str(tmp_path / name)

    s0 = dict(rank=0, stage=0, layers=[1, 2], calls=[0, 1])
    s1 = dict(rank=2, stage=1, layers=[3, 4], calls=[0, 1])
    missing = run("missing", {**s0, "stages": 3}, {**s1, "stages": 3})
    with pytest.raises(ValueError, match=r"stage\(s\) \[2\] of 3 have no trace .*without_moe"):
        read_trace(missing)
    assert read_trace(missing, stages_without_moe=[2]).layers == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"pipeline_size is 2 in rank 2 .* but 3 in rank 0"):
        read_trace(run("size", {**s0, "stages": 3}, s1))
    with pytest.raises(ValueError, match=r"num_experts is 8 in rank 2 \(pipeline stage 1\)"):
        read_trace(run("experts", s0, {**s1, "counts": _counts(4, 2, 8)}))
    with pytest.raises(ValueError, match=r"hidden_size is 64 in rank 2 .* but None in rank 0"):
        read_trace(run("shape", s0, {**s1, "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"layer 2 recorded twice, by rank 0 \(pipeline stage 0\) "
                       r"and rank 2 \(pipeline stage 1\).*global"):
        read_trace(run("twice", s0, {**s1, "layers": [2, 3]}))
    short = run("short", s0, {**s1, "calls": [0]})
    with pytest.raises(ValueError, match=r"rank 2 \(pipeline stage 1\) \(EP group 0\) .* lacks "
                       r"call indices \[1\] .*common_calls=True / --common-calls"):
        read_trace(short)
    common = read_trace(short, common_calls=True)
    assert common.call.tolist() == [0] * 4 and common.layers == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"call 1 has step 5 in rank 0 .* but 6 in rank 2"):
        read_trace(run("steps", {**s0, "steps": [4, 5]}, {**s1, "steps": [4, 6]}))
    groups = run("groups", s0, {**s0, "rank": 4, "ep_ranks": [4, 5]}, s1)
    with pytest.raises(ValueError, match=r"different numbers of EP groups \{0: 2, 1: 1\}"):
        read_trace(groups)
    assert read_trace(groups, rank=4).meta["rank"] == 4  # one directory still reads alone


def test_recorder_writes_the_pipeline_position(tmp_path) -> None:
    recorder = TraceRecorder(
        [_Layer(5), _Layer(6)], tmp_path, rank=4, pipeline_rank=1, pipeline_size=2,
        ep_ranks=[4, 5], data_coords=[0, 1, 2],
    )  # fmt: skip
    recorder.close()
    meta = read_trace(tmp_path, rank=4).meta
    assert (meta["pipeline_rank"], meta["pipeline_size"], meta["ep_rank"]) == (1, 2, 0)
    assert meta["ep_ranks"] == [4, 5] and meta["layers"] == [5, 6]
    assert meta["data_coords"] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"pipeline_rank \(2\) must lie in \[0, pipeline_size"):
        TraceRecorder([_Layer(1)], tmp_path / "b", rank=0, pipeline_rank=2, pipeline_size=2)
