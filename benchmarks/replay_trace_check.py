"""The replay against the run it replays: a routing trace recorded in training
(``--lrmoe-trace-dir``) priced at the run's own EP size, set against the MoE-layer time the same
run measured (``--moe-layer-timing``). CPU; the check issue 37's validation still lacks.

    python benchmarks/replay_trace_check.py --trace DIR --log LOG [--skip 5]
        [--gemm-table FILE] [--costs FILE|none] [--out check.json]

From the log's argument dump: the arm (``keepR``, with ``+recompute`` / ``+lean`` / ``+auto``
and ``+repN`` as the run was set), the micro-batches per iteration (global batch over micro
batch times data-parallel size) and the recorded EP size. The trace's calls are grouped into
passes (one micro-batch through every recorded layer, ``RoutingTrace.passes``); the passes of
iterations ``--skip`` and earlier are left out (compilation, CUDA-graph capture and the
allocator's warm-up), as are the iterations' measured times. Predicted MoE time per iteration:
the replay's mean per pass times the micro-batches per iteration. Measured: the median of the
log's ``moe layers: X ms/iter`` over the same iterations. The error is predicted / measured - 1.

The trace must come from the run whose log is given (the check refuses a trace whose recorded
EP size, layer shape or call count does not fit the log).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.train_logs import RunLog, parse_log  # noqa: E402
from megatron_lrmoe.observe.trace import read_trace  # noqa: E402
from megatron_lrmoe.replay import cli as replay_cli  # noqa: E402


def run_arm(run: RunLog) -> str:
    """The replay arm a logged run was set as.

    Raises:
        ValueError: The run did not use LRMoE (no trace can come from it), or an argument the
            arm needs is missing from the dump.
    """
    if run.args.get("lrmoe") != "True":
        raise ValueError(f"{run.path}: not an LRMoE run (--lrmoe); its routing has no trace")
    keep = run.args.get("lrmoe_keep_ratio")
    if keep is None or keep == "auto":
        raise ValueError(
            f"{run.path}: keep ratio {keep!r}; the check replays a fixed keep ratio"
        )
    arm = [f"keep{float(keep):g}"]
    mode = run.args.get("lrmoe_activation_mode", "save")
    if mode not in ("save", "None"):
        arm.append(mode)
    replicas = run.args.get("lrmoe_max_replicas_per_rank", "None")
    if replicas not in ("None", "0"):
        arm.append(f"rep{int(replicas)}")
    return "+".join(arm)


def micro_batches(run: RunLog) -> int:
    """Micro-batches each rank runs per iteration (global batch / (micro batch x DP)).

    Raises:
        ValueError: The dump lacks a batch size, or they do not divide.
    """
    try:
        gbs, mbs = int(run.args["global_batch_size"]), int(run.args["micro_batch_size"])
        dp = int(run.args.get("data_parallel_size", "1"))
    except KeyError as e:
        raise ValueError(f"{run.path}: no {e.args[0]} in the argument dump") from None
    if gbs % (mbs * dp):
        raise ValueError(f"{run.path}: global batch {gbs} is not a multiple of {mbs} x DP {dp}")
    return gbs // (mbs * dp)


def check(
    trace: Path,
    log: Path,
    skip: int,
    gemm_table: Optional[str] = None,
    costs: Optional[str] = None,
) -> dict:
    """Measured against predicted MoE-layer time per iteration (see the module docstring).

    Raises:
        ValueError: The trace and the log do not belong together, or nothing is left after
            ``skip``.
    """
    run = parse_log(log)
    arm, per_iter = run_arm(run), micro_batches(run)
    recorded = read_trace(trace)
    if int(recorded.meta.get("every", 1)) != 1:
        raise ValueError(
            f"{trace}: recorded every {recorded.meta['every']} calls; the check needs every call "
            "(the passes of each iteration)"
        )
    passes = len(list(recorded.passes()))
    iterations = sorted(i for i in run.moe_ms if i > skip)
    if not iterations:
        raise ValueError(f"{log}: no MoE-layer times after iteration {skip} (lower --skip)")
    # Pass k is micro-batch k of the run; iteration i's are (i - 1) * M .. i * M - 1. A run
    # stopped inside an iteration may have recorded part of the next: not replayed.
    first, end = skip * per_iter, iterations[-1] * per_iter
    if passes < end or passes > end + per_iter:
        raise ValueError(
            f"{trace}: {passes} passes recorded; the log's {iterations[-1]} iterations of "
            f"{per_iter} micro-batches need {end} (up to {end + per_iter} for a run stopped "
            "inside an iteration): a trace of another run?"
        )
    ep = int(recorded.meta["ep_size"])
    if ep != int(run.args.get("expert_model_parallel_size", ep)):
        raise ValueError(f"{trace}: recorded at EP {ep}, the log's run at EP "
                         f"{run.args['expert_model_parallel_size']}")
    argv = ["--trace", str(trace), "--ep", str(ep), "--arms", "stock", arm,
            "--first", str(first), "--passes", str(end - first), "--out", ""]
    argv += ["--gemm-table", gemm_table] if gemm_table else []
    argv += ["--costs", costs] if costs else []
    payload = replay_cli.run(replay_cli.build_parser().parse_args(argv))
    row = payload["results"][str(ep)][arm]
    measured = statistics.median(run.moe_ms[i] for i in iterations)
    predicted = row["moe_ms"] * per_iter
    return {
        "trace": str(trace),
        "log": str(log),
        "arm": arm,
        "ep": ep,
        "micro_batches_per_iteration": per_iter,
        "passes_replayed": end - first,
        "iterations_measured": len(iterations),
        "skip": skip,
        "measured_moe_ms_per_iter": measured,
        "predicted_moe_ms_per_iter": predicted,
        "error": predicted / measured - 1,
        "predicted_phase_ms_per_iter": {k: v * per_iter for k, v in row["phase_ms"].items()},
        "replay_settings": payload["settings"],
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", required=True, type=Path, help="the run's --lrmoe-trace-dir")
    p.add_argument("--log", required=True, type=Path, help="the same run's log")
    p.add_argument("--skip", type=int, default=5, help="iterations left out at the start")
    p.add_argument("--gemm-table", default=None, help="GEMM table JSON (gemm_table.py)")
    p.add_argument("--costs", default=None, metavar="FILE|none", help="as the replay's")
    p.add_argument("--out", type=Path, default=None, help="JSON (default: print it)")
    args = p.parse_args(argv)
    try:
        result = check(args.trace, args.log, args.skip, args.gemm_table, args.costs)
    except ValueError as e:
        p.error(str(e))
    print(
        f"{result['arm']} at EP {result['ep']}: MoE layers {result['measured_moe_ms_per_iter']:.1f}"
        f" ms/iter measured, {result['predicted_moe_ms_per_iter']:.1f} predicted "
        f"({result['error']:+.1%}; {result['iterations_measured']} iterations, "
        f"{result['passes_replayed']} passes)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
