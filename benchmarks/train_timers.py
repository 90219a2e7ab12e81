"""Where a training iteration goes, from Megatron logs run with ``--timing-log-level 1``.

    python benchmarks/train_timers.py LOG [LOG ...] [--skip 5] [--json OUT.json]

Per log: the median over iterations (after ``--skip`` warm-up iterations) of Megatron's
``elapsed time per iteration``, its ``forward-backward`` and ``optimizer`` timers (and the
optimizer's parts when logged), and LRMoE's ``moe layers`` line (``--moe-layer-timing``: the MoE
layers' forward + backward, CUDA events). The share columns say how much of an iteration each
takes; ``bound`` is the iteration time if the MoE layers cost nothing at all, as a fraction of
the measured one (no change to the MoE layers can beat it).

The timers are host-side (Megatron synchronises the device only at their ends, with the default
``--timing-log-option minmax`` and no barrier), so compare them within one log, and compare logs
of one device call. Works with the logs of ``benchmarks/train_compare.sh`` and
``examples/qwen3_30b_a3b/pretrain.sh`` (pass ``--timing-log-level 1`` as an extra flag).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections import defaultdict

_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*elapsed time per iteration \(ms\): ([0-9.]+)")
_MOE = re.compile(r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([0-9.]+) ms/iter")
_TIMER = re.compile(r"^\s+([a-z][a-z0-9-]*) \.*: \(([0-9.]+), ([0-9.]+)\)")
_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: ([0-9.E+-]+)")


def parse(text: str) -> dict[str, dict[int, float]]:
    """``{series: {iteration: ms}}`` from one log: ``iteration``, ``moe_layers``, ``loss`` and
    every timer name (a timer block belongs to the iteration line printed just before it)."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    current = None
    for line in text.splitlines():
        m = _ITER.search(line)
        if m:
            current = int(m.group(1))
            series["iteration"][current] = float(m.group(2))
            loss = _LOSS.search(line)
            if loss:
                series["loss"][current] = float(loss.group(2))
            continue
        m = _MOE.search(line)
        if m:
            series["moe_layers"][int(m.group(1))] = float(m.group(2))
            continue
        m = _TIMER.match(line)
        if m and current is not None:
            series[m.group(1)][current] = float(m.group(3))  # the max over ranks
    return series


def summarize(series: dict[str, dict[int, float]], skip: int) -> dict[str, float]:
    """Medians over iterations ``> skip`` and the shares of an iteration."""
    out: dict[str, float] = {}
    for name, values in series.items():
        kept = [v for it, v in values.items() if it > skip]
        if kept:
            out[name] = statistics.median(kept)
    out["iterations"] = float(len([it for it in series.get("iteration", {}) if it > skip]))
    total = out.get("iteration")
    if total:
        for name in ("forward-backward", "optimizer", "moe_layers"):
            if name in out:
                out[f"{name}_share"] = out[name] / total
        if "moe_layers" in out:
            out["bound"] = (total - out["moe_layers"]) / total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--skip", type=int, default=5, help="warm-up iterations left out")
    parser.add_argument("--json", default=None, help="also write the summaries here")
    args = parser.parse_args()
    rows = {}
    for path in args.logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            rows[os.path.basename(path)] = summarize(parse(f.read()), args.skip)
    cols = ("iteration", "forward-backward", "optimizer", "moe_layers")
    print(f"{'log':34s} {'its':>4s} " + " ".join(f"{c[:16]:>16s}" for c in cols)
          + f" {'fwd-bwd %':>9s} {'optim %':>8s} {'moe %':>6s} {'bound':>6s}")
    for name, r in rows.items():
        vals = " ".join(f"{r.get(c, float('nan')):16.1f}" for c in cols)
        print(f"{name:34s} {int(r['iterations']):4d} {vals} "
              f"{100 * r.get('forward-backward_share', float('nan')):9.1f} "
              f"{100 * r.get('optimizer_share', float('nan')):8.1f} "
              f"{100 * r.get('moe_layers_share', float('nan')):6.1f} "
              f"{r.get('bound', float('nan')):6.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
