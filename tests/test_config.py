"""LRMoEConfig: field validation, and one test per rule of the TransformerConfig check."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import CudaGraphModule as GM

from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.testing import moe_transformer_config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keep_ratio=1.5), r"keep_ratio \(1.5\) must be in \[0, 1\]"),
        (dict(keep_ratio=-0.1), r"keep_ratio \(-0.1\) must be in \[0, 1\]"),
        (dict(keep_ratio=float("nan")), r"keep_ratio \(nan\) must be a finite number"),
        (dict(selection="greedy"), r"selection \('greedy'\) must be one of"),
        (dict(scope="world"), r"scope \('world'\) must be one of"),
        (dict(activation_mode="offload"), r"activation_mode \('offload'\) must be one of"),
        (dict(seed=-1), r"seed \(-1\) must be a non-negative int"),
    ],
)
def test_invalid_fields(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LRMoEConfig(**kwargs)


def test_defaults_and_exactness() -> None:
    cfg = LRMoEConfig()
    assert cfg.keep_ratio == 1.0 and cfg.is_exact
    assert cfg.selection == "sample" and cfg.scope == "local" and cfg.activation_mode == "save"
    assert not LRMoEConfig(keep_ratio=0.999).is_exact
    with pytest.raises(Exception):
        cfg.keep_ratio = 0.5  # frozen


def test_from_args_reads_lrmoe_flags() -> None:
    ns = argparse.Namespace(lrmoe_keep_ratio=0.25, lrmoe_selection="topk", lrmoe_scope=None)
    cfg = LRMoEConfig.from_args(ns)
    assert cfg.keep_ratio == 0.25 and cfg.selection == "topk" and cfg.scope == "local"


def _bad(**fields):
    """A valid tiny MoE config with ``fields`` forced past TransformerConfig's own checks."""
    cfg = copy.copy(moe_transformer_config())
    for k, v in fields.items():
        assert hasattr(cfg, k), f"TransformerConfig has no field {k!r}: the rule could never fire"
        object.__setattr__(cfg, k, v)
    return cfg


RULES = [
    (dict(num_moe_experts=None), r"num_moe_experts=None .* --num-experts"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4), r"num_moe_experts \(6\) must be divisible"),
    (dict(moe_token_dispatcher_type="allgather"), r"'allgather'.*--moe-token-dispatcher-type alltoall"),
    (dict(moe_token_dispatcher_type="flex"), r"'flex'.*--moe-token-dispatcher-type alltoall"),
    (dict(expert_tensor_parallel_size=2), r"expert_tensor_parallel_size=2.*--expert-tensor-parallel-size 1"),
    (dict(moe_pad_expert_input_to_capacity=True), r"drop-and-pad"),
    (dict(moe_expert_capacity_factor=1.0), r"moe_expert_capacity_factor=1.0.*--lrmoe-keep-ratio"),
    (dict(moe_apply_probs_on_input=True), r"moe_apply_probs_on_input=True"),
    (dict(overlap_moe_expert_parallel_comm=True), r"overlap_moe_expert_parallel_comm=True"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), r"overlap_dispatch_backward_with_experts_wgrad"),
    (dict(delay_wgrad_compute=True), r"delay_wgrad_compute=True"),
    (dict(moe_router_padding_for_quantization=True), r"moe_router_padding_for_quantization"),
    (dict(fp8="e4m3"), r"fp8='e4m3'"),
    (dict(moe_latent_size=16), r"moe_latent_size"),
    (dict(add_bias_linear=True), r"add_bias_linear=True.*--disable-bias-linear"),
    (dict(activation_func=torch.tanh), r"activation"),
    (
        dict(cuda_graph_impl="local", cuda_graph_modules=[]),
        r"cuda_graph_impl='local' capturing the whole transformer layer.*--cuda-graph-modules attn",
    ),
    (
        dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=[GM.attn, GM.moe_router]),
        r"capturing moe_router \(cuda_graph_modules=\['attn', 'moe_router'\]\)",
    ),
    (
        dict(cuda_graph_impl="local", cuda_graph_modules=[GM.moe_router, GM.moe_preprocess]),
        r"capturing moe_router and moe_preprocess",
    ),
    (dict(cuda_graph_impl="full_iteration"), r"capturing the whole training iteration"),
    (
        dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "moe_act"]),
        r"offload_modules=\['moe_act'\].*remove them from --offload-modules",
    ),
    (
        dict(use_te_activation_func=True, gated_linear_unit=False, activation_func=F.gelu),
        r"use_te_activation_func=True with activation_func=gelu \(gated_linear_unit=False\)",
    ),
    (
        dict(use_te_activation_func=True, gated_linear_unit=False, activation_func=F.silu),
        r"use_te_activation_func=True with activation_func=silu",
    ),
    (dict(activation_func_fp8_input_store=True), r"activation_func_fp8_input_store=True"),
    (dict(use_kitchen=True), r"use_kitchen=True.*--kitchen-config-file"),
    (
        dict(expert_tensor_parallel_num_weight_shards=2, expert_gtp_weight_remat_size=2),
        r"expert_tensor_parallel_num_weight_shards=2 .*GTP group of 2",
    ),
    (dict(transformer_impl="inference_optimized"), r"transformer_impl='inference_optimized'"),
]


@pytest.mark.parametrize("fields, match", RULES, ids=[next(iter(r[0])) for r in RULES])
def test_each_unsupported_setting_is_named(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        LRMoEConfig(keep_ratio=0.5).validate_against(_bad(**fields), "decoder.layers.3.mlp")
    assert "decoder.layers.3.mlp" in str(info.value)


def test_valid_config_passes() -> None:
    LRMoEConfig(keep_ratio=0.5).validate_against(moe_transformer_config())


def test_lean_mode_refuses_replicas_and_exchange_budgets() -> None:
    LRMoEConfig(keep_ratio=0.5, activation_mode="lean").validate_against(
        _bad(expert_model_parallel_size=2)
    )
    replicas = r"'lean'\) runs without replicas .*max_replicas_per_rank=2"
    with pytest.raises(ValueError, match=replicas):
        LRMoEConfig(keep_ratio=0.5, activation_mode="lean", max_replicas_per_rank=2)
    with pytest.raises(ValueError, match=r"exchange budget \(4096\) cannot trim"):
        LRMoEConfig(keep_ratio=0.5, activation_mode="lean", exchange_budget_bytes=4096)


@pytest.mark.parametrize(
    "fields",
    [
        # CUDA graphs of attention only; "none" ignores the (whole-layer) default modules.
        dict(cuda_graph_impl="local", cuda_graph_modules=[GM.attn]),
        dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=[GM.attn]),
        dict(cuda_graph_impl="none", cuda_graph_modules=[]),
        # Offloading outside the experts.
        dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "qkv_linear"]),
        # Listed but off.
        dict(fine_grained_activation_offloading=False, offload_modules=["expert_fc1"]),
        # SwiGLU is the same function in Transformer Engine's op and LRMoE's kernels.
        dict(use_te_activation_func=True),
        # Nothing to recompute: LRMoE's experts never save the activation's output.
        dict(recompute_granularity="selective", recompute_modules=["moe_act", "shared_experts"]),
        dict(moe_grouped_gemm=True),
    ],
    ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()),
)
def test_neighbouring_settings_pass(fields: dict) -> None:
    LRMoEConfig(keep_ratio=0.5).validate_against(_bad(**fields), "decoder.layers.3.mlp")


def test_graph_capture_reads_every_spelling() -> None:
    """Enums, names, one value or a list; the deprecated whole-layer and whole-iteration names."""
    from megatron_lrmoe.config import moe_graph_capture

    assert moe_graph_capture("local", GM.moe) == "moe"
    assert moe_graph_capture("local", ["attn"]) is None
    assert moe_graph_capture("transformer_engine", "full") == "the whole transformer layer"
    assert moe_graph_capture("none", ["full_iteration"]) == "the whole training iteration"
    assert moe_graph_capture("none", None) is None and moe_graph_capture(None, []) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(memory_budget_bytes=-1), r"memory_budget_bytes \(-1\) must be None \(unbounded\)"),
        (dict(memory_budget_bytes=1.5e9), r"memory_budget_bytes \(1500000000.0\) must be None"),
        (dict(exchange_budget_bytes=-5), r"exchange_budget_bytes \(-5\) must be None"),
        (dict(exchange_budget_bytes=True), r"exchange_budget_bytes \(True\) must be None"),
        (dict(max_replicas_per_rank=-1), r"max_replicas_per_rank \(-1\) must be an int >= 0"),
        (dict(max_replicas_per_rank=None), r"max_replicas_per_rank \(None\) must be an int"),
    ],
)
def test_invalid_budget_fields(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LRMoEConfig(**kwargs)


def test_budget_defaults_are_stock() -> None:
    cfg = LRMoEConfig()
    assert cfg.memory_budget_bytes is None and cfg.exchange_budget_bytes is None
    assert cfg.max_replicas_per_rank == 0
    cfg = LRMoEConfig(
        memory_budget_bytes=0,
        exchange_budget_bytes=10,
        max_replicas_per_rank=2,
        activation_mode="auto",
    )
    assert cfg.memory_budget_bytes == 0 and cfg.activation_mode == "auto"
