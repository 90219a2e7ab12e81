"""``benchmarks/replay_trace_check.py``: a trace set against the log of the run that recorded it
(the arm and micro-batches from the argument dump, the passes of the measured iterations, the
replay's time per pass times the micro-batches), and its refusals of a trace that does not fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import replay_trace_check as rc
from benchmarks.train_logs import parse_log
from megatron_lrmoe.observe.trace import write_trace
from megatron_lrmoe.replay import cli as replay_cli
from megatron_lrmoe.replay.shard import synthetic_counts

LAYERS, EXPERTS, TOKENS, TOPK = 2, 16, 512, 2


def _log(path: Path, iters: int, moe_ms: dict[int, float], **args: str) -> Path:
    dump = {
        "lrmoe": "True", "lrmoe_keep_ratio": "0.5", "lrmoe_activation_mode": "save",
        "lrmoe_max_replicas_per_rank": "None", "global_batch_size": "8",
        "micro_batch_size": "2", "data_parallel_size": "2", "expert_model_parallel_size": "1",
        **args,
    }
    lines = [f"  {k} {'.' * (48 - len(k))} {v}" for k, v in dump.items()]
    for i in range(1, iters + 1):
        lines.append(
            f" [t] iteration {i:8d}/{iters:8d} | consumed samples: {8 * i} | elapsed time per "
            "iteration (ms): 100.0 | lm loss: 1.0E+00 |"
        )
        lines.append(
            f" [t] iteration {i:8d}/{iters:8d} | moe layers: {moe_ms.get(i, 10.0):.1f} ms/iter | "
            "moe layers cumulative: 1.0 s |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _trace(path: Path, passes: int, every: int = 1) -> Path:
    counts = np.concatenate(
        [synthetic_counts(LAYERS, 1, EXPERTS, TOKENS, TOPK, zipf=0.5, seed=k)
         for k in range(passes)]
    )
    write_trace(
        path, counts, layers=list(range(1, LAYERS + 1)) * passes,
        calls=[k for k in range(passes) for _ in range(LAYERS)],
        meta={"topk": TOPK, "hidden_size": 64, "ffn_hidden_size": 32, "every": every},
    )  # fmt: skip
    return path


def test_arm_and_micro_batches_come_from_the_argument_dump(tmp_path: Path) -> None:
    run = parse_log(_log(tmp_path / "a.log", 1, {}))
    assert rc.run_arm(run) == "keep0.5" and rc.micro_batches(run) == 2  # 8 / (2 x DP 2)
    lean = parse_log(_log(tmp_path / "b.log", 1, {}, lrmoe_activation_mode="lean",
                          lrmoe_keep_ratio="0.25"))  # fmt: skip
    assert rc.run_arm(lean) == "keep0.25+lean"
    rep = parse_log(_log(tmp_path / "c.log", 1, {}, lrmoe_max_replicas_per_rank="2",
                         lrmoe_keep_ratio="1.0"))  # fmt: skip
    assert rc.run_arm(rep) == "keep1+rep2"
    with pytest.raises(ValueError, match="not an LRMoE run"):
        rc.run_arm(parse_log(_log(tmp_path / "d.log", 1, {}, lrmoe="False")))
    with pytest.raises(ValueError, match="fixed keep ratio"):
        rc.run_arm(parse_log(_log(tmp_path / "e.log", 1, {}, lrmoe_keep_ratio="auto")))
    with pytest.raises(ValueError, match="not a multiple"):
        rc.micro_batches(parse_log(_log(tmp_path / "f.log", 1, {}, global_batch_size="6")))


def test_check_prices_the_measured_iterations_passes(tmp_path: Path) -> None:
    # 4 iterations of 2 micro-batches: 8 passes; --skip 1 leaves iterations 2-4, passes 2-7,
    # and a ninth pass of a run stopped inside iteration 5 is not replayed.
    log = _log(tmp_path / "run.log", 4, {1: 500.0, 2: 11.0, 3: 13.0, 4: 12.0})
    trace = _trace(tmp_path / "trace", 9)
    result = rc.check(trace, log, skip=1)
    assert result["arm"] == "keep0.5" and result["passes_replayed"] == 6
    assert result["measured_moe_ms_per_iter"] == 12.0  # median of 11, 13, 12
    direct = replay_cli.run(replay_cli.build_parser().parse_args([
        "--trace", str(trace), "--ep", "1", "--arms", "stock", "keep0.5",
        "--first", "2", "--passes", "6", "--out", "",
    ]))["results"]["1"]["keep0.5"]  # fmt: skip
    assert result["predicted_moe_ms_per_iter"] == pytest.approx(2 * direct["moe_ms"])
    assert result["error"] == pytest.approx(result["predicted_moe_ms_per_iter"] / 12.0 - 1)
    assert sum(result["predicted_phase_ms_per_iter"].values()) == pytest.approx(
        result["predicted_moe_ms_per_iter"]
    )


def test_check_refuses_a_trace_of_another_run(tmp_path: Path) -> None:
    log = _log(tmp_path / "run.log", 4, {})
    with pytest.raises(ValueError, match="5 passes recorded; the log's 4 iterations"):
        rc.check(_trace(tmp_path / "short", 5), log, skip=1)
    with pytest.raises(ValueError, match="11 passes recorded"):
        rc.check(_trace(tmp_path / "long", 11), log, skip=1)
    with pytest.raises(ValueError, match="recorded every 2 calls"):
        rc.check(_trace(tmp_path / "every", 8, every=2), log, skip=1)
    with pytest.raises(ValueError, match="no MoE-layer times after iteration 4"):
        rc.check(_trace(tmp_path / "ok", 8), log, skip=4)
    with pytest.raises(ValueError, match="recorded at EP 1, the log's run at EP 2"):
        rc.check(_trace(tmp_path / "ep", 8), _log(tmp_path / "ep2.log", 4, {},
                 expert_model_parallel_size="2"), skip=1)  # fmt: skip
