"""Grouped expert MLP with SequentialMLP's parameters, satisfying Megatron-Core's experts interface.

Shape legend: L local experts, H hidden, F expert ffn hidden, F1 = 2F when gated (SwiGLU).

Every expert keeps its own parameters under SequentialMLP's names
(``local_experts.{i}.linear_fc1.weight: [F1, H]``, ``local_experts.{i}.linear_fc2.weight:
[H, F]``), so ``state_dict``, ``sharded_state_dict``, Megatron's DDP buffers and the optimizer
(including its checkpoints, which map optimizer state to model parameters by identity) treat
them exactly like stock experts. The compute stacks them into ``[L, F1, H]`` / ``[L, H, F]`` for
one grouped GEMM per projection; the stack is made in forward and again in backward rather than
kept, so it costs no activation memory between the two.
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


class ExpertLinear(torch.nn.Module):
    """One expert projection's weight, named and checkpointed like Megatron's local linears."""

    def __init__(self, weight: torch.nn.Parameter, partition_dim: int) -> None:
        super().__init__()
        self.weight = weight
        # Expert weights are reduced over the expert-data-parallel group, like every Megatron
        # expert linear (allreduce=False routes them to the expert DP buffer).
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
        setattr(weight, "allreduce", False)

    def get_extra_state(self) -> None:
        """Megatron's local linears carry an empty extra state; keep the key for compatibility."""
        return None

    def set_extra_state(self, state: Any) -> None:
        """Nothing to restore (the entry exists for checkpoint-key compatibility)."""


class ExpertWeights(torch.nn.Module):
    """The two projections of one expert (``linear_fc1``, ``linear_fc2``)."""

    def __init__(self, fc1: torch.nn.Parameter, fc2: torch.nn.Parameter) -> None:
        super().__init__()
        self.linear_fc1 = ExpertLinear(fc1, partition_dim=0)
        self.linear_fc2 = ExpertLinear(fc2, partition_dim=1)


class LRGroupedMLP(MegatronModule):
    """Local experts computed with variable-size grouped GEMMs.

    Used by ``LRMoELayer`` through its fused dispatch/expert/combine op; ``forward`` also
    implements Megatron's ``ExpertsInterface`` so the module works as a drop-in experts module.
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

        self.local_experts = torch.nn.ModuleList(
            ExpertWeights(param(fc1_out, hidden), param(hidden, ffn))
            for _ in range(num_local_experts)
        )
        if config.perform_initialization:
            self._init_weights(config)

    @torch.no_grad()
    def _init_weights(self, config: TransformerConfig) -> None:
        """Initialise each expert as Megatron initialises an expert linear."""

        def init_all() -> None:
            for expert in self.local_experts:
                for linear, init in (
                    (expert.linear_fc1, config.init_method),
                    (expert.linear_fc2, config.output_layer_init_method),
                ):
                    master = torch.empty_like(linear.weight, dtype=torch.float32)
                    init(master)
                    linear.weight.copy_(master)

        if config.use_cpu_initialization:
            init_all()
        else:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_all()

    def weight_params(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """The per-expert fc1 and fc2 parameters, in local expert order."""
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        return fc1, fc2

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([L, F1, H], [L, H, F])`` copies of the weights (autograd flows to the experts)."""
        fc1, fc2 = self.weight_params()
        return torch.stack(fc1), torch.stack(fc2)

    def stacked_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([L, F1, H], [L, H, F])`` of the current ``.grad`` of every expert weight."""
        fc1, fc2 = self.weight_params()
        return torch.stack([p.grad for p in fc1]), torch.stack([p.grad for p in fc2])

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([L, F1, H], [L, H, F])`` expert weights for the op (autograd reaches the experts)."""
        return self.stacked_weights()

    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Not used: LRMoELayer computes its experts inside its own op (``op.py``)."""
        raise RuntimeError(
            f"{type(self).__name__} is computed by LRMoELayer's fused op; build the layer with "
            "megatron_lrmoe.get_lrmoe_moe_spec instead of calling the experts module directly"
        )

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        """Same keys, shapes and sharding as ``SequentialMLP.sharded_state_dict``."""
        from megatron_lrmoe.experts.checkpoint import sequential_mlp_sharded_state_dict

        return sequential_mlp_sharded_state_dict(self, prefix, sharded_offsets, metadata)
