"""The memory-bound comparison's pieces on the CPU (``benchmarks/memory_bound.py``,
``benchmarks/train_logs.py``, ``megatron_lrmoe/training/memory_cap.py`` and
``validation_spread.py``): log parsing and time to target on synthetic logs with known answers,
the search's picks, every arm's launch arguments through Megatron's own validation, and the
report (JSON, table, plot) from synthetic convergence logs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_bound  # noqa: E402
import train_logs  # noqa: E402

from megatron_lrmoe.training import compat
from megatron_lrmoe.training.memory_cap import (
    GIB,
    apply_gpu_memory,
    apply_memory_cap,
    describe,
    describe_gpu_memory,
    plan_gpu_memory,
    plan_memory_cap,
)
from megatron_lrmoe.training.validation_spread import ValidationSpread


# -- synthetic logs ----------------------------------------------------------------------------


def fake_log(
    *,
    seed: int = 1234,
    iters: int = 10,
    iter_ms: float = 100.0,
    first_ms: float = 5000.0,
    moe_ms: float = 40.0,
    val: dict[int, float] | None = None,
    se: float | None = None,
    peak_mib: int = 70000,
    cap: float | None = 78.0,
    oom_at: int | None = None,
    planned: int | None = None,
) -> str:
    """A log in the shape of ``pretrain_lrmoe.py --moe-layer-timing`` output."""
    lines = [
        "------------------------ arguments ------------------------",
        f"  seed ............................................ {seed}",
        "  lrmoe ........................................... True",
        "  lrmoe_keep_ratio ................................ 0.5",
    ]
    if cap is not None:
        lines.append(f"INFO:megatron_lrmoe.training.memory_cap:memory cap: {cap:.1f} GiB on cuda:0 "
                     "(fraction 0.5581 of 139.8 GiB)")
    val = val or {}
    cumulative = 0.0
    clock = 0.0  # seconds since the start: iterations, and 30 s per evaluation
    for i in range(1, iters + 1):
        if oom_at == i:
            lines.append("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
            break
        ms = first_ms if i == 1 else iter_ms
        moe = 1000.0 if i == 1 else moe_ms
        cumulative += moe / 1e3
        clock += ms / 1e3
        stamp = f"2026-12-04 10:{int(clock // 60):02d}:{clock % 60:09.6f}"
        lines.append(
            f" [{stamp}] iteration {i:8d}/{planned or iters:8d} | consumed "
            f"samples: {16 * i} | elapsed time per iteration (ms): {ms:.1f} | learning rate: "
            f"1.0E-04 | global batch size:    16 | lm loss: {5.0 - 0.1 * i:.6E} | loss scale: 1.0 |"
        )
        lines.append(
            f" [2026-12-04 10:00:00.000001] iteration {i:8d}/{planned or iters:8d} | moe layers: "
            f"{moe:.1f} ms/iter | moe layers cumulative: {cumulative:.3f} s | max allocated: "
            f"{peak_mib if i > 1 else peak_mib // 2} MiB | alloc retries: {i // 4} |"
        )
        if i in val:
            if se is not None:
                lines.append(f" validation spread | sequences: 1400 | loss std: 2.0E-01 | "
                             f"standard error: {se:.6E} |")
            lines.append(f" validation loss at iteration {i} | lm loss value: {val[i]:.6E} | "
                         "lm loss PPL: 1.0E+00 |")
            clock += 30.0
    else:
        last = max(val, default=None)
        if last is not None:
            lines.append(f" validation loss at iteration {iters} on validation set | lm loss value: "
                         f"{val[last]:.6E} |")
            lines.append(f" validation loss at iteration {iters} on test set | lm loss value: "
                         "9.0E+00 |")
    return "\n".join(lines) + "\n"


def test_parse_log_reads_every_series(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    path.write_text(fake_log(val={5: 2.0, 10: 1.5}, se=0.006))
    run = train_logs.parse_log(path)
    assert run.seed() == 1234 and run.args["lrmoe_keep_ratio"] == "0.5"
    assert run.planned_iters == 10 and run.last_iteration == 10 and run.finished
    assert run.iter_ms[1] == 5000.0 and run.iter_ms[2] == 100.0
    assert run.moe_ms[1] == 1000.0 and run.moe_ms[7] == 40.0
    assert run.train_loss[3] == pytest.approx(4.7)
    assert run.val == {5: 2.0, 10: 1.5}  # the test-set line is not a validation loss
    assert run.val_se == {5: pytest.approx(0.003), 10: pytest.approx(0.004)}
    assert run.max_allocated_mib == 70000 and run.memory_cap_gib == 78.0 and not run.oom
    assert run.alloc_retries == 2  # the last count printed (iteration 10)
    assert run.eval_s == {5: pytest.approx(30.0)}  # the last evaluation has no iteration after it
    assert run.steady_ms("iter_ms") == 100.0 and run.steady_ms("moe_ms") == 40.0


def test_an_out_of_memory_run_does_not_fit(tmp_path: Path) -> None:
    path = tmp_path / "oom.log"
    path.write_text(fake_log(oom_at=3))
    run = train_logs.parse_log(path)
    assert run.oom and not run.finished and run.last_iteration == 2
    stopped = tmp_path / "stopped.log"
    stopped.write_text(fake_log(iters=4, planned=10))
    assert not train_logs.parse_log(stopped).finished


def test_crossing_interpolates_between_evaluations() -> None:
    points = [(100, 2.0), (200, 1.6), (300, 1.4)]
    assert train_logs.crossing(points, 1.8) == pytest.approx(150.0)
    assert train_logs.crossing(points, 1.5) == pytest.approx(250.0)
    assert train_logs.crossing(points, 2.5) == 100.0  # already there at the first evaluation
    assert train_logs.crossing(points, 1.0) is None
    # A later rise above the target does not move the first crossing.
    assert train_logs.crossing([(1, 3.0), (2, 1.0), (3, 3.0), (4, 0.5)], 2.0) == pytest.approx(1.5)


def test_cumulative_leaves_out_iteration_one_and_takes_fractions() -> None:
    series = {1: 1000.0, 2: 10.0, 3: 20.0, 4: 40.0}
    assert train_logs.cumulative(series, 3) == 30.0
    assert train_logs.cumulative(series, 3.25) == pytest.approx(40.0)
    assert train_logs.cumulative(series, 1.5) == pytest.approx(5.0)
    assert train_logs.cumulative(series, 3, first=1) == 1030.0


def test_time_to_target_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    path.write_text(fake_log(iters=10, val={4: 2.0, 8: 1.0}))
    reached = train_logs.time_to_target(train_logs.parse_log(path), 1.5)
    # Crossing at iteration 6: iterations 2..6 at 100 ms and 40 ms of MoE each.
    assert reached.iteration == pytest.approx(6.0)
    assert reached.wall_s == pytest.approx(0.5) and reached.moe_s == pytest.approx(0.2)
    assert reached.first_iteration_s == 5.0 and reached.first_iteration_moe_s == 1.0
    assert train_logs.time_to_target(train_logs.parse_log(path), 0.5) is None


def test_spread_over_seeds_counts_the_missing() -> None:
    s = train_logs.spread([1.0, 2.0, None, 3.0])
    assert (s.n, s.mean, s.min, s.max, s.missing) == (3, 2.0, 1.0, 3.0, 1)
    assert s.std == pytest.approx(1.0)
    assert train_logs.spread([None]).mean is None
    assert train_logs.spread([4.0]).std == 0.0


# -- the search's picks and the arms' launch arguments -----------------------------------------


def _row(name: str, fits: bool, iter_ms: float) -> dict:
    return {"arm": memory_bound.asdict(memory_bound.ARMS[name]), "fits": fits, "iter_ms": iter_ms}


def test_picks_take_the_fastest_arm_that_fits() -> None:
    rows = [
        _row("stock", False, 500.0),  # out of memory: never the baseline, however fast
        _row("stock+moe", True, 700.0),
        _row("stock-mbs8+moe", True, 650.0),
        _row("megatron-sequential+moe", True, 100.0),  # listed, never picked
        _row("k0.5+moe", True, 600.0),
        _row("k0.5-recompute", True, 580.0),
        _row("k0.25+moe", False, 400.0),
    ]
    assert memory_bound.picks(rows) == {"baseline": "stock-mbs8+moe", "keep 0.5": "k0.5-recompute"}


def test_arm_flags() -> None:
    arms = memory_bound.ARMS
    assert arms["stock"].flags() == [
        "--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    assert arms["k0.5+moe"].flags()[-2:] == ["core_attn", "moe"]
    assert "full" in arms["stock+full"].flags()
    assert arms["megatron-sequential+moe"].env()["LRMOE"] == "0"
    assert arms["k0.25-recompute"].env()["ACTIVATION_MODE"] == "recompute"
    run = memory_bound.Run(arms["stock-mbs8"], 7, 400, Path("x.log"), 78.0, 24, evaluate=True)
    env = run.env()
    assert env["MBS"] == "8" and env["GBS"] == "16" and env["SEED"] == "7"
    assert env["MEMORY_CAP_GIB"] == "78" and env["EVAL_INTERVAL"] == "100"
    assert run.flags()[-4:] == ["--eval-global-batch-size", "32", "--eval-micro-batch-size", "32"]
    assert "--full-validation" in run.flags()
    two = memory_bound.Run(arms["stock"], 7, 6, Path("x.log"), 78.0, 24, evaluate=True, evaluations=2)
    assert two.env()["EVAL_INTERVAL"] == "3"
    quick = memory_bound.Run(arms["stock"], 7, 10, Path("x.log"), None, 24, evaluate=False)
    assert "MEMORY_CAP_GIB" not in quick.env() and "--full-validation" not in quick.flags()
    # Megatron's scheduler needs the warm-up shorter than the run, short runs included.
    assert int(quick.env()["WARMUP_ITERS"]) < 10 and env["WARMUP_ITERS"] == "20"
    for bad in ("attn", "moe_act"):
        with pytest.raises(ValueError, match=f"recompute '{bad}'"):
            memory_bound.Arm("bad", recompute=bad).flags()


@pytest.mark.parametrize("name", list(memory_bound.ARMS))
def test_every_arm_passes_megatron_validation(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each arm's launch (examples/qwen3_30b_a3b/pretrain.sh with the proxy's settings, DRY_RUN)
    passes Megatron's argument validation, the entry point's checks and LRMoE's check of the
    resulting TransformerConfig."""
    from megatron.training import arguments

    import pretrain_lrmoe as entry
    from megatron_lrmoe.training.args import lrmoe_config_from_args

    arm = memory_bound.ARMS[name]
    run = memory_bound.Run(arm, 1234, 600, Path("x.log"), 78.0, 24, evaluate=True)
    proc = subprocess.run(
        run.command(), env={**os.environ, **run.env(), "DRY_RUN": "1"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    argv = proc.stdout.splitlines()
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_lrmoe.py", *argv])
    args = arguments.parse_args(entry.extra_args_provider)
    arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    entry.check_args(args)
    assert args.memory_cap_gib == 78.0 and args.full_validation and args.moe_layer_timing
    assert args.num_experts == 16 and args.seq_length == 1024 and args.micro_batch_size == arm.mbs
    assert args.global_batch_size == 16 and args.num_layers == 24 and args.vocab_size == 512
    assert args.eval_micro_batch_size == 32 and args.split == "80,20,0"
    # --full-validation's sampler (compat.fix_full_validation): one micro-batch of 32 per
    # evaluation step, so an evaluation is ceil(sequences / 32) forward passes.
    assert compat.evaluation_micro_batches_per_step(args) == 1
    config = arguments.core_transformer_config_from_args(args)
    if arm.recompute == "full":
        assert config.recompute_granularity == "full"
    else:
        modules = ["core_attn"] + ([] if arm.recompute == "none" else [arm.recompute])
        assert config.recompute_granularity == "selective"
        assert sorted(config.recompute_modules) == sorted(modules)
    lrmoe = lrmoe_config_from_args(args)
    assert (lrmoe is None) == (not arm.lrmoe)
    if lrmoe is not None:
        assert lrmoe.keep_ratio == arm.keep and lrmoe.activation_mode == arm.activation_mode
        lrmoe.validate_against(config, name)


def test_dry_run_prints_one_launch_per_arm(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_bound.py"), "search", "--out",
         str(tmp_path), "--dry-run", "--arms", "stock", "k0.5+moe"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and "KEEP_RATIO=0.5" in lines[1] and "MEMORY_CAP_GIB=78" in lines[0]
    assert lines[1].endswith("search/k0.5_with_moe.log")  # no '+' in the files' names
    assert not (tmp_path / "search.json").exists()



def test_megatron_args_reach_every_launch(tmp_path: Path) -> None:
    """``--megatron-args`` (e.g. the profiler's flags) ends every launch's command line, split
    as a shell would, after the arm's own flags."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "memory_bound.py"), "converge", "--out",
         str(tmp_path), "--dry-run", "--arms", "stock+moe", "--seeds", "7",
         "--megatron-args", "--profile --tensorboard-dir '/tmp/a b/tb'"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (line,) = proc.stdout.splitlines()
    assert "--recompute-modules core_attn moe" in line
    assert line.split(" > ")[0].endswith("--profile --tensorboard-dir '/tmp/a b/tb'")


# -- the report --------------------------------------------------------------------------------


def test_report_from_synthetic_logs(tmp_path: Path) -> None:
    """Two arms, two seeds each: the baseline crosses 1.5 at iteration 6, the other at 8 with
    half the MoE time per iteration, so its MoE time to target is (7 * 20) / (5 * 40)."""
    (tmp_path / "converge").mkdir()
    (tmp_path / "search.json").write_text(json.dumps({"picks": {"baseline": "stock+moe",
                                                                "keep 0.5": "k0.5+moe"}}))
    for seed in (1, 2):
        (tmp_path / "converge" / f"stock_with_moe_seed{seed}.log").write_text(
            fake_log(seed=seed, val={4: 2.0, 8: 1.0}, se=0.005))
        (tmp_path / "converge" / f"k0.5_with_moe_seed{seed}.log").write_text(
            fake_log(seed=seed, moe_ms=20.0, val={4: 2.0, 10: 1.25}, se=0.005))
    result = memory_bound.main(["report", "--out", str(tmp_path), "--target", "1.5"]) or json.loads(
        (tmp_path / "summary.json").read_text())
    base, lrmoe = result["arms"]["stock+moe"], result["arms"]["k0.5+moe"]
    assert result["baseline"] == "stock+moe"
    assert base["iterations_to_target"]["mean"] == pytest.approx(6.0)
    assert lrmoe["iterations_to_target"]["mean"] == pytest.approx(8.0)
    assert lrmoe["vs_baseline"]["moe_s_to_target"] == pytest.approx(0.14 / 0.2)
    assert lrmoe["moe_s_to_target_vs_baseline_by_seed"] == {
        "1": pytest.approx(0.7), "2": pytest.approx(0.7)
    }
    assert lrmoe["first_iteration_s"]["mean"] == 5.0
    assert lrmoe["final_val_loss"]["n"] == 2 and lrmoe["val_relative_se"]["mean"] == pytest.approx(0.004)
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0
    # Default target: 1 % above the baseline's mean final validation loss.
    default = json.loads(json.dumps(memory_bound.report(memory_bound.parser().parse_args(
        ["report", "--out", str(tmp_path)]))))
    assert default["target"] == pytest.approx(1.01)
    # No baseline run and no --target: the table still prints, nothing reaches a target.
    for log in (tmp_path / "converge").glob("stock_with_moe_*"):
        log.unlink()
    (tmp_path / "search.json").unlink()
    lone = memory_bound.report(memory_bound.parser().parse_args(["report", "--out", str(tmp_path)]))
    assert lone["target"] is None and lone["arms"]["k0.5+moe"]["vs_baseline"] is None


# -- the memory cap and the validation spread --------------------------------------------------


def test_memory_cap_is_a_fraction_of_the_device() -> None:
    cap = plan_memory_cap(78, int(139.8 * GIB), device=3)
    assert cap.fraction == pytest.approx(78 / 139.8) and cap.device == 3
    assert "78.0 GiB on cuda:3" in describe(cap) and describe(None) == "memory cap: none"
    with pytest.raises(ValueError, match=r"--memory-cap-gib \(200\) exceeds"):
        plan_memory_cap(200, int(139.8 * GIB))
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive number of GiB"):
            plan_memory_cap(bad, int(139.8 * GIB))
    assert apply_memory_cap(None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_memory_cap_needs_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        apply_memory_cap(78)


def test_gpu_memory_emulation_holds_the_rest_of_the_device(tmp_path: Path) -> None:
    card = plan_gpu_memory(79.18, int(139.8 * GIB), device=2)
    assert card.held_bytes == int(139.8 * GIB) - int(79.18 * GIB) and card.device == 2
    line = describe_gpu_memory(card)
    assert "79.18 GiB card emulated on cuda:2" in line and "60.62 GiB held outside" in line
    assert plan_gpu_memory(int(139.8 * GIB) / GIB, int(139.8 * GIB)).held_bytes == 0
    # 79.18 on a card of 79.176 GiB (rounded up from the card's own figure): the card itself.
    assert plan_gpu_memory(79.18, int(79.176 * GIB)).held_bytes == 0
    with pytest.raises(ValueError, match=r"--gpu-memory-gib \(140\) exceeds the memory"):
        plan_gpu_memory(140, int(139.8 * GIB))
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive number of GiB"):
            plan_gpu_memory(bad, int(139.8 * GIB))
    assert apply_gpu_memory(None) is None
    # The training log's line, as the logger prints it, is what the reports read.
    log = tmp_path / "run.log"
    log.write_text(f"INFO:megatron_lrmoe.training.memory_cap:{line}\n" + fake_log(cap=None))
    parsed = train_logs.parse_log(log)
    assert parsed.gpu_memory_gib == 79.18 and parsed.memory_cap_gib is None
    assert train_logs.summary(parsed, None)["gpu_memory_gib"] == 79.18
    # memory_bound.py passes it to the launch, instead of the allocator's cap.
    arm = memory_bound.ARMS["stock"]
    env = memory_bound.Run(arm, 1, 10, Path("x.log"), None, 24, evaluate=False, gpu_gib=79.18).env()
    assert env["GPU_MEMORY_GIB"] == "79.18" and "MEMORY_CAP_GIB" not in env
    with pytest.raises(SystemExit, match="both limit the memory"):
        memory_bound.main(["search", "--out", str(tmp_path), "--cap-gib", "78", "--gpu-gib", "79"])


def test_out_of_memory_message_is_parsed() -> None:
    """PyTorch's out-of-memory message (gpu_run34 call 10's, an H100 80GB): what the process held
    outside the allocator is the use less the allocator's reserve."""
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 274.00 MiB. GPU 0 has a "
        "total capacity of 79.18 GiB of which 62.12 MiB is free. Including non-PyTorch memory, "
        "this process has 79.11 GiB memory in use. 78.00 GiB allowed; Of the allocated memory "
        "69.58 GiB is allocated by PyTorch, with 15.00 MiB allocated in private pools (e.g., CUDA "
        "Graphs), and 5.97 GiB is reserved by PyTorch but unallocated. If reserved but ..."
    )
    oom = train_logs.oom_memory(text)
    assert oom is not None and oom.total_gib == 79.18 and oom.allocated_gib == 69.58
    assert oom.free_gib == pytest.approx(62.12 / 1024)
    assert oom.outside_gib == pytest.approx(79.11 - 69.58 - 5.97)
    # Older messages have no private pools clause.
    plain = text.replace("with 15.00 MiB allocated in private pools (e.g., CUDA Graphs), ", "")
    assert train_logs.oom_memory(plain) == oom
    assert train_logs.oom_memory("no error here") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_gpu_memory_emulation_needs_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        apply_gpu_memory(79.18)


_HOLD_ONE_GIB = """
import torch
from megatron_lrmoe.training.memory_cap import GIB, apply_gpu_memory
total = torch.cuda.get_device_properties(0).total_memory
free_before, _ = torch.cuda.mem_get_info(0)
card = apply_gpu_memory((total - GIB) / GIB, device=0)
free_after, _ = torch.cuda.mem_get_info(0)
assert abs((free_before - free_after) - card.held_bytes) < 64 * 2**20, (free_before, free_after)
assert torch.cuda.memory_allocated(0) == 0  # outside PyTorch's allocator and its statistics
print("held", card.held_bytes)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_memory_emulation_on_cuda() -> None:
    """On a GPU the driver allocation takes the memory held back out of what is free."""
    proc = subprocess.run(
        [sys.executable, "-c", _HOLD_ONE_GIB], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("held ")


def test_validation_spread_matches_a_direct_computation() -> None:
    torch.manual_seed(0)
    batches = [(torch.rand(4, 6) * 3, (torch.rand(4, 6) > 0.3).float()) for _ in range(3)]
    batches[1][1][2] = 0.0  # a sequence with no counted token is left out
    lines: list[str] = []
    spread = ValidationSpread(lambda: 3, lines.append)
    for losses, mask in batches:
        spread.record(losses, mask)
    per_sequence = [
        float((l * m).sum() / m.sum()) for losses, mask in batches
        for l, m in zip(losses, mask) if m.sum() > 0
    ]  # fmt: skip
    n = len(per_sequence)
    mean = sum(per_sequence) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in per_sequence) / (n - 1))
    assert n == 11 and len(lines) == 1  # reported after the third micro-batch, once
    assert spread.last == (n, pytest.approx(std), pytest.approx(std / math.sqrt(n)))
    assert lines[0].startswith(" validation spread | sequences: 11 |")
    # The line parses back (train_logs pairs it with the validation line after it).
    found = train_logs._SPREAD.search(lines[0])
    assert float(found.group(3)) == pytest.approx(std / math.sqrt(n), rel=1e-6)
    spread.record(*batches[0])  # the next evaluation starts afresh
    assert spread.report()[0] == 4


def test_search_merges_calls_and_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search spread over two calls: the second keeps the first's arms, the picks cover
    both, and a search at another cap into the same folder is refused."""
    launched = []

    def fake_launch(run: memory_bound.Run, timeout_s: float, dry_run: bool):
        launched.append(run.arm.name)
        run.log.parent.mkdir(parents=True, exist_ok=True)
        oom = 3 if run.arm.name == "stock" else None
        run.log.write_text(fake_log(iter_ms=100.0 + len(launched), oom_at=oom))
        return train_logs.parse_log(run.log)

    monkeypatch.setattr(memory_bound, "launch", fake_launch)
    common = ["search", "--out", str(tmp_path), "--cap-gib", "78", "--arms"]
    memory_bound.main([*common, "stock", "stock+moe"])
    memory_bound.main([*common, "stock+moe", "k0.5+moe"])
    assert launched == ["stock", "stock+moe", "k0.5+moe"]
    result = json.loads((tmp_path / "search.json").read_text())
    rows = {row["arm"]["name"]: row for row in result["arms"]}
    assert not rows["stock"]["fits"] and rows["stock"]["oom"] and rows["stock+moe"]["fits"]
    assert rows["k0.5+moe"]["max_allocated_gib"] == pytest.approx(70000 / 1024)
    assert rows["k0.5+moe"]["moe_share"] == pytest.approx(40.0 / 103.0)
    assert result["picks"] == {"baseline": "stock+moe", "keep 0.5": "k0.5+moe"}
    with pytest.raises(SystemExit, match="searched at cap 78"):
        memory_bound.main(["search", "--out", str(tmp_path), "--cap-gib", "38", "--arms", "stock"])


def test_budget_arm_holds_what_its_keep_ratio_holds() -> None:
    """``budget_keep``: the budget is what keep 0.5 plans per call, so a call planned at keep
    0.75 under it is trimmed to keep 0.5's pairs, and keep 0.5 itself is not trimmed."""
    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.control.controller import plan_call
    from megatron_lrmoe.control.costs import CostModel

    tokens = 16 * 1024
    budget = memory_bound.budget_bytes("recompute", 0.5, tokens)
    assert budget > memory_bound.budget_bytes("recompute", 0.25, tokens)
    cost = CostModel(hidden_size=2048, ffn_hidden_size=768, gated=True, activation_bytes=2,
                     param_bytes=2, grad_bytes=4)
    counts = torch.full((1, 16), tokens * 8 // 16, dtype=torch.int64)
    kept = {}
    for keep in (0.5, 0.75):
        lrmoe = LRMoEConfig(keep_ratio=keep, activation_mode="recompute", memory_budget_bytes=budget)
        kept[keep] = int(plan_call(counts, 0, lrmoe, cost).quota.sum())
    assert kept[0.5] == tokens * 8 // 2
    assert kept[0.75] <= kept[0.5]
    arm = memory_bound.ARMS["auto0.1-recompute-mem0.5"]
    assert arm.flags()[-2:] == ["--lrmoe-memory-budget-bytes", str(budget)]
