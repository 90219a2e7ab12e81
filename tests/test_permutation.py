"""Gather-based pair permutation against Megatron's own permute / unpermute (the reference)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from megatron_lrmoe.dispatch.permutation import PairPermutation, PermuteTokens, UnpermutePairs, permute_probs


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
    assert perm.complete == (not incomplete or s == t * k)
    x_new, p_new = x.clone().requires_grad_(), probs.clone().requires_grad_()
    rows = PermuteTokens.apply(x_new, perm)
    probs_perm = permute_probs(p_new, perm)
    out = UnpermutePairs.apply(rows * w, perm)
    ((out * g).sum() + (probs_perm * torch.arange(s)).sum()).backward()

    assert torch.equal(rows, rows_ref.detach())
    assert torch.equal(probs_perm, probs_perm_ref.detach())
    torch.testing.assert_close(out, out_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_new.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p_new.grad, p_ref.grad, rtol=1e-12, atol=1e-12)


def test_too_many_pairs_per_token_is_an_error() -> None:
    routing_map = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="more than moe_router_topk"):
        PairPermutation.build(routing_map, 12, 2)
