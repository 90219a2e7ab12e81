"""``benchmarks/replay_to_target.py``: the iterations to a target paired by seed, the curve each
replayed arm takes, the MoE time to the target over stock and over replicas only (by hand), its
refusals, and the whole command on a replay the CLI wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import replay_to_target as rt
from megatron_lrmoe.replay import cli as replay_cli


def _log(path: Path, seed: int, val: dict[int, float]) -> Path:
    """The lines of a ``pretrain_lrmoe.py`` log that the script reads: the seed in Megatron's
    argument dump and the validation losses."""
    lines = [f"  seed ............................................ {seed}"]
    lines += [
        f" validation loss at iteration {i} | lm loss value: {v:.6E} |" for i, v in val.items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_iteration_ratio_pairs_seeds_and_marks_unreached_runs(tmp_path: Path) -> None:
    target = 1.5
    # Seed 1 crosses 1.5 at 100 (on the point), seed 2 halfway between 150 and 250 (200).
    base = {
        1: rt.run_iterations(_log(tmp_path / "a1.log", 1, {50: 2.0, 100: 1.5}), target),
        2: rt.run_iterations(_log(tmp_path / "a2.log", 2, {150: 2.0, 250: 1.0}), target),
    }
    assert base[1].iteration == 100.0 and base[2].iteration == 200.0
    half = {
        1: rt.run_iterations(_log(tmp_path / "b1.log", 1, {100: 1.6, 120: 1.4}), target),
        2: rt.run_iterations(_log(tmp_path / "b2.log", 2, {100: 2.0, 190: 1.5}), target),
        3: rt.run_iterations(_log(tmp_path / "b3.log", 3, {10: 1.0}), target),  # no keep 1.0 pair
    }
    ratio = rt.iteration_ratio(half, base)
    assert ratio is not None and ratio.seeds == [1, 2] and not ratio.lower_bound
    assert ratio.ratio == pytest.approx((110 + 190) / (100 + 200))
    assert ratio.per_seed == {1: pytest.approx(1.1), 2: pytest.approx(0.95)}
    # A run that never gets there counts with its last evaluation: a lower bound.
    slow = {1: rt.run_iterations(_log(tmp_path / "c1.log", 1, {100: 1.9, 300: 1.7}), target)}
    assert not slow[1].reached and slow[1].iteration == 300.0 and slow[1].final_val == 1.7
    low = rt.iteration_ratio(slow, base)
    assert low is not None and low.lower_bound and low.ratio == pytest.approx(3.0)
    # Nothing to divide by: no common seed, or keep 1.0 itself never reached the target.
    assert rt.iteration_ratio({3: half[3]}, base) is None
    assert rt.iteration_ratio(half, {1: slow[1]}) is None


def test_one_log_per_seed_and_a_log_with_evaluations(tmp_path: Path) -> None:
    a = rt.run_iterations(_log(tmp_path / "a.log", 7, {10: 1.0}), 1.5)
    b = rt.run_iterations(_log(tmp_path / "b.log", 7, {10: 1.2}), 1.5)
    with pytest.raises(ValueError, match=r"keep 0.5: logs .*a.log and .*b.log are both seed 7"):
        rt.by_seed([a, b], 0.5)
    with pytest.raises(ValueError, match="no validation loss"):
        rt.run_iterations(_log(tmp_path / "c.log", 7, {}), 1.5)
    (tmp_path / "d.log").write_text(" validation loss at iteration 5 | lm loss value: 1.0E+00 |\n")
    with pytest.raises(ValueError, match="no seed"):
        rt.run_iterations(tmp_path / "d.log", 1.5)


def test_curve_for_takes_the_keep_ratio_or_the_largest_below_what_a_budget_kept() -> None:
    curves = [0.25, 0.5]
    assert rt.curve_for(1.0, 1.0, curves, 0.02) == 1.0
    assert rt.curve_for(0.5, 0.505, curves, 0.02) == 0.5
    assert rt.curve_for(0.75, 0.75, curves, 0.02) is None  # no curve of its own
    assert rt.curve_for(0.5, 0.31, curves, 0.02) == 0.25  # a budget bound: fewer pairs sampled
    assert rt.curve_for(0.5, 0.26, curves, 0.02) == 0.25
    assert rt.curve_for(0.5, 0.20, curves, 0.02) is None  # below every measured ratio
    assert rt.curve_for(1.0, 0.6, curves, 0.02) == 0.5


def _replay(results: dict) -> dict:
    return {"settings": {"trace": {"source": "hand"}}, "results": results}


def _arm(moe_ms: float, kept: float) -> dict:
    return {
        "moe_ms": moe_ms, "kept_fraction": kept, "memory_bytes": 4.0, "network_bytes": 2.0,
        "forward_imbalance": 1.5,
    }


def test_to_target_by_hand() -> None:
    ratios = {
        0.5: rt.IterationRatio(ratio=1.1, per_seed={1: 1.1}, seeds=[1], lower_bound=False),
        0.25: rt.IterationRatio(ratio=1.3, per_seed={1: 1.3}, seeds=[1], lower_bound=True),
    }
    replay = _replay({"8": {
        "stock": _arm(200.0, 1.0),
        "rep2": _arm(100.0, 1.0),
        "keep0.5": _arm(150.0, 0.5),
        "keep0.5+rep2+mem0.8x": _arm(70.0, 0.3),
        "keep0.75": _arm(180.0, 0.75),
    }})
    replicas = rt.replicas_arm(list(replay["results"]["8"]), None)
    assert replicas == "rep2"
    rows = rt.to_target(replay, ratios, replicas, 0.02)["8"]
    assert rows["stock"]["moe_to_target_vs_stock"] == 1.0
    assert rows["stock"]["moe_to_target_vs_replicas"] == pytest.approx(2.0)
    assert rows["rep2"]["moe_to_target_vs_stock"] == pytest.approx(0.5)
    # keep 0.5: 0.75x the MoE time per iteration, 1.1x the iterations.
    assert rows["keep0.5"]["moe_to_target_vs_stock"] == pytest.approx(0.75 * 1.1)
    assert rows["keep0.5"]["moe_to_target_vs_replicas"] == pytest.approx(0.75 * 1.1 / 0.5)
    # The budget kept 0.3: keep 0.25's curve, a lower bound as that curve is.
    budget = rows["keep0.5+rep2+mem0.8x"]
    assert budget["curve_keep"] == 0.25 and budget["lower_bound"]
    assert budget["moe_to_target_vs_stock"] == pytest.approx(0.35 * 1.3)
    assert rows["keep0.75"]["moe_to_target_vs_stock"] is None
    assert "no loss curve of keep 0.75" in rows["keep0.75"]["why_none"]
    text = rt.markdown({
        "settings": {"target": 1.5, "replay": "r.json", "replay_settings": replay["settings"]},
        "runs": {}, "iteration_ratios": {}, "results": {"8": rows},
    })
    row = "| 8 | keep0.5+rep2+mem0.8x | 0.30 | 70.0 | 0.35x | >1.300x (keep 0.25's) | >0.45x |"
    assert row + " >0.91x |" in text
    with pytest.raises(ValueError, match="no 'stock' arm"):
        rt.to_target(_replay({"8": {"rep2": _arm(1.0, 1.0)}}), ratios, None, 0.02)
    with pytest.raises(ValueError, match="--replicas-arm 'rep4' is not an arm"):
        rt.replicas_arm(["stock", "rep2"], "rep4")


def test_main_on_a_replay_the_cli_wrote(tmp_path: Path) -> None:
    replay = tmp_path / "replay.json"
    assert replay_cli.main([
        "--synthetic", "--layers", "2", "--experts", "16", "--topk", "2", "--tokens-per-rank",
        "256", "--ep", "4", "--arms", "stock", "rep2", "keep0.5", "keep0.5+rep2",
        "--out", str(replay),
    ]) == 0
    logs = {
        (keep, seed): _log(tmp_path / f"k{keep}_s{seed}.log", seed, val)
        for keep, seed, val in [
            (1.0, 1, {100: 2.0, 200: 1.0}),  # 1.5 at 150
            (1.0, 2, {100: 1.5}),  # 100
            (0.5, 1, {100: 2.0, 200: 1.5}),  # 200
            (0.5, 2, {100: 1.5}),  # 100
        ]
    }
    out, md = tmp_path / "tt.json", tmp_path / "tt.md"
    result = rt.main([
        "--replay", str(replay), "--target", "1.5",
        "--curve", "1.0", str(logs[1.0, 1]), str(logs[1.0, 2]),
        "--curve", "0.5", str(logs[0.5, 1]), str(logs[0.5, 2]),
        "--out", str(out), "--markdown", str(md),
    ])
    ratios = json.loads(out.read_text())["iteration_ratios"]
    assert ratios["0.5"]["ratio"] == pytest.approx(300 / 250)
    rows = result["results"]["4"]
    measured = json.loads(replay.read_text())["results"]["4"]
    assert rows["keep0.5+rep2"]["moe_to_target_vs_stock"] == pytest.approx(
        1.2 * measured["keep0.5+rep2"]["moe_ms"] / measured["stock"]["moe_ms"]
    )
    assert result["settings"]["replicas_arm"] == "rep2"
    assert "| 0.5 | 2 | 1: 200.0, 2: 100.0 | 1.200 (1: 1.333, 2: 1.000) |" in md.read_text()
    with pytest.raises(SystemExit):
        rt.main(["--replay", str(replay), "--target", "1.5", "--curve", "0.5", str(logs[0.5, 1])])
