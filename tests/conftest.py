"""The CPU test suite sees no GPU, on any machine, unless ``LRMOE_TEST_CUDA=1``.

On a GPU machine Megatron would put the layers' weights on the GPU next to the tests' CPU
inputs, and the subprocess tests (``pretrain_lrmoe.py``, the benchmarks' smoke runs) would take
their GPU paths. Hiding the GPUs here, before anything initialises CUDA, makes ``pytest`` and
``bash scripts/test.sh`` run the same CPU suite everywhere (``run_distributed``'s ranks hide
them by themselves too). The CUDA tests (``test_cuda_*``, skipped without a GPU) run with the
GPUs visible:

    LRMOE_TEST_CUDA=1 python -m pytest -k cuda tests/test_ops.py tests/test_triton_kernels.py
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("LRMOE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Each module with Triton kernels re-runs its ``test_interp_*`` tests in a child pytest with
# ``TRITON_INTERPRET=1`` (``megatron_lrmoe/testing/interpreter.py``: all must pass, at least a
# stated number). In this process they would only be skipped, so they are deselected instead:
# the summary's "skipped" then counts only what did not run anywhere (CUDA, Transformer Engine).
_INTERPRETED_HERE = os.environ.get("TRITON_INTERPRET") == "1"
_CHILD_ONLY = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    if _INTERPRETED_HERE:
        return
    here, child_only = [], []
    for item in items:
        (child_only if item.name.startswith("test_interp_") else here).append(item)
    if child_only:
        config.hook.pytest_deselected(items=child_only)
        items[:] = here
    config.stash[_CHILD_ONLY] = len(child_only)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    deselected = config.stash.get(_CHILD_ONLY, 0)
    if deselected:
        terminalreporter.write_line(
            f"{deselected} test_interp_* tests deselected here run under TRITON_INTERPRET=1 in "
            "their module's *_in_interpreter_subprocess test"
        )
