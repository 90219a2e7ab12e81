"""Markdown tables from the committed GPU results (``benchmarks/results/``).

    python benchmarks/report.py benchmarks/results/gpu_run2            # layer tables + training
    python benchmarks/report.py benchmarks/results/gpu_run1 --no-train

Layer tables come from ``layer_ep*.json`` (``benchmarks/layer_bench.py``); the training summary
from ``train_*.log`` (``benchmarks/train_compare.sh``): median time per iteration after
warm-up, validation losses, the MoE layers' cumulative time (``--moe-layer-timing``) and the
time to a target validation loss (linear interpolation between evaluations).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Optional

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples.*?per iteration \(ms\): ([\d.]+)")
_MOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([\d.]+) ms/iter \| moe layers cumulative: ([\d.]+) s")
_VAL = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")


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


def train_summary(run: Path, target: float) -> str:
    """One row per ``train_*.log``. The MoE layers' cumulative time is also given without
    iteration 1 ("from it 2"), which carries one-off work (Triton compiling into a cold cache,
    allocator warm-up) that depends on what ran before in the same machine, not on the run."""
    out = [
        f"| run | median s/iter (it 20-300) | val loss @150 / @250 / @300 | MoE layers: ms/iter "
        f"(median), cumulative s, from it 2 | iterations, wall s, MoE s (from it 2) to val loss "
        f"{target} |",
        "|---|---|---|---|---|",
    ]
    for log in sorted(run.glob("train_*.log")):
        text = log.read_text()
        iters = {int(i): float(ms) / 1e3 for i, ms in _ITER.findall(text)}
        moe = {int(i): (float(ms) / 1e3, float(c)) for i, ms, c in _MOE.findall(text)}
        vals = [(int(i), float(v)) for i, v in _VAL.findall(text)]
        vals_by = dict(vals)
        steady = [s for i, s in iters.items() if i >= 20]
        cross = _crossing(vals, target)
        to_target = "not reached"
        first = moe[1][0] if 1 in moe else 0.0
        if cross is not None:
            wall = _at(iters, cross)
            moe_s = _at({i: v[0] for i, v in moe.items()}, cross)
            to_target = f"{cross:.1f} it, {wall:.1f} s, {moe_s:.2f} s ({moe_s - first:.2f} s)"
        last = moe[max(moe)] if moe else (0.0, 0.0)
        out.append(
            f"| {log.stem} | {statistics.median(steady):.3f} | "
            f"{vals_by.get(150, float('nan')):.4f} / {vals_by.get(250, float('nan')):.4f} / "
            f"{vals_by.get(300, float('nan')):.4f} | "
            f"{1e3 * statistics.median(v[0] for i, v in moe.items() if i >= 20):.1f}, "
            f"{last[1]:.2f}, {last[1] - first:.2f} | {to_target} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("run", type=Path, help="a benchmarks/results/gpu_run* folder")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--target", type=float, default=1.75, help="target validation loss")
    args = parser.parse_args()
    for path in sorted(args.run.glob("layer_ep*.json")):
        print(layer_table(path))
    if not args.no_train and list(args.run.glob("train_*.log")):
        print(train_summary(args.run, args.target))


if __name__ == "__main__":
    main()
