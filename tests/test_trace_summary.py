"""benchmarks/trace_summary.py on a hand-made profiler trace: steps, owners, gaps, kernels."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import trace_summary


class _Events(list):
    """A hand-made trace's events: host ranges and kernels with their launches."""

    def cpu(self, name, ts, dur, cat="cpu_op"):
        self.append(dict(ph="X", cat=cat, name=name, ts=ts, dur=dur))

    def launch(self, corr, ts, kernel, start, dur):
        self.append(dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=1,
                         args=dict(correlation=corr)))
        self.append(dict(ph="X", cat="kernel", name=kernel, ts=start, dur=dur,
                         args=dict(correlation=corr)))


def _trace(tmp_path, shift: float = 0.0) -> str:
    ev = _Events()
    cpu, launch = ev.cpu, ev.launch

    for step in range(2):
        t0 = 1000.0 * step
        cpu(f"ProfilerStep#{step + 5}", t0, 900, cat="user_annotation")
        cpu("TrimmedMoEFunction", t0 + 10, 50)
        launch(100 * step + 1, t0 + 20, "fwd_gemm", t0 + 100, 40)  # in moe_fwd
        cpu("autograd::engine::evaluate_function: TrimmedMoEFunctionBackward", t0 + 300, 100)
        launch(100 * step + 2, t0 + 310, "wgrad", t0 + 400, 30)  # in moe_bwd
        launch(100 * step + 3, t0 + 390, "select", t0 + 450, 10 + shift)  # moe_bwd, 20 us gap before
        launch(100 * step + 4, t0 + 500, "attention", t0 + 600, 100)  # no owner
    # a kernel launched outside every step is not counted
    launch(999, 5000, "late", 5100, 50)
    path = tmp_path / f"rank-0-{shift}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=ev), f)
    return str(path)


def test_summary_of_a_hand_made_trace(tmp_path):
    s = trace_summary.summarize(_trace(tmp_path), top=10)
    assert [r["step"] for r in s["steps"]] == ["ProfilerStep#5", "ProfilerStep#6"]
    first = s["steps"][0]
    assert first["host_ms"] == pytest.approx(0.9)
    assert first["gpu_span_ms"] == pytest.approx(0.6)  # 100 .. 700 us
    assert first["busy_ms"] == pytest.approx(0.18)  # 40 + 30 + 10 + 100
    assert first["idle_ms"] == pytest.approx(0.42)
    bwd = s["owners"]["moe_bwd"]
    assert bwd["calls_per_step"] == 1
    assert bwd["summed_ms"] == pytest.approx(0.04)
    assert bwd["span_ms"] == pytest.approx(0.06)  # 400 .. 460
    assert bwd["gaps_ms"] == pytest.approx(0.02)
    assert s["owners"]["moe_fwd"]["summed_ms"] == pytest.approx(0.04)
    assert list(s["kernels"]) == ["attention", "fwd_gemm", "wgrad", "select"]
    assert s["kernels"]["wgrad"] == dict(ms=pytest.approx(0.03), moe_bwd_ms=pytest.approx(0.03))
    assert s["kernels"]["attention"]["moe_bwd_ms"] == 0.0
    assert "late" not in s["kernels"]


def test_model_bench_phases_get_what_the_op_does_not(tmp_path):
    """model_bench.py --profile's phase ranges: the op's activities stay the op's, the rest of
    each phase (here a router kernel in either) goes to bench_fwd_rest / bench_bwd_rest."""
    ev = _Events()
    cpu, launch = ev.cpu, ev.launch
    cpu("ProfilerStep#1", 0, 1000, cat="user_annotation")
    cpu("model_bench.forward", 10, 200, cat="user_annotation")
    launch(1, 20, "router_fwd", 30, 15)
    cpu("ExactMoEFunction", 50, 50)
    launch(2, 60, "fwd_gemm", 70, 40)
    cpu("model_bench.backward", 300, 400, cat="user_annotation")
    cpu("autograd::engine::evaluate_function: ExactMoEFunctionBackward", 310, 100)
    launch(3, 320, "wgrad", 330, 60)
    launch(4, 450, "router_bwd", 460, 25)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(dict(traceEvents=ev)))
    owners = trace_summary.summarize(str(path), top=5)["owners"]
    assert owners["moe_fwd"]["busy_ms"] == pytest.approx(0.04)
    assert owners["bench_fwd_rest"]["busy_ms"] == pytest.approx(0.015)
    assert owners["moe_bwd"]["busy_ms"] == pytest.approx(0.06)
    assert owners["bench_bwd_rest"]["busy_ms"] == pytest.approx(0.025)


def test_the_op_backward_by_kind_of_kernel(tmp_path):
    """by_kind sums the op's backward kernels per call by their names (KINDS), in order: a
    weight-gradient kernel is not a selection kernel for containing "_weights"; kernels outside
    the op count nothing; an unknown kernel goes to "other"."""
    ev = _Events()
    for step, t0 in enumerate((0.0, 1000.0)):
        ev.cpu(f"ProfilerStep#{step}", t0, 900, cat="user_annotation")
        for call, c0 in enumerate((t0 + 100, t0 + 400)):
            ev.cpu("autograd::engine::evaluate_function: TrimmedMoEFunctionBackward", c0, 200)
            kernels = (
                ("_ZN7cutlass13device_kernelIN2at4cuda6detail", 40),
                ("_wgrad_kernel", 30),
                ("_weights_kernel", 2),
                ("_row_dot_pack_args_kernel", 8),
                ("_act_bwd_args_kernel", 6),
                ("_gather_sum_args_kernel", 4),
                ("some_fill_kernel", 1),
            )
            for i, (name, dur) in enumerate(kernels):
                corr = 1000 * step + 100 * call + i
                ev.launch(corr, c0 + 1 + i, name, c0 + 10 + 20 * i, dur)
        ev.launch(1000 * step + 999, t0 + 700, "_wgrad_kernel", t0 + 710, 50)  # not the op's
    path = tmp_path / "kinds.json"
    path.write_text(json.dumps(dict(traceEvents=ev)))
    s = trace_summary.summarize(str(path), top=5)
    assert s["owners"]["moe_bwd"]["calls_per_step"] == 2
    assert s["by_kind"] == {
        "grouped GEMMs": pytest.approx(0.040),
        "weight gradients": pytest.approx(0.030),
        "activation backward": pytest.approx(0.006),
        "gradient rows": pytest.approx(0.008),
        "gather-sum": pytest.approx(0.004),
        "scores and selection": pytest.approx(0.002),
        "other": pytest.approx(0.001),
    }
    assert "moe_bwd per call by kind (ms): grouped GEMMs 0.040, weight gradients 0.030" in (
        trace_summary.report([s], ["k"])
    )


def test_two_traces_side_by_side(tmp_path):
    a = trace_summary.summarize(_trace(tmp_path), top=10)
    b = trace_summary.summarize(_trace(tmp_path, shift=5.0), top=10)
    text = trace_summary.report([a, b], ["keep1", "keep05"])
    first_kernel_line = [l for l in text.splitlines() if l.rstrip().endswith("select")][0]
    assert "+0.005" in first_kernel_line
    assert "all activities: 0.180 / 0.185 ms per step (+0.005)" in text


def test_union():
    assert trace_summary.union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert trace_summary.union_us([]) == 0
