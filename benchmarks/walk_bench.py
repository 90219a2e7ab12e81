"""Tiles of the trimmed backward's one walk (router gradient row-dot + packing), on a GPU.

    python3 benchmarks/walk_bench.py [--experts 128] [--tokens 16384] [--keep 0.5]
        [--iters 50] [--out walk_bench.json]

``triton_kernels.row_dot_pack_from_args`` walks the tokens once: for every pair the dot of its
token's gradient row with the pair's fc2 output row (the router gradient, which keep 1.0 needs
too), and for the kept pairs their scaled gradient row and their input row written to packed
rows. It moves about 1.1 GB at 128 experts, 16384 tokens and keep 0.5 and is memory-bound, so
its time against the bytes it moves says how far it is from the memory's speed.

Inputs of the Qwen3-30B-A3B shape (hidden 2048, top-8, bf16; random routing and a random kept
half, in the expert-sorted pair order the layer uses), launched through an argument block as the
replayed front does. Per tile (``BLOCK_M`` walk rows, ``BLOCK_H`` columns, warps, stages) it
prints the median CUDA-event time, GB/s, and whether the outputs are the bits of the tile the
package launches (packed rows always are; the row-dot's fp32 order may follow the tile). A
device-to-device copy of the fc2 output rows gives the memory's speed on this GPU.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms, write_json  # noqa: E402


def _inputs(
    experts: int, tokens: int, keep: float, hidden: int, topk: int, dev: torch.device
) -> dict:
    """The walk's tensors: pairs in expert-sorted order, slots token-major."""
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
        kept_pairs=kept_pairs,
        weight=1 + torch.rand(kept, generator=gen, device=dev),
        poison=torch.zeros((), device=dev),
        row_of=torch.empty(pairs + 1, dtype=torch.int64, device=dev),
        d_probs=torch.empty(pairs, device=dev),
        g_out=torch.empty(kept, hidden, dtype=bf16, device=dev),
        x_out=torch.empty(kept, hidden, dtype=bf16, device=dev),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "walk.json"))
    args = parser.parse_args()

    from megatron_lrmoe import triton_kernels as tk

    t = _inputs(args.experts, args.tokens, args.keep, args.hidden, args.topk,
                torch.device("cuda"))
    n_tokens, width = t["g"].shape
    block = torch.zeros(tk.ARG_SLOTS, dtype=torch.int64)
    for slot, name in ((tk.ARG_G, "g"), (tk.ARG_X, "x"), (tk.ARG_PROBS, "probs"),
                       (tk.ARG_Z, "z"), (tk.ARG_SLOT_PLAN, "slots"), (tk.ARG_D_PROBS, "d_probs"),
                       (tk.ARG_G_OUT, "g_out"), (tk.ARG_X_OUT, "x_out")):
        block[slot] = t[name].data_ptr()
    block[tk.ARG_COUNT] = t["kept_pairs"].numel()
    block = block.cuda()
    strides = (t["g"].stride(0), t["z"].stride(0), t["x"].stride(0))
    dtypes = (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
    kernels = tk._kernels()
    n_walk = n_tokens * args.topk

    def package() -> None:  # the launcher as the front calls it (its own tile)
        tk.row_dot_pack_from_args(
            block, t["kept_pairs"], t["weight"], t["poison"], t["row_of"], (n_tokens, width),
            args.topk, strides, dtypes, True,
        )

    def tile(block_m: int, block_h: int, warps: int, stages: int):
        def run() -> None:
            kernels.row_dot_pack_args[(tk._cdiv(n_walk, block_m),)](
                block, t["row_of"], t["weight"], t["poison"], n_walk, width, *strides,
                args.topk, OUT_TY=tk._tl_dtype(dtypes[0]), G_TY=tk._tl_dtype(dtypes[1]),
                Z_TY=tk._tl_dtype(dtypes[2]), X_TY=tk._tl_dtype(dtypes[3]),
                P_TY=tk._tl_dtype(dtypes[4]), HAS_X=True, BLOCK_M=block_m, BLOCK_H=block_h,
                num_warps=warps, num_stages=stages,
            )
        return run

    package()  # fills row_of for the walk launched alone below
    torch.cuda.synchronize()
    ref = {k: t[k].clone() for k in ("d_probs", "g_out", "x_out")}
    kept = t["kept_pairs"].numel()
    moved = (
        t["z"].numel() * 2 + 2 * t["g"].numel() * 2  # z, and g and x read once each
        + 2 * kept * width * 2  # packed gradient and input rows
        + n_walk * 8 + t["d_probs"].numel() * 4 + t["row_of"].numel() * 8  # slots, out, map
    )
    copy_ms = cuda_median_ms(lambda: t["z"].clone(), 5, args.iters)
    pkg_ms = cuda_median_ms(package, 5, args.iters)
    print(f"{args.experts} experts, {args.tokens} tokens, keep {args.keep}: {n_walk} walk rows, "
          f"{kept} kept, {moved / 1e6:.0f} MB moved")
    print(f"copy of z (read + write {2 * t['z'].numel() * 2 / 1e6:.0f} MB): {copy_ms * 1e3:.1f} us,"
          f" {2 * t['z'].numel() * 2 / copy_ms / 1e6:.0f} GB/s")
    print(f"package launcher (row_of fill + map + walk): {pkg_ms * 1e3:.1f} us, "
          f"{moved / pkg_ms / 1e6:.0f} GB/s")
    rows = []
    for bm, bh, w, s in itertools.product(args.block_m, args.block_h, args.warps, args.stages):
        if bh > width or bm * bh > 32768:
            continue
        run = tile(bm, bh, w, s)
        for k in ref:
            t[k].fill_(float("nan"))
        try:
            run()
        except Exception as e:  # out of resources for this tile: say so, go on
            print(f"  BLOCK_M {bm:3d} BLOCK_H {bh:5d} warps {w} stages {s}: failed "
                  f"({type(e).__name__})")
            continue
        torch.cuda.synchronize()
        same = {k: bool(torch.equal(t[k], ref[k])) for k in ref}
        ms = cuda_median_ms(run, 3, args.iters)
        row = dict(block_m=bm, block_h=bh, warps=w, stages=s, us=ms * 1e3,
                   gbps=moved / ms / 1e6, same_bits=same)
        rows.append(row)
        print(f"  BLOCK_M {bm:3d} BLOCK_H {bh:5d} warps {w} stages {s}: {ms * 1e3:7.1f} us "
              f"{row['gbps']:6.0f} GB/s  same bits: d_probs {same['d_probs']}, packed "
              f"{same['g_out'] and same['x_out']}")
    rows.sort(key=lambda r: r["us"])
    print("fastest:", ", ".join(
        f"{r['block_m']}x{r['block_h']}/w{r['warps']}/s{r['stages']} {r['us']:.1f} us"
        for r in rows[:5]))
    write_json(args.out, dict(vars(args), moved_bytes=moved, copy_us=copy_ms * 1e3,
                              package_us=pkg_ms * 1e3, tiles=rows,
                              device=torch.cuda.get_device_name(), torch=torch.__version__))


if __name__ == "__main__":
    main()
