"""Fused Triton selection against the torch reference on one GPU: exactness, time, launches.

    python benchmarks/select_bench.py --out select.json

For N = tokens * topk pairs over G experts with Zipf-skewed expert loads (tokens pick ``topk``
distinct experts with probability proportional to ``rank**-zipf``), keep ratios 0.25 / 0.5 / 0.75
and both policies (``topk``, ``sample``):

(a) exactness: the Triton result must equal the torch result on the GPU and the torch result on
    the CPU bit for bit (``kept_index``, ``weight``, ``kept_per_segment``); the same check also
    runs on adversarial score sets at full size (ties, zeros, NaN/inf/negative, denormals, one
    huge score, geometric scores with many capped rows, fewer positive scores than quota);
(b) time, for torch eager and Triton: CUDA-event time of one call (median of ``--iters`` after
    ``--warmup``; includes the gaps while the GPU waits for the host), the profiler's kernel
    count and summed device time of one call (the GPU time the call costs), and the host time to
    enqueue one call; ``budget`` checks the Triton device time against 0.3 ms;
(c) the sort alone, on the bench's segments and on equal ones: the merge sort
    (``_tile_sort_kernel`` + ``_merge_rank_kernel``) at a few tiles against the 64-bit
    ``torch.sort``, same order checked, device time of one call, and which of the two the
    selection picks (``select_triton.merge_tile``); ``--sort-only`` runs this part alone;
(d) everything goes to the JSON file ``--out``.

Each part runs in its own ``try``: a failure prints ``FAIL`` with the error and the script goes
on. Every check prints one ``PASS`` / ``FAIL`` line; the exit status is 1 if any check failed.
Runs without megatron-core installed (only ``megatron_lrmoe.select``,
``megatron_lrmoe.triton_common`` and ``megatron_lrmoe.cuda_graphs`` are needed).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _import_select() -> tuple[Any, Any]:
    """``scoring`` and ``select_triton``; without megatron-core the package ``__init__`` is
    skipped."""
    try:
        from megatron_lrmoe.select import scoring, select_triton
    except ImportError:
        for name in ("megatron_lrmoe", "megatron_lrmoe.select"):
            sys.modules.pop(name, None)
        package = types.ModuleType("megatron_lrmoe")
        package.__path__ = [os.path.join(ROOT, "megatron_lrmoe")]
        sys.modules["megatron_lrmoe"] = package
        from megatron_lrmoe.select import scoring, select_triton
    return scoring, select_triton


scoring, select_triton = _import_select()

FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)
    return ok


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; an exception is reported as a FAIL line and returns None."""
    try:
        return fn()
    except Exception as e:  # keep going: one broken part must not hide the others
        traceback.print_exc()
        report(name, False, f"{type(e).__name__}: {e}")
        return None


# ---------------------------------------------------------------------------------------------
# Problem
# ---------------------------------------------------------------------------------------------


def zipf_counts(tokens: int, experts: int, topk: int, zipf: float, seed: int) -> torch.Tensor:
    """Pairs per expert when every token picks ``topk`` distinct Zipf-weighted experts."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.arange(1, experts + 1, dtype=torch.float64) ** -zipf
    p = p[torch.randperm(experts, generator=gen)]
    picks = torch.multinomial(p.expand(tokens, experts), topk, replacement=False, generator=gen)
    return torch.bincount(picks.flatten(), minlength=experts).to(torch.int64)


def lrm_like_scores(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed positive scores (``p**2 * ||g||**2 * ||x||**2`` is a product of such)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=gen)
    return (p * p * torch.exp(2 * torch.randn(n, generator=gen))).float()


def adversarial_scores(kind: str, n: int, seed: int) -> torch.Tensor:
    """``[n]`` fp32 scores of one adversarial kind (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(n, generator=gen)
    if kind == "ties":
        s = torch.randint(0, 4, (n,), generator=gen).float()
    elif kind == "zeros":
        s = torch.zeros(n)
    elif kind == "nonfinite":
        bad = torch.tensor([float("nan"), float("inf"), -float("inf"), -1.0, -0.0, -1e-40])
        idx = torch.randint(0, n, (n // 10,), generator=gen)
        s[idx] = bad[torch.randint(0, len(bad), (idx.numel(),), generator=gen)]
    elif kind == "denormal":
        s = s * 1e-39
    elif kind == "huge":
        s[torch.randint(0, n, (64,), generator=gen)] = torch.finfo(torch.float32).max
    elif kind == "geometric":
        s = 0.7 ** torch.randint(0, 200, (n,), generator=gen).float()
    elif kind == "mixed_magnitudes":
        s = 10.0 ** (torch.rand(n, generator=gen) * 70 - 40)
    elif kind == "few_positive":
        s = torch.zeros(n)
        idx = torch.randint(0, n, (n // 50,), generator=gen)
        s[idx] = torch.rand(idx.numel(), generator=gen)
    return s.float()


# ---------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------


def run_policy(impl: str, policy: str, scores, counts, quota, uniforms):
    if impl == "triton":
        return select_triton.select_triton(policy, scores, counts, quota, uniforms)
    if policy == "topk":
        return scoring.select_topk(scores, counts, quota)
    return scoring.select_sample(scores, counts, quota, uniforms)


def same(a, b) -> bool:
    return (
        torch.equal(a.kept_index.cpu(), b.kept_index.cpu())
        and torch.equal(a.weight.cpu(), b.weight.cpu())
        and torch.equal(a.kept_per_segment.cpu(), b.kept_per_segment.cpu())
    )


def check_exact(name: str, policy: str, scores, counts, quota, uniforms) -> bool:
    cpu = run_policy("torch", policy, scores.cpu(), counts, quota, uniforms.cpu())
    gpu = run_policy("torch", policy, scores, counts, quota, uniforms)
    tri = run_policy("triton", policy, scores, counts, quota, uniforms)
    torch.cuda.synchronize()
    ok_gpu, ok_cpu = same(tri, gpu), same(tri, cpu)
    detail = f"K={tri.num_kept} triton==torch_gpu {ok_gpu} triton==torch_cpu {ok_cpu}"
    return report(f"exact {name} {policy}", ok_gpu and ok_cpu, detail)


def event_time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def host_time_us(fn: Callable[[], Any], iters: int) -> float:
    """CPU time to enqueue one call (no synchronization inside the loop)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def profile_call(fn: Callable[[], Any]) -> dict[str, Any]:
    """Kernels, memcpy/memset ops and their summed device time for one call (after warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels_, copies, device_us = [], [], 0.0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        device_us += evt.device_time
        item = f"{evt.name[:80]} ({evt.device_time:.1f} us)"
        (copies if ("Memcpy" in evt.name or "Memset" in evt.name) else kernels_).append(item)
    return {
        "kernel_launches": len(kernels_),
        "copies": len(copies),
        "device_time_us": device_us,
        "kernels": kernels_,
        "copy_ops": copies,
    }


def ptx_report() -> dict[str, Any]:
    """Counts of float64 division / sqrt instructions (IEEE or approximate) in the compiled
    selection kernels' PTX."""
    found: dict[str, Any] = {}
    kernels = vars(select_triton.selection_kernels()).values()
    jitted = [k for k in kernels if hasattr(k, "device_caches")]
    caches = [c for k in jitted for c in (getattr(k, "device_caches", None) or {}).values()]
    for cache in caches:
        entries = cache[0] if isinstance(cache, tuple) else cache
        for compiled in getattr(entries, "values", lambda: [])():
            ptx = getattr(compiled, "asm", {}).get("ptx", "")
            for op in ("div.rn.f64", "sqrt.rn.f64", "div.full.f32", "rcp.approx", "sqrt.approx"):
                found[op] = found.get(op, 0) + ptx.count(op)
            found["cvt.ftz.f64.f32"] = found.get("cvt.ftz.f64.f32", 0) + ptx.count(
                "cvt.ftz.f64.f32"
            )
            found["kernels_seen"] = found.get("kernels_seen", 0) + 1
    return found


# (rows per program, rows per sorted tile, tiles searched at once, warps) of the merge sort.
MERGE_TILES = (
    (128, 256, 1, 4), (128, 256, 4, 4), (128, 512, 1, 4), (128, 512, 2, 4), (128, 512, 4, 4),
    (128, 512, 8, 8), (64, 512, 4, 4), (128, 1024, 4, 8),
)


def sort_part(counts: torch.Tensor, device: torch.device, args: argparse.Namespace) -> dict:
    """The selection's sort alone on these segments: the merge sort at several tiles
    against the 64-bit ``torch.sort`` (``_sort_order_reference``), same order checked, device
    time of one call from the profiler."""
    k = select_triton.selection_kernels()
    n, g = int(counts.sum()), counts.numel()
    scores = lrm_like_scores(n, args.seed + 1).to(device)
    table = select_triton._segment_table(counts, counts, None, device)
    key = select_triton._sort_keys(k, scores, table, select_triton.ROW_BLOCK)
    ref_key, ref_order = select_triton._sort_order_reference(key)
    out: dict[str, Any] = {
        "sum_sq": int((counts.double() ** 2).sum()),
        "max": int(counts.max()),
        # What the selection picks for these segments.
        "merge_tile": (tile := select_triton.merge_tile(counts)) and tile._asdict(),
    }
    print(f"sort N={n} G={g}: the selection sorts by {tile or 'torch.sort'}")

    fns = {"sort64": lambda: select_triton._sort_order_reference(key)}
    for bi, size, unroll, w in MERGE_TILES:
        fns[f"merge_{bi}_t{size}_u{unroll}_w{w}"] = functools.partial(
            select_triton._sort_order, k, key, table, select_triton.MergeTile(bi, size, unroll, w)
        )
    for name, fn in fns.items():
        got_key, got_order = fn()
        ok = torch.equal(got_order, ref_order) and torch.equal(got_key, ref_key)
        prof = profile_call(fn)
        out[name] = {"same": ok, "device_us": prof["device_time_us"]}
        print(
            f"sort N={n} G={g} max={out['max']} sum_sq={out['sum_sq']:.3g} {name}: "
            f"{prof['device_time_us']:.1f} us device, {prof['kernel_launches']} kernels, "
            f"{'same' if ok else 'DIFFERENT'} order",
            flush=True,
        )
        if not ok:
            report(f"sort order {name}", False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", default="select_bench.json")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--keeps", default="0.25,0.5,0.75")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-adversarial", action="store_true")
    parser.add_argument("--sort-only", action="store_true", help="run part (c) alone")
    args = parser.parse_args()
    results: dict[str, Any] = {"args": vars(args), "runs": [], "adversarial": []}
    if not torch.cuda.is_available():
        report("cuda available", False)
        sys.exit(1)
    device = torch.device("cuda")
    results["device"] = torch.cuda.get_device_name(device)
    results["torch"] = torch.__version__
    try:
        import triton

        results["triton"] = triton.__version__
    except Exception as e:  # reported, not fatal: the Triton parts will FAIL on their own
        results["triton"] = f"import failed: {e}"

    counts = zipf_counts(args.tokens, args.experts, args.topk, args.zipf, args.seed)
    n = int(counts.sum())
    results["segments"] = {
        "n": n,
        "g": counts.numel(),
        "max": int(counts.max()),
        "min": int(counts.min()),
        "counts": counts.tolist(),
    }
    print(f"N={n} G={counts.numel()} segment sizes {int(counts.min())}..{int(counts.max())}")
    scores = lrm_like_scores(n, args.seed).to(device)
    uniforms = scoring.draw_uniforms(args.seed, (1,), counts.numel(), device)

    for keep in () if args.sort_only else (float(k) for k in args.keeps.split(",")):
        quota = torch.ceil(keep * counts.double()).to(torch.int64).clamp_max(counts)
        for policy in ("topk", "sample"):
            run: dict[str, Any] = {"keep": keep, "policy": policy, "k": int(quota.sum())}
            tag = f"keep={keep} {policy}"
            run["exact"] = guarded(
                f"exact {tag}",
                lambda: check_exact(f"zipf keep={keep}", policy, scores, counts, quota, uniforms),
            )
            for impl in ("torch", "triton"):
                call = lambda: run_policy(impl, policy, scores, counts, quota, uniforms)  # noqa
                run[f"{impl}_events"] = guarded(
                    f"time {impl} {tag}", lambda: event_time_ms(call, args.warmup, args.iters)
                )
                run[f"{impl}_profile"] = guarded(
                    f"profile {impl} {tag}", lambda: profile_call(call)
                )
                run[f"{impl}_host_us"] = guarded(
                    f"host time {impl} {tag}", lambda: host_time_us(call, args.iters)
                )
            t, p = run.get("triton_events"), run.get("triton_profile")
            if t and p:
                torch_p = run.get("torch_profile") or {}
                torch_t = run.get("torch_events") or {}
                nan = float("nan")
                report(
                    f"budget {tag}",
                    p["device_time_us"] <= 300.0,
                    f"triton {p['device_time_us']:.1f} us device in {p['kernel_launches']} "
                    f"kernels + {p['copies']} copies/memsets, {t['median_ms']:.3f} ms events, "
                    f"{run.get('triton_host_us') or nan:.0f} us host; torch "
                    f"{torch_p.get('device_time_us', nan):.1f} us device, "
                    f"{torch_t.get('median_ms', nan):.3f} ms events",
                )
            results["runs"].append(run)

    balanced = torch.full((counts.numel(),), n // counts.numel(), dtype=torch.int64)
    balanced[: n % counts.numel()] += 1
    results["sort"] = {
        name: guarded(f"sort {name}", lambda: sort_part(c, device, args))
        for name, c in (("zipf", counts), ("balanced", balanced))
    }

    if not (args.no_adversarial or args.sort_only):
        quota = torch.ceil(0.25 * counts.double()).to(torch.int64).clamp_max(counts)
        kinds = (
            "ties",
            "zeros",
            "nonfinite",
            "denormal",
            "huge",
            "geometric",
            "mixed_magnitudes",
            "few_positive",
        )
        for i, kind in enumerate(kinds):
            s = adversarial_scores(kind, n, args.seed + 10 + i).to(device)
            for policy in ("topk", "sample"):
                ok = guarded(
                    f"exact {kind} {policy}",
                    lambda: check_exact(kind, policy, s, counts, quota, uniforms),
                )
                results["adversarial"].append({"kind": kind, "policy": policy, "ok": ok})
        # Edge uniforms (0, just below 1, out of range) and a single segment of all rows.
        edge_u = torch.tensor([0.0, 1 - 2**-53, 1.0, -0.5, 2.0], dtype=torch.float64)
        edge_u = edge_u.repeat(math.ceil(counts.numel() / 5))[: counts.numel()].to(device)
        ok = guarded(
            "exact edge uniforms sample",
            lambda: check_exact("edge uniforms", "sample", scores, counts, quota, edge_u),
        )
        results["adversarial"].append({"kind": "edge_uniforms", "policy": "sample", "ok": ok})
        one = torch.tensor([n])
        one_q = torch.tensor([n // 3])
        one_u = uniforms[:1].contiguous()
        for policy in ("topk", "sample"):
            ok = guarded(
                f"exact single segment {policy}",
                lambda: check_exact("single segment", policy, scores, one, one_q, one_u),
            )
            results["adversarial"].append({"kind": "single_segment", "policy": policy, "ok": ok})

    # The float64 steps are compiled only when the selection ran (not with --sort-only).
    results["ptx"] = None if args.sort_only else guarded("ptx report", ptx_report)
    if results["ptx"]:
        ptx = results["ptx"]
        report(
            "ptx float64 div/sqrt are IEEE round-to-nearest",
            ptx.get("div.rn.f64", 0) > 0
            and ptx.get("sqrt.rn.f64", 0) > 0
            and ptx.get("rcp.approx", 0) == 0
            and ptx.get("cvt.ftz.f64.f32", 0) == 0,
            json.dumps(ptx),
        )
    results["failures"] = FAILURES
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}; {len(FAILURES)} failure(s)", flush=True)
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
