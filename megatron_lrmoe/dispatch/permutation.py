"""Token <-> pair permutation as index plans (the dispatcher's stages 1 and 6).

Shape legend: T tokens, E experts, K top-k (slots per token), S pairs (= routing_map.sum()).

Pairs are laid out exactly as Megatron's ``permute`` lays them out: sorted by expert, tokens in
ascending order inside an expert. Megatron moves rows with ``index_select`` one way and an
atomic ``scatter_add`` over ``[T, H]`` the other way (the combine's unpermute and the dispatch's
backward). Here both directions are gathers: pairs take their token's row
(``tokens.index_select(0, token_of_pair)``) and tokens add up their pairs' rows through
``slot_pair`` (``dispatch.rows.gather_sum``), in fp32, slot by slot: deterministic, no atomics,
one rounding per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lrmoe.dispatch import pair_plan_triton


@dataclass(frozen=True)
class PairPermutation:
    """Where every pair of this rank's tokens lives.

    Attributes:
        token_of_pair: ``[S]`` int64 token of each pair, in pair (expert-major) order.
        expert_of_pair: ``[S]`` int64 expert of each pair.
        slot_pair: ``[T, K]`` int64 pair held by slot k of token t, ``-1`` for an empty slot (a
            token routed to fewer than K experts). Slots follow expert order within a token.
        num_tokens: T.
        topk: K.
        full: Every slot holds a pair (every token routed to K experts, the usual case), so
            ``slot_pair`` has no ``-1``.
    """

    token_of_pair: torch.Tensor
    expert_of_pair: torch.Tensor
    slot_pair: torch.Tensor
    num_tokens: int
    topk: int
    full: bool = False

    @property
    def num_pairs(self) -> int:
        return self.token_of_pair.numel()

    @classmethod
    def build(cls, routing_map: torch.Tensor, num_pairs: int, topk: int) -> "PairPermutation":
        """Index plans from a ``[T, E]`` bool routing map with ``num_pairs`` True entries.

        ``num_pairs`` is known on the host from the all-gathered counts, so nothing here syncs.
        On CUDA (Triton available, ``KernelOptions.triton`` on) the plan comes from two Triton
        kernels and one ``cumsum`` (``pair_plan_triton.pair_plan_triton``, about 15 kernels
        fewer than :func:`_build_torch`, the reference and the host path). A speculative
        ``num_pairs`` above the map's count (``dispatcher.expect_full_routing``) gives a plan
        with in-bounds indices, to be rebuilt once the real count is known.
        """
        num_tokens, num_experts = routing_map.shape
        if num_pairs > num_tokens * topk:
            raise ValueError(
                f"routing map has {num_pairs} pairs for {num_tokens} tokens, more than "
                f"moe_router_topk ({topk}) per token"
            )
        if pair_plan_triton.use_pair_plan_triton(routing_map):
            token_of_pair, expert_of_pair, slot_pair = pair_plan_triton.pair_plan_triton(
                routing_map, num_pairs, topk
            )
            return cls(
                token_of_pair=token_of_pair,
                expert_of_pair=expert_of_pair,
                slot_pair=slot_pair,
                num_tokens=num_tokens,
                topk=topk,
                full=num_pairs == num_tokens * topk,
            )
        return _build_torch(routing_map, num_pairs, topk)

    def slot_rows(self, kept_index: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` position in ``kept_index`` of each slot's pair, ``-1`` if dropped or empty.

        The reference of the trimmed backward's return path, which builds no ``[T, K]`` plan:
        the packing kernel writes each kept pair's row (``rows.pack_pairs(..., row_of_pair)``)
        and ``rows.gather_sum(rows, slot_pair, row_of=row_of_pair)`` maps every slot through
        it. Five small torch ops here, one ``torch.full`` there.

        Args:
            kept_index: ``[Kp]`` int64 pairs that have a row, in row order.

        Returns:
            The index plan with which ``gather_sum`` adds those rows back into their tokens.
        """
        device = kept_index.device
        row_of_pair = torch.full((self.num_pairs + 1,), -1, dtype=torch.int64, device=device)
        row_of_pair[kept_index] = torch.arange(kept_index.numel(), device=device)
        slots = self.slot_pair
        if not self.full:  # empty slots read the trailing -1
            slots = slots.masked_fill(slots < 0, self.num_pairs)
        return row_of_pair[slots]


def _build_torch(routing_map: torch.Tensor, num_pairs: int, topk: int) -> PairPermutation:
    """:meth:`PairPermutation.build` in torch ops: the reference of the Triton path, and the
    host path. Pairs past the map's True entries (a speculative ``num_pairs``) read token
    ``T - 1`` and expert ``E - 1``, as on the Triton path."""
    num_tokens, num_experts = routing_map.shape
    flat = routing_map.t().reshape(-1)  # expert-major, token-ascending
    index = torch.nonzero_static(flat, size=num_pairs, fill_value=flat.numel() - 1).squeeze(1)
    expert_of_pair = index // num_tokens
    token_of_pair = index % num_tokens
    if num_pairs == num_tokens * topk:
        # Every token has exactly K pairs: listing the pairs token-major (experts ascending
        # within a token, i.e. slot order) is the whole slot plan. The keys are unique.
        order = torch.argsort(token_of_pair * num_experts + expert_of_pair)
        return PairPermutation(
            token_of_pair=token_of_pair,
            expert_of_pair=expert_of_pair,
            slot_pair=order.view(num_tokens, topk),
            num_tokens=num_tokens,
            topk=topk,
            full=True,
        )
    return PairPermutation(
        token_of_pair=token_of_pair,
        expert_of_pair=expert_of_pair,
        slot_pair=_slot_pair_by_rank(routing_map, token_of_pair, expert_of_pair, topk),
        num_tokens=num_tokens,
        topk=topk,
    )


def _slot_pair_by_rank(
    routing_map: torch.Tensor, token_of_pair: torch.Tensor, expert_of_pair: torch.Tensor, topk: int
) -> torch.Tensor:
    """``[T, K]`` slot plan for any routing map (tokens may have fewer than K pairs): slot k of
    token t holds its k-th expert in ascending order, ``-1`` past its last pair."""
    num_tokens = routing_map.shape[0]
    num_pairs = token_of_pair.numel()
    device = routing_map.device
    slot_rank = torch.cumsum(routing_map, dim=1, dtype=torch.int64) - 1
    slot_of_pair = slot_rank[token_of_pair, expert_of_pair]
    slot_pair = torch.full((num_tokens * topk,), -1, dtype=torch.int64, device=device)
    slot_pair.index_copy_(
        0, token_of_pair * topk + slot_of_pair, torch.arange(num_pairs, device=device)
    )
    return slot_pair.view(num_tokens, topk)


def permute_probs(probs: torch.Tensor, perm: PairPermutation) -> torch.Tensor:
    """``[T, E] -> [S]``: the routing weight of each pair (autograd flows back into probs)."""
    flat = perm.token_of_pair * probs.shape[1] + perm.expert_of_pair
    return probs.reshape(-1).index_select(0, flat)
