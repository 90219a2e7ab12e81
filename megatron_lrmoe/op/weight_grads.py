"""The expert weights' gradients under fused accumulation (Megatron's ``main_grad``
protocol), shared by both autograd functions: where the weight-gradient GEMMs write, and what
autograd gets back for weights whose gradient already went there."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lrmoe.experts.wgrad_triton import MainGrads
from megatron_lrmoe.op.call import ExpertCall


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
