"""``python -m megatron_lrmoe.replay``: replay routing at EP 8-64 and compare arms against stock.

    python -m megatron_lrmoe.replay --trace DIR --ep 8 16 32 64 [--arms stock rep2 keep0.5 ...]
        [--passes 1] [--tokens recorded|split] [--tokens-per-rank T] [--gemm-table FILE]
        [--costs FILE|none] [--main-grad fused|none]
        [--ep-group G|all] [--common-calls] [--stages-without-moe S ...] [--rank R]
        [--out replay.json]
    python -m megatron_lrmoe.replay --synthetic --layers 48 --experts 128 --zipf 1.2 --ep 64
        [--recorded-ep 8] [--write-trace DIR]

Prints one table per EP size (MoE-layer time per pass, each arm over stock, peak rank load,
memory and network bytes of the busiest rank, kept fraction, calls where a budget bound) and
writes every number as JSON. ``--trace`` takes the run's trace directory: the pipeline stages'
recordings are merged into one pass of all layers (``read_trace``), one EP group of each stage
(``--ep-group``, default 0) or all side by side; ``--rank`` reads one rank's directory alone.
See docs/replay.md for the model and its sources.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional, Sequence

import numpy as np

from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.observe.trace import read_trace, write_trace
from megatron_lrmoe.replay.cost import (
    DEFAULT_GEMM_TABLE,
    DEFAULT_LAYER_COSTS,
    GPUS_PER_NODE,
    MAIN_GRAD_MODES,
    NIC_GBPS,
    NIC_LATENCY_US,
    NVLINK_GBPS,
    NVLINK_LATENCY_US,
    LayerCosts,
    Network,
    load_costs,
    load_gemm_table,
)
from megatron_lrmoe.replay.replay import DEFAULT_ARMS, PHASES, parse_arm, replay_pass
from megatron_lrmoe.replay.shard import TOKEN_MODES, reshard, synthetic_counts

__all__ = ["build_parser", "main", "run"]

_GIB = float(1 << 30)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.replay",
        description="Replay recorded (or synthetic) MoE routing at P virtual EP ranks through "
        "the LRMoE controller and price every rank's forward, backward and exchanges.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        metavar="DIR",
        help="the run's routing trace directory (install_trace_recorder): every pipeline "
        "stage's rank directories, merged into one pass of all layers",
    )
    src.add_argument("--synthetic", action="store_true", help="synthetic skewed counts")
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="read only this rank's directory (one stage, one EP group)",
    )
    p.add_argument(
        "--ep-group",
        default="0",
        metavar="G",
        help="EP group of each stage to read: an index (0: the lowest ranks) or 'all' (every "
        "group's sources side by side: recorded EP x groups sources)",
    )
    p.add_argument(
        "--common-calls",
        action="store_true",
        help="keep the calls every stage recorded completely (else stages that differ fail)",
    )
    p.add_argument(
        "--stages-without-moe",
        type=int,
        nargs="+",
        default=[],
        metavar="S",
        help="pipeline stages that hold no LRMoE layer (record nothing)",
    )
    p.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], help="virtual EP sizes")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), help="arms (see docs)")
    p.add_argument("--passes", type=int, default=1, help="passes to replay (from --first)")
    p.add_argument("--first", type=int, default=0, help="first pass to replay")
    p.add_argument("--tokens", choices=TOKEN_MODES, default="recorded", help="resharding rule")
    p.add_argument("--tokens-per-rank", type=int, default=None, help="scale every rank to T")
    p.add_argument("--topk", type=int, default=None, help="top-k (else the trace's)")
    p.add_argument("--hidden-size", type=int, default=None, help="H (else the trace's, 2048)")
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="F (else trace's, 768)")
    p.add_argument("--activation-bytes", type=int, default=None, help="bytes per element (2)")
    p.add_argument("--gemm-table", default=None, help="GEMM table JSON (gemm_table.py)")
    p.add_argument(
        "--costs",
        default=None,
        metavar="FILE|none",
        help="layer costs (router, elementwise work, main_grad, host) and the network fields a "
        "fitted file sets (benchmarks/replay_fit.py); default: the committed fit; 'none': "
        "GEMMs and exchanges only",
    )
    p.add_argument(
        "--main-grad",
        choices=MAIN_GRAD_MODES,
        default="fused",
        help="weight gradients accumulated into fp32 main_grad in the GEMM (fused, Megatron's "
        "default with gradient_accumulation_fusion) or not accumulated in the layer (none)",
    )
    p.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE)
    p.add_argument("--intra-gbps", type=float, default=None, help=f"default {NVLINK_GBPS:g}")
    p.add_argument("--intra-latency-us", type=float, default=None)
    p.add_argument("--inter-gbps", type=float, default=None)
    p.add_argument("--inter-latency-us", type=float, default=None)
    p.add_argument("--check", action="store_true", help="check every plan's invariants")
    p.add_argument("--out", default="replay.json", help="JSON output ('' for none)")
    syn = p.add_argument_group("synthetic counts (--synthetic)")
    syn.add_argument("--layers", type=int, default=48)
    syn.add_argument("--experts", type=int, default=128)
    syn.add_argument("--zipf", type=float, default=1.0)
    syn.add_argument("--gamma-cv", type=float, default=0.0)
    syn.add_argument("--source-cv", type=float, default=0.3)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--recorded-ep", type=int, default=None, help="EP of the synthetic record")
    syn.add_argument("--write-trace", default=None, help="also write the counts as a trace")
    return p


def _passes(args: argparse.Namespace) -> tuple[list[np.ndarray], dict[str, Any]]:
    """``([L, p, E] counts per pass], meta)`` from the trace or the synthetic generator."""
    if args.synthetic:
        tokens = args.tokens_per_rank or 16384
        topk = args.topk or 8
        recorded = args.recorded_ep or max(args.ep)
        counts = [
            synthetic_counts(
                args.layers,
                recorded,
                args.experts,
                tokens,
                topk,
                zipf=args.zipf,
                gamma_cv=args.gamma_cv,
                source_cv=args.source_cv,
                seed=args.seed + k,
            )
            for k in range(args.first, args.first + args.passes)
        ]
        meta = {"source": "synthetic", "ep_size": recorded, "num_experts": args.experts}
        meta.update(topk=topk, tokens_per_rank=tokens, zipf=args.zipf, gamma_cv=args.gamma_cv)
        meta.update(source_cv=args.source_cv, seed=args.seed)
        if args.write_trace:
            layers = list(range(1, args.layers + 1))
            write_trace(
                args.write_trace,
                np.concatenate(counts),
                layers=layers * len(counts),
                calls=[k for k in range(len(counts)) for _ in layers],
                meta={k: v for k, v in meta.items() if k not in ("ep_size", "num_experts")},
            )
        return counts, meta
    ep_group = args.ep_group if args.ep_group == "all" else _index(args.ep_group, "--ep-group")
    trace = read_trace(
        args.trace,
        args.rank,
        ep_group=ep_group,
        common_calls=args.common_calls,
        stages_without_moe=args.stages_without_moe,
    )
    passes = [c.astype(np.int64) for _, _, c in trace.passes()]
    chosen = passes[args.first : args.first + args.passes]
    if not chosen:
        raise ValueError(
            f"--trace {args.trace}: {len(passes)} passes recorded, none from --first "
            f"{args.first} (lower --first)"
        )
    return chosen, {"source": os.fspath(args.trace), **trace.meta}


def _index(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} ({text!r}) must be an index or 'all'") from None


def _cost(args: argparse.Namespace, meta: dict[str, Any]) -> CostModel:
    def pick(flag: Optional[int], key: str, default: Any) -> Any:
        return flag if flag is not None else meta.get(key, default)

    return CostModel(
        hidden_size=int(pick(args.hidden_size, "hidden_size", 2048)),
        ffn_hidden_size=int(pick(args.ffn_hidden_size, "ffn_hidden_size", 768)),
        gated=bool(meta.get("gated", True)),
        activation_bytes=int(pick(args.activation_bytes, "activation_bytes", 2)),
        param_bytes=int(meta.get("param_bytes", 2)),
    )


def _costs(args: argparse.Namespace) -> tuple[Optional[LayerCosts], Network]:
    """The layer costs and the network: each network field from its flag, else from the costs
    file (``--costs FILE``), else the default."""
    layer: Optional[LayerCosts] = DEFAULT_LAYER_COSTS
    fitted: dict[str, float] = {}
    if args.costs == "none":
        layer = None
    elif args.costs:
        layer, fitted = load_costs(args.costs)
    defaults = {
        "intra_gbps": NVLINK_GBPS,
        "intra_latency_us": NVLINK_LATENCY_US,
        "inter_gbps": NIC_GBPS,
        "inter_latency_us": NIC_LATENCY_US,
    }
    fields = {
        k: getattr(args, k) if getattr(args, k) is not None else fitted.get(k, default)
        for k, default in defaults.items()
    }
    return layer, Network(gpus_per_node=args.gpus_per_node, **fields)


def _mean(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in summaries[0].items():
        if isinstance(value, dict):
            out[key] = {k: float(np.mean([s[key][k] for s in summaries])) for k in value}
        else:
            out[key] = float(np.mean([s[key] for s in summaries]))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Replay as ``args`` say; returns the JSON payload (also logged as tables)."""
    passes, meta = _passes(args)
    cost = _cost(args, meta)
    gemm = load_gemm_table(args.gemm_table) if args.gemm_table else DEFAULT_GEMM_TABLE
    layer, network = _costs(args)
    arms = [parse_arm(a) for a in args.arms]
    topk = args.topk or meta.get("topk")
    if layer is not None and not topk:
        raise ValueError(
            "the layer costs need the router's top-k (tokens = pairs / top-k): the trace records "
            "none; pass --topk K, or --costs none"
        )
    pairs = None
    if args.tokens_per_rank is not None and not args.synthetic:
        if not topk:
            raise ValueError("--tokens-per-rank needs --topk (the trace records no top-k)")
        pairs = args.tokens_per_rank * int(topk)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for ranks in args.ep:
        start = time.perf_counter()
        per_arm: dict[str, list[dict[str, Any]]] = {}
        for counts in passes:
            virtual = np.stack([reshard(c, ranks, args.tokens, pairs) for c in counts])
            for name, result in replay_pass(
                virtual,
                arms,
                cost,
                gemm,
                network,
                check=args.check,
                layer=layer,
                topk=int(topk) if topk else None,
                main_grad=args.main_grad,
            ).items():
                per_arm.setdefault(name, []).append(result.summary())
        seconds[str(ranks)] = time.perf_counter() - start
        table = {name: _mean(s) for name, s in per_arm.items()}
        stock = table["stock"]
        for row in table.values():
            for key in ("moe_ms", "memory_bytes", "network_bytes", "forward_peak_rows"):
                row[f"{key}_vs_stock"] = row[key] / stock[key] if stock[key] else float("nan")
        results[str(ranks)] = table
    return {
        "settings": {
            "trace": meta,
            "ep": list(args.ep),
            "arms": [a for a in args.arms],
            "passes": len(passes),
            "layers": int(passes[0].shape[0]),
            "tokens": args.tokens,
            "tokens_per_rank": args.tokens_per_rank,
            "cost": cost.__dict__,
            "gemm_table": gemm.to_json(),
            "network": {k: v for k, v in network.__dict__.items() if not k.startswith("_")},
            "layer_costs": layer.to_json() if layer is not None else None,
            "main_grad": args.main_grad,
            "phases": list(PHASES),
        },
        "results": results,
        "seconds_per_ep": seconds,
    }


def format_tables(payload: dict[str, Any]) -> str:
    """The payload's results as one text table per EP size."""
    lines = []
    head = (
        f"{'arm':<24} {'MoE ms':>8} {'x stock':>7} {'fwd peak':>9} {'imbal':>6} "
        f"{'mem GiB':>8} {'x stock':>7} {'net GB':>7} {'x stock':>7} {'kept':>5} {'bound':>5}"
    )
    layers = payload["settings"]["layers"]
    for ranks, table in payload["results"].items():
        took = payload["seconds_per_ep"][ranks]
        lines.append(f"EP {ranks}: {layers} layers per pass, replayed in {took:.2f} s")
        lines.append(head)
        for name, r in table.items():
            lines.append(
                f"{name:<24} {r['moe_ms']:8.2f} {r['moe_ms_vs_stock']:7.3f} "
                f"{r['forward_peak_rows']:9.0f} {r['forward_imbalance']:6.2f} "
                f"{r['memory_bytes'] / _GIB:8.2f} {r['memory_bytes_vs_stock']:7.3f} "
                f"{r['network_bytes'] / 1e9:7.2f} {r['network_bytes_vs_stock']:7.3f} "
                f"{r['kept_fraction']:5.2f} {r['binding_calls']:5.0f}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry: parse, replay, print the tables, write the JSON."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        payload = run(args)
    except ValueError as e:
        parser.error(str(e))
    print(format_tables(payload))  # the tool's output (a console entry, not library code)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {args.out}")
    return 0
