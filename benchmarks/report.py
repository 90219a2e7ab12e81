"""Markdown tables from the committed GPU results (``benchmarks/results/``).

    python benchmarks/report.py benchmarks/results/gpu_run1            # layer tables
    python benchmarks/report.py benchmarks/results/gpu_run26/call9/train --vs-keep1
    python benchmarks/report.py --results-md docs/results.md           # the current figures

Layer tables come from ``layer_ep*.json`` (``benchmarks/layer_bench.py``); the training summary
from ``train_*.log`` (``benchmarks/train_compare.sh``): median time per iteration after
warm-up, validation losses, the MoE layers' cumulative time (``--moe-layer-timing``) and the
time to a target validation loss (linear interpolation between evaluations). Several folders
(or ``train_*.log`` files) go into one table, each row named by its folder when there is more
than one. ``--vs-keep1`` adds each run's ratios to the keep-1.0 run of the same seed (both read
from Megatron's argument dump at the top of the log: ``seed``, ``lrmoe``,
``lrmoe_keep_ratio``) and, per keep ratio, the MoE time to the target summed over the seeds.

``--results-md`` writes docs/results.md: one section per function in ``SECTIONS``, each a table
read from committed files under ``benchmarks/results/`` with the run, the code and the command
that made them (tests/test_report.py checks the committed page is exactly what this writes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import train_logs  # noqa: E402  (benchmarks/train_logs.py: the log parser and time to target)
from megatron_lrmoe.replay.replay import FORWARD_PHASES  # noqa: E402


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
    run = train_logs.parse_log(log)
    iters = {i: ms / 1e3 for i, ms in run.iter_ms.items()}
    name = name or log.stem
    if iters and max(iters) < run.planned_iters:
        name += f" (stopped at iteration {max(iters)} of {run.planned_iters})"
    moe = {i: ms / 1e3 for i, ms in run.moe_ms.items()}
    keep = float(run.args["lrmoe_keep_ratio"]) if run.args.get("lrmoe") == "True" else None
    cross = train_logs.crossing(sorted(run.val.items()), target)
    return RunStats(
        name=name,
        seed=run.seed(),
        keep=keep,
        s_per_iter=statistics.median(s for i, s in iters.items() if i >= 20),
        val=dict(run.val),
        moe_ms_per_iter=1e3 * statistics.median(v for i, v in moe.items() if i >= 20),
        moe_total=run.moe_cumulative_s[max(moe)] if moe else 0.0,
        moe_first=moe.get(1, 0.0),
        cross=cross,
        wall_to_target=None if cross is None else train_logs.cumulative(iters, cross, first=1),
        moe_to_target=None if cross is None else train_logs.cumulative(moe, cross, first=1),
    )


def _logs(paths: Sequence[Path], root: Optional[Path] = None) -> list[tuple[Path, str]]:
    """``train_*.log`` files of the given folders and files, with their row labels (folders
    written relative to ``root`` when given)."""
    found = []
    for path in paths:
        logs = [path] if path.is_file() else sorted(path.glob("train_*.log"))
        for log in logs:
            folder = log.parent.relative_to(root) if root is not None else log.parent
            found.append((log, f"{folder.as_posix()}/{log.stem}" if len(paths) > 1 else log.stem))
    return found


def train_summary(
    run: Path | Sequence[Path], target: float, root: Optional[Path] = None
) -> str:
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
    for log, name in _logs(paths, root):
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


# -- docs/results.md ------------------------------------------------------------------------------
# Each section is a function: the repository root -> a markdown section (a "## " title, where its
# data come from, one table). SECTIONS lists them in page order; add one by writing a function
# and listing it where it belongs.

RESULTS = Path("benchmarks/results")
RESULTS_MD = Path("docs/results.md")
REGENERATE = "python benchmarks/report.py --results-md docs/results.md"
TARGET_LOSS = 1.75  # the Qwen3 proxy's target validation loss (train_compare.sh's runs)


def _source(run: str, code: str, command: str, files: Sequence[Path]) -> str:
    """Where a section's numbers come from: the run, the code that ran, the command, the files."""
    listed = ", ".join(f"`{f.as_posix()}`" for f in files)
    return f"Run `{run}`, code {code}; made by `{command}`. Files: {listed}."


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x"


def section_layer(root: Path) -> str:
    """One MoE layer against stock Megatron's (``layer_bench.py``, gpu_run1)."""
    files = [RESULTS / "gpu_run1" / f"layer_ep{ep}.json" for ep in (1, 2)]
    out = [
        "## One MoE layer against stock Megatron",
        "",
        "The Qwen3-30B-A3B MoE layer shape (hidden 2048, 128 experts, top-8, expert FFN 768), "
        "bf16; stock runs its experts as `SequentialMLP` (no Transformer Engine). The only "
        "measurement of a layer against stock, on the first GPU run's code (the sections above "
        "compare keep ratios on the current code).",
        "",
        _source(
            "gpu_run1",
            (root / RESULTS / "gpu_run1" / "commit.txt").read_text().split()[0],
            "torchrun --nproc_per_node={1,2} benchmarks/layer_bench.py --tokens 4096 16384 "
            "--iters 15",
            files,
        ),
        "",
        "| file | tokens per GPU | stock fwd + bwd ms | keep 1.0 fwd + bwd ms | keep 1.0 speed-up "
        "| saved for backward MiB: stock / keep 1.0 / keep 0.5 `recompute` |",
        "|---|---|---|---|---|---|",
    ]
    for path in files:
        data = json.loads((root / path).read_text())
        for tokens in sorted({r["tokens"] for r in data["rows"]}):
            rows = {r["variant"]: r for r in data["rows"] if r["tokens"] == tokens}
            stock, keep1 = rows["stock MoELayer (SequentialMLP)"], rows["LRMoE keep 1.0"]
            recompute = rows["LRMoE keep 0.5 sample recompute"]
            s_ms, k_ms = stock["fwd_ms"] + stock["bwd_ms"], keep1["fwd_ms"] + keep1["bwd_ms"]
            out.append(
                f"| `{path.name}` (EP {data['ep']}) | {tokens} | {s_ms:.1f} | {k_ms:.1f} | "
                f"{s_ms / k_ms:.1f}x | "
                f"{stock['saved_mib']:.0f} / {keep1['saved_mib']:.0f} / "
                f"{recompute['saved_mib']:.0f} |"
            )
    return "\n".join(out)


# gpu_run32: 8 layers stacked as in a model (model_bench.py), EP 1, current code.
_STACKED = [
    RESULTS / "gpu_run32" / call / f"model_{shape}.json"
    for call in ("call1", "call2")
    for shape in ("e16_t16384", "e128_t16384", "e16_t4096", "e16_t16384_topk")
    if not (call == "call1" and shape.endswith("topk"))
]
_STACKED_SOURCE = (
    "gpu_run32 calls 1-2",
    "deda9b2 (call 1), 7e39742 (call 2)",
    "torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts E --tokens T "
    "--keep 1.0 0.75 0.5 0.25 --selection S --profile DIR --out FILE",
)


def _tree_hash(root: Path, folder: Path) -> str:
    """The tree hash a device call printed first (``benchmarks/tree_hash.sh``)."""
    return (root / folder / "run.log").read_text().split("\n", 1)[0].strip()


def _stacked_rows(root: Path) -> list[tuple[Path, dict, dict[float, dict]]]:
    found = []
    for path in _STACKED:
        data = json.loads((root / path).read_text())
        found.append((path, data["args"], {r["keep"]: r for r in data["rows"]}))
    return found


def section_stacked(root: Path) -> str:
    """Backward and forward time of 8 stacked layers at each keep ratio (gpu_run32)."""
    hashes = ", ".join(
        f"{c}: `{_tree_hash(root, RESULTS / 'gpu_run32' / c)}`" for c in ("call1", "call2")
    )
    out = [
        "## Layers stacked as in a model: time per keep ratio",
        "",
        "Eight LRMoE layers stacked as in a model (the host queues layer after layer), one H200, "
        "EP 1, the weight gradients accumulated into `main_grad` in the GEMM. Milliseconds per "
        "layer call; the ratios are to keep 1.0 in the same process. What does not shrink with "
        "the keep ratio: Megatron's router backward, the exact router gradient's read of every "
        "pair's expert output, the scoring and selection, and at 128 experts the fp32 "
        "`main_grad` traffic. At 4096 tokens and 16 experts the host, not the GPU, bounds the "
        "stack (noisy ratios).",
        "",
        _source(*_STACKED_SOURCE[:2], _STACKED_SOURCE[2], _STACKED)
        + f" Tree hashes (first line of each call's `run.log`): {hashes}.",
        "",
        "| file | experts, tokens, selection | keep 1.0 fwd / bwd ms | bwd at keep 0.75 / 0.5 / "
        "0.25 | fwd at keep 0.75 / 0.5 / 0.25 |",
        "|---|---|---|---|---|",
    ]
    for path, args, rows in _stacked_rows(root):
        base = rows[1.0]
        keeps = (0.75, 0.5, 0.25)
        out.append(
            f"| `{path.relative_to(RESULTS).as_posix()}` | {args['experts']}, {args['tokens']}, "
            f"`{args['selection']}` | {base['fwd_ms']:.2f} / {base['bwd_ms']:.2f} | "
            + " / ".join(_ratio(rows[k]["bwd_ms"], base["bwd_ms"]) for k in keeps)
            + " | "
            + " / ".join(_ratio(rows[k]["fwd_ms"], base["fwd_ms"]) for k in keeps)
            + " |"
        )
    return "\n".join(out)


def section_memory(root: Path) -> str:
    """Peak memory of the stacked layers per keep ratio (gpu_run32, the same files)."""
    out = [
        "## Memory per keep ratio",
        "",
        "Peak allocated memory of the same 8 stacked layers (weights and fp32 `main_grad` "
        "included) and the memory the replayed backward graphs hold (once per process, on top of "
        "the peak's allocations), in MiB; the ratio is the peak's to keep 1.0's. The trimmed "
        "backward saves and exchanges only the kept pairs' rows.",
        "",
        _source(*_STACKED_SOURCE, _STACKED),
        "",
        "| file | experts, tokens, selection | peak MiB at keep 1.0 | peak at keep 0.75 / 0.5 / "
        "0.25 | graphs MiB at keep 0.75 / 0.5 / 0.25 |",
        "|---|---|---|---|---|",
    ]
    for path, args, rows in _stacked_rows(root):
        base = rows[1.0]
        keeps = (0.75, 0.5, 0.25)
        out.append(
            f"| `{path.relative_to(RESULTS).as_posix()}` | {args['experts']}, {args['tokens']}, "
            f"`{args['selection']}` | {base['peak_mib']:.0f} | "
            + " / ".join(
                f"{rows[k]['peak_mib']:.0f} ({_ratio(rows[k]['peak_mib'], base['peak_mib'])})"
                for k in keeps
            )
            + " | "
            + " / ".join(f"{rows[k]['graphs_mib']:.0f}" for k in keeps)
            + " |"
        )
    return "\n".join(out)


def _training(root: Path, title: str, text: str, source: tuple[str, str], logs: Sequence[Path]):
    paths = [root / log for log in logs]
    stats = [run_stats(log, TARGET_LOSS, name) for log, name in _logs(paths, root / RESULTS)]
    command = f"python benchmarks/report.py {' '.join(p.as_posix() for p in logs)} --vs-keep1"
    return "\n".join(
        [
            f"## {title}",
            "",
            text,
            "",
            _source(*source, command, logs),
            "",
            train_summary(paths, TARGET_LOSS, root / RESULTS),
            "",
            versus_keep1(stats),
        ]
    )


_PROXY = (
    "The Qwen3 proxy (`benchmarks/train_compare.sh`): 4 MoE layers of 128 experts at the "
    "Qwen3-30B-A3B shape, one H200 (EP 1), real text, 300 iterations, 16384 tokens per "
    "micro-batch, the weight gradients accumulated into `main_grad`, `sample` selection. "
    "The MoE layers are a small part of this proxy's iteration (compare the MoE ms/iter and "
    "s/iter columns; attention without flash kernels, the 151936-word output layer and the "
    f"optimizer take the rest), which bounds what they can save of it. Target validation loss "
    f"{TARGET_LOSS}; \"from it 2\" leaves out "
    "iteration 1 (Triton compiling into a cold cache)."
)


def section_training_half(root: Path) -> str:
    """Keep 0.5 against keep 1.0 in training, three seeds (gpu_run28 and its keep-1.0 runs)."""
    return _training(
        root,
        "Training: keep 0.5 against keep 1.0, three seeds",
        _PROXY + " Keep 1.0 at seed 1234 is gpu_run26 call 9's run, at 2024 gpu_run24 call 3's.",
        ("gpu_run28 calls 1-2 (keep 1.0 also gpu_run26 call 9, gpu_run24 call 3)",
         "5c830a7 (gpu_run28)"),
        [
            RESULTS / "gpu_run28/call1/train/train_keep1.0.log",
            RESULTS / "gpu_run28/call2/train",
            RESULTS / "gpu_run26/call9/train",
            RESULTS / "gpu_run24/call3/train/train_keep1.0.log",
        ],
    )


def section_training_quarter(root: Path) -> str:
    """Keep 0.25 against keep 1.0 in training, three seeds (gpu_run25)."""
    return _training(
        root,
        "Training: keep 0.25 against keep 1.0, three seeds",
        _PROXY + " Keep 0.25 ran on the code before the weight gradient's atomic accumulation "
        "(gpu_run26), so its ratios are to keep 1.0 runs of that time: seed 1234 in the same "
        "call, 4321 gpu_run20 call 5's, 2024 gpu_run24 call 3's.",
        ("gpu_run25 calls 2-3 (keep 1.0 also gpu_run20 call 5, gpu_run24 call 3)",
         "e839766, 7e6804c, f707273 (gpu_run25)"),
        [
            RESULTS / "gpu_run25/call2/train",
            RESULTS / "gpu_run25/call3/train",
            RESULTS / "gpu_run20/call5/train/train_keep1.0.log",
            RESULTS / "gpu_run24/call3/train/train_keep1.0.log",
        ],
    )


# Memory-bound training (a separate section, planned) goes after the training sections.


def section_glm(root: Path) -> str:
    """The GLM-4.5-Air proxy, stock against LRMoE keep 0.5 (gpu_run29 calls 2-3)."""
    files = [RESULTS / f"gpu_run29/call{c}/glm/summary.json" for c in (2, 3)]
    out = [
        "## Training: the GLM-4.5-Air proxy against stock Megatron",
        "",
        "1 dense + 1 MoE layer + the MTP layer at GLM-4.5-Air's shapes (shared expert, sigmoid "
        "router with expert bias), full recompute, one H200, 100 iterations; stock runs its "
        "experts as `SequentialMLP` (no Transformer Engine). Stock stopped at its timeout in "
        "call 2 and ran again alone in call 3, whose keep 0.5 row is call 2's log, copied.",
        "",
        _source(
            "gpu_run29 calls 2-3",
            "e550189",
            "TRAIN_ITERS=100 EVAL_INTERVAL=50 TIMEOUT_S=285 bash benchmarks/glm_compare.sh OUT",
            files,
        ),
        "",
        "| file | run | iterations | s/iter (median) | MoE ms/iter (median) | validation loss "
        "(iteration) | max allocated GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in files:
        for r in json.loads((root / path).read_text()):
            val = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f} ({r['val_iteration']})"
            out.append(
                f"| `{path.relative_to(RESULTS).as_posix()}` | {r['run']} | {r['iterations']} | "
                f"{r['s_per_iter_median']:.3f} | {r['moe_ms_per_iter_median']:.1f} | {val} | "
                f"{r['max_allocated_gib']:.1f} |"
            )
    return "\n".join(out)


def section_planner(root: Path) -> str:
    """The per-call controller's planning time and quality (planner_bench.json)."""
    path = RESULTS / "planner_bench.json"
    data = json.loads((root / path).read_text())
    settings, machine, small = data["settings"], data["machine"], data["small_cases"]
    out = [
        "## The quota controller's planner",
        "",
        f"`plan_call` alone on synthetic Zipf loads ({settings['pairs_per_rank']} pairs per "
        f"rank, keep {settings['keep_ratio']:g}, up to {settings['max_replicas_per_rank']} "
        f"replicas per rank, the {settings['planner_path']} planner), host CPU time per plan "
        f"(median of {settings['repeats']}) on a {machine['cpus']}-core {machine['processor']} "
        "machine; forward peak: the busiest rank's pairs, against the lower bound no placement "
        f"can beat. On {small['cases']} small cases the controller's peak over the brute-force "
        f"optimum is at most {small['controller_over_optimum_max']:.3f}. Rows: EP 64.",
        "",
        _source("planner_bench.json", "1f57882 (the file's commit)",
                "python benchmarks/planner_bench.py", [path]),
        "",
        "| experts | Zipf | quotas only us | with replicas us | memory budget binding us | "
        "forward peak: no replicas / controller / lower bound |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if r["ep"] != 64:
            continue
        out.append(
            f"| {r['experts']} | {r['zipf']:g} | {r['quotas_us']:.0f} | "
            f"{r['replicas_save_us']:.0f} | {r['replicas_budget_us']:.0f} | "
            f"{r['fwd_no_replicas']} / {r['fwd_controller']} / {r['lower_bound']} |"
        )
    return "\n".join(out)


_RUN33 = RESULTS / "gpu_run33"
_SEARCH = _RUN33 / "call2" / "search.json"
_RECOMPUTE = [_RUN33 / "call1" / f"model_recompute_{r}.json" for r in ("none", "moe")]
_RECOMPUTE_LABELS = {"none": "none (every layer keeps its activations)",
                     "moe": "Megatron's MoE-layer recompute"}
_RECOMPUTE_TEXT = {
    "none": "attention scores", "moe": "attention scores, MoE layer", "full": "every layer"
}


def _arm_setting(arm: dict) -> str:
    experts = "Megatron's `SequentialMLP`" if not arm["lrmoe"] else (
        "stock math (LRMoE keep 1.0)" if arm["keep"] >= 1.0
        else f"LRMoE keep {arm['keep']:g}, `{arm['activation_mode']}`")
    return f"{experts}; recompute: {_RECOMPUTE_TEXT[arm['recompute']]}; micro-batch {arm['mbs']}"


def section_memory_bound(root: Path) -> str:
    """Where GPU memory binds (issue 39): the configurations that fit under a cap, and the MoE
    layers under Megatron's MoE-layer recompute (gpu_run33)."""
    search = json.loads((root / _SEARCH).read_text())
    baseline = next(r for r in search["arms"] if r["arm"]["name"] == search["picks"]["baseline"])
    out = [
        "## Where GPU memory binds: what fits under an 80 GB cap, and at what cost per iteration",
        "",
        f"One GPU's share of a Qwen3-30B-A3B job at EP 8 (`benchmarks/memory_bound.py`'s proxy: "
        f"{search['layers']} layers, 16 experts of the real MoE shape per layer, top-8, sequences "
        "of 1024 tokens, 16384 tokens per iteration, byte-level text), each process capped at "
        f"{search['cap_gib']:g} GiB (`--memory-cap-gib`, an 80 GB card). Ten iterations per "
        "configuration; medians of iterations 4-10 (single short runs: a few per cent of noise). "
        "Time to a target loss under the cap is not measured yet (the `converge` phase), so no "
        "time-to-target claim is made here. The MoE-layer time counts what runs with gradients: "
        "under full recompute the first, gradient-free forward of each MoE layer is not in it. "
        "The MoE layers hold 62 % of this proxy's forward FLOPs (52 % in the full model at "
        "sequence 4096; `benchmarks/memory_bound.py` shows the sums) but 24-32 % of its time: "
        "without Transformer Engine the rest of the layer runs far below the GPU's peak.",
        "",
        _source("gpu_run33 call 2", "b026f0a (package) with dd8c92e's memory_bound.py",
                "python benchmarks/memory_bound.py search --out DIR --cap-gib 78 --layers 24 "
                "--search-iters 10 --arms ...", [_SEARCH]),
        "",
        "| arm | setting | fits | peak GiB | ms/iter | MoE ms/iter (share) | iteration / "
        f"MoE vs {baseline['arm']['name']} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in search["arms"]:
        arm = row["arm"]
        fits = "yes" if row["fits"] else ("out of memory" if row["oom"] else "did not finish")
        if row["iter_ms"] is None:
            cost = "- | - | -"
        else:
            cost = (f"{row['iter_ms']:.0f} | {row['moe_ms']:.0f} ({row['moe_share']:.0%}) | "
                    f"{_ratio(row['iter_ms'], baseline['iter_ms'])} / "
                    f"{_ratio(row['moe_ms'], baseline['moe_ms'])}")
        peak = "-" if row["max_allocated_gib"] is None else f"{row['max_allocated_gib']:.1f}"
        out.append(f"| {arm['name']} | {_arm_setting(arm)} | {fits} | {peak} | {cost} |")
    out += [
        "",
        "The same MoE layers stacked alone (8 layers, 16 experts, 16384 tokens; "
        "`benchmarks/model_bench.py --recompute`), forward + backward per layer against keep "
        "1.0's in the same process, and the peak memory of a round above what the layers hold:",
        "",
        _source("gpu_run33 call 1", "b026f0a",
                "torchrun --nproc_per_node=1 benchmarks/model_bench.py --layers 8 --experts 16 "
                "--tokens 16384 --keep 1.0 0.5 0.25 --recompute R --out FILE", _RECOMPUTE),
        "",
        "| recompute | keep 1.0 fwd / bwd ms | fwd+bwd at keep 0.5 / 0.25 | peak MiB at keep 1.0 "
        "/ 0.5 / 0.25 |",
        "|---|---|---|---|",
    ]
    for path in _RECOMPUTE:
        result = json.loads((root / path).read_text())
        rows = {r["keep"]: r for r in result["rows"]}
        base = rows[1.0]
        out.append(
            f"| {_RECOMPUTE_LABELS[result['args']['recompute']]} | {base['fwd_ms']:.2f} / "
            f"{base['bwd_ms']:.2f} | {rows[0.5]['layer_vs_keep1']:.2f}x / "
            f"{rows[0.25]['layer_vs_keep1']:.2f}x | "
            + " / ".join(f"{rows[k]['peak_mib']:.0f}" for k in (1.0, 0.5, 0.25))
            + " |"
        )
    moe = json.loads((root / _RECOMPUTE[1]).read_text())
    base = next(r for r in moe["rows"] if r["keep"] == 1.0)
    forward, backward = base["fwd_ms"], base["bwd_ms"] - base["fwd_ms"]
    bound = {k: (2 * forward + k * backward) / (2 * forward + backward) for k in (0.5, 0.25)}
    out += [
        "",
        "Under Megatron's MoE-layer recompute LRMoE gains less: the exact router gradient needs "
        "every pair's expert output, so the recomputed forward runs for every pair whatever the "
        "keep ratio, and only the backward after it shrinks. Even a backward that shrank exactly "
        f"k-fold would take the layer to (2F + kB) / (2F + B) = {bound[0.5]:.2f}x at keep 0.5 and "
        f"{bound[0.25]:.2f}x at keep 0.25 (F = {forward:.2f} ms, the forward; B = "
        f"{backward:.2f} ms, the backward after the recompute, the keep-1.0 row above less F).",
    ]
    return "\n".join(out)


_RUN34 = RESULTS / "gpu_run34"
_CONVERGE = {"declared": _RUN34 / "summary.json", "looser": _RUN34 / "summary_target_1.60.json"}


def _pm(stat: dict, fmt: str) -> str:
    """A seed statistic: the mean, with the spread when there is more than one seed."""
    if stat["n"] == 0:
        return "not reached"
    text = format(stat["mean"], fmt)
    return text if stat["n"] == 1 else f"{text} ± {format(stat['std'], fmt)}"


def section_time_to_target(root: Path) -> str:
    """Time to a target validation loss under the 78 GiB cap (issue 39's protocol, gpu_run34)."""
    runs = {k: json.loads((root / path).read_text()) for k, path in _CONVERGE.items()}
    declared, looser = runs["declared"], runs["looser"]
    baseline = declared["baseline"]
    seeds = sorted({s["seed"] for a in declared["arms"].values() for s in a["seeds"]})
    out = [
        "## Where GPU memory binds: time to a target loss",
        "",
        "The proxy and cap of the section above, trained for 300 iterations with the validation "
        "loss of a fixed held-out set (1524 sequences, every one read once per evaluation; its "
        "standard error is the 'SE' column) at iterations 75, 150, 225 and 300. Each arm is "
        f"the fastest of its kind that fits: {baseline} (stock's math under Megatron's MoE-layer "
        "recompute) and keep 0.5 in LRMoE's `recompute` mode. "
        f"Seeds: {', '.join(map(str, seeds))} (one per arm so far: no spread over seeds yet; "
        "earlier proxies varied by several per cent from seed to seed). MoE time: the MoE layers' "
        "cumulative time from iteration 2 (iteration 1 compiles Triton kernels), interpolated to "
        "the target. keep 0.5 ran with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: with "
        "the default allocator it ran out of memory right after the first evaluation "
        "(`gpu_run34/call4`); stock+moe ran with the default allocator (a short stock+moe run with "
        "expandable segments, `gpu_run34/call7`, took the same time per iteration to within 1 %).",
        "",
        _source("gpu_run34 calls 3 and 5", "b994bed",
                "ARM=<arm> SEED=1234 bash benchmarks/results/gpu_run34/call3.sh, then "
                "python benchmarks/memory_bound.py report --out benchmarks/results/gpu_run34 "
                "[--target 1.60]", list(_CONVERGE.values())),
        "",
        "![validation loss against MoE time and wall time](../benchmarks/results/gpu_run34/"
        "loss_vs_time.png)",
        "",
        "| arm | final val loss (SE) | vs baseline | ms/iter | MoE ms/iter | peak GiB | MoE s / "
        f"wall s to {declared['target']:.4f} | MoE s / wall s to {looser['target']:.2f} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = declared["arms"][baseline]
    for name, arm in declared["arms"].items():
        other = looser["arms"][name]
        final = arm["final_val_loss"]["mean"] / base["final_val_loss"]["mean"] - 1
        cells = []
        for run, a in ((declared, arm), (looser, other)):
            ratio = a.get("vs_baseline", {}).get("moe_s_to_target")
            wall = a.get("vs_baseline", {}).get("wall_s_to_target")
            text = f"{_pm(a['moe_s_to_target'], '.1f')} / {_pm(a['wall_s_to_target'], '.1f')}"
            if name != baseline and ratio is not None:
                text += f" ({ratio:.2f}x / {wall:.2f}x)"
            cells.append(text)
        out.append(
            f"| {name} | {_pm(arm['final_val_loss'], '.4f')} "
            f"({arm['val_relative_se']['mean']:.2%}) | {final:+.2%} | {_pm(arm['iter_ms'], '.0f')} "
            f"| {_pm(arm['moe_ms'], '.0f')} | {arm['max_allocated_gib']:.1f} | {cells[0]} | "
            f"{cells[1]} |"
        )
    for name, arm in declared["arms"].items():
        if name == baseline:
            continue
        vs, loose = arm["vs_baseline"], looser["arms"][name]["vs_baseline"]
        reached = arm["moe_s_to_target"]["n"] > 0
        out += [
            "",
            f"{name}: the declared target ({declared['target']:.4f}, 1 % above {baseline}'s "
            f"final loss) is {'reached' if reached else 'not reached in 300 iterations'}; per "
            f"iteration it takes {vs['iter_ms']:.2f}x the time and {vs['moe_ms']:.2f}x the MoE "
            f"layers' time, and ends {vs['final_val_loss'] - 1:+.2%} in loss. At the looser "
            f"target ({looser['target']:.2f}, for scale) it needs {loose['moe_s_to_target']:.2f}x "
            f"the MoE-layer time and {loose['wall_s_to_target']:.2f}x the wall time.",
        ]
    out += ["", "One seed per arm on this card; a second seed, on a real 80 GB card, follows."]
    out += ["", _real_card_check(root)]
    return "\n".join(out)


_REAL_CARD = _RUN34 / "call10" / "summary.json"
_REAL_SEARCH = _RUN34 / "call13" / "search.json"


def _real_card_search(root: Path) -> str:
    """What fits a real H100 80GB with no cap (gpu_run34 call 13), ``lean`` among them."""
    search = json.loads((root / _REAL_SEARCH).read_text())
    rows = {r["arm"]["name"]: r for r in search["arms"]}
    base = rows[search["picks"]["baseline"]]
    out = [
        "",
        "What fits the real card (no cap; 10 iterations each, medians of iterations 4-10, "
        "expandable segments in every arm):",
        "",
        _source("gpu_run34 call 13", "f76cf1a",
                "bash benchmarks/results/gpu_run34/call13.sh (memory_bound.py search --cap-gib 0 "
                "on an H100 80GB)", [_REAL_SEARCH]),
        "",
        f"| arm | setting | fits | peak GiB | ms/iter | MoE ms/iter | iteration / MoE vs "
        f"{base['arm']['name']} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        fits = "yes" if row["fits"] else ("out of memory" if row["oom"] else "did not finish")
        cost = "- | - | -" if row["iter_ms"] is None else (
            f"{row['iter_ms']:.0f} | {row['moe_ms']:.0f} | "
            f"{_ratio(row['iter_ms'], base['iter_ms'])} / {_ratio(row['moe_ms'], base['moe_ms'])}")
        peak = "-" if not row["fits"] else f"{row['max_allocated_gib']:.1f}"
        out.append(f"| {name} | {_arm_setting(row['arm'])} | {fits} | {peak} | {cost} |")
    return "\n".join(out)


def _real_card_check(root: Path) -> str:
    """The keep-0.5 `recompute` arm on a real 80 GB card (gpu_run34 call 10)."""
    run = json.loads((root / _REAL_CARD).read_text())
    oom = run["oom_memory"]
    device = run["device"].split(",")[0]
    return (
        f"**On a real 80 GB card it does not fit.** The same arm and protocol (seed "
        f"{run['seed']}, the same {run['memory_cap_gib']:g} GiB cap) on an {device} ran out of "
        f"memory in iteration {run['iterations'] + 1}: {oom['allocated_gib']:.1f} GiB allocated "
        f"and {oom['reserved_unallocated_gib']:.1f} GiB reserved by PyTorch's allocator, and "
        f"{oom['outside_gib']:.1f} GiB held outside it (CUDA context, NCCL, cuBLAS, loaded "
        f"kernels), of the card's {oom['total_gib']:.2f} GiB. The cap on the H200 limits the "
        "allocator alone and never charged that memory: the H200 figures above hold for a card "
        f"of about {run['memory_cap_gib'] + oom['outside_gib']:.0f} GiB, not for an 80 GB one. "
        "`--gpu-memory-gib 79.18` emulates the H100 whole (the rest of the device held outside "
        "PyTorch); the time-to-target runs are to be repeated on the real card or with it. "
        + _source("gpu_run34 call 10", "40ca965",
                  "ARM=k0.5-recompute SEED=4321 bash benchmarks/results/gpu_run34/call8.sh; "
                  "python benchmarks/train_logs.py LOG --one --device \"$(sed -n 2p run.log)\"",
                  [_REAL_CARD])
        + "\n" + _real_card_search(root)
        + "\n\n" + _real_card_converge(root)
    )


_RUN35 = RESULTS / "gpu_run35"
_REAL_CONVERGE = _RUN35 / "summary.json"


def _real_card_converge(root: Path) -> str:
    """Time to target on a real H100 80GB, keep 0.5 in `lean` mode (gpu_run35 calls 2-3), and
    keep 0.5's final loss over every seed of both cards."""
    run = json.loads((root / _REAL_CONVERGE).read_text())
    earlier = json.loads((root / _CONVERGE["declared"]).read_text())
    baseline = run["baseline"]
    base = run["arms"][baseline]
    seeds = sorted({s["seed"] for a in run["arms"].values() for s in a["seeds"]})
    out = [
        f"**Time to target on the real card** (seed{'s' if len(seeds) > 1 else ''} "
        f"{', '.join(map(str, seeds))}): the protocol above on an H100 80GB as it is (no cap), "
        "keep 0.5 in `lean` mode (the kept pairs and weight gradients of `recompute`; 768 "
        "instead of 2048 values per pair kept for the exact router gradient) against "
        f"{baseline}, both with expandable segments. Target: 1 % above {baseline}'s final loss "
        f"({run['target']:.4f}).",
        "",
        _source("gpu_run35 calls 2-3", "6f8f15b",
                "ARM=<arm> SEED=4321 bash benchmarks/results/gpu_run35/call2.sh, then python "
                "benchmarks/memory_bound.py report --out benchmarks/results/gpu_run35",
                [_REAL_CONVERGE]),
        "",
        "![validation loss against MoE time and wall time, H100](../benchmarks/results/gpu_run35/"
        "loss_vs_time.png)",
        "",
        f"| arm | final val loss (SE) | vs {baseline} | ms/iter | MoE ms/iter | peak GiB | "
        "iterations / MoE s / wall s to target | MoE / wall time to target vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in run["arms"].items():
        final = arm["final_val_loss"]["mean"] / base["final_val_loss"]["mean"] - 1
        reached = arm["iterations_to_target"]["n"] > 0
        to = (f"{_pm(arm['iterations_to_target'], '.0f')} / {_pm(arm['moe_s_to_target'], '.1f')}"
              f" / {_pm(arm['wall_s_to_target'], '.1f')}") if reached else "not reached"
        vs = arm.get("vs_baseline", {})
        ratio = ("-" if name == baseline or vs.get("moe_s_to_target") is None
                 else f"{vs['moe_s_to_target']:.2f}x / {vs['wall_s_to_target']:.2f}x")
        out.append(
            f"| {name} | {_pm(arm['final_val_loss'], '.4f')} "
            f"({arm['val_relative_se']['mean']:.2%}) | {final:+.2%} | "
            f"{_pm(arm['iter_ms'], '.0f')} | {_pm(arm['moe_ms'], '.0f')} | "
            f"{arm['max_allocated_gib']:.1f} | {to} | {ratio} |"
        )
    finals = []
    for summary, card in ((earlier, "H200 under the 78 GiB allocator cap"), (run, "H100 80GB")):
        by_seed = {s["seed"]: s["final_val_loss"]
                   for s in summary["arms"][summary["baseline"]]["seeds"]}
        for name, arm in summary["arms"].items():
            if name == summary["baseline"]:
                continue
            for s in arm["seeds"]:
                if s["seed"] in by_seed and s["final_val_loss"] is not None:
                    change = s["final_val_loss"] / by_seed[s["seed"]] - 1
                    finals.append(f"{change:+.2%} (seed {s['seed']}, `{name}`, {card})")
    out += [
        "",
        "keep 0.5's final validation loss against stock+moe of the same seed, every run so far: "
        + "; ".join(finals) + ". The keep-0.5 arms share their math (`lean` and `recompute` keep "
        "the same pairs and give the same weight gradients), so these are seeds of one method; "
        "they differ by more than the validation set's standard error (0.5 %) and, while they "
        "disagree in sign, no time-to-target claim over seeds is made.",
    ]
    return "\n".join(out)


_SCALE = RESULTS / "replay_target"
_SCALE_FILES = {
    "replay": _SCALE / "replay.json",
    "proxy4": _SCALE / "to_target_proxy4.json",
    "memory24": _SCALE / "to_target_memory24.json",
}
_SKEWS = {
    "balanced": _SCALE / "skew_balanced" / "to_target_proxy4.json",
    "mild": _SCALE / "skew_mild" / "to_target_proxy4.json",
    "medium": _SCALE / "skew_medium" / "to_target_proxy4.json",
    "heavy (the table above)": _SCALE_FILES["proxy4"],
}


def _validation_counts(root: Path) -> str:
    """The replay validation's comparisons within its target, per split (validation.json)."""
    data = json.loads((root / RESULTS / "replay_validation" / "validation.json").read_text())
    parts = [
        f"{data[key]['all']['within_target']} of {data[key]['all']['n']} {label}"
        for key, label in (("summary_training", "training"), ("summary_held_out", "held-out"))
    ]
    return f"{' and '.join(parts)} comparisons within {data['target'] * 100:g} %"


def _bounded(row: Optional[dict], value: Optional[float]) -> str:
    """A ratio of a to-target row, ``>`` before it where the row's iterations are a lower
    bound (a run that never reached the target); ``-`` without one."""
    if row is None or value is None:
        return "-"
    return f"{'>' if row['lower_bound'] else ''}{value:.2f}x"


def _to_target_cell(row: Optional[dict]) -> str:
    return _bounded(row, row and row["moe_to_target_vs_stock"])


def _iteration_line(data: dict, label: str, noise: str) -> str:
    """One curve set's iteration ratios, with its seeds, keep 1.0's own spread over them and
    the noise of its validation set (``noise``)."""
    parts = []
    for keep, ratio in data["iteration_ratios"].items():
        sign = ">" if ratio["lower_bound"] else ""
        per = ", ".join(f"{v:.2f}" for v in ratio["per_seed"].values())
        parts.append(f"keep {keep} {sign}{ratio['ratio']:.3f}x (seeds: {per})")
    base = data["runs"]["1.0"]
    seeds = ", ".join(str(r["seed"]) for r in base)
    spread = [r["iteration"] for r in base]
    return (f"- {label}, target {data['settings']['target']:g}, seeds {seeds} (keep 1.0 reached "
            f"it in {min(spread):.0f}-{max(spread):.0f} iterations over them; {noise}): "
            + "; ".join(parts) + ".")


def section_replay_at_scale(root: Path) -> str:
    """What LRMoE buys at EP 8-64, predicted: the replay's MoE time per iteration times the
    iterations real runs took to a target loss (benchmarks/replay_to_target.py)."""
    data = {k: json.loads((root / path).read_text()) for k, path in _SCALE_FILES.items()}
    replay, proxy4, memory24 = data["replay"], data["proxy4"], data["memory24"]
    trace = replay["settings"]["trace"]
    out = [
        "## At EP 8-64, predicted: MoE-layer time per iteration and to a target loss",
        "",
        "No GPU here runs EP > 2: these figures are the replay's (docs/replay.md), not "
        "measurements. It shards the routing of "
        + (f"a trace recorded on the GPU ({trace['source']})" if trace.get("source") != "synthetic"
           else f"a synthetic pass (Zipf {trace.get('zipf')}, {trace.get('num_experts')} experts)")
        + f" over P ranks, {trace.get('tokens_per_rank', 'as recorded')} tokens per rank, "
        f"{replay['settings']['layers']} layers, plans every call with the real controller and "
        "prices each rank's forward, backward and exchanges (H200 GEMM times, NVLink within 8 "
        "GPUs, 400 Gb/s per GPU across nodes); the step waits for the slowest rank. Its "
        f"validation against the measured EP 1 and EP 2 runs: {_validation_counts(root)} "
        "(docs/replay.md). The iterations to the target come "
        "from real runs' logs, paired by seed; they are taken to carry over to the larger job. "
        "Only the MoE layers' time is priced: the rest of the iteration is the same in every arm "
        "and not in these ratios. `rep2`: replicas only (keep 1.0, up to 2 replicas per rank; "
        "the SYMI / UltraEP-like baseline). `+recompute`, `+lean`: LRMoE's memory modes "
        "(docs/config.md; `lean` takes no replicas and sends every pair's gradient row at EP > "
        "1); their memory is against stock keeping every activation (the replay does not model "
        "Megatron's own recompute).",
        "",
        "Iterations to the target over keep 1.0, summed over the paired seeds (each seed's own "
        "ratio after it):",
        "",
        _iteration_line(proxy4, "the 4-layer Qwen3 proxy (the training sections above)",
                        "its validation set's noise not measured: 8 batches per evaluation"),
        _iteration_line(memory24, "the 24-layer proxy where memory binds (the time-to-target "
                        "section above; a looser target than its declared ones, which seed "
                        "1234's keep 0.5 did not reach in 300 iterations)",
                        "validation-set standard error 0.5 %"),
        "",
        _source("replay_target", "(the files' commit)",
                "python -m megatron_lrmoe.replay ... --out replay.json; python "
                "benchmarks/replay_to_target.py --replay replay.json --target T --curve 1.0 LOG... "
                "--curve 0.5 LOG... --curve 0.25 LOG... (benchmarks/results/replay_target/README)",
                list(_SCALE_FILES.values())),
        "",
        "| EP | arm | kept | MoE ms/iter | vs stock | memory / network per rank vs stock | "
        "MoE time to target vs stock: 4-layer / 24-layer curves | 4-layer vs replicas only |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ep, rows in proxy4["results"].items():
        deep = memory24["results"].get(ep, {})
        for name, row in rows.items():
            out.append(
                f"| {ep} | {name} | {row['kept_fraction']:.2f} | {row['moe_ms']:.0f} | "
                f"{row['moe_ms_vs_stock']:.2f}x | {row['memory_bytes_vs_stock']:.2f}x / "
                f"{row['network_bytes_vs_stock']:.2f}x | {_to_target_cell(row)} / "
                f"{_to_target_cell(deep.get(name))} | "
                f"{_bounded(row, row.get('moe_to_target_vs_replicas'))} |"
            )
    return "\n".join(
        out + ["", _why_from_phases(replay), "", _skew_table(root), "", _memory_at_scale(root)]
    )


_MEMORY_SCALE = {
    "balanced": _SCALE / "memory_balanced",
    "heavy": _SCALE / "memory_heavy",
}
_MEMORY_ARMS = ("stock+moe", "rep2+moe", "keep0.5+moe", "keep0.5+rep2+moe", "keep0.5+lean",
                "keep0.5+rep2+recompute")


def _training_check(root: Path) -> str:
    """What the replay's validation says of the measured training runs' LRMoE ratios."""
    data = json.loads((root / RESULTS / "replay_validation" / "validation.json").read_text())
    rows = [c for c in data["comparisons"] if c["quantity"] == "moe_vs_baseline"]
    cells = "; ".join(
        f"{c['label']} {c['measured']:.3f}x measured, {c['predicted']:.3f}x predicted"
        for c in rows
        if c["label"] in ("k0.5+moe", "k0.25+moe", "k0.5-recompute")
    )
    return (
        "Caution: in real training (the 24-layer proxy at EP 1, over stock+moe) the replay is "
        f"optimistic: {cells} (docs/replay.md, validation): read the `+moe` ratios here as "
        "upper bounds on the gain."
    )


def _memory_at_scale(root: Path) -> str:
    """Where memory binds, at EP 8-64: the replay's arms under Megatron's MoE-layer recompute
    (``+moe``) and LRMoE's memory modes, against ``stock+moe``, with the 24-layer proxy's
    iterations to the target."""
    out = [
        "Where memory binds, at scale: the MoE layers' memory per rank (48 layers, 16384 tokens "
        "per rank; the rest of the model not counted) and time, against stock's math under "
        "Megatron's MoE-layer recompute (`stock+moe`, the baseline that fits in the measured "
        "proxy). `+moe`: Megatron's MoE-layer recompute on an LRMoE arm (the replay's `moe` "
        "token, validated against the measured stack: docs/replay.md); `lean` and `recompute`: "
        "LRMoE's own modes. Time to target with the 24-layer proxy's two seeds (keep 0.5's "
        "iterations 1.046x keep 1.0's to 1.60). " + _training_check(root),
        "",
        _source("replay_target/memory_*", "(the files' commit)",
                "python -m megatron_lrmoe.replay --synthetic --zipf Z --ep 8 64 --arms stock "
                "stock+moe rep2+moe keep0.5+moe keep0.5+rep2+moe keep0.5+lean "
                "keep0.5+rep2+recompute --out replay.json; python benchmarks/replay_to_target.py "
                "... --replicas-arm rep2+moe (README there)",
                [d / "to_target_memory24.json" for d in _MEMORY_SCALE.values()]),
        "",
        "| routing | EP | arm | MoE memory per rank GiB | vs stock+moe | MoE ms/iter vs "
        "stock+moe | MoE time to target vs stock+moe | vs rep2+moe |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, folder in _MEMORY_SCALE.items():
        replay = json.loads((root / folder / "replay.json").read_text())
        target = json.loads((root / folder / "to_target_memory24.json").read_text())
        zipf = replay["settings"]["trace"]["zipf"]
        for ep, rows in target["results"].items():
            base, rep = rows["stock+moe"], rows["rep2+moe"]
            for name in _MEMORY_ARMS:
                row = rows[name]
                gib = replay["results"][ep][name]["memory_bytes"] / 2**30
                to_t = row["moe_to_target_vs_stock"]
                out.append(
                    f"| {label} (zipf {zipf:g}) | {ep} | {name} | {gib:.1f} | "
                    f"{row['memory_bytes_vs_stock'] / base['memory_bytes_vs_stock']:.2f}x | "
                    f"{row['moe_ms_vs_stock'] / base['moe_ms_vs_stock']:.2f}x | "
                    f"{_bounded(row, to_t / base['moe_to_target_vs_stock'])} | "
                    f"{_bounded(row, to_t / rep['moe_to_target_vs_stock'])} |"
                )
    return "\n".join(out)


def _why_from_phases(replay: dict) -> str:
    """Why the arms land where they do, from the replay's phases of the slowest rank."""
    eps = list(replay["results"])
    lo, hi = replay["results"][eps[0]], replay["results"][eps[-1]]

    def forward(arm: dict) -> float:
        return sum(arm["phase_ms"][p] for p in FORWARD_PHASES)

    def exchanges(arm: dict) -> float:
        return sum(arm["phase_ms"][p] for p in ("dispatch", "combine", "grad", "dgrad"))

    share = [forward(r["stock"]) / r["stock"]["moe_ms"] for r in (lo, hi)]
    floor = [forward(r["keep0.5+rep2"]) / r["rep2"]["moe_ms"] for r in (lo, hi)]
    xch = [exchanges(r["keep0.5+rep2"]) / r["keep0.5+rep2"]["moe_ms"] for r in (lo, hi)]
    host = lo["keep0.25+rep2"]["phase_ms"]["host_bwd"]
    gain = lo["keep0.25+rep2"]["moe_ms"] / lo["keep0.5+rep2"]["moe_ms"]
    quarter = "" if gain < 0.95 or host <= 0 else (
        f" At EP {eps[0]} keep 0.25 gains little over keep 0.5 ({gain:.2f}x): its backward's GPU "
        f"work falls under the host's floor for the trimmed backward ({host:.0f} ms of host "
        "time in the pass; the floor is fitted to EP 2 runs, docs/replay.md)."
    )
    return (
        f"Why, from the model's phases (the slowest rank's; EP {eps[0]} / {eps[-1]} above): the "
        f"forward (router, dispatch, expert GEMMs, combine, the host's launches) is "
        f"{share[0]:.0%} / {share[1]:.0%} of stock's MoE time and the same at every keep ratio; "
        "the keep ratio shrinks only the backward's exchanges and GEMMs, so with replicas keep "
        f"0.5 cannot go below {floor[0]:.2f}x / {floor[1]:.2f}x of replicas only whatever it "
        f"drops. At EP {eps[-1]} the all-to-alls are {xch[1]:.0%} of keep 0.5's time (at EP "
        f"{eps[0]}, within NVLink, {xch[0]:.0%}). Without replicas the keep ratio leaves stock's "
        f"forward peak as it is ({lo['keep0.5']['forward_peak_rows']:.0f} pairs on the busiest "
        f"rank at EP {eps[0]} against {lo['keep0.5+rep2']['forward_peak_rows']:.0f} with "
        "replicas): that is why keep 0.5 alone falls behind replicas only wherever the routing "
        "is skewed." + quarter
    )


def _skew_table(root: Path) -> str:
    """The replay's figures over routings of growing skew (synthetic passes, 4-layer curves)."""
    out = [
        "How the routing's skew changes it: the same replay of synthetic passes from balanced to "
        "the heavy one above (expert popularity `rank^-zipf` over a random order, times a Gamma "
        "draw of coefficient of variation `gamma_cv`; each source rank perturbs it by "
        "`source_cv`), MoE time to the target with the 4-layer proxy's curves. A real trace "
        "places a run on this scale (stock's forward imbalance: the busiest rank's pairs over "
        "the mean).",
        "",
        _source("replay_target/skew_*", "(the files' commit)",
                "python -m megatron_lrmoe.replay --synthetic --zipf Z --gamma-cv G --ep 8 16 32 "
                "64 --arms stock rep2 keep0.5 keep0.25 keep0.5+rep2 keep0.25+rep2 --out "
                "replay.json; python benchmarks/replay_to_target.py ... (README there)",
                list(_SKEWS.values())),
        "",
        "| routing | EP | stock's forward imbalance | replicas only vs stock | keep 0.5 vs stock | "
        "keep 0.5 + replicas vs replicas only | keep 0.25 + replicas vs replicas only |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, path in _SKEWS.items():
        data = json.loads((root / path).read_text())
        trace = data["settings"]["replay_settings"]["trace"]
        name = (f"{label}: zipf {trace['zipf']:g}, gamma_cv {trace['gamma_cv']:g}, "
                f"source_cv {trace['source_cv']:g}")
        for ep, rows in data["results"].items():
            out.append(
                f"| {name} | {ep} | {rows['stock']['forward_imbalance']:.2f} | "
                f"{_to_target_cell(rows['rep2'])} | {_to_target_cell(rows['keep0.5'])} | "
                f"{rows['keep0.5+rep2']['moe_to_target_vs_replicas']:.2f}x | "
                f"{rows['keep0.25+rep2']['moe_to_target_vs_replicas']:.2f}x |"
            )
    return "\n".join(out)


SECTIONS: list[Callable[[Path], str]] = [
    section_stacked,
    section_memory,
    section_training_half,
    section_training_quarter,
    section_memory_bound,
    section_time_to_target,
    section_replay_at_scale,
    section_glm,
    section_layer,
    section_planner,
]


def results_md(root: Path) -> str:
    """docs/results.md: a short header, then every section of SECTIONS."""
    header = "\n".join(
        [
            "# Results: the current figures",
            "",
            f"<!-- Generated by `{REGENERATE}` from committed files under benchmarks/results/: "
            "do not edit by hand. -->",
            "",
            "GPU: NVIDIA H200 (an H100 80GB where a section says so), torch 2.11.0+cu130, "
            "megatron-core 0.19.2, no Transformer Engine, "
            "no Apex, bf16. Each section names the run, the code and the command behind its "
            "table, and each row its file (paths under `benchmarks/results/`). How the figures "
            "came about, and older ones: [history/notebook.md](history/notebook.md); the "
            "benchmark scripts: [../benchmarks/README.md](../benchmarks/README.md).",
        ]
    )
    return "\n\n".join([header, *(section(root) for section in SECTIONS)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "run", type=Path, nargs="*", help="benchmarks/results/gpu_run* folders or train_*.log files"
    )
    parser.add_argument(
        "--results-md",
        type=Path,
        metavar="PATH",
        help="write the current figures (docs/results.md) from this checkout's committed results",
    )
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--target", type=float, default=1.75, help="target validation loss")
    parser.add_argument(
        "--vs-keep1", action="store_true", help="ratios to the keep-1.0 run of the same seed"
    )
    args = parser.parse_args()
    if args.results_md is not None:
        args.results_md.write_text(results_md(Path(__file__).resolve().parents[1]), "utf-8")
        print(f"wrote {args.results_md}")
        if not args.run:
            return
    elif not args.run:
        parser.error("give result folders or train_*.log files, or --results-md PATH")
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
