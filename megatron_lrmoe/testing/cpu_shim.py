"""Test-only CUDA shim that lets real megatron-core 0.19.2 MoE code run on CPU over gloo.

megatron-core has no CPU path: it allocates with ``device=torch.cuda.current_device()``, keeps its
model-parallel RNG states in the CUDA generator, creates CUDA streams/events for overlap and
device-to-host copies, and hard-codes ``device="cuda"`` in a few optimizer/DDP spots. This module
patches exactly those touch points so that CPU-only CI can exercise the *stock* megatron-core
modules (MoELayer + alltoall dispatcher, SequentialMLP, TopKRouter, shared experts, GPTModel with
the local spec, the MoE metrics tracker, DistributedDataParallel + the Megatron optimizer).

Nothing happens on import. Call :func:`install_cpu_shim` explicitly, in a process that has no GPU
(it refuses to run when ``torch.cuda.is_available()``), before building megatron modules. The
patches are process-global and are never undone, so install it in worker processes (see
:func:`megatron_lrmoe.testing.harness.run_distributed`), not in a shared pytest process.

Patch table (each entry: target -> replacement, then why)::

    1  torch.cuda.current_device -> lambda: "cpu"
       megatron allocates with device=torch.cuda.current_device(): tensor_parallel mappings and
       layers, router expert-bias buffers and the Router.gating weight move, GlobalMemoryBuffer,
       DDP grad buffers, transformer_layer, attention.
    2  torch.cuda.{get,set}_rng_state, torch.cuda.manual_seed{,_all} (also torch.cuda.random.*)
       -> the CPU default generator
       model_parallel_cuda_manual_seed and CudaRNGStatesTracker.add use them; without a driver
       get_rng_state raises and manual_seed is silently queued as a lazy call.
    3  megatron.core.tensor_parallel.random._{get,set}_cuda_rng_state -> the CPU generator
       The original setter goes through torch.cuda._lazy_call, which only queues the call while
       CUDA is uninitialised, so tracker.fork() would never switch RNG streams.
    4  logging filter on the megatron.core.tensor_parallel.random logger
       fork() warns "CPU RNG state changed within GPU RNG context" whenever numbers are drawn
       inside it; with (2)/(3) the "GPU" state *is* the CPU state, so the warning is spurious.
    5  torch.cuda.Stream / Event / current_stream / default_stream / stream / synchronize
       -> no-op stubs (_CpuStream, _CpuEvent)
       The alltoall dispatcher creates a DtoH side stream in __init__ and records/synchronises an
       event in _maybe_dtoh_and_synchronize; SharedExpertMLP with moe_shared_expert_overlap runs
       on its own stream; DDP bucket groups query current_stream(). CPU ops are synchronous, so
       no-ops are exact.
    6  torch.cuda.is_current_stream_capturing -> False
       Raises without a driver; queried by router_trace and the NCCL-EP dispatcher.
    7  torch.Tensor.record_stream -> no-op for non-CUDA tensors
       CPU tensors raise "unknown parameter type"; called by maybe_move_tensor_to_cpu.
    8  moe_utils.maybe_move_tensor_to_cpu (and the name token_dispatcher imported)
       -> also converts CPU tensors to numpy when as_numpy=True
       The original converts only is_cuda tensors, so the input/output splits stay torch.Tensor
       and gloo's all_to_all_single rejects them (TypeError: incompatible function arguments).
    9  module-global ``torch`` of the modules in _TORCH_PROXY_MODULES (optimizer, clip_grads,
       grad_scaler, param_and_grad_buffer, transformer.utils, core.utils, schedules)
       -> a proxy whose tensor factories map a literal device="cuda" to CPU
       FP32Optimizer.__init__, get_grad_norm_fp32, count_zeros_fp32, the grad scalers,
       get_default_causal_mask (attention without an explicit mask), the local multi-tensor l2
       norm and the schedules' token counter hard-code device="cuda". Scoping the rewrite to
       these modules leaves the rest of torch untouched.
    10 clip_grads.clip_grad_by_total_norm_fp32 (and the names bound elsewhere),
       Float16OptimizerWithFloat16Params.__init__, DistributedOptimizer.__init__
       -> run with Tensor.type() reporting "torch.cuda.<X>Tensor" for CPU tensors
       They assert/dispatch on the legacy type string ('torch.cuda.FloatTensor', ...), so
       clip_grad > 0, bf16/fp16 and distributed optimizers fail on CPU. The Tensor.type override
       is inert outside these calls (thread-local depth counter).
    11 megatron.core.jit.jit_fuser (torch.compile) and the functions it already wrapped
       (TopKRouter._apply_expert_bias with expert bias, L2Norm._norm for qk_l2_norm, ...)
       -> eager: disable_jit_fuser() for modules imported later, originals for the rest
       On CPU, Inductor compiles C++ on the first call: it needs a toolchain on the CI image and
       costs seconds per function and process on 2 cores. Eager is the reference anyway.

Verified with the shim on CPU/gloo (EP=2 and EP=4): MoELayer with the alltoall and allgather
dispatchers, softmax and sigmoid+expert-bias routers, shared experts with and without
moe_shared_expert_overlap, GPTModel (local spec, RoPE, RMSNorm) trained through
forward_backward_no_pipelining + DistributedDataParallel (with and without overlap_grad_reduce)
+ the Megatron optimizer (FP32, bf16 mixed precision, distributed optimizer, grad clipping), and
MoEMetricsTracker.report.

Not patched: ``Tensor.cuda()`` is left alone (only optimizer load_state_dict, the PP>1
tied-embedding sync and check_param_hashes use it); TE, grouped GEMM, fused permute/router and the
flex dispatcher need GPU packages anyway. ``use_cpu_initialization`` may be True or False under the
shim (with False, the "GPU" initialisation path allocates on "cpu" and draws from the tracker).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch

logger = logging.getLogger(__name__)

__all__ = ["cpu_shim_installed", "install_cpu_shim"]

_INSTALL_LOCK = threading.Lock()
_INSTALLED = False

# Kept so that a debugging session can see what was replaced; never restored automatically.
_ORIGINALS: dict[str, Any] = {}

_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


# --------------------------------------------------------------------------------------------
# Stream / event stubs (patch 5).
# --------------------------------------------------------------------------------------------
class _CpuEvent:
    """No-op stand-in for ``torch.cuda.Event``; CPU work is synchronous, so it is always done."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: _CpuStream | None = None) -> None:
        """Remember the wall time so ``elapsed_time`` gives a meaningful number."""
        self._recorded_at = time.perf_counter()

    def wait(self, stream: _CpuStream | None = None) -> None:
        """Nothing to wait for on CPU."""

    def synchronize(self) -> None:
        """Nothing to wait for on CPU."""

    def query(self) -> bool:
        """CPU work has always completed."""
        return True

    def elapsed_time(self, end_event: _CpuEvent) -> float:
        """Milliseconds between two recorded events (0.0 if either was not recorded)."""
        if self._recorded_at is None or end_event._recorded_at is None:
            return 0.0
        return (end_event._recorded_at - self._recorded_at) * 1000.0

    def ipc_handle(self) -> None:
        """Interprocess events do not exist on CPU."""
        raise RuntimeError("CPU shim: torch.cuda.Event.ipc_handle is not supported on CPU")


class _CpuStream:
    """No-op stand-in for ``torch.cuda.Stream``.

    Accepts (and ignores) the constructor arguments megatron passes (``device``, ``priority``).
    Equality is identity, so ``current_stream() != side_stream`` behaves as on a GPU.
    """

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority
        self.cuda_stream = 0

    def wait_stream(self, stream: _CpuStream) -> None:
        """Nothing to order on CPU."""

    def wait_event(self, event: _CpuEvent) -> None:
        """Nothing to order on CPU."""

    def record_event(self, event: _CpuEvent | None = None) -> _CpuEvent:
        """Return a (recorded) event, as the CUDA API does."""
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing to wait for on CPU."""

    def query(self) -> bool:
        """CPU work has always completed."""
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_DEFAULT_STREAM = _CpuStream()


def _current_stream(device: Any = None) -> _CpuStream:
    return _DEFAULT_STREAM


@contextlib.contextmanager
def _stream_context(stream: _CpuStream | None = None) -> Iterator[_CpuStream | None]:
    # torch.cuda.stream(s) is a context manager that makes s current; on CPU there is one stream.
    yield stream


def _synchronize(device: Any = None) -> None:
    return None


# --------------------------------------------------------------------------------------------
# RNG (patches 2-4).
# --------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # Seed the generator directly: torch.manual_seed calls torch.cuda.manual_seed_all, which is
    # this function once the shim is installed, so going through it would recurse.
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    # graph_safe states are only used under CUDA-graph capture; on CPU a plain state tensor is the
    # same information, so we return it in every case.
    return torch.get_rng_state()


def _megatron_set_cuda_rng_state(
    new_state: torch.Tensor | torch.Generator, device: Any = -1, graph_safe: bool = False
) -> None:
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


class _DropSpuriousRngWarning(logging.Filter):
    """Drops the tracker's CPU-RNG-changed warning, which is always true under this shim."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


# --------------------------------------------------------------------------------------------
# record_stream (patch 7) and maybe_move_tensor_to_cpu (patch 8).
# --------------------------------------------------------------------------------------------
def _make_record_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if self.is_cuda:
            return original(self, stream)
        return None

    record_stream.__doc__ = original.__doc__
    return record_stream


def _cpu_maybe_move_tensor_to_cpu(
    tensor: torch.Tensor, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """CPU-aware ``moe_utils.maybe_move_tensor_to_cpu`` (same signature as 0.19.2)."""
    if torch.is_tensor(tensor):
        if tensor.is_cuda:  # pragma: no cover - unreachable without a GPU
            tensor = tensor.to(torch.device("cpu"))
        if as_numpy:
            # gloo's all_to_all_single only accepts list/array split sizes, not a torch.Tensor.
            tensor = tensor.numpy()
    return tensor


# --------------------------------------------------------------------------------------------
# device="cuda" literals (patch 9).
# --------------------------------------------------------------------------------------------
_FACTORY_NAMES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _cpu_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    return factory


class _CpuTorchProxy(types.ModuleType):
    """A stand-in for the ``torch`` module inside selected megatron modules.

    Tensor factories rewrite ``device="cuda"`` to CPU; every other attribute is the real torch one.
    """

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORY_NAMES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# Modules whose device="cuda" literals sit on a path the CPU tests use (each line: the culprit).
_TORCH_PROXY_MODULES = (
    # FP32Optimizer._scale, Float16 optimizer found_inf, grad-norm-group flag.
    "megatron.core.optimizer.optimizer",
    # get_grad_norm_fp32 / count_zeros_fp32 accumulators.
    "megatron.core.optimizer.clip_grads",
    # ConstantGradScaler / DynamicGradScaler tensors (fp16 runs).
    "megatron.core.optimizer.grad_scaler",
    # NCCL user-buffer warm-up tensor.
    "megatron.core.distributed.param_and_grad_buffer",
    # get_default_causal_mask / get_sliding_window_causal_mask (attention without explicit mask).
    "megatron.core.transformer.utils",
    # total_num_tokens accumulator of forward_backward_no_pipelining / pipelining schedules.
    "megatron.core.pipeline_parallel.schedules",
    # local_multi_tensor_l2_norm (the non-apex grad-norm kernel used by clip_grads).
    "megatron.core.utils",
)


# --------------------------------------------------------------------------------------------
# Legacy CUDA type strings inside selected optimizer code (patch 10).
# --------------------------------------------------------------------------------------------
_CUDA_TYPE_NAMES = threading.local()


def _make_tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
    def tensor_type(
        self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any
    ) -> Any:
        if dtype is not None or kwargs:
            # Conversion form (t.type(torch.float16)): untouched.
            return original(self, dtype, non_blocking, **kwargs)
        name = original(self)
        inside_wrapped_call = getattr(_CUDA_TYPE_NAMES, "depth", 0) > 0
        if inside_wrapped_call and name.startswith("torch.") and not name.startswith("torch.cuda."):
            # Only inside the wrapped optimizer functions: report CPU tensors as CUDA ones.
            return "torch.cuda." + name[len("torch.") :]
        return name

    tensor_type.__doc__ = original.__doc__
    return tensor_type


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _CUDA_TYPE_NAMES.depth = getattr(_CUDA_TYPE_NAMES, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _CUDA_TYPE_NAMES.depth -= 1

    return wrapper


def _replace_everywhere(original: Any, replacement: Any) -> None:
    """Rebind every already-imported ``megatron*`` module global that is ``original``.

    Needed because megatron modules use ``from x import fn``; modules imported later look the
    (patched) attribute up on the defining module.
    """
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("megatron"):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


# --------------------------------------------------------------------------------------------
# torch.compile'd megatron functions (patch 11).
# --------------------------------------------------------------------------------------------
# Modules whose jit_fuser-decorated functions are on the paths the CPU tests use; imported before
# the sweep so that their compiled wrappers exist and get unwrapped.
_JIT_FUSER_MODULES = (
    "megatron.core.activations",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.utils",
)


def _compiled_original(value: Any) -> Any:
    """The eager function behind a torch.compile wrapper, or None if ``value`` is not one."""
    original = getattr(value, "_torchdynamo_orig_callable", None)
    return original if callable(original) else None


def _unwrap_compiled_megatron() -> int:
    """Replace torch.compile wrappers in loaded megatron modules (and their classes) by eager."""
    count = 0
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("megatron"):
            continue
        for attr, value in list(vars(module).items()):
            original = _compiled_original(value)
            if original is not None:
                setattr(module, attr, original)
                count += 1
            elif isinstance(value, type) and value.__module__ == mod_name:
                for cls_attr, cls_value in list(vars(value).items()):
                    original = _compiled_original(cls_value)
                    if original is not None:
                        setattr(value, cls_attr, original)
                        count += 1
    return count


# --------------------------------------------------------------------------------------------
# Install.
# --------------------------------------------------------------------------------------------
def _original(owner: Any, name: str, key: str) -> Any:
    """The pre-shim value of ``owner.name`` (stable even if an earlier install attempt failed
    halfway, so wrappers never wrap wrappers)."""
    return _ORIGINALS.setdefault(key, getattr(owner, name, None))


def _set(owner: Any, name: str, value: Any, key: str) -> None:
    _original(owner, name, key)
    setattr(owner, name, value)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # 1: allocation device.
    _set(cuda, "current_device", lambda: "cpu", "torch.cuda.current_device")
    # 2: RNG state of "the GPU" is the CPU generator.
    for owner, prefix in ((cuda, "torch.cuda"), (cuda.random, "torch.cuda.random")):
        _set(owner, "get_rng_state", _cpu_get_rng_state, f"{prefix}.get_rng_state")
        _set(owner, "set_rng_state", _cpu_set_rng_state, f"{prefix}.set_rng_state")
        _set(owner, "manual_seed", _cpu_manual_seed, f"{prefix}.manual_seed")
        _set(owner, "manual_seed_all", _cpu_manual_seed, f"{prefix}.manual_seed_all")
    # 5: streams and events.
    _set(cuda, "Stream", _CpuStream, "torch.cuda.Stream")
    _set(cuda, "Event", _CpuEvent, "torch.cuda.Event")
    _set(cuda, "current_stream", _current_stream, "torch.cuda.current_stream")
    _set(cuda, "default_stream", _current_stream, "torch.cuda.default_stream")
    _set(cuda, "stream", _stream_context, "torch.cuda.stream")
    _set(cuda, "synchronize", _synchronize, "torch.cuda.synchronize")
    # 6: no CUDA graph can be capturing.
    _set(
        cuda, "is_current_stream_capturing", lambda: False, "torch.cuda.is_current_stream_capturing"
    )
    # 7: record_stream on CPU tensors.
    original_record_stream = _original(torch.Tensor, "record_stream", "torch.Tensor.record_stream")
    _set(
        torch.Tensor,
        "record_stream",
        _make_record_stream(original_record_stream),
        "torch.Tensor.record_stream",
    )


def _patch_megatron() -> None:
    # Imported here, not at module level, so that importing this module has no side effects and
    # stays cheap.
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401  (binds the name below)
    from megatron.core.transformer.moe import moe_utils

    # 3: tracker add/fork and _fork_rng look these names up in the module at call time.
    _set(mrandom, "_get_cuda_rng_state", _megatron_get_cuda_rng_state, "mrandom._get")
    _set(mrandom, "_set_cuda_rng_state", _megatron_set_cuda_rng_state, "mrandom._set")
    # 4: the tracker warning is spurious when the "CUDA" generator is the CPU generator.
    logging.getLogger(mrandom.__name__).addFilter(_DropSpuriousRngWarning())

    # 8: patch the definition and every already-imported megatron module that bound it by name
    # (token_dispatcher does `from moe_utils import maybe_move_tensor_to_cpu`). Modules imported
    # later pick up the patched attribute from moe_utils.
    original = _original(
        moe_utils, "maybe_move_tensor_to_cpu", "moe_utils.maybe_move_tensor_to_cpu"
    )
    _replace_everywhere(original, _cpu_maybe_move_tensor_to_cpu)

    # 9: device="cuda" literals, only where the optimizer / DDP need them.
    proxy = _CpuTorchProxy()
    for mod_name in _TORCH_PROXY_MODULES:
        module = importlib.import_module(mod_name)
        _set(module, "torch", proxy, f"{mod_name}.torch")

    # 10: legacy CUDA type-string checks in the optimizer.
    import megatron.core.optimizer.optimizer as moptimizer
    from megatron.core.optimizer import clip_grads, distrib_optimizer

    original_type = _original(torch.Tensor, "type", "torch.Tensor.type")
    _set(torch.Tensor, "type", _make_tensor_type(original_type), "torch.Tensor.type")
    original_clip = _original(
        clip_grads, "clip_grad_by_total_norm_fp32", "clip_grads.clip_grad_by_total_norm_fp32"
    )
    _replace_everywhere(original_clip, _with_cuda_type_names(original_clip))
    for cls in (
        moptimizer.Float16OptimizerWithFloat16Params,
        distrib_optimizer.DistributedOptimizer,
    ):
        key = f"{cls.__qualname__}.__init__"
        # The class's own __init__ (vars, not getattr), so a subclass never re-wraps its parent's.
        init = _ORIGINALS.setdefault(key, vars(cls)["__init__"])
        _set(cls, "__init__", _with_cuda_type_names(init), key)

    # 11: eager instead of torch.compile (jit_fuser).
    import megatron.core.jit as mjit

    mjit.disable_jit_fuser()
    for mod_name in _JIT_FUSER_MODULES:
        importlib.import_module(mod_name)
    unwrapped = _unwrap_compiled_megatron()
    logger.debug("CPU shim: %d torch.compile'd megatron functions run eagerly", unwrapped)


def install_cpu_shim() -> None:
    """Install the CPU shim (see the module docstring for the full patch table).

    Idempotent: a second call is a no-op. Must be called explicitly; importing this module does
    nothing.

    Raises:
        RuntimeError: if CUDA is available. The shim replaces CUDA streams, RNG and devices with
            CPU stand-ins, which would silently break real GPU runs.
    """
    global _INSTALLED
    with _INSTALL_LOCK:
        # Checked before the idempotency test so that a process which *does* see a GPU always
        # gets the error, whatever happened earlier.
        if torch.cuda.is_available():
            raise RuntimeError(
                "megatron_lrmoe.testing.install_cpu_shim() refuses to run because "
                "torch.cuda.is_available() is True: the shim replaces CUDA devices, streams and "
                "RNG with CPU stand-ins and is only meant for CPU-only test processes. Run the "
                "test on the GPU without the shim instead."
            )
        if _INSTALLED:
            return
        _patch_torch_cuda()
        _patch_megatron()
        _INSTALLED = True
        logger.debug("megatron_lrmoe CPU shim installed (%d patches)", len(_ORIGINALS))


def cpu_shim_installed() -> bool:
    """Whether :func:`install_cpu_shim` has run in this process."""
    return _INSTALLED
