"""LRMoE statistics per layer and averaged, for Megatron's TensorBoard / W&B writers and log line.

What is reported (``lrmoe/`` prefix; per layer ``lrmoe/<name>_layer_<i>`` with ``i =
layer_number - 1``, Megatron's ``moe/<name>_layer_<i>`` convention, when ``per_layer=True``):

=============================  ==================================================================
``kept_ratio``                 pairs the backward actually kept / all pairs, counted after each
                               call's backward (``CallStats.kept_pairs_sent`` over ``pairs_sent``,
                               summed over the ranks of the reduction); not the plan (the quotas)
``dropped_score_fraction``     LRM score mass of the dropped pairs / all score mass (the share of
                               the squared expert-weight-gradient norm left out), summed over ranks
``added_variance``             the variance ``sample`` adds to the expert weight gradients / all
                               score mass (``sum (1/pi - 1) score / sum score``, estimated from
                               the kept pairs; ``select/variance.py``): 0 at keep 1 and for
                               ``topk``, whose error is the dropped mass, a bias
``backward_bytes``             bytes one rank sends in the MoE backward exchanges, per iteration
                               (mean over the ranks of the reduction)
``backward_bytes_saved``       stock bytes minus ``backward_bytes`` (what stock Megatron's backward
                               all-to-alls would have sent), per rank and iteration
``overhead_ms``                milliseconds in LRMoE's scoring, selection and packing, per rank
                               and iteration (where they replay as one graph, with the router
                               gradient's row-dot, which is in the same graph); not counted
                               where the whole trimmed backward replays as one graph per layer
                               (EP 1, fused accumulation: no span inside a graph;
                               ``--no-lrmoe-expert-graphs`` brings it back)
``budget_trimmed_fraction``    only for calls the controller planned (budgets, ``auto``): pairs the
                               budgets took from the keep ratio's quotas / all pairs of those calls
``planner_ms``                 same calls: the controller's milliseconds per rank and iteration
``replicas_per_call``          same calls: expert replicas placed per layer call
=============================  ==================================================================

Ratios are sums of numerators over sums of denominators (over calls, micro-batches, layers and
ranks), not means of per-call ratios. "Per iteration" divides by the iterations since the previous
report (``iteration - previous iteration``).

Megatron's MoE metrics tracker (``get_moe_metrics_tracker()``) is not used. Its ``report``
``clear()``s every entry, and ``megatron.training``'s ``training_log`` calls it every iteration
with only the aux/z-loss ``track_names``, so a value recorded under an LRMoE name would be zeroed
before any logging interval and never written; and it DP-averages per-layer sums, which is wrong
for ratios. :class:`LRMoEMetrics` therefore keeps its own accumulator. A call's stats are folded
into it as soon as its backward has run (host integers into a host tensor, score sums into a
device tensor without a sync, the call's span timer kept for later), so memory stays bounded by
the calls in flight plus one timer per call; :meth:`LRMoEMetrics.report` reads the timers (the
one device sync of the interval, CUDA events) and does one all-reduce.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch

from megatron_lrmoe.observe.stats import CallStats

logger = logging.getLogger(__name__)

__all__ = ["LRMoEMetrics", "METRIC_NAMES", "format_log_string", "stock_backward_bytes"]

PREFIX = "lrmoe/"
METRIC_NAMES = (
    "kept_ratio",
    "dropped_score_fraction",
    "backward_bytes",
    "backward_bytes_saved",
    "overhead_ms",
    "added_variance",
)
# Rows of the per-layer accumulator (one float64 [len(_ROWS), num_layers] tensor, one all-reduce).
_ROWS = (
    "pairs",
    "kept",
    "score_total",
    "score_dropped",
    "score_added",
    "bytes",
    "stock_bytes",
    "overhead_ms",
    "calls",
    "ranks",
    "planned_calls",
    "planned_pairs",
    "trimmed_pairs",
    "planner_ms",
    "replicas",
)
_ROW = {name: i for i, name in enumerate(_ROWS)}
# Probabilities travel as fp32 in stock Megatron (router dtype); LRMoE's stats count 4 bytes too.
_PROB_BYTES = 4


def stock_backward_bytes(
    input_splits: Iterable[int], output_splits: Iterable[int], hidden: int, element_size: int
) -> int:
    """Bytes one rank sends in a stock alltoall-dispatcher MoE layer's backward.

    Autograd of the three forward all-to-alls: the combine's backward sends this rank's pair
    gradients to the experts (``sum(input_splits)`` rows of ``hidden``), the token dispatch's
    backward sends the input gradients of the pairs its experts received back
    (``sum(output_splits)`` rows), and the probs dispatch's backward one fp32 per received pair.
    Rows a rank sends to itself are counted, as in LRMoE's ``CallStats.stock_backward_bytes``.

    Args:
        input_splits: ``[P]`` rows this rank sent to each EP rank (``dispatcher.input_splits``).
        output_splits: ``[P]`` rows this rank received (``dispatcher.output_splits``).
        hidden: Hidden size H.
        element_size: Bytes per element of the hidden states.
    """
    sent = int(sum(int(x) for x in input_splits))
    received = int(sum(int(x) for x in output_splits))
    return (sent + received) * hidden * element_size + received * _PROB_BYTES


def format_log_string(scalars: dict[str, float]) -> str:
    """The iteration-log fragment, in Megatron's `` name: value |`` style."""
    if not scalars:
        return ""
    parts = [
        ("lrmoe kept", f"{scalars[PREFIX + 'kept_ratio']:.3f}"),
        ("lrmoe dropped score", f"{scalars[PREFIX + 'dropped_score_fraction']:.3f}"),
        ("lrmoe bwd saved", _format_bytes(scalars[PREFIX + "backward_bytes_saved"])),
        ("lrmoe overhead", f"{scalars[PREFIX + 'overhead_ms']:.1f} ms"),
        ("lrmoe added variance", f"{scalars[PREFIX + 'added_variance']:.3f}"),
    ]
    return "".join(f" {name}: {value} |" for name, value in parts)


def _format_bytes(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def _stats_layers(model: Union[torch.nn.Module, Sequence[torch.nn.Module]]) -> list[Any]:
    """The model's LRMoE layers: the modules whose class defines ``add_stats_listener``
    (``LRMoELayer``; found by that method rather than by class, so that observe/ does not import
    the layer; looked up on the class so that a wrapper forwarding attributes does not count)."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    return [
        m
        for chunk in chunks
        for m in chunk.modules()
        if callable(getattr(type(m), "add_stats_listener", None))
    ]


class LRMoEMetrics:
    """Collects ``last_call_stats`` of a model's LRMoE layers and reports them.

    Every ``LRMoELayer`` hands it the ``CallStats`` of each call made with gradients enabled
    (``LRMoELayer.add_stats_listener``; evaluation and the no-grad first pass of activation
    recomputation never run LRMoE's backward, and the recomputed call, which Megatron's MoE
    checkpointing runs inside backward where module hooks do not fire, is the one recorded).
    The stats object is filled by the layer's backward later; :meth:`report` uses the calls
    whose backward has run and drops the rest.

    Example::

        metrics = LRMoEMetrics(model, num_layers=config.num_layers)
        ...  # train
        if iteration % log_interval == 0:
            scalars = metrics.report(iteration, writer=tb_writer, wandb_writer=wandb_writer)
            log_line += metrics.last_log_string

    Args:
        model: A module or list of model chunks (DDP-wrapped or not).
        groups: Process groups to sum over, one after another; their product must cover every
            rank whose numbers belong in the total exactly once (e.g. ``[WORLD]``, the default
            when ``torch.distributed`` is initialised, or ``[pp, dp x ep]``). Every rank of them
            must call :meth:`report` at the same iterations.
        num_layers: Length of the per-layer vectors (transformer layers plus MTP layers); the
            same on every rank. Default: the largest ``layer_number`` of this rank's LRMoE layers,
            taken from their config (``num_layers + mtp_num_layers``). A rank without LRMoE layers
            (a pipeline stage without MoE) must pass it, or the reduction would not match.
        per_layer: Also write ``lrmoe/<name>_layer_<i>``.
        start_iteration: Iteration of the last step before collection starts (the first report
            covers ``iteration - start_iteration`` iterations).
        device: Device of the reduction tensor; default CUDA's current device when CUDA is
            available (NCCL needs it), else CPU.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Sequence[torch.nn.Module], None] = None,
        *,
        groups: Optional[Sequence[Any]] = None,
        num_layers: Optional[int] = None,
        per_layer: bool = False,
        start_iteration: int = 0,
        device: Optional[torch.device] = None,
    ) -> None:
        layers = _stats_layers(model) if model is not None else []
        if num_layers is None and layers:
            cfg = layers[0].config
            num_layers = cfg.num_layers + (getattr(cfg, "mtp_num_layers", None) or 0)
        self.num_layers = num_layers
        self.groups = groups
        self.per_layer = per_layer
        self.device = device
        self.last_log_string = ""
        self._last_iteration = start_iteration
        self._pending: list[tuple[int, CallStats]] = []
        self._host_acc: Optional[torch.Tensor] = None  # [len(_ROWS), num_layers] float64
        # [3, num_layers]: score total / dropped / added variance
        self._score_acc: Optional[torch.Tensor] = None
        self._timers: list[tuple[int, Any]] = []  # (layer index, SpanTimer) read at report
        self._handles = [layer.add_stats_listener(self.record) for layer in layers]
        if self.num_layers is None:
            logger.warning(
                "LRMoEMetrics: no LRMoE layers and no num_layers; report() returns {} without "
                "joining the reduction"
            )

    # --- collection -----------------------------------------------------------------------------
    def record(self, layer_number: int, stats: CallStats) -> None:
        """Keep one call's stats (the hook does this; public for custom loops and tests).

        Args:
            layer_number: 1-based Megatron layer number.
            stats: The call's stats; read at the next :meth:`report`, not now.
        """
        self._fold(final=False)
        self._pending.append((layer_number, stats))

    def close(self) -> None:
        """Stop listening to the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- reporting ------------------------------------------------------------------------------
    def _reduction_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _fold(self, final: bool) -> None:
        """Move finished calls from ``_pending`` into the accumulators (no device sync).

        Args:
            final: Also drop calls whose backward never ran (at report time).
        """
        if self.num_layers is None:
            return
        if self._host_acc is None:
            self._host_acc = torch.zeros(len(_ROWS), self.num_layers, dtype=torch.float64)
        done = [(n, st) for n, st in self._pending if st.backward_done]
        waiting = [(n, st) for n, st in self._pending if not st.backward_done]
        if final and waiting:
            logger.debug("LRMoEMetrics: %d calls without backward dropped", len(waiting))
            waiting = []
        self._pending = waiting
        scores: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for layer_number, stats in done:
            i = layer_number - 1
            if not 0 <= i < self.num_layers:
                raise ValueError(
                    f"LRMoEMetrics: layer_number {layer_number} outside num_layers "
                    f"({self.num_layers}); pass num_layers including MTP layers"
                )
            col = self._host_acc[:, i]
            # This rank's own pairs and those its backward kept; the reduction sums the ranks.
            col[_ROW["pairs"]] += stats.pairs_sent
            if stats.kept_pairs_sent is None:
                raise ValueError(
                    f"LRMoEMetrics: layer {layer_number}'s finished call has no kept_pairs_sent "
                    "(every LRMoE backward records it; hand-built CallStats must set it)"
                )
            col[_ROW["kept"]] += stats.kept_pairs_sent
            col[_ROW["bytes"]] += stats.backward_bytes
            col[_ROW["stock_bytes"]] += stats.stock_backward_bytes
            col[_ROW["calls"]] += 1
            col[_ROW["ranks"]] = 1
            control = stats.control
            if control is not None:
                # The controller's plan of the call (budgets / auto): global numbers, the same
                # on every rank; the reduction's sums keep their ratios.
                col[_ROW["planned_calls"]] += 1
                col[_ROW["planned_pairs"]] += float(control.counts.sum())
                col[_ROW["trimmed_pairs"]] += control.trimmed_pairs
                col[_ROW["planner_ms"]] += 1e3 * control.planner_time_s
                col[_ROW["replicas"]] += control.num_replicas
            if stats.timer is not None:
                self._timers.append((i, stats.timer))
            if stats.score_total is not None and stats.score_kept is not None:
                added = stats.score_added_variance
                scores.append((i, stats.score_total, stats.score_kept, added))
        if scores:
            total = torch.stack([t.reshape(()).double() for _, t, _, _ in scores])
            kept = torch.stack([k.reshape(()).double() for _, _, k, _ in scores])
            added = torch.stack(
                [
                    a.reshape(()).to(total.device, torch.float64) if a is not None else t.new_zeros(())
                    for _, t, _, a in scores
                ]
            ).to(total.dtype)
            if self._score_acc is None or self._score_acc.device != total.device:
                prev = self._score_acc
                self._score_acc = torch.zeros(
                    3, self.num_layers, dtype=torch.float64, device=total.device
                )
                if prev is not None:
                    self._score_acc += prev.to(total.device)
            index = torch.tensor([i for i, _, _, _ in scores], device=total.device)
            self._score_acc[0].index_add_(0, index, total)
            self._score_acc[1].index_add_(0, index, (total - kept).clamp_min(0.0))
            self._score_acc[2].index_add_(0, index, added)

    def _accumulate(self, device: torch.device) -> torch.Tensor:
        """``[len(_ROWS), num_layers]`` float64 sums of this rank's finished calls; resets."""
        self._fold(final=True)
        acc = self._host_acc.clone()
        for i, timer in self._timers:
            # NOTE: device-to-host sync on GPU (CUDA events), once per report.
            acc[_ROW["overhead_ms"], i] += sum(timer.milliseconds().values())
        acc = acc.to(device)
        if self._score_acc is not None:
            acc[_ROW["score_total"]] += self._score_acc[0].to(device)
            acc[_ROW["score_dropped"]] += self._score_acc[1].to(device)
            acc[_ROW["score_added"]] += self._score_acc[2].to(device)
        self._host_acc = None
        self._score_acc = None
        self._timers = []
        return acc

    def _reduce(self, acc: torch.Tensor) -> int:
        """Sum ``acc`` over the groups in place; returns the number of ranks summed over."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return 1
        groups = self.groups if self.groups is not None else [torch.distributed.group.WORLD]
        ranks = 1
        for group in groups:
            torch.distributed.all_reduce(acc, group=group)
            ranks *= torch.distributed.get_world_size(group)
        return ranks

    def report(
        self,
        iteration: int,
        writer: Any = None,
        wandb_writer: Any = None,
    ) -> dict[str, float]:
        """Reduce everything since the last report, write it, and reset.

        Every rank of ``groups`` must call this at the same iterations (it all-reduces once).

        Args:
            iteration: The current iteration (x axis of the writers).
            writer: TensorBoard ``SummaryWriter``-like (``add_scalar(name, value, iteration)``).
            wandb_writer: W&B run-like (``log({name: value}, iteration)``).

        Returns:
            ``{"lrmoe/<name>": value}`` (and the per-layer names when ``per_layer``); empty when
            no LRMoE call finished its backward anywhere. ``last_log_string`` holds the
            iteration-log fragment.
        """
        if self.num_layers is None:
            self.last_log_string = ""
            return {}
        iterations = iteration - self._last_iteration
        self._last_iteration = iteration
        if iterations <= 0:
            iterations = 1
        acc = self._accumulate(self._reduction_device())
        num_ranks = self._reduce(acc)
        acc = acc.cpu()  # NOTE: device-to-host sync (once per report)
        scalars = self._scalars(acc, iterations, num_ranks)
        for name, value in scalars.items():
            if writer is not None:
                writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: value}, iteration)
        self.last_log_string = format_log_string(scalars)
        return scalars

    def _scalars(self, acc: torch.Tensor, iterations: int, num_ranks: int) -> dict[str, float]:
        row = {name: acc[i] for i, name in enumerate(_ROWS)}
        if float(row["calls"].sum()) == 0:
            return {}
        total = {name: float(values.sum()) for name, values in row.items()}
        scalars = _summary(total, iterations * num_ranks)
        if self.per_layer:
            for i in range(self.num_layers):
                if float(row["calls"][i]) == 0:
                    continue
                layer = {name: float(values[i]) for name, values in row.items()}
                per_rank = iterations * max(layer["ranks"], 1.0)
                for name, value in _summary(layer, per_rank).items():
                    scalars[f"{name}_layer_{i}"] = value
        return scalars


def _summary(sums: dict[str, float], per: float) -> dict[str, float]:
    """The metrics from accumulated sums; ``per`` = iterations x ranks to average over.

    The five LRMoE metrics always; with calls planned by the controller (budgets or
    ``activation_mode="auto"``) also ``budget_trimmed_fraction`` (pairs the budgets took from the
    keep ratio's quotas, over all pairs of those calls) and ``planner_ms`` (per rank and
    iteration).
    """
    out = _base_summary(sums, per)
    if sums.get("planned_calls", 0.0) > 0:
        out[PREFIX + "budget_trimmed_fraction"] = sums["trimmed_pairs"] / max(
            sums["planned_pairs"], 1.0
        )
        out[PREFIX + "planner_ms"] = sums["planner_ms"] / per
        out[PREFIX + "replicas_per_call"] = sums["replicas"] / sums["planned_calls"]
    return out


def _base_summary(sums: dict[str, float], per: float) -> dict[str, float]:
    return {
        PREFIX + "kept_ratio": sums["kept"] / max(sums["pairs"], 1.0),
        PREFIX
        + "dropped_score_fraction": (
            sums["score_dropped"] / sums["score_total"] if sums["score_total"] > 0 else 0.0
        ),
        PREFIX + "backward_bytes": sums["bytes"] / per,
        PREFIX + "backward_bytes_saved": (sums["stock_bytes"] - sums["bytes"]) / per,
        PREFIX + "overhead_ms": sums["overhead_ms"] / per,
        PREFIX
        + "added_variance": (
            sums["score_added"] / sums["score_total"] if sums["score_total"] > 0 else 0.0
        ),
    }
