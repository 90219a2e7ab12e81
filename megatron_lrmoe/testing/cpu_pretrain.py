"""Run ``pretrain_lrmoe.py`` -- Megatron's own ``pretrain()`` loop -- on CPU over gloo.

Test-only. ``megatron.training`` has no CPU path: ``initialize_megatron`` asserts CUDA, sets up
model parallelism and the model-parallel RNG only ``if torch.cuda.device_count() > 0``, moves the
model with ``Module.cuda``, the entry point moves batches with ``Tensor.cuda`` and the training
loop builds a few tensors with a literal ``device="cuda"``. This launcher installs the test CUDA
shim (:func:`megatron_lrmoe.testing.install_cpu_shim`), patches exactly those touch points, adds
the flags a CPU needs, and hands over to ``pretrain_lrmoe.main``. Everything else -- argument
parsing and validation, the model builder (stock or LRMoE), DDP, the distributed optimizer, the
schedule, activation recomputation, MTP, evaluation and the iteration / LRMoE log lines -- is
the code a GPU run executes.

Launch scripts use it through their ``ENTRY`` variable, so the very script a GPU run uses runs
tiny on CPU (sizes overridden by appended flags; a later flag wins)::

    ENTRY=megatron_lrmoe/testing/cpu_pretrain.py TRAIN_ITERS=3 GBS=2 \\
        bash examples/glm45_air/proxy_1xh200.sh --hidden-size 64 --num-experts 8 ...

or directly: ``torchrun --nproc_per_node N megatron_lrmoe/testing/cpu_pretrain.py <flags>``.
It refuses to run where CUDA is available (the shim does).

Patch table (on top of the shim's):

    1 megatron.training.initialize: ``torch`` -> a proxy whose ``cuda.device_count()`` is 1
      and ``cuda.set_device`` a no-op, so model parallelism and the tracker's RNG are set up
      (``initialize_model_parallel`` and ``model_parallel_cuda_manual_seed`` run on gloo).
    2 megatron.training.training.initialize_megatron -> called with ``allow_no_cuda=True``;
      megatron.training.training.set_jit_fusion_options -> a no-op (it only warms up CUDA
      fusion kernels on random CUDA tensors; the shim runs torch.compile'd functions eagerly).
    3 megatron.training.training / checkpointing / utils.common_utils,
      megatron.core.rerun_state_machine / tensor_parallel.data: ``torch`` -> the shim's proxy
      that maps ``device="cuda"`` factories to CPU (start-time all-reduce, loss dicts,
      eval-iteration counts, train/valid/test flags, rerun reductions, TP batch broadcast).
    4 ``torch.nn.Module.cuda`` and ``torch.Tensor.cuda`` -> identity (the model placement in
      ``get_model`` and the entry point's batch copies).
    5 megatron.training.training.train -> the same call, followed by one log line (stderr,
      logger ``megatron_lrmoe.testing.cpu_pretrain``) that says what was trained, for tests to
      check the feature set of a launch script::

          cpu_pretrain model: moe_layers=LRMoELayer:2 shared_experts=2 mtp_layers=1
          recompute=full expert_bias_routers=2 expert_bias_max_change=3.0e-03

Environment: ``LRMOE_CPU_FP32=1`` drops ``--bf16`` / ``--fp16`` (CPU bf16 GEMMs round
differently from one implementation to the next, and "keep 1.0 equals stock" is a statement
about the math, checked in fp32); ``LRMOE_CPU_THREADS`` (1) sets torch's intra-op threads.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import runpy
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch

if __name__ == "__main__":
    # Run by path (torchrun .../cpu_pretrain.py): import megatron_lrmoe and pretrain_lrmoe from
    # this checkout, not from the script's folder or another installed copy.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from megatron_lrmoe.testing.harness import _loopback_ifname  # noqa: E402
from megatron_lrmoe.training import compat  # noqa: E402

# A fixed name: the module also runs as __main__; pretrain_lrmoe routes megatron_lrmoe.* to stderr.
logger = logging.getLogger("megatron_lrmoe.testing.cpu_pretrain")

# Repository root (pretrain_lrmoe.py lives there; a source checkout is assumed).
ROOT = Path(__file__).resolve().parents[2]

_INSTALLED = False

# Flags a CPU run needs; appended after the caller's, so they win. No TE, no apex, no CUDA
# fusions; weights created on the host; gloo instead of NCCL.
CPU_FLAGS = (
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
)  # fmt: skip

# megatron.training modules whose ``device="cuda"`` literals a CPU run reaches (patch 3).
_CUDA_LITERAL_MODULES = (
    "megatron.training.training",
    "megatron.training.checkpointing",
    "megatron.training.utils.common_utils",
    # The rerun state machine's any-rank reductions, every iteration.
    "megatron.core.rerun_state_machine",
    # broadcast_data (batches across tensor-parallel ranks).
    "megatron.core.tensor_parallel.data",
)


class _OneDeviceCuda(types.ModuleType):
    """``torch.cuda`` as ``megatron.training.initialize`` sees it: one device, no switching."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _InitializeTorch(types.ModuleType):
    """``torch`` for ``megatron.training.initialize``: the real one with ``cuda`` replaced."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _OneDeviceCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _no_jit_fusion_options(tp_size: Any = None) -> None:
    return None


def _module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    return self


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def model_report(model: list[torch.nn.Module], bias_before: dict[str, torch.Tensor]) -> str:
    """One line on what a run trained (patch 5): MoE layer classes, shared experts, MTP layers,
    recomputation and how far the routers' expert biases moved (aux-loss-free balancing)."""
    moe: dict[str, int] = {}
    shared = mtp = 0
    recompute = None
    for chunk in model:
        for module in chunk.modules():
            name = type(module).__name__
            if name.endswith("MoELayer"):
                moe[name] = moe.get(name, 0) + 1
            shared += name == "SharedExpertMLP"
            mtp += name == "MultiTokenPredictionLayer"
            config = getattr(module, "config", None)
            recompute = recompute or getattr(config, "recompute_granularity", None)
    moved = [
        float((buffer.float() - bias_before[name].float()).abs().max())
        for name, buffer in _expert_biases(model).items()
    ]
    layers = ",".join(f"{k}:{v}" for k, v in sorted(moe.items())) or "none"
    return (
        f"cpu_pretrain model: moe_layers={layers} shared_experts={shared} mtp_layers={mtp} "
        f"recompute={recompute} expert_bias_routers={len(moved)} "
        f"expert_bias_max_change={max(moved, default=0.0):.1e}"
    )


def _expert_biases(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": buffer
        for i, chunk in enumerate(model)
        for name, buffer in chunk.named_buffers()
        if name.endswith("expert_bias")
    }


def _reporting_train(train: Callable[..., Any]) -> Callable[..., Any]:
    # functools.wraps keeps train's signature visible: the LRMoE training-log hooks check it.
    @functools.wraps(train)
    def wrapper(forward_step_func: Any, model: list[torch.nn.Module], *args: Any, **kwargs: Any):
        before = {name: b.detach().clone() for name, b in _expert_biases(model).items()}
        result = train(forward_step_func, model, *args, **kwargs)
        if torch.distributed.get_rank() == 0:
            logger.info(model_report(model, before))
        return result

    return wrapper


def install_cpu_training() -> None:
    """Install the shim and the ``megatron.training`` patches above (process-global, not undone).

    Idempotent: a second call is a no-op.

    Raises:
        RuntimeError: if CUDA is available (from the shim), or megatron-core is not 0.19.x (the
            patched names are 0.19.2's).
    """
    global _INSTALLED
    from megatron_lrmoe.testing.cpu_shim import _CpuTorchProxy, install_cpu_shim

    install_cpu_shim()
    if _INSTALLED:
        return
    compat.check_megatron_core_version()
    from megatron.training import initialize, training

    initialize.torch = _InitializeTorch()  # 1
    original_initialize = training.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:  # 2
        kwargs["allow_no_cuda"] = True
        return original_initialize(*args, **kwargs)

    training.initialize_megatron = initialize_megatron
    training.set_jit_fusion_options = _no_jit_fusion_options
    training.train = _reporting_train(training.train)  # 5
    proxy = _CpuTorchProxy()
    for name in _CUDA_LITERAL_MODULES:  # 3
        importlib.import_module(name).torch = proxy
    torch.nn.Module.cuda = _module_cuda  # 4
    torch.Tensor.cuda = _tensor_cuda
    _INSTALLED = True


def main(argv: list[str] | None = None) -> None:
    """Run ``pretrain_lrmoe.main`` on CPU with ``argv`` (default ``sys.argv[1:]``) + CPU flags."""
    argv = sys.argv[1:] if argv is None else argv
    # Two cores shared by every rank on a CI machine: intra-op threads would oversubscribe them.
    torch.set_num_threads(int(os.environ.get("LRMOE_CPU_THREADS", "1")))
    ifname = _loopback_ifname()
    if ifname is not None:
        # gloo would otherwise pick the interface of the hostname, which may not route locally.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    install_cpu_training()
    if os.environ.get("LRMOE_CPU_FP32") == "1":
        argv = [flag for flag in argv if flag not in ("--bf16", "--fp16")]
    sys.argv = [str(ROOT / "pretrain_lrmoe.py"), *argv, *CPU_FLAGS]
    runpy.run_path(str(ROOT / "pretrain_lrmoe.py"), run_name="__main__")


if __name__ == "__main__":
    main()
