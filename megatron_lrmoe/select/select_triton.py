"""Fused Triton selection: ``topk`` and ``sample`` bit-identical to the torch reference.

Shapes: N rows (token-expert pairs), G segments (contiguous row runs sharing a quota), K kept rows
(``sum(quota)``), B row blocks (``ceil(N / BLOCK)``).

Why: the torch reference in ``scoring.py`` (``select_topk`` / ``select_sample``) runs about a
hundred small kernels per call (1.2 ms eager at N = 131072, G = 128 on an H200). Segment sizes are
skewed (one expert can hold 16k of the 131k pairs), so one program per segment would leave the
largest segment's rows on a single multiprocessor; every pass over rows here is spread over the
whole GPU instead, and per-segment work is limited to short scans of a segment's top rows.

One call, in launch order (``sample``; ``topk`` runs 1-3, 7 for the ranks only, 9 and 10):

1. one pinned, non-blocking host-to-device copy of the ``[_ROWS, G]`` int64 segment table
   (starts, ends, quota, first output slot, uniforms if on the host, zeroed accumulators);
2. ``_sort_key_kernel`` (rows): sanitized score and segment -> int64 key
   ``segment * 2**31 + (2**31 - 1 - fp32 bits)`` (``scoring._order_within_segments``);
3. the stable sort of the keys, by one of two methods that give the same order
   (:func:`merge_tile` picks on the host from the segment sizes): ``_tile_sort_kernel`` (tiles
   of rows sorted in registers) then ``_merge_rank_kernel`` (each row's sorted position from
   binary searches in the sorted tiles its segment touches), unless one segment is very large;
   else ``torch.sort(key, stable=True)`` (cub's radix sort: eight latency-bound passes, 70-82
   us on an H200 whatever the size here);
4. ``_weights_kernel`` (sorted rows): integer weights ``w_int`` relative to the segment maximum
   (the segment's first sorted row); their segment totals ``W``;
5. ``_capping_kernel`` (segments): the number of capped rows ``c*``, scanning the segment's top
   ranks only until the capping test first fails (at rank ``quota`` at the latest);
6. ``_uncapped_kernel`` (sorted rows): weights ``w2`` relative to the largest uncapped one and
   their totals ``W2``;
7. ``_units_kernel`` (sorted rows): floored probability units ``a`` within their bounds, the
   totals the repair needs, and ``a`` / sorted rank scattered to canonical positions;
8. ``_repair_kernel`` (segments): where the two repair passes of the reference move units (see
   below);
9. ``_finalize_kernel`` (rows): final units (``topk``: kept flags) and their block totals;
10. ``_draw_kernel`` (rows): running sums from the block totals, the systematic draw, and the
    kept rows written straight to their output slots (no compaction).

On CUDA, steps 2-10 of one shape (N rows, G segments, policy, which sort) are captured into a
CUDA graph the second time the shape is seen and replayed after that (``_GraphCache``): one
launch from the host instead of about twenty, the same kernels on the same inputs (the scores
and the table's host rows are copied into the graph's static buffers first; the outputs are
copied out). Not inside another capture, not with device-side uniforms; ``select_graphs`` off in
the active kernel options (``options.active_kernels()``, ``--no-lrmoe-select-graphs``) turns it
off. The backward's front, the scoring and more replayed in the same graph, is
``graphs/front.py``'s: it extends :class:`CapturedSelection` and captures into the same cache.

Why the repairs need no scan over all rows: among a segment's active rows (uncapped, positive
weight, quota left), which are the consecutive ranks ``[c*, c* + n_active)``, the floored units
``a`` do not increase with rank (every step from the score to ``a`` is monotone). So the rows with
one unit of room (``a < 2**32``) are a suffix of that range and the rows with one unit of slack
(``a > 1``) a prefix; the reference's first pass (one unit per row, largest
first) therefore changes exactly a window of ranks that three counts determine. Its second pass
moves whole capacities, row after row, from rank ``c*`` on until the remaining deficit is placed:
the rows before one rank ``r`` reach their bound, row ``r`` takes the rest, later rows keep their
value. ``_repair_kernel`` finds ``r`` by scanning from rank ``c*`` and stops there (in the first
block unless the deficit is spread very thin; it is usually zero and then nothing is scanned).

Exactness: every decision is integer arithmetic on the same int64 quantities as the reference,
and the floating-point steps are the same IEEE operations in the same order (float64 sqrt,
division, multiplication by 2**32, round-half-to-even, truncation to int64, the final fp64 ->
fp32 rounding). Segment totals are integer atomics (exact and order-independent, so
deterministic). The draw uses the reference's own formula for the in-segment running sum (global
running sum minus ``quota_before * 2**32``), and the kept rank of a row in its segment is the
number of grid points below its running sum, which equals the reference's compaction because each
segment keeps exactly ``quota`` rows (its invariant). Float64 ``/`` lowers to ``div.rn.f64`` and
``tl.sqrt`` on float64 to ``sqrt.rn.f64`` (IEEE round-to-nearest; ``tl.div_rn`` / ``tl.sqrt_rn``
are fp32-only); ``benchmarks/select_bench.py`` checks the GPU against the CPU reference.

Python float literals in a kernel become fp32 constants, so only constants exact in fp32 appear
next to float64 values (``2**32``, ``0.5``, ``1.0``); integer literals in ``[2**31, 2**32)``
would become uint32, so none are used (``2**31 - 1`` and ``2**32`` are int32 / int64).

Triton is imported lazily, with the conventions of ``megatron_lrmoe/triton_common.py`` (whose
``triton_available`` this module reuses): the kernel bodies are plain functions until
:func:`selection_kernels` wraps them, and under ``TRITON_INTERPRET=1`` (set before triton is first
imported) the launcher accepts CPU tensors and runs them in Triton's interpreter (the tests do).

Why one module of about a thousand lines: the ten kernels are one pipeline over one shared
representation (the ``[_ROWS, G]`` segment table, the int64 sort key, the fixed-point units), and
the exactness argument above holds only for all of them together; split, each piece would have to
restate the layout it shares with the others. About 300 of its lines are docstrings and
comments (that argument and the kernels' own notes).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from megatron_lrmoe.cuda_graphs import GraphCache, capture as capture_graph
from megatron_lrmoe.options import active_kernels
from megatron_lrmoe.select import contract
from megatron_lrmoe.triton_common import cdiv, device_ctx, jit_kernels

# select_triton is the entry point; the rest is the capture interface graphs/front.py builds on
# (its front graph replays these launches with the router gradient's and the packing's around
# them, into the same graph cache).
__all__ = [
    "GRAPHS",
    "HOST_ROWS",
    "ROW_BLOCK",
    "ROW_QUOTA",
    "ROW_SLOT",
    "ROW_UNIFORM",
    "CapturedSelection",
    "MergeTile",
    "graphs_wanted",
    "host_block",
    "launch_selection",
    "merge_tile",
    "select_triton",
    "selection_kernels",
]

# Rows per program of the row-parallel kernels, and of each step of the per-segment scans: 512
# programs at N = 131072, a few per multiprocessor; the best of 256 / 512 / 1024 rows with 4 or 8
# warps on an H200 (within a few microseconds of each other).
ROW_BLOCK = 256
_NUM_WARPS = 4

# Rows of the [_ROWS, G] int64 segment table. The first HOST_ROWS are filled on the host (the
# accumulators with zeros) and copied in one go; the rest are written by the per-segment kernels.
(
    _START,  # first row of the segment
    _END,  # one past its last row
    ROW_QUOTA,
    ROW_SLOT,  # first output slot: exclusive cumsum of quota
    ROW_UNIFORM,  # float64 bits of the segment's uniform (host uniforms only)
    _W,  # sum of w_int
    _W2,  # sum of w2
    _ASUM,  # sum of the floored units a
    _NACT,  # active rows
    _NFULL,  # active rows with a == 2**32
    _NGT1,  # active rows with a > 1
    _CSTAR,  # capped rows c*
    _WIN_LO,  # first rank the first repair pass changes
    _WIN_HI,  # one past the last one
    _RFULL,  # second repair pass: ranks below this reach their bound
    _REST,  # ... and this many units go to rank _RFULL
    _GROW,  # bit 0: first pass adds units; bit 1: second pass adds units
) = range(17)
HOST_ROWS = _CSTAR
_ROWS = _GROW + 1

# Bound to ``triton.language`` by :func:`selection_kernels`; the kernel bodies resolve it at
# compile (or interpret) time, never at definition time (annotations are strings here).
tl: Any = None


# --------------------------------------------------------------------------------------------
# Device helpers (plain functions; :func:`selection_kernels` replaces them by their triton.jit
# versions in this module's globals before any kernel compiles, so the kernels call the jitted
# ones).
# Integer constants: 2147483647 = 2**31 - 1, 4294967296 = 2**32 (a probability of 1).
# --------------------------------------------------------------------------------------------


def _sqrt_weight(key):
    """float64 ``sqrt`` of the sanitized fp32 score that a sort key encodes (its low 31 bits)."""
    bits = (2147483647 - (key & 2147483647)).to(tl.int32)
    return tl.sqrt(bits.to(tl.float32, bitcast=True).to(tl.float64))


def _round_half_even(x):
    """``torch.round`` of non-negative float64 values below 2**52, as int64."""
    r = tl.floor(x)
    d = x - r  # exact: 0 <= d < 1 and both are multiples of x's ulp
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
    """Bounds ``lo`` / ``hi`` of the probability units of rows at ``rank`` with weight ``w2``.

    Capped rows (rank < c*) are pinned to 2**32; active rows (uncapped, positive weight, quota
    left) may take ``[1, 2**32]``; all others 0 (``scoring._fixed_point_probabilities``). The
    floored units of an uncapped row are positive exactly when it is active, so they may stand
    in for ``w2`` here.
    """
    capped = rank < c_star
    active = (rank >= c_star) & (w2 > 0) & (remaining > 0)
    lo = tl.where(capped, 4294967296, active.to(tl.int64))
    hi = tl.where(capped | active, 4294967296, 0)
    return lo, hi


def _segment_add(acc_ptr, seg, inclusive, exclusive, first, last):
    """``acc[seg] += values`` for a block of sorted rows, two integer atomics per segment run.

    ``inclusive`` / ``exclusive`` are the block's scans of the values; ``first`` / ``last`` flag
    the first and last row of each run of one segment in the block. A run adds its inclusive scan
    at its last row and subtracts the exclusive one at its first row. Integer atomics are exact in
    any order, so the totals are deterministic.
    """
    tl.atomic_add(acc_ptr + seg, inclusive, mask=last, sem="relaxed")
    tl.atomic_add(acc_ptr + seg, -exclusive, mask=first, sem="relaxed")


_HELPERS = ("_sqrt_weight", "_round_half_even", "_fixed_point", "_bounds", "_segment_add")


# --------------------------------------------------------------------------------------------
# Kernel bodies (plain functions; wrapped by triton.jit or the interpreter in selection_kernels()).
# Row indices are int64: unit sums reach N * 2**32 and slots are int64 anyway.
# Row kernels: program p covers rows [p * BLOCK, (p + 1) * BLOCK) of the sorted or canonical
# order. Segment kernels: program g covers segment g. `table_ptr` is the [_ROWS, G] table; row r
# (numbered as _START.. above; kernels cannot read those module globals) is at table_ptr + r * G.
# --------------------------------------------------------------------------------------------


def _sort_key_kernel(
    key_ptr, scores_ptr, ends_ptr, n, num_segments, STEPS: tl.constexpr, BLOCK: tl.constexpr
):
    """``key[i] = segment(i) * 2**31 + (2**31 - 1 - bits(sanitize(score[i])))``.

    Sanitizing works on the bit pattern: NaN, +-inf (exponent all ones) and anything with the
    sign bit (negative values, -0.0) become +0.0, as ``scoring.sanitize`` plus the reference's
    ``clamp_min(0)`` on the bits do. The segment is the number of segment ends ``<= i``, found by
    a branch-free binary search over the ``[G]`` ends (``STEPS = ceil(log2(G + 1))``).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x = tl.load(scores_ptr + offs, mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    bad = ((bits & 0x7F800000) == 0x7F800000) | (bits < 0)
    bits = tl.where(bad, 0, bits).to(tl.int64)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + num_segments
    for _ in tl.static_range(STEPS):
        live = lo < hi
        mid = (lo + hi) >> 1
        end = tl.load(ends_ptr + mid, mask=mask & live, other=0)
        right = end <= offs
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & (~right), mid, hi)
    tl.store(key_ptr + offs, (lo << 31) + (2147483647 - bits), mask=mask)


def _tile_sort_kernel(tiles_ptr, key_ptr, n, TILE: tl.constexpr):
    """``tiles[t * TILE:(t + 1) * TILE]``: rows ``[t * TILE, (t + 1) * TILE)`` as packed
    ``key * 2**21 + row``, sorted (``tl.sort``); rows past ``n`` pad with the int64 maximum."""
    rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE).to(tl.int64)
    valid = rows < n
    key = tl.load(key_ptr + rows, mask=valid, other=0)
    packed = tl.where(valid, (key << 21) + rows, 9223372036854775807)
    tl.store(tiles_ptr + rows, tl.sort(packed))


def _merge_rank_kernel(
    order_ptr,
    sorted_key_ptr,
    key_ptr,
    tiles_ptr,
    table_ptr,
    n,
    num_segments,
    BLOCK_I: tl.constexpr,
    TILE: tl.constexpr,
    LOG_TILE: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """``torch.sort(key, stable=True)`` by ranks from sorted tiles (``_tile_sort_kernel``).

    A row's sorted position is the number of packed keys ``key * 2**21 + row`` below its own (the
    stable sort's order: keys, then rows; the host keeps rows below 2**21 and keys below 2**42,
    i.e. fewer than 2**11 segments: :func:`merge_tile`). Tiles before the first tile of its
    segment hold only lower segments' rows and tiles after the last one only higher segments',
    so the position is ``first_tile * TILE`` plus, for each tile its segment touches, the count
    of that sorted tile's entries below the row's: a branch-free binary search of
    ``LOG_TILE + 1`` dependent loads, over ``UNROLL`` tiles at once (independent loads in
    flight together: the searches are latency-bound).
    """
    G = num_segments
    i = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I).to(tl.int64)
    valid = i < n
    key_i = tl.load(key_ptr + i, mask=valid, other=0)
    seg_i = key_i >> 31
    t_first = tl.load(table_ptr + 0 * G + seg_i, mask=valid, other=0) // TILE
    t_last = (tl.load(table_ptr + 1 * G + seg_i, mask=valid, other=1) - 1) // TILE
    t_lo = tl.min(tl.where(valid, t_first, 9223372036854775807), 0)
    t_hi = tl.max(tl.where(valid, t_last, -1), 0)
    c_i = ((key_i << 21) + i)[:, None]
    below = tl.zeros([BLOCK_I, UNROLL], dtype=tl.int64)
    for t0 in range(t_lo, t_hi + 1, UNROLL):
        t = t0 + tl.arange(0, UNROLL).to(tl.int64)[None, :]
        active = valid[:, None] & (t >= t_first[:, None]) & (t <= t_last[:, None])
        base = tiles_ptr + t * TILE
        count = tl.zeros([BLOCK_I, UNROLL], dtype=tl.int64)
        for step in tl.static_range(LOG_TILE):
            half = TILE >> (step + 1)
            probe = tl.load(base + count + (half - 1), mask=active, other=0)
            count = tl.where(probe < c_i, count + half, count)
        last = tl.load(base + count, mask=active, other=0)
        count = tl.where(last < c_i, count + 1, count)
        below += tl.where(active, count, 0)
    pos = t_first * TILE + tl.sum(below, 1)
    tl.store(order_ptr + pos, i, mask=valid)
    tl.store(sorted_key_ptr + pos, key_i, mask=valid)


def _weights_kernel(
    units_ptr, block_sum_ptr, sorted_key_ptr, table_ptr, n, num_segments, BLOCK: tl.constexpr
):
    """``units = w_int`` (sorted order), ``table[_W] += w_int`` per segment, block totals."""
    G = num_segments
    block0 = tl.program_id(0).to(tl.int64) * BLOCK
    p = block0 + tl.arange(0, BLOCK).to(tl.int64)
    valid = p < n
    key = tl.load(sorted_key_ptr + p, mask=valid, other=2147483647)
    seg = key >> 31
    start = tl.load(table_ptr + 0 * G + seg, mask=valid, other=0)
    end = tl.load(table_ptr + 1 * G + seg, mask=valid, other=0)
    key_max = tl.load(sorted_key_ptr + start, mask=valid, other=2147483647)
    w_int = _fixed_point(_sqrt_weight(key), _sqrt_weight(key_max))
    w_int = tl.where(valid, w_int, 0)
    tl.store(units_ptr + p, w_int, mask=valid)
    first = valid & ((p == block0) | (p == start))
    last = valid & ((p == block0 + BLOCK - 1) | (p == end - 1))
    inclusive = tl.cumsum(w_int, 0)
    _segment_add(table_ptr + 5 * G, seg, inclusive, inclusive - w_int, first, last)
    tl.store(block_sum_ptr + tl.program_id(0), tl.sum(w_int, 0))


def _capping_kernel(units_ptr, block_sum_ptr, table_ptr, num_segments, BLOCK: tl.constexpr):
    """``table[_CSTAR] = c*``: the first rank failing ``left > 0 and left * w_int >= suffix``.

    ``left = quota - rank`` and ``suffix`` is the sum of ``w_int`` from that rank on. The test
    is monotone (``w_int`` does not increase with rank, so once it fails it fails for every later
    rank), so c* lies in the first row block whose last row fails: the block totals of
    ``_weights_kernel`` test every block's last row at once, and only that block is scanned.
    """
    G = num_segments
    g = tl.program_id(0)
    start = tl.load(table_ptr + 0 * G + g)
    end = tl.load(table_ptr + 1 * G + g)
    count = end - start
    quota = tl.load(table_ptr + 2 * G + g)
    total = tl.load(table_ptr + 5 * G + g)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    first_block = start // BLOCK
    last_block = tl.maximum(end - 1, start) // BLOCK
    # Rows of the first block before the segment, to turn block totals into in-segment sums.
    x = first_block * BLOCK + lanes
    before = tl.sum(tl.load(units_ptr + x, mask=x < start, other=0), 0)

    # Blocks [first_block, last_block) end inside the segment; find the first whose last row
    # fails (none: the failure, if any, is in last_block), and the in-segment sum before it.
    fail_block = last_block
    prefix = -before
    b0 = first_block
    while b0 < fail_block:
        b = b0 + lanes
        mb = b < last_block
        block_total = tl.load(block_sum_ptr + b, mask=mb, other=0)
        inclusive = prefix + tl.cumsum(block_total, 0)
        j = (b + 1) * BLOCK - 1
        w_int = tl.load(units_ptr + j, mask=mb, other=0)
        left = quota - (j - start)
        holds = (left > 0) & (left * w_int >= total - (inclusive - w_int))
        fail_block = tl.minimum(fail_block, tl.min(tl.where(mb & (~holds), b, last_block), 0))
        prefix += tl.sum(tl.where(mb & (b < fail_block), block_total, 0), 0)
        b0 += BLOCK

    # Scan the rows of fail_block that belong to the segment.
    prefix = tl.where(fail_block == first_block, 0, prefix)
    j = tl.maximum(fail_block * BLOCK, start) + lanes
    m = j < tl.minimum((fail_block + 1) * BLOCK, end)
    w_int = tl.load(units_ptr + j, mask=m, other=0)
    suffix = total - (prefix + tl.cumsum(w_int, 0) - w_int)
    left = quota - (j - start)
    holds = (left > 0) & (left * w_int >= suffix)
    c_star = tl.min(tl.where(m & (~holds), j - start, count), 0)
    tl.store(table_ptr + 11 * G + g, c_star)


def _uncapped_kernel(units_ptr, sorted_key_ptr, table_ptr, n, num_segments, BLOCK: tl.constexpr):
    """``units = w2`` and ``table[_W2] += w2``.

    ``w2`` is 0 for capped rows and the weight relative to the largest uncapped one (rank c*)
    otherwise; with no capped row that reference is the segment maximum, so ``w2 = w_int``.
    """
    G = num_segments
    block0 = tl.program_id(0).to(tl.int64) * BLOCK
    p = block0 + tl.arange(0, BLOCK).to(tl.int64)
    valid = p < n
    key = tl.load(sorted_key_ptr + p, mask=valid, other=2147483647)
    seg = key >> 31
    start = tl.load(table_ptr + 0 * G + seg, mask=valid, other=0)
    end = tl.load(table_ptr + 1 * G + seg, mask=valid, other=0)
    c_star = tl.load(table_ptr + 11 * G + seg, mask=valid, other=0)
    rank = p - start
    head = valid & (c_star > 0) & (c_star < end - start)
    key_head = tl.load(sorted_key_ptr + start + c_star, mask=head, other=2147483647)
    w_int = tl.load(units_ptr + p, mask=valid, other=0)
    w2 = tl.where(rank < c_star, 0, _fixed_point(_sqrt_weight(key), _sqrt_weight(key_head)))
    w2 = tl.where(valid, tl.where(c_star == 0, w_int, w2), 0)
    tl.store(units_ptr + p, w2, mask=valid)
    first = valid & ((p == block0) | (p == start))
    last = valid & ((p == block0 + BLOCK - 1) | (p == end - 1))
    inclusive = tl.cumsum(w2, 0)
    _segment_add(table_ptr + 6 * G, seg, inclusive, inclusive - w2, first, last)


def _units_kernel(
    units_ptr,
    units_canon_ptr,
    rank_canon_ptr,
    sorted_key_ptr,
    order_ptr,
    table_ptr,
    n,
    num_segments,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Floored units ``a`` (sorted order and canonical), sorted ranks at canonical positions.

    ``a = clamp(floor(remaining * w2 / max(W2, 1) * 2**32), lo, hi)``; adds the segment totals
    of ``a``, of the active rows, and of the active rows with ``a == 2**32`` and ``a > 1``.
    ``topk`` (``SAMPLE`` off) only scatters the ranks.
    """
    G = num_segments
    block0 = tl.program_id(0).to(tl.int64) * BLOCK
    p = block0 + tl.arange(0, BLOCK).to(tl.int64)
    valid = p < n
    key = tl.load(sorted_key_ptr + p, mask=valid, other=2147483647)
    seg = key >> 31
    start = tl.load(table_ptr + 0 * G + seg, mask=valid, other=0)
    rank = p - start
    row = tl.load(order_ptr + p, mask=valid, other=0)
    tl.store(rank_canon_ptr + row, rank, mask=valid)
    if SAMPLE:
        end = tl.load(table_ptr + 1 * G + seg, mask=valid, other=0)
        quota = tl.load(table_ptr + 2 * G + seg, mask=valid, other=0)
        total2 = tl.load(table_ptr + 6 * G + seg, mask=valid, other=0)
        c_star = tl.load(table_ptr + 11 * G + seg, mask=valid, other=0)
        remaining = quota - c_star
        w2 = tl.load(units_ptr + p, mask=valid, other=0)
        lo, hi = _bounds(rank, w2, c_star, remaining)
        ideal = (remaining * w2).to(tl.float64) / tl.maximum(total2, 1).to(tl.float64)
        a = tl.floor(ideal * 4294967296.0).to(tl.int64)
        a = tl.where(valid, tl.minimum(tl.maximum(a, lo), hi), 0)
        tl.store(units_ptr + p, a, mask=valid)
        tl.store(units_canon_ptr + row, a, mask=valid)
        active = valid & (rank >= c_star) & (w2 > 0) & (remaining > 0)
        first = valid & ((p == block0) | (p == start))
        last = valid & ((p == block0 + BLOCK - 1) | (p == end - 1))
        inclusive = tl.cumsum(a, 0)
        _segment_add(table_ptr + 7 * G, seg, inclusive, inclusive - a, first, last)
        # The three row counts share one scan: 21-bit fields hold any block's counts.
        counts = (
            active.to(tl.int64)
            + ((active & (a == 4294967296)).to(tl.int64) << 21)
            + ((active & (a > 1)).to(tl.int64) << 42)
        )
        inclusive = tl.cumsum(counts, 0)
        exclusive = inclusive - counts
        for field in tl.static_range(3):
            inc = (inclusive >> (21 * field)) & 2097151
            exc = (exclusive >> (21 * field)) & 2097151
            _segment_add(table_ptr + (8 + field) * G, seg, inc, exc, first, last)


def _repair_kernel(units_ptr, table_ptr, num_segments, BLOCK: tl.constexpr):
    """Where the reference's two repair passes move units in segment g (module docstring).

    First pass (one unit per row with room / slack, largest weights first): ranks
    ``[_WIN_LO, _WIN_HI)`` gain (``_GROW`` bit 0) or lose one unit. Second pass (whole capacities
    from rank c* on): ranks below ``_RFULL`` reach their upper (bit 1) or lower bound and rank
    ``_RFULL`` moves ``_REST`` units.
    """
    G = num_segments
    ONE = 4294967296
    g = tl.program_id(0)
    start = tl.load(table_ptr + 0 * G + g)
    count = tl.load(table_ptr + 1 * G + g) - start
    quota = tl.load(table_ptr + 2 * G + g)
    a_sum = tl.load(table_ptr + 7 * G + g)
    n_active = tl.load(table_ptr + 8 * G + g)
    n_full = tl.load(table_ptr + 9 * G + g)
    n_gt1 = tl.load(table_ptr + 10 * G + g)
    c_star = tl.load(table_ptr + 11 * G + g)
    remaining = quota - c_star

    deficit1 = quota * ONE - a_sum
    grow1 = deficit1 >= 0
    amount1 = tl.where(grow1, deficit1, -deficit1)
    win_lo = tl.where(grow1, c_star + n_full, c_star)
    moved1 = tl.minimum(amount1, tl.where(grow1, n_active - n_full, n_gt1))
    deficit2 = tl.where(grow1, deficit1 - moved1, deficit1 + moved1)
    grow2 = deficit2 >= 0
    amount2 = tl.where(grow2, deficit2, -deficit2)

    # Second pass: first rank whose inclusive capacity sum reaches amount2 (none: all rows).
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    r_full = tl.where(amount2 > 0, count, 0)
    rest = tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int64)
    j0 = c_star
    while (j0 < count) & (amount2 > 0) & (r_full == count):
        j = j0 + lanes
        m = j < count
        a = tl.load(units_ptr + start + j, mask=m, other=0)
        lo, hi = _bounds(j, a, c_star, remaining)
        inside = (j >= win_lo) & (j < win_lo + moved1)
        a = tl.where(grow1, a + inside.to(tl.int64), a - inside.to(tl.int64))
        cap = tl.where(m, tl.where(grow2, tl.minimum(hi - a, ONE), tl.minimum(a - lo, ONE)), 0)
        inclusive = carry + tl.cumsum(cap, 0)
        reached = m & (inclusive >= amount2)
        r = tl.min(tl.where(reached, j, count), 0)
        rest = tl.where(r < count, tl.sum(tl.where(j == r, amount2 - (inclusive - cap), 0), 0), 0)
        r_full = r
        carry += tl.sum(cap, 0)
        j0 += BLOCK
    tl.store(table_ptr + 12 * G + g, win_lo)
    tl.store(table_ptr + 13 * G + g, win_lo + moved1)
    tl.store(table_ptr + 14 * G + g, r_full)
    tl.store(table_ptr + 15 * G + g, rest)
    tl.store(table_ptr + 16 * G + g, grow1.to(tl.int64) + 2 * grow2.to(tl.int64))


def _finalize_kernel(
    units_canon_ptr,
    rank_canon_ptr,
    block_sum_ptr,
    key_ptr,
    table_ptr,
    n,
    num_segments,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Final units (``sample``) or kept flags (``topk``) in canonical order, and block totals."""
    G = num_segments
    x = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = x < n
    seg = tl.load(key_ptr + x, mask=valid, other=0) >> 31
    rank = tl.load(rank_canon_ptr + x, mask=valid, other=0)
    quota = tl.load(table_ptr + 2 * G + seg, mask=valid, other=0)
    if SAMPLE:
        c_star = tl.load(table_ptr + 11 * G + seg, mask=valid, other=0)
        win_lo = tl.load(table_ptr + 12 * G + seg, mask=valid, other=0)
        win_hi = tl.load(table_ptr + 13 * G + seg, mask=valid, other=0)
        r_full = tl.load(table_ptr + 14 * G + seg, mask=valid, other=0)
        rest = tl.load(table_ptr + 15 * G + seg, mask=valid, other=0)
        grow = tl.load(table_ptr + 16 * G + seg, mask=valid, other=0)
        a = tl.load(units_canon_ptr + x, mask=valid, other=0)
        lo, hi = _bounds(rank, a, c_star, quota - c_star)
        step1 = ((rank >= win_lo) & (rank < win_hi)).to(tl.int64)
        a = tl.where((grow & 1) != 0, a + step1, a - step1)
        grow2 = (grow & 2) != 0
        a = tl.where(rank == r_full, tl.where(grow2, a + rest, a - rest), a)
        a = tl.where(rank < r_full, tl.where(grow2, hi, lo), a)
        value = tl.where(valid, a, 0)
    else:
        value = (valid & (rank < quota)).to(tl.int64)
    tl.store(units_canon_ptr + x, value, mask=valid)
    tl.store(block_sum_ptr + tl.program_id(0), tl.sum(value, 0))


def _draw_kernel(
    kept_ptr,
    weight_ptr,
    units_canon_ptr,
    block_sum_ptr,
    key_ptr,
    table_ptr,
    uniforms_ptr,
    n,
    num_segments,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Kept rows of a canonical block, written at their output slots.

    ``sample``: with ``U`` the global running sum of the units, the in-segment running sum is
    ``A = U - quota_before * 2**32`` (the reference's formula); a row is kept iff a grid point
    ``v + m * 2**32`` (``v = clamp(floor(u * 2**32), 0, 2**32 - 1)``) lies in ``[A - a, A)``, and
    the number of grid points below ``A - a`` is its kept rank in the segment. ``topk``: the
    running count of kept flags is the output slot itself.
    """
    G = num_segments
    ONE = 4294967296
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    carry = tl.zeros([], dtype=tl.int64)
    for b0 in range(0, pid, BLOCK):
        b = b0 + lanes
        carry += tl.sum(tl.load(block_sum_ptr + b, mask=b < pid, other=0), 0)
    x = pid.to(tl.int64) * BLOCK + lanes.to(tl.int64)
    valid = x < n
    value = tl.load(units_canon_ptr + x, mask=valid, other=0)
    upper = carry + tl.cumsum(value, 0)
    lower = upper - value
    if SAMPLE:
        seg = tl.load(key_ptr + x, mask=valid, other=0) >> 31
        slot0 = tl.load(table_ptr + 3 * G + seg, mask=valid, other=0)
        u = tl.load(uniforms_ptr + seg, mask=valid, other=0.0)
        # The clamp to 2**32 - 1 happens in int64: 2**32 - 1 is no fp32 constant.
        v = tl.minimum(tl.maximum(tl.floor(u * 4294967296.0), 0.0), 4294967296.0)
        shift = ONE - 1 - tl.minimum(v.to(tl.int64), ONE - 1)
        below = ((lower - slot0 * ONE) + shift) >> 32
        keep = valid & ((((upper - slot0 * ONE) + shift) >> 32) > below)
        slot = slot0 + below
        weight = (4294967296.0 / tl.where(keep, value, 1).to(tl.float64)).to(tl.float32)
    else:
        keep = valid & (value != 0)
        slot = lower
        weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
    tl.store(kept_ptr + slot, x, mask=keep)
    tl.store(weight_ptr + slot, weight, mask=keep)


@functools.lru_cache(maxsize=1)
def selection_kernels() -> SimpleNamespace:
    """The kernel bodies wrapped by ``triton.jit`` (built once, on first launch).

    Under ``TRITON_INTERPRET=1`` these are interpreter functions that run on host tensors;
    ``interpreted`` says so.
    """
    return jit_kernels(
        globals(),
        _HELPERS,
        {
            # ``interpreted`` is read off the first.
            "draw": _draw_kernel,
            "sort_key": _sort_key_kernel,
            "tile_sort": _tile_sort_kernel,
            "merge_rank": _merge_rank_kernel,
            "weights": _weights_kernel,
            "capping": _capping_kernel,
            "uncapped": _uncapped_kernel,
            "units": _units_kernel,
            "repair": _repair_kernel,
            "finalize": _finalize_kernel,
        },
        "Triton selection",
    )


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _host_table(
    counts_h: torch.Tensor,
    quota_h: torch.Tensor,
    uniforms: torch.Tensor | None,
    pin: bool,
) -> torch.Tensor:
    """The host rows (``[HOST_ROWS, G]`` int64) of the segment table.

    Rows ``_START`` .. ``_NGT1`` (accumulators zeroed here, so no memset launches), ``ROW_UNIFORM``
    holds the float64 bits of host ``uniforms`` (if given). Pinned (``pin``): a copy from it
    returns at once, and the caching host allocator keeps the block alive until the copy ran.
    """
    block = host_block(counts_h, quota_h, uniforms, pin, lead=0)
    return block.view(HOST_ROWS, counts_h.numel())


def host_block(
    counts_h: torch.Tensor,
    quota_h: torch.Tensor,
    uniforms: torch.Tensor | None,
    pin: bool,
    lead: int,
) -> torch.Tensor:
    """``[lead + HOST_ROWS * G]`` int64: ``lead`` slots for the caller (not written), then the
    rows of :func:`_host_table`, so that both go to the device in one copy."""
    num_segments = counts_h.numel()
    flat = torch.empty(lead + HOST_ROWS * num_segments, dtype=torch.int64, pin_memory=pin)
    # Filled through numpy: ~1 us per row where a torch CPU op costs ~5 us.
    rows = flat.numpy()[lead:].reshape(HOST_ROWS, num_segments)
    rows[ROW_UNIFORM:] = 0  # the uniforms (unless given) and the accumulators; the rest below
    counts_np, quota_np = counts_h.numpy(), quota_h.numpy()
    np.cumsum(counts_np, out=rows[_END])
    np.subtract(rows[_END], counts_np, out=rows[_START])
    rows[ROW_QUOTA] = quota_np
    np.cumsum(quota_np, out=rows[ROW_SLOT])
    rows[ROW_SLOT] -= quota_np
    if uniforms is not None:
        if uniforms.dtype != torch.float64:
            uniforms = uniforms.to(torch.float64)
        rows[ROW_UNIFORM].view(np.float64)[:] = uniforms.numpy()
    return flat


def _segment_table(
    counts_h: torch.Tensor,
    quota_h: torch.Tensor,
    uniforms: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The ``[_ROWS, G]`` int64 segment table on ``device``, from one non-blocking copy of
    :func:`_host_table`; the rows from ``_CSTAR`` on are written by the per-segment kernels."""
    host = _host_table(counts_h, quota_h, uniforms, pin=device.type == "cuda")
    table = torch.empty((_ROWS, counts_h.numel()), dtype=torch.int64, device=device)
    table[:HOST_ROWS].copy_(host, non_blocking=True)
    return table


def select_triton(
    policy: str,
    scores: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    block: int | None = None,
    owned: bool = True,
) -> contract.Selection:
    """``scoring.select_topk`` / ``scoring.select_sample`` as a few row-parallel Triton kernels.

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
        block: rows per program (a power of two >= 16), for tests and tuning.
        owned: ``False``: a replayed selection returns its graph's output buffers, not copies
            (see ``scoring.select``).

    Returns:
        The selection.

    Raises:
        ValueError: unknown policy, ``"sample"`` without uniforms, malformed shapes, counts not
            adding up to N, a quota out of range, or host tensors without the interpreter.
    """
    sample = contract.check_policy(policy, uniforms)
    block = ROW_BLOCK if block is None else block
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    scores = contract.check_scores(scores).contiguous()
    n = scores.numel()
    device = scores.device
    counts_h, quota_h = contract.host_segments(counts, quota, n)
    num_segments = counts_h.numel()
    host_uniforms = None
    if sample:
        contract.check_uniforms(uniforms, num_segments)
        if uniforms.device.type == "cpu":
            host_uniforms = uniforms
    kernels = selection_kernels()
    if device.type != "cuda" and not kernels.interpreted:
        raise ValueError(
            "select_triton got host tensors; it needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported (the interpreter runs the kernels on the host)"
        )
    num_kept = int(quota_h.numpy().sum())
    if num_kept == 0:
        table = _segment_table(counts_h, quota_h, host_uniforms, device)
        empty = torch.empty(0, dtype=torch.int64, device=device)
        # Nothing to write (and N == 0 has nothing to sort).
        return contract.Selection(empty, empty.float(), table[ROW_QUOTA])
    if (sample and host_uniforms is None) or not graphs_wanted(device):
        return _select_eager(
            kernels, scores, counts_h, quota_h, host_uniforms, uniforms, sample, block,
            merge_tile(counts_h),
        )
    return GRAPHS.select(
        kernels, scores, counts_h, quota_h, host_uniforms, sample, block, num_kept, owned
    )


def _select_eager(
    kernels: SimpleNamespace,
    scores: torch.Tensor,
    counts_h: torch.Tensor,
    quota_h: torch.Tensor,
    host_uniforms: torch.Tensor | None,
    uniforms: torch.Tensor | None,
    sample: bool,
    block: int,
    sort: MergeTile | None,
) -> contract.Selection:
    """One selection, every kernel launched from Python (``sort``: :func:`merge_tile`)."""
    device = scores.device
    table = _segment_table(counts_h, quota_h, host_uniforms, device)
    num_kept = int(quota_h.sum())
    kept = torch.empty(num_kept, dtype=torch.int64, device=device)
    weight = torch.empty(num_kept, dtype=torch.float32, device=device)
    if host_uniforms is not None:
        u = table[ROW_UNIFORM].view(torch.float64)
    elif sample:
        u = uniforms.detach().to(device=device, dtype=torch.float64).contiguous()
    else:
        u = scores  # unread placeholder
    launch_selection(kernels, scores, table, kept, weight, u, sample, block, sort)
    return contract.Selection(kept, weight, table[ROW_QUOTA])


def launch_selection(
    kernels: SimpleNamespace,
    scores: torch.Tensor,
    table: torch.Tensor,
    kept: torch.Tensor,
    weight: torch.Tensor,
    u: torch.Tensor,
    sample: bool,
    block: int,
    sort: MergeTile | None,
) -> None:
    """Steps 2-10 of the module docstring on a filled segment table; writes ``kept[:K]`` and
    ``weight[:K]`` (K = the table's quota total; the buffers may be longer). ``sort``: how
    step 3 sorts (:func:`merge_tile` of the segments)."""
    device = scores.device
    n, g = scores.numel(), table.shape[1]
    rows = (cdiv(n, block),)
    segments = (g,)
    with device_ctx(scores):
        key = _sort_keys(kernels, scores, table, block)
        sorted_key, order = _sort_order(kernels, key, table, sort)
        units = torch.empty(n, dtype=torch.int64, device=device) if sample else key
        units_canon = torch.empty(n, dtype=torch.int64, device=device)
        rank_canon = torch.empty(n, dtype=torch.int64, device=device)
        block_sum = torch.empty(rows[0], dtype=torch.int64, device=device)
        common = dict(BLOCK=block, num_warps=_NUM_WARPS)
        if sample:
            kernels.weights[rows](units, block_sum, sorted_key, table, n, g, **common)
            kernels.capping[segments](units, block_sum, table, g, **common)
            kernels.uncapped[rows](units, sorted_key, table, n, g, **common)
        kernels.units[rows](
            units, units_canon, rank_canon, sorted_key, order, table, n, g, SAMPLE=sample, **common
        )
        if sample:
            kernels.repair[segments](units, table, g, **common)
        kernels.finalize[rows](
            units_canon, rank_canon, block_sum, key, table, n, g, SAMPLE=sample, **common
        )
        kernels.draw[rows](
            kept, weight, units_canon, block_sum, key, table, u, n, g, SAMPLE=sample, **common
        )


class MergeTile(NamedTuple):
    """A launch of the merge sort (``_tile_sort_kernel`` + ``_merge_rank_kernel``)."""

    block_i: int  # rows per program of _merge_rank_kernel
    tile: int  # rows per sorted tile (a power of two)
    unroll: int  # tiles searched at once
    warps: int


# The merge sort's launch by the largest segment's rows, up to the last bound; larger segments
# take torch.sort. Each row searches every tile of its segment, so the time grows with the
# largest segment; larger tiles shorten the searches there. Measured on an H200 at 32768-262144
# rows, 8-128 segments (docs/history/notebook.md section 21): 6-18 us where cub's radix sort takes
# 69-82, 35-48 us at 8192-16384 rows in one segment, 189 us against cub's 92 at 32768. (512-row
# tiles were within a microsecond of 256-row ones up to 4096 rows, 1.8 us slower at 1024.)
MERGE_TILES: tuple[tuple[int, MergeTile], ...] = (
    (4096, MergeTile(128, 256, 4, 4)),
    (16384, MergeTile(128, 1024, 4, 8)),
)
# Most tile searches (``merge_searches``) for the merge sort; more take torch.sort. Past the
# longest searches, the time grows with their number: about 10 us plus 20 us per million on an
# H200 (35-37 us at 0.9-1.3 million, 189 us at 8.9 million, where cub's sort took 92; section
# 21), so this limit (about 70 us) keeps many large segments (a very large layer call) on cub.
MERGE_SORT_MAX_SEARCHES = 3_000_000


def merge_searches(counts: np.ndarray, tile: int) -> int:
    """Binary searches of ``_merge_rank_kernel`` over segments of these sizes, at most: each
    row searches every tile its segment touches (``count // tile + 2`` at most)."""
    counts = np.asarray(counts, dtype=np.int64)
    return int(np.dot(counts, counts // tile + 2))


def merge_tile(counts_h: torch.Tensor) -> MergeTile | None:
    """How the selection sorts the keys of segments of these (host) sizes: the merge sort's
    launch (:data:`MERGE_TILES` by the largest segment), or ``None`` for ``torch.sort`` (cub's
    radix sort, whatever the sizes): past the table's last bound or
    ``MERGE_SORT_MAX_SEARCHES``, and from ``2**21`` rows or ``2**11`` segments on (the merge
    sort's packed ``(key, row)`` comparison). Both give the same order; the choice is part of
    every captured graph's key."""
    counts = counts_h.numpy()
    # In this order: with fewer than 2**21 rows the int64 sums below cannot overflow.
    if counts.size >= (1 << 11) or int(counts.sum()) >= (1 << 21):
        return None
    largest = int(counts.max()) if counts.size else 0
    tile = next((tile for bound, tile in MERGE_TILES if largest <= bound), None)
    if tile is None or merge_searches(counts, tile.tile) > MERGE_SORT_MAX_SEARCHES:
        return None
    return tile


def _sort_keys(
    kernels: SimpleNamespace, scores: torch.Tensor, table: torch.Tensor, block: int
) -> torch.Tensor:
    """``[N]`` int64 sort keys of ``scores`` over the table's segments (``_sort_key_kernel``)."""
    n, g = scores.numel(), table.shape[1]
    key = torch.empty(n, dtype=torch.int64, device=scores.device)
    steps = max(1, math.ceil(math.log2(g + 1)))
    kernels.sort_key[(cdiv(n, block),)](
        key, scores, table[_END], n, g, STEPS=steps, BLOCK=block, num_warps=_NUM_WARPS
    )
    return key


def _sort_order(
    kernels: SimpleNamespace, key: torch.Tensor, table: torch.Tensor, tile: MergeTile | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_key, order)`` of ``torch.sort(key, stable=True)``: by the merge sort with
    ``tile`` (:func:`merge_tile`), or ``torch.sort`` where it is ``None``."""
    if tile is None:
        return _sort_order_reference(key)
    n = key.numel()
    order = torch.empty(n, dtype=torch.int64, device=key.device)
    sorted_key = torch.empty_like(key)
    num_tiles = cdiv(n, tile.tile)
    tiles = torch.empty(num_tiles * tile.tile, dtype=torch.int64, device=key.device)
    kernels.tile_sort[(num_tiles,)](tiles, key, n, TILE=tile.tile, num_warps=tile.warps)
    kernels.merge_rank[(cdiv(n, tile.block_i),)](
        order, sorted_key, key, tiles, table, n, table.shape[1],
        BLOCK_I=tile.block_i, TILE=tile.tile, LOG_TILE=tile.tile.bit_length() - 1,
        UNROLL=tile.unroll, num_warps=tile.warps,
    )
    return sorted_key, order


def _sort_order_reference(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(key, stable=True)`` of the int64 keys: what the merge sort computes."""
    return torch.sort(key, stable=True)


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------


def graphs_wanted(device: torch.device) -> bool:
    """Replay captured selections: on CUDA, not inside someone else's capture, not switched off
    (``select_graphs`` of the active kernel options; off, graphs/front.py's graphs, which
    replay these launches, are off as well)."""
    return (
        device.type == "cuda"
        and active_kernels().select_graphs
        and not torch.cuda.is_current_stream_capturing()
    )


class CapturedSelection:
    """One captured selection: static inputs and outputs, and the graph that links them.

    Inputs are copied in before a replay (the scores, ``[N]``, device to device; the host rows
    of the segment table, the one host-to-device copy the eager path makes too); outputs have
    room for every row (``kept[:K]`` is written, K varies with the quotas). Replays run on the
    stream of the call, in order with the kernels that read the previous outputs, and the
    outputs are handed out as copies, so a later replay cannot change what a caller holds;
    except with ``owned=False``, for a caller that queues every use of them before the next
    replay (the layer's backward), which saves the copies.
    """

    def __init__(
        self,
        kernels: SimpleNamespace,
        scores: torch.Tensor,
        host: torch.Tensor,
        sample: bool,
        block: int,
        sort: MergeTile | None,
    ) -> None:
        n, g = scores.numel(), host.shape[1]
        self.scores = torch.empty_like(scores)
        self._outputs(scores.device, n, g, lead=0)
        u = self.table[ROW_UNIFORM].view(torch.float64) if sample else self.scores
        args = (kernels, self.scores, self.table, self.kept, self.weight, u, sample, block, sort)
        self._load(scores, host)
        self._capture(lambda: launch_selection(*args), scores.device)

    def _outputs(self, device: torch.device, n: int, g: int, lead: int) -> None:
        """The segment table (after ``lead`` int64 slots of one flat buffer: the host part of
        both goes in with one copy) and room for ``n`` kept rows."""
        self.flat = torch.empty(lead + _ROWS * g, dtype=torch.int64, device=device)
        self.table = self.flat[lead:].view(_ROWS, g)
        self.kept = torch.empty(n, dtype=torch.int64, device=device)
        self.weight = torch.empty(n, dtype=torch.float32, device=device)

    def _capture(self, launch: Callable[[], None], device: torch.device) -> None:
        self.graph = capture_graph(launch, device)

    def _load(self, scores: torch.Tensor, host: torch.Tensor) -> None:
        self.scores.copy_(scores)
        self.table[:HOST_ROWS].copy_(host, non_blocking=True)

    def outputs(self, num_kept: int, owned: bool = True) -> contract.Selection:
        """The last run's outputs: copies, or (``owned=False``) the buffers themselves."""
        kept, weight, quota = self.kept[:num_kept], self.weight[:num_kept], self.table[ROW_QUOTA]
        if owned:
            kept, weight, quota = kept.clone(), weight.clone(), quota.clone()
        return contract.Selection(kept, weight, quota)

    def run(
        self, scores: torch.Tensor, host: torch.Tensor, num_kept: int, owned: bool
    ) -> contract.Selection:
        self._load(scores, host)
        self.graph.replay()
        return self.outputs(num_kept, owned)


class _GraphCache(GraphCache[CapturedSelection]):
    """Captured selections by shape (at most 8, each holding a few ``[N]`` buffers in its
    memory pool)."""

    def select(
        self,
        kernels: SimpleNamespace,
        scores: torch.Tensor,
        counts_h: torch.Tensor,
        quota_h: torch.Tensor,
        host_uniforms: torch.Tensor | None,
        sample: bool,
        block: int,
        num_kept: int,
        owned: bool,
    ) -> contract.Selection:
        device = scores.device
        sort = merge_tile(counts_h)
        key = (device.index, scores.numel(), counts_h.numel(), sample, block, scores.dtype, sort)
        entry, capture = self.lookup(key)
        if entry is None and not capture:
            return _select_eager(
                kernels, scores, counts_h, quota_h, host_uniforms, None, sample, block, sort
            )
        host = _host_table(counts_h, quota_h, host_uniforms, pin=True)
        with device_ctx(scores):
            if entry is None:
                entry = CapturedSelection(kernels, scores, host, sample, block, sort)
                self.add(key, entry)
                return entry.outputs(num_kept)
            return entry.run(scores, host, num_kept, owned)


# Also holds graphs/front.py's captures (one least-recently-used list of both kinds).
GRAPHS = _GraphCache()
