"""megatron-lrmoe: quota-limited, compacted MoE backward for Megatron-Core.

Importing this package changes nothing in Megatron; build layers through the spec helpers.
"""

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.experts.module import LRGroupedMLP
from megatron_lrmoe.layer import LRMoELayer, set_lrmoe_training_step
from megatron_lrmoe.training.args import add_lrmoe_args
from megatron_lrmoe.specs import get_lrmoe_moe_spec, lrmoe_decoder_block_spec, lrmoe_layer_spec

__all__ = [
    "LRMoEConfig",
    "LRGroupedMLP",
    "LRMoELayer",
    "set_lrmoe_training_step",
    "add_lrmoe_args",
    "get_lrmoe_moe_spec",
    "lrmoe_decoder_block_spec",
    "lrmoe_layer_spec",
]
__version__ = "0.1.0"
