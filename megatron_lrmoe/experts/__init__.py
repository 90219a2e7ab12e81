"""Expert math on rows grouped by expert: weights, grouped GEMMs, activation, expert MLP.

Shape legend:
    N: rows grouped by expert (contiguous per group, in group order, no padding).
    G: local experts; H: hidden; F: expert FFN width; F1: ``2F`` if gated else ``F``.
    Weights: ``w1: [G, F1, H]``, ``w2: [G, H, F]`` (Megatron's ``[out, in]`` stacked on dim 0).

``KernelOptions(grouped_mm=False)`` (``LRMoEConfig.kernels``, ``--no-lrmoe-grouped-mm``) forces
the per-group ``torch.mm`` loop instead of ``torch.nn.functional.grouped_mm`` (see
``grouped_gemm.py``).
"""

from megatron_lrmoe.experts.activation import (
    ActivationKind,
    GluSpec,
    act_backward,
    act_forward,
    activation_spec_from_config,
)
from megatron_lrmoe.experts.grouped_gemm import (
    Counts,
    GroupedMMBackend,
    GroupSizes,
    grouped_mm_backend,
    grouped_mm_nn,
    grouped_mm_nt,
    grouped_mm_tn,
)
from megatron_lrmoe.experts.mlp import expert_backward, expert_forward

__all__ = [
    "ActivationKind",
    "Counts",
    "GluSpec",
    "GroupSizes",
    "GroupedMMBackend",
    "act_backward",
    "act_forward",
    "activation_spec_from_config",
    "expert_backward",
    "expert_forward",
    "grouped_mm_backend",
    "grouped_mm_nn",
    "grouped_mm_nt",
    "grouped_mm_tn",
]
