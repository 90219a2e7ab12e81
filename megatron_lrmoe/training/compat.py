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
  evaluation in megatron-core 0.19.2 (it indexes an int), reads the set one sequence per forward
  pass, and reads it several times over when an evaluation step has several micro-batches; this
  makes every evaluation read each sequence once, in micro-batches of ``--eval-micro-batch-size``,
  and does not run the end-of-training evaluation again when the last in-loop one already read
  the same fixed set at the same iteration.
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
    "PaddedValidationSet",
    "evaluation_micro_batches_per_step",
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


def evaluation_micro_batches_per_step(args: Any) -> int:
    """Micro-batches per data-parallel rank in one evaluation step, as megatron-core 0.19.2's
    ``evaluate`` computes them (training.py:4195): ``--eval-global-batch-size`` over
    ``--eval-micro-batch-size`` x data-parallel size (x the GTP-remat width)."""
    per_step = (
        args.eval_micro_batch_size
        * args.data_parallel_size
        * (getattr(args, "gtp_weight_remat_size", None) or 1)
    )
    return max(1, args.eval_global_batch_size // per_step)


class MicroBatchFullValidationSampler:
    """``--full-validation``'s batch sampler: the whole set once, in full micro-batches.

    Data-parallel rank r reads the sequences r, r + dp, r + 2 dp, ... (as the wheel's sampler
    does), ``micro_batch_size`` of them per batch. Every rank yields the same number of batches,
    a multiple of ``micro_batches_per_step`` (the micro-batches of one evaluation step, so that
    ``steps`` steps read each batch exactly once), and every batch holds exactly
    ``micro_batch_size`` entries: where a rank has run out of sequences the entries are None,
    padding sequences that :class:`PaddedValidationSet` returns with a zero loss mask. So every
    sequence is read once per evaluation, none twice (Megatron's cyclic validation iterator never
    starts over within an evaluation, nor drifts from one evaluation to the next), and every
    forward pass has the shape the pipeline schedule was given (``micro_batch_size``).

    Args:
        total_samples: Sequences in the validation set.
        data_parallel_rank, data_parallel_size: This rank and the data-parallel width.
        micro_batch_size: Sequences per batch (None: ``--eval-micro-batch-size``).
        micro_batches_per_step: Batches per evaluation step (None: from Megatron's arguments,
            :func:`evaluation_micro_batches_per_step`).

    Attributes:
        steps: Evaluation steps that read the set once (``len(self) == steps *
            micro_batches_per_step``).
        padding: Padding entries this rank yields (``padding_all_ranks``: all ranks together).
    """

    def __init__(
        self,
        total_samples: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        micro_batch_size: Optional[int] = None,
        micro_batches_per_step: Optional[int] = None,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(
                f"full validation: no sequence to read (total_samples={total_samples})"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"full validation: data_parallel_rank {data_parallel_rank} not in "
                f"[0, {data_parallel_size})"
            )
        if micro_batch_size is None or micro_batches_per_step is None:
            from megatron.training import get_args

            args = get_args()
            if micro_batch_size is None:
                micro_batch_size = (
                    getattr(args, "eval_micro_batch_size", None) or args.micro_batch_size
                )
            if micro_batches_per_step is None:
                micro_batches_per_step = evaluation_micro_batches_per_step(args)
        if micro_batch_size < 1:
            raise ValueError(f"full validation: micro_batch_size {micro_batch_size} < 1")
        if micro_batches_per_step < 1:
            raise ValueError(
                f"full validation: micro_batches_per_step {micro_batches_per_step} < 1"
            )
        self.total_samples = total_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_size = int(micro_batch_size)
        self.micro_batches_per_step = int(micro_batches_per_step)
        self._mine = range(data_parallel_rank, total_samples, data_parallel_size)
        most = -(-total_samples // data_parallel_size)  # rank 0 reads the most
        batches = -(-most // self.micro_batch_size)
        self.steps = -(-batches // self.micro_batches_per_step)
        self.padding = len(self) * self.micro_batch_size - len(self._mine)
        self.padding_all_ranks = (
            data_parallel_size * len(self) * self.micro_batch_size - total_samples
        )

    def __len__(self) -> int:
        return self.steps * self.micro_batches_per_step

    def __iter__(self) -> Iterator[list[Optional[int]]]:
        mbs = self.micro_batch_size
        for start in range(0, len(self) * mbs, mbs):
            batch: list[Optional[int]] = list(self._mine[start : start + mbs])
            yield batch + [None] * (mbs - len(batch))

    def describe(self) -> str:
        """One line on what every evaluation reads (printed at start-up)."""
        return (
            f" full validation | sequences: {self.total_samples} | data-parallel ranks: "
            f"{self.data_parallel_size} | micro-batches per rank: {len(self)} of "
            f"{self.micro_batch_size} | steps: {self.steps} of {self.micro_batches_per_step} "
            f"micro-batches | padding sequences: {self.padding_all_ranks} |"
        )


class PaddedValidationSet:
    """A validation dataset where index None is a padding sequence (the first sequence with its
    loss mask zeroed: it adds no loss, no token and no sequence to the evaluation).

    megatron-core's ``GPTDataset`` reads None the same way, a ``BlendedDataset`` does not; this
    wrapper gives every dataset the padding :class:`MicroBatchFullValidationSampler` asks for.
    Other attributes (``index_split``, ``split``, ...) are the wrapped dataset's.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: Optional[int]) -> Any:
        if idx is not None:
            return self.dataset[idx]
        import torch

        sample = dict(self.dataset[0])
        if "loss_mask" not in sample:
            raise ValueError(
                f"full validation: {type(self.dataset).__name__}'s samples have no 'loss_mask' "
                f"to zero in a padding sequence (keys: {sorted(sample)})"
            )
        sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        return sample

    def __getattr__(self, name: str) -> Any:
        # Not for dunders (DataLoader probes __getitems__) nor before __init__ (unpickling).
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _is_validation_split(dataset: Any) -> bool:
    from megatron.core.datasets.utils import Split

    # As build_pretraining_data_loader tells the split (data_samplers.py:26-31).
    if hasattr(dataset, "split"):
        return dataset.split == Split.valid
    return getattr(dataset, "index_split", None) == Split.valid


def _check_calls(module: Any, caller: str, callee: str) -> None:
    fn = getattr(module, caller)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if callee not in fn.__code__.co_names:
        raise RuntimeError(
            f"{module.__name__}.{caller} no longer calls {callee} by its global name "
            f"(megatron-core {megatron_core_version()}); update "
            "megatron_lrmoe/training/compat.py::fix_full_validation"
        )


def _check_full_validation_layout(args: Any) -> None:
    """Refuse the layouts where some rank builds no validation set.

    ``pretrain_lrmoe``'s dataset provider is "distributed" (called on every rank, datasets built
    only where ``is_dataset_built_on_rank``: tensor-parallel rank 0 of the stages with the
    embedding, the loss or MTP), as ``pretrain_gpt``'s is; with ``--full-validation``
    megatron-core 0.19.2's ``build_train_valid_test_data_iterators`` then takes ``len()`` of the
    missing validation loader on the other ranks (``TypeError: object of type 'NoneType' has no
    len()``, seen on CPU with a virtual pipeline).
    """
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if tp > 1 or pp > 2 or (pp > 1 and vp is not None and vp > 1):
        raise ValueError(
            f"--full-validation with tensor parallel {tp}, pipeline parallel {pp}, virtual "
            f"pipeline {vp}: megatron-core {megatron_core_version()} fails on the ranks that "
            "build no validation set (TP rank > 0, middle pipeline stages); use TP 1 and at "
            "most 2 pipeline stages without virtual stages, or drop --full-validation "
            "(--eval-iters batches per evaluation)"
        )


def fix_full_validation(args: Any) -> bool:
    """Make ``--full-validation`` read the single validation set once per evaluation.

    megatron-core 0.19.2 has four faults here, each fixed by a wrapper or a replacement in
    ``megatron.training.training`` / ``megatron.training.datasets.data_samplers``:

    1. ``evaluate_and_print_results`` broadcasts ``args.eval_iters`` as a tensor and indexes the
       list it expects back (``eval_iters[0]``); with one validation set ``args.eval_iters`` is
       an int, ``tolist()`` returns an int and the first evaluation raises ``TypeError: 'int'
       object is not subscriptable``. The wrapper hands it a one-element list.
    2. ``MegatronFullValidationSampler`` yields one sequence per batch whatever
       ``--eval-micro-batch-size`` says, so an evaluation was one forward pass per sequence (on
       one H200, 24 layers of the Qwen3 MoE shape: 1200 sequences took over two minutes, against
       about half a second per 32-sequence forward pass). :class:`MicroBatchFullValidationSampler`
       takes its place: the same sequences on the same ranks, in full batches of
       ``--eval-micro-batch-size`` (padded with zero-loss sequences, :class:`PaddedValidationSet`,
       installed around the validation set by the ``build_pretraining_data_loader`` wrapper), the
       same number of batches on every data-parallel rank.
    3. ``build_train_valid_test_data_iterators`` sets ``args.eval_iters`` to the validation
       loader's length, a count of micro-batches, but ``evaluate`` runs ``eval_iters`` steps of
       ``--eval-global-batch-size / (--eval-micro-batch-size x DP)`` micro-batches each: with
       more than one micro-batch per step every evaluation read the set that many times over (on
       CPU, GBS 8 / MBS 2: 4 times, 1488 sequences for a set of 372). The wrapper turns the count
       into steps (the sampler pads the batches to a whole number of steps).
    4. The test set, sized by ``--eval-iters`` steps, was then read for as many steps as the
       validation set takes; the wrapper evaluates it for ``--eval-iters`` steps as given.

    After training Megatron evaluates the validation set once more ("iteration N on validation
    set"). With ``--full-validation`` and ``--train-iters`` a multiple of ``--eval-interval`` the
    in-loop evaluation has just read the same set with the same weights at the same iteration
    (evaluation mode, no dropout: the same loss), so the wrapper prints a line saying so instead of
    spending a second pass over the whole set (about a minute per run in
    ``benchmarks/memory_bound.py``'s protocol).

    Explicit (``pretrain_lrmoe.main`` calls it), version-checked, idempotent; does nothing (and
    returns False) unless ``--full-validation`` is given without ``--multiple-validation-sets``.
    """
    if not getattr(args, "full_validation", False) or getattr(
        args, "multiple_validation_sets", False
    ):
        return False
    check_megatron_core_version()
    _check_full_validation_layout(args)
    module = importlib.import_module(_TRAINING_MODULE)
    original = module.evaluate_and_print_results
    if getattr(original, _FULL_VALIDATION_MARKER, False):
        return True
    samplers = importlib.import_module(_SAMPLERS_MODULE)
    for owner, caller, callee in (
        (module, "pretrain", "evaluate_and_print_results"),
        (module, "train", "evaluate_and_print_results"),
        (module, "pretrain", "build_train_valid_test_data_iterators"),
        (module, "build_train_valid_test_data_loaders", "build_pretraining_data_loader"),
        (samplers, "build_pretraining_data_loader", "MegatronFullValidationSampler"),
    ):
        _check_calls(owner, caller, callee)

    last_validated: list[int] = []  # the iteration of the last in-loop evaluation
    # What this rank's validation loader reads, and the steps of the test set (--eval-iters as
    # given); set when the data iterators are built.
    state: dict[str, Any] = {"sampler": None, "test_steps": None}

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
        validation_steps = current.eval_iters
        if isinstance(validation_steps, list):
            validation_steps = validation_steps[0]
        test = prefix.endswith("on test set") and state["test_steps"] is not None
        current.eval_iters = [state["test_steps"] if test else validation_steps]
        try:
            return original(*a, **kw)
        finally:
            if test:
                current.eval_iters = validation_steps

    build_loader = module.build_pretraining_data_loader

    def build_pretraining_data_loader(dataset: Any, consumed_samples: int, *a: Any, **kw: Any):
        from megatron.training import get_args

        current = get_args()
        if (
            dataset is None
            or not getattr(current, "full_validation", False)
            or getattr(current, "dataloader_type", None) == "external"
            or not _is_validation_split(dataset)
        ):
            return build_loader(dataset, consumed_samples, *a, **kw)
        loader = build_loader(PaddedValidationSet(dataset), consumed_samples, *a, **kw)
        if not isinstance(loader.batch_sampler, MicroBatchFullValidationSampler):
            raise RuntimeError(
                f"full validation: the validation loader's sampler is "
                f"{type(loader.batch_sampler).__name__}, not MicroBatchFullValidationSampler"
            )
        state["sampler"] = loader.batch_sampler
        return loader

    build_iterators = module.build_train_valid_test_data_iterators

    def build_train_valid_test_data_iterators(*a: Any, **kw: Any) -> Any:
        from megatron.training import get_args
        from megatron.training.utils import print_rank_0

        current = get_args()
        state["sampler"] = None
        # --eval-iters as given: the test set is sized for that many steps
        # (get_train_valid_test_num_samples), here and on a later call (one per virtual
        # pipeline stage), which would otherwise see the validation steps set below.
        if state["test_steps"] is None:
            state["test_steps"] = current.eval_iters
        current.eval_iters = state["test_steps"]
        iterators = build_iterators(*a, **kw)
        sampler = state["sampler"]
        if sampler is not None:
            # Megatron set eval_iters to the loader's length, the most over data-parallel ranks
            # (every rank's is the same: the sampler pads them).
            if current.eval_iters != len(sampler):
                raise RuntimeError(
                    f"full validation: eval_iters {current.eval_iters} is not the validation "
                    f"loader's length {len(sampler)}"
                )
            current.eval_iters = sampler.steps
            print_rank_0(sampler.describe())
            if getattr(current, "mock_data", False) and sampler.data_parallel_rank == 0:
                # Megatron splits the mock set's 100000 documents (about 2000 tokens each)
                # evenly whatever --split says: a third of 2e8 tokens, per evaluation.
                logger.warning(
                    "--full-validation with --mock-data: every evaluation reads all %d "
                    "sequences of the mock validation split",
                    sampler.total_samples,
                )
        return iterators

    for name, fn, wrapped in (
        ("evaluate_and_print_results", evaluate_and_print_results, original),
        ("build_pretraining_data_loader", build_pretraining_data_loader, build_loader),
        ("build_train_valid_test_data_iterators", build_train_valid_test_data_iterators,
         build_iterators),
    ):  # fmt: skip
        setattr(fn, _FULL_VALIDATION_MARKER, True)
        fn.__wrapped__ = wrapped  # type: ignore[attr-defined]
        setattr(module, name, fn)
    samplers.MegatronFullValidationSampler = MicroBatchFullValidationSampler
    logger.info(
        "%s: --full-validation reads the validation set once per evaluation, in micro-batches of "
        "--eval-micro-batch-size", _TRAINING_MODULE
    )
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
