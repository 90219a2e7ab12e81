"""LRMoELayer against stock Megatron-Core and against a dense masked reference (CPU, gloo).

Each test spawns one process group and runs several cases inside it (process start-up dominates
on CI's two cores). fp32 throughout; tolerances are relative to each quantity's scale.
"""

from __future__ import annotations

import pytest
import torch

import lrmoe_workers as w
from megatron_lrmoe.testing import run_distributed

RTOL = 1e-5  # fp32, a handful of re-associated sums per element
ATOL = 1e-8  # quantities that are zero in exact arithmetic (e.g. a router grad through p == 1)


def _assert_close_keep1(results: list[list[dict]], cases: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for case, d in zip(cases, per_rank):
            for key in ("out", "dx", "router", "fc1", "fc2"):
                scale = max(d[f"scale_{key}"], 1e-12)
                assert (
                    d[key] <= RTOL * scale + ATOL
                ), f"rank {rank} {case}: {key} {d[key]:.3e} vs {scale:.3e}"
            if "shared" in d:
                assert d["shared"] <= 1e-6, f"rank {rank} {case}: shared experts {d['shared']:.3e}"


KEEP1_CASES = [
    dict(moe_router_topk=1, moe_router_pre_softmax=True),
    dict(moe_router_topk=2, moe_shared_expert_intermediate_size=40),
    dict(
        moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    ),
    dict(moe_router_topk=2, moe_shared_expert_intermediate_size=40, moe_shared_expert_overlap=True),
]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_keep1_equals_stock(ep: int) -> None:
    """Keep ratio 1.0: output, input grad, router grad and every expert grad equal stock's."""
    cases = KEEP1_CASES if ep != 4 else KEEP1_CASES[1:3]
    results = run_distributed(w.stock_vs_lrmoe_keep1_cases, ep, ep, cases, timeout=240)
    _assert_close_keep1(results, cases)


ATTENTION_PARALLEL = [dict(tp=2), dict(cp=2)]


@pytest.mark.parametrize("sizes", ATTENTION_PARALLEL, ids=["tp2", "cp2"])
def test_keep1_equals_stock_with_attention_parallelism(sizes: dict) -> None:
    """TP 2 with sequence parallelism, or CP 2, with expert TP 1 over EP 2 (how the largest MoE
    recipes run attention): keep 1.0 still equals stock, shared experts included."""
    cases = [KEEP1_CASES[0], KEEP1_CASES[1], KEEP1_CASES[3]]
    results = run_distributed(
        w.stock_vs_lrmoe_keep1_parallel_cases, 2, 2, cases, timeout=240, **sizes
    )
    _assert_close_keep1(results, cases)


@pytest.mark.parametrize("sizes", ATTENTION_PARALLEL, ids=["tp2", "cp2"])
def test_keep_below_one_with_attention_parallelism(sizes: dict) -> None:
    """Keep < 1 at TP 2 (sequence parallel) or CP 2, expert TP 1, over EP 2 equals the dense
    masked reference, both scopes, and keeps exactly the quota."""
    cases = [
        (dict(keep_ratio=0.5), dict(moe_aux_loss_coeff=0.0), None),
        (
            dict(keep_ratio=0.4, scope="global", selection="topk"),
            dict(moe_aux_loss_coeff=0.0),
            None,
        ),
    ]
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, 2, 2, cases, timeout=300, **sizes)
    _assert_matches_reference(results)
    _check_counts(results)


def _assert_matches_reference(results: list[list[dict]]) -> None:
    for rank, per_rank in enumerate(results):
        for d in per_rank:
            for key in ("out", "dx", "router", "fc1", "fc2"):
                scale = max(d["scales"][key], 1e-12)
                assert (
                    d[key] <= RTOL * scale + ATOL
                ), f"rank {rank} {d['case']}: {key} differs by {d[key]:.3e} (scale {scale:.3e})"


def _check_counts(results: list[list[dict]]) -> None:
    """Kept pairs per expert == quota, counted independently from the recorded kept masks."""
    for i, d0 in enumerate(results[0]):
        quota = torch.tensor(d0["quota"])
        kept = torch.zeros_like(quota)
        for rank, per_rank in enumerate(results):
            d = per_rank[i]
            mask = d["kept_mask"]
            # The mask is in send order (sorted by expert); split it by this rank's pair counts.
            per_expert = torch.split(mask, d["global_counts"][rank].tolist())
            kept += torch.tensor([int(m.sum()) for m in per_expert])
            assert d["grad_rows"] == int(mask.sum()), f"{d['case']}: exchange rows != kept rows"
        assert torch.equal(
            kept, quota
        ), f"{d0['case']}: kept {kept.tolist()} != quota {quota.tolist()}"


REF_CASES = [
    (
        dict(keep_ratio=kr, selection=sel, scope=scope, activation_mode=mode),
        dict(moe_aux_loss_coeff=0.0),
        None,
    )
    for kr, sel, scope, mode in [
        (0.5, "sample", "local", "save"),
        (0.5, "sample", "local", "recompute"),
        (0.5, "sample", "global", "save"),
        (0.5, "sample", "global", "recompute"),
        (0.5, "topk", "local", "save"),
        (0.3, "topk", "global", "recompute"),
        (0.7, "topk", "global", "save"),
        (0.25, "topk", "local", "recompute"),
    ]
]


@pytest.mark.parametrize("ep", [1, 2])
def test_keep_below_one_matches_dense_reference(ep: int) -> None:
    """Both policies, both scopes, both activation modes: compaction never changes the math."""
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, ep, ep, REF_CASES, timeout=300)
    _assert_matches_reference(results)
    _check_counts(results)


LEAN_CASES = [
    (dict(keep_ratio=kr, selection=sel, activation_mode="lean"), dict(moe_aux_loss_coeff=0.0), None)
    for kr, sel in [(0.5, "sample"), (0.25, "topk"), (0.0, "sample"), (1.0, "sample")]
]


@pytest.mark.parametrize("ep", [1, 2])
def test_lean_mode_matches_dense_reference(ep: int) -> None:
    """``lean`` keeps the activation at the expert instead of z at the source and takes the
    router gradient through fc2 (at EP 2 every pair's gradient row goes to the experts and one
    scalar per pair comes back): the same math as the dense reference, the router's gradient
    exact for every pair, both scopes."""
    cases = LEAN_CASES + [
        (
            dict(keep_ratio=0.5, scope="global", activation_mode="lean"),
            dict(moe_aux_loss_coeff=0.0),
            None,
        )
    ]
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, ep, ep, cases, timeout=300)
    _assert_matches_reference(results)
    _check_counts(results)
    if ep == 1:
        return
    for per_rank in results:  # every pair's gradient row out, one fp32 scalar per pair back
        for d in per_rank:
            if d["case"][0]["keep_ratio"] == 1.0:  # the exact path: stock's exchanges
                continue
            rows = d["exchange_rows"]
            assert rows["lean_grad"][0] == d["pairs"], d["case"]
            assert rows["probs_grad"][1] == 4 * rows["probs_grad"][0] > 0, d["case"]
            assert rows["grad"][0] == d["grad_rows"] == d["kept"], d["case"]
            # the kept rows' token rows (H) only, with a position and a scale each
            assert rows["grad"][1] * d["pairs"] == rows["lean_grad"][1] * d["kept"]
            assert rows["scales"][1] == 4 * d["kept"], d["case"]
            if d["case"][0].get("scope", "local") == "local":  # the owner knows them (global)
                assert rows["positions"][1] == 8 * d["kept"], d["case"]


def test_keep_below_one_ep4_and_shared_sigmoid() -> None:
    cases = [
        (dict(keep_ratio=0.5), dict(moe_aux_loss_coeff=0.0, moe_router_topk=4), None),
        (
            dict(keep_ratio=0.4, scope="global", selection="topk"),
            dict(
                moe_aux_loss_coeff=0.0,
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
            ),
            None,
        ),
        (
            dict(keep_ratio=0.3, activation_mode="lean"),
            dict(
                moe_aux_loss_coeff=0.0,
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_topk=4,
            ),
            None,
        ),
    ]
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, 4, 4, cases, timeout=300)
    _assert_matches_reference(results)
    _check_counts(results)


DEGENERATE_CASES = [
    # All tokens to one expert: every other expert has zero tokens, one rank receives nothing.
    (
        dict(keep_ratio=0.5, scope="global"),
        dict(moe_aux_loss_coeff=0.0, moe_router_topk=1, moe_router_pre_softmax=True),
        "one_expert",
    ),
    (
        dict(keep_ratio=0.5, scope="local"),
        dict(moe_aux_loss_coeff=0.0, moe_router_topk=1, moe_router_pre_softmax=True),
        "one_expert",
    ),
    # Each rank routes only to its own experts: it sends nothing to the other rank.
    (
        dict(keep_ratio=0.5, scope="global", activation_mode="recompute"),
        dict(moe_aux_loss_coeff=0.0),
        "stay_home",
    ),
    (dict(keep_ratio=0.6, selection="topk"), dict(moe_aux_loss_coeff=0.0), "first_rank_only"),
    # Keep ratio 0: experts get zero gradient, the router's stays exact.
    (dict(keep_ratio=0.0), dict(moe_aux_loss_coeff=0.0), None),
    (
        dict(keep_ratio=0.0, scope="global", activation_mode="recompute"),
        dict(moe_aux_loss_coeff=0.0),
        None,
    ),
    # A keep ratio that leaves one pair per (non-empty) expert.
    (dict(keep_ratio=1e-6), dict(moe_aux_loss_coeff=0.0), None),
    (dict(keep_ratio=1e-6, scope="global", selection="topk"), dict(moe_aux_loss_coeff=0.0), None),
    # Keep ratio 1 through the same reference.
    (dict(keep_ratio=1.0), dict(moe_aux_loss_coeff=0.0), None),
]


def test_degenerate_routing() -> None:
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, 2, 2, DEGENERATE_CASES, timeout=300)
    _assert_matches_reference(results)
    _check_counts(results)
    for per_rank in results:
        for d in per_rank:
            kr = d["case"][0]["keep_ratio"]
            if kr == 0.0:
                assert d["kept"] == 0 and d["grad_rows"] == 0
                assert float(d["w1_grad"].abs().max()) == 0.0
            if kr == 1e-6:
                n = d["global_counts"].sum(0)
                assert d["quota"] == [int(x > 0) for x in n.tolist()]


EP1_PARTIAL_CASES = [
    # Fewer pairs than T * topk at EP 1, where the forward runs before the plan exists.
    (dict(keep_ratio=0.5), dict(moe_aux_loss_coeff=0.0), "stay_home"),
    (dict(keep_ratio=1.0), dict(moe_aux_loss_coeff=0.0), "stay_home"),
    (dict(keep_ratio=0.6, selection="topk"), dict(moe_aux_loss_coeff=0.0), "first_rank_only"),
    (dict(keep_ratio=0.5, selection="topk"), dict(moe_aux_loss_coeff=0.0), None),
]


def test_partial_routing_map_at_ep1() -> None:
    """EP 1 runs the forward before the call's plan is built (from device-side rows per
    expert); maps with fewer pairs than T * topk still match the reference."""
    results = run_distributed(w.lrmoe_vs_dense_reference_cases, 1, 1, EP1_PARTIAL_CASES)
    _assert_matches_reference(results)
    _check_counts(results)


def test_forward_host_shortcuts_match_their_slow_forms() -> None:
    """EP 2: the device-offset decision follows the grouped GEMM switch
    (``KernelOptions.grouped_mm``) and the operands' dtypes (memoised, never stale); the call's statistics and stock's split metadata equal torch sums
    over the all-gathered counts."""
    grouped = hasattr(torch.nn.functional, "grouped_mm")  # fp32 / bf16 on the CPU, aligned
    want = {
        "auto": grouped, "loop": False, "bogus": "ValueError", "unset": grouped,
        "torch.float64": False, "weights torch.float64": False,
        "torch.bfloat16": grouped, "weights torch.bfloat16": False, "layer float64": False,
    }  # fmt: skip
    for rank, d in enumerate(run_distributed(w.forward_host_facts, 2, timeout=240)):
        assert d["decided"] == want, (rank, d["decided"])
        assert d["stats"] == d["stats_want"], rank
        assert d["metadata"] == d["metadata_want"], rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (counts copied async)")
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-grouped_mm", "fp32-loop"])
def test_cuda_partial_routing_map_reruns_the_forward(bf16: bool) -> None:
    """On the GPU the pair plan is built for T * topk pairs before the counts reach the host;
    a map with fewer pairs is caught after the forward was queued and the forward runs again
    on the rebuilt plan: the same result as a call that waits for the counts first (the next
    one), bit for bit. A full map keeps the speculation on. In fp32 the grouped GEMMs loop
    over experts with host sizes, so the layer waits for the counts before its forward."""
    d = run_distributed(w.cuda_partial_routing_rerun, 1, bf16, device="cuda")[0]
    assert d["device"].startswith("cuda"), d["device"]
    assert d["deferred"] == bf16 and (d["backend"] == "torch_grouped_mm") == bf16, d
    assert d["diff"] == 0.0, d
    assert d["flags"] == [False, False, True], d["flags"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_cuda_scoring_graph_matches_eager_layer() -> None:
    """The layer on the GPU, keep 0.5: with the router gradient's row-dot, the scoring, the
    selection and the packing replayed as one graph, and with only the scoring inside the
    selection graph (from the second call of a shape on), every output and gradient has the
    bits of the same calls with the scoring launched eagerly; each graph was used, and only
    when allowed."""
    d = run_distributed(w.cuda_scoring_graph_matches_eager, 1, device="cuda")[0]
    assert d["device"].startswith("cuda"), d
    assert d["graphs"] == {
        "front": {"front": 1, "scored": 0},
        "scored": {"front": 0, "scored": 1},
        "eager": {"front": 0, "scored": 0},
    }, d
    assert d["diff"] == {"front": 0.0, "scored": 0.0}, d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lean_matches_recompute() -> None:
    """On the GPU (bf16, fused ``main_grad``), ``lean`` keeps the same pairs as ``recompute``
    and gives the same outputs and expert weight gradients bit for bit; its router gradient,
    taken through fc2, agrees to bf16 rounding, and so does the input gradient (the router's
    part of it); it holds less between forward and backward (the activation, F wide, instead
    of z, H wide)."""
    d = run_distributed(w.cuda_lean_matches_recompute, 1, device="cuda")[0]
    assert d["device"].startswith("cuda"), d
    assert d["same_kept"], d
    assert [d["diff"][k] for k in ("out", "fc1", "fc2")] == [0.0, 0.0, 0.0], d
    assert d["diff"]["router"] < 2e-2 and d["diff"]["dx"] < 2e-2, d
    assert d["held"]["lean"] < d["held"]["recompute"], d


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_cuda_expert_graph_matches_eager_layer() -> None:
    """The layer on the GPU, keep 0.5, fused ``main_grad``, two layers sharing the graphs'
    buffers and memory pool: with the whole trimmed backward replayed as one graph per layer
    (the front and the expert half; captured on a layer's second sighting once its shape has
    a shared set), outputs, input and router gradients and ``main_grad`` after every call have
    the bits of the front replayed alone and the expert half launched eagerly
    (``KernelOptions(expert_graphs=False)``), in ``save`` and ``recompute`` mode (the latter with
    ``overwrite_main_grad``: a NaN ``main_grad`` written over); one layer graph per layer, none
    with the switch off."""
    d = run_distributed(w.cuda_expert_graph_matches_eager, 1, device="cuda")[0]
    assert d["device"].startswith("cuda"), d
    assert d["graphs"] == {
        case: {"graph": 2, "eager": 0} for case in ("save_sample", "recompute_topk_overwrite")
    }, d
    assert d["diff"] == {"save_sample": 0.0, "recompute_topk_overwrite": 0.0}, d


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="host tensors only; on a GPU test_cuda_scoring_graph_matches_eager_layer covers it",
)
@pytest.mark.parametrize(("ep", "selection"), [(1, "topk"), (1, "sample"), (2, "sample")])
def test_front_graph_wiring_matches_stages_on_cpu(
    monkeypatch: pytest.MonkeyPatch, ep: int, selection: str
) -> None:
    """The op's use of the front graph (``replayed_front``: the router gradient, the kept plan,
    the packed rows and the map that brings ``dx`` home; at EP 2 the kept rows' positions go to
    the expert side and only gradient rows are packed) on the host: the graph's kernels run in
    Triton's interpreter, the graph itself re-runs its launches (CUDA graphs need a GPU:
    ``test_cuda_scoring_graph_matches_eager_layer``). Four keep-0.5 calls against the stages on
    the torch paths, on every rank: the same kept pairs, outputs and gradients equal up to fp32
    summation order; one front captured, none with ``KernelOptions(front_graphs=False)``."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by triton in the spawned worker
    for d in run_distributed(w.interp_front_matches_stages, ep, selection, timeout=300):
        assert d["fronts"] == {"front": 1, "stages": 0}, d
        assert d["same_kept"], d
        for name, rel in d["diff"].items():
            assert rel < 1e-5, (name, d)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="host tensors only; on a GPU test_cuda_expert_graph_matches_eager_layer covers it",
)
@pytest.mark.parametrize(
    ("selection", "activation_mode"), [("sample", "save"), ("topk", "recompute")]
)
def test_graphed_backward_wiring_matches_stages_on_cpu(
    monkeypatch: pytest.MonkeyPatch, selection: str, activation_mode: str
) -> None:
    """The op's use of the one graph per layer (``op.trimmed._graphed_backward``: the front and
    the expert half over one argument block, ``main_grad`` fused, the kept plan and statistics
    from the graph's buffers) on the host: the graph's kernels run in Triton's interpreter, the
    graph itself re-runs its launches (``test_cuda_expert_graph_matches_eager_layer`` replays
    real CUDA graphs). Four keep-0.5 calls against the stages on the torch paths: the same kept
    pairs, outputs, gradients and ``main_grad`` equal up to fp32 summation order; one layer
    graph, none with the switches off."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by triton in the spawned worker
    d = run_distributed(
        w.interp_graphed_backward_matches_stages, 1, selection, activation_mode, timeout=300
    )[0]
    assert d["graphs"] == {"graph": 1, "stages": 0}, d
    assert d["same_kept"], d
    for name, rel in d["diff"].items():
        assert rel < 1e-5, (name, d)


def test_selection_deterministic_across_runs_and_ranks() -> None:
    """Same seed and inputs -> bit-identical selection on every rank and every run."""
    cases = [
        (
            dict(keep_ratio=0.5, selection="sample", scope="global"),
            dict(moe_aux_loss_coeff=0.0),
            None,
        ),
        (
            dict(keep_ratio=0.5, selection="sample", scope="local"),
            dict(moe_aux_loss_coeff=0.0),
            None,
        ),
    ]
    first = run_distributed(w.lrmoe_vs_dense_reference_cases, 2, 2, cases, timeout=300)
    second = run_distributed(w.lrmoe_vs_dense_reference_cases, 2, 2, cases, timeout=300)
    for a_rank, b_rank in zip(first, second):
        for a, b in zip(a_rank, b_rank):
            assert torch.equal(a["kept_mask"], b["kept_mask"])
            assert torch.equal(a["w1_grad"], b["w1_grad"])


@pytest.mark.parametrize("scope", ["local", "global"])
def test_sample_is_unbiased_and_topk_is_not(scope: str) -> None:
    """Mean expert weight gradient over many seeds -> the full gradient, for ``sample`` only.

    Bound: every element of the mean over n draws is within 5 standard errors (the sample std
    over draws / sqrt(n)) of the full-backward gradient, plus 1e-7 absolute for elements whose
    variance is ~0. ``topk`` is deterministic, so its bias shows up as a violated bound.
    """
    n = 400
    res = run_distributed(w.sample_mean_gradient, 2, n, scope, timeout=300)
    for d in res:
        for name in ("w1", "w2"):
            full, mean, std = d[f"{name}_full"], d[f"{name}_sample_mean"], d[f"{name}_sample_std"]
            err = (mean - full).abs()
            bound = 5 * std / n**0.5 + 1e-7
            worst = float((err / bound).max())
            assert worst <= 1.0, f"{name}: mean deviates by {worst:.2f}x the 5-sigma bound"
        topk_err = (d["w1_topk"] - d["w1_full"]).abs()
        assert float((topk_err / (5 * d["w1_sample_std"] / n**0.5 + 1e-7)).max()) > 1.0


def test_fused_accumulation_follows_megatron_ddp_and_fsdp_protocols() -> None:
    """Megatron's protocol for layers that write their weight gradients themselves, as its own
    and TE's linear layers follow it: DDP's ``main_grad`` is added to; a weight with
    ``overwrite_main_grad`` has it written over (a NaN start must never be read);
    Megatron-FSDP's buffer comes from ``get_main_grad()`` in the backward; two weights asking
    for different protocols get the unfused path. Keep 1.0, 0.5 in either mode and 0 (no kept
    rows: a buffer written over comes out zero), EP 1 and 2."""
    for ep in (1, 2):
        results = run_distributed(w.fused_accumulation_protocols, ep, timeout=300)
        for res in results[0]:
            case = (ep, res["case"], res["protocol"])
            assert res["same_outputs"] and res["unfused_left_buffers"], case
            assert all(res["grad_matches"]) and len(res["grad_matches"]) == 2, case
            fused = res["protocol"] != "mixed"
            assert res["flags"] == [fused, fused], case


def test_fused_accumulation_under_saved_tensor_hooks() -> None:
    """Saved-tensor hooks (activation offloading, non-reentrant checkpointing) must not turn
    the fused accumulation into main_grad off: the weights' ``main_grad`` gains the unfused
    gradient and autograd gets none; outputs and input gradients are unchanged (EP 1 and 2)."""
    for ep in (1, 2):
        results = run_distributed(w.fused_accumulation_under_saved_tensor_hooks, ep, timeout=240)
        for res in results[0]:
            case = (ep, res["case"])
            assert res["hooks_ran"] and res["same_outputs"], case
            assert res["unfused_left_main_grad"] and res["fused_grads_empty"], case
            assert all(res["fused_added_grad"]) and len(res["fused_added_grad"]) == 2, case
