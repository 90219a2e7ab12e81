"""Routing traces: the all-gathered pair counts of every MoE layer call, on disk.

Shape legend: P EP ranks of the recorded run, E experts, C recorded calls, ``N[r, e]`` pairs
from source rank r to expert e (what every EP rank all-gathers before the controller runs).

Format ``lrmoe-routing-trace``, version 1 (:data:`TRACE_VERSION`). A trace is a directory; each
writing process (by default EP rank 0 of every EP group, which holds its group's counts) owns
one sub-directory named by its global rank::

    DIR/rank00000/meta.json         {"format": "lrmoe-routing-trace", "version": 1,
                                     "rank": 0, "ep_size": P, "num_experts": E, ...}
    DIR/rank00000/chunk000000.npz   counts [C, P, E] int32, layer [C] int32,
                                    call [C] int64, step [C] int64
    DIR/rank00000/chunk000001.npz   ...

``meta.json`` may carry more keys (``topk``, ``hidden_size``, ``ffn_hidden_size``, ``gated``,
``activation_bytes``, ``param_bytes``: the layer's shape, for the replay's cost model;
``layers``, ``every``; and where the writer sits in the run: ``pipeline_rank``,
``pipeline_size``, ``ep_rank``, ``ep_ranks``, the global ranks of its EP group, and
``data_coords``, its tensor-, context- and data-parallel ranks). Each
chunk holds whole calls in the order they ran: ``layer`` is Megatron's 1-based layer number
(global: with the pipeline offset), ``call`` the layer's forward call counter (calls made with
gradients enabled; the k-th call of every layer belongs to the k-th micro-batch forward, which
is how :meth:`RoutingTrace.passes` groups them), ``step`` the training step when the recorder
was told it, else -1. Chunks are written with ``numpy.savez`` (``numpy.savez_compressed`` with
``compress=True``: about 3 times smaller, 30 times slower) under a temporary name and renamed
into place, so a reader never sees half a chunk; by default a background thread writes them, so
the caller only copies counts. A reader refuses other formats and newer versions.

Reading a run (:func:`read_trace` without ``rank``): every pipeline stage's recording ranks
write into the same directory, each its stage's layers. The reader groups the rank directories
by ``pipeline_rank`` and, within a stage, by EP group (``ep_ranks``; groups ordered by their
recording rank's ``data_coords``, its tensor-, context- and data-parallel ranks, which pair
group g of every stage with the same micro-batches whatever Megatron's rank order; traces
without them by their lowest rank, which does so in Megatron's default order), takes one EP
group (``ep_group``; the lowest EP rank's copy where ``all_ranks=True`` recorded it several
times) or all of them side by side,
and merges the stages' calls into one pass of all layers per call index. The stages must agree
on everything but their layers: pipeline size, shapes, calls, steps; a missing stage or a layer
recorded twice is refused. A directory without these keys (written before they existed) reads
as one stage of one pipeline whose rank directories are EP groups.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "RoutingTrace",
    "TraceWriter",
    "rank_directory",
    "read_trace",
    "write_trace",
]

TRACE_FORMAT = "lrmoe-routing-trace"
TRACE_VERSION = 1
_META = "meta.json"


def rank_directory(directory: str | os.PathLike, rank: int) -> Path:
    """``DIR/rankNNNNN``: where global rank ``rank`` writes."""
    return Path(directory) / f"rank{int(rank):05d}"


class TraceWriter:
    """Buffers calls in memory and writes them as compressed chunks (one process, one rank).

    Args:
        directory: The trace directory (created if missing).
        rank: The writer's global rank (its sub-directory's name).
        ep_size: P of the recorded calls.
        num_experts: E.
        meta: More keys for ``meta.json`` (JSON-serialisable).
        chunk_calls: Calls per chunk: a chunk is written when this many are buffered. The
            buffer holds ``chunk_calls * P * E`` int32 (two of them with ``background``), touched
            once here: writing into fresh pages costs about 90 us per call at EP 64 with 128
            experts on the development machine, into touched ones about 5 us.
        compress: Write chunks with ``numpy.savez_compressed``.
        background: Write chunks on a background thread (one chunk in flight; a write error is
            raised by the next :meth:`flush` or :meth:`close`).

    Raises:
        ValueError: A non-positive size, or a directory that already holds this rank's trace
            (choose another directory or remove the old one).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        ep_size: int,
        num_experts: int,
        meta: Optional[dict[str, Any]] = None,
        chunk_calls: int = 1024,
        compress: bool = False,
        background: bool = False,
    ) -> None:
        for name, value in (("ep_size", ep_size), ("num_experts", num_experts)):
            if int(value) <= 0:
                raise ValueError(f"TraceWriter: {name} ({value}) must be positive")
        if int(chunk_calls) <= 0:
            raise ValueError(f"TraceWriter: chunk_calls ({chunk_calls}) must be positive")
        self.path = rank_directory(directory, rank)
        if (self.path / _META).exists():
            raise ValueError(
                f"TraceWriter: {self.path} already holds a routing trace; pass another "
                "directory or remove the old trace"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self.ep_size, self.num_experts = int(ep_size), int(num_experts)
        header = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "rank": int(rank),
            "ep_size": self.ep_size,
            "num_experts": self.num_experts,
            **(meta or {}),
        }
        _atomic_write_text(self.path / _META, json.dumps(header, indent=1, sort_keys=True))
        self._capacity = int(chunk_calls)
        self._buffers = [self._new_buffers() for _ in range(2 if background else 1)]
        self._counts, self._layer, self._call, self._step = self._buffers[0]
        self._size = 0
        self._chunks = 0
        self._save = np.savez_compressed if compress else np.savez
        self._pool = ThreadPoolExecutor(max_workers=1) if background else None
        self._pending: Optional[Future] = None
        self.calls_written = 0

    def _new_buffers(self) -> tuple[np.ndarray, ...]:
        """``(counts, layer, call, step)`` buffers, their pages touched (zeroed) now."""
        shape = (self._capacity, self.ep_size, self.num_experts)
        buffers = (
            np.empty(shape, np.int32),
            np.empty(self._capacity, np.int32),
            np.empty(self._capacity, np.int64),
            np.empty(self._capacity, np.int64),
        )
        for b in buffers:
            b.fill(0)
        return buffers

    def append(self, layer: int, call: int, step: int, counts: Any) -> None:
        """Buffer one call's ``[P, E]`` counts (copied as int32); write a chunk when full.

        Raises:
            ValueError: counts of another shape than the trace's ``[P, E]``.
        """
        counts = np.asarray(counts)
        if counts.shape != (self.ep_size, self.num_experts):
            raise ValueError(
                f"TraceWriter: counts of layer {layer} have shape {counts.shape}; this trace "
                f"records [P, E] = [{self.ep_size}, {self.num_experts}] (one trace per EP size)"
            )
        i = self._size
        self._counts[i] = counts  # int64 -> int32: counts per call stay far below 2**31
        self._layer[i], self._call[i], self._step[i] = layer, call, step
        self._size += 1
        if self._size == self._capacity:
            self.flush(wait=False)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed write

    def flush(self, wait: bool = True) -> None:
        """Write the buffered calls as the next chunk (nothing when the buffer is empty).

        Args:
            wait: Return only once every chunk is on disk (else, in the background, once the
                previous chunk is).
        """
        self._wait()
        if self._size:
            n = self._size
            name = self.path / f"chunk{self._chunks:06d}.npz"
            arrays = dict(
                counts=self._counts[:n], layer=self._layer[:n], call=self._call[:n],
                step=self._step[:n],
            )  # fmt: skip
            self._chunks += 1
            self.calls_written += n
            self._size = 0
            if self._pool is None:
                self._write(name, arrays)
            else:
                # The thread owns these buffers until its write ends (waited for above before
                # the next chunk); fill the other set meanwhile.
                self._pending = self._pool.submit(self._write, name, arrays)
                self._buffers.reverse()
                self._counts, self._layer, self._call, self._step = self._buffers[0]
        if wait:
            self._wait()

    def _write(self, name: Path, arrays: dict[str, np.ndarray]) -> None:
        tmp = name.with_suffix(".tmp.npz")
        self._save(tmp, **arrays)
        os.replace(tmp, name)

    def close(self) -> None:
        """Write what is buffered and wait for it (idempotent)."""
        self.flush(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass(frozen=True)
class RoutingTrace:
    """One rank's recorded calls, in the order they ran.

    Attributes:
        meta: ``meta.json`` (format, version, rank, ep_size, num_experts, and any extra keys).
        counts: ``[C, P, E]`` int32 pair counts per call.
        layer: ``[C]`` Megatron layer numbers.
        call: ``[C]`` each layer's call counter.
        step: ``[C]`` training steps (-1 where unknown).
    """

    meta: dict[str, Any]
    counts: np.ndarray
    layer: np.ndarray
    call: np.ndarray
    step: np.ndarray

    @property
    def ep_size(self) -> int:
        return int(self.meta["ep_size"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def layers(self) -> list[int]:
        """The recorded layer numbers, ascending."""
        return sorted({int(x) for x in self.layer})

    def passes(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(call index, layer numbers [n], counts [n, P, E])`` per forward pass, in call order.

        A pass is the k-th recorded call of every layer (one micro-batch's forward through the
        layers this rank records), its calls sorted by layer number.
        """
        for k in np.unique(self.call):
            rows = np.flatnonzero(self.call == k)
            rows = rows[np.argsort(self.layer[rows], kind="stable")]
            yield int(k), self.layer[rows], self.counts[rows]


def write_trace(
    directory: str | os.PathLike,
    counts: np.ndarray,
    layers: Sequence[int],
    calls: Sequence[int],
    *,
    rank: int = 0,
    steps: Optional[Sequence[int]] = None,
    meta: Optional[dict[str, Any]] = None,
) -> Path:
    """Write a whole trace at once (synthetic traces, tests): ``counts`` ``[C, P, E]``.

    Returns:
        The rank's sub-directory.
    """
    counts = np.asarray(counts)
    if counts.ndim != 3:
        raise ValueError(f"write_trace: counts must be [C, P, E], got shape {counts.shape}")
    steps = [-1] * len(counts) if steps is None else steps
    if not len(layers) == len(calls) == len(steps) == len(counts):
        raise ValueError(
            f"write_trace: {len(counts)} calls of counts but {len(layers)} layers, "
            f"{len(calls)} call indices, {len(steps)} steps (give one of each per call)"
        )
    writer = TraceWriter(
        directory, rank, counts.shape[1], counts.shape[2], meta, chunk_calls=max(1, len(counts)),
        compress=True,
    )  # fmt: skip
    for c, layer, call, step in zip(counts, layers, calls, steps):
        writer.append(int(layer), int(call), int(step), c)
    writer.close()
    return writer.path


def _rank_directories(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("rank*") if (p / _META).is_file())


def _read_meta(path: Path) -> dict[str, Any]:
    meta = json.loads((path / _META).read_text())
    if meta.get("format") != TRACE_FORMAT:
        raise ValueError(f"read_trace: {path / _META} is not an {TRACE_FORMAT} header")
    if int(meta.get("version", 0)) > TRACE_VERSION:
        raise ValueError(
            f"read_trace: {path} is version {meta['version']}; this reader knows up to "
            f"{TRACE_VERSION} (update megatron-lrmoe)"
        )
    return meta


def _read_rank(path: Path, meta: dict[str, Any]) -> RoutingTrace:
    shape = (int(meta["ep_size"]), int(meta["num_experts"]))
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("counts", "layer", "call", "step")}
    for chunk in sorted(path.glob("chunk[0-9]*.npz")):
        if chunk.name.endswith(".tmp.npz"):
            continue
        with np.load(chunk) as data:
            if data["counts"].shape[1:] != shape:
                raise ValueError(
                    f"read_trace: {chunk} holds counts of shape {data['counts'].shape[1:]}, "
                    f"meta.json says {shape}"
                )
            for key in parts:
                parts[key].append(data[key])
    empty = {"counts": np.zeros((0, *shape), np.int32)}
    arrays = {
        k: np.concatenate(v) if v else empty.get(k, np.zeros(0, np.int64))
        for k, v in parts.items()
    }
    return RoutingTrace(meta=meta, **arrays)


def read_trace(
    directory: str | os.PathLike,
    rank: Optional[int] = None,
    *,
    ep_group: int | str = 0,
    common_calls: bool = False,
    stages_without_moe: Sequence[int] = (),
) -> RoutingTrace:
    """Read a run's trace: every pipeline stage merged into one model, or one rank's directory.

    With ``rank`` given, that rank's directory alone (one stage, one EP group), its calls in
    the order they ran. Else the directory is read as one run (see the module docstring's
    *Reading a run*): per pipeline stage (``meta.json``'s ``pipeline_rank``) the EP group
    ``ep_group`` (groups ordered by their recording rank's ``data_coords``, else by their
    lowest global rank; of an EP group recorded on several ranks, ``all_ranks=True``, the
    lowest EP rank's copy), the stages' calls merged into
    one pass of every recorded layer per call index, sorted by (call, layer). ``ep_group="all"``
    puts every group's sources side by side: ``[C, G p, E]``, the micro-batch of all G groups'
    ranks as one EP group of ``G p`` sources. A trace without pipeline keys (recorded before
    they existed) reads as one stage whose rank directories are its EP groups.

    Args:
        directory: The trace directory (``rankNNNNN/`` sub-directories).
        rank: Read only this rank's directory.
        ep_group: The EP group of every stage to read (an index) or ``"all"``.
        common_calls: Keep only the calls that every stage read recorded completely (every
            layer of the stage), instead of refusing stages that recorded different calls.
        stages_without_moe: Pipeline stages that hold no LRMoE layer (they record nothing, so
            their absence is not an error).

    Raises:
        ValueError: No trace there, a foreign format, a newer version, chunks whose shapes
            disagree with ``meta.json``; when merging, stages or groups that disagree: a
            missing stage, different pipeline sizes, shapes or layer shapes, a layer
            recorded by two stages, different calls or steps (without ``common_calls``),
            ``ep_group`` out of range.
    """
    directory = Path(directory)
    if rank is not None:
        path = rank_directory(directory, rank)
        if not (path / _META).is_file():
            raise ValueError(f"read_trace: no trace of rank {rank} in {directory} ({path})")
        return _read_rank(path, _read_meta(path))
    found = _rank_directories(directory)
    if not found:
        raise ValueError(
            f"read_trace: no routing trace in {directory} (expected rankNNNNN/{_META}; "
            "record one with megatron_lrmoe.training.trace.install_trace_recorder)"
        )
    grid = _stage_grid(directory, [(path, _read_meta(path)) for path in found], stages_without_moe)
    groups = len(next(iter(grid.values())))
    if ep_group == "all":
        chosen = list(range(groups))
    elif isinstance(ep_group, int) or str(ep_group).isdigit():
        if not 0 <= int(ep_group) < groups:
            raise ValueError(
                f"read_trace: ep_group ({ep_group}) out of range: {directory} holds {groups} "
                f"EP group(s) per pipeline stage (pass 0..{groups - 1} or 'all')"
            )
        chosen = [int(ep_group)]
    else:
        raise ValueError(f"read_trace: ep_group ({ep_group!r}) must be an index or 'all'")
    parts = {
        (g, stage): _read_rank(*grid[stage][g]) for stage in sorted(grid) for g in chosen
    }
    return _merge(directory, parts, chosen, common_calls)


# Keys every stage and EP group of one run must agree on (the layers' shape and the recording).
_SAME_KEYS = (
    "ep_size", "num_experts", "topk", "hidden_size", "ffn_hidden_size", "gated",
    "activation_bytes", "param_bytes", "every", "pipeline_size",
)  # fmt: skip


def _where(meta: dict[str, Any]) -> str:
    return f"rank {meta['rank']} (pipeline stage {int(meta.get('pipeline_rank', 0))})"


def _stage_grid(
    directory: Path, found: list[tuple[Path, dict[str, Any]]], stages_without_moe: Sequence[int]
) -> dict[int, list[tuple[Path, dict[str, Any]]]]:
    """``stage -> [(path, meta) per EP group]``, checked. Groups in the order of their
    recording ranks' ``data_coords`` where every directory has them (the same micro-batches
    in every stage whatever Megatron's rank order), else of their lowest global rank; of a
    group recorded on several ranks, its lowest EP rank's copy."""
    first = found[0][1]
    for _, meta in found[1:]:
        for key in _SAME_KEYS:
            if meta.get(key) != first.get(key):
                raise ValueError(
                    f"read_trace: {key} is {meta.get(key)} in {_where(meta)} but "
                    f"{first.get(key)} in {_where(first)} of {directory}; one trace directory "
                    "holds one run (record each run into its own directory, or read one "
                    "rank with rank= / --rank)"
                )
    stages = int(first.get("pipeline_size", 1))
    by_stage: dict[int, dict[tuple[int, ...], tuple[Path, dict[str, Any]]]] = {}
    for path, meta in found:  # ascending rank: of equal EP ranks the lowest rank wins
        stage = int(meta.get("pipeline_rank", 0))
        if not 0 <= stage < stages:
            raise ValueError(
                f"read_trace: {_where(meta)} of {directory} is outside pipeline_size "
                f"({stages}); the trace's meta.json is damaged"
            )
        key = tuple(int(r) for r in meta.get("ep_ranks", [meta["rank"]]))
        group = by_stage.setdefault(stage, {})
        if key not in group or int(meta.get("ep_rank", 0)) < int(group[key][1].get("ep_rank", 0)):
            group[key] = (path, meta)
    missing = sorted(set(range(stages)) - set(by_stage) - {int(s) for s in stages_without_moe})
    if missing:
        raise ValueError(
            f"read_trace: pipeline stage(s) {missing} of {stages} have no trace in "
            f"{directory} (stages recorded: {sorted(by_stage)}); copy every stage's "
            "rankNNNNN directory into it, or, for a stage that holds no LRMoE layer, pass "
            "stages_without_moe / --stages-without-moe"
        )
    coords = all("data_coords" in m for g in by_stage.values() for _, m in g.values())
    grid = {
        s: sorted(g.values(), key=lambda e: tuple(e[1]["data_coords"]))
        if coords
        else [g[k] for k in sorted(g)]
        for s, g in sorted(by_stage.items())
    }
    sizes = {s: len(g) for s, g in grid.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"read_trace: the pipeline stages of {directory} hold different numbers of EP "
            f"groups {sizes} (stage: groups); a recording rank's directory is missing (copy "
            "it in) or read one rank with rank= / --rank"
        )
    if coords:
        positions = {s: [m["data_coords"] for _, m in g] for s, g in grid.items()}
        if len({str(p) for p in positions.values()}) > 1:
            raise ValueError(
                f"read_trace: the pipeline stages of {directory} recorded EP groups at "
                f"different data positions {positions} (stage: [tensor, context, data]-"
                "parallel ranks of each group's recording rank), so no group of one stage "
                "saw another's micro-batches; record with the default EP rank 0 writers (no "
                "all_ranks), copy every stage's directories in, or read one rank with rank= / "
                "--rank"
            )
    return grid


def _merge(
    directory: Path,
    parts: dict[tuple[int, int], RoutingTrace],
    chosen: list[int],
    common_calls: bool,
) -> RoutingTrace:
    """One trace from ``(EP group, stage) -> trace``: checked, merged, sorted by (call, layer).

    One part alone is returned as read (its calls in the order they ran), unless
    ``common_calls`` asks for its complete passes only.
    """
    stages = sorted({s for _, s in parts})
    for g in chosen:
        owner: dict[int, dict[str, Any]] = {}
        for s in stages:
            trace = parts[g, s]
            for layer in sorted({*trace.meta.get("layers", []), *trace.layers}):
                if layer in owner:
                    raise ValueError(
                        f"read_trace: layer {layer} recorded twice, by {_where(owner[layer])} "
                        f"and {_where(trace.meta)} of {directory}; a stage's layer numbers "
                        "must be global (Megatron's, with the pipeline offset) and every "
                        "rank directory must come from one run"
                    )
                owner[layer] = trace.meta
    if len(parts) == 1 and not common_calls:
        return next(iter(parts.values()))
    # A part's complete calls: each of the layers it records once under that call index.
    calls, complete = {}, {}
    for key, trace in parts.items():
        layers = np.asarray(trace.layers, dtype=trace.layer.dtype)
        calls[key] = set(np.unique(trace.call).tolist())
        complete[key] = {
            k for k in calls[key] if np.array_equal(np.sort(trace.layer[trace.call == k]), layers)
        }
    every, keep = set.union(*calls.values()), set.intersection(*complete.values())
    if not common_calls:
        for key, trace in parts.items():
            lacks, partial = sorted(every - calls[key]), sorted(calls[key] - complete[key])
            if lacks or partial:
                what = (
                    f"lacks call indices {lacks[:5]} that other stages or EP groups recorded"
                    if lacks
                    else f"holds incomplete passes (call indices {partial[:5]}: not each of its "
                    "layers once)"
                )
                raise ValueError(
                    f"read_trace: {_where(trace.meta)} (EP group {key[0]}) of {directory} "
                    f"{what}; the stages recorded different iterations (a process stopped "
                    "before its recorder closed loses its unwritten calls): read the calls "
                    "every stage holds completely with common_calls=True / --common-calls"
                )
    steps: dict[int, tuple[int, dict[str, Any]]] = {}
    for trace in parts.values():
        for k, step in zip(trace.call.tolist(), trace.step.tolist()):
            if k not in keep:
                continue
            first_step, where = steps.setdefault(k, (step, trace.meta))
            if first_step != step:
                raise ValueError(
                    f"read_trace: call {k} has step {first_step} in {_where(where)} but "
                    f"{step} in {_where(trace.meta)} of {directory}; these stages come from "
                    "different runs (record each run into its own directory)"
                )
    kept = np.array(sorted(keep), dtype=np.int64)
    merged = []
    for g in chosen:
        rows = [(parts[g, s], np.isin(parts[g, s].call, kept)) for s in stages]
        layer = np.concatenate([t.layer[m] for t, m in rows])
        call = np.concatenate([t.call[m] for t, m in rows])
        order = np.lexsort((layer, call))
        counts = np.concatenate([t.counts[m] for t, m in rows])[order]
        step = np.concatenate([t.step[m] for t, m in rows])[order]
        merged.append((counts, layer[order], call[order], step))
    for g, (_, layer, _, _) in zip(chosen[1:], merged[1:]):
        if not np.array_equal(layer, merged[0][1]):
            raise ValueError(
                f"read_trace: EP group {g} of {directory} records other layers than group "
                f"{chosen[0]} (a trace recorded without pipeline keys reads as one stage whose "
                "rank directories are EP groups); read one group with ep_group= / --ep-group"
            )

    def layers_of(trace: RoutingTrace) -> list[int]:
        return sorted({int(x) for x in trace.meta.get("layers", trace.layers)})

    first = parts[chosen[0], stages[0]].meta
    meta = {
        **first,
        "ep_size": int(first["ep_size"]) * len(chosen),
        "layers": sorted({x for t in parts.values() for x in layers_of(t)}),
        "ep_group": "all" if len(chosen) > 1 else chosen[0],
        "ep_groups_read": len(chosen),
        "stages": [
            {
                "pipeline_rank": s,
                "ranks": [int(parts[g, s].meta["rank"]) for g in chosen],
                "layers": layers_of(parts[chosen[0], s]),
            }
            for s in stages
        ],
    }
    _, layer, call, step = merged[0]
    counts = np.concatenate([m[0] for m in merged], axis=1)
    return RoutingTrace(meta=meta, counts=counts, layer=layer, call=call, step=step)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
