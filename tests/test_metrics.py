"""``megatron_lrmoe.observe.metrics``: values written for known calls, Megatron's tracker zeroing.

The first tests feed hand-made ``CallStats`` (no processes): every reported number is checked
against a value computed by hand. A two-rank test trains a tiny LRMoE GPT (EP=2)
while Megatron's MoE metrics tracker is reported (and so cleared) after every step, as
``megatron.training`` does, and checks the LRMoE report at the end against the ``CallStats``
the layers produced, gathered from both ranks. The kept ratio is checked against independent
counts: the kept masks recorded by real layers (``debug_record_selection``), not the quotas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_lrmoe.observe.metrics import LRMoEMetrics, format_log_string, stock_backward_bytes
from megatron_lrmoe.observe.stats import CallStats, ExchangeStats, SpanTimer
from megatron_lrmoe.testing import run_distributed

TIMEOUT_S = 180.0


class FakeWriter:
    """TensorBoard ``SummaryWriter`` stand-in."""

    def __init__(self) -> None:
        self.scalars: dict[str, tuple[float, int]] = {}

    def add_scalar(self, name: str, value: float, iteration: int) -> None:
        self.scalars[name] = (value, iteration)


class FakeWandb:
    """W&B run stand-in."""

    def __init__(self) -> None:
        self.logged: dict[str, tuple[float, int]] = {}

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.logged[name] = (value, step)


class FixedTimer:
    """A ``SpanTimer`` stand-in with known spans."""

    def __init__(self, spans: dict[str, float]) -> None:
        self.spans = spans

    def milliseconds(self) -> dict[str, float]:
        return dict(self.spans)


def _exchange(bytes_: int, stock_bytes: int) -> ExchangeStats:
    return ExchangeStats(
        rows=0, bytes=bytes_, remote_rows=0, remote_bytes=0, stock_rows=0, stock_bytes=stock_bytes
    )


def _trimmed_call() -> CallStats:
    """Layer 1 at keep 0.5: 50 of 100 pairs planned, but this rank's backward kept 20 of its
    50 (the metric must report what was kept, not the plan), a quarter of the score mass
    dropped."""
    stats = CallStats(
        layer_number=1,
        call_index=0,
        total_pairs=100,
        pairs_sent=50,
        quota_per_expert=[10, 20, 20],
        tokens_per_expert=[20, 40, 40],
    )
    stats.kept_pairs_sent = 20
    stats.score_total = torch.tensor(4.0)
    stats.score_kept = torch.tensor(3.0)
    stats.score_added_variance = torch.tensor(0.5)
    stats.exchanges = {"grad": _exchange(1000, 2000), "dgrad": _exchange(500, 1500)}
    stats.timer = FixedTimer({"scoring": 1.0, "selection": 2.0, "packing": 0.5})
    stats.backward_done = True
    return stats


def _exact_call() -> CallStats:
    """Layer 2 at keep 1.0: every pair kept, no scores, stock bytes."""
    stats = CallStats(
        layer_number=2,
        call_index=0,
        total_pairs=60,
        pairs_sent=30,
        quota_per_expert=[30, 30],
        tokens_per_expert=[30, 30],
    )
    stats.kept_pairs_sent = 30
    stats.exchanges = {"grad": _exchange(800, 800)}
    stats.backward_done = True
    return stats


def test_report_known_calls() -> None:
    """Averages, per-layer values, both writers and the log string for two known calls."""
    metrics = LRMoEMetrics(num_layers=2, per_layer=True)
    metrics.record(1, _trimmed_call())
    metrics.record(2, _exact_call())
    unfinished = _trimmed_call()
    unfinished.backward_done = False  # e.g. a forward whose backward never ran: not counted
    metrics.record(1, unfinished)
    writer, wandb = FakeWriter(), FakeWandb()

    scalars = metrics.report(2, writer=writer, wandb_writer=wandb)  # 2 iterations since start

    expected = {
        "lrmoe/kept_ratio": (20 + 30) / (50 + 30),
        "lrmoe/dropped_score_fraction": 1.0 / 4.0,
        "lrmoe/backward_bytes": (1500 + 800) / 2,
        "lrmoe/backward_bytes_saved": ((3500 + 800) - (1500 + 800)) / 2,
        "lrmoe/overhead_ms": 3.5 / 2,
        "lrmoe/added_variance": 0.5 / 4.0,
        "lrmoe/kept_ratio_layer_0": 20 / 50,
        "lrmoe/dropped_score_fraction_layer_0": 0.25,
        "lrmoe/backward_bytes_layer_0": 1500 / 2,
        "lrmoe/backward_bytes_saved_layer_0": 2000 / 2,
        "lrmoe/overhead_ms_layer_0": 3.5 / 2,
        "lrmoe/added_variance_layer_0": 0.5 / 4.0,
        "lrmoe/kept_ratio_layer_1": 1.0,
        "lrmoe/dropped_score_fraction_layer_1": 0.0,
        "lrmoe/backward_bytes_layer_1": 800 / 2,
        "lrmoe/backward_bytes_saved_layer_1": 0.0,
        "lrmoe/overhead_ms_layer_1": 0.0,
        "lrmoe/added_variance_layer_1": 0.0,
    }
    assert scalars.keys() == expected.keys()
    for name, value in expected.items():
        assert scalars[name] == pytest.approx(value, rel=1e-12), name
        assert writer.scalars[name] == (pytest.approx(value, rel=1e-12), 2), name
        assert wandb.logged[name] == (pytest.approx(value, rel=1e-12), 2), name
    assert metrics.last_log_string == format_log_string(scalars)
    assert " lrmoe kept: 0.625 |" in metrics.last_log_string
    assert " lrmoe dropped score: 0.250 |" in metrics.last_log_string
    assert " lrmoe bwd saved: 1000 B |" in metrics.last_log_string
    assert " lrmoe overhead: 1.8 ms |" in metrics.last_log_string
    assert " lrmoe added variance: 0.125 |" in metrics.last_log_string

    # Everything was consumed: the next interval starts empty and writes nothing.
    writer2 = FakeWriter()
    assert metrics.report(3, writer=writer2) == {}
    assert writer2.scalars == {} and metrics.last_log_string == ""


def test_per_iteration_uses_iterations_since_last_report() -> None:
    metrics = LRMoEMetrics(num_layers=1, start_iteration=10)
    for _ in range(3):
        metrics.record(1, _exact_call())
    scalars = metrics.report(13)  # three iterations, one call each
    assert scalars["lrmoe/backward_bytes"] == pytest.approx(800.0)
    metrics.record(1, _exact_call())
    metrics.record(1, _exact_call())
    assert metrics.report(14)["lrmoe/backward_bytes"] == pytest.approx(1600.0)


def test_layer_number_outside_num_layers_is_an_error() -> None:
    metrics = LRMoEMetrics(num_layers=1)
    metrics.record(2, _exact_call())
    with pytest.raises(ValueError, match="num_layers"):
        metrics.report(1)


def test_stock_backward_bytes_formula() -> None:
    """Combine backward (sent rows) + dispatch backward (received rows) + fp32 probs."""
    assert stock_backward_bytes([3, 5], [4, 6], hidden=8, element_size=2) == (8 + 10) * 8 * 2 + 40


# ------------------------------------------------------------------------------------------------
# Two ranks: real layers, Megatron's tracker reported every step.
# ------------------------------------------------------------------------------------------------
def _expected_from_stats(per_rank: list[list[tuple[int, dict]]], iterations: int) -> dict:
    """The report computed by hand from every rank's call summaries."""
    calls = [c for rank in per_rank for _, c in rank]
    ranks = len(per_rank)
    return {
        "lrmoe/kept_ratio": sum(c["kept"] for c in calls) / sum(c["pairs"] for c in calls),
        "lrmoe/dropped_score_fraction": sum(c["score_total"] - c["score_kept"] for c in calls)
        / sum(c["score_total"] for c in calls),
        "lrmoe/backward_bytes": sum(c["bytes"] for c in calls) / (iterations * ranks),
        "lrmoe/backward_bytes_saved": sum(c["stock_bytes"] - c["bytes"] for c in calls)
        / (iterations * ranks),
        "lrmoe/overhead_ms": sum(c["ms"] for c in calls) / (iterations * ranks),
        "lrmoe/added_variance": sum(c["score_added"] for c in calls)
        / sum(c["score_total"] for c in calls),
    }


def _metrics_under_tracker_zeroing(rank: int, world_size: int) -> dict[str, Any]:
    """Train 3 steps; Megatron's tracker is reported (cleared) every step by the trainer."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_lrmoe import LRMoEConfig, LRMoELayer
    from megatron_lrmoe.demo.trainer import ModelShape, Trainer, TrainSettings, load_stdlib_corpus
    from megatron_lrmoe.testing import init_megatron_parallel

    init_megatron_parallel(ep=world_size)
    corpus = load_stdlib_corpus(1 << 20, 64 << 10)
    shape = ModelShape(hidden_size=32, kv_channels=8, moe_ffn_hidden_size=32, seq_length=32)
    settings = TrainSettings(steps=3, micro_batch_size=4, num_microbatches=2, eval_interval=100)
    # The kept masks give an independent count of what each call's backward kept.
    lrmoe = LRMoEConfig(keep_ratio=0.5, debug_record_selection=True)
    trainer = Trainer(shape, settings, corpus, lrmoe=lrmoe)
    seen: list[tuple[int, CallStats]] = []

    def keep(layer: Any, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled():
            seen.append((layer.layer_number, layer.last_call_stats))

    for module in trainer.model.modules():
        if isinstance(module, LRMoELayer):
            module.register_forward_hook(keep)
    tracker = get_moe_metrics_tracker()
    zeroed = []
    for _ in range(settings.steps):
        # A value recorded in Megatron's tracker under our own name ...
        tracker.record("lrmoe_kept_ratio", torch.tensor(0.5), layer_number=1, num_layers=2)
        trainer.train_step()  # ... is cleared by the tracker report the trainer makes each step.
        zeroed.append(bool((tracker.metrics["lrmoe_kept_ratio"].values == 0).all()))
    writer = FakeWriter()
    scalars = trainer.metrics.report(settings.steps, writer=writer)
    trainer.close()
    summaries = [
        (
            number,
            {
                "pairs": int(s.kept_mask.numel()),
                "kept": int(s.kept_mask.sum()),
                "score_total": float(s.score_total),
                "score_kept": float(s.score_kept),
                "score_added": float(s.score_added_variance),
                "bytes": s.backward_bytes,
                "stock_bytes": s.stock_backward_bytes,
                "ms": sum(s.timings_ms.values()),
            },
        )
        for number, s in seen
    ]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, summaries)
    return {
        "scalars": scalars,
        "writer": writer.scalars,
        "expected": _expected_from_stats(gathered, settings.steps),
        "calls": len(seen),
        "tracker_zeroed": zeroed,
    }


def test_metrics_survive_megatron_tracker_zeroing() -> None:
    results = run_distributed(_metrics_under_tracker_zeroing, 2, timeout=TIMEOUT_S)
    for rank, res in enumerate(results):
        # 3 steps x 2 micro-batches x 2 layers, every one with a finished backward.
        assert res["calls"] == 12, rank
        assert all(res["tracker_zeroed"]), "Megatron's tracker report no longer clears entries"
        assert res["scalars"].keys() == res["expected"].keys()
        for name, value in res["expected"].items():
            assert res["scalars"][name] == pytest.approx(value, rel=1e-9), (rank, name)
            assert res["writer"][name] == (pytest.approx(value, rel=1e-9), 3), (rank, name)
        assert 0.45 < res["scalars"]["lrmoe/kept_ratio"] < 0.55
        assert 0.0 < res["scalars"]["lrmoe/dropped_score_fraction"] < 1.0
        assert res["scalars"]["lrmoe/backward_bytes_saved"] > 0
    # Every rank reports the same (reduced) numbers.
    assert results[0]["scalars"] == results[1]["scalars"]


def test_finished_calls_are_folded_so_memory_stays_bounded() -> None:
    """Only calls still waiting for their backward stay referenced between reports."""
    metrics = LRMoEMetrics(num_layers=1)
    for _ in range(500):
        metrics.record(1, _exact_call())
        assert len(metrics._pending) <= 1
    waiting = _trimmed_call()
    waiting.backward_done = False
    metrics.record(1, waiting)
    metrics.record(1, _exact_call())
    assert waiting in [stats for _, stats in metrics._pending]  # kept until its backward runs
    assert metrics.report(1)["lrmoe/backward_bytes"] == pytest.approx(501 * 800.0)


def test_kept_ratio_counts_kept_pairs_not_the_plan() -> None:
    """``CallStats.kept_ratio`` is this rank's kept / sent after backward, None before it; the
    plan stays available as ``planned_keep_ratio``."""
    stats = _trimmed_call()
    assert stats.kept_ratio == pytest.approx(20 / 50)
    assert stats.planned_keep_ratio == pytest.approx(50 / 100)
    stats.kept_pairs_sent = None  # backward has not run
    assert stats.kept_ratio is None


def test_kept_ratio_sums_ranks_apart() -> None:
    """Two ranks of one call: the report is (sum kept) / (sum sent), not a mean of ratios."""
    metrics = LRMoEMetrics(num_layers=1)
    for sent, kept in ((10, 9), (90, 36)):
        stats = _trimmed_call()
        stats.pairs_sent, stats.kept_pairs_sent = sent, kept
        metrics.record(1, stats)
    assert metrics.report(1)["lrmoe/kept_ratio"] == pytest.approx(45 / 100)


def test_a_finished_call_without_a_kept_count_is_an_error() -> None:
    """Every backward records what it kept; stats without the count are a bug, not a guess."""
    stats = _trimmed_call()
    stats.kept_pairs_sent = None
    metrics = LRMoEMetrics(num_layers=1)
    metrics.record(1, stats)
    with pytest.raises(ValueError, match="kept_pairs_sent"):
        metrics.report(1)


def test_controller_calls_report_trimming_and_planner_time() -> None:
    """Calls planned by the controller add two metrics; plain calls do not."""
    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.control.controller import plan_call
    from megatron_lrmoe.control.costs import CostModel

    counts = torch.tensor([[30, 10, 0, 20], [50, 10, 0, 0]])  # [P, E], 120 pairs
    cost = CostModel(
        hidden_size=64, ffn_hidden_size=32, gated=True, activation_bytes=2, param_bytes=2,
        grad_bytes=4,
    )
    lrmoe = LRMoEConfig(keep_ratio=1.0, exchange_budget_bytes=40 * 64 * 2)
    control = plan_call(counts, 0, lrmoe, cost)
    assert control.trimmed_pairs > 0  # the budget binds
    planned = _trimmed_call()
    planned.control = control
    metrics = LRMoEMetrics(num_layers=2)
    metrics.record(1, planned)
    metrics.record(2, _exact_call())
    scalars = metrics.report(1)
    assert scalars["lrmoe/budget_trimmed_fraction"] == pytest.approx(control.trimmed_pairs / 120)
    assert scalars["lrmoe/planner_ms"] == pytest.approx(1e3 * control.planner_time_s)
    assert scalars["lrmoe/replicas_per_call"] == pytest.approx(control.num_replicas)
    plain = LRMoEMetrics(num_layers=2)
    plain.record(2, _exact_call())
    assert "lrmoe/planner_ms" not in plain.report(1)


# ------------------------------------------------------------------------------------------------
# Real layers: the reported kept ratio against the kept masks, and under MoE recompute.
# ------------------------------------------------------------------------------------------------
def _kept_ratio_of_real_calls(rank: int, world_size: int, recompute: bool) -> dict[str, Any]:
    """Two forward/backward calls of one LRMoE layer; the report against the recorded masks."""
    import selection_reference as ref

    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world_size)
    overrides = dict(recompute_granularity="selective", recompute_modules=["moe"])
    layer = ref.build_layer(
        pg,
        world_size,
        dict(keep_ratio=0.3, selection="sample", scope="global", debug_record_selection=True),
        **(overrides if recompute else {}),
    )
    metrics = LRMoEMetrics(layer, num_layers=1)
    kept = pairs = 0
    for micro_batch in range(2):
        x, upstream = ref.layer_inputs(rank, 24, layer.config.hidden_size, seed=micro_batch)
        ref.run_once(layer, x, upstream)
        mask = layer.last_call_stats.kept_mask  # the call whose backward ran
        kept, pairs = kept + int(mask.sum()), pairs + mask.numel()
    totals = torch.tensor([kept, pairs], dtype=torch.float64)
    torch.distributed.all_reduce(totals)
    return {"scalars": metrics.report(1), "expected": float(totals[0] / totals[1])}


def test_kept_ratio_matches_kept_masks_of_real_calls() -> None:
    """EP=2, scope global (per-rank kept counts differ from any per-rank plan)."""
    for res in run_distributed(_kept_ratio_of_real_calls, 2, False, timeout=TIMEOUT_S):
        assert res["scalars"]["lrmoe/kept_ratio"] == pytest.approx(res["expected"], rel=1e-12)


def test_kept_ratio_is_reported_under_moe_recompute() -> None:
    for res in run_distributed(_kept_ratio_of_real_calls, 1, True, timeout=TIMEOUT_S):
        assert res["scalars"].get("lrmoe/kept_ratio") == pytest.approx(res["expected"])


def test_span_timer_cancel_forgets_a_span() -> None:
    """A cancelled span is not reported, and the other spans still are (host clock here; the
    CUDA events path returns the start event to the spare pool)."""
    timer = SpanTimer(torch.device("cpu"))
    timer.start("front")
    timer.cancel("front")
    timer.start("selection")
    timer.stop("selection")
    spans = timer.milliseconds()
    assert set(spans) == {"selection"} and spans["selection"] >= 0.0
    with pytest.raises(KeyError):
        timer.cancel("front")


def _mtp_layer_numbers(rank: int, world_size: int) -> dict[str, Any]:
    """A decoder layer 1 and an MTP layer 1 (Megatron numbers the MTP block's layers from 1
    again) of a 2-layer model, one call each: the numbers their statistics carry."""
    import selection_reference as ref

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config

    pg = init_megatron_parallel(ep=world_size)
    cfg = moe_transformer_config(num_layers=2, mtp_num_layers=1, moe_aux_loss_coeff=0.0)
    spec = get_lrmoe_moe_spec(LRMoEConfig(keep_ratio=0.5))
    decoder = spec(config=cfg, pg_collection=pg, layer_number=1)
    mtp = spec(config=cfg, pg_collection=pg, layer_number=1, is_mtp_layer=True)
    metrics = LRMoEMetrics([decoder, mtp], per_layer=True)
    heard: list[int] = []
    for layer in (decoder, mtp):
        layer.add_stats_listener(lambda number, _stats: heard.append(number))
        x, upstream = ref.layer_inputs(rank, 24, cfg.hidden_size, seed=0)
        ref.run_once(layer, x, upstream)
    writer = FakeWriter()
    metrics.report(1, writer=writer)
    return {
        "global": [decoder.global_layer_number, mtp.global_layer_number],
        "heard": heard,
        "plans": [decoder.last_call_stats.layer_number, mtp.last_call_stats.layer_number],
        "num_layers": metrics.num_layers,
        "per_layer": sorted(k for k in writer.scalars if k.startswith("lrmoe/kept_ratio_layer")),
    }


def test_mtp_layers_are_numbered_after_the_decoders() -> None:
    """As Megatron's router logs them: MTP depth d is layer num_layers + d, so its statistics,
    sampling stream and trace do not land on decoder layer d's."""
    (res,) = run_distributed(_mtp_layer_numbers, 1, timeout=TIMEOUT_S)
    assert res["global"] == [1, 3] and res["heard"] == [1, 3] and res["plans"] == [1, 3], res
    assert res["num_layers"] == 3, res
    # i = layer_number - 1, Megatron's moe/<name>_layer_<i> convention.
    assert res["per_layer"] == ["lrmoe/kept_ratio_layer_0", "lrmoe/kept_ratio_layer_2"], res
