"""The experts' weight gradient into Megatron's fp32 ``main_grad`` (GPU), two ways, side by side:

    python benchmarks/wgrad_bench.py [--rows 128 256 512 1024] [--out wgrad_bench.json]

* ``gemm+add``: torch's grouped GEMM writes the bf16 gradient, then ``main_grad += grad`` (what
  Megatron's DDP hook does for a layer without gradient-accumulation fusion), and the GEMM alone;
* ``fused``: :func:`megatron_lrmoe.experts.wgrad_triton.grouped_wgrad_triton`, the fp32
  accumulation in the GEMM's epilogue, for a few tile configurations.

Shapes: the Qwen3-30B-A3B experts (128 experts, fc1 ``[2F=1536, H=2048]``, fc2 ``[H, F=768]``),
``--rows`` rows per expert on average (group sizes drawn from a multinomial, as routing gives).
Medians of CUDA-event times after warm-up; the fused result is checked against an fp32
reference.

Trained routers are not uniform: ``--skew CV ...`` draws the experts' shares from a Gamma
distribution with that coefficient of variation first (0: uniform), and ``--order`` lays the
groups out in the drawn order (``drawn``), largest first (``descending``) or smallest first
(``ascending``); the kernels visit groups in memory order. ``--fused-only`` skips the GEMM,
cuBLAS and overwrite references (a sweep of tiles over skews).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cuda_median_ms, gamma_shares  # noqa: E402
from megatron_lrmoe.experts.grouped_gemm import GroupSizes, grouped_mm_tn  # noqa: E402
from megatron_lrmoe.experts.wgrad_triton import (  # noqa: E402
    LARGE_GROUP_CONFIG,
    WgradConfig,
    config_for,
    grouped_wgrad_triton,
)

TILES = [
    WgradConfig(128, 128, 32, 4, 4),  # the default tile before gpu_run26
    WgradConfig(128, 256, 64, 8, 3, 1),  # the large-group tile before gpu_run26
    WgradConfig(128, 128, 64, 8, 3),
    WgradConfig(128, 128, 64, 4, 4),
    WgradConfig(64, 128, 32, 4, 4),
]
# The first two tiles on the other grid: one program per tile, or persistent (1, 2 per SM).
OTHER_GRID = [
    WgradConfig(**{**vars(tile), "programs_per_sm": pps})
    for tile in TILES[:2]
    for pps in (0, 1, 2)
    if pps != tile.programs_per_sm
]
# Every tile above again with the fire-and-forget atomic epilogue.
ATOMIC = [WgradConfig(**{**vars(c), "atomic_epilogue": True}) for c in TILES + OTHER_GRID]
CONFIGS = TILES + OTHER_GRID + ATOMIC
# --quick: the two load-add-store tiles used before the atomic epilogue, and the atomic
# epilogue on the tiles that were best with it in gpu_run26 call 1.
QUICK = [
    WgradConfig(128, 128, 32, 4, 4),
    WgradConfig(128, 256, 64, 8, 3, 1),
    WgradConfig(64, 128, 32, 4, 4, atomic_epilogue=True),
    WgradConfig(128, 128, 32, 4, 4, atomic_epilogue=True),
    WgradConfig(128, 256, 64, 8, 3, 0, atomic_epilogue=True),
    WgradConfig(128, 256, 64, 8, 3, 1, atomic_epilogue=True),
]


def _group_sizes(rows: int, experts: int, cv: float, order: str) -> torch.Tensor:
    """``experts`` group sizes summing to about ``rows * experts``: a multinomial over shares
    drawn from a Gamma distribution of coefficient of variation ``cv`` (uniform at 0), laid out
    in ``order``. The same draw for the same ``rows`` and ``cv`` (each order, each projection)."""
    torch.manual_seed(rows * 1000 + round(cv * 100))
    shares = gamma_shares(experts, cv)
    sizes = torch.distributions.Multinomial(rows * experts, shares / shares.sum()).sample().long()
    if order != "drawn":
        sizes = sizes.sort(descending=order == "descending").values
    return sizes


def _tile(text: str) -> WgradConfig:
    m, n, k, warps, stages, pps, atomic = (int(v) for v in text.split(","))
    return WgradConfig(m, n, k, warps, stages, pps, bool(atomic))


def _print_sass(kernels: list) -> None:
    """Counts of the global-memory, atomic and MMA instructions in each compiled kernel."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for kernel in kernels:
        try:
            caches = kernel.device_caches.values()
            compiled_kernels = [c for cache in caches for c in cache[0].values()]
        except (AttributeError, TypeError, IndexError) as exc:  # another Triton's cache layout
            print(f"  sass: cannot list compiled kernels ({exc!r})")
            continue
        for compiled in compiled_kernels:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
            ops = re.findall(r"\b((?:RED|ATOM|ATOMG|STG|LDG|LDGSTS|HGMMA)[\w.]*)", sass.stdout)
            meta = compiled.metadata
            print(f"  sass {compiled.name} warps {meta.num_warps} stages {meta.num_stages} "
                  f"smem {meta.shared}: {collections.Counter(ops).most_common(6)}")


def _references(a, b, offs, sizes, scratch, main_grad, args) -> dict:
    """The default tile with a bf16 result and overwriting fp32, and cuBLAS per expert."""
    row = {}
    # Where the default tile's time goes: the GEMM with a bf16 result (no fp32 traffic)
    # and overwriting the fp32 accumulator (its write, no read).
    bf16_out = torch.empty(main_grad.shape, device=main_grad.device, dtype=torch.bfloat16)
    row["triton_gemm_bf16_ms"] = cuda_median_ms(
        lambda: grouped_wgrad_triton(a, b, offs, bf16_out, accumulate=False),
        args.warmup,
        args.iters,
    )
    row["triton_overwrite_fp32_ms"] = cuda_median_ms(
        lambda: grouped_wgrad_triton(a, b, offs, scratch, accumulate=False),
        args.warmup,
        args.iters,
    )
    # The same with the large tile: its main loop with the least epilogue traffic.
    row["triton_gemm_bf16_large_tile_ms"] = cuda_median_ms(
        lambda: grouped_wgrad_triton(
            a, b, offs, bf16_out, accumulate=False, config=LARGE_GROUP_CONFIG
        ),
        args.warmup,
        args.iters,
    )
    del bf16_out
    # A vendor reference: cuBLAS per expert, accumulating into fp32 in its epilogue
    # (beta = 1; torch's addmm with out_dtype), launched from a Python loop.
    bounds = [0, *sizes.cumsum(0).tolist()]

    def cublas_loop() -> None:
        for g in range(args.experts):
            lo, hi = bounds[g], bounds[g + 1]
            torch.addmm(main_grad[g], a[lo:hi].t(), b[lo:hi],
                        out_dtype=torch.float32, out=main_grad[g])

    try:
        row["cublas_loop_ms"] = cuda_median_ms(cublas_loop, args.warmup, args.iters)
    except Exception as exc:  # addmm without out_dtype on this torch
        row["cublas_loop_ms"] = repr(exc)[:120]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="time only the QUICK tiles")
    parser.add_argument(
        "--tiles", nargs="+", default=None, metavar="M,N,K,WARPS,STAGES,PPS,ATOMIC",
        help="time these tiles only (e.g. 128,256,64,8,3,0,1)",
    )
    parser.add_argument(
        "--skew", type=float, nargs="+", default=[0.0], metavar="CV",
        help="coefficients of variation of the experts' shares (0: uniform; default 0)",
    )
    parser.add_argument(
        "--order", nargs="+", default=["drawn"], choices=("drawn", "descending", "ascending"),
        help="the groups' order in memory, which the kernels visit in (default drawn)",
    )
    parser.add_argument("--fused-only", action="store_true", help="time the fused kernels only")
    parser.add_argument(
        "--sass", action="store_true",
        help="print the memory and MMA instructions of each compiled kernel (needs cuobjdump)",
    )
    parser.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", "."), "wgrad_bench.json")
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results = []
    for name, m, n in (("fc1", 1536, 2048), ("fc2", 2048, 768)):
        main_grad = torch.zeros(args.experts, m, n, device=dev, dtype=torch.float32)
        for rows, cv, order in itertools.product(args.rows, args.skew, args.order):
            sizes = _group_sizes(rows, args.experts, cv, order)
            total = int(sizes.sum())
            a = torch.randn(total, m, device=dev, dtype=torch.bfloat16)
            b = torch.randn(total, n, device=dev, dtype=torch.bfloat16)
            groups = GroupSizes(sizes)
            offs = groups.offsets(dev)
            flops = 2.0 * total * m * n

            def gemm() -> None:
                grouped_mm_tn(a, b, groups, out_dtype=torch.bfloat16)

            def gemm_add() -> None:
                main_grad.add_(grouped_mm_tn(a, b, groups, out_dtype=torch.bfloat16))

            row = {"proj": name, "M": m, "N": n, "rows_per_expert": rows, "rows": total,
                   "skew": cv, "order": order, "size_cv": float(sizes.float().std() / sizes.float().mean()),
                   "largest_group": int(sizes.max()), "empty_groups": int((sizes == 0).sum()),
                   "fused": {}}
            if not args.fused_only:
                row["gemm_ms"] = cuda_median_ms(gemm, args.warmup, args.iters)
                row["gemm_add_ms"] = cuda_median_ms(gemm_add, args.warmup, args.iters)
            # Correctness on a fresh buffer: fused vs fp32 reference of the first groups.
            check = torch.zeros_like(main_grad)
            grouped_wgrad_triton(a, b, offs, check, accumulate=False)
            s0, s1 = 0, int(sizes[0])
            ref = a[s0:s1].float().t() @ b[s0:s1].float()
            row["max_rel_err_group0"] = float((check[0] - ref).abs().max() / ref.abs().max())
            if not args.fused_only:
                row.update(_references(a, b, offs, sizes, check, main_grad, args))
            if args.tiles:
                configs = [_tile(t) for t in args.tiles]
            else:
                configs = QUICK if args.quick else CONFIGS
            for cfg in configs:
                try:
                    ms = cuda_median_ms(
                        lambda: grouped_wgrad_triton(a, b, offs, main_grad, config=cfg),
                        args.warmup,
                        args.iters,
                    )
                except Exception as exc:  # a config that does not compile here
                    row["fused"][str(cfg)] = repr(exc)[:120]
                    continue
                row["fused"][str(cfg)] = ms
                if cfg.programs_per_sm or cfg.atomic_epilogue:  # against the default tile
                    other = torch.full_like(check, 0.5)
                    grouped_wgrad_triton(a, b, offs, other, accumulate=True, config=cfg)
                    err = float((other - 0.5 - check).abs().max() / check.abs().max())
                    del other
                    if err > 1e-3:
                        row["fused"][str(cfg)] = f"wrong result: rel err {err:.1e}"
            best = min((v, k) for k, v in row["fused"].items() if isinstance(v, float))
            row["fused_best_ms"], row["fused_best"] = best
            row["fused_best_tflops"] = flops / best[0] / 1e9
            # The tile accumulate_grouped_wgrad picks here; compare it within the sweep (a
            # timing taken after the sweep came out up to 14 % off for the same tile).
            row["fused_auto"] = str(config_for(total, args.experts))
            print(f"  accumulate_grouped_wgrad picks {row['fused_auto']}")
            results.append(row)
            line = (f"{name} rows/expert {rows:5d} skew {cv:g} ({order}: cv {row['size_cv']:.2f}, "
                    f"largest {row['largest_group']}): fused best {best[0]:.3f} ms "
                    f"({row['fused_best_tflops']:.0f} TF/s) {best[1]}")
            if not args.fused_only:
                row["gemm_tflops"] = flops / row["gemm_ms"] / 1e9
                line += (f"; gemm {row['gemm_ms']:.3f} ms ({row['gemm_tflops']:.0f} TF/s), gemm+add "
                         f"{row['gemm_add_ms']:.3f}; rel err {row['max_rel_err_group0']:.1e}; default "
                         f"tile: GEMM to bf16 {row['triton_gemm_bf16_ms']:.3f}, overwrite fp32 "
                         f"{row['triton_overwrite_fp32_ms']:.3f}, large tile to bf16 "
                         f"{row['triton_gemm_bf16_large_tile_ms']:.3f}; cuBLAS loop {row['cublas_loop_ms']}")
            print(line, flush=True)
            for k, v in row["fused"].items():
                print(f"    {k}: {v if isinstance(v, str) else f'{v:.3f} ms'}")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    if args.sass:
        from megatron_lrmoe.experts.wgrad_triton import _kernel

        _print_sass(list(_kernel()[:2]))


if __name__ == "__main__":
    main()
