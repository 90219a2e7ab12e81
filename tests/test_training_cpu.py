"""End-to-end training on 2 gloo ranks (EP=2) with megatron.core: LRMoE against stock.

One 2-rank run (module-scoped fixture) trains a tiny Qwen3-style MoE GPT through Megatron's DDP,
optimizer and schedule (``megatron_lrmoe.demo.trainer``) and returns loss curves; the tests
compare them. Runs that should agree start from the same weights and see the same data.

* LRMoE at keep 1.0 against stock: same losses, fp32-tight. Not bit-exact: LRMoE's experts are
  one grouped GEMM over stacked weights, stock's ``SequentialMLP`` runs one GEMM per expert, and
  the two sum in different orders.
* Checkpoints (``megatron.core.dist_checkpointing``, torch_dist, the model's
  ``sharded_state_dict``) written with LRMoE off load with it on and the reverse: the resumed
  run's first loss is the uninterrupted run's loss at that step (the forward is exact in both
  implementations), and it goes on as a run of the other implementation resumed from the same
  checkpoint does.
* Optimizer state: Megatron's optimizer ``sharded_state_dict`` checkpoints (model + Adam moments
  + LR schedule) resume exactly within an implementation (stock, LRMoE keep 1.0 and keep 0.5)
  and move between stock and LRMoE both ways.

A second 2-rank run puts single LRMoE layers behind Megatron's DDP (``overlap_grad_reduce`` off
and on) and checks that each expert projection is one parameter that gets exactly one gradient
per backward, zeros included for experts (and a whole rank) that received no rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from megatron_lrmoe.testing import run_distributed

WORLD_SIZE = 2
TIMEOUT_S = 240.0
SAVE_AT = 3  # checkpoint after this many steps
STEPS = 6
RTOL_EXACT = 1e-5  # fp32, same math in a different summation order, over a few steps


def _losses(records: list) -> list[float]:
    return [r.loss for r in records]


def _training_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every run of this module on one rank; returns loss curves and the optimizer error."""
    import torch

    from megatron_lrmoe import LRMoEConfig
    from megatron_lrmoe.demo.trainer import ModelShape, Trainer, TrainSettings, load_stdlib_corpus
    from megatron_lrmoe.testing import init_megatron_parallel

    init_megatron_parallel(ep=world_size)
    corpus = load_stdlib_corpus(1 << 20, 64 << 10)
    shape = ModelShape(hidden_size=32, kv_channels=8, moe_ffn_hidden_size=32, seq_length=32)
    settings = TrainSettings(steps=STEPS, micro_batch_size=4, eval_interval=STEPS, warmup_steps=2)
    keep_half = LRMoEConfig(keep_ratio=0.5)
    keep_one = LRMoEConfig(keep_ratio=1.0)
    names = ("stock", "lrmoe", "stock_full", "keep1_full", "lrmoe_full")
    dirs = {name: str(Path(root) / name) for name in names}
    out: dict[str, Any] = {}

    def uninterrupted(lrmoe: Any, init: Any, save_to: str = "", optimizer: bool = False):
        trainer = Trainer(shape, settings, corpus, lrmoe=lrmoe, init_from=init)
        first = trainer.run(steps=SAVE_AT)
        if save_to:
            trainer.save(save_to, optimizer=optimizer)
        rest = trainer.run()
        trainer.close()
        return trainer.initial_state, _losses(first + rest)

    def resumed(lrmoe: Any, directory: str, optimizer: bool = False) -> list[float]:
        trainer = Trainer(shape, settings, corpus, lrmoe=lrmoe, start_step=SAVE_AT)
        trainer.load(directory, optimizer=optimizer)
        losses = _losses(trainer.run())
        trainer.close()
        return losses

    init, out["stock"] = uninterrupted(None, None, dirs["stock"])
    _, out["keep1"] = uninterrupted(keep_one, init)
    fused = LRMoEConfig(keep_ratio=1.0, grad_accumulation_fusion="on")
    trainer = Trainer(shape, settings, corpus, lrmoe=fused, init_from=init)
    out["keep1_fused"] = _losses(trainer.run())
    # Set by the layers in the last backward (DDP resets them when it zeroes the buffers).
    out["fused_flags"] = [
        p.grad_added_to_main_grad
        for m in trainer.model.modules()
        if getattr(m, "lrmoe_config", None) is not None
        for p in m.experts.weights()
    ]
    trainer.close()
    # keep_ratio "auto" through DDP, the optimizer and the schedule: the ratio each layer
    # planned its last call with.
    auto = LRMoEConfig(keep_ratio="auto", variance_target=0.1)
    trainer = Trainer(shape, settings, corpus, lrmoe=auto, init_from=init)
    out["auto"] = _losses(trainer.run())
    out["auto_planned"] = [
        m.auto_keep.planned
        for m in trainer.model.modules()
        if getattr(m, "lrmoe_config", None) is not None
    ]
    trainer.close()
    _, out["lrmoe"] = uninterrupted(keep_half, init, dirs["lrmoe"])
    # Stock checkpoint -> LRMoE on (keep 0.5, and keep 1.0), and stock again as the reference.
    out["stock_to_lrmoe"] = resumed(keep_half, dirs["stock"])
    out["stock_to_keep1"] = resumed(keep_one, dirs["stock"])
    out["stock_to_stock"] = resumed(None, dirs["stock"])
    # LRMoE checkpoint -> LRMoE off, and LRMoE keep 1.0 as the reference.
    out["lrmoe_to_stock"] = resumed(None, dirs["lrmoe"])
    out["lrmoe_to_keep1"] = resumed(keep_one, dirs["lrmoe"])
    # Model + Megatron optimizer state + LR schedule, within and across implementations.
    _, out["stock_full_uninterrupted"] = uninterrupted(None, init, dirs["stock_full"], True)
    out["stock_full_resumed"] = resumed(None, dirs["stock_full"], optimizer=True)
    out["stock_full_to_keep1"] = resumed(keep_one, dirs["stock_full"], optimizer=True)
    _, out["keep1_full_uninterrupted"] = uninterrupted(keep_one, init, dirs["keep1_full"], True)
    out["keep1_full_resumed"] = resumed(keep_one, dirs["keep1_full"], optimizer=True)
    out["keep1_full_to_stock"] = resumed(None, dirs["keep1_full"], optimizer=True)
    _, out["lrmoe_full_uninterrupted"] = uninterrupted(keep_half, init, dirs["lrmoe_full"], True)
    out["lrmoe_full_to_stock"] = resumed(None, dirs["lrmoe_full"], optimizer=True)
    out["lrmoe_full_resumed"] = resumed(keep_half, dirs["lrmoe_full"], optimizer=True)
    # Replicas of hot experts (keep 1.0: exact, so every curve must be stock's): checkpoints with
    # optimizer state from a run with replicas resume with and without them, and back.
    with_replicas = LRMoEConfig(keep_ratio=1.0, max_replicas_per_rank=1)
    trainer = Trainer(shape, settings, corpus, lrmoe=with_replicas, init_from=init)
    first = trainer.run(steps=SAVE_AT)
    trainer.save(str(Path(root) / "replicas_full"), optimizer=True)
    rest = trainer.run()
    out["replicas_placed"] = sum(
        getattr(m.last_call_stats, "replicas_placed", 0)
        for m in trainer.model.modules()
        if getattr(m, "last_call_stats", None) is not None
    )
    trainer.close()
    out["replicas_full_uninterrupted"] = _losses(first + rest)
    replicas_dir = str(Path(root) / "replicas_full")
    out["replicas_full_resumed"] = resumed(with_replicas, replicas_dir, optimizer=True)
    out["replicas_full_to_stock"] = resumed(None, replicas_dir, optimizer=True)
    out["stock_full_to_replicas"] = resumed(with_replicas, dirs["stock_full"], optimizer=True)
    return out


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Rank 0's loss curves (losses are all-reduced, so every rank holds the same)."""
    root = tmp_path_factory.mktemp("lrmoe_training")
    results = run_distributed(_training_worker, WORLD_SIZE, str(root), timeout=TIMEOUT_S)
    for name, values in results[0].items():
        if isinstance(values, list):
            assert values == results[1][name], f"ranks disagree on {name}"
    return results[0]


def _assert_close(got: list[float], want: list[float], rtol: float, what: str) -> None:
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert math.isfinite(a), f"{what}: step {step} loss {a}"
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {step}: {a!r} vs {b!r}"


def test_keep1_losses_equal_stock(curves: dict[str, Any]) -> None:
    _assert_close(curves["keep1"], curves["stock"], RTOL_EXACT, "LRMoE keep 1.0 vs stock")
    assert curves["stock"][-1] < curves["stock"][0], "the run does not learn"


def test_keep1_with_fused_gradient_accumulation_equals_stock(curves: dict[str, Any]) -> None:
    """The expert gradients added into DDP's ``main_grad`` by the layer (fp32 here, as the
    unfused path's): the same training as stock's, through Megatron's optimizer and clipping."""
    _assert_close(curves["keep1_fused"], curves["stock"], RTOL_EXACT, "keep 1.0 fused vs stock")
    assert curves["fused_flags"] and all(curves["fused_flags"]), curves["fused_flags"]


def test_keep_half_trains(curves: dict[str, Any]) -> None:
    """Keep 0.5 changes only the backward: the first loss is stock's, later ones stay close."""
    assert curves["lrmoe"][0] == pytest.approx(curves["stock"][0], rel=RTOL_EXACT)
    _assert_close(curves["lrmoe"], curves["stock"], 0.01, "LRMoE keep 0.5 vs stock")
    assert curves["lrmoe"][-1] < curves["lrmoe"][0]


def test_auto_keep_ratio_trains(curves: dict[str, Any]) -> None:
    """Keep ratio "auto": the first step is keep 1.0's (the forward is exact and the first call
    of every layer keeps every pair), the run trains, and every MoE layer planned its calls."""
    auto, keep1 = curves["auto"], curves["keep1"]
    assert auto[0] == pytest.approx(keep1[0], rel=RTOL_EXACT)
    assert all(math.isfinite(x) for x in auto) and auto[-1] < auto[0]
    planned = curves["auto_planned"]
    assert planned and all(0 < k <= 1 for k in planned), planned


def test_stock_checkpoint_resumes_with_lrmoe_on(curves: dict[str, Any]) -> None:
    resumed_from = curves["stock"][SAVE_AT:]
    # The first resumed loss is the forward of the saved weights: the uninterrupted curve's.
    for name in ("stock_to_lrmoe", "stock_to_keep1", "stock_to_stock"):
        assert curves[name][0] == pytest.approx(resumed_from[0], rel=RTOL_EXACT), name
    # Then LRMoE goes on exactly as stock resumed from the same checkpoint (fresh Adam) ...
    _assert_close(curves["stock_to_keep1"], curves["stock_to_stock"], RTOL_EXACT, "keep 1.0")
    # ... and, trimmed, close to it.
    _assert_close(curves["stock_to_lrmoe"], curves["stock_to_stock"], 0.01, "keep 0.5")


def test_lrmoe_checkpoint_resumes_with_lrmoe_off(curves: dict[str, Any]) -> None:
    resumed_from = curves["lrmoe"][SAVE_AT:]
    for name in ("lrmoe_to_stock", "lrmoe_to_keep1"):
        assert curves[name][0] == pytest.approx(resumed_from[0], rel=RTOL_EXACT), name
    _assert_close(curves["lrmoe_to_stock"], curves["lrmoe_to_keep1"], RTOL_EXACT, "LRMoE off")


def test_model_only_resume_continues_the_curve(curves: dict[str, Any]) -> None:
    """With Adam restarted, the resumed curve stays near the uninterrupted one."""
    _assert_close(curves["stock_to_stock"], curves["stock"][SAVE_AT:], 0.02, "model-only resume")


def test_stock_optimizer_checkpoint_resumes_exactly(curves: dict[str, Any]) -> None:
    """Model + Megatron optimizer state + LR schedule: the resumed curve is the same curve."""
    _assert_close(
        curves["stock_full_resumed"],
        curves["stock_full_uninterrupted"][SAVE_AT:],
        RTOL_EXACT,
        "stock resume with optimizer state",
    )


def test_optimizer_checkpoints_move_between_stock_and_lrmoe(curves: dict[str, Any]) -> None:
    """Model + optimizer state saved by either implementation resumes in either, on the curve.

    LRMoE's ``[L, ...]`` expert parameters are checkpointed under SequentialMLP's global keys and
    shapes, with the parameters themselves as sharded data, so Megatron's optimizer checkpoint
    (which maps state to model entries by parameter identity) has one layout for both.
    """
    tail = slice(SAVE_AT, None)
    _assert_close(
        curves["keep1_full_resumed"],
        curves["keep1_full_uninterrupted"][tail],
        RTOL_EXACT,
        "LRMoE keep 1.0 -> LRMoE keep 1.0 with optimizer state",
    )
    _assert_close(
        curves["keep1_full_to_stock"],
        curves["keep1_full_uninterrupted"][tail],
        RTOL_EXACT,
        "LRMoE keep 1.0 -> stock with optimizer state",
    )
    _assert_close(
        curves["stock_full_to_keep1"],
        curves["stock_full_uninterrupted"][tail],
        RTOL_EXACT,
        "stock -> LRMoE keep 1.0 with optimizer state",
    )
    # From an LRMoE keep-0.5 checkpoint, stock continues from the same weights and moments: its
    # first loss is the forward of the saved weights, which LRMoE's forward matches exactly.
    first = curves["lrmoe_full_to_stock"][0]
    want = curves["lrmoe_full_uninterrupted"][SAVE_AT]
    assert math.isclose(first, want, rel_tol=RTOL_EXACT), (first, want)
    assert all(math.isfinite(x) for x in curves["lrmoe_full_to_stock"])


def test_lrmoe_resume_continues_the_sampled_curve(curves: dict[str, Any]) -> None:
    """Keep 0.5 with sampling, resumed with optimizer state, is the uninterrupted curve.

    The sampling stream is keyed by (seed, layer, training step, call within the step), so the
    resumed run draws the same pairs as the uninterrupted one: no sampler state to checkpoint.
    """
    _assert_close(
        curves["lrmoe_full_resumed"],
        curves["lrmoe_full_uninterrupted"][SAVE_AT:],
        RTOL_EXACT,
        "LRMoE keep 0.5 -> LRMoE keep 0.5 with optimizer state",
    )


def _ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    """LRMoE layers behind Megatron's DDP, overlap_grad_reduce off and on; facts per case.

    Routing is forced so that only rank 0's first and last experts receive pairs: rank 0's
    middle experts and every expert of rank 1 get no rows. Each case runs two iterations (DDP
    learns the expected grad counts in the first and checks them in the second).
    """
    import lrmoe_workers as w
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config

    pg = init_megatron_parallel(ep=world_size)
    facts: dict[str, Any] = {}
    configs = [
        LRMoEConfig(grad_accumulation_fusion=fusion, **keep)
        for fusion in ("off", "on")
        for keep in ({}, {"keep_ratio": 0.5, "selection": "topk"})
    ]
    for overlap in (False, True):
        for lrmoe in configs:
            cfg = moe_transformer_config(expert_model_parallel_size=world_size)
            layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
            w._apply_routing(layer.router, "first_rank_only", cfg.num_moe_experts, rank, world_size)
            x, upstream = w._inputs(rank, cfg.hidden_size)
            weights = layer.experts.weights()
            w._run(layer, x, upstream)  # plain autograd: the reference gradients
            reference = [p.grad.clone() for p in weights]
            layer.zero_grad(set_to_none=True)

            accumulations = [0, 0]
            for i, param in enumerate(weights):
                param.register_post_accumulate_grad_hook(
                    lambda _, i=i: accumulations.__setitem__(i, accumulations[i] + 1)
                )
            ddp = DistributedDataParallel(
                cfg, DistributedDataParallelConfig(overlap_grad_reduce=overlap), layer
            )
            for _ in range(2):
                ddp.zero_grad_buffer()
                w._run(ddp, x, upstream)
                ddp.finish_grad_sync()
            expert_buffer_params = [p for b in ddp.expert_parallel_buffers for p in b.params]
            (scaling,) = {b.gradient_scaling_factor for b in ddp.expert_parallel_buffers}
            fusion = lrmoe.grad_accumulation_fusion
            key = f"overlap={overlap} keep={lrmoe.keep_ratio} fusion={fusion}"
            facts[key] = {
                "accumulations": list(accumulations),
                "expert_buffer_params": len(expert_buffer_params),
                "buffer_holds_weights": all(
                    any(p is q for q in expert_buffer_params) for p in weights
                ),
                # DDP pre-scales by 1 / (dense DP size) (Megatron's loss averaging); the expert-DP
                # all-reduce is over one rank here, so main_grad is exactly the scaled gradient.
                "main_grad_equal": [
                    torch.equal(p.main_grad, r * scaling) for p, r in zip(weights, reference)
                ],
                # Fused: the GEMMs added into main_grad themselves (another fp32 summation).
                "main_grad_close": [
                    torch.allclose(p.main_grad, r * scaling, rtol=1e-5, atol=1e-7)
                    for p, r in zip(weights, reference)
                ],
                "fused": fusion == "on",
                # Set by the layer when it added into main_grad (DDP resets it per iteration).
                "grad_added_to_main_grad": [p.grad_added_to_main_grad for p in weights],
                # Rows of experts that received pairs / of those that did not.
                "nonzero_experts": [(r.flatten(1).abs().sum(1) > 0).tolist() for r in reference],
                "grad_left_on_params": [p.grad is not None for p in weights],
            }
            # Two micro-batches in one iteration (the first under no_sync, as Megatron's
            # schedules run them): main_grad holds both, whoever adds them.
            ddp.zero_grad_buffer()
            with ddp.no_sync():
                w._run(ddp, x, upstream)
            w._run(ddp, x, upstream)
            ddp.finish_grad_sync()
            facts[key]["two_microbatches_close"] = [
                torch.allclose(p.main_grad, 2 * r * scaling, rtol=1e-5, atol=1e-7)
                for p, r in zip(weights, reference)
            ]
    return facts


@pytest.fixture(scope="module")
def ddp_facts() -> list[dict[str, Any]]:
    return run_distributed(_ddp_worker, WORLD_SIZE, timeout=TIMEOUT_S)


def test_ddp_sees_one_grad_per_projection(ddp_facts: list[dict[str, Any]]) -> None:
    """Megatron's DDP (overlap_grad_reduce off and on) gets exactly one gradient per expert
    projection per backward, also on a rank whose experts received no rows, and reduces it into
    ``main_grad`` unchanged (expert DP size 1 here), zeros for experts without rows. With
    ``grad_accumulation_fusion="on"`` the layer adds into ``main_grad`` itself and DDP's hook
    still fires once per projection and backward (readiness) without adding again. Two
    micro-batches of one iteration (the first under ``no_sync``) both end up in ``main_grad``.
    """
    for rank, per_rank in enumerate(ddp_facts):
        assert len(per_rank) == 8
        for case, f in per_rank.items():
            where = f"rank {rank} {case}"
            assert f["accumulations"] == [2, 2], f"{where}: {f['accumulations']}"
            assert f["expert_buffer_params"] == 2 and f["buffer_holds_weights"], where
            assert f["grad_added_to_main_grad"] == [f["fused"]] * 2, where
            if f["fused"]:
                assert f["main_grad_close"] == [True, True], where
            else:
                assert f["main_grad_equal"] == [True, True], where
            assert f["grad_left_on_params"] == [False, False], where
            assert f["two_microbatches_close"] == [True, True], where
            # first_rank_only: rank 0's first and last experts receive, nothing else does.
            local = len(f["nonzero_experts"][0])
            want = [rank == 0 and i in (0, local - 1) for i in range(local)]
            assert f["nonzero_experts"] == [want, want], f"{where}: {f['nonzero_experts']}"


def test_corpus_split_is_by_file_and_skips_site_packages(tmp_path: Path) -> None:
    """Validation files are chosen by a hash of the relative path; site-packages is not stdlib."""
    import zlib

    from megatron_lrmoe.demo.trainer import load_stdlib_corpus

    names = [f"pkg{i % 4}/mod_{i:03d}.py" for i in range(64)]
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"# {name}\n" + "x = 1\n" * 700)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "third_party.py").write_text("# third_party\n" * 1000)

    corpus = load_stdlib_corpus(root=str(tmp_path))
    train = bytes(corpus.train.tolist()).decode()
    valid = bytes(corpus.valid.tolist()).decode()
    want_valid = {n for n in names if zlib.crc32(n.encode()) % 16 == 0}
    assert want_valid and corpus.valid_files == len(want_valid)
    assert corpus.train_files == len(names) - len(want_valid)
    for name in names:
        assert (f"# {name}\n" in valid) == (name in want_valid), name
        assert (f"# {name}\n" in train) == (name not in want_valid), name
    assert "third_party" not in train + valid


def test_replicas_train_and_checkpoint_like_stock(curves: dict[str, Any]) -> None:
    """Keep 1.0 with replicas of hot experts: the stock curve, and checkpoints (model + Megatron
    optimizer state) that resume with replicas, without LRMoE, and from stock into replicas."""
    assert curves["replicas_placed"] > 0, "the controller placed no replica: the test is void"
    _assert_close(
        curves["replicas_full_uninterrupted"], curves["stock_full_uninterrupted"], RTOL_EXACT,
        "replicas keep 1.0 vs stock",
    )
    tail = curves["replicas_full_uninterrupted"][SAVE_AT:]
    for name in ("replicas_full_resumed", "replicas_full_to_stock"):
        _assert_close(curves[name], tail, RTOL_EXACT, name)
    _assert_close(
        curves["stock_full_to_replicas"], curves["stock_full_resumed"], RTOL_EXACT,
        "stock checkpoint resumed with replicas",
    )
