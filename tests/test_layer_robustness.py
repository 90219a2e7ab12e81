"""LRMoE layers under activation checkpointing, non-finite values and the invariant checks (CPU).

* Recomputed forwards (Megatron's ``recompute_modules=["moe"]``, which wraps the layer in
  ``tensor_parallel.checkpoint``, and ``torch.utils.checkpoint`` reentrant and not) must draw the
  same sample stream as plain forwards: the same kept pairs per call and the same gradients,
  over two micro-batches so that a call counter that runs ahead shows up in the second call.
* NaN / Inf in the incoming gradient or in the input must make the gradients non-finite (expert
  weights, router, input), so Megatron's NaN check fires, instead of being selected away.
* ``LRMoEConfig(debug_check_invariants=True)`` runs clean on valid calls (and changes nothing),
  and a corrupted plan raises.

Everything goes through the public layer API (spec builder, ``last_call_stats``, the experts'
weights); the workers are module level so ``spawn`` can pickle them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

import selection_reference as ref
from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.testing import run_distributed

TIMEOUT_S = 240.0
TOKENS = 32

# --------------------------------------------------------------------------------------------- #
# Workers.
# --------------------------------------------------------------------------------------------- #

CHECKPOINT_MODES = ("plain", "megatron_recompute", "torch_reentrant", "torch_non_reentrant")


class _StatsLog:
    """The ``CallStats`` objects a layer exposed, read after every forward and every backward.

    ``last_call_stats`` after a forward is that forward's call; after a backward it is the call
    a recompute made (reentrant checkpointing, Megatron's MoE recompute). Which of them ran a
    backward differs by checkpointing style, so :meth:`finished` keeps those, in order.
    """

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.seen: list[Any] = []

    def read(self) -> None:
        stats = self.layer.last_call_stats
        if stats is not None and all(stats is not s for s in self.seen):
            self.seen.append(stats)

    def finished(self) -> list[Any]:
        return [s for s in self.seen if s.backward_done]


def _call(layer: Any, x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "torch_reentrant":
        out, _ = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
    elif mode == "torch_non_reentrant":
        out, _ = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    else:  # plain, or Megatron's own recompute inside MoELayer.forward (set in the config)
        out, _ = layer(x)
    return out


def _checkpoint_run(pg: Any, ep: int, rank: int, lrmoe: dict, mode: str, state: dict) -> dict:
    """Two micro-batches (forward, backward each) through a fresh layer in ``mode``."""
    overrides = {}
    if mode == "megatron_recompute":
        overrides = dict(recompute_granularity="selective", recompute_modules=["moe"])
    layer = ref.build_layer(pg, ep, dict(lrmoe, debug_record_selection=True), **overrides)
    if state:
        layer.load_state_dict(state)
    initial = {
        k: v.detach().clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()
    }
    layer.train()
    log = _StatsLog(layer)
    # Forwards are counted where they enter the experts: a recompute can stop early (torch's
    # non-reentrant checkpoint stops once it has every saved tensor back), so the layer's
    # ``last_call_stats`` is not a reliable witness of it.
    forwards: list[int] = []
    routed = layer.routed_experts_compute

    def counted(*args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        return routed(*args, **kwargs)

    layer.routed_experts_compute = counted
    input_grads = []
    for micro_batch in range(2):
        hidden = layer.config.hidden_size
        x, upstream = ref.layer_inputs(rank, TOKENS, hidden, seed=20 + micro_batch)
        x = x.clone().requires_grad_(True)
        out = _call(layer, x, mode)
        log.read()
        (out * upstream).sum().backward()
        log.read()
        input_grads.append(x.grad.detach().clone())
    finished = log.finished()
    return {
        "state": initial,
        "kept_weight": [s.kept_weight.clone() for s in finished],
        "stream_calls": len(finished),
        "forwards": len(forwards),
        "dx": input_grads,
        "router": layer.router.weight.grad.detach().clone(),
        "experts": ref.flat_expert_grads(layer),
    }


def checkpoint_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Every case in every checkpoint mode, from the same weights."""
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    results = []
    for lrmoe in cases:
        plain = _checkpoint_run(pg, world, rank, lrmoe, "plain", {})
        state = plain.pop("state")
        per_mode = {"plain": plain}
        for mode in CHECKPOINT_MODES[1:]:
            run = _checkpoint_run(pg, world, rank, lrmoe, mode, state)
            run.pop("state")
            per_mode[mode] = run
        results.append({"lrmoe": lrmoe, "modes": per_mode})
    return results


def _poison(t: torch.Tensor, token: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[token, 0, 3] = value
    return t


def nonfinite_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Runs each case with one NaN/Inf on rank 0 (in its incoming gradient or its input) and
    reports which gradients came out non-finite."""
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    results = []
    for case in cases:
        layer = ref.build_layer(pg, world, case["lrmoe"])
        x, upstream = ref.layer_inputs(rank, TOKENS, layer.config.hidden_size, seed=3)
        if rank == 0:
            if case["where"] == "grad":
                upstream = _poison(upstream, token=5, value=case["value"])
            else:
                x = _poison(x, token=5, value=case["value"])
        dx = ref.run_once(layer, x, upstream)["dx"]
        grads = ref.expert_grads(layer)
        router = layer.router.weight.grad
        local_sq = sum(float(t.double().square().sum()) for pair in grads for t in pair)
        local_sq += float(router.double().square().sum())
        norm_sq = torch.tensor([local_sq], dtype=torch.float64)
        # Megatron reduces the grad norm over the model-parallel ranks (here: the EP group).
        torch.distributed.all_reduce(norm_sq)
        results.append(
            {
                "case": case,
                "experts_nonfinite": [
                    [not bool(torch.isfinite(t).all()) for t in pair] for pair in grads
                ],
                "router_nonfinite": not bool(torch.isfinite(router).all()),
                "dx_nonfinite": not bool(torch.isfinite(dx).all()),
                "global_norm_finite": math.isfinite(float(norm_sq)),
            }
        )
    return results


def invariants_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case with ``debug_check_invariants`` off and on, from the same weights and inputs."""
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    results = []
    for lrmoe in cases:
        runs = []
        state = None
        for check in (False, True):
            kwargs = dict(lrmoe, debug_record_selection=True, debug_check_invariants=check)
            layer = ref.build_layer(pg, world, kwargs)
            if state is None:
                state = layer.state_dict()
            else:
                layer.load_state_dict(state)
            x, upstream = ref.layer_inputs(rank, TOKENS, layer.config.hidden_size, seed=9)
            dx = ref.run_once(layer, x, upstream)["dx"]
            runs.append(
                {
                    "kept_weight": layer.last_call_stats.kept_weight.clone(),
                    "dx": dx,
                    "experts": ref.flat_expert_grads(layer),
                }
            )
        results.append({"lrmoe": lrmoe, "off": runs[0], "on": runs[1]})
    return results


# --------------------------------------------------------------------------------------------- #
# (a) Activation checkpointing.
# --------------------------------------------------------------------------------------------- #


CHECKPOINT_CASES = {
    1: [
        dict(keep_ratio=0.5, selection="sample"),
        dict(keep_ratio=0.5, selection="topk", activation_mode="recompute"),
        dict(keep_ratio=0.5, selection="sample", activation_mode="lean"),
    ],
    2: [
        dict(keep_ratio=0.5, selection="sample", scope="local"),
        dict(keep_ratio=0.4, selection="sample", scope="global", activation_mode="recompute"),
        dict(keep_ratio=0.5, selection="sample", scope="local", activation_mode="lean"),
    ],
}


@functools.lru_cache(maxsize=None)
def _checkpoint_results(ep: int) -> list[list[dict]]:
    """One process group per EP size runs every mode; the tests below share the results."""
    return run_distributed(checkpoint_worker, ep, CHECKPOINT_CASES[ep], timeout=TIMEOUT_S)




@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize(
    "mode",
    [
        "megatron_recompute",
        "torch_reentrant",
        "torch_non_reentrant",
    ],
)
def test_recomputed_forward_draws_the_same_sample(ep: int, mode: str) -> None:
    """Same kept pairs in both micro-batches and the same gradients as without checkpointing."""
    for rank, per_rank in enumerate(_checkpoint_results(ep)):
        for res in per_rank:
            plain, got = res["modes"]["plain"], res["modes"][mode]
            where = f"rank {rank} {res['lrmoe']} {mode}"
            assert plain["stream_calls"] == plain["forwards"] == 2, f"{where}: plain run"
            # Each micro-batch really ran its forward twice (or the test would prove nothing).
            assert got["forwards"] == 4, f"{where}: {got['forwards']} forwards"
            assert got["stream_calls"] == 2, f"{where}: {got['stream_calls']} finished calls"
            for call, (a, b) in enumerate(zip(plain["kept_weight"], got["kept_weight"])):
                assert torch.equal(a, b), f"{where}: call {call} kept other pairs"
            for name in ("router", "experts"):
                torch.testing.assert_close(
                    got[name], plain[name], rtol=1e-6, atol=1e-9, msg=f"{where}: {name} grad"
                )
            for a, b in zip(plain["dx"], got["dx"]):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9, msg=f"{where}: dx")


# --------------------------------------------------------------------------------------------- #
# (b) Non-finite values reach Megatron's NaN check.
# --------------------------------------------------------------------------------------------- #

NONFINITE_CASES = [
    dict(lrmoe=dict(keep_ratio=kr, selection=sel, scope=scope), where=where, value=value)
    for kr, sel, scope in [
        (0.5, "sample", "local"),
        (0.5, "topk", "global"),
        (1.0, "sample", "local"),
    ]
    for where, value in [("grad", math.nan), ("grad", math.inf), ("input", math.nan)]
]


@pytest.mark.parametrize("ep", [1, 2])
def test_nonfinite_values_poison_the_gradients(ep: int) -> None:
    results = run_distributed(nonfinite_worker, ep, NONFINITE_CASES, timeout=TIMEOUT_S)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            case = res["case"]
            where = f"EP={ep} rank {rank} {case}"
            # The norm Megatron checks (reduced over the EP group) is non-finite everywhere.
            assert not res["global_norm_finite"], f"{where}: gradient norm stayed finite"
            if rank != 0:
                continue  # only rank 0 holds the bad value
            assert res["router_nonfinite"], f"{where}: router gradient finite"
            assert res["dx_nonfinite"], f"{where}: input gradient finite"
            if case["lrmoe"]["keep_ratio"] < 1.0:
                # A dropped bad pair must not leave finite expert gradients behind: both expert
                # weight parameters (one per projection, what Megatron's norm and NaN checks see)
                # of the rank that scored it are flagged, whichever pairs were selected.
                experts = res["experts_nonfinite"]
                assert all(any(pair[j] for pair in experts) for j in (0, 1)), f"{where}: {experts}"
    # Keep 1.0 has no scores: the bad rows reach the experts they were routed to, on any rank.
    for i, case in enumerate(NONFINITE_CASES):
        flagged = [any(any(p) for p in per_rank[i]["experts_nonfinite"]) for per_rank in results]
        assert any(flagged), f"EP={ep} {case}: no expert gradient is non-finite on any rank"


def retained_calls_worker(rank: int, world: int, keeps: list[float]) -> list[int]:
    """Two stacked layers, forward and backward, the output dropped: how many ``ExpertCall``
    objects (a call's plans and index tensors) are still alive, per keep ratio."""
    import gc

    from megatron_lrmoe.op import ExpertCall
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    alive = []
    for keep in keeps:
        first = ref.build_layer(pg, world, dict(keep_ratio=keep))
        second = ref.build_layer(pg, world, dict(keep_ratio=keep))
        x, upstream = ref.layer_inputs(rank, TOKENS, first.config.hidden_size, seed=6)
        x = x.clone().requires_grad_(True)
        out, _ = second(first(x)[0])
        (out * upstream).sum().backward()
        del out
        gc.collect()
        alive.append(sum(isinstance(o, ExpertCall) for o in gc.get_objects()))
    return alive


@pytest.mark.parametrize("ep", [1, 2])
def test_no_call_outlives_its_backward(ep: int) -> None:
    """A layer's dispatcher must not keep the call's routing weights: they carry the graph of
    the layers before it, whose op contexts hold each call's index plans (one call per layer
    stayed alive until the next forward before the dispatcher dropped them)."""
    for rank, alive in enumerate(run_distributed(retained_calls_worker, ep, [1.0, 0.5])):
        assert alive == [0, 0], f"EP {ep} rank {rank}: ExpertCall objects alive {alive}"


def saved_shapes_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Shapes of every tensor the layer's forward saves for backward (saved-tensor hooks on:
    the op then saves everything through autograd), and the call's expert-side rows."""
    from megatron_lrmoe.testing import init_megatron_parallel

    pg = init_megatron_parallel(ep=world)
    results = []
    for lrmoe in cases:
        layer = ref.build_layer(pg, world, dict(lrmoe, record_stats=True))
        params = {id(p) for p in layer.parameters()}
        shapes: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in params:
                shapes.append(tuple(t.shape))
            return t

        x, upstream = ref.layer_inputs(rank, TOKENS, layer.config.hidden_size, seed=4)
        x = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = layer(x)
        (out * upstream).sum().backward()
        rows, ffn = layer.last_call_stats.forward_rows, layer.config.moe_ffn_hidden_size
        results.append(dict(lrmoe=lrmoe, shapes=shapes, rows=rows, ffn=ffn))
    return results


def test_experts_never_save_the_activation_output() -> None:
    """Why ``recompute_modules=["moe_act"]`` needs no rule (docs/config.md): the expert side
    saves fc1's output ``[rows, 2F]`` and recomputes the activation ``[rows, F]`` in backward,
    at keep 1 and below, at EP 1 and 2."""
    cases = [
        dict(keep_ratio=1.0),
        dict(keep_ratio=0.5),
        dict(keep_ratio=0.5, activation_mode="recompute"),
    ]
    for ep in (1, 2):
        results = run_distributed(saved_shapes_worker, ep, cases, timeout=TIMEOUT_S)
        for rank, per_rank in enumerate(results):
            for res in per_rank:
                rows, ffn = res["rows"], res["ffn"]
                where = f"EP {ep} rank {rank} {res['lrmoe']}: {res['shapes']}"
                assert rows > 0, where
                assert (rows, ffn) not in res["shapes"], where
                if res["lrmoe"].get("activation_mode", "save") == "save":
                    assert (rows, 2 * ffn) in res["shapes"], where  # the hook saw the op's saves


# --------------------------------------------------------------------------------------------- #
# (c) debug_check_invariants.
# --------------------------------------------------------------------------------------------- #


def test_invariant_checks_run_clean_and_change_nothing() -> None:
    cases = [
        dict(keep_ratio=0.5, selection="sample", scope="local"),
        dict(keep_ratio=0.3, selection="topk", scope="global"),
        dict(keep_ratio=1e-6, activation_mode="recompute"),
        dict(keep_ratio=1.0),
    ]
    results = run_distributed(invariants_worker, 2, cases, timeout=TIMEOUT_S)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            off, on = res["off"], res["on"]
            where = f"rank {rank} {res['lrmoe']}"
            assert torch.equal(off["kept_weight"], on["kept_weight"]), where
            assert torch.equal(off["dx"], on["dx"]), where
            assert torch.equal(off["experts"], on["experts"]), where


def _plan(**changes: Any):
    """A valid 2-rank, 4-expert scope-local plan, with ``changes`` applied."""
    from megatron_lrmoe.control.plan import CallPlan

    counts = torch.tensor([[3, 0, 5, 2], [1, 4, 0, 2]], dtype=torch.int64)
    fields = dict(
        ep_rank=0,
        ep_size=2,
        num_local_experts=2,
        global_counts=counts,
        quota=torch.tensor([2, 2, 3, 2], dtype=torch.int64),
        source_quota=torch.tensor([[2, 0, 3, 1], [0, 2, 0, 1]], dtype=torch.int64),
        layer_number=1,
        stream=(0,),
    )
    fields.update(changes)
    return CallPlan(**fields)


def test_valid_plan_passes_check_invariants() -> None:
    from megatron_lrmoe.control.plan import CallPlan

    _plan().check_invariants()
    lrmoe = LRMoEConfig(keep_ratio=0.5, debug_check_invariants=True)
    built = CallPlan.build(_plan().global_counts, 1, 2, lrmoe, layer_number=1, stream=(0,))
    assert torch.equal(built.source_quota.sum(0), built.quota)


@pytest.mark.parametrize(
    "changes",
    [
        # Split does not add up to the quota of expert 3.
        dict(source_quota=torch.tensor([[2, 0, 3, 1], [0, 2, 0, 0]])),
        # A source asked to keep more pairs than it sent (rank 1 sent 0 to expert 2).
        dict(source_quota=torch.tensor([[2, 0, 2, 1], [0, 2, 1, 1]])),
        # A negative share balanced by an excess one.
        dict(source_quota=torch.tensor([[3, 0, 3, 1], [-1, 2, 0, 1]])),
        # A quota above the expert's pairs (expert 1 has 4).
        dict(
            quota=torch.tensor([2, 5, 3, 2]),
            source_quota=torch.tensor([[2, 0, 3, 1], [0, 5, 0, 1]]),
        ),
        # A negative quota.
        dict(quota=torch.tensor([2, -1, 3, 2]), source_quota=None),
    ],
    ids=["split-sum", "share-above-count", "negative-share", "quota-above-count", "negative-quota"],
)
def test_corrupted_plan_fails_check_invariants(changes: dict) -> None:
    plan = _plan(**changes)
    with pytest.raises((AssertionError, ValueError)):
        plan.check_invariants()
