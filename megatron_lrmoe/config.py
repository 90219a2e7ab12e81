"""LRMoE configuration: one frozen dataclass, validated against Megatron's ``TransformerConfig``.

Every field has a default that means "stock behaviour or the documented default"; ``keep_ratio=1.0``
makes the backward numerically the stock Megatron-Core path (all pairs kept, no reweighting).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

from megatron_lrmoe.options import KernelOptions

Selection = Literal["sample", "topk"]
Scope = Literal["local", "global"]
ActivationMode = Literal["save", "recompute", "lean", "auto"]
GradAccumulationFusion = Literal["auto", "on", "off"]
ActivationKind = Literal["silu", "gelu"]
KeepRatio = Union[float, Literal["auto"]]

SELECTIONS: tuple[str, ...] = ("sample", "topk")
SCOPES: tuple[str, ...] = ("local", "global")
ACTIVATION_MODES: tuple[str, ...] = ("save", "recompute", "lean", "auto")
GRAD_ACCUMULATION_FUSIONS: tuple[str, ...] = ("auto", "on", "off")


@dataclass(frozen=True)
class LRMoEConfig:
    """How an LRMoE layer trims its backward pass.

    Attributes:
        keep_ratio: Fraction of each expert's token-expert pairs ("pairs") that survive the backward
            pass: quota ``Q[e] = ceil(keep_ratio * N[e])`` for an expert that received ``N[e]``
            pairs in this layer call. ``1.0`` keeps every pair (numerically the stock backward);
            ``0.0`` gives the experts no gradient while the router gradient stays exact.
            ``"auto"``: each layer sets its keep ratio per call from ``variance_target``
            (``control/auto_keep.py``): the smallest ratio on a grid of sixteenths whose
            sampling would have added at most that relative variance to the expert weight
            gradients in the layer's recent calls. Needs ``selection="sample"``.
        selection: Which pairs survive. ``"sample"`` (default): an unbiased importance sample of
            exactly ``Q[e]`` pairs, inclusion probability proportional to ``sqrt(score)`` capped at
            1, kept rows weighted by ``1/probability`` (systematic sampling from a seeded stream).
            ``"topk"``: the ``Q[e]`` highest LRM scores, the published rule; biased, see
            docs/design.md for the convergence probe that made ``sample`` the default.
        scope: Over which pairs an expert's quota is applied. ``"local"`` (default): the quota is
            split over source ranks in forward (largest remainder, proportional to each source's
            pairs) and every source selects among its own pairs: no extra exchange and no extra
            device-to-host sync in backward. ``"global"``: the expert's owner selects among the
            pairs of all sources, which costs one exchange of one fp32 score per pair, one
            exchange of one weight per pair back, and one device-to-host sync.
        activation_mode: What the expert side keeps for backward. ``"save"`` (stock-like): the
            received token rows and the fc1 output of every pair. ``"recompute"``: nothing on the
            expert side; the source re-sends the kept pairs' token rows with their gradient rows
            and the expert recomputes fc1 for kept rows only; the source keeps every pair's
            expert output z (H per pair) for the exact router gradient. ``"lean"``: as
            ``"recompute"``, but the expert side keeps every pair's activation a (F per pair,
            F < H in Qwen3 and GLM shapes) instead of z, and the backward takes the exact router
            gradient as ``<W2^T g, a>`` (one extra fc2 input-gradient GEMM over the pairs the
            quota drops; at EP > 1 every pair's gradient row goes to its expert first, as in
            stock's backward, one scalar per pair comes back, and the kept pairs send only their
            token rows, positions and scales); no replicas, no exchange budget. ``"auto"``: the
            controller chooses per call: ``"save"`` unless the memory budget trims it, then
            ``"recompute"``, then ``"lean"`` (without replicas and exchange budget): the first
            the budget does not trim, else the one that keeps the most pairs
            (megatron_lrmoe/control/controller.py).
        seed: Seed of the sampling stream; the stream is also keyed by layer number and call
            index, so every rank and every rerun draws the same sample.
        record_stats: Keep per-call statistics on ``layer.last_call_stats`` (counts, bytes, and
            timings of scoring/selection/packing). Timing uses CUDA events on GPU.
        debug_record_selection: Also keep the kept mask of each call (per source rank, in the
            source's permuted pair order) in the statistics. Costs memory; for tests and debugging.
        debug_check_invariants: Check the integer plan's invariants at run time (quota range,
            the split over sources and its sums; with the controller, every invariant of its
            plan). Host-side only; for debugging.
        memory_budget_bytes: Per-GPU bytes one layer call may hold for its backward: replica
            weights and their gradient buffers, saved activations and the backward's token
            buffers (control/costs.py lists the terms). ``None`` (default): unbounded. A call
            that would exceed it keeps fewer pairs (hot experts first); ``keep_ratio`` stays the
            upper bound. 0 keeps no pair.
        exchange_budget_bytes: Per-GPU bytes sent or received in the backward's gradient
            exchange, every kept row counted. ``None`` (default): unbounded.
        max_replicas_per_rank: Copies of other ranks' experts one rank may host in a call to
            balance the load (placed per call by the controller; weights fetched from the owner
            once per training step, gradients added into the owner's). Needs ``scope="local"``.
            0 (default): fixed ownership, as stock Megatron.
        grad_accumulation_fusion: Where the expert weight gradients go under Megatron's DDP.
            ``"on"``: the weight-gradient GEMMs add into the parameters' fp32 ``main_grad``
            themselves (one fused kernel per projection; the bf16 gradient and DDP's
            ``main_grad += grad`` are skipped), like TE's and apex's linear layers with
            Megatron's ``gradient_accumulation_fusion``. ``"off"``: the layer returns the bf16
            gradient and DDP adds it. ``"auto"`` (default): follow the Megatron config's
            ``gradient_accumulation_fusion``, so the experts accumulate as stock's do. With
            replicas the holders' gradients are added into the owner's ``main_grad`` too.
            Megatron-FSDP's parameters get their buffer from ``get_main_grad()``, written over
            where they set ``overwrite_main_grad``, as TE's layers do. Parameters without
            ``main_grad`` and fp64 weights always take the unfused path.
        variance_target: With ``keep_ratio="auto"`` only: the variance the sample may add to
            the expert weight gradients, relative to their own mini-batch noise
            (``select/variance.py``; e.g. 0.1). Budgets stay hard limits over it.
        kernels: The fast paths the layer may take (Triton kernels, torch's grouped GEMM, the
            backward's CUDA graphs, the compiled planner), all on by default; switch one off to
            debug it or to time the code without it (``megatron_lrmoe/options.py``).
    """

    keep_ratio: KeepRatio = 1.0
    selection: Selection = "sample"
    scope: Scope = "local"
    activation_mode: ActivationMode = "save"
    seed: int = 1234
    record_stats: bool = True
    debug_record_selection: bool = False
    debug_check_invariants: bool = False
    memory_budget_bytes: Optional[int] = None
    exchange_budget_bytes: Optional[int] = None
    max_replicas_per_rank: int = 0
    grad_accumulation_fusion: GradAccumulationFusion = "auto"
    variance_target: Optional[float] = None
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self) -> None:
        self._check_keep_ratio()
        _check_choice("selection", self.selection, SELECTIONS)
        _check_choice("scope", self.scope, SCOPES)
        _check_choice("activation_mode", self.activation_mode, ACTIVATION_MODES)
        _check_choice(
            "grad_accumulation_fusion", self.grad_accumulation_fusion, GRAD_ACCUMULATION_FUSIONS
        )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LRMoEConfig.seed ({self.seed!r}) must be a non-negative int")
        for name in ("memory_budget_bytes", "exchange_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < 0):
                raise ValueError(
                    f"LRMoEConfig.{name} ({value!r}) must be None (unbounded) or an int >= 0"
                )
        if _not_int(self.max_replicas_per_rank) or self.max_replicas_per_rank < 0:
            raise ValueError(
                f"LRMoEConfig.max_replicas_per_rank ({self.max_replicas_per_rank!r}) must be an "
                "int >= 0 (0: fixed ownership)"
            )
        conflicts = self.lean_conflicts()
        if self.activation_mode == "lean" and conflicts:
            raise ValueError(f"LRMoEConfig.activation_mode ('lean') {conflicts[0]}")
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(
                f"LRMoEConfig.kernels ({self.kernels!r}) must be a "
                "megatron_lrmoe.KernelOptions (e.g. KernelOptions(triton=False))"
            )

    def lean_conflicts(self) -> list[str]:
        """Why ``activation_mode="lean"`` cannot run with these settings (empty: it can).

        Lean sends every pair's gradient row to the expert that owns it, so it takes neither
        replicas nor an exchange budget. The refusal of ``"lean"`` and ``"auto"``'s choice of
        candidates both read this.
        """
        out = []
        if self.max_replicas_per_rank > 0:
            out.append(
                f"runs without replicas (got max_replicas_per_rank={self.max_replicas_per_rank}); "
                "use --lrmoe-activation-mode recompute or --lrmoe-max-replicas-per-rank 0"
            )
        if self.exchange_budget_bytes is not None:
            out.append(
                "sends every pair's gradient row, which an exchange budget "
                f"({self.exchange_budget_bytes}) cannot trim; use --lrmoe-activation-mode "
                "recompute or drop --lrmoe-exchange-budget-bytes"
            )
        return out

    def _check_keep_ratio(self) -> None:
        if self.keep_ratio == "auto":
            target = self.variance_target
            if _not_number(target) or not math.isfinite(target) or target <= 0:
                raise ValueError(
                    f"LRMoEConfig.variance_target ({target!r}) must be a number > 0 with "
                    "keep_ratio='auto' (the relative variance the sample may add, e.g. 0.1)"
                )
            if self.selection != "sample":
                raise ValueError(
                    f"LRMoEConfig.keep_ratio ('auto') needs selection='sample' (got "
                    f"{self.selection!r}: topk adds a bias, not a variance); use "
                    "--lrmoe-selection sample or a fixed --lrmoe-keep-ratio"
                )
            return
        if _not_number(self.keep_ratio) or not math.isfinite(self.keep_ratio):
            raise ValueError(
                f"LRMoEConfig.keep_ratio ({self.keep_ratio!r}) must be a finite number or 'auto'"
            )
        if not 0.0 <= float(self.keep_ratio) <= 1.0:
            raise ValueError(
                f"LRMoEConfig.keep_ratio ({self.keep_ratio}) must be in [0, 1]; use 1.0 for the "
                "stock backward"
            )
        if self.variance_target is not None:
            raise ValueError(
                f"LRMoEConfig.variance_target ({self.variance_target!r}) applies only to "
                f"keep_ratio='auto' (got keep_ratio={self.keep_ratio}); pass "
                "--lrmoe-keep-ratio auto or drop --lrmoe-variance-target"
            )

    @property
    def is_auto(self) -> bool:
        """True when the layers choose their keep ratio per call (``keep_ratio="auto"``)."""
        return self.keep_ratio == "auto"

    def at_keep_ratio(self, keep_ratio: float) -> "LRMoEConfig":
        """This config with a fixed ``keep_ratio`` (what an ``"auto"`` layer plans one call
        with); ``variance_target`` is dropped with ``"auto"``."""
        return dataclasses.replace(self, keep_ratio=float(keep_ratio), variance_target=None)

    def fuses_grad_accumulation(self, config: Any) -> bool:
        """Whether the expert weight gradients add into ``main_grad`` in their GEMMs, given the
        layer's Megatron ``TransformerConfig`` (``grad_accumulation_fusion="auto"`` follows its
        ``gradient_accumulation_fusion``)."""
        if self.grad_accumulation_fusion == "auto":
            return bool(getattr(config, "gradient_accumulation_fusion", False))
        return self.grad_accumulation_fusion == "on"

    @property
    def is_exact(self) -> bool:
        """True when every pair is kept, i.e. the backward equals the stock one."""
        return not self.is_auto and float(self.keep_ratio) >= 1.0

    def validate_against(self, config: Any, layer_name: str = "LRMoELayer") -> None:
        """Raise ``ValueError`` if ``config`` (a ``TransformerConfig``) uses settings LRMoE lacks.

        Args:
            config: The Megatron ``TransformerConfig`` of the MoE layer.
            layer_name: Named in error messages so a user can find the layer.
        """
        validate_transformer_config(config, layer_name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LRMoEConfig":
        """Build from parsed ``--lrmoe-*`` flags (see ``megatron_lrmoe.add_lrmoe_args``): one
        ``lrmoe_<field>`` attribute per field, and for ``kernels`` one ``lrmoe_<switch>`` per
        :class:`KernelOptions` switch (``--no-lrmoe-<switch>``); unset ones (absent or None)
        keep their defaults."""
        kwargs = {}
        for f in fields(cls):
            name = f"lrmoe_{f.name}"
            if f.name != "kernels" and getattr(args, name, None) is not None:
                kwargs[f.name] = getattr(args, name)
        switches = {
            f.name: getattr(args, f"lrmoe_{f.name}")
            for f in fields(KernelOptions)
            if getattr(args, f"lrmoe_{f.name}", None) is not None
        }
        if switches:
            kwargs["kernels"] = KernelOptions(**switches)
        return cls(**kwargs)


def _not_int(value: Any) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _not_number(value: Any) -> bool:
    return not isinstance(value, (int, float)) or isinstance(value, bool)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"LRMoEConfig.{name} ({value!r}) must be one of {list(choices)}")


def _fail(layer_name: str, what: str, fix: str) -> None:
    raise ValueError(f"{layer_name}: {what} is not supported by LRMoE; {fix}")


# ``offload_modules`` entries whose offloading points live inside Megatron's expert modules,
# which LRMoE replaces (fine-grained activation offloading): nothing would be offloaded.
EXPERT_OFFLOAD_MODULES: tuple[str, ...] = ("expert_fc1", "moe_act", "fused_group_mlp")
# ``cuda_graph_modules`` entries that capture part of an MoE layer.
MOE_GRAPH_MODULES: tuple[str, ...] = ("moe", "moe_router", "moe_preprocess")
_DEPRECATED_WHOLE_SCOPES = ("full", "full_iteration", "full_iteration_inference")


def graph_module_names(modules: Any) -> list[str]:
    """``cuda_graph_modules`` (enums, names, one value or a list) as a list of names."""
    if modules is None:
        return []
    items = modules if isinstance(modules, (list, tuple)) else [modules]
    return [getattr(m, "name", str(m)) for m in items]


def moe_graph_capture(impl: Optional[str], modules: Any) -> Optional[str]:
    """What Megatron's training CUDA graphs would capture of an MoE layer, or ``None``.

    Args:
        impl: ``cuda_graph_impl`` (``"none"``, ``"local"``, ``"transformer_engine"``,
            ``"full_iteration"``).
        modules: ``cuda_graph_modules``; empty (or the deprecated ``"full"``) is the whole layer,
            the deprecated ``"full_iteration"`` means ``impl="full_iteration"``.
    """
    names = graph_module_names(modules)
    if "full_iteration" in names:
        impl = "full_iteration"
    if impl == "full_iteration":
        return "the whole training iteration"
    if impl not in ("local", "transformer_engine"):
        return None
    names = [n for n in names if n not in _DEPRECATED_WHOLE_SCOPES]
    if not names:
        return "the whole transformer layer"
    moe = [n for n in names if n in MOE_GRAPH_MODULES]
    return " and ".join(moe) if moe else None


def offloaded_expert_modules(config: Any) -> list[str]:
    """The ``offload_modules`` of ``config`` that point inside the stock experts (if on)."""
    if not getattr(config, "fine_grained_activation_offloading", False):
        return []
    listed = getattr(config, "offload_modules", None) or []
    return [m for m in listed if m in EXPERT_OFFLOAD_MODULES]


def expert_activation(config: Any) -> tuple[bool, ActivationKind]:
    """Reads ``(gated, kind)`` of the expert activation from a Megatron ``TransformerConfig``.

    Supported: ``activation_func`` in {``F.silu``, ``F.gelu``}, gated or not, with
    ``glu_linear_offset == 0``, no ``activation_func_clamp_value`` and no
    ``moe_mlp_glu_interleave_size``. The experts build their ``GluSpec`` from it
    (``experts.activation.activation_spec_from_config``).

    Args:
        config: A ``megatron.core.transformer.TransformerConfig`` (or any object with the same
            attributes; missing optional ones count as their Megatron defaults).

    Returns:
        Whether the activation is gated, and ``"silu"`` or ``"gelu"``.

    Raises:
        ValueError: Naming the unsupported setting and how to change it.
    """
    # Imported here so the config module stays importable without torch-heavy imports.
    import torch.nn.functional as F

    func = getattr(config, "activation_func", None)
    if func is F.silu:
        kind: ActivationKind = "silu"
    elif func is F.gelu:
        kind = "gelu"
    else:
        name = getattr(func, "__qualname__", None) or repr(func)
        raise ValueError(
            f"activation_func={name} is not supported by the LRMoE expert ops; set "
            "activation_func to torch.nn.functional.silu (SwiGLU with gated_linear_unit=True) "
            "or torch.nn.functional.gelu"
        )
    gated = bool(getattr(config, "gated_linear_unit", False))
    clamp = getattr(config, "activation_func_clamp_value", None)
    if clamp is not None:
        raise ValueError(
            f"activation_func_clamp_value={clamp} is not supported by the LRMoE expert ops; "
            "set activation_func_clamp_value=None"
        )
    offset = getattr(config, "glu_linear_offset", 0.0)
    if offset is not None and float(offset) != 0.0:
        raise ValueError(
            f"glu_linear_offset={offset} is not supported by the LRMoE expert ops; "
            "set glu_linear_offset=0.0"
        )
    interleave = getattr(config, "moe_mlp_glu_interleave_size", None)
    if gated and interleave is not None:
        raise ValueError(
            f"moe_mlp_glu_interleave_size={interleave} is not supported by the LRMoE expert "
            "ops (they expect fc1 as [gate | up] halves); set moe_mlp_glu_interleave_size=None"
        )
    return gated, kind


def validate_transformer_config(config: Any, layer_name: str = "LRMoELayer") -> None:
    """Reject Megatron settings that the LRMoE layer does not implement.

    Each rule names the offending value and the fix. Rules are listed in docs/config.md.
    """
    # Imported here so the config module stays importable without torch-heavy imports.
    import torch.nn.functional as F

    num_experts: Optional[int] = config.num_moe_experts
    if not num_experts:
        _fail(layer_name, f"num_moe_experts={num_experts!r}", "set --num-experts (MoE layers only)")
    ep = config.expert_model_parallel_size or 1
    if num_experts % ep != 0:
        raise ValueError(
            f"{layer_name}: num_moe_experts ({num_experts}) must be divisible by "
            f"expert_model_parallel_size ({ep})"
        )
    impl = getattr(config, "cuda_graph_impl", "none")
    modules = getattr(config, "cuda_graph_modules", None)
    graphed = moe_graph_capture(impl, modules)
    offloaded = offloaded_expert_modules(config)
    func = getattr(config, "activation_func", None)
    act_name = getattr(func, "__name__", None) or repr(func)
    gated = bool(getattr(config, "gated_linear_unit", False))
    gtp = int(getattr(config, "expert_gtp_weight_remat_size", 1) or 1)
    te_act_matches = gated and func is F.silu  # SwiGLU: Transformer Engine's op is the same
    rules: list[tuple[bool, str, str]] = [
        (
            config.moe_token_dispatcher_type != "alltoall",
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}",
            "use --moe-token-dispatcher-type alltoall",
        ),
        (
            (config.expert_tensor_parallel_size or 1) != 1,
            f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}",
            "use --expert-tensor-parallel-size 1",
        ),
        (
            bool(config.moe_pad_expert_input_to_capacity),
            "moe_pad_expert_input_to_capacity=True (drop-and-pad)",
            "drop --moe-pad-expert-input-to-capacity",
        ),
        (
            config.moe_expert_capacity_factor is not None,
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor}",
            "LRMoE is dropless in forward; drop --moe-expert-capacity-factor and use "
            "--lrmoe-keep-ratio to trim the backward instead",
        ),
        (
            bool(config.moe_apply_probs_on_input),
            "moe_apply_probs_on_input=True",
            "drop --moe-apply-probs-on-input",
        ),
        (
            bool(config.overlap_moe_expert_parallel_comm),
            "overlap_moe_expert_parallel_comm=True (EP A2A overlap)",
            "drop --overlap-moe-expert-parallel-comm",
        ),
        (
            bool(config.overlap_dispatch_backward_with_experts_wgrad),
            "overlap_dispatch_backward_with_experts_wgrad=True",
            "drop --overlap-dispatch-backward-with-experts-wgrad",
        ),
        (
            bool(config.delay_wgrad_compute),
            "delay_wgrad_compute=True",
            "drop --delay-wgrad-compute",
        ),
        (
            bool(config.moe_router_padding_for_quantization),
            "moe_router_padding_for_quantization=True",
            "drop --moe-router-padding-for-quantization",
        ),
        (
            bool(config.fp8) or bool(config.fp4),
            f"fp8={config.fp8!r} / fp4={config.fp4!r} experts",
            "train the MoE layers in bf16 or fp32",
        ),
        (config.moe_latent_size is not None, "moe_latent_size", "drop --moe-latent-size"),
        (
            bool(config.add_bias_linear),
            "add_bias_linear=True (expert biases)",
            "use --disable-bias-linear",
        ),
        (
            bool(config.moe_permute_fusion),
            "moe_permute_fusion=True",
            "drop --moe-permute-fusion (the LRMoE path permutes with the unfused kernels)",
        ),
        (
            graphed is not None,
            f"cuda_graph_impl={impl!r} capturing {graphed} "
            f"(cuda_graph_modules={graph_module_names(modules)})",
            "the layer plans every call on the host and replays its own graphs inside; capture "
            "attention only (--cuda-graph-modules attn) or drop --cuda-graph-impl",
        ),
        (
            bool(offloaded),
            f"offload_modules={offloaded} (fine-grained activation offloading inside the experts)",
            "LRMoE's expert op has no such offloading points; remove them from --offload-modules",
        ),
        (
            bool(getattr(config, "use_te_activation_func", False)) and not te_act_matches,
            f"use_te_activation_func=True with activation_func={act_name} "
            f"(gated_linear_unit={gated})",
            "LRMoE's experts compute the activation with their own kernels (exact SiLU, erf "
            "GELU), which is Transformer Engine's function only for SwiGLU; drop "
            "--use-te-activation-func",
        ),
        (
            bool(getattr(config, "activation_func_fp8_input_store", False)),
            "activation_func_fp8_input_store=True",
            "LRMoE keeps fc1's output in the parameters' dtype for the backward; set it False",
        ),
        (
            bool(getattr(config, "use_kitchen", False)),
            "use_kitchen=True (kitchen-quantised linear layers)",
            "LRMoE's experts are not quantised; drop --kitchen-config-file / "
            "--kitchen-recipe-number",
        ),
        (
            gtp > 1,
            "expert_tensor_parallel_num_weight_shards="
            f"{getattr(config, 'expert_tensor_parallel_num_weight_shards', None)} (expert "
            f"weights sharded over a GTP group of {gtp})",
            "LRMoE's expert weights are whole on each rank; leave "
            "--expert-tensor-parallel-num-weight-shards unset",
        ),
        (
            getattr(config, "transformer_impl", "local") == "inference_optimized",
            "transformer_impl='inference_optimized'",
            "LRMoE is a training feature; use transformer_impl 'local' or 'transformer_engine'",
        ),
    ]
    for bad, what, fix in rules:
        if bad:
            _fail(layer_name, what, fix)
    try:
        expert_activation(config)
    except ValueError as e:
        raise ValueError(f"{layer_name}: {e}") from e
