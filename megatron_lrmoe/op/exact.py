"""Keep ratio 1, the exact route: :class:`ExactMoEFunction`, Megatron's math and order.

The routing weight scales the activation before fc2 on the expert side; the backward sends
every gradient row and returns ``d probs`` from the experts. This is the baseline the trimmed
route must beat. Device-to-host syncs in the backward: none.
"""

from __future__ import annotations

import torch

from megatron_lrmoe.dispatch.rows import gather_rows, gather_sum
from megatron_lrmoe.experts.mlp import expert_backward_parts, expert_forward_parts
from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.op.keep_curve import observe_keep_curve, row_norms
from megatron_lrmoe.op.record import _record_exact
from megatron_lrmoe.op.weight_grads import _fused_weight_grads, _main_grad_targets
from megatron_lrmoe.options import using_kernels

__all__ = ["ExactMoEFunction"]


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
        x = call.route.to_experts(gather_rows(hidden, call.route.token_of_send))
        p_e = call.route.to_experts(call.route.to_send_order(probs))
        stacks, counts = call.weight_stacks(w1, w2), call.stack_counts(call.forward_groups)
        z, h = expert_forward_parts(x, stacks, counts, call.spec, probs=p_e)
        out = gather_sum(call.route.to_sources(z), call.route.slot_send)
        ctx.call = call
        ctx.params = (w1, w2)  # the parameter objects themselves (see _main_grad_targets)
        ctx.save_for_backward(x, h, p_e, w1, w2)
        # keep_ratio "auto": what the backward's measurement needs on the token side.
        ctx.auto = (probs.detach(), row_norms(hidden)) if call.auto_keep is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # The call's kernel options, on whatever thread autograd runs this (options.py).
        with using_kernels(ctx.call.lrmoe.kernels):
            return ExactMoEFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        call: ExpertCall = ctx.call
        x, h, p_e, w1, w2 = ctx.saved_tensors
        if call.sample_stream is not None:
            call.sample_stream()  # every backward advances the stream, exact or not
        g = grad_out.contiguous()
        if ctx.auto is not None:
            probs, x_norms = ctx.auto
            observe_keep_curve(call, probs, torch.stack((row_norms(g), x_norms)))
            ctx.auto = None
        dz = call.route.to_experts(gather_rows(g, call.route.token_of_send))
        into = _main_grad_targets(call, *ctx.params)
        dx, dw1, dw2, dp_e = expert_backward_parts(
            dz, x, h, call.weight_stacks(w1, w2), call.stack_counts(call.groups), call.spec,
            probs=p_e, need_dx=ctx.needs_input_grad[0], wgrad_into=into,
        )
        dw1, dw2 = call.fold_grads(dw1, dw2, into)
        if into is not None:
            dw1, dw2 = _fused_weight_grads(*ctx.params)
        d_probs = call.route.to_pair_order(call.route.to_sources(dp_e).to(p_e.dtype))
        d_hidden = None
        if dx is not None:
            d_hidden = gather_sum(call.route.to_sources(dx), call.route.slot_send)
        if call.stats is not None:
            _record_exact(call, g)
        return d_hidden, d_probs, None, dw1, dw2
