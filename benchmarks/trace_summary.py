"""Where the GPU time of profiled training iterations goes, from PyTorch profiler traces.

    python3 benchmarks/trace_summary.py TRACE.json.gz [TRACE_B.json.gz] [--top 40]
        [--names A B] [--out summary.json]

A trace is what Megatron's ``--profile --use-pytorch-profiler --profile-step-start S
--profile-step-end E --tensorboard-dir DIR`` writes (``DIR/../torch_profile/rank-0.json.gz``),
one per run, or ``model_bench.py --profile DIR`` (``DIR/trace_k<keep>_rank<r>.json``, one per
keep ratio and rank). Each GPU activity (kernel, memcpy, memset; a CUDA graph's kernels
included) is put in the profiled step whose host range holds its launch (the runtime call with
the same correlation id) and, within it, in the one of these host ranges that holds the launch:

    moe_fwd   the MoE experts' autograd function (ExactMoEFunction / TrimmedMoEFunction)
    moe_bwd   its backward (autograd::engine::evaluate_function: ...MoEFunctionBackward)
    bench_fwd_rest, bench_bwd_rest
              ``model_bench.py --profile``'s forward and backward phases, less the above

Per trace, per step on average (ms): the step's host time, the GPU's span (first launch's start
to the last one's end), busy time (the union of the activities) and idle time; per owner the
summed activity time, its union, and its "span" (first start to last end of each call's
activities, summed over the calls) minus its union = the GPU's gaps inside the owner's calls
(the host late with the next launch, or a wait); the op's backward per call by kind of kernel
(``KINDS``: grouped GEMMs, weight gradients, activation backward, gradient rows, gather-sum,
scores and selection, other); and the kernels with the most time. With two traces the kernel
table puts them side by side with the difference (B - A).

Reads only the trace: no GPU, no Megatron.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OWNERS = {
    "moe_bwd": re.compile(r"evaluate_function: (Exact|Trimmed)MoEFunctionBackward"),
    "moe_fwd": re.compile(r"^(Exact|Trimmed)MoEFunction$"),
    # benchmarks/model_bench.py --profile annotates its phases; an activity goes to the first
    # owner whose range holds its launch, so these get what the op's ranges above do not: the
    # rest of each phase (Megatron's router and its auxiliary loss, the residual stream).
    "bench_bwd_rest": re.compile(r"^model_bench\.backward$"),
    "bench_fwd_rest": re.compile(r"^model_bench\.forward$"),
}
STEP = re.compile(r"^ProfilerStep#(\d+)$")
# The op's backward kernels by kind (``by_kind``), the first pattern that matches a kernel's name
# wins; LRMoE's Triton kernels by their function names, the grouped GEMMs as CUTLASS 3 names them.
KINDS = (
    ("grouped GEMMs", re.compile(r"cutlass13device_kernel")),
    ("weight gradients", re.compile(r"_wgrad_")),
    ("activation backward", re.compile(r"_act_bwd")),
    ("gradient rows", re.compile(r"_scale_rows|_row_dot|_pack_pairs|_row_of")),
    ("gather-sum", re.compile(r"_gather_sum")),
    (
        "scores and selection",
        re.compile(
            r"_row_norms|_pair_scores|_merge_rank|_tile_sort|_units|_capping|_draw|_weights_"
            r"|_uncapped|_sort_key|_finalize|_repair"
        ),
    ),
)


@dataclass
class Activity:
    name: str
    start: float  # us
    end: float
    launch: float  # host us of the runtime call that launched it


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _activities(events: list[dict[str, Any]]) -> list[Activity]:
    launches: dict[Any, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = float(e["ts"])
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        corr = e.get("args", {}).get("correlation")
        if corr not in launches:
            continue
        start = float(e["ts"])
        out.append(Activity(e["name"], start, start + float(e.get("dur", 0.0)), launches[corr]))
    return out


def _ranges(events: list[dict[str, Any]], pattern: re.Pattern[str]) -> list[tuple[float, float, str]]:
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            if pattern.search(e.get("name", "")):
                out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]))
    return sorted(out)


def _holder(ranges: list[tuple[float, float, str]], starts: list[float], t: float) -> int:
    """Index of the range holding host time ``t``, or -1 (ranges of one kind do not overlap)."""
    i = bisect.bisect_right(starts, t) - 1
    return i if i >= 0 and t <= ranges[i][1] else -1


def summarize(path: str, top: int) -> dict[str, Any]:
    events = load(path)
    acts = _activities(events)
    steps = _ranges(events, STEP)
    if not steps:
        raise SystemExit(f"{path}: no ProfilerStep#N ranges; was the profiler's schedule active?")
    step_starts = [s for s, _, _ in steps]
    owners = {name: _ranges(events, pat) for name, pat in OWNERS.items()}
    owner_starts = {name: [s for s, _, _ in r] for name, r in owners.items()}

    per_step: list[list[Activity]] = [[] for _ in steps]
    owned: dict[str, dict[int, list[Activity]]] = {name: defaultdict(list) for name in OWNERS}
    for a in acts:
        i = _holder(steps, step_starts, a.launch)
        if i < 0:
            continue
        per_step[i].append(a)
        for name, ranges in owners.items():
            j = _holder(ranges, owner_starts[name], a.launch)
            if j >= 0:
                owned[name][j].append(a)
                break

    n = len(steps)
    step_rows = []
    for (s, e, label), items in zip(steps, per_step):
        span = (max(a.end for a in items) - min(a.start for a in items)) if items else 0.0
        busy = union_us((a.start, a.end) for a in items)
        step_rows.append(dict(step=label, host_ms=(e - s) / 1e3, gpu_span_ms=span / 1e3,
                              busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3))

    owner_rows = {}
    for name, calls in owned.items():
        summed = sum(a.end - a.start for c in calls.values() for a in c)
        unions = sum(union_us((a.start, a.end) for a in c) for c in calls.values())
        spans = sum(max(a.end for a in c) - min(a.start for a in c) for c in calls.values())
        owner_rows[name] = dict(calls_per_step=len(calls) / n, summed_ms=summed / n / 1e3,
                                busy_ms=unions / n / 1e3, span_ms=spans / n / 1e3,
                                gaps_ms=(spans - unions) / n / 1e3)

    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    in_bwd = {id(a) for c in owned["moe_bwd"].values() for a in c}
    for items in per_step:
        for a in items:
            k = kernels[a.name]
            k[0] += (a.end - a.start) / n / 1e3
            if id(a) in in_bwd:
                k[1] += (a.end - a.start) / n / 1e3
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    kernel_rows = {name: dict(ms=v[0], moe_bwd_ms=v[1]) for name, v in ranked}
    return dict(path=path, steps=step_rows, owners=owner_rows, kernels=kernel_rows,
                by_kind=by_kind(kernel_rows, owner_rows["moe_bwd"]["calls_per_step"]), top=top)


def by_kind(kernels: dict[str, dict[str, float]], calls_per_step: float) -> dict[str, float]:
    """The op's backward per call, ms, summed by :data:`KINDS` (the rest under ``other``)."""
    out = {name: 0.0 for name, _ in KINDS}
    out["other"] = 0.0
    for name, k in kernels.items():
        if k["moe_bwd_ms"] and calls_per_step:
            kind = next((kind for kind, pattern in KINDS if pattern.search(name)), "other")
            out[kind] += k["moe_bwd_ms"] / calls_per_step
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _short(name: str, width: int = 88) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report(summaries: list[dict[str, Any]], names: list[str]) -> str:
    lines = []
    for label, s in zip(names, summaries):
        rows = s["steps"]
        lines.append(f"== {label}: {s['path']} ({len(rows)} steps)")
        lines.append("  per step (mean ms): host {:.2f}, GPU span {:.2f}, busy {:.2f}, idle {:.2f}".format(
            *(_mean(rows, k) for k in ("host_ms", "gpu_span_ms", "busy_ms", "idle_ms"))))
        for owner, o in s["owners"].items():
            if owner.startswith("bench_") and not o["calls_per_step"]:
                continue  # a training trace has no model_bench phases
            lines.append(f"  {owner}: {o['calls_per_step']:.1f} calls/step, activities {o['summed_ms']:.2f} ms,"
                         f" busy {o['busy_ms']:.2f}, span {o['span_ms']:.2f}, gaps {o['gaps_ms']:.2f}")
        kinds = ", ".join(f"{kind} {ms:.3f}" for kind, ms in s["by_kind"].items())
        lines.append(f"  moe_bwd per call by kind (ms): {kinds}")
    top = summaries[0]["top"]
    if len(summaries) == 1:
        lines.append("  top kernels, ms per step (of it in moe_bwd):")
        for name, k in list(summaries[0]["kernels"].items())[:top]:
            lines.append(f"  {k['ms']:9.3f} {k['moe_bwd_ms']:9.3f}  {_short(name)}")
        return "\n".join(lines)
    a, b = summaries[0]["kernels"], summaries[1]["kernels"]
    keys = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, {}).get("ms", 0) - a.get(n, {}).get("ms", 0)))
    lines.append(f"  kernels by |{names[1]} - {names[0]}|, ms per step: {names[0]} ({names[0]} moe_bwd), "
                 f"{names[1]} ({names[1]} moe_bwd), difference")
    total_a = sum(k["ms"] for k in a.values())
    total_b = sum(k["ms"] for k in b.values())
    for name in keys[:top]:
        ka, kb = a.get(name, dict(ms=0.0, moe_bwd_ms=0.0)), b.get(name, dict(ms=0.0, moe_bwd_ms=0.0))
        lines.append(f"  {ka['ms']:8.3f} ({ka['moe_bwd_ms']:7.3f}) {kb['ms']:8.3f} ({kb['moe_bwd_ms']:7.3f})"
                     f" {kb['ms'] - ka['ms']:+8.3f}  {_short(name)}")
    lines.append(f"  all activities: {total_a:.3f} / {total_b:.3f} ms per step ({total_b - total_a:+.3f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="one or two profiler traces (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=40, help="kernels to list (default 40)")
    parser.add_argument("--names", nargs="+", default=None, help="a label per trace")
    parser.add_argument("--out", default=None, help="write the summaries as JSON here")
    args = parser.parse_args()
    if len(args.traces) > 2:
        parser.error(f"one or two traces, got {len(args.traces)}")
    names = args.names or [f"trace{i}" for i in range(len(args.traces))]
    if len(names) != len(args.traces):
        parser.error(f"--names needs one label per trace ({len(args.traces)}), got {names}")
    summaries = [summarize(p, args.top) for p in args.traces]
    print(report(summaries, names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(zip(names, summaries)), f, indent=1)


if __name__ == "__main__":
    main()
