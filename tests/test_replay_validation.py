"""benchmarks/replay_validation.py: the replay against committed GPU measurements (issue 37 step 4).

Cheapest first: the key lookup and the arm mapping, the router simulation and its trace, the fit
(benchmarks/replay_fit.py) recovering known constants from the model's own predictions, then the
script's core on one model_bench file and one replica_bench file (committed traces, the real
replay) and the committed JSON: every measured number it quotes is read from a committed result
file by its key and appears there verbatim (none typed in), every prediction is what the replay
gives, the train / held-out split is the declared one, and the committed fit is what the
validation used and what the replay's defaults hold.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from benchmarks import replay_fit as rf
from benchmarks import replay_validation as rv
from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.controller import plan_call
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.observe.trace import read_trace
from megatron_lrmoe.replay.cost import DEFAULT_GEMM_TABLE, DEFAULT_LAYER_COSTS, NVLINK_GBPS
from megatron_lrmoe.replay.cost import LayerCosts, Network
from megatron_lrmoe.replay.replay import price_call, retime
from megatron_lrmoe.replay.shard import synthetic_counts

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "replay_validation" / "validation.json"
COSTS = REPO / "benchmarks" / "results" / "replay_validation" / "costs.json"
ROW_KEYS = {
    "config", "split", "bench", "ep", "arm", "label", "quantity", "routing", "measured",
    "source", "predicted", "error", "within_target",
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


def test_levenberg_marquardt_solves_a_small_least_squares_problem() -> None:
    t = np.linspace(0.0, 1.0, 20)
    y = 2.0 * np.exp(-3.0 * t) + 0.5
    x, info = rf.levenberg_marquardt(lambda p: p[0] * np.exp(-p[1] * t) + p[2] - y,
                                     np.array([1.0, 1.0, 0.0]))  # fmt: skip
    assert x == pytest.approx([2.0, 3.0, 0.5], rel=1e-6) and info["cost"] < 1e-20


def test_fit_recovers_known_constants_from_the_models_own_predictions() -> None:
    """Measurements made by the model itself at known constants (calls at P = 1 and 2, keep 1
    and 0.5, fused and bf16 weight gradients, small calls where the host floors bind and large
    ones where they do not; the validation's kinds of quantity): the fit, from the script's
    START, finds the constants again."""
    truth = {"memory_gbps": 2500.0, "trimmed_fixed_ms": 0.12, "router_fixed_ms": 0.05,
             "router_token_ns": 25.0,
             "router_score_ns": 0.3, "main_grad_gbps": 4000.0, "host_fwd_ms": 1.5,
             "host_bwd_ms": 1.2, "host_trimmed_bwd_ms": 3.0, "sync_ms": 0.8,
             "intra_gbps": 200.0}  # fmt: skip
    assert set(truth) == set(rf.NAMES)
    cost = CostModel(hidden_size=2048, ffn_hidden_size=768)
    table = DEFAULT_GEMM_TABLE.for_shape(cost)
    calls = []
    for seed, (ranks, experts, tokens, keep, main_grad) in enumerate([
        (1, 16, 1024, 1.0, "fused"), (1, 16, 4096, 0.5, "fused"), (1, 16, 16384, 0.5, "fused"),
        (1, 128, 16384, 1.0, "fused"), (1, 128, 16384, 0.25, "fused"),
        (2, 32, 1024, 0.5, "none"), (2, 32, 16384, 1.0, "none"), (2, 32, 16384, 0.5, "none"),
    ]):  # fmt: skip
        counts = synthetic_counts(1, ranks, experts, tokens, 8, zipf=0.5, seed=seed)[0]
        plan = plan_call(counts, 0, LRMoEConfig(keep_ratio=keep), cost)
        calls.append(price_call(plan, cost, table, Network(), topk=8, main_grad=main_grad))

    def quantities(values: dict) -> np.ndarray:
        layer = LayerCosts(**{k: values[k] for k in LayerCosts.CONSTANTS})
        network = Network(intra_gbps=values["intra_gbps"])
        out = []
        for call in calls:
            p = retime(call, cost, network, layer).phase_ms
            out += [sum(p[x] for x in rv.FORWARD), sum(p[x] for x in rv.BACKWARD),
                    sum(p[x] for x in rv.OP_FORWARD), sum(p[x] for x in rv.OP_BACKWARD),
                    p["router"], p["elementwise_bwd"], p["gemm_bwd"] / 2 + p["main_grad"],
                    sum(p[x] for x in rv.EXCHANGES4)]  # fmt: skip
        return np.array(out)

    measured = quantities(truth)
    used = measured > 0  # no exchanges at P = 1

    def residuals(x: np.ndarray) -> np.ndarray:
        values = dict(zip(rf.NAMES, np.exp(x)))
        return np.log(quantities(values)[used] / measured[used])

    start = np.log([rf.START[k] for k in rf.NAMES])
    assert np.abs(residuals(start)).max() > 0.5  # the start is far off
    x, info = rf.levenberg_marquardt(residuals, start)
    found = dict(zip(rf.NAMES, np.exp(x)))
    assert info["cost"] < 1e-12
    for name in rf.NAMES:
        assert found[name] == pytest.approx(truth[name], rel=1e-4), name


def test_split_is_declared_and_the_fit_reads_only_training_runs() -> None:
    files = rf.training_files()
    every = [*files["model_files"], *files["layer_files"], *files["replica_files"]]
    assert every and all(f.startswith(rv.TRAINING_RUNS) for f in every)
    held = [f for f in (*rv.MODEL_BENCH, *rv.LAYER_BENCH, *rv.REPLICA_BENCH) if f not in every]
    assert {f.split("/")[0] for f in held} == {
        "gpu_run33", "gpu_run28", "gpu_run29", "gpu_run1", "gpu_run2", "gpu_run4", "gpu_run5"
    }  # fmt: skip
    assert rv.split_of("gpu_run32/call1/model_e16_t4096") == "training"
    assert rv.split_of("gpu_run8/layer_ep2 t4096") == "training"
    assert rv.split_of("gpu_run4/layer_ep2 t4096") == "held-out"


def test_committed_costs_are_the_fit_of_the_declared_split() -> None:
    data = json.loads(COSTS.read_text(encoding="utf-8"))
    assert data["split"]["training_runs"] == list(rv.TRAINING_RUNS)
    assert all(f.startswith(tuple(f"benchmarks/results/{r}" for r in rv.TRAINING_RUNS))
               for f in data["split"]["training_files"])  # fmt: skip
    assert data["fit"]["start"] == rf.START and data["fit"]["quantities"] == list(rf.FIT_QUANTITIES)
    assert data["fit"]["objective_at_fit"] < data["fit"]["objective_at_start"]
    assert {k: data["layer"][k] for k in LayerCosts.CONSTANTS} == {
        k: getattr(DEFAULT_LAYER_COSTS, k) for k in LayerCosts.CONSTANTS
    }
    assert data["network"]["intra_gbps"] == NVLINK_GBPS


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
        search_files=(),
    )
    assert payload["format"] == "lrmoe-replay-validation" and payload["target"] == 0.1
    rows = payload["comparisons"]
    assert {r["bench"] for r in rows} == {"model_bench", "replica_bench"}
    for r in rows:
        assert ROW_KEYS <= set(r) and r["quantity"] in rv.QUANTITIES
        assert math.isfinite(r["predicted"]) and r["predicted"] > 0
        assert (REPO / r["routing"] / "rank00000" / "meta.json").is_file()
    _assert_read_from_committed_files(rows)

    # The predictions are the replay's: the keep-1.0 GEMM floor is its gemm_fwd phase, the
    # layer and the op the sums of their phases, the profiled rest the router.
    (replay,) = [d for d in payload["replays"] if d["config"].endswith("model_e128_t16384")]
    floor = next(r for r in rows if r["quantity"] == "floor_gemm_fwd_ms")
    phases = replay["predictions"]["keep1"]["phase_ms"]
    assert floor["predicted"] == phases["gemm_fwd"]
    keep1 = {r["quantity"]: r for r in rows if r["arm"] == "keep1" and r["bench"] == "model_bench"}
    for quantity, names in (("fwd_ms", rv.FORWARD), ("bwd_ms", rv.BACKWARD),
                            ("op_fwd_ms", rv.OP_FORWARD), ("op_bwd_ms", rv.OP_BACKWARD)):
        assert keep1[quantity]["predicted"] == pytest.approx(sum(phases[p] for p in names))
    assert keep1["rest_fwd_ms"]["predicted"] == phases["router"] > 0
    assert phases["main_grad"] > 0  # model_bench fuses main_grad, the replica bench does not
    # The model before the fit: GEMMs and exchanges only, the rest 0.
    assert keep1["rest_fwd_ms"]["predicted_unfitted"] == 0.0
    assert keep1["floor_gemm_fwd_ms"]["predicted_unfitted"] == floor["predicted"]
    assert {r["split"] for r in rows} == {"training", "held-out"}
    assert all(r["split"] == rv.split_of(r["config"]) for r in rows)
    replica = [d for d in payload["replays"] if "replica_bench" in d["config"]]
    predictions = [p for d in replica for p in d["predictions"].values()]
    assert predictions and all(p["phase_ms"]["main_grad"] == 0.0 for p in predictions)
    # The planner's peaks from the recorded expert totals match the file's rows exactly.
    peaks = [r for r in rows if r["quantity"] in ("fwd_peak_rows", "bwd_peak_rows")]
    assert len(peaks) == 3 * 4 * 2 and all(r["error"] == 0.0 for r in peaks)
    summary = payload["summary"]
    assert summary["all"]["n"] == len(rows)
    assert sum(v["n"] for k, v in summary.items() if k != "all") == len(rows)
    split = payload["summary_training"]["all"]["n"] + payload["summary_held_out"]["all"]["n"]
    assert split == len(rows) == payload["summary_unfitted"]["all"]["n"]
    assert payload["not_compared"] and payload["routing_checks"]
    table = rv.markdown(payload)
    assert "| gpu_run32/call2/model_e128_t16384 | train | floor_gemm_fwd_ms |" in table


def test_committed_validation_json_quotes_only_committed_numbers() -> None:
    payload = json.loads(COMMITTED.read_text(encoding="utf-8"))
    rows = payload["comparisons"]
    assert payload["summary"]["all"]["n"] == len(rows) > 0
    assert {r["bench"] for r in rows} == {
        "model_bench", "layer_bench", "replica_bench", "memory_bound"
    }
    for r in rows:
        assert ROW_KEYS <= set(r) and r["split"] == rv.split_of(r["config"])
        assert (REPO / r["routing"] / "rank00000" / "meta.json").is_file()
        assert r["error_unfitted"] == pytest.approx(r["predicted_unfitted"] / r["measured"] - 1)
    _assert_read_from_committed_files(rows)
    # Made with the committed fit (the replay's defaults), on the declared split.
    layer = payload["layer_costs"]
    assert {k: layer[k] for k in LayerCosts.CONSTANTS} == {
        k: getattr(DEFAULT_LAYER_COSTS, k) for k in LayerCosts.CONSTANTS
    }
    assert payload["network"]["intra_gbps"] == NVLINK_GBPS
    assert payload["split"]["training_runs"] == list(rv.TRAINING_RUNS)
    for name, split in (("summary_training", "training"), ("summary_held_out", "held-out")):
        mine = [r for r in rows if r["split"] == split]
        assert payload[name]["all"]["n"] == len(mine)
        assert payload[name]["all"]["within_target"] == sum(r["within_target"] for r in mine)


def test_memory_bound_search_prices_each_arm_per_training_iteration() -> None:
    """The search's arms as replay arms (activation mode, ``+moe`` under Megatron's MoE
    recompute, nothing for full recompute), each priced per iteration as (forward + backward)
    x layers x micro-batches on the reconstructed routing of its micro-batch, and each arm over
    the baseline's; every measured number read from the committed file."""
    moe = {"keep": 1.0, "activation_mode": "save", "recompute": "moe"}
    assert rv.search_arm(moe) == "keep1+moe"
    assert rv.search_arm({"keep": 0.5, "activation_mode": "lean", "recompute": "none"}) == (
        "keep0.5+lean"
    )
    assert rv.search_arm({"keep": 1.0, "activation_mode": "save", "recompute": "full"}) == "keep1"
    payload = rv.validate(model_files=(), layer_files=(), replica_files=())
    rows = payload["comparisons"]
    assert {r["bench"] for r in rows} == {"memory_bound"}
    assert all(r["split"] == "held-out" for r in rows)
    _assert_read_from_committed_files(rows)
    per_iter = {r["label"]: r for r in rows if r["quantity"] == "moe_ms_per_iter"}
    # Seven arms ran; the one out of memory (stock) has no time.
    assert set(per_iter) == {"stock+moe", "k0.5+moe", "k0.25+moe", "stock-mbs8", "stock+full",
                             "k0.5-recompute", "stock-mbs8+moe"}  # fmt: skip
    details = {d["arm"]: d for d in payload["replays"]}
    # Megatron's MoE recompute: both forwards in the layer's time (the second in bwd_ms);
    # full recompute on gpu_run33's timer (gradient-free forwards not counted): one forward.
    for label, micro in (("stock+moe", 1), ("stock-mbs8", 2), ("stock+full", 1)):
        pred = details[label]["prediction"]
        want = (pred["fwd_ms"] + pred["bwd_ms"]) * 24 * micro
        assert per_iter[label]["predicted"] == pytest.approx(want)
    assert details["stock+full"]["prediction"]["phase_ms"]["moe_recompute"] == 0.0
    assert "t8192" in details["stock-mbs8"]["trace"] and "t16384" in details["stock+moe"]["trace"]
    phases = details["stock+moe"]["prediction"]["phase_ms"]
    assert phases["moe_recompute"] == pytest.approx(sum(phases[p] for p in rv.FORWARD))
    ratio = {r["label"]: r for r in rows if r["quantity"] == "moe_vs_baseline"}
    assert "stock+moe" not in ratio and len(ratio) == 6
    assert ratio["k0.5+moe"]["predicted"] == pytest.approx(
        per_iter["k0.5+moe"]["predicted"] / per_iter["stock+moe"]["predicted"]
    )
