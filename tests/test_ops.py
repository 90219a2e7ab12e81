"""Tests for ``megatron_lrmoe.experts`` against the slow references in ``experts/reference.py``.

Shape legend: N rows grouped by expert, G experts, H hidden, F FFN width, F1 = 2F if gated.

Tolerances (stated once, used below):
    fp32 GEMM paths vs fp32 references: atol 1e-5 / rtol 1e-5 for single products, 1e-4 for the
        whole MLP (two GEMMs plus activation in different summation orders).
    bf16: atol/rtol 2e-2 against fp32/fp64 ground truth (bf16 epsilon is 2^-8 ~ 3.9e-3; a few
        roundings accumulate), and 1 bf16 ulp-ish (1e-2) against autograd of the same bf16 op.
        The CUDA tests (larger shapes, long wgrad sums) use a norm-relative error below 1.5e-2.

The CUDA tests are skipped on CPU-only machines; they also assert that the expert MLP forward
and backward issue no synchronising CUDA call (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import megatron_lrmoe.experts.grouped_gemm as gg
from megatron_lrmoe.experts import (
    GluSpec,
    GroupSizes,
    act_backward,
    act_forward,
    activation_spec_from_config,
    expert_backward,
    expert_forward,
    grouped_mm_backend,
    grouped_mm_nn,
    grouped_mm_nt,
    grouped_mm_tn,
)
from megatron_lrmoe.experts.reference import (
    reference_activation,
    reference_expert_mlp,
    reference_grouped_mm_nn,
    reference_grouped_mm_nt,
    reference_grouped_mm_tn,
)
from megatron_lrmoe.options import KernelOptions, using_kernels

HAS_GROUPED_MM = hasattr(F, "grouped_mm")

# Group-size patterns: empty groups in the middle and at the ends, all rows in one group,
# zero rows in total, a single group.
COUNT_CASES = {
    "mixed_with_empty": [3, 0, 5, 2],
    "empty_ends": [0, 4, 3, 0],
    "all_in_one": [0, 9, 0],
    "zero_rows": [0, 0, 0],
    "single_group": [6],
}

# (K, M) feature widths: fp32 needs multiples of 4 elements (16 bytes) for torch's grouped_mm.
ALIGNED = (16, 8)
ODD = (5, 7)

SPECS = [
    GluSpec(gated=True, kind="silu"),
    GluSpec(gated=False, kind="silu"),
    GluSpec(gated=True, kind="gelu"),
    GluSpec(gated=False, kind="gelu"),
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def grouped_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls into torch.nn.functional.grouped_mm to prove which path ran."""
    calls: list[int] = []
    if not HAS_GROUPED_MM:
        return calls
    real = F.grouped_mm

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", spy)
    return calls


def _spec_id(spec: GluSpec) -> str:
    return f"{spec.kind}{'-glu' if spec.gated else ''}"


# --------------------------------------------------------------------------------------------
# grouped GEMMs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", list(COUNT_CASES.values()), ids=list(COUNT_CASES))
@pytest.mark.parametrize("widths", [ALIGNED, ODD], ids=["aligned", "odd"])
@pytest.mark.parametrize("counts_as", ["list", "tensor", "group_sizes"])
def test_grouped_mm_matches_reference(
    counts: list[int], widths: tuple[int, int], counts_as: str, grouped_mm_calls: list[int]
) -> None:
    k, m = widths
    g, n = len(counts), sum(counts)
    c: Any = {
        "list": counts,
        "tensor": torch.tensor(counts, dtype=torch.long),
        "group_sizes": GroupSizes(counts),
    }[counts_as]
    x = torch.randn(n, k)
    w = torch.randn(g, m, k)
    dy = torch.randn(n, m)

    expected_backend = "torch_grouped_mm" if widths == ALIGNED and HAS_GROUPED_MM else "loop"
    assert grouped_mm_backend(x, w) == expected_backend
    assert grouped_mm_backend(dy, x) == expected_backend

    y = grouped_mm_nt(x, w, c)
    dx = grouped_mm_nn(dy, w, c)
    dw = grouped_mm_tn(dy, x, c)
    torch.testing.assert_close(y, reference_grouped_mm_nt(x, w, counts), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, reference_grouped_mm_nn(dy, w, counts), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, reference_grouped_mm_tn(dy, x, counts), atol=1e-5, rtol=1e-5)
    assert y.shape == (n, m) and dx.shape == (n, k) and dw.shape == (g, m, k)
    for gi, cnt in enumerate(counts):
        if cnt == 0:
            assert torch.count_nonzero(dw[gi]) == 0, "empty group must get an exact zero wgrad"

    if expected_backend == "torch_grouped_mm" and n > 0:
        assert len(grouped_mm_calls) == 3, "torch grouped_mm path was not exercised"
    else:
        assert not grouped_mm_calls


@pytest.mark.parametrize("widths", [ALIGNED, ODD], ids=["aligned", "odd"])
def test_grouped_mm_torch_path_equals_forced_loop(
    widths: tuple[int, int], grouped_mm_calls: list[int]
) -> None:
    k, m = widths
    counts = [4, 0, 7, 1]
    x, w, dy = torch.randn(12, k), torch.randn(4, m, k), torch.randn(12, m)
    auto = (grouped_mm_nt(x, w, counts), grouped_mm_nn(dy, w, counts), grouped_mm_tn(dy, x, counts))
    n_auto_calls = len(grouped_mm_calls)
    with using_kernels(KernelOptions(grouped_mm=False)):
        assert grouped_mm_backend(x, w) == "loop"
        loop = (
            grouped_mm_nt(x, w, counts), grouped_mm_nn(dy, w, counts), grouped_mm_tn(dy, x, counts)
        )
    assert len(grouped_mm_calls) == n_auto_calls, "grouped_mm off must bypass grouped_mm"
    for a, b in zip(auto, loop, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch.nn.functional.grouped_mm missing")
def test_grouped_mm_bf16_cpu_and_noncontiguous(grouped_mm_calls: list[int]) -> None:
    counts = [5, 0, 3]
    k, m = 16, 24  # multiples of 8 bf16 elements
    x_big = torch.randn(8, 2 * k)
    x = x_big[:, :k].to(torch.bfloat16)  # contiguous after .to; slice below is not
    x_view = torch.randn(8, 2 * k, dtype=torch.bfloat16)[:, ::2]  # stride 2 in the last dim
    w = torch.randn(3, m, k).to(torch.bfloat16)
    w_nc = torch.randn(3, k, m).to(torch.bfloat16).transpose(1, 2)  # [G, M, K] non-contiguous
    for xi, wi in [(x, w), (x_view, w), (x, w_nc)]:
        assert grouped_mm_backend(xi, wi) == "torch_grouped_mm"
        ref = reference_grouped_mm_nt(xi.double(), wi.double(), counts)
        torch.testing.assert_close(
            grouped_mm_nt(xi, wi, counts).double(), ref, atol=2e-2 * math.sqrt(k), rtol=2e-2
        )
    dy = torch.randn(8, m).to(torch.bfloat16)
    dw = grouped_mm_tn(dy, x, counts, out_dtype=torch.float32)
    assert dw.dtype == torch.float32
    ref = reference_grouped_mm_tn(dy.double(), x.double(), counts)
    torch.testing.assert_close(dw.double(), ref, atol=5e-2, rtol=2e-2)
    assert len(grouped_mm_calls) == 4


@pytest.mark.parametrize("backend", ["auto", "loop"])
def test_grouped_mm_nn_half_cpu_takes_a_column_major_right_operand(backend: str) -> None:
    """On the CPU a bf16 / fp16 ``x @ w[g]`` runs on a column-major copy of ``w`` (a row-major
    right operand takes a path about 27x slower there, gg._right_operand); fp32 and an operand
    already column-major are passed as they are. The products match a float64 reference on
    both backends."""
    with using_kernels(KernelOptions(grouped_mm=backend == "auto")):
        counts = [5, 0, 3]
        k, m = 16, 24
        for dtype in (torch.bfloat16, torch.float16):
            w = torch.randn(3, m, k).to(dtype)
            right = gg._right_operand(w)
            assert right.stride(-2) == 1 and torch.equal(right, w)
            w_col = torch.randn(3, k, m).to(dtype).transpose(1, 2)
            assert gg._right_operand(w_col) is w_col
            dy = torch.randn(8, m).to(dtype)
            for wi in (w, w_col):
                ref = reference_grouped_mm_nn(dy.double(), wi.double(), counts)
                got = grouped_mm_nn(dy, wi, counts).double()
                torch.testing.assert_close(got, ref, atol=2e-2 * math.sqrt(m), rtol=2e-2)
    w32 = torch.randn(3, m, k)
    assert gg._right_operand(w32) is w32


def test_grouped_mm_tn_zeroes_empty_groups_even_if_kernel_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not HAS_GROUPED_MM:
        pytest.skip("torch.nn.functional.grouped_mm missing")
    real = F.grouped_mm

    def garbage_for_empty(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        # Emulates kernels that leave empty groups' wgrad unwritten (reported on sm100).
        out = real(a, b, offs=offs)
        if a.dim() == 2 and b.dim() == 2:
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(F, "grouped_mm", garbage_for_empty)
    counts = [0, 3, 0, 2]
    a, b = torch.randn(5, 8), torch.randn(5, 4)
    out = grouped_mm_tn(a, b, counts)
    torch.testing.assert_close(out, reference_grouped_mm_tn(a, b, counts), atol=1e-5, rtol=1e-5)


def test_grouped_mm_errors() -> None:
    x, w = torch.randn(6, 4), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="sum to 5 but there are 6 rows"):
        grouped_mm_nt(x, w, [2, 3])
    with pytest.raises(ValueError, match="3 group sizes for 2 groups"):
        grouped_mm_nt(x, w, [2, 2, 2])
    with pytest.raises(ValueError, match="dtypes differ"):
        grouped_mm_nt(x, w.double(), [3, 3])
    with pytest.raises(ValueError, match="non-negative"):
        grouped_mm_nt(x, w, [7, -1])
    with pytest.raises(ValueError, match="expects"):
        grouped_mm_nn(x, w, [3, 3])


def test_grouped_mm_backend_rules() -> None:
    # fp64 has no grouped_mm kernel; mismatched dtypes never reach it.
    assert grouped_mm_backend(torch.randn(3, 16).double(), torch.randn(2, 8, 16).double()) == "loop"
    assert grouped_mm_backend(torch.randn(3, 16), torch.randn(2, 8, 16).bfloat16()) == "loop"
    # One unaligned width anywhere (here M = 6 fp32 = 24 bytes) selects the loop.
    assert grouped_mm_backend(torch.randn(3, 16), torch.randn(2, 6, 16)) == "loop"


def test_grouped_mm_backend_memo_equals_the_rule() -> None:
    """The memoised decision against :func:`decide_backend` (uncached) on every combination of
    the switch (``KernelOptions.grouped_mm``), dtypes, devices and aligned / unaligned widths the
    CPU offers."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    cpu = torch.device("cpu")
    for grouped_mm in (True, False):
        for xd in dtypes:
            for wd in dtypes:
                for widths in ((16, 8, 32), (16, 8, 5), (12, 24), (3, 24)):
                    w_shape = (2,) + widths[:0:-1] if len(widths) == 3 else (4, widths[1])
                    x = torch.empty(4, widths[0], dtype=xd)
                    w = torch.empty(w_shape, dtype=wd)
                    want = gg.decide_backend(grouped_mm, xd, cpu, wd, cpu, widths)
                    if not HAS_GROUPED_MM:
                        want = "loop"
                    with using_kernels(KernelOptions(grouped_mm=grouped_mm)):
                        assert grouped_mm_backend(x, w) == want, (grouped_mm, xd, wd, widths)
                        assert gg.grouped_mm_backend_for(xd, cpu, widths[0], w) == want


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch.nn.functional.grouped_mm missing")
def test_grouped_mm_backend_is_never_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision is memoised per input; the same operands must follow a changed switch
    (``KernelOptions.grouped_mm`` of the active options, read at every call) and changed dtypes
    or widths."""
    x, w = torch.randn(6, 16), torch.randn(3, 8, 16)
    assert grouped_mm_backend(x, w) == "torch_grouped_mm"  # now cached
    with using_kernels(KernelOptions(grouped_mm=False)):
        assert grouped_mm_backend(x, w) == "loop"
        with using_kernels(KernelOptions()):
            assert grouped_mm_backend(x, w) == "torch_grouped_mm"
        assert grouped_mm_backend(x, w) == "loop"
    assert grouped_mm_backend(x, w) == "torch_grouped_mm"
    assert grouped_mm_backend(x.double(), w.double()) == "loop"  # no fp64 kernel
    assert grouped_mm_backend(x, w.bfloat16()) == "loop"  # the weights' dtype alone changed
    assert grouped_mm_backend(x.bfloat16(), w.bfloat16()) == "torch_grouped_mm"
    assert grouped_mm_backend(x, torch.randn(3, 6, 16)) == "loop"  # 24-byte width
    assert gg.grouped_mm_backend_for(torch.float32, x.device, 6, w) == "loop"
    assert gg.grouped_mm_backend_for(torch.float32, x.device, 16, w) == "torch_grouped_mm"
    monkeypatch.delattr(F, "grouped_mm")  # a torch without it: never served from the memo
    assert grouped_mm_backend(x, w) == "loop"


# --------------------------------------------------------------------------------------------
# activation
# --------------------------------------------------------------------------------------------


def _act_inputs(spec: GluSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    f = 12
    # Wide range so both tails and the curved middle of silu/gelu are exercised.
    h = (torch.randn(33, f * spec.fc1_multiplier) * 3.0).to(dtype)
    d_a = torch.randn(33, f).to(dtype)
    return h, d_a


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_forward_matches_reference(spec: GluSpec, dtype: torch.dtype) -> None:
    h, _ = _act_inputs(spec, dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    expected = reference_activation(h.double(), spec)
    torch.testing.assert_close(act_forward(h, spec).double(), expected, atol=tol, rtol=tol)
    assert act_forward(h, spec).dtype == dtype


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_backward_matches_autograd(spec: GluSpec, dtype: torch.dtype) -> None:
    h, d_a = _act_inputs(spec, dtype)
    h_req = h.clone().requires_grad_(True)
    act_forward(h_req, spec).backward(d_a)
    got, act, dprobs = act_backward(d_a, h, spec, store_act=True)
    assert got.dtype == dtype and got.shape == h.shape and dprobs is None
    torch.testing.assert_close(act, act_forward(h, spec))
    # Same-dtype autograd: fp32 1e-5; bf16 both end in one bf16 rounding of ~equal fp32 values.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, h_req.grad, atol=tol, rtol=tol)
    # Ground truth in fp64 through the plain-torch reference.
    h64 = h.double().requires_grad_(True)
    reference_activation(h64, spec).backward(d_a.double())
    tol64 = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), h64.grad, atol=tol64, rtol=tol64)


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_with_probs_matches_autograd(spec: GluSpec, dtype: torch.dtype) -> None:
    """Megatron's order: the routing weight scales the activation before fc2."""
    h, d = _act_inputs(spec, dtype)
    probs = torch.rand(h.shape[0], dtype=torch.float32) + 0.1
    got_fwd = act_forward(h, spec, probs)
    h64 = h.double().requires_grad_(True)
    p64 = probs.double().requires_grad_(True)
    ref = reference_activation(h64, spec) * p64.unsqueeze(-1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_fwd.double(), ref.detach(), atol=tol, rtol=tol)
    ref.backward(d.double())
    dh, act, dprobs = act_backward(d, h, spec, probs, store_act=True)
    torch.testing.assert_close(act, got_fwd)
    assert dprobs is not None and dprobs.dtype == torch.float32
    torch.testing.assert_close(dh.double(), h64.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(dprobs.double(), p64.grad, atol=tol * 10, rtol=tol)


def test_act_backward_rejects_bad_shapes() -> None:
    spec = GluSpec(gated=True, kind="silu")
    with pytest.raises(ValueError, match="even"):
        act_forward(torch.randn(3, 5), spec)
    with pytest.raises(ValueError, match="does not match"):
        act_backward(torch.randn(3, 5), torch.randn(3, 8), spec)
    with pytest.raises(ValueError, match="kind"):
        GluSpec(gated=False, kind="relu")  # type: ignore[arg-type]


def _megatron_config(**overrides: Any) -> Any:
    transformer = pytest.importorskip("megatron.core.transformer")
    cfg = transformer.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    for key, value in overrides.items():
        # Set after construction: __post_init__ itself rejects some combinations we test.
        setattr(cfg, key, value)
    return cfg


def test_activation_spec_from_config_supported() -> None:
    cfg = _megatron_config(activation_func=F.silu, gated_linear_unit=True)
    assert activation_spec_from_config(cfg) == GluSpec(gated=True, kind="silu")
    cfg = _megatron_config(activation_func=F.gelu, gated_linear_unit=False)
    assert activation_spec_from_config(cfg) == GluSpec(gated=False, kind="gelu")
    # Interleave is only used by Megatron when gated; harmless otherwise.
    ns = SimpleNamespace(
        activation_func=F.gelu, gated_linear_unit=False, moe_mlp_glu_interleave_size=32
    )
    assert activation_spec_from_config(ns) == GluSpec(gated=False, kind="gelu")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"activation_func": "quick_gelu"}, r"activation_func=quick_gelu.*silu"),
        ({"activation_func": "squared_relu"}, r"activation_func=squared_relu"),
        ({"activation_func": F.relu}, r"activation_func=relu"),
        ({"activation_func_clamp_value": 7.0}, r"activation_func_clamp_value=7.0.*None"),
        ({"glu_linear_offset": 1.0}, r"glu_linear_offset=1.0.*0.0"),
        ({"moe_mlp_glu_interleave_size": 32}, r"moe_mlp_glu_interleave_size=32.*None"),
    ],
)
def test_activation_spec_from_config_errors(overrides: dict[str, Any], pattern: str) -> None:
    activations = pytest.importorskip("megatron.core.activations")
    resolved = dict(overrides)
    if isinstance(resolved.get("activation_func"), str):
        resolved["activation_func"] = getattr(activations, resolved["activation_func"])
    cfg = _megatron_config(**{"activation_func": F.silu, "gated_linear_unit": True, **resolved})
    with pytest.raises(ValueError, match=pattern):
        activation_spec_from_config(cfg)


# --------------------------------------------------------------------------------------------
# expert MLP
# --------------------------------------------------------------------------------------------


def _mlp_tensors(
    counts: list[int], h: int, f: int, spec: GluSpec, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, g = sum(counts), len(counts)
    x = torch.randn(n, h, dtype=dtype)
    w1 = (torch.randn(g, f * spec.fc1_multiplier, h) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(g, h, f) / math.sqrt(f)).to(dtype)
    probs = torch.rand(n, dtype=torch.float32)
    return x, w1, w2, probs


MLP_SHAPES = {"aligned": (16, 8), "odd": (6, 5)}  # (H, F); fp32 aligned -> torch grouped_mm


class _ExpertMLP(torch.autograd.Function):
    """Test-only autograd wrapper of expert_forward / expert_backward, for gradcheck."""

    @staticmethod
    def forward(ctx, x, probs, w1, w2, counts, spec, save_h):
        z, h = expert_forward(x, w1, w2, counts, spec, probs=probs)
        ctx.save_for_backward(x, probs, w1, w2, h if save_h else None)
        ctx.counts, ctx.spec = counts, spec
        return z

    @staticmethod
    def backward(ctx, dz):
        x, probs, w1, w2, h = ctx.saved_tensors
        dx, dw1, dw2, dp = expert_backward(dz, x, h, w1, w2, ctx.counts, ctx.spec, probs=probs)
        return dx, dp, dw1, dw2, None, None, None


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
@pytest.mark.parametrize("shape", list(MLP_SHAPES.values()), ids=list(MLP_SHAPES))
@pytest.mark.parametrize("save_h", [True, False], ids=["save_h", "recompute_h"])
@pytest.mark.parametrize("counts_name", ["mixed_with_empty", "all_in_one"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
def test_expert_mlp_matches_autograd_reference(
    spec: GluSpec, shape: tuple[int, int], save_h: bool, counts_name: str, with_probs: bool
) -> None:
    counts = COUNT_CASES[counts_name]
    hid, f = shape
    x, w1, w2, probs = _mlp_tensors(counts, hid, f, spec)
    probs = probs if with_probs else None
    z, h = expert_forward(x, w1, w2, counts, spec, probs=probs)
    assert h.shape == (x.shape[0], w1.shape[1])

    leaves = [x, w1, w2] + ([probs] if with_probs else [])
    refs = [t.clone().requires_grad_(True) for t in leaves]
    zr = reference_expert_mlp(refs[0], refs[3] if with_probs else None, refs[1], refs[2], counts, spec)
    torch.testing.assert_close(z, zr.detach(), atol=1e-4, rtol=1e-4)

    dz = torch.randn_like(z)
    dx, dw1, dw2, dp = expert_backward(
        dz, x, h if save_h else None, w1, w2, counts, spec, probs=probs
    )
    want = torch.autograd.grad(zr, refs, dz, allow_unused=True, materialize_grads=True)
    assert dx is not None
    torch.testing.assert_close(dx, want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw1, want[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw2, want[2], atol=1e-4, rtol=1e-4)
    assert dw1.shape == w1.shape and dw2.shape == w2.shape
    if with_probs:
        torch.testing.assert_close(dp, want[3], atol=1e-4, rtol=1e-4)
    else:
        assert dp is None


def test_expert_mlp_zero_rows_and_options() -> None:
    spec = GluSpec(gated=True, kind="silu")
    x, w1, w2, _ = _mlp_tensors([0, 0, 0], 16, 8, spec)
    z, h = expert_forward(x, w1, w2, [0, 0, 0], spec)
    assert z.shape == (0, 16) and h.shape == (0, 16)
    dx, dw1, dw2, dp = expert_backward(torch.zeros_like(z), x, None, w1, w2, [0, 0, 0], spec)
    assert dx is not None and dx.shape == (0, 16) and dp is None
    assert torch.count_nonzero(dw1) == 0 and torch.count_nonzero(dw2) == 0
    assert dw1.shape == w1.shape and dw2.shape == w2.shape

    counts = [3, 0, 4]
    x, w1, w2, _ = _mlp_tensors(counts, 16, 8, spec, dtype=torch.bfloat16)
    z, _ = expert_forward(x, w1, w2, counts, spec)
    dx, dw1, dw2, _ = expert_backward(torch.randn_like(z), x, None, w1, w2, counts, spec, need_dx=False)
    assert dx is None and dw1.dtype == torch.bfloat16 and dw2.dtype == torch.bfloat16
    assert torch.count_nonzero(dw1[1]) == 0 and torch.count_nonzero(dw2[1]) == 0
    with pytest.raises(ValueError, match="inconsistent shapes"):
        expert_forward(x, w1, w2[:, :, :4], counts, spec)


def test_expert_mlp_gradcheck_fp64() -> None:
    # fp64 has no grouped_mm kernel, so this checks the loop path and the analytic math exactly.
    counts = [2, 0, 3]
    for spec, save_h in ((GluSpec(gated=True, kind="silu"), True), (GluSpec(False, "gelu"), False)):
        x, w1, w2, probs = _mlp_tensors(counts, 3, 2, spec, dtype=torch.float64)
        inputs = tuple(
            t.double().requires_grad_(True) for t in (x, probs, w1, w2)
        )

        def fn(xx, pp, a, b, spec=spec, save_h=save_h):
            return _ExpertMLP.apply(xx, pp, a, b, counts, spec, save_h)

        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch.nn.functional.grouped_mm missing")
def test_expert_mlp_bf16_close_to_fp32(grouped_mm_calls: list[int]) -> None:
    spec = GluSpec(gated=True, kind="silu")
    counts = [5, 0, 9, 2]
    x, w1, w2, probs = _mlp_tensors(counts, 16, 8, spec)
    x16, w116, w216 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
    z16, h16 = expert_forward(x16, w116, w216, counts, spec, probs=probs)
    assert z16.dtype == torch.bfloat16
    leaves32 = [t.float().requires_grad_(True) for t in (x16, probs, w116, w216)]
    z32 = reference_expert_mlp(*leaves32, counts, spec)
    torch.testing.assert_close(z16.float(), z32, atol=2e-2, rtol=2e-2)
    dz = torch.randn_like(z32)
    dx, dw1, dw2, dp = expert_backward(dz.bfloat16(), x16, h16, w116, w216, counts, spec, probs)
    want = torch.autograd.grad(z32, leaves32, dz, materialize_grads=True)
    for got, ref in zip((dx, dp, dw1, dw2), want, strict=True):
        torch.testing.assert_close(got.float(), ref, atol=5e-2, rtol=2e-2)
    assert grouped_mm_calls, "bf16 on CPU with aligned widths should use torch grouped_mm"


# --------------------------------------------------------------------------------------------
# CUDA only (skipped on CPU machines): the bf16 grouped_mm path and the absence of host syncs.
# --------------------------------------------------------------------------------------------

CUDA = torch.cuda.is_available()


def _cuda_fast_path_expected() -> bool:
    return (
        HAS_GROUPED_MM
        and torch.version.hip is None
        and torch.cuda.get_device_capability()[0] in (9, 10)
    )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius-norm relative error (bf16 tolerance of 1.5e-2 is ~4 bf16 epsilons)."""
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
def test_cuda_expert_mlp_matches_reference_without_host_sync(
    dtype: torch.dtype, with_probs: bool, grouped_mm_calls: list[int]
) -> None:
    spec = GluSpec(gated=True, kind="silu")
    counts = [37, 0, 120, 5, 0]
    x, w1, w2, probs = _mlp_tensors(counts, 64, 32, spec)
    x, w1, w2 = (t.cuda().to(dtype) for t in (x, w1, w2))
    probs = probs.cuda() if with_probs else None
    dz = torch.randn_like(x)
    expected = (
        "torch_grouped_mm" if dtype == torch.bfloat16 and _cuda_fast_path_expected() else "loop"
    )
    assert grouped_mm_backend(x, w1) == expected

    groups = GroupSizes(counts)
    expert_backward(dz, x, None, w1, w2, groups, spec, probs)  # warm-up: cuBLAS, pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # Fresh GroupSizes: offsets are rebuilt (host -> device) inside the checked region.
        groups = GroupSizes(torch.tensor(counts))
        z, h = expert_forward(x, w1, w2, groups, spec, probs)
        dx, dw1, dw2, dp = expert_backward(dz, x, h, w1, w2, groups, spec, probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    leaves = [t.detach().float().requires_grad_(True) for t in (x, w1, w2)]
    pr = probs.detach().clone().requires_grad_(True) if with_probs else None
    zr = reference_expert_mlp(leaves[0], pr, leaves[1], leaves[2], counts, spec)
    want = torch.autograd.grad(
        zr, leaves + ([pr] if with_probs else []), dz.float(), materialize_grads=True
    )
    assert dx is not None
    # bf16 rounds h, a, dh and the outputs; wgrads sum 120 rows, so single elements near zero
    # can be off by more than an elementwise rtol allows. Compare norm-relative errors instead.
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    pairs = [("z", z, zr), ("dx", dx, want[0]), ("dw1", dw1, want[1]), ("dw2", dw2, want[2])]
    if with_probs:
        pairs.append(("dprobs", dp, want[3]))
    for name, got, ref in pairs:
        assert _rel_err(got, ref) < tol, f"{name}: relative error {_rel_err(got, ref):.2e}"
    for g in (1, 4):
        assert torch.count_nonzero(dw1[g]) == 0 and torch.count_nonzero(dw2[g]) == 0
    assert bool(grouped_mm_calls) == (expected == "torch_grouped_mm")
