"""LRMoE layers stacked as in a model: the host queues layer after layer, nothing waits between.

    torchrun --nproc_per_node=1 benchmarks/model_bench.py [--layers 8] [--experts 16]
        [--hidden 2048] [--ffn 768] [--tokens 8192] [--keep 1.0 0.75 0.5] [--selection sample]
        [--skew 0] [--rounds 10] [--warmup 3] [--profile DIR] [--recompute none|moe]
        [--out model_bench.json]

One process per GPU; expert parallelism over all of them (EP = number of processes),
``--tokens`` per GPU; times and memory are the largest over the ranks.

``layer_bench.py`` times one layer call started on an idle GPU, so the host's work in front of
the layer's first kernels and between them (Megatron's router, the pair plan, the op's set-up,
the backward's Python) is on its clock whenever the GPU is faster than the host; at small calls
that is most of what it measures. In a model the host queues the next layer while the GPU still
works on this one. Here ``--layers`` LRMoE layers of the Qwen3-30B-A3B MoE shape (``--experts``
experts; ``--hidden`` and ``--ffn``, the expert FFN, default to its 2048 and 768; weight
gradients fused into an fp32 ``main_grad``, as in training) form a residual
stream (each adds its output to the next one's input) and run forward, then backward, with no
synchronisation inside a round; CUDA events around the stack give each phase's time per layer
as a model sees it (the one start-up of the round is spread over the layers).

Routing: random router weights on random tokens give the experts nearly even groups, a trained
router does not (docs/benchmarks.md section 25). ``--skew CV`` (default 0: the routers as
built, nothing added) adds a per-expert bias ``log(shares)`` to each layer's router logits, the
shares drawn from a Gamma distribution of coefficient of variation CV (shape 1/CV^2, rate 1;
``common.gamma_shares``) seeded with the layer's number: the same bias on every rank and at
every keep ratio. The bias is installed here only, by wrapping that router instance's
``gating`` (``TopKRouter.forward`` routes on the logits it returns). The skew reached is in each
row (``tokens_cv``, ``tokens_max``).

Per keep ratio (its own layers, built afresh from the same seed), medians over ``--rounds``
after ``--warmup`` (at EP 1 each layer's backward graph is captured in the warm-up). The keep
ratios run one after the other in ``--keep``'s order (one set of layers alive at a time): where
the host bounds a phase (the forward at 4096 tokens) the later one measured 2-7 % slower
whatever its keep ratio (docs/benchmarks.md section 29), so compare such shapes over runs in
both orders. Reported:
    fwd_ms, bwd_ms: GPU time per layer of the forward and the backward.
    host_fwd_ms, host_bwd_ms: host time per layer to queue them (below the GPU time: the GPU is
        the bound, as it is in a model whose host runs ahead).
    bwd_vs_keep1: bwd_ms over keep 1.0's (wherever 1.0 is in ``--keep``; absent without it).
    layer_ms, layer_vs_keep1: fwd_ms + bwd_ms, and its ratio to keep 1.0's.
``--recompute moe`` runs every layer under Megatron's MoE-layer recompute (the layer keeps its
input only and runs its forward again inside the backward, which bwd_ms then includes): the
stock arm a memory-bound run falls back to, and LRMoE at keep < 1 under the same recompute.
    peak_mib: peak memory allocated during one round above what the layers hold before it.
    graphs_mib: what the expert graphs hold (``graphs.backward.graph_memory_bytes``).
    stale_layers: layers of the previous keep ratio still alive when this one's were built
        (0, or its memory figures count them too; a warning says so).
    reserved_mib: memory reserved after the rounds (the graphs' pool included; each keep
        ratio starts without graphs or shared buffers, ``graphs.backward.reset``), and what it
        holds then: allocated_mib (live tensors, the layers' weights and ``main_grad`` and the
        graphs' pool included), inactive_split_mib (free pieces of partly used segments, which
        the allocator cannot give back: fragmentation), segments (their number); the rest of
        reserved_mib is whole free segments, given back before an out-of-memory error.
    op_fwd_gpu_ms, rest_fwd_gpu_ms, op_bwd_gpu_ms, rest_bwd_gpu_ms (``--profile DIR``): per
        layer, the GPU's busy time (the union of its kernels and copies) in the op (the
        routed experts' autograd function) and in the rest of each phase (Megatron's router,
        its auxiliary loss and the residual stream), from three more rounds under torch's
        profiler (one warms it up; ``trace_summary.py`` attributes each activity by the host
        range that launched it; the traces stay in DIR for ``trace_summary.py A B``, which
        lists the kernels of two side by side). The rest of the backward is the same code at
        every keep ratio; the op's backward ratio is what the trimmed path changes.
    op_bwd_by_kind_ms (``--profile DIR``): the op's backward per layer by kind of kernel
        (``trace_summary.KINDS``: grouped GEMMs, weight gradients, activation backward,
        gradient rows, gather-sum, scores and selection, other), summed kernel time.
    tokens_cv, tokens_max: the tokens per expert that the first layer's router sends in one
        forward (all ranks' tokens summed; outside the rounds): their coefficient of variation
        (std / mean over the experts) and the largest expert's count.
Floor, per layer (GPU only, keep 1.0's rows, rank 0: ``layer_bench._floor``): the grouped GEMMs
of the experts, at EP > 1 plus the four all-to-alls of the pair rows (``floor_ms``; printed as
"GEMMs"); ``acc_ms`` the fp32 ``main_grad`` accumulation of both weight gradients (a bf16 add into
fp32, which the fused weight gradient does in its epilogue and an unfused layer leaves to DDP).

On a CPU (a smoke run with the test-only shim) the times are host times and no floor is taken.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import weakref
from contextlib import nullcontext
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    QWEN3_30B_A3B_MOE,
    attach_main_grad,
    cuda_median_ms,
    gamma_shares,
    init_distributed,
    moe_config,
    write_json,
    zero_grads,
)


class _Clock:
    """CUDA events on a GPU, ``perf_counter`` on the CPU: milliseconds between marks."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (waits for the last one)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _build(
    args: argparse.Namespace,
    ep: int,
    keep: float,
    pg: Any,
    device: torch.device,
    skew: float = 0.0,
) -> list[Any]:
    """``args.layers`` LRMoE layers of keep ratio ``keep``, the same weights at every call;
    ``skew > 0`` biases each layer's router (:func:`_skew_router`)."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec

    recompute = (
        dict(recompute_granularity="selective", recompute_modules=["moe"])
        if args.recompute == "moe"
        else {}
    )
    cfg = moe_config(
        ep,
        num_moe_experts=args.experts,
        hidden_size=args.hidden,
        moe_ffn_hidden_size=args.ffn,
        **recompute,
    )
    lrmoe = LRMoEConfig(
        keep_ratio=keep, selection=args.selection, grad_accumulation_fusion="on",
        activation_mode=args.activation_mode,
    )  # fmt: skip
    torch.manual_seed(1234)  # the same weights at every keep ratio
    layers = []
    for number in range(1, args.layers + 1):
        spec = get_lrmoe_moe_spec(lrmoe)
        layer = spec(config=cfg, pg_collection=pg, layer_number=number).to(device)
        attach_main_grad(layer)
        if skew > 0:
            _skew_router(layer, skew)
        layers.append(layer)
    return layers


def _release(layers: list[Any]) -> int:
    """Empties ``layers`` and collects; returns how many of them are still alive.

    A layer's last call leaves its dispatcher's routing weights with their autograd graph,
    which reaches every earlier layer's op and, through its context, that layer: one stray
    reference to the last layer holds the whole stack, weights and ``main_grad`` (a loop
    variable did in docs/benchmarks.md section 26's skewed runs: the next keep ratio's
    reserved memory counted two stacks).
    """
    refs = [weakref.ref(layer) for layer in layers]
    layers.clear()
    gc.collect()
    return sum(ref() is not None for ref in refs)


def _skew_router(layer: Any, cv: float) -> None:
    """Adds ``log(gamma_shares(experts, cv, seed=layer_number))``, one bias per expert, to the
    logits that ``layer``'s router instance's ``gating`` returns (``TopKRouter.forward`` routes
    on them)."""
    router = layer.router
    shares = gamma_shares(router.config.num_moe_experts, cv, seed=layer.layer_number)
    bias = shares.log().to(router.weight.device)
    gating = router.gating

    def skewed(input: torch.Tensor) -> torch.Tensor:
        logits = gating(input)
        return logits + bias.to(logits.dtype)  # the router's dtype, whatever its setting

    router.gating = skewed


def _tokens_per_expert(layer: Any, x: torch.Tensor) -> dict[str, float]:
    """Coefficient of variation (std / mean over the experts) and largest count of the tokens per
    expert that ``layer``'s router sends from ``x``, summed over the ranks (no gradient, so no
    auxiliary loss)."""
    with torch.no_grad():
        _, routing_map = layer.router(x)
    counts = routing_map.sum(0).to(torch.float64)
    torch.distributed.all_reduce(counts)
    return dict(tokens_cv=float(counts.std() / counts.mean()), tokens_max=int(counts.max()))


def _round(
    layers: list[Any], x: torch.Tensor, up: torch.Tensor, annotate: bool = False
) -> dict[str, float]:
    """Forward through the stack, then backward; per-layer GPU and host milliseconds (the
    largest over the ranks). ``annotate``: name the phases for the profiler
    (``trace_summary.OWNERS``)."""
    forward, backward = (
        (record_function("model_bench.forward"), record_function("model_bench.backward"))
        if annotate
        else (nullcontext(), nullcontext())
    )
    clock = _Clock(x.device)
    if clock.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    clock.mark()
    h = x.detach().requires_grad_(True)
    with forward:
        for layer in layers:
            out, _ = layer(h)
            h = h + out
    clock.mark()
    t1 = time.perf_counter()
    with backward:
        h.backward(up)
    clock.mark()
    t2 = time.perf_counter()
    fwd, bwd = clock.spans_ms()
    n = len(layers)
    for layer in layers:
        zero_grads(layer)
    times = dict(
        fwd_ms=fwd / n,
        bwd_ms=bwd / n,
        host_fwd_ms=(t1 - t0) * 1e3 / n,
        host_bwd_ms=(t2 - t1) * 1e3 / n,
    )
    return dict(zip(times, _max_over_ranks(list(times.values()), x.device)))


def _profiled(
    layers: list[Any], x: torch.Tensor, up: torch.Tensor, path: str
) -> dict[str, float]:
    """Three more rounds under torch's profiler (the first warms it up, two are recorded), the
    trace written to ``path``; per layer, from :func:`trace_summary.summarize`, the GPU's busy
    time (ms, the union of its activities) in the op's forward and backward and in the rest of
    each phase (Megatron's router and auxiliary loss, the residual stream)."""
    from benchmarks import trace_summary

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=2),
        on_trace_ready=lambda prof: prof.export_chrome_trace(path),
    ) as prof:
        for _ in range(3):
            _round(layers, x, up, annotate=True)
            prof.step()
    summary = trace_summary.summarize(path, top=0)
    owners, n = summary["owners"], len(layers)
    parts = dict(
        op_fwd_gpu_ms=owners["moe_fwd"]["busy_ms"] / n,
        rest_fwd_gpu_ms=owners["bench_fwd_rest"]["busy_ms"] / n,
        op_bwd_gpu_ms=owners["moe_bwd"]["busy_ms"] / n,
        rest_bwd_gpu_ms=owners["bench_bwd_rest"]["busy_ms"] / n,
    )
    kinds = summary["by_kind"]  # per op call: per layer
    out: dict[str, Any] = dict(zip(parts, _max_over_ranks(list(parts.values()), x.device)))
    out["op_bwd_by_kind_ms"] = dict(zip(kinds, _max_over_ranks(list(kinds.values()), x.device)))
    return out


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def _accumulation_ms(layer: Any, warmup: int, iters: int) -> float:
    """GPU ms of adding bf16 weight gradients of both projections into their fp32 main_grad."""
    pairs = [(w.main_grad, torch.randn_like(w)) for w in layer.experts.weights()]
    return cuda_median_ms(lambda: [m.add_(g) for m, g in pairs], warmup, iters)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    hidden, ffn = QWEN3_30B_A3B_MOE["hidden_size"], QWEN3_30B_A3B_MOE["moe_ffn_hidden_size"]
    parser.add_argument(
        "--hidden", type=int, default=hidden, help=f"hidden size (default {hidden})"
    )
    parser.add_argument("--ffn", type=int, default=ffn, help=f"expert FFN size (default {ffn})")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--selection", choices=("sample", "topk"), default="sample")
    parser.add_argument(
        "--skew", type=float, default=0.0, metavar="CV",
        help="add log(shares), Gamma of this coefficient of variation, to each layer's router "
        "logits (0: none; default 0)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--profile", default=None, metavar="DIR",
        help="after the rounds, profile three more per keep ratio and write each rank's trace "
        "to DIR (made if missing) as trace_k<keep>_rank<r>.json",
    )  # fmt: skip
    parser.add_argument(
        "--recompute", choices=("none", "moe"), default="none",
        help="moe: Megatron's MoE-layer recompute (recompute_modules=['moe']): each layer keeps "
        "only its input and runs its forward again inside the backward",
    )  # fmt: skip
    parser.add_argument(
        "--activation-mode", choices=("save", "recompute", "lean"), default="save",
        help="LRMoE's activation mode at keep < 1; default save",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.skew < 0:
        parser.error(f"--skew {args.skew}: a coefficient of variation, not below 0")
    if args.warmup < 2:
        parser.error(f"--warmup {args.warmup}: at least 2 (graphs are captured on a 2nd call)")

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.experts % ep:
        parser.error(f"--experts {args.experts}: not a multiple of EP {ep} (the processes)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pg = init_distributed(ep, device.type)
    from megatron_lrmoe.graphs import backward as bg

    base_cfg = moe_config(ep)
    heads = base_cfg.num_attention_heads
    if args.hidden <= 0 or args.hidden % heads:
        parser.error(f"--hidden {args.hidden}: a positive multiple of the config's {heads} heads")
    if args.ffn <= 0:
        parser.error(f"--ffn {args.ffn}: the expert FFN size, above 0")
    if args.experts < base_cfg.moe_router_topk:
        parser.error(
            f"--experts {args.experts}: fewer than the router's top-{base_cfg.moe_router_topk}"
        )
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, generator=gen).to(dtype)
    up = torch.randn(x.shape, device=device, generator=gen).to(dtype)
    rows: list[dict[str, Any]] = []
    floor: dict[str, float] = {}
    stale = 0  # layers of the previous keep ratio still alive when this one's are built
    for keep in args.keep:
        layers = _build(args, ep, keep, pg, device, skew=args.skew)
        for _ in range(args.warmup):
            _round(layers, x, up)
        samples = [_round(layers, x, up) for _ in range(args.rounds)]
        row: dict[str, Any] = {"keep": keep, "stale_layers": stale}
        for key in samples[0]:
            row[key] = statistics.median(s[key] for s in samples)
        row.update(_tokens_per_expert(layers[0], x))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _round(layers, x, up)
            stats = torch.cuda.memory_stats()
            memory = (
                (torch.cuda.max_memory_allocated() - base) / 2**20,
                torch.cuda.memory_reserved() / 2**20,
                bg.graph_memory_bytes() / 2**20,
                torch.cuda.memory_allocated() / 2**20,
                stats.get("inactive_split_bytes.all.current", 0) / 2**20,
                stats.get("segment.all.current", 0),
            )
            keys = (
                "peak_mib", "reserved_mib", "graphs_mib", "allocated_mib", "inactive_split_mib",
                "segments",
            )  # fmt: skip
            row.update(zip(keys, _max_over_ranks(list(memory), device)))
            if not floor:
                from benchmarks.layer_bench import _floor

                floor = _floor(layers[0], ep, args.tokens, args.warmup, args.rounds, [])
                floor["acc_ms"] = _accumulation_ms(layers[0], args.warmup, args.rounds)
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            trace = os.path.join(args.profile, f"trace_k{keep:g}_rank{rank}.json")
            row.update(_profiled(layers, x, up, trace))
        rows.append(row)
        # Each keep ratio starts from no layers, no graphs and no shared buffers (a deleted
        # layer's graphs go with its weights; the shared buffers and their pool would stay).
        stale = _release(layers)
        if stale:
            print(
                f"model_bench: {stale} layer(s) of keep {keep:g} still referenced after release; "
                "the next keep ratio's memory counts them (stale_layers)",
                file=sys.stderr,
            )
        bg.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        torch.distributed.destroy_process_group()
        return
    keep1 = next((r for r in rows if r["keep"] == 1.0), None)
    print(
        f"{args.layers} layers, {args.experts} experts, EP {ep}, {args.tokens} tokens per GPU, "
        f"{args.selection}, router skew {args.skew:g}, recompute {args.recompute}, per layer "
        f"(medians of {args.rounds} rounds):"
    )
    for row in rows:
        row["layer_ms"] = row["fwd_ms"] + row["bwd_ms"]
        if keep1 is not None:
            row["bwd_vs_keep1"] = row["bwd_ms"] / keep1["bwd_ms"]
            row["layer_vs_keep1"] = row["layer_ms"] / (keep1["fwd_ms"] + keep1["bwd_ms"])
        memory = (
            f" peak {row['peak_mib']:.0f} MiB, reserved {row['reserved_mib']:.0f} MiB (allocated "
            f"{row['allocated_mib']:.0f}, inactive split {row['inactive_split_mib']:.0f}, "
            f"{row['segments']:.0f} segments), graphs {row['graphs_mib']:.0f} MiB"
            if "peak_mib" in row
            else ""
        )
        ratio = (
            f" (bwd/keep1 {row['bwd_vs_keep1']:.3f}, fwd+bwd/keep1 {row['layer_vs_keep1']:.3f})"
            if "bwd_vs_keep1" in row
            else ""
        )
        parts = (
            f" GPU busy (profiled): op fwd {row['op_fwd_gpu_ms']:.3f}, rest of fwd "
            f"{row['rest_fwd_gpu_ms']:.3f}, op bwd {row['op_bwd_gpu_ms']:.3f}, rest of bwd "
            f"{row['rest_bwd_gpu_ms']:.3f};"
            if "op_bwd_gpu_ms" in row
            else ""
        )
        print(
            f"  keep {row['keep']:g}: fwd {row['fwd_ms']:.3f} ms, bwd {row['bwd_ms']:.3f} ms{ratio}"
            f"; host fwd {row['host_fwd_ms']:.3f}, bwd {row['host_bwd_ms']:.3f};{parts} tokens "
            f"per expert cv {row['tokens_cv']:.3f}, max {row['tokens_max']};{memory}"
        )
        if "op_bwd_by_kind_ms" in row:
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in row["op_bwd_by_kind_ms"].items())
            print(f"    op bwd by kind of kernel (ms, profiled): {kinds}")
    if floor and keep1 is not None:
        total = keep1["fwd_ms"] + keep1["bwd_ms"]
        print(
            f"  floor: GEMMs {floor['floor_ms']:.3f} ms (fwd {floor['gemm_fwd_ms']:.3f}, bwd "
            f"{floor['gemm_bwd_ms']:.3f}, all-to-alls {floor['a2a4_ms']:.3f}), main_grad "
            f"accumulation {floor['acc_ms']:.3f} ms; keep "
            f"1.0 / GEMMs {total / floor['floor_ms']:.3f}, / (GEMMs + accumulation) "
            f"{total / (floor['floor_ms'] + floor['acc_ms']):.3f}"
        )
    if args.out:
        payload = {
            "args": vars(args), "ep": ep, "torch": torch.__version__, "rows": rows, "floor": floor,
        }  # fmt: skip
        write_json(args.out, payload)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
