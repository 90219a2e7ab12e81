"""Which pairs an LRMoE layer keeps, decided again from first principles (CPU, gloo).

A real layer runs forward and the backward of ``sum(out * U)``, so ``dL/d out_t = U_t`` is known;
its router output and the input are captured. The references in ``selection_reference`` then
recompute every pair's score as ``||(p g_t) x_t^T||_F^2`` from the materialised outer product,
the quotas ``ceil(keep * N[e])`` and their largest-remainder split over sources with Python
integers, and decide top-k by sorting or the capped-PPS inclusion probabilities by a float64
iteration. The layer's recorded kept pairs and weights (``last_call_stats``) must agree: exactly
for ``topk``; for ``sample`` every kept count equals its quota and ``1 / weight`` equals the
reference probability to 1e-6 relative. A last test checks that ``sample``'s expert-weight and
input gradients, averaged over seeds, converge to the exact ones at the ``1/sqrt(N)`` rate.
"""

from __future__ import annotations

import math

import pytest
import torch

import selection_reference as ref
from megatron_lrmoe.testing import run_distributed

TIMEOUT_S = 240.0
# fp32 scores and weights against float64 references: a few fp32 roundings plus the selection's
# 2**-32 fixed-point grid; well below any difference a scoring or sampling bug makes.
PI_RTOL = 1e-6
# Top-k boundaries closer than this (relative) could flip under fp32 rounding: the problem, not
# the layer, would be at fault, so such a case fails as ill-posed.
MIN_TOPK_GAP = 1e-5


def _check_against_reference(per_rank: list[dict]) -> dict[str, int]:
    """Assert the layer's selection on every rank equals the first-principles one.

    Returns coverage counts (segments checked, capped and uncapped sampled pairs).
    """
    case = per_rank[0]["case"]
    lrmoe = case["lrmoe"]
    keep = lrmoe["keep_ratio"]
    selection = lrmoe.get("selection", "sample")
    scope = lrmoe.get("scope", "local")
    ep = len(per_rank)
    num_experts = per_rank[0]["routing_map"].shape[1]
    tag = f"{case} EP={ep}"

    pairs = [ref.pairs_in_send_order(d["routing_map"]) for d in per_rank]
    scores = [
        ref.explicit_scores(d["x"], d["grad_out"], d["probs"], d["routing_map"]).tolist()
        for d in per_rank
    ]
    counts = [[experts.count(e) for e in range(num_experts)] for experts, _ in pairs]
    n_per_expert = [sum(counts[r][e] for r in range(ep)) for e in range(num_experts)]
    quota = ref.reference_quotas(n_per_expert, keep)
    for rank, d in enumerate(per_rank):
        assert d["tokens_per_expert"] == n_per_expert, f"{tag} rank {rank}: N"
        assert d["quota_per_expert"] == quota, f"{tag} rank {rank}: quotas"
        assert d["kept_weight"].shape == (len(pairs[rank][0]),), f"{tag} rank {rank}: [S]"
        assert torch.equal(d["kept_mask"], d["kept_weight"] > 0), f"{tag} rank {rank}: mask"

    # Segments compete for one quota: (source, expert) for scope local, expert for global.
    # Rows are (source rank, position in its send order), in canonical (source, token) order.
    segments: list[tuple[str, int, list[tuple[int, int]]]] = []
    if scope == "local" or ep == 1:
        share = ref.reference_hamilton(counts, quota)
        for r in range(ep):
            for e in range(num_experts):
                rows = [(r, i) for i, pe in enumerate(pairs[r][0]) if pe == e]
                segments.append((f"source {r} expert {e}", share[r][e], rows))
    else:
        for e in range(num_experts):
            rows = [(r, i) for r in range(ep) for i, pe in enumerate(pairs[r][0]) if pe == e]
            segments.append((f"expert {e}", quota[e], rows))

    coverage = {"segments": 0, "capped": 0, "uncapped": 0}
    for label, q, rows in segments:
        if not rows:
            continue
        coverage["segments"] += 1
        seg_scores = [scores[r][i] for r, i in rows]
        weights = [float(per_rank[r]["kept_weight"][i]) for r, i in rows]
        kept = [w > 0 for w in weights]
        where = f"{tag}: {label} (quota {q} of {len(rows)})"
        assert sum(kept) == q, f"{where}: kept {sum(kept)} pairs"
        if selection == "topk":
            gap = ref.topk_boundary_gap(seg_scores, q)
            assert gap > MIN_TOPK_GAP, f"{where}: near-tie at the boundary ({gap:.2e}), reseed"
            expected = ref.reference_topk(seg_scores, q)
            got = {j for j, k in enumerate(kept) if k}
            assert got == expected, f"{where}: kept {sorted(got)}, reference {sorted(expected)}"
            assert all(w == 1.0 for w, k in zip(weights, kept) if k), f"{where}: topk weight"
        else:
            pi = ref.reference_capped_pps(seg_scores, q)
            for j, (p, w, k) in enumerate(zip(pi, weights, kept)):
                if p >= 1.0:
                    coverage["capped"] += 1
                    assert k and w == 1.0, f"{where}: pair {j} has probability 1, weight {w}"
                else:
                    coverage["uncapped"] += 1
                if k:
                    assert abs(1.0 / w - p) <= PI_RTOL * p, (
                        f"{where}: pair {j} kept with 1/weight {1.0 / w:.9g}, reference "
                        f"probability {p:.9g}"
                    )

    # The rest of the public statistics, counted from the masks.
    local = per_rank[0]["num_local_experts"]
    for rank, d in enumerate(per_rank):
        kept_sent = int(d["kept_mask"].sum())
        assert d["kept_pairs_sent"] == kept_sent, f"{tag} rank {rank}: kept_pairs_sent"
        assert d["kept_ratio"] == pytest.approx(kept_sent / max(d["pairs_sent"], 1), abs=1e-12)
        mine = range(rank * local, (rank + 1) * local)
        kept_here = [
            sum(
                int(m)
                for r in range(ep)
                for pe, m in zip(pairs[r][0], per_rank[r]["kept_mask"].tolist())
                if pe == e
            )
            for e in mine
        ]
        assert d["kept_per_local_expert"] == kept_here, f"{tag} rank {rank}: kept per expert"
    return coverage


def _check_all(results: list[list[dict]]) -> dict[str, int]:
    total = {"segments": 0, "capped": 0, "uncapped": 0}
    for i in range(len(results[0])):
        for key, value in _check_against_reference([rank[i] for rank in results]).items():
            total[key] += value
    return total


EP1_CASES = [
    dict(lrmoe=dict(keep_ratio=0.5, selection="topk"), tokens=48, seed=1),
    dict(lrmoe=dict(keep_ratio=0.25, selection="topk", activation_mode="recompute"), tokens=48,
         seed=2),
    dict(lrmoe=dict(keep_ratio=0.75, selection="topk"), tokens=48, seed=3),
    dict(lrmoe=dict(keep_ratio=0.5, selection="sample"), tokens=48, seed=1),
    dict(lrmoe=dict(keep_ratio=0.3, selection="sample", seed=77), tokens=48, seed=2),
    dict(lrmoe=dict(keep_ratio=0.75, selection="sample", activation_mode="recompute"),
         tokens=48, seed=3),
]

EP2_CASES = [
    dict(lrmoe=dict(keep_ratio=0.5, selection="topk", scope="local"), tokens=32, seed=4),
    dict(lrmoe=dict(keep_ratio=0.4, selection="topk", scope="global"), tokens=32, seed=5),
    dict(lrmoe=dict(keep_ratio=0.5, selection="sample", scope="local"), tokens=32, seed=4),
    dict(lrmoe=dict(keep_ratio=0.3, selection="sample", scope="local", seed=5), tokens=32,
         seed=6),
    dict(lrmoe=dict(keep_ratio=0.5, selection="sample", scope="global",
                    activation_mode="recompute"), tokens=32, seed=5),
]


def test_selection_matches_first_principles_ep1() -> None:
    results = run_distributed(ref.selection_cases, 1, EP1_CASES, timeout=TIMEOUT_S)
    coverage = _check_all(results)
    # The cases must exercise both branches of capped PPS, or the check above proves little.
    assert coverage["capped"] > 0 and coverage["uncapped"] > 0, coverage


def test_selection_matches_first_principles_ep2() -> None:
    """Two gloo ranks: the quota split over sources (local) and the owner's choice (global)."""
    results = run_distributed(ref.selection_cases, 2, EP2_CASES, timeout=TIMEOUT_S)
    coverage = _check_all(results)
    assert coverage["capped"] > 0 and coverage["uncapped"] > 0, coverage


# --------------------------------------------------------------------------------------------- #
# The references themselves, on cases small enough to check by hand.
# --------------------------------------------------------------------------------------------- #


def test_reference_quotas_and_split_by_hand() -> None:
    assert ref.reference_quotas([10, 3, 0, 7], 0.3) == [3, 1, 0, 3]
    assert ref.reference_quotas([4, 5], 1.0) == [4, 5]
    # Expert 0: Q=3 over N=(1, 1, 1): floors 1,1,1. Expert 1: Q=2 over (1, 1, 1): floors 0, all
    # remainders 2, so ranks 0 and 1 win the tie. Expert 2: Q=3 over (5, 1, 0): 15/6 -> 2 r3,
    # 3/6 -> 0 r3: leftover 1 goes to the lower rank of the tie.
    counts = [[1, 1, 5], [1, 1, 1], [1, 1, 0]]
    assert ref.reference_hamilton(counts, [3, 2, 3]) == [[1, 1, 3], [1, 1, 0], [1, 0, 0]]


def test_reference_capped_pps_by_hand() -> None:
    # sqrt-weights 4, 1, 1, 1, 1 with quota 2: 2*4/8 = 1 -> capped; the rest share 1 equally.
    pi = ref.reference_capped_pps([16.0, 1.0, 1.0, 1.0, 1.0], 2)
    assert pi == pytest.approx([1.0, 0.25, 0.25, 0.25, 0.25], abs=1e-15)
    # Capping cascades: weights 10, 9, 1, 1 with quota 3: both large ones capped, then 1/2 each.
    pi = ref.reference_capped_pps([100.0, 81.0, 1.0, 1.0], 3)
    assert pi == pytest.approx([1.0, 1.0, 0.5, 0.5], abs=1e-15)
    assert sum(ref.reference_capped_pps([3.0, 2.0, 0.5, 7.0, 1.0], 2)) == pytest.approx(2.0)


def test_explicit_score_is_the_outer_product_norm_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0], [0.0, 3.0]])
    g = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    probs = torch.tensor([[0.5, 0.0, 0.5], [0.0, 0.25, 0.75]])
    routing_map = probs > 0
    # Send order: (e0, t0), (e1, t1), (e2, t0), (e2, t1).
    got = ref.explicit_scores(x, g, probs, routing_map).tolist()
    want = [0.25 * 4 * 5, 0.0625 * 2 * 9, 0.25 * 4 * 5, 0.5625 * 2 * 9]
    assert got == pytest.approx(want, rel=1e-15)


# --------------------------------------------------------------------------------------------- #
# Unbiasedness: mean of sampled gradients -> exact gradients, error ~ 1/sqrt(N).
# --------------------------------------------------------------------------------------------- #

DRAWS = 400
BLOCK = 25


def _relative_errors(block_sums: torch.Tensor, exact: torch.Tensor) -> dict[int, float]:
    """RMS over disjoint groups of blocks of ``||mean_N - exact|| / ||exact||`` for each N."""
    errors = {}
    blocks = block_sums.shape[0]
    for per_group in (1, 4, 16):
        n = per_group * BLOCK
        groups = block_sums.reshape(blocks // per_group, per_group, -1).sum(1) / n
        err = (groups - exact).norm(dim=1) / exact.norm()
        errors[n] = float(err.square().mean().sqrt())
    return errors


def _slope(errors: dict[int, float]) -> float:
    """Least-squares slope of log(error) against log(N)."""
    xs = [math.log(n) for n in errors]
    ys = [math.log(e) for e in errors.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def test_sampled_gradients_converge_to_exact_at_inverse_sqrt_rate() -> None:
    """Expert-weight and input gradients averaged over N seeds: error ~ N**-0.5, router exact.

    Errors for N = 25 and 100 are RMS over the 16 and 4 disjoint groups of the same 400 draws,
    so the expected slope is -0.5 with little noise; a biased estimator flattens it towards 0.
    """
    (res,) = run_distributed(ref.sampled_gradient_blocks, 1, 48, DRAWS, BLOCK, 0.5,
                             timeout=TIMEOUT_S)
    assert res["router_rel_dev"] < 1e-5, "router gradient must stay exact for every pair"
    for name in ("w", "dx"):
        errors = _relative_errors(res[f"{name}_block_sums"], res[f"{name}_exact"])
        slope = _slope(errors)
        assert errors[400] < errors[25] / 2.5, f"{name}: {errors}"
        assert -0.65 < slope < -0.35, f"{name}: slope {slope:.3f}, errors {errors}"
        # The estimate is useful, not just shrinking: 400 draws land within 10 % of exact.
        assert errors[400] < 0.1, f"{name}: {errors}"
