"""Device memory a model's backward graphs keep, layer after layer (GPU, one process).

    torchrun --nproc_per_node=1 benchmarks/graph_memory.py [--layers 16] [--experts 16]
        [--tokens 4096] [--keep 0.5] [--calls 3] [--stream-per-capture] [--out graph_memory.json]

``--layers`` LRMoE layers of the Qwen3-30B-A3B MoE shape (``--experts`` experts each, weight
gradients fused into an fp32 ``main_grad``) run forward and backward ``--calls`` times each, one
layer after the other; each layer's backward graph is captured on its second call
(``graphs/backward.py``). After every round this prints ``memory_allocated``,
``memory_reserved`` and what the graphs hold (that module's ``graph_memory_bytes``: the fronts'
buffers and the graphs' memory pool). Keep 1.0 captures nothing and is the baseline.

``--stream-per-capture`` records every capture on a new side stream, as ``cuda_graphs.capture``
did before 7ccdf9d (the eager warm-up stays on the current stream, as since 01f65b1): the
caching allocator reuses a freed block only on the stream it was freed on, so the graphs' shared
pool then grows with the captures (up to torch's 32 pool streams). Run the script once with
and once without it (one process each: the allocator's state carries over within a process).
``gpu_run20/call1``: 16 layers, 16 experts, 4096 tokens, keep 0.5: graphs 247 vs 3937 MiB,
reserved 8324 vs 15706 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    attach_main_grad,
    init_distributed,
    moe_config,
    write_json,
    zero_grads,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--stream-per-capture", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_memory.py needs a GPU (the backward graphs are CUDA graphs)")

    from megatron_lrmoe import LRMoEConfig, cuda_graphs, get_lrmoe_moe_spec
    from megatron_lrmoe.graphs import backward as bg

    if args.stream_per_capture:
        cuda_graphs._side_stream = lambda device: torch.cuda.Stream(device)
    pg = init_distributed(1)
    cfg = moe_config(1, num_moe_experts=args.experts)
    lrmoe = LRMoEConfig(keep_ratio=args.keep, grad_accumulation_fusion="on")
    layers = []
    for number in range(1, args.layers + 1):
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=number)
        layers.append(layer.cuda())
        attach_main_grad(layers[-1])
    gen = torch.Generator(device="cuda").manual_seed(100)
    x = torch.randn(args.tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16,
                    generator=gen)  # fmt: skip
    up = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows = []
    for call in range(1, args.calls + 1):
        for layer in layers:
            inp = x.detach().requires_grad_(True)
            out, _ = layer(inp)
            out.backward(up)
            del out, inp
            zero_grads(layer)
        torch.cuda.synchronize()
        row = dict(
            call=call,
            allocated_mib=torch.cuda.memory_allocated() / 2**20,
            reserved_mib=torch.cuda.memory_reserved() / 2**20,
            graphs_mib=bg.graph_memory_bytes() / 2**20,
            layer_graphs=len(bg._GRAPHS.graphs),
        )
        rows.append(row)
        print(
            f"after call {call} of {args.layers} layers (keep {args.keep}, "
            f"{'a stream per capture' if args.stream_per_capture else 'one side stream'}): "
            f"allocated {row['allocated_mib']:.0f} MiB, reserved {row['reserved_mib']:.0f} MiB, "
            f"graphs {row['graphs_mib']:.0f} MiB, {row['layer_graphs']} layer graphs",
            flush=True,
        )
    if args.out:
        write_json(args.out, {"args": vars(args), "torch": torch.__version__, "rows": rows})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
