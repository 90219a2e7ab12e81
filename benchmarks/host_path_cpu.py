"""Host time of the trimmed backward around its replayed graph, measured on the CPU (no GPU).

    python benchmarks/host_path_cpu.py [--tokens 512] [--experts 128] [--hidden 256] [--iters 200]

At EP 1 with the weight gradients fused into ``main_grad`` the whole trimmed backward is one
replayed CUDA graph per layer (``experts/backward_graph.py``). What the host does around that
replay (the uniforms, the checks, the argument block, the kept plan, the statistics) bounds the
layer at 4096-8192 tokens per GPU, where the GPU waits for it (docs/benchmarks.md section 15).
This script times that host code where no GPU is lent: the layer runs on the CPU (the CPU shim,
fp32, one process) with ``megatron_lrmoe/testing/host_graphs.py``'s switches, so the graphs'
kernels run once, in Triton's interpreter, when a graph is captured, and a replay does nothing.

Prints, and writes as JSON (``--out``), the median microseconds per call of each stage of the
op's backward, from ``host_trace.py``'s stage clock (``perf_counter`` around the op's stage
functions, inclusive): ``_graphed_backward`` is everything up to the queued replay and the kept
plan, its parts are listed below it, and ``_record_trimmed`` (statistics) follows it. As on
the GPU host, a call costs several times what it costs in a loop (docs/benchmarks.md section
14). This machine's CPU is not the GPU host's: compare stages and code changes between runs of
this script on one machine (alternate them), not with ``host_trace.py``'s numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
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


def measure(
    rank: int,
    world: int,
    tokens: int,
    experts: int,
    hidden: int,
    iters: int,
    selection: str,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Keep 0.5, EP 1, fused accumulation: median host us per call of each backward stage,
    after five warm-up calls (the second and third capture the front and the layer graph)."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.experts import backward_graph
    from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config
    from megatron_lrmoe.testing.host_graphs import layer_graphs_on_host

    layer_graphs_on_host(replay=False)
    pg = init_megatron_parallel(ep=1)
    cfg = moe_transformer_config(
        expert_model_parallel_size=1, hidden_size=hidden, num_moe_experts=experts,
        moe_router_topk=min(8, experts), moe_aux_loss_coeff=0.0,
    )
    lrmoe = LRMoEConfig(keep_ratio=0.5, selection=selection, grad_accumulation_fusion="on")
    layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
    for p in layer.experts.weights():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    # The same input every call: the same kept count, which the host's shared rows need.
    x = torch.randn(tokens, 1, hidden, generator=gen)
    up = torch.randn(tokens, 1, hidden, generator=gen)

    def step() -> None:
        out, _ = layer(x.clone().requires_grad_(True))
        out.backward(up)
        for p in layer.parameters():
            p.grad = None

    for _ in range(5):
        step()
    labels = BACKWARD_STAGES + tuple(spec.partition(":")[2] for spec in extra)
    clock = StageClock(extra, only=labels)
    try:
        for _ in range(iters):
            step()
            clock.lap()
    finally:
        clock.restore()
    return {
        "stage_us": {
            k: statistics.median(clock.us[k]) for k in labels if any(clock.us[k])
        },
        "layer_graphs": len(backward_graph._GRAPHS.graphs),
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--selection", default="sample", choices=("sample", "topk"))
    parser.add_argument(
        "--time", nargs="*", default=[], metavar="MODULE:NAME",
        help="more functions for the stage clock (as host_trace.py --time), e.g. "
        "megatron_lrmoe.select.kernels:_host_block",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_path.json"))
    args = parser.parse_args()
    # Read by triton when the worker imports it (host_graphs.py needs the interpreter).
    os.environ["TRITON_INTERPRET"] = "1"
    from megatron_lrmoe.testing import run_distributed

    result = run_distributed(
        measure, 1, args.tokens, args.experts, args.hidden, args.iters, args.selection,
        tuple(args.time), timeout=1800,
    )[0]
    result.update(vars(args))
    print(f"keep 0.5 {args.selection}, {args.tokens} tokens, {args.experts} experts, hidden "
          f"{args.hidden}: host us per call (median of {args.iters}), "
          f"{result['layer_graphs']} layer graph(s)")
    for name, us in result["stage_us"].items():
        print(f"  {name:30s} {us:8.1f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
