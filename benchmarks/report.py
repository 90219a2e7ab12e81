"""Markdown tables from the committed GPU results (``benchmarks/results/``).

    python benchmarks/report.py benchmarks/results/gpu_run2            # layer tables + training
    python benchmarks/report.py benchmarks/results/gpu_run1 --no-train
    python benchmarks/report.py R/gpu_run25/call2/train R/gpu_run20/call5/train --vs-keep1

Layer tables come from ``layer_ep*.json`` (``benchmarks/layer_bench.py``); the training summary
from ``train_*.log`` (``benchmarks/train_compare.sh``): median time per iteration after
warm-up, validation losses, the MoE layers' cumulative time (``--moe-layer-timing``) and the
time to a target validation loss (linear interpolation between evaluations). Several folders
(or ``train_*.log`` files) go into one table, each row named by its folder when there is more
than one. ``--vs-keep1`` adds each run's ratios to the keep-1.0 run of the same seed (both read
from Megatron's argument dump at the top of the log: ``seed``, ``lrmoe``,
``lrmoe_keep_ratio``) and, per keep ratio, the MoE time to the target summed over the seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+) \| consumed samples.*?per iteration \(ms\): ([\d.]+)")
_MOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([\d.]+) ms/iter \| moe layers cumulative: ([\d.]+) s")
_VAL = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")
# Megatron's argument dump: "  name ....... value".
_ARG = re.compile(r"^  (seed|lrmoe|lrmoe_keep_ratio) \.+ (\S+)$", re.MULTILINE)


def layer_table(path: Path) -> str:
    data = json.loads(path.read_text())
    out = [f"`{path}` — EP={data['ep']}, {data['device']}, torch {data['torch']}", ""]
    for tokens in sorted({r["tokens"] for r in data["rows"]}):
        rows = [r for r in data["rows"] if r["tokens"] == tokens]
        floor = next(r for r in rows if r["variant"] == "floor")
        keep1 = next(r for r in rows if r["variant"] == "LRMoE keep 1.0")
        total1 = keep1["fwd_ms"] + keep1["bwd_ms"]
        out += [
            f"**{tokens} tokens/GPU.** Floor {floor['floor_ms']:.2f} ms (grouped GEMMs fwd "
            f"{floor['gemm_fwd_ms']:.2f} + bwd {floor['gemm_bwd_ms']:.2f}, all-to-alls "
            f"{floor['a2a4_ms']:.2f}); keep 1.0 fwd+bwd / floor = "
            f"{total1 / floor['floor_ms']:.2f}.",
            "",
            "| variant | fwd ms | bwd ms | bwd host ms | bwd / keep 1.0 (target) | attainable "
            "| fwd / keep 1.0 | overhead ms | saved MiB | peak MiB | bwd syncs |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["variant"] == "floor":
                continue
            target = r.get("bwd_target")
            ratio = r.get("bwd_vs_keep1")
            ratio_s = "" if ratio is None else f"{ratio:.3f}" + (
                f" ({target:.2f})" if target is not None else ""
            )
            fwd_ratio = r.get("fwd_vs_keep1")
            attainable = r.get("bwd_attainable")
            out.append(
                f"| {r['variant']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
                f"{r['bwd_cpu_ms']:.2f} | {ratio_s} | "
                f"{'' if attainable is None else f'{attainable:.3f}'} | "
                f"{'' if fwd_ratio is None else f'{fwd_ratio:.3f}'} | "
                f"{(r.get('overhead_ms') or 0.0):.2f} | {r['saved_mib']:.0f} | "
                f"{r['peak_mib']:.0f} | {r['bwd_syncs']:.0f} |"
            )
        out.append("")
    return "\n".join(out)


def _crossing(points: list[tuple[int, float]], target: float) -> Optional[float]:
    for (i0, l0), (i1, l1) in zip(points, points[1:]):
        if l1 <= target < l0:
            return i0 + (l0 - target) / (l0 - l1) * (i1 - i0)
    return None


def _at(series: dict[int, float], iteration: float) -> float:
    """Cumulative value of a per-iteration series at a fractional iteration."""
    whole = int(iteration)
    total = sum(v for i, v in series.items() if i <= whole)
    return total + (iteration - whole) * series.get(whole + 1, 0.0)


@dataclass(frozen=True)
class RunStats:
    """One training log's figures (seconds unless named otherwise)."""

    name: str
    seed: Optional[int]
    keep: Optional[float]  # None: stock Megatron (no --lrmoe)
    s_per_iter: float  # median from iteration 20
    val: dict[int, float]
    moe_ms_per_iter: float  # median from iteration 20
    moe_total: float  # cumulative MoE-layer time at the end
    moe_first: float  # iteration 1's MoE-layer time
    cross: Optional[float]  # fractional iteration where validation loss reaches the target
    wall_to_target: Optional[float]
    moe_to_target: Optional[float]  # with iteration 1


def run_stats(log: Path, target: float, name: Optional[str] = None) -> RunStats:
    """The figures of one ``train_*.log`` (``name``: its row label, the file's stem if None;
    a run that stopped before its last iteration, e.g. at a timeout, gets "(stopped at
    iteration I of N)" appended, since its later columns then lack what it did not reach)."""
    text = log.read_text()
    found = _ITER.findall(text)
    iters = {int(i): float(ms) / 1e3 for i, _, ms in found}
    planned = max((int(n) for _, n, _ in found), default=0)
    name = name or log.stem
    if iters and max(iters) < planned:
        name += f" (stopped at iteration {max(iters)} of {planned})"
    moe = {int(i): (float(ms) / 1e3, float(c)) for i, ms, c in _MOE.findall(text)}
    vals = [(int(i), float(v)) for i, v in _VAL.findall(text)]
    args = dict(_ARG.findall(text))
    keep = float(args["lrmoe_keep_ratio"]) if args.get("lrmoe") == "True" else None
    cross = _crossing(vals, target)
    return RunStats(
        name=name,
        seed=int(args["seed"]) if "seed" in args else None,
        keep=keep,
        s_per_iter=statistics.median(s for i, s in iters.items() if i >= 20),
        val=dict(vals),
        moe_ms_per_iter=1e3 * statistics.median(v[0] for i, v in moe.items() if i >= 20),
        moe_total=moe[max(moe)][1] if moe else 0.0,
        moe_first=moe[1][0] if 1 in moe else 0.0,
        cross=cross,
        wall_to_target=None if cross is None else _at(iters, cross),
        moe_to_target=None if cross is None else _at({i: v[0] for i, v in moe.items()}, cross),
    )


def _logs(paths: Sequence[Path]) -> list[tuple[Path, str]]:
    """``train_*.log`` files of the given folders and files, with their row labels."""
    found = []
    for path in paths:
        logs = [path] if path.is_file() else sorted(path.glob("train_*.log"))
        found += [(log, f"{log.parent}/{log.stem}" if len(paths) > 1 else log.stem) for log in logs]
    return found


def train_summary(run: Path | Sequence[Path], target: float) -> str:
    """One row per ``train_*.log``. The MoE layers' cumulative time is also given without
    iteration 1 ("from it 2"), which carries one-off work (Triton compiling into a cold cache,
    allocator warm-up) that depends on what ran before in the same machine, not on the run."""
    out = [
        f"| run | median s/iter (it 20-300) | val loss @150 / @250 / @300 | MoE layers: ms/iter "
        f"(median), cumulative s, from it 2 | iterations, wall s, MoE s (from it 2) to val loss "
        f"{target} |",
        "|---|---|---|---|---|",
    ]
    paths = [run] if isinstance(run, Path) else list(run)
    for log, name in _logs(paths):
        r = run_stats(log, target, name)
        to_target = "not reached"
        if r.cross is not None:
            to_target = (
                f"{r.cross:.1f} it, {r.wall_to_target:.1f} s, {r.moe_to_target:.2f} s "
                f"({r.moe_to_target - r.moe_first:.2f} s)"
            )
        out.append(
            f"| {r.name} | {r.s_per_iter:.3f} | "
            f"{r.val.get(150, float('nan')):.4f} / {r.val.get(250, float('nan')):.4f} / "
            f"{r.val.get(300, float('nan')):.4f} | "
            f"{r.moe_ms_per_iter:.1f}, {r.moe_total:.2f}, {r.moe_total - r.moe_first:.2f} | "
            f"{to_target} |"
        )
    return "\n".join(out)


def versus_keep1(runs: Sequence[RunStats]) -> str:
    """Each LRMoE run against the keep-1.0 run of its seed: the ratios of the MoE layers' time
    per iteration, the iteration's and the MoE time to the target from iteration 2, and the
    last validation loss's difference; then per keep ratio the sums over the runs that reached
    the target in both runs (a seed with several runs at one keep ratio counts its keep-1.0 run
    once per run, and the line says so). A seed with no keep-1.0 run, or with two, is left
    out."""
    base: dict[int, list[RunStats]] = {}
    for r in runs:
        if r.keep == 1.0 and r.seed is not None:
            base.setdefault(r.seed, []).append(r)
    out = [
        "| run | seed | keep | MoE ms/iter | s/iter | last val loss | MoE s to target, from it 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    reached: dict[float, list[tuple[float, float, int]]] = {}  # keep -> (mine, keep 1.0's, seed)
    for r in sorted(runs, key=lambda r: (r.keep or 0.0, r.seed or 0, r.name)):
        ref = base.get(r.seed, [])
        if r.keep is None or r.keep == 1.0 or len(ref) != 1:
            continue
        b = ref[0]
        last = max(set(r.val) & set(b.val), default=None)
        loss = "" if last is None else f"{100 * (r.val[last] / b.val[last] - 1):+.2f} % @{last}"
        moe = ""
        if r.moe_to_target is not None and b.moe_to_target is not None:
            mine, theirs = r.moe_to_target - r.moe_first, b.moe_to_target - b.moe_first
            moe = f"{mine / theirs:.3f}x ({mine:.2f} / {theirs:.2f})"
            reached.setdefault(r.keep, []).append((mine, theirs, r.seed))
        out.append(
            f"| {r.name} | {r.seed} | {r.keep:g} | {r.moe_ms_per_iter / b.moe_ms_per_iter:.3f}x | "
            f"{r.s_per_iter / b.s_per_iter:.3f}x | {loss} | {moe} |"
        )
    out.append("")
    for keep, entries in sorted(reached.items()):
        mine, theirs = sum(e[0] for e in entries), sum(e[1] for e in entries)
        seeds = [e[2] for e in entries]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        again = f"; seed(s) {', '.join(map(str, repeated))} more than once" if repeated else ""
        out.append(
            f"keep {keep:g}: MoE time to target from iteration 2, summed over {len(seeds)} run(s) "
            f"of {len(set(seeds))} seed(s){again}: {mine:.2f} s against keep 1.0's {theirs:.2f} s "
            f"({mine / theirs:.3f}x)"
        )
    for seed, ref in sorted(base.items()):
        if len(ref) > 1:
            out.append(f"seed {seed}: {len(ref)} keep-1.0 runs ({', '.join(r.name for r in ref)}), "
                       "left out")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "run", type=Path, nargs="+", help="benchmarks/results/gpu_run* folders or train_*.log files"
    )
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--target", type=float, default=1.75, help="target validation loss")
    parser.add_argument(
        "--vs-keep1", action="store_true", help="ratios to the keep-1.0 run of the same seed"
    )
    args = parser.parse_args()
    for run in args.run:
        for path in sorted(run.glob("layer_ep*.json")) if run.is_dir() else []:
            print(layer_table(path))
    logs = _logs(args.run)
    if not args.no_train and logs:
        print(train_summary(args.run, args.target))
        if args.vs_keep1:
            print()
            print(versus_keep1([run_stats(log, args.target, name) for log, name in logs]))


if __name__ == "__main__":
    main()
