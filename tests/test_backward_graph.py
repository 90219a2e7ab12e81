"""Host-side bookkeeping of the expert graphs (``graphs/backward.py``): which calls get
the shared buffers, when they are replaced, and what is dropped with them.

The graphs themselves need CUDA (``test_cuda_expert_graph_matches_eager_layer`` in
``tests/test_layer.py``); their recorded body runs in Triton's interpreter in
``test_interp_layer_graph_body_matches_front_and_eager_stages``
(``tests/test_triton_kernels.py``).
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from megatron_lrmoe.graphs import backward as bg


@pytest.fixture(autouse=True)
def _fresh() -> None:
    bg.reset()
    yield
    bg.reset()


def _rows(num_kept: int, tokens: int) -> bg.ExpertRows | None:
    """The shared buffers for a call of ``tokens`` tokens, top-2, 3 experts, width 16."""
    g = torch.zeros(tokens, 16)
    slot_plan = torch.zeros(tokens, 2, dtype=torch.int64)
    return bg.expert_graph_rows(num_kept, g, slot_plan, 2 * tokens, 3, True)


def test_shared_rows_come_from_the_second_sighting_and_grow_when_a_call_keeps_more() -> None:
    assert _rows(5, tokens=6) is None  # a one-off shape allocates nothing
    rows = _rows(5, tokens=6)
    assert rows is not None and rows.capacity % 256 == 0 and rows.capacity >= 5
    # The kept rows live in the graphs' pool: a set holds none of its own, and hands the front
    # stand-ins that only say their dtype and that the inputs are packed.
    front = rows.front_buffers(torch.zeros(12, 16), torch.zeros(6, 2), torch.zeros(12))
    assert front.rows_in_graph and front.g_kept.shape == (0, 16) and front.x_kept is not None
    assert _rows(7, tokens=6) is rows  # fits: the same buffers
    bg._GRAPHS.add(("layer 1",), SimpleNamespace(rows=rows))
    bg._GRAPHS.add(("layer 2",), SimpleNamespace(rows=rows))
    bigger = _rows(rows.capacity + 1, tokens=6)  # does not fit: a new set ...
    assert bigger is not None and bigger is not rows and bigger.capacity > rows.capacity
    assert not bg._GRAPHS.graphs  # ... and the graphs captured on the old one go with it
    assert bg.graph_memory_bytes() == 0  # nothing held before a graph captures


def test_at_most_max_shapes_keep_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bg, "_MAX_SHAPES", 2)
    kept: dict[int, bg.ExpertRows] = {}
    for tokens in (6, 7, 8):
        assert _rows(4, tokens) is None
        kept[tokens] = _rows(4, tokens)
        bg._GRAPHS.add((tokens,), SimpleNamespace(rows=kept[tokens]))
    # The least recently used shape (6 tokens) lost its buffers and its graph.
    assert [s.tokens for s in bg._ROWS] == [7, 8]
    assert sorted(k[0] for k in bg._GRAPHS.graphs) == [7, 8]
    assert _rows(4, 7) is kept[7]  # 7 is now the most recently used
    again = _rows(4, 6)  # seen twice before: buffers again at once, new ones
    assert again is not None and again is not kept[6]
    assert [s.tokens for s in bg._ROWS] == [7, 6]


def test_the_front_graph_alone_refuses_rows_left_to_a_layer_graph() -> None:
    """Only the layer graph allocates the kept rows itself; the front graph alone packs into
    the caller's buffers, so it rejects the stand-ins rather than pack to address 0."""
    from megatron_lrmoe.graphs import front as front_graph

    assert _rows(5, tokens=6) is None
    rows = _rows(5, tokens=6)
    front = rows.front_buffers(torch.zeros(12, 16), torch.zeros(6, 2, dtype=torch.int64),
                               torch.zeros(12))  # fmt: skip
    g = torch.zeros(6, 16)
    with pytest.raises(ValueError, match="rows_in_graph"):
        front_graph.front_triton(
            "topk", g, g, torch.zeros(12), torch.zeros(12, dtype=torch.int64),
            torch.tensor([4, 4, 4]), torch.tensor([2, 2, 2]), None, front,
        )  # fmt: skip


def test_a_layers_graphs_go_when_its_weight_is_freed() -> None:
    """``_track``: a cached layer graph stays until the layer's fc1 weight is freed (the layer
    deleted), or until the cache lets it go first (then freeing the weight is a no-op)."""
    w1, other = torch.zeros(3, 4), torch.zeros(3, 4)
    mine, theirs = SimpleNamespace(), SimpleNamespace()
    bg._track(("mine",), mine, w1)
    bg._track(("theirs",), theirs, other)
    assert bg._GRAPHS.graphs == {("mine",): mine, ("theirs",): theirs}
    del w1
    gc.collect()
    assert bg._GRAPHS.graphs == {("theirs",): theirs}
    bg._GRAPHS.clear()
    del other  # its entry went first: nothing left to drop
    gc.collect()
    assert not bg._GRAPHS.graphs
