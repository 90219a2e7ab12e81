"""LRMoE against stock's best configuration that fits, on one GPU whose memory is capped.

    python benchmarks/memory_bound.py search   --out DIR [--cap-gib 78 | --gpu-gib 79.18] [--arms ...]
                                               [--dry-run]
    python benchmarks/memory_bound.py converge --out DIR [--cap-gib 78 | --gpu-gib 79.18]
                                               [--seeds 1234 4321 2024]
                                               [--iters 400] [--arms ...]  (default: search's picks)
    python benchmarks/memory_bound.py report   --out DIR [--target LOSS]
    python benchmarks/memory_bound.py all      --out DIR ...            (the three in order)

The question: where a GPU's memory cannot hold the whole backward, stock Megatron must recompute
(part of) its layers or shrink its micro-batch; how long does LRMoE take to a target validation
loss there, against the fastest stock configuration that fits?

The proxy (``PROXY``; launched through ``examples/qwen3_30b_a3b/pretrain.sh``): one GPU's share
of a Qwen3-30B-A3B job at EP 8: the real MoE layer (hidden 2048, expert FFN 768, top-8) with 16
experts per layer (128 / 8: the same pairs per expert and per GPU as the full model at EP 8),
``--layers`` layers (24: with 16384 tokens per micro-batch the full backward needs about 100 GB,
so an 80 GB card cannot hold it), Qwen3's attention (32 heads, 4 groups, QK-norm), sequences of
1024 tokens (short, so that Megatron's unfused local attention does not dominate the iteration as
it does at 4096; its scores are recomputed in every arm, ``--recompute-modules core_attn``), a
512-word vocabulary over byte-level text (the Python standard library's sources,
``examples/make_indexed_dataset.py``), 16 sequences (16384 tokens) per iteration. The MoE layers'
share of an iteration is printed by every run (``--moe-layer-timing``) and reported.

How representative the MoE layers' share is, estimated from forward FLOPs per token and layer:
attention projections 2*2048*(4096+512+512) + 2*4096*2048 = 37.7 M, causal attention 8192*s
(s the sequence: 33.6 M at 4096, 8.4 M at 1024), experts 8 * (2*2048*1536 + 2*768*2048) = 75.5 M,
router 2*2048*E. The full model at sequence 4096: 52 % of the FLOPs in the MoE layers; this proxy
at 1024: 62 %. The time share measured in the proxy is lower (24-32 % in gpu_run33's search):
without Transformer Engine the rest of the layer (unfused attention softmax, norms, RoPE) and
the optimizer step run far below the GPU's peak, so what the MoE layers save weighs less in the
iteration here than it would where the rest is fused.

Arms (``ARMS``): "stock" is the stock math with grouped-GEMM experts, i.e. LRMoE at keep 1.0
(numerically stock Megatron, tests/test_layer.py); without Transformer Engine Megatron-Core's own
experts are ``SequentialMLP``, a loop over the experts, listed as "megatron-sequential" for
reference. Each arm sets Megatron's recompute (``none``: attention scores only; ``moe``:
Megatron's selective recompute of the whole MoE layer; ``full``: every transformer layer), the
micro-batch (tokens per iteration fixed) and, for LRMoE, the keep ratio (``auto0.1``: keep ratio
"auto" at a variance target of 0.1, issue 38) and ``--lrmoe-activation-mode`` (``-lean``: the
activation kept instead of the expert output, F = 768 against H = 2048 per pair). There is no ``moe_act`` arm: LRMoE's experts never keep the
activation's output (they recompute it in the backward, as Megatron's ``moe_act`` recompute does;
``tests/test_layer_robustness.py::test_experts_never_save_the_activation_output``), and Megatron
allows ``moe_act`` only with ``--moe-grouped-gemm``, which needs Transformer Engine here.

Phases:
* ``search``: every arm for ``--search-iters`` iterations under the cap; an arm fits when it
  finishes without running out of memory. Writes ``search.json``: per arm its peak allocated
  memory, median time per iteration and MoE-layer time per iteration (from iteration 4), and the
  picks: the fastest fitting stock arm (the baseline) and, per keep ratio, the fastest fitting
  LRMoE arm.
* ``converge``: the picked arms (or ``--arms``), each seed alone on the GPU under the cap (so
  their times are the arms' own), ``--iters`` iterations, a fixed held-out validation set
  (``--full-validation``: every evaluation reads the same ~1200 sequences; each evaluation prints
  the standard error of its mean, ``megatron_lrmoe/training/validation_spread.py``; read in
  micro-batches of 32 through ``compat.fix_full_validation``, where megatron-core 0.19.2 reads
  one sequence per forward pass), ``--evaluations`` evaluations per run (default four). A log
  that already finished is kept: the phase can be spread over several calls or sessions.
* ``report``: ``summary.json`` and ``loss_vs_time.png``: per arm and seed the iterations, the
  wall time and the MoE layers' time to the target validation loss (iteration 1, which
  compiles Triton kernels, left out and reported apart; ``benchmarks/train_logs.py``), the final
  validation loss and its standard error, and per arm the mean and spread over seeds and the
  ratios of the means to the baseline's. ``--target`` defaults to 1 % above the baseline's mean
  final validation loss.

Every log, the JSON and the plot go to ``--out``. Needs a CUDA GPU (``--dry-run`` prints the
launch commands anywhere) and megatron-core 0.19.2 importable with this checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_logs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "examples" / "qwen3_30b_a3b" / "pretrain.sh"
DATA_PREFIX = ROOT / ".data" / "pystdlib_bytes"

PROXY: dict[str, str] = {
    "GPUS_PER_NODE": "1",
    "NNODES": "1",
    "TP": "1",
    "PP": "1",
    "EP": "1",
    "SEQ_LENGTH": "1024",
    "GBS": "16",
    "TRANSFORMER_IMPL": "local",
    "LR": "5e-4",
    "MIN_LR": "5e-5",
    "LOG_INTERVAL": "1",
}
PROXY_FLAGS: tuple[str, ...] = ("--num-experts", "16", "--vocab-size", "512", "--moe-layer-timing")
# 20 % of the ~12 MB of text held out: about 1200 sequences of 1024 tokens. gpu_run33's pilot
# (12 %: 696 sequences) measured a per-sequence loss spread of 13 % of the loss, a relative
# standard error of 0.49 %; 1200 sequences bring it to about 0.38 %.
SPLIT = "80,20,0"
# Evaluation batches of 32 sequences (forward only: no activations are kept, the cap holds).
EVAL_FLAGS: tuple[str, ...] = ("--eval-global-batch-size", "32", "--eval-micro-batch-size", "32")


@dataclass(frozen=True)
class Arm:
    """One configuration.

    Attributes:
        name: Its label in logs, JSON and plots.
        lrmoe: LRMoE layers (False: Megatron's own, ``SequentialMLP`` without TE).
        keep: LRMoE keep ratio (1.0: the stock math), or "auto" with ``variance_target``.
        recompute: Megatron's recompute: "none", "moe_act", "moe" or "full".
        mbs: Sequences per micro-batch (``PROXY``'s GBS per iteration stays).
        activation_mode: ``--lrmoe-activation-mode``.
        variance_target: ``--lrmoe-variance-target`` (with ``keep="auto"``).
        budget_keep: ``--lrmoe-memory-budget-bytes`` set to what keep ``budget_keep`` plans per
            layer call in this arm's activation mode (:func:`budget_bytes`): the arm keeps more
            pairs than that keep ratio only in calls where they fit in what it holds.
    """

    name: str
    lrmoe: bool = True
    keep: float | str = 1.0
    recompute: str = "none"
    mbs: int = 16
    activation_mode: str = "save"
    variance_target: Optional[float] = None
    budget_keep: Optional[float] = None

    @property
    def is_stock(self) -> bool:
        return not self.lrmoe or (self.keep != "auto" and float(self.keep) >= 1.0)

    def env(self) -> dict[str, str]:
        env = {"LRMOE": "1" if self.lrmoe else "0", "MBS": str(self.mbs)}
        if self.lrmoe:
            env.update(KEEP_RATIO=str(self.keep), ACTIVATION_MODE=self.activation_mode)
            if self.variance_target is not None:
                env.update(VARIANCE_TARGET=str(self.variance_target))
        return env

    def flags(self) -> list[str]:
        budget = []
        if self.budget_keep is not None:
            tokens = self.mbs * int(PROXY["SEQ_LENGTH"])
            budget = ["--lrmoe-memory-budget-bytes",
                      str(budget_bytes(self.activation_mode, self.budget_keep, tokens))]
        return self._recompute_flags() + budget

    def _recompute_flags(self) -> list[str]:
        if self.recompute == "full":
            return [
                "--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1",
            ]
        if self.recompute not in ("none", "moe"):
            raise ValueError(f"arm {self.name}: recompute {self.recompute!r} is not one of none, "
                             "moe, full")
        modules = ["core_attn"] + ([] if self.recompute == "none" else [self.recompute])
        return ["--recompute-granularity", "selective", "--recompute-modules", *modules]


def budget_bytes(mode: str, keep: float, tokens: int) -> int:
    """Bytes one layer call of the proxy plans to hold for its backward (what
    ``--lrmoe-memory-budget-bytes`` limits) at keep ratio ``keep`` in ``mode``, from the
    controller's own plan of a balanced call (``tokens`` per micro-batch, every expert the same
    pairs), so that a budget of this size lets the arm hold what that keep ratio holds."""
    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.control.controller import plan_call
    import torch

    from megatron_lrmoe.control.costs import CostModel

    experts, topk = int(PROXY_FLAGS[PROXY_FLAGS.index("--num-experts") + 1]), 8
    cost = CostModel(hidden_size=2048, ffn_hidden_size=768, gated=True, activation_bytes=2,
                     param_bytes=2, grad_bytes=4)
    counts = torch.full((1, experts), tokens * topk // experts, dtype=torch.int64)
    lrmoe = LRMoEConfig(keep_ratio=keep, activation_mode=mode, memory_budget_bytes=1 << 62)
    return int(plan_call(counts, 0, lrmoe, cost).memory.budgeted_bytes.max())


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("stock"),
        Arm("stock+moe", recompute="moe"),
        Arm("stock+full", recompute="full"),
        Arm("stock-mbs8", mbs=8),
        Arm("stock-mbs8+moe", mbs=8, recompute="moe"),
        Arm("megatron-sequential+moe", lrmoe=False, recompute="moe"),
        Arm("k0.5", keep=0.5),
        Arm("k0.5-recompute", keep=0.5, activation_mode="recompute"),
        Arm("k0.5+moe", keep=0.5, recompute="moe"),
        Arm("k0.25-recompute", keep=0.25, activation_mode="recompute"),
        Arm("k0.5-lean", keep=0.5, activation_mode="lean"),
        Arm("k0.25-lean", keep=0.25, activation_mode="lean"),
        Arm("k0.25+moe", keep=0.25, recompute="moe"),
        Arm("auto0.1-recompute", keep="auto", variance_target=0.1, activation_mode="recompute"),
        Arm("auto0.1-recompute-mem0.5", keep="auto", variance_target=0.1,
            activation_mode="recompute", budget_keep=0.5),
    )
}


@dataclass(frozen=True)
class Run:
    """One launch: an arm, a seed, its iterations and where its log goes."""

    arm: Arm
    seed: int
    iters: int
    log: Path
    cap_gib: Optional[float]
    layers: int
    evaluate: bool
    evaluations: int = 4
    gpu_gib: Optional[float] = None
    extra_flags: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        env = dict(PROXY)
        env.update(self.arm.env())
        env.update(
            NUM_LAYERS=str(self.layers),
            TRAIN_ITERS=str(self.iters),
            SEED=str(self.seed),
            # 5 % of the run, at most 30 (Megatron needs the warm-up shorter than the run).
            WARMUP_ITERS=str(max(1, min(30, self.iters // 20))),
            DATA_PREFIX=str(DATA_PREFIX),
            DATA_CACHE="/tmp/lrmoe_memory_bound_cache",
        )
        if self.evaluate:
            interval = max(1, self.iters // max(1, self.evaluations))
            env.update(EVAL_INTERVAL=str(interval), EVAL_ITERS="1")
        else:  # no evaluation inside the run (the one after it reads a single batch)
            env.update(EVAL_INTERVAL=str(self.iters + 1), EVAL_ITERS="1")
        if self.cap_gib is not None:
            env["MEMORY_CAP_GIB"] = f"{self.cap_gib:g}"
        if self.gpu_gib is not None:
            env["GPU_MEMORY_GIB"] = f"{self.gpu_gib:g}"
        return env

    def flags(self) -> list[str]:
        flags = [*PROXY_FLAGS, *self.arm.flags(), "--split", SPLIT]
        if self.evaluate:
            flags += ["--full-validation", *EVAL_FLAGS]
        return flags + list(self.extra_flags)

    def command(self) -> list[str]:
        return ["bash", str(LAUNCH), *self.flags()]

    def describe(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env().items()))
        return f"{env} {shlex.join(self.command())} > {self.log}"


def ensure_data(out: Path) -> None:
    """The byte-level dataset ``DATA_PREFIX`` (written once, about 12 MB)."""
    if DATA_PREFIX.with_suffix(".bin").exists():
        return
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_indexed_dataset.py"),
         "--output-prefix", str(DATA_PREFIX), "--max-bytes", "12000000"],
        check=True, stdout=open(out / "dataset.log", "w"), stderr=subprocess.STDOUT,
    )


def launch(run: Run, timeout_s: float, dry_run: bool) -> Optional[train_logs.RunLog]:
    """Run one launch to its log (or print it with ``dry_run``)."""
    if dry_run:
        print(run.describe())
        return None
    run.log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **run.env()}
    started = time.time()
    with open(run.log, "w") as log:
        try:
            code = subprocess.run(
                run.command(), env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                cwd=ROOT,
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        log.write(f"\nmemory_bound: exit {code} after {time.time() - started:.0f} s\n")
    return train_logs.parse_log(run.log)


def file_stem(name: str) -> str:
    """An arm's name as a file name: letters, digits, '.', '_' and '-' only (the device tool
    brings back no file whose name holds a '+')."""
    return name.replace("+", "_with_")


def arms_named(names: Sequence[str]) -> list[Arm]:
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise SystemExit(f"memory_bound.py: unknown arm(s) {unknown}; known: {list(ARMS)}")
    return [ARMS[n] for n in names]


# -- search ------------------------------------------------------------------------------------


def search_row(arm: Arm, run: train_logs.RunLog) -> dict:
    """One arm's search figures."""
    iter_ms, moe_ms = run.steady_ms("iter_ms"), run.steady_ms("moe_ms")
    return {
        "arm": asdict(arm),
        "log": os.path.relpath(run.path, ROOT),
        "fits": run.finished,
        "oom": run.oom,
        "oom_memory": asdict(run.oom_memory) if run.oom_memory is not None else None,
        "iterations": run.last_iteration,
        "memory_cap_gib": run.memory_cap_gib,
        "gpu_memory_gib": run.gpu_memory_gib,
        "max_allocated_gib": None if run.max_allocated_mib is None else run.max_allocated_mib / 1024,
        "alloc_retries": run.alloc_retries,
        "iter_ms": iter_ms,
        "moe_ms": moe_ms,
        "moe_share": None if not (iter_ms and moe_ms) else moe_ms / iter_ms,
        "first_iteration_s": run.iter_ms.get(1, 0.0) / 1e3 if run.iter_ms else None,
    }


def picks(rows: Sequence[dict]) -> dict[str, Optional[str]]:
    """The fastest fitting stock arm ("baseline") and the fastest fitting LRMoE arm per keep
    ratio (``"keep 0.5"``), by median time per iteration; None where nothing fits."""
    best: dict[str, tuple[float, str]] = {}
    for row in rows:
        if not row["fits"] or row["iter_ms"] is None:
            continue
        arm = row["arm"]
        # The baseline is the stock math on grouped GEMMs; Megatron's SequentialMLP is listed only.
        if arm["lrmoe"] and arm["keep"] >= 1.0:
            key = "baseline"
        elif arm["lrmoe"]:
            key = f"keep {arm['keep']:g}"
        else:
            continue
        if key not in best or row["iter_ms"] < best[key][0]:
            best[key] = (row["iter_ms"], arm["name"])
    return {key: name for key, (_, name) in sorted(best.items())}


def search(args: argparse.Namespace) -> dict:
    """Run the arms not yet in ``search.json`` (all of them with ``--redo``) and merge: the
    search can be spread over several calls."""
    path = args.out / "search.json"
    done: dict[str, dict] = {}
    if path.exists() and not args.redo:
        previous = json.loads(path.read_text())
        was = (previous["cap_gib"], previous.get("gpu_gib"), previous["layers"])
        if was != (args.cap_gib, args.gpu_gib, args.layers):
            raise SystemExit(
                f"memory_bound.py: {path} was searched at cap {previous['cap_gib']} GiB, card "
                f"{previous.get('gpu_gib')} GiB and {previous['layers']} layers, not "
                f"{args.cap_gib}, {args.gpu_gib} and {args.layers}; use another --out or --redo"
            )
        done = {row["arm"]["name"]: row for row in previous["arms"]}
    for arm in arms_named(args.arms or list(ARMS)):
        if arm.name in done:
            print(f"kept {arm.name} (in {path})")
            continue
        run = Run(arm, args.seeds[0], args.search_iters, args.out / "search" / f"{file_stem(arm.name)}.log",
                  args.cap_gib, args.layers, evaluate=False, gpu_gib=args.gpu_gib,
                  extra_flags=tuple(shlex.split(args.megatron_args)))
        parsed = launch(run, args.timeout_s, args.dry_run)
        if parsed is not None:
            done[arm.name] = search_row(arm, parsed)
            print(json.dumps(done[arm.name]), flush=True)
            _write_search(path, args, done)  # after every arm: a stopped call keeps its arms
    return _write_search(path, args, done) if not args.dry_run else {}


def _write_search(path: Path, args: argparse.Namespace, done: dict[str, dict]) -> dict:
    rows = list(done.values())
    result = {"cap_gib": args.cap_gib, "gpu_gib": args.gpu_gib, "layers": args.layers, "proxy": PROXY,
              "proxy_flags": list(PROXY_FLAGS), "megatron_args": args.megatron_args, "arms": rows,
              "picks": picks(rows)}
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


# -- converge ----------------------------------------------------------------------------------


def converge_arms(args: argparse.Namespace) -> list[Arm]:
    if args.arms:
        return arms_named(args.arms)
    path = args.out / "search.json"
    if not path.exists():
        raise SystemExit(f"memory_bound.py: no {path}; run the search first or name --arms")
    chosen = json.loads(path.read_text())["picks"]
    return arms_named([name for name in chosen.values() if name])


def converge(args: argparse.Namespace) -> None:
    for seed in args.seeds:  # seed-major: a call that stops early leaves whole seeds behind
        for arm in converge_arms(args):
            log = args.out / "converge" / f"{file_stem(arm.name)}_seed{seed}.log"
            if log.exists() and train_logs.parse_log(log).finished:
                print(f"kept {log} (finished)")
                continue
            run = Run(arm, seed, args.iters, log, args.cap_gib, args.layers, evaluate=True,
                      evaluations=args.evaluations, gpu_gib=args.gpu_gib,
                      extra_flags=tuple(shlex.split(args.megatron_args)))
            parsed = launch(run, args.timeout_s, args.dry_run)
            if parsed is not None:
                print(json.dumps(train_logs.summary(parsed, None)), flush=True)


# -- report ------------------------------------------------------------------------------------


def arm_of(log: Path) -> str:
    """The arm a ``converge/<stem>_seed<N>.log`` belongs to (its stem if no arm has it)."""
    stem = log.stem.rsplit("_seed", 1)[0]
    return next((name for name in ARMS if file_stem(name) == stem), stem)


def report(args: argparse.Namespace) -> dict:
    logs = sorted((args.out / "converge").glob("*_seed*.log"))
    runs = {log: train_logs.parse_log(log) for log in logs}
    by_arm: dict[str, list[train_logs.RunLog]] = {}
    for log, run in runs.items():
        by_arm.setdefault(arm_of(log), []).append(run)
    search_path = args.out / "search.json"
    chosen = json.loads(search_path.read_text())["picks"] if search_path.exists() else {}
    baseline = chosen.get("baseline") or next((a for a in by_arm if ARMS.get(a, Arm(a)).is_stock), None)
    target = args.target
    if target is None and baseline in by_arm:
        finals = [r.val[max(r.val)] for r in by_arm[baseline] if r.val]
        target = statistics.fmean(finals) * 1.01 if finals else None
    arms = {}
    for name, arm_runs in sorted(by_arm.items()):
        seeds = [train_logs.summary(r, target) for r in arm_runs]
        reached = [s["to_target"] for s in seeds]

        def over(key: str, rows=reached) -> dict:
            return asdict(train_logs.spread([None if r is None else r[key] for r in rows]))

        arms[name] = {
            "seeds": seeds,
            "final_val_loss": asdict(train_logs.spread([s["final_val_loss"] for s in seeds])),
            "val_relative_se": asdict(train_logs.spread([s["val_relative_se"] for s in seeds])),
            "iterations_to_target": over("iteration"),
            "moe_s_to_target": over("moe_s"),
            "wall_s_to_target": over("wall_s"),
            "first_iteration_s": asdict(train_logs.spread([s["first_iteration_s"] for s in seeds])),
            "iter_ms": asdict(train_logs.spread([s["iter_ms_median"] for s in seeds])),
            "moe_ms": asdict(train_logs.spread([s["moe_ms_median"] for s in seeds])),
            "max_allocated_gib": max(
                (s["max_allocated_mib"] / 1024 for s in seeds if s["max_allocated_mib"]),
                default=None,
            ),
        }
    for name, row in arms.items():
        base = arms.get(baseline)
        row["vs_baseline"] = None if base is None else {
            key: _ratio(row[key]["mean"], base[key]["mean"])
            for key in ("moe_s_to_target", "wall_s_to_target", "final_val_loss", "iter_ms", "moe_ms")
        }
        # Seed by seed against the baseline's run of the same seed (same data order and weights
        # at the start): the pairs' spread is the noise the comparison carries.
        row["moe_s_to_target_vs_baseline_by_seed"] = None if base is None else _paired(
            row["seeds"], base["seeds"]
        )
    result = {"target": target, "baseline": baseline, "picks": chosen, "arms": arms}
    (args.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, target, args.out / "loss_vs_time.png")
    print(table(result))
    return result


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def _paired(seeds: Sequence[dict], base_seeds: Sequence[dict]) -> dict[str, Optional[float]]:
    """``{seed: MoE time to target over the baseline's of that seed}`` (None where either run
    missed the target or the baseline has no run of that seed)."""
    base = {s["seed"]: s["to_target"] for s in base_seeds}
    out: dict[str, Optional[float]] = {}
    for s in seeds:
        mine, theirs = s["to_target"], base.get(s["seed"])
        out[str(s["seed"])] = (
            None if mine is None or theirs is None else _ratio(mine["moe_s"], theirs["moe_s"])
        )
    return out


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(result: dict) -> str:
    """The summary as a Markdown table (means over seeds, with min-max)."""
    def cell(s: dict, fmt: str = "{:.1f}") -> str:
        if s["mean"] is None:
            return "not reached" if s["missing"] else "-"
        text = fmt.format(s["mean"])
        if s["n"] > 1:
            text += f" ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
        if s["missing"]:
            text += f", {s['missing']} not reached"
        return text

    target = "target" if result["target"] is None else f"val {result['target']:.4f}"
    lines = [
        f"| arm | seeds | MoE s to {target} | wall s to it | iterations to it | final val "
        "loss | its SE | ms/iter | MoE ms/iter | peak GiB | MoE time to target vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["arms"].items():
        ratio = (row["vs_baseline"] or {}).get("moe_s_to_target")
        lines.append(
            f"| {name} | {row['final_val_loss']['n']} | {cell(row['moe_s_to_target'])} | "
            f"{cell(row['wall_s_to_target'])} | {cell(row['iterations_to_target'], '{:.0f}')} | "
            f"{cell(row['final_val_loss'], '{:.4f}')} | {cell(row['val_relative_se'], '{:.2%}')} | "
            f"{cell(row['iter_ms'], '{:.0f}')} | {cell(row['moe_ms'], '{:.0f}')} | "
            f"{_num(row['max_allocated_gib'], '{:.1f}')} | {_num(ratio, '{:.3f}x')} |"
        )
    return "\n".join(lines)


def plot(runs: dict[Path, train_logs.RunLog], target: Optional[float], path: Path) -> None:
    """Validation loss against the MoE layers' cumulative time and against wall time."""
    if not runs:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors: dict[str, str] = {}
    for log, run in runs.items():
        arm = arm_of(log)
        label = None if arm in colors else arm  # one legend entry per arm, one line per seed
        color = colors.setdefault(arm, f"C{len(colors)}")
        its = sorted(run.val)
        for ax, series in zip(axes, (run.moe_ms, run.iter_ms)):
            xs = [train_logs.cumulative(series, i) / 1e3 for i in its]
            ax.plot(xs, [run.val[i] for i in its], color=color, marker=".", linewidth=1,
                    label=label)
    for ax, what in zip(axes, ("MoE layers' cumulative time (s, from iteration 2)",
                               "wall time (s, Megatron's per-iteration times, from iteration 2)")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=0.8,
                       label=f"target {target:.4f}")
        ax.set_xlabel(what)
        ax.set_ylabel("validation loss (fixed held-out set)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- command line ------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("phase", choices=("search", "converge", "report", "all"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cap-gib", type=float, default=None,
                   help="PyTorch allocator's cap per process, GiB (default 78 unless --gpu-gib; "
                   "0: none); what the process holds outside the allocator is not counted")
    p.add_argument("--gpu-gib", type=float, default=None,
                   help="emulate a card of this many GiB whole (--gpu-memory-gib; 79.18: an "
                   "H100 80GB), instead of --cap-gib")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--arms", nargs="*", default=None, help=f"from {list(ARMS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 4321, 2024])
    p.add_argument("--iters", type=int, default=400,
                   help="converge: iterations per run (400: about 0.9 s each at 24 layers, with "
                   "four evaluations, fit one 10-minute device call)")
    p.add_argument("--evaluations", type=int, default=4,
                   help="converge: evaluations of the fixed validation set per run, evenly spaced")
    p.add_argument("--search-iters", type=int, default=10)
    p.add_argument("--target", type=float, default=None,
                   help="report: target validation loss (default: 1 %% above the baseline's mean "
                   "final validation loss)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per launch")
    p.add_argument("--megatron-args", default="",
                   help="search, converge: more Megatron flags for every launch, one string (e.g. "
                   "the profiler's: \"--profile --use-pytorch-profiler --profile-step-start 10 "
                   "--profile-step-end 12 --tensorboard-dir DIR/tb\")")
    p.add_argument("--redo", action="store_true",
                   help="search: run every arm again (default: keep the arms in search.json)")
    p.add_argument("--dry-run", action="store_true", help="print the launch commands only")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parser().parse_args(argv)
    if args.gpu_gib is not None and args.cap_gib not in (None, 0):
        raise SystemExit(f"memory_bound.py: --cap-gib {args.cap_gib} and --gpu-gib "
                         f"{args.gpu_gib} both limit the memory; give one")
    if args.cap_gib is None and args.gpu_gib is None:
        args.cap_gib = 78.0
    if args.cap_gib == 0:
        args.cap_gib = None
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and args.phase in ("search", "converge", "all"):
        ensure_data(args.out)
    if args.phase in ("search", "all"):
        search(args)
    if args.phase in ("converge", "all"):
        converge(args)
    if args.phase in ("report", "all") and not args.dry_run:
        report(args)


if __name__ == "__main__":
    main()
