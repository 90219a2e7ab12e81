"""Host time of the layer's forward and of the trimmed backward around its replayed graph,
measured on the CPU (no GPU).

    python benchmarks/host_path_cpu.py [--tokens 512] [--experts 128] [--hidden 256] [--iters 200]
    python benchmarks/host_path_cpu.py --mode forward [--tokens 64] [--experts 16] [--hidden 64]
    python benchmarks/host_path_cpu.py --ep 2 [--keep 0.5] [--front eager] [--tokens 256]
        [--experts 32] [--hidden 64]
    python benchmarks/host_path_cpu.py --mode forward --ep 2 [--keep 0.5] [--tokens 256]
        [--experts 32] [--hidden 64]

At EP 1 with the weight gradients fused into ``main_grad`` the whole trimmed backward is one
replayed CUDA graph per layer (``graphs/backward.py``). What the host does around that
replay (the uniforms, the checks, the argument block, the kept plan, the statistics) bounds the
layer at 4096-8192 tokens per GPU, where the GPU waits for it (docs/history/notebook.md section 15).
This script times that host code where no GPU is lent: the layer runs on the CPU (the CPU shim,
fp32, one process) with ``megatron_lrmoe/testing/host_graphs.py``'s switches, so the graphs'
kernels run once, in Triton's interpreter, when a graph is captured, and a replay does nothing.

Prints, and writes as JSON (``--out``), the median microseconds per call of each stage of the
op's backward, from ``host_trace.py``'s stage clock (``perf_counter`` around the op's stage
functions, inclusive): ``_graphed_backward`` is everything up to the queued replay and the kept
plan, its parts are listed below it, and ``_record_trimmed`` (statistics) follows it. As on
the GPU host, a call costs several times what it costs in a loop (docs/history/notebook.md section
14). This machine's CPU is not the GPU host's: compare stages and code changes between runs of
this script on one machine (alternate them), not with ``host_trace.py``'s numbers.

``--mode forward`` times the layer's forward instead (keep ``--keep``, EP 1, fused accumulation,
statistics on: the defaults a training run has). At small calls on the GPU host (16 experts, 4096
tokens per GPU) the forward's host code (Megatron's router, then ours: the dispatcher's stages,
the plan, the statistics, the op's forward) takes several times the expert GEMMs' GPU time. The
CPU runs the same deferred EP 1 path as a Hopper GPU there (fp32 grouped_mm on the CPU; Triton
and the device count copy are the GPU's only differences), with real but tiny kernels. Reported:
``layer_call`` (the whole ``layer(x)``, by ``perf_counter`` around it) and each stage of
``FORWARD_STAGES`` (the stage clock, inclusive), median us per call.

``--mode forward --ep P`` (P > 1) times the forward at expert parallelism P: one gloo process
per rank (CPU shim, fp32, one thread each), with the defaults of ``--ep``'s backward (keep
``--keep``, fused accumulation, statistics on, scope local, ``save`` mode, no replicas, 32
experts, 256 tokens per rank, hidden 64). Every rank's input differs (seeded by its rank), so
the ranks send each other different counts. Besides the EP 1 stages: the all-to-alls' side of
the op (``EP_FORWARD_TARGETS``: ``RowRoute.to_experts`` / ``to_sources`` / ``reorder``) and
the two collectives, ``fwd.all_gather_counts`` and ``all_to_all_rows``, which are left out of
every stage around them (``StageClock``'s ``exclude``, as the backward's ``--ep``), and
``forward_host``: the whole ``layer(x)`` minus them. Per-rank table; the JSON's ``stage_us`` is
rank 0's, ``stage_us_per_rank`` has them all.

``--ep 2`` (backward mode) times the eager backward at expert parallelism > 1 instead: one gloo
process per EP rank (CPU shim, fp32, one thread each), keep ``--keep`` (0.5: the trimmed
backward, ``TrimmedMoEFunction.backward``; 1.0: ``ExactMoEFunction.backward``), fused
accumulation, statistics on, scope local, ``save`` mode, no replicas (the defaults a training
run has; Qwen3-30B runs EP 8 with 16 local experts, hence 32 experts at EP 2 by default).
The front (router gradient, scoring, selection, packing) runs eagerly on the CPU's reference
kernels (``--front eager``: ``row_dot``, ``select_kept``, ``pack_kept``), or as on CUDA through
:func:`replayed_front` with the host switches of ``host_graphs.py`` (``--front graph``: the
front's launches run once, in Triton's interpreter, when its graph is captured; a replay does
nothing and leaves the captured kept plan in place, so later stages see the same rows; the
gradient rows it would have packed stay unwritten, so time the expert GEMMs eagerly). Reported
per rank: ``backward_call`` (the whole ``out.backward``, Megatron's router included, by
``perf_counter``), ``backward_host`` (the same minus its all-to-alls) and each stage of
``EP_BACKWARD_STAGES`` and ``EP_TARGETS`` (the stage clock, inclusive, only the calls inside
the backward), median us per call. A rank waits for the others inside the all-to-alls
(``all_to_all_rows``, reported on its own), so every stage around one is timed without it
(``StageClock``'s ``exclude``): the stages count this rank's host work only. The table prints
every rank, the JSON's ``stage_us`` is rank 0's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_json  # noqa: E402
from benchmarks.host_trace import StageClock  # noqa: E402

# The op's backward stages this path runs (host_trace.STAGES has the other paths' too). Not
# TrimmedMoEFunction.backward and _trimmed_grads as a whole: on the host they also allocate the
# weights' full-size gradient placeholders from the CPU allocator, which takes 0.1-0.6 ms from
# run to run here and a few microseconds from CUDA's caching allocator.
BACKWARD_STAGES = (
    "_graphed_backward", "_local_segments", "scored_call", "expert_graph_rows",
    "run_layer_graph", "_local_plan", "_record_selection", "_record_trimmed",
    "expert_graph_wanted",
)

# The eager backward's stages at EP > 1 (host_trace.STAGES, both autograd functions'
# backward), then ours by name: EP_TARGETS.
EP_BACKWARD_STAGES = (
    "TrimmedMoEFunction.backward", "ExactMoEFunction.backward", "replayed_front", "row_dot",
    "select_kept", "_local_segments", "_local_plan", "_record_selection", "pack_kept",
    "exchange_kept", "_kept_inputs", "expert_backward_parts", "return_dx", "gather_sum",
    "_trimmed_grads", "_record_trimmed", "_record_exact",
)
EP_TARGETS = (
    "megatron_lrmoe.op:ExpertCall.fold_grads",
    "megatron_lrmoe.dispatch.route:RowRoute.to_experts",
    "megatron_lrmoe.dispatch.route:RowRoute.to_sources",
    "megatron_lrmoe.dispatch.route:RowRoute.reorder",
    "megatron_lrmoe.dispatch.comm:all_to_all_rows",
)
# Where a rank waits for the others: left out of every stage around it (StageClock.exclude).
EP_EXCLUDED = ("all_to_all_rows",)

# The forward's stages: host_trace's (router, count exchange, pair plan, call plan, the layer's
# routed experts, the op), then ours by name ("module:Qualified.name", as ``--time``).
FORWARD_STAGES = (
    "fwd.router", "fwd.preprocess(counts+sync)", "fwd.PairPermutation.build",
    "fwd.CallPlan.build", "fwd.routed_experts_compute", "fwd.op", "TrimmedMoEFunction.forward",
    "ExactMoEFunction.forward", "gather_sum",
)
FORWARD_TARGETS = (
    "megatron.core.transformer.moe.moe_layer:MoELayer.forward",
    "megatron_lrmoe.dispatch.dispatcher:LRAlltoAllTokenDispatcher.dispatch_preprocess",
    "megatron_lrmoe.dispatch.dispatcher:LRAlltoAllTokenDispatcher._set_stock_metadata",
    "megatron_lrmoe.dispatch.dispatcher:LRAlltoAllTokenDispatcher.resolve",
    "megatron_lrmoe.layer:LRMoELayer._gemms_take_device_offsets",
    "megatron_lrmoe.layer:LRMoELayer._expert_call",
    "megatron_lrmoe.layer:LRMoELayer._plan",
    "megatron_lrmoe.layer:LRMoELayer._call_stats",
    "megatron_lrmoe.op.exact:expert_forward_parts",
    "megatron_lrmoe.op.trimmed:expert_forward_parts",
)

# At EP > 1 also the count exchange and our stages around the forward's all-to-alls.
EP_FORWARD_STAGES = ("fwd.all_gather_counts",)
EP_FORWARD_TARGETS = (
    "megatron_lrmoe.dispatch.route:RowRoute.to_experts",
    "megatron_lrmoe.dispatch.route:RowRoute.to_sources",
    "megatron_lrmoe.dispatch.route:RowRoute.reorder",
    "megatron_lrmoe.dispatch.comm:all_to_all_rows",
)
# The collectives, where a rank waits for the others (StageClock.exclude).
EP_FORWARD_EXCLUDED = ("fwd.all_gather_counts", "all_to_all_rows")


def _layer(
    tokens: int, experts: int, hidden: int, keep: float, selection: str, ep: int = 1
) -> Any:
    """EP ``ep``, fused accumulation (``main_grad`` attached), no aux loss: one LRMoE layer."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config

    pg = init_megatron_parallel(ep=ep)
    cfg = moe_transformer_config(
        expert_model_parallel_size=ep, hidden_size=hidden, num_moe_experts=experts,
        moe_router_topk=min(8, experts), moe_aux_loss_coeff=0.0,
    )
    lrmoe = LRMoEConfig(keep_ratio=keep, selection=selection, grad_accumulation_fusion="on")
    layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
    for p in layer.experts.weights():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return layer


def measure(
    rank: int,
    world: int,
    tokens: int,
    experts: int,
    hidden: int,
    iters: int,
    selection: str,
    extra: tuple[str, ...] = (),
    keep: float = 0.5,
    front: str = "eager",
) -> dict[str, Any]:
    """Median host us per call of each backward stage, after five warm-up calls.

    EP 1 (``world`` 1): keep 0.5, the graphed backward (the second and third call capture the
    front and the layer graph). EP ``world`` > 1: keep ``keep``, the eager backward, its front
    replayed (``front="graph"``) or eager; only the stage calls inside ``out.backward`` count.
    """
    from megatron_lrmoe.graphs import backward as bg
    from megatron_lrmoe.testing.host_graphs import graphs_on_host, layer_graphs_on_host

    if world == 1:
        layer_graphs_on_host(replay=False)
        keep, stages, targets, excluded = 0.5, BACKWARD_STAGES, tuple(extra), ()
    else:
        if front == "graph":
            graphs_on_host(replay=False)
        stages, targets, excluded = EP_BACKWARD_STAGES, EP_TARGETS + tuple(extra), EP_EXCLUDED
    layer = _layer(tokens, experts, hidden, keep, selection, ep=world)
    gen = torch.Generator().manual_seed(3 + rank)
    # The same input every call: the same kept count, which the host's shared rows need.
    x = torch.randn(tokens, 1, hidden, generator=gen)
    up = torch.randn(tokens, 1, hidden, generator=gen)
    clock: StageClock | None = None
    whole: list[float] = []

    def step() -> None:
        out, _ = layer(x.clone().requires_grad_(True))
        if clock is not None:
            clock.calls.clear()  # the forward's calls of the stages (reorder, gather_sum)
        start = time.perf_counter()
        out.backward(up)
        whole.append((time.perf_counter() - start) * 1e6)
        for p in layer.parameters():
            p.grad = None

    for _ in range(5):
        step()
    whole.clear()
    labels = stages + tuple(spec.partition(":")[2] for spec in targets)
    clock = StageClock(targets, only=labels, exclude=excluded)
    host: list[float] = []
    try:
        for _ in range(iters):
            step()
            host.append(whole[-1] - sum(clock.calls.get(k, 0.0) for k in excluded))
            clock.lap()
    finally:
        clock.restore()
    stage_us: dict[str, float] = {}
    if world > 1:
        stage_us["backward_call"] = statistics.median(whole)
        stage_us["backward_host"] = statistics.median(host)
    stage_us.update({k: statistics.median(clock.us[k]) for k in labels if any(clock.us[k])})
    return {
        "stage_us": stage_us,
        "layer_graphs": len(bg._GRAPHS.graphs),
        "torch": torch.__version__,
    }


def measure_forward(
    rank: int,
    world: int,
    tokens: int,
    experts: int,
    hidden: int,
    iters: int,
    selection: str,
    keep: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Median host us per forward call (gradients on, no backward) after ten warm-up calls:
    ``iters`` whole calls, then ``iters`` more with the stage clock (its wrappers cost about
    1 us each). The same input every call: the same plan every call.

    EP ``world`` > 1: also ``EP_FORWARD_TARGETS``, the collectives (``EP_FORWARD_EXCLUDED``)
    left out of every stage around them, and ``forward_host``: the whole call minus them (from
    the clocked calls)."""
    layer = _layer(tokens, experts, hidden, keep, selection, ep=world)
    x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(3 + rank))

    def call() -> float:
        inp = x.clone().requires_grad_(True)
        start = time.perf_counter()
        layer(inp)
        return (time.perf_counter() - start) * 1e6

    for _ in range(10):
        call()
    whole = [call() for _ in range(iters)]
    stages, targets, excluded = FORWARD_STAGES, FORWARD_TARGETS + tuple(extra), ()
    if world > 1:
        stages, excluded = stages + EP_FORWARD_STAGES, EP_FORWARD_EXCLUDED
        targets = FORWARD_TARGETS + EP_FORWARD_TARGETS + tuple(extra)
    labels = stages + tuple(spec.partition(":")[2] for spec in targets)
    clock = StageClock(targets, only=labels, exclude=excluded)
    host: list[float] = []
    try:
        for _ in range(iters):
            us = call()
            host.append(us - sum(clock.calls.get(k, 0.0) for k in excluded))
            clock.lap()
    finally:
        clock.restore()
    stage_us = {"layer_call": statistics.median(whole)}
    if world > 1:
        stage_us["forward_host"] = statistics.median(host)
    stage_us.update(
        {k: statistics.median(clock.us[k]) for k in labels if any(clock.us[k])}
    )
    return {"stage_us": stage_us, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", default="backward", choices=("backward", "forward"))
    parser.add_argument(
        "--ep", type=int, default=1, help="EP ranks, one gloo process each (either mode)"
    )
    parser.add_argument(
        "--front", default="eager", choices=("eager", "graph"),
        help="--ep > 1: the backward's front eager, or replayed as on CUDA",
    )
    parser.add_argument(
        "--tokens", type=int,
        help="per rank; default 512 (backward), 64 (forward), 256 (--ep > 1, either mode)",
    )
    parser.add_argument(
        "--experts", type=int, help="default 128 (backward), 16 (forward), 32 (--ep)"
    )
    parser.add_argument("--hidden", type=int, help="default 256 (backward), 64 (forward, --ep)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--selection", default="sample", choices=("sample", "topk"))
    parser.add_argument(
        "--keep", type=float, default=0.5,
        help="keep ratio (forward mode and --ep > 1; EP 1 backward: 0.5)",
    )
    parser.add_argument(
        "--time", nargs="*", default=[], metavar="MODULE:NAME",
        help="more functions for the stage clock (as host_trace.py --time), e.g. "
        "megatron_lrmoe.select.select_triton:_host_block",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_path.json"))
    args = parser.parse_args()
    forward = args.mode == "forward"
    if args.ep < 1:
        parser.error(f"--ep {args.ep}: at least one rank")
    if args.ep > 1:
        defaults = (256, 32, 64)
    else:
        defaults = (64, 16, 64) if forward else (512, 128, 256)
    for name, value in zip(("tokens", "experts", "hidden"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not forward and (args.ep == 1 or args.front == "graph"):
        # Read by triton when the worker imports it (host_graphs.py needs the interpreter).
        os.environ["TRITON_INTERPRET"] = "1"
    from megatron_lrmoe.testing import run_distributed

    shape = (args.tokens, args.experts, args.hidden, args.iters, args.selection)
    if forward:
        ranks = run_distributed(
            measure_forward, args.ep, *shape, args.keep, tuple(args.time), timeout=1800
        )
        what = f"forward, EP {args.ep}, keep {args.keep}"
    elif args.ep == 1:
        ranks = run_distributed(measure, 1, *shape, tuple(args.time), timeout=1800)
        what = f"keep 0.5, {ranks[0]['layer_graphs']} layer graph(s)"
    else:
        ranks = run_distributed(
            measure, args.ep, *shape, tuple(args.time), args.keep, args.front, timeout=1800
        )
        what = f"EP {args.ep}, keep {args.keep}, front {args.front}"
    result = ranks[0]
    if args.ep > 1:
        result = dict(result, stage_us_per_rank=[r["stage_us"] for r in ranks])
    result.update(vars(args))
    print(f"{what}, {args.selection}, {args.tokens} tokens, {args.experts} experts, hidden "
          f"{args.hidden}: host us per call (median of {args.iters})")
    per_rank = result.get("stage_us_per_rank", [result["stage_us"]])
    if len(per_rank) > 1:
        print(f"  {'':30s} " + " ".join(f"{f'rank {r}':>8s}" for r in range(len(per_rank))))
    for name in result["stage_us"]:
        print(f"  {name:30s} " + " ".join(f"{r.get(name, 0.0):8.1f}" for r in per_rank))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
