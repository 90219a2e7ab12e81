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

Three routes. Both autograd functions share the forward and differ in what they keep and how
they go back; :func:`lrmoe_experts` picks the function per call, the trimmed backward picks how
to run per backward:

* exact (keep 1.0, ``exact.py``): :class:`ExactMoEFunction` where ``ExpertCall.exact``: the
  controller's plan keeps every pair (``ControlPlan.keeps_all``; budgets can trim even at keep
  ratio 1), or, in a call the controller did not plan, the keep ratio is 1
  (``LRMoEConfig.is_exact``). Megatron's math and order: the routing weight scales the
  activation before fc2 on the expert side, the backward sends every gradient row and returns
  ``d probs`` from the experts. This is the baseline the trimmed route must beat.
* eager trimmed (every other call, ``trimmed.py``): :class:`TrimmedMoEFunction`. The source
  applies the routing weight while summing each token's pairs and keeps the expert output
  ``z`` so that the router gradient stays exact for every pair without any expert backward;
  the backward runs the named stages of ``stages.py`` as separate launches:
  ``select_kept`` -> ``pack_kept`` -> ``exchange_kept`` -> expert backward on the survivors ->
  ``return_dx``, each consuming a small frozen plan (``KeptPlan``). Always so with replicas
  placed, with scope ``global`` at EP > 1, and in ``lean`` mode (the expert side keeps the
  activation instead of z; the router gradient goes through fc2 first, outside the graphs).
* graphed (a trimmed backward on CUDA where this source selects among its own pairs: no
  replicas placed, and scope ``local`` or EP 1): the same kernels replayed as CUDA graphs, so
  the same bits. Tried in this order, each falling through to the next where it does not run
  (switched off, inside another capture, a shape's first sighting, inputs it cannot read in
  place):
  - the whole backward as one graph per layer (``trimmed._graphed_backward``,
    ``graphs/backward.py``'s ``run_layer_graph``): at EP 1, with the weight gradients
    fused into ``main_grad`` buffers that stay put (DDP's, not Megatron-FSDP's), bf16/fp16
    tensors Triton and torch's grouped GEMM take, ``expert_graphs`` on and the front graphs
    on (``expert_graph_wanted``), and at least one kept pair;
  - the front only (``stages.replayed_front``, ``graphs/front.py``'s ``front_triton``): the
    router gradient, scoring, selection and packing as one graph, at any EP; the exchange,
    expert backward and return then run as in the eager route. Needs ``triton``,
    ``select_graphs``, ``score_graphs`` and ``front_graphs`` on.

The switches named here are the call's kernel options (``ExpertCall.lrmoe.kernels``,
``megatron_lrmoe/options.py``): :func:`lrmoe_experts` makes them active for the forward and each
function's ``backward`` for the backward, so every stage and kernel wrapper below reads them
(``options.active_kernels()``).

Modules, in the order the data flows: ``call.py`` (:class:`ExpertCall`, the frozen per-call
context; its rows move through ``call.route``, a ``dispatch/route.py`` :class:`RowRoute` built
from the plan: every exchange and reorder of both routes goes through it), ``exact.py``,
``trimmed.py`` (the trimmed function and its backward's orchestration), ``stages.py`` (the named backward stages and their frozen plan),
``weight_grads.py`` (fused accumulation into ``main_grad``, for both functions), ``record.py``
(the per-call statistics).

Device-to-host syncs: none in either backward with scope ``local`` (every count is a host
integer of the forward plan); scope ``global`` needs one (the owners' kept counts).
"""

from __future__ import annotations

import torch

from megatron_lrmoe.op.call import ExpertCall
from megatron_lrmoe.op.exact import ExactMoEFunction
from megatron_lrmoe.op.trimmed import TrimmedMoEFunction
from megatron_lrmoe.options import using_kernels

__all__ = ["ExactMoEFunction", "ExpertCall", "TrimmedMoEFunction", "lrmoe_experts"]


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
    with using_kernels(call.lrmoe.kernels):
        return fn.apply(hidden, probs, call, w1, w2)
