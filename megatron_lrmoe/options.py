"""Which fast paths LRMoE takes: :class:`KernelOptions`, one switch per fast path, all on.

Every switch turns one fast path off, for debugging or for an A/B run against the code that
existed before it; the defaults are what a training run wants. They are a field of the config
(``LRMoEConfig.kernels``) and, on the command line, ``--no-lrmoe-<switch>`` (docs/config.md).

How they reach the code that reads them:

* The planner (``control/controller.py``, ``plan_call``) reads ``native_planner`` from the
  ``LRMoEConfig`` it is given, like the rest of its settings.
* The data path reads the process-wide *active* options, :func:`active_kernels`. An LRMoE layer
  makes its config's options active while its own work runs and puts back what was active
  before: ``LRMoELayer.preprocess`` (the pair plan) and ``routed_experts_compute`` (the plan, the
  op's forward) from ``LRMoELayer.lrmoe_config``, the op (``op/__init__.py``, ``exact.py``,
  ``trimmed.py``) from ``ExpertCall.lrmoe`` for its forward and its backward. Outside a layer
  call (a test or a benchmark calling a stage directly) the active options are
  ``KernelOptions()`` unless :func:`using_kernels` says otherwise.

Why one process-wide object and not an argument: the Triton switch and the grouped GEMMs'
backend are read by the low-level wrappers every stage calls (``triton_common.use_triton`` from
``dispatch/rows.py``, ``dispatch/pair_plan_triton.py``, ``select/scoring.py``,
``experts/activation.py``, ``experts/wgrad_triton.py``, ``graphs/``; ``experts/grouped_gemm.py``
from every grouped product), often several calls below the op and also without any layer (the
tests, the benchmarks); an argument would run through nearly every signature of the data path.
The graph switches sit in the same wrappers' callers (``select/select_triton.py``'s selection
is reached through ``scoring.select``) and are read the same way, so that one rule holds for
all six. It is a plain module global, neither thread-local nor a context variable: the autograd
engine runs a CUDA backward on a thread of its own, and the options the op's backward makes
active must be the ones its kernels see.

Nothing here imports torch (``pretrain_lrmoe.py --lrmoe-help`` builds its parser from it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Optional

__all__ = [
    "RETIRED_ENVIRONMENT",
    "KernelOptions",
    "active_kernels",
    "using_kernels",
    "warn_retired_environment",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelOptions:
    """The fast paths an LRMoE layer may take; each ``False`` switches one off.

    Switching one off changes how a result is computed, not what: the torch implementations,
    the per-expert loop and the eager launches are the references the fast paths are tested
    against (bit for bit where the tests say so, else up to floating-point rounding).

    Attributes:
        triton: The Triton kernels on CUDA (row gathers, scaling, row dots and packing, the pair
            plan, token norms and pair scores, the selection, the activation and its backward,
            the weight gradients added into ``main_grad``). ``False``: their torch
            implementations, and none of the CUDA graphs below (they replay those kernels).
        grouped_mm: ``torch.nn.functional.grouped_mm`` for the grouped GEMMs where it has a
            kernel that never reads the group offsets back to the host (bf16 on sm90/sm100,
            fp32/bf16/fp16 on the CPU, widths a multiple of 16 bytes). ``False``: one
            ``torch.mm`` per non-empty expert everywhere (``experts/grouped_gemm.py``).
        select_graphs: Replay the selection as a CUDA graph captured per shape on its second
            call. ``False``: its kernels launched one by one on every call, and none of the
            graphs below either (they extend the selection's).
        score_graphs: The pair scoring (token norms, pair scores, the kept-score sum) inside the
            selection's graph. ``False``: launched before it, and ``front_graphs`` off too.
        front_graphs: The router gradient's row-dot and the packing of the kept rows inside the
            scoring and selection graph. ``False``: launched around it.
        expert_graphs: At EP 1 with the weight gradients fused into ``main_grad``, the whole
            trimmed backward (the front and the expert half) as one CUDA graph per layer.
            ``False``: the front replayed alone and the expert half launched kernel by kernel,
            which also saves the memory those graphs hold.
        native_planner: Plan calls that the controller plans (budgets, replicas, activation
            mode ``auto``) with its compiled twin (``control/_native.c``, built on first use
            with the system C compiler; same plans). ``False``: the Python planner, slower.
            Without a C compiler the Python planner runs anyway, after one warning.
    """

    triton: bool = True
    grouped_mm: bool = True
    select_graphs: bool = True
    score_graphs: bool = True
    front_graphs: bool = True
    expert_graphs: bool = True
    native_planner: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"LRMoEConfig.kernels.{f.name} ({value!r}) must be True or False "
                    f"(--no-lrmoe-{f.name.replace('_', '-')} switches it off)"
                )

    @property
    def switched_off(self) -> tuple[str, ...]:
        """The names of the switches that are off, in field order (``()`` by default)."""
        return tuple(f.name for f in fields(self) if not getattr(self, f.name))


_active = KernelOptions()


def active_kernels() -> KernelOptions:
    """The options in force: the running LRMoE layer's, else those of the innermost
    :func:`using_kernels`, else ``KernelOptions()``."""
    return _active


def using_kernels(options: KernelOptions) -> "_Using":
    """``with using_kernels(options):`` makes ``options`` active inside and puts back what was
    active before on the way out (exceptions included). Nests.

    Raises:
        ValueError: ``options`` is not a :class:`KernelOptions`.
    """
    if not isinstance(options, KernelOptions):
        raise ValueError(f"using_kernels needs a KernelOptions, got {options!r}")
    return _Using(options)


class _Using:
    """:func:`using_kernels`' context manager (a class, not a generator: the layer enters one
    several times per call, and this costs a fraction of a microsecond)."""

    __slots__ = ("options", "_previous")

    def __init__(self, options: KernelOptions) -> None:
        self.options = options

    def __enter__(self) -> KernelOptions:
        global _active
        self._previous, _active = _active, self.options
        return self.options

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        global _active
        _active = self._previous


# The environment variables that set these switches before they were options, with what
# replaces each (no longer read; a set one gets one warning, see warn_retired_environment).
RETIRED_ENVIRONMENT: dict[str, str] = {
    "LRMOE_TRITON": "--no-lrmoe-triton",
    "LRMOE_GROUPED_MM": "--no-lrmoe-grouped-mm",
    "LRMOE_SELECT_GRAPHS": "--no-lrmoe-select-graphs",
    "LRMOE_SCORE_GRAPHS": "--no-lrmoe-score-graphs",
    "LRMOE_FRONT_GRAPHS": "--no-lrmoe-front-graphs",
    "LRMOE_EXPERT_GRAPHS": "--no-lrmoe-expert-graphs",
    "LRMOE_NATIVE": "--no-lrmoe-native-planner",
}
_warned = False


def warn_retired_environment() -> list[str]:
    """Log one warning per process naming the retired ``LRMOE_*`` switches that are set (they
    are ignored now), with the flag that replaces each; returns their names. The layer calls
    it when it is built, so a script that still sets one does not silently change meaning."""
    global _warned
    found = [name for name in RETIRED_ENVIRONMENT if name in os.environ]
    if found and not _warned:
        _warned = True
        logger.warning(
            "megatron_lrmoe: %s no longer read; the switches are LRMoEConfig.kernels "
            "(KernelOptions), on the command line %s",
            ", ".join(found) + (" is" if len(found) == 1 else " are"),
            ", ".join(RETIRED_ENVIRONMENT[name] for name in found),
        )
    return found
