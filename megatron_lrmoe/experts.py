"""Grouped expert MLP with stacked weights, satisfying Megatron-Core's experts interface.

Shape legend: L local experts, H hidden, F expert ffn hidden, F1 = 2F when gated (SwiGLU).

Parameters are stacked so that one variable-size grouped GEMM covers all local experts:
``weight1: [L, F1, H]`` (row ``i`` is ``SequentialMLP.local_experts.i.linear_fc1.weight``) and
``weight2: [L, H, F]`` (``...linear_fc2.weight``). ``state_dict`` and ``sharded_state_dict``
use SequentialMLP's per-expert names (see ``checkpoint.py``), so checkpoints move freely between
this module, ``SequentialMLP`` and ``TEGroupedMLP``.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrmoe.ops import GroupedExpertMLP
from megatron_lrmoe.ops.activation import activation_spec_from_config


class LRGroupedMLP(MegatronModule):
    """Local experts as two stacked weights, computed with variable-size grouped GEMMs.

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
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_out, hidden, dtype=config.params_dtype, device=device)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            self._init_weights(config)
        for param, dim in ((self.weight1, 1), (self.weight2, 2)):
            # Expert weights are reduced over the expert-data-parallel group, like every
            # Megatron expert linear (allreduce=False routes them to the expert DP buffer).
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
            setattr(param, "allreduce", False)

        from megatron_lrmoe.checkpoint import install_sequential_mlp_state_dict_hooks

        install_sequential_mlp_state_dict_hooks(self)

    @torch.no_grad()
    def _init_weights(self, config: TransformerConfig) -> None:
        """Initialise each expert as Megatron initialises an expert linear."""

        def init_all() -> None:
            for i in range(self.num_local_experts):
                w1 = torch.empty_like(self.weight1[i], dtype=torch.float32)
                config.init_method(w1)
                self.weight1[i].copy_(w1)
                w2 = torch.empty_like(self.weight2[i], dtype=torch.float32)
                config.output_layer_init_method(w2)
                self.weight2[i].copy_(w2)

        if config.use_cpu_initialization:
            init_all()
        else:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                init_all()

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Megatron experts interface: rows grouped by local expert -> (output, None)."""
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64).cpu()
        out = GroupedExpertMLP.apply(
            permuted_local_hidden_states, permuted_probs, self.weight1, self.weight2, counts,
            self.spec,
        )
        return out, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """SequentialMLP's sharded layout (keys, offsets, SwiGLU factory); see ``checkpoint.py``."""
        from megatron_lrmoe.checkpoint import sequential_mlp_sharded_state_dict

        return sequential_mlp_sharded_state_dict(self, prefix, sharded_offsets, metadata)
