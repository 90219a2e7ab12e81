"""The backward's front as one replayed CUDA graph: the scoring and the selection, and behind
them the router gradient's row-dot and the packing of the kept rows.

Shapes: T tokens, H hidden, N pairs, S slots per token, G segments, K kept rows.

What it captures: the token norms and their maxima, the pair scores with their poison and total,
the selection (``select/select_triton.py``'s launches) and, with a front (:class:`FrontBuffers`),
the router gradient ``<g[t], z[i]>`` of every pair and the kept pairs' rows packed for the expert
backward. Why: launched one by one these are many small kernels, each with its host launch work;
a replay is one host-to-device copy of an argument block and one graph launch, the same kernels
on the same inputs (read in place at the addresses the block carries), so the same bits. A
shape is captured the second time it is seen.

Where it is used:

* :func:`replayed_score_and_select`: ``scoring.score_and_select``, replayed where it can be
  (``op/stages.py``, ``select_kept``);
* :func:`front_triton`: the whole front (``op/stages.py``, ``replayed_front``);
* :func:`scored_call` and :class:`FrontWork`: the argument block and the launches that
  ``graphs/backward.py`` captures together with the expert backward, one graph per layer.

It builds on the selection's own graph in ``select/select_triton.py``: :class:`FrontWork`
extends its ``CapturedSelection`` (the segment table, the selection's outputs, the capture) and the
captures go into its cache (``select_triton.GRAPHS``: at most 8 graphs of either kind). That
cache, the switch ``graphs_wanted`` and ``host_block`` are looked up in that module at call
time, so that a replacement there (``testing/host_graphs.py``, the tests) reaches both.

Switches (the active kernel options, ``options.active_kernels()``: the running layer's
``LRMoEConfig.kernels``): ``score_graphs`` off keeps the scoring (and so the front) out of the
replayed selection, ``front_graphs`` off the row-dot and the packing; ``select_graphs`` off
turns every one of these graphs off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_lrmoe import triton_common as tc
from megatron_lrmoe.dispatch import rows_triton
from megatron_lrmoe.options import active_kernels
from megatron_lrmoe.select import contract, scores_triton, scoring, select_triton
from megatron_lrmoe.select.select_triton import (
    HOST_ROWS,
    ROW_BLOCK,
    ROW_QUOTA,
    ROW_SLOT,
    ROW_UNIFORM,
    CapturedSelection,
    MergeTile,
    launch_selection,
    merge_tile,
    selection_kernels,
)
from megatron_lrmoe.triton_common import device_ctx, use_triton

__all__ = [
    "Front",
    "FrontBuffers",
    "FrontWork",
    "ScoreInputs",
    "ScoredCall",
    "front_graphs_wanted",
    "front_triton",
    "replayed_score_and_select",
    "score_select_triton",
    "scored_call",
]


class ScoreInputs(NamedTuple):
    """The tensors :func:`score_select_triton` scores (read in place by a replayed graph)."""

    g: torch.Tensor  # [T, H] gradient rows
    x: torch.Tensor  # [T, H] input rows
    probs: torch.Tensor  # [N] routing weight of each pair
    token: torch.Tensor  # [N] token of each pair


def _graph_scorable(inputs: ScoreInputs) -> bool:
    """Whether a captured graph can score ``inputs`` in place (else the caller scores eagerly)."""
    g, x, probs, token = inputs
    return (
        g.dim() == 2
        and g.shape == x.shape
        and g.shape[0] > 0
        and g.dtype in tc.KERNEL_DTYPES
        and x.dtype in tc.KERNEL_DTYPES
        and probs.dim() == 1
        and probs.dtype in tc.KERNEL_DTYPES
        and token.shape == probs.shape
        and token.dtype in (torch.int32, torch.int64)
        and probs.is_contiguous()
        and token.is_contiguous()
        and tc.args_ready(g, x, probs, token)
    )


class FrontBuffers(NamedTuple):
    """The rest of the trimmed backward's front that :func:`front_triton` runs in the same
    graph: the router gradient's row-dot and the packing of the kept rows. Per-call tensors,
    read or written in place by a replayed graph."""

    z: torch.Tensor  # [N, H] the pairs' expert outputs: d_probs[i] = <g[token of i], z[i]>
    slots: torch.Tensor  # [T, S] int64 the pair of each token slot, -1 for none
    d_probs: torch.Tensor  # [N] written: the router gradient of every pair
    g_kept: torch.Tensor  # [K, H] written: the kept pairs' gradient rows times p * w (+ poison)
    x_kept: torch.Tensor | None  # [K, H] written: their input rows (None: not packed)
    # The kept rows live in the caller's graph (graphs/backward.py): g_kept / x_kept are
    # then [0, H] stand-ins that only say the rows' dtype and whether inputs are packed, and the
    # graph writes its rows' addresses into the argument block (ARG_G_OUT, ARG_X_OUT) before the
    # front's launches read them.
    rows_in_graph: bool = False


class Front(NamedTuple):
    """What :func:`front_triton` hands out besides the caller's buffers."""

    scored: contract.Scored
    row_of_pair: torch.Tensor | None  # [N + 1] int64 packed row of each pair, -1 if not kept
    # (None from a graph without a front: score_select_triton)


def _front_ready(inputs: ScoreInputs, front: FrontBuffers, num_kept: int) -> bool:
    """Whether a captured graph can run ``front`` on ``inputs`` in place."""
    g, x, probs, _ = inputs
    z, slots, d_probs, g_kept, x_kept, rows_in_graph = front
    n, (t, h) = probs.shape[0], g.shape
    outputs_ok = (
        d_probs.shape == probs.shape
        and d_probs.dtype in tc.KERNEL_DTYPES
        and d_probs.is_contiguous()
        and g_kept.shape == (0 if rows_in_graph else num_kept, h)
        and g_kept.dtype == g.dtype
        and g_kept.is_contiguous()
        and (
            x_kept is None
            or (
                x_kept.shape == g_kept.shape
                and x_kept.dtype == x.dtype
                and x_kept.is_contiguous()
            )
        )
    )
    return (
        outputs_ok
        and z.shape == (n, h)
        and z.dtype in tc.KERNEL_DTYPES
        and slots.dim() == 2
        and slots.shape[0] == t
        and slots.numel() >= n
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and tc.args_ready(z, slots, d_probs, g_kept)
        and (x_kept is None or tc.args_ready(x_kept))
    )


def replayed_score_and_select(
    policy: str,
    g: torch.Tensor,
    x: torch.Tensor,
    probs: torch.Tensor,
    token: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    kept_total: bool = False,
    owned: bool = True,
) -> contract.Scored:
    """``scoring.score_and_select``, on CUDA from the second call of a shape on as one replayed
    CUDA graph that reads ``g``, ``x``, ``probs`` and ``token`` in place
    (:func:`score_select_triton`: the same kernels, so the same bits); elsewhere, and where the
    graph cannot take the inputs, ``scoring.score_and_select``'s steps one by one. Arguments and
    outputs as there.
    """
    if use_triton(g, x, probs, token):
        fused = score_select_triton(
            policy, g, x, probs, token, counts, quota, uniforms,
            kept_total=kept_total, owned=owned,
        )
        if fused is not None:
            return fused
    return scoring.score_and_select(
        policy, g, x, probs, token, counts, quota, uniforms, kept_total=kept_total, owned=owned
    )


def score_select_triton(
    policy: str,
    g: torch.Tensor,
    x: torch.Tensor,
    probs: torch.Tensor,
    token: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    *,
    kept_total: bool = False,
    owned: bool = True,
) -> contract.Scored | None:
    """``scoring.score_and_select`` as one replayed CUDA graph, or ``None`` where it cannot be.

    The token norms, their maxima, the pair scores with their poison and total, and the
    selection (``select_triton``'s kernels) are captured together per shape, the second time a
    shape is seen, and replayed with the call's ``g``, ``x``, ``probs``, ``token`` read in place
    (their addresses go into the graph with the segment table). Same kernels on the same inputs
    as the eager composition, so the same bits.

    ``None`` (the caller then scores and selects eagerly, which is also what the first sighting
    of a shape does): not CUDA, graphs off (``select_graphs``, or ``score_graphs`` for this
    one only, off in the active kernel options) or inside another capture, device-side
    uniforms, nothing to keep, or inputs the graph cannot read in place (dtypes, layouts,
    alignment: ``_graph_scorable``). Invalid inputs raise as in
    ``select_triton``; ``owned`` as there (for every output). The kept scores' sum
    (``kept_total``) is taken over the rows of the kept buffer below the device's kept count,
    so its fp32 rounding may differ from the eager sum's in the last bits.
    """
    if not (active_kernels().score_graphs and select_triton.graphs_wanted(probs.device)):
        return None
    inputs = ScoreInputs(g, x, probs, token)
    call = scored_call(policy, inputs, counts, quota, uniforms, None, kept_total)
    run = _replay_scored(call, owned)
    return None if run is None else run.scored


def front_triton(
    policy: str,
    g: torch.Tensor,
    x: torch.Tensor,
    probs: torch.Tensor,
    token: torch.Tensor,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None,
    front: FrontBuffers,
    *,
    kept_total: bool = False,
    owned: bool = True,
) -> Front | None:
    """:func:`score_select_triton` with the router gradient's row-dot and the packing of the
    kept rows behind it, all in one replayed graph; ``None`` where it cannot be.

    Besides the scores and the selection, a replay writes ``front.d_probs`` (``row_dot`` with
    ``slots``: ``<g[t], z[i]>`` for every pair), ``front.g_kept`` and ``front.x_kept``
    (``pack_pairs`` of the kept pairs, in kept order, their routing weights and sample weights
    and the scores' poison applied) and a map from every pair to its packed row, -1 for the
    pairs not kept (``Front.row_of_pair``, :func:`gather_sum_triton`'s ``row_of``). The kept
    rows are ``sum(quota)`` (host integers), which the buffers must match. The row-dot and the
    packing are one walk over the tokens (``row_dot_pack_from_args``: each token's rows read
    once for its pairs) that does the eager ``row_dot_triton``'s and ``pack_pairs_triton``'s
    arithmetic in their order, so the same bits (``test_interp_row_dot_and_packing_in_one_walk``).

    ``None`` as :func:`score_select_triton`, also with ``front_graphs`` off or buffers the
    graph cannot use in place (``_front_ready``). ``row_of_pair`` is a graph buffer (valid until
    the next replay) unless ``owned``; the other outputs are the caller's.
    """
    if front.rows_in_graph:
        raise ValueError("front_triton packs into the caller's buffers: rows_in_graph is for "
                         "the layer graph (graphs/backward.run_layer_graph)")
    if not front_graphs_wanted(probs.device):
        return None
    inputs = ScoreInputs(g, x, probs, token)
    return _replay_scored(
        scored_call(policy, inputs, counts, quota, uniforms, front, kept_total), owned
    )


def front_graphs_wanted(device: torch.device) -> bool:
    """Whether :func:`front_triton` may replay a graph on ``device`` at all (CUDA, outside
    another capture, none of ``front_graphs``, ``score_graphs``, ``select_graphs`` off in the
    active kernel options), so that a caller can skip preparing its buffers."""
    kernels = active_kernels()
    return (
        kernels.front_graphs and kernels.score_graphs and select_triton.graphs_wanted(device)
    )


def _replay_scored(call: ScoredCall | None, owned: bool) -> Front | None:
    """:func:`score_select_triton` and :func:`front_triton` after :func:`scored_call`: the
    captured graph of ``call``'s key replayed (captured on the key's second sighting), or
    ``None`` where ``call`` is ``None`` or the key is new."""
    if call is None:
        return None
    entry, capture = select_triton.GRAPHS.lookup(call.key)
    if entry is None and not capture:
        return None
    with device_ctx(call.inputs.probs):
        if entry is None:
            entry = _CapturedScored(call)
            select_triton.GRAPHS.add(call.key, entry)
            return entry.front(call.num_kept, True)
        return entry.run_scored(call.host, call.num_kept, owned)


class ScoredCall(NamedTuple):
    """One call of a replayed front (:func:`scored_call`): what its graph is keyed by, the
    filled argument block and segment table (pinned, for one host-to-device copy), and what a
    :class:`FrontWork` is built from."""

    key: tuple
    host: torch.Tensor  # [ARG_SLOTS + HOST_ROWS * G] int64
    num_kept: int
    inputs: ScoreInputs
    sample: bool
    kept_total: bool
    front: FrontBuffers | None
    sort: MergeTile | None


def scored_call(
    policy: str,
    inputs: ScoreInputs,
    counts: torch.Tensor,
    quota: torch.Tensor,
    uniforms: torch.Tensor | None,
    front: FrontBuffers | None,
    kept_total: bool,
) -> ScoredCall | None:
    """The checks and the argument block of a replayed scoring (and ``front``) of ``inputs``;
    ``None`` where a graph cannot take them in place (the caller runs the stages eagerly).
    The caller has checked that graphs may run on the device (:func:`front_graphs_wanted`)."""
    sample = contract.check_policy(policy, uniforms)
    if not _graph_scorable(inputs):
        return None
    g, x, probs, token = inputs
    n = probs.numel()
    counts_h, quota_h = contract.host_segments(counts, quota, n)
    num_segments = counts_h.numel()
    if sample:
        contract.check_uniforms(uniforms, num_segments)
        if uniforms.device.type != "cpu":
            return None
    host = select_triton.host_block(
        counts_h, quota_h, uniforms if sample else None, True, tc.ARG_SLOTS
    )
    rows = host.numpy()[tc.ARG_SLOTS :].reshape(HOST_ROWS, num_segments)
    num_kept = int(rows[ROW_SLOT, -1] + rows[ROW_QUOTA, -1]) if num_segments else 0
    if num_kept == 0 or (front is not None and not _front_ready(inputs, front, num_kept)):
        return None
    sort = merge_tile(counts_h)
    key = (
        probs.device.index, "scored", tuple(g.shape), n, num_segments, sample, ROW_BLOCK, sort,
        kept_total, g.dtype, x.dtype, g.stride(0), x.stride(0), probs.dtype, token.dtype,
        None if front is None else _FrontShape.of(front),
    )
    args = host.numpy()
    args[tc.ARG_G], args[tc.ARG_X] = g.data_ptr(), x.data_ptr()
    args[tc.ARG_PROBS], args[tc.ARG_TOKEN] = probs.data_ptr(), token.data_ptr()
    if front is not None:
        args[tc.ARG_Z], args[tc.ARG_SLOT_PLAN] = front.z.data_ptr(), front.slots.data_ptr()
        args[tc.ARG_D_PROBS] = front.d_probs.data_ptr()
        args[tc.ARG_G_OUT] = front.g_kept.data_ptr()
        args[tc.ARG_X_OUT] = 0 if front.x_kept is None else front.x_kept.data_ptr()
        args[tc.ARG_COUNT] = num_kept
    return ScoredCall(key, host, num_kept, inputs, sample, kept_total, front, sort)


class _FrontShape(NamedTuple):
    """What a captured front depends on besides the scoring's shape (part of its key)."""

    z_stride: int
    slots_per_token: int
    dtypes: tuple[torch.dtype, torch.dtype]  # z, d_probs
    pack_x: bool

    @classmethod
    def of(cls, front: FrontBuffers) -> "_FrontShape":
        return cls(
            front.z.stride(0), front.slots.shape[1], (front.z.dtype, front.d_probs.dtype),
            front.x_kept is not None,
        )


class FrontWork(CapturedSelection):
    """The buffers and launches of a replayed scoring and selection of one shape, with the
    router gradient's row-dot and the packing behind it when it has a front
    (:func:`front_triton`; one walk over the tokens, ``rows_triton.row_dot_pack_from_args``,
    which reads each token's rows once for its pairs); :class:`_CapturedScored` captures them
    alone, the expert graphs (``graphs/backward.py``) together with the expert backward
    that follows.

    The launches read the call's tensors (``g``, ``x``, ``probs``, ``token``; ``z``, the slot
    plan and the front's outputs) in place, at the addresses written into an argument block in
    front of the segment table (``flat``: one host-to-device copy for both, :meth:`load_host`);
    norms, scores, the selection's work and the map from pairs to packed rows live in static
    buffers. So a replay replaces two Triton launches, a reduction, a copy of the scores, the
    selection's own launches, (``kept_total``) the kept scores' sum and (a front) the row-dot,
    a fill and the packing by one copy and one graph launch.
    """

    def __init__(self, call: ScoredCall) -> None:
        kernels, (g, x, probs, token), front = selection_kernels(), call.inputs, call.front
        kept_total, sample, block = call.kept_total, call.sample, ROW_BLOCK
        device, n, t = probs.device, probs.numel(), g.shape[0]
        g_segments = (call.host.numel() - tc.ARG_SLOTS) // HOST_ROWS
        self.norms = torch.empty((2, t), dtype=torch.float32, device=device)
        self.top = torch.empty(2, dtype=torch.float32, device=device)
        self.scores = torch.empty(n, dtype=torch.float32, device=device)
        blocks = scores_triton.pair_blocks(n)
        self.partial = torch.empty((2, blocks), dtype=torch.float32, device=device)
        self.sums = torch.zeros(3, dtype=torch.float32, device=device)  # poison, total, kept
        self.kept_total = kept_total
        self._outputs(device, n, g_segments, lead=tc.ARG_SLOTS)
        self.args = self.flat[: tc.ARG_SLOTS]
        # Views handed out after every replay (owned=False), made once: on the backward's host
        # path each slicing is a torch call. The kept rows' views by kept count (few counts).
        self._host_part = self.flat[: call.host.numel()]
        self._sum_views = (self.sums[0], self.sums[1], self.sums[2], self.table[ROW_QUOTA])
        self._kept_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        u = self.table[ROW_UNIFORM].view(torch.float64) if sample else self.scores
        select_args = (
            kernels, self.scores, self.table, self.kept, self.weight, u, sample, block,
            call.sort,
        )
        shape, strides = (t, g.shape[1]), (g.stride(0), x.stride(0))
        dtypes = (g.dtype, x.dtype), (probs.dtype, token.dtype)
        # Held by the object: a replay reads every buffer the capture used, so none of them may
        # go back to the allocator (a local tensor would, once this returns).
        self.rows = torch.arange(n, device=device)
        self.has_front = front is not None
        self.row_of_pair = (
            torch.empty(n + 1, dtype=torch.int64, device=device) if self.has_front else None
        )
        # Only the front's layout from here on: the launches must not hold this call's tensors
        # (z alone is [N, H]), which later calls pass at their own addresses.
        if front is not None:
            # The router gradient's row-dot and the packing, one walk over the tokens.
            tail_layout = (
                front.slots.shape[1], (g.stride(0), front.z.stride(0), x.stride(0)),
                (front.d_probs.dtype, g.dtype, front.z.dtype, x.dtype, probs.dtype),
                front.x_kept is not None,
            )
        del front, g, x, probs, token, call

        def launch() -> None:
            scores_triton.row_norms_from_args(self.norms, self.args, shape, strides, dtypes[0])
            torch.amax(self.norms, dim=1, out=self.top)
            scores_triton.pair_scores_from_args(
                self.scores, self.partial, self.args, self.norms, self.top, dtypes[1]
            )
            torch.sum(self.partial, dim=1, out=self.sums[:2])
            launch_selection(*select_args)
            if kept_total:
                # The kept rows are kept[:K], K = the last segment's slot + quota, on the device.
                valid = self.rows < self.table[ROW_SLOT, -1] + self.table[ROW_QUOTA, -1]
                picked = self.scores.index_select(0, torch.where(valid, self.kept, 0))
                picked = torch.where(valid, picked.nan_to_num(0.0, 0.0, 0.0), 0.0)
                torch.sum(picked, dim=0, out=self.sums[2])
            if self.has_front:
                rows_triton.row_dot_pack_from_args(
                    self.args, self.kept, self.weight, self.sums[0], self.row_of_pair, shape,
                    *tail_layout,
                )

        self.launch = launch

    @property
    def quota(self) -> torch.Tensor:
        """``[G]`` int64 on the device: the kept rows of each segment (the expert backward's
        group sizes at EP 1), as loaded by :meth:`load_host`."""
        return self.table[ROW_QUOTA]

    def load_host(self, host: torch.Tensor) -> None:
        self._host_part.copy_(host, non_blocking=True)

    def scored(self, owned: bool) -> tuple[contract.PairScores, torch.Tensor | None]:
        """The last run's scores, poison and score total, and (``kept_total``) the kept scores'
        finite sum: copies unless ``owned=False``."""
        if owned:
            scores, sums = self.scores.clone(), self.sums.clone()
            poison, total, kept = sums[0], sums[1], sums[2]
        else:
            scores, (poison, total, kept, _) = self.scores, self._sum_views
        return contract.PairScores(scores, poison, total), kept if self.kept_total else None

    def outputs(self, num_kept: int, owned: bool = True) -> contract.Selection:
        if owned:
            return super().outputs(num_kept, owned)
        views = self._kept_views.get(num_kept)
        if views is None:
            if len(self._kept_views) >= 64:
                self._kept_views.clear()
            views = self._kept_views[num_kept] = (
                self.kept[:num_kept], self.weight[:num_kept]
            )
        return contract.Selection(*views, self._sum_views[3])

    def front(self, num_kept: int, owned: bool) -> Front:
        """The last run's outputs (copies unless ``owned=False``: then views made once);
        ``row_of_pair`` is ``None`` unless this work has a front."""
        scored, kept_total = self.scored(owned)
        row_of = self.row_of_pair
        if owned and row_of is not None:
            row_of = row_of.clone()
        return Front(contract.Scored(scored, self.outputs(num_kept, owned), kept_total), row_of)


class _CapturedScored(FrontWork):
    """A :class:`FrontWork` captured alone (:func:`score_select_triton`,
    :func:`front_triton`); the capture runs the call's work once eagerly."""

    def __init__(self, call: ScoredCall) -> None:
        super().__init__(call)
        self.load_host(call.host)
        self._capture(self.launch, call.inputs.probs.device)

    def run_scored(self, host: torch.Tensor, num_kept: int, owned: bool) -> Front:
        self.load_host(host)
        self.graph.replay()
        return self.front(num_kept, owned)
