"""Checkpoint compatibility of ``LRGroupedMLP`` with Megatron's ``SequentialMLP``.

Shape legend: L local experts. ``weight1[i]`` <-> ``local_experts.{i}.linear_fc1.weight`` and
``weight2[i]`` <-> ``local_experts.{i}.linear_fc2.weight``: the stacked parameters are presented
under SequentialMLP's per-expert names in ``state_dict`` and accepted under them on load, so a
checkpoint written with LRMoE on loads with it off and vice versa.
"""

from __future__ import annotations

from typing import Any

import torch

_PROJ = (("weight1", "linear_fc1"), ("weight2", "linear_fc2"))


def expert_key(prefix: str, index: int, proj: str, leaf: str = "weight") -> str:
    """SequentialMLP's state-dict key of one expert's projection."""
    return f"{prefix}local_experts.{index}.{proj}.{leaf}"


def _to_sequential_keys(module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    for stacked, proj in _PROJ:
        value = state_dict.pop(prefix + stacked, None)
        if value is None:
            continue
        for i in range(value.shape[0]):
            state_dict[expert_key(prefix, i, proj)] = value[i]
            # SequentialMLP's local linears carry an (empty) extra state entry.
            state_dict[expert_key(prefix, i, proj, "_extra_state")] = None


def _from_sequential_keys(
    module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any
) -> None:
    num = module.num_local_experts
    for stacked, proj in _PROJ:
        keys = [expert_key(prefix, i, proj) for i in range(num)]
        if not all(k in state_dict for k in keys):
            continue  # strict loading reports the missing keys
        state_dict[prefix + stacked] = torch.stack([state_dict.pop(k) for k in keys])
        for i in range(num):
            state_dict.pop(expert_key(prefix, i, proj, "_extra_state"), None)


def install_sequential_mlp_state_dict_hooks(module: torch.nn.Module) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict`` speak SequentialMLP's key names."""
    module._register_state_dict_hook(_to_sequential_keys)
    module._register_load_state_dict_pre_hook(_from_sequential_keys, with_module=True)
