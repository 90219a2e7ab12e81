"""Tests of megatron_lrmoe.testing: the CPU shim, the multi-process harness and the stock models.

The shim is only ever installed inside run_distributed children (or a throw-away subprocess),
never in the pytest process, because its patches are process-global and would leak into the
other test modules. Worker functions are module level so that ``spawn`` can pickle them.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from megatron_lrmoe.testing import (
    DistributedTestError,
    cpu_shim_installed,
    init_megatron_parallel,
    install_cpu_shim,
    moe_transformer_config,
    run_distributed,
    stock_moe_layer,
)
from megatron_lrmoe.testing.models import skewed_routing_inputs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = 24
# fp32 and only the summation order differs between EP=1 and EP>1 (observed: ~1e-7 relative).
RTOL = 1e-5

needs_cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="exercises the CPU shim, which refuses to run with CUDA"
)


# ------------------------------------------------------------------------------------------------
# Workers (run in the spawned ranks).
# ------------------------------------------------------------------------------------------------
def _report_env(rank: int, world_size: int, tag: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "dist_rank": torch.distributed.get_rank(),
        "threads": torch.get_num_threads(),
        "shim": cpu_shim_installed(),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda": torch.cuda.is_available(),
        "sum": _all_reduce_rank(rank),
    }


def _report_start(rank: int, world_size: int) -> dict[str, Any]:
    """How this rank was started, and what it sees of the parent's environment."""
    return {
        "method": multiprocessing.get_start_method(allow_none=True),
        "probe": os.environ.get("LRMOE_HARNESS_PROBE"),
        "interpret": os.environ.get("TRITON_INTERPRET"),
        "torch_preloaded": "megatron.core" in sys.modules,
    }


def _all_reduce_rank(rank: int) -> float:
    value = torch.tensor([float(rank)])
    torch.distributed.all_reduce(value)
    return value.item()


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    # The healthy rank blocks in a collective that rank 1 never joins: it must be terminated.
    torch.distributed.barrier()
    time.sleep(1000)


def _exit_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)  # a hard crash: no exception, no report
    torch.distributed.barrier()


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(1000)
    return rank


def _rng_tracker_checks(rank: int, world_size: int) -> dict[str, Any]:
    """The shim maps megatron's CUDA RNG tracker onto the CPU generator; check it behaves."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
    )

    init_megatron_parallel(ep=world_size, seed=1234)
    tracker = get_cuda_rng_tracker()
    state = torch.get_rng_state()
    plain = torch.randn(4)
    torch.set_rng_state(state)
    with tracker.fork(get_expert_parallel_rng_tracker_name()):
        expert_draw = torch.randn(4)
    with tracker.fork():  # tensor-model-parallel stream, same on every rank at TP=1
        tp_draw = torch.randn(4)
    # fork() must restore the default stream exactly.
    after_forks = torch.randn(4)
    return {
        "restored": torch.equal(plain, after_forks),
        "expert_draw": expert_draw,
        "tp_draw": tp_draw,
    }


def _singleton_ep_collection(pg_collection: Any, rank: int, world_size: int) -> Any:
    """The same process groups, but with expert parallelism collapsed onto this rank alone."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    # new_group is collective: every rank creates every singleton group, in the same order.
    singletons = [torch.distributed.new_group([r]) for r in range(world_size)]
    ref = ProcessGroupCollection()
    for name, group in vars(pg_collection).items():
        setattr(ref, name, group)
    ref.ep = singletons[rank]
    ref.tp_ep = singletons[rank]
    # With EP=1 every rank holds every expert, so experts are replicated over the whole DP group.
    ref.expt_dp = parallel_state.get_data_parallel_group()
    return ref


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want| (the tensors here are small: init std is 0.02)."""
    scale = want.abs().max().item()
    assert scale > 0, "reference is all zeros; the comparison would prove nothing"
    return (got - want).abs().max().item() / scale


def _stock_ep_vs_ep1(
    rank: int, world_size: int, ep: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """Stock MoELayer at EP=ep vs an EP=1 stock layer holding all experts, same weights."""
    pg = init_megatron_parallel(ep=ep)
    cfg = moe_transformer_config(**overrides)
    assert cfg.expert_model_parallel_size == ep  # taken from the parallel state
    layer = stock_moe_layer(cfg, pg)
    ref_cfg = moe_transformer_config(expert_model_parallel_size=1, **overrides)
    ref = stock_moe_layer(ref_cfg, _singleton_ep_collection(pg, rank, world_size))

    num_local = layer.num_local_experts
    ep_rank = pg.ep.rank()
    assert num_local * ep == cfg.num_moe_experts
    assert ref.num_local_experts == cfg.num_moe_experts

    with torch.no_grad():
        # Router (weight and expert-bias buffers) and shared experts are replicated: copy them.
        ref.router.load_state_dict(layer.router.state_dict())
        if layer.shared_experts is not None:
            ref.shared_experts.load_state_dict(layer.shared_experts.state_dict())
        # Experts: gather every rank's local experts and place them by global expert index.
        distinct = False
        for name, _ in layer.experts.local_experts[0].named_parameters():
            local = torch.stack(
                [layer.experts.local_experts[i].get_parameter(name) for i in range(num_local)]
            )
            gathered = [torch.empty_like(local) for _ in range(ep)]
            torch.distributed.all_gather(gathered, local.contiguous(), group=pg.ep)
            everything = torch.cat(gathered)  # [num_experts, ...] in global expert order
            distinct = distinct or not torch.equal(everything[0], everything[-1])
            for g in range(cfg.num_moe_experts):
                ref.experts.local_experts[g].get_parameter(name).copy_(everything[g])

    x = skewed_routing_inputs(TOKENS, cfg.hidden_size, seed=11, rank=rank)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + rank))
    results = {}
    for tag, module in (("ep", layer), ("ref", ref)):
        inp = x.clone().requires_grad_(True)
        out, bias = module(inp)
        assert bias is None
        (out * upstream).sum().backward()
        results[tag] = (out.detach(), inp.grad.detach())

    # Replicated parameters (router, shared experts) see only this rank's tokens in both layers.
    replicated_diffs = [
        _rel_diff(param.grad, ref.get_parameter(name).grad)
        for name, param in layer.named_parameters()
        if not name.startswith("experts.")
    ]
    # Expert weight grads: at EP=ep an expert's grad sums the tokens of every EP rank, while
    # each EP=1 reference only saw its own rank's tokens, so sum the references first.
    # all_reduce is collective, so every rank walks all experts in the same order.
    expert_diffs = []
    for g in range(cfg.num_moe_experts):
        for name, ref_param in ref.experts.local_experts[g].named_parameters():
            ref_grad = ref_param.grad.clone()
            torch.distributed.all_reduce(ref_grad, group=pg.ep)
            if g // num_local == ep_rank:
                param = layer.experts.local_experts[g % num_local].get_parameter(name)
                expert_diffs.append(_rel_diff(param.grad, ref_grad))

    splits = layer.token_dispatcher.input_splits  # tokens this rank sent to each EP rank
    return {
        "out": _rel_diff(results["ep"][0], results["ref"][0]),
        "dx": _rel_diff(results["ep"][1], results["ref"][1]),
        "replicated_grad": max(replicated_diffs),
        "expert_grad": max(expert_diffs),
        "sent_remote": sum(int(s) for r, s in enumerate(splits) if r != ep_rank),
        "experts_distinct": distinct,
        "ep_size": layer.ep_group.size(),
        "ref_ep_size": ref.ep_group.size(),
        "num_replicated": len(replicated_diffs),
    }


def _gpt_train_steps(rank: int, world_size: int, ep: int) -> dict[str, Any]:
    """Two training steps of a dense+MoE GPTModel through megatron's own schedule, DDP and
    optimizer (grad clipping on), to guard the shim's DDP/optimizer/attention patches."""
    import functools

    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    init_megatron_parallel(ep=ep)
    seq, batch, vocab = 16, 2, 64
    cfg = moe_transformer_config(num_layers=2, moe_layer_freq=[0, 1], normalization="RMSNorm")
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
    )
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    cfg.no_sync_func = ddp.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [ddp]
    )

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        loss = output.float().sum()
        count = torch.tensor(output.numel(), dtype=torch.int)
        return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}

    def forward_step(data: Any, module: Any) -> tuple[torch.Tensor, Any]:
        tokens = next(data)
        positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        return module(tokens, positions, None, labels=tokens), functools.partial(loss_func)

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(2)]
    losses, norms = [], []
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        stats = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[ddp],
            num_microbatches=2,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(sum(float(s["lm loss"][0]) for s in stats))
        norms.append(float(grad_norm))
    total: dict[str, torch.Tensor] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0,
        iteration=1,
        track_names=["load_balancing_loss"],
        num_layers=cfg.num_layers,
        moe_layer_freq=cfg.moe_layer_freq,
        total_loss_dict=total,
    )
    return {
        "losses": losses,
        "grad_norms": norms,
        "all_params_moved": all(
            not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters())
        ),
        "lb_loss": float(total["load_balancing_loss"]),
    }


# ------------------------------------------------------------------------------------------------
# (a) shim: refusal and no side effects on import.
# ------------------------------------------------------------------------------------------------
def test_shim_refuses_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    original_current_device = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="is_available"):
        install_cpu_shim()
    assert torch.cuda.current_device is original_current_device
    assert not cpu_shim_installed()


def test_import_has_no_side_effects() -> None:
    # A fresh interpreter, since this pytest process may already have imported the package.
    code = textwrap.dedent("""
        import torch
        before = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.get_rng_state,
                  torch.Tensor.record_stream, torch.Tensor.type)
        import megatron_lrmoe.testing as testing
        import megatron_lrmoe.testing.cpu_shim, megatron_lrmoe.testing.harness
        import megatron_lrmoe.testing.models
        after = (torch.cuda.current_device, torch.cuda.Stream, torch.cuda.get_rng_state,
                 torch.Tensor.record_stream, torch.Tensor.type)
        assert before == after, "importing megatron_lrmoe.testing patched torch"
        assert not testing.cpu_shim_installed()
        print("UNPATCHED")
        """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "UNPATCHED" in proc.stdout


@needs_cpu_only
def test_shim_is_idempotent_in_subprocess() -> None:
    code = textwrap.dedent("""
        import torch
        from megatron_lrmoe.testing import install_cpu_shim, cpu_shim_installed
        install_cpu_shim()
        first = (torch.cuda.current_device, torch.Tensor.type, torch.Tensor.record_stream)
        install_cpu_shim()
        assert first == (torch.cuda.current_device, torch.Tensor.type, torch.Tensor.record_stream)
        assert cpu_shim_installed() and torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            s.wait_stream(torch.cuda.current_stream())
            torch.zeros(1).record_stream(s)
        s.record_event().synchronize()
        assert torch.zeros(1).type() == "torch.FloatTensor"
        print("OK")
        """)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout


# ------------------------------------------------------------------------------------------------
# (b)-(d) harness.
# ------------------------------------------------------------------------------------------------
def test_run_distributed_returns_results_in_rank_order() -> None:
    results = run_distributed(_report_env, 2, "tag", timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    for rank, res in enumerate(results):
        assert res["env_rank"] == res["dist_rank"] == res["local_rank"] == rank
        assert res["world_size"] == 2 and res["tag"] == "tag"
        assert res["master_addr"] == "127.0.0.1"
        assert res["threads"] == 1
        assert res["shim"]  # device "cpu": the CPU shim, whatever the machine has
        assert res["sum"] == 1.0  # 0 + 1 over gloo


def test_cpu_ranks_see_no_gpu_and_the_parent_keeps_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU machine the CPU tests' ranks must not see its GPUs (Megatron would put the
    layers' weights there, next to the tests' CPU inputs): they start with CUDA hidden."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    results = run_distributed(_report_env, 2, "tag", timeout=120)
    for res in results:
        assert res["cuda_visible"] == "" and not res["cuda"] and res["shim"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    run_distributed(_report_env, 1, "tag", timeout=120)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_cpu_ranks_fork_from_a_preloaded_server_with_the_run_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU ranks come from the forkserver (megatron-core already imported) yet see the parent's
    environment as it is when each run starts, like spawned ones; a run that changes a variable
    Triton reads at import (``TRITON_INTERPRET``) is spawned instead, and the next plain run
    forks again."""
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the whole run interprets Triton: its forkserver started with it set")
    run_distributed(_report_start, 1, timeout=120)  # the server exists from here on
    monkeypatch.setenv("LRMOE_HARNESS_PROBE", "first")
    first = run_distributed(_report_start, 2, timeout=120)
    assert [r["probe"] for r in first] == ["first", "first"], first
    assert all(r["method"] == "forkserver" and r["torch_preloaded"] for r in first), first
    monkeypatch.setenv("LRMOE_HARNESS_PROBE", "second")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawned = run_distributed(_report_start, 1, timeout=120)[0]
    assert spawned["method"] == "spawn" and spawned["interpret"] == "1", spawned
    assert spawned["probe"] == "second", spawned
    monkeypatch.delenv("TRITON_INTERPRET")
    again = run_distributed(_report_start, 1, timeout=120)[0]
    assert again["method"] == "forkserver" and again["interpret"] is None, again
    assert again["probe"] == "second", again


def test_rank_exception_fails_fast_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=240)
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"failure took {elapsed:.1f}s to surface"
    message = str(info.value)
    assert "rank 1 failed" in message  # the raising rank is named as the cause
    assert "ValueError" in message and "deliberate failure on rank one" in message
    assert 1 in info.value.failed_ranks


def test_hanging_rank_hits_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=5)
    elapsed = time.monotonic() - start
    # The 5 s are rank 1's own, counted from its start-up (which a busy machine makes slow).
    ready = info.value.ready_after_s
    assert set(ready) == {0, 1}, ready
    assert 5 <= elapsed - ready[1] < 35, f"timeout took {elapsed - ready[1]:.1f}s after start-up"
    message = str(info.value)
    assert "timed out" in message and "did not finish: [1]" in message
    assert "rank 1 ran fn for more than 5.0s" in message
    # Rank 0 returned at once: however long start-up took, it is not blamed.
    assert info.value.failed_ranks == [1]


def test_deadlines_are_per_rank_and_exclude_start_up() -> None:
    from megatron_lrmoe.testing.harness import _RunState

    run = _RunState(start=0.0, timeout=20.0, startup_timeout=100.0)
    # Start-up is slow (a loaded machine): nobody is overdue before the start-up budget ends.
    assert run.overdue(2, now=99.0) == []
    assert run.overdue(2, now=101.0) == [0, 1]
    assert "rank 0 did not start within 100.0s" in run.describe([0])
    # Rank 0 became ready at 60 s and finished; rank 1 became ready at 61 s and still runs.
    run.ready_at = {0: 60.0, 1: 61.0}
    run.values[0] = "done"
    assert run.overdue(2, now=80.5) == []  # rank 1 has used 19.5 s of its 20
    assert run.overdue(2, now=81.5) == [1]  # a finished rank is never overdue
    assert run.ready_after_s() == {0: 60.0, 1: 61.0}


def test_suite_sees_no_gpu_unless_asked() -> None:
    """tests/conftest.py hides the GPUs from the CPU suite (``LRMOE_TEST_CUDA=1`` shows them)."""
    if os.environ.get("LRMOE_TEST_CUDA") == "1":
        pytest.skip("LRMOE_TEST_CUDA=1: the GPUs stay visible")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available()


def test_bad_timeouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_report_env, 2, "tag", timeout=0)
    with pytest.raises(ValueError, match="startup_timeout"):
        run_distributed(_report_env, 2, "tag", startup_timeout=-1.0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        run_distributed(_report_env, 2, "tag", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda'"):
            run_distributed(_report_env, 2, "tag", device="cuda")


def test_crashed_rank_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank_one, 2, timeout=240)
    assert time.monotonic() - start < 60
    assert "rank 1 exited with code 3" in str(info.value)
    assert 1 in info.value.failed_ranks


def test_unpicklable_fn_is_rejected() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_distributed(lambda rank, world_size: rank, 2, timeout=30)


# ------------------------------------------------------------------------------------------------
# (e) real megatron-core MoE on CPU/gloo.
# ------------------------------------------------------------------------------------------------
def test_rng_tracker_fork_on_cpu() -> None:
    results = run_distributed(_rng_tracker_checks, 2, timeout=180)
    assert all(r["restored"] for r in results)
    # Expert-parallel streams differ per EP rank; the TP stream is shared at TP=1.
    assert not torch.equal(results[0]["expert_draw"], results[1]["expert_draw"])
    assert torch.equal(results[0]["tp_draw"], results[1]["tp_draw"])


# Router and shared-expert variants; the stream stubs matter for moe_shared_expert_overlap.
SHARED_SIGMOID = {
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_load_balancing_type": "seq_aux_loss",
    "moe_shared_expert_intermediate_size": 40,
    "moe_shared_expert_overlap": True,
}


@pytest.mark.parametrize(
    "ep, overrides, num_replicated",
    [
        pytest.param(2, {}, 1, id="ep2-softmax"),
        pytest.param(2, SHARED_SIGMOID, 3, id="ep2-sigmoid-bias-shared-overlap"),
        pytest.param(2, {**SHARED_SIGMOID, "moe_shared_expert_overlap": False}, 3, id="ep2-shared"),
        pytest.param(4, {}, 1, id="ep4-softmax"),
    ],
)
def test_stock_moe_layer_ep_matches_ep1(
    ep: int, overrides: dict[str, Any], num_replicated: int
) -> None:
    results = run_distributed(_stock_ep_vs_ep1, ep, ep, overrides, timeout=240)
    for rank, res in enumerate(results):
        assert res["ep_size"] == ep and res["ref_ep_size"] == 1
        assert res["experts_distinct"], "experts are identical; the comparison would prove little"
        assert res["sent_remote"] > 0, f"rank {rank} sent no token to another EP rank"
        assert res["num_replicated"] == num_replicated  # router (+ shared fc1, fc2)
        for key in ("out", "dx", "replicated_grad", "expert_grad"):
            assert res[key] <= RTOL, f"rank {rank}: {key} relative difference {res[key]:.3e}"


def test_gpt_model_ddp_optimizer_on_cpu() -> None:
    results = run_distributed(_gpt_train_steps, 2, 2, timeout=240)
    for res in results:
        assert all(torch.isfinite(torch.tensor(res["losses"])))
        assert res["losses"][1] < res["losses"][0], "two Adam steps on the same data should help"
        assert res["all_params_moved"]
        assert res["lb_loss"] > 0
    # The grad norm is reduced over the model-parallel group by the optimizer: ranks agree.
    assert results[0]["grad_norms"] == pytest.approx(results[1]["grad_norms"], rel=1e-6)
