"""``lrmoe-demo --quick`` end to end, as the console script runs it (a fresh interpreter).

What the demo could get wrong, each checked against an independent computation:

* the summary table (steps, training time and MoE time to the target, final losses, cumulative
  times, bytes per step) is recomputed here from the per-step records in ``results.json``, with
  its own crossing interpolation, and the printed table must show the same numbers;
* the stock run's backward bytes equal the alltoall dispatcher's traffic worked out from the
  model shape, and LRMoE's at keep 0.5 lie within the bounds the quotas allow;
* the metrics line's kept ratio is what the quotas allow (at least keep, at most one extra pair
  per expert and layer call);
* LRMoE at keep 1.0 reproduces stock's losses step by step, and an unreachable target is
  reported as not reached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[1])
# Interpreter start and the megatron import (~10 s per process on 2 cores), two ranks, and two
# 12-step runs of a tiny model.
TIMEOUT_S = 240
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEEP = 0.5


def _demo_command(*args: str) -> list[str]:
    """The installed console script if there is one, else exactly what it runs."""
    script = Path(sys.executable).with_name("lrmoe-demo")
    if script.exists():
        return [str(script), *args]
    code = "import sys; from megatron_lrmoe.demo.main import main; sys.exit(main())"
    return [sys.executable, "-c", code, *args]


def _run(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return subprocess.run(
        _demo_command(*args), env=env, capture_output=True, text=True, timeout=timeout
    )


def _demo(out_dir: Path, *args: str) -> tuple[str, dict]:
    proc = _run("--quick", "--out-dir", str(out_dir), *args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Quiet by default (--verbose shows them): no warnings about what the machine lacks.
    for noise in ("No CUDA runtime", "Apex is not installed", "Warning:"):
        assert noise not in proc.stderr + proc.stdout, proc.stderr[-4000:]
    return proc.stdout, json.loads((out_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    """The default quick demo (LRMoE keep 0.5, sample), run once for the tests below."""
    out_dir = tmp_path_factory.mktemp("demo") / "out"
    stdout, result = _demo(out_dir, "--keep-ratio", str(KEEP))
    return stdout, result, out_dir


# ------------------------------------------------------------------------------------------------
# Independent recomputation of the summary.
# ------------------------------------------------------------------------------------------------
def _first_reach(evals: list[dict], target: float, key: str) -> Optional[float]:
    """``key`` where the validation loss first gets to ``target`` or below, interpolated
    linearly in the loss between that evaluation and the one before it."""
    for i, record in enumerate(evals):
        if record["valid_loss"] > target:
            continue
        if i == 0:
            return float(record[key])
        before = evals[i - 1]
        t = (before["valid_loss"] - target) / (before["valid_loss"] - record["valid_loss"])
        return before[key] + t * (record[key] - before[key])
    return None


def _expected_row(records: list[dict], target: float) -> dict[str, Any]:
    """The table row of one run, from its per-step records only."""
    train = moe = 0.0
    rows = []
    for record in records:
        train += record["train_seconds"]
        moe += record["moe_seconds"]
        rows.append(dict(record, train=train, moe=moe))
    evals = [r for r in rows if r["valid_loss"] is not None]
    return {
        "steps_to_target": _first_reach(evals, target, "step"),
        "seconds_to_target": _first_reach(evals, target, "train"),
        "moe_seconds_to_target": _first_reach(evals, target, "moe"),
        "final_valid_loss": evals[-1]["valid_loss"],
        "final_train_loss": records[-1]["loss"],
        "train_seconds": train,
        "moe_seconds": moe,
        "backward_mib_per_step": sum(r["backward_bytes"] for r in records)
        / len(records)
        / 2**20,
    }


def _check_table(stdout: str, result: dict) -> None:
    target = result["target_loss"]
    runs = result["runs"]
    for row, name in zip(result["table"], ("stock", "lrmoe")):
        expected = _expected_row(runs[name], target)
        for key, value in expected.items():
            if value is None:
                assert row[key] is None, (name, key, row[key])
            else:
                assert row[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
        # The printed line shows the same numbers.
        line = next(x for x in stdout.splitlines() if x.startswith(row["run"] + " "))
        cells = line[len(row["run"]) :].split()
        shown = [
            ("-" if expected["steps_to_target"] is None else f"{expected['steps_to_target']:.0f}"),
            (
                "-"
                if expected["seconds_to_target"] is None
                else f"{expected['seconds_to_target']:.1f}"
            ),
        ]
        assert cells[:2] == shown, (line, shown)
        assert f"{expected['final_valid_loss']:.4f}" in cells, line
        assert f"{expected['backward_mib_per_step']:.2f}" == cells[-1], line
    stock_bytes = result["table"][0]["backward_mib_per_step"]
    lrmoe_bytes = result["table"][1]["backward_mib_per_step"]
    note = f"LRMoE backward bytes: {100.0 * (lrmoe_bytes / stock_bytes - 1.0):+.1f}% vs stock"
    assert note in stdout, stdout[-2000:]


def _geometry(result: dict) -> dict[str, int]:
    """Per-rank traffic parameters from the model shape the demo reports."""
    from megatron_lrmoe.demo.trainer import ModelShape, TrainSettings, qwen3_style_config

    shape = ModelShape(**result["shape"])
    settings = TrainSettings(**result["settings"])
    config = qwen3_style_config(shape, result["world_size"])
    return {
        "layers": shape.num_layers,  # every layer is MoE
        "calls": shape.num_layers * settings.num_microbatches,  # layer calls per step and rank
        "pairs": settings.micro_batch_size * shape.seq_length * shape.topk,  # per call and rank
        "hidden": shape.hidden_size,
        "experts": shape.num_experts,
        "ranks": result["world_size"],
        "element": config.params_dtype.itemsize,
    }


# ------------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------------
def test_quick_demo_end_to_end(quick: tuple[str, dict, Path]) -> None:
    stdout, result, out_dir = quick
    # Progress while it runs, then the table.
    assert "[stock] step" in stdout and "[lrmoe] step" in stdout, stdout
    assert "lrmoe kept:" in stdout, "the LRMoE progress lines carry the metrics log string"
    assert "target validation loss" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("run "))
    for column in ("steps to target", "time to target (s)", "final val loss", "MoE time (s)"):
        assert column in header, header
    rows = [line for line in stdout.splitlines() if line.startswith(("stock ", "lrmoe keep 0.5"))]
    assert len(rows) == 2, stdout

    assert (out_dir / "loss_vs_time.png").read_bytes()[:8] == PNG_MAGIC
    # Where the results are, each file on a line of its own, and what the figures rest on.
    lines = [line.strip() for line in stdout.splitlines()]
    assert str(out_dir / "results.json") in lines and str(out_dir / "loss_vs_time.png") in lines
    assert any(line.startswith("one seed, CPU:") for line in lines), stdout[-2000:]
    assert result["lrmoe"]["keep_ratio"] == KEEP and result["lrmoe"]["selection"] == "sample"
    assert [row["run"] for row in result["table"]] == ["stock", "lrmoe keep 0.5"]
    stock, lrmoe = result["runs"]["stock"], result["runs"]["lrmoe"]
    assert len(stock) == len(lrmoe) == result["settings"]["steps"] == 12
    assert [r["step"] for r in stock] == list(range(1, 13))
    # Same initial weights and data: the first loss (before any update) is the same.
    assert lrmoe[0]["loss"] == pytest.approx(stock[0]["loss"], rel=1e-5)
    # Evaluations every eval_interval steps and at the end, for both runs.
    interval = result["settings"]["eval_interval"]
    for records in (stock, lrmoe):
        evaluated = [r["step"] for r in records if r["valid_loss"] is not None]
        assert evaluated == list(range(interval, 13, interval)), evaluated


def test_summary_is_what_the_step_records_say(quick: tuple[str, dict, Path]) -> None:
    """Steps/time/MoE time to target and the other columns, recomputed from the records."""
    stdout, result, _ = quick
    # Default target: stock's validation loss at the evaluation nearest 3/4 of 12 steps (9).
    at_nine = [r["valid_loss"] for r in result["runs"]["stock"] if r["step"] == 9]
    assert result["target_loss"] == pytest.approx(at_nine[0], rel=1e-12)
    _check_table(stdout, result)


def test_backward_bytes_follow_the_dispatcher_and_the_keep_ratio(
    quick: tuple[str, dict, Path],
) -> None:
    """Stock: every pair's gradient row out and its input-gradient row back, plus one fp32 per
    pair for the routing weight. LRMoE at keep k: only kept pairs' rows, with at most 16 bytes of
    bookkeeping per kept pair; kept pairs are between k and k plus one per expert and call."""
    _, result, _ = quick
    geo = _geometry(result)
    row_bytes = geo["hidden"] * geo["element"]
    stock_per_step = geo["calls"] * geo["pairs"] * (2 * row_bytes + 4)
    for record in result["runs"]["stock"]:
        # Mean over ranks: everything sent is received by some rank of the EP group.
        assert record["backward_bytes"] == pytest.approx(stock_per_step, rel=1e-12)
    kept_max = KEEP + geo["experts"] / (geo["ranks"] * geo["pairs"])
    low = KEEP * 2 * row_bytes / (2 * row_bytes + 4)
    high = kept_max * (2 * row_bytes + 16) / (2 * row_bytes + 4)
    for record in result["runs"]["lrmoe"]:
        ratio = record["backward_bytes"] / stock_per_step
        assert low <= ratio <= high, (record["step"], ratio, low, high)


def test_reported_kept_ratio_is_what_the_quotas_allow(quick: tuple[str, dict, Path]) -> None:
    stdout, result, _ = quick
    geo = _geometry(result)
    kept = [float(m) for m in re.findall(r"lrmoe kept: ([0-9.]+) \|", stdout)]
    assert len(kept) == 4, stdout  # one metrics report per evaluation
    kept_max = KEEP + geo["experts"] / (geo["ranks"] * geo["pairs"])
    for value in kept:
        assert KEEP - 5e-4 <= value <= kept_max + 5e-4, (value, kept_max)
    for record in result["runs"]["lrmoe"]:
        if record["metrics"]:
            assert KEEP <= record["metrics"]["lrmoe/kept_ratio"] <= kept_max, record


def test_keep_one_reproduces_stock(tmp_path: Path) -> None:
    """Keep 1.0 is the stock backward: the same losses and bytes at every step. The target 0.0
    is out of reach: both rows say so ('-'), and so does the note."""
    stdout, result = _demo(tmp_path / "out", "--keep-ratio", "1.0", "--target-loss", "0.0")
    stock, lrmoe = result["runs"]["stock"], result["runs"]["lrmoe"]
    assert len(stock) == len(lrmoe) == 12
    for a, b in zip(stock, lrmoe):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert (a["valid_loss"] is None) == (b["valid_loss"] is None)
        if a["valid_loss"] is not None:
            assert b["valid_loss"] == pytest.approx(a["valid_loss"], rel=1e-5), a["step"]
        assert b["backward_bytes"] == a["backward_bytes"], a["step"]
    assert result["target_loss"] == 0.0 and result["target_source"] == "--target-loss"
    assert all(row["steps_to_target"] is None for row in result["table"])
    assert "LRMoE did not reach the target within its steps ('-')" in stdout
    assert "lrmoe kept: 1.000 |" in stdout
    _check_table(stdout, result)


def test_help_lists_the_options() -> None:
    proc = _run("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for option in (
        "--keep-ratio",
        "--selection",
        "--scope",
        "--activation-mode",
        "--steps",
        "--target-loss",
        "--out-dir",
        "--quick",
        "--seed",
    ):
        assert option in proc.stdout, option


def test_bad_arguments_fail_before_starting_ranks(capsys: pytest.CaptureFixture) -> None:
    from megatron_lrmoe.demo.main import main

    assert main(["--keep-ratio", "1.5"]) == 2
    assert "--keep-ratio" in capsys.readouterr().err
    assert main(["--steps", "0"]) == 2
