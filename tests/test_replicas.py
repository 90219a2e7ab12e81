"""Replicas of hot experts placed by the controller and computed by the layer (CPU, gloo).

Cheapest first:

* index plans (``dispatch/replicas.py``) against slow walks of the controller's line rule, on
  synthetic plans including degenerate loads (one expert takes everything, a rank without
  pairs); the two-stack expert MLP against one concatenated stack;
* multi-process (EP 2, 4 and 8, real megatron-core layers): keep 1.0 with replicas == keep 1.0
  without == stock ``MoELayer``; keep < 1 with replicas == the dense masked reference with the
  same selection; the counts the controller promised (kept per expert == quota, per-rank
  loads == the plan, within the planned peaks, no replica in backward that was not in
  forward); recompute mode selects the same pairs with and without replicas; replica weights
  are fetched once per step and never part of the model; determinism across ranks and runs;
* a short training run (Megatron DDP + optimizer) with replicas on == off at keep 1.0.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import replica_workers as rw
from megatron_lrmoe import LRMoEConfig
from megatron_lrmoe.control.controller import plan_call
from megatron_lrmoe.dispatch.compaction import chunk_gather_index
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.dispatch.replicas import ReplicaLayout
from megatron_lrmoe.experts.activation import GluSpec
from megatron_lrmoe.experts.mlp import (
    expert_backward,
    expert_backward_parts,
    expert_forward,
    expert_forward_parts,
)
from megatron_lrmoe.testing import run_distributed
from test_layer import _assert_matches_reference, _check_counts

RTOL = 1e-5  # fp32, a handful of re-associated sums per element
ATOL = 1e-8
TIMEOUT_S = 300.0

# --------------------------------------------------------------------------------------------- #
# Index plans against slow references (no processes).
# --------------------------------------------------------------------------------------------- #


def test_chunk_gather_index_matches_a_loop() -> None:
    gen = random.Random(3)
    for _ in range(20):
        sizes = [gen.randint(0, 4) for _ in range(gen.randint(0, 6))]
        order = list(range(len(sizes)))
        gen.shuffle(order)
        starts, at = [0] * len(sizes), 0
        for i in order:  # chunks tile the source in a shuffled order
            starts[i], at = at, at + sizes[i]
        want = [s + j for s, n in zip(starts, sizes) for j in range(n)]
        got = chunk_gather_index(torch.tensor(starts), torch.tensor(sizes), "cpu")
        assert got.tolist() == want


def _routing_maps(counts_hint: list[list[float]], tokens: list[int], topk: int, seed: int):
    """Per-rank ``[T, E]`` routing maps drawn with the given expert weights (``<= topk`` each)."""
    gen = torch.Generator().manual_seed(seed)
    maps = []
    for weights, t in zip(counts_hint, tokens):
        w = torch.tensor(weights, dtype=torch.float64).expand(t, -1)
        picks = torch.multinomial(w, topk, replacement=False, generator=gen) if t else None
        m = torch.zeros(t, len(weights), dtype=torch.bool)
        if picks is not None:
            m.scatter_(1, picks, True)
        maps.append(m)
    return maps


def _holder_line(control, e: int) -> list[tuple[int, int, int]]:
    """``(holder, lo, hi)`` ranges of expert e's line, owner first then by rank (slow)."""
    owner = int(control.owner[e])
    holders = [owner] + [g for g in range(control.ep_size) if g != owner]
    out, at = [], 0
    for g in holders:
        a = int(control.forward_load[e, g])
        out.append((g, at, at + a))
        at += a
    return out


def _instances(control, g: int) -> list[int]:
    num_owned = control.num_local_experts
    owned = list(range(g * num_owned, (g + 1) * num_owned))
    replicas = [
        e
        for e in range(control.counts.shape[1])
        if bool(control.holds[e, g]) and int(control.owner[e]) != g
    ]
    return owned + replicas


def _slow_send_order(control, r: int) -> list[int]:
    """Source r's pairs (pair-order positions) in send order, walking the line rule."""
    n = control.counts
    seg_start = [int(n[r, :e].sum()) for e in range(n.shape[1])]
    order = []
    for g in range(control.ep_size):
        for e in _instances(control, g):
            chunk_lo = int(n[:r, e].sum())
            for holder, lo, hi in _holder_line(control, e):
                if holder != g:
                    continue
                a, b = max(lo, chunk_lo), min(hi, chunk_lo + int(n[r, e]))
                order += [seg_start[e] + i - chunk_lo for i in range(a, b)]
    return order


def _slow_kept_order(control, r: int, kept: list[int], save: bool) -> list[int]:
    """Source r's kept pairs in exchange order: per destination and instance, the kept pairs
    the plan sends there (save: those inside the holder's forward sub-chunk; recompute: the
    expert's kept pairs split over holders in line order)."""
    n = control.counts
    bsc = control.backward_send_counts(r)
    send = _slow_send_order(control, r)
    holder_of = {}
    at = 0
    for g in range(control.ep_size):  # which forward holder got each pair
        for e in _instances(control, g):
            k = int(control.forward_send_counts(r)[e, g])
            for p in send[at : at + k]:
                holder_of[p] = g
            at += k
    seg_start = [int(n[r, :e].sum()) for e in range(n.shape[1])]
    per_expert = {
        e: [p for p in kept if seg_start[e] <= p < seg_start[e] + int(n[r, e])]
        for e in range(n.shape[1])
    }
    order = []
    for g in range(control.ep_size):
        for e in _instances(control, g):
            if save:
                order += [p for p in per_expert[e] if holder_of[p] == g]
            else:
                owner = int(control.owner[e])
                line = [owner] + [h for h in range(control.ep_size) if h != owner]
                start = sum(int(bsc[e, h]) for h in line[: line.index(g)])
                order += per_expert[e][start : start + int(bsc[e, g])]
    return order


def _plans(seed: int):
    """Synthetic calls: (counts hint, tokens per rank, topk) with hot experts and degenerate
    loads (everything on one expert, a rank without tokens)."""
    yield [[8, 1, 1, 1, 1, 1, 1, 1]] * 2, [12, 10], 2
    yield [[1, 1, 1, 1, 9, 9, 1, 1]] * 4, [10, 0, 7, 9], 2
    yield [[1] + [1e-9] * 7] * 4, [6, 6, 6, 6], 1  # one expert takes everything
    yield [[5, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]] * 3, [9, 11, 0], 3
    gen = random.Random(seed)
    for _ in range(4):
        p = gen.choice([2, 3, 4])
        e = p * gen.choice([1, 2, 3])
        hint = [[gen.random() ** 3 + 0.01 for _ in range(e)] for _ in range(p)]
        yield hint, [gen.randint(0, 12) for _ in range(p)], gen.choice([1, 2])


@pytest.mark.parametrize("mode", ["save", "recompute"])
def test_layout_matches_slow_walk_of_the_plan(mode: str) -> None:
    placed = 0
    for case, (hint, tokens, topk) in enumerate(_plans(seed=11)):
        maps = _routing_maps(hint, tokens, topk, seed=case)
        counts = torch.stack([m.sum(0) for m in maps]).to(torch.int64)
        lrmoe = LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=2, activation_mode=mode)
        for r, routing_map in enumerate(maps):
            control = plan_call(counts, r, lrmoe, check=True)
            if control.num_replicas == 0:
                continue
            placed += 1
            perm = PairPermutation.build(routing_map, int(counts[r].sum()), topk)
            layout = ReplicaLayout.build(control, perm)
            send = _slow_send_order(control, r)
            assert layout.send_perm.tolist() == send, f"case {case} rank {r}"
            assert torch.equal(layout.token_of_send, perm.token_of_pair[layout.send_perm])
            for t, k in zip(*torch.nonzero(perm.slot_pair >= 0, as_tuple=True)):
                assert send[int(layout.slot_send[t, k])] == int(perm.slot_pair[t, k])
            assert layout.instances.tolist() == _instances(control, r)
            for s in range(control.ep_size):  # what this rank receives from every source
                want = [int(control.forward_send_counts(s)[e, r]) for e in _instances(control, r)]
                assert layout.recv_counts[s].tolist() == want
            # Kept pairs per the plan's backward split; the first ones of each segment.
            bsc = control.backward_send_counts(r)
            if mode == "save":
                counts_seg, quota_seg, start_seg = layout.selection_segments(control)
                assert torch.equal(start_seg, torch.cumsum(counts_seg, 0) - counts_seg)
                assert int(counts_seg.sum()) == int(counts[r].sum())
                assert bool((quota_seg <= counts_seg).all())
                kept = [
                    int(s) + i for s, q in zip(start_seg.tolist(), quota_seg.tolist())
                    for i in range(q)
                ]
            else:
                seg_start = torch.cumsum(counts[r], 0) - counts[r]
                kept = [
                    int(seg_start[e]) + 2 * i
                    for e in range(counts.shape[1])
                    for i in range(int(bsc[e].sum()))
                ]
            kept_layout = layout.kept_layout(bsc, control.backward_recv_counts(r))
            got = torch.tensor(kept)[kept_layout.send_index].tolist() if kept else []
            assert got == _slow_kept_order(control, r, kept, mode == "save")
            assert kept_layout.send_totals.sum() == len(kept)
    assert placed >= 6, "the synthetic plans should place replicas"


def test_two_weight_stacks_equal_one_concatenated_stack() -> None:
    gen = torch.Generator().manual_seed(0)
    spec = GluSpec(gated=True, kind="silu")
    h, f = 8, 4
    counts_a, counts_b = [3, 0, 2], [4, 1]
    n = sum(counts_a) + sum(counts_b)
    x = torch.randn(n, h, generator=gen)
    dz = torch.randn(n, h, generator=gen)
    probs = torch.rand(n, generator=gen)
    w1 = torch.randn(5, 2 * f, h, generator=gen)
    w2 = torch.randn(5, h, f, generator=gen)
    stacks = [(w1[:3], w2[:3]), (w1[3:].clone(), w2[3:].clone())]
    z, hh = expert_forward(x, w1, w2, counts_a + counts_b, spec, probs)
    z2, hh2 = expert_forward_parts(x, stacks, [counts_a, counts_b], spec, probs)
    torch.testing.assert_close(z2, z, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(hh2, hh, rtol=RTOL, atol=ATOL)
    for saved in (hh, None):
        dx, dw1, dw2, dp = expert_backward(dz, x, saved, w1, w2, counts_a + counts_b, spec, probs)
        dx2, dw1s, dw2s, dp2 = expert_backward_parts(
            dz, x, saved, stacks, [counts_a, counts_b], spec, probs
        )
        torch.testing.assert_close(dx2, dx, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.cat(dw1s), dw1, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.cat(dw2s), dw2, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(dp2, dp, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------------------------- #
# Layers over gloo.
# --------------------------------------------------------------------------------------------- #

R = rw.REPLICAS
CHECK = dict(debug_check_invariants=True)
NO_AUX = dict(moe_aux_loss_coeff=0.0)

KEEP1 = {
    2: [
        (dict(moe_router_topk=2, moe_aux_loss_coeff=0.0), "hot_expert0"),
        (dict(moe_router_topk=4, moe_shared_expert_intermediate_size=40), "hot_expert0"),
        (dict(moe_router_topk=1, moe_router_pre_softmax=True), "one_expert"),
    ],
    4: [
        (dict(moe_router_topk=2), "hot_expert0"),
        (dict(moe_router_topk=4, moe_aux_loss_coeff=0.0), "hot_expert0"),
    ],
    8: [(dict(moe_router_topk=2), "hot_expert0")],  # one expert per rank
}


def _dense(keep: float, routing: str, topk: int = 2, **kwargs) -> tuple:
    overrides = dict(NO_AUX, moe_router_topk=topk)
    if topk == 1:
        overrides["moe_router_pre_softmax"] = True
    return (dict(keep_ratio=keep, max_replicas_per_rank=R, **CHECK, **kwargs), overrides, routing)


DENSE = {
    2: [
        _dense(0.5, "hot_expert0"),
        _dense(0.5, "hot_expert0", topk=4, selection="topk"),
        _dense(0.5, "hot_expert0", activation_mode="recompute"),
        _dense(0.4, "hot_expert0", topk=4, activation_mode="auto"),
        # Budgets with replicas: a binding exchange budget at keep 1 (the trimmed path runs), a
        # binding memory budget, and one under which auto resolves to recompute.
        _dense(1.0, "hot_expert0", exchange_budget_bytes=2048),
        _dense(0.5, "hot_expert0", memory_budget_bytes=75_000),
        _dense(0.5, "hot_expert0", memory_budget_bytes=70_000, activation_mode="auto"),
        # Degenerate loads.
        _dense(0.5, "one_expert", topk=1),
        _dense(0.6, "first_rank_only", selection="topk"),
        _dense(0.5, "idle_last_rank"),
        _dense(1.0, "idle_last_rank"),
        _dense(0.0, "hot_expert0"),
        _dense(1e-6, "hot_expert0", activation_mode="recompute"),
    ],
    4: [
        _dense(0.5, "hot_expert0"),
        _dense(0.3, "hot_expert0", topk=4, selection="topk", activation_mode="recompute"),
        _dense(0.5, "one_expert", topk=1),
        _dense(0.5, "idle_last_rank", topk=4),
    ],
    8: [
        _dense(0.5, "hot_expert0"),
        _dense(0.5, "hot_expert0", topk=4, activation_mode="recompute"),
    ],
}

ON_OFF = [
    dict(keep_ratio=0.5, activation_mode="recompute"),
    dict(keep_ratio=0.3, activation_mode="recompute", selection="topk"),
]


CHECKPOINT = [dict(keep_ratio=0.5), dict(keep_ratio=0.5, activation_mode="recompute")]


FUSED = [dict(keep_ratio=1.0), dict(keep_ratio=0.5)]


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    # "dense" first: test_deterministic_across_ranks_and_runs reruns its first cases alone.
    sections = {
        "dense": DENSE[2],
        "keep1": KEEP1[2],
        "on_off": ON_OFF,
        "cache": [{}],
        "checkpoint": CHECKPOINT,
        "fused": FUSED,
    }
    return run_distributed(rw.suite, 2, 2, sections, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def ep4() -> list[dict]:
    sections = {"keep1": KEEP1[4], "dense": DENSE[4]}
    return run_distributed(rw.suite, 4, 4, sections, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def ep8() -> list[dict]:
    sections = {"keep1": KEEP1[8], "dense": DENSE[8]}
    return run_distributed(rw.suite, 8, 8, sections, timeout=TIMEOUT_S)


@pytest.fixture
def by_ep(request) -> list[dict]:
    """The results of the parametrized test's EP size (each size runs once per module)."""
    return request.getfixturevalue(f"ep{request.node.callspec.params['ep']}")


def _close(diff: float, scale: float) -> bool:
    return diff <= RTOL * max(scale, 1e-12) + ATOL


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_keep1_with_replicas_equals_without_and_stock(ep: int, by_ep) -> None:
    for rank, result in enumerate(by_ep):
        for d in result["keep1"]:
            where = f"EP {ep} rank {rank} {d['case']}"
            assert d["summary"]["replicas"] > 0, f"{where}: no replica placed"
            for against in ("vs_stock", "vs_plain"):
                for key, diff in d[against].items():
                    assert _close(diff, d["scales"][key]), f"{where} {against} {key}: {diff:.2e}"


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_trimmed_with_replicas_matches_dense_reference(ep: int, by_ep) -> None:
    per_rank = [result["dense"] for result in by_ep]
    _assert_matches_reference(per_rank)
    _check_counts(per_rank)  # kept pairs per expert == quota; exchanged rows == kept rows
    placed = [d["replicas"]["placed"] for d in per_rank[0]]
    routings = [d["case"][2] for d in per_rank[0]]
    for p, routing in zip(placed, routings):
        if routing in ("hot_expert0", "first_rank_only", "one_expert"):
            assert p > 0, f"EP {ep} {routing}: no replica placed"


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_loads_are_what_the_controller_planned(ep: int, by_ep) -> None:
    """Per rank: forward and kept rows per instance == the plan; kept load within the planned
    peak; no replica in backward that was not placed in forward (and, in save mode, none
    beyond the pairs it computed in forward)."""
    for rank, result in enumerate(by_ep):
        for d in result["dense"]:
            f = d["replicas"]
            where = f"EP {ep} rank {rank} {d['case'][0]} {d['case'][2]}"
            holds, fwd, bwd = f["holds"], f["forward_load"], f["backward_load"]
            num_owned = holds.shape[0] // ep
            owned = list(range(rank * num_owned, (rank + 1) * num_owned))
            held = [e for e in range(holds.shape[0]) if holds[e, rank] and e not in owned]
            assert f["experts"] == held, where
            assert f["forward_per_replica"] == [int(fwd[e, rank]) for e in f["experts"]], where
            assert f["forward_rows"] == int(fwd[:, rank].sum()) <= f["planned_forward_peak"], where
            assert f["kept_rows"] == int(bwd[:, rank].sum()) <= f["planned_backward_peak"], where
            assert f["kept_per_replica"] == [int(bwd[e, rank]) for e in f["experts"]], where
            assert f["kept_per_local_expert"] == [int(bwd[e, rank]) for e in owned], where
            assert not bool(bwd[~holds].any()), f"{where}: backward on a rank without the expert"
            assert f["replica_grad_rows"] == len(f["experts"]), f"{where}: replica grads sent"
            if f["activation_mode"] == "save":
                assert bool((bwd <= fwd).all()), f"{where}: kept pairs beyond the saved ones"


def test_recompute_selects_the_same_pairs_with_and_without_replicas(ep2) -> None:
    for rank, result in enumerate(ep2):
        for d in result["on_off"]:
            assert d["placed"] > 0 and d["same_mask"], f"rank {rank} {d['case']}"
            for key, diff in d["diffs"].items():
                assert _close(diff, d["scales"][key]), f"rank {rank} {d['case']} {key}: {diff:.2e}"


def test_fused_accumulation_adds_replica_gradients_into_main_grad(ep2) -> None:
    """``grad_accumulation_fusion="on"`` with replicas: each weight's ``main_grad`` gains what
    the unfused layer returns (own gradient plus every replica's, folded in), or holds exactly
    that where the weight has ``overwrite_main_grad`` (a NaN start never read), and the layer
    marks it ``grad_added_to_main_grad`` (the unfused one does not)."""
    for rank, result in enumerate(ep2):
        for d in result["fused"]:
            where = f"rank {rank} {d['case']}"
            assert d["placed"] > 0, f"{where}: no replica placed"
            assert d["flags"] == [True, True, False, False, True, True], where
            for diff, scale in zip(d["diffs"], d["scales"]):
                assert _close(diff, scale), f"{where}: {diff:.2e} (scale {scale:.2e})"


def test_replica_weights_are_fetched_once_per_step_and_never_part_of_the_model(ep2) -> None:
    for rank, result in enumerate(ep2):
        (f,) = result["cache"]
        assert f["placed"] > 0
        assert all(f["equal"].values()), f"rank {rank}: stale replica weights {f['equal']}"
        fetched = f["fetched"]
        for tag in ("no_step_1", "no_step_2", "step5_first", "step5_no_grad", "step6_first"):
            assert fetched[tag] > 0, f"rank {rank}: {tag} should fetch ({fetched})"
        assert fetched["step6_after_load"] > 0, "load_state_dict must drop cached replicas"
        for tag in ("step5_again", "step5_after_no_grad", "step6_again"):
            assert fetched[tag] == 0, f"rank {rank}: {tag} should reuse the cache ({fetched})"
        assert f["state_keys"] and f["param_names"] and f["buffer_names"], f
        assert f["cache_outside_state"], f
    assert sum(sum(r["cache"][0]["cached_replicas"]) for r in ep2) > 0, "no rank cached a replica"


def test_activation_checkpointing_uses_the_same_replicas_and_pairs(ep2) -> None:
    """Megatron's MoE recompute and torch's reentrant / non-reentrant checkpoints: the same
    kept pairs and gradients as without checkpointing, with replicas placed."""
    for rank, result in enumerate(ep2):
        for case, modes in zip(CHECKPOINT, result["checkpoint"]):
            plain = modes["plain"]
            assert len(plain["kept"]) == 2 and all(p > 0 for p in plain["placed"]), case
            for mode, got in modes.items():
                where = f"rank {rank} {case} {mode}"
                assert len(got["kept"]) == 2, where
                for a, b in zip(plain["kept"], got["kept"]):
                    assert torch.equal(a, b), f"{where}: other pairs kept"
                for key in ("router", "fc1", "fc2"):
                    torch.testing.assert_close(got[key], plain[key], rtol=1e-6, atol=1e-9)
                for a, b in zip(plain["dx"], got["dx"]):
                    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)


def test_deterministic_across_ranks_and_runs(ep2) -> None:
    again = run_distributed(rw.suite, 2, 2, {"dense": DENSE[2][:3]}, timeout=TIMEOUT_S)
    for first, second in zip(ep2, again):
        for a, b in zip(first["dense"], second["dense"]):
            assert torch.equal(a["kept_mask"], b["kept_mask"]), a["case"]
            assert torch.equal(a["w1_grad"], b["w1_grad"]), a["case"]
    for i, d0 in enumerate(ep2[0]["dense"]):
        for other in ep2[1:]:  # every rank planned the same call
            d = other["dense"][i]
            assert _same_plan(d["control"], d0["control"])
            assert torch.equal(d["replicas"]["holds"], d0["replicas"]["holds"])
            assert torch.equal(d["replicas"]["backward_load"], d0["replicas"]["backward_load"])


def _same_plan(a: dict, b: dict) -> bool:
    """Control summaries equal except the planner's wall time."""
    skip = {"planner_time_us"}
    return {k: v for k, v in a.items() if k not in skip} == {
        k: v for k, v in b.items() if k not in skip
    }


def test_training_with_replicas_equals_without() -> None:
    """Megatron DDP + the Megatron optimizer at keep 1.0, two steps of two micro-batches: the
    same losses and weights with replicas on and off; replicas were placed, fetched once per
    step and reused by the second micro-batch; the optimizer holds the same parameters."""
    results = run_distributed(rw.training_on_off, 2, 2, timeout=TIMEOUT_S)
    for rank, out in enumerate(results):
        off, on = out["off"], out["on"]
        assert len(on["losses"]) == 2
        for a, b in zip(on["losses"] + on["valid"], off["losses"] + off["valid"]):
            assert math.isclose(a, b, rel_tol=RTOL), (rank, on["losses"], off["losses"])
        assert on["state"].keys() == off["state"].keys()
        for key, value in off["state"].items():
            diff = (on["state"][key] - value).abs().max().item()
            assert diff <= RTOL * max(value.abs().max().item(), 1e-12), f"rank {rank} {key}"
        assert on["optimizer_params"] == off["optimizer_params"]
        placed = [p for p, _ in on["calls"]]
        assert sum(placed) > 0, f"rank {rank}: no replica placed in training"
        assert any(f == 0 and p > 0 for p, f in on["calls"]), "no call reused cached replicas"
