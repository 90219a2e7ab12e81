"""Training logs of ``pretrain_lrmoe.py`` as numbers: per-iteration times, losses, memory, and the
time to a target validation loss with its spread over seeds.

    python benchmarks/train_logs.py --target 1.75 LOG [LOG ...]      # one row per log, JSON

What a log holds (Megatron 0.19.2's lines, ``--log-interval 1``, plus ours):

* Megatron's iteration line: ``iteration I/N | ... elapsed time per iteration (ms): X | ... lm
  loss: L |`` (training loss of that iteration).
* ``--moe-layer-timing``'s line: ``iteration I/N | moe layers: X ms/iter | moe layers
  cumulative: S s | max allocated: M MiB | alloc retries: R |`` (the last two on CUDA only).
* ``validation loss at iteration I | lm loss value: L`` (Megatron; the run's final evaluation
  "on validation set" too), preceded by ``validation spread | sequences: n | loss std: s |
  standard error: e |`` (``pretrain_lrmoe.py``: the per-sequence losses of that evaluation,
  ``megatron_lrmoe/training/validation_spread.py``).
* the argument dump (``  name ......... value``), which names the seed, the keep ratio, the
  recompute settings and the memory cap, and ``memory cap: ...`` / out-of-memory errors.

Time to target. The iteration at which the validation loss first reaches the target is found by
linear interpolation between consecutive evaluations (:func:`crossing`); the wall time and the
MoE layers' time to it are the per-iteration times summed up to that fractional iteration.
Iteration 1 is left out of both and reported apart (``first_iteration_s``): it carries one-off
work (Triton compiling into the cache, CUDA graph capture, allocator warm-up) whose size depends
on what ran before on the machine, not on the arm.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

__all__ = [
    "RunLog",
    "Spread",
    "ToTarget",
    "crossing",
    "cumulative",
    "parse_log",
    "spread",
    "time_to_target",
]

_ITER = re.compile(
    r"(?:\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] )?"
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples.*?per iteration \(ms\): ([\d.]+)"
    r"(?:.*?lm loss: ([\d.E+-]+))?"
)
_MOE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \| moe layers: ([\d.]+) ms/iter \| moe layers cumulative: "
    r"([\d.]+) s \|(?: max allocated: (\d+) MiB \|)?(?: alloc retries: (\d+) \|)?"
)
_VAL = re.compile(r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: ([\d.E+-]+)")
_SPREAD = re.compile(
    r"validation spread \| sequences: (\d+) \| loss std: ([\d.E+-]+) \| "
    r"standard error: ([\d.E+-]+)"
)
_EVAL = re.compile(r"validation loss at iteration (\d+)( on validation set| on test set)? \|")
_ARG = re.compile(r"^  (\w+) \.+ (.*\S)\s*$", re.MULTILINE)
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
_CAP = re.compile(r"memory cap: ([\d.]+) GiB")
_CARD = re.compile(r"gpu memory: ([\d.]+) GiB card emulated")
_SIZE = r"([\d.]+) (GiB|MiB|KiB|bytes)"
# PyTorch's out-of-memory message: the device, this process and the caching allocator.
_OOM_DETAIL = re.compile(
    rf"total capacity of {_SIZE} of which {_SIZE} is free\. Including non-PyTorch memory, this "
    rf"process has {_SIZE} memory in use\..*?Of the allocated memory {_SIZE} is allocated by "
    rf"PyTorch, (?:with {_SIZE} allocated in private pools \(e\.g\., CUDA Graphs\), )?and "
    rf"{_SIZE} is reserved by PyTorch but unallocated"
)
_UNIT_GIB = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2, "bytes": 1 / 1024**3}


@dataclass(frozen=True)
class OomMemory:
    """What PyTorch's first out-of-memory message in a log says about the device, GiB.

    Attributes:
        total_gib: The device's memory.
        free_gib: Free on the device when the allocation failed.
        in_use_gib: This process's use, what it holds outside PyTorch's allocator included.
        allocated_gib: Allocated by PyTorch's caching allocator (private pools included).
        reserved_unallocated_gib: Reserved by the allocator but not allocated.
        outside_gib: ``in_use - allocated - reserved_unallocated``: the CUDA context, NCCL,
            cuBLAS workspaces, loaded kernels (and ``--gpu-memory-gib``'s hold).
    """

    total_gib: float
    free_gib: float
    in_use_gib: float
    allocated_gib: float
    reserved_unallocated_gib: float
    outside_gib: float


def oom_memory(text: str) -> Optional[OomMemory]:
    """The first out-of-memory message's figures in ``text`` (None without one)."""
    match = _OOM_DETAIL.search(text)
    if match is None:
        return None
    values = match.groups()
    gib = [
        float(values[i]) * _UNIT_GIB[values[i + 1]] if values[i] is not None else 0.0
        for i in range(0, len(values), 2)
    ]
    total, free, in_use, allocated, _private, unallocated = gib
    return OomMemory(total, free, in_use, allocated, unallocated, in_use - allocated - unallocated)


@dataclass
class RunLog:
    """One training log, parsed.

    Attributes:
        path: The log file.
        args: Megatron's argument dump (name -> printed value).
        planned_iters: ``--train-iters`` as the iteration lines print it (0 if none).
        iter_ms: Elapsed time per iteration (Megatron's), ms.
        train_loss: Training loss per iteration.
        moe_ms: MoE layers' time per iteration (``--moe-layer-timing``), ms.
        moe_cumulative_s: The same line's cumulative MoE-layer time, s.
        val: Validation loss per evaluation iteration.
        val_se: Relative standard error of each evaluation (``validation spread`` lines).
        eval_s: Seconds each evaluation inside the run took (from the iteration lines' time
            stamps: the gap to the next iteration's line less that iteration's own time).
        max_allocated_mib: The largest ``max allocated`` printed, MiB (None without).
        alloc_retries: The caching allocator's retries after failed allocations, as last
            printed (None without).
        memory_cap_gib: The cap the run ran under (None: none printed).
        gpu_memory_gib: The card the run emulated (``--gpu-memory-gib``; None: none printed).
        oom: An out-of-memory error is in the log.
        oom_memory: The first out-of-memory message's figures (None without one).
    """

    path: str
    args: dict[str, str] = field(default_factory=dict)
    planned_iters: int = 0
    iter_ms: dict[int, float] = field(default_factory=dict)
    train_loss: dict[int, float] = field(default_factory=dict)
    moe_ms: dict[int, float] = field(default_factory=dict)
    moe_cumulative_s: dict[int, float] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    val_se: dict[int, float] = field(default_factory=dict)
    eval_s: dict[int, float] = field(default_factory=dict)
    max_allocated_mib: Optional[float] = None
    alloc_retries: Optional[int] = None
    memory_cap_gib: Optional[float] = None
    gpu_memory_gib: Optional[float] = None
    oom: bool = False
    oom_memory: Optional[OomMemory] = None

    @property
    def last_iteration(self) -> int:
        return max(self.iter_ms, default=0)

    @property
    def finished(self) -> bool:
        """Every planned iteration ran and nothing ran out of memory."""
        return not self.oom and self.planned_iters > 0 and self.last_iteration >= self.planned_iters

    def seed(self) -> Optional[int]:
        value = self.args.get("seed")
        return int(value) if value is not None else None

    def steady_ms(self, series: str = "iter_ms", skip: int = 3) -> Optional[float]:
        """Median of a per-iteration series after its first ``skip`` iterations."""
        values = [v for i, v in getattr(self, series).items() if i > skip]
        return statistics.median(values) if values else None


def parse_log(path: str | Path) -> RunLog:
    """Read one ``pretrain_lrmoe.py`` log (see the module docstring for the lines used)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    run = RunLog(path=str(path), args=dict(_ARG.findall(text)))
    stamps: dict[int, datetime] = {}
    for stamp, i, planned, ms, loss in _ITER.findall(text):
        run.iter_ms[int(i)] = float(ms)
        run.planned_iters = max(run.planned_iters, int(planned))
        if loss:
            run.train_loss[int(i)] = float(loss)
        if stamp:
            stamps[int(i)] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")
    peaks = []
    for i, ms, total, peak, retries in _MOE.findall(text):
        run.moe_ms[int(i)] = float(ms)
        run.moe_cumulative_s[int(i)] = float(total)
        if peak:
            peaks.append(float(peak))
        if retries:
            run.alloc_retries = max(run.alloc_retries or 0, int(retries))
    run.max_allocated_mib = max(peaks) if peaks else None
    for i, loss in _VAL.findall(text):
        # The evaluation inside the run comes first; the one after training ("on validation
        # set") reads other batches unless --full-validation, so the first value stands.
        run.val.setdefault(int(i), float(loss))
    # A spread line comes right before the validation (or test) line of its evaluation.
    pending: Optional[float] = None
    for line in text.splitlines():
        found = _SPREAD.search(line)
        if found:
            pending = float(found.group(3))
            continue
        found = _EVAL.search(line)
        if found:
            loss = run.val.get(int(found.group(1)))
            if pending is not None and found.group(2) != " on test set" and loss:
                run.val_se[int(found.group(1))] = pending / loss
            pending = None
    # An evaluation after iteration i runs between its line and iteration i + 1's, whose own
    # elapsed time is the rest of that gap.
    for i in run.val:
        if i in stamps and i + 1 in stamps and i + 1 in run.iter_ms:
            gap = (stamps[i + 1] - stamps[i]).total_seconds() - run.iter_ms[i + 1] / 1e3
            run.eval_s[i] = max(0.0, gap)
    run.oom = bool(_OOM.search(text))
    run.oom_memory = oom_memory(text)
    cap = _CAP.search(text)
    run.memory_cap_gib = float(cap.group(1)) if cap else None
    card = _CARD.search(text)
    run.gpu_memory_gib = float(card.group(1)) if card else None
    return run


def crossing(points: Sequence[tuple[int, float]], target: float) -> Optional[float]:
    """The first fractional iteration at which ``points`` (iteration, loss) reach ``target``.

    Linear interpolation between the consecutive evaluations that bracket it; the first
    evaluation itself when it is already at or below the target; None when never reached.
    """
    points = sorted(points)
    if points and points[0][1] <= target:
        return float(points[0][0])
    for (i0, l0), (i1, l1) in zip(points, points[1:]):
        if l1 <= target < l0:
            return i0 + (l0 - target) / (l0 - l1) * (i1 - i0)
    return None


def cumulative(series: dict[int, float], iteration: float, first: int = 2) -> float:
    """``series`` summed over iterations ``first`` .. ``iteration`` (fractional: the share of the
    next iteration's value). Iteration ``i`` is the work that ends at ``i``."""
    whole = math.floor(iteration)
    total = sum(v for i, v in series.items() if first <= i <= whole)
    if iteration > whole and whole + 1 >= first:
        total += (iteration - whole) * series.get(whole + 1, 0.0)
    return total


@dataclass(frozen=True)
class ToTarget:
    """How long one run took to reach the target validation loss (iteration 1 left out).

    Attributes:
        iteration: Fractional iteration of the crossing.
        wall_s: Megatron's elapsed time, iterations 2 .. crossing.
        moe_s: The MoE layers' time, iterations 2 .. crossing.
        first_iteration_s: Iteration 1's elapsed time (compilation, capture, warm-up).
        first_iteration_moe_s: Iteration 1's MoE-layer time.
    """

    iteration: float
    wall_s: float
    moe_s: float
    first_iteration_s: float
    first_iteration_moe_s: float


def time_to_target(run: RunLog, target: float) -> Optional[ToTarget]:
    """The run's time to ``target`` (None when its validation loss never reaches it)."""
    at = crossing(list(run.val.items()), target)
    if at is None:
        return None
    return ToTarget(
        iteration=at,
        wall_s=cumulative(run.iter_ms, at) / 1e3,
        moe_s=cumulative(run.moe_ms, at) / 1e3,
        first_iteration_s=run.iter_ms.get(1, 0.0) / 1e3,
        first_iteration_moe_s=run.moe_ms.get(1, 0.0) / 1e3,
    )


@dataclass(frozen=True)
class Spread:
    """Mean and spread of one figure over seeds (``std`` is the sample standard deviation,
    0 for one value; ``missing``: seeds that gave no value, e.g. never reached the target)."""

    n: int
    mean: Optional[float]
    std: Optional[float]
    min: Optional[float]
    max: Optional[float]
    missing: int = 0


def spread(values: Sequence[Optional[float]]) -> Spread:
    """:class:`Spread` of ``values``, ``None`` entries counted as missing."""
    have = [float(v) for v in values if v is not None]
    missing = len(values) - len(have)
    if not have:
        return Spread(0, None, None, None, None, missing)
    std = statistics.stdev(have) if len(have) > 1 else 0.0
    return Spread(len(have), statistics.fmean(have), std, min(have), max(have), missing)


def summary(run: RunLog, target: Optional[float]) -> dict:
    """One run's figures as a JSON-ready dict."""
    reached = time_to_target(run, target) if target is not None else None
    last_val = max(run.val, default=None)
    return {
        "log": run.path,
        "seed": run.seed(),
        "finished": run.finished,
        "oom": run.oom,
        "oom_memory": asdict(run.oom_memory) if run.oom_memory is not None else None,
        "iterations": run.last_iteration,
        "memory_cap_gib": run.memory_cap_gib,
        "gpu_memory_gib": run.gpu_memory_gib,
        "max_allocated_mib": run.max_allocated_mib,
        "alloc_retries": run.alloc_retries,
        "iter_ms_median": run.steady_ms("iter_ms"),
        "moe_ms_median": run.steady_ms("moe_ms"),
        "first_iteration_s": run.iter_ms.get(1, 0.0) / 1e3 if run.iter_ms else None,
        "eval_s_median": statistics.median(run.eval_s.values()) if run.eval_s else None,
        "final_val_iteration": last_val,
        "final_val_loss": run.val.get(last_val) if last_val is not None else None,
        "val_relative_se": run.val_se.get(last_val) if last_val is not None else None,
        "to_target": asdict(reached) if reached is not None else None,
    }


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--target", type=float, default=None, help="target validation loss")
    parser.add_argument("--device", default=None,
                        help="the GPU the logs ran on (e.g. nvidia-smi's name), added to each row")
    parser.add_argument("--one", action="store_true", help="one log: print its row, not a list")
    args = parser.parse_args(argv)
    rows = [summary(parse_log(p), args.target) for p in args.logs]
    if args.device is not None:
        for row in rows:
            row["device"] = args.device
    if args.one and len(rows) != 1:
        parser.error(f"--one takes one log, not {len(rows)}")
    print(json.dumps(rows[0] if args.one else rows, indent=2))


if __name__ == "__main__":
    main()
