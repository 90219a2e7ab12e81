"""Test support for megatron_lrmoe: CPU shim, multi-process harness, tiny stock MoE models.

Never imported by production code. Importing this package has no side effects: the CPU shim is
installed only by an explicit :func:`install_cpu_shim` call (``run_distributed`` does it in its
child processes, which it starts with every GPU hidden unless asked for ``device="cuda"``).
"""

from megatron_lrmoe.testing.cpu_shim import cpu_shim_installed, install_cpu_shim
from megatron_lrmoe.testing.harness import (
    DistributedTestError,
    init_megatron_parallel,
    run_distributed,
)
from megatron_lrmoe.testing.models import (
    moe_transformer_config,
    skewed_routing_inputs,
    stock_moe_layer,
)

__all__ = [
    "DistributedTestError",
    "cpu_shim_installed",
    "init_megatron_parallel",
    "install_cpu_shim",
    "moe_transformer_config",
    "run_distributed",
    "skewed_routing_inputs",
    "stock_moe_layer",
]
