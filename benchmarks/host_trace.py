"""Where the host time of one LRMoE layer call goes, from a torch.profiler trace (GPU).

    torchrun --nproc_per_node=1 benchmarks/host_trace.py --tokens 16384 --keep 1.0 0.5 --out DIR

Unlike cProfile (``host_profile.py``), the profiler's Python tracer attributes time to the real
nesting of Python functions, aten ops and CUDA runtime calls on the calling thread, so the table
says how much *self* host time each Python function, aten op and runtime call costs per call,
inside the forward and inside the backward. The profiler itself slows Python down (its numbers
are upper bounds); ``host ms`` without the profiler is printed beside them.

Per keep ratio it writes ``trace_keep<k>.json`` (Chrome trace) and prints:
    host ms per forward and backward without the profiler (median of ``--iters``);
    host us per call of each named stage, without the profiler (``perf_counter`` around the
        stage functions of ``megatron_lrmoe.op``'s modules and the forward's router, count
        exchange and device-to-host sync, plan and op: ``_forward_stages``; inclusive, so
        ``select_kept`` contains the scoring and the selection);
    per phase: the top self-time entries (Python functions, aten ops, runtime calls), the
        number of kernels launched, the GPU busy time (sum of kernel durations, overlaps merged,
        from the phase's host start until its last kernel ends: work an earlier phase queued
        that still runs then counts too) with "its own work" (the same over the kernels the
        phase launched), and the phase's wall time, so "GPU idle" = wall - busy is what the host
        costs;
    per phase, the GPU idle gaps of one call (``--gap-us``) with the Python frames that
        launched the kernel ending each gap: where the GPU waits for the host.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    attach_main_grad,
    init_distributed,
    moe_config,
    write_json,
    zero_grads,
)
from benchmarks.trace_summary import union_us  # noqa: E402

PHASES = ("lrmoe_bench::forward", "lrmoe_bench::backward")

# Functions of megatron_lrmoe.op timed by --stages (module-level names the op calls), wrapped
# in every module of the op that looks them up (OP_MODULES).
STAGES = (
    "replayed_front", "front_triton", "_record_selection", "row_dot", "select_kept",
    "replayed_score_and_select", "token_norms", "pair_scores", "_local_segments", "_local_plan",
    "pack_kept", "exchange_kept", "_kept_inputs", "expert_backward_parts", "return_dx",
    "gather_sum", "_record_trimmed", "_record_exact", "_graphed_backward", "run_layer_graph",
    "scored_call", "expert_graph_rows", "expert_graph_wanted", "_trimmed_grads",
)
OP_MODULES = ("call", "exact", "trimmed", "stages", "weight_grads", "record")


def _forward_stages() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the forward's stages, timed by ``--stages`` too."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_lrmoe import layer
    from megatron_lrmoe.control.plan import CallPlan
    from megatron_lrmoe.dispatch import dispatcher
    from megatron_lrmoe.dispatch.permutation import PairPermutation

    return [
        (TopKRouter, "forward", "fwd.router"),
        (dispatcher.LRAlltoAllTokenDispatcher, "preprocess", "fwd.preprocess(counts+sync)"),
        (dispatcher.comm, "all_gather_counts", "fwd.all_gather_counts"),
        (PairPermutation, "build", "fwd.PairPermutation.build"),
        (CallPlan, "build", "fwd.CallPlan.build"),
        (layer, "plan_call", "fwd.plan_call"),
        (layer.LRMoELayer, "routed_experts_compute", "fwd.routed_experts_compute"),
        (layer, "lrmoe_experts", "fwd.op"),
    ]


class StageClock:
    """Wraps the op's stage functions (and the forward's, see ``_forward_stages``) with
    ``perf_counter`` (about 1 us each); ``only``: just the stages with these labels.

    ``exclude``: labels (of stages this clock wraps) whose time is left out of every stage
    that encloses them (they still report their own): e.g. the all-to-alls of a multi-process
    CPU run, where a rank waits for the others, so that the stages around them count host
    work only.
    """

    def __init__(
        self,
        extra: tuple[str, ...] = (),
        only: tuple[str, ...] | None = None,
        exclude: tuple[str, ...] = (),
    ) -> None:
        from megatron_lrmoe import op

        self.saved: list[tuple[Any, str, Any]] = []
        self.us: dict[str, list[float]] = collections.defaultdict(list)
        self.calls: dict[str, float] = collections.defaultdict(float)
        self.exclude = frozenset(exclude)
        self._excluded_us = 0.0  # running total of the excluded stages' time
        # A function is looked up in the globals of the module that calls it: wrap it there,
        # in each such module (one label, so the calls through all of them add up).
        modules = [importlib.import_module(f"megatron_lrmoe.op.{m}") for m in OP_MODULES]
        targets = [(m, name, name) for m in modules for name in STAGES if hasattr(m, name)]
        # The autograd functions' own forward and backward (looked up on the class at run time).
        for cls in (op.TrimmedMoEFunction, op.ExactMoEFunction):
            targets += [(cls, meth, f"{cls.__name__}.{meth}") for meth in ("forward", "backward")]
        targets += _forward_stages()
        targets += [_resolve(spec) for spec in extra]
        if only is not None:
            targets = [t for t in targets if t[2] in only]
        self.labels = list(dict.fromkeys(label for _, _, label in targets))
        for owner, name, label in targets:
            raw = inspect.getattr_static(owner, name)
            self.saved.append((owner, name, raw))
            if isinstance(raw, (staticmethod, classmethod)):
                setattr(owner, name, type(raw)(self._wrap(label, raw.__func__)))
            else:
                setattr(owner, name, self._wrap(label, raw))

    def _wrap(self, name: str, fn: Any) -> Any:
        excluded = name in self.exclude

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0, inner0 = time.perf_counter(), self._excluded_us
            try:
                return fn(*a, **k)
            finally:
                us = (time.perf_counter() - t0) * 1e6 - (self._excluded_us - inner0)
                self.calls[name] += us
                if excluded:
                    self._excluded_us += us

        return timed

    def lap(self) -> None:
        """Close one layer call: move the per-call sums into the samples."""
        for name in self.labels:
            self.us[name].append(self.calls.pop(name, 0.0))

    def restore(self) -> None:
        for owner, name, raw in reversed(self.saved):
            setattr(owner, name, raw)


def _resolve(spec: str) -> tuple[Any, str, str]:
    """``"package.module:Name.attr"`` -> (owner, attribute, label) for ``--time``."""
    import importlib

    module, _, qual = spec.partition(":")
    owner: Any = importlib.import_module(module)
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, qual


def _self_times(events: list[dict], start: float, end: float) -> dict[str, list[float]]:
    """Self time (us) per name of the host events of one thread inside ``[start, end)``."""
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime",
                                                  "cuda_driver", "user_annotation")]
    host = [e for e in host if start <= e["ts"] < end and e.get("ph") == "X"]
    by_tid: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, child time]
        def pop() -> None:
            ev, child = stack.pop()
            key = f"{ev['cat'][:3]} {ev['name']}"
            out[key][0] += ev["dur"] - child
            out[key][1] += 1
            if stack:
                stack[-1][1] += ev["dur"]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                pop()
            stack.append([e, 0.0])
        while stack:
            pop()
    return out


def _gpu_busy(events: list[dict], start: float, end: float) -> tuple[float, int]:
    """Union of kernel / memcpy / memset intervals (us) overlapping ``[start, end)``, count."""
    spans = sorted(
        (max(e["ts"], start), min(e["ts"] + e["dur"], end))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
        and e["ts"] < end and e["ts"] + e["dur"] > start
    )
    busy = union_us(spans)
    return busy, len(spans)


def _gaps(events: list[dict], start: float, end: float, min_us: float) -> list[tuple[float, str, str]]:
    """GPU idle gaps of at least ``min_us`` in ``[start, end)``: (gap us, next kernel, launcher).

    The launcher is the innermost Python frames (of megatron_lrmoe / megatron) around the
    runtime call that launched the kernel after the gap, found through the trace's
    ``correlation`` ids; the first gap runs from ``start`` (the phase's host start), and work
    queued before the phase that still runs after ``start`` counts as busy.
    """
    gpu = sorted((e for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
                  and e["ts"] < end and e["ts"] + e["dur"] > start), key=lambda e: e["ts"])
    runtime = {e.get("args", {}).get("correlation"): e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"}
    frames = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"
              and start <= e["ts"] < end]
    out, busy_until = [], start
    for e in gpu:
        if e["ts"] - busy_until >= min_us:
            launch = runtime.get(e.get("args", {}).get("correlation"))
            where = ""
            if launch is not None:
                stack = sorted((f for f in frames if f["tid"] == launch["tid"]
                                and f["ts"] <= launch["ts"] <= f["ts"] + f["dur"]
                                and ("megatron" in f["name"])), key=lambda f: f["ts"])
                where = " < ".join(f["name"].split("/")[-1] for f in stack[::-1][:4])
            out.append((e["ts"] - busy_until, e["name"], where))
        busy_until = max(busy_until, e["ts"] + e["dur"])
    return out


def _launched_in(events: list[dict], start: float, end: float) -> list[dict]:
    """Kernel / memcpy / memset events whose launching runtime call ran in ``[start, end)``.

    Attributes GPU work to the phase that queued it (a forward's GEMMs that run after the
    backward's host start stay the forward's); work without a launch record (none expected)
    goes by its own start time.
    """
    launch = {e.get("args", {}).get("correlation"): e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"}
    out = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X":
            ts = launch.get(e.get("args", {}).get("correlation"), e["ts"])
            if start <= ts < end:
                out.append(e)
    return out


def _kernel_times(gpu: list[dict]) -> dict[str, list[float]]:
    """Summed duration (us) and count per kernel / memcpy / memset name."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        out[e["name"]][0] += e["dur"]
        out[e["name"]][1] += 1
    return out


def _phase_window(events: list[dict], name: str) -> list[tuple[float, float]]:
    """Host windows of the user annotation ``name`` and the GPU window of its work."""
    return [(e["ts"], e["ts"] + e["dur"]) for e in events
            if e.get("cat") == "user_annotation" and e.get("name") == name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5])
    parser.add_argument("--selection", default="sample")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=3, help="calls inside the profiler")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--kernel-rows", type=int, default=25)
    parser.add_argument("--gap-us", type=float, default=20.0,
                        help="list GPU idle gaps of at least this many us per phase (0: none)")
    parser.add_argument(
        "--time", nargs="*", default=[], metavar="MODULE:NAME",
        help="more functions for the stage clock, e.g. "
        "megatron_lrmoe.select.select_triton:_host_table or "
        "megatron_lrmoe.select.select_triton:_Captured.run (looked up by name at call time)",
    )
    parser.add_argument(
        "--main-grad",
        action="store_true",
        help="fp32 main_grad on every parameter, DDP-like, and the weight gradients fused into "
        "it (grad_accumulation_fusion on): what Megatron training runs",
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=None,
        help="experts in the layer (default: Qwen3-30B-A3B's 128); 16 is one GPU's share of EP 8 "
        "(as layer_bench.py --experts)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--trace-dir", default=None, help="where the Chrome traces go (default --out)")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    rank = torch.distributed.get_rank()
    cfg = moe_config(ep) if args.experts is None else moe_config(ep, num_moe_experts=args.experts)
    layer = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).cuda()
    fusion = "on" if args.main_grad else "off"
    if args.main_grad:
        attach_main_grad(layer)
    x = torch.randn(args.tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(x)
    summary: dict[str, Any] = dict(tokens=args.tokens, ep=ep, torch=torch.__version__, calls={})

    def step(annotate: bool) -> tuple[float, float]:
        inp = x.detach().requires_grad_(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with record_function(PHASES[0]) if annotate else _null():
            out, _ = layer(inp)
        t1 = time.perf_counter()
        with record_function(PHASES[1]) if annotate else _null():
            out.backward(up)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        # As in layer_bench.py: no accumulation into an existing ``.grad`` (a full-size add per
        # weight, the same for every variant, that would hide in the backward's kernel table).
        zero_grads(layer)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    for keep in args.keep:
        layer.lrmoe_config = LRMoEConfig(
            keep_ratio=keep, selection=args.selection, grad_accumulation_fusion=fusion
        )
        for _ in range(5):
            step(False)
        host = [step(False) for _ in range(args.iters)]
        fwd_ms = statistics.median(h[0] for h in host)
        bwd_ms = statistics.median(h[1] for h in host)
        clock = StageClock(tuple(args.time))
        try:
            for _ in range(args.iters):
                step(False)
                clock.lap()
        finally:
            clock.restore()
        stage_us = {k: statistics.median(v) for k, v in clock.us.items() if any(v)}
        tag = f"keep{keep:g}"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     with_stack=True) as prof:
            for _ in range(args.profiled):
                step(True)
        trace_dir = args.trace_dir or args.out
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"trace_{tag}_rank{rank}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if rank != 0:
            continue
        rec: dict[str, Any] = dict(host_fwd_ms=fwd_ms, host_bwd_ms=bwd_ms, stage_us=stage_us,
                                   phases={})
        print(f"===== {tag} {args.selection}: host fwd {fwd_ms:.2f} ms, bwd {bwd_ms:.2f} ms per call "
              f"(no profiler)", flush=True)
        print("  host us per call by stage (no profiler, inclusive; forward and backward): "
              + ", ".join(f"{k} {v:.0f}" for k, v in stage_us.items()), flush=True)
        for phase in PHASES:
            windows = _phase_window(events, phase)
            totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            ktotals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            busy = own = wall = kernels = 0.0
            gaps: list[tuple[float, str, str]] = []
            for a, b in windows:
                for k, (t, n) in _self_times(events, a, b).items():
                    totals[k][0] += t
                    totals[k][1] += n
                # GPU work of this phase: what its host window launched, until the last of it
                # ends (the queue drains after the host returns).
                launched = _launched_in(events, a, b)
                gpu_end = max([e["ts"] + e["dur"] for e in launched] + [b])
                for k, (t, c) in _kernel_times(launched).items():
                    ktotals[k][0] += t
                    ktotals[k][1] += c
                if args.gap_us > 0 and not gaps:  # the first profiled call's gaps
                    gaps = _gaps(events, a, gpu_end, args.gap_us)
                bz, nk = _gpu_busy(events, a, gpu_end)
                busy += bz
                own += _gpu_busy(launched, a, gpu_end)[0]
                wall += gpu_end - a
                kernels += nk
            n = max(len(windows), 1)
            host_total = sum(w[1] - w[0] for w in windows) / n / 1e3
            top = sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.rows]
            ktop = sorted(ktotals.items(), key=lambda kv: -kv[1][0])[: args.kernel_rows]
            rec["phases"][phase] = dict(
                host_ms=host_total, gpu_busy_ms=busy / n / 1e3, gpu_own_busy_ms=own / n / 1e3,
                gpu_wall_ms=wall / n / 1e3,
                kernels=kernels / n,
                top=[dict(name=k, self_us=t / n, calls=c / n) for k, (t, c) in top],
                gpu_top=[dict(name=k, gpu_us=t / n, calls=c / n) for k, (t, c) in ktop],
                gaps=[dict(gap_us=g, kernel=k, launcher=w) for g, k, w in gaps],
            )
            print(f"--- {phase}: host {host_total:.2f} ms (profiled), GPU busy {busy / n / 1e3:.2f} "
                  f"ms (its own work {own / n / 1e3:.2f} ms) of {wall / n / 1e3:.2f} ms wall, "
                  f"{kernels / n:.0f} kernels/memcpys per call", flush=True)
            for k, (t, c) in top:
                print(f"  {t / n:9.1f} us  {c / n:6.1f}x  {k[:110]}", flush=True)
            print(f"  GPU kernels of {phase} (summed duration per call):", flush=True)
            for k, (t, c) in ktop:
                print(f"  {t / n:9.1f} us  {c / n:6.1f}x  gpu {k[:106]}", flush=True)
            if gaps:
                print(f"  GPU idle gaps >= {args.gap_us:g} us in {phase} (one call; "
                      f"{sum(g for g, _, _ in gaps):.0f} us in all):", flush=True)
                for g, k, w in gaps:
                    print(f"  {g:9.1f} us  before gpu {k[:60]}  launched in {w[:150]}", flush=True)
        summary["calls"][tag] = rec
    if rank == 0:
        write_json(os.path.join(args.out, "host_trace.json"), summary)
    torch.distributed.destroy_process_group()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    main()
