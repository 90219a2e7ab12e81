"""The Triton pair plan (``dispatch/pair_plan_triton.py``) against the torch plan it replaces.

Shape legend: T tokens, E experts, K top-k, S pairs.

The kernels run under Triton's interpreter on host tensors: ``test_in_interpreter_subprocess``
re-runs this module's ``test_interp_*`` tests in a subprocess with ``TRITON_INTERPRET=1`` (it
must be set before triton is first imported; see ``test_triton_kernels.py``). In this process
those are skipped and the torch path's own contract is tested.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lrmoe import triton_common
from megatron_lrmoe.dispatch import pair_plan_triton
from megatron_lrmoe.dispatch.permutation import PairPermutation, _build_torch
from megatron_lrmoe.testing.interpreter import run_interpreter_tests

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

interp = pytest.mark.skipif(
    not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess of this module"
)
cuda = pytest.mark.skipif(
    INTERPRETING or not HAS_CUDA or not triton_common.triton_available(),
    reason="needs a CUDA device and triton",
)


def _routing(t: int, e: int, k: int, seed: int, drop: str = "none") -> torch.Tensor:
    """``[T, E]`` map with K experts per token; ``drop`` removes some: ``"some"`` one pair of
    every third token and all pairs of every fifth, ``"half"`` about half of all pairs."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    if drop == "some":
        routing_map[torch.arange(0, t, 3), idx[::3, 0]] = False
        routing_map[::5] = False
    elif drop == "half":
        routing_map &= torch.rand(t, e, generator=gen) < 0.5
    return routing_map


def _assert_same_plan(got: tuple, ref: PairPermutation) -> None:
    token_of_pair, expert_of_pair, slot_pair = got
    for name, a, b in (
        ("token_of_pair", token_of_pair, ref.token_of_pair),
        ("expert_of_pair", expert_of_pair, ref.expert_of_pair),
        ("slot_pair", slot_pair, ref.slot_pair),
    ):
        assert a.dtype == torch.int64 and a.shape == b.shape, (name, a.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()}"


def _assert_in_bounds(got: tuple, t: int, e: int, s: int) -> None:
    token_of_pair, expert_of_pair, slot_pair = got
    assert token_of_pair.shape == (s,) and expert_of_pair.shape == (s,)
    assert bool(((token_of_pair >= 0) & (token_of_pair < t)).all()), token_of_pair
    assert bool(((expert_of_pair >= 0) & (expert_of_pair < e)).all()), expert_of_pair
    assert bool(((slot_pair >= -1) & (slot_pair < s)).all()), slot_pair


# --------------------------------------------------------------------------------------------
# this process: the torch path's contract and the path choice
# --------------------------------------------------------------------------------------------


def test_torch_path_pads_a_speculative_plan_in_bounds() -> None:
    routing_map = _routing(7, 5, 2, seed=1, drop="some")
    t, e = routing_map.shape
    perm = PairPermutation.build(routing_map, t * 2, 2)
    _assert_in_bounds((perm.token_of_pair, perm.expert_of_pair, perm.slot_pair), t, e, t * 2)
    real = int(routing_map.sum())
    assert bool((perm.token_of_pair[real:] == t - 1).all())
    assert bool((perm.expert_of_pair[real:] == e - 1).all())


def test_host_maps_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernels(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton plan must not run on host tensors")

    monkeypatch.setattr(pair_plan_triton, "pair_plan_triton", no_kernels)
    routing_map = _routing(6, 4, 2, seed=2)
    assert not pair_plan_triton.use_pair_plan_triton(routing_map)
    perm = PairPermutation.build(routing_map, 12, 2)
    assert perm.full and torch.equal(perm.slot_pair, _build_torch(routing_map, 12, 2).slot_pair)


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter subprocess")
def test_in_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreter_tests(__file__, min_passed=NUM_INTERP_TESTS)


# --------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1 subprocess: the kernels on host tensors
# --------------------------------------------------------------------------------------------

# (T, E, K, block_t, block_e): small blocks make several token blocks (a ragged last one) and
# expert chunks (a ragged last one, E not a power of two); None takes the launcher's sizes,
# which at these T are one or two blocks of the main shapes' tiles.
SHAPES = [
    (1, 4, 1, None, None),
    (1, 6, 3, 4, 4),
    (37, 12, 3, 8, 4),
    (64, 20, 4, 16, 8),
    (50, 16, 1, 16, 16),
    (96, 128, 8, None, None),
    (40, 160, 8, None, None),
    (33, 256, 8, None, None),
]
SHAPE_IDS = [f"t{t}-e{e}-k{k}-bt{bt or 'auto'}-be{be or 'auto'}" for t, e, k, bt, be in SHAPES]
NUM_INTERP_TESTS = 2 * len(SHAPES) + 8


@interp
@pytest.mark.parametrize("drop", ["none", "some"])
@pytest.mark.parametrize("t, e, k, block_t, block_e", SHAPES, ids=SHAPE_IDS)
def test_interp_matches_torch(t: int, e: int, k: int, block_t, block_e, drop: str) -> None:
    """Bit-identical to the torch plan when ``num_pairs`` is the map's True count."""
    routing_map = _routing(t, e, k, seed=t * 1000 + e, drop=drop)
    s = int(routing_map.sum())
    got = pair_plan_triton.pair_plan_triton(routing_map, s, k, block_t=block_t, block_e=block_e)
    _assert_same_plan(got, _build_torch(routing_map, s, k))


@interp
def test_interp_all_tokens_to_one_expert() -> None:
    routing_map = torch.zeros(45, 7, dtype=torch.bool)
    routing_map[:, 5] = True
    got = pair_plan_triton.pair_plan_triton(routing_map, 45, 2, block_t=16, block_e=4)
    _assert_same_plan(got, _build_torch(routing_map, 45, 2))
    assert torch.equal(got[0], torch.arange(45)) and bool((got[2][:, 1] == -1).all())


@interp
def test_interp_empty_map() -> None:
    routing_map = torch.zeros(9, 5, dtype=torch.bool)
    got = pair_plan_triton.pair_plan_triton(routing_map, 0, 3, block_t=4, block_e=4)
    _assert_same_plan(got, _build_torch(routing_map, 0, 3))
    assert bool((got[2] == -1).all())


@interp
@pytest.mark.parametrize("layout", ["transposed", "column_slice"])
def test_interp_strided_map(layout: str) -> None:
    routing_map = _routing(21, 10, 3, seed=4, drop="some")
    if layout == "transposed":  # column-major storage
        strided = routing_map.t().contiguous().t()
    else:  # a column slice of a wider map
        wide = torch.zeros(21, 17, dtype=torch.bool)
        wide[:, 3:13] = routing_map
        strided = wide[:, 3:13]
    s = int(routing_map.sum())
    got = pair_plan_triton.pair_plan_triton(strided, s, 3, block_t=8, block_e=4)
    _assert_same_plan(got, _build_torch(routing_map, s, 3))


@interp
@pytest.mark.parametrize("drop", ["some", "half"])
def test_interp_speculative_num_pairs(drop: str) -> None:
    """``num_pairs = T * K`` before the real count is known: in bounds, and the real pairs and
    slots are those of the exact plan (the padding reads token T-1, expert E-1)."""
    t, e, k = 43, 12, 4
    routing_map = _routing(t, e, k, seed=9, drop=drop)
    real = int(routing_map.sum())
    assert real < t * k
    got = pair_plan_triton.pair_plan_triton(routing_map, t * k, k, block_t=8, block_e=8)
    _assert_in_bounds(got, t, e, t * k)
    exact = _build_torch(routing_map, real, k)
    assert torch.equal(got[0][:real], exact.token_of_pair)
    assert torch.equal(got[1][:real], exact.expert_of_pair)
    assert torch.equal(got[2], exact.slot_pair)
    assert bool((got[0][real:] == t - 1).all()) and bool((got[1][real:] == e - 1).all())


@interp
def test_interp_maps_outside_the_contract_stay_in_bounds() -> None:
    """More True entries than ``num_pairs``, and rows with more than K: no write out of bounds."""
    t, e, k = 30, 9, 2
    routing_map = _routing(t, e, 4, seed=5)  # 4 experts per token, K = 2
    for s in (t * k, 7):
        got = pair_plan_triton.pair_plan_triton(routing_map, s, k, block_t=8, block_e=4)
        _assert_in_bounds(got, t, e, s)


@interp
def test_interp_build_takes_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PairPermutation.build`` runs the kernels where ``use_triton`` says so (CUDA normally;
    forced here), with the same plan and ``full`` flag, and still rejects too many pairs."""
    calls = []
    real_plan = pair_plan_triton.pair_plan_triton

    def counted(*args: object, **kwargs: object) -> tuple:
        calls.append(args[1:])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(triton_common, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(pair_plan_triton, "pair_plan_triton", counted)
    for drop, k in (("none", 3), ("some", 3)):
        routing_map = _routing(17, 8, k, seed=6, drop=drop)
        s = int(routing_map.sum())
        perm = PairPermutation.build(routing_map, s, k)
        ref = _build_torch(routing_map, s, k)
        _assert_same_plan((perm.token_of_pair, perm.expert_of_pair, perm.slot_pair), ref)
        assert perm.full == ref.full == (drop == "none")
    assert calls == [(51, 3), (int(_routing(17, 8, 3, seed=6, drop="some").sum()), 3)]
    too_many = r"52 pairs for 17 tokens, more than moe_router_topk \(3\)"
    with pytest.raises(ValueError, match=too_many):
        PairPermutation.build(torch.ones(17, 8, dtype=torch.bool), 52, 3)


# --------------------------------------------------------------------------------------------
# CUDA (skipped without a device): the compiled kernels at the model shapes
# --------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("drop", ["none", "some"])
@pytest.mark.parametrize("t, e, k", [(4096, 128, 8), (1000, 160, 8), (3000, 256, 8), (77, 512, 6)])
def test_cuda_matches_torch(t: int, e: int, k: int, drop: str):
    routing_map = _routing(t, e, k, seed=t + e, drop=drop).cuda()
    assert pair_plan_triton.use_pair_plan_triton(routing_map)
    s = int(routing_map.sum())
    perm = PairPermutation.build(routing_map, s, k)
    _assert_same_plan(
        (perm.token_of_pair, perm.expert_of_pair, perm.slot_pair), _build_torch(routing_map, s, k)
    )
    assert perm.full == (drop == "none")
    if drop != "none":  # the dispatcher's speculative T * K
        spec = PairPermutation.build(routing_map, t * k, k)
        _assert_in_bounds((spec.token_of_pair, spec.expert_of_pair, spec.slot_pair), t, e, t * k)
        assert torch.equal(spec.token_of_pair[:s], perm.token_of_pair)
        assert torch.equal(spec.slot_pair, perm.slot_pair)
