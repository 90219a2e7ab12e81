"""``--lrmoe`` / ``--lrmoe-*`` command-line flags for Megatron's ``extra_args_provider``.

Typical use (this is what ``pretrain_lrmoe.py`` does)::

    args = parse_and_validate_args(extra_args_provider=add_lrmoe_args)
    validate_lrmoe_args(args)                   # ValueError naming both flags of a bad pair
    lrmoe_config = lrmoe_config_from_args(args)  # None unless --lrmoe

Every ``LRMoEConfig`` field has one flag, ``--lrmoe-<field with dashes>``, except ``kernels``,
whose switches (``KernelOptions``, all on) have one flag each in a group of their own,
``--no-lrmoe-<switch with dashes>`` (Megatron's ``--no-*-fusion`` style). The flags default to
``None`` ("not given"), so ``LRMoEConfig``'s own defaults apply and a ``--lrmoe-*`` flag given
without ``--lrmoe`` is detected. Stock ``--moe-*`` flags keep their meaning: LRMoE only replaces
the MoE layer class, so the router, load balancing and expert shapes still come from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_lrmoe.config import (
    ACTIVATION_MODES,
    GRAD_ACCUMULATION_FUSIONS,
    SCOPES,
    SELECTIONS,
    LRMoEConfig,
    graph_module_names,
    moe_graph_capture,
    offloaded_expert_modules,
)
from megatron_lrmoe.options import KernelOptions

__all__ = [
    "LRMOE_FLAGS",
    "LRMOE_HELP_FLAG",
    "LRMOE_KERNEL_FLAGS",
    "LRMOE_TRACE_FLAG",
    "add_lrmoe_args",
    "lrmoe_help_text",
    "lrmoe_config_from_args",
    "parse_bytes",
    "validate_lrmoe_args",
]

# The config's fields with one flag each (``kernels`` has one per switch: LRMOE_KERNEL_FLAGS).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LRMoEConfig) if f.name != "kernels"}
_CHOICES = {
    "selection": SELECTIONS,
    "scope": SCOPES,
    "activation_mode": ACTIVATION_MODES,
    "grad_accumulation_fusion": GRAD_ACCUMULATION_FUSIONS,
}


def _flag(field_name: str) -> str:
    return "--lrmoe-" + field_name.replace("_", "-")


LRMOE_FLAGS: dict[str, str] = {name: _flag(name) for name in _DEFAULTS}
"""``LRMoEConfig`` field name -> its command-line flag (every field but ``kernels``)."""

LRMOE_KERNEL_FLAGS: dict[str, str] = {
    f.name: _flag(f.name) for f in dataclasses.fields(KernelOptions)
}
"""``KernelOptions`` switch -> its flag (``--lrmoe-<switch>``; ``--no-lrmoe-<switch>`` turns it
off: ``LRMoEConfig.kernels``)."""

LRMOE_HELP_FLAG = "--lrmoe-help"
LRMOE_TRACE_FLAG = "--lrmoe-trace-dir"
"""Prints only the "LRMoE" argument group and exits (Megatron's ``--help`` is ~3,900 lines)."""

_HELP: dict[str, str] = {
    "keep_ratio": (
        "Fraction of each expert's token-expert pairs that survive the MoE backward: quota "
        "ceil(K * pairs) per expert and layer call. 1.0 keeps every pair (the stock backward); "
        "the forward is always exact. 'auto': each layer picks K per call (a multiple of 1/16) "
        "from --lrmoe-variance-target, from the scores of its recent calls (needs "
        "--lrmoe-selection sample). Default: %(def)s."
    ),
    "selection": (
        "Which pairs survive. 'sample': an unbiased importance sample (probability ~ "
        "sqrt(LRM score), kept rows weighted by 1/probability). 'topk': the highest LRM "
        "scores (the published rule; biased). Default: %(def)s."
    ),
    "scope": (
        "Where an expert's quota is applied. 'local': split over source ranks in forward, each "
        "source selects among its own pairs (no extra exchange). 'global': the expert's owner "
        "selects among all sources' pairs (one extra score exchange and one device-to-host "
        "sync per layer call). Default: %(def)s."
    ),
    "activation_mode": (
        "What the expert side keeps for backward. 'save': received token rows and fc1 outputs "
        "(stock-like). 'recompute': nothing; kept rows are re-sent with their gradients and "
        "fc1 is recomputed for them only; the source keeps each pair's expert output (H wide) "
        "for the exact router gradient. 'lean': as 'recompute', keeping each pair's "
        "activation (F wide) at the expert instead and taking the router gradient through fc2 "
        "(at EP > 1 every pair's gradient row is sent, as in stock; no replicas). "
        "'auto': the controller picks per layer call: 'save' unless the memory budget trims "
        "it, then 'recompute', then 'lean' (no replicas, no exchange budget), the first the "
        "budget does not trim, else the one keeping the most pairs. Default: %(def)s."
    ),
    "seed": (
        "Seed of the pair-sampling stream (keyed further by layer and call, identical on every "
        "rank and rerun). Default: Megatron's --seed."
    ),
    "record_stats": (
        "Keep per-call statistics (kept pairs, bytes sent, timings) on each LRMoE layer's "
        "last_call_stats. Default: %(def)s."
    ),
    "debug_record_selection": (
        "Also keep each call's kept-pair mask in the statistics (memory; for debugging). "
        "Default: off."
    ),
    "debug_check_invariants": (
        "Check the integer plan's invariants at run time (adds device-to-host syncs; for "
        "debugging). Default: off."
    ),
    "memory_budget_bytes": (
        "Per-GPU bytes one MoE layer call may hold for its backward: replica weights and "
        "gradient buffers, saved activations and backward token buffers. Calls that would "
        "exceed it keep fewer pairs, hottest experts trimmed first (--lrmoe-keep-ratio stays the "
        "upper bound). Accepts K/M/G/KiB/MiB/GiB suffixes. Default: unbounded."
    ),
    "exchange_budget_bytes": (
        "Per-GPU bytes sent or received by the MoE backward's gradient exchange per layer call; "
        "calls that would exceed it keep fewer pairs. Accepts K/M/G/KiB/MiB/GiB suffixes. "
        "Default: unbounded."
    ),
    "max_replicas_per_rank": (
        "Copies of other ranks' hot experts one rank may host per layer call to balance the "
        "expert load (placed per call by the controller; replica weights fetched once per step, "
        "their gradients added into the owner's). Needs --lrmoe-scope local. Default: %(def)s "
        "(fixed ownership, as stock Megatron)."
    ),
    "grad_accumulation_fusion": (
        "Expert weight gradients under Megatron's DDP. 'on': the weight-gradient GEMMs add into "
        "the fp32 main_grad themselves (no bf16 gradient, no separate main_grad += grad), like "
        "TE's linear layers with --gradient-accumulation-fusion (Megatron-FSDP's buffers too: "
        "written over where it sets overwrite_main_grad); works without TE and apex. "
        "'off': DDP adds the bf16 gradient. 'auto': follow --gradient-accumulation-fusion / "
        "--no-gradient-accumulation-fusion. Default: %(def)s."
    ),
    "variance_target": (
        "With --lrmoe-keep-ratio auto: the variance the pair sample may add to the expert "
        "weight gradients, relative to their own mini-batch noise (e.g. 0.1; the 'added "
        "variance' metric). Budgets stay hard limits. Default: none (required with auto)."
    ),
}

_KERNEL_HELP: dict[str, str] = {
    "triton": (
        "The Triton kernels on CUDA (row gathers and packing, the pair plan, pair scores, the "
        "selection, the activation, the weight gradients into main_grad). Off: their torch "
        "implementations, and no CUDA graphs (they replay those kernels)."
    ),
    "grouped_mm": (
        "torch's grouped_mm for the experts' grouped GEMMs where it runs without a "
        "device-to-host sync (bf16 on sm90/sm100 GPUs, widths a multiple of 16 bytes). Off: one "
        "torch.mm per expert."
    ),
    "select_graphs": (
        "The backward's selection replayed as a CUDA graph, captured per shape on its second "
        "call. Off: launched kernel by kernel, and the scoring, front and expert graphs off "
        "too."
    ),
    "score_graphs": (
        "The pair scoring inside the selection's graph. Off: launched before it (and the "
        "front graph off)."
    ),
    "front_graphs": (
        "The router gradient's row-dot and the packing of the kept rows inside the scoring "
        "and selection graph. Off: launched around it."
    ),
    "expert_graphs": (
        "At EP 1 with the weight gradients fused into main_grad "
        "(--lrmoe-grad-accumulation-fusion): the whole trimmed backward as one CUDA graph per "
        "layer. Off: the front replayed alone, the expert half launched kernel "
        "by kernel (saves the graphs' memory)."
    ),
    "native_planner": (
        "The controller's compiled planner (control/_native.c, built on first use with the "
        "system C compiler; same plans). Off: the Python planner (slower)."
    ),
}

_BYTE_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str) -> int:
    """``"512"``, ``"80G"`` or ``"1.5GiB"`` as a whole number of bytes (argparse ``type``).

    K/M/G/T are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; a trailing B is optional.
    """
    match = _BYTE_COUNT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count such as 512, 80G or 24GiB")
    number, unit = match.group(1), (match.group(2) or "").lower()
    scale = 1024 ** ("kmgt".index(unit[0]) + 1) if unit.endswith("i") else _BYTE_UNITS[unit]
    return int(float(number) * scale)


def _keep_ratio(text: str) -> float | str:
    """``--lrmoe-keep-ratio``: a number, or ``auto`` (argparse ``type``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number in [0, 1] nor 'auto'"
        ) from None


class _LRMoEHelpAction(argparse.Action):
    """``--lrmoe-help``: like ``-h``, but prints the LRMoE group only."""

    def __init__(self, option_strings: list[str], dest: str, help: Optional[str] = None) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        sys.stdout.write(lrmoe_help_text(parser.prog))
        parser.exit()


def lrmoe_help_text(prog: str = "pretrain_lrmoe.py") -> str:
    """The help text of the "LRMoE" argument group alone (what ``--lrmoe-help`` prints).

    Builds a parser with only this group, so no Megatron import is needed.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s <Megatron GPT / MoE flags> --lrmoe [--lrmoe-* ...]",
        add_help=False,
    )
    return add_lrmoe_args(parser).format_help()


def add_lrmoe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "LRMoE" argument group; use as Megatron's ``extra_args_provider``.

    Args:
        parser: Megatron's parser (or any ``argparse.ArgumentParser``).

    Returns:
        The same parser, as ``extra_args_provider`` must.
    """
    group = parser.add_argument_group(
        title="LRMoE",
        description=(
            "Quota-limited, compacted MoE backward (megatron-lrmoe). Needs "
            "--moe-token-dispatcher-type alltoall, --disable-bias-linear, expert tensor "
            "parallel size 1 and a dropless MoE; every --lrmoe-* flag needs --lrmoe."
        ),
    )
    group.add_argument(
        "--lrmoe",
        action="store_true",
        help=(
            "Build every MoE layer, MTP layers included, as an LRMoE layer (exact forward, "
            f"quota-limited backward). Without it the model is stock Megatron. {LRMOE_HELP_FLAG} "
            "lists only the LRMoE flags."
        ),
    )
    group.add_argument(
        LRMOE_HELP_FLAG,
        action=_LRMoEHelpAction,
        help="Show the LRMoE flags only (this group) and exit.",
    )
    group.add_argument(
        "--moe-layer-timing",
        action="store_true",
        help=(
            "Log the time spent in the MoE layers (forward + backward, CUDA events, every "
            "overhead included) per iteration and since the start, summed over the pipeline "
            "stages, for stock and LRMoE layers alike (a line after Megatron's, and moe/layer_* "
            "scalars), with the peak allocated GPU memory and the allocator's retries. Does not "
            "need --lrmoe."
        ),
    )
    group.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        metavar="GIB",
        help=(
            "Cap each process's GPU memory (PyTorch's caching allocator) at GIB GiB, so that a "
            "large GPU behaves as a smaller one in comparison runs (78 for an 80 GB card, 38 "
            "for a 40 GB one; megatron_lrmoe/training/memory_cap.py). Logged at start. Stock "
            "runs too; does not need --lrmoe. Default: no cap. The allocator's cap leaves out "
            "what the process holds outside it (3.6 GiB in a 24-layer run on an H100): to "
            "stand for a card whole, use --gpu-memory-gib."
        ),
    )
    group.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        metavar="GIB",
        help=(
            "Emulate a card with GIB GiB of memory in all (as torch reports it: 79.18 for an "
            "H100 80GB): hold the rest of this process's GPU outside PyTorch's allocator, so "
            "that the CUDA context, NCCL and cuBLAS count against GIB as on that card "
            "(megatron_lrmoe/training/memory_cap.py; one process per GPU). Logged at start. "
            "Not with --memory-cap-gib. Default: the GPU's own memory."
        ),
    )
    group.add_argument(
        LRMOE_TRACE_FLAG,
        default=None,
        metavar="DIR",
        help=(
            "Record every LRMoE layer call's all-gathered [EP ranks, experts] routing counts "
            "into DIR (on EP rank 0 of each EP group; about 5 us per call), for "
            "`python -m megatron_lrmoe.replay --trace DIR` (docs/replay.md). Needs --lrmoe."
        ),
    )
    for name, default in _DEFAULTS.items():
        text = _HELP[name] % {"def": default}
        flag = LRMOE_FLAGS[name]
        if name in _CHOICES:
            group.add_argument(flag, choices=_CHOICES[name], default=None, help=text)
        elif name == "keep_ratio":
            group.add_argument(flag, type=_keep_ratio, default=None, metavar="K|auto", help=text)
        elif name == "variance_target":
            group.add_argument(flag, type=float, default=None, metavar="V", help=text)
        elif name == "seed":
            group.add_argument(flag, type=int, default=None, metavar="SEED", help=text)
        elif name.endswith("_bytes"):
            group.add_argument(flag, type=parse_bytes, default=None, metavar="BYTES", help=text)
        elif name == "max_replicas_per_rank":
            group.add_argument(flag, type=int, default=None, metavar="N", help=text)
        elif default is True:
            # --lrmoe-record-stats / --no-lrmoe-record-stats; None means "not given".
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, action="store_true", default=None, help=text)
    kernels = parser.add_argument_group(
        title="LRMoE kernels",
        description=(
            "The fast paths an LRMoE layer takes (LRMoEConfig.kernels), all on; switch one off "
            "to debug it or to time LRMoE without it. Results are the same up to "
            "floating-point rounding. Need --lrmoe."
        ),
    )
    for name, flag in LRMOE_KERNEL_FLAGS.items():
        kernels.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=None, help=_KERNEL_HELP[name]
        )
    return parser


def _given_lrmoe_flags(args: argparse.Namespace) -> list[str]:
    flags = {**LRMOE_FLAGS, **LRMOE_KERNEL_FLAGS}
    given = [f for n, f in flags.items() if getattr(args, f"lrmoe_{n}", None) is not None]
    if getattr(args, "lrmoe_trace_dir", None) is not None:
        given.append(LRMOE_TRACE_FLAG)
    return given


def lrmoe_config_from_args(args: argparse.Namespace) -> Optional[LRMoEConfig]:
    """The ``LRMoEConfig`` the flags describe, or None when ``--lrmoe`` is absent.

    ``--lrmoe-seed`` defaults to Megatron's ``--seed`` (so changing ``--seed`` changes the
    sample, as it changes everything else); other unset flags take ``LRMoEConfig``'s defaults.

    Raises:
        ValueError: A field value is invalid; the message names its flag.
    """
    if not getattr(args, "lrmoe", False):
        return None
    try:
        config = LRMoEConfig.from_args(args)
    except ValueError as e:
        flag = next((f for n, f in LRMOE_FLAGS.items() if f"LRMoEConfig.{n} " in str(e)), "--lrmoe")
        raise ValueError(f"{flag}: {e}") from e
    if getattr(args, "lrmoe_seed", None) is None and getattr(args, "seed", None) is not None:
        try:
            config = dataclasses.replace(config, seed=int(args.seed))
        except ValueError as e:
            raise ValueError(f"--seed (the default of --lrmoe-seed): {e}") from e
    return config


@dataclass(frozen=True)
class _Rule:
    """One Megatron setting LRMoE cannot run with.

    Attributes:
        bad: True when ``args`` has the setting.
        flag: The offending flag as a user would write it (value filled from ``args``).
        why: What LRMoE lacks.
        fix: What to pass instead.
    """

    bad: Callable[[argparse.Namespace], bool]
    flag: Callable[[argparse.Namespace], str]
    why: str
    fix: str


def _get(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    # Flags that a given Megatron build lacks count as their default.
    return getattr(args, name, default)


def _expert_tp(args: argparse.Namespace) -> int:
    # Megatron's validate_args sets it to the tensor-parallel size when it is not given.
    etp = _get(args, "expert_tensor_parallel_size")
    return int(etp if etp is not None else _get(args, "tensor_model_parallel_size", 1) or 1)


def _expert_tp_flag(args: argparse.Namespace) -> str:
    if _get(args, "expert_tensor_parallel_size") is None:
        tp = _get(args, "tensor_model_parallel_size", 1)
        return f"--tensor-model-parallel-size {tp} (--expert-tensor-parallel-size defaults to it)"
    return f"--expert-tensor-parallel-size {_expert_tp(args)}"


def _set(name: str) -> Callable[[argparse.Namespace], bool]:
    return lambda a: bool(_get(a, name))


def _not_none(name: str) -> Callable[[argparse.Namespace], bool]:
    return lambda a: _get(a, name) is not None


def _with_value(flag: str, name: str) -> Callable[[argparse.Namespace], str]:
    return lambda a: f"{flag} {_get(a, name)}"


def _plain(flag: str) -> Callable[[argparse.Namespace], str]:
    return lambda a: flag


def _graph_impl(args: argparse.Namespace) -> str:
    # Megatron's validate_args turns the deprecated flags into --cuda-graph-impl.
    if _get(args, "enable_cuda_graph"):
        return "local"
    if _get(args, "external_cuda_graph"):
        return "transformer_engine"
    return _get(args, "cuda_graph_impl", "none") or "none"


def _graph_modules(args: argparse.Namespace) -> list[str]:
    deprecated = _get(args, "cuda_graph_scope_deprecated")
    modules = deprecated if deprecated is not None else _get(args, "cuda_graph_modules")
    return graph_module_names(modules)


def _graph_flags(args: argparse.Namespace) -> str:
    if _get(args, "enable_cuda_graph") or _get(args, "external_cuda_graph"):
        impl = "--enable-cuda-graph" if _get(args, "enable_cuda_graph") else "--external-cuda-graph"
    else:
        impl = f"--cuda-graph-impl {_graph_impl(args)}"
    names = _graph_modules(args)
    if names:
        return f"{impl} --cuda-graph-modules {' '.join(names)}"
    return impl if _graph_impl(args) == "full_iteration" else f"{impl} (the whole layer)"


# Megatron's optimizers whose update depends on a weight's matrix shape: the Muon family gives
# non-2-D weights Adam (megatron/core/optimizer/emerging_optimizers.py,
# ``_is_nonlinear_or_embedding``); SOAP keeps one Kronecker factor per dimension.
MATRIX_OPTIMIZERS: tuple[str, ...] = ("muon", "dist_muon", "adaptive_muon", "soap")

# Mirrors megatron_lrmoe.config.validate_transformer_config, one rule per flag, so that a bad
# combination fails at argument parsing, naming both flags, before any process group exists
# (plus the optimizer, which no TransformerConfig holds).
_RULES: tuple[_Rule, ...] = (
    _Rule(
        lambda a: _get(a, "moe_token_dispatcher_type", "allgather") != "alltoall",
        _with_value("--moe-token-dispatcher-type", "moe_token_dispatcher_type"),
        "LRMoE replaces the alltoall dispatcher's exchanges",
        "pass --moe-token-dispatcher-type alltoall (Megatron's default is allgather)",
    ),
    _Rule(
        _set("moe_enable_deepep"),
        _plain("--moe-enable-deepep"),
        "DeepEP runs the flex dispatcher",
        "drop --moe-enable-deepep and use --moe-token-dispatcher-type alltoall",
    ),
    _Rule(
        lambda a: _expert_tp(a) != 1,
        _expert_tp_flag,
        "LRMoE experts are not tensor-parallel",
        "pass --expert-tensor-parallel-size 1",
    ),
    _Rule(
        _not_none("moe_expert_capacity_factor"),
        _with_value("--moe-expert-capacity-factor", "moe_expert_capacity_factor"),
        "LRMoE is dropless in forward",
        "drop it and use --lrmoe-keep-ratio to trim the backward instead",
    ),
    _Rule(
        _set("moe_pad_expert_input_to_capacity"),
        _plain("--moe-pad-expert-input-to-capacity"),
        "drop-and-pad changes the dispatcher's layouts",
        "drop --moe-pad-expert-input-to-capacity",
    ),
    _Rule(
        _set("moe_apply_probs_on_input"),
        _plain("--moe-apply-probs-on-input"),
        "LRMoE applies the routing weight after the activation, as Megatron does by default",
        "drop --moe-apply-probs-on-input",
    ),
    _Rule(
        _set("overlap_moe_expert_parallel_comm"),
        _plain("--overlap-moe-expert-parallel-comm"),
        "that schedule calls the dispatcher stages one by one, bypassing LRMoE's fused op",
        "drop --overlap-moe-expert-parallel-comm",
    ),
    _Rule(
        _set("overlap_dispatch_backward_with_experts_wgrad"),
        _plain("--overlap-dispatch-backward-with-experts-wgrad"),
        "LRMoE computes expert weight gradients inside its backward",
        "drop --overlap-dispatch-backward-with-experts-wgrad",
    ),
    _Rule(
        _set("delay_wgrad_compute"),
        _plain("--delay-wgrad-compute"),
        "LRMoE computes expert weight gradients inside its backward",
        "drop --delay-wgrad-compute",
    ),
    _Rule(
        _set("moe_router_padding_for_quantization"),
        _plain("--moe-router-padding-for-quantization"),
        "a padded routing map changes the dispatcher's layouts",
        "drop --moe-router-padding-for-quantization",
    ),
    _Rule(
        _set("moe_router_padding_for_fp8"),
        _plain("--moe-router-padding-for-fp8"),
        "a padded routing map changes the dispatcher's layouts",
        "drop --moe-router-padding-for-fp8",
    ),
    _Rule(
        _not_none("fp8"),
        _with_value("--fp8-format", "fp8"),
        "LRMoE's grouped GEMMs have no fp8 path",
        "train in bf16 (drop --fp8-format)",
    ),
    _Rule(
        _not_none("fp4"),
        _with_value("--fp4-format", "fp4"),
        "LRMoE's grouped GEMMs have no fp4 path",
        "train in bf16 (drop --fp4-format)",
    ),
    _Rule(
        _not_none("moe_latent_size"),
        _with_value("--moe-latent-size", "moe_latent_size"),
        "latent projections around the experts are not implemented",
        "drop --moe-latent-size",
    ),
    _Rule(
        lambda a: bool(_get(a, "add_bias_linear", True)),
        _plain("biased linear layers (Megatron's default when --disable-bias-linear is absent)"),
        "expert biases are not implemented",
        "pass --disable-bias-linear",
    ),
    _Rule(
        _set("moe_permute_fusion"),
        _plain("--moe-permute-fusion"),
        "LRMoE permutes with the unfused kernels",
        "drop --moe-permute-fusion",
    ),
    _Rule(
        _set("squared_relu"),
        _plain("--squared-relu"),
        "LRMoE experts support SiLU and GeLU, gated (--swiglu) or not",
        "use --swiglu or the default GeLU",
    ),
    _Rule(
        _set("quick_geglu"),
        _plain("--quick-geglu"),
        "LRMoE experts support SiLU and GeLU, gated (--swiglu) or not",
        "use --swiglu or the default GeLU",
    ),
    _Rule(
        lambda a: float(_get(a, "glu_linear_offset", 0.0) or 0.0) != 0.0,
        _with_value("--glu-linear-offset", "glu_linear_offset"),
        "the gated activation has no linear offset in LRMoE",
        "drop --glu-linear-offset",
    ),
    _Rule(
        _not_none("activation_func_clamp_value"),
        _with_value("--activation-func-clamp-value", "activation_func_clamp_value"),
        "the activation is not clamped in LRMoE",
        "drop --activation-func-clamp-value",
    ),
    _Rule(
        lambda a: bool(_get(a, "swiglu")) and _get(a, "moe_mlp_glu_interleave_size") is not None,
        _with_value("--moe-mlp-glu-interleave-size", "moe_mlp_glu_interleave_size"),
        "LRMoE expects fc1 as [gate | up] halves",
        "drop --moe-mlp-glu-interleave-size",
    ),
    _Rule(
        lambda a: _get(a, "transformer_impl") == "inference_optimized",
        _plain("--transformer-impl inference_optimized"),
        "LRMoE is a training feature",
        "use --transformer-impl local or transformer_engine",
    ),
    _Rule(
        lambda a: moe_graph_capture(_graph_impl(a), _graph_modules(a)) is not None,
        _graph_flags,
        "those CUDA graphs would capture the MoE layer, which LRMoE plans on the host every call "
        "(it replays its own graphs inside)",
        "capture attention only (--cuda-graph-modules attn) or drop --cuda-graph-impl",
    ),
    _Rule(
        lambda a: bool(offloaded_expert_modules(a)),
        lambda a: f"--offload-modules {' '.join(offloaded_expert_modules(a))}",
        "LRMoE's expert op has no such offloading points",
        "remove them from --offload-modules",
    ),
    _Rule(
        lambda a: bool(_get(a, "use_te_activation_func")) and not _get(a, "swiglu"),
        _plain("--use-te-activation-func"),
        "LRMoE's experts compute the activation with their own kernels, which is Transformer "
        "Engine's function only for SwiGLU",
        "drop --use-te-activation-func",
    ),
    _Rule(
        lambda a: int(_get(a, "expert_tensor_parallel_num_weight_shards") or 1) > _expert_tp(a),
        _with_value(
            "--expert-tensor-parallel-num-weight-shards", "expert_tensor_parallel_num_weight_shards"
        ),
        "LRMoE's expert weights are whole on each rank",
        "leave --expert-tensor-parallel-num-weight-shards unset",
    ),
    _Rule(
        _not_none("kitchen_config_file"),
        _with_value("--kitchen-config-file", "kitchen_config_file"),
        "LRMoE's experts are not quantised",
        "drop --kitchen-config-file",
    ),
    _Rule(
        _not_none("kitchen_recipe_number"),
        _with_value("--kitchen-recipe-number", "kitchen_recipe_number"),
        "LRMoE's experts are not quantised",
        "drop --kitchen-recipe-number",
    ),
    _Rule(
        lambda a: _get(a, "optimizer") in MATRIX_OPTIMIZERS,
        _with_value("--optimizer", "optimizer"),
        "LRMoE holds each layer's experts as one [experts, rows, columns] weight per projection, "
        "and this optimizer's update depends on the weight's shape: Muon gives non-2-D weights "
        "Adam, SOAP would precondition across experts; stock's per-expert matrices get the "
        "optimizer itself",
        "use --optimizer adam (or sgd, lion)",
    ),
)


def validate_lrmoe_args(args: argparse.Namespace) -> None:
    """Reject ``--lrmoe-*`` without ``--lrmoe`` and Megatron flags LRMoE cannot run with.

    Works on the namespace before or after Megatron's ``validate_args``. Per-layer checks
    against the built ``TransformerConfig`` still run when each LRMoE layer is constructed.

    Args:
        args: Parsed arguments (from a parser that went through :func:`add_lrmoe_args`).

    Raises:
        ValueError: Naming both flags of an incompatible combination and the fix.
    """
    if not getattr(args, "lrmoe", False):
        given = _given_lrmoe_flags(args)
        if given:
            raise ValueError(
                f"{', '.join(given)} given without --lrmoe; add --lrmoe to enable LRMoE, or "
                "drop the --lrmoe-* flags"
            )
        return
    lrmoe_config_from_args(args)
    num_experts = _get(args, "num_experts")
    if not num_experts:
        raise ValueError("--lrmoe needs an MoE model: set --num-experts")
    ep = int(_get(args, "expert_model_parallel_size", 1) or 1)
    if num_experts % ep != 0:
        raise ValueError(
            f"--lrmoe: --num-experts ({num_experts}) must be divisible by "
            f"--expert-model-parallel-size ({ep})"
        )
    for rule in _RULES:
        if rule.bad(args):
            raise ValueError(
                f"--lrmoe cannot be combined with {rule.flag(args)}: {rule.why}; {rule.fix}"
            )
