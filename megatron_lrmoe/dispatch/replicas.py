"""Index plans for a layer call whose controller placed replicas of hot experts.

Shape legend: P EP ranks, E experts, L = E/P owned experts per rank (rank r owns
``[r*L, (r+1)*L)``), I instances on this rank (its L owned experts, then its replicas of this
call, ascending expert id), S pairs this rank sends, T tokens, K top-k.

Orders of one source rank's pairs:

* pair order: Megatron's permute order (by expert, tokens ascending), the op's ``probs`` input
  and :class:`~megatron_lrmoe.dispatch.permutation.PairPermutation`'s order.
* line order: the same, each expert's segment cut into consecutive sub-chunks per holder by the
  controller's line rule (owner first, then the replicas by rank; ``ControlPlan`` docstring).
  A permutation-free refinement of pair order: selection in ``save`` mode runs on these
  sub-chunks.
* send order: ``(destination rank, instance)`` major: for each destination g and each instance
  of g, the sub-chunk of the source's expert segment that the plan assigns to g. It is what the
  all-to-all sends and what the receiver gets as ``[source][instance]`` rank-major rows.

Without replicas send order is pair order and none of this is built (the op keeps its plain path).
Everything here is host int64 planning plus a few device gathers of ``[S]`` / ``[T, K]`` int64
indices, built once per call; nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from megatron_lrmoe.dispatch.compaction import chunk_gather_index, exclusive_cumsum
from megatron_lrmoe.dispatch.permutation import PairPermutation

if TYPE_CHECKING:
    from megatron_lrmoe.control.controller import ControlPlan

__all__ = ["KeptLayout", "ReplicaLayout", "line_starts"]


def line_starts(parts: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """``[E, P]`` start of each holder's sub-chunk inside one source's expert segment.

    Args:
        parts: ``[E, P]`` host int64 pairs of the source's segment of expert e on holder g.
        owner: ``[E]`` owner rank of every expert.

    Returns:
        Offsets in line order: the owner's sub-chunk first, then the other holders by rank.
    """
    rows = torch.arange(parts.shape[0])
    before = parts.cumsum(1) - parts
    first = parts[rows, owner]
    lo = before + first[:, None] * (torch.arange(parts.shape[1])[None, :] < owner[:, None])
    lo[rows, owner] = 0
    return lo


@dataclass(frozen=True, eq=False)
class KeptLayout:
    """Where this source's kept pairs go in backward (host plan plus one device index).

    Attributes:
        send_index: ``[Ks]`` device int64: row j of the exchange is kept pair
            ``kept_index[send_index[j]]`` (kept pairs listed in pair order).
        send_totals: ``[P, 1]`` host int64 kept rows sent to each rank.
        recv_counts: ``[P, I]`` host int64 kept rows this rank's instances receive per source.
    """

    send_index: torch.Tensor
    send_totals: torch.Tensor
    recv_counts: torch.Tensor


@dataclass(frozen=True, eq=False)
class ReplicaLayout:
    """This rank's instances and the send-order index plans of one call with replicas.

    Attributes:
        ep_rank: This rank.
        ep_size: P.
        num_owned: L.
        owner: ``[E]`` host owner rank of every expert.
        replicas_of: Per rank, the experts it holds as replicas this call (ascending); the same
            tuple on every rank.
        instances: ``[I]`` host expert id of each local instance (owned, then replicas).
        chunk_expert: ``[C]`` host expert of each send chunk, send order (destination-major).
        chunk_rank: ``[C]`` host destination of each send chunk.
        send_counts: ``[C]`` host rows of each send chunk.
        send_totals: ``[P, 1]`` host rows sent to each rank.
        recv_counts: ``[P, I]`` host rows received per (source, instance), rank-major.
        send_perm: ``[S]`` device pair (in pair order) of each send-order row.
        pair_to_send: ``[S]`` device send-order row of each pair (the inverse permutation).
        token_of_send: ``[S]`` device token of each send-order row.
        slot_send: ``[T, K]`` device send-order row of each token slot (``-1`` if empty).
    """

    ep_rank: int
    ep_size: int
    num_owned: int
    owner: torch.Tensor
    replicas_of: tuple[tuple[int, ...], ...]
    instances: torch.Tensor
    chunk_expert: torch.Tensor
    chunk_rank: torch.Tensor
    send_counts: torch.Tensor
    send_totals: torch.Tensor
    recv_counts: torch.Tensor
    send_perm: torch.Tensor
    pair_to_send: torch.Tensor
    token_of_send: torch.Tensor
    slot_send: torch.Tensor

    @classmethod
    def build(cls, control: "ControlPlan", perm: PairPermutation) -> "ReplicaLayout":
        """The layout of ``control`` (which placed replicas) for this rank's pairs ``perm``.

        Every rank derives the same chunk order from the plan, so a source's send order is
        exactly the rank-major order its destinations expect.
        """
        rank, num_ranks = control.ep_rank, control.ep_size
        num_experts = control.counts.shape[1]
        owner = control.owner
        # Send chunks: every (destination g, expert e held by g), g-major; within g its owned
        # experts first, then its replicas, each ascending.
        holder, expert = control.holds.t().nonzero(as_tuple=True)
        is_replica = (owner[expert] != holder).to(torch.int64)
        order = torch.argsort(holder * 2 * num_experts + is_replica * num_experts + expert)
        chunk_rank, chunk_expert = holder[order], expert[order]
        replica = is_replica[order].bool()
        grouped: list[list[int]] = [[] for _ in range(num_ranks)]
        for g, e in zip(chunk_rank[replica].tolist(), chunk_expert[replica].tolist()):
            grouped[g].append(e)  # ascending within g: the chunk order
        replicas_of = tuple(tuple(experts) for experts in grouped)
        instances = chunk_expert[chunk_rank == rank]

        forward = control.forward_send_counts(rank)  # [E, P]
        segment_start = exclusive_cumsum(control.counts[rank])  # [E] in pair order
        starts = segment_start[chunk_expert] + line_starts(forward, owner)[chunk_expert, chunk_rank]
        send_counts = forward[chunk_expert, chunk_rank]
        send_totals = torch.zeros(num_ranks, dtype=torch.int64)
        send_totals.index_add_(0, chunk_rank, send_counts)
        recv_counts = control.forward_recv_counts(rank)[:, instances].contiguous()

        device = perm.token_of_pair.device
        send_perm = chunk_gather_index(starts, send_counts, device)
        num_pairs = send_perm.numel()
        # One extra entry, -1, for empty slots (a token routed to fewer than K experts).
        pair_to_send = torch.full((num_pairs + 1,), -1, dtype=torch.int64, device=device)
        pair_to_send[send_perm] = torch.arange(num_pairs, device=device)
        slots = perm.slot_pair
        slot_send = pair_to_send[slots.masked_fill(slots < 0, num_pairs)]
        pair_to_send = pair_to_send[:num_pairs]
        return cls(
            ep_rank=rank,
            ep_size=num_ranks,
            num_owned=control.num_local_experts,
            owner=owner,
            replicas_of=replicas_of,
            instances=instances,
            chunk_expert=chunk_expert,
            chunk_rank=chunk_rank,
            send_counts=send_counts,
            send_totals=send_totals.unsqueeze(1),
            recv_counts=recv_counts,
            send_perm=send_perm,
            pair_to_send=pair_to_send,
            token_of_send=perm.token_of_pair.index_select(0, send_perm),
            slot_send=slot_send,
        )

    @property
    def num_replicas(self) -> int:
        """Replicas on this rank this call."""
        return len(self.replicas_of[self.ep_rank])

    @cached_property
    def send_splits(self) -> list[int]:
        return self.send_totals.reshape(-1).tolist()

    @cached_property
    def recv_splits(self) -> list[int]:
        return self.recv_counts.sum(1).tolist()

    @cached_property
    def rows_per_instance(self) -> torch.Tensor:
        """``[I]`` rows each instance computes in forward."""
        return self.recv_counts.sum(0)

    def kept_layout(self, backward_send: torch.Tensor, backward_recv: torch.Tensor) -> KeptLayout:
        """The backward exchange of kept pairs, from the plan's per-source backward split.

        Args:
            backward_send: ``[E, P]`` ``ControlPlan.backward_send_counts(this rank)``: kept pairs
                of each expert this source sends to each holder. Its kept pairs, listed in pair
                order, come per expert in line-order sub-chunks of these sizes (``save`` mode
                selects per forward sub-chunk; ``recompute`` splits each expert's kept pairs by
                the line rule), so one chunk gather puts them in send order.
            backward_recv: ``[P, E]`` ``ControlPlan.backward_recv_counts(this rank)``.
        """
        owner = self.owner
        kept_start = exclusive_cumsum(backward_send.sum(1))  # [E] in kept (pair) order
        starts = (
            kept_start[self.chunk_expert]
            + line_starts(backward_send, owner)[self.chunk_expert, self.chunk_rank]
        )
        sizes = backward_send[self.chunk_expert, self.chunk_rank]
        totals = torch.zeros(self.ep_size, dtype=torch.int64)
        totals.index_add_(0, self.chunk_rank, sizes)
        return KeptLayout(
            send_index=chunk_gather_index(starts, sizes, self.send_perm.device),
            send_totals=totals.unsqueeze(1),
            recv_counts=backward_recv[:, self.instances].contiguous(),
        )

    def selection_segments(
        self, control: "ControlPlan"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``save`` mode: this source's forward sub-chunks in line order, as selection segments.

        Returns:
            ``(counts [G], quota [G], start [G])`` host int64: pairs, kept pairs
            (``backward_send_counts``, at most the pairs: the holder saved their activations)
            and pair-order start of every (expert, holder) sub-chunk with the holder holding the
            expert, experts ascending, holders in line order (owner first, then by rank).
        """
        rank, owner = self.ep_rank, self.owner
        num_ranks = self.ep_size
        forward = control.forward_send_counts(rank)
        backward = control.backward_send_counts(rank)
        expert, holder = control.holds.nonzero(as_tuple=True)
        line_key = torch.where(holder == owner[expert], 0, holder + 1)
        order = torch.argsort(expert * (num_ranks + 1) + line_key)
        expert, holder = expert[order], holder[order]
        start = exclusive_cumsum(control.counts[rank])[expert] + line_starts(forward, owner)[
            expert, holder
        ]
        return forward[expert, holder], backward[expert, holder], start
