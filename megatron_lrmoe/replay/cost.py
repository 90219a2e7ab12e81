"""The replay's cost model: grouped-GEMM time from a measured table, all-to-all time from bytes.

Shape legend: P EP ranks, E experts, H hidden, F expert FFN width, F1 fc1 width (2F gated).

GEMM. :class:`GemmTable` holds, per projection (fc1 ``[F1, H]``, fc2 ``[H, F]``), the time of one
grouped GEMM over ``groups`` experts of ``r`` rows each, for a grid of ``r``. A rank's grouped
GEMM over its experts (owned and replicas) with rows ``r_e`` is priced as the sum of per-expert
times ``t(r_e) = table(r_e) / groups``: piecewise linear between the table's points, the
smallest point's time for ``0 < r`` below it (a group costs at least its first tile), the last
segment's slope above the grid (throughput-bound), 0 for an empty group. Forward: fc1 + fc2 on
the rows computed. Backward: dgrad and wgrad of both projections (twice the forward's GEMMs, the
same FLOPs per row) on the rows whose backward runs there, plus fc1 again in ``recompute`` mode.
Elementwise work (activation, scaling, gathers) and launch gaps are not priced. A table measured
at another shape is scaled by the ratio of weight sizes (FLOPs per row), see
:meth:`GemmTable.for_shape`.

Network. :class:`Network` prices one all-to-all from its ``[P, P]`` bytes (sender, receiver):
ranks ``g // gpus_per_node`` share a node. A rank's time is the slower of its intra-node and its
inter-node part, each ``latency + max(bytes sent, bytes received) / bandwidth`` over the links
of that class (its NVLink port, its own NIC), both running at once; bytes a rank keeps cost
nothing. The collective ends with its slowest rank.

The rest of a layer call. :class:`LayerCosts` prices what the GEMM table and the network leave
out, from the rows of the call's plan (:class:`LayerWork`) and a few constants, each with a
physical meaning (their values: fitted to committed GPU measurements by
``benchmarks/replay_fit.py``, see :data:`DEFAULT_LAYER_COSTS`):

* the router (Megatron's ``TopKRouter``: its GEMM, scores, top-k, auxiliary loss) and what a
  layer adds around the experts (the residual stream), forward and again backward:
  ``router_fixed_ms + tokens * (router_token_ns + E * router_score_ns)``;
* the experts' elementwise and row-moving kernels, as bytes moved over ``memory_gbps``: forward,
  the permutation of token rows into pair order and back (read T, write N rows of H, twice) and
  the activation (read F1, write F per row computed); backward with every pair kept, the
  gradient rows and the input-gradient gather-sum (T + N rows of H each) and the activation
  backward (read F1 and F, write F1 per kept row); the trimmed backward, the scoring pass over
  every pair (T + N rows of H: the router gradient's row dots), the packing of the kept pairs'
  gradient rows (read and write H; also the token rows at EP 1 and in ``recompute`` mode), the
  activation backward on the kept rows (plus its forward again in ``recompute`` mode), the
  gather-sum over the kept rows (kept + T rows of H), and a fixed ``trimmed_fixed_ms`` (the
  selection's passes over the quota table, the small kernels of the front); in ``lean`` mode
  the scoring reads no z row, and every computed row's gradient row is gathered (read and write
  H) and its fc2 input gradient dotted with the saved activation (read 2F);
* the fp32 ``main_grad`` accumulation fused into the weight-gradient GEMMs
  (``main_grad="fused"``, Megatron's default with ``gradient_accumulation_fusion``): every
  owned expert's ``[F1, H]`` and ``[H, F]`` fp32 buffers read and written once by the atomic
  adds, less the bf16 gradient the table's GEMM writes, i.e. :data:`MAIN_GRAD_BYTES` per
  parameter over ``main_grad_gbps``, whatever the rows (the fixed cost the trimmed backward
  cannot trim);
* the host: a layer's forward takes at least ``host_fwd_ms`` and its backward at least
  ``host_bwd_ms`` (``host_trimmed_bwd_ms`` for a trimmed backward launched kernel by kernel,
  i.e. not replayed as one CUDA graph: at EP > 1 or without fused ``main_grad``) of host time;
  when the GPU work is shorter the GPU waits for the host. At P > 1 the forward also waits
  ``sync_ms`` for the host to turn the all-gathered counts around (device-to-host copy, the
  controller's plan, the dispatch's first launches).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from megatron_lrmoe.control.costs import CostModel

__all__ = [
    "DEFAULT_GEMM_TABLE",
    "DEFAULT_LAYER_COSTS",
    "GemmTable",
    "LayerCosts",
    "LayerWork",
    "MAIN_GRAD_MODES",
    "Network",
    "load_costs",
    "load_gemm_table",
]

GEMM_TABLE_FORMAT = "lrmoe-gemm-table"
COSTS_FORMAT = "lrmoe-replay-costs"


@dataclass(frozen=True)
class GemmTable:
    """Measured grouped-GEMM times (milliseconds) per projection against rows per expert.

    Attributes:
        rows_per_expert: The grid, ascending, positive.
        fc1_ms: Time of one grouped GEMM over ``groups`` experts of fc1's shape, per grid point.
        fc2_ms: The same for fc2.
        groups: Experts in each measured grouped GEMM.
        hidden_size, ffn_hidden_size, gated: The measured shape (H, F, gated fc1).
        source: Where the numbers come from (files, device, command).
    """

    rows_per_expert: tuple[int, ...]
    fc1_ms: tuple[float, ...]
    fc2_ms: tuple[float, ...]
    groups: int
    hidden_size: int
    ffn_hidden_size: int
    gated: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        rows = np.asarray(self.rows_per_expert)
        n = len(rows)
        if n < 2 or len(self.fc1_ms) != n or len(self.fc2_ms) != n:
            raise ValueError(
                f"GemmTable: {n} grid points, {len(self.fc1_ms)} fc1 and {len(self.fc2_ms)} fc2 "
                "times; give at least two points and one time per point for each projection"
            )
        if rows[0] <= 0 or (np.diff(rows) <= 0).any():
            raise ValueError(
                f"GemmTable.rows_per_expert ({list(self.rows_per_expert)}) must be positive and "
                "strictly ascending"
            )
        if min(self.fc1_ms) <= 0 or min(self.fc2_ms) <= 0 or self.groups <= 0:
            raise ValueError("GemmTable: times and groups must be positive")

    def expert_ms(self, projection: str, rows: np.ndarray) -> np.ndarray:
        """Milliseconds of one expert's share of a grouped GEMM with ``rows`` rows (any shape).

        Args:
            projection: ``"fc1"`` or ``"fc2"``.
            rows: Non-negative row counts.
        """
        if projection not in ("fc1", "fc2"):
            raise ValueError(f"GemmTable: projection {projection!r} must be 'fc1' or 'fc2'")
        grid = np.asarray(self.rows_per_expert, dtype=np.float64)
        ms = np.asarray(self.fc1_ms if projection == "fc1" else self.fc2_ms) / self.groups
        r = np.asarray(rows, dtype=np.float64)
        slope = (ms[-1] - ms[-2]) / (grid[-1] - grid[-2])
        out = np.interp(r, grid, ms)  # below the grid: ms[0] (the first tile's floor)
        out = np.where(r > grid[-1], ms[-1] + slope * (r - grid[-1]), out)
        return np.where(r > 0, out, 0.0)

    def rank_ms(self, projection: str, rows_per_expert_rank: np.ndarray) -> np.ndarray:
        """``[P]`` ms of each rank's grouped GEMM from ``[E, P]`` rows (0 where not held)."""
        return self.expert_ms(projection, rows_per_expert_rank).sum(axis=0)

    def for_shape(self, cost: CostModel) -> "GemmTable":
        """This table rescaled to ``cost``'s shape by the ratio of each projection's weight
        elements (FLOPs per row); itself when the shape matches."""
        fc1_t = (2 if self.gated else 1) * self.ffn_hidden_size * self.hidden_size
        fc2_t = self.hidden_size * self.ffn_hidden_size
        fc1 = cost.fc1_width * cost.hidden_size / fc1_t
        fc2 = cost.hidden_size * cost.ffn_hidden_size / fc2_t
        if fc1 == 1.0 and fc2 == 1.0:
            return self
        return GemmTable(
            rows_per_expert=self.rows_per_expert,
            fc1_ms=tuple(t * fc1 for t in self.fc1_ms),
            fc2_ms=tuple(t * fc2 for t in self.fc2_ms),
            groups=self.groups,
            hidden_size=cost.hidden_size,
            ffn_hidden_size=cost.ffn_hidden_size,
            gated=cost.gated,
            source=f"{self.source}; scaled by weight size to H={cost.hidden_size}, "
            f"F={cost.ffn_hidden_size}, gated={cost.gated}",
        )

    def to_json(self) -> dict[str, Any]:
        return {"format": GEMM_TABLE_FORMAT, "version": 1, **asdict(self)}


def load_gemm_table(path: str | os.PathLike) -> GemmTable:
    """Read a table written by ``benchmarks/gemm_table.py`` (or :meth:`GemmTable.to_json`).

    Raises:
        ValueError: Not a GEMM table, or malformed (the message names the field).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != GEMM_TABLE_FORMAT:
        raise ValueError(
            f"{path} is not an {GEMM_TABLE_FORMAT} file (write one with "
            "python benchmarks/gemm_table.py --out FILE)"
        )
    fields = {k: data[k] for k in GemmTable.__dataclass_fields__ if k in data}
    for key in ("rows_per_expert", "fc1_ms", "fc2_ms"):
        fields[key] = tuple(fields[key])
    return GemmTable(**fields)


# The default table: torch's grouped GEMM (bf16, ``torch.nn.functional.grouped_mm``) over 128
# experts at the Qwen3-30B-A3B expert shape (H 2048, F 768, SwiGLU), one H200, the ``gemm_ms``
# column of benchmarks/wgrad_bench.py (the weight-gradient GEMM, group sizes drawn around the
# mean; the forward and dgrad GEMMs of a projection have the same FLOPs per row and are priced
# with it). Points 128-2048: benchmarks/results/gpu_run26/call2/wgrad_quick.json (one run);
# 4096: benchmarks/results/gpu_run12/wgrad_auto.json (the only committed point above 2048).
# Cross-check against /work/shared/measurements/h200_baseline.md: 64 experts x 2048 rows
# forward (fc1 + fc2 + activation) measured 2.35 ms; this table gives 1.86 ms of GEMMs.
# Re-measure with ``python benchmarks/gemm_table.py --out FILE`` on the GPU and pass --gemm-table.
DEFAULT_GEMM_TABLE = GemmTable(
    rows_per_expert=(128, 256, 512, 768, 1024, 1536, 2048, 4096),
    fc1_ms=(0.5084, 0.5854, 0.8059, 1.0471, 1.3571, 1.8997, 2.4554, 5.0740),
    fc2_ms=(0.3069, 0.3058, 0.4319, 0.5579, 0.6863, 0.9620, 1.2688, 2.2861),
    groups=128,
    hidden_size=2048,
    ffn_hidden_size=768,
    gated=True,
    source=(
        "H200, torch grouped_mm bf16, 128 experts: benchmarks/results/gpu_run26/call2/"
        "wgrad_quick.json (128-2048 rows), benchmarks/results/gpu_run12/wgrad_auto.json (4096)"
    ),
)

# NVLink within a node. The latency, and the bandwidth of an even all-to-all, fitted to the two
# NCCL all-to-all points of /work/shared/measurements/h200_baseline.md (2 x H200, 2048-wide bf16
# rows, half of each buffer crossing: 32768 rows at 264 GB/s, 131072 rows at 295 GB/s per GPU
# off-GPU traffic): t = 36 us + bytes / 307 GB/s (NCCL_NVLINK_GBPS; the H200's NVLink 4 peak is
# 450 GB/s per direction). The default bandwidth is the layer's own all-to-alls (uneven splits),
# fitted with the layer costs (benchmarks/replay_fit.py) to the four-all-to-all floors and layer
# times of the training runs: benchmarks/results/replay_validation/costs.json.
NCCL_NVLINK_GBPS = 307.0
NVLINK_GBPS = 259.6
NVLINK_LATENCY_US = 36.0
# Across nodes: one 400 Gb/s NIC per GPU (ConnectX-7 NDR, HGX H200 reference design; the
# issue's default), 50 GB/s per direction. Latency: an assumption (NCCL's inter-node all-to-all
# start-up plus an InfiniBand round trip, tens of microseconds); not measured in this repo.
NIC_GBPS = 50.0
NIC_LATENCY_US = 50.0
# GPUs per node: the HGX H200 board (NVLink reaches 8 GPUs).
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Network:
    """All-to-all pricing (see the module docstring); bandwidths in GB/s (1e9 bytes/s).

    Attributes:
        gpus_per_node: Ranks ``g`` with the same ``g // gpus_per_node`` share NVLink.
        intra_gbps, intra_latency_us: One rank's NVLink bandwidth per direction and the
            collective's fixed cost within a node.
        inter_gbps, inter_latency_us: One rank's NIC bandwidth per direction and the fixed cost
            of the inter-node part.
    """

    gpus_per_node: int = GPUS_PER_NODE
    intra_gbps: float = NVLINK_GBPS
    intra_latency_us: float = NVLINK_LATENCY_US
    inter_gbps: float = NIC_GBPS
    inter_latency_us: float = NIC_LATENCY_US
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.intra_gbps <= 0 or self.inter_gbps <= 0:
            raise ValueError(
                f"Network: gpus_per_node ({self.gpus_per_node}) must be >= 1 and bandwidths "
                f"({self.intra_gbps}, {self.inter_gbps} GB/s) positive"
            )

    def _same_node(self, ranks: int) -> np.ndarray:
        mask = self._masks.get(ranks)
        if mask is None:
            node = np.arange(ranks) // self.gpus_per_node
            mask = self._masks[ranks] = node[:, None] == node[None, :]
        return mask

    def alltoall_ms(self, bytes_matrix: np.ndarray) -> np.ndarray:
        """``[P]`` milliseconds each rank spends in one all-to-all of ``[P, P]`` bytes
        (``[sender, receiver]``; the diagonal is free). 0 for every rank when nothing moves."""
        b = np.asarray(bytes_matrix, dtype=np.float64)
        ranks = b.shape[0]
        if b.shape != (ranks, ranks):
            raise ValueError(f"Network: bytes must be [P, P], got shape {b.shape}")
        same = self._same_node(ranks)
        off = ~np.eye(ranks, dtype=bool)
        times = []
        for mask, gbps, latency_us in (
            (same & off, self.intra_gbps, self.intra_latency_us),
            (~same, self.inter_gbps, self.inter_latency_us),
        ):
            part = np.where(mask, b, 0.0)
            volume = np.maximum(part.sum(axis=1), part.sum(axis=0))
            t = volume / (gbps * 1e6)  # GB/s -> bytes per ms
            times.append(np.where(volume > 0, t + latency_us * 1e-3, 0.0))
        return np.maximum(times[0], times[1])


# -- the rest of a layer call ---------------------------------------------------------------

MAIN_GRAD_MODES = ("fused", "none")
# Bytes per expert parameter that the fused fp32 main_grad accumulation moves beyond the table's
# GEMM: the fp32 buffer read (4) and written (4) by the atomic adds, less the bf16 gradient (2)
# that the table's weight-gradient GEMM writes and the fused kernel does not.
MAIN_GRAD_BYTES = 6


@dataclass(frozen=True, eq=False)
class LayerWork:
    """One layer call's rows per rank, what :class:`LayerCosts` prices (``[P]`` arrays).

    Attributes:
        tokens: Tokens each rank routes (its pairs over top-k).
        pairs: Pairs each rank routes (source side, N).
        forward_rows: Rows each rank's experts and replicas compute in forward (A).
        kept_rows: Rows whose expert backward runs on each rank (B).
        kept_pairs: Kept pairs of each rank's tokens (source side).
        experts: Experts each rank owns (their ``main_grad`` lives there).
        num_experts: E, the router's width.
        trimmed: The call's backward is the trimmed path (not every pair kept).
        recompute: The trimmed backward runs in ``recompute`` mode (or ``lean``).
        lean: The trimmed backward runs in ``lean`` mode: no z to read in the scoring; every
            computed row's gradient row gathered and its fc2 input gradient dotted with the
            saved activation (the router gradient).
    """

    tokens: np.ndarray
    pairs: np.ndarray
    forward_rows: np.ndarray
    kept_rows: np.ndarray
    kept_pairs: np.ndarray
    experts: np.ndarray
    num_experts: int
    trimmed: bool = False
    recompute: bool = False
    lean: bool = False

    @property
    def ranks(self) -> int:
        return int(len(self.tokens))


def elementwise_bytes(work: LayerWork, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """``([P] forward, [P] backward)`` bytes the experts' elementwise and row-moving kernels
    read and write on each rank (the module docstring lists the passes)."""
    a, h, f, f1 = cost.activation_bytes, cost.hidden_size, cost.ffn_hidden_size, cost.fc1_width
    t = np.asarray(work.tokens, dtype=np.float64)
    n = np.asarray(work.pairs, dtype=np.float64)
    rows_a = np.asarray(work.forward_rows, dtype=np.float64)
    rows_b = np.asarray(work.kept_rows, dtype=np.float64)
    kept = np.asarray(work.kept_pairs, dtype=np.float64)
    forward = 2 * a * h * (t + n) + a * rows_a * (f1 + f)
    activation_bwd = a * rows_b * (2 * f1 + f)
    if not work.trimmed:
        return forward, 2 * a * h * (t + n) + activation_bwd
    packs_x = work.ranks == 1 or work.recompute
    backward = (
        a * h * (t + (0.0 if work.lean else n))  # scoring: the token's gradient row, each z row
        + (a * rows_a * (2 * h + 2 * f) if work.lean else 0.0)  # lean: gather g, dot u . a
        + 2 * a * h * kept * (2 if packs_x else 1)  # packing: read and write the kept rows
        + activation_bwd
        + (a * rows_b * (f1 + f) if work.recompute else 0.0)  # the activation again
        + a * h * (kept + t)  # gather-sum of the kept pairs' input-gradient rows
    )
    return forward, backward


def main_grad_bytes(work: LayerWork, cost: CostModel, main_grad: str = "fused") -> np.ndarray:
    """``[P]`` bytes of the fused fp32 ``main_grad`` accumulation (:data:`MAIN_GRAD_BYTES` per
    owned expert parameter; 0 with ``main_grad="none"``)."""
    if main_grad not in MAIN_GRAD_MODES:
        raise ValueError(f"main_grad ({main_grad!r}) must be one of {MAIN_GRAD_MODES}")
    if main_grad == "none":
        return np.zeros(work.ranks)
    params = cost.fc1_width * cost.hidden_size + cost.hidden_size * cost.ffn_hidden_size
    return np.asarray(work.experts, dtype=np.float64) * params * MAIN_GRAD_BYTES


@dataclass(frozen=True)
class LayerCosts:
    """What a layer call costs beyond its grouped GEMMs and all-to-alls (module docstring).

    Attributes:
        memory_gbps: Effective memory bandwidth (GB/s) of the experts' elementwise and
            row-moving kernels (HBM3e peak on an H200: 4800).
        trimmed_fixed_ms: GPU time of a trimmed backward that does not scale with its rows.
        router_fixed_ms: GPU time per call of the router's kernels that do not scale with the
            tokens (reductions over the experts, small launches), each of forward and backward.
        router_token_ns: GPU time per routed token of the router's and the residual stream's
            row passes, each of forward and backward.
        router_score_ns: GPU time per token and expert of the router's score passes (softmax,
            top-k, auxiliary loss over ``[T, E]``), each of forward and backward.
        main_grad_gbps: Effective bandwidth (GB/s) of the fused fp32 ``main_grad``
            accumulation's :data:`MAIN_GRAD_BYTES` per parameter.
        host_fwd_ms: Host time to queue one layer forward (a floor under its GPU time).
        host_bwd_ms: The same for a backward with every pair kept, or trimmed and replayed as
            one CUDA graph (EP 1 with fused ``main_grad``).
        host_trimmed_bwd_ms: The same for a trimmed backward launched kernel by kernel.
        sync_ms: At P > 1, the GPU's wait in each forward while the host turns the
            all-gathered counts around.
        source: Where the values come from.
    """

    memory_gbps: float
    trimmed_fixed_ms: float
    router_fixed_ms: float
    router_token_ns: float
    router_score_ns: float
    main_grad_gbps: float
    host_fwd_ms: float
    host_bwd_ms: float
    host_trimmed_bwd_ms: float
    sync_ms: float
    source: str = ""

    CONSTANTS = (
        "memory_gbps",
        "trimmed_fixed_ms",
        "router_fixed_ms",
        "router_token_ns",
        "router_score_ns",
        "main_grad_gbps",
        "host_fwd_ms",
        "host_bwd_ms",
        "host_trimmed_bwd_ms",
        "sync_ms",
    )

    def __post_init__(self) -> None:
        for name in self.CONSTANTS:
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0 or (name.endswith("gbps") and value == 0):
                raise ValueError(
                    f"LayerCosts.{name} ({value!r}) must be finite and >= 0 (bandwidths > 0)"
                )

    def gpu_ms(
        self, work: LayerWork, cost: CostModel, main_grad: str = "fused"
    ) -> dict[str, np.ndarray]:
        """``[P]`` GPU milliseconds per rank of the phases ``router``, ``elementwise_fwd``,
        ``elementwise_bwd``, ``main_grad`` and ``router_bwd``."""
        forward, backward = elementwise_bytes(work, cost)
        per_ms = self.memory_gbps * 1e6  # GB/s -> bytes per ms
        router = self.router_fixed_ms + np.asarray(work.tokens, dtype=np.float64) * (
            self.router_token_ns + work.num_experts * self.router_score_ns
        ) * 1e-6
        fixed = self.trimmed_fixed_ms if work.trimmed else 0.0
        return {
            "router": router,
            "elementwise_fwd": forward / per_ms,
            "elementwise_bwd": backward / per_ms + fixed,
            "main_grad": main_grad_bytes(work, cost, main_grad) / (self.main_grad_gbps * 1e6),
            "router_bwd": router,
        }

    def host_ms(self, work: LayerWork, main_grad: str = "fused") -> tuple[float, float, float]:
        """``(forward floor, backward floor, forward sync)`` host milliseconds of the call."""
        graphed = work.ranks == 1 and main_grad == "fused"
        eager_trimmed = work.trimmed and not graphed
        backward = self.host_trimmed_bwd_ms if eager_trimmed else self.host_bwd_ms
        return self.host_fwd_ms, backward, self.sync_ms if work.ranks > 1 else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_costs(path: str | os.PathLike) -> tuple[LayerCosts, dict[str, float]]:
    """Read fitted costs (``benchmarks/replay_fit.py --out``): the layer costs and the
    :class:`Network` fields the file sets (``intra_gbps``).

    Raises:
        ValueError: Not a costs file, or a constant missing (the message names it).
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") != COSTS_FORMAT:
        raise ValueError(
            f"{path} is not an {COSTS_FORMAT} file (write one with "
            "python benchmarks/replay_fit.py --out FILE)"
        )
    layer = data.get("layer", {})
    missing = [k for k in LayerCosts.CONSTANTS if k not in layer]
    if missing:
        raise ValueError(f"{path}: layer constants {missing} missing")
    fields = {k: float(layer[k]) for k in LayerCosts.CONSTANTS}
    costs = LayerCosts(**fields, source=str(data.get("source", os.fspath(path))))
    network = {k: float(v) for k, v in data.get("network", {}).items()}
    unknown = set(network) - {"intra_gbps", "intra_latency_us", "inter_gbps", "inter_latency_us"}
    if unknown:
        raise ValueError(f"{path}: network fields {sorted(unknown)} are not Network's")
    return costs, network


# The committed fit (benchmarks/replay_fit.py on the training runs of its TRAINING split;
# benchmarks/results/replay_validation/costs.json holds the same values, the split, the start
# and the training objective; tests/test_replay.py checks they agree).
DEFAULT_LAYER_COSTS = LayerCosts(
    memory_gbps=3527.0,
    trimmed_fixed_ms=0.08004,
    router_fixed_ms=0.07937,
    router_token_ns=18.63,
    router_score_ns=0.2038,
    main_grad_gbps=4691.0,
    host_fwd_ms=2.251,
    host_bwd_ms=1.901,
    host_trimmed_bwd_ms=5.239,
    sync_ms=1.92,
    source="benchmarks/results/replay_validation/costs.json (benchmarks/replay_fit.py)",
)
