"""The replica slots a placement may fill on each rank, as a function of the peak-load threshold.

Shapes: P ranks.

``Slots`` is what :func:`placement.place_replicas` takes: one count for every rank, a count per
rank, or a function of the threshold T giving a count per rank. :class:`LinearSlots` is the
controller's memory-budget rule; the native search (native.py) recognises it and evaluates the
same rule in C. Apart from placement.py so that native.py and placement.py (which calls into
native.py) both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

__all__ = ["LinearSlots", "Slots"]


@dataclass(frozen=True, eq=False)
class LinearSlots:
    """Replica slots that shrink as the threshold T grows (the controller's memory budget):
    ``min(max((room[g] - per_pair * T) // replica_bytes, 0), limit)`` on rank g.

    A callable like any slots function; the native search (native.py) recognises it and
    evaluates the same rule in C.

    Attributes:
        room: ``[P]`` int64 bytes each rank has left for replicas and saved activations.
        per_pair: Bytes each pair of forward load holds (saved activations), ``> 0`` or 0.
        replica_bytes: Bytes of one replica, ``> 0``.
        limit: Most replicas per rank (``max_replicas_per_rank``).
    """

    room: np.ndarray
    per_pair: int
    replica_bytes: int
    limit: int

    def __call__(self, threshold: int) -> list[int]:
        room = self.room - self.per_pair * threshold
        return np.minimum(np.maximum(room // self.replica_bytes, 0), self.limit).tolist()


Slots = Union[int, Sequence[int], Callable[[int], Sequence[int]]]
