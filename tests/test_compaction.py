"""Index plans of ``dispatch/compaction.py`` against row-by-row references.

Shape legend: P ranks, L local experts, E = P * L experts; a chunk grid ``[A, B]`` holds the
rows of chunk (a, b), laid out a-major or b-major.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lrmoe.dispatch.compaction import (
    chunk_transpose_index,
    inverse_permutation,
    kept_position_shift,
)
from megatron_lrmoe.dispatch.route import RowRoute


def _chunk_rows(counts: np.ndarray, b_major: bool) -> dict[tuple[int, int, int], int]:
    """(a, b, j) -> row of the j-th row of chunk (a, b) in the a-major or b-major layout."""
    a_n, b_n = counts.shape
    cells = [(a, b) for b in range(b_n) for a in range(a_n)] if b_major else [
        (a, b) for a in range(a_n) for b in range(b_n)
    ]
    rows, row = {}, 0
    for a, b in cells:
        for j in range(int(counts[a, b])):
            rows[a, b, j] = row
            row += 1
    return rows


def _grids() -> list[np.ndarray]:
    gen = np.random.default_rng(5)
    grids = [gen.integers(0, 6, size=shape) for shape in ((2, 3), (3, 2), (4, 4), (1, 5))]
    grids += [np.zeros((2, 3), dtype=np.int64), np.array([[0, 7], [0, 0]])]
    return [g.astype(np.int64) for g in grids]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("grid", range(6))
def test_chunk_transpose_index_matches_the_row_walk(grid: int, transposed: bool) -> None:
    """b_major[i] = a_major[idx[i]] for every row, from plain and transposed (strided) grids,
    empty ones included."""
    counts_np = _grids()[grid]
    counts = torch.from_numpy(counts_np.T.copy()).t() if transposed else torch.from_numpy(counts_np)
    idx = chunk_transpose_index(counts, "cpu")
    a_major, b_major = _chunk_rows(counts_np, False), _chunk_rows(counts_np, True)
    expected = [0] * len(a_major)
    for cell, row in b_major.items():
        expected[row] = a_major[cell]
    assert idx.dtype == torch.int64
    assert idx.tolist() == expected


@pytest.mark.parametrize("p, local", [(1, 3), (2, 2), (3, 2), (4, 1)])
def test_kept_position_shift_names_the_owners_saved_row(p: int, local: int) -> None:
    """Send position + shift = the row its owner saved, for every pair of every source: the
    owner's expert order is [local expert][source], each chunk in send order."""
    gen = np.random.default_rng(p * 10 + local)
    counts = gen.integers(0, 5, size=(p, p * local)).astype(np.int64)
    counts[0, 0] = 0  # an empty (source, expert) chunk
    for source in range(p):
        shift = kept_position_shift(counts, source, local)
        assert shift.shape == (p * local,) and shift.dtype == np.int64
        send = 0
        for e in range(p * local):
            owner, l_e = divmod(e, local)
            saved = _chunk_rows(counts[:, owner * local : (owner + 1) * local], True)
            for j in range(int(counts[source, e])):
                assert send + shift[e] == saved[source, l_e, j], (source, e, j)
                send += 1


@pytest.mark.parametrize("grid", range(6))
def test_inverse_permutation_is_the_transposed_grids_index(grid: int) -> None:
    counts = torch.from_numpy(_grids()[grid])
    there = chunk_transpose_index(counts, "cpu")
    assert torch.equal(inverse_permutation(there), chunk_transpose_index(counts.t(), "cpu"))


def _bare_route() -> RowRoute:
    """A route with nothing to exchange: its reorder needs only the grids it is given."""
    return RowRoute(None, None, None, [], [], None)


def test_reorder_derives_the_way_back_per_grid() -> None:
    """RowRoute.reorder caches one index per grid and derives a transpose's from it: each
    reorder equals the reference index's gather, whichever direction came first, and an index
    never serves a grid with other counts (a stale one would misplace rows here)."""
    call = _bare_route()  # reorder needs no plan
    grids = [torch.tensor([[2, 0, 3], [1, 4, 0]]), torch.tensor([[2, 0, 3], [0, 4, 1]])]
    for counts in grids:
        rows = torch.arange(int(counts.sum()), dtype=torch.float32).unsqueeze(1).repeat(1, 3)
        there = call.reorder(rows, counts)
        assert torch.equal(there, rows[chunk_transpose_index(counts, "cpu")])
        back = call.reorder(there, counts.t())
        assert torch.equal(back, rows)
        expected = rows[chunk_transpose_index(counts.t(), "cpu")]
        assert torch.equal(call.reorder(rows, counts.t()), expected)
    # The way back first, then the way there (from the cached transpose).
    fresh = _bare_route()
    counts = grids[1]
    rows = torch.randn(int(counts.sum()), 2)
    expected = rows[chunk_transpose_index(counts.t(), "cpu")]
    assert torch.equal(fresh.reorder(rows, counts.t()), expected)
    assert torch.equal(fresh.reorder(rows, counts), rows[chunk_transpose_index(counts, "cpu")])
    assert len(fresh._indices) == 2


def test_reorder_keys_on_the_grids_shape_and_values() -> None:
    """Grids with the same bytes and other shapes (a [2, 3] grid and its [3, 2] reshape) or the
    same shape and other values each get their own index; int32 counts give the int64 grid's
    index."""
    call = _bare_route()
    flat = torch.tensor([1, 0, 2, 3, 1, 2])
    for counts in (flat.view(2, 3), flat.view(3, 2), flat.flip(0).view(3, 2)):
        rows = torch.randn(int(counts.sum()), 2)
        reference = rows[chunk_transpose_index(counts, "cpu")]
        assert torch.equal(call.reorder(rows, counts), reference)
        assert torch.equal(call.reorder(rows, counts.to(torch.int32)), reference)
        assert torch.equal(chunk_transpose_index(counts.to(torch.int32), "cpu"), (
            chunk_transpose_index(counts, "cpu")
        ))
