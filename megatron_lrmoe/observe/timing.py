"""Time spent in a model's MoE layers, forward and backward, stock or LRMoE alike.

Forward time runs from a forward pre-hook to a forward hook of each ``MoELayer`` (router,
permutation, dispatch, experts, combine, un-permutation). Backward time runs from a full backward
pre-hook (the gradient of the layer's output has arrived) to a full backward hook (the gradient of
its input is complete); autograd runs the nodes of one layer back to back, so the span holds that
layer's whole backward, LRMoE's scoring, selection, packing and exchanges included. On GPU the
spans are CUDA events, read (one sync) in :meth:`MoELayerTimer.take`; on CPU wall clock.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence, Union

import torch

from megatron_lrmoe.observe.stats import elapsed_ms, timestamp

__all__ = ["MoELayerTimer"]


class MoELayerTimer:
    """Accumulates the forward and backward time of every ``MoELayer`` of ``model``.

    Evaluation forwards (the layer in eval mode, as Megatron's ``evaluate`` sets it) are not
    counted. A training forward without gradients is: under full activation recompute Megatron
    runs each transformer layer's first forward with gradients off and again in the backward,
    and both forwards are MoE-layer time.

    Args:
        model: A module or a list of model chunks (DDP-wrapped or not).
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
        self.layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]
        self._cuda = torch.cuda.is_available()
        self._open: dict[tuple[int, str], Any] = {}
        self._spans: list[tuple[Any, Any]] = []
        self.total_seconds = 0.0
        self._handles = []
        for layer in self.layers:
            key = id(layer)
            self._handles += [
                layer.register_forward_pre_hook(partial(self._start, key, "fwd")),
                layer.register_forward_hook(partial(self._stop_forward, key)),
                layer.register_full_backward_pre_hook(partial(self._start, key, "bwd")),
                layer.register_full_backward_hook(partial(self._stop, key, "bwd")),
            ]

    def _now(self) -> Any:
        return timestamp(self._cuda)

    def _start(self, key: int, phase: str, module: torch.nn.Module, *_: Any) -> None:
        if phase == "fwd" and not _training_forward(module):
            return
        self._open[(key, phase)] = self._now()

    def _stop(self, key: int, phase: str, *_: Any) -> None:
        start = self._open.pop((key, phase), None)
        if start is not None:
            self._spans.append((start, self._now()))

    def _stop_forward(self, key: int, module: torch.nn.Module, *_: Any) -> None:
        if _training_forward(module):
            self._stop(key, "fwd")

    @property
    def spans(self) -> int:
        """Forward and backward spans recorded since the last :meth:`take`."""
        return len(self._spans)

    def take(self) -> float:
        """Seconds in MoE layers since the last call (added to ``total_seconds``).

        NOTE: device-to-host sync on GPU (the events are read).
        """
        seconds = sum(elapsed_ms(a, b) for a, b in self._spans) / 1e3
        self._spans = []
        self.total_seconds += seconds
        return seconds

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _training_forward(module: torch.nn.Module) -> bool:
    """A forward of training: gradients on, or the module in training mode (a checkpointed
    first forward runs with gradients off)."""
    return torch.is_grad_enabled() or module.training
