"""Tiles of memory-bound row kernels at the Qwen3-30B-A3B shape, against the memory's speed (GPU).

    python3 benchmarks/tile_bench.py --case walk|gather|rowdot [--experts 128] [--tokens 16384]
        [--keep 0.5] [--iters 50] [--out tile_bench.json]

``--case walk``: the trimmed backward's one walk, ``rows_triton.row_dot_pack_from_args``:
for every pair the dot of its token's gradient row with the pair's fc2 output row (the router
gradient, which keep 1.0 needs too), and for the kept pairs their scaled gradient row and their
input row written to packed rows, launched through an argument block as the replayed front
does (random routing and a random kept ``--keep`` share, in the layer's expert-sorted pair
order). Per tile: whether the outputs are the bits of the tile the package launches (packed
rows always are; the row-dot's fp32 order may follow the tile).

``--case rowdot``: the router gradient's row-dot launched alone (``row_dot_triton`` with the
token-major slots), as the eager trimmed backward runs it (EP > 1, or no graphs).

``--case gather``: the forward's gather of every pair's token row into expert order
(``[T, H] -> [S, H]``, ``hidden.index_select(0, token_of_pair)`` in the op's forward), torch's
``index_select`` against the Triton row kernel (``_scale_rows_kernel`` without a scale: a copy;
gpu_run21 call 2 ran it with a scale of 1, which reads one fp32 more per row).

Per tile (``BLOCK_M`` rows, ``BLOCK_H`` columns, warps, stages) the median CUDA-event time and
GB/s of the bytes the kernel must move; a device-to-device copy gives the memory's speed.
(Written as walk_bench.py for gpu_run21 call 1, the walk case alone.)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms, write_json  # noqa: E402


def _inputs(
    experts: int, tokens: int, keep: float, hidden: int, topk: int, dev: torch.device
) -> dict:
    """The cases' tensors: pairs in expert-sorted order, slots token-major."""
    gen = torch.Generator(device=dev).manual_seed(7)
    choice = torch.rand(tokens, experts, generator=gen, device=dev).topk(topk, dim=1).indices
    expert_of = choice.reshape(-1)  # token-major pairs
    order = torch.sort(expert_of, stable=True).indices  # pair p (sorted) = token-major order[p]
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=dev)
    slots = slot_of.view(tokens, topk).contiguous()  # [T, topk] sorted pair of each slot
    pairs = order.numel()
    kept = int(round(keep * pairs))
    kept_pairs = torch.randperm(pairs, generator=gen, device=dev)[:kept].sort().values
    bf16 = torch.bfloat16
    return dict(
        g=torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16),
        x=torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16),
        z=torch.randn(pairs, hidden, generator=gen, device=dev).to(bf16),
        probs=torch.rand(pairs, generator=gen, device=dev),
        slots=slots,
        token_of_pair=torch.arange(tokens, device=dev).repeat_interleave(topk)[order],
        kept_pairs=kept_pairs,
        weight=1 + torch.rand(kept, generator=gen, device=dev),
        poison=torch.zeros((), device=dev),
        row_of=torch.empty(pairs + 1, dtype=torch.int64, device=dev),
        d_probs=torch.empty(pairs, device=dev),
        g_out=torch.empty(kept, hidden, dtype=bf16, device=dev),
        x_out=torch.empty(kept, hidden, dtype=bf16, device=dev),
    )


class Case(NamedTuple):
    """One kernel to tile: its package launch, a launch per tile, its outputs, bytes moved."""

    title: str
    package: Callable[[], object]  # as the package launches it (its own tile)
    package_label: str
    tile: Callable[[int, int, int, int], Callable[[], object]]
    outputs: dict[str, torch.Tensor]
    moved: int
    copy_of: torch.Tensor  # a tensor of the kernel's size, copied for the memory's speed


def _walk_case(t: dict, topk: int) -> Case:
    from megatron_lrmoe import triton_common as tc
    from megatron_lrmoe.dispatch import rows_triton as tk

    n_tokens, width = t["g"].shape
    block = torch.zeros(tc.ARG_SLOTS, dtype=torch.int64)
    for slot, name in ((tc.ARG_G, "g"), (tc.ARG_X, "x"), (tc.ARG_PROBS, "probs"),
                       (tc.ARG_Z, "z"), (tc.ARG_SLOT_PLAN, "slots"), (tc.ARG_D_PROBS, "d_probs"),
                       (tc.ARG_G_OUT, "g_out"), (tc.ARG_X_OUT, "x_out")):
        block[slot] = t[name].data_ptr()
    block[tc.ARG_COUNT] = t["kept_pairs"].numel()
    block = block.cuda()
    strides = (t["g"].stride(0), t["z"].stride(0), t["x"].stride(0))
    dtypes = (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
    kernels = tk._kernels()
    n_walk = n_tokens * topk

    def package() -> None:
        tk.row_dot_pack_from_args(
            block, t["kept_pairs"], t["weight"], t["poison"], t["row_of"], (n_tokens, width),
            topk, strides, dtypes, True,
        )

    def tile(block_m: int, block_h: int, warps: int, stages: int) -> Callable[[], object]:
        return lambda: kernels.row_dot_pack_args[(tc.cdiv(n_walk, block_m),)](
            block, t["row_of"], t["weight"], t["poison"], n_walk, width, *strides, topk,
            OUT_TY=tc.tl_dtype(dtypes[0]), G_TY=tc.tl_dtype(dtypes[1]),
            Z_TY=tc.tl_dtype(dtypes[2]), X_TY=tc.tl_dtype(dtypes[3]),
            P_TY=tc.tl_dtype(dtypes[4]), HAS_X=True, BLOCK_M=block_m, BLOCK_H=block_h,
            num_warps=warps, num_stages=stages,
        )

    package()  # fills row_of, which the walk launched alone reads
    kept = t["kept_pairs"].numel()
    moved = (
        t["z"].numel() * 2 + 2 * t["g"].numel() * 2  # z, and g and x read once each
        + 2 * kept * width * 2  # packed gradient and input rows
        + n_walk * 8 + t["d_probs"].numel() * 4 + t["row_of"].numel() * 8  # slots, out, map
    )
    return Case(
        f"walk: {n_walk} walk rows, {kept} kept", package,
        "package launcher (row_of fill + map + walk)", tile,
        {k: t[k] for k in ("d_probs", "g_out", "x_out")}, moved, t["z"],
    )


def _gather_case(t: dict) -> Case:
    from megatron_lrmoe import triton_common as tc
    from megatron_lrmoe.dispatch import rows_triton as tk

    x, token = t["x"], t["token_of_pair"]
    n_out, width = token.numel(), x.shape[1]
    out = torch.empty(n_out, width, dtype=x.dtype, device=x.device)
    kernels = tk._kernels()

    def tile(block_m: int, block_h: int, warps: int, stages: int) -> Callable[[], object]:
        grid = (tc.cdiv(n_out, block_m), tc.cdiv(width, block_h))
        return lambda: kernels.scale_rows[grid](
            out, x, token, token, n_out, width, x.stride(0), out.stride(0), HAS_INDEX=True,
            BLOCK_M=block_m, BLOCK_H=block_h, HAS_SCALE=False, num_warps=warps,
            num_stages=stages,
        )

    return Case(
        f"gather: {n_out} pair rows from {x.shape[0]} token rows",
        lambda: torch.index_select(x, 0, token, out=out), "torch index_select", tile,
        {"out": out}, n_out * width * 2 + x.numel() * 2 + n_out * 8, out,
    )


def _rowdot_case(t: dict) -> Case:
    from megatron_lrmoe import triton_common as tc
    from megatron_lrmoe.dispatch import rows_triton as tk

    g, z, slots = t["g"], t["z"], t["slots"]
    n_walk, width = slots.numel(), g.shape[1]
    out = t["d_probs"]
    index = slots.reshape(-1)
    kernels = tk._kernels()

    def package() -> None:
        out.copy_(tk.row_dot_triton(g, z, torch.float32, slots=slots))

    def tile(block_m: int, block_h: int, warps: int, stages: int) -> Callable[[], object]:
        return lambda: kernels.row_dot[(tc.cdiv(n_walk, block_m),)](
            out, g, z, index, n_walk, width, g.stride(0), z.stride(0), slots.shape[1],
            A_INDEX=False, SLOTS=True, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps,
            num_stages=stages,
        )

    return Case(
        f"row-dot alone: {n_walk} pairs", package, "row_dot_triton (+ a copy of its output)",
        tile, {"d_probs": out}, z.numel() * 2 + g.numel() * 2 + n_walk * 12, z,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=("walk", "gather", "rowdot"), default="walk")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--keep", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--block-m", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--block-h", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "tile_bench.json")
    )
    args = parser.parse_args()

    t = _inputs(args.experts, args.tokens, args.keep, args.hidden, args.topk,
                torch.device("cuda"))
    cases = {"walk": lambda: _walk_case(t, args.topk), "gather": lambda: _gather_case(t),
             "rowdot": lambda: _rowdot_case(t)}
    case = cases[args.case]()
    width = t["g"].shape[1]
    case.package()
    torch.cuda.synchronize()
    ref = {k: v.clone() for k, v in case.outputs.items()}
    copy_bytes = 2 * case.copy_of.numel() * case.copy_of.element_size()
    copy_ms = cuda_median_ms(lambda: case.copy_of.clone(), 5, args.iters)
    pkg_ms = cuda_median_ms(case.package, 5, args.iters)
    print(f"{args.experts} experts, {args.tokens} tokens, keep {args.keep}, {case.title}, "
          f"{case.moved / 1e6:.0f} MB moved")
    print(f"copy (read + write {copy_bytes / 1e6:.0f} MB): {copy_ms * 1e3:.1f} us, "
          f"{copy_bytes / copy_ms / 1e6:.0f} GB/s")
    print(f"{case.package_label}: {pkg_ms * 1e3:.1f} us, {case.moved / pkg_ms / 1e6:.0f} GB/s")
    rows = []
    for bm, bh, w, s in itertools.product(args.block_m, args.block_h, args.warps, args.stages):
        if bh > width or bm * bh > 32768:
            continue
        run = case.tile(bm, bh, w, s)
        for v in case.outputs.values():
            v.fill_(float("nan"))
        try:
            run()
        except Exception as e:  # out of resources for this tile: say so, go on
            print(f"  BLOCK_M {bm:3d} BLOCK_H {bh:5d} warps {w} stages {s}: failed "
                  f"({type(e).__name__})")
            continue
        torch.cuda.synchronize()
        same = {k: bool(torch.equal(case.outputs[k], ref[k])) for k in ref}
        ms = cuda_median_ms(run, 3, args.iters)
        row = dict(block_m=bm, block_h=bh, warps=w, stages=s, us=ms * 1e3,
                   gbps=case.moved / ms / 1e6, same_bits=same)
        rows.append(row)
        bits = ", ".join(f"{k} {v}" for k, v in same.items())
        print(f"  BLOCK_M {bm:3d} BLOCK_H {bh:5d} warps {w} stages {s}: {ms * 1e3:7.1f} us "
              f"{row['gbps']:6.0f} GB/s  same bits: {bits}")
    rows.sort(key=lambda r: r["us"])
    print("fastest:", ", ".join(
        f"{r['block_m']}x{r['block_h']}/w{r['warps']}/s{r['stages']} {r['us']:.1f} us"
        for r in rows[:5]))
    write_json(args.out, dict(vars(args), moved_bytes=case.moved, copy_us=copy_ms * 1e3,
                              package_us=pkg_ms * 1e3, tiles=rows,
                              device=torch.cuda.get_device_name(), torch=torch.__version__))


if __name__ == "__main__":
    main()
