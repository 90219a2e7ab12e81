"""CPU smoke tests of the benchmark scripts (benchmarks/replica_bench.py, gpu_equivalence.py,
host_path_cpu.py in both modes and at EP 2, model_bench.py, first_call.py).

Cheapest first: the benchmark's pure helpers (routing targets, the EP 2 closed-form optimum
against the repo's brute force), then one real run of the script under torchrun at EP 2 (gloo,
CPU shim, tiny shapes) whose JSON must show what the GPU run is meant to show: the requested
skew was reached, replicas were placed, the layer kept its plan, and replicas lowered the
measured per-rank forward rows. Then the bf16 equivalence check with fused accumulation, and
last the host-time tool of the graphed backward and of the forward, on tiny shapes.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.replica_bench import (
    cap_shares,
    hot_rank_shares,
    lower_bound_peak,
    optimal_peak_two_ranks,
    zipf_shares,
)
from megatron_lrmoe.control.reference import reference_optimal_peak

REPO = Path(__file__).resolve().parents[1]
SMOKE_TIMEOUT_S = 600  # start-up of two ranks on a loaded 2-core machine dominates


def test_cap_shares_water_fills() -> None:
    shares = cap_shares(np.array([8.0, 4.0, 2.0, 1.0, 1.0]), cap=0.3)
    assert shares.sum() == pytest.approx(1.0)
    assert shares.max() <= 0.3 + 1e-12
    # 8/16 is over the cap; scaling the rest up then pushes 4 over it too (a second round).
    # Capped experts sit at the cap, the others keep their proportions (2:1:1).
    assert shares[:2] == pytest.approx([0.3, 0.3])
    assert shares[2:] == pytest.approx([0.2, 0.1, 0.1])
    with pytest.raises(ValueError):
        cap_shares(np.ones(3), cap=0.2)


def test_zipf_and_hot_rank_shares() -> None:
    zipf = zipf_shares(16, 1.0, topk=2, seed=3)
    ranked = np.sort(zipf)[::-1]
    assert zipf.sum() == pytest.approx(1.0)
    assert ranked[1] / ranked[3] == pytest.approx(2.0)  # (1/2) / (1/4), below the cap
    hot = hot_rank_shares(16, ep=2, share=0.7, hot_experts=2, topk=2)
    assert hot.sum() == pytest.approx(1.0)
    assert hot[:8].sum() == pytest.approx(0.7)
    assert hot[2:].min() == pytest.approx(hot[2:].max())  # every cold expert alike
    with pytest.raises(ValueError):
        hot_rank_shares(16, ep=2, share=0.2, hot_experts=1, topk=2)


def test_two_rank_optimum_matches_brute_force() -> None:
    rng = np.random.default_rng(11)
    for _ in range(60):
        local = int(rng.integers(1, 4))
        load = rng.integers(0, 50, size=2 * local) * rng.integers(0, 2, size=2 * local)
        load[int(rng.integers(0, 2 * local))] += int(rng.integers(0, 200))
        slots = int(rng.integers(0, 3))
        expected = reference_optimal_peak(load.tolist(), 2, slots)
        assert optimal_peak_two_ranks(load, slots) == expected, (load, slots)
        assert lower_bound_peak(load, 2) <= expected


def _loopback() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def _torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` under torchrun with ``nproc`` CPU processes (this checkout on the path); fails
    the test with the output's tail unless it exits 0."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    ifname = _loopback()
    if ifname is not None:  # as run_distributed does: gloo must not pick a hostname interface
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", script, *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run (the CPU shim refuses a CUDA machine)"
)
def test_replica_bench_runs_at_ep2(tmp_path: Path) -> None:
    out = tmp_path / "replica_bench.json"
    proc = _torchrun(
        2, "benchmarks/replica_bench.py", "--device", "cpu", "--hidden", "32", "--ffn", "16",
        "--experts", "16", "--topk", "2", "--tokens", "128", "--iters", "1", "--warmup", "1",
        "--zipf", "1.5", "--hot-experts", "2", "--calib-iters", "100", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["ep"] == 2 and "hot-rank" in proc.stdout
    blocks = {b["scenario"]: b for b in result["scenarios"]}
    assert set(blocks) == {"zipf-1.5", "hot-rank"}
    for block in blocks.values():
        rows = {r["variant"]: r for r in block["rows"]}
        assert len(rows) == 5 and "stock MoELayer" in rows
        assert block["fixed_peak"] >= block["optimum_peak"] >= block["lower_bound_peak"]
        for row in rows.values():
            assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
            # The layer computed exactly the rows its plan assigned to each rank.
            assert row["fwd_rows_vs_plan"] == 0 and row["kept_rows_vs_plan"] == 0
            assert row["peak_mib"] is None  # no allocator statistics on CPU
        # Same weights and tokens: keep 1.0 (with or without replicas) is the stock forward.
        assert rows["LRMoE keep 1.0"]["fwd_rel_diff_vs_stock"] < 1e-5
        assert rows["LRMoE keep 1.0 R=2"]["fwd_rel_diff_vs_stock"] < 1e-5
    hot = blocks["hot-rank"]
    assert hot["rank_share"][0] == pytest.approx(0.7, abs=0.02)
    rows = {r["variant"]: r for r in hot["rows"]}
    plain, replicated = rows["LRMoE keep 0.5 sample save"], rows["LRMoE keep 0.5 sample save R=2"]
    assert replicated["replicas"] > 0 and plain["replicas"] == 0
    # Replicas move rank 0's hot pairs to rank 1: fewer forward rows on the busiest rank.
    assert replicated["fwd_rows_max"] < plain["fwd_rows_max"]
    assert plain["fwd_rows_max"] == rows["stock MoELayer"]["fwd_rows_max"]
    assert replicated["fwd_rows_max"] == replicated["plan_forward_peak"]
    assert replicated["goals"]["peak"] in ("PASS", "MISS")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run (the CPU shim refuses a CUDA machine)"
)
def test_gpu_equivalence_runs_on_the_cpu_with_fused_accumulation(tmp_path: Path) -> None:
    """benchmarks/gpu_equivalence.py --fused, tiny, on the CPU shim: keep 1.0 with its weight
    gradients added into main_grad passes against stock in bf16 (both against stock in fp32)."""
    out = tmp_path / "eq.json"
    _torchrun(
        1, "benchmarks/gpu_equivalence.py", "--experts", "8", "--tokens", "32", "--fused",
        "--out", str(out),
    )
    result = json.loads(out.read_text())
    assert result["experts"] == 8 and result["fused"] and result["ep"] == 1
    (report,) = result["ranks"]
    assert set(report) == {"out", "dx", "router", "fc1", "fc2"}
    for key, row in report.items():
        assert row["passed"], (key, row)
        assert row["scale"] > 0 and row["stock_bf16_vs_fp32"] > 0  # bf16 moved something


def _trace_event(cat: str, name: str, ts: float, dur: float, corr: int, tid: int = 1) -> dict:
    return dict(cat=cat, name=name, ph="X", ts=ts, dur=dur, tid=tid, args=dict(correlation=corr))


def test_host_trace_attributes_kernels_to_the_phase_that_launched_them() -> None:
    """A kernel the forward queued that still runs after the backward's host start is the
    forward's; the backward's idle gap ends at its first kernel, named with its launcher."""
    from benchmarks.host_trace import _gaps, _gpu_busy, _kernel_times, _launched_in

    events = [
        _trace_event("cuda_runtime", "cudaLaunchKernel", 10, 2, 1),  # forward launch
        _trace_event("kernel", "fwd_gemm", 15, 100, 1),  # runs into the backward window
        _trace_event("python_function", "megatron_lrmoe/op.py(1): backward", 60, 100, 0),
        _trace_event("cuda_runtime", "cudaLaunchKernel", 150, 2, 2),  # backward launch
        _trace_event("kernel", "bwd_gather", 155, 10, 2),
    ]
    backward = _launched_in(events, 50, 200)
    assert [e["name"] for e in backward] == ["bwd_gather"]
    assert dict(_kernel_times(backward)) == {"bwd_gather": [10, 1]}
    # Busy from the backward's host start: the forward's GEMM until 115, then the gather; of
    # that, the backward's own work is the gather alone.
    assert _gpu_busy(events, 50, 200) == (75, 2)
    assert _gpu_busy(backward, 50, 200) == (10, 1)
    gaps = _gaps(events, 50, 200, min_us=20)
    # Busy with the forward's GEMM until 115, idle until the gather starts at 155.
    assert [(g, k) for g, k, _ in gaps] == [(40, "bwd_gather")]
    assert "op.py(1): backward" in gaps[0][2]


def _megatron_log(iterations: list[tuple[int, float, float, float, float]]) -> str:
    """A log in Megatron's format: (iteration, ms, forward-backward, optimizer, moe layers)."""
    lines = []
    for it, ms, fb, opt, moe in iterations:
        lines.append(
            f" [2026-12-01 05:00:00.0] iteration {it:8d}/     300 | consumed samples: {4 * it:12d} "
            f"| elapsed time per iteration (ms): {ms:.1f} | lm loss: 8.0E+00 |"
        )
        lines.append("(min, max) time across ranks (ms):")
        for name, value in (("forward-backward", fb), ("optimizer", opt)):
            lines.append(f"    {(name + ' ').ljust(48, '.')}: ({value - 1:.2f}, {value:.2f})")
        lines.append(
            f" [2026-12-01 05:00:00.1] iteration {it:8d}/     300 | moe layers: {moe:.1f} ms/iter |"
        )
    return "\n".join(lines)


def test_train_timers_reads_megatron_timer_blocks(tmp_path: Path) -> None:
    from benchmarks.train_timers import parse, summarize

    its = [(1, 9000.0, 8000.0, 900.0, 5000.0)] + [
        (i, 500.0 + i, 200.0 + i, 290.0, 60.0 + i) for i in range(2, 9)
    ]
    summary = summarize(parse(_megatron_log(its)), skip=1)
    assert summary["iterations"] == 7
    assert summary["iteration"] == 505.0  # median of 502..508, the warm-up left out
    assert summary["forward-backward"] == 205.0  # the max over ranks, not the min
    assert summary["optimizer"] == 290.0
    assert summary["moe_layers"] == 65.0
    assert summary["bound"] == pytest.approx((505.0 - 65.0) / 505.0)
    log = tmp_path / "train.log"
    log.write_text(_megatron_log(its))
    out = subprocess.run(
        [sys.executable, "benchmarks/train_timers.py", str(log), "--skip", "1", "--json",
         str(tmp_path / "t.json")],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True,
    )
    assert "train.log" in out.stdout
    assert json.loads((tmp_path / "t.json").read_text())["train.log"]["optimizer"] == 290.0


def _host_path(out: Path, *args: str) -> dict:
    """Runs benchmarks/host_path_cpu.py with ``args`` writing ``out``; returns its JSON."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [sys.executable, "benchmarks/host_path_cpu.py", *args, "--out", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_host_path_cpu_times_the_graphed_backward(tmp_path: Path) -> None:
    """benchmarks/host_path_cpu.py on tiny shapes: the graphed path ran (one layer graph) and
    every stage it lists has a time, the parts no more than the whole."""
    pytest.importorskip("triton")
    result = _host_path(
        tmp_path / "host_path.json", "--tokens", "64", "--experts", "8", "--hidden", "32",
        "--iters", "3",
    )
    assert result["layer_graphs"] == 1, result
    stages = result["stage_us"]
    assert set(stages) >= {"_graphed_backward", "scored_call", "run_layer_graph", "_record_trimmed"}
    parts = ("_local_segments", "scored_call", "run_layer_graph", "_local_plan")
    assert sum(stages[k] for k in parts) <= stages["_graphed_backward"], stages


def test_host_path_cpu_times_the_forward(tmp_path: Path) -> None:
    """benchmarks/host_path_cpu.py --mode forward on tiny shapes: the whole call and every
    forward stage have a time, the parts no more than their wholes."""
    result = _host_path(
        tmp_path / "host_fwd.json", "--mode", "forward", "--tokens", "32", "--experts", "8",
        "--hidden", "32", "--iters", "5",
    )
    assert result["mode"] == "forward" and result["keep"] == 0.5, result
    stages = result["stage_us"]
    assert set(stages) >= {
        "layer_call", "MoELayer.forward", "fwd.router", "fwd.routed_experts_compute",
        "TrimmedMoEFunction.forward", "LRMoELayer._plan", "LRMoELayer._call_stats",
        "LRMoELayer._gemms_take_device_offsets", "LRAlltoAllTokenDispatcher.resolve",
        "LRAlltoAllTokenDispatcher._set_stock_metadata", "expert_forward_parts",
    }, stages
    assert "ExactMoEFunction.forward" not in stages  # keep 0.5 runs the trimmed op only
    assert all(us > 0 for us in stages.values()), stages
    assert stages["fwd.CallPlan.build"] <= stages["LRMoELayer._plan"], stages
    assert stages["expert_forward_parts"] <= stages["TrimmedMoEFunction.forward"], stages
    # Medians of nested spans keep their order (each call's part is inside its whole).
    for part in ("LRMoELayer._plan", "LRMoELayer._call_stats", "fwd.op"):
        assert stages[part] <= stages["fwd.routed_experts_compute"], (part, stages)
    assert stages["fwd.routed_experts_compute"] <= stages["MoELayer.forward"], stages


def test_host_path_cpu_times_the_forward_at_ep2(tmp_path: Path) -> None:
    """benchmarks/host_path_cpu.py --mode forward --ep 2 on tiny shapes: both ranks report the
    forward's stages with the all-to-alls' side of the op, the collectives left out of the
    stages around them, parts within wholes (stages nested in one clocked call; the unclocked
    ``layer_call`` is not compared with the clocked ``forward_host``: separate calls)."""
    result = _host_path(
        tmp_path / "host_ep_fwd.json", "--mode", "forward", "--ep", "2", "--tokens", "16",
        "--experts", "4", "--hidden", "16", "--iters", "3",
    )
    assert result["ep"] == 2 and result["mode"] == "forward" and result["keep"] == 0.5, result
    assert len(result["stage_us_per_rank"]) == 2 and result["stage_us"] == (
        result["stage_us_per_rank"][0]
    )
    for stages in result["stage_us_per_rank"]:
        assert set(stages) >= {
            "layer_call", "forward_host", "fwd.router", "fwd.all_gather_counts",
            "fwd.CallPlan.build", "fwd.op", "TrimmedMoEFunction.forward", "LRMoELayer._plan",
            "LRMoELayer._call_stats", "expert_forward_parts", "RowRoute.to_experts",
            "RowRoute.to_sources", "RowRoute.reorder", "all_to_all_rows",
        }, stages
        # Keep 0.5 runs the trimmed op; EP 2 never defers the forward (no device offsets).
        assert not {"ExactMoEFunction.forward", "LRMoELayer._gemms_take_device_offsets"} & (
            set(stages)
        ), stages
        assert all(us > 0 for us in stages.values()), stages
        assert stages["fwd.CallPlan.build"] <= stages["LRMoELayer._plan"], stages
        for part in ("expert_forward_parts", "RowRoute.to_experts", "RowRoute.to_sources"):
            assert stages[part] <= stages["TrimmedMoEFunction.forward"], (part, stages)
        assert stages["fwd.op"] <= stages["fwd.routed_experts_compute"], stages


def test_host_path_cpu_times_the_eager_backward_at_ep2(tmp_path: Path) -> None:
    """benchmarks/host_path_cpu.py --ep 2 on tiny shapes: both ranks report the trimmed eager
    backward's stages (and none of the forward's or the exact path's), parts within wholes."""
    result = _host_path(
        tmp_path / "host_ep.json", "--ep", "2", "--tokens", "16", "--experts", "4",
        "--hidden", "16", "--iters", "3",
    )
    assert result["ep"] == 2 and result["keep"] == 0.5, result
    assert len(result["stage_us_per_rank"]) == 2 and result["stage_us"] == (
        result["stage_us_per_rank"][0]
    )
    for stages in result["stage_us_per_rank"]:
        assert set(stages) >= {
            "backward_call", "TrimmedMoEFunction.backward", "row_dot", "select_kept",
            "_local_segments", "_local_plan", "pack_kept", "exchange_kept", "_kept_inputs",
            "expert_backward_parts", "return_dx", "gather_sum", "_trimmed_grads",
            "_record_trimmed", "ExpertCall.fold_grads", "RowRoute.reorder",
        }, stages
        # Keep 0.5 runs the trimmed op; the forward's calls (to_experts) do not count.
        assert not {"ExactMoEFunction.backward", "RowRoute.to_experts"} & set(stages), stages
        # Each call's part lies inside its whole, so the medians keep that order too.
        whole = stages["TrimmedMoEFunction.backward"]
        parts = ("row_dot", "select_kept", "pack_kept", "exchange_kept", "_kept_inputs",
                 "expert_backward_parts", "return_dx", "_trimmed_grads")  # fmt: skip
        assert all(stages[k] <= whole for k in parts), stages
        assert whole <= stages["backward_call"], stages
        assert stages["_local_plan"] <= stages["select_kept"], stages
        assert stages["gather_sum"] <= stages["return_dx"], stages


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run (the CPU shim refuses a CUDA machine)"
)
def test_model_bench_runs_a_stack_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/model_bench.py, tiny, on the CPU shim at EP 2: two stacked layers per keep
    ratio run forward and backward with fused accumulation; keep 1.0 is the ratios' base;
    ``--profile`` writes each rank's trace per keep ratio (no GPU here: no busy time)."""
    out = tmp_path / "model.json"
    traces = tmp_path / "traces"
    proc = _torchrun(
        2, "benchmarks/model_bench.py", "--layers", "2", "--experts", "8", "--hidden", "64",
        "--ffn", "32", "--tokens", "8", "--keep", "1.0", "0.5", "--rounds", "1", "--warmup", "2",
        "--profile", str(traces), "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["ep"] == 2
    assert [row["keep"] for row in result["rows"]] == [1.0, 0.5]
    keep1, keep_half = result["rows"]
    assert keep1["bwd_vs_keep1"] == 1.0
    assert keep_half["bwd_vs_keep1"] == keep_half["bwd_ms"] / keep1["bwd_ms"]
    for row in result["rows"]:
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    assert result["floor"] == {}  # the GEMM floor is taken on a GPU only
    assert "EP 2" in proc.stdout and "keep 0.5: fwd" in proc.stdout
    assert sorted(p.name for p in traces.iterdir()) == [
        f"trace_k{k}_rank{r}.json" for k in ("0.5", "1") for r in (0, 1)
    ]
    for row in result["rows"]:
        parts = ("op_fwd_gpu_ms", "rest_fwd_gpu_ms", "op_bwd_gpu_ms", "rest_bwd_gpu_ms")
        assert [row[k] for k in parts] == [0.0] * 4
        assert set(row["op_bwd_by_kind_ms"]) >= {"grouped GEMMs", "weight gradients", "other"}
    assert "GPU busy (profiled): op fwd 0.000" in proc.stdout


def test_model_bench_recompute_moe_runs_on_the_cpu(tmp_path: Path) -> None:
    """``model_bench.py --recompute moe`` (Megatron's MoE-layer recompute), tiny, EP 2: both keep
    ratios run and report the whole layer's time against keep 1.0's."""
    out = tmp_path / "model.json"
    proc = _torchrun(
        2, "benchmarks/model_bench.py", "--layers", "2", "--experts", "8", "--hidden", "64",
        "--ffn", "32", "--tokens", "8", "--keep", "1.0", "0.5", "--rounds", "1", "--warmup", "2",
        "--recompute", "moe", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["args"]["recompute"] == "moe" and "recompute moe" in proc.stdout
    keep1, keep_half = result["rows"]
    assert keep1["layer_vs_keep1"] == 1.0
    assert keep_half["layer_ms"] == keep_half["fwd_ms"] + keep_half["bwd_ms"]
    assert keep_half["layer_vs_keep1"] == keep_half["layer_ms"] / keep1["layer_ms"]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run (the CPU shim refuses a CUDA machine)"
)
def test_model_bench_lean_runs_on_the_cpu(tmp_path: Path) -> None:
    """``model_bench.py --activation-mode lean``, tiny, EP 1: both keep ratios run, the mode is
    in the result's arguments."""
    out = tmp_path / "model.json"
    _torchrun(
        1, "benchmarks/model_bench.py", "--layers", "2", "--experts", "8", "--hidden", "64",
        "--ffn", "32", "--tokens", "16", "--keep", "1.0", "0.5", "--rounds", "1", "--warmup", "2",
        "--activation-mode", "lean", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["args"]["activation_mode"] == "lean" and result["ep"] == 1
    assert [row["keep"] for row in result["rows"]] == [1.0, 0.5]
    assert all(row["fwd_ms"] > 0 and row["bwd_ms"] > 0 for row in result["rows"])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke run (the CPU shim refuses a CUDA machine)"
)
def test_model_bench_skew_makes_the_groups_uneven(tmp_path: Path) -> None:
    """benchmarks/model_bench.py --skew, tiny (hidden 64), on the CPU shim at EP 2: the random
    router's groups are nearly even, a per-expert logit bias of CV 1 makes them clearly uneven,
    and the bias is the same draw at every keep ratio (same weights, same tokens: the same
    counts)."""
    rows = {}
    for skew, keeps in (("0", ["1.0"]), ("1.0", ["1.0", "0.5"])):
        out = tmp_path / f"model_skew{skew}.json"
        proc = _torchrun(
            2, "benchmarks/model_bench.py", "--layers", "2", "--experts", "16", "--hidden", "64",
            "--ffn", "32", "--tokens", "256", "--keep", *keeps, "--rounds", "1", "--warmup", "2",
            "--skew", skew, "--out", str(out),
        )  # fmt: skip
        rows[skew] = json.loads(out.read_text())["rows"]
        assert f"router skew {float(skew):g}," in proc.stdout
        assert "tokens per expert cv" in proc.stdout
    (even,) = rows["0"]
    skewed, skewed_half = rows["1.0"]
    # 2 ranks x 256 tokens x top-8 over 16 experts: 256 per expert on average, at most 512.
    assert even["tokens_cv"] < 0.15 and even["tokens_max"] < 1.5 * 256, even
    assert skewed["tokens_cv"] > 0.4 and skewed["tokens_cv"] > 4 * even["tokens_cv"], skewed
    assert 256 < skewed["tokens_max"] <= 512 and skewed["tokens_max"] > even["tokens_max"]
    assert (skewed_half["tokens_cv"], skewed_half["tokens_max"]) == (
        skewed["tokens_cv"], skewed["tokens_max"]
    )
    # The skewed keep 1.0 stack was gone before keep 0.5's was built (section 26's skewed rows
    # counted two stacks: a stray reference to the last layer held them all).
    assert [row["stale_layers"] for row in (even, skewed, skewed_half)] == [0, 0, 0]
    assert "still referenced" not in proc.stderr


def test_model_bench_release_counts_layers_a_stray_reference_holds() -> None:
    """model_bench._release empties the list and counts the layers something else still holds:
    as a layer's call leaves them, a later layer's routing weights keep a graph whose op
    context holds the earlier layer (LRMoE's op keeps the layer's bound ``next_sample_stream``)."""
    from benchmarks.model_bench import _release

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, owner):
            ctx.stream = owner.forward  # a bound method: the context holds its layer
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.probs = x * self.weight  # kept after the call, with its graph
            return Op.apply(self.probs, self)

    def stack() -> list[Layer]:
        layers = [Layer(), Layer()]
        y = layers[1](layers[0](torch.ones(2)))
        y.sum().backward()
        return layers

    layers = stack()
    assert _release(layers) == 0 and layers == []
    layers = stack()
    stray = layers[-1]
    assert _release(layers) == 2  # the last layer's probs reach the first layer's op context
    del stray


def test_first_call_reads_a_triton_cache_and_the_one_off_cost(tmp_path: Path) -> None:
    """benchmarks/first_call.py's helpers: kernels are named from their metadata JSON (group
    indices and unreadable files skipped), and the one-off cost is the first two rounds over the
    steady median."""
    from benchmarks.first_call import compiled_kernels, one_off_seconds

    for i, name in enumerate(("_wgrad_kernel", "_tile_sort_kernel")):
        folder = tmp_path / f"hash{i}"
        folder.mkdir()
        (folder / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 4}))
        (folder / f"__grp__{name}.json").write_text(json.dumps({"child_paths": {}}))
    (tmp_path / "hash0" / "broken.json").write_text("{")
    assert compiled_kernels(str(tmp_path)) == ["_tile_sort_kernel", "_wgrad_kernel"]
    assert compiled_kernels(str(tmp_path / "missing")) == []
    assert one_off_seconds([10.0, 3.0, 1.0, 2.0, 1.0]) == pytest.approx(11.0)
    with pytest.raises(ValueError):
        one_off_seconds([1.0, 1.0])


def test_first_call_runs_cold_and_warm_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/first_call.py on the CPU shim: one keep ratio, a cold and a warm process, each
    timing its rounds (nothing is compiled on a CPU)."""
    out = tmp_path / "first_call.json"
    env = dict(os.environ)
    ifname = _loopback()
    if ifname is not None:  # as _torchrun: gloo must not pick a hostname interface
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
    proc = subprocess.run(
        [sys.executable, "benchmarks/first_call.py", "--experts", "8", "--tokens", "8",
         "--layers", "1", "--keep", "0.5", "--calls", "3", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["keep"], row["cache"]) for row in rows] == [(0.5, "cold"), (0.5, "warm")]
    for row in rows:
        assert len(row["rounds_s"]) == 3 and min(row["rounds_s"]) > 0
        assert row["compiled"] == 0 and row["kernels"] == []
    assert "keep 0.5 warm: one-off" in proc.stdout


def test_train_compare_runs_a_alone_and_gives_each_run_a_cold_cache(tmp_path: Path) -> None:
    """benchmarks/train_compare.sh's plumbing, with a stand-in for Python that prints what the
    launch got: runs A and B with COLD_CACHE=1 each get an empty Triton cache of their own,
    removed afterwards; by default they share the machine's; B_KEEP=none runs A alone."""
    import shutil

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "train_compare.sh", root / "benchmarks")
    shutil.copytree(REPO / "examples", root / "examples")
    (root / ".data").mkdir()
    (root / ".data" / "pystdlib_bytes.bin").touch()  # no dataset build
    fake = tmp_path / "python"
    fake.write_text(
        '#!/usr/bin/env bash\necho "cache=${TRITON_CACHE_DIR:-shared} keep=$KEEP_RATIO"\n'
    )
    fake.chmod(0o755)
    env = dict(os.environ, A_ENV=f"PYTHON={fake}", B_ENV=f"PYTHON={fake}")

    def logs(out: Path, **extra: str) -> dict[str, str]:
        subprocess.run(
            ["bash", str(root / "benchmarks" / "train_compare.sh"), str(out)],
            env=dict(env, **extra), capture_output=True, text=True, timeout=120, check=True,
        )
        return {p.name: p.read_text() for p in sorted(out.glob("train_*.log"))}

    cold = logs(tmp_path / "cold", COLD_CACHE="1")
    assert sorted(cold) == ["train_keep0.5.log", "train_keep1.0.log"]
    caches = {name: text.split()[0].partition("=")[2] for name, text in cold.items()}
    assert caches["train_keep1.0.log"].endswith("/train_keep1.0")
    assert caches["train_keep0.5.log"].endswith("/train_keep0.5")
    assert not any(os.path.exists(c) for c in caches.values())  # removed on exit
    shared = logs(tmp_path / "shared")
    assert all(text.startswith("cache=shared") for text in shared.values())
    alone = logs(tmp_path / "alone", B_KEEP="none", A_KEEP="0.25")
    assert list(alone) == ["train_keep0.25.log"]
    assert "keep=0.25" in alone["train_keep0.25.log"]
    assert "exit 0 (0.25)" in alone["train_keep0.25.log"]


def test_wgrad_bench_group_sizes_skew_and_order() -> None:
    """wgrad_bench's skewed group sizes: the requested total, the same draw in every order,
    about the requested coefficient of variation, uniform at 0."""
    from benchmarks.wgrad_bench import _group_sizes

    even = _group_sizes(512, 128, 0.0, "drawn")
    assert int(even.sum()) == 512 * 128 and float(even.float().std() / even.float().mean()) < 0.1
    drawn = _group_sizes(512, 128, 1.0, "drawn")
    desc = _group_sizes(512, 128, 1.0, "descending")
    asc = _group_sizes(512, 128, 1.0, "ascending")
    assert int(drawn.sum()) == 512 * 128
    assert torch.equal(desc, drawn.sort(descending=True).values)
    assert torch.equal(asc, drawn.sort().values)
    assert 0.7 < float(drawn.float().std() / drawn.float().mean()) < 1.3


def test_gamma_shares_keeps_wgrad_bench_draws() -> None:
    """The shared Gamma draw (benchmarks.common.gamma_shares) gives wgrad_bench the group sizes
    of its former inline draw, bit for bit; with a seed it is reproducible and leaves torch's
    global generator where it was."""
    from benchmarks.common import gamma_shares
    from benchmarks.wgrad_bench import _group_sizes

    def before(rows: int, experts: int, cv: float, order: str) -> torch.Tensor:
        torch.manual_seed(rows * 1000 + round(cv * 100))  # wgrad_bench._group_sizes before
        if cv > 0:
            shares = torch.distributions.Gamma(torch.full((experts,), 1.0 / cv**2), 1.0).sample()
        else:
            shares = torch.ones(experts)
        sizes = torch.distributions.Multinomial(rows * experts, shares / shares.sum())
        sizes = sizes.sample().long()
        if order != "drawn":
            sizes = sizes.sort(descending=order == "descending").values
        return sizes

    cases = itertools.product((128, 512), (0.0, 0.5, 1.0, 2.0), ("drawn", "ascending"))
    for rows, cv, order in cases:
        assert torch.equal(_group_sizes(rows, 128, cv, order), before(rows, 128, cv, order))
    state = torch.get_rng_state()
    shares = gamma_shares(4096, 0.5, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(shares, gamma_shares(4096, 0.5, seed=3))
    assert not torch.equal(shares, gamma_shares(4096, 0.5, seed=4))
    assert 0.45 < float(shares.std() / shares.mean()) < 0.55
    assert torch.equal(gamma_shares(8, 0.0, seed=3), torch.ones(8))


def test_tree_hash_follows_the_code_not_the_results(tmp_path: Path) -> None:
    """benchmarks/tree_hash.sh: 12 hex digits; a changed package file changes it, a changed
    measured file under benchmarks/results/ does not."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tree_hash.sh"
    files = {
        "megatron_lrmoe/op.py": "a = 1\n", "benchmarks/x.sh": "echo\n", "examples/q/p.sh": "x\n",
        "benchmarks/results/run/r.py": "1\n", "pretrain_lrmoe.py": "", "setup.py": "",
    }  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def tree_hash() -> str:
        done = subprocess.run(
            ["bash", str(script), str(tmp_path)], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    first = tree_hash()
    assert re.fullmatch(r"[0-9a-f]{12}", first)
    (tmp_path / "benchmarks/results/run/r.py").write_text("2\n")
    assert tree_hash() == first
    (tmp_path / "megatron_lrmoe/op.py").write_text("a = 2\n")
    assert tree_hash() != first
