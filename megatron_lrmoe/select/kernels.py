"""Fused Triton selection: ``topk`` and ``sample`` bit-identical to the torch reference.

Shapes: N rows (token-expert pairs), G segments (contiguous row runs sharing a quota), K kept rows
(``sum(quota)``).

Why: the torch reference in ``scoring.py`` (``select_topk`` / ``select_sample``) runs about a
hundred small kernels per call (segment sums, scatters, two repair passes, a compaction), 1.2 ms at
N = 131072, G = 128 on an H200. Here one call is:

1. one pinned, non-blocking host-to-device copy of the per-segment table (starts, ends, quota,
   output offsets, launch order, and the uniforms when they are host tensors);
2. ``_sort_key_kernel``: sanitize every score and build the int64 sort key
   ``(segment, inverted fp32 bits)`` of ``scoring._order_within_segments``;
3. one stable ``torch.sort`` of the keys (cub radix sort: its own few launches);
4. ``_select_kernel``: one program per segment, looping over the segment's rows in blocks with
   running carries. ``sample``: every fixed-point pass of ``scoring._fixed_point_probabilities``
   in sorted order, the probability units scattered back to canonical positions, then (after a
   CTA barrier) the systematic draw in canonical order. ``topk``: the kept flags scattered back,
   then the canonical pass. Kept rows are written straight to their output slot (exclusive
   cumsum of quota over segments + kept rank inside the segment), so no compaction follows.

Exactness: every decision is integer arithmetic on the same int64 quantities as the reference,
and the few floating-point steps are the same IEEE operations in the same order (float64 sqrt,
division, multiplication by 2**32, round-half-to-even, truncation to int64, the final fp64 ->
fp32 rounding). Sums that the reference takes as segment totals are order-independent integer
sums here too, and its prefix sums (suffix sums, the repair spreads, the running sum of the
draw) are per-block scans plus a carried total. The reference computes the in-segment running
sum of the draw from a global cumsum minus ``quota_before * 2**32``; the two agree because every
segment's probability units add up to exactly ``quota * 2**32`` (the reference's invariant).
Float64 ``/`` in Triton lowers to ``div.rn.f64`` and ``tl.sqrt`` on float64 to ``sqrt.rn.f64``
(both IEEE round-to-nearest; ``tl.div_rn`` / ``tl.sqrt_rn`` are fp32-only);
``benchmarks/select_bench.py`` checks the GPU result against the CPU reference bit for bit.

Python float literals in a kernel become fp32 constants, so only constants exact in fp32 appear
next to float64 values (``2**32``, ``0.5``, ``1.0``); integer literals in ``[2**31, 2**32)``
would become uint32, so none are used.

Triton is imported lazily, with the conventions of ``megatron_lrmoe/triton_kernels.py`` (whose
``triton_available`` / ``use_triton`` this module reuses): the kernel bodies are plain functions
until :func:`_kernels` wraps them, and under ``TRITON_INTERPRET=1`` (set before triton is first
imported) the launcher accepts CPU tensors and runs them in Triton's interpreter (the tests do).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lrmoe.select import scoring
from megatron_lrmoe.triton_kernels import _cdiv, _device_ctx, triton_available

__all__ = ["select_triton"]

# Rows per block of the per-segment loops: 1024 int64 lanes over 4 warps is 8 per thread, which
# keeps the float64 math of a block in registers; a hot segment of 16384 rows takes 16 blocks.
_SELECT_BLOCK = 1024
_SELECT_WARPS = 4
_KEY_BLOCK = 1024
_KEY_WARPS = 4

# Rows of the per-segment table that travels to the device in one copy.
_START, _END, _QUOTA, _SLOT, _PROGRAM, _UNIFORM = range(6)

# Bound to ``triton.language`` by :func:`_kernels`; the kernel bodies resolve it at compile (or
# interpret) time, never at definition time (annotations are strings here).
tl: Any = None


# --------------------------------------------------------------------------------------------
# Device helpers (plain functions; :func:`_kernels` replaces them by their triton.jit versions
# in this module's globals before any kernel compiles, so the kernels call the jitted ones).
# Integer constants: 2147483647 = 2**31 - 1, 4294967296 = 2**32 (one probability unit of 1).
# --------------------------------------------------------------------------------------------


def _sqrt_weight(key):
    """float64 ``sqrt`` of the sanitized fp32 score that a sort key encodes (its low 31 bits)."""
    bits = (2147483647 - (key & 2147483647)).to(tl.int32)
    return tl.sqrt(bits.to(tl.float32, bitcast=True).to(tl.float64))


def _round_half_even(x):
    """``torch.round`` of non-negative float64 values below 2**52, as int64."""
    r = tl.floor(x)
    d = x - r  # exact: r and x share the exponent range and r <= x < r + 1
    r_int = r.to(tl.int64)
    up = (d > 0.5) | ((d == 0.5) & ((r_int & 1) == 1))
    return r_int + up.to(tl.int64)


def _fixed_point(w, ref):
    """``scoring._fixed_point``: ``w / ref`` in int64 units of 2**-32; positive ``w`` gets >= 1."""
    ratio = tl.where(ref > 0, w / tl.where(ref > 0, ref, 1.0), 0.0)
    ratio = tl.minimum(ratio, 1.0)
    units = _round_half_even(ratio * 4294967296.0)
    units = tl.minimum(tl.maximum(units, 1), 4294967296)
    return tl.where(w > 0, units, 0)


def _bounds(rank, w2, c_star, remaining):
    """Bounds ``lo`` / ``hi`` of the probability units of rows at ``rank`` with weights ``w2``.

    Capped rows (rank < c*) are pinned to 2**32; active rows (uncapped, positive weight, quota
    left) may take ``[1, 2**32]``; all others 0 (as in ``scoring._fixed_point_probabilities``).
    """
    capped = rank < c_star
    active = (rank >= c_star) & (w2 > 0) & (remaining > 0)
    lo = tl.where(capped, 4294967296, active.to(tl.int64))
    hi = tl.where(capped | active, 4294967296, 0)
    return lo, hi


def _spread(amount, capacity, carry):
    """``scoring._spread`` on one block: ``carry`` is the capacity of the earlier blocks."""
    before = carry + tl.cumsum(capacity, 0) - capacity
    return tl.minimum(tl.maximum(amount - before, 0), capacity)


_HELPERS = ("_sqrt_weight", "_round_half_even", "_fixed_point", "_bounds", "_spread")


# --------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; wrapped by triton.jit or the interpreter in _kernels()).
# Row offsets are int64: N * 2**32 sums and slot arithmetic need it anyway.
# --------------------------------------------------------------------------------------------


def _sort_key_kernel(
    key_ptr,
    scores_ptr,
    ends_ptr,
    n,
    num_segments,
    SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``key[i] = segment(i) * 2**31 + (2**31 - 1 - bits(sanitize(score[i])))``.

    Sanitizing works on the bit pattern: NaN, +-inf (exponent all ones) and anything with the
    sign bit (negative values, -0.0) become +0.0, as ``scoring.sanitize`` plus the reference's
    ``clamp_min(0)`` on the bits do. The segment is the number of segment ends ``<= i``, found by
    a branch-free binary search over the ``[G]`` ends (``SEARCH_STEPS = ceil(log2(G + 1))``).
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x = tl.load(scores_ptr + offs, mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    bad = ((bits & 0x7F800000) == 0x7F800000) | (bits < 0)
    bits = tl.where(bad, 0, bits).to(tl.int64)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + num_segments
    for _ in tl.static_range(SEARCH_STEPS):
        live = lo < hi
        mid = (lo + hi) >> 1
        end = tl.load(ends_ptr + mid, mask=mask & live, other=0)
        right = end <= offs
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & (~right), mid, hi)
    key = (lo << 31) + (2147483647 - bits)
    tl.store(key_ptr + offs, key, mask=mask)


def _select_kernel(
    kept_ptr,
    weight_ptr,
    scratch_ptr,
    units_ptr,
    sorted_key_ptr,
    order_ptr,
    table_ptr,
    uniforms_ptr,
    num_segments,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One segment per program: selection in sorted order, then the kept rows in canonical order.

    ``table_ptr`` is the ``[6 or 5, G]`` int64 per-segment table (rows ``_START``, ``_END``,
    ``_QUOTA``, ``_SLOT`` = exclusive cumsum of quota, ``_PROGRAM`` = segment of each program,
    largest first). ``scratch_ptr`` is ``[N]`` int64: the probability units ``a`` (``sample``) or
    the kept flags (``topk``) at canonical positions, written in sorted order and read back in
    canonical order by the same program after a barrier.
    """
    pid = tl.program_id(0)
    g = tl.load(table_ptr + 4 * num_segments + pid)
    start = tl.load(table_ptr + g)
    count = tl.load(table_ptr + num_segments + g) - start
    quota = tl.load(table_ptr + 2 * num_segments + g)
    slot0 = tl.load(table_ptr + 3 * num_segments + g)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    ONE = 4294967296

    if SAMPLE:
        # Each float64 step runs once per row: `units` (sorted order) holds the integer weights
        # w_int, then the uncapped weights w2, then the floored probability units, as the passes
        # go. The longest segment runs on one multiprocessor, so recomputing costs time there.
        # A pass may read a row that another thread of the program wrote (the compiler picks
        # each loop's layout), hence a barrier after every writing pass and ".cg" (L2) reads.
        #
        # Pass A: integer weights relative to the segment maximum (the first sorted row); W is
        # their exact total. Masked lanes load the key of a zero score, i.e. weight 0.
        key0 = tl.load(sorted_key_ptr + start, mask=count > 0, other=2147483647)
        w_max = _sqrt_weight(key0)
        total = tl.zeros([], dtype=tl.int64)
        for j0 in range(0, count, BLOCK):
            j = j0 + lanes
            m = j < count
            key = tl.load(sorted_key_ptr + start + j, mask=m, other=2147483647)
            w_int = _fixed_point(_sqrt_weight(key), w_max)
            tl.store(units_ptr + start + j, w_int, mask=m)
            total += tl.sum(w_int, 0)
        tl.debug_barrier()

        # Pass B: number of capped rows c* = first rank failing
        # (quota - rank > 0) & ((quota - rank) * w_int >= suffix sum). Rank quota always fails,
        # so the scan stops there at the latest (and usually inside its first block).
        c_star = count
        prefix = tl.zeros([], dtype=tl.int64)
        j0 = tl.zeros([], dtype=tl.int64)
        scan_end = tl.minimum(count, quota + 1)
        while (j0 < scan_end) & (c_star == count):
            j = j0 + lanes
            m = j < count
            w_int = tl.load(units_ptr + start + j, mask=m, other=0, cache_modifier=".cg")
            suffix = total - (prefix + tl.cumsum(w_int, 0) - w_int)
            left = quota - j
            capped = (left > 0) & (left * w_int >= suffix)
            c_star = tl.minimum(c_star, tl.min(tl.where(m & (~capped), j, count), 0))
            prefix += tl.sum(w_int, 0)
            j0 += BLOCK
        remaining = quota - c_star
        tl.debug_barrier()  # pass C overwrites rows that pass B read

        # Pass C: uncapped weights relative to the largest uncapped one (rank c*); capped rows
        # get 0. With no capped row that reference is the segment maximum again, so w2 = w_int
        # and W2 = W: the pass is skipped.
        key_h = tl.load(sorted_key_ptr + start + c_star, mask=c_star < count, other=2147483647)
        w_head = _sqrt_weight(key_h)
        total2 = tl.where(c_star == 0, total, 0)
        for j0 in range(0, tl.where(c_star == 0, 0, count), BLOCK):
            j = j0 + lanes
            m = j < count
            key = tl.load(sorted_key_ptr + start + j, mask=m, other=2147483647)
            w2 = tl.where(j < c_star, 0, _fixed_point(_sqrt_weight(key), w_head))
            tl.store(units_ptr + start + j, w2, mask=m)
            total2 += tl.sum(w2, 0)
        tl.debug_barrier()
        denominator = tl.maximum(total2, 1).to(tl.float64)

        # Pass D: floored units a = floor(remaining * w2 / W2 * 2**32) within [lo, hi], and the
        # totals of a and of the one-unit room / slack, so both repair deficits are known before
        # the rows are walked in order (a spread of `amount` over capacities moves
        # min(amount, total capacity)).
        a_sum = tl.zeros([], dtype=tl.int64)
        room_sum = tl.zeros([], dtype=tl.int64)
        slack_sum = tl.zeros([], dtype=tl.int64)
        for j0 in range(0, count, BLOCK):
            j = j0 + lanes
            m = j < count
            w2 = tl.load(units_ptr + start + j, mask=m, other=0, cache_modifier=".cg")
            lo, hi = _bounds(j, w2, c_star, remaining)
            ideal = (remaining * w2).to(tl.float64) / denominator
            a = tl.floor(ideal * 4294967296.0).to(tl.int64)
            a = tl.where(m, tl.minimum(tl.maximum(a, lo), hi), 0)
            tl.store(units_ptr + start + j, a, mask=m)
            a_sum += tl.sum(a, 0)
            room_sum += tl.sum(tl.where(m, tl.minimum(hi - a, 1), 0), 0)
            slack_sum += tl.sum(tl.where(m, tl.minimum(a - lo, 1), 0), 0)
        tl.debug_barrier()
        deficit1 = quota * ONE - a_sum
        deficit2 = (
            deficit1
            - tl.minimum(tl.maximum(deficit1, 0), room_sum)
            + tl.minimum(tl.maximum(-deficit1, 0), slack_sum)
        )
        # Only one direction is non-zero per pass: add to room when short, take slack when over.
        grow1 = deficit1 >= 0
        amount1 = tl.where(grow1, deficit1, -deficit1)
        grow2 = deficit2 >= 0
        amount2 = tl.where(grow2, deficit2, -deficit2)

        # Pass E: both repairs in sorted order (largest weights first), then scatter the final
        # units to canonical positions. Active rows are exactly the uncapped rows with a > 0
        # (their lower bound is 1; other uncapped rows are pinned to 0), so a stands in for w2.
        carry1 = tl.zeros([], dtype=tl.int64)
        carry2 = tl.zeros([], dtype=tl.int64)
        for j0 in range(0, count, BLOCK):
            j = j0 + lanes
            m = j < count
            a = tl.load(units_ptr + start + j, mask=m, other=0, cache_modifier=".cg")
            lo, hi = _bounds(j, a, c_star, remaining)
            cap1 = tl.where(m, tl.where(grow1, tl.minimum(hi - a, 1), tl.minimum(a - lo, 1)), 0)
            moved1 = _spread(amount1, cap1, carry1)
            a = tl.where(grow1, a + moved1, a - moved1)
            cap2 = tl.where(m, tl.where(grow2, tl.minimum(hi - a, ONE), tl.minimum(a - lo, ONE)), 0)
            moved2 = _spread(amount2, cap2, carry2)
            a = tl.where(grow2, a + moved2, a - moved2)
            carry1 += tl.sum(cap1, 0)
            carry2 += tl.sum(cap2, 0)
            row = tl.load(order_ptr + start + j, mask=m, other=0)
            tl.store(scratch_ptr + row, a, mask=m)
    else:
        # topk: the first `quota` rows in sorted order are kept; flag them at canonical positions.
        for j0 in range(0, count, BLOCK):
            j = j0 + lanes
            m = j < count
            row = tl.load(order_ptr + start + j, mask=m, other=0)
            tl.store(scratch_ptr + row, (j < quota).to(tl.int64), mask=m)

    # The canonical pass reads what other threads of this program scattered: a CTA barrier
    # orders those global stores before these loads, and ".cg" reads bypass L1.
    tl.debug_barrier()

    if SAMPLE:
        # Systematic draw on the integer grid: offset v = clamp(floor(u * 2**32), 0, 2**32 - 1);
        # row kept iff a grid point v + m * 2**32 lies in [A_{i-1}, A_i). The clamp to 2**32 - 1
        # happens in int64 because 2**32 - 1 is no fp32 constant.
        u = tl.load(uniforms_ptr + g)
        v = tl.minimum(tl.maximum(tl.floor(u * 4294967296.0), 0.0), 4294967296.0)
        shift = ONE - 1 - tl.minimum(v.to(tl.int64), ONE - 1)
    running = tl.zeros([], dtype=tl.int64)
    taken = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, count, BLOCK):
        pos = start + j0 + lanes
        m = pos < start + count
        a = tl.load(scratch_ptr + pos, mask=m, other=0, cache_modifier=".cg")
        if SAMPLE:
            upper = running + tl.cumsum(a, 0)
            lower = upper - a
            keep = m & (((upper + shift) >> 32) > ((lower + shift) >> 32))
            weight = (4294967296.0 / tl.where(keep, a, 1).to(tl.float64)).to(tl.float32)
            running += tl.sum(a, 0)
        else:
            keep = m & (a != 0)
            weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
        flag = keep.to(tl.int64)
        slot = slot0 + taken + tl.cumsum(flag, 0) - flag
        tl.store(kept_ptr + slot, pos, mask=keep)
        tl.store(weight_ptr + slot, weight, mask=keep)
        taken += tl.sum(flag, 0)


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    """The kernel bodies wrapped by ``triton.jit`` (built once, on first launch).

    Under ``TRITON_INTERPRET=1`` these are interpreter functions that run on host tensors;
    ``interpreted`` says so.
    """
    global tl
    if not triton_available():
        raise RuntimeError("megatron_lrmoe Triton selection needs an importable `triton` package")
    import triton
    import triton.language as language
    from triton.runtime.jit import JITFunction

    tl = language
    module = globals()
    for name in _HELPERS:
        module[name] = triton.jit(module[name])
    kernels = SimpleNamespace(
        sort_key=triton.jit(_sort_key_kernel), select=triton.jit(_select_kernel)
    )
    kernels.interpreted = not isinstance(kernels.select, JITFunction)
    return kernels


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _segment_table(
    counts_h: torch.Tensor, quota_h: torch.Tensor, uniforms: torch.Tensor | None, device
) -> torch.Tensor:
    """``[5 or 6, G]`` int64 per-segment table on ``device``, in one non-blocking copy.

    Rows: ``_START``, ``_END``, ``_QUOTA``, ``_SLOT`` (first output slot of the segment),
    ``_PROGRAM`` (segment of each program: largest first, so that with more segments than
    multiprocessors the long programs start first), and ``_UNIFORM`` (the float64 bits of host
    uniforms) when ``uniforms`` is given.
    """
    num_segments = counts_h.numel()
    rows = 6 if uniforms is not None else 5
    # Pinned: the copy below is asynchronous and returns at once, and the caching host allocator
    # keeps the block alive until the copy has run.
    pin = device.type == "cuda"
    table = torch.empty((rows, num_segments), dtype=torch.int64, pin_memory=pin)
    torch.cumsum(counts_h, 0, out=table[_END])
    torch.sub(table[_END], counts_h, out=table[_START])
    table[_QUOTA] = quota_h
    torch.cumsum(quota_h, 0, out=table[_SLOT])
    table[_SLOT] -= quota_h
    table[_PROGRAM] = torch.argsort(counts_h, descending=True, stable=True)
    if uniforms is not None:
        table[_UNIFORM].view(torch.float64).copy_(uniforms.to(torch.float64))
    return table.to(device, non_blocking=True)


def select_triton(
    policy: str,
    scores: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    block: int | None = None,
) -> scoring.Selection:
    """``scoring.select_topk`` / ``scoring.select_sample`` in three launches plus a sort.

    Same contract and bit-identical results as the torch functions (same ``kept_index``,
    ``weight`` and ``kept_per_segment``); uniforms outside ``[0, 1)`` are clamped the same way
    (NaN uniforms are undefined in both). No device-to-host sync when ``counts`` and ``quota``
    are CPU tensors; device ones are read back once, as in the reference.

    Args:
        policy: ``"topk"`` or ``"sample"``.
        scores: ``[N]`` floating scores on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        counts: ``[G]`` rows per segment, sum N.
        quota: ``[G]`` rows to keep per segment, ``0 <= quota <= counts``.
        uniforms: ``[G]`` uniforms in ``[0, 1)``, required by ``"sample"``.
        block: rows per block of the per-segment loops (a power of two), for tests and tuning.

    Returns:
        The selection.

    Raises:
        ValueError: unknown policy, ``"sample"`` without uniforms, malformed shapes, counts not
            adding up to N, a quota out of range, or host tensors without the interpreter.
    """
    if policy not in scoring._POLICIES:
        raise ValueError(f"unknown selection policy {policy!r}; expected one of {scoring._POLICIES}")
    sample = policy == "sample"
    if sample and uniforms is None:
        raise ValueError("policy 'sample' needs uniforms (see draw_uniforms)")
    block = _SELECT_BLOCK if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    scores = scoring._check_scores(scores).contiguous()
    n = scores.numel()
    device = scores.device
    counts_h, quota_h = scoring._host_segments(counts, quota, n)
    num_segments = counts_h.numel()
    host_uniforms = None
    if sample:
        scoring._check_uniforms(uniforms, num_segments)
        if uniforms.device.type == "cpu":
            host_uniforms = uniforms
    kernels = _kernels()
    if device.type != "cuda" and not kernels.interpreted:
        raise ValueError(
            "select_triton got host tensors; it needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported (the interpreter runs the kernels on the host)"
        )
    table = _segment_table(counts_h, quota_h, host_uniforms, device)
    num_kept = int(quota_h.sum())
    kept = torch.empty(num_kept, dtype=torch.int64, device=device)
    weight = torch.empty(num_kept, dtype=torch.float32, device=device)
    selection = scoring.Selection(kept, weight, table[_QUOTA])
    if num_kept == 0:
        return selection  # nothing to write (and N == 0 has nothing to sort)

    if sample:
        if host_uniforms is not None:
            u = table[_UNIFORM].view(torch.float64)
        else:
            u = uniforms.detach().to(device=device, dtype=torch.float64).contiguous()
    with _device_ctx(scores):
        key = torch.empty(n, dtype=torch.int64, device=device)
        steps = max(1, math.ceil(math.log2(num_segments + 1)))
        kernels.sort_key[(_cdiv(n, _KEY_BLOCK),)](
            key,
            scores,
            table[_END],
            n,
            num_segments,
            SEARCH_STEPS=steps,
            BLOCK=_KEY_BLOCK,
            num_warps=_KEY_WARPS,
        )
        sorted_key, order = torch.sort(key, stable=True)
        scratch = torch.empty(n, dtype=torch.int64, device=device)
        units = torch.empty(n, dtype=torch.int64, device=device) if sample else scratch
        kernels.select[(num_segments,)](
            kept,
            weight,
            scratch,
            units,
            sorted_key,
            order,
            table,
            u if sample else table,  # unread placeholder for topk
            num_segments,
            SAMPLE=sample,
            BLOCK=block,
            num_warps=_SELECT_WARPS,
        )
    return selection
