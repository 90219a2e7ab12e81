"""Spec helpers: LRMoE MoE layers wherever Megatron's GPT specs put ``MoELayer``."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, Optional

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.experts.module import LRGroupedMLP
from megatron_lrmoe.layer import LRMoELayer


def _lrmoe_builder(submodules: MoESubmodules, lrmoe_config: LRMoEConfig) -> Callable[..., Any]:
    return partial(
        LRMoELayer,
        submodules=MoESubmodules(
            experts=LRGroupedMLP,
            shared_experts=submodules.shared_experts,
            router=submodules.router,
        ),
        lrmoe_config=lrmoe_config,
    )


def get_lrmoe_moe_spec(
    lrmoe_config: Optional[LRMoEConfig] = None,
    use_te: bool = False,
    num_experts: Optional[int] = None,
) -> Callable[..., Any]:
    """LRMoE counterpart of ``get_moe_module_spec``: call it as ``builder(config=...,
    pg_collection=..., [layer_number=..., is_mtp_layer=..., name=...])``.

    Args:
        lrmoe_config: LRMoE settings; ``None`` means keep ratio 1.0 (stock backward).
        use_te: Take the shared-expert linears from Transformer Engine (needs TE installed).
        num_experts: Only checked to be set, as in ``get_moe_module_spec``.
    """
    stock = get_moe_module_spec(use_te=use_te, num_experts=num_experts or 1, moe_grouped_gemm=False)
    return _lrmoe_builder(stock.keywords["submodules"], lrmoe_config or LRMoEConfig())


def _as_lrmoe(mlp: Any, lrmoe_config: LRMoEConfig) -> Any:
    """Return the LRMoE replacement of one layer's ``mlp`` builder, or it unchanged."""
    if isinstance(mlp, partial) and isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer):
        return _lrmoe_builder(mlp.keywords["submodules"], lrmoe_config)
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type):
        if issubclass(mlp.module, MoELayer):
            return _lrmoe_builder(mlp.submodules, lrmoe_config)
    return mlp


def lrmoe_layer_spec(layer_spec: ModuleSpec, lrmoe_config: LRMoEConfig) -> ModuleSpec:
    """A copy of one transformer layer spec with its MoE ``mlp`` made LRMoE."""
    new = copy.copy(layer_spec)
    submodules = copy.copy(layer_spec.submodules)
    if submodules is not None and hasattr(submodules, "mlp"):
        submodules.mlp = _as_lrmoe(submodules.mlp, lrmoe_config)
    new.submodules = submodules
    return new


def lrmoe_decoder_block_spec(block_spec: Any, lrmoe_config: LRMoEConfig) -> Any:
    """Turn a GPT decoder block spec (local or TE) into the same spec with LRMoE MoE layers.

    Accepts a ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec``), a ``ModuleSpec``
    whose submodules hold ``layer_specs``, or a single layer ``ModuleSpec``.
    """
    if isinstance(block_spec, ModuleSpec) and not hasattr(block_spec.submodules, "layer_specs"):
        return lrmoe_layer_spec(block_spec, lrmoe_config)
    holder = block_spec.submodules if isinstance(block_spec, ModuleSpec) else block_spec
    new_holder = copy.copy(holder)
    new_holder.layer_specs = [lrmoe_layer_spec(s, lrmoe_config) for s in holder.layer_specs]
    if isinstance(block_spec, ModuleSpec):
        new = copy.copy(block_spec)
        new.submodules = new_holder
        return new
    return new_holder
