"""Version checks and the few explicit fixes the entry point needs for the megatron-core wheel.

Nothing here runs on import. ``pretrain_lrmoe.main`` calls, in order:

* :func:`check_megatron_core_version`: the plugin reaches into megatron-core 0.19 internals
  (``MoELayer``'s constructor, ``GPTModelBuilder``, the alltoall dispatcher's state), so any other
  minor version is refused with a message instead of failing somewhere inside a layer.
* :func:`use_prebuilt_dataset_helpers`: ``megatron.training.initialize`` calls
  ``megatron.core.datasets.utils.compile_helpers()`` on rank 0, which runs ``make`` in the
  installed package directory. The wheel ships no Makefile, only the compiled
  ``helpers_cpp`` extension, so ``make`` fails and Megatron calls ``sys.exit(1)``. This replaces
  ``compile_helpers`` with a check that the compiled helper imports.
* :func:`repair_help_strings`: one help string in megatron-core 0.19.2
  (``--moe-paged-stash-buffer-size-factor-cuda``) contains a bare ``%``, so ``--help`` raises
  ``ValueError: unsupported format character``; this escapes such strings.
* :func:`fix_full_validation`: ``--full-validation`` with one validation set fails at the first
  evaluation in megatron-core 0.19.2 (it indexes an int); this hands it the list it expects,
  makes it read the set in micro-batches of ``--eval-micro-batch-size`` (the wheel's sampler
  yields one sequence per forward pass), and does not run the end-of-training evaluation again
  when the last in-loop one already read the same fixed set at the same iteration.
* :func:`check_transformer_impl`: ``--transformer-impl transformer_engine`` (Megatron's default)
  without Transformer Engine fails deep in spec construction with ``'NoneType' object is not
  callable``; this names the fix instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
from typing import Any, Callable, Iterator, Optional

logger = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "check_megatron_core_version",
    "check_transformer_impl",
    "MicroBatchFullValidationSampler",
    "fix_full_validation",
    "megatron_core_version",
    "repair_help_strings",
    "use_prebuilt_dataset_helpers",
]

SUPPORTED_MEGATRON_CORE = (0, 19)
"""(major, minor) of megatron-core this plugin is written against (wheel 0.19.2; the
Megatron-LM branch ``core_r0.19.0`` reports 0.19.1 and has the same MoE and training code)."""

_HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
_DATASET_UTILS_MODULE = "megatron.core.datasets.utils"
# Set on our replacement so a second call recognises it (idempotence).
_PATCH_MARKER = "__lrmoe_prebuilt_helpers__"


def megatron_core_version() -> str:
    """The installed megatron-core version string, e.g. ``"0.19.2"``."""
    from megatron.core import package_info

    return str(package_info.__version__)


def check_megatron_core_version() -> None:
    """Raise ``RuntimeError`` unless megatron-core is 0.19.x.

    Raises:
        RuntimeError: Naming the installed version and the supported one.
    """
    version = megatron_core_version()
    match = re.match(r"(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else None
    if found != SUPPORTED_MEGATRON_CORE:
        want = ".".join(map(str, SUPPORTED_MEGATRON_CORE))
        raise RuntimeError(
            f"megatron-lrmoe needs megatron-core {want}.x (it subclasses 0.19's MoELayer, "
            f"alltoall dispatcher and GPTModelBuilder); found megatron-core {version}. Install "
            "megatron-core==0.19.2 or a Megatron-LM core_r0.19.0 checkout."
        )


def _prebuilt_helpers_error() -> Exception | None:
    """The error raised by importing the compiled dataset helper, or None when it imports."""
    try:
        importlib.import_module(_HELPERS_MODULE)
    except ImportError as e:
        return e
    return None


def use_prebuilt_dataset_helpers() -> bool:
    """Make Megatron's ``compile_helpers()`` use the helper the wheel already ships.

    Explicit (call it before ``pretrain``), version-checked, idempotent. Three cases:

    * the compiled ``helpers_cpp`` imports: ``megatron.core.datasets.utils.compile_helpers`` is
      replaced by a function that re-checks the import and does not run ``make``;
    * it does not import but the package has its ``Makefile`` (a Megatron-LM source checkout):
      nothing is patched, Megatron compiles the helper as usual;
    * neither: ``RuntimeError`` now, rather than ``sys.exit(1)`` from rank 0 later.

    Returns:
        True if ``compile_helpers`` is (now or already) replaced, False if Megatron's own
        compilation is left in place.

    Raises:
        RuntimeError: The megatron-core version is not supported, or the helper is missing and
            cannot be compiled.
    """
    check_megatron_core_version()
    utils = importlib.import_module(_DATASET_UTILS_MODULE)
    if getattr(utils.compile_helpers, _PATCH_MARKER, False):
        return True
    error = _prebuilt_helpers_error()
    if error is not None:
        makefile = os.path.join(os.path.dirname(os.path.abspath(utils.__file__)), "Makefile")
        if os.path.exists(makefile):
            logger.info("%s does not import (%s); Megatron will build it", _HELPERS_MODULE, error)
            return False
        raise RuntimeError(
            f"megatron-core's compiled dataset helper {_HELPERS_MODULE} is missing ({error}) "
            f"and {os.path.dirname(makefile)} has no Makefile to build it; reinstall the "
            "megatron-core wheel (it ships the helper) or use a Megatron-LM checkout"
        ) from error
    utils.compile_helpers = _make_prebuilt_check(utils.compile_helpers)
    logger.info("megatron.core.datasets.utils.compile_helpers now uses the prebuilt helper")
    return True


_FULL_VALIDATION_MARKER = "__lrmoe_full_validation_fix__"
_TRAINING_MODULE = "megatron.training.training"
_SAMPLERS_MODULE = "megatron.training.datasets.data_samplers"


class MicroBatchFullValidationSampler:
    """``--full-validation``'s batch sampler with micro-batches of ``--eval-micro-batch-size``.

    Data-parallel rank r reads the sequences r, r + dp, r + 2 dp, ... (as the wheel's sampler
    does), ``micro_batch_size`` of them per batch, the last batch possibly shorter; every
    sequence is read once per evaluation. Ranks' batch counts differ by at most one; Megatron
    runs the largest count on every rank (its cyclic iterator starts over on the others), as
    with the wheel's sampler.

    Args:
        total_samples: Sequences in the validation set.
        data_parallel_rank, data_parallel_size: This rank and the data-parallel width.
        micro_batch_size: Sequences per batch (None: ``--eval-micro-batch-size`` from Megatron's
            arguments).
    """

    def __init__(
        self,
        total_samples: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        micro_batch_size: Optional[int] = None,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"full validation: no sequence to read (total_samples={total_samples})")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"full validation: data_parallel_rank {data_parallel_rank} not in "
                f"[0, {data_parallel_size})"
            )
        if micro_batch_size is None:
            from megatron.training import get_args

            args = get_args()
            micro_batch_size = getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
        if micro_batch_size < 1:
            raise ValueError(f"full validation: micro_batch_size {micro_batch_size} < 1")
        self.total_samples = total_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_size = int(micro_batch_size)
        self._mine = range(data_parallel_rank, total_samples, data_parallel_size)

    def __len__(self) -> int:
        return -(-len(self._mine) // self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, len(self._mine), self.micro_batch_size):
            yield list(self._mine[start : start + self.micro_batch_size])


def fix_full_validation(args: Any) -> bool:
    """Let ``--full-validation`` evaluate more than once with a single validation set.

    megatron-core 0.19.2's ``evaluate_and_print_results`` broadcasts ``args.eval_iters`` as a
    tensor and indexes the list it expects back (``eval_iters[0]``); with one validation set
    ``args.eval_iters`` is an int, ``tolist()`` returns an int and the first evaluation raises
    ``TypeError: 'int' object is not subscriptable``. The wrapper installed here hands the
    function a one-element list, which it turns back into the int itself, so every evaluation
    reads the whole (fixed) validation set as the flag intends.

    The wheel's ``MegatronFullValidationSampler`` yields one sequence per batch whatever
    ``--eval-micro-batch-size`` says, so every evaluation is one forward pass per sequence (on one
    H200, 24 layers of the Qwen3 MoE shape: 1200 sequences took over two minutes, against about
    half a second per 32-sequence forward pass). :class:`MicroBatchFullValidationSampler` takes
    its place in ``megatron.training.datasets.data_samplers``: the same sequences on the same
    data-parallel ranks, ``--eval-micro-batch-size`` of them per batch.

    After training Megatron evaluates the validation set once more ("iteration N on validation
    set"). With ``--full-validation`` and ``--train-iters`` a multiple of ``--eval-interval`` the
    in-loop evaluation has just read the same set with the same weights at the same iteration
    (evaluation mode, no dropout: the same loss), so the wrapper prints a line saying so instead of
    spending a second pass over the whole set (about a minute per run in
    ``benchmarks/memory_bound.py``'s protocol).

    Explicit (``pretrain_lrmoe.main`` calls it), version-checked, idempotent; does nothing (and
    returns False) unless ``--full-validation`` is given without ``--multiple-validation-sets``.
    """
    if not getattr(args, "full_validation", False) or getattr(args, "multiple_validation_sets", False):
        return False
    check_megatron_core_version()
    module = importlib.import_module(_TRAINING_MODULE)
    original = module.evaluate_and_print_results
    if getattr(original, _FULL_VALIDATION_MARKER, False):
        return True
    for caller in ("pretrain", "train"):
        fn = getattr(module, caller)
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        if "evaluate_and_print_results" not in fn.__code__.co_names:
            raise RuntimeError(
                f"{_TRAINING_MODULE}.{caller} no longer calls evaluate_and_print_results by its "
                f"global name (megatron-core {megatron_core_version()}); update "
                "megatron_lrmoe/training/compat.py::fix_full_validation"
            )

    last_validated: list[int] = []  # the iteration of the last in-loop evaluation

    def evaluate_and_print_results(*a: Any, **kw: Any) -> Any:
        from megatron.training import get_args
        from megatron.training.utils import print_rank_last

        prefix = str(a[0] if a else kw.get("prefix", ""))
        iteration = a[4] if len(a) > 4 else kw.get("iteration")
        if prefix.endswith("on validation set") and last_validated == [iteration]:
            print_rank_last(
                f" validation at {prefix}: not repeated (--full-validation: the evaluation at "
                f"iteration {iteration} read the same set with the same weights)"
            )
            return None
        if not prefix.endswith(("on validation set", "on test set")):
            last_validated[:] = [iteration]
        current = get_args()
        if isinstance(current.eval_iters, int):
            current.eval_iters = [current.eval_iters]
        return original(*a, **kw)

    setattr(evaluate_and_print_results, _FULL_VALIDATION_MARKER, True)
    evaluate_and_print_results.__wrapped__ = original  # type: ignore[attr-defined]
    module.evaluate_and_print_results = evaluate_and_print_results
    samplers = importlib.import_module(_SAMPLERS_MODULE)
    build = samplers.build_pretraining_data_loader
    if "MegatronFullValidationSampler" not in build.__code__.co_names:
        raise RuntimeError(
            f"{_SAMPLERS_MODULE}.build_pretraining_data_loader no longer builds "
            f"MegatronFullValidationSampler by its global name (megatron-core "
            f"{megatron_core_version()}); update megatron_lrmoe/training/compat.py::fix_full_validation"
        )
    samplers.MegatronFullValidationSampler = MicroBatchFullValidationSampler
    logger.info("%s.evaluate_and_print_results takes --full-validation's count as a list",
                _TRAINING_MODULE)
    return True


def _make_prebuilt_check(original: Callable[[], Any]) -> Callable[[], None]:
    def compile_helpers() -> None:
        """Check that the compiled dataset helper imports instead of running ``make``."""
        error = _prebuilt_helpers_error()
        if error is not None:
            raise RuntimeError(
                f"{_HELPERS_MODULE} no longer imports ({error}); cannot build it from the wheel"
            ) from error

    setattr(compile_helpers, _PATCH_MARKER, True)
    compile_helpers.__wrapped__ = original  # type: ignore[attr-defined]
    return compile_helpers


# A conversion specifier argparse understands (%(name)s), an escaped percent (%%), or a bare %.
_PERCENT = re.compile(r"%(%|\([^)]*\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z])?")


def repair_help_strings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Escape bare ``%`` in help strings that argparse cannot format (so ``--help`` works).

    Only strings that fail to format are changed, and only their bare ``%`` signs.

    Args:
        parser: The parser, after Megatron added its arguments.

    Returns:
        The same parser.
    """
    formatter = parser._get_formatter()  # noqa: SLF001 - argparse's own expansion is the test
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public iterator
        if not action.help or "%" not in action.help:
            continue
        try:
            formatter._expand_help(action)  # noqa: SLF001
        except (ValueError, TypeError, KeyError):
            action.help = _PERCENT.sub(lambda m: m.group(0) if m.group(1) else "%%", action.help)
    return parser


def check_transformer_impl(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` if ``--transformer-impl`` needs Transformer Engine and it is absent.

    Args:
        args: Parsed Megatron arguments.
    """
    if getattr(args, "transformer_impl", None) != "transformer_engine":
        return
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        raise ValueError(
            "--transformer-impl transformer_engine (Megatron's default) needs Transformer "
            "Engine, which is not installed; pass --transformer-impl local or install "
            "transformer-engine[pytorch]"
        )
