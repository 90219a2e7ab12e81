"""LRM scores of token-expert pairs and the per-segment selection of the pairs that get a backward.

Shapes: N rows (token-expert pairs), G segments (contiguous row runs sharing a quota), H hidden.

A *segment* is the set of rows that compete for one quota (for instance all pairs routed to one
expert). Segments are contiguous and in order, described by ``counts[G]`` (rows per segment) and
``quota[G]`` (rows to keep per segment). Inside a segment the row order is the canonical order
(source rank, then token index) that breaks ties.

Two selection policies:

* ``topk``: the ``quota`` highest scores per segment, every kept row with weight 1 (the paper's
  rule; biased, see "Why ``sample`` is the default" in docs/design.md).
* ``sample``: an unbiased fixed-size importance sample, inclusion probability proportional to
  ``sqrt(score)`` capped at 1, systematic sampling, weight ``1 / probability``.

Exactness and determinism. All sums that decide a selection are done in int64 fixed point, never
with floating-point scans: CUDA's float ``cumsum`` and atomics may sum in a different order from run
to run, while integer sums are exact in any order. Inclusion probabilities are multiples of
``2**-PROB_BITS`` that add up to exactly ``quota`` per segment; systematic sampling runs on that
integer grid, so every draw keeps exactly ``quota`` rows per segment, the probability that a row is
kept is exactly its reported probability, and the weights ``1 / probability`` make the estimate
unbiased (exactly, up to the fp32 rounding of the stored weights). The same scores, counts, quota
and uniforms give bit-identical selections on every device and run.

Implementations. :func:`select_topk` and :func:`select_sample` are the torch reference (any
device). :func:`select` is what callers use: on CUDA it runs the fused Triton kernels of
``select/select_triton.py``, which give bit-identical results in a handful of launches (switch:
``KernelOptions.triton``, see ``triton_common.use_triton``), and the torch functions elsewhere.

Device-to-host syncs: none when ``counts`` and ``quota`` are CPU tensors (the controller plans on
the host). When they live on an accelerator they are copied to the host once per call to validate
them and to size the outputs (marked ``NOTE: device-to-host sync``).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.select import scores_triton, select_triton
from megatron_lrmoe.select.contract import (
    PairScores,
    Scored,
    Selection,
    check_policy,
    check_scores,
    check_uniforms,
    host_segments,
)
from megatron_lrmoe.triton_common import use_triton

__all__ = [
    "PROB_BITS",
    "draw_uniforms",
    "inclusion_probabilities",
    "lrm_scores",
    "nonfinite_poison",
    "pair_scores",
    "row_sq_norms",
    "sanitize",
    "score_and_select",
    "select",
    "select_sample",
    "select_topk",
    "token_norms",
]

# Inclusion probabilities are integers in units of 2**-PROB_BITS (a probability of 1 is 2**32).
PROB_BITS = 32
_PROB_ONE = 1 << PROB_BITS
# sqrt-score weights are rounded to integers in units of 2**-32 of a reference weight per segment.
_WEIGHT_ONE = float(1 << 32)


# --------------------------------------------------------------------------------------------- #
# Scores
# --------------------------------------------------------------------------------------------- #


def row_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of every row, accumulated in fp32 (fp64 for fp64 input).

    ``vector_norm`` with an fp32 ``dtype`` upcasts inside the reduction kernel on CUDA, so no fp32
    copy of a bf16/fp16 ``x`` is materialised, and unlike a matmul-based dot product it never runs
    in TF32. Squaring the norm costs at most two fp32 roundings, far below the accumulation error.

    Args:
        x: ``[N, H]`` floating tensor.

    Returns:
        ``[N]`` float32 tensor of ``sum_h x[n, h]**2``.
    """
    if x.dim() != 2:
        raise ValueError(f"row_sq_norms expects a [N, H] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"row_sq_norms expects a floating tensor, got {x.dtype}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    norms = torch.linalg.vector_norm(x, ord=2, dim=-1, dtype=acc)
    return norms.square().to(torch.float32)


def lrm_scores(
    probs: torch.Tensor, grad_sq_norm: torch.Tensor, input_sq_norm: torch.Tensor
) -> torch.Tensor:
    """LRM score ``p**2 * ||g||**2 * ||x||**2`` of every pair, in fp32.

    This is the squared Frobenius norm of the pair's rank-one weight-gradient contribution
    ``(p * g) x^T``, since ``||u v^T||_F**2 = ||u||**2 * ||v||**2``.

    Args:
        probs: ``[N]`` routing probability of each pair.
        grad_sq_norm: ``[N]`` squared norm of the output gradient row of each pair.
        input_sq_norm: ``[N]`` squared norm of the projection input row of each pair.

    Returns:
        ``[N]`` float32 scores.
    """
    shape = probs.shape
    if probs.dim() != 1 or grad_sq_norm.shape != shape or input_sq_norm.shape != shape:
        raise ValueError(
            "lrm_scores expects three [N] tensors, got shapes "
            f"{tuple(probs.shape)}, {tuple(grad_sq_norm.shape)}, {tuple(input_sq_norm.shape)}"
        )
    p = probs.to(torch.float32)
    return (p * p) * grad_sq_norm.to(torch.float32) * input_sq_norm.to(torch.float32)


def token_norms(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[2, T]``: the L2 norm of every token's gradient row (row 0) and input row (row 1).

    Both are token properties: a pair only adds its routing weight, so the backward takes them
    once per token, never per pair. fp32 accumulation (fp64 for fp64 input). On CUDA one fused
    Triton kernel reads both matrices once (``scores_triton.row_norms_triton``); the torch
    code below is the reference it is tested against.

    Args:
        g: ``[T, H]`` gradient rows.
        x: ``[T, H]`` input rows.
    """
    if g.dim() != 2 or g.shape != x.shape:
        raise ValueError(
            f"token_norms: g {tuple(g.shape)} and x {tuple(x.shape)} must be one [T, H]"
        )
    if (
        use_triton(g, x)
        and g.dtype in triton_common.KERNEL_DTYPES
        and x.dtype in triton_common.KERNEL_DTYPES
    ):
        return scores_triton.row_norms_triton(g, x)
    acc = torch.float64 if torch.float64 in (g.dtype, x.dtype) else torch.float32
    return torch.stack([torch.linalg.vector_norm(t, ord=2, dim=-1, dtype=acc) for t in (g, x)])


def pair_scores(
    probs: torch.Tensor, token: torch.Tensor, norms: torch.Tensor, top: torch.Tensor
) -> PairScores:
    """LRM score ``p^2 ||g_t||^2 ||x_t||^2`` of every pair, from per-token norms.

    Each norm is first divided by ``top`` (the largest norm of its kind over the call, or over
    the EP group when sources compete): selection depends only on score ratios within a segment,
    and the fp32 score then cannot overflow however large finite gradients get, while a
    non-finite value still turns the scores non-finite (the poison). On CUDA one Triton kernel
    writes the scores and per-block poison and score sums (``scores_triton.pair_scores_triton``),
    plus one reduction; the torch code below is the reference.

    Args:
        probs: ``[N]`` routing weight of each pair.
        token: ``[N]`` int64 token of each pair.
        norms: ``[2, T]`` token norms (:func:`token_norms`).
        top: ``[2]`` the scale of each kind; a value <= 0 counts as 1.
    """
    if (
        use_triton(probs, token, norms, top)
        and norms.dtype == torch.float32
        and top.dtype == torch.float32
        and probs.dtype.is_floating_point
        and probs.dim() == 1
    ):
        scores, partial = scores_triton.pair_scores_triton(probs, token, norms, top)
        sums = partial.sum(1)
        return PairScores(scores, sums[0], sums[1])
    top = torch.where(top > 0, top, torch.ones_like(top))
    unit = (norms / top.to(norms.dtype).unsqueeze(1)).to(torch.float32)
    g_unit, x_unit = unit[0][token], unit[1][token]
    scores = lrm_scores(probs, g_unit.square(), x_unit.square())
    total = torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0).sum()
    return PairScores(scores, nonfinite_poison(scores), total)


def nonfinite_poison(scores: torch.Tensor) -> torch.Tensor:
    """0-dim float32 tensor: 0 when every score is finite, NaN otherwise; no host sync.

    Callers add it to a gradient so that Megatron's NaN check flags the step. ``score * 0`` is 0 for
    any finite score and NaN for inf/NaN, and a sum of zeros cannot overflow, so large but finite
    scores never raise a false alarm (unlike ``scores.sum() * 0``).

    Args:
        scores: ``[N]`` scores of any floating dtype (empty allowed).

    Returns:
        0-dim float32 tensor on the scores' device.
    """
    return (scores.detach() * 0).sum().to(torch.float32)


def sanitize(scores: torch.Tensor) -> torch.Tensor:
    """Scores with NaN, +-inf and negative values replaced by 0, for the selection itself.

    Scores are non-negative by construction; a non-finite one is reported through
    :func:`nonfinite_poison`, and mapping it to 0 here keeps the selection well formed (exactly
    ``quota`` rows per segment) for the step that Megatron will then skip.

    Args:
        scores: ``[N]`` floating tensor.

    Returns:
        ``[N]`` tensor of the same dtype with values in ``[0, max finite]``.
    """
    return torch.nan_to_num(scores, nan=0.0, posinf=0.0, neginf=0.0).clamp_min(0)


# --------------------------------------------------------------------------------------------- #
# Segment bookkeeping (private)
# --------------------------------------------------------------------------------------------- #


class _Segments(NamedTuple):
    """Segment layout on the scores' device."""

    seg: torch.Tensor  # [N] segment of each row
    start: torch.Tensor  # [G] first row of each segment
    counts: torch.Tensor  # [G] rows per segment
    quota: torch.Tensor  # [G] rows to keep per segment
    total_quota: int  # K = sum(quota), on the host


def _segments(counts: torch.Tensor, quota: torch.Tensor, n: int, device: torch.device) -> _Segments:
    """Checks ``counts`` / ``quota`` against ``n`` rows and lays the segments out on ``device``."""
    _, quota_h = host_segments(counts, quota, n)

    # A blocking host-to-device copy would wait for the whole stream; a non-blocking one from
    # pageable memory stages the source before returning. No copy when already on the device.
    counts_d = counts.to(device=device, dtype=torch.int64, non_blocking=True)
    quota_d = quota.to(device=device, dtype=torch.int64, non_blocking=True)
    num_segments = counts_d.numel()
    # output_size makes repeat_interleave skip its own device-to-host read of sum(counts).
    seg = torch.repeat_interleave(
        torch.arange(num_segments, device=device), counts_d, output_size=n
    )
    start = torch.cumsum(counts_d, 0) - counts_d
    return _Segments(seg, start, counts_d, quota_d, int(quota_h.sum()))


def _order_within_segments(clean: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Permutation listing rows segment by segment, score descending, ties by lower position.

    One stable int64 sort on the key ``(segment, inverted fp32 bit pattern)``: the bit pattern of a
    non-negative float orders like the float itself, so the key is exact and no second sort is
    needed. The result keeps every segment at its own place, so ``seg`` is also the segment of each
    entry of the permutation.

    Args:
        clean: ``[N]`` float32 sanitized (finite, non-negative) scores.
        seg: ``[N]`` segment of each row.

    Returns:
        ``[N]`` int64 permutation.
    """
    bits = clean.view(torch.int32).to(torch.int64)
    bits = bits.clamp_min(0)  # -0.0 has the sign bit set; it is the same score as +0.0
    key = seg * (1 << 31) + ((1 << 31) - 1 - bits)
    return torch.argsort(key, stable=True)


def _segment_sums(x: torch.Tensor, lay: _Segments) -> torch.Tensor:
    """``[G]`` exact per-segment sums of an int64 ``[N]`` tensor (empty segments give 0)."""
    ext = torch.nn.functional.pad(torch.cumsum(x, 0), (1, 0))
    return ext[lay.start + lay.counts] - ext[lay.start]


def _segment_exclusive_cumsum(x: torch.Tensor, lay: _Segments) -> torch.Tensor:
    """``[N]`` exact sum of the earlier rows of the same segment, for an int64 ``[N]`` tensor."""
    ext = torch.nn.functional.pad(torch.cumsum(x, 0), (1, 0))
    return ext[:-1] - ext[lay.start][lay.seg]


def _fixed_point(w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Rounds ``w / ref`` to int64 units of 2**-32; positive weights never round to 0."""
    ratio = torch.where(ref > 0, w / torch.where(ref > 0, ref, 1.0), 0.0).clamp_max(1.0)
    units = torch.round(ratio * _WEIGHT_ONE).to(torch.int64)
    # A tiny positive weight keeps a positive probability so that the sample stays unbiased.
    return torch.where(w > 0, units.clamp(1, 1 << 32), 0)


def _compact(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the True entries of ``mask``, known to be exactly ``k``; no sync."""
    n = mask.numel()
    slot = torch.cumsum(mask, 0) - 1
    # Dropped rows all write into one spare slot k that is cut off afterwards.
    slot = torch.where(mask, slot.clamp_max(k), k)
    out = torch.empty(k + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, slot, torch.arange(n, device=mask.device))
    return out[:k]


def _fixed_point_probabilities(clean: torch.Tensor, lay: _Segments) -> torch.Tensor:
    """Capped-PPS inclusion probabilities in int64 units of ``2**-PROB_BITS``, canonical order.

    Capped PPS: ``pi_i = min(1, c * w_i)`` with ``w = sqrt(score)`` and the scale ``c`` such that
    ``sum_i pi_i = quota``. With the rows of a segment sorted by ``w`` descending (ties by
    position), the capped rows are a prefix: row j (0-based rank) is capped while
    ``(quota - j) * w_j >= sum_{i >= j} w_i``. The test is monotone (once it fails it fails for all
    later ranks), so the number of capped rows ``c*`` is the first failing rank. The uncapped rows
    then get ``pi_i = (quota - c*) * w_i / sum_uncapped w``.

    Weights are first rounded to integers (units of 2**-32 of the segment's largest weight) so the
    suffix sums and the capping test are exact; the uncapped rows are rounded again relative to
    the largest uncapped weight so that a huge capped row does not cost them precision. The
    probabilities ``a_i / 2**32`` are then repaired by whole units so that every segment adds up to
    exactly ``quota * 2**32``, with ``1 <= a_i <= 2**32`` for every row of positive probability.

    Segments with fewer positive weights than quota: every positive row is capped (the test holds
    for them), and so are the first zero-weight rows in canonical order until the quota is full;
    their gradient contribution is zero anyway, so weight 1 is harmless.

    Args:
        clean: ``[N]`` sanitized scores.
        lay: segment layout.

    Returns:
        ``[N]`` int64 ``a`` with ``pi = a / 2**PROB_BITS``; per segment ``sum(a) == quota * 2**32``.
    """
    n = clean.numel()
    device = clean.device
    order = _order_within_segments(clean, lay.seg)
    seg = lay.seg  # segment of every sorted position too (segments keep their place)
    rank = torch.arange(n, device=device) - lay.start[seg]
    quota = lay.quota[seg]
    w = clean[order].to(torch.float64).sqrt()  # descending within each segment

    # Pass 1: exact capping decision on integer weights relative to the segment maximum.
    w_int = _fixed_point(w, w[lay.start[seg]])
    suffix = _segment_sums(w_int, lay)[seg] - _segment_exclusive_cumsum(w_int, lay)
    left = quota - rank  # quota not yet taken by the rows ranked before this one
    # Exact in integers. It also guarantees that an unfinished segment keeps more than
    # (quota - c*) positive uncapped rows (suffix <= positive rows * w at the first uncapped
    # rank), which is what the repair below needs to reach the exact total.
    capped_test = (left > 0) & (left * w_int >= suffix)
    first_fail = torch.where(capped_test, lay.counts[seg], rank)
    num_capped = lay.counts.clone().scatter_reduce_(0, seg, first_fail, "amin", include_self=True)
    capped = rank < num_capped[seg]
    remaining = (lay.quota - num_capped)[seg]  # quota left for the uncapped rows

    # Pass 2: uncapped weights relative to the largest uncapped one (the row at rank c*).
    head = (lay.start + num_capped).clamp_max(max(n - 1, 0))[seg]
    w2 = torch.where(capped, 0, _fixed_point(w, w[head]))
    w2_sum = _segment_sums(w2, lay)[seg]
    active = (~capped) & (w2 > 0) & (remaining > 0)
    ideal = (remaining * w2).to(torch.float64) / w2_sum.clamp_min(1).to(torch.float64)
    lo = torch.where(capped, _PROB_ONE, active.to(torch.int64))
    hi = torch.where(capped | active, _PROB_ONE, 0)
    a = torch.floor(ideal * float(_PROB_ONE)).to(torch.int64)
    a = torch.minimum(torch.maximum(a, lo), hi)

    # Repair: move whole units so every segment adds up to exactly quota * 2**32. Flooring loses
    # less than one unit per row, so one unit per row (largest weights first) normally settles it
    # and keeps every probability within a few units of its ideal; a second pass over the full
    # room/slack covers whatever is left. Room suffices because more than (quota - c*) positive
    # rows stay uncapped, slack because their count is far below 2**32.
    for limit in (1, _PROB_ONE):
        deficit = (lay.quota * _PROB_ONE - _segment_sums(a, lay))[seg]
        room = (hi - a).clamp_max(limit)
        slack = (a - lo).clamp_max(limit)
        a = (
            a
            + _spread(deficit.clamp_min(0), room, lay)
            - _spread((-deficit).clamp_min(0), slack, lay)
        )
    return torch.empty_like(a).scatter_(0, order, a)


def _spread(amount: torch.Tensor, capacity: torch.Tensor, lay: _Segments) -> torch.Tensor:
    """Fills each segment's ``amount`` into its rows' ``capacity`` in row order (int64, exact).

    Args:
        amount: ``[N]`` amount to place, the same for every row of a segment.
        capacity: ``[N]`` non-negative room of each row.
        lay: segment layout.

    Returns:
        ``[N]`` per-row share in ``[0, capacity]``, adding up to ``min(amount, sum capacity)``.
    """
    before = _segment_exclusive_cumsum(capacity, lay)
    return torch.minimum((amount - before).clamp_min(0), capacity)


# --------------------------------------------------------------------------------------------- #
# Public selection API
# --------------------------------------------------------------------------------------------- #


def select_topk(scores: torch.Tensor, counts: torch.Tensor, quota: torch.Tensor) -> Selection:
    """Keeps the ``quota`` highest-scoring rows of every segment, weight 1.

    Ties are broken by lower row position (the canonical order). Non-finite and negative scores
    count as 0 (see :func:`sanitize`). Vectorized over segments: one stable sort.

    Args:
        scores: ``[N]`` scores.
        counts: ``[G]`` rows per segment (CPU or device), sum N.
        quota: ``[G]`` rows to keep per segment, ``0 <= quota <= counts``.

    Returns:
        The selection; ``kept_per_segment == quota``.

    Raises:
        ValueError: malformed shapes, counts not adding up to N, or a quota out of range.
    """
    scores = check_scores(scores)
    n = scores.numel()
    device = scores.device
    lay = _segments(counts, quota, n, device)
    order = _order_within_segments(sanitize(scores), lay.seg)
    rank = torch.arange(n, device=device) - lay.start[lay.seg]
    keep_sorted = rank < lay.quota[lay.seg]
    mask = torch.empty(n, dtype=torch.bool, device=device).scatter_(0, order, keep_sorted)
    kept = _compact(mask, lay.total_quota)
    weight = torch.ones(lay.total_quota, dtype=torch.float32, device=device)
    return Selection(kept, weight, lay.quota.clone())


def inclusion_probabilities(
    scores: torch.Tensor, counts: torch.Tensor, quota: torch.Tensor
) -> torch.Tensor:
    """Capped-PPS inclusion probabilities used by :func:`select_sample`.

    ``pi_i`` is proportional to ``sqrt(score_i)``, capped at 1, and adds up to exactly ``quota`` per
    segment. The values are multiples of ``2**-PROB_BITS`` (fixed point, see the module docstring):
    they match the real-valued capped-PPS solution to about ``1e-9`` absolute, and they are exactly
    the probabilities with which :func:`select_sample` keeps each row. A positive score never gets
    probability 0 (at least ``2**-32``). Segments with fewer positive scores than quota: all
    positive rows get 1, and the remaining quota goes to zero-score rows in canonical order, with
    probability 1 (their gradient is zero, so their weight does not matter).

    Args:
        scores: ``[N]`` scores.
        counts: ``[G]`` rows per segment (CPU or device), sum N.
        quota: ``[G]`` rows to keep per segment, ``0 <= quota <= counts``.

    Returns:
        ``[N]`` float64 probabilities in ``[0, 1]`` on the scores' device.

    Raises:
        ValueError: malformed shapes, counts not adding up to N, or a quota out of range.
    """
    scores = check_scores(scores)
    lay = _segments(counts, quota, scores.numel(), scores.device)
    a = _fixed_point_probabilities(sanitize(scores), lay)
    return a.to(torch.float64) / float(_PROB_ONE)


def select_sample(
    scores: torch.Tensor, counts: torch.Tensor, quota: torch.Tensor, uniforms: torch.Tensor
) -> Selection:
    """Unbiased fixed-size sample of exactly ``quota`` rows per segment.

    Inclusion probabilities are :func:`inclusion_probabilities`. Systematic sampling per segment,
    on the integer grid of the fixed-point probabilities: with ``A_i`` the running sum of ``a`` over
    the segment in canonical order and ``v = floor(u * 2**32)``, row i is kept iff some integer m
    has ``A_{i-1} <= v + m * 2**32 < A_i``. Rows with probability 1 fill a whole period and are
    always kept, which is the same as running systematic sampling over the uncapped rows only. As
    the segment's total is exactly ``quota * 2**32`` and each ``a_i <= 2**32``, exactly ``quota``
    rows are kept for every ``u``, and row i is kept with probability exactly ``a_i / 2**32`` over a
    uniform ``u``; weights are ``2**32 / a_i`` (rounded to fp32), so the Horvitz-Thompson estimate
    ``sum_kept weight * value`` is unbiased for the sum over rows of positive score.

    Args:
        scores: ``[N]`` scores.
        counts: ``[G]`` rows per segment (CPU or device), sum N.
        quota: ``[G]`` rows to keep per segment, ``0 <= quota <= counts``.
        uniforms: ``[G]`` float64 uniforms in ``[0, 1)``, one per segment (see
            :func:`draw_uniforms`); values outside are clamped into ``[0, 1)``.

    Returns:
        The selection; ``kept_per_segment == quota``; weight 1 for rows with probability 1.

    Raises:
        ValueError: malformed shapes, counts not adding up to N, or a quota out of range.
    """
    scores = check_scores(scores)
    n = scores.numel()
    device = scores.device
    lay = _segments(counts, quota, n, device)
    check_uniforms(uniforms, lay.counts.numel())
    a = _fixed_point_probabilities(sanitize(scores), lay)
    # Each segment's a adds up to exactly quota * 2**32, so the segment offset of the global
    # running sum is known without another scan.
    quota_before = torch.cumsum(lay.quota, 0) - lay.quota
    upper = torch.cumsum(a, 0) - (quota_before * _PROB_ONE)[lay.seg]  # A_i within the segment
    lower = upper - a  # A_{i-1}
    u = uniforms.to(device=device, dtype=torch.float64, non_blocking=True)
    grid = torch.floor(u * float(_PROB_ONE))
    offset = grid.clamp(0, _PROB_ONE - 1).to(torch.int64)[lay.seg]
    # points(x) = number of grid points offset + m * 2**32 (m >= 0) below x; x - offset > -2**32.
    shift = _PROB_ONE - 1 - offset
    keep = torch.div(upper + shift, _PROB_ONE, rounding_mode="floor") > torch.div(
        lower + shift, _PROB_ONE, rounding_mode="floor"
    )
    kept = _compact(keep, lay.total_quota)
    weight = (float(_PROB_ONE) / a[kept].to(torch.float64)).to(torch.float32)
    return Selection(kept, weight, lay.quota.clone())


def draw_uniforms(
    seed: int, stream: tuple[int, ...], n: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Deterministic uniforms in ``[0, 1)`` for ``(seed, *stream)``, the same on every rank and run.

    The generator seed is the first 8 bytes of a SHA-256 digest of the decimal integers, so it does
    not depend on Python's per-process string hashing. The values come from a CPU
    ``torch.Generator`` (the same on every machine for a given PyTorch version) and are then moved
    to ``device``.

    Args:
        seed: base seed (e.g. the training seed).
        stream: integers naming the use, e.g. ``(layer, step, micro_batch)``.
        n: number of uniforms.
        device: target device (CPU when None).

    Returns:
        ``[n]`` float64 tensor.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    text = ",".join(str(int(v)) for v in (seed, *stream))
    digest = hashlib.sha256(b"megatron_lrmoe.draw_uniforms:" + text.encode("ascii")).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little"))
    values = torch.rand(n, generator=generator, dtype=torch.float64)
    if device is None:
        return values
    # non_blocking: a blocking host-to-device copy would wait for the whole stream; from pageable
    # memory the source is staged before the call returns, so the temporary may go away.
    return values.to(device, non_blocking=True)


def score_and_select(
    policy: str,
    g: torch.Tensor,
    x: torch.Tensor,
    probs: torch.Tensor,
    token: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    kept_total: bool = False,
    owned: bool = True,
) -> Scored:
    """Score every pair (:func:`token_norms`, each kind relative to its largest value in the
    call, :func:`pair_scores`) and :func:`select` the survivors of each segment.

    The steps run one by one (the reference). On CUDA the whole of it can be one replayed CUDA
    graph that reads ``g``, ``x``, ``probs`` and ``token`` in place, from the second call of a
    shape on: ``graphs/front.py``'s ``replayed_score_and_select`` (the same kernels, so the same
    bits), which falls back to this. For sources that compete over the EP group (scope
    ``global``), the norms' maxima need an all-reduce between the steps: call them one by one
    there.

    Args:
        policy: ``"topk"`` or ``"sample"``.
        g: ``[T, H]`` gradient rows of the tokens.
        x: ``[T, H]`` input rows of the tokens.
        probs: ``[N]`` routing weight of each pair.
        token: ``[N]`` token of each pair.
        counts: ``[G]`` pairs per segment (the pairs are segment-major).
        quota: ``[G]`` pairs to keep per segment.
        uniforms: ``[G]`` uniforms, required by ``"sample"``.
        kept_total: Also sum the kept rows' finite scores (statistics).
        owned: As in :func:`select` (for every output).
    """
    norms = token_norms(g, x)  # [2, T]
    top = norms.amax(dim=1) if norms.shape[1] else norms.new_zeros(2)
    scored = pair_scores(probs, token, norms, top)
    sel = select(policy, scored.scores, counts, quota, uniforms, owned=owned)
    total = None
    if kept_total:
        kept = scored.scores.index_select(0, sel.kept_index)
        total = torch.nan_to_num(kept, nan=0.0, posinf=0.0, neginf=0.0).sum()
    return Scored(scored, sel, total)


def select(
    policy: str,
    scores: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    owned: bool = True,
) -> Selection:
    """:func:`select_topk` (``"topk"``) or :func:`select_sample` (``"sample"``), fused on CUDA.

    CUDA scores take the fused Triton path (``select/select_triton.py``: a handful of launches
    instead of about a hundred, bit-identical results) when triton imports and the active kernel
    options have ``triton`` on (``triton_common.use_triton``); everything else takes the torch
    functions, which stay the reference.

    Args:
        policy: ``"topk"`` or ``"sample"``.
        scores: ``[N]`` scores.
        counts: ``[G]`` rows per segment.
        quota: ``[G]`` rows to keep per segment.
        uniforms: ``[G]`` uniforms, required by ``"sample"``, ignored by ``"topk"``.
        owned: ``False`` lets a replayed selection hand out its graph's own output buffers
            instead of copies (``select/select_triton.py``): they stay valid until the next
            selection of the same shape is queued, so only a caller that queues every use of them
            before that (on the same stream) may pass it; the layer's backward does.

    Returns:
        The selection.

    Raises:
        ValueError: unknown policy, ``"sample"`` without uniforms, or malformed inputs (see
            :func:`select_topk` / :func:`select_sample`).
    """
    check_policy(policy, uniforms)
    if use_triton(scores):
        return select_triton.select_triton(policy, scores, counts, quota, uniforms, owned=owned)
    if policy == "sample" and uniforms.device != scores.device and scores.is_cuda:
        # Pinned, so the copy is queued instead of waiting for the stream to drain.
        uniforms = uniforms.pin_memory().to(scores.device, non_blocking=True)
    if policy == "topk":
        return select_topk(scores, counts, quota)
    return select_sample(scores, counts, quota, uniforms)
