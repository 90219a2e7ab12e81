"""Checkpoints move between Megatron's ``SequentialMLP`` experts and ``LRGroupedMLP``.

Shape legend: E global experts, L local experts, H hidden, F expert FFN width, F1 = 2F (SwiGLU).

``LRGroupedMLP`` holds one ``[L, ...]`` parameter per projection where SequentialMLP holds L
per-expert parameters, so the local entries of the two ``sharded_state_dict``s differ by design;
what must agree is what lands in a checkpoint. One 2-rank gloo run (module-scoped fixture) does
the checks of ``CHECKS``, at EP=2, then EP=1 (DP=2) and EP=2 again (re-initialising megatron's
parallel state in between), so process start-up and the megatron import are paid once; one
4-rank run does ``EP_CHANGE_CHECKS`` (EP=4 <-> EP=2). Each check returns a list of problems per
rank; the tests assert it is empty, so a failure names the check and the keys.

Checked (``layout``/``views``/``state_dict`` at both EP sizes):
* ``layout``: the sharded state dicts of a stock ``MoELayer`` and of an LRMoE layer holding the
  same weights, gathered from every rank, have the same global keys, global shapes, dtypes and
  per-rank replica ids; the main replicas of each implementation cover every global tensor
  exactly once (no gap, no overlap) and assemble to the same global tensors (so every expert and
  both SwiGLU halves land at the same place); ``ShardedObject`` extra states agree. For the
  default metadata, a parent prefix + layer offset, ``singleton_local_shards`` and (EP=2) a
  non-gated GELU config.
* ``views``: each LRMoE weight entry's data is the parameter itself, the tensors its factories
  build are views of it, and Megatron's ``get_param_id_to_sharded_param_map`` (the optimizer's
  checkpoint mapping) finds both parameters, with and without ``singleton_local_shards``.
* ``experts_api``: DDP/optimizer attributes (``allreduce``, ``tensor_model_parallel``) as stock's
  expert linears; initial weights are the per-expert draws in order; ``expert_weights()`` are
  views; ``forward`` raises (the experts run inside LRMoELayer's fused op).
* ``state_dict``: same keys in the same order and value types as stock; values are the experts.
* ``load_hooks``: stacked keys load too; both layouts at once, a missing expert and an extra
  expert are errors.
* ``torch_save``: ``torch.save`` state dicts strict-load stock -> LRMoE and LRMoE -> stock.
* ``dist_*`` (torch_dist, loaded as Megatron's training loop does: ``dist_checkpointing.load``
  then strict ``load_state_dict``): model checkpoints stock <-> LRMoE at EP=2, with
  ``singleton_local_shards``, EP=2 -> EP=1 and EP=1 -> EP=2.
* ``optim_*``: model + optimizer state (Megatron's ``get_megatron_optimizer`` Adam behind
  Megatron's DDP; two steps of deterministic gradients before the save): after the load the
  weights are the saved ones and one more step with the same gradients gives the source's next
  weights exactly (so Adam's moments and step count moved too). Stock -> LRMoE, LRMoE -> stock
  and LRMoE -> LRMoE at EP=2 and at EP=1, with ``singleton_local_shards`` (EP=2); every
  combination EP=4 -> EP=2 and EP=2 -> EP=4 (4 ranks). Not EP=1 <-> EP>1: Megatron's optimizer
  has no expert part at EP=1 (expert weights are ordinary data-parallel parameters there), so
  its checkpoint structure differs; that holds for SequentialMLP alone as well.
* ``distopt_*``: the same with ``use_distributed_optimizer=True``: the ``fully_reshardable``
  format (model space, keyed by the model's sharded entries) stock <-> LRMoE at EP=2 and across
  EP=4 <-> EP=2; ``dp_reshardable`` (Megatron-LM's default, bucket space) LRMoE -> LRMoE at EP=2
  and EP=1. ``dp_reshardable`` does not move between implementations: its buckets follow the
  parameters' order and shapes, and a stock bucket loads without error into LRMoE's with the
  experts' state permuted. Two megatron 0.19.2 bugs of
  the CPU-only path (torch AdamW instead of apex/TE Adam) are worked around in this process: see
  ``_fix_torch_adam_step_on_load`` and ``_untie_torch_adam_steps``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import queue
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from megatron_lrmoe.testing import run_distributed

WORLD_SIZE = 2
# Spawning two ranks and importing megatron takes ~10-20 s here; the checks a few tens of seconds.
TIMEOUT_S = 420.0
# Parent-module prefix and layer-axis offset as a TransformerBlock passes them to its MLP.
BLOCK_PREFIX = "decoder.layers.0.mlp."
BLOCK_OFFSETS = ((0, 0, 1),)
# What megatron.training passes (training/checkpointing.py _build_sharded_state_dict_metadata).
TRAINING_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
SINGLETON_METADATA = {**TRAINING_METADATA, "singleton_local_shards": True}
# The gloo ("memory efficient") variant: the default one moves the gathered state with .cuda().
FULLY_RESHARDABLE = {
    **TRAINING_METADATA,
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}
DP_RESHARDABLE = {**TRAINING_METADATA, "distrib_optim_sharding_type": "dp_reshardable"}
IMPLS = ("stock", "lrmoe")
SAVED_STEPS = 2  # optimizer steps before a save
CHECKS = (
    "layout_ep2",
    "layout_ep1",
    "layout_ep2_not_gated",
    "views_ep2",
    "views_ep1",
    "experts_api_ep2",
    "experts_api_ep1",
    "state_dict_ep2",
    "state_dict_ep1",
    "load_hooks",
    "torch_save_stock_to_lrmoe",
    "torch_save_lrmoe_to_stock",
    "dist_stock_to_lrmoe_ep2",
    "dist_lrmoe_to_stock_ep2",
    "dist_singleton_both_ways_ep2",
    "dist_ep2_to_ep1_stock_sanity",
    "dist_ep2_to_ep1_lrmoe",
    "dist_ep1_to_ep2",
    "optim_both_ways_ep2",
    "optim_both_ways_ep1",
    "optim_singleton_both_ways_ep2",
    "distopt_fully_reshardable_both_ways_ep2",
    "distopt_dp_reshardable_resume",
)
EP_CHANGE_WORLD_SIZE = 4
EP_CHANGE_CHECKS = (
    "optim_ep4_to_ep2",
    "optim_ep2_to_ep4",
    "distopt_fully_reshardable_ep4_to_ep2",
    "distopt_fully_reshardable_ep2_to_ep4",
)


# ----------------------------------------------------------------------------------------------
# Per-rank helpers (run inside run_distributed children).
# ----------------------------------------------------------------------------------------------


def _build_layer(impl: str, ep: int, pg: Any, **overrides: Any) -> Any:
    """A stock MoELayer (SequentialMLP experts) or an LRMoE layer; each draws its own weights."""
    from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
    from megatron_lrmoe.testing import moe_transformer_config, stock_moe_layer

    config = moe_transformer_config(expert_model_parallel_size=ep, **overrides)
    if impl == "stock":
        return stock_moe_layer(config, pg)
    return get_lrmoe_moe_spec(LRMoEConfig())(config=config, pg_collection=pg, layer_number=1)


def _build_layers(ep: int, pg: Any, **overrides: Any) -> tuple[Any, Any]:
    return tuple(_build_layer(impl, ep, pg, **overrides) for impl in IMPLS)


@torch.no_grad()
def _poison(layer: torch.nn.Module) -> None:
    """Fill every parameter with NaN, so anything a load fails to write cannot compare equal."""
    for param in layer.parameters():
        param.fill_(float("nan"))


def _is_lrmoe(layer: Any) -> bool:
    return hasattr(layer.experts, "weights")


def _expert_stacks(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``([L, F1, H], [L, H, F])`` local expert weights of either experts implementation."""
    experts = layer.experts
    if _is_lrmoe(layer):
        return tuple(w.detach() for w in experts.weights())
    fc1 = torch.stack([e.linear_fc1.weight.detach() for e in experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.detach() for e in experts.local_experts])
    return fc1, fc2


def _weights(layer: Any) -> dict[str, torch.Tensor]:
    """Router and expert weights, named independently of the experts implementation."""
    fc1, fc2 = _expert_stacks(layer)
    return {"router": layer.router.weight.detach().clone(), "fc1": fc1.clone(), "fc2": fc2.clone()}


def _global_weights(layer: Any) -> dict[str, torch.Tensor]:
    """Router and global ``[E, ...]`` expert stacks (EP ranks hold consecutive experts)."""
    weights = _weights(layer)
    group = layer.experts.ep_group
    for name in ("fc1", "fc2"):
        parts = [torch.empty_like(weights[name]) for _ in range(group.size())]
        torch.distributed.all_gather(parts, weights[name].contiguous(), group=group)
        weights[name] = torch.cat(parts)
    return weights


def _weight_mismatches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str
) -> list[str]:
    """One line per weight of ``want`` that ``got`` does not match exactly (NaN never matches)."""
    return [
        f"{what}: {name} differs (shapes {tuple(got[name].shape)} / {tuple(want[name].shape)})"
        for name in want
        if got[name].shape != want[name].shape or not torch.equal(got[name], want[name])
    ]


def _copy_weights(src: Any, dst: Any) -> None:
    """Give ``dst`` the weights of ``src`` (either implementation, same EP size)."""
    dst.load_state_dict(src.state_dict(), strict=True)


# --- Sharded layout ---------------------------------------------------------------------------


def _flat_entries(sharded: dict) -> list:
    """Every ``ShardedTensor`` / ``ShardedObject`` a sharded state dict saves (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = []
    for value in sharded.values():
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            out.extend(built.values() if isinstance(built, dict) else built)
        else:
            out.append(value)
    return out


def _shards(sharded: dict) -> dict[str, dict]:
    """Global key -> kind, global shape, dtype and this rank's shards (offset, box, replica, data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out: dict[str, dict] = {}
    for sh in _flat_entries(sharded):
        if isinstance(sh, ShardedTensor):
            assert sh.flattened_range is None, sh
            box = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            kind = ("tensor", tuple(sh.global_shape), sh.dtype)
            shard = (tuple(sh.global_offset), box, sh.replica_id, sh.data.detach().reshape(box))
        elif isinstance(sh, ShardedObject):
            kind = ("object", tuple(sh.global_shape), type(sh.data).__name__)
            shard = (tuple(sh.global_offset), None, sh.replica_id, None)
        else:
            raise TypeError(f"unexpected sharded entry {type(sh).__name__}")
        entry = out.setdefault(sh.key, {"kind": kind, "shards": []})
        if entry["kind"] != kind:
            raise AssertionError(f"{sh.key}: inconsistent entries {entry['kind']} / {kind}")
        entry["shards"].append(shard)
    return out


def _assemble(key: str, kind: tuple, ranks_shards: list[list]) -> tuple[Any, list[str]]:
    """Main replicas of every rank -> (global tensor or object offsets, coverage problems)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    main = [s for shards in ranks_shards for s in shards if is_main_replica(s[2])]
    if kind[0] == "object":
        offsets = sorted(s[0] for s in main)
        grid = list(itertools.product(*(range(n) for n in kind[1])))
        problems = [] if offsets == grid else [f"{key}: objects at {offsets}, want {grid}"]
        return offsets, problems
    count = torch.zeros(kind[1], dtype=torch.int64)
    tensor = torch.zeros(kind[1], dtype=kind[2])
    for offset, box, _, data in main:
        region = tuple(slice(o, o + b) for o, b in zip(offset, box))
        count[region] += 1
        tensor[region] = data
    problems = []
    if not torch.all(count == 1):
        problems.append(
            f"{key}: main replicas cover {int((count == 0).sum())} elements 0 times and "
            f"{int((count > 1).sum())} more than once"
        )
    return tensor, problems


def _layout_problems(stock: Any, lrmoe: Any) -> list[str]:
    """What a checkpoint of either layer holds, compared (both hold the same weights)."""
    variants = {
        "default": {},
        "block prefix/offsets": dict(prefix=BLOCK_PREFIX, sharded_offsets=BLOCK_OFFSETS),
        "singleton_local_shards": dict(metadata=dict(SINGLETON_METADATA)),
    }
    _copy_weights(stock, lrmoe)
    problems: list[str] = []
    for variant, kwargs in variants.items():
        gathered = {}
        for impl, layer in zip(IMPLS, (stock, lrmoe)):
            mine = _shards(layer.sharded_state_dict(**kwargs))
            ranks: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(ranks, mine)
            gathered[impl] = ranks
        want, got = gathered["stock"], gathered["lrmoe"]
        keys = set(want[0])
        for rank in range(len(want)):
            if set(got[rank]) != set(want[rank]):
                problems.append(
                    f"{variant}: rank {rank} global keys differ: only stock "
                    f"{sorted(set(want[rank]) - set(got[rank]))}, only LRMoE "
                    f"{sorted(set(got[rank]) - set(want[rank]))}"
                )
            keys |= set(want[rank])
        if problems:
            continue
        for key in sorted(keys):
            kinds = {r[key]["kind"] for impl in IMPLS for r in gathered[impl] if key in r}
            if len(kinds) != 1:
                problems.append(f"{variant}: {key}: kind/global shape/dtype differ: {kinds}")
                continue
            kind = kinds.pop()
            for rank in range(len(want)):
                ids = [
                    sorted({s[2] for s in gathered[impl][rank].get(key, {"shards": []})["shards"]})
                    for impl in IMPLS
                ]
                if ids[0] != ids[1]:
                    problems.append(
                        f"{variant}: {key}: rank {rank} replica ids {ids[1]} != {ids[0]}"
                    )
            built = {}
            for impl in IMPLS:
                ranks_shards = [r[key]["shards"] for r in gathered[impl] if key in r]
                built[impl], coverage = _assemble(key, kind, ranks_shards)
                problems += [f"{variant}: {impl}: {line}" for line in coverage]
            if kind[0] == "tensor" and not torch.equal(built["stock"], built["lrmoe"]):
                problems.append(f"{variant}: {key}: global tensors differ")
            if kind[0] == "object" and built["stock"] != built["lrmoe"]:
                problems.append(f"{variant}: {key}: object offsets differ")
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
    """Weight entries hold the parameters themselves; what their factories build are views.

    Megatron's optimizer checkpoints map optimizer state to model entries by ``id(entry.data)``.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    w1, w2 = lrmoe.experts.weights()
    num_local, ffn = w1.shape[0], w2.shape[-1]
    problems: list[str] = []
    for singleton in (False, True):
        sharded = lrmoe.sharded_state_dict(metadata={"singleton_local_shards": singleton})
        mode = f"singleton={singleton}"
        for proj, param in (("linear_fc1", w1), ("linear_fc2", w2)):
            entry = sharded[f"experts.{proj}.weight"]
            if entry.data is not param:
                problems.append(f"{mode}: {proj} entry data is not the parameter")
            if not isinstance(entry, ShardedTensorFactory):
                continue
            built = entry.build()
            if singleton:
                want = [param[i] for i in range(num_local)]
                if proj == "linear_fc1":
                    want = [h for i in range(num_local) for h in (param[i, :ffn], param[i, ffn:])]
            else:
                want = [param[:, :ffn], param[:, ffn:]]
            if len(built) != len(want) or not all(
                _same_view(b.data, v) for b, v in zip(built, want)
            ):
                problems.append(f"{mode}: {proj} factory does not build views of the parameter")
        found = get_param_id_to_sharded_param_map(sharded, [w1, w2])
        if sorted(found) != [0, 1]:
            problems.append(f"{mode}: optimizer mapping finds params {sorted(found)}, want [0, 1]")
    return problems


def _experts_api_problems(stock: Any, lrmoe: Any) -> list[str]:
    """Parameter attributes as Megatron's expert linears; init; ``expert_weights``; ``forward``."""
    from megatron_lrmoe.experts.module import LRGroupedMLP

    problems: list[str] = []
    experts = lrmoe.experts
    w1, w2 = experts.weights()
    for (proj, param), dim in zip((("linear_fc1", w1), ("linear_fc2", w2)), (1, 2)):
        stock_param = getattr(stock.experts.local_experts[0], proj).weight
        # Same DDP buffer / optimizer routing as SequentialMLP (allreduce False iff EP > 1 here).
        for attr in ("allreduce", "tensor_model_parallel"):
            if getattr(param, attr) != getattr(stock_param, attr):
                problems.append(f"{proj}.{attr} {getattr(param, attr)} != stock's")
        if param.partition_dim != dim:
            problems.append(f"{proj}.partition_dim {param.partition_dim} != {dim}")
    views = experts.expert_weights()
    if len(views) != experts.num_local_experts or not all(
        _same_view(fc1, w1[i]) and _same_view(fc2, w2[i]) for i, (fc1, fc2) in enumerate(views)
    ):
        problems.append("expert_weights() are not views of w1[i], w2[i]")

    # Initialisation: per expert, fc1 then fc2, each an fp32 master of the expert's own shape
    # (the draws of the per-expert parameters this module used to have).
    config = lrmoe.config
    torch.manual_seed(11)
    fresh = LRGroupedMLP(3, config, name="probe")
    torch.manual_seed(11)
    want: list[list[torch.Tensor]] = [[], []]
    for _ in range(3):
        for i, (init, shape) in enumerate(
            ((config.init_method, w1.shape[1:]), (config.output_layer_init_method, w2.shape[1:]))
        ):
            master = torch.empty(shape, dtype=torch.float32)
            init(master)
            want[i].append(master.to(config.params_dtype))
    if not all(torch.equal(w, torch.stack(m)) for w, m in zip(fresh.weights(), want)):
        problems.append("initial weights are not the per-expert draws in order")
    try:
        fresh(torch.zeros(0, w1.shape[2]), torch.zeros(3, dtype=torch.long), torch.zeros(0))
        problems.append("forward did not raise")
    except RuntimeError as e:
        if "fused" not in str(e):
            problems.append(f"forward raised an unclear error: {e}")
    return problems


def _state_dict_problems(stock: Any, lrmoe: Any) -> list[str]:
    """Plain ``state_dict()``: stock's keys, order and value types; values are the experts."""
    want = stock.state_dict()
    got = lrmoe.state_dict()
    if list(got) != list(want):
        return [f"state_dict keys differ:\n  got  {list(got)}\n  want {list(want)}"]
    problems = [
        f"{key}: value type {type(got[key]).__name__} != {type(want[key]).__name__}"
        for key in want
        if type(got[key]) is not type(want[key])
    ]
    w1, w2 = lrmoe.experts.weights()
    for i in range(lrmoe.experts.num_local_experts):
        for proj, param in (("linear_fc1", w1), ("linear_fc2", w2)):
            value = got[f"experts.local_experts.{i}.{proj}.weight"]
            if not _same_view(value, param[i]):
                problems.append(f"expert {i} {proj}: state_dict value is not a view of w[{i}]")
    return problems


def _load_error(layer: Any, state: dict) -> str:
    try:
        layer.load_state_dict(state, strict=True)
    except RuntimeError as e:
        return str(e)
    return ""


def _load_hook_problems(lrmoe: Any) -> list[str]:
    """``load_state_dict`` takes the stacked layout too and rejects ambiguous or partial input."""
    problems: list[str] = []
    per_expert = lrmoe.state_dict()
    w1, w2 = lrmoe.experts.weights()
    gen = torch.Generator().manual_seed(5)
    new = {"fc1": torch.randn(w1.shape, generator=gen), "fc2": torch.randn(w2.shape, generator=gen)}
    stacked = {k: v for k, v in per_expert.items() if ".local_experts." not in k}
    stacked["experts.linear_fc1.weight"] = new["fc1"]
    stacked["experts.linear_fc2.weight"] = new["fc2"]
    error = _load_error(lrmoe, stacked)
    if error:
        problems.append(f"stacked keys do not load: {error}")
    elif not (torch.equal(w1, new["fc1"]) and torch.equal(w2, new["fc2"])):
        problems.append("stacked keys load wrong values")

    both = {**per_expert, "experts.linear_fc1.weight": new["fc1"]}
    if "keep one layout" not in _load_error(lrmoe, both):
        problems.append("stacked + per-expert keys together are not rejected")
    partial = dict(per_expert)
    missing = "experts.local_experts.1.linear_fc2.weight"
    del partial[missing]
    if missing not in _load_error(lrmoe, partial):
        problems.append("a missing per-expert weight is not reported by name")
    extra = dict(per_expert)
    surplus = f"experts.local_experts.{lrmoe.experts.num_local_experts}.linear_fc1.weight"
    extra[surplus] = per_expert["experts.local_experts.0.linear_fc1.weight"]
    if surplus not in _load_error(lrmoe, extra):
        problems.append("a per-expert weight beyond L is not reported as unexpected")
    return problems


def _torch_save_problems(src: Any, dst: Any, path: str, what: str) -> list[str]:
    """``torch.save(src.state_dict())``, strict-load it into ``dst``; return weight mismatches."""
    torch.save(src.state_dict(), path)
    _poison(dst)
    dst.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return _weight_mismatches(_weights(dst), _weights(src), what)


# --- Distributed checkpoints --------------------------------------------------------------------


def _allow_writes_in_daemon() -> None:
    """Let the torch_dist writer run inside run_distributed's daemonic ranks.

    It collects write results through a multiprocessing Manager queue, and daemonic processes may
    not start processes. A synchronous save writes and reads the results in this process, so a
    thread queue does the same job.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _fix_torch_adam_step_on_load() -> None:
    """Work around a megatron 0.19.2 bug hit only without apex / Transformer Engine (CPU).

    The CPU fallback optimizer is ``torch.optim.AdamW``, which keeps a per-parameter ``step``
    tensor. ``DistributedOptimizer.load_parameter_state_from_fully_reshardable`` skips ``step``
    (``load_state_dict`` restores it from ``param_groups`` first), but
    ``_set_main_param_and_optimizer_states`` then looks up every state key of the live optimizer
    and raises ``KeyError: 'step'``, for stock models as well. A ``None`` entry is skipped by
    that function's own non-tensor check. Test process only.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "lrmoe_test_fix", False):
        return

    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        original(self, model_param, {"step": None, **tensors})

    set_states.lrmoe_test_fix = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _untie_torch_adam_steps(optimizer: Any) -> None:
    """Work around a second megatron 0.19.2 bug of the same CPU-only path.

    ``DistributedOptimizer.load_state_dict`` gives every torch AdamW state one shared ``step``
    tensor (``s["step"] = step`` in a loop), which each parameter's update then increments, so
    all but the first parameter of a group step with a wrong bias correction; ``dp_reshardable``
    also leaves the stale pre-load value in it. The right value is in ``param_groups`` (restored
    from the checkpoint). Give each state its own step tensor with that value. Test process only.
    """
    for chained in optimizer.chained_optimizers:
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = torch.tensor(float(group["step"]))


def _dist_save(state: dict, directory: str) -> None:
    from megatron.core import dist_checkpointing

    _allow_writes_in_daemon()
    dist_checkpointing.save(state, directory)


def _dist_load_model(layer: Any, directory: str, metadata: dict | None = None) -> None:
    """Model-only load as megatron.training does: dist load, then a strict load_state_dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _poison(layer)
    # RAISE_ALL (not training's default) so that any difference between the checkpoint's global
    # keys and the requested ones fails loudly.
    loaded = dist_checkpointing.load(
        layer.sharded_state_dict(metadata=metadata), directory, strict=StrictHandling.RAISE_ALL
    )
    layer.load_state_dict(loaded, strict=True)


@dataclass
class Trained:
    """A layer behind Megatron's DDP with its Megatron optimizer."""

    layer: Any
    ddp: Any
    optimizer: Any
    metadata: dict
    step: int = 0


def _trained(impl: str, ep: int, pg: Any, metadata: dict) -> Trained:
    """Layer + DDP + Adam (distributed when the metadata names a distrib-optim format)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = "distrib_optim_sharding_type" in metadata
    layer = _build_layer(impl, ep, pg)
    ddp = DistributedDataParallel(
        layer.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), layer
    )
    # No gradient clipping: the global grad norm would couple every element and its summation
    # order differs between the implementations; Adam alone is elementwise, hence bit-exact.
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=0.0,
            use_distributed_optimizer=distributed,
        ),
        [ddp],
    )
    return Trained(layer, ddp, optimizer, metadata)


def _synthetic_step(model: Trained) -> None:
    """One optimizer step on gradients that depend only on (step, parameter, global expert)."""
    layer = model.layer
    model.step += 1
    for name, param in layer.named_parameters():
        if not name.startswith("experts."):
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 100 + model.step)
            param.main_grad.copy_(torch.randn(param.shape, generator=gen))
    experts = layer.experts
    num_local = experts.num_local_experts
    first = experts.ep_group.rank() * num_local
    num_global = experts.ep_group.size() * num_local
    w1, w2 = _expert_stacks(layer)
    for index, (proj, local) in enumerate((("linear_fc1", w1), ("linear_fc2", w2))):
        gen = torch.Generator().manual_seed(7919 * model.step + index)
        grad = torch.randn((num_global, *local.shape[1:]), generator=gen)[first : first + num_local]
        if _is_lrmoe(layer):
            getattr(experts, proj).weight.main_grad.copy_(grad)
        else:
            for i, expert in enumerate(experts.local_experts):
                getattr(expert, proj).weight.main_grad.copy_(grad[i])
    ok, _, _ = model.optimizer.step()
    assert ok, "optimizer step failed"


def _save_full(model: Trained, directory: str) -> None:
    sharded = model.layer.sharded_state_dict(metadata=dict(model.metadata))
    optimizer = model.optimizer.sharded_state_dict(sharded, metadata=dict(model.metadata))
    _dist_save({"model": sharded, "optimizer": optimizer}, directory)


def _load_full(model: Trained, directory: str) -> None:
    """Model + optimizer state, in the order megatron.training loads them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _fix_torch_adam_step_on_load()
    if "distrib_optim_sharding_type" in model.metadata and model.step == 0:
        # megatron 0.19.2 without apex / TE: DistributedOptimizer.state_dict() reads the step from
        # torch AdamW's per-parameter states and asserts there is exactly one value, so a
        # never-stepped optimizer cannot build its sharded state dict. One step creates the
        # states; the load overwrites them, the weights and the step count.
        _synthetic_step(model)
    _poison(model.layer)
    metadata = dict(model.metadata)
    sharded = model.layer.sharded_state_dict(metadata=metadata)
    request = {
        "model": sharded,
        "optimizer": model.optimizer.sharded_state_dict(
            sharded, is_loading=True, metadata=metadata
        ),
    }
    state = dist_checkpointing.load(request, directory, strict=StrictHandling.RAISE_UNEXPECTED)
    model.layer.load_state_dict(state["model"], strict=True)
    # dp_reshardable copies into views of parameters that require grad; megatron.training loads
    # with the same guard in effect.
    with torch.no_grad():
        model.optimizer.load_state_dict(state["optimizer"])
    if "distrib_optim_sharding_type" in model.metadata:
        _untie_torch_adam_steps(model.optimizer)
    model.step = SAVED_STEPS


def _train_and_save(model: Trained, directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps, save, one more step; the global weights at the save and after the next step."""
    for _ in range(SAVED_STEPS):
        _synthetic_step(model)
    _save_full(model, directory)
    saved = _global_weights(model.layer)
    _synthetic_step(model)
    return {"saved": saved, "next": _global_weights(model.layer)}


def _resume_problems(model: Trained, directory: str, record: dict, what: str) -> list[str]:
    """Load, compare with the saved weights, step once, compare with the source's next step."""
    try:
        _load_full(model, directory)
    except Exception as e:  # reported per check; every rank fails the same way (same data)
        return [f"{what}: load raised {type(e).__name__}: {e}"]
    problems = _weight_mismatches(_global_weights(model.layer), record["saved"], f"{what} load")
    _synthetic_step(model)
    problems += _weight_mismatches(_global_weights(model.layer), record["next"], f"{what} step")
    return problems


# --- The runs ---------------------------------------------------------------------------------


def _make_directories(root: str, names: list[str], rank: int) -> None:
    """Empty checkpoint directories, created once and seen by every rank."""
    if rank == 0:
        for name in names:
            os.makedirs(os.path.join(root, name))
    torch.distributed.barrier()


def _cross_resumes(
    ep: int, pg: Any, root: str, name: str, metadata: dict, records: dict, pairs: tuple, tag: str
) -> list[str]:
    """``_resume_problems`` of ``{name.format(src)}`` into a fresh ``dst`` for every pair."""
    problems: list[str] = []
    for src, dst in pairs:
        problems += _resume_problems(
            _trained(dst, ep, pg, metadata),
            os.path.join(root, name.format(src)),
            records[name.format(src)],
            f"{tag}{src} -> {dst}",
        )
    return problems


ALL_PAIRS = tuple((src, dst) for src in IMPLS for dst in IMPLS)
CROSS_PAIRS = (("stock", "lrmoe"), ("lrmoe", "stock"), ("lrmoe", "lrmoe"))


def _checkpoint_worker(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """All checks of :data:`CHECKS` on one rank (EP=2, EP=1, EP=2); check name -> problems."""
    from megatron.core import parallel_state

    from megatron_lrmoe.testing import init_megatron_parallel

    # megatron's torch_dist writer imports psutil lazily and fails without it; report that as
    # the reason for every distributed-checkpoint check instead of erroring the whole run.
    has_psutil = importlib.util.find_spec("psutil") is not None
    missing = [
        "psutil is not installed (megatron's torch_dist writer needs it; add it to setup.py)"
    ]
    results: dict[str, list[str]] = {
        name: list(missing) for name in CHECKS if name.startswith(("dist", "optim"))
    }

    def path(name: str) -> str:
        return os.path.join(root, name)

    names = [f"model_{impl}_ep{ep}" for impl in IMPLS for ep in (1, 2)]
    names += [f"singleton_model_{impl}" for impl in IMPLS]
    names += [f"{kind}_{impl}_ep2" for kind in ("optim", "singleton_optim") for impl in IMPLS]
    names += [f"distopt_full_{impl}_ep2" for impl in IMPLS] + [f"optim_{i}_ep1" for i in IMPLS]
    names += [f"distopt_dp_lrmoe_ep{ep}" for ep in (1, 2)]
    _make_directories(root, names, rank)
    records: dict[str, dict] = {}

    # --- EP=2: each rank holds E/2 experts. ---
    pg = init_megatron_parallel(ep=2)
    stock, lrmoe = _build_layers(2, pg)  # independently initialised, so their weights differ
    assert not torch.equal(_weights(stock)["fc1"], _weights(lrmoe)["fc1"])
    results["views_ep2"] = _view_problems(lrmoe)
    results["experts_api_ep2"] = _experts_api_problems(stock, lrmoe)
    results["state_dict_ep2"] = _state_dict_problems(stock, lrmoe)
    results["load_hooks"] = _load_hook_problems(_build_layer("lrmoe", 2, pg))
    results["torch_save_stock_to_lrmoe"] = _torch_save_problems(
        stock, _build_layer("lrmoe", 2, pg), path(f"stock_rank{rank}.pt"), "stock -> LRMoE"
    )
    results["torch_save_lrmoe_to_stock"] = _torch_save_problems(
        lrmoe, _build_layer("stock", 2, pg), path(f"lrmoe_rank{rank}.pt"), "LRMoE -> stock"
    )
    # Without a GLU, fc1 is a plain ShardedTensor on both sides (no SwiGLU factory).
    results["layout_ep2_not_gated"] = _layout_problems(
        *_build_layers(2, pg, gated_linear_unit=False, activation_func=torch.nn.functional.gelu)
    )

    if has_psutil:
        for impl, layer in (("stock", stock), ("lrmoe", lrmoe)):
            records[f"model_{impl}_ep2"] = {"saved": _global_weights(layer)}
            _dist_save(layer.sharded_state_dict(), path(f"model_{impl}_ep2"))
            singleton = layer.sharded_state_dict(metadata=dict(SINGLETON_METADATA))
            _dist_save(singleton, path(f"singleton_model_{impl}"))
        for src, dst in (("stock", "lrmoe"), ("lrmoe", "stock")):
            layer = _build_layer(dst, 2, pg)
            _dist_load_model(layer, path(f"model_{src}_ep2"))
            results[f"dist_{src}_to_{dst}_ep2"] = _weight_mismatches(
                _global_weights(layer), records[f"model_{src}_ep2"]["saved"], f"{src} -> {dst}"
            )
        problems = []
        for src, dst in (("stock", "lrmoe"), ("lrmoe", "stock")):
            layer = _build_layer(dst, 2, pg)
            _dist_load_model(layer, path(f"singleton_model_{src}"), dict(SINGLETON_METADATA))
            problems += _weight_mismatches(
                _global_weights(layer), records[f"model_{src}_ep2"]["saved"], f"{src} -> {dst}"
            )
        results["dist_singleton_both_ways_ep2"] = problems

        # Model + optimizer state.
        formats = {
            "optim": TRAINING_METADATA,
            "singleton_optim": SINGLETON_METADATA,
            "distopt_full": FULLY_RESHARDABLE,
        }
        for kind, metadata in formats.items():
            for impl in IMPLS:
                name = f"{kind}_{impl}_ep2"
                records[name] = _train_and_save(_trained(impl, 2, pg, metadata), path(name))
        name = "distopt_dp_lrmoe_ep2"
        records[name] = _train_and_save(_trained("lrmoe", 2, pg, DP_RESHARDABLE), path(name))
        for check, kind in (
            ("optim_both_ways_ep2", "optim"),
            ("optim_singleton_both_ways_ep2", "singleton_optim"),
            ("distopt_fully_reshardable_both_ways_ep2", "distopt_full"),
        ):
            results[check] = _cross_resumes(
                2, pg, root, kind + "_{}_ep2", formats[kind], records, CROSS_PAIRS, ""
            )
        results["distopt_dp_reshardable_resume"] = _cross_resumes(
            2, pg, root, "distopt_dp_{}_ep2", DP_RESHARDABLE, records, (("lrmoe",) * 2,), "EP=2 "
        )

    # Last at EP=2: it copies stock's weights into this LRMoE layer.
    results["layout_ep2"] = _layout_problems(stock, lrmoe)

    # --- EP=1 (DP=2): every rank holds all E experts; EP=2 checkpoints reshard. ---
    parallel_state.destroy_model_parallel()
    pg = init_megatron_parallel(ep=1)
    stock, lrmoe = _build_layers(1, pg)
    results["views_ep1"] = _view_problems(lrmoe)
    results["experts_api_ep1"] = _experts_api_problems(stock, lrmoe)
    results["state_dict_ep1"] = _state_dict_problems(stock, lrmoe)
    results["layout_ep1"] = _layout_problems(stock, lrmoe)

    if has_psutil:
        sanity: list[str] = []
        lrmoe_problems: list[str] = []
        for src in IMPLS:
            want = records[f"model_{src}_ep2"]["saved"]
            _dist_load_model(stock, path(f"model_{src}_ep2"))
            sanity += _weight_mismatches(_weights(stock), want, f"EP=2 {src} -> EP=1 stock")
            _dist_load_model(lrmoe, path(f"model_{src}_ep2"))
            lrmoe_problems += _weight_mismatches(_weights(lrmoe), want, f"EP=2 {src} -> EP=1 LRMoE")
        results["dist_ep2_to_ep1_stock_sanity"] = sanity
        results["dist_ep2_to_ep1_lrmoe"] = lrmoe_problems
        for impl, layer in (("stock", stock), ("lrmoe", lrmoe)):
            records[f"model_{impl}_ep1"] = {"saved": _global_weights(layer)}
            _dist_save(layer.sharded_state_dict(), path(f"model_{impl}_ep1"))

        # At EP=1 Megatron keeps expert weights in the dense DDP buffer and optimizer; LRMoE's
        # must be too, or optimizer checkpoints would not move between the implementations.
        for impl in IMPLS:
            name = f"optim_{impl}_ep1"
            records[name] = _train_and_save(_trained(impl, 1, pg, TRAINING_METADATA), path(name))
        results["optim_both_ways_ep1"] = _cross_resumes(
            1, pg, root, "optim_{}_ep1", TRAINING_METADATA, records, CROSS_PAIRS, ""
        )
        # dp_reshardable with the experts' optimizer state sharded over the two DP ranks.
        name = "distopt_dp_lrmoe_ep1"
        records[name] = _train_and_save(_trained("lrmoe", 1, pg, DP_RESHARDABLE), path(name))
        results["distopt_dp_reshardable_resume"] += _cross_resumes(
            1, pg, root, "distopt_dp_{}_ep1", DP_RESHARDABLE, records, (("lrmoe",) * 2,), "EP=1 "
        )

        # --- EP=2 again: EP=1 model checkpoints into both implementations. ---
        parallel_state.destroy_model_parallel()
        pg = init_megatron_parallel(ep=2)
        results["dist_ep1_to_ep2"] = []
        for src, dst in ALL_PAIRS:
            layer = _build_layer(dst, 2, pg)
            _dist_load_model(layer, path(f"model_{src}_ep1"))
            results["dist_ep1_to_ep2"] += _weight_mismatches(
                _global_weights(layer),
                records[f"model_{src}_ep1"]["saved"],
                f"EP=1 {src} -> EP=2 {dst}",
            )
    return results


def _ep_change_worker(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """Model + optimizer checkpoints across EP sizes: EP=4 -> EP=2 and EP=2 -> EP=4.

    Megatron's optimizer for a model with experts at EP=1 has no expert part (its checkpoint has
    a different structure, for SequentialMLP as for LRMoE), so optimizer state moves between EP
    sizes > 1 only; four ranks give EP=4 and EP=2 (expert DP=2).
    """
    from megatron.core import parallel_state

    from megatron_lrmoe.testing import init_megatron_parallel

    if importlib.util.find_spec("psutil") is None:
        return {name: ["psutil is not installed"] for name in EP_CHANGE_CHECKS}
    formats = {"optim": TRAINING_METADATA, "distopt_full": FULLY_RESHARDABLE}
    names = [f"{kind}_{impl}_ep{ep}" for kind in formats for impl in IMPLS for ep in (2, 4)]
    _make_directories(root, names, rank)
    records: dict[str, dict] = {}
    results: dict[str, list[str]] = {}

    def save_all(ep: int, pg: Any) -> None:
        for kind, metadata in formats.items():
            for impl in IMPLS:
                name = f"{kind}_{impl}_ep{ep}"
                trained = _trained(impl, ep, pg, metadata)
                records[name] = _train_and_save(trained, os.path.join(root, name))

    def resume_all(src_ep: int, dst_ep: int, pg: Any) -> None:
        for check, kind in (("optim", "optim"), ("distopt_fully_reshardable", "distopt_full")):
            results[f"{check}_ep{src_ep}_to_ep{dst_ep}"] = _cross_resumes(
                dst_ep,
                pg,
                root,
                f"{kind}_{{}}_ep{src_ep}",
                formats[kind],
                records,
                ALL_PAIRS,
                f"EP={src_ep} -> EP={dst_ep}: ",
            )

    save_all(4, init_megatron_parallel(ep=4))
    parallel_state.destroy_model_parallel()
    pg = init_megatron_parallel(ep=2)
    resume_all(4, 2, pg)
    save_all(2, pg)
    parallel_state.destroy_model_parallel()
    resume_all(2, 4, init_megatron_parallel(ep=4))
    return results


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


def _assert_no_problems(check: str, per_rank: list[dict[str, list[str]]]) -> None:
    for rank, res in enumerate(per_rank):
        assert check in res, f"rank {rank} did not run {check}"
    problems = {rank: res[check] for rank, res in enumerate(per_rank) if res[check]}
    assert not problems, "\n".join(
        f"rank {rank}: " + "\n".join(lines) for rank, lines in problems.items()
    )


@pytest.fixture(scope="module")
def checkpoint_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    """Per-rank results of :func:`_checkpoint_worker` (one 2-rank run for those checks)."""
    root = tmp_path_factory.mktemp("lrmoe_checkpoint")
    return run_distributed(_checkpoint_worker, WORLD_SIZE, str(root), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def ep_change_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    """Per-rank results of :func:`_ep_change_worker` (one 4-rank run)."""
    root = tmp_path_factory.mktemp("lrmoe_checkpoint_ep_change")
    return run_distributed(_ep_change_worker, EP_CHANGE_WORLD_SIZE, str(root), timeout=TIMEOUT_S)


@pytest.mark.parametrize("check", CHECKS)
def test_checkpoint_compatibility(
    check: str, checkpoint_results: list[dict[str, list[str]]]
) -> None:
    """``check`` found nothing on any rank (see the module docstring for what each covers)."""
    _assert_no_problems(check, checkpoint_results)


@pytest.mark.parametrize("check", EP_CHANGE_CHECKS)
def test_optimizer_checkpoints_across_ep_sizes(
    check: str, ep_change_results: list[dict[str, list[str]]]
) -> None:
    """Model + optimizer state saved at one EP size resumes exactly at another, either way."""
    _assert_no_problems(check, ep_change_results)
