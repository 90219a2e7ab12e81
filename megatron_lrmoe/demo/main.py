"""``lrmoe-demo``: stock Megatron MoE against LRMoE on a tiny Qwen3-style MoE GPT, on CPU.

Two gloo ranks (EP=2) train the same model from the same initial weights on the same byte-level
text (the Python standard library's own sources, see :mod:`megatron_lrmoe.demo.trainer`), once
with Megatron's stock ``MoELayer`` and once with ``LRMoELayer`` at the chosen keep ratio. The
demo prints progress, then a table (steps and wall time to a target validation loss, final loss,
cumulative MoE-layer time, backward exchange bytes), and writes ``loss_vs_time.png`` and
``results.json`` into ``--out-dir``.

How things are measured:

* Wall time is each rank's training time (forward, backward, optimizer step); evaluation and
  logging are excluded. Values are means over the two ranks.
* MoE-layer time is wall clock inside every ``MoELayer`` (forward: forward pre-hook to forward
  hook; backward: full backward pre-hook to full backward hook), LRMoE's scoring, selection,
  packing and exchanges included (:class:`megatron_lrmoe.demo.trainer.MoELayerProbe`).
* Backward bytes are the bytes a rank sends in the MoE layers' backward exchanges per step:
  ``last_call_stats.backward_bytes`` for LRMoE, the alltoall dispatcher's splits for stock.
* The target loss, unless ``--target-loss`` is given, is the stock run's validation loss at the
  evaluation nearest 3/4 of its steps: stock reaches it by construction at that point, and the
  table shows when LRMoE does (or that it does not). Steps and times to the target are where the
  validation curve crosses it, linearly interpolated between the two evaluations around the
  crossing.

The two runs share one pair of processes and alternate step by step (a stock step, then an
LRMoE step), so process start-up is paid once and changes in machine load affect both runs
alike; each run has its own model, optimizer and data stream, built from the same seed (runs do
not share random state: dropout is 0 and LRMoE's sampling stream is its own). Timings on a
shared 2-core machine are still noisy: compare cumulative times, not single steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional, Sequence

from megatron_lrmoe.config import ACTIVATION_MODES, SCOPES, SELECTIONS, LRMoEConfig

WORLD_SIZE = 2  # ranks = expert-parallel size
RUN_NAMES = ("stock", "lrmoe")
TARGET_FRACTION = 0.75  # default target: stock's validation loss at 3/4 of its steps

# Hidden unless --verbose: warnings that only say what this CPU machine lacks (CUDA, Transformer
# Engine, Apex, absl), or that megatron-core and torch print on their own defaults. Message
# prefixes, matched like Python's -W option matches them (start of the message, any case), so
# every other warning still shows.
ENVIRONMENT_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "Only transformer-engine>=1.7.0 supports MoE experts",
    "absl.logging is not installed",
    "The following imports from `dynamic_context.py` will be removed",
    "Could not determine rank from torch.distributed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
    # torch 2.14 on megatron_lrmoe.dispatch.comm's count exchange; --verbose shows it.
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    # A SyntaxWarning of megatron-core 0.19.2's docstrings, where its sources are compiled on
    # import (installed with pip --no-compile, as on the project's GPU host, or not writable).
    "invalid escape sequence",
)
# torch's CUDA wheels log "No CUDA runtime is found" from this logger when it is imported.
QUIET_TORCH_LOGGERS = ("torch.utils.cpp_extension",)


@dataclass(frozen=True)
class DemoPlan:
    """Everything the ranks need (picklable)."""

    shape: dict
    settings: dict
    lrmoe: LRMoEConfig
    corpus_train_bytes: int
    corpus_valid_bytes: int
    verbose: bool


def _shape_and_settings(quick: bool, steps: Optional[int], seed: int) -> tuple[dict, dict]:
    if quick:
        shape = dict(
            num_layers=2, hidden_size=64, kv_channels=16, moe_ffn_hidden_size=64, seq_length=64
        )
        settings = dict(steps=12, micro_batch_size=4, eval_interval=3, eval_batches=1)
    else:
        shape = dict(
            num_layers=2, hidden_size=128, kv_channels=32, moe_ffn_hidden_size=256, seq_length=256
        )
        settings = dict(steps=200, micro_batch_size=8, eval_interval=10, eval_batches=4)
    if steps is not None:
        settings["steps"] = steps
    settings["seed"] = seed
    settings["eval_interval"] = min(settings["eval_interval"], settings["steps"])
    return shape, settings


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    parser = argparse.ArgumentParser(
        prog="lrmoe-demo",
        description=(
            "Train a tiny Qwen3-style MoE GPT (RMSNorm, QK-norm, RoPE, GQA, SwiGLU experts, "
            "softmax top-k router with normalised probabilities, aux loss) on 2 CPU processes "
            "(gloo, expert parallel 2) twice, stock Megatron-Core MoE and LRMoE, on byte-level "
            "text of the Python standard library's sources (no download). Prints a comparison "
            "table and writes loss_vs_time.png and results.json."
        ),
    )
    parser.add_argument(
        "--keep-ratio",
        type=float,
        default=0.5,
        help="fraction of each expert's token-expert pairs kept in the LRMoE backward "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--selection",
        choices=SELECTIONS,
        default="sample",
        help="which pairs LRMoE keeps (default %(default)s)",
    )
    parser.add_argument(
        "--scope",
        choices=SCOPES,
        default="local",
        help="select per source rank or per expert (default %(default)s)",
    )
    parser.add_argument(
        "--activation-mode",
        choices=ACTIVATION_MODES,
        default="save",
        help="what the expert side keeps for backward (default %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per run (default 200; --quick 12)"
    )
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help=(
            "validation loss to measure steps and time to; default: the stock run's validation "
            "loss at the evaluation nearest 3/4 of its steps"
        ),
    )
    parser.add_argument(
        "--out-dir",
        # runs/ is git-ignored; scripts/demo.sh runs from the repository root.
        default=os.path.join("runs", "lrmoe-demo"),
        help="where loss_vs_time.png and results.json go (default %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smaller model and 12 steps (well under a minute; what the tests run)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="seeds weights, data order and sampling (default %(default)s)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=(
            "show the warnings about what this machine lacks (CUDA, Transformer Engine, Apex) "
            "and Megatron's log messages, which are hidden by default"
        ),
    )
    return parser


# ------------------------------------------------------------------------------------------------
# Ranks.
# ------------------------------------------------------------------------------------------------
def _quiet() -> None:
    """Hide Megatron's per-model log lines in a rank (the demo prints its own progress).

    Import-time warnings are hidden before this runs, by the environment that
    :func:`_quiet_environment` gives the spawned ranks.
    """
    logging.getLogger("megatron").setLevel(logging.ERROR)


@contextlib.contextmanager
def _quiet_environment() -> Iterator[None]:
    """Hide ``ENVIRONMENT_WARNINGS`` and ``QUIET_TORCH_LOGGERS`` in this process and in the ranks
    it spawns while the context is open; restores warnings filters, logger levels and the
    environment afterwards.

    The ranks fork from a server that the demo's first run starts inside this context (see
    :func:`megatron_lrmoe.testing.run_distributed`), a fresh interpreter that imports torch and
    megatron.core before any demo code runs, so it and the ranks get the filters through
    ``PYTHONWARNINGS`` (read at interpreter start) and ``TORCH_LOGS`` (read when torch is
    imported).
    """
    saved_env = {name: os.environ.get(name) for name in ("PYTHONWARNINGS", "TORCH_LOGS")}
    loggers = [logging.getLogger(name) for name in QUIET_TORCH_LOGGERS]
    saved_levels = [logger.level for logger in loggers]

    def extend(name: str, items: Sequence[str]) -> None:
        os.environ[name] = ",".join(filter(None, [saved_env[name], *items]))

    # PYTHONWARNINGS separates filters by ',' and fields by ':'; the prefixes contain neither.
    extend("PYTHONWARNINGS", [f"ignore:{prefix}" for prefix in ENVIRONMENT_WARNINGS])
    extend("TORCH_LOGS", [f"-{name}" for name in QUIET_TORCH_LOGGERS])
    try:
        with warnings.catch_warnings():
            for prefix in ENVIRONMENT_WARNINGS:
                warnings.filterwarnings("ignore", message=re.escape(prefix))
            for logger in loggers:  # in case torch is imported already
                logger.setLevel(logging.ERROR)
            yield
    finally:
        for logger, level in zip(loggers, saved_levels):
            logger.setLevel(level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _progress_line(name: str, steps: int, record: Any, train_seconds: float) -> str:
    line = (
        f"[{name:>5}] step {record.step:4d}/{steps}  loss {record.loss:6.3f}"
        f"  val {record.valid_loss:6.3f}  train time {train_seconds:6.1f}s"
    )
    if record.metrics:
        from megatron_lrmoe.observe.metrics import format_log_string

        line += " |" + format_log_string(record.metrics)
    return line


def _demo_rank(rank: int, world_size: int, plan: DemoPlan) -> dict:
    """One rank: both runs, alternating step by step; returns per-step records and corpus facts."""
    if not plan.verbose:
        _quiet()
    from megatron_lrmoe.demo.trainer import ModelShape, Trainer, TrainSettings, load_stdlib_corpus
    from megatron_lrmoe.testing import init_megatron_parallel

    settings = TrainSettings(**plan.settings)
    shape = ModelShape(**plan.shape)
    init_megatron_parallel(ep=world_size, seed=settings.seed)
    corpus = load_stdlib_corpus(plan.corpus_train_bytes, plan.corpus_valid_bytes)
    if rank == 0:
        print(
            f"data: {corpus.train_files} train files ({corpus.train.numel() / 2**20:.1f} MiB), "
            f"{corpus.valid_files} validation files ({corpus.valid.numel() / 2**10:.0f} KiB) "
            f"from {corpus.root}",
            flush=True,
        )
    stock = Trainer(shape, settings, corpus)
    trainers = {
        "stock": stock,
        # From stock's initial weights: LRMoE's experts draw their initial values in another order.
        "lrmoe": Trainer(
            shape, settings, corpus, lrmoe=plan.lrmoe, init_from=stock.initial_state
        ),
    }
    runs: dict[str, list[dict]] = {name: [] for name in RUN_NAMES}
    train_seconds = {name: 0.0 for name in RUN_NAMES}
    # Alternate the runs step by step, so that changes in machine load hit both alike.
    for _ in range(settings.steps):
        for name in RUN_NAMES:
            (record,) = trainers[name].run(steps=1)
            train_seconds[name] += record.train_seconds
            runs[name].append(asdict(record))
            if rank == 0 and record.valid_loss is not None:
                line = _progress_line(name, settings.steps, record, train_seconds[name])
                print(line, flush=True)
    for trainer in trainers.values():
        trainer.close()
    return {
        "runs": runs,
        "corpus": {
            "root": corpus.root,
            "train_files": corpus.train_files,
            "valid_files": corpus.valid_files,
            "train_bytes": int(corpus.train.numel()),
            "valid_bytes": int(corpus.valid.numel()),
        },
    }


# ------------------------------------------------------------------------------------------------
# Summary.
# ------------------------------------------------------------------------------------------------
def merge_ranks(per_rank: Sequence[list[dict]]) -> list[dict]:
    """One record per step: losses (identical on every rank) and rank means of the rest."""
    merged = []
    for records in zip(*per_rank):
        first = dict(records[0])
        for key in ("train_seconds", "moe_seconds", "backward_bytes"):
            first[key] = sum(r[key] for r in records) / len(records)
        merged.append(first)
    cumulative_train = cumulative_moe = 0.0
    for record in merged:
        cumulative_train += record["train_seconds"]
        cumulative_moe += record["moe_seconds"]
        record["cum_train_seconds"] = cumulative_train
        record["cum_moe_seconds"] = cumulative_moe
    return merged


def default_target(stock: Sequence[dict]) -> float:
    """Stock's validation loss at the evaluation nearest ``TARGET_FRACTION`` of its steps."""
    evals = [r for r in stock if r["valid_loss"] is not None]
    goal = TARGET_FRACTION * stock[-1]["step"]
    return min(evals, key=lambda r: (abs(r["step"] - goal), r["step"]))["valid_loss"]


def _crossing(evals: Sequence[dict], target: float, key: str) -> Optional[float]:
    """``key`` where the validation curve first reaches ``target``, linearly interpolated
    between the evaluation before and the first one at or below it (evaluations are every
    ``eval_interval`` steps, so the raw first hit would quantise times to that grid)."""
    previous = None
    for record in evals:
        if record["valid_loss"] <= target:
            if previous is None:
                return float(record[key])
            drop = previous["valid_loss"] - record["valid_loss"]
            fraction = (previous["valid_loss"] - target) / drop
            return previous[key] + fraction * (record[key] - previous[key])
        previous = record
    return None


def summarize(records: Sequence[dict], target: float) -> dict:
    """The table row of one run."""
    evals = [r for r in records if r["valid_loss"] is not None]
    return {
        "steps_to_target": _crossing(evals, target, "step"),
        "seconds_to_target": _crossing(evals, target, "cum_train_seconds"),
        "moe_seconds_to_target": _crossing(evals, target, "cum_moe_seconds"),
        "final_valid_loss": evals[-1]["valid_loss"],
        "final_train_loss": records[-1]["loss"],
        "train_seconds": records[-1]["cum_train_seconds"],
        "moe_seconds": records[-1]["cum_moe_seconds"],
        "backward_mib_per_step": sum(r["backward_bytes"] for r in records) / len(records) / 2**20,
    }


_COLUMNS = (
    ("run", "run", "{}"),
    ("steps_to_target", "steps to target", "{:.0f}"),
    ("seconds_to_target", "time to target (s)", "{:.1f}"),
    ("moe_seconds_to_target", "MoE time to target (s)", "{:.1f}"),
    ("final_valid_loss", "final val loss", "{:.4f}"),
    ("train_seconds", "train time (s)", "{:.1f}"),
    ("moe_seconds", "MoE time (s)", "{:.1f}"),
    ("backward_mib_per_step", "MoE bwd MiB/step", "{:.2f}"),
)
_TABLE_LEGEND = (
    "times: training wall clock, mean of the 2 ranks, evaluation excluded; MoE time: inside the "
    "MoE layers (forward + backward);\nMoE bwd MiB/step: bytes one rank sends in the MoE "
    "layers' backward exchanges per step (mean over steps and ranks)"
)


def format_table(rows: Sequence[dict], target: float, target_source: str) -> str:
    """The printed comparison table (plain text, one line per run)."""
    cells = [[title for _, title, _ in _COLUMNS]]
    for row in rows:
        cells.append(
            ["-" if row[key] is None else fmt.format(row[key]) for key, _, fmt in _COLUMNS]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))
        )
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    header = f"target validation loss {target:.4f} ({target_source})"
    notes = []
    stock, lrmoe = rows[0], rows[1]
    for key, what in (
        ("moe_seconds_to_target", "MoE-layer time to target"),
        ("seconds_to_target", "training time to target"),
    ):
        if stock[key] and lrmoe[key] is not None:
            notes.append(f"LRMoE {what}: {100.0 * (lrmoe[key] / stock[key] - 1.0):+.1f}% vs stock")
    if lrmoe["steps_to_target"] is None:
        notes.append("LRMoE did not reach the target within its steps ('-')")
    bytes_ratio = lrmoe["backward_mib_per_step"] / max(stock["backward_mib_per_step"], 1e-12)
    notes.append(f"LRMoE backward bytes: {100.0 * (bytes_ratio - 1.0):+.1f}% vs stock")
    return "\n".join([header, *lines, *notes, _TABLE_LEGEND])


def plot(runs: dict[str, list[dict]], target: float, labels: dict[str, str], path: str) -> None:
    """Validation (markers) and training (thin) loss against training wall time and step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax_time, ax_step = fig.subplots(1, 2)
    colors = {"stock": "tab:blue", "lrmoe": "tab:orange"}
    for name, records in runs.items():
        evals = [r for r in records if r["valid_loss"] is not None]
        for ax, key in ((ax_time, "cum_train_seconds"), (ax_step, "step")):
            ax.plot(
                [r[key] for r in records],
                [r["loss"] for r in records],
                color=colors[name],
                alpha=0.25,
                linewidth=0.8,
            )
            ax.plot(
                [r[key] for r in evals],
                [r["valid_loss"] for r in evals],
                "o-",
                color=colors[name],
                markersize=3,
                label=f"{labels[name]} (validation)",
            )
    for ax, xlabel in ((ax_time, "training wall time (s, mean of 2 ranks)"), (ax_step, "step")):
        ax.axhline(
            target, color="gray", linestyle="--", linewidth=0.8, label=f"target {target:.4f}"
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    first_evals = [
        r["valid_loss"] for rs in runs.values() for r in rs if r["valid_loss"] is not None
    ][:1]
    if first_evals:  # the first steps' losses would squash the interesting part
        bottom = min(min(r["loss"] for r in rs) for rs in runs.values()) - 0.05
        for ax in (ax_time, ax_step):
            ax.set_ylim(bottom, first_evals[0] + 0.2)
    ax_time.legend(fontsize=8)
    ax_time.set_title("loss vs time (thin: training loss; one seed, CPU)", fontsize=10)
    ax_step.set_title("loss vs step (one seed, CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


# ------------------------------------------------------------------------------------------------
# Entry point.
# ------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.keep_ratio <= 1.0:
        print(f"lrmoe-demo: --keep-ratio must be in [0, 1], got {args.keep_ratio}", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print(f"lrmoe-demo: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "lrmoe-demo: matplotlib is needed for the plot: pip install 'megatron-lrmoe[demo]'",
            file=sys.stderr,
        )
        return 2

    # Default: hide the warnings and log lines about what this machine lacks, here and in the
    # ranks, before anything imports torch or megatron.core; --verbose shows them.
    with contextlib.nullcontext() if args.verbose else _quiet_environment():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run the demo for parsed and checked ``args``; returns the process exit status."""
    from megatron_lrmoe.testing import DistributedTestError, run_distributed

    lrmoe = LRMoEConfig(
        keep_ratio=args.keep_ratio,
        selection=args.selection,
        scope=args.scope,
        activation_mode=args.activation_mode,
        seed=args.seed,
    )
    shape, settings = _shape_and_settings(args.quick, args.steps, args.seed)
    plan = DemoPlan(
        shape=shape,
        settings=settings,
        lrmoe=lrmoe,
        corpus_train_bytes=(1 << 20) if args.quick else (4 << 20),
        corpus_valid_bytes=(64 << 10) if args.quick else (256 << 10),
        verbose=args.verbose,
    )
    label = (
        f"LRMoE keep {lrmoe.keep_ratio:g} ({lrmoe.selection}, {lrmoe.scope}, "
        f"{lrmoe.activation_mode})"
    )
    print(
        f"lrmoe-demo: {WORLD_SIZE} CPU ranks (gloo, EP={WORLD_SIZE}); {settings['steps']} steps "
        f"each of stock Megatron MoE and {label}, alternating step by step; model {shape}",
        flush=True,
    )
    started = time.perf_counter()
    # Generous: a loaded 2-core machine runs the default demo in a few minutes.
    timeout = 600.0 + 30.0 * settings["steps"]
    try:
        per_rank = run_distributed(_demo_rank, WORLD_SIZE, plan, timeout=timeout)
    except DistributedTestError as e:
        print(
            f"lrmoe-demo: a rank failed (rerun with --verbose for Megatron's messages)\n{e}",
            file=sys.stderr,
        )
        return 1
    wall = time.perf_counter() - started

    runs = {name: merge_ranks([r["runs"][name] for r in per_rank]) for name in RUN_NAMES}
    if args.target_loss is not None:
        target, source = args.target_loss, "--target-loss"
    else:
        target = default_target(runs["stock"])
        source = f"stock's validation loss near {TARGET_FRACTION:.0%} of its steps"
    labels = {"stock": "stock Megatron MoE", "lrmoe": label}
    short = {"stock": "stock", "lrmoe": f"lrmoe keep {lrmoe.keep_ratio:g}"}
    rows = [{"run": short[name], **summarize(runs[name], target)} for name in RUN_NAMES]
    print()
    print(format_table(rows, target, source))

    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "loss_vs_time.png")
    plot(runs, target, labels, png)
    result = {
        "args": vars(args),
        "world_size": WORLD_SIZE,
        "shape": shape,
        "settings": settings,
        "lrmoe": asdict(lrmoe),
        "corpus": per_rank[0]["corpus"],
        "target_loss": target,
        "target_source": source,
        "table": rows,
        "runs": runs,
        "wall_seconds": wall,
    }
    path = os.path.join(args.out_dir, "results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=_json_default)
    print(
        f"\none seed, CPU: demo wall time {wall:.0f} s; the times come from one run on this "
        "machine and are noisy (GPU figures: docs/results.md)"
    )
    print("results:")
    print(f"  {path}")
    print(f"  {png}")
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
