"""Loss-vs-time plot and time-to-target table from Megatron pretraining logs.

    python benchmarks/plot_training.py --target 2.6 --out docs/proxy_loss_vs_time.png \\
        stock=qwen_stock.log "keep 1.0=qwen_k1.0.log" ...

Each log is a ``pretrain_lrmoe.py`` / Megatron log with ``--log-interval 1``; time is the sum of
Megatron's "elapsed time per iteration" (the first iteration, which includes start-up work, is
counted too). Time to target: the first iteration whose training loss, averaged over a window of
``--window`` iterations, is at or below ``--target``.
"""

from __future__ import annotations

import argparse
import re

_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|.*?"
    r"lm loss: ([\d.E+-]+)"
)
_VAL = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")


def parse(path: str) -> tuple[list[int], list[float], list[float], dict[int, float]]:
    """(iterations, cumulative seconds, training losses, {iteration: validation loss})."""
    its, secs, losses, val = [], [], [], {}
    total = 0.0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _LINE.search(line)
            if m:
                total += float(m.group(2)) / 1e3
                its.append(int(m.group(1)))
                secs.append(total)
                losses.append(float(m.group(3)))
                continue
            v = _VAL.search(line)
            if v and "on validation set" not in line:
                val[int(v.group(1))] = float(v.group(2))
    return its, secs, losses, val


def time_to_target(its, secs, losses, target: float, window: int):
    for i in range(window - 1, len(losses)):
        if sum(losses[i - window + 1 : i + 1]) / window <= target:
            return its[i], secs[i]
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("runs", nargs="+", help="label=path")
    parser.add_argument("--target", type=float, required=True)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    print("| run | s/iter (median, it 10-100) | time to train loss <= "
          f"{args.target} ({args.window}-it mean) | iterations | final train loss | val loss @50 | val loss @100 |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.runs:
        label, path = spec.split("=", 1)
        its, secs, losses, val = parse(path)
        per_it = sorted(b - a for a, b in zip(secs[9:], secs[10:]))
        med = per_it[len(per_it) // 2] if per_it else float("nan")
        it_t, t_t = time_to_target(its, secs, losses, args.target, args.window)
        reached = f"{t_t:.1f} s" if t_t is not None else "not reached"
        print(f"| {label} | {med:.3f} | {reached} | {it_t or '-'} | {losses[-1]:.3f} | "
              f"{val.get(50, float('nan')):.3f} | {val.get(100, float('nan')):.3f} |")
        ax.plot(secs, losses, label=label, linewidth=1.2)
    ax.axhline(args.target, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("training time (s, sum of Megatron's per-iteration times)")
    ax.set_ylabel("training lm loss")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
