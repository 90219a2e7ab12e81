"""``keep_ratio="auto"``: each layer's keep ratio for its next calls, from a variance target.

The controller plans a call before its scores exist, so the keep ratio adapts from calls already
run. After every backward of an ``"auto"`` layer the op measures, from that call's LRM scores, the
variance capped sqrt-proportional sampling would add to the expert weight gradients at every keep
ratio of :data:`KEEP_GRID` (``select/variance.py``, ``added_variance_curve``), relative to the
scores' total (the gradient's own mini-batch noise), summed over the expert-parallel group so
every rank sees the same numbers. :class:`AutoKeepRatio` turns those measurements into the keep
ratio of the layer's next call:

* ``best``: the smallest grid ratio whose relative added variance is at most the target (1.0 if
  none is);
* ``level``: the first measurement's ``best``, then an exponential moving average,
  ``level += SMOOTHING * (best - level)``: after a step change of the gradients, half of the gap
  closes per call (94 % after four calls), so one odd batch moves the ratio by half a step;
* the call plans with the smallest grid ratio at or above ``level`` (rounding up: conservative).

The first call of a layer runs at keep 1.0 (exact). Budgets (``memory_budget_bytes``,
``exchange_budget_bytes``) stay hard limits: the controller trims below the auto ratio where
they bind. This module is host arithmetic only: the op hands it :class:`PendingCurve` objects
whose values it reads when the layer plans its next call (by then long computed, so reading
them does not wait for the device).
"""

from __future__ import annotations

import math
from typing import Optional, Protocol, Sequence

__all__ = ["AutoKeepRatio", "KEEP_GRID", "PendingCurve", "SMOOTHING"]

KEEP_GRID: tuple[float, ...] = tuple(j / 16 for j in range(1, 16))
"""The keep ratios below 1.0 that ``"auto"`` chooses among (1.0 is the last resort)."""

SMOOTHING = 0.5
"""Weight of the newest measurement in the moving average of the wanted keep ratio."""


class PendingCurve(Protocol):
    """One backward's measurement, read on the host once the device has it."""

    def result(self) -> tuple[Sequence[float], float]:
        """``(added variance at each ratio of KEEP_GRID, score total)``, EP-group sums."""
        ...


class AutoKeepRatio:
    """The keep ratio state of one ``"auto"`` layer.

    Args:
        target: Relative added variance allowed (``LRMoEConfig.variance_target``), > 0.
    """

    def __init__(self, target: float) -> None:
        if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
            raise ValueError(f"AutoKeepRatio: target ({target!r}) must be a number > 0")
        self.target = float(target)
        self.level = 1.0
        self.observed = 0
        self.last_ratio: Optional[float] = None
        """The relative added variance measured at the planned ratio of the last measured call
        (0 at keep 1.0), for logs."""
        self._pending: list[tuple[float, PendingCurve]] = []
        self.planned = 1.0
        """The keep ratio :meth:`keep_ratio` last gave (the latest call's)."""

    def push(self, pending: PendingCurve, planned: float) -> None:
        """Queue one backward's measurement (``planned``: the keep ratio its call ran with)."""
        self._pending.append((planned, pending))

    def keep_ratio(self) -> float:
        """The keep ratio of the layer's next call, after reading every queued measurement."""
        pending, self._pending = self._pending, []
        for planned, item in pending:
            added, total = item.result()
            self.observe(added, total, planned)
        self.planned = _round_up(self.level)
        return self.planned

    def observe(self, added: Sequence[float], total: float, planned: float = 1.0) -> None:
        """Fold in one call's curve: ``added[i]`` at ``KEEP_GRID[i]``, ``total`` the scores' sum.

        A call without scores (total 0) or with non-finite ones (a step Megatron will skip)
        tells nothing and changes nothing.
        """
        if len(added) != len(KEEP_GRID):
            raise ValueError(
                f"AutoKeepRatio.observe: {len(added)} values for a grid of {len(KEEP_GRID)}"
            )
        values = [float(a) for a in added]
        if not (math.isfinite(total) and total > 0 and all(map(math.isfinite, values))):
            return
        ratios = [a / total for a in values]
        best = next((k for k, r in zip(KEEP_GRID, ratios) if r <= self.target), 1.0)
        self.level = best if self.observed == 0 else self.level + SMOOTHING * (best - self.level)
        self.observed += 1
        self.last_ratio = _ratio_at(planned, ratios)


def _round_up(level: float) -> float:
    """The smallest ratio of ``KEEP_GRID + (1.0,)`` at or above ``level`` (float noise aside)."""
    return next((k for k in KEEP_GRID if k >= level - 1e-9), 1.0)


def _ratio_at(keep: float, ratios: Sequence[float]) -> float:
    """The measured relative added variance at ``keep`` (0 at 1.0: every pair kept)."""
    if keep >= 1.0:
        return 0.0
    index = min(range(len(KEEP_GRID)), key=lambda i: abs(KEEP_GRID[i] - keep))
    return ratios[index]
