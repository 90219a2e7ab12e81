"""Checkpoints move between Megatron's ``SequentialMLP`` experts and ``LRGroupedMLP``.

Shape legend: E global experts, L local experts, H hidden, F expert FFN width, F1 = 2F (SwiGLU).

One 2-rank gloo run (module-scoped fixture) does every check, first at EP=2 and then, after
re-initialising megatron's parallel state, at EP=1 (DP=2), so process start-up and the megatron
import are paid once. Each check returns a list of problems per rank; the tests assert it is
empty, so a failure names the check and the offending keys.

Checked, at both EP sizes unless stated:
* ``sharded_state_dict()`` of a stock ``MoELayer`` and of an LRMoE layer from the same config:
  same local keys in the same order and, per entry, the same type, global key, global shape and
  offset, axis fragmentations, replica id, local shape, dtype and, for the SwiGLU
  ``ShardedTensorFactory``, the same of every tensor it builds; also with a parent prefix and
  layer offset, and with ``singleton_local_shards``; and for a non-gated (GELU) config at EP=2.
* Each LRMoE ``ShardedTensor`` holds the expert parameter itself (factory halves are views of it).
* ``state_dict()``: same keys in the same order, values of the same type (``_extra_state`` is
  ``None`` on both sides).
* torch_dist distributed checkpoints, loaded as Megatron's training loop does
  (``dist_checkpointing.load`` then ``load_state_dict(strict=True)``): stock -> LRMoE and
  LRMoE -> stock at EP=2, and both checkpoints (written at EP=2) into both layers at EP=1.
* ``torch.save`` / ``torch.load`` of ``state_dict()``, stock -> LRMoE and LRMoE -> stock.
"""

from __future__ import annotations

import importlib.util
import os
import queue
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lrmoe.testing import run_distributed

WORLD_SIZE = 2
# Spawning two ranks and importing megatron takes ~10 s; the checks themselves take ~2 s.
TIMEOUT_S = 180.0
# Parent-module prefix and layer-axis offset as a TransformerBlock passes them to its MLP.
BLOCK_PREFIX = "decoder.layers.0.mlp."
BLOCK_OFFSETS = ((0, 0, 1),)
STOCK_DIR = "dist_stock_ep2"
LRMOE_DIR = "dist_lrmoe_ep2"
CHECKS = (
    "layout_ep2",
    "layout_ep1",
    "layout_ep2_not_gated",
    "views_ep2",
    "views_ep1",
    "state_dict_keys_ep2",
    "state_dict_keys_ep1",
    "dist_stock_to_lrmoe_ep2",
    "dist_lrmoe_to_stock_ep2",
    "dist_ep2_to_ep1_stock_sanity",
    "dist_ep2_to_ep1_lrmoe",
    "torch_save_stock_to_lrmoe",
    "torch_save_lrmoe_to_stock",
)


# ----------------------------------------------------------------------------------------------
# Per-rank helpers (run inside run_distributed children).
# ----------------------------------------------------------------------------------------------


def _build_layers(ep: int, pg: Any, **overrides: Any) -> tuple[Any, Any]:
    """A stock MoELayer (SequentialMLP experts) and an LRMoE layer from the same config."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import moe_transformer_config, stock_moe_layer

    config = moe_transformer_config(expert_model_parallel_size=ep, **overrides)
    stock = stock_moe_layer(config, pg)
    lrmoe = get_lrmoe_moe_spec(LRMoEConfig())(config=config, pg_collection=pg, layer_number=1)
    return stock, lrmoe


@torch.no_grad()
def _poison(layer: torch.nn.Module) -> None:
    """Fill every parameter with NaN, so anything a load fails to write cannot compare equal."""
    for param in layer.parameters():
        param.fill_(float("nan"))


def _expert_stacks(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``([L, F1, H], [L, H, F])`` local expert weights of either experts implementation."""
    experts = layer.experts
    fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts.local_experts])
    return fc1, fc2


def _weights(layer: Any) -> dict[str, torch.Tensor]:
    """Router and expert weights, named independently of the experts implementation."""
    fc1, fc2 = _expert_stacks(layer)
    return {"router": layer.router.weight.detach().clone(), "fc1": fc1.clone(), "fc2": fc2.clone()}


def _weight_mismatches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str
) -> list[str]:
    """One line per weight of ``want`` that ``got`` does not match exactly (NaN never matches)."""
    return [
        f"{what}: {name} differs (shapes {tuple(got[name].shape)} / {tuple(want[name].shape)})"
        for name in want
        if got[name].shape != want[name].shape or not torch.equal(got[name], want[name])
    ]


def _gather_experts(weights: dict[str, torch.Tensor], ep_group: Any) -> dict[str, torch.Tensor]:
    """Global ``[E, ...]`` expert stacks (EP ranks hold consecutive experts); router as is."""
    out = {"router": weights["router"]}
    for name in ("fc1", "fc2"):
        parts = [torch.empty_like(weights[name]) for _ in range(ep_group.size())]
        torch.distributed.all_gather(parts, weights[name].contiguous(), group=ep_group)
        out[name] = torch.cat(parts)
    return out


def _describe(value: Any) -> tuple:
    """Everything about a sharded-state-dict entry that decides where it lands in a checkpoint."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    if isinstance(value, ShardedTensorFactory):
        built = value.build()
        built = built.values() if isinstance(built, dict) else built
        return ("factory", value.key, value.replica_id, tuple(_describe(v) for v in built))
    if isinstance(value, ShardedTensor):
        return (
            "tensor",
            value.key,
            tuple(value.global_shape),
            tuple(value.global_offset),
            tuple(value.axis_fragmentations),
            value.replica_id,
            tuple(value.local_shape),
            value.dtype,
            value.prepend_axis_num,
            value.allow_shape_mismatch,
            value.flattened_range,
        )
    if isinstance(value, ShardedObject):
        return (
            "object",
            value.key,
            tuple(value.global_shape),
            tuple(value.global_offset),
            value.replica_id,
            type(value.data).__name__,
        )
    return ("plain", type(value).__name__)


def _layout_problems(stock: Any, lrmoe: Any) -> list[str]:
    """Differences between the two layers' sharded state dicts, for three calling contexts."""
    problems: list[str] = []
    variants = {
        "default": {},
        "block prefix/offsets": dict(prefix=BLOCK_PREFIX, sharded_offsets=BLOCK_OFFSETS),
        "singleton_local_shards": dict(metadata={"singleton_local_shards": True}),
    }
    for variant, kwargs in variants.items():
        want = stock.sharded_state_dict(**kwargs)
        got = lrmoe.sharded_state_dict(**kwargs)
        if list(got) != list(want):
            problems.append(
                f"{variant}: local keys differ:\n  got  {list(got)}\n  want {list(want)}"
            )
            continue
        for key in want:
            got_desc, want_desc = _describe(got[key]), _describe(want[key])
            if got_desc != want_desc:
                problems.append(f"{variant}: {key}:\n  got  {got_desc}\n  want {want_desc}")
    return problems


def _same_view(view: torch.Tensor, target: torch.Tensor) -> bool:
    """``view`` aliases exactly ``target``'s elements (same storage, offset, shape, strides)."""
    return (
        view.untyped_storage().data_ptr() == target.untyped_storage().data_ptr()
        and view.data_ptr() == target.data_ptr()
        and view.shape == target.shape
        and view.stride() == target.stride()
    )


def _view_problems(lrmoe: Any) -> list[str]:
    """Every LRMoE sharded tensor holds the expert parameter itself (factory halves: views of it).

    The optimizer's checkpoint maps its state to model parameters by identity, so the data must be
    the parameter object, as in SequentialMLP.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    experts = lrmoe.experts
    sharded = lrmoe.sharded_state_dict()
    problems: list[str] = []
    for i, expert in enumerate(experts.local_experts):
        w1, w2 = expert.linear_fc1.weight, expert.linear_fc2.weight
        ffn = w2.shape[-1]
        fc1 = sharded[f"experts.local_experts.{i}.linear_fc1.weight"]
        fc2 = sharded[f"experts.local_experts.{i}.linear_fc2.weight"]
        if isinstance(fc1, ShardedTensorFactory):
            if fc1.data is not w1:
                problems.append(f"expert {i}: fc1 factory data is not the fc1 parameter")
            gate, up = fc1.build()
            if not _same_view(gate.data, w1[:ffn]):
                problems.append(f"expert {i}: factory gate half is not a view of fc1[:F]")
            if not _same_view(up.data, w1[ffn:]):
                problems.append(f"expert {i}: factory up half is not a view of fc1[F:]")
        elif fc1.data is not w1:
            problems.append(f"expert {i}: fc1 data is not the fc1 parameter")
        if fc2.data is not w2:
            problems.append(f"expert {i}: fc2 data is not the fc2 parameter")
    return problems


def _state_dict_problems(stock: Any, lrmoe: Any) -> list[str]:
    """Differences between the two layers' plain ``state_dict()`` keys, order and value types."""
    want = stock.state_dict()
    got = lrmoe.state_dict()
    if list(got) != list(want):
        return [f"state_dict keys differ:\n  got  {list(got)}\n  want {list(want)}"]
    return [
        f"{key}: value type {type(got[key]).__name__} != {type(want[key]).__name__}"
        for key in want
        if type(got[key]) is not type(want[key])
    ]


def _dist_save(layer: Any, directory: str) -> None:
    """Save ``layer`` as a torch_dist checkpoint (megatron's default format) into ``directory``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The torch_dist writer collects write results through a multiprocessing Manager queue, and
    # run_distributed's daemonic ranks may not start processes. A synchronous save writes and
    # reads the results in this process, so a thread queue does the same job.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(layer.sharded_state_dict(), directory)


def _dist_load(layer: Any, directory: str) -> None:
    """Load as megatron.training.checkpointing does: dist load, then a strict load_state_dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _poison(layer)
    # RAISE_ALL (not training's default, which assumes unexpected keys are fine) so that any
    # difference between the checkpoint's global keys and the requested ones fails loudly.
    loaded = dist_checkpointing.load(
        layer.sharded_state_dict(), directory, strict=StrictHandling.RAISE_ALL
    )
    layer.load_state_dict(loaded, strict=True)


def _torch_save_problems(src: Any, dst: Any, path: str, what: str) -> list[str]:
    """``torch.save(src.state_dict())``, strict-load it into ``dst``; return weight mismatches."""
    torch.save(src.state_dict(), path)
    _poison(dst)
    dst.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return _weight_mismatches(_weights(dst), _weights(src), what)


def _checkpoint_worker(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """All checks of this module on one rank; returns check name -> problems."""
    from megatron.core import parallel_state

    from megatron_lrmoe.testing import init_megatron_parallel

    # megatron's torch_dist writer imports psutil lazily and fails without it; report that as
    # the reason for every distributed-checkpoint check instead of erroring the whole run.
    has_psutil = importlib.util.find_spec("psutil") is not None
    missing = [
        "psutil is not installed (megatron's torch_dist writer needs it; add it to setup.py)"
    ]
    results: dict[str, list[str]] = {name: list(missing) for name in CHECKS if "dist_" in name}
    stock_dir, lrmoe_dir = os.path.join(root, STOCK_DIR), os.path.join(root, LRMOE_DIR)

    # --- EP=2: each rank holds E/2 experts. ---
    pg = init_megatron_parallel(ep=2)
    stock, lrmoe = _build_layers(2, pg)  # independently initialised, so their weights differ
    results["layout_ep2"] = _layout_problems(stock, lrmoe)
    results["views_ep2"] = _view_problems(lrmoe)
    results["state_dict_keys_ep2"] = _state_dict_problems(stock, lrmoe)
    # Without a GLU, fc1 is a plain ShardedTensor on both sides (no SwiGLU factory).
    results["layout_ep2_not_gated"] = _layout_problems(
        *_build_layers(2, pg, gated_linear_unit=False, activation_func=torch.nn.functional.gelu)
    )
    # Otherwise a checkpoint loaded from the wrong directory would still compare equal.
    assert not torch.equal(_weights(stock)["fc1"], _weights(lrmoe)["fc1"])
    stock_global = _gather_experts(_weights(stock), pg.ep)
    lrmoe_global = _gather_experts(_weights(lrmoe), pg.ep)

    stock_dst, lrmoe_dst = _build_layers(2, pg)
    if has_psutil:
        _dist_save(stock, stock_dir)
        _dist_save(lrmoe, lrmoe_dir)
        _dist_load(lrmoe_dst, stock_dir)
        results["dist_stock_to_lrmoe_ep2"] = _weight_mismatches(
            _weights(lrmoe_dst), _weights(stock), "stock ckpt -> LRMoE"
        )
        _dist_load(stock_dst, lrmoe_dir)
        results["dist_lrmoe_to_stock_ep2"] = _weight_mismatches(
            _weights(stock_dst), _weights(lrmoe), "LRMoE ckpt -> stock"
        )

    results["torch_save_stock_to_lrmoe"] = _torch_save_problems(
        stock, lrmoe_dst, os.path.join(root, f"stock_rank{rank}.pt"), "stock -> LRMoE"
    )
    results["torch_save_lrmoe_to_stock"] = _torch_save_problems(
        lrmoe, stock_dst, os.path.join(root, f"lrmoe_rank{rank}.pt"), "LRMoE -> stock"
    )

    # --- EP=1 (DP=2): every rank holds all E experts; checkpoints written at EP=2 reshard. ---
    parallel_state.destroy_model_parallel()
    pg = init_megatron_parallel(ep=1)
    stock, lrmoe = _build_layers(1, pg)
    results["layout_ep1"] = _layout_problems(stock, lrmoe)
    results["views_ep1"] = _view_problems(lrmoe)
    results["state_dict_keys_ep1"] = _state_dict_problems(stock, lrmoe)

    if has_psutil:
        sanity: list[str] = []
        lrmoe_problems: list[str] = []
        for directory, want, name in (
            (stock_dir, stock_global, "stock"),
            (lrmoe_dir, lrmoe_global, "LRMoE"),
        ):
            _dist_load(stock, directory)
            sanity += _weight_mismatches(_weights(stock), want, f"EP=2 {name} ckpt -> EP=1 stock")
            _dist_load(lrmoe, directory)
            lrmoe_problems += _weight_mismatches(
                _weights(lrmoe), want, f"EP=2 {name} ckpt -> EP=1 LRMoE"
            )
        results["dist_ep2_to_ep1_stock_sanity"] = sanity
        results["dist_ep2_to_ep1_lrmoe"] = lrmoe_problems
    return results


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    """Per-rank results of :func:`_checkpoint_worker` (one 2-rank run for the whole module)."""
    root: Path = tmp_path_factory.mktemp("lrmoe_checkpoint")
    # Created here so both ranks see the same, existing and empty, directories.
    for name in (STOCK_DIR, LRMOE_DIR):
        (root / name).mkdir()
    return run_distributed(_checkpoint_worker, WORLD_SIZE, str(root), timeout=TIMEOUT_S)


@pytest.mark.parametrize("check", CHECKS)
def test_checkpoint_compatibility(
    check: str, checkpoint_results: list[dict[str, list[str]]]
) -> None:
    """``check`` found nothing on any rank (see the module docstring for what each covers)."""
    problems = {rank: res[check] for rank, res in enumerate(checkpoint_results) if res[check]}
    assert not problems, "\n".join(
        f"rank {rank}: " + "\n".join(lines) for rank, lines in problems.items()
    )
