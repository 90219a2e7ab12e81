"""Small, CPU-friendly stock megatron-core MoE building blocks for tests.

megatron-core is imported lazily inside the functions so that importing
``megatron_lrmoe.testing`` stays cheap and free of side effects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)

__all__ = ["moe_transformer_config", "skewed_routing_inputs", "stock_moe_layer"]


def _parallel_sizes_from_state() -> dict[str, int]:
    """TP/EP sizes of the initialised megatron parallel state ({} if not initialised)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {}
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
    }


def moe_transformer_config(**overrides: Any) -> TransformerConfig:
    """Build a tiny fp32 MoE ``TransformerConfig`` that runs on CPU with the local spec.

    Defaults: 1 layer, hidden 32, 4 heads, FFN 64, 8 experts of FFN 48, top-2, alltoall
    dispatcher, SwiGLU, no biases, aux-loss load balancing (coeff 1e-2), every fusion and TE path
    off, ``use_cpu_initialization=True``, dropout 0 (so that runs are
    deterministic and comparable). ``tensor_model_parallel_size`` and
    ``expert_model_parallel_size`` come from ``overrides``, else from megatron's parallel state
    when it is initialised, else 1.

    Args:
        **overrides: any ``TransformerConfig`` field; unknown names raise ``TypeError``.

    Returns:
        The validated ``TransformerConfig``.
    """
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": 48,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        # Build weights on the CPU directly rather than on torch.cuda.current_device() (which only
        # the CPU shim turns into "cpu"), so the config is CPU-safe with or without the shim.
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "bf16": False,
        "fp16": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 1e-2,
        # Fused permute / router / bias-activation kernels need TE or CUDA.
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
        "gradient_accumulation_fusion": False,
        # The default is "transformer_engine", which fails without TE.
        "transformer_impl": "local",
        "attention_backend": AttnBackend.local,
        "sequence_parallel": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": 1,
        "expert_model_parallel_size": 1,
    }
    fields.update(_parallel_sizes_from_state())
    fields.update(overrides)
    return TransformerConfig(**fields)


def stock_moe_layer(
    config: TransformerConfig,
    pg_collection: ProcessGroupCollection | None = None,
    layer_number: int = 1,
) -> MoELayer:
    """Build megatron-core's stock ``MoELayer`` from the local (non-TE) MoE spec.

    This is exactly what ``get_gpt_decoder_block_spec(..., use_transformer_engine=False)`` puts in a
    transformer layer: ``MoELayer`` with ``SequentialMLP`` experts, ``TopKRouter`` and (when
    ``config.moe_shared_expert_intermediate_size`` is set) ``SharedExpertMLP``.

    Args:
        config: an MoE ``TransformerConfig`` (e.g. from :func:`moe_transformer_config`).
        pg_collection: process groups; ``None`` lets MoELayer use megatron's global parallel state.
        layer_number: 1-based layer number (the router logs its aux loss under it).

    Returns:
        The ``MoELayer`` (on CPU when ``config.use_cpu_initialization``).
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    # In 0.19.2 the spec is a builder, functools.partial(MoELayer, submodules=MoESubmodules(...)),
    # that TransformerLayer calls with keyword arguments.
    builder = get_moe_module_spec(
        use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False
    )
    return builder(config=config, pg_collection=pg_collection, layer_number=layer_number)


def skewed_routing_inputs(
    num_tokens: int,
    hidden: int,
    seed: int,
    rank: int,
    skew: float = 2.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Deterministic, rank-dependent hidden states whose routing is skewed towards a few experts.

    Every token is ``N(0, 1)`` noise (different per ``rank``) plus ``skew`` times a unit direction
    shared by all ranks (derived from ``seed`` only). Through a router, the shared component
    raises the same few expert logits on every token, so the expert loads are imbalanced, the case
    that capacity/quota logic has to handle. A private generator is used, so the global RNG state
    is left untouched.

    Args:
        num_tokens: sequence length (tokens per rank).
        hidden: hidden size.
        seed: base seed; same seed and rank give the same tensor.
        rank: rank whose tokens to generate.
        skew: weight of the shared direction (0 gives plain Gaussian tokens).
        dtype: output dtype.

    Returns:
        Tensor of shape ``[num_tokens, 1, hidden]`` (megatron's ``[seq, batch, hidden]`` layout).
    """
    shared_gen = torch.Generator().manual_seed(int(seed))
    direction = torch.randn(hidden, generator=shared_gen)
    direction = direction / direction.norm()
    # 1_000_003 is prime, so (seed, rank) pairs do not collide for realistic ranks.
    rank_gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(rank) + 1)
    noise = torch.randn(num_tokens, 1, hidden, generator=rank_gen)
    return (noise + skew * direction).to(dtype)
