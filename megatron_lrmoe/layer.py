"""``LRMoELayer``: Megatron's ``MoELayer`` with LRMoE's dispatcher and fused expert op. Wiring only."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.dispatch.dispatcher import LRAlltoAllTokenDispatcher
from megatron_lrmoe.experts.module import LRGroupedMLP
from megatron_lrmoe.op import ExpertCall, LRMoEExpertsFunction
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.observe.stats import CallStats

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
        self._step: Optional[int] = None
        self._calls_in_step = 0
        self.last_call_stats: Optional[CallStats] = None

    def set_training_step(self, step: int) -> None:
        """Key the sampling stream by the training step (and the call within it).

        Without it the stream is keyed by a per-layer call counter, which restarts at 0 when a
        run is resumed; keyed by the step, a resumed run draws exactly what the uninterrupted run
        would have drawn, so no sampler state needs to be checkpointed.
        """
        if step != self._step:
            self._step = int(step)
            self._calls_in_step = 0

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Dispatch, experts and combine as one op whose backward is LRMoE's."""
        dispatcher = self.token_dispatcher
        dispatcher.tokens_per_expert = None
        call_index = self._call_index
        stream = (call_index,) if self._step is None else (self._step, self._calls_in_step)
        # Counted on grad-enabled calls only, so a recomputed forward (activation checkpointing)
        # draws the same sample stream as a plain one and reruns agree.
        if torch.is_grad_enabled():
            self._call_index += 1
            self._calls_in_step += 1
        plan = CallPlan.build(
            dispatcher.global_counts,
            ep_rank=dispatcher.ep_rank,
            num_local_experts=self.num_local_experts,
            lrmoe=self.lrmoe_config,
            layer_number=int(self.layer_number or 0),
            stream=stream,
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
        w1, w2 = self.experts.weights()
        output = LRMoEExpertsFunction.apply(hidden_states, probs, call, w1, w2)
        self.last_call_stats = stats
        return output, None


def set_lrmoe_training_step(model: Any, step: int) -> int:
    """Tell every ``LRMoELayer`` in ``model`` (a module or a list of model chunks) the step.

    Call it before each training step with the number of steps completed so far (Megatron's
    ``iteration``); ``lrmoe-pretrain`` does. Returns the number of layers updated.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LRMoELayer):
                module.set_training_step(step)
                count += 1
    return count
