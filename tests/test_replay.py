"""The routing replay (megatron_lrmoe/replay/), CPU.

* the cost model against hand-computed cases (GEMM table interpolation, all-to-all pricing,
  one small call priced by hand; the layer costs: elementwise and main_grad bytes, router, host
  floors and sync, one call priced with them by hand; re-pricing equals pricing afresh; the
  defaults equal the committed fit);
* the replay's per-rank rows against the controller's own assignments on random plans;
* resharding (sums, rules, refusals) and the synthetic generator;
* a skewed synthetic pass: replicas lower the peak, budgets bind;
* P = 1 and 2 against ``plan_call`` directly, and P = 2 against real LRMoE layers on the gloo
  harness: the trace they record, replayed, gives the layers' own per-rank statistics (forward
  rows, kept rows, gradient-exchange bytes, quotas);
* a trace of two pipeline stages read as one model: recorded by real layers over gloo (PP 2 x
  EP 2), it equals the unsplit model's trace and replays the same; merged synthetic stages
  replay as the stages' own replays concatenated; the console entry's --ep-group,
  --common-calls and --rank on it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.controller import plan_call
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.replay.cli import main as replay_main
from megatron_lrmoe.replay.cost import (
    COSTS_FORMAT,
    DEFAULT_GEMM_TABLE,
    DEFAULT_LAYER_COSTS,
    MAIN_GRAD_BYTES,
    NVLINK_GBPS,
    GemmTable,
    LayerCosts,
    LayerWork,
    Network,
    elementwise_bytes,
    load_costs,
    load_gemm_table,
    main_grad_bytes,
)
from megatron_lrmoe.replay.replay import (
    BACKWARD_PHASES,
    FORWARD_PHASES,
    PHASES,
    Arm,
    parse_arm,
    price_call,
    rank_pair_rows,
    replay_pass,
    retime,
)
from megatron_lrmoe.replay.shard import reshard, scale_rows, synthetic_counts

LINEAR = GemmTable((1, 2), (2.0, 4.0), (2.0, 4.0), groups=2, hidden_size=4, ffn_hidden_size=2)
SMALL = CostModel(hidden_size=4, ffn_hidden_size=2, gated=True, activation_bytes=2, param_bytes=2)


# --- cost model --------------------------------------------------------------------------------
def test_gemm_table_interpolation_by_hand() -> None:
    table = GemmTable(
        (100, 200), (1.0, 3.0), (2.0, 2.0), groups=2, hidden_size=8, ffn_hidden_size=4
    )
    rows = np.array([0, 1, 50, 100, 150, 200, 300])
    # Per expert: 0.5 ms at 100 rows, 1.5 at 200; the first point's time below the grid, the
    # last slope (1 ms per 100 rows) above, nothing for an empty group.
    assert table.expert_ms("fc1", rows).tolist() == [0.0, 0.5, 0.5, 0.5, 1.0, 1.5, 2.5]
    assert table.expert_ms("fc2", rows).tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert table.rank_ms("fc1", np.array([[100, 0], [200, 150]])).tolist() == [2.0, 1.0]
    double = table.for_shape(CostModel(hidden_size=16, ffn_hidden_size=4))
    assert double.fc1_ms == (2.0, 6.0) and double.fc2_ms == (4.0, 4.0)
    assert table.for_shape(CostModel(hidden_size=8, ffn_hidden_size=4)) is table
    with pytest.raises(ValueError, match="strictly ascending"):
        GemmTable((2, 1), (1.0, 1.0), (1.0, 1.0), groups=1, hidden_size=1, ffn_hidden_size=1)
    with pytest.raises(ValueError, match="'fc1' or 'fc2'"):
        table.expert_ms("fc3", rows)


def test_default_table_matches_its_sources() -> None:
    """The committed default is the gemm_ms column of the files it names."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    quick = json.loads((results / "gpu_run26/call2/wgrad_quick.json").read_text())
    auto = json.loads((results / "gpu_run12/wgrad_auto.json").read_text())
    points = {(r["proj"], r["rows_per_expert"]): r["gemm_ms"] for r in auto}
    points = {key: ms for key, ms in points.items() if key[1] == 4096}
    points.update({(r["proj"], r["rows_per_expert"]): r["gemm_ms"] for r in quick})
    t = DEFAULT_GEMM_TABLE
    for proj, times in (("fc1", t.fc1_ms), ("fc2", t.fc2_ms)):
        for rows, ms in zip(t.rows_per_expert, times):
            assert ms == pytest.approx(points[(proj, rows)], abs=5e-5), (proj, rows)


def test_gemm_table_file_round_trip(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(LINEAR.to_json()))
    assert load_gemm_table(path) == LINEAR
    path.write_text(json.dumps({"rows_per_expert": [1, 2]}))
    with pytest.raises(ValueError, match="gemm_table.py"):
        load_gemm_table(path)


def test_alltoall_by_hand() -> None:
    net = Network(
        gpus_per_node=2,
        intra_gbps=100.0,
        intra_latency_us=10.0,
        inter_gbps=50.0,
        inter_latency_us=20.0,
    )
    b = np.zeros((4, 4))
    b[0, 1] = 1e9  # intra: 10 ms + 10 us
    b[0, 2] = 5e8  # inter: 10 ms + 20 us
    b[3, 3] = 1e12  # kept at home: free
    got = net.alltoall_ms(b)
    assert got.tolist() == pytest.approx([10.02, 10.01, 10.02, 0.0])
    b[2, 0] = 1e9  # rank 0 now receives 1e9 across nodes: max(sent, received) = 20 ms
    assert net.alltoall_ms(b)[0] == pytest.approx(20.02)


def test_one_call_priced_by_hand() -> None:
    """P = 2, E = 2, fixed ownership at keep 1: every phase from first principles."""
    counts = np.array([[3, 1], [1, 3]])
    plan = plan_call(counts, 0, LRMoEConfig(), SMALL)
    net = Network(gpus_per_node=8, intra_gbps=1e-3, intra_latency_us=1.0)  # 1e3 bytes per ms
    price = price_call(plan, SMALL, LINEAR, net)
    row = SMALL.row_bytes  # 8 bytes
    # Each rank sends one row to the other in each of the four row exchanges.
    for phase in ("dispatch", "combine", "grad", "dgrad"):
        assert price.exchange_bytes[phase].tolist() == [[3 * row, row], [row, 3 * row]]
        assert price.phase_ms[phase] == pytest.approx(0.001 + row / 1e3)
    assert price.phase_ms["replica_fetch"] == price.phase_ms["replica_grads"] == 0.0
    # LINEAR: 1 ms per row per expert for each projection; 4 rows per rank.
    assert price.phase_ms["gemm_fwd"] == pytest.approx(8.0)
    assert price.phase_ms["gemm_bwd"] == pytest.approx(16.0)
    assert price.forward_rows.tolist() == [4, 4] and price.network_bytes.tolist() == [32, 32]
    saved = SMALL.expert_saved_bytes("save")
    assert price.held_bytes.tolist() == [4 * saved, 4 * saved]
    # Keep 0.5 in recompute mode: two kept rows per expert, 2H gradient rows, fc1 recomputed.
    half = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, activation_mode="recompute"), SMALL)
    price = price_call(half, SMALL, LINEAR, net)
    assert price.backward_rows.tolist() == [2, 2]
    assert price.phase_ms["gemm_bwd"] == pytest.approx(2 * (2 + 2) + 2)
    grad = price.exchange_bytes["grad"]
    assert grad.sum() == 4 * 2 * row and (grad.T == price.exchange_bytes["dgrad"] * 2).all()
    held_recompute = price.held_bytes
    # lean: the same kept rows, plus every pair's gradient row out and fc2's input gradient
    # over the 4 computed rows per rank; F per computed pair held instead of z per sent pair.
    lean = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, activation_mode="lean"), SMALL)
    price = price_call(lean, SMALL, LINEAR, net)
    assert price.phase_ms["gemm_bwd"] == pytest.approx(2 * (2 + 2) + 2 + 4)
    assert price.exchange_bytes["grad"].sum() == 4 * row + 8 * row  # kept token rows, all g
    lean_held = 4 * SMALL.ffn_hidden_size * SMALL.activation_bytes
    assert price.held_bytes.tolist() == [lean_held] * 2 and held_recompute.tolist() == [4 * row] * 2


# A layer cost of round numbers: 1e6 bytes per ms of memory (2e6 of main_grad), router 0.5 ms per
# call + 1 ms per token + 0.5 ms per token-expert, 0.25 ms fixed per trimmed backward; host
# floors 10 / 20 / 30 ms, sync 4 ms.
ROUND = LayerCosts(
    memory_gbps=1.0,
    trimmed_fixed_ms=0.25,
    router_fixed_ms=0.5,
    router_token_ns=1e6,
    router_score_ns=5e5,
    main_grad_gbps=2.0,
    host_fwd_ms=10.0,
    host_bwd_ms=20.0,
    host_trimmed_bwd_ms=30.0,
    sync_ms=4.0,
)


def _work(**kw) -> LayerWork:
    base = dict(
        tokens=np.array([2.0, 3.0]),
        pairs=np.array([4, 6]),
        forward_rows=np.array([5, 5]),
        kept_rows=np.array([3, 2]),
        kept_pairs=np.array([2, 3]),
        experts=np.array([1, 1]),
        num_experts=2,
    )
    return LayerWork(**{**base, **kw})


def test_layer_cost_bytes_by_hand() -> None:
    """SMALL: H 4, F 2, F1 4, 2 bytes per element."""
    a, h, f, f1 = 2, 4, 2, 4
    work = _work()
    fwd, bwd = elementwise_bytes(work, SMALL)
    # forward: permute (read T, write N rows of H) and back, activation (read F1, write F)
    assert fwd.tolist() == [2 * a * h * (2 + 4) + a * 5 * (f1 + f),
                            2 * a * h * (3 + 6) + a * 5 * (f1 + f)]  # fmt: skip
    # every pair kept: gradient rows and gather-sum (T + N rows each), activation backward
    assert bwd.tolist() == [2 * a * h * (2 + 4) + a * 3 * (2 * f1 + f),
                            2 * a * h * (3 + 6) + a * 2 * (2 * f1 + f)]  # fmt: skip
    # trimmed at P = 2 in save mode: scoring (T + N), packing (2 per kept row), activation
    # backward on B, gather-sum (kept + T)
    _, bwd = elementwise_bytes(_work(trimmed=True), SMALL)
    assert bwd[0] == a * h * 6 + 2 * a * h * 2 + a * 3 * (2 * f1 + f) + a * h * (2 + 2)
    # recompute: the token rows packed too, the activation's forward again
    _, rec = elementwise_bytes(_work(trimmed=True, recompute=True), SMALL)
    assert rec[0] - bwd[0] == 2 * a * h * 2 + a * 3 * (f1 + f)
    # P = 1 packs the token rows (the fc1 inputs) with the gradient rows
    one = _work(tokens=np.array([2.0]), pairs=np.array([4]), forward_rows=np.array([4]),
                kept_rows=np.array([2]), kept_pairs=np.array([2]), experts=np.array([2]),
                trimmed=True)  # fmt: skip
    _, bwd1 = elementwise_bytes(one, SMALL)
    assert bwd1[0] == a * h * 6 + 4 * a * h * 2 + a * 2 * (2 * f1 + f) + a * h * (2 + 2)
    # main_grad: 6 bytes per owned parameter ([F1, H] + [H, F] per expert), none without it
    params = f1 * h + h * f
    assert MAIN_GRAD_BYTES == 6
    assert main_grad_bytes(one, SMALL).tolist() == [2 * params * 6]
    assert main_grad_bytes(one, SMALL, "none").tolist() == [0.0]
    with pytest.raises(ValueError, match="main_grad"):
        main_grad_bytes(one, SMALL, "unfused")


def test_layer_cost_times_and_host_floors_by_hand() -> None:
    work = _work()
    ms = ROUND.gpu_ms(work, SMALL)
    fwd, bwd = elementwise_bytes(work, SMALL)
    # router: 0.5 ms + tokens * (1e6 ns + 2 experts * 5e5 ns), forward and backward
    assert ms["router"].tolist() == ms["router_bwd"].tolist() == [4.5, 6.5]
    assert ms["elementwise_fwd"].tolist() == (fwd / 1e6).tolist()
    assert ms["elementwise_bwd"].tolist() == (bwd / 1e6).tolist()  # no fixed part at keep 1
    assert ms["main_grad"].tolist() == [24 * 6 / 2e6] * 2
    trimmed = ROUND.gpu_ms(_work(trimmed=True), SMALL)["elementwise_bwd"]
    assert trimmed.tolist() == pytest.approx(
        (elementwise_bytes(_work(trimmed=True), SMALL)[1] / 1e6 + 0.25).tolist()
    )
    # host floors: the trimmed backward launched kernel by kernel (P > 1) gets its own; at
    # P = 1 with fused main_grad it is one graph replay; the sync at P > 1 only
    assert ROUND.host_ms(work) == (10.0, 20.0, 4.0)
    assert ROUND.host_ms(_work(trimmed=True)) == (10.0, 30.0, 4.0)
    one = _work(tokens=np.array([2.0]), pairs=np.array([4]), forward_rows=np.array([4]),
                kept_rows=np.array([2]), kept_pairs=np.array([2]), experts=np.array([2]),
                trimmed=True)  # fmt: skip
    assert ROUND.host_ms(one) == (10.0, 20.0, 0.0)
    assert ROUND.host_ms(one, "none") == (10.0, 30.0, 0.0)
    with pytest.raises(ValueError, match="memory_gbps"):
        LayerCosts(0.0, 0, 0, 0, 0, 1, 0, 0, 0, 0)


def test_one_call_priced_with_layer_costs_by_hand() -> None:
    """The call of test_one_call_priced_by_hand (P = 2, E = 2, keep 1, top-2) with ROUND."""
    counts = np.array([[3, 1], [1, 3]])
    plan = plan_call(counts, 0, LRMoEConfig(), SMALL)
    net = Network(gpus_per_node=8, intra_gbps=1e-3, intra_latency_us=1.0)
    bare = price_call(plan, SMALL, LINEAR, net)
    assert all(bare.phase_ms[p] == 0.0 for p in PHASES if p not in bare.gemm_rank_ms
               and p not in bare.exchange_bytes)  # fmt: skip
    price = price_call(plan, SMALL, LINEAR, net, layer=ROUND, topk=2)
    work = price.work
    assert work.tokens.tolist() == [2.0, 2.0] and work.pairs.tolist() == [4, 4]
    assert work.kept_pairs.tolist() == [4, 4] and work.experts.tolist() == [1, 1]
    assert not work.trimmed
    p = price.phase_ms
    for phase in ("dispatch", "combine", "gemm_fwd", "grad", "gemm_bwd", "dgrad"):
        assert p[phase] == bare.phase_ms[phase]
    assert p["router"] == p["router_bwd"] == pytest.approx(4.5)  # 0.5 + 2 tokens * 2 ms
    fwd, bwd = elementwise_bytes(work, SMALL)
    assert p["elementwise_fwd"] == pytest.approx(fwd.max() / 1e6)
    assert p["main_grad"] == pytest.approx(24 * 6 / 2e6)
    gpu_fwd = sum(p[x] for x in FORWARD_PHASES if x != "host_fwd")
    gpu_bwd = sum(p[x] for x in BACKWARD_PHASES if x != "host_bwd")
    assert p["host_fwd"] == pytest.approx(max(0.0, 10.0 - gpu_fwd) + 4.0)
    assert p["host_bwd"] == pytest.approx(max(0.0, 20.0 - gpu_bwd))
    assert sum(p[x] for x in BACKWARD_PHASES) == pytest.approx(max(20.0, gpu_bwd))
    # bf16 weight gradients: no main_grad phase
    none = price_call(plan, SMALL, LINEAR, net, layer=ROUND, topk=2, main_grad="none")
    assert none.phase_ms["main_grad"] == 0.0
    with pytest.raises(ValueError, match="topk"):
        price_call(plan, SMALL, LINEAR, net, layer=ROUND)
    with pytest.raises(ValueError, match="main_grad"):
        price_call(plan, SMALL, LINEAR, net, main_grad="fp32")


def test_retime_equals_pricing_afresh() -> None:
    counts = synthetic_counts(1, 4, 16, 256, 2, zipf=1.2, seed=3)[0]
    plan = plan_call(counts, 0, LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=1), SMALL)
    first = price_call(plan, SMALL, LINEAR, Network(), topk=2)
    other = Network(intra_gbps=100.0, inter_gbps=10.0)
    again = retime(first, SMALL, other, ROUND)
    fresh = price_call(plan, SMALL, LINEAR, other, layer=ROUND, topk=2)
    assert again.phase_ms == fresh.phase_ms and again.work.trimmed
    assert retime(again, SMALL, Network()).phase_ms == first.phase_ms


def test_default_layer_costs_are_the_committed_fit(tmp_path) -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks/results/replay_validation/costs.json"
    layer, network = load_costs(path)
    assert layer == dataclasses.replace(DEFAULT_LAYER_COSTS, source=layer.source)
    assert network == {"intra_gbps": NVLINK_GBPS} and Network().intra_gbps == NVLINK_GBPS
    data = json.loads(path.read_text())
    assert data["format"] == COSTS_FORMAT and set(data["meaning"]) >= set(LayerCosts.CONSTANTS)
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"format": COSTS_FORMAT, "layer": {"memory_gbps": 1.0}}))
    with pytest.raises(ValueError, match="missing"):
        load_costs(bad)
    bad.write_text(json.dumps({"layer": {}}))
    with pytest.raises(ValueError, match="replay_fit.py"):
        load_costs(bad)


def test_cli_prices_layer_costs_by_default(tmp_path) -> None:
    args = ["--synthetic", "--layers", "2", "--experts", "16", "--ep", "8", "--arms", "stock",
            "keep0.5", "--tokens-per-rank", "1024", "--topk", "2"]  # fmt: skip
    runs = {}
    for name, extra in (("default", []), ("none", ["--costs", "none"]),
                        ("bf16", ["--main-grad", "none"])):  # fmt: skip
        out = tmp_path / f"{name}.json"
        assert replay_main([*args, *extra, "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())
    stock = {k: v["results"]["8"]["stock"] for k, v in runs.items()}
    assert stock["none"]["moe_ms"] < stock["default"]["moe_ms"]
    assert stock["none"]["phase_ms"]["router"] == 0.0 < stock["default"]["phase_ms"]["router"]
    assert stock["bf16"]["phase_ms"]["main_grad"] == 0.0 < stock["default"]["phase_ms"]["main_grad"]
    assert runs["none"]["settings"]["layer_costs"] is None
    assert runs["default"]["settings"]["network"]["intra_gbps"] == NVLINK_GBPS
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": COSTS_FORMAT, "layer": ROUND.to_json(),
                                 "network": {"intra_gbps": 99.0}}))  # fmt: skip
    out = tmp_path / "file.json"
    assert replay_main([*args, "--costs", str(costs), "--out", str(out)]) == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["network"]["intra_gbps"] == 99.0
    assert settings["layer_costs"]["host_fwd_ms"] == 10.0
    assert replay_main([*args, "--costs", str(costs), "--intra-gbps", "5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["network"]["intra_gbps"] == 5.0


# --- the replay's rows against the controller's assignments ------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_rank_pair_rows_equal_the_plans_assignments(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ranks = int(rng.choice([2, 3, 4, 8]))
    experts = ranks * int(rng.integers(1, 4))
    zipf = float(rng.uniform(0, 2))
    counts = synthetic_counts(1, ranks, experts, 64, 2, zipf=zipf, seed=seed)[0]
    lrmoe = LRMoEConfig(
        keep_ratio=float(rng.choice([0.25, 0.5, 1.0])),
        max_replicas_per_rank=int(rng.integers(0, 3)),
        activation_mode=str(rng.choice(["save", "recompute"])),
    )
    plan = plan_call(counts, 0, lrmoe, SMALL, check=True)
    price = price_call(plan, SMALL, LINEAR, Network())
    row = SMALL.row_bytes
    forward = plan.forward_assignment.sum(1).numpy()
    assert (price.exchange_bytes["dispatch"] == forward * row).all()
    backward = plan.backward_assignment.sum(1).numpy()
    assert (price.exchange_bytes["dgrad"] == backward.T * row).all()
    assert price.forward_rows.tolist() == plan.forward_rank_load.tolist()
    assert price.backward_rows.tolist() == plan.backward_rank_load.tolist()
    holds = plan.holds.numpy()
    many = holds.sum(1) > 1
    rows = rank_pair_rows(counts, plan.forward_load.numpy(), plan.owner.numpy(), many)
    assert (rows == forward).all()


@pytest.mark.parametrize("ranks", [1, 2])
def test_replay_at_p1_and_p2_reproduces_plan_call(ranks: int) -> None:
    counts = synthetic_counts(3, ranks, 4, 32, 2, zipf=1.5, seed=ranks)
    arms = [parse_arm(a) for a in ("stock", "keep0.5", "keep0.5+rep1+recompute")]
    results = replay_pass(counts, arms, SMALL, LINEAR, Network())
    for arm in arms:
        config = arm.config()
        for layer, price in zip(counts, results[arm.name].calls):
            plan = plan_call(layer, 0, config, SMALL)
            assert price.kept == int(plan.quota.sum())
            assert price.forward_rows.tolist() == plan.forward_rank_load.tolist()
            assert price.backward_rows.tolist() == plan.backward_rank_load.tolist()
            if ranks == 1:  # nothing crosses the network; only the GEMMs take time
                assert price.network_bytes.tolist() == [0]
                gemm = price.phase_ms["gemm_fwd"] + price.phase_ms["gemm_bwd"]
                assert price.total_ms == pytest.approx(gemm)


# --- resharding and synthetic counts -----------------------------------------------------------
def test_reshard_rules() -> None:
    n = np.array([[5, 0, 3, 1], [2, 2, 2, 2]])
    assert (reshard(n, 2) == n).all()
    assert (reshard(n, 4) == np.repeat(n, 2, axis=0)).all()  # tokens as recorded
    split = reshard(n, 4, tokens="split")
    assert split.tolist() == [[2, 0, 1, 0], [3, 0, 2, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert (split.reshape(2, 2, 4).sum(1) == n).all()
    merged = reshard(np.repeat(n, 2, axis=0), 2)
    assert (merged == n).all()
    assert reshard(n, 1, tokens="split").tolist() == [[7, 2, 5, 3]]
    scaled = reshard(n, 2, pairs_per_rank=18)
    assert scaled.sum(1).tolist() == [18, 18] and scaled[1].tolist() == [5, 5, 4, 4]
    with pytest.raises(ValueError, match="multiple or a divisor of 2, not 3"):
        reshard(np.zeros((2, 12)), 3)
    with pytest.raises(ValueError, match="cannot be owned evenly by 8"):
        reshard(n, 8)


def test_scale_rows_keeps_zero_rows_and_sums() -> None:
    rows = np.array([[0, 0, 0], [1, 1, 1], [10, 0, 1]])
    out = scale_rows(rows, 7)
    assert out[0].tolist() == [0, 0, 0] and out[1].tolist() == [3, 2, 2]
    assert out[2].sum() == 7 and out[2].tolist() == [6, 0, 1]


def test_synthetic_counts_shape_and_caps() -> None:
    c = synthetic_counts(2, 4, 16, 100, 4, zipf=3.0, seed=1)
    assert c.shape == (2, 4, 16) and (c.sum(2) == 400).all()
    assert c.max() <= 100 * 1.3  # no expert's share above 1 / topk (up to the draw)
    assert (synthetic_counts(2, 4, 16, 100, 4, zipf=3.0, seed=1) == c).all()
    with pytest.raises(ValueError, match="topk <= experts"):
        synthetic_counts(1, 2, 4, 10, 5)


# --- arms on a skewed pass ---------------------------------------------------------------------
def test_skewed_pass_replicas_lower_the_peak_and_budgets_bind() -> None:
    counts = synthetic_counts(4, 8, 64, 4096, 8, zipf=1.2, seed=3)
    cost = CostModel(hidden_size=2048, ffn_hidden_size=768)
    names = ["stock", "rep2", "keep0.5", "keep0.5+rep2", "keep0.5+rep2+mem0.5x", "keep1+xch0.4x"]
    out = replay_pass(counts, [parse_arm(a) for a in names], cost, DEFAULT_GEMM_TABLE, Network())
    s = {name: out[name].summary() for name in names}
    assert s["rep2"]["forward_peak_rows"] < 0.8 * s["stock"]["forward_peak_rows"]
    assert s["rep2"]["moe_ms"] < s["stock"]["moe_ms"] and s["rep2"]["replicas"] > 0
    assert s["keep0.5"]["phase_ms"]["gemm_bwd"] < s["stock"]["phase_ms"]["gemm_bwd"]
    assert s["keep0.5"]["kept_fraction"] == pytest.approx(0.5, abs=0.01)
    assert s["keep0.5+rep2+mem0.5x"]["binding_calls"] == 4
    assert s["keep0.5+rep2+mem0.5x"]["kept_fraction"] < s["keep0.5+rep2"]["kept_fraction"]
    assert s["keep1+xch0.4x"]["binding_calls"] == 4
    assert s["keep1+xch0.4x"]["phase_ms"]["grad"] < s["stock"]["phase_ms"]["grad"]


def test_parse_arm() -> None:
    arm = parse_arm("keep0.25+rep2+mem0.5x+xch3e8+recompute")
    assert arm == Arm(
        name="keep0.25+rep2+mem0.5x+xch3e8+recompute",
        keep_ratio=0.25,
        max_replicas_per_rank=2,
        activation_mode="recompute",
        memory_budget=(0.5, True),
        exchange_budget=(3e8, False),
    )
    assert arm.config(1000, 10).memory_budget_bytes == 500
    assert arm.config(1000, 10).exchange_budget_bytes == 300000000
    assert parse_arm("stock").stock
    with pytest.raises(ValueError, match="token 'rpl2'"):
        parse_arm("keep0.5+rpl2")
    with pytest.raises(ValueError, match="keep_ratio"):
        parse_arm("keep1.5")
    assert parse_arm("keep0.5+lean").activation_mode == "lean"
    with pytest.raises(ValueError, match="runs without replicas"):
        parse_arm("keep0.5+rep2+lean")
    moe = parse_arm("stock+moe")
    assert moe.stock and moe.moe_recompute and not parse_arm("stock").moe_recompute
    assert parse_arm("keep0.5+rep2+moe") == Arm(
        name="keep0.5+rep2+moe", keep_ratio=0.5, max_replicas_per_rank=2, moe_recompute=True
    )
    with pytest.raises(ValueError, match="stock takes only '\\+moe'"):
        parse_arm("stock+rep2")


@pytest.mark.parametrize("name", ["stock", "keep0.5+rep1"])
def test_megatron_moe_recompute_holds_the_input_and_runs_the_forward_again(name: str) -> None:
    """``+moe``: the layer input alone is held from forward to backward, what the call holds
    otherwise lives during its own backward, every forward phase runs again and the forward's
    exchanges are sent again; everything else as without it."""
    topk, cost = 2, CostModel(hidden_size=64, ffn_hidden_size=32)
    counts = synthetic_counts(3, 4, 8, 128, topk, zipf=1.2, seed=5)
    arms = [parse_arm(name), parse_arm("stock+moe" if name == "stock" else name + "+moe")]
    out = replay_pass(
        counts, arms, cost, LINEAR, Network(), layer=DEFAULT_LAYER_COSTS, topk=topk
    )
    plain, moe = out[arms[0].name], out[arms[1].name]
    forward = ("router", "dispatch", "replica_fetch", "elementwise_fwd", "gemm_fwd", "combine",
               "host_fwd")  # fmt: skip
    inputs = counts.sum(axis=2) // topk * cost.hidden_size * cost.activation_bytes  # [L, P]
    for p_call, m_call, held_input in zip(plain.calls, moe.calls, inputs):
        again = sum(p_call.phase_ms[k] for k in forward)
        assert m_call.phase_ms["moe_recompute"] == pytest.approx(again) and again > 0
        assert m_call.total_ms == pytest.approx(p_call.total_ms + again)
        assert m_call.held_bytes.tolist() == held_input.tolist()
        assert (m_call.transient_bytes == p_call.held_bytes + p_call.transient_bytes).all()
        sent_again = sum(
            m.sum(axis=1) - np.diag(m) for k, m in p_call.exchange_bytes.items()
            if k in ("dispatch", "replica_fetch", "combine")
        )  # fmt: skip
        assert (m_call.network_bytes == p_call.network_bytes + sent_again).all()
    summary = moe.summary()
    held = inputs.sum(axis=0) + np.max([c.transient_bytes for c in moe.calls], axis=0)
    assert summary["memory_bytes"] == int(held.max())
    assert summary["memory_bytes"] < plain.summary()["memory_bytes"]
    with pytest.raises(ValueError, match="give topk"):
        replay_pass(counts, arms, cost, LINEAR, Network())


def test_console_entry_on_a_trace(tmp_path, capsys) -> None:
    from megatron_lrmoe.observe.trace import write_trace

    counts = synthetic_counts(2, 2, 8, 64, 2, zipf=1.0, seed=0)
    write_trace(tmp_path / "t", counts, layers=[1, 2], calls=[0, 0], meta={"topk": 2})
    out = tmp_path / "r.json"
    args = ["--trace", str(tmp_path / "t"), "--ep", "2", "4", "--arms", "stock", "keep0.5+rep1"]
    args += ["--hidden-size", "64", "--ffn-hidden-size", "32", "--out", str(out)]
    assert replay_main(args) == 0
    payload = json.loads(out.read_text())
    assert set(payload["results"]) == {"2", "4"}
    assert payload["results"]["4"]["stock"]["moe_ms_vs_stock"] == 1.0
    assert payload["settings"]["cost"]["hidden_size"] == 64
    assert "EP 4: 2 layers per pass" in capsys.readouterr().out


def _write_stages(directory: Path, groups: int = 1, short_stage: bool = False) -> list[np.ndarray]:
    """A run of two pipeline stages (layers 1-2 and 3-4), ``groups`` EP groups of 2 ranks per
    stage, 2 calls (stage 1 of group 0 only 1 with ``short_stage``); each rank's ``[4, 2, 8]``
    counts, in rank order."""
    from megatron_lrmoe.observe.trace import write_trace

    written = []
    for stage in (0, 1):
        for g in range(groups):
            rank = 2 * (stage * groups + g)
            calls = [0] if short_stage and stage == 1 and g == 0 else [0, 1]
            counts = synthetic_counts(4, 2, 8, 64, 2, zipf=1.0, seed=rank)[: 2 * len(calls)]
            meta = dict(topk=2, pipeline_rank=stage, pipeline_size=2, ep_ranks=[rank, rank + 1])
            layers = [2 * stage + 1, 2 * stage + 2]
            write_trace(
                directory, counts, layers=layers * len(calls), rank=rank, meta=meta,
                calls=[k for k in calls for _ in layers],
            )  # fmt: skip
            written.append(counts)
    return written


def _same_calls(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("forward_rows", "backward_rows", "held_bytes", "network_bytes"):
            assert np.array_equal(getattr(x, name), getattr(y, name)), name
        for phase in x.exchange_bytes:
            assert np.array_equal(x.exchange_bytes[phase], y.exchange_bytes[phase]), phase
        assert x.phase_ms == y.phase_ms
        assert (x.pairs, x.kept, x.replicas, x.binding) == (y.pairs, y.kept, y.replicas, y.binding)


def test_merged_stages_replay_as_the_stages_concatenated(tmp_path) -> None:
    """Each layer call of the merged pass is priced as in its own stage's replay (arms whose
    budgets are absolute: relative ones scale with the pass's calls, now every stage's)."""
    from megatron_lrmoe.observe.trace import read_trace

    _write_stages(tmp_path)
    arms = [parse_arm(a) for a in ("stock", "rep1", "keep0.5+rep1", "keep0.5+recompute")]
    merged = list(read_trace(tmp_path).passes())
    stages = [list(read_trace(tmp_path, rank=r).passes()) for r in (0, 2)]
    assert len(merged) == 2
    for k, (_, layers, counts) in enumerate(merged):
        assert layers.tolist() == [1, 2, 3, 4]
        virtual = np.stack([reshard(c, 4, "split") for c in counts])
        got = replay_pass(virtual, arms, SMALL, LINEAR, Network())
        parts = [
            replay_pass(np.stack([reshard(c, 4, "split") for c in s[k][2]]), arms, SMALL,
                        LINEAR, Network())
            for s in stages
        ]  # fmt: skip
        for arm in got:
            _same_calls(got[arm].calls, parts[0][arm].calls + parts[1][arm].calls)
            moe = sum(p[arm].summary()["moe_ms"] for p in parts)
            assert got[arm].summary()["moe_ms"] == pytest.approx(moe, rel=1e-12)


def test_console_entry_on_a_pipeline_trace(tmp_path, capsys) -> None:
    written = _write_stages(tmp_path / "t", groups=2)
    out = tmp_path / "r.json"
    args = ["--trace", str(tmp_path / "t"), "--ep", "4", "--arms", "stock", "--out", str(out)]
    args += ["--hidden-size", "64", "--ffn-hidden-size", "32"]
    assert replay_main(args + ["--ep-group", "all"]) == 0
    payload = json.loads(out.read_text())
    trace = payload["settings"]["trace"]
    assert trace["ep_size"] == 4 and trace["ep_group"] == "all" and trace["layers"] == [1, 2, 3, 4]
    assert [s["ranks"] for s in trace["stages"]] == [[0, 2], [4, 6]]
    assert payload["settings"]["layers"] == 4 and payload["settings"]["passes"] == 1
    assert "EP 4: 4 layers per pass" in capsys.readouterr().out
    assert replay_main(args + ["--ep-group", "1", "--passes", "2"]) == 0
    trace = json.loads(out.read_text())["settings"]["trace"]
    assert [s["ranks"] for s in trace["stages"]] == [[2], [6]] and trace["ep_size"] == 2
    assert replay_main(args + ["--rank", "4"]) == 0
    assert json.loads(out.read_text())["settings"]["layers"] == 2
    assert len(written) == 4
    for bad, message in (
        (["--ep-group", "x"], "--ep-group ('x') must be an index or 'all'"),
        (["--ep-group", "2"], "ep_group (2) out of range"),
    ):
        with pytest.raises(SystemExit):
            replay_main(args + bad)
        assert message in capsys.readouterr().err
    _write_stages(tmp_path / "short", short_stage=True)
    short = ["--trace", str(tmp_path / "short"), "--ep", "2", "--arms", "stock", "--out", ""]
    with pytest.raises(SystemExit):
        replay_main(short)
    assert "lacks call indices [1]" in capsys.readouterr().err
    assert replay_main(short + ["--common-calls"]) == 0
    assert "EP 2: 4 layers per pass" in capsys.readouterr().out


# --- P = 2 against real layers on the gloo harness ---------------------------------------------
CASES = [
    dict(keep_ratio=0.5),
    dict(keep_ratio=0.5, max_replicas_per_rank=1, activation_mode="recompute"),
    dict(keep_ratio=1.0, max_replicas_per_rank=1),
    dict(keep_ratio=0.5, activation_mode="lean"),
]


def _layer_calls(rank: int, world: int, directory: str) -> list[list[dict]]:
    """Each case's LRMoE layer, recorded, called twice; the statistics of every call."""
    from megatron_lrmoe import get_lrmoe_moe_spec
    from megatron_lrmoe.testing import (
        init_megatron_parallel,
        moe_transformer_config,
        skewed_routing_inputs,
    )
    from megatron_lrmoe.training.trace import install_trace_recorder

    pg = init_megatron_parallel(ep=world)
    cfg = moe_transformer_config(expert_model_parallel_size=world, moe_aux_loss_coeff=0.0)
    out = []
    for i, case in enumerate(CASES):
        spec = get_lrmoe_moe_spec(LRMoEConfig(**case))
        layer = spec(config=cfg, pg_collection=pg, layer_number=1)
        recorder = install_trace_recorder(layer, f"{directory}/case{i}")
        assert (recorder is None) == (rank != 0)
        calls = []
        for seed in (7, 8):
            x = skewed_routing_inputs(48, cfg.hidden_size, seed=seed, rank=rank)
            x.requires_grad_(True)
            y, _ = layer(x)
            y.sum().backward()
            s = layer.last_call_stats
            calls.append(
                dict(
                    counts=s.global_counts.tolist(),
                    quota=s.quota_per_expert,
                    forward_rows=s.forward_rows,
                    kept_rows=s.kept_rows,
                    **{f"{k}_bytes": v.bytes for k, v in s.exchanges.items()},
                )
            )
        if recorder is not None:
            recorder.close()
        out.append(calls)
    return out


@pytest.fixture(scope="module")
def layer_runs(tmp_path_factory) -> tuple[str, list]:
    from megatron_lrmoe.testing import run_distributed

    directory = str(tmp_path_factory.mktemp("traces"))
    return directory, run_distributed(_layer_calls, 2, directory, timeout=300)


def test_replay_at_p2_matches_the_layers_statistics(layer_runs) -> None:
    from megatron_lrmoe.observe.trace import read_trace

    directory, per_rank = layer_runs
    for i, case in enumerate(CASES):
        trace = read_trace(f"{directory}/case{i}")
        assert trace.ep_size == 2 and trace.meta["activation_bytes"] == 4
        cost = CostModel(
            hidden_size=trace.meta["hidden_size"],
            ffn_hidden_size=trace.meta["ffn_hidden_size"],
            gated=trace.meta["gated"],
            activation_bytes=trace.meta["activation_bytes"],
            param_bytes=trace.meta["param_bytes"],
        )
        arm = Arm(name="case", **case)
        passes = list(trace.passes())
        assert [k for k, _, _ in passes] == [0, 1]
        replicas = 0
        for k, layers, counts in passes:
            calls = [per_rank[r][i][k] for r in range(2)]
            assert counts[0].tolist() == calls[0]["counts"] == calls[1]["counts"]
            (price,) = replay_pass(counts, [arm], cost, DEFAULT_GEMM_TABLE, Network())["case"].calls
            replicas += price.replicas
            assert price.kept == sum(calls[0]["quota"]), (case, k)
            for r in range(2):
                got = calls[r]
                assert price.forward_rows[r] == got["forward_rows"], (case, k, r)
                assert price.backward_rows[r] == got["kept_rows"], (case, k, r)
                # lean's two gradient exchanges (every pair's row, the kept rows) price as one
                grad = got["grad_bytes"] + got.get("lean_grad_bytes", 0)
                assert price.exchange_bytes["grad"][r].sum() == grad, (case, k, r)
                assert price.exchange_bytes["dgrad"][r].sum() == got["dgrad_bytes"], (case, k, r)
                replica = price.exchange_bytes["replica_grads"][r].sum()
                assert replica == got.get("replica_grads_bytes", 0), (case, k, r)
        assert (replicas > 0) == ("max_replicas_per_rank" in case), case


def test_console_entry_synthetic_writes_a_trace(tmp_path, capsys) -> None:
    from megatron_lrmoe.observe.trace import read_trace

    args = ["--synthetic", "--layers", "3", "--experts", "8", "--tokens-per-rank", "32"]
    args += ["--topk", "2", "--recorded-ep", "2", "--ep", "2", "--arms", "stock", "rep1"]
    args += ["--passes", "2", "--write-trace", str(tmp_path / "t"), "--out", ""]
    assert replay_main(args) == 0
    trace = read_trace(tmp_path / "t")
    assert trace.counts.shape == (6, 2, 8) and trace.meta["topk"] == 2
    assert [layers.tolist() for _, layers, _ in trace.passes()] == [[1, 2, 3], [1, 2, 3]]
    assert "rep1" in capsys.readouterr().out


# --- a pipeline of two stages, recorded on the gloo harness, read as one model ------------------
def _pipeline_run(rank: int, world: int, directory: str) -> list[dict]:
    """PP 2 x EP 2 on 4 ranks: stage 0 (ranks 0, 1) runs layer 1, sends its output to stage 1
    (ranks 2, 3: layer 2) and receives the input gradient back; each stage records its layer
    (pipeline rank from Megatron's parallel state). Stage 0's ranks then run both layers in one
    stage (same weights: built again from the same seeds) and record that too: the unsplit
    model on the same tokens. Returns the counts each layer all-gathered, per call."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_lrmoe import get_lrmoe_moe_spec
    from megatron_lrmoe.testing import moe_transformer_config, skewed_routing_inputs
    from megatron_lrmoe.training.trace import install_trace_recorder

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    assert stage == rank // 2
    pg = get_default_pg_collection()
    cfg = moe_transformer_config(
        num_layers=2, expert_model_parallel_size=2, moe_aux_loss_coeff=0.0
    )

    def build() -> list:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        spec = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=0.5))
        return [spec(config=cfg, pg_collection=pg, layer_number=n) for n in (1, 2)]

    def inputs(seed: int) -> "torch.Tensor":
        return skewed_routing_inputs(48, cfg.hidden_size, seed=seed, rank=rank % 2)

    seen: list[dict] = []
    mine = build()[stage]  # every rank builds both layers: the same RNG draws everywhere
    recorder = install_trace_recorder(mine, f"{directory}/pipeline")
    assert (recorder is None) == (rank % 2 == 1)
    for seed in (7, 8):
        if stage == 0:
            x = inputs(seed).requires_grad_(True)
            y, _ = mine(x)
            torch.distributed.send(y.detach().contiguous(), rank + 2)
            grad = torch.empty_like(y)
            torch.distributed.recv(grad, rank + 2)
            y.backward(grad)
        else:
            x = torch.empty(48, 1, cfg.hidden_size)
            torch.distributed.recv(x, rank - 2)
            x.requires_grad_(True)
            y, _ = mine(x)
            y.sum().backward()
            torch.distributed.send(x.grad.contiguous(), rank - 2)
        seen.append(dict(layer=stage + 1, counts=mine.last_call_stats.global_counts.tolist()))
    if recorder is not None:
        recorder.close()
    if stage == 0:
        flat = build()
        recorder = install_trace_recorder(
            flat, f"{directory}/flat", pipeline_rank=0, pipeline_size=1
        )
        for seed in (7, 8):
            h, _ = flat[0](inputs(seed).requires_grad_(True))
            y, _ = flat[1](h)
            y.sum().backward()
        if recorder is not None:
            recorder.close()
    return seen


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> tuple[Path, list]:
    from megatron_lrmoe.testing import run_distributed

    directory = tmp_path_factory.mktemp("pipeline")
    return directory, run_distributed(_pipeline_run, 4, str(directory), timeout=300)


def test_two_stage_trace_reads_as_the_unsplit_model(pipeline_run) -> None:
    from megatron_lrmoe.observe.trace import read_trace

    directory, per_rank = pipeline_run
    merged = read_trace(directory / "pipeline")
    flat = read_trace(directory / "flat")
    assert sorted(p.name for p in (directory / "pipeline").iterdir()) == [
        "rank00000",
        "rank00002",
    ]
    stage0, stage1 = (read_trace(directory / "pipeline", rank=r) for r in (0, 2))
    assert (stage0.meta["pipeline_rank"], stage1.meta["pipeline_rank"]) == (0, 1)
    assert stage0.meta["pipeline_size"] == 2 and stage1.meta["ep_ranks"] == [2, 3]
    # Megatron's [tensor, context, data]-parallel ranks: both stages' writers see data rank 0.
    assert stage0.meta["data_coords"] == stage1.meta["data_coords"] == [0, 0, 0]
    assert stage0.layers == [1] and stage1.layers == [2]
    assert merged.meta["stages"] == [
        {"pipeline_rank": 0, "ranks": [0], "layers": [1]},
        {"pipeline_rank": 1, "ranks": [2], "layers": [2]},
    ]
    assert merged.layers == flat.layers == [1, 2] and merged.ep_size == 2
    assert merged.layer.tolist() == flat.layer.tolist() == [1, 2, 1, 2]
    assert merged.call.tolist() == flat.call.tolist() == [0, 0, 1, 1]
    assert np.array_equal(merged.counts, flat.counts)
    # What each stage's layer all-gathered, on both ranks of its EP group.
    for rank, calls in enumerate(per_rank):
        for k, call in enumerate(calls):
            row = 2 * k + call["layer"] - 1
            assert merged.counts[row].tolist() == call["counts"], (rank, k)
    arms = [parse_arm(a) for a in ("stock", "keep0.5+rep1", "keep0.5+rep1+mem0.8x")]
    cost = CostModel(hidden_size=32, ffn_hidden_size=48, activation_bytes=4, param_bytes=4)
    for (_, _, a), (_, _, b) in zip(merged.passes(), flat.passes()):
        got = replay_pass(a, arms, cost, DEFAULT_GEMM_TABLE, Network())
        want = replay_pass(b, arms, cost, DEFAULT_GEMM_TABLE, Network())
        for name in want:
            assert got[name].summary() | {"plan_ms": 0} == want[name].summary() | {"plan_ms": 0}
