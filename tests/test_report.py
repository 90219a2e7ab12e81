"""``benchmarks/report.py``: the training summary and the comparison with keep 1.0 by seed, on
synthetic logs in Megatron's format (what ``benchmarks/train_compare.sh`` writes), and
docs/results.md, which it generates from the committed results."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.report import run_stats, train_summary, versus_keep1


def _log(
    first_moe_ms: float,
    moe_ms: float,
    iters: int,
    losses: dict[int, float],
    seed: int = 1234,
    keep: float | None = None,
    ms_per_iter: float = 500.0,
) -> str:
    """A log in Megatron's format: the argument dump (``keep`` None: stock, no ``--lrmoe``),
    then each iteration's line and LRMoE's MoE-layer line, and the validation losses."""
    lines = [f"  lrmoe ........................................... {keep is not None}"]
    if keep is not None:
        lines.append(f"  lrmoe_keep_ratio ................................ {keep}")
    lines.append(f"  seed ............................................ {seed}")
    cumulative = 0.0
    for i in range(1, iters + 1):
        step = first_moe_ms if i == 1 else moe_ms
        cumulative += step / 1e3
        lines.append(
            f" [t] iteration {i:8d}/{iters:8d} | consumed samples: {4 * i} | elapsed time per "
            f"iteration (ms): {ms_per_iter} | throughput per GPU (TFLOP/s/GPU): 1.0 |"
        )
        lines.append(
            f" [t] iteration {i:8d}/{iters:8d} | moe layers: {step:.1f} ms/iter | moe layers "
            f"cumulative: {cumulative:.3f} s |"
        )
        if i in losses:
            lines.append(f" validation loss at iteration {i} | lm loss value: {losses[i]:E} |")
    return "\n".join(lines) + "\n"


def test_train_summary_separates_the_first_iteration(tmp_path: Path) -> None:
    """A run whose first iteration compiled for 3 s: the cumulative MoE time carries it, the
    "from iteration 2" figures do not; the target loss is crossed between two evaluations."""
    losses = {50: 2.0, 100: 1.5, 150: 1.4}
    (tmp_path / "train_cold.log").write_text(_log(3000.0, 40.0, 150, losses))
    (tmp_path / "train_warm.log").write_text(_log(40.0, 40.0, 150, losses))
    rows = {line.split(" | ")[0][2:]: line for line in train_summary(tmp_path, 1.75).splitlines()}
    cold, warm = rows["train_cold"].split(" | "), rows["train_warm"].split(" | ")
    assert cold[1] == warm[1] == "0.500"  # median s/iter
    assert cold[3] == "40.0, 8.96, 5.96" and warm[3] == "40.0, 6.00, 5.96"
    # 1.75 is crossed halfway between iterations 50 and 100: 75 iterations.
    assert cold[4] == "75.0 it, 37.5 s, 5.96 s (2.96 s) |"
    assert warm[4] == "75.0 it, 37.5 s, 3.00 s (2.96 s) |"


def test_versus_keep1_pairs_runs_by_seed_from_the_argument_dump(tmp_path: Path) -> None:
    """Runs in two folders: each LRMoE run is compared with the keep-1.0 run of its own seed
    (read from the log, not the file name), stock runs and seeds without one keep-1.0 run are
    left out, and the MoE time to the target from iteration 2 is summed per keep ratio."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    early = {50: 2.0, 100: 1.5, 150: 1.4}  # 1.75 at iteration 75
    late = {50: 2.0, 100: 1.75, 150: 1.47}  # at 100
    (a / "train_x.log").write_text(_log(40.0, 40.0, 150, early, seed=1, keep=1.0))
    (a / "train_y.log").write_text(_log(3000.0, 30.0, 150, late, seed=1, keep=0.5, ms_per_iter=450))
    (b / "train_x.log").write_text(_log(40.0, 50.0, 150, early, seed=2, keep=1.0))
    (b / "train_y.log").write_text(_log(40.0, 25.0, 150, early, seed=2, keep=0.5))
    (b / "train_stock.log").write_text(_log(40.0, 90.0, 150, early, seed=2))
    (b / "train_lonely.log").write_text(_log(40.0, 25.0, 150, early, seed=3, keep=0.5))
    stats = [run_stats(log, 1.75) for log in sorted(tmp_path.glob("*/train_*.log"))]
    by_name = {(s.seed, s.keep): s for s in stats}
    assert by_name[(2, None)].moe_ms_per_iter == 90.0  # stock: no --lrmoe
    table = versus_keep1(stats).splitlines()
    rows = [line.rstrip(" |").split(" | ") for line in table if line.startswith("| train_y")]
    assert [r[1:3] for r in rows] == [["1", "0.5"], ["2", "0.5"]]
    # Seed 1: 30 / 40 ms per iteration, 450 / 500 ms per iteration, the target at iteration 100
    # against 75: 99 * 0.030 = 2.97 s against 74 * 0.040 = 2.96 s from iteration 2.
    assert rows[0][3:7] == ["0.750x", "0.900x", "+5.00 % @150", "1.003x (2.97 / 2.96)"]
    # Seed 2: 25 / 50 ms, the same iterations: 74 * 0.025 = 1.85 s against 74 * 0.050 = 3.70 s.
    assert rows[1][6] == "0.500x (1.85 / 3.70)"
    assert not any("lonely" in line or "stock" in line for line in table)
    assert table[-1] == (
        "keep 0.5: MoE time to target from iteration 2, summed over 2 run(s) of 2 seed(s): 4.82 s "
        "against keep 1.0's 6.66 s (0.724x)"
    )
    summary = train_summary([a, b], 1.75)
    assert f"| {a}/train_x | " in summary and f"| {b}/train_stock | " in summary


def test_versus_keep1_says_when_a_seed_counts_twice(tmp_path: Path) -> None:
    """Two keep-0.5 runs of one seed (a rerun, or the same run in two folders) are each set
    against that seed's keep-1.0 run, and the sum says it holds the seed twice."""
    early = {50: 2.0, 100: 1.5, 150: 1.4}
    for name, keep, ms in (("x", 1.0, 50.0), ("y", 0.5, 25.0), ("z", 0.5, 25.0)):
        (tmp_path / f"train_{name}.log").write_text(_log(40.0, ms, 150, early, seed=2, keep=keep))
    stats = [run_stats(log, 1.75) for log in sorted(tmp_path.glob("train_*.log"))]
    assert versus_keep1(stats).splitlines()[-1] == (
        "keep 0.5: MoE time to target from iteration 2, summed over 2 run(s) of 1 seed(s); "
        "seed(s) 2 more than once: 3.70 s against keep 1.0's 7.40 s (0.500x)"
    )


def test_a_run_stopped_early_says_so(tmp_path: Path) -> None:
    """A run cut off at iteration 120 of 150 (a timeout): its row names where it stopped, and
    a finished run's row does not."""
    losses = {50: 2.0, 100: 1.5, 150: 1.4}
    text = _log(40.0, 40.0, 150, losses)
    cut = text.index(" [t] iteration      121/")
    (tmp_path / "train_cut.log").write_text(text[:cut])
    (tmp_path / "train_full.log").write_text(text)
    names = {run_stats(log, 1.75).name for log in tmp_path.glob("train_*.log")}
    assert names == {"train_cut (stopped at iteration 120 of 150)", "train_full"}


def test_results_md_is_what_report_py_writes() -> None:
    """docs/results.md is generated from the committed results (regenerate it with the command
    its first lines name, never edit it by hand): the committed page is byte for byte what
    ``report.py --results-md`` writes, and each section names its run and command."""
    from benchmarks import report

    root = Path(__file__).resolve().parents[1]
    page = (root / report.RESULTS_MD).read_text(encoding="utf-8")
    assert page == report.results_md(root), f"regenerate: {report.REGENERATE}"
    sections = page.split("\n## ")[1:]
    assert len(sections) == len(report.SECTIONS)
    assert all("Run `" in s and "made by `" in s for s in sections)
    assert not re.search(r"\bsections? \d", page), "cite runs and files, not notebook sections"
