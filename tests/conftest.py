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

if os.environ.get("LRMOE_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
