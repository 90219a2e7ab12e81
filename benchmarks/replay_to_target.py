"""MoE-layer time to a target loss at EP 8-64: the replay's time per iteration times the
iterations that real training runs took to reach the target at each keep ratio (issue 37, 3).

    python -m megatron_lrmoe.replay --trace DIR --ep 8 16 32 64 --out replay.json
    python benchmarks/replay_to_target.py --replay replay.json --target 1.75 \\
        --curve 1.0 KEEP1_LOG [KEEP1_LOG ...] --curve 0.5 KEEP05_LOG [...] \\
        [--out to_target.json] [--markdown to_target.md]

The replay prices one training iteration's MoE layers at each EP size (a pass of the recorded
layers); it says nothing of the loss. The logs (``pretrain_lrmoe.py`` at ``--log-interval 1``
with evaluations, e.g. ``benchmarks/train_compare.sh``'s) give, for each keep ratio and seed,
the fractional iteration at which the validation loss first reaches ``--target``
(``train_logs.crossing``). Runs are paired by seed: each keep ratio's iterations are summed
over the seeds that keep 1.0 has too and divided by keep 1.0's sum over the same seeds (the
per-seed ratios give the spread). A run that never reaches the target counts with its last
evaluation's iteration and makes its keep ratio's figure a lower bound (``>``).

Per EP size and arm: the MoE time to the target over stock's is the arm's iteration ratio
(its keep ratio's; 1 for keep 1.0) times its MoE time per iteration over stock's, and likewise
over the replicas-only arm (``--replicas-arm``, default the first arm of keep 1.0 with
replicas). An arm whose kept fraction in the replay is below its keep ratio (a memory or exchange
budget cut further; ``--keep-tolerance``) takes the curve of the largest measured keep ratio at
or below that fraction (fewer pairs sampled: taken to need no fewer iterations); an arm with no
such curve gets no figure.

Assumption, stated in the output: the ratio of iterations to the target between keep ratios
measured on the proxy carries over to the replayed job (the same sampling of pairs per expert
at every EP size; a larger global batch at scale changes the iterations of every arm alike).
Only the MoE layers' time is priced: the rest of the iteration (attention, the output layer,
the optimizer) is the same in every arm and not in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.train_logs import crossing, parse_log  # noqa: E402
from megatron_lrmoe.replay.replay import parse_arm  # noqa: E402

ASSUMPTION = (
    "The ratio of iterations to the target between keep ratios, measured on the proxy's logs, "
    "is taken to hold for the replayed job; only the MoE layers' time is priced."
)


@dataclass(frozen=True)
class RunIterations:
    """One log's iterations to the target.

    Attributes:
        log: The log file.
        seed: Its ``--seed``.
        iteration: The fractional iteration of the crossing, or the last evaluation's iteration
            when the run never reached the target.
        reached: Whether it reached the target.
        final_val: The last validation loss.
    """

    log: str
    seed: int
    iteration: float
    reached: bool
    final_val: float


@dataclass(frozen=True)
class IterationRatio:
    """A keep ratio's iterations to the target over keep 1.0's, paired by seed.

    Attributes:
        ratio: Sum over the paired seeds of its iterations over keep 1.0's sum.
        per_seed: Seed -> its own ratio.
        seeds: The paired seeds.
        lower_bound: Some run of this keep ratio never reached the target (its last evaluation
            stands in): the true ratio is above ``ratio``.
    """

    ratio: float
    per_seed: dict[int, float]
    seeds: list[int]
    lower_bound: bool


def run_iterations(log: str | Path, target: float) -> RunIterations:
    """Iterations to ``target`` of one log.

    Raises:
        ValueError: The log has no evaluation or no ``--seed`` in its argument dump.
    """
    run = parse_log(log)
    if not run.val:
        raise ValueError(
            f"{log}: no validation loss in the log; the curves need runs with evaluations "
            "(--eval-interval) at --log-interval 1"
        )
    seed = run.seed()
    if seed is None:
        raise ValueError(f"{log}: no seed in the argument dump; pass logs of pretrain_lrmoe.py")
    at = crossing(list(run.val.items()), target)
    last = max(run.val)
    return RunIterations(
        log=str(log),
        seed=seed,
        iteration=at if at is not None else float(last),
        reached=at is not None,
        final_val=run.val[last],
    )


def by_seed(runs: Sequence[RunIterations], keep: float) -> dict[int, RunIterations]:
    """``runs`` of one keep ratio by seed.

    Raises:
        ValueError: Two logs of one seed (name the one to use).
    """
    out: dict[int, RunIterations] = {}
    for run in runs:
        if run.seed in out:
            raise ValueError(
                f"keep {keep}: logs {out[run.seed].log} and {run.log} are both seed {run.seed}; "
                "pass one log per seed and keep ratio"
            )
        out[run.seed] = run
    return out


def iteration_ratio(
    runs: dict[int, RunIterations], baseline: dict[int, RunIterations]
) -> Optional[IterationRatio]:
    """``runs`` over ``baseline`` (keep 1.0) over their common seeds; None without one, or when
    a baseline run of those seeds never reached the target (nothing to divide by)."""
    seeds = sorted(set(runs) & set(baseline))
    if not seeds or not all(baseline[s].reached for s in seeds):
        return None
    total = sum(runs[s].iteration for s in seeds) / sum(baseline[s].iteration for s in seeds)
    return IterationRatio(
        ratio=total,
        per_seed={s: runs[s].iteration / baseline[s].iteration for s in seeds},
        seeds=seeds,
        lower_bound=not all(runs[s].reached for s in seeds),
    )


def replicas_arm(arms: Sequence[str], named: Optional[str]) -> Optional[str]:
    """The replicas-only arm: ``named`` (must be an arm of the replay), else the first arm of
    keep 1.0 with replicas and no budget."""
    if named is not None:
        if named not in arms:
            raise ValueError(f"--replicas-arm {named!r} is not an arm of the replay: {list(arms)}")
        return named
    for name in arms:
        arm = parse_arm(name)
        if (
            not arm.stock
            and arm.keep_ratio == 1.0
            and arm.max_replicas_per_rank > 0
            and arm.memory_budget is None
            and arm.exchange_budget is None
        ):
            return name
    return None


def curve_for(
    keep: float, kept: float, curves: Sequence[float], tolerance: float
) -> Optional[float]:
    """The keep ratio whose loss curve an arm of keep ratio ``keep`` that kept ``kept`` of its
    pairs in the replay takes: ``keep`` itself when ``kept`` is within ``tolerance`` of it
    (1.0 needs no curve), else (a budget cut the kept pairs further) the largest ratio with a
    curve at or below ``kept`` (+ ``tolerance``): a run that sampled fewer pairs, taken to need
    no fewer iterations. None when there is none."""
    if abs(kept - keep) <= tolerance:
        return keep if keep == 1.0 or keep in curves else None
    below = [c for c in curves if c <= kept + tolerance]
    return max(below) if below else None


def to_target(
    replay: dict,
    ratios: dict[float, IterationRatio],
    replicas: Optional[str],
    keep_tolerance: float,
) -> dict[str, dict[str, dict]]:
    """Per EP size and arm of ``replay`` (the replay CLI's JSON): MoE time per iteration, the
    iteration ratio used and the MoE time to the target over stock and over ``replicas``.

    Raises:
        ValueError: The replay has no ``stock`` arm.
    """
    out: dict[str, dict[str, dict]] = {}
    for ep, arms in replay["results"].items():
        if "stock" not in arms:
            raise ValueError(
                f"the replay at EP {ep} has no 'stock' arm; replay with --arms stock ..."
            )
        stock_ms = arms["stock"]["moe_ms"]
        rows: dict[str, dict] = {}
        for name, res in arms.items():
            arm = parse_arm(name)
            keep = 1.0 if arm.stock else arm.keep_ratio
            kept = res["kept_fraction"]
            row = {
                "moe_ms": res["moe_ms"],
                "moe_ms_vs_stock": res["moe_ms"] / stock_ms,
                "memory_bytes_vs_stock": res["memory_bytes"] / arms["stock"]["memory_bytes"],
                "network_bytes_vs_stock": res["network_bytes"] / arms["stock"]["network_bytes"],
                "forward_imbalance": res["forward_imbalance"],
                "keep_ratio": keep,
                "kept_fraction": kept,
                "iterations_vs_keep1": None,
                "lower_bound": False,
                "moe_to_target_vs_stock": None,
                "why_none": None,
            }
            curve = curve_for(keep, kept, sorted(ratios), keep_tolerance)
            row["curve_keep"] = curve
            if curve == 1.0:
                row["iterations_vs_keep1"] = 1.0
            elif curve is not None:
                row["iterations_vs_keep1"] = ratios[curve].ratio
                row["lower_bound"] = ratios[curve].lower_bound
            elif abs(kept - keep) > keep_tolerance:
                row["why_none"] = (
                    f"kept {kept:.3f} of the pairs, below every keep ratio with a curve"
                )
            else:
                row["why_none"] = f"no loss curve of keep {keep} (pass --curve {keep} LOG ...)"
            if row["iterations_vs_keep1"] is not None:
                row["moe_to_target_vs_stock"] = row["iterations_vs_keep1"] * row["moe_ms_vs_stock"]
            rows[name] = row
        if replicas is not None and rows[replicas]["moe_to_target_vs_stock"] is not None:
            base = rows[replicas]["moe_to_target_vs_stock"]
            for row in rows.values():
                value = row["moe_to_target_vs_stock"]
                row["moe_to_target_vs_replicas"] = value / base if value is not None else None
        out[ep] = rows
    return out


def markdown(result: dict) -> str:
    """The tables of :func:`main`'s JSON."""
    s = result["settings"]
    lines = [
        f"Target validation loss {s['target']}; replay `{s['replay']}` "
        f"({s['replay_settings'].get('trace', {}).get('source', '?')}). {ASSUMPTION}",
        "",
        "| keep | seeds | iterations to target (per seed) | over keep 1.0 (per seed) |",
        "|---|---|---|---|",
    ]
    for keep, runs in sorted(result["runs"].items(), key=lambda kv: -float(kv[0])):
        ratio = result["iteration_ratios"].get(keep)
        its = ", ".join(
            f"{r['seed']}: {r['iteration']:.1f}" + ("" if r["reached"] else " (not reached)")
            for r in runs
        )
        if ratio is None:
            rel = "-" if float(keep) == 1.0 else "no paired keep 1.0 run"
        else:
            sign = ">" if ratio["lower_bound"] else ""
            per = ", ".join(f"{sd}: {v:.3f}" for sd, v in ratio["per_seed"].items())
            rel = f"{sign}{ratio['ratio']:.3f} ({per})"
        lines.append(f"| {keep} | {len(runs)} | {its} | {rel} |")
    lines += [
        "",
        "| EP | arm | kept | MoE ms/iter | vs stock | iterations vs keep 1.0 "
        "| MoE time to target vs stock | vs replicas only |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ep, rows in result["results"].items():
        for name, row in rows.items():
            its = row["iterations_vs_keep1"]
            sign = ">" if row["lower_bound"] else ""
            to_t = row["moe_to_target_vs_stock"]
            vs_rep = row.get("moe_to_target_vs_replicas")
            curve = row["curve_keep"]
            whose = f" (keep {curve}'s)" if curve is not None and curve != row["keep_ratio"] else ""
            lines.append(
                f"| {ep} | {name} | {row['kept_fraction']:.2f} | {row['moe_ms']:.1f} | "
                f"{row['moe_ms_vs_stock']:.2f}x | "
                + (f"{sign}{its:.3f}x{whose}" if its is not None else "-")
                + " | "
                + (f"{sign}{to_t:.2f}x" if to_t is not None else f"- ({row['why_none']})")
                + " | "
                + (f"{sign}{vs_rep:.2f}x" if vs_rep is not None else "-")
                + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replay", required=True, type=Path, help="the replay's JSON (--out)")
    p.add_argument("--target", required=True, type=float, help="target validation loss")
    p.add_argument(
        "--curve",
        nargs="+",
        action="append",
        required=True,
        metavar="KEEP LOG",
        help="a keep ratio and its runs' logs, one per seed (repeat per keep ratio; 1.0 needed)",
    )
    p.add_argument("--replicas-arm", default=None, help="the replicas-only baseline arm")
    p.add_argument("--keep-tolerance", type=float, default=0.02)
    p.add_argument("--out", type=Path, default=None, help="JSON (default: print it)")
    p.add_argument("--markdown", type=Path, default=None, help="the tables as Markdown")
    args = p.parse_args(argv)

    curves: dict[float, dict[int, RunIterations]] = {}
    for item in args.curve:
        if len(item) < 2:
            p.error(f"--curve {' '.join(item)}: give a keep ratio and at least one log")
        try:
            keep = float(item[0])
        except ValueError:
            p.error(f"--curve {item[0]!r}: the first value is the keep ratio (--curve 0.5 LOG)")
        if keep in curves:
            p.error(f"--curve {keep} given twice; list all its logs after one --curve")
        curves[keep] = by_seed([run_iterations(log, args.target) for log in item[1:]], keep)
    if 1.0 not in curves:
        p.error("no --curve 1.0: the ratios are to keep 1.0's runs of the same seeds")
    ratios = {
        keep: r
        for keep, runs in curves.items()
        if keep != 1.0 and (r := iteration_ratio(runs, curves[1.0])) is not None
    }
    replay = json.loads(args.replay.read_text())
    first_ep = next(iter(replay["results"].values()))
    result = {
        "settings": {
            "target": args.target,
            "replay": str(args.replay),
            "replay_settings": replay.get("settings", {}),
            "keep_tolerance": args.keep_tolerance,
            "replicas_arm": replicas_arm(list(first_ep), args.replicas_arm),
            "assumption": ASSUMPTION,
        },
        "runs": {str(k): [asdict(r) for r in v.values()] for k, v in curves.items()},
        "iteration_ratios": {str(k): asdict(r) for k, r in ratios.items()},
    }
    result["results"] = to_target(
        replay, ratios, result["settings"]["replicas_arm"], args.keep_tolerance
    )
    text = json.dumps(result, indent=1, sort_keys=False)
    if args.out is not None:
        args.out.write_text(text + "\n")
    else:
        print(text)
    if args.markdown is not None:
        args.markdown.write_text(markdown(result))
    return result


if __name__ == "__main__":
    main()
