"""The LRMoE autograd op: permute -> dispatch all-to-all -> grouped experts -> combine
all-to-all -> un-permute, with LRMoE's backward.

Shape legend: T tokens on this rank, H hidden, P EP ranks, L local experts, E = P*L experts,
F expert ffn width, F1 fc1 width (2F gated), S pairs this rank sends (= its tokens' pairs),
R pairs its experts receive, Ks kept pairs this rank sends, Kr kept pairs its experts receive.

Row layouts:
* token side: ``[T, H]`` tokens; pairs in "pair order" (Megatron's permute order: sorted by
  global expert, tokens ascending), the order of ``probs``. Without replicas pair order is also
  the "send order", destination-rank-major.
* expert side: "recv order" is rank-major ``[source rank][local expert]`` as the all-to-all
  delivers it; "expert order" is ``[local expert][source rank]``, what the grouped GEMM needs.
  Within every (rank, expert) chunk rows keep token order, the canonical tie-break order.
* with replicas (the controller placed copies of hot experts on other ranks this call, see
  ``dispatch/replicas.py``): a rank's "instances" are its L experts, then its replicas
  (ascending id); send order is ``(destination, instance)``-major, each chunk the contiguous
  sub-chunk of a pair-order expert segment that the plan assigns to that holder. One composed
  index (``token_of_send``, ``slot_send``) keeps the forward at one gather of token rows and
  one gather-sum back; the expert side runs two grouped GEMMs per projection (own weights,
  replica weights) over contiguous row ranges, and replica gradients are added into their
  owners' gradients before the op returns them.

Two autograd functions share the forward and differ in what they keep and how they go back:

* :class:`ExactMoEFunction` (keep ratio 1): Megatron's math and order, the routing weight scales
  the activation before fc2 on the expert side, the backward sends every gradient row and
  returns ``d probs`` from the experts. This is the baseline the trimmed path must beat.
* :class:`TrimmedMoEFunction` (keep ratio < 1): the source applies the routing weight while
  summing each token's pairs and keeps the expert output ``z`` so that the router gradient stays
  exact for every pair without any expert backward; the backward runs the named stages
  :func:`select_kept` -> :func:`pack_kept` -> :func:`exchange_kept` -> expert backward on the
  survivors -> :func:`return_dx`, each consuming a small frozen plan.

Device-to-host syncs: none in either backward with scope ``local`` (every count is a host
integer of the forward plan); scope ``global`` needs one (the owners' kept counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.controller import ControlPlan
from megatron_lrmoe.control.plan import CallPlan
from megatron_lrmoe.dispatch import comm
from megatron_lrmoe.dispatch.compaction import (
    chunk_transpose_index,
    exclusive_cumsum,
    host_to_device,
    inverse_permutation,
    kept_position_shift,
    repeat_per_row,
    row_chunk_ids,
)
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.replicas import KeptLayout, ReplicaLayout
from megatron_lrmoe.dispatch.rows import gather_rows, gather_sum, pack_pairs, row_dot
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.experts.backward_graph import (
    expert_graph_rows,
    expert_graph_wanted,
    run_layer_graph,
)
from megatron_lrmoe.experts.grouped_gemm import GroupSizes
from megatron_lrmoe.experts.mlp import expert_backward_parts, expert_forward_parts
from megatron_lrmoe.experts.replica_weights import fold_replica_grads
from megatron_lrmoe.experts.wgrad_triton import MainGrads
from megatron_lrmoe.observe.stats import CallStats, ExchangeStats, SpanTimer
from megatron_lrmoe.select.kernels import (
    FrontBuffers,
    ScoreInputs,
    front_graphs_wanted,
    front_triton,
    scored_call,
)
from megatron_lrmoe.select.contract import PairScores, Selection
from megatron_lrmoe.select.scoring import (
    draw_uniforms,
    pair_scores,
    score_and_select,
    select,
    token_norms,
)
from megatron_lrmoe.triton_common import use_triton

__all__ = ["ExactMoEFunction", "ExpertCall", "TrimmedMoEFunction", "lrmoe_experts"]


@dataclass
class ExpertCall:
    """Everything the op needs besides tensors; one per layer call (not a tensor input).

    Attributes:
        plan_source: The integer plan of this call (host), or ``None`` until the layer sets
            it: at EP 1 without the controller the forward runs before the host has the counts
            (it needs none) and the layer fills the plan in behind it; read it as :attr:`plan`.
        lrmoe: The layer's LRMoE configuration.
        spec: Expert activation.
        group: The expert-parallel process group.
        perm: This rank's token <-> pair index plan.
        stats: Per-call statistics to fill, or ``None``.
        sample_stream: Returns the sampling stream's key for this call's backward (the layer
            counts backward calls); ``None`` keys every call alike.
        layout: The send-order index plans when the controller placed replicas this call, else
            ``None`` (send order is pair order).
        replica_weights: ``(w1 [n, F1, H], w2 [n, H, F])`` this rank's replicas (detached, in
            ``layout.replicas_of[rank]`` order) when ``layout`` is set.
        device_rows: ``[L]`` forward rows per local expert on the device, for a forward that
            runs before the plan exists (EP 1; the grouped GEMMs take device offsets).
        fuse_grad_accumulation: Add the expert weight gradients into the weights' ``main_grad``
            in the weight-gradient GEMMs (``LRMoEConfig.fuses_grad_accumulation``).
    """

    plan_source: Optional[CallPlan]
    lrmoe: LRMoEConfig
    spec: GluSpec
    group: Optional[torch.distributed.ProcessGroup]
    perm: PairPermutation
    stats: Optional[CallStats]
    sample_stream: Optional[Callable[[], tuple[int, ...]]] = None
    layout: Optional[ReplicaLayout] = None
    replica_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    device_rows: Optional[torch.Tensor] = None
    fuse_grad_accumulation: bool = False
    _indices: dict = field(default_factory=dict)
    _groups: Optional[GroupSizes] = None

    @property
    def plan(self) -> CallPlan:
        """The call's integer plan (set by the layer before the backward can run)."""
        if self.plan_source is None:
            raise RuntimeError("ExpertCall.plan read before the layer set it")
        return self.plan_source

    @property
    def control(self) -> Optional[ControlPlan]:
        """The controller's plan, if the controller planned this call (a call whose plan comes
        later never is: the layer defers only without the controller)."""
        return self.plan_source.control if self.plan_source is not None else None

    def set_plan(self, plan: CallPlan) -> None:
        """Give a call whose forward ran from device rows its plan.

        The backward then groups rows by the plan's host counts again: with device counts the
        weight-gradient GEMMs would have to mask the whole ``[L, F1, H]`` output to zero the
        empty experts' slices instead of touching only those.
        """
        self.plan_source = plan
        self.device_rows = None
        self._groups = None

    @cached_property
    def ep_size(self) -> int:
        """P, the size of the expert-parallel group."""
        return comm.group_size(self.group)

    def reorder(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reorder ``rows`` laid out as an a-major ``counts[A, B]`` chunk grid to b-major.

        Index plans are cached per call: forward and a keep-all backward reuse the same two.
        The way back (``counts.t()``) is the inverse permutation of the way there, so where
        one is cached the other is its inverse (:func:`chunk_transpose_index` is the
        reference, ``tests/test_compaction.py`` compares them).
        """
        if counts.shape[0] == 1 or counts.shape[1] == 1:
            return rows
        grid = counts.numpy()  # the keys in numpy (the transpose's too: no torch op)
        key = _grid_key(grid)
        index = self._indices.get(key)
        if index is None:
            there = self._indices.get(_grid_key(grid.T))
            if there is None:
                index = chunk_transpose_index(counts, rows.device)
            else:
                index = inverse_permutation(there)
            self._indices[key] = index
        return gather_rows(rows, index)

    @property
    def exact(self) -> bool:
        """Every pair is kept: the exact (keep 1) path. Budgets can trim even at keep ratio 1,
        so a controller plan decides when there is one."""
        control = self.control
        return control.keeps_all if control is not None else self.lrmoe.is_exact

    @property
    def activation_mode(self) -> str:
        """``"save"`` or ``"recompute"`` for this call (the controller resolves ``"auto"``)."""
        control = self.control
        return control.activation_mode if control is not None else self.lrmoe.activation_mode

    @property
    def groups(self) -> GroupSizes:
        """Rows per local expert (per instance, with replicas) in forward (offsets built once
        per call)."""
        if self._groups is None:
            if self.layout is not None:
                rows = self.layout.rows_per_instance
            elif self.device_rows is not None:
                rows = self.device_rows
            else:
                rows = self.plan.tokens_per_local_expert
            self._groups = GroupSizes(rows)
        return self._groups

    # -- send order (pair order unless replicas were placed) ----------------------------------

    @property
    def token_of_send(self) -> torch.Tensor:
        """``[S]`` token of each send-order row."""
        return self.perm.token_of_pair if self.layout is None else self.layout.token_of_send

    @property
    def slot_send(self) -> torch.Tensor:
        """``[T, K]`` send-order row of each token slot (``-1`` if empty)."""
        return self.perm.slot_pair if self.layout is None else self.layout.slot_send

    def to_send_order(self, values: torch.Tensor) -> torch.Tensor:
        """Pair-order values -> send order."""
        return values if self.layout is None else values.index_select(0, self.layout.send_perm)

    def to_pair_order(self, values: torch.Tensor) -> torch.Tensor:
        """Send-order values -> pair order."""
        if self.layout is None:
            return values
        return values.index_select(0, self.layout.pair_to_send)

    @cached_property
    def stock_rows(self) -> tuple[int, int]:
        """Pair rows this rank sends to experts and its experts receive in the forward (what
        stock's backward exchanges carry), for the statistics."""
        plan = self.plan
        return int(plan.send_counts.numpy().sum()), int(plan.recv_counts.numpy().sum())

    @property
    def recv_counts(self) -> torch.Tensor:
        """``[P, L]`` (``[P, I]`` with replicas) forward rows per (source, local instance)."""
        return self.plan.recv_counts if self.layout is None else self.layout.recv_counts

    @property
    def send_counts(self) -> torch.Tensor:
        """``[P, *]`` forward rows this rank sends per destination (and its experts)."""
        return self.plan.send_counts if self.layout is None else self.layout.send_totals

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """Send-order rows of this rank -> expert-order rows of its experts (forward split)."""
        if self.ep_size == 1:  # send order is expert order; no plan needed
            return rows
        send, recv = self._splits()
        rows = comm.all_to_all_rows(rows, send, recv, self.group)
        return self.reorder(rows, self.recv_counts)

    def to_sources(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert-order rows of this rank's experts -> send-order rows of their sources."""
        if self.ep_size == 1:
            return rows
        send, recv = self._splits()
        rows = self.reorder(rows, self.recv_counts.t())
        return comm.all_to_all_rows(rows, recv, send, self.group)

    def _splits(self) -> tuple[list[int], list[int]]:
        source = self.plan if self.layout is None else self.layout
        return source.send_splits, source.recv_splits

    # -- experts (own weights, then replica weights) ------------------------------------------

    def weight_stacks(
        self, w1: torch.Tensor, w2: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The weight stacks of this rank's instances: its parameters, then its replicas."""
        if self.layout is None:
            return [(w1, w2)]
        return [(w1, w2), self.replica_weights]

    def stack_counts(self, rows_per_instance: GroupSizes | torch.Tensor) -> list:
        """Rows per instance split by weight stack (owned experts, replicas)."""
        if self.layout is None:
            return [rows_per_instance]
        sizes = GroupSizes(rows_per_instance).host_sizes()
        own = self.layout.num_owned
        return [sizes[:own], sizes[own:]]

    def fold_grads(
        self,
        dw1: list[Optional[torch.Tensor]],
        dw2: list[Optional[torch.Tensor]],
        into: Optional[MainGrads] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The parameters' gradients: own, plus (with replicas) every replica's, from its
        holder, added in a fixed order before autograd sees them.

        With ``into`` (the weights' ``main_grad``, which already holds the own gradient: fused
        accumulation) the replicas' gradients are added there instead, and ``into`` returned.
        """
        own1, own2 = (dw1[0], dw2[0]) if into is None else (into.fc1, into.fc2)
        if self.layout is None:
            return own1, own2
        return fold_replica_grads(own1, own2, dw1[1], dw2[1], self.layout, self.group)


def _grid_key(grid: np.ndarray) -> tuple:
    """What a chunk grid's reorder index depends on: its shape and its counts (the host
    grid's bytes in C order, so a transposed view keys as its transpose's copy)."""
    return grid.shape, grid.tobytes()


def lrmoe_experts(
    hidden: torch.Tensor,
    probs: torch.Tensor,
    call: ExpertCall,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The routed experts of one MoE layer call, ``[T, H] -> [T, H]``.

    Args:
        hidden: ``[T, H]`` this rank's tokens.
        probs: ``[S]`` routing weight of each pair, in send order.
        call: The call's plan and context.
        w1: ``[L, F1, H]`` fc1 weights of the local experts.
        w2: ``[L, H, F]`` fc2 weights.

    Returns:
        ``[T, H]``: for each token the sum of its pairs' routing-weighted expert outputs.
    """
    fn = ExactMoEFunction if call.exact else TrimmedMoEFunction
    return fn.apply(hidden, probs, call, w1, w2)


# --------------------------------------------------------------------------------------------- #
# Keep ratio 1: the exact path.
# --------------------------------------------------------------------------------------------- #


class ExactMoEFunction(torch.autograd.Function):
    """Keep ratio 1: every pair forward and backward, in Megatron's order.

    | name    | shape      | notes                                                        |
    |---------|------------|--------------------------------------------------------------|
    | hidden  | [T, H]     | input; gathered into send order, exchanged                   |
    | probs   | [S]        | input; exchanged, scales the activation before fc2           |
    | w1, w2  | [L,F1,H], [L,H,F] | inputs (the experts' parameters themselves)           |
    | replica | [n,F1,H], [n,H,F] | with replicas: ``call.replica_weights`` (not inputs;  |
    | weights |            | their gradients are folded into ``dw1``, ``dw2``)            |
    | x       | [R, H]     | received rows, expert order: saved (fc1's weight gradient)   |
    | h       | [R, F1]    | fc1 output: saved (the activation backward)                  |
    | p_e     | [R]        | received routing weights: saved                              |
    | out     | [T, H]     | each token's sum of its pairs' outputs                       |

    Backward: every gradient row goes to the experts (one ``[S, H]`` gather and exchange), the
    expert backward returns ``dx`` and ``d probs`` for every pair, and each token adds up its
    pairs' ``dx``. The activation output is recomputed inside the fused activation backward.
    """

    @staticmethod
    def forward(ctx, hidden, probs, call: ExpertCall, w1, w2):
        x = call.to_experts(gather_rows(hidden, call.token_of_send))
        p_e = call.to_experts(call.to_send_order(probs))
        z, h = expert_forward_parts(
            x, call.weight_stacks(w1, w2), call.stack_counts(call.groups), call.spec, probs=p_e
        )
        out = gather_sum(call.to_sources(z), call.slot_send)
        ctx.call = call
        ctx.params = (w1, w2)  # the parameter objects themselves (see _main_grad_targets)
        ctx.save_for_backward(x, h, p_e, w1, w2)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        call: ExpertCall = ctx.call
        x, h, p_e, w1, w2 = ctx.saved_tensors
        if call.sample_stream is not None:
            call.sample_stream()  # every backward advances the stream, exact or not
        g = grad_out.contiguous()
        dz = call.to_experts(gather_rows(g, call.token_of_send))
        into = _main_grad_targets(call, *ctx.params)
        dx, dw1, dw2, dp_e = expert_backward_parts(
            dz, x, h, call.weight_stacks(w1, w2), call.stack_counts(call.groups), call.spec,
            probs=p_e, need_dx=ctx.needs_input_grad[0], wgrad_into=into,
        )
        dw1, dw2 = call.fold_grads(dw1, dw2, into)
        if into is not None:
            dw1, dw2 = _fused_weight_grads(*ctx.params)
        d_probs = call.to_pair_order(call.to_sources(dp_e).to(p_e.dtype))
        d_hidden = None
        if dx is not None:
            d_hidden = gather_sum(call.to_sources(dx), call.slot_send)
        if call.stats is not None:
            _record_exact(call, g)
        return d_hidden, d_probs, None, dw1, dw2


# --------------------------------------------------------------------------------------------- #
# Keep ratio < 1: the trimmed path and its backward stages.
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class KeptPlan:
    """What survives this call's backward, from :func:`select_kept`.

    Attributes:
        kept_index: ``[Ks]`` int64 kept pairs of this rank, ascending send-order positions.
        weight: ``[Ks]`` fp32 gradient multiplier of each (1, or 1/inclusion probability).
        send_kept: ``[P, L]`` host int64 kept rows this rank sends to (rank, local expert).
        recv_kept: ``[P, L]`` host int64 kept rows its experts receive from (source, expert).
        kept_positions: ``[Kr]`` int64 row of each received kept pair in the forward's
            expert-order rows (``save`` mode, where the expert side kept them), else ``None``.
        poison: 0-dim fp32, NaN when a score was not finite (added to the gradients).
        send_pairs: With replicas, ``[Ks]`` kept pairs (pair-order positions) in exchange
            order, ``(destination, instance)``-major; ``None`` when that is ``kept_index``.
        send_weight: Their multipliers, in the same order (``None`` likewise).

    With replicas ``send_kept`` is ``[P, 1]`` (rows per destination) and ``recv_kept``
    ``[P, I]`` (per source and local instance).
    """

    kept_index: torch.Tensor
    weight: torch.Tensor
    send_kept: torch.Tensor
    recv_kept: torch.Tensor
    kept_positions: Optional[torch.Tensor]
    poison: torch.Tensor
    send_pairs: Optional[torch.Tensor] = None
    send_weight: Optional[torch.Tensor] = None

    @cached_property
    def send_splits(self) -> list[int]:
        """Kept rows this rank sends to each rank (host ints, computed once)."""
        return self.send_kept.numpy().sum(1).tolist()

    @cached_property
    def recv_splits(self) -> list[int]:
        """Kept rows this rank's experts receive from each rank."""
        return self.recv_kept.numpy().sum(1).tolist()

    @cached_property
    def rows_per_instance(self) -> torch.Tensor:
        """``[L]`` (``[I]`` with replicas) kept rows each local expert (instance) runs."""
        return self.recv_kept.sum(0)

    @property
    def exchange_pairs(self) -> torch.Tensor:
        """``[Ks]`` the kept pairs in the order their rows are exchanged."""
        return self.kept_index if self.send_pairs is None else self.send_pairs

    @property
    def exchange_weight(self) -> torch.Tensor:
        """``[Ks]`` their gradient multipliers, in the same order."""
        return self.weight if self.send_weight is None else self.send_weight


class TrimmedMoEFunction(torch.autograd.Function):
    """Keep ratio < 1: exact forward, quota-limited backward.

    | name    | shape      | notes                                                         |
    |---------|------------|---------------------------------------------------------------|
    | hidden  | [T, H]     | input; saved (it is the router's saved input too, so free):   |
    |         |            | ``||x||^2`` per token and, at EP 1 or in ``recompute`` mode, the |
    |         |            | kept pairs' fc1 input rows are read from it in backward        |
    | probs   | [S]        | input; saved                                                  |
    | z       | [S, H]     | expert outputs at the source, unweighted: kept until the      |
    |         |            | router gradient ``<g, z>`` is taken, then freed               |
    | h       | [R, F1]    | ``save`` mode: fc1 output on the expert side                  |
    | x       | [R, H]     | ``save`` mode at EP > 1: received rows (remote tokens)        |
    | out     | [T, H]     | ``sum_k p * z`` per token (fp32 sum, one rounding)             |

    With replicas, ``z`` is in send order (``call.slot_send`` sums it back), ``h`` and ``x``
    hold the rows of every local instance (owned experts, then replicas), and the replica
    weights come with ``call`` (their gradients are folded into ``dw1``, ``dw2``).

    Without saved-tensor hooks, ``z``, ``h`` and ``x`` are held on ``ctx`` so that each is
    released as soon as the backward has taken what it needs from it (the backward's peak stays
    below keep 1's). Under saved-tensor hooks (non-reentrant activation checkpointing, activation
    offloading) they go through ``save_for_backward`` like everything else, so the hooks can
    drop, recompute or offload them.
    """

    @staticmethod
    def forward(ctx, hidden, probs, call: ExpertCall, w1, w2):
        save = call.activation_mode == "save"
        x = call.to_experts(gather_rows(hidden, call.token_of_send))
        z, h = expert_forward_parts(
            x, call.weight_stacks(w1, w2), call.stack_counts(call.groups), call.spec
        )
        z = call.to_sources(z)  # send order
        out = gather_sum(z, call.slot_send, scale=call.to_send_order(probs))
        ctx.call = call
        ctx.params = (w1, w2)  # the parameter objects themselves (see _main_grad_targets)
        h = h if save else None
        # At EP 1 every received row is a local token: read it from ``hidden`` instead.
        x = x if save and call.ep_size > 1 else None
        ctx.stashed = not _saved_tensor_hooks_active()
        if ctx.stashed:
            ctx.save_for_backward(hidden, probs, w1, w2)
            ctx.z, ctx.h, ctx.x = z, h, x
        else:
            ctx.save_for_backward(hidden, probs, w1, w2, z, h, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        call: ExpertCall = ctx.call
        if ctx.stashed:
            hidden, probs, w1, w2 = ctx.saved_tensors
            z, ctx.z = ctx.z, None
        else:
            hidden, probs, w1, w2, z, ctx.h, ctx.x = ctx.saved_tensors
        stats = call.stats
        timer = SpanTimer(grad_out.device) if stats is not None else None
        g = grad_out.contiguous()

        key = call.sample_stream() if call.sample_stream is not None else ()
        into = _main_grad_targets(call, *ctx.params)
        # EP 1: the whole backward can be one replayed graph per layer.
        if (
            call.plan.ep_size == 1
            and call.layout is None
            and expert_graph_wanted(g, (w1, w2), into, ctx.h)
        ):
            graphed = _graphed_backward(call, ctx, g, hidden, probs, z, key, into)
            if graphed is not None:
                # z goes before the weights' placeholders are allocated (the replay that reads
                # it is queued on this stream ahead of any reuse of its memory).
                del z
                d_probs, kept, d_hidden = graphed
                return _trimmed_grads(call, ctx, g, kept, d_probs, d_hidden, into, timer)
        front = replayed_front(call, g, hidden, probs, z, key, timer)
        if front is not None:
            d_probs, kept, g_kept, x_kept, row_of_pair = front
        else:
            # Router gradient, exact for every pair: d probs = <g_token, z_pair>. Walked token
            # by token (each g row read once for its K pairs, not once per pair).
            d_probs = call.to_pair_order(row_dot(g, z, probs.dtype, slots=call.slot_send))
            kept = select_kept(call, g, hidden, probs, key, timer)
            if timer:
                timer.start("packing")
            # Packed row of each kept pair, written by the packing kernel, read by return_dx.
            row_of_pair = new_row_of_pair(call, g.device) if ctx.needs_input_grad[0] else None
            g_kept, x_kept = pack_kept(call, g, hidden, probs, kept, row_of_pair)
            if timer:
                timer.stop("packing")
        del z, front  # z is no longer needed (the router gradient is taken)
        dz, x_in = exchange_kept(call, kept, g_kept, x_kept)
        x_k = _kept_inputs(ctx, kept, x_in)
        # Save mode: the activation backward reads the kept rows of the saved h in place.
        h, h_rows = ctx.h, (kept.kept_positions if ctx.h is not None else None)
        ctx.h = ctx.x = None
        kept_groups = GroupSizes(kept.rows_per_instance)
        dx_k, dw1, dw2, _ = expert_backward_parts(
            dz, x_k, h, call.weight_stacks(w1, w2), call.stack_counts(kept_groups), call.spec,
            need_dx=ctx.needs_input_grad[0], h_rows=h_rows, wgrad_into=into,
        )
        del h
        dw1, dw2 = call.fold_grads(dw1, dw2, into)
        d_hidden = return_dx(call, kept, dx_k, row_of_pair) if dx_k is not None else None
        return _trimmed_grads(call, ctx, g, kept, d_probs, d_hidden, into, timer, (dw1, dw2))


def _graphed_backward(
    call: ExpertCall,
    ctx,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    z: torch.Tensor,
    key: tuple[int, ...],
    into: MainGrads,
) -> Optional[tuple[torch.Tensor, KeptPlan, Optional[torch.Tensor]]]:
    """The trimmed backward at EP 1 as one replayed graph per layer
    (``experts/backward_graph.py``): the router gradient, scoring, selection and packing of
    :func:`replayed_front`, then the expert backward into ``main_grad`` and the return, with one
    argument block copied in and one graph launched. Returns ``(d_probs, kept, d_hidden)``
    (without the poison, which :func:`_trimmed_grads` adds), or ``None`` where the graph does
    not run (a shape's or a layer's first sighting, inputs it cannot read in place) and nothing
    was written: the caller runs the stages.

    The front and the expert half are not timed apart here (no span: a timing event cannot be
    recorded inside the graph); ``LRMOE_EXPERT_GRAPHS=0`` times the front as ``front``.
    """
    counts, quota, uniforms = _local_segments(call, key)
    num_kept = int(quota.numpy().sum())
    if num_kept == 0:  # nothing to replay, and no rows to make room for
        return None
    perm = call.perm
    rows = expert_graph_rows(
        num_kept, g, perm.slot_pair, perm.num_pairs, counts.numel(), _packs_inputs(call)
    )
    if rows is None:
        return None
    d_probs = torch.empty(probs.shape, dtype=probs.dtype, device=probs.device)
    front = rows.front_buffers(z, call.slot_send, d_probs)
    scored = scored_call(
        call.lrmoe.selection, ScoreInputs(g, hidden, probs, perm.token_of_pair), counts, quota,
        uniforms, front, kept_total=call.stats is not None,
    )
    if scored is None:
        return None
    d_hidden = torch.empty_like(g) if ctx.needs_input_grad[0] else None
    w1, w2 = ctx.params
    out = run_layer_graph(rows, scored, ctx.h, perm.slot_pair, d_hidden, (w1, w2), into, call.spec)
    if out is None:
        return None
    (scores, sel, kept_total), _ = out
    kept = _local_plan(call, sel, quota, scores.poison)
    if call.stats is not None:
        _record_selection(call, scores, kept, kept_total)
    ctx.h = ctx.x = None
    return d_probs, kept, d_hidden


def _trimmed_grads(
    call: ExpertCall,
    ctx,
    g: torch.Tensor,
    kept: KeptPlan,
    d_probs: torch.Tensor,
    d_hidden: Optional[torch.Tensor],
    into: Optional[MainGrads],
    timer: Optional[SpanTimer],
    weight_grads: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None),
) -> tuple:
    """What :meth:`TrimmedMoEFunction.backward` returns, after the poison and the statistics.

    Where the weight gradients went into ``main_grad`` (``into``: fused accumulation),
    autograd gets Megatron's placeholders (:func:`_fused_weight_grads`), else ``weight_grads``.
    """
    dw1, dw2 = weight_grads
    if into is not None:
        dw1, dw2 = _fused_weight_grads(*ctx.params)
    # Non-finite scores must reach Megatron's NaN check, never hide in a selection: the
    # poison (0 or NaN) went into every packed gradient row's scale, so into the expert
    # weight gradients of every rank that kept a row; the router gradient gets it here.
    d_probs.add_(kept.poison.to(d_probs.dtype))
    if call.stats is not None:
        _record_trimmed(call, g, kept, timer)
    return d_hidden, d_probs, None, dw1, dw2


def _main_grad_targets(
    call: ExpertCall, w1: torch.Tensor, w2: torch.Tensor
) -> Optional[MainGrads]:
    """The weights' ``main_grad`` when this call writes the expert weight gradients there in
    its GEMMs (``LRMoEConfig.grad_accumulation_fusion``), else ``None``.

    Megatron's protocol for fused layers: Megatron-FSDP's parameters (``__fsdp_param__``) get
    their buffer from ``get_main_grad()`` here, in the backward, as its linear layers and TE's
    fetch it; a weight with ``overwrite_main_grad`` (Megatron-FSDP sets it) has its buffer
    written over, any other added to (DDP). Replica gradients are then folded in
    (``ExpertCall.fold_grads``). Weights without a ``main_grad`` of their own shape, fp64 ones,
    and two weights that ask for different protocols return gradients as usual. ``w1``, ``w2``
    must be the parameter objects the forward got (``ctx.params``), not ``ctx.saved_tensors``:
    under saved-tensor hooks (activation offloading, non-reentrant checkpointing) those come
    back as new tensor objects without DDP's ``main_grad`` attribute.
    """
    if not call.fuse_grad_accumulation:
        return None
    weights = (w1, w2)
    overwrite = [bool(getattr(w, "overwrite_main_grad", False)) for w in weights]
    fsdp = [hasattr(w, "__fsdp_param__") and hasattr(w, "get_main_grad") for w in weights]
    if overwrite[0] != overwrite[1] or fsdp[0] != fsdp[1]:
        return None
    targets = []
    for w, lazy in zip(weights, fsdp):
        if lazy:  # Megatron-FSDP makes the buffer per backward
            w.main_grad = w.get_main_grad()
        acc = getattr(w, "main_grad", None)
        if acc is None or acc.shape != w.shape or w.dtype == torch.float64:
            return None
        targets.append(acc)
    # An FSDP buffer may sit elsewhere at every call: no captured graph writes it.
    return MainGrads(*targets, accumulate=not overwrite[0], fixed=not fsdp[0])


def _fused_weight_grads(w1: torch.Tensor, w2: torch.Tensor) -> list[Optional[torch.Tensor]]:
    """What autograd gets for weights whose gradient already went into ``main_grad``.

    Megatron's protocol (its linear layers with ``gradient_accumulation_fusion``): mark the
    weight ``grad_added_to_main_grad`` and hand autograd an uninitialised (``zero_out_wgrad``:
    zero) gradient, so that DDP's hook still fires once per backward (bucket readiness, overlap)
    but does not add it. A weight without that attribute gets no gradient at all.
    """
    grads: list[Optional[torch.Tensor]] = []
    for w in (w1, w2):
        if not hasattr(w, "grad_added_to_main_grad"):
            grads.append(None)
            continue
        w.grad_added_to_main_grad = True
        make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
        grads.append(make(w.shape, dtype=w.dtype, device=w.device))
    return grads


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, offloading) are in force for this forward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    # Without the (private) query, assume hooks: save_for_backward is always correct.
    return True if top is None else top(False) is not None


def _uniforms(call: ExpertCall, key: tuple[int, ...], n: int) -> torch.Tensor:
    """``[n]`` host uniforms of this call, the same on every rank and every rerun."""
    return draw_uniforms(call.lrmoe.seed, (call.plan.layer_number, *key), n)


def select_kept(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    key: tuple[int, ...],
    timer: Optional[SpanTimer],
) -> KeptPlan:
    """Stage 1: score every pair of this rank and select the survivors.

    Score ``p^2 ||g_t||^2 ||x_t||^2``: both norms are token properties, taken once per token
    (:func:`token_norms`), each relative to its largest value in the call (in the EP group for
    scope global, where sources compete), so the fp32 scores cannot overflow and need no sync
    (:func:`pair_scores`). Where this source selects among its own pairs (scope local or EP 1,
    no replicas) scoring and selection are one step (:func:`score_and_select`: on CUDA one
    replayed graph), and its time is the ``selection`` span.
    """
    lrmoe, token_of_pair, stats = call.lrmoe, call.perm.token_of_pair, call.stats
    kept_total = None
    if call.layout is None and (lrmoe.scope == "local" or call.plan.ep_size == 1):
        if timer:
            timer.start("selection")
        counts, quota, uniforms = _local_segments(call, key)
        scored, sel, kept_total = score_and_select(
            lrmoe.selection, g, hidden, probs, token_of_pair, counts, quota, uniforms,
            kept_total=stats is not None, owned=False,
        )
        kept = _local_plan(call, sel, quota, scored.poison)
        if timer:
            timer.stop("selection")
    else:
        if timer:
            timer.start("scoring")
        norms = token_norms(g, hidden)  # [2, T]
        top = norms.amax(dim=1) if norms.shape[1] else norms.new_zeros(2)
        if lrmoe.scope == "global":
            top = comm.all_reduce_max(top, call.group)
        scored = pair_scores(probs, token_of_pair, norms, top)
        if timer:
            timer.stop("scoring")
            timer.start("selection")
        if call.layout is not None:
            kept = _select_with_replicas(call, scored.scores, scored.poison, key)
        else:
            kept = _select_global(call, scored.scores, scored.poison, key)
        if timer:
            timer.stop("selection")
    if stats is not None:
        _record_selection(call, scored, kept, kept_total)
    return kept


def _record_selection(
    call: ExpertCall, scored: PairScores, kept: KeptPlan, kept_total: Optional[torch.Tensor]
) -> None:
    """The selection's statistics: the score total, the kept scores' (``kept_total`` when the
    selection summed them already) and, when asked, the dense kept weights."""
    stats = call.stats
    if kept_total is None:
        kept_scores = scored.scores.index_select(0, kept.kept_index)
        kept_total = torch.nan_to_num(kept_scores, nan=0.0, posinf=0.0, neginf=0.0).sum()
    # One copy of both: a replayed graph's sums are overwritten by its next replay, and these
    # are read when the metrics are reported.
    totals = torch.stack((scored.total, kept_total))
    stats.score_total, stats.score_kept = totals[0], totals[1]
    if call.lrmoe.debug_record_selection:
        dense = torch.zeros(scored.scores.numel(), dtype=torch.float32, device=totals.device)
        stats.kept_weight = dense.index_copy_(0, kept.kept_index, kept.weight).cpu()
        stats.kept_mask = stats.kept_weight > 0


def replayed_front(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    z: torch.Tensor,
    key: tuple[int, ...],
    timer: Optional[SpanTimer],
) -> Optional[tuple[torch.Tensor, KeptPlan, torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    """The router gradient, :func:`select_kept` and :func:`pack_kept` as one replayed CUDA
    graph (``select/kernels.py``, ``front_triton``), where a source selects among its own pairs
    (scope local or EP 1, no replicas) on CUDA; ``None`` elsewhere and where the graph cannot
    run (its first sighting of a shape, graphs off, inputs it cannot read in place), and the
    caller runs the stages one by one: the same kernels, so the same bits.

    Returns ``(d_probs, kept, g_kept, x_kept, row_of_pair)`` as the stages give them; its time
    is the ``front`` span (row-dot, scoring, selection and packing together). At EP 1 with fused
    accumulation :func:`_graphed_backward` replays this front and the expert half as one graph.
    """
    lrmoe = call.lrmoe
    local = call.layout is None and (lrmoe.scope == "local" or call.plan.ep_size == 1)
    # Nothing is prepared where no graph can run (switched off, inside a capture, not CUDA).
    if not (local and use_triton(g, hidden, probs, z) and front_graphs_wanted(g.device)):
        return None
    counts, quota, uniforms = _local_segments(call, key)
    num_kept, width = int(quota.numpy().sum()), g.shape[1]
    g_kept = g.new_empty((num_kept, width))
    x_kept = hidden.new_empty((num_kept, width)) if _packs_inputs(call) else None
    buffers = FrontBuffers(
        z=z,
        slots=call.slot_send,
        d_probs=torch.empty(probs.shape, dtype=probs.dtype, device=probs.device),
        g_kept=g_kept,
        x_kept=x_kept,
    )
    if timer:
        timer.start("front")
    front = front_triton(
        lrmoe.selection, g, hidden, probs, call.perm.token_of_pair, counts, quota, uniforms,
        buffers, kept_total=call.stats is not None, owned=False,
    )
    if front is None:
        if timer:
            timer.cancel("front")
        return None
    scored, sel, kept_total = front.scored
    kept = _local_plan(call, sel, quota, scored.poison)
    if timer:
        timer.stop("front")
    if call.stats is not None:
        _record_selection(call, scored, kept, kept_total)
    return buffers.d_probs, kept, buffers.g_kept, buffers.x_kept, front.row_of_pair


def _local_segments(
    call: ExpertCall, key: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Scope local: this source selects among its own pairs with its share of each quota.

    Returns ``(counts, quota, uniforms)`` of its segments (one per expert, in send order): host
    tensors, and the call's host uniforms for ``sample`` (else ``None``).
    """
    plan, lrmoe = call.plan, call.lrmoe
    counts = plan.global_counts[plan.ep_rank]  # [E] segments = experts, in send order
    quota = plan.quota_by_source[plan.ep_rank]
    uniforms = None
    if lrmoe.selection == "sample":
        num_experts = counts.numel()
        uniforms = _uniforms(call, key, plan.ep_size * num_experts)
        # Host uniforms: the fused selection puts them into its one host-to-device copy.
        if plan.ep_size > 1:
            uniforms = uniforms[plan.ep_rank * num_experts : (plan.ep_rank + 1) * num_experts]
    return counts, quota, uniforms


def _local_plan(
    call: ExpertCall,
    sel: Selection,
    quota: torch.Tensor,
    poison: torch.Tensor,
) -> KeptPlan:
    """The :class:`KeptPlan` of a scope-local selection (:func:`_local_segments`)."""
    plan = call.plan
    device = sel.kept_index.device
    p, nle = plan.ep_size, plan.num_local_experts
    send_kept = quota.reshape(p, nle)
    kept_positions = None
    if p == 1:
        recv_kept = plan.quota_by_source[:, plan.local_experts].contiguous()
        if call.activation_mode == "save":
            # Send order is expert order: the kept pairs are the kept expert-side rows.
            kept_positions = sel.kept_index
        return KeptPlan(sel.kept_index, sel.weight, send_kept, recv_kept, kept_positions, poison)
    # Host integers in numpy (a torch CPU op costs ~5 us; this runs in every backward).
    recv_np = np.ascontiguousarray(plan.quota_by_source.numpy()[:, plan.local_experts])
    recv_kept = torch.from_numpy(recv_np)
    if call.activation_mode == "save":
        # The expert side holds every received row; the source tells it which ones survived,
        # as their rows there: each kept send position plus its expert's shift (one host
        # table, one copy, one expansion; the owner only reorders what arrives).
        quota_np = quota.numpy()
        shift = kept_position_shift(
            np.asarray(plan.global_counts.numpy(), dtype=np.int64), plan.ep_rank, nle
        )
        positions = sel.kept_index + repeat_per_row(
            shift, quota_np, sel.kept_index.numel(), device
        )
        positions = comm.all_to_all_rows(
            positions,
            quota_np.reshape(p, nle).sum(1).tolist(),
            recv_np.sum(1).tolist(),
            call.group,
        )
        kept_positions = call.reorder(positions, recv_kept)
    return KeptPlan(sel.kept_index, sel.weight, send_kept, recv_kept, kept_positions, poison)


# Tag of the sampling stream of the per-holder sub-chunks (save mode with replicas), so that it
# never coincides with the per-(source, expert) stream of the same call.
REPLICA_SUBCHUNK_STREAM = -1


def _select_with_replicas(
    call: ExpertCall, scores: torch.Tensor, poison: torch.Tensor, key: tuple[int, ...]
) -> KeptPlan:
    """Scope local with replicas placed: the kept pairs go to the holders the plan chose.

    ``save``: a holder can only run backward on pairs whose activations it saved, so this
    source selects per forward sub-chunk (expert, holder) exactly the plan's
    ``backward_send_counts`` (at most the sub-chunk's pairs; their sum per expert is its quota
    share). ``recompute``: the selection per (source, expert) chunk is the one without
    replicas (same quotas, same uniforms, same pairs); the kept pairs of each expert are then
    split over its holders by the line rule. Either way the kept pairs, listed in pair order,
    come per expert in line-order holder sub-chunks, and one chunk gather puts them in
    ``(destination, instance)`` order for the exchange.
    """
    plan, lrmoe, layout = call.plan, call.lrmoe, call.layout
    control = plan.control
    rank, num_ranks = plan.ep_rank, plan.ep_size
    device = scores.device
    save = call.activation_mode == "save"
    if save:
        counts, quota, segment_start = layout.selection_segments(control)
    else:
        counts, quota = plan.global_counts[rank], plan.source_quota[rank]
    uniforms = None
    if lrmoe.selection == "sample":
        if save:
            stream = (*key, REPLICA_SUBCHUNK_STREAM, rank)
            uniforms = _uniforms(call, stream, counts.numel())
        else:
            num_experts = counts.numel()
            uniforms = _uniforms(call, key, num_ranks * num_experts)
            uniforms = uniforms[rank * num_experts : (rank + 1) * num_experts]
    sel: Selection = select(lrmoe.selection, scores, counts, quota, uniforms, owned=False)
    kept_layout: KeptLayout = layout.kept_layout(
        control.backward_send_counts(rank), control.backward_recv_counts(rank)
    )
    send_index = kept_layout.send_index
    kept_positions = None
    if save:
        # Position of each kept row inside its forward sub-chunk, which is the holder's
        # (source, instance) chunk of saved rows; it travels with the gradient rows.
        seg = row_chunk_ids(quota, device)
        within = sel.kept_index - host_to_device(segment_start, device)[seg]
        within = comm.all_to_all_rows(
            within.index_select(0, send_index),
            kept_layout.send_totals.reshape(-1).tolist(),
            kept_layout.recv_counts.sum(1).tolist(),
            call.group,
        )
        forward_counts = layout.recv_counts  # [P, I]
        num_instances = forward_counts.shape[1]
        chunk_start = (
            exclusive_cumsum(forward_counts.t().reshape(-1)).reshape(num_instances, num_ranks).t()
        )
        chunk_of_row = row_chunk_ids(kept_layout.recv_counts.reshape(-1), device)
        positions = host_to_device(chunk_start.reshape(-1), device)[chunk_of_row] + within
        kept_positions = call.reorder(positions, kept_layout.recv_counts)
    return KeptPlan(
        kept_index=sel.kept_index,
        weight=sel.weight,
        send_kept=kept_layout.send_totals,
        recv_kept=kept_layout.recv_counts,
        kept_positions=kept_positions,
        poison=poison,
        send_pairs=sel.kept_index.index_select(0, send_index),
        send_weight=sel.weight.index_select(0, send_index),
    )


def _select_global(
    call: ExpertCall, scores: torch.Tensor, poison: torch.Tensor, key: tuple[int, ...]
) -> KeptPlan:
    """Scope global: each expert's owner selects among the pairs of all sources."""
    plan, lrmoe, group = call.plan, call.lrmoe, call.group
    device = scores.device
    p, nle = plan.ep_size, plan.num_local_experts
    recv_scores = call.to_experts(scores)
    uniforms = None
    if lrmoe.selection == "sample":
        uniforms = _uniforms(call, key, plan.quota.numel())[plan.local_experts]
    owner_sel = select(
        lrmoe.selection,
        recv_scores,
        plan.tokens_per_local_expert,
        plan.local_quota,
        uniforms,
        owned=False,
    )
    weight_expert_order = owner_sel.dense_weight(recv_scores.shape[0])
    weight_recv_order = call.reorder(weight_expert_order, plan.recv_counts.t())
    weight_src = comm.all_to_all_rows(weight_recv_order, plan.recv_splits, plan.send_splits, group)
    kept_src = weight_src > 0
    # Kept counts per chunk on both sides; one host copy for both.
    src_chunks = row_chunk_ids(plan.send_counts.reshape(-1), device)
    recv_chunks = row_chunk_ids(plan.recv_counts.reshape(-1), device)
    kept_recv_order = weight_recv_order > 0
    counts = torch.zeros(2, p * nle, dtype=torch.int64, device=device)
    counts[0].index_add_(0, src_chunks, kept_src.to(torch.int64))
    counts[1].index_add_(0, recv_chunks, kept_recv_order.to(torch.int64))
    counts = counts.cpu()  # NOTE: device-to-host sync: split sizes of the compacted exchange
    send_kept = counts[0].reshape(p, nle)
    recv_kept = counts[1].reshape(p, nle)
    # The kept count is a host integer now: no second sync for the compaction.
    kept_index = torch.nonzero_static(kept_src, size=int(send_kept.sum())).squeeze(1)
    kept_positions = owner_sel.kept_index if call.activation_mode == "save" else None
    return KeptPlan(
        kept_index, weight_src[kept_index].float(), send_kept, recv_kept, kept_positions, poison
    )


def new_row_of_pair(call: ExpertCall, device: torch.device) -> torch.Tensor:
    """``[S + 1]`` int64 all ``-1``: :func:`pack_kept` writes each kept pair's packed row into
    it, the trailing entry stays ``-1`` (no pair), and :func:`return_dx` reads it."""
    return torch.full((call.perm.num_pairs + 1,), -1, dtype=torch.int64, device=device)


def pack_kept(
    call: ExpertCall,
    g: torch.Tensor,
    hidden: torch.Tensor,
    probs: torch.Tensor,
    kept: KeptPlan,
    row_of_pair: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stage 2: the kept pairs' gradient rows ``p * w * g_t`` (and their fc1 input rows ``x_t``
    when the expert side does not hold them: at EP 1, where the expert side is this rank, and in
    ``recompute`` mode), packed densely in exchange order, (receiver rank, expert)-major (with
    replicas: (receiver rank, instance)-major, ``KeptPlan.send_pairs``). One fused kernel
    (:func:`pack_pairs`); nothing ``[S, H]``. The poison rides in the rows' scale. With
    ``row_of_pair`` (:func:`new_row_of_pair`) the kernel also records each kept pair's packed
    row, which is the row its ``dx`` comes back in (:func:`return_dx`).
    """
    return pack_pairs(
        g,
        call.perm.token_of_pair,
        kept.exchange_pairs,
        probs,
        kept.exchange_weight,
        x=hidden if _packs_inputs(call) else None,
        poison=kept.poison,
        row_of_pair=row_of_pair,
    )


def _packs_inputs(call: ExpertCall) -> bool:
    """Whether the kept rows' inputs go with their gradient rows (the expert side does not
    hold them: EP 1, where it reads them from the tokens, and ``recompute`` mode)."""
    return call.plan.ep_size == 1 or call.activation_mode == "recompute"


def exchange_kept(
    call: ExpertCall, kept: KeptPlan, g_kept: torch.Tensor, x_kept: Optional[torch.Tensor]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Stage 3: all-to-all of the kept rows only, into expert order on the receiver."""
    send, recv = kept.send_splits, kept.recv_splits
    dz = call.reorder(comm.all_to_all_rows(g_kept, send, recv, call.group), kept.recv_kept)
    x_in = None
    if x_kept is not None:
        x_in = call.reorder(comm.all_to_all_rows(x_kept, send, recv, call.group), kept.recv_kept)
    return dz, x_in


def _kept_inputs(ctx, kept: KeptPlan, x_in: Optional[torch.Tensor]) -> torch.Tensor:
    """The kept rows' fc1 input, in expert order (fc1's weight gradient needs them dense).

    The input rows came packed with the gradients (``x_in``) at EP 1 and in ``recompute`` mode;
    otherwise (``save`` at EP > 1) the expert side gathers them from the rows it saved. The
    kept rows of the saved fc1 output are not gathered: the activation backward reads them in
    place (``h_rows``).
    """
    return x_in if x_in is not None else gather_rows(ctx.x, kept.kept_positions)


def return_dx(
    call: ExpertCall, kept: KeptPlan, dx_k: torch.Tensor, row_of_pair: torch.Tensor
) -> torch.Tensor:
    """Stage 5: kept rows' ``dx`` go home; each token adds up its kept pairs' rows.

    The return exchange inverts :func:`exchange_kept` (expert order -> receive order -> the
    senders), so ``dx_k`` arrives in the order :func:`pack_kept` packed the gradient rows,
    ``kept.exchange_pairs``. ``row_of_pair`` (filled by :func:`pack_kept`) maps every pair to
    that row or ``-1``, so the gather-sum walks the slot plan ``perm.slot_pair`` through it: no
    ``[T, K]`` index is built (``PairPermutation.slot_rows`` is the reference).
    """
    send, recv = kept.send_splits, kept.recv_splits
    dx_k = call.reorder(dx_k, kept.recv_kept.t())
    dx_k = comm.all_to_all_rows(dx_k, recv, send, call.group)
    return gather_sum(dx_k, call.perm.slot_pair, row_of=row_of_pair)


# --------------------------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------------------------- #


def _exchange_stats(
    send_counts: torch.Tensor, rank: int, row_bytes: int, stock_rows: int, stock_row_bytes: int
) -> ExchangeStats:
    """Row and byte counts of one exchange; ``send_counts`` is ``[P, ...]`` host rows per
    receiver. Through numpy: this runs in every backward, where a torch CPU op costs ~5 us."""
    per_rank = send_counts.numpy().reshape(send_counts.shape[0], -1).sum(1)
    return _rank_exchange(per_rank, rank, row_bytes, stock_rows, stock_row_bytes)


def _rank_exchange(
    per_rank: np.ndarray, rank: int, row_bytes: int, stock_rows: int, stock_row_bytes: int
) -> ExchangeStats:
    """:func:`_exchange_stats` from the rows sent to each rank (``[P]``)."""
    rows = int(per_rank.sum())
    remote = rows - int(per_rank[rank])
    return ExchangeStats(
        rows=rows,
        bytes=rows * row_bytes,
        remote_rows=remote,
        remote_bytes=remote * row_bytes,
        stock_rows=stock_rows,
        stock_bytes=stock_rows * stock_row_bytes,
    )


def _record_exact(call: ExpertCall, g: torch.Tensor) -> None:
    stats, plan = call.stats, call.plan
    if call.lrmoe.debug_record_selection:
        stats.kept_weight = torch.ones(plan.send_counts.sum().item())
        stats.kept_mask = stats.kept_weight > 0
    _fill_exchanges(call, g, call.send_counts, call.recv_counts, g.shape[-1])
    stats.exchanges["probs_grad"] = _exchange_stats(
        call.recv_counts, plan.ep_rank, 4, call.stock_rows[1], 4
    )
    stats.backward_done = True


def _record_trimmed(
    call: ExpertCall, g: torch.Tensor, kept: KeptPlan, timer: Optional[SpanTimer]
) -> None:
    stats, plan, lrmoe = call.stats, call.plan, call.lrmoe
    hidden = g.shape[-1]
    recompute_rows = call.activation_mode == "recompute" and plan.ep_size > 1
    send_per_rank = _fill_exchanges(
        call, g, kept.send_kept, kept.recv_kept, hidden * (2 if recompute_rows else 1)
    )
    # What the selection returned, not the plan (the same number when selection is exact).
    stats.kept_pairs_sent = kept.kept_index.numel()
    recv_rows = call.stock_rows[1]
    # Stock returns one routing-weight gradient per pair; the trimmed path computes them at
    # the source from z.
    stats.exchanges["probs_grad"] = ExchangeStats(0, 0, 0, 0, recv_rows, recv_rows * 4)
    if plan.ep_size > 1:
        rank = plan.ep_rank
        if lrmoe.scope == "global":
            stats.exchanges["scores"] = _exchange_stats(plan.send_counts, rank, 4, 0, 0)
            stats.exchanges["weights"] = _exchange_stats(plan.recv_counts, rank, 4, 0, 0)
        elif call.activation_mode == "save":
            stats.exchanges["positions"] = _rank_exchange(send_per_rank, rank, 8, 0, 0)
    stats.timer = timer
    stats.backward_done = True


def _record_replica_grads(call: ExpertCall) -> None:
    """The all-to-all that returns replica weight gradients to their owners (stock: none)."""
    layout, weights = call.layout, call.replica_weights
    if layout is None:
        return
    mine = layout.replicas_of[layout.ep_rank]
    row_bytes = sum(w[0].numel() * w.element_size() for w in weights) if mine else 0
    rows = len(mine)  # every replica's row goes to another rank (its owner)
    call.stats.exchanges["replica_grads"] = ExchangeStats(
        rows=rows,
        bytes=rows * row_bytes,
        remote_rows=rows,
        remote_bytes=rows * row_bytes,
        stock_rows=0,
        stock_bytes=0,
    )


def _fill_exchanges(
    call: ExpertCall,
    g: torch.Tensor,
    send_kept: torch.Tensor,
    recv_kept: torch.Tensor,
    grad_row_width: int,
) -> np.ndarray:
    """The gradient exchanges' statistics; returns the ``[P]`` rows sent to each rank (the
    kept positions, one per kept row, go the same way)."""
    stats, plan = call.stats, call.plan
    rank = plan.ep_rank
    elem = g.element_size()
    hidden = g.shape[-1]
    # Each count table read once (numpy: a torch CPU op costs ~5 us, and this runs in every
    # backward of every layer).
    send_per_rank = send_kept.numpy().reshape(send_kept.shape[0], -1).sum(1)
    recv = recv_kept.numpy()  # [P, L] / [P, I]
    per_instance = recv.sum(0)
    owned = plan.num_local_experts
    stats.kept_pairs_sent = int(send_per_rank.sum())
    stats.kept_per_local_expert = per_instance[:owned].tolist()
    stats.kept_per_replica = per_instance[owned:].tolist()
    stats.kept_rows = int(per_instance.sum())
    _record_replica_grads(call)
    stock_send, stock_recv = call.stock_rows
    stats.exchanges["grad"] = _rank_exchange(
        send_per_rank, rank, grad_row_width * elem, stock_send, hidden * elem
    )
    stats.exchanges["dgrad"] = _rank_exchange(
        recv.sum(1), rank, hidden * elem, stock_recv, hidden * elem
    )
    return send_per_rank
