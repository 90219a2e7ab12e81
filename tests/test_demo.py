"""``lrmoe-demo --quick`` end to end, as the console script runs it (a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[1])
# Interpreter start and the megatron import (~10 s per process on 2 cores), two ranks, and two
# 12-step runs of a tiny model.
TIMEOUT_S = 240
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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


def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    proc = _run("--quick", "--out-dir", str(out_dir))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stdout = proc.stdout
    # Quiet by default (--verbose shows them): no warnings about what the machine lacks.
    for noise in ("No CUDA runtime", "Apex is not installed", "Warning:"):
        assert noise not in proc.stderr + stdout, proc.stderr[-4000:]

    # Progress while it runs, then the table.
    assert "[stock] step" in stdout and "[lrmoe] step" in stdout, stdout
    assert "lrmoe kept:" in stdout, "the LRMoE progress lines carry the metrics log string"
    assert "target validation loss" in stdout
    header = next(line for line in stdout.splitlines() if line.startswith("run "))
    for column in ("steps to target", "time to target (s)", "final val loss", "MoE time (s)"):
        assert column in header, header
    rows = [line for line in stdout.splitlines() if line.startswith(("stock ", "lrmoe keep 0.5"))]
    assert len(rows) == 2, stdout

    png = out_dir / "loss_vs_time.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    result = json.loads((out_dir / "results.json").read_text())
    assert result["lrmoe"]["keep_ratio"] == 0.5 and result["lrmoe"]["selection"] == "sample"
    assert [row["run"] for row in result["table"]] == ["stock", "lrmoe keep 0.5"]
    stock, lrmoe = result["runs"]["stock"], result["runs"]["lrmoe"]
    assert len(stock) == len(lrmoe) == result["settings"]["steps"] == 12
    # Same initial weights and data: the first loss (before any update) is the same.
    assert lrmoe[0]["loss"] == pytest.approx(stock[0]["loss"], rel=1e-5)
    # LRMoE at keep 0.5 sends about half the stock backward bytes.
    stock_row, lrmoe_row = result["table"]
    ratio = lrmoe_row["backward_mib_per_step"] / stock_row["backward_mib_per_step"]
    assert 0.3 < ratio < 0.7, ratio
    assert result["target_loss"] == pytest.approx(
        min(r["valid_loss"] for r in stock if r["step"] == 9)
    )
    assert stock_row["steps_to_target"] == pytest.approx(9)


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
