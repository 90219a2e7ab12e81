"""``MoELayerTimer`` (``--moe-layer-timing``): which forwards and backwards of an MoE layer count.

One rank, a stock Megatron MoE layer on CPU: a training step counts its forward and backward,
an evaluation forward (eval mode, no gradients) counts nothing, and under reentrant activation
checkpointing (Megatron's full recompute) the first forward, run with gradients off, counts as
well as the recomputed one.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lrmoe.testing import run_distributed


def _spans_worker(rank: int, world: int) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from megatron_lrmoe.observe.timing import MoELayerTimer
    from megatron_lrmoe.testing import init_megatron_parallel, moe_transformer_config
    from megatron_lrmoe.testing import stock_moe_layer

    pg = init_megatron_parallel(ep=1)
    layer = stock_moe_layer(moe_transformer_config(expert_model_parallel_size=1), pg)
    timer = MoELayerTimer(layer)
    x = torch.randn(16, 1, 32)
    out: dict[str, Any] = {}

    def step(run) -> int:
        run()
        count = timer.spans
        seconds = timer.take()
        assert seconds >= 0 and timer.spans == 0
        return count

    def train() -> None:
        y, _ = layer(x.clone().requires_grad_(True))
        y.sum().backward()

    def evaluate() -> None:
        layer.eval()
        with torch.no_grad():
            layer(x)
        layer.train()

    def checkpointed() -> None:
        xi = x.clone().requires_grad_(True)
        y = tensor_parallel.checkpoint(lambda t: layer(t)[0], False, xi)
        y.sum().backward()

    out["train"] = step(train)
    out["eval"] = step(evaluate)
    out["checkpointed"] = step(checkpointed)
    timer.remove()
    out["removed"] = step(train)
    return out


def test_timer_counts_training_forwards_and_backwards() -> None:
    got = run_distributed(_spans_worker, 1, timeout=300)[0]
    assert got == {"train": 2, "eval": 0, "checkpointed": 3, "removed": 0}, got
