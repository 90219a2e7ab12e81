"""Fit the replay's layer costs to the training runs of the validation; the rest is held out.

    python benchmarks/replay_fit.py [--out benchmarks/results/replay_validation/costs.json]
        [--traces DIR] [--gemm-table FILE]

The replay (``megatron_lrmoe/replay/cost.py``) prices a layer call's grouped GEMMs from a measured
table and its all-to-alls from bytes; :class:`~megatron_lrmoe.replay.cost.LayerCosts` adds what
those leave out (the router, the elementwise and row-moving kernels, the fused fp32 ``main_grad``
accumulation, the host), each a simple function of the plan's rows with one constant of
physical meaning. This script fits those constants, and the bandwidth of the layer's own
all-to-alls (``Network.intra_gbps``), to the comparisons of ``replay_validation.py`` whose
configuration belongs to a training run (``replay_validation.TRAINING_RUNS``, declared before
fitting: gpu_run32, model_bench at EP 1 with profiles; gpu_run8, layer_bench at EP 2 with
backward floors); it never reads the held-out runs.

Objective: the squared log error ``log(predicted / measured)^2`` summed over the training
comparisons of the time quantities that depend on the constants (:data:`FIT_QUANTITIES`), each
(bench, quantity) category weighing 1 in total (so that the 64-row categories do not drown the
profiled ones). Minimised over the logarithms of the constants (all stay positive) by
Levenberg-Marquardt with forward-difference Jacobians (:func:`levenberg_marquardt`), from
:data:`START` (round values of the right order, not fitted). The GEMM table, the network
latencies and the inter-node bandwidth are not fitted. Output: the fitted constants (what
``megatron_lrmoe.replay.cost.DEFAULT_LAYER_COSTS`` and ``NVLINK_GBPS`` must equal, a test checks
it), their meaning, the split, the start, the objective, and each constant's rough relative
uncertainty (from the Jacobian at the optimum). Then
``python benchmarks/replay_validation.py --markdown ...`` reports training and held-out errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import replay_validation as rv  # noqa: E402
from megatron_lrmoe.replay.cost import COSTS_FORMAT, DEFAULT_GEMM_TABLE, GemmTable  # noqa: E402
from megatron_lrmoe.replay.cost import LayerCosts, Network, load_gemm_table  # noqa: E402

OUT = rv.OUT_DIR / "costs.json"
# Time quantities whose prediction depends on a fitted constant (the GEMM floors and the dgrad
# kernels do not; the ratios are quotients of the times fitted).
FIT_QUANTITIES = (
    "floor_a2a4_ms",
    "floor_bwd_kept_ms",
    "fwd_ms",
    "bwd_ms",
    "op_fwd_ms",
    "op_bwd_ms",
    "rest_fwd_ms",
    "rest_bwd_ms",
    "bwd_gemm_kernels_ms",
    "bwd_wgrad_kernels_ms",
    "bwd_elementwise_kernels_ms",
)
NAMES = LayerCosts.CONSTANTS + ("intra_gbps",)
MEANING = {
    "memory_gbps": "effective memory bandwidth (GB/s) of the experts' elementwise and "
    "row-moving kernels: permutation, activation, gradient rows, scoring, packing, gather-sum",
    "trimmed_fixed_ms": "GPU time (ms) of a trimmed backward that does not scale with its rows "
    "(the selection's passes over the quota table, the front's small kernels)",
    "router_fixed_ms": "GPU time (ms) per call of the router's kernels that do not scale with "
    "the tokens (reductions over the experts, small launches), each of forward and backward",
    "router_token_ns": "GPU time (ns) per routed token of the router's and the residual "
    "stream's row passes, each of forward and backward",
    "router_score_ns": "GPU time (ns) per token and expert of the router's score passes "
    "(softmax, top-k, auxiliary loss over [T, E]), each of forward and backward",
    "main_grad_gbps": "effective bandwidth (GB/s) of the fused fp32 main_grad accumulation: 6 "
    "bytes per owned expert parameter (fp32 read and write, less the bf16 gradient not written)",
    "host_fwd_ms": "host time (ms) to queue one layer forward: a floor under its GPU time",
    "host_bwd_ms": "host time (ms) to queue one layer backward with every pair kept, or trimmed "
    "and replayed as one CUDA graph (EP 1, fused main_grad)",
    "host_trimmed_bwd_ms": "host time (ms) to queue a trimmed backward launched kernel by kernel "
    "(EP > 1, or bf16 weight gradients)",
    "sync_ms": "at P > 1, the GPU's wait (ms) in each forward while the host turns the "
    "all-gathered counts around (fitted on single layer calls on an idle GPU, so it includes "
    "the host's lead in front of the call's first kernel)",
    "intra_gbps": "NVLink bandwidth (GB/s per direction) of the layer's own all-to-alls "
    "(uneven splits; latency kept at the NCCL benchmark's 36 us)",
}
# Where the fit starts: round values of the right order (HBM3e peak 4800 GB/s; the NCCL
# all-to-all's 307 GB/s), not fitted to anything. The host floors start high (10 ms, above every
# GPU time of the training set): a floor below the GPU time has no gradient (the wait is
# max(0, floor - GPU)), so from below the fit could not find the calls it binds; from above
# it lowers each floor until it binds only where the measurements say so.
START = {
    "memory_gbps": 3000.0,
    "trimmed_fixed_ms": 0.1,
    "router_fixed_ms": 0.1,
    "router_token_ns": 10.0,
    "router_score_ns": 0.1,
    "main_grad_gbps": 3000.0,
    "host_fwd_ms": 10.0,
    "host_bwd_ms": 10.0,
    "host_trimmed_bwd_ms": 10.0,
    "sync_ms": 1.0,
    "intra_gbps": 307.0,
}


def models(values: dict[str, float], gemm: GemmTable, source: str = "") -> rv.Model:
    """The validation's model with these constants (``NAMES``)."""
    layer = LayerCosts(**{k: values[k] for k in LayerCosts.CONSTANTS}, source=source)
    return rv.Model(gemm, Network(intra_gbps=values["intra_gbps"]), layer)


def levenberg_marquardt(
    residuals: Callable[[np.ndarray], np.ndarray],
    x0: np.ndarray,
    max_iterations: int = 200,
    tolerance: float = 1e-10,
    step: float = 1e-6,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Minimise ``sum(residuals(x)^2)`` from ``x0``: damped Gauss-Newton steps
    ``(J^T J + lam diag(J^T J)) dx = -J^T r`` with a forward-difference Jacobian, ``lam``
    lowered after a step that lowers the sum and raised until one does. Stops when a step
    lowers the sum by less than ``tolerance`` of it, or no step lowers it. Deterministic.

    Returns:
        ``(x, info)``: info holds ``cost`` (the sum), ``iterations``, ``jacobian`` at ``x``.
    """
    x = np.asarray(x0, dtype=np.float64).copy()
    r = residuals(x)
    cost = float(r @ r)
    lam = 1e-3
    iterations = 0
    jac = np.zeros((len(r), len(x)))
    for iterations in range(1, max_iterations + 1):
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = step * max(1.0, abs(x[j]))
            jac[:, j] = (residuals(x + dx) - r) / dx[j]
        grad = jac.T @ r
        normal = jac.T @ jac
        damping = np.diag(np.diag(normal)) + 1e-12 * np.eye(len(x))
        improved = False
        while lam < 1e12:
            move = np.linalg.solve(normal + lam * damping, -grad)
            r_new = residuals(x + move)
            cost_new = float(r_new @ r_new)
            if np.isfinite(cost_new) and cost_new < cost:
                improved = True
                break
            lam *= 4.0
        if not improved:
            break
        x, r, gain, cost = x + move, r_new, cost - cost_new, cost_new
        lam = max(lam / 3.0, 1e-12)
        if gain <= tolerance * max(cost, 1e-300):
            break
    for j in range(len(x)):
        dx = np.zeros_like(x)
        dx[j] = step * max(1.0, abs(x[j]))
        jac[:, j] = (residuals(x + dx) - r) / dx[j]
    return x, {"cost": cost, "iterations": iterations, "jacobian": jac}


def category_weights(rows: Sequence[dict[str, Any]]) -> np.ndarray:
    """Each row's weight: 1 over the number of rows of its (bench, quantity) category."""
    keys = [f"{r['bench']}:{r['quantity']}" for r in rows]
    counts = {k: keys.count(k) for k in set(keys)}
    return np.array([1.0 / counts[k] for k in keys])


def training_files() -> dict[str, tuple[str, ...]]:
    """The validation's files of the training runs, by benchmark."""
    pick = lambda files: tuple(f for f in files if f.startswith(rv.TRAINING_RUNS))  # noqa: E731
    return {
        "model_files": pick(rv.MODEL_BENCH),
        "layer_files": pick(rv.LAYER_BENCH),
        "replica_files": pick(rv.REPLICA_BENCH),
    }


def fit(
    gemm: GemmTable = DEFAULT_GEMM_TABLE, traces: Path = rv.TRACES, starts_extra: int = 3
) -> tuple[dict[str, float], dict[str, Any]]:
    """The constants (``NAMES``) fitted to the training comparisons; and what the fit did."""
    files = training_files()
    cache: dict[str, Any] = {}

    def rows_of(values: dict[str, float]) -> list[dict[str, Any]]:
        rows, _, _ = rv.compare(models(values, gemm), traces, None, cache, **files)
        return [r for r in rows if r["quantity"] in FIT_QUANTITIES]

    rows = rows_of(START)
    assert all(r["split"] == "training" for r in rows)
    sqrt_w = np.sqrt(category_weights(rows))
    measured = np.array([r["measured"] for r in rows])

    def residuals(x: np.ndarray) -> np.ndarray:
        values = dict(zip(NAMES, np.exp(np.clip(x, -30.0, 30.0))))
        predicted = np.array([r["predicted"] for r in rows_of(values)])
        return sqrt_w * np.log(np.maximum(predicted, 1e-12) / measured)

    # The objective is not convex (the host floors' kinks): fit from START and from a few
    # seeded variants of it (every constant but the host floors scaled by e^u, u uniform in
    # [-1, 1]); keep the lowest.
    rng = np.random.default_rng(0)
    starts = [np.log([START[k] for k in NAMES])]
    for _ in range(starts_extra):
        u = rng.uniform(-1.0, 1.0, len(NAMES))
        u[[i for i, k in enumerate(NAMES) if k.startswith("host_")]] = 0.0
        starts.append(starts[0] + u)
    found = [levenberg_marquardt(residuals, x0) for x0 in starts]
    best = int(np.argmin([info["cost"] for _, info in found]))
    x, info = found[best]
    x0 = starts[0]
    values = {k: float(v) for k, v in zip(NAMES, np.exp(x))}
    jac = info["jacobian"]
    dof = max(len(rows) - len(NAMES), 1)
    # A constant the training set does not determine (a host floor that binds nowhere) has a
    # zero column: its uncertainty is None.
    determined = np.abs(jac).sum(axis=0) > 0
    covariance = np.linalg.pinv(jac[:, determined].T @ jac[:, determined]) * info["cost"] / dof
    sigma = iter(np.sqrt(np.maximum(np.diag(covariance), 0.0)))
    uncertainty = {k: float(next(sigma)) if d else None for k, d in zip(NAMES, determined)}
    categories = sorted({f"{r['bench']}:{r['quantity']}" for r in rows})
    return values, {
        "objective": info["cost"],
        "objective_at_start": float(residuals(x0) @ residuals(x0)),
        "objectives_from_each_start": [float(i["cost"]) for _, i in found],
        "iterations": info["iterations"],
        "comparisons": len(rows),
        "categories": categories,
        "relative_uncertainty": uncertainty,
        "files": sorted({r["source"]["file"] for r in rows}),
    }


def payload(values: dict[str, float], info: dict[str, Any], gemm: GemmTable) -> dict[str, Any]:
    """The costs file: what ``megatron_lrmoe.replay.cost.load_costs`` reads, and the fit's
    record."""
    return {
        "format": COSTS_FORMAT,
        "version": 1,
        "source": "benchmarks/results/replay_validation/costs.json: benchmarks/replay_fit.py, "
        f"fitted to the training runs {list(rv.TRAINING_RUNS)} of benchmarks/replay_validation.py",
        "layer": {k: _round(values[k]) for k in LayerCosts.CONSTANTS},
        "network": {"intra_gbps": _round(values["intra_gbps"])},
        "meaning": MEANING,
        "split": {
            "training_runs": list(rv.TRAINING_RUNS),
            "training_files": info["files"],
            "held_out": "every other result file benchmarks/replay_validation.py compares "
            "(model_bench gpu_run33, gpu_run28, gpu_run29; layer_bench gpu_run1, 2, 4; "
            "replica_bench gpu_run4, 5); the fit reads none of them",
        },
        "fit": {
            "quantities": list(FIT_QUANTITIES),
            "categories": info["categories"],
            "comparisons": info["comparisons"],
            "weights": "each (bench, quantity) category of the training set weighs 1 in total",
            "objective": "sum over the training comparisons of weight * log(predicted / "
            "measured)^2, minimised over log(constants) by Levenberg-Marquardt",
            "objective_at_start": info["objective_at_start"],
            "objective_at_fit": info["objective"],
            "iterations": info["iterations"],
            "start": START,
            "starts": "START and 3 seeded variants (numpy default_rng(0): every constant but the "
            "host floors times e^u, u uniform in [-1, 1]); the lowest objective kept",
            "objectives_from_each_start": info["objectives_from_each_start"],
            "relative_uncertainty": {
                k: None if v is None else _round(v)
                for k, v in info["relative_uncertainty"].items()
            },
            "relative_uncertainty_note": "rough: the standard error of each log(constant) from "
            "the Jacobian at the optimum, residuals taken as independent (they are not: the "
            "categories share runs and configurations)",
            "not_fitted": "the GEMM table (" + gemm.source + "), the network latencies, the "
            "inter-node bandwidth",
        },
    }


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(OUT), help="the costs JSON to write")
    parser.add_argument("--traces", default=str(rv.TRACES), help="routing traces (read)")
    parser.add_argument("--gemm-table", default=None, help="GEMM table JSON (gemm_table.py)")
    args = parser.parse_args(argv)
    gemm = load_gemm_table(args.gemm_table) if args.gemm_table else DEFAULT_GEMM_TABLE
    values, info = fit(gemm, Path(args.traces))
    data = payload(values, info, gemm)
    for name in NAMES:  # the script's report (a console script, not library code)
        group = "network" if name == "intra_gbps" else "layer"
        sigma = info["relative_uncertainty"][name]
        spread = "not determined" if sigma is None else f"+-{sigma:.0%}"
        print(f"{name:<22} {data[group][name]:>10g}  ({spread})")
    print(f"objective {info['objective_at_start']:.4g} -> {info['objective']:.4g} in "
          f"{info['iterations']} iterations over {info['comparisons']} comparisons")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
