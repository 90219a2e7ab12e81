"""The spread of one evaluation's per-sequence losses, so a validation loss comes with its noise.

Megatron prints one number per evaluation (the token-weighted mean loss). Whether two runs'
validation losses differ by more than the validation set's own sampling noise needs that noise:
the standard error of the mean over the evaluated sequences (tokens of one sequence are not
independent draws, so the sequence is the unit). ``pretrain_lrmoe.loss_func`` feeds every
evaluation micro-batch's per-token losses to :class:`ValidationSpread`; after the evaluation's
last micro-batch it prints, before Megatron's own ``validation loss at ...`` line::

     validation spread | sequences: 2304 | loss std: 2.1E-01 | standard error: 4.4E-03 |

(``benchmarks/train_logs.py`` pairs it with the validation line that follows). With
``--full-validation`` every evaluation reads the same sequences, so the standard error is that
of a fixed held-out set; without it each evaluation reads the next ``--eval-iters`` batches.

Shape legend: b sequences in a micro-batch, s tokens per sequence.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

__all__ = ["ValidationSpread", "format_spread"]


def format_spread(sequences: int, std: float, standard_error: float) -> str:
    """The printed line (see the module docstring)."""
    return (
        f" validation spread | sequences: {sequences} | loss std: {std:.6E} | "
        f"standard error: {standard_error:.6E} |"
    )


class ValidationSpread:
    """Per-sequence loss moments of the evaluation in progress (device tensors, no sync until
    :meth:`report`).

    Args:
        micro_batches_per_evaluation: How many micro-batches one evaluation runs on this rank
            (a callable, read at every micro-batch: Megatron sets ``--eval-iters`` from the
            validation set's size only after start-up with ``--full-validation``).
        emit: Where the line goes (``print_rank_last`` in training).
        all_reduce: Sums a float64 ``[3]`` tensor over the data-parallel ranks in place (None:
            this rank alone).
    """

    def __init__(
        self,
        micro_batches_per_evaluation: Callable[[], int],
        emit: Callable[[str], None],
        all_reduce: Optional[Callable[[torch.Tensor], Any]] = None,
    ) -> None:
        self._expected = micro_batches_per_evaluation
        self._emit = emit
        self._all_reduce = all_reduce
        self._moments: Optional[torch.Tensor] = None
        self._micro_batches = 0
        self.last: Optional[tuple[int, float, float]] = None

    def record(self, losses: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one micro-batch: ``losses`` and ``mask`` ``[b, s]`` (mask 1 where a token counts).
        Sequences without a counted token are left out. Reports after the evaluation's last."""
        losses = losses.detach().float().reshape(mask.shape[0], -1)
        mask = mask.detach().float().reshape(mask.shape[0], -1)
        counted = mask.sum(1)
        has = counted > 0
        per_sequence = (losses * mask).sum(1) / counted.clamp(min=1)
        has = has.double()
        per_sequence = per_sequence.double() * has
        moments = torch.stack([has.sum(), per_sequence.sum(), (per_sequence**2).sum()])
        self._moments = moments if self._moments is None else self._moments + moments
        self._micro_batches += 1
        if self._micro_batches >= self._expected():
            self.report()

    def report(self) -> Optional[tuple[int, float, float]]:
        """Reduce, emit the line and start afresh; returns ``(sequences, std, standard error)``.

        NOTE: device-to-host sync (once per evaluation).
        """
        moments, self._moments, self._micro_batches = self._moments, None, 0
        if moments is None:
            return None
        if self._all_reduce is not None:
            self._all_reduce(moments)
        n, total, squares = (float(v) for v in moments.cpu().tolist())
        if n < 1:
            return None
        mean = total / n
        var = max(0.0, (squares - n * mean * mean) / (n - 1)) if n > 1 else 0.0
        std = math.sqrt(var)
        self.last = (int(n), std, std / math.sqrt(n))
        self._emit(format_spread(*self.last))
        return self.last
