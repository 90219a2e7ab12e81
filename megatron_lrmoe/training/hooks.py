"""LRMoE statistics in ``megatron.training``'s iteration log, TensorBoard and W&B (``--lrmoe``).

``megatron.training`` 0.19's ``training_log`` has no hook for extra log text: it builds the
iteration line in a local variable and prints it (``print_rank_last``) in the same call, and the
MoE metrics tracker it reports is cleared every iteration (see :mod:`megatron_lrmoe.observe.metrics`).
Appending to that line would mean copying ``training_log`` or intercepting ``print_rank_last``
while it runs. Instead :func:`install_lrmoe_training_log`, called explicitly by the entry point
``pretrain_lrmoe.main`` and only with ``--lrmoe``, wraps two functions of
``megatron.training.training``, both of which Megatron calls through their module-global names:

* ``train(forward_step_func, model, ...)`` (called by ``pretrain``): the wrapper creates an
  :class:`~megatron_lrmoe.observe.metrics.LRMoEMetrics` over ``model`` (the model chunks being trained,
  DDP-wrapped) before calling the original, so its forward hooks see every training call, and
  removes the hooks when ``train`` returns or raises; with ``--lrmoe-trace-dir`` it also records
  the routing (``megatron_lrmoe.training.trace``), keyed by the step ``training_log`` reports.
* ``training_log(...)`` (called by ``train`` after every iteration): the wrapper calls the
  original unchanged, then, on the iterations on which Megatron prints its line
  (``iteration % --log-interval == 0`` or the first iteration of the run), reports: one
  all-reduce over all ranks (the only device sync; every rank calls ``training_log`` at the same
  iterations), ``lrmoe/...`` scalars to ``get_tensorboard_writer()`` and ``get_wandb_writer()``
  (None on ranks without them), and ``LRMoEMetrics.last_log_string`` printed on the last rank
  (``print_rank_last``, like Megatron's line) in the iteration-line format, right after it::

     [2025-06-01 12:00:00.000000] iteration      100/   10000 | consumed samples: ... |
     [2025-06-01 12:00:00.012345] iteration      100/   10000 | lrmoe kept: 0.500 | lrmoe
    dropped score: 0.213 | lrmoe bwd saved: 1.25 GiB | lrmoe overhead: 3.2 ms | lrmoe added
    variance: 0.180 |

  (the second line is one line in the log; ``grep 'lrmoe kept'`` selects it).

Both wrappers are version-checked (megatron-core 0.19 and the exact parameter names of 0.19.2's
functions, and that ``pretrain`` / ``train`` still call them by global name), installed together
or not at all, and idempotent. Nothing happens on import, and nothing is installed without
``--lrmoe`` or ``--moe-layer-timing``. ``--moe-layer-timing`` (stock runs too) adds a line with
the time spent in the MoE layers (forward and backward, CUDA events, every overhead included)
per iteration and since the start, summed over the pipeline stages, with this process's peak
allocated GPU memory and the caching allocator's retries (``max allocated``, ``alloc retries``,
on CUDA), and ``moe/layer_*`` scalars.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
from datetime import datetime
from types import ModuleType
from typing import Any, Callable, Optional

from megatron_lrmoe.layer import set_lrmoe_training_step
from megatron_lrmoe.observe.metrics import LRMoEMetrics
from megatron_lrmoe.observe.timing import MoELayerTimer
from megatron_lrmoe.training.trace import TraceRecorder, install_trace_recorder

logger = logging.getLogger(__name__)

__all__ = [
    "TRAIN_PARAMETERS",
    "TRAINING_LOG_PARAMETERS",
    "LRMoETrainingLog",
    "check_training_functions",
    "install_lrmoe_training_log",
    "lrmoe_log_line",
]

_TRAINING_MODULE = "megatron.training.training"
# Set on both wrappers; its value is the LRMoETrainingLog that installed them.
_MARKER = "__lrmoe_training_log__"

TRAIN_PARAMETERS = (
    "forward_step_func",
    "model",
    "optimizer",
    "opt_param_scheduler",
    "train_data_iterator",
    "valid_data_iterator",
    "process_non_loss_data_func",
    "config",
    "checkpointing_context",
    "non_loss_data_func",
    "inference_model",
    "p2p_communicator",
    "pg_collection",
)
"""Parameter names of ``megatron.training.training.train`` in megatron-core 0.19.2."""

TRAINING_LOG_PARAMETERS = (
    "loss_dict",
    "total_loss_dict",
    "learning_rate",
    "iteration",
    "loss_scale",
    "report_memory_flag",
    "skipped_iter",
    "grad_norm",
    "params_norm",
    "num_zeros_in_grad",
    "max_attention_logit",
    "pg_collection",
    "is_first_iteration",
    "seqlen_squared_sum_in_batch",
    "total_real_tokens_in_batch",
)
"""Parameter names of ``megatron.training.training.training_log`` in megatron-core 0.19.2."""


def _parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def check_training_functions(module: ModuleType) -> None:
    """Raise ``RuntimeError`` unless ``module`` has 0.19.2's ``train`` and ``training_log``.

    Checked: the megatron-core version (0.19.x), the parameter names of both functions (in
    order), and that ``pretrain`` calls ``train`` and ``train`` calls ``training_log`` through
    the module's globals (else replacing the module attributes would silently do nothing).

    Args:
        module: ``megatron.training.training``.
    """
    from megatron_lrmoe.training import compat

    compat.check_megatron_core_version()
    version = compat.megatron_core_version()
    for name, want in (("train", TRAIN_PARAMETERS), ("training_log", TRAINING_LOG_PARAMETERS)):
        fn = getattr(module, name, None)
        if not callable(fn):
            raise RuntimeError(
                f"{module.__name__}.{name} is missing (megatron-core {version}); the LRMoE "
                "training log needs megatron-core 0.19.2's"
            )
        found = _parameter_names(fn)
        if found != want:
            raise RuntimeError(
                f"{module.__name__}.{name} has parameters {found}; the LRMoE training log wraps "
                f"megatron-core 0.19.2's {name}{want} (installed: megatron-core {version}). "
                "Update megatron_lrmoe/training/hooks.py for this version."
            )
    for caller, callee in (("pretrain", "train"), ("train", "training_log")):
        fn = inspect.unwrap(getattr(module, caller))
        if callee not in getattr(getattr(fn, "__code__", None), "co_names", ()):
            raise RuntimeError(
                f"{module.__name__}.{caller} no longer calls {callee} by its global name "
                f"(megatron-core {version}); wrapping {callee} would not take effect"
            )


def lrmoe_log_line(
    iteration: int, train_iters: Optional[int], fragment: str, now: Optional[datetime] = None
) -> str:
    """The printed line: Megatron's iteration-line head followed by the LRMoE fragment.

    Args:
        iteration: Current iteration.
        train_iters: ``--train-iters`` (None prints ``?``).
        fragment: ``LRMoEMetrics.last_log_string`` (`` name: value |`` items).
        now: Timestamp; default the current time.
    """
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
    total = f"{train_iters:8d}" if train_iters is not None else "       ?"
    return f" [{stamp}] iteration {iteration:8d}/{total} |{fragment}"


def _megatron_args() -> argparse.Namespace:
    from megatron.training import global_vars

    return global_vars.get_args()


def _megatron_writers() -> tuple[Any, Any]:
    from megatron.training import global_vars

    return global_vars.get_tensorboard_writer(), global_vars.get_wandb_writer()


def _print_rank_last(message: str) -> None:
    from megatron.training.utils import print_rank_last

    print_rank_last(message)


def _sum_over_pipeline(value: float) -> float:
    """``value`` summed over this rank's pipeline-parallel group (``value`` itself without one).

    NOTE: a collective over the group (and a device-to-host copy on CUDA) when it has more
    than one rank.
    """
    import torch
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return value
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    device = torch.device("cpu")
    if torch.cuda.is_available():  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return float(total.item())


def _max_allocated_fragment() -> str:
    """`` max allocated: N MiB | alloc retries: R |``: this process's peak allocated GPU memory
    since the start and how often the caching allocator had to free its cache and retry a
    failed allocation (each retry synchronises the device: many of them mean the run is close
    to its memory limit, a cap's or the card's); PyTorch's allocator statistics, read on the
    host. Nothing without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    return (
        f" max allocated: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB |"
        f" alloc retries: {retries} |"
    )


class LRMoETrainingLog:
    """The two wrappers and their shared state (the ``LRMoEMetrics`` of the running ``train``).

    Megatron's arguments are read with ``megatron.training.get_args()`` when the wrappers run
    (``--log-interval``, ``--train-iters``, ``--num-layers``, ``--mtp-num-layers``,
    ``--moe-per-layer-logging`` and the iteration ``train`` starts from).

    Args:
        groups: Process groups of the reduction (see ``LRMoEMetrics``); default all ranks.

    Attributes:
        metrics: The ``LRMoEMetrics`` of the ``train`` call in progress, else None.
        last_line: The last line printed (or that would be printed on the last rank).
    """

    def __init__(
        self, groups: Optional[list[Any]] = None, lrmoe: bool = True, moe_timing: bool = False
    ) -> None:
        self.groups = groups
        self.lrmoe = lrmoe
        self.moe_timing = moe_timing
        self.metrics: Optional[LRMoEMetrics] = None
        self.timer: Optional[MoELayerTimer] = None
        self.recorder: Optional[TraceRecorder] = None
        self.model: Any = None
        self.last_line = ""
        self._module: Optional[ModuleType] = None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._timed_iteration = 0
        self._timed_seconds = 0.0

    # --- wrappers -------------------------------------------------------------------------------
    def wrap_train(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``train`` that collects LRMoE statistics of ``model`` while it runs."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def train(*args: Any, **kwargs: Any) -> Any:
            model = signature.bind(*args, **kwargs).arguments["model"]
            self.model = model
            # The sampling stream follows the training step, so a resumed run draws what an
            # uninterrupted one would (see LRMoELayer.set_training_step).
            set_lrmoe_training_step(model, int(getattr(_megatron_args(), "iteration", 0) or 0))
            trace_dir = getattr(_megatron_args(), "lrmoe_trace_dir", None)
            previous = self.metrics, self.timer, self.recorder
            self.recorder = install_trace_recorder(model, trace_dir) if trace_dir else None
            metrics = self.metrics = self.make_metrics(model) if self.lrmoe else None
            timer = self.timer = MoELayerTimer(model) if self.moe_timing else None
            self._timed_iteration = int(getattr(_megatron_args(), "iteration", 0) or 0)
            self._timed_seconds = 0.0
            try:
                return original(*args, **kwargs)
            finally:
                if metrics is not None:
                    metrics.close()
                if timer is not None:
                    timer.remove()
                if self.recorder is not None:
                    self.recorder.close()
                self.metrics, self.timer, self.recorder = previous

        setattr(train, _MARKER, self)
        return train

    def wrap_training_log(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``training_log`` that reports LRMoE statistics after Megatron's line."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        def training_log(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if self.metrics is not None or self.timer is not None:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                iteration = int(bound.arguments["iteration"])
                if self.model is not None:
                    set_lrmoe_training_step(self.model, iteration)
                if self.recorder is not None:
                    self.recorder.set_step(iteration)
                first = bool(bound.arguments["is_first_iteration"])
                if first or iteration % _megatron_args().log_interval == 0:
                    self.report(iteration)
            return result

        setattr(training_log, _MARKER, self)
        return training_log

    # --- the work -------------------------------------------------------------------------------
    def make_metrics(self, model: Any) -> LRMoEMetrics:
        """Forward hooks on ``model``'s LRMoE layers, starting at the current iteration.

        ``num_layers`` is passed (decoder plus MTP layers) so that a pipeline stage without
        LRMoE layers still joins every reduction.
        """
        args = _megatron_args()
        return LRMoEMetrics(
            model,
            groups=self.groups,
            num_layers=args.num_layers + (getattr(args, "mtp_num_layers", None) or 0),
            per_layer=bool(getattr(args, "moe_per_layer_logging", False)),
            start_iteration=int(getattr(args, "iteration", 0) or 0),
        )

    def report(self, iteration: int) -> dict[str, float]:
        """Reduce, write ``lrmoe/...`` scalars, print the line on the last rank (all ranks call).

        Returns:
            The reported scalars (empty when no LRMoE backward ran anywhere; nothing is
            printed then).
        """
        writer, wandb_writer = _megatron_writers()
        train_iters = getattr(_megatron_args(), "train_iters", None)
        scalars: dict[str, float] = {}
        if self.metrics is not None:
            scalars = self.metrics.report(iteration, writer=writer, wandb_writer=wandb_writer)
            fragment = self.metrics.last_log_string
            if fragment:
                self.last_line = lrmoe_log_line(iteration, train_iters, fragment)
                _print_rank_last(self.last_line)
        if self.timer is not None:
            self._report_timing(iteration, train_iters, writer, wandb_writer)
        return scalars

    def _report_timing(self, iteration: int, train_iters: Any, writer: Any, wandb: Any) -> None:
        """MoE-layer time since the last report and since the start, one line.

        Summed over the pipeline stages (every rank of this rank's pipeline group calls this at
        the same iterations), so the last stage's line covers all MoE layers of its model
        replica, not only its own.
        """
        iterations = max(1, iteration - self._timed_iteration)
        self._timed_iteration = iteration
        seconds = self.timer.take()  # NOTE: device-to-host sync (CUDA events), once per report
        seconds = _sum_over_pipeline(seconds)
        self._timed_seconds += seconds
        ms = 1e3 * seconds / iterations
        values = {
            "moe/layer_ms_per_iteration": ms,
            "moe/layer_seconds_cumulative": self._timed_seconds,
        }
        for name, value in values.items():
            if writer is not None:
                writer.add_scalar(name, value, iteration)
        if wandb is not None:
            wandb.log(values, iteration)
        fragment = (
            f" moe layers: {ms:.1f} ms/iter | moe layers cumulative: "
            f"{self._timed_seconds:.3f} s |{_max_allocated_fragment()}"
        )
        self.last_line = lrmoe_log_line(iteration, train_iters, fragment)
        _print_rank_last(self.last_line)

    # --- installation ---------------------------------------------------------------------------
    def install(self, module: ModuleType) -> None:
        """Replace ``module.train`` and ``module.training_log`` by the wrappers (checked first)."""
        check_training_functions(module)
        self._module = module
        self._originals = {"train": module.train, "training_log": module.training_log}
        module.train = self.wrap_train(module.train)
        module.training_log = self.wrap_training_log(module.training_log)
        logger.info("LRMoE statistics reported in %s.training_log", module.__name__)

    def uninstall(self) -> None:
        """Put the original functions back (where the wrappers are still in place)."""
        module, self._module = self._module, None
        if module is None:
            return
        for name, original in self._originals.items():
            if getattr(getattr(module, name), _MARKER, None) is self:
                setattr(module, name, original)
        self._originals = {}


def install_lrmoe_training_log(
    args: argparse.Namespace, module: Optional[ModuleType] = None
) -> Optional[LRMoETrainingLog]:
    """With ``--lrmoe``, report LRMoE statistics from ``megatron.training``'s training log.

    Explicit (the entry point calls it before ``pretrain``), version-checked and idempotent;
    without ``--lrmoe`` it does nothing.

    Args:
        args: Parsed arguments (``args.lrmoe``).
        module: The module to patch; default ``megatron.training.training``.

    Returns:
        The installed :class:`LRMoETrainingLog` (the same one on a second call), or None
        without ``--lrmoe``.

    Raises:
        RuntimeError: The installed megatron-core's ``train`` / ``training_log`` are not the
            0.19.2 ones this wraps, or only one of them is wrapped.
    """
    lrmoe = bool(getattr(args, "lrmoe", False))
    moe_timing = bool(getattr(args, "moe_layer_timing", False))
    if not (lrmoe or moe_timing):
        return None
    if module is None:
        import importlib

        module = importlib.import_module(_TRAINING_MODULE)
    hooks = getattr(module.train, _MARKER, None)
    if hooks is not None or getattr(module.training_log, _MARKER, None) is not None:
        if getattr(module.training_log, _MARKER, None) is not hooks:
            raise RuntimeError(
                f"{module.__name__}.train and .training_log are not wrapped together; "
                "something replaced one of the LRMoE training-log wrappers"
            )
        return hooks
    hooks = LRMoETrainingLog(lrmoe=lrmoe, moe_timing=moe_timing)
    hooks.install(module)
    return hooks
