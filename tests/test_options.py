"""``KernelOptions`` (megatron_lrmoe/options.py): the switches, how they are made active, and
each switch's reader on the host (the GPU paths they turn off have their own tests: the CUDA
tests of test_select_kernels.py, test_triton_kernels.py and test_layer.py compare each fast path
with the code it replaces, the options switching between them).

Readers: ``triton`` in ``triton_common.use_triton``, ``grouped_mm`` in the grouped GEMMs'
backend rule, ``select_graphs`` / ``score_graphs`` / ``front_graphs`` in the selection's and the
front's graph switches, ``expert_graphs`` in the layer graph's, ``native_planner`` in
``plan_call``; and the layer, which makes its config's options active for its own work only.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lrmoe_workers as w
from megatron_lrmoe import KernelOptions, LRMoEConfig, options
from megatron_lrmoe.control import native
from megatron_lrmoe.control.controller import plan_call
from megatron_lrmoe.experts import grouped_gemm as gg
from megatron_lrmoe.graphs import backward as bg
from megatron_lrmoe.graphs import front
from megatron_lrmoe.options import active_kernels, using_kernels
from megatron_lrmoe.select import select_triton
from megatron_lrmoe.testing import run_distributed

SWITCHES = [f.name for f in dataclasses.fields(KernelOptions)]
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def test_defaults_are_all_on_and_checked() -> None:
    assert all(getattr(KernelOptions(), name) for name in SWITCHES)
    assert KernelOptions().switched_off == ()
    assert KernelOptions(triton=False, native_planner=False).switched_off == (
        "triton",
        "native_planner",
    )
    assert LRMoEConfig().kernels == KernelOptions()
    assert active_kernels() == KernelOptions()  # nothing left active by an earlier test
    for name in SWITCHES:
        with pytest.raises(ValueError, match=rf"LRMoEConfig.kernels.{name} \(0\) must be True"):
            KernelOptions(**{name: 0})
    with pytest.raises(ValueError, match="must be True or False"):
        KernelOptions(grouped_mm="loop")  # the retired environment variable's value
    with pytest.raises(ValueError, match=r"LRMoEConfig.kernels \(\{'triton': False\}\)"):
        LRMoEConfig(kernels={"triton": False})
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().triton = False  # type: ignore[misc]
    # An "auto" layer's per-call config keeps the options.
    auto = LRMoEConfig(
        keep_ratio="auto", variance_target=0.1, kernels=KernelOptions(front_graphs=False)
    )
    assert auto.at_keep_ratio(0.5).kernels == KernelOptions(front_graphs=False)


def test_using_kernels_nests_and_restores() -> None:
    off = KernelOptions(triton=False)
    loop = KernelOptions(grouped_mm=False)
    with using_kernels(off) as entered:
        assert entered is off and active_kernels() is off
        with using_kernels(loop):
            assert active_kernels() is loop
        assert active_kernels() is off
        with pytest.raises(RuntimeError), using_kernels(loop):
            raise RuntimeError("restored on the way out all the same")
        assert active_kernels() is off
    assert active_kernels() == KernelOptions()
    with pytest.raises(ValueError, match="needs a KernelOptions"):
        using_kernels({"triton": False})  # type: ignore[arg-type]


def test_triton_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_lrmoe import triton_common

    monkeypatch.setattr(triton_common, "triton_available", lambda: True)
    cuda_tensor = SimpleNamespace(is_cuda=True)  # what use_triton reads of a tensor
    assert triton_common.use_triton(cuda_tensor)
    with using_kernels(KernelOptions(triton=False)):
        assert not triton_common.use_triton(cuda_tensor)
    assert triton_common.use_triton(cuda_tensor)


def test_grouped_mm_switch() -> None:
    x, weight = torch.randn(6, 16), torch.randn(3, 8, 16)
    auto = "torch_grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "loop"
    assert gg.grouped_mm_backend(x, weight) == auto
    with using_kernels(KernelOptions(grouped_mm=False)):
        assert gg.grouped_mm_backend(x, weight) == "loop"
        assert gg.grouped_mm_backend_for(x.dtype, x.device, 16, weight) == "loop"
    assert gg.grouped_mm_backend(x, weight) == auto


def test_graph_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each graph switch turns its graph off and, as documented, the graphs built on it."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert select_triton.graphs_wanted(CUDA) and front.front_graphs_wanted(CUDA)
    assert not select_triton.graphs_wanted(torch.device("cpu"))
    wanted = {
        "select_graphs": (False, False),
        "score_graphs": (True, False),
        "front_graphs": (True, False),
        "triton": (True, True),  # the callers check use_triton themselves
    }
    for name, (selection, fronts) in wanted.items():
        with using_kernels(KernelOptions(**{name: False})):
            assert select_triton.graphs_wanted(CUDA) == selection, name
            assert front.front_graphs_wanted(CUDA) == fronts, name
    # The scoring graph declines before looking at its inputs when the scoring is kept out.
    with using_kernels(KernelOptions(score_graphs=False)):
        assert front.score_select_triton("topk", None, None, SimpleNamespace(device=CUDA),
                                         None, None, None) is None  # fmt: skip


def test_expert_graph_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer graph (graphs/backward.py) runs only with ``expert_graphs`` and the front
    graphs on (its other conditions faked as met)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(bg, "_kernels_take", lambda g, w1, w2: True)
    main_grad = SimpleNamespace(is_contiguous=lambda: True)
    into = SimpleNamespace(fixed=True, fc1=main_grad, fc2=main_grad)
    g = SimpleNamespace(is_cuda=True, device=CUDA)
    assert bg.expert_graph_wanted(g, (None, None), into, None)
    for name in ("expert_graphs", "front_graphs", "score_graphs", "select_graphs"):
        with using_kernels(KernelOptions(**{name: False})):
            assert not bg.expert_graph_wanted(g, (None, None), into, None), name
    assert not bg.expert_graph_wanted(g, (None, None), None, None)  # no main_grad


def test_native_planner_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan_call`` asks for the compiled library only with ``native_planner`` on (the switch
    is the config's: the planner reads no process-wide options)."""
    asked = []
    monkeypatch.setattr(native, "library", lambda: asked.append(1))  # "no library"
    counts = np.array([[40, 3, 9, 0], [5, 30, 2, 7]], dtype=np.int64)
    lrmoe = LRMoEConfig(keep_ratio=0.5, max_replicas_per_rank=1)
    python = dataclasses.replace(lrmoe, kernels=KernelOptions(native_planner=False))
    plan_call(counts, 0, python)
    assert asked == []
    with using_kernels(KernelOptions(native_planner=False)):  # not what plan_call reads
        plan_call(counts, 0, lrmoe)
    assert asked


def test_retired_environment_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(options, "_warned", False)
    for name in options.RETIRED_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert options.warn_retired_environment() == []
    monkeypatch.setenv("LRMOE_TRITON", "0")
    monkeypatch.setenv("LRMOE_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger=options.__name__):
        assert options.warn_retired_environment() == ["LRMOE_TRITON", "LRMOE_NATIVE"]
        options.warn_retired_environment()
    records = [r.getMessage() for r in caplog.records if r.name == options.__name__]
    assert len(records) == 1, records
    assert "--no-lrmoe-triton" in records[0] and "--no-lrmoe-native-planner" in records[0]


def test_layer_makes_its_options_active_for_its_own_work() -> None:
    """EP 2, planned by the controller: every grouped GEMM (forward and backward) and the pair
    plan run under the layer's ``kernels``, whatever options surround the call; the planner
    never asks for the library it was told not to use; afterwards the surrounding options are
    active again, then the defaults."""
    for d in run_distributed(w.kernel_options_in_a_layer_call, 2, timeout=240):
        assert d["planned"], d
        assert d["gemm"] == [d["want"]] and d["pair_plan"] == [d["want"]], d
        assert d["library_asked"] == 0, d
        assert d["outer_restored"] and d["default_restored"], d
