"""Per-rank bodies of tests/test_replicas.py (module level so that spawn can pickle them).

Every rank builds the same seeded problem; the controller places replicas of hot experts
(``LRMoEConfig.max_replicas_per_rank``) and the layer computes them. Shape legend: T tokens per
rank, H hidden, E experts, L owned experts per rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import lrmoe_workers as w
from megatron_lrmoe import LRMoEConfig, get_lrmoe_moe_spec
from megatron_lrmoe.testing import init_megatron_parallel, stock_moe_layer

REPLICAS = 2  # max_replicas_per_rank of every replica case


def _grads(layer) -> dict[str, torch.Tensor]:
    w1, w2 = layer.experts.weights()
    return {"router": layer.router.weight.grad, "fc1": w1.grad, "fc2": w2.grad}


def _stock_grads(stock) -> dict[str, torch.Tensor]:
    experts = stock.experts.local_experts
    return {
        "router": stock.router.weight.grad,
        "fc1": torch.stack([e.linear_fc1.weight.grad for e in experts]),
        "fc2": torch.stack([e.linear_fc2.weight.grad for e in experts]),
    }


def _diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: (a[k] - b[k]).abs().max().item() for k in a}


def _scales(a: dict) -> dict[str, float]:
    return {k: a[k].abs().max().item() for k in a}


def keep1_cases(rank: int, world: int, ep: int, cases: list[tuple[dict, Optional[str]]]) -> list:
    """Keep 1.0 with replicas against keep 1.0 without them and against stock ``MoELayer``."""
    pg = init_megatron_parallel(ep=ep)
    return [keep1_case(pg, ep, overrides, routing) for overrides, routing in cases]


def keep1_case(pg, ep: int, overrides: dict, routing: Optional[str]) -> dict[str, Any]:
    cfg = w._config(ep, **overrides)
    ep_rank = pg.ep.rank()
    stock = stock_moe_layer(cfg, pg)
    w._apply_routing(stock.router, routing, cfg.num_moe_experts, ep_rank, ep)
    runs: dict[str, dict] = {}
    x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
    a = w._run(stock, x, up)
    runs["stock"] = dict(a, **_stock_grads(stock))
    facts = {}
    for name, replicas in (("plain", 0), ("replicas", REPLICAS)):
        lrmoe = LRMoEConfig(
            keep_ratio=1.0, max_replicas_per_rank=replicas, debug_check_invariants=True
        )
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        w._copy_stock_into_lrmoe(stock, layer)
        w._apply_routing(layer.router, routing, cfg.num_moe_experts, ep_rank, ep)
        b = w._run(layer, x, up)
        runs[name] = dict(b, **_grads(layer))
        facts[name] = w._replica_facts(layer.last_call_stats)
        facts[name]["summary"] = layer.last_call_stats.control_summary
    keys = ("out", "dx", "router", "fc1", "fc2")
    pick = lambda d: {k: d[k] for k in keys}  # noqa: E731
    return {
        "case": (overrides, routing),
        "scales": _scales(pick(runs["stock"])),
        "vs_stock": _diffs(pick(runs["replicas"]), pick(runs["stock"])),
        "vs_plain": _diffs(pick(runs["replicas"]), pick(runs["plain"])),
        "plain_vs_stock": _diffs(pick(runs["plain"]), pick(runs["stock"])),
        "facts": facts["replicas"],
        "summary": facts["replicas"]["summary"],
    }


def suite(rank: int, world: int, ep: int, sections: dict[str, list]) -> dict[str, list]:
    """Several sections in one process group (process start-up dominates on two cores)."""
    pg = init_megatron_parallel(ep=ep)
    runners = {
        "keep1": lambda case: keep1_case(pg, ep, *case),
        "dense": lambda case: w.lrmoe_vs_dense_reference(pg, ep, *case),
        "on_off": lambda case: on_off_case(pg, ep, case),
        "cache": lambda case: cache_facts(pg, ep, case),
        "checkpoint": lambda case: checkpoint_case(pg, ep, case),
        "fused": lambda case: fused_case(pg, ep, case),
    }
    return {name: [runners[name](case) for case in cases] for name, cases in sections.items()}


def on_off_case(pg, ep: int, kwargs: dict) -> dict[str, Any]:
    """The same call with replicas on and off: gradients, outputs and kept masks of both."""
    cfg = w._config(ep, moe_aux_loss_coeff=0.0, moe_router_topk=4)
    x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
    state = None
    runs = {}
    for replicas in (0, REPLICAS):
        lrmoe = LRMoEConfig(max_replicas_per_rank=replicas, debug_record_selection=True, **kwargs)
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        if state is None:
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        got = w._run(layer, x, up)
        stats = layer.last_call_stats
        runs[replicas] = dict(got, **_grads(layer))
        runs[replicas]["mask"] = stats.kept_mask
        runs[replicas]["placed"] = stats.replicas_placed
    keys = ("out", "dx", "router", "fc1", "fc2")
    pick = lambda d: {k: d[k] for k in keys}  # noqa: E731
    return {
        "case": kwargs,
        "scales": _scales(pick(runs[0])),
        "diffs": _diffs(pick(runs[REPLICAS]), pick(runs[0])),
        "same_mask": torch.equal(runs[0]["mask"], runs[REPLICAS]["mask"]),
        "placed": runs[REPLICAS]["placed"],
    }


def fused_case(pg, ep: int, kwargs: dict) -> dict[str, Any]:
    """The same call with replicas, the expert gradients returned (DDP would add them) and
    added into ``main_grad`` by the layer (``grad_accumulation_fusion="on"``): the fused
    ``main_grad`` gains exactly the returned gradient, replicas' contributions included; with
    ``overwrite_main_grad`` (Megatron-FSDP's protocol) a NaN ``main_grad`` ends up holding
    exactly that gradient (the owner's part written over it, the replicas' added after)."""
    cfg = w._config(ep, moe_aux_loss_coeff=0.0, moe_router_topk=4)
    x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
    state, runs = None, {}
    for fusion in ("off", "on", "overwrite"):
        lrmoe = LRMoEConfig(
            max_replicas_per_rank=REPLICAS,
            grad_accumulation_fusion="off" if fusion == "off" else "on",
            **kwargs,
        )
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        if state is None:
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        weights = layer.experts.weights()
        fill = float("nan") if fusion == "overwrite" else 0.25
        prior = [torch.full_like(p, fill, dtype=torch.float32) for p in weights]
        for p, acc in zip(weights, prior):  # what Megatron's DDP attaches to a parameter
            p.main_grad = acc.clone()
            p.grad_added_to_main_grad = False
            p.overwrite_main_grad = fusion == "overwrite"
        w._run(layer, x, up)
        runs[fusion] = {
            "grads": [p.grad if fusion == "off" else
                      p.main_grad if fusion == "overwrite" else p.main_grad - acc
                      for p, acc in zip(weights, prior)],
            "flags": [p.grad_added_to_main_grad for p in weights],
            "placed": layer.last_call_stats.replicas_placed,
        }  # fmt: skip
    off, on, over = runs["off"], runs["on"], runs["overwrite"]
    return {
        "case": kwargs,
        "placed": on["placed"],
        "flags": on["flags"] + off["flags"] + over["flags"],
        "diffs": [(a.float() - b).abs().max().item()
                  for run in (on, over) for a, b in zip(off["grads"], run["grads"])],
        "scales": [a.abs().max().item() for a in off["grads"]] * 2,
    }


def cache_facts(pg, ep: int, kwargs: dict) -> dict[str, Any]:
    """When replica weights are fetched, and that they are never part of the model's state.

    A replica layer and a plain one share weights; after every change of the weights (an
    in-place update standing in for an optimizer step, a ``load_state_dict``) both must give
    the same outputs, which a stale replica would break.
    """
    cfg = w._config(ep, moe_aux_loss_coeff=0.0)
    ep_rank = pg.ep.rank()
    layers = {}
    for replicas in (REPLICAS, 0):
        lrmoe = LRMoEConfig(max_replicas_per_rank=replicas, **kwargs)
        layers[replicas] = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        w._apply_routing(layers[replicas].router, "hot_expert0", cfg.num_moe_experts, ep_rank, ep)
    layer, plain = layers[REPLICAS], layers[0]
    plain.load_state_dict(layer.state_dict())
    x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size)
    facts: dict[str, Any] = {"fetched": {}, "equal": {}}

    def call(tag: str, grad: bool = True) -> None:
        with torch.set_grad_enabled(grad):
            got = layer(x)[0].detach()
            want = plain(x)[0].detach()
        facts["fetched"][tag] = layer.last_call_stats.replicas_fetched
        facts["equal"][tag] = (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
        facts.setdefault("placed", layer.last_call_stats.replicas_placed)

    call("no_step_1")
    call("no_step_2")
    layer.set_training_step(5)
    call("step5_first")
    call("step5_again")
    call("step5_no_grad", grad=False)
    call("step5_after_no_grad")
    with torch.no_grad():  # an optimizer step: every owner's weights change
        for a, b in zip(layer.experts.weights(), plain.experts.weights()):
            a.mul_(1.5)
            b.mul_(1.5)
    layer.set_training_step(6)
    call("step6_first")
    call("step6_again")
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    with torch.no_grad():
        for k in state:
            if torch.is_tensor(state[k]) and "experts" in k:
                state[k].mul_(0.5)
    layer.load_state_dict(state)
    plain.load_state_dict(state)
    call("step6_after_load")
    # Never part of the model: names and tensors as without replicas, no cached tensor inside.
    cached = [t for t in (layer._replica_cache._w1, layer._replica_cache._w2) if t is not None]
    ptrs = {t.data_ptr() for t in cached if t.numel()}
    facts["cached_replicas"] = [int(t.shape[0]) for t in cached]
    facts["state_keys"] = list(layer.state_dict().keys()) == list(plain.state_dict().keys())
    facts["param_names"] = [n for n, _ in layer.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    facts["buffer_names"] = [n for n, _ in layer.named_buffers()] == [
        n for n, _ in plain.named_buffers()
    ]
    tensors = [v for v in layer.state_dict().values() if torch.is_tensor(v)]
    tensors += [p for p in layer.parameters()] + [b for b in layer.buffers()]
    facts["cache_outside_state"] = not any(t.data_ptr() in ptrs for t in tensors)
    return facts


def training_on_off(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Megatron DDP + the Megatron optimizer, keep 1.0, replicas off and on, same start."""
    from megatron_lrmoe.demo.trainer import ModelShape, Trainer, TrainSettings, load_stdlib_corpus
    from megatron_lrmoe.layer import LRMoELayer

    init_megatron_parallel(ep=world)
    corpus = load_stdlib_corpus(1 << 20, 64 << 10)
    shape = ModelShape(hidden_size=32, kv_channels=8, moe_ffn_hidden_size=32, seq_length=32)
    settings = TrainSettings(
        steps=steps, micro_batch_size=4, num_microbatches=2, eval_interval=steps, warmup_steps=1
    )
    out: dict[str, Any] = {}
    init = None
    for name, replicas in (("off", 0), ("on", REPLICAS)):
        lrmoe = LRMoEConfig(keep_ratio=1.0, max_replicas_per_rank=replicas)
        trainer = Trainer(shape, settings, corpus, lrmoe=lrmoe, init_from=init, metrics=False)
        init = trainer.initial_state
        calls: list[tuple[int, int]] = []
        layers = [m for m in trainer.model.modules() if isinstance(m, LRMoELayer)]
        handles = [
            layer.add_stats_listener(
                lambda _, s: calls.append((s.replicas_placed, s.replicas_fetched))
            )
            for layer in layers
        ]
        records = trainer.run()
        for h in handles:
            h.remove()
        model = trainer.model.module
        out[name] = {
            "losses": [r.loss for r in records],
            "valid": [r.valid_loss for r in records if r.valid_loss is not None],
            "state": {
                k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
            },
            "optimizer_params": sum(
                len(g["params"]) for g in trainer.optimizer.param_groups
            ),
            "calls": calls,
        }
        trainer.close()
    return out


CHECKPOINT_MODES = ("plain", "megatron_recompute", "torch_reentrant", "torch_non_reentrant")


def checkpoint_case(pg, ep: int, kwargs: dict) -> dict[str, Any]:
    """Two micro-batches of one training step under each activation checkpointing style (the
    recomputed forward, and for reentrant styles a first forward without gradients, must place
    and use the same replicas): kept pairs and gradients of every mode, and what was fetched."""
    ep_rank = pg.ep.rank()
    state = None
    out: dict[str, Any] = {}
    for mode in CHECKPOINT_MODES:
        overrides = dict(moe_aux_loss_coeff=0.0)
        if mode == "megatron_recompute":
            overrides.update(recompute_granularity="selective", recompute_modules=["moe"])
        cfg = w._config(ep, **overrides)
        lrmoe = LRMoEConfig(max_replicas_per_rank=REPLICAS, debug_record_selection=True, **kwargs)
        layer = get_lrmoe_moe_spec(lrmoe)(config=cfg, pg_collection=pg, layer_number=1)
        w._apply_routing(layer.router, "hot_expert0", cfg.num_moe_experts, ep_rank, ep)
        if state is None:
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        layer.train()
        layer.set_training_step(3)
        seen: list = []
        layer.add_stats_listener(lambda _, s: seen.append(s))
        dxs = []
        for micro_batch in range(2):
            x, up = w._inputs(torch.distributed.get_rank(), cfg.hidden_size, seed=20 + micro_batch)
            x = x.clone().requires_grad_(True)
            if mode == "torch_reentrant":
                y, _ = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
            elif mode == "torch_non_reentrant":
                y, _ = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                y, _ = layer(x)
            (y * up).sum().backward()
            dxs.append(x.grad.detach().clone())
        finished = [s for s in seen if s.backward_done]
        out[mode] = {
            "kept": [s.kept_weight.clone() for s in finished],
            "placed": [s.replicas_placed for s in finished],
            "dx": dxs,
            **{k: v.detach().clone() for k, v in _grads(layer).items()},
        }
    return out
