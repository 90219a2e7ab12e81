"""Megatron's six-stage alltoall dispatcher, with LRMoE's metadata and a fused middle.

Shape legend: T tokens on this rank, E experts, P EP ranks, L local experts, S pairs.

Stage 1 (``dispatch_preprocess``) gathers the ``[P, E]`` pair counts (the controller's input,
one device-to-host copy, as stock's split sizes need) and builds the token <-> pair index plan
(``permutation.py``), but moves no rows: the op in ``op.py`` takes the ``[T, H]`` tokens and
does the permutation, both all-to-alls, the experts and the un-permutation itself, because its
backward must differ from the autograd of those steps (the trimmed backward never materialises
a ``[S, H]`` gradient). Stages 2-5 are pass-throughs that only drive the shared-expert overlap
hooks at stock's points; stage 6 (``combine_postprocess``) restores the shape and adds the
shared-expert output.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.permutation import PairPermutation, permute_probs


class LRAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Alltoall dispatcher whose exchanges are done by LRMoE's fused expert op."""

    global_counts: torch.Tensor | None = None

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Gather the global pair counts and set the stock split metadata from them.

        Returns:
            ``[L]`` host int64: pairs each local expert receives.
        """
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()  # [E]
        global_counts = comm.all_gather_counts(num_local_tokens_per_expert, self.ep_group)
        # NOTE: device-to-host sync: split sizes and the quota plan are host integers (stock
        # syncs for its split sizes too; this is the one sync of the forward metadata).
        global_counts = global_counts.cpu()
        self.global_counts = global_counts
        lo = self.local_expert_indices[0]
        local = global_counts[:, lo : lo + self.num_local_experts].contiguous()
        self.num_out_tokens = int(global_counts[self.ep_rank].sum())
        self.input_splits = (
            global_counts[self.ep_rank].reshape(self.ep_size, self.num_local_experts).sum(1).numpy()
        )
        self.output_splits = local.sum(1).numpy()
        self.output_splits_tp = self.output_splits.sum(keepdims=True)
        self.num_global_tokens_per_local_expert = local
        return local.sum(0)

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ):
        """Stage 1: metadata (one host sync, in ``preprocess``) and the pair index plan.

        Returns:
            ``[T, H]`` token rows (not permuted: the op gathers them) and the ``[S]`` routing
            weights in Megatron's pair order.
        """
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden.view(self.hidden_shape))
        self.hidden_shape_before_permute = hidden.shape
        perm = PairPermutation.build(routing_map, self.num_out_tokens, self.config.moe_router_topk)
        self.pair_permutation = perm
        return hidden, permute_probs(probs, perm)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Stage 6: the op already summed each token's pairs; shared-expert output added."""
        self.pair_permutation = None
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
        """Stage 3, pass-through: the op sorts rows by local expert itself."""
        tokens_per_expert = self.tokens_per_expert
        self.tokens_per_expert = None
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
