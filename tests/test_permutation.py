"""Gather-based pair permutation against Megatron's own permute / unpermute (the reference).

The op moves rows with ``tokens.index_select(0, token_of_pair)`` (tokens -> pairs) and
``gather_sum(rows, slot_pair)`` (pairs -> tokens, the combine and the dispatch's input gradient);
the references are Megatron's ``permute`` / ``unpermute`` and their autograd.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from megatron_lrmoe.dispatch.permutation import PairPermutation, _slot_pair_by_rank, permute_probs
from megatron_lrmoe.dispatch.rows import gather_sum, pack_pairs


def _routing(t: int, e: int, k: int, incomplete: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=gen)
    idx = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    if incomplete:  # some tokens routed to fewer than k experts (e.g. padding)
        routing_map[::3, idx[::3, 0]] = False
    return routing_map


@pytest.mark.parametrize("t, e, k", [(1, 4, 1), (16, 8, 2), (33, 16, 4), (5, 4, 4)])
@pytest.mark.parametrize("incomplete", [False, True])
def test_matches_megatron_permute(t: int, e: int, k: int, incomplete: bool) -> None:
    if incomplete and k == 1 and t == 1:
        pytest.skip("would route nothing")
    routing_map = _routing(t, e, k, incomplete, seed=t * 100 + e)
    s = int(routing_map.sum())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, 12, generator=gen, dtype=torch.float64)
    probs = torch.rand(t, e, generator=gen, dtype=torch.float64) * routing_map
    w = torch.randn(s, 12, generator=gen, dtype=torch.float64)
    g = torch.randn(t, 12, generator=gen, dtype=torch.float64)

    x_ref, p_ref = x.clone().requires_grad_(), probs.clone().requires_grad_()
    rows_ref, probs_perm_ref, mapping, _, _ = permute(x_ref, routing_map, probs=p_ref, num_out_tokens=s)
    out_ref = unpermute(rows_ref * w, mapping, restore_shape=x.shape, routing_map=routing_map)
    ((out_ref * g).sum() + (probs_perm_ref * torch.arange(s)).sum()).backward()

    perm = PairPermutation.build(routing_map, s, k)
    assert perm.num_pairs == s and perm.slot_pair.shape == (t, k)
    p_new = probs.clone().requires_grad_()
    rows = x.index_select(0, perm.token_of_pair)
    probs_perm = permute_probs(p_new, perm)
    out = gather_sum(rows * w, perm.slot_pair)
    (probs_perm * torch.arange(s)).sum().backward()
    # The permute's input gradient: each token adds up its pairs' gradient rows (here those of
    # ``(out * g).sum()``: the token gradient gathered to every pair, times w).
    dx = gather_sum(g.index_select(0, perm.token_of_pair) * w, perm.slot_pair)

    assert torch.equal(rows, rows_ref.detach())
    assert torch.equal(probs_perm, probs_perm_ref.detach())
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p_new.grad, p_ref.grad, rtol=1e-12, atol=1e-12)


def test_slot_rows_and_scaled_gather_sum() -> None:
    """Kept rows go back to their tokens; dropped pairs and empty slots add nothing."""
    routing_map = _routing(9, 6, 3, incomplete=True, seed=5)
    s = int(routing_map.sum())
    perm = PairPermutation.build(routing_map, s, 3)
    gen = torch.Generator().manual_seed(2)
    pair_rows = torch.randn(s, 5, generator=gen, dtype=torch.float64)
    scale = torch.rand(s, generator=gen, dtype=torch.float64)
    kept = torch.tensor([i for i in range(s) if i % 3 != 1])
    got = gather_sum(pair_rows[kept], perm.slot_rows(kept))
    want = torch.zeros(9, 5, dtype=torch.float64)
    got_scaled = gather_sum(pair_rows, perm.slot_pair, scale=scale)
    want_scaled = torch.zeros(9, 5, dtype=torch.float64)
    for i in range(s):
        t = int(perm.token_of_pair[i])
        want_scaled[t] += scale[i] * pair_rows[i]
        if i % 3 != 1:
            want[t] += pair_rows[i]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_scaled, want_scaled, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("incomplete", [False, True], ids=["full", "empty_slots"])
@pytest.mark.parametrize("keep", [0, 1, 7, None], ids=["none", "one", "some", "all"])
def test_row_of_pair_from_packing_matches_slot_rows(incomplete: bool, keep: int | None) -> None:
    """The trimmed backward's return path: ``pack_pairs`` records each packed pair's row, and
    ``gather_sum(rows, slot_pair, row_of=...)`` equals ``gather_sum`` on ``slot_rows``."""
    t, e, k, h = 11, 6, 3, 5
    routing_map = _routing(t, e, k, incomplete, seed=7)
    s = int(routing_map.sum())
    perm = PairPermutation.build(routing_map, s, k)
    assert perm.full == (not incomplete)
    gen = torch.Generator().manual_seed(3)
    kept = torch.randperm(s, generator=gen)[: s if keep is None else keep]  # exchange order
    g = torch.randn(t, h, generator=gen, dtype=torch.float64)
    probs = torch.rand(s, generator=gen).double()  # fp32 values: the packing scales in fp32
    weight = torch.ones(kept.numel())
    row_of_pair = torch.full((s + 1,), -1, dtype=torch.int64)
    packed, _ = pack_pairs(g, perm.token_of_pair, kept, probs, weight, row_of_pair=row_of_pair)
    assert int(row_of_pair[s]) == -1 and int((row_of_pair >= 0).sum()) == kept.numel()
    assert torch.equal(row_of_pair[kept], torch.arange(kept.numel()))
    rows = torch.randn(kept.numel(), h, generator=gen, dtype=torch.float64)
    got = gather_sum(rows, perm.slot_pair, row_of=row_of_pair)
    assert torch.equal(got, gather_sum(rows, perm.slot_rows(kept)))
    # Round trip: each token gets back p * g_t once per kept pair of its own.
    back = gather_sum(packed, perm.slot_pair, row_of=row_of_pair)
    kept_p = torch.zeros(s, dtype=torch.float64).index_copy_(0, kept, probs[kept])
    per_token = torch.zeros(t, dtype=torch.float64).index_add_(0, perm.token_of_pair, kept_p)
    torch.testing.assert_close(back, g * per_token[:, None], rtol=1e-12, atol=1e-12)


def test_too_many_pairs_per_token_is_an_error() -> None:
    routing_map = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="more than moe_router_topk"):
        PairPermutation.build(routing_map, 12, 2)


@pytest.mark.parametrize("t, e, k", [(1, 4, 1), (33, 16, 4), (64, 128, 8)])
def test_complete_routing_slot_plan_equals_the_general_one(t: int, e: int, k: int) -> None:
    """The sort-based plan for tokens with exactly K pairs is the general rank-based plan."""
    routing_map = _routing(t, e, k, incomplete=False, seed=3)
    perm = PairPermutation.build(routing_map, t * k, k)
    general = _slot_pair_by_rank(routing_map, perm.token_of_pair, perm.expert_of_pair, k)
    assert torch.equal(perm.slot_pair, general)
