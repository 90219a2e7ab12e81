"""The pair permutation plan (``permutation.PairPermutation``) from two Triton kernels.

Shape legend: T tokens, E experts, K top-k (slots per token), S pairs, B token blocks of
``BLOCK_T`` tokens.

Why: the torch plan (a transposed copy of the map, ``nonzero_static``, a division, a modulo, a
sort key and an ``argsort``) is about 15 small kernels, 280-320 us of host time per MoE layer on
an H200 while the device work is tiny. Here it is two Triton launches, one torch op and two
allocations (the int64 outputs share one buffer):

1. ``_pair_count_kernel`` (B programs): ``counts[e, b]`` = True entries of column ``e`` in
   token block ``b``, stored expert-major (``[E, B]`` flattened).
2. ``counts.cumsum_(0)`` (one torch op, in place): because the layout is expert-major, the
   inclusive scan at ``[e, b]`` is the number of pairs of all experts before ``e`` plus those of
   expert ``e`` in blocks ``<= b``, i.e. where block ``b``'s pairs of expert ``e`` end.
3. ``_pair_write_kernel`` (B programs): re-reads its block, ranks each True ``(t, e)`` within
   its column of the block (a cumsum over tokens) and within its row (a cumsum over experts),
   and writes ``token_of_pair[pair] = t``, ``expert_of_pair[pair] = e`` and ``slot_pair[t, k] =
   pair``; then ``-1`` into the slots past each row's last pair. Every position is written by
   exactly one program, so the plan is deterministic without atomics.

Contract (the caller's speculative ``num_pairs = T * K``, see ``dispatcher.expect_full_routing``):
with exactly ``num_pairs`` True entries the plan is bit-identical to the torch one. With fewer,
pairs past the real count read token ``T - 1`` and expert ``E - 1`` (the torch path's padding,
as negative indices), and slots of missing pairs are ``-1``. With more, pairs past ``num_pairs``
are dropped (their slots ``-1``). A row with more than K True entries keeps its first K in
``slot_pair``. Every index stays in bounds in all these cases; nothing is range-checked on the
host (that would be a sync).

Kernel bodies are plain functions until :func:`_kernels` wraps them (``triton.jit``, or
Triton's interpreter under ``TRITON_INTERPRET=1``, which runs them on host tensors; the tests
do that in a subprocess), following ``megatron_lrmoe.triton_common``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.triton_common import cdiv, device_ctx

__all__ = ["pair_plan_triton", "use_pair_plan_triton"]

# Map elements per program tile (BLOCK_T x BLOCK_E), at least 16 tokens: 8 per thread with 8
# warps. The write kernel keeps per element two ranks, a pair and three store addresses; ptxas
# (sm_90, triton 3.8) gives it 158 registers at 16 x 128 and 204 at 16 x 256, no spills, where
# 64 x 128 spills.
_TILE = 2048
_MIN_BLOCK_T = 16
_MAX_BLOCK_E = 256
_NUM_WARPS = 8
_FILL_BLOCK = 256

# Bound to ``triton.language`` by ``_kernels()``; the bodies resolve it at compile time.
tl: Any = None


def _pair_count_kernel(
    counts_ptr,
    map_ptr,
    n_tokens,
    n_experts,
    n_blocks,
    stride_t,
    stride_e,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """``counts[e * n_blocks + b]`` = True entries of column ``e`` in token block ``b``."""
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    rows = offs_t.to(tl.int64) * stride_t
    for e0 in range(0, n_experts, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        mask_e = offs_e < n_experts
        mask = mask_t[:, None] & mask_e[None, :]
        src = rows[:, None] + offs_e.to(tl.int64)[None, :] * stride_e
        hit = tl.load(map_ptr + src, mask=mask, other=0)
        count = tl.sum((hit != 0).to(tl.int32), axis=0)
        tl.store(counts_ptr + offs_e * n_blocks + pid, count, mask=mask_e)


def _pair_write_kernel(
    token_ptr,
    expert_ptr,
    slot_ptr,
    ends_ptr,
    map_ptr,
    n_tokens,
    n_experts,
    n_blocks,
    n_pairs,
    topk,
    stride_t,
    stride_e,
    fill_chunk,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    """Pairs, expert-major and token-ascending, of token block ``pid``; its slot plan rows; and
    program ``pid``'s share of the padding past the real pair count (see the module doc).

    ``ends[e * n_blocks + b]`` is the inclusive scan of the counts: one past the last pair of
    expert ``e`` in block ``b``.
    """
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    tok = offs_t.to(tl.int64)
    rows = tok * stride_t
    # True entries of each row in the expert chunks already done: the slot of the next one.
    row_base = tl.zeros([BLOCK_T], dtype=tl.int32)
    for e0 in range(0, n_experts, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        mask_e = offs_e < n_experts
        mask = mask_t[:, None] & mask_e[None, :]
        src = rows[:, None] + offs_e.to(tl.int64)[None, :] * stride_e
        hit = tl.load(map_ptr + src, mask=mask, other=0)
        one = (hit != 0).to(tl.int32)
        hit = one != 0
        col_rank = tl.cumsum(one, axis=0)  # inclusive, within the block's column
        row_rank = tl.cumsum(one, axis=1) + row_base[:, None]  # inclusive, within the row
        count = tl.sum(one, axis=0)
        end = tl.load(ends_ptr + offs_e * n_blocks + pid, mask=mask_e, other=0)
        pair = (end - count)[None, :] + col_rank - 1
        in_range = pair < n_pairs
        pair = pair.to(tl.int64)
        tok_2d = tok[:, None] + tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int64)
        exp_2d = offs_e.to(tl.int64)[None, :] + tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int64)
        tl.store(token_ptr + pair, tok_2d, mask=hit & in_range)
        tl.store(expert_ptr + pair, exp_2d, mask=hit & in_range)
        slot = row_rank - 1
        tl.store(
            slot_ptr + tok[:, None] * topk + slot,
            tl.where(in_range, pair, -1),
            mask=hit & (slot < topk),
        )
        row_base += tl.sum(one, axis=1)
    offs_k = tl.arange(0, BLOCK_K)
    empty = mask_t[:, None] & (offs_k[None, :] >= row_base[:, None]) & (offs_k[None, :] < topk)
    tl.store(
        slot_ptr + tok[:, None] * topk + offs_k[None, :],
        tl.full([BLOCK_T, BLOCK_K], -1, dtype=tl.int64),
        mask=empty,
    )
    # Padding: pairs in [total, n_pairs), split into one chunk per program. Empty (no loop
    # iteration) when the map has n_pairs True entries, the usual case.
    total = tl.load(ends_ptr + n_experts * n_blocks - 1)
    lo = tl.maximum(pid * fill_chunk, total)
    hi = tl.minimum(pid * fill_chunk + fill_chunk, n_pairs)
    for i0 in range(lo, hi, FILL_BLOCK):
        offs = (i0 + tl.arange(0, FILL_BLOCK)).to(tl.int64)
        pad = offs < hi
        tl.store(token_ptr + offs, tl.full([FILL_BLOCK], 0, tl.int64) + (n_tokens - 1), mask=pad)
        tl.store(expert_ptr + offs, tl.full([FILL_BLOCK], 0, tl.int64) + (n_experts - 1), mask=pad)


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    """The kernel bodies wrapped by ``triton.jit`` (or the interpreter), built once."""
    return triton_common.jit_kernels(
        globals(),
        (),
        {
            "count": _pair_count_kernel,
            # The speculative build (n_pairs = T * K) and the real one (any count) share a
            # binary.
            "write": (_pair_write_kernel, {"do_not_specialize": ["n_pairs", "fill_chunk"]}),
        },
        "pair plan kernels",
    )


# Largest map (T * E entries) the kernels serve. Measured on an H200 (gpu_run11,
# benchmarks/pair_plan_bench.py): up to 16384 x 128 and 8192 x 256 they take less than half the
# host time of the torch plan and less device time; at 65536 x 512 (33.5M entries, 4096 token
# blocks and a 2M-entry scan) the synced time was 652 us against torch's 469 us. Larger maps
# than those measured to pay go to the torch plan.
MAX_KERNEL_MAP = 1 << 22


def use_pair_plan_triton(routing_map: torch.Tensor) -> bool:
    """Whether :func:`pair_plan_triton` serves this map: the Triton switch
    (``triton_common.use_triton``: CUDA, triton, ``KernelOptions.triton``), a non-empty bool map
    of at most ``MAX_KERNEL_MAP`` entries (which also keeps positions within the kernels' int32
    counts)."""
    num_tokens, num_experts = routing_map.shape
    return (
        routing_map.dtype == torch.bool
        and 0 < num_tokens * num_experts <= MAX_KERNEL_MAP
        and triton_common.use_triton(routing_map)
    )


@functools.lru_cache(maxsize=64)
def _blocks(num_experts: int, topk: int, block_t: int | None, block_e: int | None) -> tuple:
    """``(BLOCK_T, BLOCK_E, BLOCK_K)``: the expert chunk is the next power of two of E up to
    256 (E = 160 gets one 256 chunk, E = 512 two), the token block fills the tile (E = 128:
    16 tokens, so T = 16384 makes 1024 programs and a 128K-entry cumsum); overrides (powers of
    two) are for tests."""
    be = block_e or min(_next_pow2(num_experts), _MAX_BLOCK_E)
    bt = block_t or max(_MIN_BLOCK_T, _TILE // be)
    return bt, be, _next_pow2(max(topk, 1))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pair_plan_triton(
    routing_map: torch.Tensor,
    num_pairs: int,
    topk: int,
    *,
    block_t: int | None = None,
    block_e: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_of_pair [S], expert_of_pair [S], slot_pair [T, K])``, all int64, from a ``[T, E]``
    bool routing map: two Triton launches and one in-place torch ``cumsum``; no host sync.

    The plan of ``PairPermutation.build`` (the torch path there is the reference), with the
    contract for maps that do not hold exactly ``num_pairs`` True entries in the module doc.
    The three outputs are views of one int64 buffer (one allocation instead of three).

    Args:
        routing_map: ``[T, E]`` bool, any strides, ``0 < T * E < 2**31``.
        num_pairs: S, with ``0 <= S <= T * K`` (the caller checks the upper bound).
        topk: K >= 1.
        block_t: Token block override (a power of two), for tests.
        block_e: Expert chunk override (a power of two), for tests.
    """
    num_tokens, num_experts = routing_map.shape
    bt, be, bk = _blocks(num_experts, topk, block_t, block_e)
    num_blocks = cdiv(num_tokens, bt)
    device = routing_map.device
    out = torch.empty(2 * num_pairs + num_tokens * topk, dtype=torch.int64, device=device)
    token_of_pair = out[:num_pairs]
    expert_of_pair = out[num_pairs : 2 * num_pairs]
    slot_pair = out[2 * num_pairs :]
    counts = torch.empty(num_experts * num_blocks, dtype=torch.int32, device=device)
    hits = routing_map.view(torch.uint8)  # same bytes; Triton's bool pointers are awkward
    stride_t, stride_e = hits.stride()
    kernels = _kernels()
    if not hits.is_cuda and not kernels.interpreted:
        raise ValueError(
            "pair_plan_triton got host tensors; it needs CUDA tensors, or TRITON_INTERPRET=1 set "
            "before triton is first imported"
        )
    grid = (num_blocks,)
    with device_ctx(hits):
        kernels.count[grid](
            counts, hits, num_tokens, num_experts, num_blocks, stride_t, stride_e,
            BLOCK_T=bt, BLOCK_E=be, num_warps=_NUM_WARPS,
        )
        counts.cumsum_(0)
        kernels.write[grid](
            token_of_pair, expert_of_pair, slot_pair, counts, hits, num_tokens, num_experts,
            num_blocks, num_pairs, topk, stride_t, stride_e, cdiv(num_pairs, num_blocks),
            BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, FILL_BLOCK=_FILL_BLOCK, num_warps=_NUM_WARPS,
        )
    return token_of_pair, expert_of_pair, slot_pair.view(num_tokens, topk)
