"""What the package's Triton kernel modules share: the switch, the lazy import, launch helpers.

The kernels live beside the stage that uses them: ``dispatch/rows_triton.py`` (row scaling,
gathers, row dots, packing), ``dispatch/pair_plan_triton.py``, ``select/scores_triton.py`` (row
norms, pair scores), ``select/select_triton.py`` (the selection), ``experts/activation_triton.py``,
``experts/wgrad_triton.py``.

Selection: :func:`use_triton` is true when every tensor is on CUDA, ``triton`` imports, and the
active kernel options (``options.active_kernels()``: the running layer's
``LRMoEConfig.kernels``) have ``triton`` on. The callers also keep their torch path for fp64,
for inputs that need autograd, and for unusual shapes, so their semantics do not change.

Triton is imported lazily (first launch or first :func:`triton_available` call), so importing
the package works where triton is missing or broken. Each kernel module's bodies are plain
functions until its kernel factory (``_kernels()``; ``select_triton.selection_kernels()``)
wraps them; they reference that module's global ``tl``, which is bound then (this module's,
which :func:`arg_ptr` and :func:`tl_dtype` use, by :func:`triton_available`).

Everything here is shared by the kernel modules, so nothing here is private to this module:
the names they import are public (``__all__``).

Tuning constants that several kernel modules read (``TILE``, ``PAIR_BLOCK``,
``STRIDING_PROGRAMS``) are read from this module at launch time (``tc.TILE``), so that one
change (a test's monkeypatch) reaches every launcher.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported: triton's own helpers such as
``tl.zeros`` are wrapped at import time) the launchers (``*_triton``) accept CPU tensors and run
the kernel bodies in Triton's numpy interpreter; the tests do that in a subprocess. It is slow,
and the interpreter rounds fp32 -> bf16 by truncation instead of to nearest, so its bf16
results may differ from the GPU ones by one ulp.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any, Sequence

import torch

from megatron_lrmoe.options import active_kernels

__all__ = [
    "ARG_COUNT",
    "ARG_D_PROBS",
    "ARG_G",
    "ARG_G_OUT",
    "ARG_H",
    "ARG_H_ROWS",
    "ARG_OUT",
    "ARG_PROBS",
    "ARG_ROW_OF",
    "ARG_SLOTS",
    "ARG_SLOT_PLAN",
    "ARG_TOKEN",
    "ARG_X",
    "ARG_X_OUT",
    "ARG_Z",
    "KERNEL_DTYPES",
    "MAX_BLOCK",
    "MIN_BLOCK",
    "NUM_WARPS",
    "PAIR_BLOCK",
    "STRIDING_PROGRAMS",
    "TILE",
    "arg_ptr",
    "args_ready",
    "cdiv",
    "check_dtype",
    "checked_kernels",
    "col_block",
    "device_ctx",
    "jit_kernels",
    "reduction_tile",
    "tl_dtype",
    "triton_available",
    "unit_cols",
    "use_triton",
]


# Dtypes the kernels load and store; their math is fp32, so fp64 stays on the torch paths.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Elements per program tile: 4096 bf16 elements are 8 KiB per input, 16 per thread at 8 warps,
# large enough to hide memory latency on H100/H200 without spilling in the backward kernel.
TILE = 4096


NUM_WARPS = 8


MIN_BLOCK, MAX_BLOCK = 16, 1024


# Bound to ``triton.language`` by ``triton_available()``; :func:`arg_ptr` resolves it at
# compile (or interpret) time, never at definition time (annotations are strings here).
tl: Any = None


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``triton`` imports here (cached; any import error counts as unavailable)."""
    global tl
    try:
        import triton  # noqa: F401
        import triton.language as language
    except Exception:  # a broken install can raise anything, not only ImportError
        return False
    tl = language
    _interpreter_takes_scalar_bounds()
    return True


def _interpreter_takes_scalar_bounds() -> None:
    """Let Triton 3.6's interpreter (torch 2.11's Triton) use a kernel argument as a loop bound.

    Its ``tensor.__index__`` is ``int(array)`` of a one-element 1-d array, which NumPy 2.5
    rejects ("only 0-dimensional arrays can be converted to Python scalars"), so every
    ``range(0, n, BLOCK)`` over a runtime ``n`` failed: 320 of our 441 interpreter tests.
    Triton 3.8's interpreter takes the element itself; this gives older ones the same
    ``__index__``. Only the interpreter (``TRITON_INTERPRET=1``) is touched, never compiled
    kernels, and nothing where the interpreter is laid out differently.
    """
    try:
        from triton.runtime import interpreter
    except Exception:  # no interpreter in this Triton
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "lrmoe_scalar_index", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    patch_lang_tensor.lrmoe_scalar_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _scalar_index(self: Any) -> int:
    """``__index__`` of an interpreted scalar: its one element, whatever the array's rank."""
    return int(self.handle.data.item())


def jit_kernels(
    module: dict[str, Any],
    helpers: Sequence[str],
    kernels: dict[str, Any],
    what: str,
) -> SimpleNamespace:
    """A kernel module's bodies wrapped by ``triton.jit``: each module calls it once, from its
    ``functools.lru_cache``'d ``_kernels()``, on first launch.

    Binds ``tl`` in ``module`` (the kernels resolve it there when they compile), replaces each
    device helper named in ``helpers`` by its jitted version in ``module`` (before any kernel
    compiles, since the kernels call them by name), and jits every kernel. Under
    ``TRITON_INTERPRET=1`` (read by triton when it is imported and when ``jit`` wraps) these are
    interpreter functions that run on host tensors; ``interpreted`` says so.

    Args:
        module: The calling module's ``globals()``.
        helpers: Names of the module's device helpers (``arg_ptr`` is this module's).
        kernels: ``{name: function}`` or ``{name: (function, jit keyword arguments)}``.
        what: The kernels' job, named in the error without ``triton``.

    Returns:
        The jitted kernels by name, and ``interpreted``.
    """
    if not triton_available():
        raise RuntimeError(f"megatron_lrmoe's {what} needs an importable `triton` package")
    import triton
    import triton.language as language
    from triton.runtime.jit import JITFunction

    module["tl"] = language
    for name in helpers:
        module[name] = triton.jit(module[name])
    jitted = {}
    for name, spec in kernels.items():
        fn, options = spec if isinstance(spec, tuple) else (spec, {})
        jitted[name] = triton.jit(fn, **options)
    out = SimpleNamespace(**jitted)
    out.interpreted = not isinstance(next(iter(jitted.values())), JITFunction)
    return out


def use_triton(*tensors: torch.Tensor) -> bool:
    """The fast-path switch: all ``tensors`` on CUDA, triton available, and ``triton`` on in
    the active kernel options (``options.active_kernels()``)."""
    if not active_kernels().triton:
        return False
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    return triton_available()


def checked_kernels(kernels: SimpleNamespace, t: torch.Tensor) -> SimpleNamespace:
    """A kernel module's ``kernels`` (its ``_kernels()``), after checking they can run on
    ``t``'s device."""
    if not t.is_cuda and not kernels.interpreted:
        raise ValueError(
            "Triton kernels got host tensors; they need CUDA tensors, or TRITON_INTERPRET=1 "
            "set before triton is first imported (the interpreter runs them on the host)"
        )
    return kernels


def arg_ptr(args_ptr, index, TY: tl.constexpr):
    """Pointer ``index`` of an argument block (int64 addresses, each 16-byte aligned: the
    launcher checks), typed ``TY``: kernels replayed from a CUDA graph read the addresses of
    tensors that change from call to call from such a block."""
    # The hint goes on the pointer: the alignment of an integer does not survive its cast to a
    # pointer, and without it the loads and stores are not vectorised (one element each).
    ptr = tl.load(args_ptr + index).to(tl.pointer_type(TY))
    return tl.multiple_of(ptr, 16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def col_block(width: int, override: int | None) -> int:
    """Power-of-two column block with the least padding, the larger one on ties.

    E.g. F = 768 gets 256 (no masked-off lanes) where the next power of two (1024) would idle a
    quarter of every tile; H = 2048 gets 1024.
    """
    if override is not None:
        if override < 1 or override & (override - 1):
            raise ValueError(f"block width must be a power of two, got {override}")
        return override
    best, best_pad = MAX_BLOCK, None
    b = MAX_BLOCK
    while b >= MIN_BLOCK:
        pad = cdiv(max(width, 1), b) * b
        if best_pad is None or pad < best_pad:
            best, best_pad = b, pad
        b //= 2
    return best


def reduction_tile(
    width: int, override: int | None, max_block_h: int, accumulators: int
) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_M)`` of a kernel that loops over the columns and reduces each row: a
    column block of at most ``max_block_h`` (unless overridden) and rows so that its fp32
    accumulators (``accumulators`` tiles' worth of ``TILE``) stay in registers."""
    block_h = (
        col_block(width, override)
        if override is not None
        else min(col_block(width, None), max_block_h)
    )
    return block_h, max(1, (TILE // accumulators) // block_h)


def unit_cols(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) with unit column stride: the kernels take any row stride, but coalesced
    loads need contiguous rows, so only a column-strided input is copied."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


_NULL_CTX = contextlib.nullcontext()


def device_ctx(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: pin it to the tensors' device when it differs.

    Entering ``torch.cuda.device`` costs about 10 us of host time per launch, the price of a
    whole kernel launch, so it is skipped in the usual case (the tensors are on the current
    device).
    """
    if not t.is_cuda or t.device.index == torch.cuda.current_device():
        return _NULL_CTX
    return torch.cuda.device(t.device)


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} not supported by the Triton kernels")


# Pairs per program of the pair-scoring kernel.
PAIR_BLOCK = 1024


# Slots of the int64 argument block that the ``*_args`` kernels read tensor addresses (and, in
# ``ARG_COUNT``, a row count) from; the kernels name them by number.
ARG_G, ARG_X, ARG_PROBS, ARG_TOKEN = range(4)  # gradient and input rows, routing weights, tokens


ARG_Z, ARG_SLOT_PLAN, ARG_D_PROBS = 4, 5, 6  # the router gradient's row-dot: inputs, output


ARG_G_OUT, ARG_X_OUT, ARG_COUNT = 7, 8, 9  # packing: dense outputs, the rows they get


# The expert graph (graphs/backward.py): the saved fc1 output and the kept rows of it
# (the activation backward), the map to packed rows and the output (the return's gather-sum;
# it reads the slot plan at ARG_SLOT_PLAN).
ARG_H, ARG_H_ROWS, ARG_ROW_OF, ARG_OUT = 10, 11, 12, 13


ARG_SLOTS = 16  # 128 bytes, so what follows the block in one buffer stays 64-byte aligned


def args_ready(*tensors: torch.Tensor) -> bool:
    """Whether the ``*_args`` kernels may read ``tensors`` through an argument block: base
    addresses and row strides on 16 bytes (the kernels assume it), rows of unit column stride."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        if t.dim() == 2 and (t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16):
            return False
    return True


def tl_dtype(dtype: torch.dtype) -> Any:
    """The ``triton.language`` dtype of a torch dtype (``tl`` is bound by then)."""
    return {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
        torch.int32: tl.int32,
        torch.int64: tl.int64,
    }[dtype]


# Programs per column block of the striding packing kernel: a few per multiprocessor of an
# H100 / H200 (132), enough to keep their memory pipes busy.
STRIDING_PROGRAMS = 1024
