"""``sharded_state_dict`` of ``LRGroupedMLP``: SequentialMLP's checkpoint, one entry per projection.

Shape legend: L local experts, P EP ranks, E = P * L global experts, H hidden, F expert FFN width,
F1 = 2F when gated (SwiGLU, gate half first). A parent's ``sharded_offsets`` (e.g. the layer axis
of a TransformerBlock) prepend axes to every global shape below.

What a torch_dist checkpoint holds is decided by global keys, global shapes and which part of the
global tensor each rank writes; the local layout of the shards is free. ``SequentialMLP`` writes
one shard per expert; this module writes, per projection, one shard of L consecutive experts:

=========================================  =================  ===================================
global key (default metadata)              global shape       this rank's shard
=========================================  =================  ===================================
``{prefix}experts.linear_fc1.weight``      ``[E, F1, H]``     ``w1`` at ``[ep_rank * L, 0, 0]``;
                                                              gated: gate ``w1[:, :F]`` at
                                                              ``[ep_rank * L, 0, 0]``, up
                                                              ``w1[:, F:]`` at
                                                              ``[ep_rank * L, F, 0]`` (what
                                                              ``apply_swiglu_sharded_factory``
                                                              writes for SequentialMLP)
``{prefix}experts.linear_fc2.weight``      ``[E, H, F]``      ``w2`` at ``[ep_rank * L, 0, 0]``
``{prefix}experts.linear_fc{1,2}.``        ``[E]`` objects    ``None`` at each local expert's
``_extra_state``                                              global index (one object each)
=========================================  =================  ===================================

Replica ids are SequentialMLP's: ``(0, 0, expert_dp_rank)`` for weights and
``(0, expert_tp_rank, expert_dp_rank)`` for the extra states. Each weight entry is a
``ShardedTensor`` whose data is the parameter itself, or a ``ShardedTensorFactory`` (SwiGLU) whose
data is the parameter. Megatron's optimizer checkpoints find model entries by parameter identity
(``get_param_id_to_sharded_param_map`` and the distributed optimizer's model-space formats), so
they work unchanged and store optimizer state under the same global keys as SequentialMLP's.

``metadata["singleton_local_shards"]``: SequentialMLP then writes one global key per expert
(``{prefix}experts.{g}.linear_fc1.weight`` of shape ``[F1, H]``; gated:
``..._w`` / ``..._v`` of ``[F, H]``). Here each projection is then one factory whose data is the
parameter and which builds those per-expert tensors as views ``w[i]``; on load it stacks them
back. So that mode, too, works for the model and for optimizer state.

Distributed optimizer: ``fully_reshardable`` (model space) checkpoints move between this module
and SequentialMLP like the plain optimizer's. ``dp_reshardable`` (Megatron-LM's default with
``--use-distributed-optimizer``) stores raw gradient-buffer buckets, whose layout follows the
parameters' order and shapes: it resumes within one implementation only, and a stock bucket
loads without error into LRMoE's (or the reverse) with the experts' state permuted. To switch
implementations, save with ``--dist-ckpt-optim-fully-reshardable`` or resume model-only.

Not supported (raise): expert tensor parallelism > 1 and flattened (``flattened_range``) entries,
which only the deprecated ``fully_sharded_model_space`` distributed-optimizer format produces
(megatron 0.19.2's torch_dist saving rejects those for SequentialMLP too).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (
    ReplicaId,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

_EXTRA_STATE = "_extra_state"
# Suffixes of SequentialMLP's singleton-mode keys of the two SwiGLU halves (gate, up).
_SWIGLU_SUFFIXES = ("_w", "_v")


def _expert_tp_group(module: torch.nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The expert-tensor-parallel group SequentialMLP's linears would use (always of size 1)."""
    group = getattr(module, "tp_group", None)
    if group is None:
        # Same group as pg_collection.expt_tp of the default collection; None when megatron's
        # parallel state is not initialised, which Megatron's helpers treat as rank 0 of 1.
        group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    if get_pg_size(group) != 1:
        # The parameters hold whole experts, so a shard would be mislabelled as a TP shard.
        raise ValueError(
            f"{type(module).__name__}.sharded_state_dict needs an expert tensor-parallel group "
            f"of size 1, got {get_pg_size(group)}; set expert_tensor_parallel_size=1"
        )
    return group


def _no_flattened_range(key: str, flattened_range: Optional[slice]) -> None:
    if flattened_range is not None:
        raise NotImplementedError(
            f"{key}: flattened sharded tensors (the deprecated 'fully_sharded_model_space' "
            "distributed-optimizer format) are not supported for LRMoE experts; save with "
            "metadata['distrib_optim_sharding_type'] 'dp_reshardable' or 'fully_reshardable'"
        )


def _global_key_head(key: str, tail: str) -> str:
    """``key`` without its ``tail``: the prefix that the optimizer (or nothing) put in front."""
    if not key.endswith(tail):
        raise ValueError(f"sharded key {key!r} does not end with {tail!r}")
    return key[: len(key) - len(tail)]


class _StackedSwiGLU:
    """Build / merge functions of the factory for a gated ``[L, F1, H]`` fc1 (default metadata).

    Build: gate ``t[:, :F]`` and up ``t[:, F:]`` as two shards of one global key, at F1-axis
    chunks 0 and 1 of 2 (as ``apply_swiglu_sharded_factory`` places each expert's halves).
    Merge: concatenate them back along F1.
    """

    def __init__(self, offsets: tuple, expert_axis: int, ep_rank: int, ep_size: int) -> None:
        self.offsets = offsets
        self.expert_axis = expert_axis
        self.ep_rank = ep_rank
        self.ep_size = ep_size

    @torch.no_grad()
    def build(
        self, key: str, t: torch.Tensor, replica_id: ReplicaId, flattened_range: Optional[slice]
    ) -> list[ShardedTensor]:
        _no_flattened_range(key, flattened_range)
        gate, up = torch.chunk(t, 2, dim=1)
        return [
            ShardedTensor.from_rank_offsets(
                key,
                half,
                *self.offsets,
                (self.expert_axis, self.ep_rank, self.ep_size),
                (self.expert_axis + 1, chunk, 2),
                replica_id=replica_id,
                prepend_axis_num=len(self.offsets),
            )
            for chunk, half in enumerate((gate, up))
        ]

    @staticmethod
    def merge(halves: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(halves, dim=1)


class _PerExpertShards:
    """Build / merge functions of a projection's factory under ``singleton_local_shards``.

    Build: one shard per local expert ``w[i]`` under SequentialMLP's per-expert global key
    ``{head}experts.{g}.{proj}.weight`` (gated fc1: ``..._w`` gate ``w[i, :F]`` and ``..._v`` up
    ``w[i, F:]``), where ``head`` is whatever precedes ``experts.{proj}.weight`` in the factory's
    key (the module prefix, and the optimizer's state prefix for optimizer state).
    Merge: stack them back into ``[L, ...]``.
    """

    def __init__(self, proj: str, offsets: tuple, first_global: int, gated: bool) -> None:
        self.proj = proj
        self.offsets = offsets
        self.first_global = first_global
        self.gated = gated

    @torch.no_grad()
    def build(
        self, key: str, t: torch.Tensor, replica_id: ReplicaId, flattened_range: Optional[slice]
    ) -> list[ShardedTensor]:
        _no_flattened_range(key, flattened_range)
        head = _global_key_head(key, f"experts.{self.proj}.weight")
        shards = []
        for i in range(t.shape[0]):
            expert_key = f"{head}experts.{self.first_global + i}.{self.proj}.weight"
            if self.gated:
                # SequentialMLP's singleton SwiGLU halves are whole tensors of their own keys.
                parts = zip(_SWIGLU_SUFFIXES, torch.chunk(t[i], 2, dim=0))
                items = [
                    (expert_key + suffix, half, (len(self.offsets), 0, 1)) for suffix, half in parts
                ]
            else:
                items = [(expert_key, t[i], None)]
            for shard_key, data, own_offset in items:
                offsets = (*self.offsets, own_offset) if own_offset else self.offsets
                shards.append(
                    ShardedTensor.from_rank_offsets(
                        shard_key,
                        data,
                        *offsets,
                        replica_id=replica_id,
                        prepend_axis_num=len(self.offsets),
                    )
                )
        return shards

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        if self.gated:
            shards = [torch.cat(shards[j : j + 2], dim=0) for j in range(0, len(shards), 2)]
        return torch.stack(shards)


def stacked_experts_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: Optional[dict] = None,
) -> ShardedStateDict:
    """``SequentialMLP.sharded_state_dict``'s checkpoint content for ``[L, ...]`` expert weights.

    Args:
        module: an ``LRGroupedMLP`` (``weights()``, ``num_local_experts``, ``ep_group``,
            ``tp_group`` (expert TP), ``dp_group`` (expert DP), ``config``).
        prefix: state-dict prefix of the module, e.g. ``"decoder.layers.0.mlp.experts."``.
        sharded_offsets: offsets already applied by parent modules (e.g. the layer axis).
        metadata: sharded-state-dict metadata; ``singleton_local_shards`` selects one global key
            per expert, as in SequentialMLP.

    Returns:
        Local key -> entry: ``{prefix}linear_fc{1,2}.weight`` (the parameters' own names, so a
        loaded state dict goes straight into ``load_state_dict``) -> ``ShardedTensor`` or
        ``ShardedTensorFactory`` with the parameter as data; and SequentialMLP's local keys
        ``{prefix}local_experts.{i}.linear_fc{1,2}._extra_state`` -> ``ShardedObject`` (``None``),
        which ``load_state_dict`` accepts and drops.
    """
    singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
    tp_group = _expert_tp_group(module)
    num_local = module.num_local_experts
    ep_size, ep_rank = module.ep_group.size(), module.ep_group.rank()
    num_global = ep_size * num_local
    first_global = ep_rank * num_local
    expert_dp_rank = module.dp_group.rank()
    # As SequentialMLP: Megatron's linears give (0, 0, dp) for weights and (0, tp, dp) for extra
    # states, and SequentialMLP replaces dp by the expert-data-parallel rank.
    weight_replica_id = (0, 0, expert_dp_rank)
    extra_replica_id = (0, get_pg_rank(tp_group), expert_dp_rank)
    offsets = tuple(sharded_offsets)
    expert_axis = len(offsets)
    w1, w2 = module.weights()

    sharded_state_dict: ShardedStateDict = {}
    for proj, weight in (("linear_fc1", w1), ("linear_fc2", w2)):
        global_key = f"{prefix}experts.{proj}.weight"
        gated = proj == "linear_fc1" and module.config.gated_linear_unit
        if singleton_local_shards:
            shards = _PerExpertShards(proj, offsets, first_global, gated)
            entry = ShardedTensorFactory(
                global_key, weight, shards.build, shards.merge, weight_replica_id
            )
        elif gated:
            swiglu = _StackedSwiGLU(offsets, expert_axis, ep_rank, ep_size)
            entry = ShardedTensorFactory(
                global_key, weight, swiglu.build, swiglu.merge, weight_replica_id
            )
        else:
            entry = ShardedTensor.from_rank_offsets(
                global_key,
                weight,
                *offsets,
                (expert_axis, ep_rank, ep_size),
                replica_id=weight_replica_id,
                prepend_axis_num=len(offsets),
            )
        sharded_state_dict[f"{prefix}{proj}.weight"] = entry

        for i in range(num_local):
            global_idx = first_global + i
            if singleton_local_shards:
                key, object_offsets = f"{prefix}experts.{global_idx}.{proj}.{_EXTRA_STATE}", offsets
            else:
                key = f"{prefix}experts.{proj}.{_EXTRA_STATE}"
                object_offsets = (*offsets, (expert_axis, global_idx, num_global))
            local_key = f"{prefix}local_experts.{i}.{proj}.{_EXTRA_STATE}"
            sharded_state_dict[local_key] = make_sharded_object_for_checkpoint(
                None, key, object_offsets, replica_id=extra_replica_id
            )
    return sharded_state_dict
