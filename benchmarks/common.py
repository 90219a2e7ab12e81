"""Shared set-up for the GPU benchmark scripts (torchrun, NCCL, one process per GPU)."""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable

import torch

QWEN3_30B_A3B_MOE = dict(
    hidden_size=2048,
    num_moe_experts=128,
    moe_router_topk=8,
    moe_ffn_hidden_size=768,
    ffn_hidden_size=6144,
    num_attention_heads=32,
)


def init_distributed(ep: int, device: str = "cuda") -> Any:
    """Process group from torchrun's environment and Megatron's parallel state (EP=ep).

    ``device="cuda"``: NCCL, one GPU per process. ``device="cpu"`` (smoke runs without a GPU):
    the test-only CPU shim (megatron_lrmoe.testing.install_cpu_shim) and gloo.
    """
    if device == "cpu":
        from megatron_lrmoe.testing import install_cpu_shim

        install_cpu_shim()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    if device == "cpu":
        torch.distributed.init_process_group("gloo")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    return get_default_pg_collection()


def moe_config(ep: int, dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> Any:
    """``TransformerConfig`` of one Qwen3-30B-A3B MoE layer (no TE: local spec)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        QWEN3_30B_A3B_MOE,
        num_layers=1,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_router_dtype="fp32",
        moe_router_pre_softmax=False,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        expert_model_parallel_size=ep,
        transformer_impl="local",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def gamma_shares(experts: int, cv: float, seed: int | None = None) -> torch.Tensor:
    """``experts`` shares (not normalised) from a Gamma distribution of coefficient of variation
    ``cv`` (shape ``1 / cv**2``, rate 1), all ones at ``cv`` 0 (nothing drawn). Drawn from
    torch's global CPU generator as it stands, or, with ``seed``, from it seeded so and then
    restored (the global stream goes on as if nothing had been drawn)."""
    if cv <= 0:
        return torch.ones(experts)
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return gamma_shares(experts, cv)
    return torch.distributions.Gamma(torch.full((experts,), 1.0 / cv**2), 1.0).sample()


class CudaTimer:
    """Median of CUDA-event timings."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable[[], Any]) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        self.samples.setdefault(name, []).append(start.elapsed_time(end))
        return out

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def expert_grads(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``([L, F1, H], [L, H, F])`` expert weight gradients of a stock or an LRMoE layer."""
    experts = layer.experts
    if hasattr(experts, "weights"):  # LRGroupedMLP: one parameter per projection
        w1, w2 = experts.weights()
        return w1.grad, w2.grad
    fc1 = torch.stack([e.linear_fc1.weight.grad for e in experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.grad for e in experts.local_experts])
    return fc1, fc2


def host_us_per_call(fn: Callable[[], object], calls: int, warmup: int = 10) -> float:
    """Host microseconds to enqueue one call of ``fn`` (GPU): the loop is not synced, so the
    device limits it only when its work per call exceeds the host's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def cuda_median_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median CUDA-event milliseconds of ``fn`` started on an idle device, after ``warmup``
    calls."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for it in range(warmup + iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if it >= warmup:
            samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def write_json(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)


def zero_grads(layer: Any) -> None:
    """Drops every ``.grad`` and clears DDP's fused-accumulation flag (between benchmark calls)."""
    for p in layer.parameters():
        p.grad = None
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = False


def attach_main_grad(layer: Any) -> None:
    """What Megatron's DDP gives every parameter: an fp32 ``main_grad`` and a hook that adds
    each new ``.grad`` into it (unless the layer already did) and drops the ``.grad``."""

    def hook(p: torch.Tensor) -> None:
        if not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
        p.register_post_accumulate_grad_hook(hook)
