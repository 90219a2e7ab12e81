"""Keep ratio < 1, the trimmed route: :class:`TrimmedMoEFunction`, exact forward and
quota-limited backward.

The source applies the routing weight while summing each token's pairs and keeps the expert
output ``z`` so that the router gradient stays exact for every pair without any expert
backward; in ``lean`` mode the expert side keeps the activation ``a`` instead (F wide against
z's H) and the router gradient is ``<W2^T g, a>`` (:func:`_lean_router_grad`). The
backward orchestrates the named stages of ``stages.py`` (select -> pack -> exchange -> expert
backward on the survivors -> return), or replays them as CUDA graphs where it can: the front
(``stages.replayed_front``) or, at EP 1, the whole backward as one graph per layer
(:func:`_graphed_backward`); ``megatron_lrmoe/op/__init__.py`` says when each runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lrmoe.dispatch.rows import gather_rows, gather_sum, row_dot
from megatron_lrmoe.experts.grouped_gemm import GroupSizes, grouped_mm_nn
from megatron_lrmoe.experts.mlp import expert_backward_parts, expert_forward_parts
from megatron_lrmoe.experts.wgrad_triton import MainGrads
from megatron_lrmoe.graphs.backward import (
    expert_graph_rows,
    expert_graph_wanted,
    run_layer_graph,
)
from megatron_lrmoe.graphs.front import ScoreInputs, scored_call
from megatron_lrmoe.observe.stats import SpanTimer
from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.op.keep_curve import observe_keep_curve
from megatron_lrmoe.op.record import _record_trimmed
from megatron_lrmoe.op.stages import (
    KeptPlan,
    _kept_inputs,
    _local_plan,
    _local_segments,
    _packs_inputs,
    _record_selection,
    exchange_kept,
    exchange_lean_kept,
    new_row_of_pair,
    pack_kept,
    replayed_front,
    return_dx,
    select_kept,
)
from megatron_lrmoe.op.weight_grads import _fused_weight_grads, _main_grad_targets
from megatron_lrmoe.options import using_kernels
from megatron_lrmoe.select.scoring import token_norms

__all__ = ["TrimmedMoEFunction"]


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
    | a       | [R, F]     | ``lean`` mode: the activation on the expert side, for z       |
    | out     | [T, H]     | ``sum_k p * z`` per token (fp32 sum, one rounding)             |

    With replicas, ``z`` is in send order (``call.route.slot_send`` sums it back), ``h`` and ``x``
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
        mode = call.activation_mode
        if mode == "lean" and call.layout is not None:
            raise ValueError(
                "activation_mode='lean' runs without replicas; use --lrmoe-activation-mode "
                "recompute or --lrmoe-max-replicas-per-rank 0"
            )
        x = call.route.to_experts(gather_rows(hidden, call.route.token_of_send))
        # lean keeps the activation (fc2's input) in place of fc1's output.
        z, h = expert_forward_parts(
            x, call.weight_stacks(w1, w2), call.stack_counts(call.forward_groups), call.spec,
            keep_act=mode == "lean",
        )  # fmt: skip
        z = call.route.to_sources(z)  # send order
        out = gather_sum(z, call.route.slot_send, scale=call.route.to_send_order(probs))
        ctx.call = call
        ctx.params = (w1, w2)  # the parameter objects themselves (see _main_grad_targets)
        # lean: the expert side's activation stands in for the source's z.
        a = h if mode == "lean" else None
        z = None if mode == "lean" else z
        h = h if mode == "save" else None
        # At EP 1 every received row is a local token: read it from ``hidden`` instead.
        x = x if mode == "save" and call.ep_size > 1 else None
        ctx.stashed = not _saved_tensor_hooks_active()
        if ctx.stashed:
            ctx.save_for_backward(hidden, probs, w1, w2)
            ctx.z, ctx.h, ctx.x, ctx.a = z, h, x, a
        else:
            ctx.save_for_backward(hidden, probs, w1, w2, z, h, x, a)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # The call's kernel options, on whatever thread autograd runs this (options.py).
        with using_kernels(ctx.call.lrmoe.kernels):
            return TrimmedMoEFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        call: ExpertCall = ctx.call
        if ctx.stashed:
            hidden, probs, w1, w2 = ctx.saved_tensors
            z, ctx.z, a, ctx.a = ctx.z, None, ctx.a, None
        else:
            hidden, probs, w1, w2, z, ctx.h, ctx.x, a = ctx.saved_tensors
        stats = call.stats
        timer = SpanTimer(grad_out.device) if stats is not None else None
        g = grad_out.contiguous()
        if call.auto_keep is not None:
            observe_keep_curve(call, probs, token_norms(g, hidden))

        key = call.sample_stream() if call.sample_stream is not None else ()
        into = _main_grad_targets(call, *ctx.params)
        # EP 1: the whole backward can be one replayed graph per layer (not in lean mode, whose
        # router gradient the graphs do not take).
        if (
            a is None
            and call.plan.ep_size == 1
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
        front = replayed_front(call, g, hidden, probs, z, key, timer) if a is None else None
        lean_rows = None  # lean at EP > 1: every pair's gradient row, at the experts
        if front is not None:
            d_probs, kept, g_kept, x_kept, row_of_pair = front
        else:
            # Router gradient, exact for every pair: d probs = <g_token, z_pair>. Walked token
            # by token (each g row read once for its K pairs, not once per pair).
            route = call.route
            if a is not None:
                d_send, lean_rows = _lean_router_grad(call, g, a, w2, probs.dtype)
                d_probs = route.to_pair_order(d_send)
            else:
                d_probs = route.to_pair_order(row_dot(g, z, probs.dtype, slots=route.slot_send))
            del a
            kept = select_kept(call, g, hidden, probs, key, timer)
            if timer:
                timer.start("packing")
            # Packed row of each kept pair, written by the packing kernel, read by return_dx.
            row_of_pair = new_row_of_pair(call, g.device) if ctx.needs_input_grad[0] else None
            if lean_rows is None:
                g_kept, x_kept = pack_kept(call, g, hidden, probs, kept, row_of_pair)
            if timer:
                timer.stop("packing")
        del z, front  # z is no longer needed (the router gradient is taken)
        if lean_rows is not None:  # the experts gather their own kept gradient rows
            dz, x_in = exchange_lean_kept(call, kept, hidden, probs, lean_rows, row_of_pair)
            del lean_rows
        else:
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


def _lean_router_grad(
    call: ExpertCall, g: torch.Tensor, a: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``([S] router gradient in send order, [R, H] gradient rows or None)`` from the expert
    side's saved activation (``lean``): ``<g_t, z_pair> = <W2_e^T g_t, a_pair>``, one fc2
    input-gradient GEMM over every pair. At EP > 1 every pair's gradient row goes to its expert
    (the exchange stock's backward makes) and one scalar per pair comes back; the experts keep
    the rows for the kept pairs' backward (``stages.exchange_lean_kept``).
    Checked against the dense reference (``tests/test_layer.py -k lean``, the router gradient
    ``<g_t, z_pair>`` of every pair).
    """
    route = call.route
    g_rows = route.to_experts(gather_rows(g, route.token_of_send))
    u = grouped_mm_nn(g_rows, w2, call.groups)  # one weight stack: lean has no replicas
    d = row_dot(u, a, torch.float32)
    del u
    if call.ep_size == 1:  # the kept rows are packed from g at the source, as in recompute
        return d.to(dtype), None
    return route.to_sources(d.unsqueeze(1)).squeeze(1).to(dtype), g_rows


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
    (``graphs/backward.py``): the router gradient, scoring, selection and packing of
    :func:`replayed_front`, then the expert backward into ``main_grad`` and the return, with one
    argument block copied in and one graph launched. Returns ``(d_probs, kept, d_hidden)``
    (without the poison, which :func:`_trimmed_grads` adds), or ``None`` where the graph does
    not run (a shape's or a layer's first sighting, inputs it cannot read in place) and nothing
    was written: the caller runs the stages.

    The front and the expert half are not timed apart here (no span: a timing event cannot be
    recorded inside the graph); with ``expert_graphs`` off the front is timed as ``front``.
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
    front = rows.front_buffers(z, call.route.slot_send, d_probs)
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


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (checkpointing, offloading) are in force for this forward."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    # Without the (private) query, assume hooks: save_for_backward is always correct.
    return True if top is None else top(False) is not None
