"""Replay recorded routing through the controller at P virtual EP ranks and price every rank.

Shape legend: P virtual EP ranks, E experts, L layers of a pass, ``N[r, e]`` pairs from source
r to expert e, ``A[e, g]`` / ``B[e, g]`` pairs of e computed on g in forward / kept for its
backward on g (the controller's ``forward_load`` / ``backward_load``).

Per layer call and arm, :func:`plan_call` (the real controller, the same plan every rank would
compute) decides quotas, replicas and both assignments; :func:`price_call` turns the plan into
per-rank work and prices each phase with :mod:`megatron_lrmoe.replay.cost`:

| phase | rows / bytes per rank |
|---|---|
| ``dispatch``, ``combine`` | token rows (H) per pair, source -> holder and back |
| ``replica_fetch`` | each replica's fc1 + fc2 weights, owner -> holder |
| ``gemm_fwd`` | fc1 + fc2 over ``A[:, g]`` |
| ``grad`` | the kept pairs' gradient rows, source -> holder (H; 2H with recompute at P > 1; lean: every pair's gradient row and the kept pairs' token rows, H each, priced as one all-to-all) |
| ``gemm_bwd`` | dgrad + wgrad of fc1 and fc2 over ``B[:, g]`` (+ fc1 again with recompute or lean; lean: + fc2's input gradient over ``A[:, g]``, the router gradient) |
| ``dgrad`` | the kept pairs' input-gradient rows (H), holder -> source |
| ``replica_grads`` | each replica's weight gradient (in the weights' dtype), holder -> owner |
| ``moe_recompute`` | ``moe`` arms (Megatron's MoE-layer recompute): the forward's phases again |

With :class:`~megatron_lrmoe.replay.cost.LayerCosts` (``layer=``; the CLI's default) the rest
of the call is priced too (see that module):

| phase | per rank |
|---|---|
| ``router``, ``router_bwd`` | the router and the residual stream, per token (and token-expert) |
| ``elementwise_fwd`` | permutation, activation, un-permutation: bytes over the memory's speed |
| ``host_fwd`` | the forward's host floor less its GPU phases, plus the count sync at P > 1 |
| ``elementwise_bwd`` | gradient rows, activation bwd, gather-sum; trimmed: scoring, packing |
| ``main_grad`` | the fused fp32 ``main_grad`` accumulation of the owned experts' weight gradients |
| ``host_bwd`` | the backward's host floor less its GPU phases |

A phase lasts as long as its slowest rank; the call's MoE time is the sum of its phases (no
overlap between phases), a pass's the sum over its layers. The stock arm (fixed ownership, keep
1.0) is the same controller at keep 1.0 without replicas; its memory is stock Megatron's
(``MemoryPlan.stock_*``: ``SequentialMLP``'s saved activations); its time is priced as LRMoE's
at keep 1.0 (a grouped GEMM, not ``SequentialMLP``'s loop). Memory per rank over a pass:
what each layer holds from its forward to its backward (replicas and saved activations) summed
over the layers, plus the largest transient buffer of one layer (forward token buffers or
backward working rows). Not priced: the scalar exchanges (routing-weight gradients, positions),
overlap of phases, and without ``layer`` everything but the GEMMs and the exchanges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.control.balance import interval_split_np
from megatron_lrmoe.control.controller import ControlPlan, plan_call
from megatron_lrmoe.control.costs import CostModel
from megatron_lrmoe.replay.cost import MAIN_GRAD_MODES, GemmTable, LayerCosts, LayerWork, Network

__all__ = [
    "BACKWARD_PHASES",
    "DEFAULT_ARMS",
    "FORWARD_PHASES",
    "Arm",
    "CallPrice",
    "PHASES",
    "parse_arm",
    "price_call",
    "rank_pair_rows",
    "replay_pass",
    "retime",
]

FORWARD_PHASES = (
    "router",
    "dispatch",
    "replica_fetch",
    "elementwise_fwd",
    "gemm_fwd",
    "combine",
    "host_fwd",
)
BACKWARD_PHASES = (
    "grad",
    "elementwise_bwd",
    "gemm_bwd",
    "main_grad",
    "dgrad",
    "replica_grads",
    "router_bwd",
    "host_bwd",
    "moe_recompute",
)
PHASES = FORWARD_PHASES + BACKWARD_PHASES
_EXCHANGES = ("dispatch", "replica_fetch", "combine", "grad", "dgrad", "replica_grads")
DEFAULT_ARMS = (
    "stock",
    "rep2",
    "keep0.5",
    "keep0.25",
    "keep0.5+rep2",
    "keep0.25+rep2",
    "keep0.5+rep2+mem0.8x",
    "keep0.5+rep2+xch0.3x",
)


@dataclass(frozen=True)
class Arm:
    """One configuration to replay.

    Attributes:
        name: As given (``stock``, or tokens joined by ``+``: ``keep0.5``, ``rep2``,
            ``mem0.6x`` / ``mem2e9``, ``xch0.5x`` / ``xch1e8``, ``save`` / ``recompute`` /
            ``lean`` / ``auto``, ``moe``; ``stock+moe``). A budget ending in ``x`` is a fraction
            of what the stock arm holds per rank at the same P when balanced
            (:func:`stock_references`: budgeted bytes for ``mem``, gradient-exchange bytes for
            ``xch``); else bytes.
        stock: Fixed ownership, keep 1.0, memory as stock Megatron's.
        keep_ratio, max_replicas_per_rank, activation_mode: As in :class:`LRMoEConfig`.
        memory_budget, exchange_budget: ``(value, relative)`` or None.
        moe_recompute: Under Megatron's MoE-layer recompute (``--recompute-granularity
            selective --recompute-modules moe``): the layer holds only its input from forward
            to backward and runs its whole forward again before its backward.
    """

    name: str
    stock: bool = False
    keep_ratio: float = 1.0
    max_replicas_per_rank: int = 0
    activation_mode: str = "save"
    memory_budget: Optional[tuple[float, bool]] = None
    exchange_budget: Optional[tuple[float, bool]] = None
    moe_recompute: bool = False

    @property
    def relative_budgets(self) -> bool:
        return any(b is not None and b[1] for b in (self.memory_budget, self.exchange_budget))

    def config(self, stock_memory: float = 0.0, stock_exchange: float = 0.0) -> LRMoEConfig:
        """The layer config of this arm; relative budgets scale the stock references given."""

        def resolve(budget: Optional[tuple[float, bool]], ref: float) -> Optional[int]:
            if budget is None:
                return None
            value, relative = budget
            return int(value * ref) if relative else int(value)

        return LRMoEConfig(
            keep_ratio=self.keep_ratio,
            max_replicas_per_rank=self.max_replicas_per_rank,
            activation_mode=self.activation_mode,
            memory_budget_bytes=resolve(self.memory_budget, stock_memory),
            exchange_budget_bytes=resolve(self.exchange_budget, stock_exchange),
        )


_TOKEN = re.compile(r"^(keep|rep|mem|xch)([0-9.eE+-]+?)(x?)$")


def parse_arm(text: str) -> Arm:
    """An :class:`Arm` from its name (see :attr:`Arm.name`).

    Raises:
        ValueError: An unknown token, naming it and the grammar.
    """
    if text == "stock":
        return Arm(name=text, stock=True)
    if text.split("+")[0] == "stock":
        if text != "stock+moe":
            raise ValueError(
                f"arm {text!r}: stock takes only '+moe' (Megatron's MoE-layer recompute)"
            )
        return Arm(name=text, stock=True, moe_recompute=True)
    arm = Arm(name=text)
    for token in text.split("+"):
        if token in ("save", "recompute", "lean", "auto"):
            arm = replace(arm, activation_mode=token)
            continue
        if token == "moe":
            arm = replace(arm, moe_recompute=True)
            continue
        m = _TOKEN.match(token)
        try:
            key, value, relative = m.group(1), float(m.group(2)), m.group(3) == "x"
        except (AttributeError, ValueError):
            raise ValueError(
                f"arm {text!r}: token {token!r} is not one of keepR, repN, memB, memFx, xchB, "
                "xchFx, save, recompute, lean, auto, moe (e.g. keep0.5+rep2+mem0.6x), nor "
                "'stock' / 'stock+moe'"
            ) from None
        if key in ("keep", "rep") and relative:
            raise ValueError(f"arm {text!r}: {token!r} takes no 'x' (only mem and xch do)")
        if key == "keep":
            arm = replace(arm, keep_ratio=value)
        elif key == "rep":
            arm = replace(arm, max_replicas_per_rank=int(value))
        elif key == "mem":
            arm = replace(arm, memory_budget=(value, relative))
        else:
            arm = replace(arm, exchange_budget=(value, relative))
    arm.config()  # LRMoEConfig validates the values
    return arm


def rank_pair_rows(
    chunks: np.ndarray, load: np.ndarray, owner: np.ndarray, holds_many: np.ndarray
) -> np.ndarray:
    """``[P(src), P(holder)]`` rows of ``chunks`` ``[P, E]`` split over holders by ``load``
    ``[E, P]`` with the controller's line rule (``interval_split_np``), summed over experts.

    Experts held by one rank in ``load`` go whole to it; only ``holds_many`` experts are split.
    """
    ranks = chunks.shape[0]
    out = np.zeros((ranks, ranks), dtype=np.int64)
    single = ~holds_many
    if single.any():
        dest = np.where(load[single].any(axis=1), load[single].argmax(axis=1), owner[single])
        onehot = np.zeros((int(single.sum()), ranks), dtype=np.int64)
        onehot[np.arange(len(dest)), dest] = 1
        out += chunks[:, single] @ onehot
    if holds_many.any():
        many = np.flatnonzero(holds_many)
        out += interval_split_np(
            np.ascontiguousarray(chunks[:, many]), load[many], owner[many]
        ).sum(axis=1)
    return out


@dataclass
class CallPrice:
    """One layer call of one arm, priced.

    Attributes:
        phase_ms: Slowest rank's milliseconds per phase (:data:`PHASES`).
        forward_rows, backward_rows: ``[P]`` pairs computed / kept per rank.
        held_bytes: ``[P]`` bytes held from forward to backward (replicas, saved activations).
        transient_bytes: ``[P]`` the larger of forward token buffers and backward working rows.
        network_bytes: ``[P]`` bytes each rank sends to other ranks over all phases.
        exchange_bytes: ``[P(sender), P(receiver)]`` bytes per exchange phase (the diagonal is
            what a rank keeps; the layer's ``CallStats.exchanges`` count it too).
        pairs, kept, trimmed, replicas: Totals of the call.
        binding: Budgets that bound (``ControlPlan.binding_budgets``), unmet ones marked ``!``.
        plan_ms: The controller's wall time.
        gemm_rank_ms: ``[P]`` GEMM milliseconds per rank of ``gemm_fwd`` and ``gemm_bwd``.
        work: The rows :class:`LayerCosts` prices (None: priced without, no top-k given).
        main_grad: Where the weight gradients go (``MAIN_GRAD_MODES``).
        moe_recompute: Under Megatron's MoE-layer recompute (the forward runs again in the
            backward: phase ``moe_recompute``).
    """

    phase_ms: dict[str, float]
    forward_rows: np.ndarray
    backward_rows: np.ndarray
    held_bytes: np.ndarray
    transient_bytes: np.ndarray
    network_bytes: np.ndarray
    exchange_bytes: dict[str, np.ndarray]
    pairs: int
    kept: int
    trimmed: int
    replicas: int
    binding: tuple[str, ...] = ()
    plan_ms: float = 0.0
    gemm_rank_ms: dict[str, np.ndarray] = field(default_factory=dict)
    work: Optional[LayerWork] = None
    main_grad: str = "fused"
    moe_recompute: bool = False

    @property
    def total_ms(self) -> float:
        return float(sum(self.phase_ms.values()))


def _replica_matrix(plan: ControlPlan, owner: np.ndarray) -> np.ndarray:
    """``[P(owner), P(holder)]`` replicas of the call."""
    holds = plan.holds.numpy().copy()
    holds[np.arange(len(owner)), owner] = False
    ranks = holds.shape[1]
    out = np.zeros((ranks, ranks), dtype=np.int64)
    experts, holders = np.nonzero(holds)
    np.add.at(out, (owner[experts], holders), 1)
    return out


def _backward_pairs(plan: ControlPlan, owner: np.ndarray, holds_many: np.ndarray) -> np.ndarray:
    """``[P(src), P(holder)]`` kept pairs of the backward (sum over E of the assignment)."""
    counts = plan.counts.numpy()
    b = plan.backward_load.numpy()
    if plan.keeps_all:
        chunks = counts
    elif plan.source_split is not None:
        groups = plan.save_groups
        if groups is not None:  # save mode with replicas: per forward sub-chunk
            group_expert, group_rank, group_kept = (t.numpy() for t in groups)
            source_quota = plan.source_quota.numpy().copy()
            source_quota[:, group_expert] = 0
            out = rank_pair_rows(source_quota, np.zeros_like(b), owner, np.zeros_like(holds_many))
            onehot = np.zeros((len(group_rank), b.shape[1]), dtype=np.int64)
            onehot[np.arange(len(group_rank)), group_rank] = 1
            return out + group_kept @ onehot
        chunks = plan.source_quota.numpy()
    else:  # scope global: sources decided at run time; split B in proportion to the counts
        w = np.maximum(counts.sum(axis=0), 1)
        chunks = (counts * plan.quota.numpy()[None, :]) // w[None, :]
    return rank_pair_rows(chunks, b, owner, (b > 0).sum(axis=1) > 1)


def price_call(
    plan: ControlPlan,
    cost: CostModel,
    gemm: GemmTable,
    network: Network,
    stock: bool = False,
    layer: Optional[LayerCosts] = None,
    topk: Optional[int] = None,
    main_grad: str = "fused",
    moe_recompute: bool = False,
) -> CallPrice:
    """Price one planned call on every rank (see the module docstring).

    Args:
        plan: The controller's plan (made with ``cost``, so that ``plan.memory`` exists).
        cost: Bytes per row and per replica.
        gemm: The GEMM table at ``cost``'s shape (:meth:`GemmTable.for_shape`).
        network: All-to-all pricing.
        stock: Price the memory as stock Megatron's (``MemoryPlan.stock_*``).
        layer: Also price the router, elementwise work, ``main_grad`` and the host
            (:class:`LayerCosts`); None: GEMMs and exchanges only.
        topk: The router's top-k (tokens = pairs / top-k); needed with ``layer``.
        main_grad: ``"fused"`` (the weight gradients accumulate into fp32 ``main_grad`` in the
            GEMM) or ``"none"`` (bf16 gradients, no accumulation in the layer).
        moe_recompute: Megatron's MoE-layer recompute: held from forward to backward is the
            layer's input alone (tokens x H per rank; needs ``topk``); what the call would hold
            becomes part of its transient, and the forward's phases run again
            (``moe_recompute``).
    """
    memory = plan.memory
    if memory is None:
        raise ValueError("price_call: the plan has no memory plan; call plan_call with a cost")
    if main_grad not in MAIN_GRAD_MODES:
        raise ValueError(f"price_call: main_grad ({main_grad!r}) must be one of {MAIN_GRAD_MODES}")
    counts = plan.counts.numpy()
    owner = plan.owner.numpy()
    a, b = plan.forward_load.numpy(), plan.backward_load.numpy()
    holds_many = plan.holds.numpy().sum(axis=1) > 1
    multi = plan.ep_size > 1
    row = cost.row_bytes
    forward_pairs = rank_pair_rows(counts, a, owner, holds_many)
    backward_pairs = forward_pairs if plan.keeps_all else _backward_pairs(plan, owner, holds_many)
    lean = plan.activation_mode == "lean" and not plan.keeps_all
    recompute = plan.activation_mode == "recompute" and not plan.keeps_all or lean
    grad_row = row * (2 if recompute and multi and not lean else 1)  # lean: token rows alone
    weights = cost.replica_bytes // (cost.param_bytes + cost.grad_bytes) * cost.param_bytes
    replicas = _replica_matrix(plan, owner)
    exchanges = {
        "dispatch": forward_pairs * row,
        "replica_fetch": replicas * weights,
        "combine": forward_pairs.T * row,
        "grad": backward_pairs * grad_row + (forward_pairs * row if lean else 0),
        "dgrad": backward_pairs.T * row,
        "replica_grads": replicas.T * weights,
    }
    fwd = gemm.rank_ms("fc1", a) + gemm.rank_ms("fc2", a)
    bwd = 2.0 * (gemm.rank_ms("fc1", b) + gemm.rank_ms("fc2", b))
    if recompute:
        bwd = bwd + gemm.rank_ms("fc1", b)
    if lean:  # the router gradient: fc2's input gradient over every computed row
        bwd = bwd + gemm.rank_ms("fc2", a)
    work = None
    if topk is not None:
        if topk <= 0:
            raise ValueError(f"price_call: topk ({topk}) must be positive")
        pairs = counts.sum(axis=1)
        work = LayerWork(
            tokens=pairs / topk,
            pairs=pairs,
            forward_rows=a.sum(axis=0),
            kept_rows=b.sum(axis=0),
            kept_pairs=backward_pairs.sum(axis=1),
            experts=np.bincount(owner, minlength=plan.ep_size),
            num_experts=int(counts.shape[1]),
            trimmed=not plan.keeps_all,
            recompute=recompute,
            lean=lean,
        )
    elif layer is not None:
        raise ValueError("price_call: layer costs need the router's topk (tokens = pairs / topk)")
    off = ~np.eye(plan.ep_size, dtype=bool)
    network_bytes = sum(np.where(off, m, 0).sum(axis=1) for m in exchanges.values())
    if moe_recompute:  # the recomputed forward exchanges its rows (and fetches replicas) again
        network_bytes = network_bytes + sum(
            np.where(off, exchanges[k], 0).sum(axis=1)
            for k in ("dispatch", "replica_fetch", "combine")
        )
    if stock:
        held = memory.stock_saved_bytes.numpy()
        transient = np.maximum(
            memory.stock_backward_bytes.numpy(), memory.stock_forward_buffer_bytes.numpy()
        )
    else:
        held = memory.replica_bytes.numpy() + memory.saved_bytes.numpy()
        # lean's router-gradient rows of every computed pair: 0 in the other modes
        transient = np.maximum.reduce(
            [memory.backward_bytes.numpy(), memory.forward_buffer_bytes.numpy(),
             memory.router_bytes.numpy()]
        )  # fmt: skip
    if moe_recompute:  # the checkpointed input; the rest lives during this layer's backward
        if topk is None:
            raise ValueError(
                "price_call: Megatron's MoE-layer recompute holds the layer input (tokens = "
                "pairs / topk): give topk (the CLI: --topk K)"
            )
        transient = held + transient
        held = counts.sum(axis=1) // topk * cost.hidden_size * cost.activation_bytes
    price = CallPrice(
        phase_ms={},
        forward_rows=a.sum(axis=0),
        backward_rows=b.sum(axis=0),
        held_bytes=held,
        transient_bytes=transient,
        network_bytes=np.asarray(network_bytes, dtype=np.int64),
        exchange_bytes=exchanges,
        pairs=int(counts.sum()),
        kept=int(plan.quota.sum()),
        trimmed=int(plan.trimmed_pairs),
        replicas=int(plan.num_replicas),
        binding=tuple(plan.binding_budgets) + tuple(f"{u}!" for u in plan.unmet_budgets),
        plan_ms=plan.planner_time_s * 1e3,
        gemm_rank_ms={"gemm_fwd": fwd, "gemm_bwd": bwd},
        work=work,
        main_grad=main_grad,
        moe_recompute=moe_recompute,
    )
    return retime(price, cost, network, layer)


def retime(
    price: CallPrice, cost: CostModel, network: Network, layer: Optional[LayerCosts] = None
) -> CallPrice:
    """``price`` with its phases priced again under ``network`` and ``layer`` (the plan's rows
    and bytes as they are): what a fit of the constants evaluates many times.

    Each phase lasts as long as its slowest rank. With ``layer`` the host phases are what the
    GPU waits for the host: ``host_fwd = max(0, host floor - GPU forward phases) + sync``,
    ``host_bwd = max(0, host floor - GPU backward phases)``.
    """
    phase_ms = {name: 0.0 for name in PHASES}
    for name in _EXCHANGES:
        phase_ms[name] = float(network.alltoall_ms(price.exchange_bytes[name]).max())
    for name, ms in price.gemm_rank_ms.items():
        phase_ms[name] = float(ms.max())
    if layer is not None:
        if price.work is None:
            raise ValueError("retime: the call was priced without topk; layer costs need it")
        for name, ms in layer.gpu_ms(price.work, cost, price.main_grad).items():
            phase_ms[name] = float(ms.max())
        host_fwd, host_bwd, sync = layer.host_ms(price.work, price.main_grad)
        gpu_fwd = sum(phase_ms[p] for p in FORWARD_PHASES)
        gpu_bwd = sum(phase_ms[p] for p in BACKWARD_PHASES)
        phase_ms["host_fwd"] = max(0.0, host_fwd - gpu_fwd) + sync
        phase_ms["host_bwd"] = max(0.0, host_bwd - gpu_bwd)
    if price.moe_recompute:  # the whole forward again, before the backward
        phase_ms["moe_recompute"] = sum(phase_ms[p] for p in FORWARD_PHASES)
    return replace(price, phase_ms=phase_ms)


@dataclass
class PassResult:
    """One arm over one pass (L layer calls) at one P.

    Attributes:
        calls: The priced calls in layer order.
    """

    calls: list[CallPrice] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Per-pass totals: ``moe_ms`` (sum over layers of the slowest rank per phase), the
        per-phase split, peak rank loads (mean over layers of max / mean), memory and network
        bytes of the busiest rank, kept fraction, replicas, budgets that bound."""
        calls = self.calls
        phases = {p: sum(c.phase_ms[p] for c in calls) for p in PHASES}
        held = np.sum([c.held_bytes for c in calls], axis=0)
        transient = np.max([c.transient_bytes for c in calls], axis=0)
        network = np.sum([c.network_bytes for c in calls], axis=0)
        pairs = sum(c.pairs for c in calls)

        def imbalance(rows: list[np.ndarray]) -> float:
            return float(np.mean([r.max() / max(r.mean(), 1e-12) for r in rows]))

        return {
            "moe_ms": sum(phases.values()),
            "phase_ms": phases,
            "forward_peak_rows": float(np.mean([c.forward_rows.max() for c in calls])),
            "forward_imbalance": imbalance([c.forward_rows for c in calls]),
            "backward_peak_rows": float(np.mean([c.backward_rows.max() for c in calls])),
            "memory_bytes": int((held + transient).max()),
            "network_bytes": int(network.max()),
            "kept_fraction": sum(c.kept for c in calls) / max(pairs, 1),
            "trimmed_pairs": sum(c.trimmed for c in calls),
            "replicas": sum(c.replicas for c in calls),
            "binding_calls": sum(1 for c in calls if c.binding),
            "unmet_calls": sum(1 for c in calls if any(b.endswith("!") for b in c.binding)),
            "plan_ms": sum(c.plan_ms for c in calls),
        }


def stock_references(plans: Sequence[ControlPlan]) -> tuple[int, int]:
    """What relative budgets scale: the stock arm's bytes per rank as a perfectly balanced
    stock would hold them (the mean over ranks, median over the pass's calls) of budgeted
    memory (saved activations + backward working rows of its plan) and of the backward
    gradient exchange (the larger of sent and received)."""
    memory = [float(p.memory.budgeted_bytes.double().mean()) for p in plans]
    exchange = [float(p.memory.exchange_bytes.double().mean()) for p in plans]
    return int(np.median(memory)), int(np.median(exchange))


def replay_pass(
    counts: np.ndarray,
    arms: Iterable[Arm],
    cost: CostModel,
    gemm: GemmTable,
    network: Network,
    check: bool = False,
    layer: Optional[LayerCosts] = None,
    topk: Optional[int] = None,
    main_grad: str = "fused",
) -> dict[str, PassResult]:
    """Every arm over one pass of ``[L, P, E]`` counts (already at the replay's P).

    The stock arm runs first (relative budgets need its references; it is added if missing).
    ``layer``, ``topk``, ``main_grad``: as :func:`price_call` takes them.

    Returns:
        ``arm name -> PassResult``, the stock arm under ``"stock"``.
    """
    arms = list(arms)
    if not any(a.name == "stock" for a in arms):
        arms.insert(0, parse_arm("stock"))
    arms.sort(key=lambda a: not a.stock)
    table = gemm.for_shape(cost)
    results: dict[str, PassResult] = {}
    refs = (0, 0)
    for arm in arms:
        config = arm.config(*refs)
        result = PassResult()
        plans = []
        for layer_counts in counts:
            plan = plan_call(layer_counts, 0, config, cost, check=check)
            plans.append(plan)
            result.calls.append(
                price_call(
                    plan, cost, table, network, arm.stock, layer, topk, main_grad,
                    arm.moe_recompute,
                )
            )
        if arm.stock:
            refs = stock_references(plans)
        results[arm.name] = result
    return results
