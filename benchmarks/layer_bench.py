"""One MoE layer, stock Megatron-Core vs LRMoE: time, memory, floor, overheads, syncs, launches.

Run (one process per GPU; EP = number of processes):

    torchrun --nproc_per_node=1 benchmarks/layer_bench.py --tokens 4096 16384 --out ep1.json
    torchrun --nproc_per_node=2 benchmarks/layer_bench.py --tokens 4096 16384 --out ep2.json

Variants: stock ``MoELayer`` as installed (alltoall dispatcher + ``SequentialMLP`` local experts:
no Transformer Engine on our GPU machine) and ``LRMoELayer`` at keep 1.0 and each keep ratio x
selection policy (``save``), plus ``recompute`` and (EP > 1) scope ``global`` at keep 0.5. All
variants run in one process on the same inputs and weights, measured round-robin (iteration i of
every variant before iteration i+1 of any), so drift of the machine hits all alike.

Per variant and token count (medians over ``--iters`` after ``--warmup``):
    fwd_ms, bwd_ms: CUDA events around the forward and the backward call.
    bwd_cpu_ms: host time of the ``backward()`` call (it returns once everything is queued, so
        below bwd_ms means the GPU, not Python, is the bottleneck).
    overhead_ms: GPU time of scoring + selection + packing (the layer's own CUDA-event spans;
        with the front graph one span that also holds the router gradient's row-dot). 0 where
        the front and the expert half replay as one graph (EP 1, fused accumulation): no span
        can be recorded inside it; the ``--eager-experts`` variant times that front.
    saved_mib: memory allocated after the forward with the output alive, minus before.
    peak_mib: peak allocated during the backward, minus before the forward.
    graph_mib: what the expert graphs (``graphs/backward.py``) hold from call to call,
        beside peak_mib: their shared buffers (with the front's static buffers) and memory
        pool (a replay's intermediates live in the pool, which memory_allocated does not
        count). Measured on a replay after a fresh capture.
    bwd_syncs: synchronising CUDA calls inside the backward (torch's sync debug mode).
    kernels_fwd / kernels_bwd: CUDA kernel launches per call (torch.profiler), with the
        profiler's backward CPU and CUDA totals.
Floor (same run): the six grouped GEMMs of the experts (fc1, fc2 forward; dgrad and wgrad of
both) on the same rows and group sizes, plus at EP > 1 the four all-to-alls of the pair rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    attach_main_grad,
    init_distributed,
    moe_config,
    write_json,
    zero_grads,
)
from megatron_lrmoe.options import KernelOptions  # noqa: E402


@dataclasses.dataclass
class Variant:
    name: str
    lrmoe: Any  # LRMoEConfig, or None for stock
    samples: dict = dataclasses.field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def median(self, key: str) -> Optional[float]:
        vals = self.samples.get(key)
        return statistics.median(vals) if vals else None


# The A/B switches: ``--eager-<name>`` adds keep 0.5 ``sample`` with that graph off (its
# ``KernelOptions`` switch, in the variant's ``LRMoEConfig.kernels``).
EAGER_SWITCHES = {
    "selection": "select_graphs",  # the selection launched kernel by kernel
    "scoring": "score_graphs",  # the scoring launched before the replayed selection
    "front": "front_graphs",  # the row-dot and packing launched around the graph
    "experts": "expert_graphs",  # the expert half (EP 1, fused main_grad) launched eagerly
}


def _variants(
    ep: int,
    keeps: list[float],
    selections: list[str],
    extras: bool,
    eager: Sequence[str] = (),
    fusion: str = "off",
) -> list[Variant]:
    """The LRMoE variants; ``fusion`` "on" / "both" adds each with its weight gradients
    accumulated into ``main_grad`` (name suffix " fused"; needs ``--main-grad``)."""
    from megatron_lrmoe import LRMoEConfig

    base = _base_variants(ep, keeps, selections, extras, eager, LRMoEConfig)
    out = [] if fusion == "on" else list(base)
    if fusion in ("on", "both"):
        out += [
            Variant(f"{v.name} fused", dataclasses.replace(v.lrmoe, grad_accumulation_fusion="on"))
            for v in base
        ]  # fmt: skip
    return out


def _base_variants(
    ep: int, keeps: list[float], selections: list[str], extras: bool, eager: Sequence[str],
    config: Any,
) -> list[Variant]:
    LRMoEConfig = config  # noqa: N806
    out = [Variant("LRMoE keep 1.0", LRMoEConfig(keep_ratio=1.0, grad_accumulation_fusion="off"))]
    for keep in keeps:
        if keep >= 1.0:
            continue
        for sel in selections:
            out.append(
                Variant(
                    f"LRMoE keep {keep} {sel}",
                    LRMoEConfig(keep_ratio=keep, selection=sel, grad_accumulation_fusion="off"),
                )
            )
    if extras:
        out.append(
            Variant(
                "LRMoE keep 0.5 sample recompute",
                LRMoEConfig(keep_ratio=0.5, activation_mode="recompute"),
            )
        )
        if ep > 1:
            out.append(
                Variant("LRMoE keep 0.5 sample global", LRMoEConfig(keep_ratio=0.5, scope="global"))
            )
    # The same keep-0.5 call with one graph switched off (the code before that graph, or that
    # part of it, existed): an A/B of each graph inside one process.
    for what in eager:
        kernels = KernelOptions(**{EAGER_SWITCHES[what]: False})
        out.append(
            Variant(
                f"LRMoE keep 0.5 sample eager {what}",
                LRMoEConfig(keep_ratio=0.5, kernels=kernels),
            )
        )
    return out


def _timed_step(layer: Any, x: torch.Tensor, up: torch.Tensor, v: Variant) -> None:
    inp = x.detach().requires_grad_(True)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    ev[0].record()
    out, _ = layer(inp)
    ev[1].record()
    t0 = time.perf_counter()
    out.backward(up)
    v.add("bwd_cpu_ms", (time.perf_counter() - t0) * 1e3)
    ev[2].record()
    ev[2].synchronize()
    v.add("fwd_ms", ev[0].elapsed_time(ev[1]))
    v.add("bwd_ms", ev[1].elapsed_time(ev[2]))
    stats = getattr(layer, "last_call_stats", None)
    if stats is not None:
        t = stats.timings_ms
        # "front": one graph for the router gradient's row-dot, scoring, selection and packing.
        spans = ("scoring", "selection", "packing", "front")
        v.add("overhead_ms", sum(t.get(k, 0.0) for k in spans))
        for k, val in t.items():
            v.add(f"{k}_ms", val)
    del out, inp
    zero_grads(layer)


def _memory_step(layer: Any, x: torch.Tensor, up: torch.Tensor, v: Variant) -> None:
    inp = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out, _ = layer(inp)
    torch.cuda.synchronize()
    v.add("saved_mib", (torch.cuda.memory_allocated() - base) / 2**20)
    torch.cuda.reset_peak_memory_stats()
    # Count synchronising calls the backward makes (warn mode reports each one).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out.backward(up)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    v.add("peak_mib", (torch.cuda.max_memory_allocated() - base) / 2**20)
    v.add("bwd_syncs", sum("synchroniz" in str(w.message) for w in caught))
    del out, inp
    zero_grads(layer)


def _profile_step(layer: Any, x: torch.Tensor, up: torch.Tensor, v: Variant, out_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    inp = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("lrmoe_bench_fwd"):
            out, _ = layer(inp)
            torch.cuda.synchronize()
        with record_function("lrmoe_bench_bwd"):
            out.backward(up)
            torch.cuda.synchronize()
    events = prof.events()
    spans = {e.name: (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("lrmoe_bench_")}

    def launches(span: tuple[int, int]) -> int:
        return sum(
            1
            for e in events
            if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
            and span[0] <= e.time_range.start <= span[1]
        )

    v.add("kernels_fwd", launches(spans["lrmoe_bench_fwd"]))
    v.add("kernels_bwd", launches(spans["lrmoe_bench_bwd"]))
    safe = v.name.replace(" ", "_").replace(".", "")
    with open(os.path.join(out_dir, f"profile_{safe}.txt"), "w", encoding="utf-8") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    del out, inp
    zero_grads(layer)


def _floor(
    layer: Any, ep: int, tokens: int, warmup: int, iters: int, keeps: list[float]
) -> dict[str, float]:
    """Grouped GEMMs of the experts on the last call's rows, and (EP > 1) four all-to-alls.

    Per keep ratio k in ``keeps`` also the backward floor on the rows a trimmed backward keeps
    (``ceil(k * rows)`` per (source, expert) chunk, within a row per chunk of the quota): the
    four backward GEMMs on them plus (EP > 1) the two all-to-alls of kept rows
    (``bwd_floor_k<k>_ms``). The weight-gradient GEMMs write the whole weight gradient at every
    keep ratio, so this floor does not shrink in proportion to k.
    """
    from megatron_lrmoe.experts.grouped_gemm import GroupSizes, grouped_mm_nn, grouped_mm_nt, grouped_mm_tn
    from megatron_lrmoe.dispatch import comm

    plan_counts = layer.token_dispatcher.global_counts
    rank, nle = layer.token_dispatcher.ep_rank, layer.num_local_experts
    w1, w2 = (w.detach() for w in layer.experts.weights())
    hid, f1, f = w1.shape[2], w1.shape[1], w2.shape[2]
    dev, dt = w1.device, w1.dtype
    group = layer.ep_group

    def shapes(keep: float) -> tuple[GroupSizes, int, list[int], list[int]]:
        counts = torch.ceil(plan_counts.double() * keep).long()  # [P, E] kept per chunk
        recv_counts = counts[:, rank * nle : (rank + 1) * nle]
        send = counts[rank].reshape(ep, nle).sum(1).tolist()
        return GroupSizes(recv_counts.sum(0)), int(recv_counts.sum()), send, recv_counts.sum(1).tolist()

    def operands(rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(rows, n, device=dev, dtype=dt) for n in (hid, f, hid, f1))

    groups, rows, send, recv = shapes(1.0)
    x, a, dz, dh = operands(rows)

    def fwd() -> None:
        grouped_mm_nt(x, w1, groups)
        grouped_mm_nt(a, w2, groups)

    def bwd_on(ops: tuple[torch.Tensor, ...], g: GroupSizes) -> Callable[[], None]:
        x_, a_, dz_, dh_ = ops

        def run() -> None:
            grouped_mm_nn(dz_, w2, g)
            grouped_mm_tn(dz_, a_, g)
            grouped_mm_tn(dh_, x_, g)
            grouped_mm_nn(dh_, w1, g)

        return run

    def a2a_on(s: list[int], r: list[int], times: int) -> Callable[[], None]:
        rows_s = torch.randn(int(sum(s)), hid, device=dev, dtype=dt)

        def run() -> None:
            for _ in range(times // 2):
                back = comm.all_to_all_rows(rows_s, s, r, group)
                comm.all_to_all_rows(back, r, s, group)

        return run

    def timed(fn: Callable[[], None]) -> float:
        samples = []
        for it in range(warmup + iters):
            torch.distributed.barrier()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            if it >= warmup:
                samples.append(s.elapsed_time(e))
        return statistics.median(samples)

    out = {
        "gemm_fwd_ms": timed(fwd),
        "gemm_bwd_ms": timed(bwd_on((x, a, dz, dh), groups)),
        "a2a4_ms": timed(a2a_on(send, recv, 4)) if ep > 1 else 0.0,
    }
    out["floor_ms"] = out["gemm_fwd_ms"] + out["gemm_bwd_ms"] + out["a2a4_ms"]
    out["rows"] = rows
    for keep in sorted(set(keeps) | {1.0}):
        g_k, rows_k, send_k, recv_k = shapes(keep)
        ops = tuple(t[:rows_k] for t in (x, a, dz, dh))
        bwd_k = timed(bwd_on(ops, g_k)) + (timed(a2a_on(send_k, recv_k, 2)) if ep > 1 else 0.0)
        out[f"bwd_floor_k{keep:g}_ms"] = bwd_k
        out[f"rows_k{keep:g}"] = rows_k
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per GPU")
    parser.add_argument("--keep", type=float, nargs="+", default=[0.75, 0.5, 0.25])
    parser.add_argument("--selections", nargs="+", default=["sample", "topk"])
    parser.add_argument("--no-extras", action="store_true", help="skip recompute / global rows")
    parser.add_argument(
        "--eager-selection",
        action="store_true",
        help="add keep 0.5 sample with the selection launched kernel by kernel "
        "(--no-lrmoe-select-graphs), beside the default CUDA-graph replay",
    )
    parser.add_argument(
        "--eager-scoring",
        action="store_true",
        help="add keep 0.5 sample with the scoring launched before the replayed selection "
        "(--no-lrmoe-score-graphs), beside the default one graph for both",
    )
    parser.add_argument(
        "--eager-front",
        action="store_true",
        help="add keep 0.5 sample with the router gradient's row-dot and the packing launched "
        "around the replayed scoring and selection (--no-lrmoe-front-graphs), beside the default "
        "one graph for all four",
    )
    parser.add_argument(
        "--eager-experts",
        action="store_true",
        help="add keep 0.5 sample with only the front replayed and the expert half of the "
        "backward launched kernel by kernel (--no-lrmoe-expert-graphs), beside the default: the "
        "whole trimmed backward as one replayed graph per layer (EP 1 with --main-grad "
        "--fusion on only)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock layer")
    parser.add_argument(
        "--main-grad",
        action="store_true",
        help="give every parameter an fp32 main_grad and a DDP-like hook adding each gradient "
        "into it (as in training; without it gradients stay in .grad and are dropped)",
    )
    parser.add_argument(
        "--fusion",
        choices=("off", "on", "both"),
        default="off",
        help="LRMoE variants with the expert gradients added into main_grad by the layer "
        "(--lrmoe-grad-accumulation-fusion on; needs --main-grad): off, on, or both",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel-launch profile")
    parser.add_argument(
        "--experts",
        type=int,
        default=None,
        help="experts in the layer (default: Qwen3-30B-A3B's 128). At EP 1, 16 experts with "
        "top-8 give each GPU the expert-side load of Qwen3-30B-A3B at EP 8 (T tokens, 8T rows "
        "over 16 experts), without the exchange",
    )
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "layer_bench.json"))
    args = parser.parse_args()

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.graphs import backward as bg

    ep = int(os.environ.get("WORLD_SIZE", "1"))
    pg = init_distributed(ep)
    rank = torch.distributed.get_rank()
    cfg = moe_config(ep) if args.experts is None else moe_config(ep, num_moe_experts=args.experts)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    stock = None
    if not args.no_stock:
        stock = get_moe_module_spec(use_te=False, num_experts=cfg.num_moe_experts)(
            config=cfg, pg_collection=pg, layer_number=1
        ).cuda()
    lr = get_lrmoe_moe_spec(LRMoEConfig())(config=cfg, pg_collection=pg, layer_number=1).cuda()
    if stock is not None:
        lr.load_state_dict(stock.state_dict(), strict=False)
    if args.fusion != "off" and not args.main_grad:
        parser.error("--fusion on/both needs --main-grad (the fused path adds into main_grad)")
    if args.main_grad:
        for module in (stock, lr):
            if module is not None:
                attach_main_grad(module)
    eager = [name for name in EAGER_SWITCHES if getattr(args, f"eager_{name}")]
    variants = _variants(ep, args.keep, args.selections, not args.no_extras, eager, args.fusion)
    if stock is not None:
        variants.insert(0, Variant("stock MoELayer (SequentialMLP)", None))

    def layer_for(v: Variant) -> Any:
        if v.lrmoe is None:
            return stock
        lr.lrmoe_config = v.lrmoe
        return lr

    rows: list[dict] = []
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        up = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        for v in variants:
            v.samples = {}
            for _ in range(args.warmup):
                _timed_step(layer_for(v), x, up, Variant("warmup", None))
        for _ in range(args.iters):
            for v in variants:
                torch.distributed.barrier()
                _timed_step(layer_for(v), x, up, v)
        # The first sync-debug-mode backward of a process reports one synchronising call
        # whichever layer runs it (stock too, when stock comes first): discard one.
        _memory_step(layer_for(variants[0]), x, up, Variant("warmup", None))
        for v in variants:
            torch.distributed.barrier()
            # The expert graphs' memory, per variant: captured afresh and measured on a
            # replay (the first call of a shape gets no shared buffers, the second runs
            # eagerly on them, the third captures).
            bg.reset()
            for _ in range(3):
                _memory_step(layer_for(v), x, up, Variant("warmup", None))
            _memory_step(layer_for(v), x, up, v)
            v.add("graph_mib", bg.graph_memory_bytes() / 2**20)
            if not args.no_profile and rank == 0 and ep == 1:
                # Profiling one rank of several would desynchronise the collectives; at
                # EP > 1 run benchmarks/profile_layer.py instead.
                _profile_step(layer_for(v), x, up, v, out_dir)
        lr.lrmoe_config = LRMoEConfig(keep_ratio=1.0)
        _timed_step(lr, x, up, Variant("floor-setup", None))
        floor = _floor(lr, ep, tokens, args.warmup, args.iters, args.keep)
        keep1s = {v.name: v for v in variants if v.name.startswith("LRMoE keep 1.0")}
        for v in variants:
            keep1 = keep1s.get("LRMoE keep 1.0" + (" fused" if v.name.endswith(" fused") else ""))
            keep1 = keep1 or next(iter(keep1s.values()))
            row = {"tokens": tokens, "variant": v.name}
            if v.lrmoe is not None:
                row["config"] = dataclasses.asdict(v.lrmoe)
            for key in sorted(v.samples):
                row[key] = v.median(key)
            row["total_ms"] = row["fwd_ms"] + row["bwd_ms"]
            if v.lrmoe is not None:
                k = v.lrmoe.keep_ratio
                row["bwd_vs_keep1"] = row["bwd_ms"] / keep1.median("bwd_ms")
                row["fwd_vs_keep1"] = row["fwd_ms"] / keep1.median("fwd_ms")
                row["bwd_target"] = None if k >= 1 else k + 0.05
                # What the backward would be if trimming cost nothing beyond keep 1's non-GEMM
                # work: keep 1's backward with its GEMM (and exchange) floor swapped for keep k's.
                f1, fk = floor.get("bwd_floor_k1_ms"), floor.get(f"bwd_floor_k{k:g}_ms")
                if f1 is not None and fk is not None:
                    row["bwd_floor_vs_keep1"] = fk / f1
                    row["bwd_attainable"] = (keep1.median("bwd_ms") - f1 + fk) / keep1.median("bwd_ms")
            rows.append(row)
        rows.append({"tokens": tokens, "variant": "floor", **floor})
        if rank == 0:
            keep1 = next(iter(keep1s.values()))
            print(f"== {tokens} tokens/GPU, EP={ep}; floor {floor['floor_ms']:.2f} ms "
                  f"(gemm fwd {floor['gemm_fwd_ms']:.2f} bwd {floor['gemm_bwd_ms']:.2f} a2a "
                  f"{floor['a2a4_ms']:.2f}); keep 1.0 total / floor "
                  f"{(keep1.median('fwd_ms') + keep1.median('bwd_ms')) / floor['floor_ms']:.3f}",
                  flush=True)
            for r in rows:
                if r["tokens"] != tokens or r["variant"] == "floor":
                    continue
                print(
                    f"{r['variant']:34s} fwd {r['fwd_ms']:6.2f} bwd {r['bwd_ms']:6.2f} "
                    f"(cpu {r['bwd_cpu_ms']:6.2f}) bwd/keep1 {r.get('bwd_vs_keep1', 0):.3f} "
                    f"(attainable {r.get('bwd_attainable') or 0:.3f}) "
                    f"ovh {r.get('overhead_ms') or 0:.3f} saved {r['saved_mib']:7.0f} peak "
                    f"{r['peak_mib']:7.0f} (+graphs {r.get('graph_mib') or 0:.0f}) MiB syncs "
                    f"{r['bwd_syncs']:.0f} "
                    + (  # not counted under --no-profile
                        f"launches {r['kernels_fwd']:.0f}/{r['kernels_bwd']:.0f}"
                        if "kernels_fwd" in r
                        else "launches -"
                    ),
                    flush=True,
                )
    if rank == 0:
        write_json(
            args.out,
            dict(ep=ep, device=torch.cuda.get_device_name(), torch=torch.__version__,
                 command=" ".join(sys.argv), rows=rows),
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
