"""Per-call statistics of an LRMoE layer (``layer.last_call_stats``).

Counts are exact integers; byte counts assume the dtype actually sent. Timings use CUDA events
on GPU (read lazily, so recording them never syncs) and ``time.perf_counter`` on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class ExchangeStats:
    """One backward all-to-all: what LRMoE sent next to what stock Megatron would send."""

    rows: int
    bytes: int
    remote_rows: int
    remote_bytes: int
    stock_rows: int
    stock_bytes: int


def timestamp(cuda: bool) -> Any:
    """A point in time: a recorded CUDA event on GPU (no sync), ``perf_counter`` on CPU."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start: Any, stop: Any) -> float:
    """Milliseconds between two :func:`timestamp` values. NOTE: syncs on GPU (reads events)."""
    if isinstance(start, float):
        return (stop - start) * 1e3
    stop.synchronize()
    return float(start.elapsed_time(stop))


# Timing events of spans already read, for reuse: creating a CUDA event and looking up the
# current stream cost more host time than recording it, and the spans are taken in every
# backward of every layer.
_SPARE_EVENTS: list[torch.cuda.Event] = []
_MAX_SPARE_EVENTS = 4096


class SpanTimer:
    """Measures named spans without forcing a device sync at record time.

    On CUDA each start and stop records a timing event on the current stream (events are
    recycled once the spans have been read); elsewhere it reads ``time.perf_counter``. The
    backward makes one per layer call, so the stream is not looked up here: that costs more
    host time than recording an event.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._spans: dict[str, list] = {}
        self._read: Optional[dict[str, float]] = None

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = _SPARE_EVENTS.pop() if _SPARE_EVENTS else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name: str) -> None:
        self._spans[name] = [self._now(), None]
        self._read = None

    def stop(self, name: str) -> None:
        self._spans[name][1] = self._now()
        self._read = None

    def cancel(self, name: str) -> None:
        """Forget a started span (the work it was to time did not run)."""
        start, _ = self._spans.pop(name)
        if self._cuda and len(_SPARE_EVENTS) < _MAX_SPARE_EVENTS:
            _SPARE_EVENTS.append(start)
        self._read = None

    def milliseconds(self) -> dict[str, float]:
        """Elapsed ms per span. NOTE: device-to-host sync on GPU (event.synchronize).

        The first read after every span closed releases the events for reuse; later reads
        return the same numbers.
        """
        if self._read is None:
            self._read = {
                name: elapsed_ms(a, b) for name, (a, b) in self._spans.items() if b is not None
            }
            closed = all(b is not None for _, b in self._spans.values())
            if self._cuda and closed:
                for a, b in self._spans.values():
                    if len(_SPARE_EVENTS) < _MAX_SPARE_EVENTS:
                        _SPARE_EVENTS.extend(e for e in (a, b) if e is not None)
                self._spans = {}
        return dict(self._read)


@dataclass
class CallStats:
    """Statistics of one layer call; the backward half is filled when backward runs.

    Attributes:
        layer_number: Megatron layer number.
        call_index: Forward call counter of the layer.
        total_pairs: Pairs of this layer call over all EP ranks (sum of N).
        pairs_sent: Pairs this rank sent to experts in forward.
        quota_per_expert: ``[E]`` quota of every expert (kept pairs per expert, by construction).
        tokens_per_expert: ``[E]`` pairs each expert received (N summed over sources).
        kept_pairs_sent: Pairs of this rank that survived, i.e. that backward sent to their
            expert (filled by backward).
        kept_per_local_expert: ``[L]`` surviving pairs of this rank's experts (after backward).
        exchanges: Backward exchanges by name ("grad", "dgrad", "probs_grad", "scores",
            "weights", "positions", and with replicas "replica_grads": replica weight
            gradients sent to their owners).
        score_total / score_kept: Sum of LRM scores of this rank's pairs and of the kept ones
            (device tensors until read; ``dropped_score_fraction`` reads them).
        score_added_variance: The variance the selection adds to the expert weight gradients,
            ``sum_i (1/pi_i - 1) * score_i`` (``select/variance.py``), as its Horvitz-Thompson
            estimate over the kept pairs, ``sum_kept w (w - 1) score`` with ``w = 1/pi`` (0 for
            ``topk``, whose error is a bias); in the scores' units, so its ratio to
            ``score_total`` is the relative added variance (device tensor until read).
        kept_mask: ``[S]`` bool in this rank's permuted pair order (``debug_record_selection``).
        kept_weight: ``[S]`` gradient multiplier of each pair, 0 when dropped (same flag).
        backward_done: Whether backward has filled the rest.
        timer: CUDA-event spans of scoring, selection and packing (read lazily).
        control: The controller's ``ControlPlan`` when budgets, ``activation_mode="auto"`` or
            replicas planned the call (see :attr:`control_summary`), else None.
        replicas_placed: Replicas the controller placed this call, over the EP group.
        replica_experts: Experts this rank held as replicas this call (ascending).
        replicas_fetched: Replica weights exchanged for this call, over the EP group (0 when
            every replica came from the layer's per-step cache).
        planned_forward_peak / planned_backward_peak: The controller's planned peak per-rank
            loads (pairs computed in forward / kept pairs in backward), None without it.
        forward_rows: Pairs this rank's experts and replicas computed in forward.
        forward_per_replica: Pairs each replica on this rank computed in forward.
        kept_rows: Kept pairs whose expert backward ran on this rank (after backward): the
            actual per-rank backward load, at most ``planned_backward_peak``.
        kept_per_replica: Kept pairs of each replica on this rank (after backward).
        global_counts: ``[P, E]`` host int64 pair counts ``N[r, e]`` of the call (all-gathered,
            the same on every EP rank; the plan's own tensor: read, never modify). What the
            routing trace records (megatron_lrmoe/observe/trace.py).
    """

    layer_number: int
    call_index: int
    total_pairs: int
    pairs_sent: int
    quota_per_expert: list[int]
    tokens_per_expert: list[int]
    kept_pairs_sent: Optional[int] = None
    kept_per_local_expert: Optional[list[int]] = None
    exchanges: dict[str, ExchangeStats] = field(default_factory=dict)
    score_total: Optional[torch.Tensor] = None
    score_kept: Optional[torch.Tensor] = None
    score_added_variance: Optional[torch.Tensor] = None
    kept_mask: Optional[torch.Tensor] = None
    kept_weight: Optional[torch.Tensor] = None
    backward_done: bool = False
    timer: Optional[SpanTimer] = None
    control: Optional[Any] = None
    replicas_placed: int = 0
    replica_experts: list[int] = field(default_factory=list)
    replicas_fetched: int = 0
    planned_forward_peak: Optional[int] = None
    planned_backward_peak: Optional[int] = None
    forward_rows: Optional[int] = None
    forward_per_replica: list[int] = field(default_factory=list)
    kept_rows: Optional[int] = None
    kept_per_replica: Optional[list[int]] = None
    global_counts: Optional[torch.Tensor] = None

    @property
    def control_summary(self) -> Optional[dict[str, Any]]:
        """The controller's plan of this call (``ControlPlan.summary()``: quota cap, trimmed
        pairs, binding budgets, activation mode, planned peak loads, memory next to fixed
        ownership, planner time), or None when the call was planned without it."""
        return None if self.control is None else self.control.summary()

    @property
    def kept_ratio(self) -> Optional[float]:
        """Pairs of this rank that backward actually kept, over the pairs it sent.

        Counted after backward (``kept_pairs_sent / pairs_sent``, 0.0 for a rank that sent no
        pairs); ``None`` before backward has run. Summed over the ranks of the EP group
        (numerators and denominators apart) it is the layer call's kept fraction; it equals
        :attr:`planned_keep_ratio` there unless the selection broke the plan, which is what
        makes it worth reporting.
        """
        if self.kept_pairs_sent is None:
            return None
        return self.kept_pairs_sent / max(1, self.pairs_sent)

    @property
    def planned_keep_ratio(self) -> float:
        """The plan: sum of the quotas over all pairs of the call (every EP rank), known in
        forward."""
        return sum(self.quota_per_expert) / max(1, self.total_pairs)

    @property
    def dropped_score_fraction(self) -> float:
        """Share of this rank's LRM score mass that was dropped (0 when nothing was dropped).

        NOTE: device-to-host sync when first read on GPU.
        """
        if self.score_total is None or self.score_kept is None:
            return 0.0
        total = float(self.score_total)
        return 0.0 if total <= 0.0 else max(0.0, 1.0 - float(self.score_kept) / total)

    @property
    def timings_ms(self) -> dict[str, float]:
        """Milliseconds spent in scoring, selection and packing (and the exchanges)."""
        return {} if self.timer is None else self.timer.milliseconds()

    @property
    def backward_bytes(self) -> int:
        return sum(x.bytes for x in self.exchanges.values())

    @property
    def stock_backward_bytes(self) -> int:
        return sum(x.stock_bytes for x in self.exchanges.values())
