"""``LRMoELayer``: Megatron's ``MoELayer`` with LRMoE's dispatcher and fused expert op. Wiring only."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.dispatcher import LRAlltoAllTokenDispatcher
from megatron_lrmoe.experts import LRGroupedMLP
from megatron_lrmoe.fused import ExpertCall, LRMoEExpertsFunction
from megatron_lrmoe.plan import CallPlan
from megatron_lrmoe.stats import CallStats

logger = logging.getLogger(__name__)


class LRMoELayer(MoELayer):
    """An MoE layer whose forward is stock and whose backward keeps a quota of pairs.

    Args:
        config: The layer's ``TransformerConfig`` (alltoall dispatcher, expert TP 1, dropless).
        submodules: ``MoESubmodules`` whose ``experts`` builds an ``LRGroupedMLP``.
        layer_number, pg_collection, is_mtp_layer, name: as for ``MoELayer``.
        lrmoe_config: How the backward is trimmed; ``None`` means ``LRMoEConfig()`` (keep 1.0).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
        lrmoe_config: Optional[LRMoEConfig] = None,
    ) -> None:
        self.lrmoe_config = lrmoe_config if lrmoe_config is not None else LRMoEConfig()
        layer_name = f"LRMoELayer(name={name!r}, layer_number={layer_number})"
        self.lrmoe_config.validate_against(config, layer_name)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            pg_collection=pg_collection,
            is_mtp_layer=is_mtp_layer,
            name=name,
        )
        self.token_dispatcher = LRAlltoAllTokenDispatcher(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=pg_collection,
        )
        if not isinstance(self.experts, LRGroupedMLP):
            raise ValueError(
                f"{layer_name}: MoESubmodules.experts built {type(self.experts).__name__}; LRMoE "
                "needs megatron_lrmoe.LRGroupedMLP (build the spec with "
                "megatron_lrmoe.get_lrmoe_moe_spec or megatron_lrmoe.lrmoe_decoder_block_spec)"
            )
        if self.use_shared_expert and self.shared_expert_overlap:
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        self._call_index = 0
        self.last_call_stats: Optional[CallStats] = None

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Dispatch, experts and combine as one op whose backward is LRMoE's."""
        dispatcher = self.token_dispatcher
        dispatcher.tokens_per_expert = None
        call_index = self._call_index
        # Counted on grad-enabled calls only, so a recomputed forward (activation checkpointing)
        # draws the same sample stream as a plain one and reruns agree.
        if torch.is_grad_enabled():
            self._call_index += 1
        plan = CallPlan.build(
            dispatcher.global_counts,
            ep_rank=dispatcher.ep_rank,
            num_local_experts=self.num_local_experts,
            lrmoe=self.lrmoe_config,
            layer_number=int(self.layer_number or 0),
            call_index=call_index,
        )
        stats = None
        if self.lrmoe_config.record_stats:
            stats = CallStats(
                layer_number=plan.layer_number,
                call_index=call_index,
                total_pairs=int(plan.global_counts.sum()),
                pairs_sent=int(plan.send_counts.sum()),
                quota_per_expert=plan.quota.tolist(),
                tokens_per_expert=plan.global_counts.sum(0).tolist(),
            )
        call = ExpertCall(
            plan=plan,
            lrmoe=self.lrmoe_config,
            spec=self.experts.spec,
            group=self.ep_group,
            stats=stats,
        )
        fc1, fc2 = self.experts.weight_params()
        output = LRMoEExpertsFunction.apply(hidden_states, probs, call, *fc1, *fc2)
        self.last_call_stats = stats
        return output, None
