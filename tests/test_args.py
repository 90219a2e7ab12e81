"""``--lrmoe`` flags: parsing next to Megatron's own flags, every validation rule, --help text,
and the round trip to ``LRMoEConfig``.

Parsing goes through ``megatron.training.arguments.parse_args(extra_args_provider=...)``, the
function ``pretrain_lrmoe.py`` uses, so the flags are checked against Megatron's real parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_lrmoe import KernelOptions, LRMoEConfig, add_lrmoe_args
from megatron_lrmoe.training.args import (
    LRMOE_FLAGS,
    LRMOE_KERNEL_FLAGS,
    lrmoe_config_from_args,
    validate_lrmoe_args,
)

ROOT = Path(__file__).resolve().parents[1]

# A tiny MoE GPT that LRMoE accepts: alltoall, no biases, SwiGLU, ETP 1, dropless.
BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "4",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
    "--disable-bias-linear", "--swiglu", "--transformer-impl", "local",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--mock-data",
    "--train-iters", "4", "--lr", "1e-3",
]  # fmt: skip


def megatron_parse(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` with Megatron's parser plus the LRMoE group (no validation)."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain_lrmoe.py", *argv])
    return parse_args(extra_args_provider=add_lrmoe_args)


def without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` minus each flag in ``flags`` and the value that follows it, if any."""
    out, skip = [], False
    for i, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item in flags:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(item)
    return out


def test_flags_parse_next_to_stock_moe_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = megatron_parse(
        monkeypatch,
        BASE + ["--lrmoe", "--lrmoe-keep-ratio", "0.5", "--lrmoe-selection", "topk",
                "--moe-router-score-function", "sigmoid", "--moe-aux-loss-coeff", "1e-3"],
    )  # fmt: skip
    assert args.lrmoe is True and args.lrmoe_keep_ratio == 0.5 and args.lrmoe_selection == "topk"
    # Stock MoE flags keep their meaning next to ours.
    assert args.num_experts == 8 and args.moe_router_topk == 2
    assert args.moe_token_dispatcher_type == "alltoall"
    assert args.moe_router_score_function == "sigmoid"
    validate_lrmoe_args(args)


def test_every_config_field_has_a_flag() -> None:
    parser = add_lrmoe_args(argparse.ArgumentParser())
    options = {s for a in parser._actions for s in a.option_strings}
    assert "--lrmoe" in options
    for field in dataclasses.fields(LRMoEConfig):
        if field.name == "kernels":  # one flag per switch, in a group of its own (below)
            assert field.name not in LRMOE_FLAGS
            continue
        assert LRMOE_FLAGS[field.name] in options, field.name
    assert "--no-lrmoe-record-stats" in options
    for switch in dataclasses.fields(KernelOptions):
        flag = LRMOE_KERNEL_FLAGS[switch.name]
        assert flag == "--lrmoe-" + switch.name.replace("_", "-")
        assert {flag, "--no-" + flag[2:]} <= options, switch.name
    kernels = next(g for g in parser._action_groups if g.title == "LRMoE kernels")
    assert {a.dest for a in kernels._group_actions} == {
        f"lrmoe_{f.name}" for f in dataclasses.fields(KernelOptions)
    }
    group = next(g for g in parser._action_groups if g.title == "LRMoE")
    assert "--lrmoe-help" in options  # prints the group and exits: stores nothing
    assert "--moe-layer-timing" in options  # not a config field: logging, stock runs too
    assert "--memory-cap-gib" in options  # not a config field: comparison runs, stock too
    assert "--gpu-memory-gib" in options  # likewise
    assert {a.dest for a in group._group_actions if a.dest != argparse.SUPPRESS} == {
        "lrmoe",
        "moe_layer_timing",
        "memory_cap_gib",
        "gpu_memory_gib",
        "lrmoe_trace_dir",
    } | {f"lrmoe_{f.name}" for f in dataclasses.fields(LRMoEConfig) if f.name != "kernels"}


def test_help_lists_each_flag_with_megatron_parser() -> None:
    from megatron.training.arguments import add_megatron_arguments

    import pretrain_lrmoe

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser = pretrain_lrmoe.extra_args_provider(add_megatron_arguments(parser))
    text = parser.format_help()  # raises on megatron-core 0.19.2 without repair_help_strings
    for flag in ["--lrmoe", *LRMOE_FLAGS.values(), "--no-lrmoe-record-stats"]:
        assert flag in text, flag
    for flag in LRMOE_KERNEL_FLAGS.values():
        assert "--no-" + flag[2:] in text, flag
    assert "--moe-token-dispatcher-type" in text


def test_entry_point_help_runs_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_lrmoe.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LRMoE:" in proc.stdout
    for flag in ["--lrmoe", *LRMOE_FLAGS.values()]:
        assert flag in proc.stdout, flag


def test_round_trip_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    args = megatron_parse(
        monkeypatch,
        BASE + ["--lrmoe", "--lrmoe-keep-ratio", "0.25", "--lrmoe-selection", "topk",
                "--lrmoe-scope", "global", "--lrmoe-activation-mode", "recompute",
                "--lrmoe-seed", "7", "--no-lrmoe-record-stats",
                "--lrmoe-debug-record-selection", "--lrmoe-debug-check-invariants"],
    )  # fmt: skip
    validate_lrmoe_args(args)
    assert lrmoe_config_from_args(args) == LRMoEConfig(
        keep_ratio=0.25,
        selection="topk",
        scope="global",
        activation_mode="recompute",
        seed=7,
        record_stats=False,
        debug_record_selection=True,
        debug_check_invariants=True,
    )
    assert LRMoEConfig.from_args(args) == lrmoe_config_from_args(args)


def test_kernel_switches_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-lrmoe-<switch>`` turns that switch of ``LRMoEConfig.kernels`` off and nothing
    else; without any, the defaults (all on); the positive form is accepted (the last wins)."""
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe"])
    assert lrmoe_config_from_args(args).kernels == KernelOptions()
    for switch in dataclasses.fields(KernelOptions):
        flag = LRMOE_KERNEL_FLAGS[switch.name]
        args = megatron_parse(monkeypatch, BASE + ["--lrmoe", "--no-" + flag[2:]])
        validate_lrmoe_args(args)
        config = lrmoe_config_from_args(args)
        assert config.kernels == KernelOptions(**{switch.name: False}), switch.name
        assert dataclasses.replace(config, kernels=KernelOptions()) == lrmoe_config_from_args(
            megatron_parse(monkeypatch, BASE + ["--lrmoe"])
        )
    args = megatron_parse(
        monkeypatch,
        BASE + ["--lrmoe", "--no-lrmoe-triton", "--no-lrmoe-expert-graphs", "--lrmoe-triton"],
    )
    assert lrmoe_config_from_args(args).kernels == KernelOptions(expert_graphs=False)
    assert LRMoEConfig.from_args(args).kernels == KernelOptions(expert_graphs=False)


def test_defaults_and_seed_follow_megatron_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lrmoe_config_from_args(megatron_parse(monkeypatch, BASE)) is None
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe"])
    assert lrmoe_config_from_args(args) == dataclasses.replace(LRMoEConfig(), seed=args.seed)
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe", "--seed", "42"])
    assert lrmoe_config_from_args(args).seed == 42
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe", "--seed", "42", "--lrmoe-seed", "3"])
    assert lrmoe_config_from_args(args).seed == 3


@pytest.mark.parametrize(
    "flag_argv",
    [
        ["--lrmoe-keep-ratio", "0.5"],
        ["--lrmoe-selection", "topk"],
        ["--lrmoe-scope", "global"],
        ["--lrmoe-activation-mode", "recompute"],
        ["--lrmoe-seed", "3"],
        ["--lrmoe-record-stats"],
        ["--no-lrmoe-record-stats"],
        ["--lrmoe-debug-record-selection"],
        ["--lrmoe-debug-check-invariants"],
        ["--lrmoe-trace-dir", "/tmp/trace"],
        ["--no-lrmoe-triton"],
        ["--no-lrmoe-native-planner"],
        ["--lrmoe-expert-graphs"],
    ],
    ids=lambda a: a[0],
)
def test_lrmoe_flag_without_lrmoe_fails(monkeypatch: pytest.MonkeyPatch, flag_argv) -> None:
    args = megatron_parse(monkeypatch, BASE + flag_argv)
    with pytest.raises(ValueError) as info:
        validate_lrmoe_args(args)
    flag = flag_argv[0].replace("--no-", "--")
    assert flag in str(info.value) and "without --lrmoe" in str(info.value)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lrmoe-keep-ratio", "1.5"], "--lrmoe-keep-ratio"),
        (["--lrmoe-keep-ratio", "-0.1"], "--lrmoe-keep-ratio"),
        (["--lrmoe-seed", "-1"], "--lrmoe-seed"),
        (["--seed", "-5"], "--seed"),
    ],
)
def test_invalid_values_name_their_flag(monkeypatch: pytest.MonkeyPatch, argv, flag) -> None:
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe", *argv])
    with pytest.raises(ValueError) as info:
        validate_lrmoe_args(args)
    assert str(info.value).startswith(flag), str(info.value)


def test_invalid_choice_is_an_argparse_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        megatron_parse(monkeypatch, BASE + ["--lrmoe", "--lrmoe-selection", "greedy"])


# (flags to add, flags to remove from BASE, the offending flag the message must name)
RULES = [
    (["--moe-token-dispatcher-type", "allgather"], [], "--moe-token-dispatcher-type allgather"),
    (["--moe-token-dispatcher-type", "flex"], [], "--moe-token-dispatcher-type flex"),
    ([], ["--moe-token-dispatcher-type"], "--moe-token-dispatcher-type allgather"),
    (["--moe-enable-deepep"], [], "--moe-enable-deepep"),
    (["--expert-tensor-parallel-size", "2"], [], "--expert-tensor-parallel-size 2"),
    (["--tensor-model-parallel-size", "2"], [], "--tensor-model-parallel-size 2"),
    (["--moe-expert-capacity-factor", "1.0"], [], "--moe-expert-capacity-factor 1.0"),
    (["--moe-pad-expert-input-to-capacity"], [], "--moe-pad-expert-input-to-capacity"),
    (["--moe-apply-probs-on-input"], [], "--moe-apply-probs-on-input"),
    (["--overlap-moe-expert-parallel-comm"], [], "--overlap-moe-expert-parallel-comm"),
    (
        ["--overlap-dispatch-backward-with-experts-wgrad"],
        [],
        "--overlap-dispatch-backward-with-experts-wgrad",
    ),
    (["--delay-wgrad-compute"], [], "--delay-wgrad-compute"),
    (["--moe-router-padding-for-quantization"], [], "--moe-router-padding-for-quantization"),
    (["--moe-router-padding-for-fp8"], [], "--moe-router-padding-for-fp8"),
    (["--fp8-format", "e4m3"], [], "--fp8-format e4m3"),
    (["--fp8-format", "hybrid"], [], "--fp8-format hybrid"),
    (["--fp4-format", "e2m1"], [], "--fp4-format e2m1"),
    (["--moe-latent-size", "16"], [], "--moe-latent-size 16"),
    ([], ["--disable-bias-linear"], "--disable-bias-linear"),
    (["--moe-permute-fusion"], [], "--moe-permute-fusion"),
    (["--squared-relu"], ["--swiglu"], "--squared-relu"),
    (["--quick-geglu"], ["--swiglu"], "--quick-geglu"),
    (["--glu-linear-offset", "1.0"], [], "--glu-linear-offset 1.0"),
    (["--activation-func-clamp-value", "7.0"], [], "--activation-func-clamp-value 7.0"),
    (["--moe-mlp-glu-interleave-size", "16"], [], "--moe-mlp-glu-interleave-size 16"),
    (["--transformer-impl", "inference_optimized"], [], "--transformer-impl inference_optimized"),
    ([], ["--num-experts"], "--num-experts"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], [], "--num-experts (6)"),
    (["--cuda-graph-impl", "local"], [], "--cuda-graph-impl local (the whole layer)"),
    (
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router"],
        [],
        "--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router",
    ),
    (["--cuda-graph-impl", "full_iteration"], [], "--cuda-graph-impl full_iteration"),
    (["--enable-cuda-graph"], [], "--enable-cuda-graph (the whole layer)"),
    (
        ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "expert_fc1"],
        [],
        "--offload-modules expert_fc1",
    ),
    (["--use-te-activation-func"], ["--swiglu"], "--use-te-activation-func"),
    (
        ["--expert-tensor-parallel-num-weight-shards", "2"],
        [],
        "--expert-tensor-parallel-num-weight-shards 2",
    ),
    (["--optimizer", "muon"], [], "--optimizer muon"),
    (["--optimizer", "dist_muon"], [], "--optimizer dist_muon"),
    (["--optimizer", "adaptive_muon"], [], "--optimizer adaptive_muon"),
    (["--optimizer", "soap"], [], "--optimizer soap"),
]


@pytest.mark.parametrize("add, remove, flag", RULES, ids=[r[2] for r in RULES])
def test_each_incompatible_combination_names_both_flags(
    monkeypatch: pytest.MonkeyPatch, add: list[str], remove: list[str], flag: str
) -> None:
    argv = without(BASE, *remove) + add
    stock = megatron_parse(monkeypatch, argv)
    validate_lrmoe_args(stock)  # without --lrmoe the same flags are fine
    args = megatron_parse(monkeypatch, argv + ["--lrmoe"])
    with pytest.raises(ValueError) as info:
        validate_lrmoe_args(args)
    message = str(info.value)
    assert "--lrmoe" in message and flag in message, message


@pytest.mark.parametrize(
    "add",
    [
        ["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"],
        ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "qkv_linear"],
        ["--use-te-activation-func"],  # with --swiglu: the same function as LRMoE's
        ["--recompute-granularity", "selective", "--recompute-modules", "moe_act", "moe"],
        ["--optimizer", "sgd"],
        ["--optimizer", "lion"],
    ],
    ids=" ".join,
)
def test_neighbouring_flags_pass(monkeypatch: pytest.MonkeyPatch, add: list[str]) -> None:
    validate_lrmoe_args(megatron_parse(monkeypatch, BASE + add + ["--lrmoe"]))


@pytest.mark.parametrize(
    "name, value, flag",
    [
        ("kitchen_config_file", "recipe.yaml", "--kitchen-config-file recipe.yaml"),
        ("kitchen_recipe_number", 3, "--kitchen-recipe-number 3"),
    ],
)
def test_kitchen_flags_are_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Any, flag: str
) -> None:
    """Megatron adds the kitchen flags only where its kitchen package is installed (not here):
    set on the parsed namespace as that parser would."""
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe"])
    validate_lrmoe_args(args)
    setattr(args, name, value)
    with pytest.raises(ValueError, match=f"--lrmoe cannot be combined with {flag}"):
        validate_lrmoe_args(args)


def test_rules_also_hold_after_megatron_validate_args(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's validate_args fills the expert TP size in from the TP size; the rule names it."""
    from megatron.training import arguments
    from megatron.training.arguments import validate_args

    # validate_args asks the GPU's architecture when TP > 1; this machine may have none.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = BASE + ["--lrmoe", "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    args = megatron_parse(monkeypatch, argv)
    validate_args(args, {})
    assert args.expert_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="with --expert-tensor-parallel-size 2"):
        validate_lrmoe_args(args)
    args = megatron_parse(monkeypatch, argv + ["--expert-tensor-parallel-size", "1"])
    validate_args(args, {})
    validate_lrmoe_args(args)


def test_budget_flags_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    args = megatron_parse(
        monkeypatch,
        BASE + ["--lrmoe", "--lrmoe-memory-budget-bytes", "24GiB",
                "--lrmoe-exchange-budget-bytes", "512M", "--lrmoe-max-replicas-per-rank", "2",
                "--lrmoe-activation-mode", "auto"],
    )  # fmt: skip
    validate_lrmoe_args(args)
    config = lrmoe_config_from_args(args)
    assert config.memory_budget_bytes == 24 * 2**30
    assert config.exchange_budget_bytes == 512 * 10**6
    assert config.max_replicas_per_rank == 2 and config.activation_mode == "auto"
    # Unset budget flags keep the config's defaults (unbounded, fixed ownership).
    config = lrmoe_config_from_args(megatron_parse(monkeypatch, BASE + ["--lrmoe"]))
    assert config.memory_budget_bytes is None and config.max_replicas_per_rank == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--lrmoe-memory-budget-bytes", "1G"],
        ["--lrmoe-exchange-budget-bytes", "100"],
        ["--lrmoe-max-replicas-per-rank", "1"],
    ],
    ids=lambda a: a[0],
)
def test_budget_flags_need_lrmoe(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    with pytest.raises(ValueError, match=f"{argv[0]}.*without --lrmoe"):
        validate_lrmoe_args(megatron_parse(monkeypatch, BASE + argv))


def test_invalid_budget_values(monkeypatch: pytest.MonkeyPatch) -> None:
    args = megatron_parse(monkeypatch, BASE + ["--lrmoe", "--lrmoe-max-replicas-per-rank", "-1"])
    with pytest.raises(ValueError) as info:
        validate_lrmoe_args(args)
    assert str(info.value).startswith("--lrmoe-max-replicas-per-rank")
    with pytest.raises(SystemExit):
        megatron_parse(monkeypatch, BASE + ["--lrmoe", "--lrmoe-memory-budget-bytes", "lots"])
    with pytest.raises(SystemExit):
        megatron_parse(monkeypatch, BASE + ["--lrmoe", "--lrmoe-exchange-budget-bytes", "-3"])


def test_parse_bytes_units() -> None:
    from megatron_lrmoe.training.args import parse_bytes

    assert parse_bytes("512") == 512 and parse_bytes("0") == 0
    assert parse_bytes("80G") == 80 * 10**9 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("2 MiB") == 2 * 2**20
    for bad in ("", "x", "1.2.3", "-1", "3PB", "GiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
