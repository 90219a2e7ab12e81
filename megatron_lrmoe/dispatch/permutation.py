"""Token <-> pair permutation without atomics (the dispatcher's stages 1 and 6).

Shape legend: T tokens, E experts, K top-k (slots per token), S pairs (= routing_map.sum()).

Pairs are laid out exactly as Megatron's ``permute`` lays them out: sorted by expert, tokens in
ascending order inside an expert. Megatron's autograd turns the permutation's backward and the
unpermutation's forward into ``index_add``/``scatter_add`` over ``[T, H]``, i.e. atomic adds in
the activation dtype. Here both are gathers into a ``[T, K, H]`` view summed over K in the sum's
accumulation precision (fp32 for bf16): deterministic, no atomics, one rounding per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairPermutation:
    """Where every pair of this rank's tokens lives.

    Attributes:
        token_of_pair: ``[S]`` token of each pair, in pair (expert-major) order.
        expert_of_pair: ``[S]`` expert of each pair.
        pair_of_slot: ``[T*K]`` pair held by slot k of token t (``t*K + k``), ``S`` for an empty
            slot (a token routed to fewer than K experts).
        num_tokens: T.
        topk: K.
        complete: Every token has exactly K pairs (``S == T*K``): no empty slots.
    """

    token_of_pair: torch.Tensor
    expert_of_pair: torch.Tensor
    pair_of_slot: torch.Tensor
    num_tokens: int
    topk: int
    complete: bool

    @property
    def num_pairs(self) -> int:
        return self.token_of_pair.numel()

    @classmethod
    def build(cls, routing_map: torch.Tensor, num_pairs: int, topk: int) -> "PairPermutation":
        """Index plans from a ``[T, E]`` bool routing map with ``num_pairs`` True entries.

        ``num_pairs`` is known on the host from the all-gathered counts, so nothing here syncs.
        """
        num_tokens, num_experts = routing_map.shape
        flat = routing_map.t().reshape(-1)  # expert-major, token-ascending
        index = torch.nonzero_static(flat, size=num_pairs).squeeze(1)
        expert_of_pair = index // num_tokens
        token_of_pair = index % num_tokens
        slot_rank = torch.cumsum(routing_map, dim=1, dtype=torch.int64) - 1
        slot_of_pair = slot_rank[token_of_pair, expert_of_pair]
        if bool(num_pairs > num_tokens * topk):
            raise ValueError(
                f"routing map has {num_pairs} pairs for {num_tokens} tokens, more than "
                f"moe_router_topk ({topk}) per token"
            )
        pair_of_slot = torch.full(
            (num_tokens * topk,), num_pairs, dtype=torch.int64, device=routing_map.device
        )
        pair_of_slot.index_copy_(
            0,
            token_of_pair * topk + slot_of_pair,
            torch.arange(num_pairs, device=routing_map.device),
        )
        return cls(
            token_of_pair=token_of_pair,
            expert_of_pair=expert_of_pair,
            pair_of_slot=pair_of_slot,
            num_tokens=num_tokens,
            topk=topk,
            complete=num_pairs == num_tokens * topk,
        )


def _sum_slots(rows: torch.Tensor, perm: PairPermutation) -> torch.Tensor:
    """``[S, H] -> [T, H]``: out[t] = sum of the rows of t's pairs (empty slots add nothing)."""
    if not perm.complete:
        rows = torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])
    gathered = rows.index_select(0, perm.pair_of_slot)
    return gathered.view(perm.num_tokens, perm.topk, -1).sum(1, dtype=rows.dtype)


class PermuteTokens(torch.autograd.Function):
    """``[T, H] -> [S, H]``: one row per pair, pair order.

    Forward: gather. Backward: each token sums the gradient rows of its pairs (gather + sum over
    K slots). Saves only the index plan.
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, perm: PairPermutation) -> torch.Tensor:
        ctx.perm = perm
        return tokens.index_select(0, perm.token_of_pair)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_slots(grad.contiguous(), ctx.perm), None


class UnpermutePairs(torch.autograd.Function):
    """``[S, H] -> [T, H]``: each token sums its pairs' rows (weights already applied).

    Forward: gather + sum over K slots. Backward: gather of the token gradient to every pair.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, perm: PairPermutation) -> torch.Tensor:
        ctx.perm = perm
        return _sum_slots(rows.contiguous(), perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(0, ctx.perm.token_of_pair), None


def permute_probs(probs: torch.Tensor, perm: PairPermutation) -> torch.Tensor:
    """``[T, E] -> [S]``: the routing weight of each pair (autograd flows back into probs)."""
    flat = perm.token_of_pair * probs.shape[1] + perm.expert_of_pair
    return probs.reshape(-1).index_select(0, flat)
