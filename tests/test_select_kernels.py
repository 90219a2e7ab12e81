"""Fused Triton selection (``select/select_triton.py``) against the torch reference, bit for bit.

Shape legend: N rows, G segments, K kept rows.

The kernels run on the host in Triton's interpreter, which has to be switched on
(``TRITON_INTERPRET=1``) before triton is first imported; this process has imported it already
(megatron.core does). So ``test_select_kernels_in_interpreter_subprocess`` re-runs this module's
``test_interp_*`` tests in a subprocess with the variable set; here they are skipped. Blocks of
16 rows make small segments cross block boundaries and make blocks hold several segments.

Every comparison is exact: same ``kept_index``, ``weight`` (fp32 bits) and ``kept_per_segment``
as ``select_topk`` / ``select_sample``. The adversarial cases must reach every branch of the
fused repair (checked through the segment table the kernels fill in), so that a case list that
stops covering a branch fails instead of passing silently.
"""

from __future__ import annotations

import math
import os
import random
import re

import numpy as np
import pytest
import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.dispatch import rows_triton
from megatron_lrmoe.graphs import front as front_graph
from megatron_lrmoe.options import KernelOptions, using_kernels
from megatron_lrmoe.select import contract, scores_triton, scoring, select_triton
from megatron_lrmoe.testing.interpreter import run_interpreter_tests

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
BLOCK = 16

interp = pytest.mark.skipif(
    not INTERPRETING,
    reason="runs in the TRITON_INTERPRET=1 subprocess of the test below",
)
cuda = pytest.mark.skipif(not (HAS_CUDA and triton_common.triton_available()), reason="needs CUDA")

Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def _case(segments: list[torch.Tensor], quota: list[int], seed: int = 0) -> Case:
    counts = torch.tensor([len(s) for s in segments], dtype=torch.int64)
    scores = torch.cat([s.float() for s in segments]) if segments else torch.zeros(0)
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(len(segments), generator=gen, dtype=torch.float64)
    return scores, counts, torch.tensor(quota, dtype=torch.int64), uniforms


def _random_case(rng: random.Random, gen: torch.Generator) -> Case:
    num_segments = rng.choice([1, 2, 3, 5, 8])
    sizes = [rng.choice([0, 1, 15, 16, 17, 33, rng.randrange(0, 80)]) for _ in range(num_segments)]
    quota = [rng.choice([0, c, rng.randint(0, c), max(c - 1, 0)]) for c in sizes]
    n = sum(sizes)
    kind = rng.choice(["uniform", "power", "log_uniform", "ties"])
    if kind == "uniform":
        scores = torch.rand(n, generator=gen)
    elif kind == "power":
        scores = torch.rand(n, generator=gen) ** 8
    elif kind == "log_uniform":
        scores = 10.0 ** (torch.rand(n, generator=gen) * 60 - 30)
    else:
        scores = torch.randint(0, 3, (n,), generator=gen).float()
    segments = list(torch.split(scores, sizes))
    return _case(segments, quota, seed=rng.randrange(1 << 30))


def _adversarial_cases() -> dict[str, Case]:
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.rand(n, generator=gen)  # noqa: E731
    nonfinite = torch.tensor([float("nan"), 2.0, float("inf"), -1.0, -0.0, 0.5, -float("inf")])
    tiny = torch.full((60,), 1e-32)  # sqrt ratio below 2**-32: floored to 0, raised to 1 unit
    return {
        "empty_segments_and_quota_0": _case([rand(0), rand(20), rand(0), rand(5)], [0, 0, 0, 3]),
        "quota_equals_count": _case([rand(17), rand(33)], [17, 33]),
        "all_zero": _case([torch.zeros(40), torch.zeros(3)], [25, 1]),
        "ties": _case([torch.tensor([2.0, 1.0, 2.0, 2.0, 1.0] * 7)], [12]),
        "nonfinite_and_negative": _case([nonfinite.repeat(5), nonfinite], [9, 6]),
        "one_huge": _case([torch.cat([rand(30), torch.tensor([3.0e38]), rand(9)])], [7]),
        "fewer_positive_than_quota": _case([torch.cat([torch.zeros(20), rand(3)])], [10]),
        "geometric_many_capped": _case([0.5 ** torch.randperm(70, generator=gen).float()], [30]),
        "long_capped_prefix": _case([torch.zeros(400), rand(10)], [300, 4]),  # c* spans blocks
        "single_segment": _case([rand(150) ** 4], [61]),
        "denormal": _case([rand(40) * 1e-39], [13]),
        # The huge row flattens every other integer weight to 1, so the capping test stops at
        # rank 1 while the next rows' ideal units exceed 2**32: the second pass fills rows.
        "huge_near_full": _case([torch.cat([torch.tensor([3.0e38]), 0.5 + rand(15)])], [15]),
        "shrink_repair": _case([torch.cat([1.0 + rand(30), tiny])], [1]),
        "shrink_capped_head": _case([torch.cat([torch.tensor([1e30]), 1.0 + rand(20), tiny])], [2]),
        "edge_uniforms": (
            torch.cat([rand(20), rand(20), rand(20), rand(20)]),
            torch.tensor([20, 20, 20, 20]),
            torch.tensor([5, 7, 9, 11]),
            torch.tensor([0.0, 1 - 2**-53, 1.5, -0.25], dtype=torch.float64),
        ),
    }


def _reference(policy: str, case: Case) -> contract.Selection:
    """The torch reference selection of ``case`` on the host."""
    scores, counts, quota, uniforms = (t.cpu() for t in case)
    if policy == "topk":
        return scoring.select_topk(scores, counts, quota)
    return scoring.select_sample(scores, counts, quota, uniforms)


def _check(policy: str, case: Case, **kwargs) -> contract.Selection:
    scores, counts, quota, uniforms = case
    got = select_triton.select_triton(policy, scores, counts, quota, uniforms, **kwargs)
    ref = _reference(policy, case)
    assert torch.equal(got.kept_index.cpu(), ref.kept_index), (got.kept_index, ref.kept_index)
    assert torch.equal(got.weight.cpu(), ref.weight), (policy, got.weight, ref.weight)
    assert torch.equal(got.kept_per_segment.cpu(), ref.kept_per_segment)
    return got


# --------------------------------------------------------------------------------------------
# run in this process: the dispatcher, and the GPU when there is one
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter subprocess")
def test_select_kernels_in_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, min_passed=16)


def test_select_takes_the_torch_path_on_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("host tensors must not reach the Triton path")

    monkeypatch.setattr(select_triton, "select_triton", fail)
    scores, counts, quota, uniforms = _case([torch.rand(9), torch.rand(4)], [3, 2])
    for policy in ("topk", "sample"):
        got = scoring.select(policy, scores, counts, quota, uniforms)
        if policy == "topk":
            ref = scoring.select_topk(scores, counts, quota)
        else:
            ref = scoring.select_sample(scores, counts, quota, uniforms)
        assert torch.equal(got.kept_index, ref.kept_index)
        assert torch.equal(got.weight, ref.weight)


def test_select_dispatch_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(policy, scores, counts, quota, uniforms=None, owned=True):
        calls.append(policy)
        return "fused"

    monkeypatch.setattr(select_triton, "select_triton", fake)
    monkeypatch.setattr(scoring, "use_triton", lambda *tensors: True)
    scores, counts, quota, uniforms = _case([torch.rand(6)], [2])
    assert scoring.select("topk", scores, counts, quota) == "fused"
    assert scoring.select("sample", scores, counts, quota, uniforms) == "fused"
    assert calls == ["topk", "sample"]
    # Argument errors are raised before dispatching, the same on both paths.
    with pytest.raises(ValueError, match="unknown selection policy"):
        scoring.select("random", scores, counts, quota)
    with pytest.raises(ValueError, match="needs uniforms"):
        scoring.select("sample", scores, counts, quota)
    monkeypatch.setattr(scoring, "use_triton", lambda *tensors: False)
    assert isinstance(scoring.select("topk", scores, counts, quota), contract.Selection)


def test_select_triton_rejects_host_tensors_without_the_interpreter() -> None:
    if INTERPRETING or not triton_common.triton_available():
        pytest.skip("needs triton, outside the interpreter")
    scores, counts, quota, uniforms = _case([torch.rand(6)], [2])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_triton.select_triton("topk", scores, counts, quota)


# MERGE_TILES that force each sort: cub's radix sort, or the merge sort (at 4 rows per tile, so
# that the random cases' segments span many tiles).
SORTS = {"radix": (), "merge": ((1 << 40, select_triton.MergeTile(8, 4, 4, 1)),)}


def _force_sort(monkeypatch: pytest.MonkeyPatch, sort: str) -> None:
    monkeypatch.setattr(select_triton, "MERGE_TILES", SORTS[sort])


@cuda
@pytest.mark.parametrize("sort", list(SORTS))
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_gpu_matches_cpu_reference(monkeypatch: pytest.MonkeyPatch, policy: str, sort: str) -> None:
    _force_sort(monkeypatch, sort)
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    cases = [_random_case(rng, gen) for _ in range(30)] + list(_adversarial_cases().values())
    for scores, counts, quota, uniforms in cases:
        for block in (16, None):
            _check(policy, (scores.cuda(), counts, quota, uniforms.cuda()), block=block)
    # Through the dispatcher, host uniforms and device counts (one sync) included.
    scores, counts, quota, uniforms = cases[0]
    got = scoring.select(policy, scores.cuda(), counts.cuda(), quota.cuda(), uniforms)
    ref = _reference(policy, cases[0])
    assert torch.equal(got.kept_index.cpu(), ref.kept_index)
    assert torch.equal(got.weight.cpu(), ref.weight)


@cuda
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_gpu_captured_selection_matches_reference(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Calls of one shape (N, G): the first runs eagerly, the second is captured into a CUDA
    graph, the rest replay it; every call equals the reference, and a replay never changes the
    outputs an earlier call returned. ``KernelOptions(select_graphs=False)`` launches
    eagerly."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    gen = torch.Generator().manual_seed(11)
    n, g = 5000, 16
    calls = []
    for call in range(6):
        cuts = torch.sort(torch.randint(0, n + 1, (g - 1,), generator=gen)).values
        counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
        quota = (counts.double() * torch.rand(g, generator=gen, dtype=torch.float64)).long()
        quota[call % g] = counts[call % g]  # a segment kept whole
        scores = torch.rand(n, generator=gen) ** (1 + 7 * (call % 3))
        uniforms = torch.rand(g, generator=gen, dtype=torch.float64)  # host: graphed
        got = _check(policy, (scores.cuda(), counts, quota, uniforms))
        calls.append(((scores, counts, quota, uniforms), got))
        assert len(select_triton.GRAPHS.graphs) == (0 if call == 0 else 1)
    torch.cuda.synchronize()
    for case, got in calls:
        ref = _reference(policy, case)
        assert torch.equal(got.kept_index.cpu(), ref.kept_index)
        assert torch.equal(got.weight.cpu(), ref.weight)
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    with using_kernels(KernelOptions(select_graphs=False)):
        for case, _ in calls[:3]:
            _check(policy, (case[0].cuda(), *case[1:]))
    assert not select_triton.GRAPHS.graphs and not select_triton.GRAPHS.seen


@cuda
def test_gpu_merge_sort_product_launches_give_torch_sorts_order() -> None:
    """Every launch of the product table (MERGE_TILES), on segments that pick it: tied and
    sanitized scores, a largest segment at the launch's bound among smaller ones."""
    gen = torch.Generator().manual_seed(7)
    k = select_triton.selection_kernels()
    for bound, tile in select_triton.MERGE_TILES:
        smaller = torch.randint(1, bound // 4, (24,), generator=gen)
        counts = torch.cat([smaller[:12], torch.tensor([bound, 0]), smaller[12:]])
        assert select_triton.merge_tile(counts) == tile
        n = int(counts.sum())
        scores = torch.randint(0, 50, (n,), generator=gen).float()
        scores[torch.randperm(n, generator=gen)[: n // 8]] = float("nan")
        table = select_triton._segment_table(counts, counts, None, torch.device("cuda"))
        key = select_triton._sort_keys(k, scores.cuda(), table, select_triton.ROW_BLOCK)
        sorted_key, order = select_triton._sort_order(k, key, table, tile)
        ref_key, ref_order = select_triton._sort_order_reference(key)
        assert torch.equal(order, ref_order), tile
        assert torch.equal(sorted_key, ref_key), tile


@cuda
def test_gpu_captured_selection_keys_on_the_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """One shape, segments that pick either sort: a graph for each, both equal the reference."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    n, g = 4096, 8
    even = torch.full((g,), n // g)
    skewed = torch.tensor([n - 7 * 8] + [8] * 7)
    tile = select_triton.MergeTile(128, 256, 4, 4)
    monkeypatch.setattr(select_triton, "MERGE_TILES", ((n // g, tile),))
    assert [select_triton.merge_tile(c) for c in (even, skewed)] == [tile, None]
    gen = torch.Generator().manual_seed(2)
    for call in range(6):
        counts = even if call % 2 else skewed
        quota = counts // 3
        uniforms = torch.rand(g, generator=gen, dtype=torch.float64)
        _check("sample", (torch.rand(n, generator=gen).cuda(), counts, quota, uniforms))
    assert len(select_triton.GRAPHS.graphs) == 2


@cuda
def test_gpu_replayed_selection_unowned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``owned=False`` (the layer's backward): replays hand out the graph's buffers; what a
    caller queues before the next replay reads that call's selection, and the next replay
    reuses the same memory (no copies). The default copies."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    gen = torch.Generator().manual_seed(5)
    n, g = 3000, 8
    counts = torch.full((g,), n // g, dtype=torch.int64)
    seen = []
    for call in range(5):
        quota = (counts.double() * torch.rand(g, generator=gen, dtype=torch.float64)).long()
        scores = torch.rand(n, generator=gen)
        uniforms = torch.rand(g, generator=gen, dtype=torch.float64)
        got = select_triton.select_triton(
            "sample", scores.cuda(), counts, quota, uniforms, owned=False
        )
        # A consumer queued before the next call, as the backward's packing is.
        used = got.kept_index.clone(), got.weight.clone()
        ref = _reference("sample", (scores, counts, quota, uniforms))
        seen.append((used, ref, got.kept_index.data_ptr()))
    torch.cuda.synchronize()
    for (kept, weight), ref, _ in seen:
        assert torch.equal(kept.cpu(), ref.kept_index)
        assert torch.equal(weight.cpu(), ref.weight)
    # Calls 2-4 replayed the graph captured in call 1: the same output buffer every time.
    assert len({ptr for *_, ptr in seen[2:]}) == 1
    owned = select_triton.select_triton("sample", scores.cuda(), counts, quota, uniforms)
    assert owned.kept_index.data_ptr() != seen[-1][2]


def _scoring_case(gen: torch.Generator, t: int, h: int, k: int, e: int, poison: bool) -> tuple:
    """CUDA ``g``, ``x`` ([T, H] bf16), ``probs``, ``token`` ([T*K]) and host segments."""
    n = t * k
    g = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    if poison:
        g[t // 3, 5] = float("inf")
    x = (3 * torch.randn(t, h, generator=gen)).to(torch.bfloat16)
    probs = torch.rand(n, generator=gen)
    token = torch.randint(0, t, (n,), generator=gen)
    cuts = torch.sort(torch.randint(0, n + 1, (e - 1,), generator=gen)).values
    counts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
    quota = (counts.double() * torch.rand(e, generator=gen, dtype=torch.float64)).long()
    uniforms = torch.rand(e, generator=gen, dtype=torch.float64)
    return (g.cuda(), x.cuda(), probs.cuda(), token.cuda()), counts, quota, uniforms


def _scored_graphs() -> list:
    """The front graphs (``graphs/front.py``) among the selection's captured graphs."""
    graphs = select_triton.GRAPHS.graphs.values()
    return [v for v in graphs if isinstance(v, front_graph._CapturedScored)]


@cuda
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_gpu_captured_scoring_matches_eager(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """``replayed_score_and_select``: the first call of a shape scores and selects eagerly, the
    second captures both into one graph, later calls replay it on new tensors (read in place).
    Every call gives the bits of the eager steps (norms, pair scores, poison, total, selection),
    with a non-finite gradient too; ``owned=False`` hands out the graph's own buffers."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    gen = torch.Generator().manual_seed(3)
    pointers = []
    for call in range(5):
        tensors, counts, quota, uniforms = _scoring_case(gen, 300, 136, 4, 16, call == 3)
        owned = call != 4
        scored, sel, kept_total = front_graph.replayed_score_and_select(
            policy, *tensors, counts, quota, uniforms, kept_total=True, owned=owned
        )
        got = (scored.scores, scored.poison, scored.total, sel.kept_index, sel.weight)
        got = tuple(t.clone() for t in got)  # queued before the next call, as in the backward
        kept_total = kept_total.clone()
        pointers.append(scored.scores.data_ptr())
        graphs = _scored_graphs()
        assert len(graphs) == (0 if call == 0 else 1)
        with using_kernels(KernelOptions(select_graphs=False)):
            g, x, probs, token = tensors
            norms = scoring.token_norms(g, x)
            ref_scored = scoring.pair_scores(probs, token, norms, norms.amax(1))
            ref_sel = scoring.select(policy, ref_scored.scores, counts, quota, uniforms)
        ref = (ref_scored.scores, ref_scored.poison, ref_scored.total)
        ref += (ref_sel.kept_index, ref_sel.weight)
        for a, b in zip(got, ref):  # the same bits, NaN where the other has NaN
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert math.isnan(float(got[1])) == (call == 3)
        finite = ref_scored.scores.index_select(0, ref_sel.kept_index).nan_to_num(0.0, 0.0, 0.0)
        torch.testing.assert_close(kept_total, finite.sum(), rtol=1e-6, atol=0.0)
    # Calls 2-3 replayed with copies out, call 4 handed out the graph's scores buffer.
    assert pointers[4] not in pointers[:4]
    assert pointers[4] == graphs[0].scores.data_ptr()


@cuda
def test_gpu_captured_scoring_declines_unreadable_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs the graph cannot read in place (a misaligned ``probs``) and device uniforms take
    the eager steps: same results, no scoring graph."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        (g, x, probs, token), counts, quota, uniforms = _scoring_case(gen, 64, 64, 2, 4, False)
        shifted = torch.cat([probs.new_zeros(1), probs])[1:]  # 4 bytes off 16
        assert front_graph.score_select_triton(
            "sample", g, x, shifted, token, counts, quota, uniforms
        ) is None
        assert front_graph.score_select_triton(
            "sample", g, x, probs, token, counts, quota, uniforms.cuda()
        ) is None
        scored, sel, kept_total = front_graph.replayed_score_and_select(
            "sample", g, x, shifted, token, counts, quota, uniforms, kept_total=True
        )
        ref = scoring.select("sample", scored.scores, counts, quota, uniforms)
        assert torch.equal(sel.kept_index, ref.kept_index)
        kept_scores = scored.scores[ref.kept_index].nan_to_num(0.0, 0.0, 0.0)
        assert torch.equal(kept_total, kept_scores.sum())
    assert not _scored_graphs()


@cuda
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_gpu_front_graph_matches_steps(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """``front_triton`` on the GPU: the first call declines (the caller runs the steps), the
    second captures the router gradient's row-dot, scoring, selection and packing into one
    graph, later calls replay it into new per-call buffers, with a kept count that changes from
    call to call and a non-finite gradient once. Every call gives the bits of the eager steps
    (``row_dot``, ``score_and_select`` without graphs, ``pack_pairs`` with the map of packed
    rows)."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    gen = torch.Generator().manual_seed(6)
    t, h, k = 300, 136, 4
    for call in range(5):
        (g, x, probs, _), counts, quota, uniforms = _scoring_case(gen, t, h, k, 16, call == 3)
        token = torch.arange(t).repeat_interleave(k)[torch.randperm(t * k, generator=gen)]
        slots = _slot_plan(token, t, k).cuda()
        token = token.cuda()
        z = torch.randn(t * k, h, generator=gen).to(torch.bfloat16).cuda()
        num_kept = int(quota.sum())
        buffers = front_graph.FrontBuffers(
            z, slots, torch.empty_like(probs), g.new_empty(num_kept, h), x.new_empty(num_kept, h)
        )
        got = front_graph.front_triton(
            policy, g, x, probs, token, counts, quota, uniforms, buffers, kept_total=True,
            owned=False,
        )
        graphs = _scored_graphs()
        assert (got is None) == (call == 0) and len(graphs) == (call > 0)
        if got is None:
            continue
        got_sel = got.scored.selection
        got = (buffers.d_probs, got_sel.kept_index, got_sel.weight, buffers.g_kept,
               buffers.x_kept, got.row_of_pair)
        got = tuple(v.clone() for v in got)  # queued before the next call, as in the backward
        with using_kernels(KernelOptions(select_graphs=False)):
            d_probs = rows_triton.row_dot_triton(g, z, probs.dtype, slots=slots)
            scored, sel, _ = scoring.score_and_select(
                policy, g, x, probs, token, counts, quota, uniforms
            )
            row_of = torch.full((t * k + 1,), -1, dtype=torch.int64, device=g.device)
            g_kept, x_kept = rows_triton.pack_pairs_triton(
                g, token, sel.kept_index, probs, sel.weight, x=x, poison=scored.poison,
                row_of_pair=row_of,
            )
        for a, b in zip(got, (d_probs, sel.kept_index, sel.weight, g_kept, x_kept, row_of)):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        assert bool(got[3].isnan().all()) == (call == 3)  # the poison reached every kept row


# --------------------------------------------------------------------------------------------
# run under TRITON_INTERPRET=1 (subprocess): host tensors, kernels interpreted
# --------------------------------------------------------------------------------------------


class _EagerGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on the host: a "replay" reruns the launches."""

    def __init__(self, launch) -> None:
        self.replay = launch


@interp
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_interp_scored_graph_body_matches_steps(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """What ``score_select_triton`` captures, run on the host: the argument block it writes,
    the launches of ``_CapturedScored`` (norms and scores through the block, the selection, the
    kept-score sum under the device's kept count) and the outputs it hands out, over calls of
    one shape on new tensors, against the eager steps. (CUDA graphs themselves need a GPU: the
    ``test_gpu_captured_scoring_*`` tests.)"""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    monkeypatch.setattr(select_triton, "graphs_wanted", lambda device: True)

    def capture(self, launch, device) -> None:
        launch()  # the eager run that precedes every capture
        self.graph = _EagerGraph(launch)

    monkeypatch.setattr(select_triton.CapturedSelection, "_capture", capture)
    block = select_triton.host_block

    def host_block(counts, quota, uniforms, _pin, lead) -> torch.Tensor:
        return block(counts, quota, uniforms, False, lead)  # no pinned memory without CUDA

    monkeypatch.setattr(select_triton, "host_block", host_block)
    monkeypatch.setattr(triton_common, "PAIR_BLOCK", 16)
    gen = torch.Generator().manual_seed(9)
    t, h, k, e = 30, 24, 3, 5
    for call in range(4):
        g = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        x = (2 * torch.randn(t, h, generator=gen)).to(torch.bfloat16)
        probs = torch.rand(t * k, generator=gen)
        token = torch.randint(0, t, (t * k,), generator=gen)
        counts = torch.tensor([20, 0, 31, 17, 22])
        quota = torch.tensor([7, 0, 31, 1, 10 + call])
        uniforms = torch.rand(e, generator=gen, dtype=torch.float64)
        got = front_graph.score_select_triton(
            policy, g, x, probs, token, counts, quota, uniforms, kept_total=True, owned=call != 3
        )
        assert (got is None) == (call == 0)  # the first sighting of a shape runs eagerly
        if got is None:
            continue
        norms = scores_triton.row_norms_triton(g, x)
        ref = scoring.pair_scores(probs, token, norms, norms.amax(1))
        ref_sel = scoring.select(policy, ref.scores, counts, quota, uniforms)
        assert torch.equal(got.scores.scores, ref.scores)
        assert float(got.scores.poison) == 0.0
        torch.testing.assert_close(got.scores.total, ref.total, rtol=1e-6, atol=0.0)
        assert torch.equal(got.selection.kept_index, ref_sel.kept_index)
        assert torch.equal(got.selection.weight, ref_sel.weight)
        kept = ref.scores[ref_sel.kept_index].sum()
        torch.testing.assert_close(got.kept_total, kept, rtol=1e-6, atol=0.0)


@interp
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_interp_front_graph_body_matches_steps(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """What ``front_triton`` captures, run on the host as in the test above: the router
    gradient's row-dot, the scoring and selection, and the packing of the kept rows with the
    map from pairs to packed rows, into new per-call buffers on every call, against the eager
    steps (``row_dot_triton``, ``pack_pairs_triton`` on the reference selection)."""
    monkeypatch.setattr(select_triton, "GRAPHS", select_triton._GraphCache())
    monkeypatch.setattr(select_triton, "graphs_wanted", lambda device: True)

    def capture(self, launch, device) -> None:
        launch()
        self.graph = _EagerGraph(launch)

    monkeypatch.setattr(select_triton.CapturedSelection, "_capture", capture)
    block = select_triton.host_block
    monkeypatch.setattr(
        select_triton, "host_block", lambda c, q, u, _pin, lead: block(c, q, u, False, lead)
    )
    monkeypatch.setattr(triton_common, "PAIR_BLOCK", 16)
    gen = torch.Generator().manual_seed(10)
    t, h, k = 30, 24, 4
    counts = torch.tensor([20, 0, 31, 17, 22])  # 90 pairs, 3 per token, in 4 slots each
    token = torch.arange(t).repeat_interleave(3)[torch.randperm(90, generator=gen)]
    slots = _slot_plan(token, t, k)
    for call in range(4):
        g = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        x = (2 * torch.randn(t, h, generator=gen)).to(torch.bfloat16)
        z = torch.randn(token.numel(), h, generator=gen).to(torch.bfloat16)
        probs = torch.rand(token.numel(), generator=gen)
        quota = torch.tensor([7, 0, 31, 1, 10 + call])
        uniforms = torch.rand(counts.numel(), generator=gen, dtype=torch.float64)
        num_kept = int(quota.sum())
        buffers = front_graph.FrontBuffers(
            z, slots, torch.empty_like(probs), torch.empty(num_kept, h, dtype=g.dtype),
            torch.empty(num_kept, h, dtype=x.dtype),
        )
        got = front_graph.front_triton(
            policy, g, x, probs, token, counts, quota, uniforms, buffers, kept_total=True,
            owned=call != 3,
        )
        assert (got is None) == (call == 0)  # the first sighting of a shape runs eagerly
        if got is None:
            continue
        ref_d_probs = rows_triton.row_dot_triton(g, z, probs.dtype, slots=slots)
        assert torch.equal(buffers.d_probs, ref_d_probs)
        norms = scores_triton.row_norms_triton(g, x)
        ref = scoring.pair_scores(probs, token, norms, norms.amax(1))
        ref_sel = scoring.select(policy, ref.scores, counts, quota, uniforms)
        assert torch.equal(got.scored.selection.kept_index, ref_sel.kept_index)
        assert torch.equal(got.scored.selection.weight, ref_sel.weight)
        row_of = torch.full((token.numel() + 1,), -1, dtype=torch.int64)
        ref_g, ref_x = rows_triton.pack_pairs_triton(
            g, token, ref_sel.kept_index, probs, ref_sel.weight, x=x, poison=ref.poison,
            row_of_pair=row_of,
        )
        assert torch.equal(buffers.g_kept, ref_g) and torch.equal(buffers.x_kept, ref_x)
        assert torch.equal(got.row_of_pair, row_of)
    # Buffers the graph cannot use in place: no graph, the caller runs the steps.
    bad = buffers._replace(g_kept=torch.empty(num_kept - 1, h, dtype=g.dtype))
    got = front_graph.front_triton(policy, g, x, probs, token, counts, quota, uniforms, bad)
    assert got is None


def _slot_plan(token: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """``[t, k]`` int64: each token's pairs in ascending order, ``-1`` after them."""
    slots = torch.full((t, k), -1, dtype=torch.int64)
    fill = [0] * t
    for pair, tok in enumerate(token.tolist()):
        slots[tok, fill[tok]] = pair
        fill[tok] += 1
    return slots


@interp
@pytest.mark.parametrize("sort", list(SORTS))
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_interp_random_cases(monkeypatch: pytest.MonkeyPatch, policy: str, sort: str) -> None:
    _force_sort(monkeypatch, sort)
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(10):
        _check(policy, _random_case(rng, gen), block=BLOCK)


@interp
@pytest.mark.parametrize("sort", list(SORTS))
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_interp_adversarial_cases(monkeypatch: pytest.MonkeyPatch, policy: str, sort: str) -> None:
    _force_sort(monkeypatch, sort)
    tables = []
    segment_table = select_triton._segment_table

    def recording(*args, **kw):
        tables.append(segment_table(*args, **kw))
        return tables[-1]

    monkeypatch.setattr(select_triton, "_segment_table", recording)
    seen: set[str] = set()
    for name, case in _adversarial_cases().items():
        tables.clear()
        _check(policy, case, block=BLOCK)
        if policy != "sample" or not tables or int(case[2].sum()) == 0:
            continue
        t = tables[0]
        for g in range(case[1].numel()):
            if int(case[2][g]) == 0:
                continue
            c_star, grow = int(t[select_triton._CSTAR, g]), int(t[select_triton._GROW, g])
            moved1 = int(t[select_triton._WIN_HI, g]) > int(t[select_triton._WIN_LO, g])
            moved2 = int(t[select_triton._RFULL, g]) > 0 or int(t[select_triton._REST, g]) > 0
            seen |= {"capped"} if c_star > 0 else set()
            seen |= {"capped across block chunks"} if c_star > BLOCK * BLOCK else set()
            seen |= {"all capped"} if c_star == int(case[1][g]) else set()
            seen |= {f"pass 1 {'grow' if grow & 1 else 'shrink'}"} if moved1 else set()
            seen |= {f"pass 2 {'grow' if grow & 2 else 'shrink'}"} if moved2 else set()
            if moved2 and int(t[select_triton._RFULL, g]) > c_star:
                seen.add("pass 2 fills whole rows")
    if policy == "sample":
        assert seen >= {
            "capped",
            "capped across block chunks",
            "all capped",
            "pass 1 grow",
            "pass 1 shrink",
            "pass 2 grow",
            "pass 2 shrink",
            "pass 2 fills whole rows",
        }, seen


@interp
@pytest.mark.parametrize("policy", ["topk", "sample"])
def test_interp_block_sizes_and_dtypes(policy: str) -> None:
    gen = torch.Generator().manual_seed(4)
    scores = torch.rand(300, generator=gen) ** 3
    counts, quota = torch.tensor([7, 0, 200, 93]), torch.tensor([3, 0, 71, 93])
    uniforms = torch.rand(4, generator=gen, dtype=torch.float64)
    for block in (16, 64, 256):
        _check(policy, (scores, counts, quota, uniforms), block=block)
    # Scores are compared at fp32 (bf16 and fp64 are converted first, as in the reference);
    # fp32 uniforms are widened exactly.
    for scores_dtype in (torch.bfloat16, torch.float64):
        _check(policy, (scores.to(scores_dtype), counts, quota, uniforms.float()), block=32)


def _sort_case(num_segments: int, max_count: int = 150) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of tied and sanitized scores (NaN, inf and negatives are 0) over random segments
    (the first one empty), and their segment table."""
    gen = torch.Generator().manual_seed(num_segments)
    counts = torch.randint(0, max_count, (num_segments,), generator=gen)
    counts[0] = 0 if num_segments > 1 else counts[0]
    n = int(counts.sum())
    scores = torch.randint(0, 5, (n,), generator=gen).float()
    scores[torch.randperm(n, generator=gen)[: n // 6]] = float("nan")
    scores[torch.randperm(n, generator=gen)[: n // 6]] = -float("inf")
    table = select_triton._segment_table(counts, counts, None, torch.device("cpu"))
    return select_triton._sort_keys(select_triton.selection_kernels(), scores, table, BLOCK), table


@interp
@pytest.mark.parametrize("num_segments", [1, 3, 24])
@pytest.mark.parametrize("tile", [(16, 4, 1, 1), (8, 16, 4, 1), (32, 8, 2, 2), (16, 64, 1, 1)])
def test_interp_merge_sort_gives_torch_sorts_order(
    num_segments: int, tile: tuple[int, int, int, int]
) -> None:
    """Through sorted tiles smaller, larger and much larger than a program's rows, one or
    several tiles searched at once: segments spanning many tiles, tiles and blocks of rows
    spanning several segments, empty segments, a padded last tile, ties (by row)."""
    key, table = _sort_case(num_segments)
    tile = select_triton.MergeTile(*tile)
    kernels = select_triton.selection_kernels()
    sorted_key, order = select_triton._sort_order(kernels, key, table, tile)
    ref_key, ref_order = select_triton._sort_order_reference(key)
    assert torch.equal(order, ref_order)
    assert torch.equal(sorted_key, ref_key)


@interp
def test_interp_select_bench_sort_part_checks_every_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/select_bench.py``'s sort part (``--sort-only`` on a GPU) on host tensors:
    every merge launch it sweeps gives torch.sort's order, and it records the selection's pick."""
    import argparse

    from benchmarks import select_bench

    monkeypatch.setattr(select_bench, "FAILURES", [])
    monkeypatch.setattr(
        select_bench, "profile_call", lambda fn: {"device_time_us": 0.0, "kernel_launches": 0}
    )
    counts = select_bench.zipf_counts(96, 8, 4, 1.2, 0)
    out = select_bench.sort_part(counts, torch.device("cpu"), argparse.Namespace(seed=0))
    launches = {name: got for name, got in out.items() if isinstance(got, dict) and "same" in got}
    assert len(launches) == len(select_bench.MERGE_TILES) + 1
    assert all(got["same"] for got in launches.values()) and not select_bench.FAILURES
    assert out["merge_tile"] == select_triton.merge_tile(counts)._asdict()


def test_merge_tile_by_largest_segment_and_size(monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = select_triton.MergeTile(8, 4, 1, 1), select_triton.MergeTile(8, 16, 2, 1)
    monkeypatch.setattr(select_triton, "MERGE_TILES", ((4, small), (9, large)))
    merge_tile = select_triton.merge_tile
    assert merge_tile(torch.tensor([3, 4, 0])) == small
    assert merge_tile(torch.tensor([3, 5])) == large
    assert merge_tile(torch.tensor([9, 9])) == large
    assert merge_tile(torch.tensor([3, 10])) is None  # torch.sort
    assert merge_tile(torch.tensor([], dtype=torch.int64)) == small
    # Up to MERGE_SORT_MAX_SEARCHES: 3 rows search 2 tiles of 16 at most, 9 rows 2 as well.
    assert select_triton.merge_searches(np.array([3, 9]), 16) == 3 * 2 + 9 * 2
    assert select_triton.merge_searches(np.array([40]), 16) == 40 * 4
    monkeypatch.setattr(select_triton, "MERGE_SORT_MAX_SEARCHES", 24)
    assert merge_tile(torch.tensor([3, 9])) == large
    assert merge_tile(torch.tensor([4, 9])) is None
    monkeypatch.setattr(select_triton, "MERGE_SORT_MAX_SEARCHES", 1 << 62)
    # The packed (key, row) comparison: fewer than 2**11 segments and 2**21 rows, else torch.
    monkeypatch.setattr(select_triton, "MERGE_TILES", ((1 << 40, large),))
    assert merge_tile(torch.ones(2047, dtype=torch.int64)) == large
    assert merge_tile(torch.ones(2048, dtype=torch.int64)) is None
    assert merge_tile(torch.tensor([(1 << 21) - 1])) == large
    assert merge_tile(torch.tensor([1 << 20, 1 << 20])) is None


def test_merge_tiles_cover_growing_segments() -> None:
    """The product table: bounds increase, tiles are powers of two, the first bound covers
    one row, and the torch fallback starts past the last bound and the search limit (a very
    large layer call: 64 experts of 16384 pairs each)."""
    bounds = [bound for bound, _ in select_triton.MERGE_TILES]
    assert bounds == sorted(set(bounds)) and bounds[0] >= 1
    for _, tile in select_triton.MERGE_TILES:
        assert tile.tile & (tile.tile - 1) == 0 and tile.block_i & (tile.block_i - 1) == 0
    assert select_triton.merge_tile(torch.tensor([bounds[-1]])) is not None
    assert select_triton.merge_tile(torch.tensor([bounds[-1] + 1])) is None
    assert select_triton.merge_tile(torch.full((64,), bounds[-1])) is None
    # The shapes the issue names take the merge sort (equal segments).
    for experts, tokens in ((128, 4096), (128, 16384), (16, 4096), (16, 8192), (16, 16384)):
        assert select_triton.merge_tile(torch.full((experts,), tokens * 8 // experts)) is not None


@interp
def test_interp_empty_inputs() -> None:
    for policy in ("topk", "sample"):
        _check(policy, _case([], []), block=BLOCK)
        _check(policy, _case([torch.zeros(0), torch.zeros(0)], [0, 0]), block=BLOCK)
        _check(policy, _case([torch.rand(5)], [0]), block=BLOCK)


@interp
def test_interp_rejects_what_the_reference_rejects() -> None:
    scores, counts, quota, uniforms = _case([torch.rand(4), torch.rand(2)], [1, 1])
    with pytest.raises(ValueError, match="unknown selection policy"):
        select_triton.select_triton("best", scores, counts, quota, uniforms)
    with pytest.raises(ValueError, match="needs uniforms"):
        select_triton.select_triton("sample", scores, counts, quota)
    with pytest.raises(ValueError, match="segment 1"):
        select_triton.select_triton("topk", scores, counts, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="add up"):
        select_triton.select_triton("topk", scores, torch.tensor([4, 1]), quota)
    with pytest.raises(ValueError, match="uniforms must be"):
        select_triton.select_triton(
            "sample", scores, counts, quota, torch.rand(3, dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="power of two"):
        select_triton.select_triton("topk", scores, counts, quota, block=24)


@pytest.mark.parametrize(
    ("counts", "quota", "n"),
    [
        ([3, 0, 2], [1, 0, 2], 5),  # valid
        ([3, -1, 3], [1, 0, 2], 5),  # a negative count
        ([3, 1, 2], [1, 2, 2], 6),  # a quota above its count
        ([3, 1, 2], [1, -1, 2], 6),  # a negative quota
        ([3, 1, 2], [1, 1, 2], 7),  # counts that do not add up to the rows
        ([], [], 0),  # no segments
    ],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_planned_segments_accept_and_reject_like_host_segments(
    counts: list[int], quota: list[int], n: int, dtype: torch.dtype
) -> None:
    """The short check of the planner's segments (``contract.host_segments``, one combined
    test) takes what the check-by-check path (``contract.checked_segments``) takes, returns the
    same int64 host tensors and rejects the rest with its message."""
    c, q = torch.tensor(counts, dtype=dtype), torch.tensor(quota, dtype=dtype)
    try:
        want = contract.checked_segments(c, q, n)
    except ValueError as err:
        with pytest.raises(ValueError, match=f"^{re.escape(str(err))}$"):
            contract.host_segments(c, q, n)
        return
    got = contract.host_segments(c, q, n)
    assert all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(got, want))
