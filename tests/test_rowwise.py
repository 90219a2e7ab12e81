"""Chunked row-wise ops against the obvious one-shot expressions."""

import pytest
import torch

from megatron_lrmoe.dispatch import rows as rowwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 40])
def test_scale_rows_and_row_dot(monkeypatch, dtype, n):
    monkeypatch.setattr(rowwise, "CHUNK_ROWS", 16)  # several chunks, and a ragged last one
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, 12, generator=gen).to(dtype)
    b = torch.randn(n, 12, generator=gen).to(dtype)
    s = torch.rand(n, generator=gen)
    assert torch.equal(rowwise.scale_rows(a, s), (a.float() * s.unsqueeze(-1)).to(dtype))
    ref = (a.float() * b.float()).sum(-1)
    torch.testing.assert_close(rowwise.row_dot(a, b, torch.float32), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [0, 5, 40])
def test_row_dot_slots_is_the_token_side_of_a_index(monkeypatch, n):
    """``slots`` (token t's pairs) and ``a_index`` (each pair's token) describe one pairing."""
    monkeypatch.setattr(rowwise, "CHUNK_ROWS", 16)
    gen = torch.Generator().manual_seed(100 + n)
    tokens, k = 20, 4
    a = torch.randn(tokens, 12, generator=gen)
    b = torch.randn(n, 12, generator=gen)
    slots = torch.full((tokens * k,), -1, dtype=torch.int64)
    slots[torch.randperm(tokens * k, generator=gen)[:n]] = torch.arange(n)
    slots = slots.view(tokens, k)
    a_index = rowwise.slots_to_rows(slots, n)
    expected = torch.nonzero(slots >= 0)[:, 0][torch.argsort(slots[slots >= 0])]
    assert torch.equal(a_index, expected)
    ref = (a[a_index] * b).sum(-1)
    got = rowwise.row_dot(a, b, torch.float32, slots=slots)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not both"):
        rowwise.row_dot(a, b, torch.float32, a_index=a_index, slots=slots)
