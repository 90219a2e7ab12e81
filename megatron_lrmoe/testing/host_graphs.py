"""The backward's CUDA graphs on the host, for tests and host-time measurements without a GPU.

The op replays CUDA graphs only on CUDA. In a process started with ``TRITON_INTERPRET=1`` (set
before triton is first imported) these switches let the same code paths run on CPU tensors:
the op is told that Triton and the graphs may run, argument blocks are pageable, and a
"capture" runs the launches once (the eager run in front of every real capture), so their
kernels run in Triton's interpreter. A "replay" then reruns the launches (``replay=True``:
tests that compare outputs) or does nothing (``replay=False``: what is left to time is the host
code around the replays, ``benchmarks/host_path_cpu.py``).

They patch module attributes of ``megatron_lrmoe.op.stages`` and ``megatron_lrmoe.op.trimmed``
(the modules that look the switches up), ``megatron_lrmoe.select.select_triton`` (whose switch,
argument block and capture ``graphs/front.py`` uses too) and ``megatron_lrmoe.graphs.backward``
for the rest of the process: call them only in a worker process of its own
(``run_distributed``).
"""

from __future__ import annotations

from typing import Callable

from megatron_lrmoe.options import active_kernels

__all__ = ["graphs_on_host", "layer_graphs_on_host"]


class _Rerun:
    """Stands in for ``torch.cuda.CUDAGraph``: a "replay" reruns the captured launches."""

    def __init__(self, launch: Callable[[], None]) -> None:
        self.replay = launch


class _Skip:
    """Stands in for ``torch.cuda.CUDAGraph``: a "replay" does nothing."""

    def replay(self) -> None:
        return None


def _graph(launch: Callable[[], None], replay: bool) -> _Rerun | _Skip:
    launch()  # the eager run in front of every capture
    return _Rerun(launch) if replay else _Skip()


def graphs_on_host(replay: bool = True) -> None:
    """The front graph (``graphs/front.py``) on the host: the op told Triton may run (the row
    kernels of ``dispatch/rows`` still see CPU tensors), pageable argument blocks, captures that
    run their launches once."""
    from megatron_lrmoe.dispatch import rows_triton
    from megatron_lrmoe.op import stages
    from megatron_lrmoe.select import select_triton

    assert rows_triton._kernels().interpreted, "needs TRITON_INTERPRET=1 before the spawn"
    stages.use_triton = lambda *tensors: True
    select_triton.graphs_wanted = lambda device: True
    host_block = select_triton.host_block
    select_triton.host_block = lambda c, q, u, _pin, lead: host_block(c, q, u, False, lead)

    def capture(self, launch, device) -> None:
        self.graph = _graph(launch, replay)

    select_triton.CapturedSelection._capture = capture


def layer_graphs_on_host(replay: bool = True) -> None:
    """:func:`graphs_on_host`, and the one graph per layer (``graphs/backward.py``):
    wanted wherever the weight gradients go into ``main_grad`` and ``expert_graphs`` is on in
    the active kernel options (the layer's ``LRMoEConfig.kernels``), no memory pool, and room
    for exactly the kept rows (on the host the grouped GEMMs' group sizes must add up to the
    rows: calls must keep the same count)."""
    from megatron_lrmoe.graphs import backward as bg
    from megatron_lrmoe.op import trimmed

    graphs_on_host(replay)
    trimmed.expert_graph_wanted = lambda g, weights, into, h: (
        into is not None and active_kernels().expert_graphs
    )
    bg.capture = lambda launch, device, pool: _graph(launch, replay)
    bg.ExpertRows.pool_for = lambda self, graph: None
    bg._ROW_QUANTUM, bg._HEADROOM = 1, 0.0
