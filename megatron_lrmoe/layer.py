"""``LRMoELayer``: Megatron's ``MoELayer`` with LRMoE's dispatcher and fused expert op. Wiring only."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.auto_keep import AutoKeepRatio
from megatron_lrmoe.dispatch.dispatcher import LRAlltoAllTokenDispatcher
from megatron_lrmoe.dispatch.replicas import ReplicaLayout
from megatron_lrmoe.dispatch.route import RowRoute
from megatron_lrmoe.experts.grouped_gemm import grouped_mm_backend, grouped_mm_backend_for
from megatron_lrmoe.experts.module import LRGroupedMLP
from megatron_lrmoe.experts.replica_weights import ReplicaWeightCache
from megatron_lrmoe.op import ExpertCall, lrmoe_experts
from megatron_lrmoe.control.controller import ControlPlan, check_budgets, plan_call
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.observe.stats import CallStats
from megatron_lrmoe.options import using_kernels, warn_retired_environment

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
        warn_retired_environment()
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
        self._layer_name = layer_name
        self._cost: Optional[CostModel] = None
        self._check_controller(self.lrmoe_config)
        self._call_index = 0
        self._backward_index = 0
        self._step: Optional[int] = None
        self._backwards_in_step = 0
        self._stats_listeners: dict[int, Callable[[int, CallStats], None]] = {}
        self.last_call_stats: Optional[CallStats] = None
        # Replica weights of other ranks' experts: a plain attribute, never a parameter or
        # buffer (not in state_dict, DDP buffers, the optimizer or checkpoints).
        self._replica_cache = ReplicaWeightCache()
        # keep_ratio "auto": the keep ratio state, and the config resolved per keep ratio.
        self._auto_keep: Optional[AutoKeepRatio] = None
        self._resolved: dict[float, LRMoEConfig] = {}
        self._resolved_from: Optional[LRMoEConfig] = None
        # Loaded weights invalidate every replica fetched before (all ranks load together).
        self.register_load_state_dict_post_hook(_clear_replica_cache)

    def set_training_step(self, step: int) -> None:
        """Key the sampling stream by the training step (and the backward call within it).

        Without it the stream is keyed by a per-layer backward counter, which restarts at 0 when
        a run is resumed; keyed by the step, a resumed run draws exactly what the uninterrupted
        run would have drawn, so no sampler state needs to be checkpointed.

        The step also keys the replica weight cache: replicas fetched from their owners are
        reused within a step (weights change only at optimizer steps) and fetched again when
        the step changes.
        """
        if step != self._step:
            self._step = int(step)
            self._backwards_in_step = 0

    def invalidate_replica_weights(self) -> None:
        """Drop every cached replica weight, so that the next call fetches from the owners.

        Needed only when the experts' weights change within one training step by other means
        than ``load_state_dict`` (which already drops them); call it on every EP rank.
        """
        self._replica_cache.clear()

    def _check_controller(self, lrmoe: LRMoEConfig) -> None:
        """Start-up checks of what the controller plans (budgets that can never be met)."""
        if lrmoe.max_replicas_per_rank > 0 and lrmoe.scope == "global":
            raise ValueError(
                f"{self._layer_name}: max_replicas_per_rank={lrmoe.max_replicas_per_rank} with "
                "scope='global' is not supported: with replicas the backward plan assigns each "
                "holder its kept pairs per source before the owner's global selection could "
                "run; use --lrmoe-scope local or --lrmoe-max-replicas-per-rank 0"
            )
        if _uses_controller(lrmoe):
            check_budgets(lrmoe, self._cost_model(), None, self._layer_name)

    def _cost_model(self) -> CostModel:
        if self._cost is None:
            self._cost = CostModel.from_config(self.config)
        return self._cost

    def next_sample_stream(self) -> tuple[int, ...]:
        """The sampling stream's key for the backward now running (the op calls it once).

        Counted in backward, where every real call runs exactly once whatever activation
        checkpointing does to the forward (Megatron's and torch's reentrant checkpoints run the
        forward twice, torch's non-reentrant one runs it twice with gradients enabled).
        """
        key = (
            (self._backward_index,)
            if self._step is None
            else (self._step, self._backwards_in_step)
        )
        self._backward_index += 1
        self._backwards_in_step += 1
        return key

    @property
    def global_layer_number(self) -> Optional[int]:
        """This layer's number in the model, multi-token-prediction layers after the decoder's.

        Megatron numbers the layers inside an MTP block from 1 again (``layer_number`` 1, 2, ..
        per depth); its router logs their auxiliary losses as ``num_layers + layer_number``, and
        so does this: the key of the layer's sampling streams, statistics (``LRMoEMetrics``'
        per-layer vectors hold ``num_layers + mtp_num_layers`` entries) and routing traces.
        ``None`` for a layer built without a number.
        """
        if self.layer_number is None:
            return None
        number = int(self.layer_number)
        return number + self.config.num_layers if self.is_mtp_layer else number

    def add_stats_listener(self, fn: Callable[[int, CallStats], None]) -> "_ListenerHandle":
        """Call ``fn(layer_number, stats)`` for every call made with gradients enabled
        (``layer_number``: :attr:`global_layer_number`, 1 for a layer built without one).

        The stats are filled by the call's backward later (``stats.backward_done``). This sees
        calls that module forward hooks miss: the recomputed forward of Megatron's MoE-layer
        activation checkpointing runs inside backward, not through ``__call__``.

        Returns:
            A handle whose ``remove()`` unsubscribes ``fn``.
        """
        key = id(fn)
        self._stats_listeners[key] = fn
        return _ListenerHandle(self._stats_listeners, key)

    def preprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ):
        """Megatron's ``preprocess`` (the dispatcher's counts and pair plan) with this layer's
        kernel options active (``LRMoEConfig.kernels``, ``megatron_lrmoe/options.py``); it runs
        again, outside :meth:`forward`, when Megatron recomputes the MoE layer in backward."""
        with using_kernels(self.lrmoe_config.kernels):
            return super().preprocess(hidden_states, probs, routing_map)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Dispatch, experts and combine as one op whose backward is LRMoE's, with this layer's
        kernel options active (``LRMoEConfig.kernels``; the op's backward makes the call's
        active again).

        Args:
            hidden_states: ``[T, H]`` this rank's tokens (the dispatcher does not permute).
            probs: ``[S]`` routing weight of each pair in Megatron's pair order.

        Returns:
            ``([T, H] routed experts' output, None)``.
        """
        with using_kernels(self.lrmoe_config.kernels):
            return self._routed_experts_compute(hidden_states, probs)

    def _routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        dispatcher = self.token_dispatcher
        call_index = self._call_index
        if torch.is_grad_enabled():
            self._call_index += 1
        lrmoe = self._call_config()
        # At EP 1 without the controller the forward needs no host integer when its grouped
        # GEMMs take device offsets: launch it before waiting for the counts (the plan, which
        # only the backward needs, is built behind it). The per-expert loop reads host sizes.
        weights = self.experts.weights()
        deferred = (
            not _uses_controller(lrmoe)
            and dispatcher.ep_size == 1
            and self._gemms_take_device_offsets(hidden_states, weights)
        )
        if deferred:
            resolved_first = dispatcher.counts_on_host
            if resolved_first:  # nothing to wait for (CPU): check the pair plan now
                probs = dispatcher.resolve(probs)
            call = self._expert_call(lrmoe)
            output = self._experts(hidden_states, probs, call, weights)
            if not resolved_first:
                resolved = dispatcher.resolve(probs)
                if resolved is not probs:  # fewer pairs than T * topk: run it again, rebuilt
                    probs, call = resolved, self._expert_call(lrmoe)
                    output = self._experts(hidden_states, probs, call, weights)
            plan, layout, fetched = self._plan(None, lrmoe), None, 0
        else:
            probs = dispatcher.resolve(probs)
            control = layout = replica_weights = None
            fetched = 0
            if _uses_controller(lrmoe):
                # Budgets, replicas, or the save/recompute choice: the controller plans the
                # call (host only).
                if lrmoe.max_replicas_per_rank > 0:
                    self._check_controller(lrmoe)  # the config may have been swapped since
                control = plan_call(
                    dispatcher.global_counts, dispatcher.ep_rank, lrmoe, self._cost_model()
                )
                if control.num_replicas > 0:
                    layout = ReplicaLayout.build(control, dispatcher.pair_permutation)
                    # No gradients (evaluation) may run after an optimizer step with the step not
                    # yet announced: fetch afresh then, without touching the cache.
                    step = self._step if torch.is_grad_enabled() else None
                    w1, w2 = weights
                    replica_weights = self._replica_cache.weights(
                        layout, w1, w2, self.ep_group, step
                    )
                    fetched = self._replica_cache.last_fetched
            plan = self._plan(control, lrmoe)
            call = self._expert_call(lrmoe, plan, layout, replica_weights)
            output = self._experts(hidden_states, probs, call, weights)
        # The op reads the statistics only in backward: filled here, behind the forward's work.
        stats = self._call_stats(plan, layout, call_index, fetched)
        call.complete(stats, plan if call.planned is None else None)
        self.last_call_stats = stats
        if stats is not None and torch.is_grad_enabled():
            for fn in list(self._stats_listeners.values()):
                fn(self.global_layer_number or 1, stats)
        return output, None

    def _gemms_take_device_offsets(
        self,
        hidden_states: torch.Tensor,
        weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> bool:
        """Whether both forward grouped GEMMs run as torch's grouped_mm (no host group sizes).

        ``weights``: the experts' ``(w1, w2)`` when the caller has them at hand.
        """
        w1, w2 = self.experts.weights() if weights is None else weights
        # fc2's row operand is the activation: hidden's dtype and device, w2's input width.
        return grouped_mm_backend(hidden_states, w1) == "torch_grouped_mm" and (
            grouped_mm_backend_for(hidden_states.dtype, hidden_states.device, w2.shape[2], w2)
            == "torch_grouped_mm"
        )

    def _call_config(self) -> LRMoEConfig:
        """The config this call runs with: the layer's, or with ``keep_ratio="auto"`` the layer's
        at the keep ratio :class:`AutoKeepRatio` gives for this call."""
        lrmoe = self.lrmoe_config
        if not lrmoe.is_auto:
            return lrmoe
        if self._resolved_from is not lrmoe:  # first call, or the config was swapped
            self._auto_keep = AutoKeepRatio(float(lrmoe.variance_target))
            self._resolved, self._resolved_from = {}, lrmoe
        keep = self._auto_keep.keep_ratio()
        resolved = self._resolved.get(keep)
        if resolved is None:
            resolved = self._resolved[keep] = lrmoe.at_keep_ratio(keep)
        return resolved

    @property
    def auto_keep(self) -> Optional[AutoKeepRatio]:
        """The keep ratio state with ``keep_ratio="auto"`` (after the first call), else None."""
        return self._auto_keep if self.lrmoe_config.is_auto else None

    def _plan(self, control: Optional[ControlPlan], lrmoe: LRMoEConfig) -> CallPlan:
        dispatcher = self.token_dispatcher
        layer_number = self.global_layer_number or 0
        if control is not None:
            return CallPlan.from_control(control, layer_number, ())
        return CallPlan.build(
            dispatcher.global_counts,
            ep_rank=dispatcher.ep_rank,
            num_local_experts=self.num_local_experts,
            lrmoe=lrmoe,
            layer_number=layer_number,
            stream=(),
        )

    def _expert_call(
        self,
        lrmoe: LRMoEConfig,
        plan: Optional[CallPlan] = None,
        layout: Optional[ReplicaLayout] = None,
        replica_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> ExpertCall:
        """The op's context; without ``plan`` (deferred) the forward rows come from the device."""
        dispatcher = self.token_dispatcher
        return ExpertCall(
            planned=plan,
            lrmoe=lrmoe,
            spec=self.experts.spec,
            route=RowRoute.build(dispatcher.pair_permutation, plan, layout, self.ep_group),
            sample_stream=self.next_sample_stream,
            replica_weights=replica_weights,
            device_rows=dispatcher.device_rows_per_local_expert if plan is None else None,
            fuse_grad_accumulation=lrmoe.fuses_grad_accumulation(self.config),
            auto_keep=self.auto_keep if torch.is_grad_enabled() else None,
        )

    def _experts(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor,
        call: ExpertCall,
        weights: tuple[torch.Tensor, torch.Tensor],
    ):
        w1, w2 = weights
        return lrmoe_experts(hidden_states, probs, call, w1, w2)

    def _call_stats(
        self,
        plan: CallPlan,
        layout: Optional[ReplicaLayout],
        call_index: int,
        fetched: int,
    ) -> Optional[CallStats]:
        """This call's statistics (``record_stats``), from its plan."""
        if not self.lrmoe_config.record_stats:
            return None
        # One reduction on a numpy view of the host counts, the rest summed from its list: a
        # torch CPU op costs several microseconds of host time each, and this runs in every
        # forward (tests/test_layer.py compares the counts with torch sums over the counts).
        counts = plan.global_counts.numpy()
        tokens_per_expert = counts.sum(0).tolist()
        stats = CallStats(
            layer_number=plan.layer_number,
            call_index=call_index,
            total_pairs=sum(tokens_per_expert),
            pairs_sent=int(counts[plan.ep_rank].sum()),
            quota_per_expert=plan.quota.tolist(),
            tokens_per_expert=tokens_per_expert,
            control=plan.control,
            global_counts=plan.global_counts,
        )
        if plan.control is not None:
            stats.replicas_placed = plan.control.num_replicas
            stats.planned_forward_peak = plan.control.forward_peak
            stats.planned_backward_peak = plan.control.backward_peak
        if layout is not None:
            stats.replica_experts = list(layout.replicas_of[layout.ep_rank])
            stats.replicas_fetched = fetched
            rows = layout.rows_per_instance
            stats.forward_per_replica = rows[layout.num_owned :].tolist()
            stats.forward_rows = int(rows.sum())
        else:  # the local experts' rows: their columns of the counts, summed over sources
            stats.forward_rows = sum(tokens_per_expert[plan.local_experts])
        return stats


def _uses_controller(lrmoe: LRMoEConfig) -> bool:
    """Whether calls need the full controller (budgets, ``auto`` mode, replicas)."""
    return (
        lrmoe.memory_budget_bytes is not None
        or lrmoe.exchange_budget_bytes is not None
        or lrmoe.activation_mode == "auto"
        or lrmoe.max_replicas_per_rank > 0
    )


def _clear_replica_cache(module: "LRMoELayer", incompatible_keys: Any) -> None:
    module.invalidate_replica_weights()


class _ListenerHandle:
    """Unsubscribes one stats listener (``LRMoELayer.add_stats_listener``)."""

    def __init__(self, listeners: dict, key: int) -> None:
        self._listeners, self._key = listeners, key

    def remove(self) -> None:
        self._listeners.pop(self._key, None)


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
