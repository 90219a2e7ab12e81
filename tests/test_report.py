"""``benchmarks/report.py``: the training summary that docs/benchmarks.md quotes, on synthetic
logs in Megatron's format (what ``benchmarks/train_compare.sh`` writes)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import train_summary


def _log(first_moe_ms: float, moe_ms: float, iters: int, losses: dict[int, float]) -> str:
    lines, cumulative = [], 0.0
    for i in range(1, iters + 1):
        step = first_moe_ms if i == 1 else moe_ms
        cumulative += step / 1e3
        lines.append(
            f" [t] iteration {i:8d}/{iters:8d} | consumed samples: {4 * i} | elapsed time per "
            f"iteration (ms): 500.0 | throughput per GPU (TFLOP/s/GPU): 1.0 |"
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
