"""Record the routing of a training run (the per-call pair counts) for the replay tool.

One call enables it::

    recorder = install_trace_recorder(model, "/path/to/trace")  # before training
    ...                                                        # train
    recorder.close()                                           # or at process exit

Every ``LRMoELayer`` of ``model`` hands the recorder the ``CallStats`` of each call made with
gradients enabled (``LRMoELayer.add_stats_listener``); the recorder copies the call's
all-gathered ``[P, E]`` counts (``CallStats.global_counts``) into a host buffer and writes
compressed chunks in the format of :mod:`megatron_lrmoe.observe.trace`. The counts are the same
on every rank of an EP group, so by default only EP rank 0 of each group records (pass
``all_ranks=True`` for every rank). Needs ``LRMoEConfig.record_stats`` (the default). Under
pipeline parallelism every stage's recording ranks write their stage's layers (Megatron's global
layer numbers) into the same directory, with their pipeline rank and EP group in ``meta.json``;
``read_trace`` merges the stages into one model.

Overhead, on the recording rank only: per recorded call one copy of ``P * E`` integers into a
pre-touched host buffer (no device work: the counts are already on the host for the controller),
and per ``chunk_calls`` calls one ``numpy.savez`` on a background thread. Measured on the 2-core
development machine at EP 64 with 128 experts (the listener called in a loop, docs/replay.md):
5 us per call; 22-24 us per call with the background writes competing for the two cores in
that tight loop; a chunk of 4096 calls written in 0.26 s. On disk 32 KiB per call (1.5 MiB per
micro-batch of 48 layers); ``compress=True`` stores 11 KiB per call but costs the background
thread about 4 ms per call here. ``every`` records one pass in ``every`` to bound the disk use.
Host memory: two buffers of ``chunk_calls * P * E`` int32 (2 x 8 MiB at the defaults, EP 64).
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Optional, Sequence, Union

import torch

from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.layer import LRMoELayer
from megatron_lrmoe.observe.stats import CallStats
from megatron_lrmoe.observe.trace import TraceWriter

__all__ = ["TraceRecorder", "install_trace_recorder"]

logger = logging.getLogger(__name__)


class TraceRecorder:
    """Listens to LRMoE layers and writes their counts (see the module docstring).

    Args:
        layers: The LRMoE layers to record (one EP size, one expert count).
        directory: The trace directory.
        rank: This process's global rank (names its sub-directory).
        every: Record the calls whose per-layer call index is a multiple of ``every``
            (with M micro-batches per step, ``every = M * s`` records one micro-batch every
            ``s`` steps).
        chunk_calls: Calls per written chunk.
        compress: Compress the chunks (about 3 times smaller; the background thread's CPU time
            grows about 30 times).
        pipeline_rank: This rank's pipeline stage (``meta.json``'s ``pipeline_rank``: the
            reader merges the stages of a run into one model).
        pipeline_size: The run's pipeline-parallel size.
        ep_ranks: The global ranks of these layers' EP group, in EP rank order (``meta.json``'s
            ``ep_ranks``); None leaves the key out (the reader then takes each rank directory
            for its own group).
        data_coords: This rank's tensor-, context- and data-parallel ranks (``meta.json``'s
            ``data_coords``): the same on the recording rank of every stage's EP group that
            sees the same micro-batches, whatever Megatron's rank order, so the reader pairs
            the stages' EP groups by them; None leaves the key out (the reader then pairs them
            by rank order, Megatron's default tp-cp-ep-dp-pp).

    Raises:
        ValueError: No layers, layers of different EP sizes or expert counts, ``every < 1``,
            a pipeline rank outside ``[0, pipeline_size)``.
    """

    def __init__(
        self,
        layers: Sequence[LRMoELayer],
        directory: Union[str, os.PathLike],
        rank: int,
        every: int = 1,
        chunk_calls: int = 256,
        compress: bool = False,
        pipeline_rank: int = 0,
        pipeline_size: int = 1,
        ep_ranks: Optional[Sequence[int]] = None,
        data_coords: Optional[Sequence[int]] = None,
    ) -> None:
        if not layers:
            raise ValueError("TraceRecorder: no LRMoE layers to record")
        if int(every) < 1:
            raise ValueError(f"TraceRecorder: every ({every}) must be >= 1")
        if not 0 <= int(pipeline_rank) < int(pipeline_size):
            raise ValueError(
                f"TraceRecorder: pipeline_rank ({pipeline_rank}) must lie in [0, pipeline_size "
                f"({pipeline_size}))"
            )
        shapes = {
            (layer.token_dispatcher.ep_size, layer.config.num_moe_experts) for layer in layers
        }
        if len(shapes) != 1:
            raise ValueError(
                f"TraceRecorder: layers with different (EP size, experts) {sorted(shapes)}; "
                "record each kind into its own directory"
            )
        ((ep_size, num_experts),) = shapes
        config = layers[0].config
        cost = CostModel.from_config(config)
        meta = {
            "topk": int(config.moe_router_topk),
            "hidden_size": cost.hidden_size,
            "ffn_hidden_size": cost.ffn_hidden_size,
            "gated": cost.gated,
            "activation_bytes": cost.activation_bytes,
            "param_bytes": cost.param_bytes,
            "layers": sorted(layer.global_layer_number or 1 for layer in layers),
            "every": int(every),
            "pipeline_rank": int(pipeline_rank),
            "pipeline_size": int(pipeline_size),
            "ep_rank": int(layers[0].token_dispatcher.ep_rank),
        }
        if ep_ranks is not None:
            meta["ep_ranks"] = [int(r) for r in ep_ranks]
        if data_coords is not None:
            meta["data_coords"] = [int(r) for r in data_coords]
        self.every = int(every)
        self.step = -1
        self.writer = TraceWriter(
            directory, rank, ep_size, num_experts, meta, chunk_calls, compress, background=True
        )
        self._handles = [layer.add_stats_listener(self.record) for layer in layers]
        self._warned = False

    def set_step(self, step: int) -> None:
        """The training step to store with the following calls (else -1)."""
        self.step = int(step)

    def record(self, layer_number: int, stats: CallStats) -> None:
        """The listener: buffer this call's counts (a host copy, no device work)."""
        if stats.call_index % self.every:
            return
        if stats.global_counts is None:
            if not self._warned:
                logger.warning("TraceRecorder: a call without global_counts was not recorded")
                self._warned = True
            return
        self.writer.append(layer_number, stats.call_index, self.step, stats.global_counts.numpy())

    def close(self) -> None:
        """Stop listening and write what is buffered (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.writer.close()


def _layers(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[LRMoELayer]:
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, LRMoELayer)]


def _megatron_pipeline() -> tuple[int, int]:
    """``(pipeline rank, pipeline size)`` from Megatron's parallel state, else ``(0, 1)``."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _megatron_data_coords() -> Optional[list[int]]:
    """``[tensor, context, data]``-parallel ranks from Megatron's parallel state (None when it
    is not initialised): what identifies an EP group's micro-batches across pipeline stages."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return [
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    ]


def install_trace_recorder(
    model: Union[torch.nn.Module, Sequence[torch.nn.Module]],
    directory: Union[str, os.PathLike],
    *,
    every: int = 1,
    all_ranks: bool = False,
    chunk_calls: int = 256,
    compress: bool = False,
    pipeline_rank: Optional[int] = None,
    pipeline_size: Optional[int] = None,
) -> Optional[TraceRecorder]:
    """Record the routing of ``model``'s LRMoE layers into ``directory`` (explicit, one call).

    Args:
        model: A module or a list of model chunks (DDP-wrapped or not).
        directory: The trace directory (every recording rank writes its own sub-directory).
        every: See :class:`TraceRecorder`.
        all_ranks: Record on every rank, not only on EP rank 0 of each EP group.
        chunk_calls: Calls per written chunk.
        compress: See :class:`TraceRecorder`.
        pipeline_rank: This rank's pipeline stage; None: Megatron's
            (``parallel_state.get_pipeline_model_parallel_rank()``) when model parallelism is
            initialised, else 0.
        pipeline_size: The pipeline-parallel size; None: Megatron's, else 1.

    Returns:
        The recorder (flushed at process exit too), or None on a rank that records nothing.

    Raises:
        ValueError: A layer with ``record_stats`` off (it makes no statistics to record).
    """
    layers = _layers(model)
    off = [
        layer.global_layer_number or 1 for layer in layers if not layer.lrmoe_config.record_stats
    ]
    if off:
        raise ValueError(
            f"install_trace_recorder: layers {off} have record_stats=False; the routing trace "
            "reads each call's statistics (turn record_stats on)"
        )
    if not all_ranks:
        layers = [layer for layer in layers if layer.token_dispatcher.ep_rank == 0]
    if not layers:
        return None
    distributed = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    stage, stages = _megatron_pipeline()
    ep_group = layers[0].token_dispatcher.ep_group
    recorder = TraceRecorder(
        layers,
        directory,
        rank,
        every=every,
        chunk_calls=chunk_calls,
        compress=compress,
        pipeline_rank=stage if pipeline_rank is None else pipeline_rank,
        pipeline_size=stages if pipeline_size is None else pipeline_size,
        ep_ranks=torch.distributed.get_process_group_ranks(ep_group) if distributed else [rank],
        data_coords=_megatron_data_coords(),
    )
    atexit.register(recorder.close)
    logger.info(
        "recording the routing of %d LRMoE layers into %s", len(layers), recorder.writer.path
    )
    return recorder
