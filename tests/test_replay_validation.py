"""benchmarks/replay_validation.py: the replay against committed GPU measurements (issue 37 step 4).

Cheapest first: the key lookup and the arm mapping, the router simulation and its trace, then the
script's core on one model_bench file and one replica_bench file (committed traces, the real
replay) and the committed JSON: every measured number it quotes is read from a committed result
file by its key and appears there verbatim (none typed in), and every prediction is what the
replay gives.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import replay_validation as rv
from megatron_lrmoe.observe.trace import read_trace

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "replay_validation" / "validation.json"
ROW_KEYS = {
    "config", "bench", "ep", "arm", "label", "quantity", "routing", "measured", "source",
    "predicted", "error", "within_target",
}  # fmt: skip


def test_lookup_selects_one_element_by_fields() -> None:
    data = {
        "rows": [
            {"keep": 1.0, "variant": "a R=2", "t": {"grouped GEMMs": 3}},
            {"keep": 0.5, "variant": "b", "t": {"grouped GEMMs": 4}},
            {"keep": 0.5, "variant": "c", "t": {}},
        ]
    }
    assert rv.lookup(data, "rows[keep=1]/t/grouped GEMMs") == 3
    assert rv.lookup(data, "rows[keep=0.5,variant=b]/t/grouped GEMMs") == 4
    assert rv.lookup(data, "rows[variant=a R=2]/keep") == 1.0  # '=' inside a value
    with pytest.raises(KeyError, match="matches 2"):
        rv.lookup(data, "rows[keep=0.5]/variant")
    with pytest.raises(KeyError, match="matches 0"):
        rv.lookup(data, "rows[keep=0.25]/variant")
    with pytest.raises(KeyError, match="no field"):
        rv.lookup(data, "rows[variant=c]/t/grouped GEMMs")


def test_measured_ops(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"a": 2.0, "b": 3.0, "c": 5.0, "d": 1.0}))
    rel = path.as_posix()  # absolute: ROOT / absolute is the absolute path
    assert rv.Measured(rel, ("a",)).read() == 2.0
    assert rv.Measured(rel, ("a", "b"), "sum").read() == 5.0
    assert rv.Measured(rel, ("a", "b"), "ratio").read() == pytest.approx(2 / 3)
    assert rv.Measured(rel, ("a", "b", "c", "d"), "ratio_of_sums").read() == pytest.approx(5 / 6)


def test_arm_of_reads_the_rows_config() -> None:
    assert rv.arm_of(None) == "stock"
    assert rv.arm_of({"keep_ratio": 1.0}) == "keep1"
    assert rv.arm_of({"keep_ratio": 0.5, "activation_mode": "recompute"}) == "keep0.5+recompute"
    assert rv.arm_of({"keep_ratio": 0.5, "max_replicas_per_rank": 2}) == "keep0.5+rep2"
    assert rv.arm_of({"keep_ratio": 0.5, "scope": "global"}) is None


def test_router_simulation_is_seeded_and_writes_a_trace(tmp_path: Path) -> None:
    spec = rv.RouterSpec(experts=8, tokens=64, layers=2, ranks=2, topk=2, hidden=16)
    counts = rv.simulate_router(spec, std=0.02, chunk=40)
    assert counts.shape == (2, 2, 8)
    assert (counts.sum(axis=2) == 64 * 2).all()  # every token picks top-k distinct experts
    assert (counts <= 64).all()
    np.testing.assert_array_equal(counts, rv.simulate_router(spec, std=0.02))
    skewed = rv.simulate_router(rv.RouterSpec(8, 64, 2, 2, 2, 16, skew=2.0), std=0.02)
    assert skewed.sum(axis=1).std(axis=1).min() > counts.sum(axis=1).std(axis=1).max()

    directory = rv.router_trace(spec, ffn=8, traces=tmp_path)
    trace = read_trace(directory)
    assert trace.meta["topk"] == 2 and trace.meta["hidden_size"] == 16
    assert "router simulation" in trace.meta["reconstruction"]
    np.testing.assert_array_equal(trace.counts, counts)
    stamp = (directory / "rank00000" / "meta.json").stat().st_mtime_ns
    assert rv.router_trace(spec, ffn=8, traces=tmp_path) == directory  # read back, not rewritten
    assert (directory / "rank00000" / "meta.json").stat().st_mtime_ns == stamp
    fresh: set[Path] = set()
    rv.router_trace(spec, ffn=8, traces=tmp_path, fresh=fresh)  # --reconstruct: once per run
    assert fresh == {directory} and read_trace(directory).counts.shape == (2, 2, 8)


def _assert_read_from_committed_files(rows: list[dict]) -> None:
    """Every measured number: ``op`` over values found at its keys in a result file that git
    tracks, each value written there verbatim."""
    tracked = None
    if shutil.which("git"):
        files = sorted({r["source"]["file"] for r in rows})
        done = subprocess.run(
            ["git", "ls-files", "--error-unmatch", *files], cwd=REPO, capture_output=True
        )
        tracked = done.returncode == 0
    assert tracked in (None, True), "a measured number's source file is not committed"
    texts: dict[str, str] = {}
    for r in rows:
        source = r["source"]
        file = source["file"]
        assert file.startswith("benchmarks/results/") and "replay_validation" not in file
        text = texts.setdefault(file, (REPO / file).read_text(encoding="utf-8"))
        data = json.loads(text)
        values = [rv.lookup(data, key) for key in source["keys"]]
        for value in values:
            assert isinstance(value, (int, float)) and json.dumps(value) in text, (file, value)
        if source["op"] == "value":
            assert r["measured"] == values[0]
        elif source["op"] == "sum":
            assert r["measured"] == pytest.approx(sum(values), rel=1e-12)
        elif source["op"] == "ratio":
            assert r["measured"] == pytest.approx(values[0] / values[1], rel=1e-12)
        else:
            half = len(values) // 2
            assert r["measured"] == pytest.approx(sum(values[:half]) / sum(values[half:]))
        assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1.0)
        assert r["within_target"] == (abs(r["error"]) <= rv.TARGET)


def test_core_on_committed_traces_quotes_only_committed_numbers() -> None:
    payload = rv.validate(
        model_files=("gpu_run32/call2/model_e128_t16384.json",),
        layer_files=(),
        replica_files=("gpu_run5/replica_bench.json",),
    )
    assert payload["format"] == "lrmoe-replay-validation" and payload["target"] == 0.1
    rows = payload["comparisons"]
    assert {r["bench"] for r in rows} == {"model_bench", "replica_bench"}
    for r in rows:
        assert ROW_KEYS <= set(r) and r["quantity"] in rv.QUANTITIES
        assert math.isfinite(r["predicted"]) and r["predicted"] > 0
        assert (REPO / r["routing"] / "rank00000" / "meta.json").is_file()
    _assert_read_from_committed_files(rows)

    # The predictions are the replay's: the keep-1.0 GEMM floor is its gemm_fwd phase.
    (replay,) = [d for d in payload["replays"] if d["config"].endswith("model_e128_t16384")]
    floor = next(r for r in rows if r["quantity"] == "floor_gemm_fwd_ms")
    assert floor["predicted"] == replay["predictions"]["keep1"]["phase_ms"]["gemm_fwd"]
    # The planner's peaks from the recorded expert totals match the file's rows exactly.
    peaks = [r for r in rows if r["quantity"] in ("fwd_peak_rows", "bwd_peak_rows")]
    assert len(peaks) == 3 * 4 * 2 and all(r["error"] == 0.0 for r in peaks)
    summary = payload["summary"]
    assert summary["all"]["n"] == len(rows)
    assert sum(v["n"] for k, v in summary.items() if k != "all") == len(rows)
    assert payload["not_compared"] and payload["routing_checks"]
    table = rv.markdown(payload)
    assert "| gpu_run32/call2/model_e128_t16384 | floor_gemm_fwd_ms |" in table


def test_committed_validation_json_quotes_only_committed_numbers() -> None:
    payload = json.loads(COMMITTED.read_text(encoding="utf-8"))
    rows = payload["comparisons"]
    assert payload["summary"]["all"]["n"] == len(rows) > 0
    assert {r["bench"] for r in rows} == {"model_bench", "layer_bench", "replica_bench"}
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert (REPO / r["routing"] / "rank00000" / "meta.json").is_file()
    _assert_read_from_committed_files(rows)
