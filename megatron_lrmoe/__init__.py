"""megatron-lrmoe: quota-limited, compacted MoE backward for Megatron-Core.

Importing this package changes nothing in Megatron; build layers through the spec helpers.

The public names below are imported on first use (PEP 562), so that importing a light
submodule (``megatron_lrmoe.config``, ``megatron_lrmoe.training.args``, the demo's command
line) does not import torch and megatron.core: ``lrmoe-demo`` can then hide Megatron's
import-time warnings before they are printed, and ``pretrain_lrmoe.py --lrmoe-help`` answers at
once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_lrmoe.config import LRMoEConfig
    from megatron_lrmoe.experts.module import LRGroupedMLP
    from megatron_lrmoe.layer import LRMoELayer, set_lrmoe_training_step
    from megatron_lrmoe.options import KernelOptions
    from megatron_lrmoe.specs import get_lrmoe_moe_spec, lrmoe_decoder_block_spec, lrmoe_layer_spec
    from megatron_lrmoe.training.args import add_lrmoe_args

# Public name -> the module that defines it.
_EXPORTS = {
    "LRMoEConfig": "megatron_lrmoe.config",
    "KernelOptions": "megatron_lrmoe.options",
    "LRGroupedMLP": "megatron_lrmoe.experts.module",
    "LRMoELayer": "megatron_lrmoe.layer",
    "set_lrmoe_training_step": "megatron_lrmoe.layer",
    "add_lrmoe_args": "megatron_lrmoe.training.args",
    "get_lrmoe_moe_spec": "megatron_lrmoe.specs",
    "lrmoe_decoder_block_spec": "megatron_lrmoe.specs",
    "lrmoe_layer_spec": "megatron_lrmoe.specs",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Unknown names raise AttributeError, so `from megatron_lrmoe import submodule` still falls
    # back to importing the submodule.
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
