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
