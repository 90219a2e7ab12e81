"""What a layer's first calls cost beyond the steady state, per keep ratio: Triton's compilation
from a cold cache, and what is left with a warm one.

    python benchmarks/first_call.py [--experts 128] [--tokens 16384] [--layers 4]
        [--keep 1.0 0.5 0.25] [--calls 5] [--out first_call.json]

Training logs show keep k < 1 spending 11-17 s of MoE-layer time in its first iteration (docs/
history/notebook.md sections 12, 15, 22, 23), against 0.3-4 s for a keep-1.0 run that came second
on the same machine. That one-off cost counts in a time-to-target comparison with
its overheads included, so this measures it, apart from everything else a training run starts.

Per keep ratio, two fresh processes one after the other (``torchrun --standalone
--nproc_per_node=1`` of this script with ``--worker``), each with the same private
``TRITON_CACHE_DIR``, empty for the first (``cold``) and left as the first run left it for the
second (``warm``). Each builds ``--layers`` LRMoE layers of the Qwen3-30B-A3B MoE shape
(``model_bench.py``'s stack: fused ``main_grad`` accumulation, a residual stream) and times
``--calls`` forward + backward rounds through them, each waited for (wall seconds). Reported per
run: the seconds of each round, ``one_off_s`` (the first two rounds minus twice the median of
the rest: a layer's backward graph is captured on its second call), and the Triton kernels
compiled into the cache (``compiled``; their names in the JSON). The keep ratios share nothing:
each has its own cache, so none pays for another's kernels (in ``train_compare.sh`` runs A and B
share the machine's cache unless ``COLD_CACHE=1``, and the second run finds the kernels the
first compiled).

On a CPU (a smoke run with the test-only shim) nothing is compiled and the rounds are host time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import init_distributed, moe_config, write_json  # noqa: E402


def compiled_kernels(cache_dir: str) -> list[str]:
    """Names of the kernels compiled into a Triton cache directory (one metadata JSON each)."""
    names = []
    for path in Path(cache_dir).rglob("*.json"):  # group indices (__grp__*) have no name
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and "name" in meta:
            names.append(str(meta["name"]))
    return sorted(names)


def one_off_seconds(rounds: list[float]) -> float:
    """The first two rounds minus twice the median of the rest (graphs capture on call 2)."""
    if len(rounds) < 3:
        raise ValueError(f"{len(rounds)} rounds: at least 3 (two first calls and a steady one)")
    return rounds[0] + rounds[1] - 2 * statistics.median(rounds[2:])


def _worker(args: argparse.Namespace) -> None:
    from benchmarks.model_bench import _build, _round

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pg = init_distributed(1, device.type)
    shape = moe_config(1)  # the Qwen3-30B-A3B layer
    hidden = shape.hidden_size
    gen = torch.Generator(device=device).manual_seed(100)
    x = torch.randn(args.tokens, 1, hidden, device=device, generator=gen).to(torch.bfloat16)
    up = torch.randn(x.shape, device=device, generator=gen).to(torch.bfloat16)
    bench = argparse.Namespace(
        layers=args.layers, experts=args.experts, selection=args.selection, hidden=hidden,
        ffn=shape.moe_ffn_hidden_size, recompute="none", activation_mode="save",
    )
    layers = _build(bench, 1, args.keep[0], pg, device)
    rounds = []
    for _ in range(args.calls):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _round(layers, x, up)  # waits for its last event
        rounds.append(time.perf_counter() - start)
    write_json(args.out, {"rounds_s": rounds})
    torch.distributed.destroy_process_group()


def _run(args: argparse.Namespace, keep: float, cache_dir: str, out: str) -> dict[str, Any]:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        os.path.abspath(__file__), "--worker",
        "--experts", str(args.experts), "--tokens", str(args.tokens),
        "--layers", str(args.layers), "--keep", str(keep), "--calls", str(args.calls),
        "--selection", args.selection, "--out", out,
    ]
    before = set(compiled_kernels(cache_dir))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    process_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"keep {keep}: the worker failed\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    with open(out, encoding="utf-8") as f:
        rounds = json.load(f)["rounds_s"]
    after = compiled_kernels(cache_dir)
    new = sorted(set(after) - before)
    return {
        "rounds_s": rounds,
        "one_off_s": one_off_seconds(rounds),
        "steady_s": statistics.median(rounds[2:]),
        "compiled": len(new),
        "kernels": new,
        "process_s": process_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--selection", choices=("sample", "topk"), default="sample")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    default_out = os.path.join(os.environ.get("OUT", "."), "first_call.json")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calls < 3:
        parser.error(f"--calls {args.calls}: at least 3 (two first calls and a steady one)")
    if args.worker:
        _worker(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for keep in args.keep:
            cache = os.path.join(scratch, f"triton_keep{keep:g}")
            os.makedirs(cache)
            for state in ("cold", "warm"):
                out = os.path.join(scratch, f"keep{keep:g}_{state}.json")
                row = dict(keep=keep, cache=state, **_run(args, keep, cache, out))
                rows.append(row)
                rounds = " ".join(f"{s:.2f}" for s in row["rounds_s"])
                print(
                    f"keep {keep:g} {state}: one-off {row['one_off_s']:.2f} s, steady "
                    f"{row['steady_s']:.3f} s per round, {row['compiled']} kernels compiled; "
                    f"rounds {rounds} s; process {row['process_s']:.1f} s",
                    flush=True,
                )
    write_json(args.out, {"args": vars(args), "rows": rows, "torch": torch.__version__})


if __name__ == "__main__":
    main()
