"""Megatron's six-stage alltoall dispatcher, with LRMoE's metadata and a fused middle.

Shape legend: T tokens on this rank, E experts, P EP ranks, L local experts, S pairs.

Stage 1 (``dispatch_preprocess``) gathers the ``[P, E]`` pair counts (the controller's input)
and starts their device-to-host copy without waiting for it, then builds the token <-> pair index
plan (``permutation.py``) on the device, but moves no rows. The host waits for the counts only
where it needs them (:meth:`LRAlltoAllTokenDispatcher.resolve`): the layer's plan and the split
sizes of the all-to-alls; at EP 1 without the controller that is after the whole forward is
queued, so the forward has no host round trip in front of the expert GEMMs. The pair plan is
built for ``T * topk`` pairs (every router of Megatron's that LRMoE accepts routes each token to
exactly ``topk`` experts: it is dropless); ``resolve`` checks that against the counts and
rebuilds it if a routing map had fewer pairs. the op in ``op.py`` takes the ``[T, H]`` tokens and
does the permutation, both all-to-alls, the experts and the un-permutation itself, because its
backward must differ from the autograd of those steps (the trimmed backward never materialises
a ``[S, H]`` gradient). Stages 2-5 are pass-throughs that only drive the shared-expert overlap
hooks at stock's points; stage 6 (``combine_postprocess``) restores the shape and adds the
shared-expert output.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import HostCounts
from megatron_lrmoe.dispatch.permutation import PairPermutation, permute_probs


class LRAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Alltoall dispatcher whose exchanges are done by LRMoE's fused expert op."""

    _pending: "HostCounts | None" = None
    _global_counts: torch.Tensor | None = None
    _device_counts: torch.Tensor | None = None  # [P, E] this call's counts where gathered
    _local_pairs: int = 0  # global_counts[ep_rank].sum() of the current call
    # Build the pair plan for T * topk pairs before the counts reach the host; turned off for
    # good the first time a routing map has fewer pairs (then every call waits first).
    expect_full_routing: bool = True

    def preprocess(self, routing_map: torch.Tensor) -> None:
        """Gather the global pair counts on the device and start copying them to the host.

        Nothing waits here; :meth:`resolve` (or reading :attr:`global_counts`) does.
        """
        # [E]; the int64 sum in one op (not a sum and a cast: one launch fewer on a GPU).
        num_local_tokens_per_expert = routing_map.sum(dim=0, dtype=torch.int64)
        counts = comm.all_gather_counts(num_local_tokens_per_expert, self.ep_group)  # [P, E]
        self._device_counts = counts
        self._pending = HostCounts(counts)
        self._global_counts = None
        if counts.device.type == "cpu":  # already on the host: nothing to wait for
            self._counts_to_host()

    @property
    def device_rows_per_local_expert(self) -> torch.Tensor:
        """``[L]`` forward rows per local expert, on the device: what the grouped GEMMs need
        when the forward runs before the counts reach the host (EP 1, where it is a view of
        this rank's counts: no kernel). Not built unless read (EP > 1 reads the host plan)."""
        lo = self.local_expert_indices[0]
        local = self._device_counts[:, lo : lo + self.num_local_experts]
        return local[0] if local.shape[0] == 1 else local.sum(0)

    @property
    def counts_on_host(self) -> bool:
        """Whether the host already has this call's counts (no wait to read them)."""
        return self._global_counts is not None

    @property
    def global_counts(self) -> torch.Tensor | None:
        """``[P, E]`` host int64 pair counts of the current call (waits for them once).

        Reading them also sets stock's split metadata (``input_splits``, ``output_splits``,
        ``num_global_tokens_per_local_expert``, ``num_out_tokens``) from them.
        """
        self._counts_to_host()
        return self._global_counts

    def _counts_to_host(self) -> None:
        if self._global_counts is None and self._pending is not None:
            # NOTE: device-to-host sync: split sizes and the quota plan are host integers
            # (stock syncs for its split sizes too; this is the one sync of the forward).
            global_counts = self._pending.wait()
            self._pending = None
            self._set_stock_metadata(global_counts)
            self._global_counts = global_counts

    def _set_stock_metadata(self, global_counts: torch.Tensor) -> None:
        # numpy views of the host counts: a torch CPU op costs several times a numpy one on
        # these few integers, and this runs once per call before the plan (same int64 values).
        counts = global_counts.numpy()
        lo = self.local_expert_indices[0]
        local = np.ascontiguousarray(counts[:, lo : lo + self.num_local_experts])
        row = counts[self.ep_rank]
        self._local_pairs = self.num_out_tokens = int(row.sum())
        self.input_splits = row.reshape(self.ep_size, self.num_local_experts).sum(1)
        self.output_splits = local.sum(1)
        self.output_splits_tp = self.output_splits.sum(keepdims=True)
        self.num_global_tokens_per_local_expert = torch.from_numpy(local)

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """Stage 1: counts (their host copy started, not waited for) and the pair index plan.

        Returns:
            ``[T, H]`` token rows (not permuted: the op gathers them) and the ``[S]`` routing
            weights in Megatron's pair order.
        """
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        self.preprocess(routing_map)
        self.tokens_per_expert = None
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden.view(self.hidden_shape))
        self.hidden_shape_before_permute = hidden.shape
        topk = self.config.moe_router_topk
        if self.expect_full_routing and not self.counts_on_host:
            num_pairs = routing_map.shape[0] * topk
        else:
            num_pairs = self._num_local_pairs()
        self.pair_permutation = PairPermutation.build(routing_map, num_pairs, topk)
        return hidden, permute_probs(probs, self.pair_permutation)

    def resolve(self, probs: torch.Tensor) -> torch.Tensor:
        """Wait for the counts and check the pair plan against them.

        Args:
            probs: ``[S]`` the routing weights ``dispatch_preprocess`` returned.

        Returns:
            ``probs``, or, when the routing map had fewer than ``T * topk`` pairs, the routing
            weights of the rebuilt pair plan (``pair_permutation`` is replaced; later calls
            wait for the counts before building it).
        """
        num_pairs = self._num_local_pairs()
        if num_pairs == self.pair_permutation.num_pairs:
            return probs
        self.expect_full_routing = False
        self.pair_permutation = PairPermutation.build(
            self.routing_map, num_pairs, self.config.moe_router_topk
        )
        return permute_probs(self.probs, self.pair_permutation)

    def _num_local_pairs(self) -> int:
        """Pairs of this rank's tokens, ``global_counts[ep_rank].sum()`` (waits for the counts,
        which sets it with stock's metadata)."""
        self._counts_to_host()
        return self._local_pairs

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Stage 6: the op already summed each token's pairs; shared-expert output added.

        The call's routing tensors go too: ``probs`` carries the autograd graph of everything
        before this layer, earlier layers' ops included, and kept here it would hold their
        contexts (each call's index plans) until this layer's next forward.
        """
        self.pair_permutation = self.probs = self.routing_map = None
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

    def token_dispatch(self, hidden_states, permuted_probs):
        """Stage 2, no communication here (the op exchanges); shared-expert fc1 hook."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
            self.shared_experts.linear_fc1_forward_and_act()
        return hidden_states, permuted_probs

    def dispatch_postprocess(self, hidden_states, probs):
        """Stage 3, pass-through: the op sorts rows by local expert itself.

        Returns stock's ``tokens_per_expert`` (host ``[L]`` rows per local expert) third.
        """
        tokens_per_expert = self.global_counts[:, self.local_expert_indices].sum(0)
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        """Stage 4, pass-through."""
        return hidden_states

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """Stage 5, no communication here; shared-expert fc2 hooks at the stock point."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
            self.shared_experts.linear_fc2_forward()
            self.shared_experts.post_forward_comm()
        return hidden_states
