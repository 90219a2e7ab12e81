"""Recorded counts onto P virtual EP ranks, and synthetic skewed counts.

Shape legend: p EP ranks of the recording, P virtual ranks of the replay, E experts,
``N[r, e]`` pairs from source r to expert e.

Resharding rule (:func:`reshard`), deterministic:

* ``P == p``: the counts as recorded.
* ``P = k * p``, ``tokens="recorded"`` (default; weak scaling, each GPU routes what a recorded
  GPU routed): virtual source ``r * k + j`` (j < k) gets recorded source r's row unchanged.
  ``tokens="split"`` (strong scaling, the recorded total spread over more GPUs): recorded row r
  is split into k rows, row j taking ``floor(N * (j + 1) / k) - floor(N * j / k)`` of every
  count (sums preserved exactly, the larger shares on the later rows).
* ``p = k * P``: virtual source r merges recorded sources ``r * k .. r * k + k - 1`` (summed);
  with ``tokens="recorded"`` the merged row is then scaled by ``1 / k``.
* ``pairs_per_rank`` (tokens per GPU times top-k, given): every virtual row is finally scaled to
  that many pairs.

Scaling a row to ``R`` pairs keeps its proportions by largest remainder: ``floor(N * R / sum)``
plus one for the largest remainders (ties: lower expert first); a row of zeros stays zero.
Other ratios of P and p are refused.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["reshard", "scale_rows", "synthetic_counts"]

TOKEN_MODES = ("recorded", "split")


def scale_rows(counts: np.ndarray, pairs: np.ndarray | int) -> np.ndarray:
    """Each row of ``[P, E]`` counts scaled to ``pairs`` (per row or one for all), exact sums.

    Rows that sum to zero stay zero.
    """
    n = np.asarray(counts, dtype=np.int64)
    target = np.broadcast_to(np.asarray(pairs, dtype=np.int64), (n.shape[0],))
    if (target < 0).any():
        raise ValueError(f"scale_rows: pairs ({pairs}) must be >= 0")
    total = n.sum(axis=1)
    safe = np.maximum(total, 1)
    exact = n * target[:, None]  # int64: counts and pairs per row stay below 2**31
    out = exact // safe[:, None]
    remainder = exact - out * safe[:, None]
    short = np.where(total > 0, target - out.sum(axis=1), 0)
    # Largest remainder first, lower expert on ties: a stable sort of the negated remainders.
    order = np.argsort(-remainder, axis=1, kind="stable")
    rank_of = np.empty_like(order)
    np.put_along_axis(rank_of, order, np.arange(n.shape[1])[None, :].repeat(n.shape[0], 0), 1)
    return out + (rank_of < short[:, None])


def reshard(
    counts: np.ndarray,
    ranks: int,
    tokens: str = "recorded",
    pairs_per_rank: Optional[int] = None,
) -> np.ndarray:
    """``[p, E]`` recorded counts as ``[P, E]`` counts of ``ranks`` virtual sources (module doc).

    Raises:
        ValueError: ``ranks`` neither a multiple nor a divisor of p, E not divisible by
            ``ranks``, or an unknown ``tokens`` mode.
    """
    n = np.asarray(counts, dtype=np.int64)
    recorded, experts = n.shape
    if tokens not in TOKEN_MODES:
        raise ValueError(f"reshard: tokens={tokens!r} must be one of {TOKEN_MODES}")
    if ranks < 1 or experts % ranks:
        raise ValueError(
            f"reshard: {experts} experts cannot be owned evenly by {ranks} ranks (choose an EP "
            f"size that divides {experts})"
        )
    if ranks % recorded == 0:
        k = ranks // recorded
        if tokens == "recorded" or k == 1:
            out = np.repeat(n, k, axis=0)
        else:
            j = np.arange(k + 1)[None, :, None]
            cuts = (n[:, None, :] * j) // k  # [p, k + 1, E]
            out = np.diff(cuts, axis=1).reshape(ranks, experts)
    elif recorded % ranks == 0:
        k = recorded // ranks
        out = n.reshape(ranks, k, experts).sum(axis=1)
        if tokens == "recorded":
            out = scale_rows(out, out.sum(axis=1) // k)
    else:
        raise ValueError(
            f"reshard: a trace recorded at EP {recorded} replays at an EP size that is a "
            f"multiple or a divisor of {recorded}, not {ranks}"
        )
    if pairs_per_rank is not None:
        out = scale_rows(out, int(pairs_per_rank))
    return out


def _capped_shares(weights: np.ndarray, cap: float) -> np.ndarray:
    """``weights`` normalised, no share above ``cap`` (the excess spread over the rest)."""
    share = weights / weights.sum()
    for _ in range(len(share)):
        over = share > cap
        if not over.any():
            break
        excess = (share[over] - cap).sum()
        share[over] = cap
        free = ~over & (share < cap)
        share[free] += excess * share[free] / share[free].sum()
    return share


def synthetic_counts(
    layers: int,
    ranks: int,
    experts: int,
    tokens_per_rank: int,
    topk: int,
    *,
    zipf: float = 0.0,
    gamma_cv: float = 0.0,
    source_cv: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """``[layers, P, E]`` skewed routing counts of one forward pass (a stand-in for a trace).

    Per layer, expert popularity is ``rank ** -zipf`` over a random order of the experts, times
    a Gamma draw of coefficient of variation ``gamma_cv``; each source rank perturbs it by its
    own Gamma draw (``source_cv``, 0: every rank routes alike) and routes ``tokens_per_rank *
    topk`` pairs by a multinomial draw. No share exceeds ``1 / topk`` (a token picks ``topk``
    distinct experts), so no count exceeds about ``tokens_per_rank``.

    Raises:
        ValueError: Non-positive sizes, ``topk > experts``, negative skews.
    """
    if min(layers, ranks, experts, tokens_per_rank, topk) < 1 or topk > experts:
        raise ValueError(
            f"synthetic_counts: layers ({layers}), ranks ({ranks}), experts ({experts}), "
            f"tokens_per_rank ({tokens_per_rank}) and topk ({topk}) must be >= 1, topk <= experts"
        )
    if min(zipf, gamma_cv, source_cv) < 0:
        raise ValueError("synthetic_counts: zipf, gamma_cv and source_cv must be >= 0")
    rng = np.random.default_rng(seed)
    pairs = tokens_per_rank * topk
    out = np.empty((layers, ranks, experts), dtype=np.int64)
    for layer in range(layers):
        base = np.arange(1, experts + 1, dtype=np.float64) ** -zipf
        base = base[rng.permutation(experts)]
        if gamma_cv > 0:
            base = base * rng.gamma(1.0 / gamma_cv**2, 1.0, experts)
        for r in range(ranks):
            w = base * rng.gamma(1.0 / source_cv**2, 1.0, experts) if source_cv > 0 else base
            out[layer, r] = rng.multinomial(pairs, _capped_shares(w, 1.0 / topk))
    return out
