"""Fused Triton kernels (``dispatch/rows_triton.py``, ``select/scores_triton.py``,
``experts/activation_triton.py``) against the torch paths they replace.

Shape legend: N rows, K gathered rows (``len(index)``), H row width, F activation width,
F1 = 2F if gated.

How the kernels run without a GPU: Triton's interpreter executes the kernel bodies with numpy
on host tensors. It has to be switched on (``TRITON_INTERPRET=1``) before triton is first
imported, because triton wraps its own helpers (``tl.zeros``, the ``tl.sum`` combine function)
at import time, and this process has imported triton already (megatron.core does). So
``test_kernels_in_interpreter_subprocess`` re-runs this module's ``test_interp_*`` tests in a
subprocess with the variable set; in this process they are skipped, and no other test module
sees the variable.

Tolerances (against the torch path of the same op, same dtype):
    scale_rows: fp32 bit-exact (one fp32 product either way). bf16/fp16: 1 ulp under the
        interpreter, which rounds fp32 -> bf16 by truncation; bit-exact on the GPU.
    activation: 1 ulp of the output dtype (2 for fp32, whose exp/erf differ by an ulp between
        libraries), plus 16 fp32 epsilons of the tensor's largest magnitude for elements where
        fp32 itself cancels (GELU's negative tail, the SiLU derivative's zero crossing).
    row_dot: 1 ulp of the output dtype plus 1e-5 of the row's ``sum |a * b|`` (fp32 sums in a
        different order); the activation's ``dprobs`` likewise.
    gather_sum: fp32 bit-exact (the same fp32 adds in the same slot order); bf16/fp16 1 ulp
        under the interpreter (truncating rounding).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import math
import os
import sys
import types

import pytest
import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.dispatch import rows as rowwise
from megatron_lrmoe.dispatch import rows_triton
from megatron_lrmoe.dispatch.permutation import PairPermutation
from megatron_lrmoe.experts import GluSpec, act_backward, act_forward, activation_triton
from megatron_lrmoe.options import KernelOptions, active_kernels, using_kernels
from megatron_lrmoe.select import scores_triton, scoring
from megatron_lrmoe.testing.interpreter import run_interpreter_tests

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

interp = pytest.mark.skipif(
    not INTERPRETING,
    reason="runs in the TRITON_INTERPRET=1 subprocess of test_kernels_in_interpreter_subprocess",
)
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
SPECS = [GluSpec(g, k) for g in (True, False) for k in ("silu", "gelu")]
SPEC_IDS = [f"{'glu_' if s.gated else ''}{s.kind}" for s in SPECS]
FP32_EPS = torch.finfo(torch.float32).eps


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at ``|x|`` (fp64; subnormals count as the smallest normal)."""
    info = torch.finfo(dtype)
    _, e = torch.frexp(x.double().abs().clamp_min(info.tiny))
    # |x| = m * 2^e with m in [0.5, 1): the ulp is eps * 2^(e - 1).
    return torch.ldexp(torch.full(x.shape, info.eps, dtype=torch.float64, device=x.device), e - 1)


def assert_within(
    got: torch.Tensor, ref: torch.Tensor, ulps: float, rel_atol: float = 0.0, what: str = ""
) -> None:
    """``|got - ref| <= ulps * ulp(ref) + rel_atol * max|ref|`` elementwise, same dtype/shape."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype, got.shape)
    if ref.numel() == 0:
        return
    err = (got.double() - ref.double()).abs()
    tol = ulps * _ulp(ref, ref.dtype) + rel_atol * ref.double().abs().max()
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err - tol, torch.zeros_like(err))))
        flat_g, flat_r = got.reshape(-1), ref.reshape(-1)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off; e.g. flat[{i}] got "
            f"{flat_g[i].item()!r} ref {flat_r[i].item()!r} (tol {tol.reshape(-1)[i].item():.3g})"
        )


def _act_ulps(dtype: torch.dtype) -> float:
    return 2.0 if dtype == torch.float32 else 1.0


def _check_row_dot(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    mag = (a.double() * b.double()).abs().sum(-1)
    tol = _ulp(ref, ref.dtype) + 1e-5 * mag
    err = (got.double() - ref.double()).abs()
    assert bool((err <= tol).all()), f"row_dot off by {(err - tol).max().item():.3g} over tol"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# run in this process: the switch, the import guard, the torch index path, the checker
# --------------------------------------------------------------------------------------------


def test_use_triton_switch() -> None:
    """The switch is the active kernel options' ``triton`` (the running layer's
    ``LRMoEConfig.kernels``); ``using_kernels`` puts the previous options back."""
    assert active_kernels() == KernelOptions()
    x = torch.zeros(2, 3)
    assert not triton_common.use_triton(x)  # host tensors always take the torch path
    assert not triton_common.use_triton()
    if HAS_CUDA and triton_common.triton_available():
        y = x.cuda()
        assert triton_common.use_triton(y)
        assert not triton_common.use_triton(y, x)
        with using_kernels(KernelOptions(triton=False)):
            assert not triton_common.use_triton(y)
        assert triton_common.use_triton(y)
    assert active_kernels() == KernelOptions()


class _BrokenTritonFinder:
    """A meta-path finder that makes ``import triton`` raise a non-ImportError."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "triton" or name.startswith("triton."):
            raise RuntimeError("simulated broken triton install")
        return None


@pytest.mark.parametrize("how", ["missing", "broken"])
def test_missing_or_broken_triton_falls_back(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    # Hide triton from this process for the duration of the test (monkeypatch restores it).
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        if how == "missing":
            monkeypatch.setitem(sys.modules, name, None)
        else:
            monkeypatch.delitem(sys.modules, name)
    if how == "broken":
        monkeypatch.setattr(sys, "meta_path", [_BrokenTritonFinder(), *sys.meta_path])
    triton_common.triton_available.cache_clear()
    try:
        assert not triton_common.triton_available()
        # The kernel modules themselves import nothing from triton at module level.
        for module in (triton_common, rows_triton, scores_triton, activation_triton):
            spec = importlib.util.spec_from_file_location("tk_copy", module.__file__)
            assert spec is not None and spec.loader is not None
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        rows = torch.randn(5, 4)
        s = torch.rand(5)
        ref = (rows * s[:, None]).to(rows.dtype)
        assert torch.equal(rowwise.scale_rows(rows, s), ref)
    finally:
        triton_common.triton_available.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [0, 1, 9, 40])
def test_scale_rows_index_torch_path(monkeypatch: pytest.MonkeyPatch, dtype, k: int) -> None:
    monkeypatch.setattr(rowwise, "CHUNK_ROWS", 16)  # several chunks, a ragged last one
    g = _gen(k)
    rows = torch.randn(13, 12, generator=g).to(dtype)
    index = torch.randint(0, 13, (k,), generator=g)
    scale = torch.rand(k, generator=g)
    got = rowwise.scale_rows(rows, scale, index)
    # scale is indexed by the output row i, not by index[i].
    assert torch.equal(got, (rows[index].float() * scale.unsqueeze(-1)).to(dtype))
    with pytest.raises(IndexError):
        rowwise.scale_rows(rows, torch.rand(2), torch.tensor([0, 13]))


def test_assert_within_can_fail() -> None:
    ref = torch.tensor([1.0, 3.0, -0.5], dtype=torch.bfloat16)
    one_ulp = (ref.float() + _ulp(ref, torch.bfloat16).float()).to(torch.bfloat16)
    assert_within(one_ulp, ref, ulps=1)
    two_ulps = (ref.float() + 2 * _ulp(ref, torch.bfloat16).float()).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="elements off"):
        assert_within(two_ulps, ref, ulps=1)
    with pytest.raises(AssertionError):
        assert_within(torch.tensor([float("nan")]), torch.tensor([1.0]), ulps=1)


@pytest.mark.skipif(not triton_common.triton_available(), reason="needs triton")
def test_interpreter_scalars_index_as_their_element() -> None:
    """Triton 3.6's interpreter (torch 2.11's) took ``int()`` of a scalar's one-element 1-d
    array, which NumPy 2.5 rejects, so a loop over a runtime bound failed in every interpreted
    kernel (320 of the 441 ``test_interp_*`` tests, checked with Triton 3.6 on this CPU);
    ``triton_available()`` wraps the interpreter's tensor patch so that any Triton gets the
    element itself."""
    import numpy as np
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang_tensor, "lrmoe_scalar_index", False)
    tl = triton_common.tl
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(tl.core.tensor, scope)
    try:
        for data in (np.array([7], dtype=np.int32), np.array(7, dtype=np.int32)):
            scalar = tl.core.tensor(interpreter.TensorHandle(data, tl.int32), tl.int32)
            assert len(range(0, scalar, 2)) == 4
    finally:
        scope.restore()


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter subprocess")
def test_kernels_in_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, min_passed=80)


def _hopper_ptx(kernel, types: dict[str, str], constexprs: dict[str, object]) -> str:
    """PTX of ``kernel`` for sm_90, compiled here (no GPU needed): ``types`` names each runtime
    argument's Triton type (pointers and integers 16-divisible, as the launcher specialises
    the tensors and strides of these shapes), ``constexprs`` the rest."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in types}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return compiled.asm["ptx"]


@pytest.mark.skipif(INTERPRETING, reason="compiles for a GPU; the interpreter does not")
def test_arg_block_kernels_vectorise_like_direct_ones() -> None:
    """The ``*_args`` kernels read their tensors at addresses loaded from the argument block;
    unless the 16-byte alignment reaches the pointers, Triton loads and stores one bf16 at a
    time (it did: the packing inside the graph took twice the time of the direct kernel on an
    H200, docs/history/notebook.md section 13). Their PTX must use the direct kernels' 16-byte
    accesses."""
    pytest.importorskip("triton")
    kernels = scores_triton._kernels()
    if kernels.interpreted:
        pytest.skip("triton runs interpreted in this process")
    tl = triton_common.tl
    ints = dict.fromkeys(
        ("n_out", "n_rows", "width", "g_stride", "x_stride", "g_out_stride", "x_out_stride",
         "a_stride", "b_stride", "slots_per_a"), "i32",
    )
    bf16_ptrs = dict.fromkeys(
        ("g_out_ptr", "x_out_ptr", "g_ptr", "x_ptr", "a_ptr", "b_ptr"), "*bf16"
    )
    other_ptrs = {
        "token_ptr": "*i64", "pairs_ptr": "*i64", "probs_ptr": "*fp32", "weight_ptr": "*fp32",
        "poison_ptr": "*fp32", "row_of_ptr": "*i64", "a_index_ptr": "*i64", "out_ptr": "*fp32",
        "args_ptr": "*i64",
    }
    types = {**ints, **bf16_ptrs, **other_ptrs}
    bf16 = dict(G_TY=tl.bfloat16, X_TY=tl.bfloat16, A_TY=tl.bfloat16, B_TY=tl.bfloat16)
    pairs = ((kernels.row_norms, kernels.row_norms_args, dict(BLOCK_M=4, BLOCK_H=256), {}),)
    for direct, args, constexprs, arg_types in pairs:
        common = {k: v for k, v in constexprs.items() if k in args.arg_names}
        want = _hopper_ptx(direct, types, constexprs)
        typed = {k: v for k, v in bf16.items() if k in args.arg_names}
        got = _hopper_ptx(args, types, {**common, **arg_types, **typed})
        for op in ("ld.global.v4", "ld.global.v2", "st.global.v4", "st.global.v2"):
            assert got.count(op) == want.count(op), (args.fn.__name__, op)
        assert "ld.global.b16" not in got, args.fn.__name__
    # The row-dot and the packing in one walk (the graph's only launch of either) has no direct
    # twin: its loads of g, z, x and stores of the packed rows must be 16-byte ones.
    walk = {**types, **dict.fromkeys(("n_walk", "z_stride", "slots_per_token"), "i32")}
    got = _hopper_ptx(rows_triton._kernels().row_dot_pack_args, walk, dict(
        OUT_TY=tl.float32, G_TY=tl.bfloat16, Z_TY=tl.bfloat16, X_TY=tl.bfloat16,
        P_TY=tl.float32, HAS_X=True, BLOCK_M=8, BLOCK_H=512,
    ))  # fmt: skip
    assert got.count("ld.global.v4") >= 3 and got.count("st.global.v4") >= 2
    assert "ld.global.b16" not in got and "st.global.b16" not in got


# --------------------------------------------------------------------------------------------
# run under TRITON_INTERPRET=1 (subprocess): each kernel against the torch path, host tensors
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 512-element tiles: with 64-wide column blocks a program covers 8 rows, so the small N
    # below span several row blocks with a ragged last one (as 4096-element tiles do at scale).
    monkeypatch.setattr(triton_common, "TILE", 512)


def _rows_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values as ``x`` ([N, H]) in the named memory layout."""
    if layout == "row_strided":  # a column slice of a wider buffer: row stride > H
        wide = torch.zeros(x.shape[0], x.shape[1] + 24, dtype=x.dtype)
        wide[:, 3 : 3 + x.shape[1]] = x
        return wide[:, 3 : 3 + x.shape[1]]
    if layout == "transposed":  # column stride != 1: the launcher copies
        return x.t().contiguous().t()
    return x


# (N, column block, layout): N = 0, 1 and odd sizes over several ragged row and column blocks.
ROW_CASES = [
    (0, 64, "contiguous"),
    (1, None, "transposed"),
    (7, 64, "row_strided"),
    (37, 64, "transposed"),
    (37, None, "row_strided"),
]
ROW_CASE_IDS = [f"n{n}-bh{b or 'auto'}-{lay}" for n, b, lay in ROW_CASES]


@interp
@pytest.mark.parametrize("n, block_h, layout", ROW_CASES, ids=ROW_CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_scale_rows(small_tiles, dtype, n: int, block_h, layout: str) -> None:
    g = _gen(100 + n)
    h = 200  # not a multiple of 64 (4 column blocks, the last one ragged)
    rows = _rows_layout(torch.randn(n, h, generator=g).to(dtype), layout)
    scale = torch.rand(n, generator=g)  # fp32, like the router probs
    got = rows_triton.scale_rows_triton(rows, scale, block_h=block_h)
    ref = rowwise.scale_rows(rows, scale)
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:
        assert_within(got, ref, ulps=1, what="scale_rows")
    # Same-dtype scale (bf16 x bf16 multiplies in bf16 on the torch side).
    scale_lp = scale.to(dtype)
    got = rows_triton.scale_rows_triton(rows, scale_lp, block_h=block_h)
    assert_within(got, rowwise.scale_rows(rows, scale_lp), ulps=1, what="same-dtype scale")


@interp
@pytest.mark.parametrize(
    "k, index_dtype",
    [(0, torch.int64), (1, torch.int32), (19, torch.int64), (53, torch.int32)],
    ids=["k0-i64", "k1-i32", "k19-i64", "k53-i32"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_scale_rows_gather(small_tiles, dtype, k: int, index_dtype) -> None:
    g = _gen(200 + k)
    n, h = 23, 200
    rows = _rows_layout(torch.randn(n, h, generator=g).to(dtype), "row_strided")
    index = torch.randint(0, n, (k,), generator=g).to(index_dtype)  # repeats, any order
    scale = torch.rand(k, generator=g)
    got = rows_triton.scale_rows_triton(rows, scale, index, block_h=64)
    ref = rowwise.scale_rows(rows, scale, index.long())
    assert got.shape == (k, h)
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:
        assert_within(got, ref, ulps=1, what="gathered scale_rows")
    # A non-contiguous index (every other element of a longer one).
    long_index = torch.randint(0, n, (2 * k,), generator=g).to(index_dtype)
    got = rows_triton.scale_rows_triton(rows, scale, long_index[::2], block_h=64)
    ref = rowwise.scale_rows(rows, scale, long_index[::2].long())
    assert_within(got, ref, ulps=0 if dtype == torch.float32 else 1, what="strided index")


@interp
@pytest.mark.parametrize(
    "k, index_dtype, layout",
    [(0, torch.int64, "contiguous"), (1, torch.int32, "transposed"),
     (19, torch.int64, "row_strided"), (53, torch.int32, "contiguous")],
    ids=["k0-i64", "k1-i32-transposed", "k19-i64-strided", "k53-i32"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_gather_rows(
    monkeypatch: pytest.MonkeyPatch, dtype, k: int, index_dtype, layout: str
) -> None:
    """The gather kernel copies the bits of ``index_select``: repeated and unordered rows,
    int32 and int64 and non-contiguous indices, strided and transposed rows, ragged row and
    column blocks (8 rows x 16 columns at H = 200), no rows at all."""
    monkeypatch.setattr(triton_common, "TILE", 64)
    g = _gen(250 + k)
    n, h = 23, 200
    rows = _rows_layout(torch.randn(n, h, generator=g).to(dtype), layout)
    index = torch.randint(0, n, (2 * k,), generator=g).to(index_dtype)
    for idx in (index[:k], index[::2]):
        got = rows_triton.gather_rows_triton(rows, idx)
        assert got.shape == (k, h) and got.is_contiguous()
        assert torch.equal(got, rows.index_select(0, idx))
    with pytest.raises(ValueError, match="gather_rows_triton"):
        rows_triton.gather_rows_triton(rows, index.float())


@interp
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["out32", "out16"])
@pytest.mark.parametrize("n, block_h, layout", ROW_CASES, ids=ROW_CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_row_dot(small_tiles, dtype, n: int, block_h, layout: str, out_dtype) -> None:
    g = _gen(300 + n)
    a = _rows_layout(torch.randn(n, 200, generator=g).to(dtype), layout)
    b = _rows_layout(torch.randn(n, 200, generator=g).to(dtype), "row_strided")
    got = rows_triton.row_dot_triton(a, b, out_dtype, block_h=block_h)
    _check_row_dot(got, a, b, rowwise.row_dot(a, b, out_dtype))


@interp
@pytest.mark.parametrize(
    "shape, block_f",
    [((0,), 32), ((1,), None), ((37,), 32), ((3, 11), None)],
    ids=["n0-bf32", "n1-bfauto", "n37-bf32", "3d-bfauto"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_interp_activation(small_tiles, spec: GluSpec, dtype, block_f, shape) -> None:
    f = 100  # not a multiple of 32 (4 column blocks, the last one ragged)
    g = _gen(400 + len(shape) + shape[0])
    # Wide range so both tails and the curved middle of silu/gelu are exercised; built as a
    # column slice of a wider buffer so the input rows are strided.
    wide = (torch.randn(*shape, f * spec.fc1_multiplier + 8, generator=g) * 4.0).to(dtype)
    h = wide[..., 5 : 5 + f * spec.fc1_multiplier]
    d_a = torch.randn(*shape, f, generator=g).to(dtype)
    ulps, rel = _act_ulps(dtype), 16 * FP32_EPS

    got = activation_triton.act_forward_triton(h, spec.gated, spec.kind, block_f=block_f)
    assert_within(got, act_forward(h, spec), ulps, rel, what="act_forward")

    got, act, dp = activation_triton.act_backward_triton(
        d_a, h, spec.gated, spec.kind, store_act=True, block_f=block_f
    )
    ref, ref_act, _ = act_backward(d_a, h, spec, store_act=True)
    assert dp is None
    assert_within(got, ref, ulps, rel, what="act_backward")
    assert_within(act, ref_act, ulps, rel, what="act_backward act")

    # Megatron's order: the routing weight scales the activation before fc2.
    rows = h.reshape(-1, h.shape[-1]).shape[0]
    probs = torch.rand(rows, generator=g) + 0.05
    got = activation_triton.act_forward_triton(h, spec.gated, spec.kind, probs, block_f=block_f)
    assert_within(got, act_forward(h, spec, probs), ulps, rel, what="act_forward probs")
    got, act, dp = activation_triton.act_backward_triton(
        d_a, h, spec.gated, spec.kind, probs, store_act=True, block_f=block_f
    )
    ref, ref_act, ref_dp = act_backward(d_a, h, spec, probs, store_act=True)
    assert_within(got, ref, ulps, rel, what="act_backward probs")
    assert_within(act, ref_act, ulps, rel, what="act_backward probs act")
    a32 = act_forward(h.float(), spec).reshape(rows, f)
    _check_row_dot(dp, d_a.reshape(rows, f), a32, ref_dp)


@interp
@pytest.mark.parametrize("kept", [0, 1, 23], ids=["k0", "k1", "k23"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_interp_activation_backward_reads_kept_rows(small_tiles, spec, dtype, kept) -> None:
    """``h_rows``: the kept rows of a larger saved h are read in place; the result equals the
    torch reference on the gathered rows (the trimmed backward's save mode)."""
    f, saved = 100, 41
    g = _gen(700 + kept)
    h = (torch.randn(saved, f * spec.fc1_multiplier, generator=g) * 4.0).to(dtype)
    h_rows = torch.randperm(saved, generator=g)[:kept].sort().values
    h_rows[-1:] = saved - 1  # the last row too (bounds)
    d_a = torch.randn(kept, f, generator=g).to(dtype)
    probs = torch.rand(kept, generator=g) + 0.05
    ulps, rel = _act_ulps(dtype), 16 * FP32_EPS
    gathered = h.index_select(0, h_rows)
    for p in (None, probs):
        got, act, dp = activation_triton.act_backward_triton(
            d_a, h, spec.gated, spec.kind, p, store_act=True, h_rows=h_rows, block_f=32
        )
        ref, ref_act, ref_dp = act_backward(d_a, gathered, spec, p, store_act=True)
        assert got.shape == (kept, h.shape[1])
        assert_within(got, ref, ulps, rel, what="act_backward h_rows")
        assert_within(act, ref_act, ulps, rel, what="act_backward h_rows act")
        # The public entry point takes the same path (or gathers first on the torch path).
        via, _, _ = act_backward(d_a, h, spec, p, store_act=True, h_rows=h_rows)
        assert_within(via, ref, ulps, rel, what="act_backward(h_rows)")
        if p is not None and kept:
            a32 = act_forward(gathered.float(), spec)
            _check_row_dot(dp, d_a, a32, ref_dp)


def test_activation_backward_h_rows_errors() -> None:
    spec = GluSpec(gated=True, kind="silu")
    h = torch.randn(5, 8)
    with pytest.raises(ValueError, match="h_rows"):
        activation_triton.act_backward_triton(
            torch.randn(2, 4), h, True, "silu", h_rows=torch.tensor([0, 1], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="does not match"):
        activation_triton.act_backward_triton(
            torch.randn(3, 4), h, True, "silu", h_rows=torch.tensor([0, 1])
        )
    with pytest.raises(ValueError, match="without a saved h"):
        from megatron_lrmoe.experts.mlp import expert_backward

        w1, w2 = torch.randn(1, 8, 6), torch.randn(1, 6, 4)
        expert_backward(
            torch.randn(2, 6), torch.randn(2, 6), None, w1, w2, [2], spec, h_rows=torch.arange(2)
        )


@interp
@pytest.mark.parametrize("n, block_h, layout", ROW_CASES, ids=ROW_CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_row_dot_gathered(small_tiles, dtype, n: int, block_h, layout: str) -> None:
    g = _gen(500 + n)
    a = _rows_layout(torch.randn(9, 200, generator=g).to(dtype), layout)
    b = _rows_layout(torch.randn(n, 200, generator=g).to(dtype), "row_strided")
    a_index = torch.randint(0, 9, (n,), generator=g)
    got = rows_triton.row_dot_triton(a, b, torch.float32, a_index, block_h=block_h)
    _check_row_dot(got, a[a_index], b, rowwise.row_dot(a, b, torch.float32, a_index))


@interp
@pytest.mark.parametrize("n, block_h, layout", ROW_CASES, ids=ROW_CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_row_dot_slots(small_tiles, dtype, n: int, block_h, layout: str) -> None:
    """The token-major walk (``slots``) gives what the pair-major walk (``a_index``) gives."""
    g = _gen(900 + n)
    tokens, k = 16, 3  # 48 slots for up to 37 pairs
    a = _rows_layout(torch.randn(tokens, 200, generator=g).to(dtype), layout)
    b = _rows_layout(torch.randn(n, 200, generator=g).to(dtype), "row_strided")
    # n pairs spread over the token slots at random, the rest of the slots empty.
    slots = torch.full((tokens * k,), -1, dtype=torch.int64)
    slots[torch.randperm(tokens * k, generator=g)[:n]] = torch.randperm(n, generator=g)
    slots = slots.view(tokens, k)
    a_index = rowwise.slots_to_rows(slots, n)
    assert bool((a_index >= 0).all())
    got = rows_triton.row_dot_triton(a, b, torch.float32, slots=slots, block_h=block_h)
    ref = rowwise.row_dot(a, b, torch.float32, a_index)
    _check_row_dot(got, a[a_index], b, ref)
    via = rowwise.row_dot(a, b, torch.float32, slots=slots)
    _check_row_dot(via, a[a_index], b, ref)


@interp
@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_gather_sum(small_tiles, dtype, slots: int, scaled: bool) -> None:
    g = _gen(600 + slots)
    r, t, h = 29, 17, 200
    rows = _rows_layout(torch.randn(r, h, generator=g).to(dtype), "row_strided")
    index = torch.randint(-1, r, (t, slots), generator=g)  # -1: empty slot; repeats allowed
    scale = torch.rand(r, generator=g) if scaled else None
    got = rows_triton.gather_sum_triton(rows, index, scale, block_h=64)
    ref = rowwise.gather_sum(rows, index, scale)
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:
        assert_within(got, ref, ulps=1, what="gather_sum")
    empty = rows_triton.gather_sum_triton(rows, torch.full((3, slots), -1), scale)
    assert torch.count_nonzero(empty) == 0 and empty.shape == (3, h)


@interp
@pytest.mark.parametrize("n, block_h, layout", ROW_CASES, ids=ROW_CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_row_norms(small_tiles, dtype, n: int, block_h, layout: str) -> None:
    g = _gen(700 + n)
    a = _rows_layout(torch.randn(n, 200, generator=g).to(dtype), layout)
    b = _rows_layout((3 * torch.randn(n, 200, generator=g)).to(dtype), "row_strided")
    got = scores_triton.row_norms_triton(a, b, block_h=block_h)
    ref = scoring.token_norms(a, b)  # host tensors: the torch reference
    assert got.shape == (2, n) and got.dtype == torch.float32
    # fp32 sums of the same squares in another order.
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0.0)


def _arg_block(**tensors: torch.Tensor) -> torch.Tensor:
    """The int64 argument block of the ``*_args`` kernels, addresses in their named slots."""
    args = torch.zeros(triton_common.ARG_SLOTS, dtype=torch.int64)
    for name, t in tensors.items():
        args[getattr(triton_common, f"ARG_{name.upper()}")] = t.data_ptr()
    return args


@interp
@pytest.mark.parametrize("n", [1, 9, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_scoring_from_arg_block(monkeypatch: pytest.MonkeyPatch, dtype, n: int) -> None:
    """The kernels a replayed graph launches read ``g``, ``x``, ``probs``, ``token`` at the
    addresses of the argument block and give the bits of the direct launchers; a row-strided
    ``x`` keeps its stride; ``args_ready`` refuses what they cannot read."""
    monkeypatch.setattr(triton_common, "PAIR_BLOCK", 16)
    gen = _gen(900 + n)
    h, pairs = 72, 3 * n + 1
    g = torch.randn(n, h, generator=gen).to(dtype)
    wide = torch.zeros(n, h + 8, dtype=torch.float32)  # row stride h + 8: 16-byte rows
    wide[:, :h] = 5 * torch.randn(n, h, generator=gen)
    x = wide[:, :h]
    probs = torch.rand(pairs, generator=gen)
    token = torch.randint(0, n, (pairs,), generator=gen)
    assert triton_common.args_ready(g, x, probs, token)
    args = _arg_block(g=g, x=x, probs=probs, token=token)
    norms = torch.full((2, n), float("nan"))
    scores_triton.row_norms_from_args(
        norms, args, (n, h), (g.stride(0), x.stride(0)), (g.dtype, x.dtype)
    )
    assert torch.equal(norms, scores_triton.row_norms_triton(g, x))
    top = norms.amax(1)
    blocks = scores_triton.pair_blocks(pairs)
    scores, partial = torch.empty(pairs), torch.empty(2, blocks)
    scores_triton.pair_scores_from_args(
        scores, partial, args, norms, top, (probs.dtype, token.dtype)
    )
    ref_scores, ref_partial = scores_triton.pair_scores_triton(probs, token, norms, top)
    assert torch.equal(scores, ref_scores) and torch.equal(partial, ref_partial)
    assert not triton_common.args_ready(wide[:, 1 : h + 1])  # base off 16 bytes
    assert not triton_common.args_ready(torch.zeros(n, 3))  # 12-byte rows
    assert not triton_common.args_ready(g.t())  # column-strided


def _token_walk_case(gen: torch.Generator, n: int, h: int, k: int, dtype: torch.dtype) -> tuple:
    """``(g [n, h] dtype, x [n, h] bf16, slots [n, k], token, z [pairs, h] bf16, probs)``:
    ``n`` tokens whose ``k`` slots hold ``n * k - 1`` pairs (one slot empty; one pair for a
    single token) in random slots, the token of each pair as the slots say, the pairs' expert
    outputs and routing weights."""
    g = torch.randn(n, h, generator=gen).to(dtype)
    x = (3 * torch.randn(n, h, generator=gen)).to(torch.bfloat16)
    pairs = n * k - 1 if n > 1 else 1
    slots = torch.full((n, k), -1, dtype=torch.int64)
    slots.view(-1)[torch.randperm(n * k, generator=gen)[:pairs]] = torch.arange(pairs)
    token = torch.empty(pairs, dtype=torch.int64)
    for t, row in enumerate(slots.tolist()):
        token[[p for p in row if p >= 0]] = t
    z = torch.randn(pairs, h, generator=gen).to(torch.bfloat16)
    return g, x, slots, token, z, torch.rand(pairs, generator=gen)


@interp
@pytest.mark.parametrize("programs", [1, 1024])
@pytest.mark.parametrize("has_x", [True, False], ids=["x", "no-x"])
@pytest.mark.parametrize("n", [1, 9, 37])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_row_dot_and_packing_in_one_walk(
    monkeypatch: pytest.MonkeyPatch, dtype, n: int, has_x: bool, programs: int
) -> None:
    """``row_dot_pack_from_args`` (one walk over the tokens) gives the bits of the row-dot and
    the packing launched apart: the router gradient of every pair, the kept pairs' scaled
    gradient rows (and input rows) in packed order, the map from pairs to packed rows; rows
    past the count are not touched, nor the map's trailing entry."""
    monkeypatch.setattr(triton_common, "STRIDING_PROGRAMS", programs)
    monkeypatch.setattr(triton_common, "PAIR_BLOCK", 4)  # several blocks of kept rows
    monkeypatch.setattr(triton_common, "TILE", 256)  # several walk rows per program
    gen = _gen(1700 + n)
    h, k = 72, 3
    g, x, slots, token, z, probs = _token_walk_case(gen, n, h, k, dtype)
    pairs = token.numel()
    kept = max(1, pairs // 2)
    room = torch.full((pairs,), 10**9, dtype=torch.int64)  # rows past the count: never read
    room[:kept] = torch.randperm(pairs, generator=gen)[:kept]
    weight = torch.full((pairs,), float("nan"))
    weight[:kept] = 1 + torch.rand(kept, generator=gen)
    poison = torch.tensor(0.0)
    d_probs = torch.full((pairs,), float("nan"), dtype=probs.dtype)
    g_out = torch.full((kept + 2, h), 7.0, dtype=dtype)  # two rows past the count stay 7
    x_out = torch.full((kept + 2, h), 7.0, dtype=x.dtype)
    row_of = torch.full((pairs + 1,), 5, dtype=torch.int64)  # filled with -1 by the launcher
    outs = dict(x_out=x_out) if has_x else {}
    args = _arg_block(
        g=g, x=x, probs=probs, token=token, z=z, slot_plan=slots, d_probs=d_probs, g_out=g_out,
        **outs,
    )
    args[triton_common.ARG_COUNT] = kept
    rows_triton.row_dot_pack_from_args(
        args, room, weight, poison, row_of, (n, h), k, (g.stride(0), z.stride(0), x.stride(0)),
        (d_probs.dtype, g.dtype, z.dtype, x.dtype, probs.dtype), has_x,
    )
    assert torch.equal(d_probs, rows_triton.row_dot_triton(g, z, probs.dtype, slots=slots))
    ref_row_of = torch.full((pairs + 1,), -1, dtype=torch.int64)
    ref_g, ref_x = rows_triton.pack_pairs_triton(
        g, token, room[:kept], probs, weight[:kept], x=x if has_x else None, poison=poison,
        row_of_pair=ref_row_of,
    )
    assert torch.equal(g_out[:kept], ref_g) and bool((g_out[kept:] == 7).all())
    if has_x:
        assert torch.equal(x_out[:kept], ref_x) and bool((x_out[kept:] == 7).all())
    assert torch.equal(row_of, ref_row_of) and int(row_of[-1]) == -1


@interp
@pytest.mark.parametrize("programs", [2, 1024])
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_act_backward_from_arg_block(
    monkeypatch: pytest.MonkeyPatch, dtype, spec: GluSpec, programs: int
) -> None:
    """The activation backward and the return's gather-sum as the expert graph launches them
    (``h``, its kept rows, the slot plan, the map to packed rows and the output at the argument
    block's addresses, the row count in the block, programs striding up to it) give the bits of
    the direct launchers; rows past the count are left alone."""
    monkeypatch.setattr(triton_common, "STRIDING_PROGRAMS", programs)
    monkeypatch.setattr(triton_common, "TILE", 128)  # 2-row blocks at F = 24 + 8 padding
    gen = _gen(990)
    f, saved, kept, room = 24, 40, 13, 17
    f1 = 2 * f if spec.gated else f
    h = (2 * torch.randn(saved, f1, generator=gen)).to(dtype)
    h_rows = torch.randperm(saved, generator=gen)[:kept]
    d = torch.randn(room, f, generator=gen).to(dtype)
    dh = torch.full((room, f1), 7.0, dtype=dtype)
    act = torch.full((room, f), 7.0, dtype=dtype)
    args = _arg_block(h=h, h_rows=h_rows)
    args[triton_common.ARG_COUNT] = kept
    activation_triton.act_backward_from_args(
        args, d, dh, act, h.stride(0), h.dtype, spec.gated, spec.kind
    )
    ref_dh, ref_act, _ = activation_triton.act_backward_triton(
        d[:kept], h, spec.gated, spec.kind, None, True, h_rows=h_rows
    )
    assert torch.equal(dh[:kept], ref_dh) and torch.equal(act[:kept], ref_act)
    assert bool((dh[kept:] == 7).all()) and bool((act[kept:] == 7).all())

    slot_plan = torch.tensor([[0, 3], [-1, 5], [2, -1], [6, 1]])
    row_of = torch.tensor([4, -1, 0, 16, -1, 6, -1, -1])
    out = torch.full((4, f), 7.0, dtype=dtype)
    args = _arg_block(slot_plan=slot_plan, row_of=row_of, out=out)
    rows_triton.gather_sum_from_args(args, d, 4, 2, out.dtype)
    assert torch.equal(out, rows_triton.gather_sum_triton(d, slot_plan, row_of=row_of))


@interp
@pytest.mark.parametrize(
    ("save", "policy", "accumulate"),
    [(True, "sample", True), (False, "topk", False)],
    ids=["save-sample", "recompute-topk-overwrite"],
)
def test_interp_layer_graph_body_matches_front_and_eager_stages(
    monkeypatch: pytest.MonkeyPatch, save: bool, policy: str, accumulate: bool
) -> None:
    """What the layer graph records (``graphs/backward.run_layer_graph``: the front's kernels,
    then the expert half on the front's buffers, in the interpreter; the CUDA graph replaced by
    re-running its launches) against the stages on the torch paths: the router gradient
    (``row_dot``), the selection (``score_and_select``), the packing (``pack_pairs``), the
    expert backward into ``main_grad`` and the return (``gather_sum``). The same kept pairs;
    router gradient, ``main_grad`` and input gradient equal up to fp32 summation order, over a
    first sighting (nothing runs), the capture's eager run and two replays. On the host the
    graph makes room for exactly the kept rows (host group sizes must add up to them); the GPU
    test ``test_cuda_expert_graph_matches_eager_layer`` covers room for more rows and the real
    capture. With ``accumulate`` off (Megatron-FSDP's ``overwrite_main_grad``) ``main_grad``
    starts as NaN, which must never be read."""
    from types import SimpleNamespace

    from megatron_lrmoe.dispatch.rows import gather_sum, pack_pairs, row_dot
    from megatron_lrmoe.experts.mlp import expert_backward
    from megatron_lrmoe.experts.wgrad_triton import MainGrads
    from megatron_lrmoe.graphs import backward as bg
    from megatron_lrmoe.graphs import front as front_graph
    from megatron_lrmoe.select import select_triton

    host_block = select_triton.host_block
    monkeypatch.setattr(select_triton, "host_block", lambda c, q, u, _pin, lead: host_block(
        c, q, u, False, lead
    ))
    monkeypatch.setattr(bg, "capture", lambda launch, device, pool: (
        launch(), SimpleNamespace(replay=launch)
    )[1])
    monkeypatch.setattr(bg.ExpertRows, "pool_for", lambda self, graph: None)
    bg.reset()

    gen = _gen(1200)
    tokens, slots, width, ffn, experts = 6, 2, 16, 8, 3
    spec = GluSpec(True, "silu")
    pairs = tokens * slots
    counts = torch.tensor([4, 3, 5])
    quota = torch.tensor([2, 1, 3])
    kept = int(quota.sum())
    # Pairs in expert order; token t's slots are two pairs of different experts.
    token = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5])
    slot_plan = torch.stack((torch.arange(tokens), torch.arange(tokens) + tokens), 1)
    w1 = torch.randn(experts, 2 * ffn, width, generator=gen) / 4
    w2 = torch.randn(experts, width, ffn, generator=gen) / 4
    starts = [torch.randn(w.shape, generator=gen) for w in (w1, w2)]
    if not accumulate:
        starts = [torch.full_like(s, float("nan")) for s in starts]
    h = torch.randn(pairs, 2 * ffn, generator=gen) if save else None
    shape = bg._Shape(torch.device("cpu"), tokens, slots, pairs, width, experts, w1.dtype, True)
    rows = bg.ExpertRows(shape, kept)
    acc = [s.clone() for s in starts]
    ref_acc = [s.clone() for s in starts]
    for call in range(4):
        g = torch.randn(tokens, width, generator=gen)
        x = torch.randn(tokens, width, generator=gen)
        z = torch.randn(pairs, width, generator=gen)
        probs = torch.rand(pairs, generator=gen)
        uniforms = torch.rand(experts, generator=gen, dtype=torch.float64)
        uniforms = uniforms if policy == "sample" else None
        d_probs = torch.full((pairs,), 7.0)
        d_hidden = torch.full((tokens, width), 7.0)
        front = rows.front_buffers(z, slot_plan, d_probs)
        scored = front_graph.scored_call(
            policy, front_graph.ScoreInputs(g, x, probs, token), counts, quota, uniforms, front,
            kept_total=True,
        )
        assert scored is not None
        into = MainGrads(acc[0], acc[1], accumulate)
        out = bg.run_layer_graph(rows, scored, h, slot_plan, d_hidden, (w1, w2), into, spec)
        if call == 0:  # the layer's first sighting: nothing ran
            assert out is None and bool((d_hidden == 7).all()) and bool((d_probs == 7).all())
            continue
        (got_scores, sel, got_total), _ = out

        ref_scored, ref_sel, ref_total = scoring.score_and_select(
            policy, g, x, probs, token, counts, quota, uniforms, kept_total=True
        )
        assert torch.equal(sel.kept_index, ref_sel.kept_index)
        torch.testing.assert_close(got_total, ref_total, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(d_probs, row_dot(g, z, probs.dtype, slots=slot_plan))
        row_of = torch.full((pairs + 1,), -1, dtype=torch.int64)
        g_rows, x_rows = pack_pairs(
            g, token, ref_sel.kept_index, probs, ref_sel.weight, x, ref_scored.poison, row_of
        )
        dx, _, _, _ = expert_backward(
            g_rows, x_rows, h, w1, w2, quota, spec,
            h_rows=ref_sel.kept_index if save else None,
            wgrad_into=MainGrads(ref_acc[0], ref_acc[1], accumulate),
        )
        ref_hidden = gather_sum(dx, slot_plan, row_of=row_of)
        torch.testing.assert_close(d_hidden, ref_hidden, rtol=1e-5, atol=1e-5)
        for got, ref, start in zip(acc, ref_acc, starts):
            assert not torch.equal(got, start) and bool(got.isfinite().all())
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # What the graph keeps from call to call (besides the recorded launches: the stand-in
    # here re-runs them) does not hold the weights or main_grad: a deleted layer is freed.
    (entry,) = bg._GRAPHS.graphs.values()
    assert not _reaches(entry, (w1, w2, *acc), skip=(entry.graph,))
    bg.reset()


def _reaches(root: object, targets: tuple[torch.Tensor, ...], skip: tuple[object, ...]) -> bool:
    """Whether ``root`` holds one of ``targets``, directly or through what it holds (functions
    through their closures only; modules and ``skip`` are not followed)."""
    want, seen, todo = {id(t) for t in targets}, {id(s) for s in skip}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in want:
            return True
        if isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    todo.append(cell.cell_contents)
        elif not isinstance(obj, types.ModuleType):
            todo.extend(gc.get_referents(obj))
    return False


@interp
@pytest.mark.parametrize("n", [0, 1, 37, 100])
@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16], ids=["p32", "p16"])
def test_interp_pair_scores(monkeypatch: pytest.MonkeyPatch, n: int, probs_dtype) -> None:
    monkeypatch.setattr(triton_common, "PAIR_BLOCK", 16)  # several blocks, a ragged last one
    g = _gen(800 + n)
    t = 11
    norms = torch.rand(2, t, generator=g) * 50
    token = torch.randint(0, t, (n,), generator=g)
    probs = torch.rand(n, generator=g).to(probs_dtype)
    for top in (norms.amax(1), torch.tensor([0.0, 7.0])):  # a zero scale counts as 1
        scores, partial = scores_triton.pair_scores_triton(probs, token, norms, top)
        ref = scoring.pair_scores(probs, token, norms, top)
        assert torch.equal(scores, ref.scores)  # same fp32 operations in the same order
        assert partial.shape == (2, max(1, -(-n // 16)))
        assert float(partial[0].sum()) == 0.0
        torch.testing.assert_close(partial[1].sum(), ref.total, rtol=1e-6, atol=0.0)
    if n:
        bad = norms.clone()
        bad[1, token[n // 2]] = float("inf")
        scores, partial = scores_triton.pair_scores_triton(probs, token, bad, bad.amax(1))
        ref = scoring.pair_scores(probs, token, bad, bad.amax(1))
        assert torch.equal(scores.isfinite(), ref.scores.isfinite())
        assert math.isnan(float(partial[0].sum())) and math.isnan(float(ref.poison))
        finite = ref.scores.isfinite()
        torch.testing.assert_close(partial[1].sum(), ref.scores[finite].sum(), rtol=1e-6, atol=0.0)


@interp
@pytest.mark.parametrize("k", [0, 1, 19, 53])
@pytest.mark.parametrize("with_x", [False, True], ids=["g", "g+x"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_pack_pairs(small_tiles, dtype, k: int, with_x: bool) -> None:
    g = _gen(900 + k)
    t, s, h = 13, 40, 200
    grad = _rows_layout(torch.randn(t, h, generator=g).to(dtype), "row_strided")
    x = _rows_layout(torch.randn(t, h, generator=g).to(dtype), "transposed") if with_x else None
    token_of_pair = torch.randint(0, t, (s,), generator=g)
    pairs = torch.randint(0, s, (k,), generator=g)  # repeats, any order
    probs = torch.rand(s, generator=g)
    weight = 1.0 + 3 * torch.rand(k, generator=g)
    for poison in (None, torch.tensor(0.0), torch.tensor(float("nan"))):
        got_g, got_x = rows_triton.pack_pairs_triton(
            grad, token_of_pair, pairs, probs, weight, x=x, poison=poison, block_h=64
        )
        ref_g, ref_x = rowwise.pack_pairs(grad, token_of_pair, pairs, probs, weight, x, poison)
        assert got_g.shape == (k, h)
        if poison is not None and math.isnan(float(poison)):
            assert bool(got_g.isnan().all()) and bool(ref_g.isnan().all())
        elif dtype == torch.float32:
            assert torch.equal(got_g, ref_g)
        else:
            assert_within(got_g, ref_g, ulps=1, what="pack_pairs")
        if with_x:
            assert torch.equal(got_x, ref_x)
        else:
            assert got_x is None and ref_x is None


@interp
@pytest.mark.parametrize("k", [0, 1, 19, 40])
@pytest.mark.parametrize("h", [200, 0], ids=["h200", "h0"])
def test_interp_pack_pairs_row_of_pair(small_tiles, k: int, h: int) -> None:
    """The packing kernel also records each packed pair's row (``row_of_pair[pairs[i]] = i``),
    like the torch path; the packed rows do not change."""
    g = _gen(950 + k)
    t, s = 13, 40
    grad = _rows_layout(torch.randn(t, h, generator=g), "row_strided") if h else torch.randn(t, 0)
    token_of_pair = torch.randint(0, t, (s,), generator=g)
    pairs = torch.randperm(s, generator=g)[:k]  # distinct, any order
    probs = torch.rand(s, generator=g)
    weight = 1.0 + torch.rand(k, generator=g)
    want = torch.full((s + 1,), -1, dtype=torch.int64)
    for i, j in enumerate(pairs.tolist()):
        want[j] = i
    got_map = torch.full((s + 1,), -1, dtype=torch.int64)
    ref_map = got_map.clone()
    got_g, _ = rows_triton.pack_pairs_triton(
        grad, token_of_pair, pairs, probs, weight, row_of_pair=got_map, block_h=64
    )
    ref_g, _ = rowwise.pack_pairs(grad, token_of_pair, pairs, probs, weight, row_of_pair=ref_map)
    plain_g, _ = rows_triton.pack_pairs_triton(
        grad, token_of_pair, pairs, probs, weight, block_h=64
    )
    assert torch.equal(got_map, want) and torch.equal(ref_map, want)
    assert torch.equal(got_g, ref_g) and torch.equal(got_g, plain_g)


@interp
@pytest.mark.parametrize("incomplete", [False, True], ids=["full", "empty_slots"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_interp_gather_sum_row_of(small_tiles, dtype, scaled: bool, incomplete: bool) -> None:
    """``gather_sum(rows, slot_pair, row_of=...)`` against ``gather_sum`` on the ``[T, K]`` plan
    ``PairPermutation.slot_rows`` builds: dropped pairs and empty slots add nothing."""
    g = _gen(970 + 2 * incomplete + scaled)
    t, e, k, h = 21, 8, 3, 200
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    if incomplete:
        routing_map[::4, idx[::4, 0]] = False
        routing_map[5] = False  # a token with no pair at all
    s = int(routing_map.sum())
    perm = PairPermutation.build(routing_map, s, k)
    assert perm.full == (not incomplete)
    # Two thirds of the pairs kept, listed in a shuffled (exchange) order.
    kept = torch.randperm(s, generator=g)[: 2 * s // 3]
    rows = _rows_layout(torch.randn(kept.numel(), h, generator=g).to(dtype), "row_strided")
    scale = torch.rand(kept.numel(), generator=g) if scaled else None
    row_of = torch.full((s + 1,), -1, dtype=torch.int64)
    row_of[kept] = torch.arange(kept.numel())
    got = rows_triton.gather_sum_triton(rows, perm.slot_pair, scale, row_of, block_h=64)
    ref = rowwise.gather_sum(rows, perm.slot_rows(kept), scale)
    via = rowwise.gather_sum(rows, perm.slot_pair, scale, row_of=row_of)  # the torch path
    assert torch.equal(via, ref)
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:
        assert_within(got, ref, ulps=1, what="gather_sum row_of")
    if incomplete:  # the token without pairs reads only empty slots
        assert bool((perm.slot_pair[5] == -1).all()) and torch.count_nonzero(got[5]) == 0


@interp
def test_interp_launchers_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match="scale has"):
        rows_triton.scale_rows_triton(torch.randn(4, 8), torch.rand(3))
    with pytest.raises(ValueError, match="index"):
        rows_triton.scale_rows_triton(torch.randn(4, 8), torch.rand(2), torch.zeros(2))
    with pytest.raises(TypeError, match="dtype"):
        rows_triton.row_dot_triton(
            torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8), torch.float32
        )
    with pytest.raises(ValueError, match="does not match"):
        activation_triton.act_backward_triton(torch.randn(3, 5), torch.randn(3, 8), True, "silu")
    with pytest.raises(ValueError, match="probs"):
        activation_triton.act_forward_triton(torch.randn(3, 8), True, "silu", torch.rand(2))
    with pytest.raises(ValueError, match="int64"):
        rows_triton.gather_sum_triton(torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="row_of"):
        rows_triton.gather_sum_triton(
            torch.randn(4, 8), torch.zeros(2, 2, dtype=torch.int64), None, torch.zeros(5)
        )
    with pytest.raises(ValueError, match="power of two"):
        activation_triton.act_forward_triton(torch.randn(3, 8), False, "silu", block_f=24)
    with pytest.raises(ValueError, match="row_norms_triton"):
        scores_triton.row_norms_triton(torch.randn(4, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="pair_scores_triton"):
        scores_triton.pair_scores_triton(
            torch.rand(4), torch.zeros(3, dtype=torch.int64), torch.rand(2, 5), torch.ones(2)
        )
    with pytest.raises(ValueError, match="pack_pairs_triton"):
        rows_triton.pack_pairs_triton(
            torch.randn(4, 8), torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
            torch.rand(6), torch.ones(2),
        )
    with pytest.raises(ValueError, match="row_of_pair"):
        rows_triton.pack_pairs_triton(
            torch.randn(4, 8), torch.zeros(6, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
            torch.rand(6), torch.ones(2), row_of_pair=torch.full((14,), -1)[::2],
        )


# --------------------------------------------------------------------------------------------
# CUDA: the dispatching ops on the GPU, realistic Qwen3-30B-A3B shapes, against their torch
# paths (KernelOptions(triton=False))
# --------------------------------------------------------------------------------------------


def _torch_path(fn, *args):
    with using_kernels(KernelOptions(triton=False)):
        return fn(*args)


def _ms(fn, *args, reps: int = 5) -> float:
    fn(*args)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


# The grouped weight gradient accumulated into main_grad (experts/wgrad_triton.py): fp32
# accumulation either way, so the kernel and the per-group fp32 matmul agree up to summation
# order (relative to the block's largest magnitude).
WGRAD_SIZES = [[5, 0, 37, 16, 1], [0, 0, 3], [64, 64]]


def _wgrad_case(sizes: list[int], dtype: torch.dtype, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    rows, m, n = sum(sizes), 24, 40
    a = torch.randn(rows, m, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(rows, n, generator=g).to(device=device, dtype=dtype)
    base = torch.randn(len(sizes), m, n, generator=g).to(device)
    return a, b, base


@interp
@pytest.mark.parametrize("sizes", WGRAD_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("persistent", [0, 1], ids=["grid", "persistent"])
@pytest.mark.parametrize("atomic", [False, True], ids=["load", "atomic"])
def test_interp_grouped_wgrad(
    sizes: list[int], dtype, accumulate: bool, persistent: int, atomic: bool
) -> None:
    from megatron_lrmoe.experts.wgrad_triton import (
        WgradConfig,
        grouped_wgrad_reference,
        grouped_wgrad_triton,
    )

    a, b, base = _wgrad_case(sizes, dtype)
    empty = [g for g, size in enumerate(sizes) if size == 0]
    base[empty, 0] = -0.0  # adding a zero tile would turn these into +0.0
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    got = grouped_wgrad_triton(
        a,
        b,
        offs,
        base.clone(),
        accumulate=accumulate,
        config=WgradConfig(16, 32, 16, 4, 2, programs_per_sm=persistent, atomic_epilogue=atomic),
    )
    want = grouped_wgrad_reference(a, b, sizes, base.clone(), accumulate=accumulate)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    for g in empty:  # accumulating, empty groups keep their bits: not read, not written
        if accumulate:
            assert torch.equal(got[g].view(torch.int32), base[g].view(torch.int32)), g
        else:
            assert not got[g].view(torch.int32).any(), g  # +0.0 everywhere


def test_grouped_wgrad_tile_by_rows_per_group() -> None:
    from megatron_lrmoe.experts.wgrad_triton import (
        LARGE_GROUP_CONFIG,
        LARGE_GROUP_ROWS,
        SMALL_GROUP_CONFIG,
        config_for,
    )

    assert LARGE_GROUP_CONFIG != SMALL_GROUP_CONFIG
    assert config_for(128 * 384, 128) is SMALL_GROUP_CONFIG
    assert config_for(128 * 512, 128) is LARGE_GROUP_CONFIG  # keep 0.5 at 16384 tokens, top-8
    assert config_for(128 * LARGE_GROUP_ROWS, 128) is LARGE_GROUP_CONFIG
    assert config_for(128 * LARGE_GROUP_ROWS - 1, 128) is SMALL_GROUP_CONFIG
    assert config_for(0, 0) is SMALL_GROUP_CONFIG


def test_grouped_wgrad_host_path_adds_each_group() -> None:
    from megatron_lrmoe.experts.wgrad_triton import accumulate_grouped_wgrad

    sizes = WGRAD_SIZES[0]
    a, b, base = _wgrad_case(sizes, torch.float32)
    got = accumulate_grouped_wgrad(a, b, torch.tensor(sizes), base.clone())
    start = 0
    for g, size in enumerate(sizes):
        want = base[g] + a[start : start + size].t() @ b[start : start + size]
        torch.testing.assert_close(got[g], want, rtol=1e-6, atol=1e-5)
        start += size
    with pytest.raises(ValueError, match="groups for out"):
        accumulate_grouped_wgrad(a, b, torch.tensor(sizes[:-1]), base)


@cuda
@pytest.mark.skipif(not triton_common.triton_available(), reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiled kernels only")
def test_cuda_grouped_wgrad_into_fp32() -> None:
    """bf16 rows, fp32 accumulator (``main_grad``), both tiles the dispatcher picks, ragged
    groups."""
    from megatron_lrmoe.experts.wgrad_triton import (
        LARGE_GROUP_CONFIG,
        SMALL_GROUP_CONFIG,
        WgradConfig,
        accumulate_grouped_wgrad,
        config_for,
        grouped_wgrad_reference,
        grouped_wgrad_triton,
    )

    torch.manual_seed(0)
    m, n = 1536, 2048
    # Small ragged groups (the default tile), then groups large enough for the larger tile
    # (config_for); group 1 is empty in both.
    for sizes, tile in (
        ([300, 0, 1, 513, 128, 77], SMALL_GROUP_CONFIG),
        ([4000, 0, 2200, 3], LARGE_GROUP_CONFIG),
    ):
        rows = sum(sizes)
        assert config_for(rows, len(sizes)) is tile
        a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        base = torch.randn(len(sizes), m, n, device="cuda")
        # An fp32 atomic add of zero would turn -0.0 into +0.0 and flush a subnormal to zero.
        base[1, 0, :2] = torch.tensor([-0.0, 1e-40])
        got = accumulate_grouped_wgrad(a, b, torch.tensor(sizes), base.clone())
        want = grouped_wgrad_reference(a, b, sizes, base.clone())
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
        assert torch.equal(got[1].view(torch.int32), base[1].view(torch.int32))
        # The same tile on the other grid (one program per tile, or persistent with 1 and 2 per
        # SM), with either epilogue: atomics add the same fp32 tile to the same base, so the
        # same bits as load-add-store.
        offs = torch.tensor(sizes, device="cuda").cumsum(0)
        for pps in (0, 1, 2):
            got = {}
            for atomic in (False, True):
                grid = {"programs_per_sm": pps, "atomic_epilogue": atomic}
                cfg = WgradConfig(**{**vars(tile), **grid})
                got[atomic] = grouped_wgrad_triton(a, b, offs, base.clone(), config=cfg)
                torch.testing.assert_close(
                    got[atomic], want, rtol=0, atol=2e-5 * float(want.abs().max())
                )
                assert torch.equal(got[atomic][1].view(torch.int32), base[1].view(torch.int32))
            assert torch.equal(got[True], got[False])


@cuda
@pytest.mark.skipif(not triton_common.triton_available(), reason="needs triton")
@pytest.mark.skipif(INTERPRETING, reason="compiled kernels only")
def test_cuda_realistic_shapes() -> None:
    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    n, hid, f = 131072, 2048, 768
    x = torch.randn(n, hid, device=dev, dtype=bf16)
    y = torch.randn(n, hid, device=dev, dtype=bf16)
    probs = torch.rand(n, device=dev)
    index = torch.randperm(n, device=dev)[: n // 3]
    timings: dict[str, tuple[float, float]] = {}

    with torch.no_grad():
        for name, fn, args in [
            ("scale_rows", rowwise.scale_rows, (x, probs)),
            ("scale_rows[index]", rowwise.scale_rows, (x, probs[: index.numel()], index)),
            ("gather_rows", rowwise.gather_rows, (x[: n // 8], torch.randint(0, n // 8, (n,),
                                                                            device=dev))),
        ]:
            got, ref = fn(*args), _torch_path(fn, *args)
            assert torch.equal(got, ref), name  # RNE on the GPU: bit-exact
            timings[name] = (
                _ms(fn, *args),
                _ms(lambda *a: _torch_path(fn, *a), *args),
            )

        got = rowwise.row_dot(x, y, torch.float32)
        _check_row_dot(got, x, y, _torch_path(rowwise.row_dot, x, y, torch.float32))

        # The backward's scoring and packing at 16384 tokens x top-8.
        tokens = n // 8
        gt, xt = x[:tokens], y[:tokens]
        token_of_pair = torch.randint(0, tokens, (n,), device=dev)
        norms = scoring.token_norms(gt, xt)
        torch.testing.assert_close(
            norms, _torch_path(scoring.token_norms, gt, xt), rtol=1e-5, atol=0.0
        )
        top = norms.amax(1)
        got = scoring.pair_scores(probs, token_of_pair, norms, top)
        ref = _torch_path(scoring.pair_scores, probs, token_of_pair, norms, top)
        assert torch.equal(got.scores, ref.scores)
        torch.testing.assert_close(got.total, ref.total, rtol=1e-5, atol=0.0)
        weight = torch.rand(index.numel(), device=dev) + 1
        args = (gt, token_of_pair, index, probs, weight, xt, torch.zeros((), device=dev))
        got_g, got_x = rowwise.pack_pairs(*args)
        ref_g, ref_x = _torch_path(rowwise.pack_pairs, *args)
        assert torch.equal(got_g, ref_g) and torch.equal(got_x, ref_x)
        timings["pack_pairs"] = (
            _ms(rowwise.pack_pairs, *args),
            _ms(lambda *a: _torch_path(rowwise.pack_pairs, *a), *args),
        )

        for spec in SPECS:
            h = torch.randn(n, f * spec.fc1_multiplier, device=dev, dtype=bf16) * 4
            d_a = torch.randn(n, f, device=dev, dtype=bf16)
            a = act_forward(h, spec)
            assert_within(a, _torch_path(act_forward, h, spec), 1, 16 * FP32_EPS)
            dh, _, _ = act_backward(d_a, h, spec)
            ref, _, _ = _torch_path(act_backward, d_a, h, spec)
            assert_within(dh, ref, 1, 16 * FP32_EPS, what=f"act_backward {spec}")
            rows = torch.randperm(n, device=dev)[: n // 2].sort().values
            dh_k, _, _ = act_backward(d_a[: rows.numel()], h, spec, h_rows=rows)
            ref_k, _, _ = _torch_path(
                act_backward, d_a[: rows.numel()], h.index_select(0, rows), spec
            )
            assert_within(dh_k, ref_k, 1, 16 * FP32_EPS, what=f"act_backward h_rows {spec}")
            if spec.gated and spec.kind == "silu":
                timings["swiglu fwd"] = (
                    _ms(act_forward, h, spec),
                    _ms(lambda *a: _torch_path(act_forward, *a), h, spec),
                )
                timings["swiglu bwd"] = (
                    _ms(act_backward, d_a, h, spec),
                    _ms(lambda *a: _torch_path(act_backward, *a), d_a, h, spec),
                )
    for name, (fast, slow) in timings.items():
        print(f"{name:>20}: triton {fast:.3f} ms, torch {slow:.3f} ms")
