"""Local expert weights as one parameter per projection, with SequentialMLP-compatible checkpoints.

Shape legend: L local experts, H hidden, F expert ffn hidden, F1 = 2F when gated (SwiGLU, gate
half first).

Parameters: ``linear_fc1.weight: [L, F1, H]`` and ``linear_fc2.weight: [L, H, F]``; row ``i`` is
local expert ``i``'s ``SequentialMLP.local_experts.{i}.linear_fc1.weight`` /
``...linear_fc2.weight``. The grouped GEMMs of ``LRMoELayer``'s fused op read them directly (no
per-call stack) and return one gradient per projection, so autograd, Megatron's DDP hooks and the
optimizer see two parameters per layer.

Checkpoints stay interchangeable with ``SequentialMLP``:

* ``state_dict()`` presents the weights under SequentialMLP's per-expert names (views of the
  parameters, plus the ``_extra_state`` ``None`` entries of Megatron's local linears), and
  ``load_state_dict()`` accepts those names as well as the stacked ones;
* ``sharded_state_dict()`` (``checkpoint.py``) has SequentialMLP's global keys, shapes and replica
  ids, with one ``ShardedTensor`` / factory per projection whose data is the parameter itself.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrmoe.experts.activation import activation_spec_from_config

PROJECTIONS = ("linear_fc1", "linear_fc2")
_EXTRA_STATE = "_extra_state"


def sequential_mlp_key(prefix: str, index: int, proj: str, leaf: str = "weight") -> str:
    """SequentialMLP's ``state_dict`` key of local expert ``index``'s projection ``proj``."""
    return f"{prefix}local_experts.{index}.{proj}.{leaf}"


class ExpertProjection(torch.nn.Module):
    """One projection of every local expert: ``weight: [L, out, in]`` (Megatron's ``[out, in]``).

    Args:
        weight: The ``[L, out, in]`` parameter.
        partition_dim: Its tensor-parallel axis (fc1: 1, the output dim; fc2: 2, the input dim).
        expert_pgs: Whether the weight is reduced over the expert process groups (see
            :func:`uses_expert_process_groups`).
    """

    def __init__(self, weight: torch.nn.Parameter, partition_dim: int, expert_pgs: bool) -> None:
        super().__init__()
        self.weight = weight
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
        # allreduce=False routes a parameter to DDP's expert-data-parallel buffer and to the
        # expert optimizer, exactly when Megatron's expert linears set it.
        setattr(weight, "allreduce", not expert_pgs)


def uses_expert_process_groups(config: TransformerConfig) -> bool:
    """Whether Megatron's expert linears (``is_expert=True``) use the expert process groups.

    ``ColumnParallelLinear`` / ``RowParallelLinear`` set ``allreduce=False`` only then; at EP=1
    with expert TP = TP, SequentialMLP's weights are ordinary data-parallel parameters (dense DDP
    buffer, dense optimizer). Following the same rule keeps Megatron's DDP buckets and its
    (chained) optimizer, hence optimizer checkpoints, structured as for SequentialMLP.
    """
    return (
        config.expert_model_parallel_size > 1
        or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
    )


class LRGroupedMLP(MegatronModule):
    """The local experts' weights for ``LRMoELayer``'s fused dispatch/expert/combine op.

    Args:
        num_local_experts: L, experts held by this EP rank.
        config: The layer's ``TransformerConfig`` (``hidden_size``, ``moe_ffn_hidden_size``,
            ``gated_linear_unit``, ``params_dtype``, init methods, ``use_cpu_initialization``).
        pg_collection: Process groups (``ep``, ``expt_tp``, ``expt_dp``); default: Megatron's.
        name: Module name, as Megatron passes it.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: Optional[str] = None,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        self.name = name
        self.spec = activation_spec_from_config(config)
        hidden = config.hidden_size
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype, device=device))

        expert_pgs = uses_expert_process_groups(config)
        self.linear_fc1 = ExpertProjection(param(num_local_experts, fc1_out, hidden), 1, expert_pgs)
        self.linear_fc2 = ExpertProjection(param(num_local_experts, hidden, ffn), 2, expert_pgs)
        if config.perform_initialization:
            self._init_weights(config)
        self.register_state_dict_post_hook(_to_sequential_mlp_keys)
        self.register_load_state_dict_pre_hook(_from_sequential_mlp_keys)

    @torch.no_grad()
    def _init_weights(self, config: TransformerConfig) -> None:
        """Initialise expert by expert, fc1 then fc2, each from an fp32 master of its own shape.

        The order and shapes of the draws are those of the per-expert parameters this module had
        before it stacked them, so a given seed still gives the same weights.
        """
        w1, w2 = self.weights()

        def init_all() -> None:
            for i in range(self.num_local_experts):
                for weight, init in (
                    (w1, config.init_method),
                    (w2, config.output_layer_init_method),
                ):
                    master = torch.empty_like(weight[i], dtype=torch.float32)
                    init(master)
                    weight[i].copy_(master)

        if config.use_cpu_initialization:
            init_all()
        else:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_all()

    def weights(self) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        """The parameters ``(w1 [L, F1, H], w2 [L, H, F])``."""
        return self.linear_fc1.weight, self.linear_fc2.weight

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per local expert, ``(fc1 [F1, H], fc2 [H, F])`` views in SequentialMLP's orientation.

        The views share storage with the parameters (writes go through); for conversion tools
        and tests.
        """
        w1, w2 = self.weights()
        return [(w1[i], w2[i]) for i in range(self.num_local_experts)]

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Not used: ``LRMoELayer`` computes the experts inside its fused op.

        Raises:
            RuntimeError: Always. The experts' forward and (trimmed) backward are one autograd op
                with the dispatch and combine exchanges, which only ``LRMoELayer`` runs.
        """
        raise RuntimeError(
            f"LRGroupedMLP(name={self.name!r}).forward is not supported: the experts are computed "
            "by LRMoELayer's fused dispatch/expert/combine op (megatron_lrmoe.op), which reads "
            "weights() directly. Use LRGroupedMLP only inside LRMoELayer (build the layer with "
            "megatron_lrmoe.get_lrmoe_moe_spec or megatron_lrmoe.lrmoe_decoder_block_spec)."
        )

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """SequentialMLP's global keys, shapes and replica ids, one entry per projection.

        See :func:`megatron_lrmoe.experts.checkpoint.stacked_experts_sharded_state_dict`.
        """
        from megatron_lrmoe.experts.checkpoint import stacked_experts_sharded_state_dict

        return stacked_experts_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _to_sequential_mlp_keys(
    module: LRGroupedMLP, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: stacked weights -> SequentialMLP's per-expert entries.

    The module's entries are the last ones written when this runs, so popping and re-adding them
    keeps them where SequentialMLP's would be, in SequentialMLP's order (expert-major; per
    projection ``weight`` then the ``None`` extra state of Megatron's local linears). Values are
    ``stacked[i]``: views of the parameters (of the detached tensors without ``keep_vars``).
    """
    stacked = {proj: state_dict.pop(f"{prefix}{proj}.weight") for proj in PROJECTIONS}
    for i in range(module.num_local_experts):
        for proj, value in stacked.items():
            state_dict[sequential_mlp_key(prefix, i, proj)] = value[i]
            state_dict[sequential_mlp_key(prefix, i, proj, _EXTRA_STATE)] = None


def _from_sequential_mlp_keys(
    module: LRGroupedMLP,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook: accept SequentialMLP's per-expert entries as well as the stacked ones.

    ``state_dict`` is ``load_state_dict``'s own copy, so entries are rewritten in place: the L
    per-expert weights of a projection are stacked into ``{prefix}{proj}.weight`` and the
    ``_extra_state`` entries (``None`` for Megatron's local linears) are dropped. Per-expert keys
    beyond L (a checkpoint of another EP size) stay and are reported as unexpected.
    """
    num_local = module.num_local_experts
    for proj in PROJECTIONS:
        stacked_key = f"{prefix}{proj}.weight"
        keys = [sequential_mlp_key(prefix, i, proj) for i in range(num_local)]
        present = [k for k in keys if k in state_dict]
        for i in range(num_local):
            state_dict.pop(sequential_mlp_key(prefix, i, proj, _EXTRA_STATE), None)
        if not present:
            continue  # stacked (or missing: strict loading reports it)
        if stacked_key in state_dict:
            error_msgs.append(
                f"{type(module).__name__} at {prefix!r}: the state dict holds both {stacked_key} "
                f"and per-expert {present[0]}...; keep one layout"
            )
        elif len(present) != num_local:
            absent = sorted(set(keys) - set(present))
            error_msgs.append(
                f"{type(module).__name__} at {prefix!r}: per-expert {proj} weights for "
                f"{num_local} local experts expected, missing {absent}"
            )
        else:
            state_dict[stacked_key] = torch.stack([state_dict.pop(k) for k in keys])
