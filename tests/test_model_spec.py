"""Model specs and builder of the training entry point (``megatron_lrmoe.training.model``).

One 2-rank gloo run (EP=2, local spec, CPU) builds a tiny MoE GPT with one dense layer, three
MoE layers and one MTP layer, stock and with ``--lrmoe``, and reports what the tests check:

* LRMoE layers exactly where the MoE layers are, dense layers untouched, the MTP layer's MoE
  made LRMoE only with ``--lrmoe``;
* the LRMoE builder builds the same model as Megatron's ``GPTModelBuilder`` (same state-dict
  keys and shapes), and at keep ratio 1.0 with the stock weights loaded it gives the stock loss
  and the stock gradients for every parameter.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import pytest
import torch

from megatron_lrmoe.testing import run_distributed

TIMEOUT_S = 600
VOCAB = 128
SEQ = 32
MOE_LAYER_FREQ = [0, 1, 1, 1]


def _transformer_config(**overrides: Any) -> Any:
    from megatron_lrmoe.testing import moe_transformer_config

    fields = dict(
        num_layers=len(MOE_LAYER_FREQ),
        moe_layer_freq=MOE_LAYER_FREQ,
        mtp_num_layers=1,
        normalization="RMSNorm",
        qk_layernorm=True,
        num_query_groups=2,
        kv_channels=8,
        moe_shared_expert_intermediate_size=40,
    )
    fields.update(overrides)
    return moe_transformer_config(**fields)


def _model_config(transformer: Any, lrmoe: Any = None) -> Any:
    from megatron.training.models.gpt import GPTModelConfig

    from megatron_lrmoe.training.model import LRMoEGPTModelConfig

    kwargs = dict(
        transformer=transformer,
        vocab_size=VOCAB,
        seq_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    if lrmoe is None:
        return GPTModelConfig(**kwargs)
    return LRMoEGPTModelConfig(lrmoe=lrmoe, **kwargs)


def _mlp_kind(mlp: Any) -> str:
    """Class name an ``mlp`` builder or spec builds."""
    if isinstance(mlp, partial):
        return mlp.func.__name__
    module = getattr(mlp, "module", mlp)
    return getattr(module, "__name__", repr(module))


def _spec_facts(transformer: Any, lrmoe: Any) -> dict[str, Any]:
    from megatron_lrmoe.training.model import gpt_decoder_spec, gpt_mtp_block_spec

    stock_cfg = _model_config(transformer)
    stock = gpt_decoder_spec(stock_cfg)
    cfg = _model_config(transformer, lrmoe)
    spec = gpt_decoder_spec(cfg)
    mtp = gpt_mtp_block_spec(cfg, spec)
    stock_mtp = gpt_mtp_block_spec(stock_cfg, stock)
    layers = spec.layer_specs
    return {
        "decoder": [_mlp_kind(s.submodules.mlp) for s in layers],
        "stock_decoder": [_mlp_kind(s.submodules.mlp) for s in stock.layer_specs],
        "mtp": [_mlp_kind(s.submodules.mtp_model_layer.submodules.mlp) for s in mtp.layer_specs],
        "stock_mtp": [
            _mlp_kind(s.submodules.mtp_model_layer.submodules.mlp) for s in stock_mtp.layer_specs
        ],
        # Dense layers are unchanged; MoE layers differ only in their mlp. Specs are compared
        # by repr because each call builds fresh spec objects (reprs name classes/functions).
        "dense_untouched": [
            repr(s) == repr(t)
            for s, t, f in zip(layers, stock.layer_specs, MOE_LAYER_FREQ)
            if f == 0
        ],
        "only_mlp_changed": [
            repr(dataclasses.replace(s.submodules, mlp=None))
            == repr(dataclasses.replace(t.submodules, mlp=None))
            for s, t in zip(layers, stock.layer_specs)
        ],
        "lrmoe_configs": [
            mlp.keywords["lrmoe_config"]
            for mlp in [s.submodules.mlp for s in layers]
            + [s.submodules.mtp_model_layer.submodules.mlp for s in mtp.layer_specs]
            if _mlp_kind(mlp) == "LRMoELayer"
        ],
        "no_mtp_without_mtp_layers": gpt_mtp_block_spec(
            _model_config(_transformer_config(mtp_num_layers=None), lrmoe), spec
        )
        is None,
    }


def _layer_kinds(model: Any) -> dict[str, list[str]]:
    def kinds(layer: Any) -> str:
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        dispatcher = getattr(mlp, "token_dispatcher", None)
        parts = [type(mlp).__name__]
        if experts is not None:
            parts += [type(experts).__name__, type(dispatcher).__name__]
        return "/".join(parts)

    return {
        "decoder": [kinds(layer) for layer in model.decoder.layers],
        "mtp": [kinds(layer.mtp_model_layer) for layer in model.mtp.layers],
    }


def _loss_and_grads(model: Any, rank: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, -1)
    labels = torch.roll(tokens, -1, dims=1)
    model.zero_grad()
    losses = model(tokens, position_ids, None, labels=labels, loss_mask=torch.ones(2, SEQ))
    losses.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads


def _stock_layout_grads(lrmoe_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LRGroupedMLP's ``[L, ...]`` expert grads under SequentialMLP's per-expert names."""
    out = {}
    for name, grad in lrmoe_grads.items():
        for proj in ("linear_fc1", "linear_fc2"):
            stacked = f".experts.{proj}.weight"
            if name.endswith(stacked):
                head = name[: -len(stacked)]
                for i in range(grad.shape[0]):
                    out[f"{head}.experts.local_experts.{i}.{proj}.weight"] = grad[i]
                break
        else:
            out[name] = grad
    return out


def _model_spec_worker(rank: int, world_size: int, with_te: bool) -> dict[str, Any]:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_lrmoe import LRMoEConfig, LRMoELayer
    from megatron_lrmoe.training.model import LRMoEGPTModelBuilder
    from megatron_lrmoe.testing import init_megatron_parallel

    init_megatron_parallel(ep=world_size)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    transformer = _transformer_config()
    keep_half = LRMoEConfig(keep_ratio=0.5, selection="topk")
    facts: dict[str, Any] = {"spec": _spec_facts(transformer, keep_half)}
    if with_te:
        te = _transformer_config(transformer_impl="transformer_engine")
        facts["te_spec"] = _spec_facts(te, keep_half)

    models = {}
    for name, lrmoe in (("stock", None), ("keep1", LRMoEConfig()), ("keep_half", keep_half)):
        cfg = _model_config(transformer, lrmoe)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        models[name] = cfg.get_builder_cls()(cfg).build_model(pg)
        facts[f"builder_{name}"] = type(cfg.get_builder_cls()(cfg)).__name__
        facts[f"kinds_{name}"] = _layer_kinds(models[name])
    facts["keep_half_configs"] = [
        m.lrmoe_config for m in models["keep_half"].modules() if isinstance(m, LRMoELayer)
    ]
    facts["is_stock_builder"] = GPTModelBuilder is type(
        _model_config(transformer).get_builder_cls()(_model_config(transformer))
    )

    stock, keep1 = models["stock"], models["keep1"]
    stock_sd = {k: tuple(v.shape) for k, v in stock.state_dict().items() if v is not None}
    keep1_sd = {k: tuple(v.shape) for k, v in keep1.state_dict().items() if v is not None}
    facts["state_dict_mismatch"] = sorted(set(stock_sd.items()) ^ set(keep1_sd.items()))[:8]

    keep1.load_state_dict(stock.state_dict())
    stock_loss, stock_grads = _loss_and_grads(stock, rank)
    keep1_loss, keep1_grads = _loss_and_grads(keep1, rank)
    keep1_grads = _stock_layout_grads(keep1_grads)
    facts["loss_diff"] = float((stock_loss - keep1_loss).abs().max())
    facts["loss_scale"] = float(stock_loss.abs().max())
    facts["grad_names_mismatch"] = sorted(set(stock_grads) ^ set(keep1_grads))[:8]
    facts["grad_rel_err"] = {
        n: float((stock_grads[n] - keep1_grads[n]).abs().max())
        / max(float(stock_grads[n].abs().max()), 1e-12)
        for n in stock_grads
        if n in keep1_grads
    }
    return facts


@pytest.fixture(scope="module")
def facts() -> list[dict[str, Any]]:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return run_distributed(_model_spec_worker, 2, bool(HAVE_TE), timeout=TIMEOUT_S)


MOE = "LRMoELayer"


def test_lrmoe_exactly_where_moe_layers_are(facts: list[dict[str, Any]]) -> None:
    spec = facts[0]["spec"]
    assert spec["stock_decoder"][1:] == ["MoELayer"] * 3
    assert spec["decoder"][1:] == [MOE] * 3
    assert spec["decoder"][0] == spec["stock_decoder"][0] not in ("MoELayer", MOE)
    assert spec["dense_untouched"] == [True]
    assert spec["only_mlp_changed"] == [True] * len(MOE_LAYER_FREQ)


def test_mtp_layer_is_lrmoe_only_with_lrmoe(facts: list[dict[str, Any]]) -> None:
    spec = facts[0]["spec"]
    assert spec["mtp"] == [MOE] and spec["stock_mtp"] == ["MoELayer"]
    assert spec["no_mtp_without_mtp_layers"]


def test_spec_carries_the_lrmoe_config(facts: list[dict[str, Any]]) -> None:
    from megatron_lrmoe import LRMoEConfig

    want = LRMoEConfig(keep_ratio=0.5, selection="topk")
    assert facts[0]["spec"]["lrmoe_configs"] == [want] * 4
    for rank_facts in facts:
        assert rank_facts["keep_half_configs"] == [want] * 4


def test_built_models_have_lrmoe_modules_only_with_lrmoe(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        stock, keep1 = rank_facts["kinds_stock"], rank_facts["kinds_keep1"]
        assert stock["decoder"][0] == keep1["decoder"][0] == "MLP"
        moe_stock = "MoELayer/SequentialMLP/MoEAlltoAllTokenDispatcher"
        moe_lrmoe = "LRMoELayer/LRGroupedMLP/LRAlltoAllTokenDispatcher"
        assert stock["decoder"][1:] == [moe_stock] * 3 and stock["mtp"] == [moe_stock]
        assert keep1["decoder"][1:] == [moe_lrmoe] * 3 and keep1["mtp"] == [moe_lrmoe]
        assert rank_facts["kinds_keep_half"] == keep1
        assert rank_facts["builder_stock"] == "GPTModelBuilder"
        assert rank_facts["builder_keep1"] == "LRMoEGPTModelBuilder"
        assert rank_facts["is_stock_builder"]


def test_lrmoe_builder_builds_the_stock_model(facts: list[dict[str, Any]]) -> None:
    for rank_facts in facts:
        assert rank_facts["state_dict_mismatch"] == []
        assert rank_facts["grad_names_mismatch"] == []


def test_keep1_reproduces_stock_loss_and_every_gradient(facts: list[dict[str, Any]]) -> None:
    for rank, rank_facts in enumerate(facts):
        assert rank_facts["loss_diff"] <= 1e-5 * rank_facts["loss_scale"], rank_facts["loss_diff"]
        bad = {n: e for n, e in rank_facts["grad_rel_err"].items() if e > 1e-4}
        assert not bad, f"rank {rank}: {bad}"
        assert any("local_experts.0.linear_fc1" in n for n in rank_facts["grad_rel_err"])
        assert any(n.startswith("mtp.") for n in rank_facts["grad_rel_err"])


def test_te_spec_variant(facts: list[dict[str, Any]]) -> None:
    if "te_spec" not in facts[0]:
        pytest.skip("Transformer Engine is not installed")
    spec = facts[0]["te_spec"]
    assert spec["decoder"][1:] == [MOE] * 3 and spec["mtp"] == [MOE]
    assert spec["stock_decoder"][1:] == ["MoELayer"] * 3 and spec["stock_mtp"] == ["MoELayer"]
    assert spec["dense_untouched"] == [True]
