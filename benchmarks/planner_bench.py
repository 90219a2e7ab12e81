"""The per-call controller alone (megatron_lrmoe.control.controller.plan_call) on synthetic loads.

For EP = 8, 16, 32, 64 ranks, 128 and 256 experts and Zipf expert popularity with exponents 0 to
1.5 (experts shuffled over owners, every source rank routing ``--pairs-per-rank`` pairs), it
measures on the host CPU:

* time per plan (median over ``--repeats`` calls, after warm-up) for four settings: quotas only
  (no replicas, no budgets: today's path), replicas (save and recompute), and replicas under a
  memory budget that binds (90 % of the unbounded plan's peak);
* quality of the forward peak per-rank load: no replicas, the controller (threshold search +
  greedy, UltraEP-style), the exact min-max split over the same replicas, an EPLB-style
  replicate-then-pack baseline, and the lower bound ``max(ceil(total / P), max_e ceil(W[e] / P))``
  (no placement can beat it); the backward peak of the controller's exact assignment against
  the same quotas without replicas;
* on small cases (P = 3-4), the controller's peak against the exact optimum found by brute force
  over every placement, with and without the placement's local search after the greedy.

Usage: ``python benchmarks/planner_bench.py [--repeats 30] [--out benchmarks/results/...json]``.
The planner runs its compiled loops (control/native.py) when a C compiler is available;
``--python-planner`` times the Python planner (``KernelOptions(native_planner=False)``, the
placement alone with ``lib=None``). The path used is printed and kept in the JSON.
It prints a table and writes JSON. Timings depend on the machine and its load (the JSON records
the load average); compare medians from one run.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control import native, placement
from megatron_lrmoe.control.controller import plan_call
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.control.placement import place_replicas
from megatron_lrmoe.control.reference import reference_optimal_peak
from megatron_lrmoe.options import KernelOptions

# Qwen3-30B-A3B-like expert shapes (bf16), as in benchmarks/common.py.
COST = CostModel(hidden_size=2048, ffn_hidden_size=768, gated=True, activation_bytes=2)
EXPONENTS = (0.0, 0.5, 1.0, 1.5)
REPLICAS = 2
KEEP = 0.5


def zipf_counts(num_ranks: int, num_experts: int, exponent: float, pairs: int, seed: int):
    """``[P, E]`` pairs: every source draws ``pairs`` from one shuffled Zipf popularity."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** exponent
    p = p[rng.permutation(num_experts)]
    return rng.multinomial(pairs, p / p.sum(), size=num_ranks).astype(np.int64)


def median_us(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``fn`` in microseconds.

    CPU time excludes the time the process waits for a core, so on a shared, loaded machine it
    is the better estimate of the planner's own cost; the JSON keeps both.
    """
    for _ in range(3):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


def eplb_style_peak(load: np.ndarray, num_ranks: int, slots: int) -> int:
    """Replicate-then-pack baseline: give each extra copy to the expert with the largest load per
    copy, then place copies heaviest first on the least-loaded rank with a free slot that does not
    hold the expert yet (owners fixed, every copy of an expert gets an equal share)."""
    num_experts = load.size
    local = num_experts // num_ranks
    copies = np.ones(num_experts, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(num_experts)]
    heapq.heapify(heap)
    for _ in range(num_ranks * slots):
        _, e = heapq.heappop(heap)
        if copies[e] >= num_ranks:
            continue
        copies[e] += 1
        heapq.heappush(heap, (-float(load[e]) / copies[e], e))
    share = load / copies
    rank_load = np.bincount(np.arange(num_experts) // local, weights=share, minlength=num_ranks)
    free = [slots] * num_ranks
    held = [set(range(r * local, (r + 1) * local)) for r in range(num_ranks)]
    extra = sorted(((share[e], e) for e in range(num_experts) for _ in range(copies[e] - 1)),
                   reverse=True)  # fmt: skip
    for amount, e in extra:
        options = [r for r in range(num_ranks) if free[r] and e not in held[r]]
        if not options:
            rank_load[e // local] += amount  # no room: the owner keeps it
            continue
        r = min(options, key=lambda g: (rank_load[g], g))
        rank_load[r] += amount
        free[r] -= 1
        held[r].add(e)
    return int(np.ceil(rank_load.max()))


def lower_bound(load: np.ndarray, num_ranks: int) -> int:
    return int(max(-(-load.sum() // num_ranks), (-(-load // num_ranks)).max(initial=0)))


def small_cases(count: int) -> dict[str, Any]:
    """The controller's forward peak over the brute-force optimum on small cases, and the same
    with the placement's local search switched off (the threshold-search greedy alone)."""
    rng = np.random.default_rng(7)
    ratios, ratios_exact, ratios_greedy, fixed = [], [], [], []
    for case in range(count):
        num_ranks = int(rng.choice([3, 4]))
        num_experts = num_ranks * (2 if num_ranks == 3 else 1)
        counts = zipf_counts(num_ranks, num_experts, float(rng.choice(EXPONENTS)), 200, case)
        load = counts.sum(0)
        lrmoe = LRMoEConfig(keep_ratio=KEEP, max_replicas_per_rank=1)
        plan = plan_call(counts, 0, lrmoe)
        exact = plan_call(counts, 0, lrmoe, exact_forward=True)
        limit, placement.IMPROVE_MAX_PAIRS = placement.IMPROVE_MAX_PAIRS, 0
        try:
            greedy = plan_call(counts, 0, lrmoe)
        finally:
            placement.IMPROVE_MAX_PAIRS = limit
        best = reference_optimal_peak(load.tolist(), num_ranks, 1)
        ratios.append(plan.forward_peak / best)
        ratios_exact.append(exact.forward_peak / best)
        ratios_greedy.append(greedy.forward_peak / best)
        fixed.append(plan.fixed_forward_peak / best)
    return {
        "cases": count,
        "controller_over_optimum_mean": statistics.fmean(ratios),
        "controller_over_optimum_max": max(ratios),
        "controller_optimal_share": sum(r == 1.0 for r in ratios) / count,
        "exact_split_over_optimum_max": max(ratios_exact),
        "greedy_alone_over_optimum_mean": statistics.fmean(ratios_greedy),
        "greedy_alone_over_optimum_max": max(ratios_greedy),
        "greedy_alone_optimal_share": sum(r == 1.0 for r in ratios_greedy) / count,
        "no_replicas_over_optimum_mean": statistics.fmean(fixed),
    }


def bench_case(num_ranks: int, num_experts: int, exponent: float, args: Any) -> dict[str, Any]:
    counts = zipf_counts(num_ranks, num_experts, exponent, args.pairs_per_rank, seed=num_experts)
    torch_counts = torch.from_numpy(counts)
    load = counts.sum(0)
    kernels = KernelOptions(native_planner=not args.python_planner)
    settings = {
        "quotas": LRMoEConfig(keep_ratio=KEEP, kernels=kernels),
        "replicas_save": LRMoEConfig(
            keep_ratio=KEEP, max_replicas_per_rank=REPLICAS, kernels=kernels
        ),
        "replicas_recompute": LRMoEConfig(
            keep_ratio=KEEP, max_replicas_per_rank=REPLICAS, activation_mode="recompute",
            kernels=kernels,
        ),
    }
    free = plan_call(counts, 0, settings["replicas_save"], COST)
    budget = int(free.memory.budgeted_bytes.max() * 0.9)
    settings["replicas_budget"] = LRMoEConfig(
        keep_ratio=KEEP, max_replicas_per_rank=REPLICAS, memory_budget_bytes=budget,
        kernels=kernels,
    )
    row: dict[str, Any] = {"ep": num_ranks, "experts": num_experts, "zipf": exponent}
    for name, lrmoe in settings.items():
        wall, cpu = median_us(lambda: plan_call(torch_counts, 0, lrmoe, COST), args.repeats)
        row[f"{name}_us"] = round(cpu, 1)
        row[f"{name}_wall_us"] = round(wall, 1)
    budgeted = plan_call(counts, 0, settings["replicas_budget"], COST, check=True)
    uncapped = max(1, int(budgeted.uncapped_quota.sum()))
    row["budget_trimmed_share"] = round(budgeted.trimmed_pairs / uncapped, 4)
    lib = None if args.python_planner else native.library()
    row["placement_us"] = round(
        median_us(
            lambda: place_replicas(load, num_ranks, REPLICAS, 1 / 512, lib=lib), args.repeats
        )[1],
        1,
    )
    plan = plan_call(counts, 0, settings["replicas_save"], COST, check=True)
    recompute = plan_call(counts, 0, settings["replicas_recompute"], COST, check=True)
    exact = plan_call(counts, 0, settings["replicas_save"], COST, exact_forward=True)
    row["exact_forward_us"] = round(
        median_us(
            lambda: plan_call(counts, 0, settings["replicas_save"], COST, exact_forward=True),
            max(3, args.repeats // 5),
        )[1],
        1,
    )
    row.update(
        lower_bound=lower_bound(load, num_ranks),
        fwd_no_replicas=plan.fixed_forward_peak,
        fwd_controller=plan.forward_peak,
        fwd_exact_split=exact.forward_peak,
        fwd_eplb_style=eplb_style_peak(load, num_ranks, REPLICAS),
        replicas=plan.num_replicas,
        bwd_no_replicas=plan.fixed_backward_peak,
        bwd_save=plan.backward_peak,
        bwd_recompute=recompute.backward_peak,
    )
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'EP':>3} {'E':>4} {'zipf':>4} | {'quota':>7} {'rep/sv':>7} {'rep/rc':>7} "
        f"{'budget':>7} {'place':>7} | {'LB':>7} {'fixed':>8} {'ctrl':>7} {'exact':>7} "
        f"{'eplb':>7} {'reps':>4} | {'bwd fix':>7} {'bwd sv':>7} {'bwd rc':>7}"
    )
    print("time per plan: median CPU microseconds; peaks: pairs on the busiest rank")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['ep']:>3} {r['experts']:>4} {r['zipf']:>4} | {r['quotas_us']:>7.0f} "
            f"{r['replicas_save_us']:>7.0f} {r['replicas_recompute_us']:>7.0f} "
            f"{r['replicas_budget_us']:>7.0f} {r['placement_us']:>7.0f} | {r['lower_bound']:>7} "
            f"{r['fwd_no_replicas']:>8} {r['fwd_controller']:>7} {r['fwd_exact_split']:>7} "
            f"{r['fwd_eplb_style']:>7} {r['replicas']:>4} | {r['bwd_no_replicas']:>7} "
            f"{r['bwd_save']:>7} {r['bwd_recompute']:>7}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--pairs-per-rank", type=int, default=4096 * 8)
    parser.add_argument("--small-cases", type=int, default=60)
    parser.add_argument("--eps", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument("--experts", type=int, nargs="*", default=[128, 256])
    parser.add_argument(
        "--python-planner",
        action="store_true",
        help="time the Python planner (KernelOptions(native_planner=False)) instead of its "
        "compiled twin",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "planner_bench.json")
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # The compiled planner (control/native.py) unless --python-planner or no C compiler; built
    # (or loaded from its cache) here, before any timing.
    path = "python" if args.python_planner or native.library() is None else "native"
    print(f"planner path: {path}", file=sys.stderr, flush=True)
    rows = []
    for num_ranks in args.eps:
        for num_experts in args.experts:
            for exponent in EXPONENTS:
                rows.append(bench_case(num_ranks, num_experts, exponent, args))
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"planner path: {path} (--python-planner forces python)")
    print_table(rows)
    small = small_cases(args.small_cases)
    print("small cases vs brute-force optimum:", json.dumps(small))
    calibration = median_us(lambda: sum(range(10**6)), 11)[1] / 1e3
    print(f"calibration: sum(range(10**6)) takes {calibration:.1f} CPU ms here")
    result = {
        "settings": {
            "keep_ratio": KEEP,
            "max_replicas_per_rank": REPLICAS,
            "pairs_per_rank": args.pairs_per_rank,
            "repeats": args.repeats,
            "cost_model": vars(COST),
            "budget": "memory_budget_bytes = 0.9 x the unbounded replicas_save plan's peak",
            "planner_path": path,
        },
        "machine": {
            # CPU ms of sum(range(10**6)): about 10-15 ms on an idle modern x86 core; scale the
            # timings by it to compare machines.
            "calibration_ms": round(median_us(lambda: sum(range(10**6)), 11)[1] / 1e3, 2),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "processor": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "small_cases": small,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
