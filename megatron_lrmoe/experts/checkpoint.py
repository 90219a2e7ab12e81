"""``sharded_state_dict`` of ``LRGroupedMLP``, identical to Megatron's ``SequentialMLP``'s.

Shape legend: L local experts, E = EP * L global experts, H hidden, F expert FFN width,
F1 = 2F when gated (SwiGLU, gate half first).

``LRGroupedMLP`` keeps SequentialMLP's parameter names (``local_experts.{i}.linear_fc1.weight``
and ``...linear_fc2.weight``), so plain ``state_dict`` needs nothing special.
:func:`sequential_mlp_sharded_state_dict` builds the same local keys, global keys, shapes,
offsets, replica ids and SwiGLU factories as ``SequentialMLP.sharded_state_dict``, with the
parameters themselves as data, so Megatron distributed checkpoints (model and optimizer) move
freely between this module, ``SequentialMLP`` and ``TEGroupedMLP`` and across EP sizes.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import get_pg_size

# Tensor-parallel axis of each projection's weight, as ColumnParallelLinear (fc1, output dim)
# and RowParallelLinear (fc2, input dim) declare it in their sharded_state_dict.
_TP_AXIS_MAP = {"linear_fc1": {"weight": 0, "bias": 0}, "linear_fc2": {"weight": 1}}
_EXTRA_STATE = "_extra_state"


def _expert_tp_group(module: torch.nn.Module) -> Optional[torch.distributed.ProcessGroup]:
    """The expert-tensor-parallel group SequentialMLP's linears would use (always of size 1)."""
    group = getattr(module, "tp_group", None)
    if group is None:
        # Same group as pg_collection.expt_tp of the default collection; None when megatron's
        # parallel state is not initialised, which Megatron's helpers treat as rank 0 of 1.
        group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    if get_pg_size(group) != 1:
        # weight1/weight2 hold whole experts, so their slices would be mislabelled as TP shards.
        raise ValueError(
            f"{type(module).__name__}.sharded_state_dict needs an expert tensor-parallel group "
            f"of size 1, got {get_pg_size(group)}"
        )
    return group


def sequential_mlp_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: Optional[dict] = None,
) -> ShardedStateDict:
    """``SequentialMLP.sharded_state_dict`` for stacked expert weights.

    Builds, for every local expert ``i``, what ``local_experts[i]`` (an ``MLP`` of a
    ``ColumnParallelLinear`` fc1 and a ``RowParallelLinear`` fc2) would contribute, through the
    same Megatron helpers, so local keys, global keys, global shapes and offsets, replica ids,
    ``_extra_state`` objects and the SwiGLU ``ShardedTensorFactory`` are identical to
    SequentialMLP's for the same config and EP rank.

    Args:
        module: an ``LRGroupedMLP`` (``local_experts[i].linear_fc{1,2}.weight``,
            ``num_local_experts``, ``ep_group``, ``dp_group`` (expert DP), ``config``).
        prefix: state-dict prefix of the module, e.g. ``"decoder.layers.0.mlp.experts."``.
        sharded_offsets: offsets already applied by parent modules (e.g. the layer axis).
        metadata: sharded-state-dict metadata; ``dp_cp_group`` is filled in when missing and
            ``singleton_local_shards`` selects one global key per expert, as in SequentialMLP.

    Returns:
        Local key -> ``ShardedTensor`` / ``ShardedTensorFactory`` / ``ShardedObject``; each
        tensor's data is the expert's parameter itself, as in SequentialMLP.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton_local_shards = metadata.get("singleton_local_shards", False)
    tp_group = _expert_tp_group(module)
    dp_cp_group = metadata["dp_cp_group"]
    num_local = module.num_local_experts
    num_global = module.ep_group.size() * num_local
    first_global = module.ep_group.rank() * num_local
    expert_dp_rank = module.dp_group.rank()

    sharded_state_dict: ShardedStateDict = {}
    for local_idx in range(num_local):
        global_idx = first_global + local_idx
        local_prefix = f"{prefix}local_experts.{local_idx}."
        if singleton_local_shards:
            sharded_prefix = f"{prefix}experts.{global_idx}."
            expert_offsets = tuple(sharded_offsets)
        else:
            sharded_prefix = f"{prefix}experts."
            expert_offsets = (
                *sharded_offsets,
                (len(sharded_offsets), global_idx, num_global),
            )
        expert_sd: ShardedStateDict = {}
        for proj in ("linear_fc1", "linear_fc2"):
            # What Column/RowParallelLinear.state_dict(keep_vars=True) holds: the parameter
            # itself (the optimizer maps its state to it by identity), no bias (LRMoE rejects
            # add_bias_linear) and the None extra state of a local linear.
            weight = getattr(module.local_experts[local_idx], proj).weight
            local_sd = {"weight": weight, _EXTRA_STATE: None}
            proj_sd = make_sharded_tensors_for_checkpoint(
                local_sd,
                f"{local_prefix}{proj}.",
                _TP_AXIS_MAP[proj],
                expert_offsets,
                tp_group=tp_group,
                dp_cp_group=dp_cp_group,
            )
            if proj == "linear_fc1" and module.config.gated_linear_unit:
                weight_key = f"{local_prefix}{proj}.weight"
                proj_sd[weight_key] = apply_swiglu_sharded_factory(
                    proj_sd[weight_key],
                    expert_offsets,
                    singleton_local_shards,
                    tp_group=tp_group,
                    dp_group=dp_cp_group,
                )
            expert_sd.update(proj_sd)
        # Global keys name experts by their offset (or global index), not by the local index.
        replace_prefix_for_sharding(expert_sd, local_prefix, sharded_prefix)
        for key, sh_ten in expert_sd.items():
            replica_id = sh_ten.replica_id
            assert (
                len(replica_id) == 3
            ), f"Expected replica_id for {key} to be in (PP, TP, DP) format, got: {replica_id}"
            # Experts are replicated over the expert-DP group, not the dense DP group.
            sh_ten.replica_id = (*replica_id[:2], expert_dp_rank)
        sharded_state_dict.update(expert_sd)
    return sharded_state_dict
